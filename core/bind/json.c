/* core.json: lua-cjson (Debian lua-cjson-dev). Null, empty-object and empty-array
 * handling is decided once, in lua/json.lua, on top of this. */
#include "runtime.h"
#include "bind/bind.h"
#include <lua-cjson.h>

int luaopen_core_json(lua_State *L) { return luaopen_cjson(L); }
