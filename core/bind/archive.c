/* core.archive: placeholder until the binding lands. */
#include "runtime.h"
#include "bind/bind.h"

int luaopen_core_archive(lua_State *L) {
  lua_newtable(L);
  return 1;
}
