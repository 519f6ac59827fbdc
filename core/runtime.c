#include "runtime.h"
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

dm_runtime dm_rt;

static void *dm_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  dm_runtime *rt = ud;
  if (ptr == NULL) osize = 0;
  if (nsize == 0) {
    free(ptr);
    rt->mem_used -= osize;
    return NULL;
  }
  if (rt->mem_cap && nsize > osize && rt->mem_used + (nsize - osize) > rt->mem_cap) return NULL;
  void *p = realloc(ptr, nsize);
  if (p) rt->mem_used = rt->mem_used - osize + nsize;
  return p;
}

static int dm_panic(lua_State *L) {
  fprintf(stderr, "demesne: unprotected Lua error: %s\n", lua_tostring(L, -1));
  return 0; /* lua_error's default handler aborts after this */
}

int dm_runtime_init(size_t mem_cap) {
  memset(&dm_rt, 0, sizeof dm_rt);
  dm_rt.mem_cap = mem_cap;
  dm_rt.loop = malloc(sizeof *dm_rt.loop);
  if (!dm_rt.loop || uv_loop_init(dm_rt.loop) != 0) {
    fprintf(stderr, "demesne: cannot initialise the event loop\n");
    return -1;
  }
  lua_State *L = lua_newstate(dm_alloc, &dm_rt);
  if (!L) {
    fprintf(stderr, "demesne: cannot create the Lua state\n");
    return -1;
  }
  lua_atpanic(L, dm_panic);
  luaL_openlibs(L);
  dm_rt.L = L;
  return 0;
}

static void walk_close(uv_handle_t *h, void *arg) {
  if (!uv_is_closing(h)) uv_close(h, NULL);
}

void dm_runtime_close(void) {
  if (dm_rt.L) {
    lua_State *L = dm_rt.L;
    lua_close(L);
    dm_rt.L = NULL;
  }
  if (dm_rt.loop) {
    /* Close callbacks queued by __gc run now; they must not touch Lua (dm_rt.L is NULL). */
    uv_run(dm_rt.loop, UV_RUN_NOWAIT);
    uv_walk(dm_rt.loop, walk_close, NULL);
    uv_run(dm_rt.loop, UV_RUN_DEFAULT);
    uv_loop_close(dm_rt.loop);
    free(dm_rt.loop);
    dm_rt.loop = NULL;
  }
}

int dm_ref(lua_State *L) {
  dm_rt.refs++;
  return luaL_ref(L, LUA_REGISTRYINDEX);
}

void dm_unref(lua_State *L, int *ref) {
  if (*ref != LUA_NOREF && *ref != LUA_REFNIL) {
    if (L) luaL_unref(L, LUA_REGISTRYINDEX, *ref);
    dm_rt.refs--;
  }
  *ref = LUA_NOREF;
}

void dm_push_ref(lua_State *L, int ref) { lua_rawgeti(L, LUA_REGISTRYINDEX, ref); }

void dm_handle_count(int delta) { dm_rt.handles += delta; }

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static dm_error_sink error_sink;
static void *error_sink_ud;

void dm_set_error_sink(dm_error_sink sink, void *ud) {
  error_sink = sink;
  error_sink_ud = ud;
}

void dm_error_to_stderr(const char *traceback) { fprintf(stderr, "demesne: callback error: %s\n", traceback); }

int dm_call(lua_State *L, int nargs) {
  int base = lua_gettop(L) - nargs; /* function index */
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);
  int rc = lua_pcall(L, nargs, 0, base);
  if (rc != LUA_OK) {
    const char *tb = lua_tostring(L, -1);
    if (!tb) tb = "(error object is not a string)";
    if (error_sink) error_sink(error_sink_ud, L, tb);
    else dm_error_to_stderr(tb);
    lua_pop(L, 1);
  }
  lua_remove(L, base);
  return rc == LUA_OK ? 0 : -1;
}

int dm_fail(lua_State *L, const char *msg, const char *code) {
  lua_pushnil(L);
  lua_pushstring(L, msg);
  lua_pushstring(L, code);
  return 3;
}

int dm_fail_uv(lua_State *L, const char *what, int err) {
  lua_pushnil(L);
  lua_pushfstring(L, "%s: %s", what, uv_strerror(err));
  lua_pushstring(L, uv_err_name(err));
  return 3;
}
