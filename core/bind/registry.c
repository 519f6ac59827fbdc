/* The one registrar: every core.* module goes into package.preload. */
#include "runtime.h"
#include "bind/bind.h"

static const luaL_Reg modules[] = {
  {"core.loop", luaopen_core_loop},
  {"core.timer", luaopen_core_timer},
  {"core.signal", luaopen_core_signal},
  {"core.stream", luaopen_core_stream},
  {"core.process", luaopen_core_process},
  {"core.fs", luaopen_core_fs},
  {"core.http", luaopen_core_http},
  {"core.json", luaopen_core_json},
  {"core.text", luaopen_core_text},
  {"core.archive", luaopen_core_archive},
  {"core.proxy", luaopen_core_proxy},
  {"core.httpd", luaopen_core_httpd},
  {"core.httphead", luaopen_core_httphead}, /* request heads (llhttp) */
  {"core.tty", luaopen_core_tty},
  {"core.yaml", luaopen_core_yaml},
  {"core.ws", luaopen_core_ws},
  {NULL, NULL},
};

void dm_open_bindings(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
  for (const luaL_Reg *m = modules; m->name; m++) {
    lua_pushcfunction(L, m->func);
    lua_setfield(L, -2, m->name);
  }
  lua_pop(L, 1);
}

lua_Integer dm_opt_count(lua_State *L, int t, const char *k, lua_Integer def) {
  lua_getfield(L, t, k);
  lua_Integer v = lua_isnil(L, -1) ? def : luaL_checkinteger(L, -1);
  lua_pop(L, 1);
  if (v < 0) luaL_error(L, "%s must be a non-negative integer", k);
  return v;
}

static int tostring(lua_State *L) {
  const char *name = luaL_getmetafield(L, 1, "__name") == LUA_TSTRING ? lua_tostring(L, -1) : luaL_typename(L, 1);
  lua_pushfstring(L, "%s: %p", name, lua_topointer(L, 1));
  return 1;
}

void dm_metatable(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction close) {
  luaL_newmetatable(L, name);
  if (methods) {
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__index");
  }
  const char *keys[] = {"__gc", "__close"};
  lua_CFunction fns[] = {gc, close};
  for (int i = 0; i < 2; i++) {
    if (!fns[i]) continue;
    lua_pushcfunction(L, fns[i]);
    lua_setfield(L, -2, keys[i]);
  }
  lua_pushcfunction(L, tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
}
