/* core.http: placeholder until the binding lands. */
#include "runtime.h"
#include "bind/bind.h"

int luaopen_core_http(lua_State *L) {
  lua_newtable(L);
  return 1;
}
