/* core.loop: run/stop the event loop, clock, counters and the embedded sources. */
#include "runtime.h"
#include "bind/bind.h"
#include "embedded.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/// core.loop.run([mode]) -> nil. mode "default" (until no handles are active or stop() is
/// called), "once" or "nowait" (one iteration; "nowait" does not block).
static int l_run(lua_State *L) {
  static const char *const modes[] = {"default", "once", "nowait", NULL};
  static const uv_run_mode m[] = {UV_RUN_DEFAULT, UV_RUN_ONCE, UV_RUN_NOWAIT};
  uv_run(dm_rt.loop, m[luaL_checkoption(L, 1, "default", modes)]);
  return 0;
}

/// core.loop.stop() -> nil. Makes run() return after the current iteration.
static int l_stop(lua_State *L) {
  uv_stop(dm_rt.loop);
  return 0;
}

/// core.loop.now() -> integer: the loop's cached time in milliseconds (monotonic).
static int l_now(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)uv_now(dm_rt.loop));
  return 1;
}

/// core.loop.hrtime() -> integer: a monotonic clock in nanoseconds.
static int l_hrtime(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)uv_hrtime());
  return 1;
}

/// core.loop.time() -> number: wall-clock seconds since the Unix epoch, with fractions.
static int l_time(lua_State *L) {
  uv_timeval64_t tv;
  uv_gettimeofday(&tv);
  lua_pushnumber(L, (double)tv.tv_sec + tv.tv_usec / 1e6);
  return 1;
}

/// core.loop.stats() -> {refs=int, handles=int, lua_bytes=int, rss_bytes=int}
/// Live registry refs and binding handles (the test runner fails when they leak).
static int l_stats(lua_State *L) {
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, dm_rt.refs);
  lua_setfield(L, -2, "refs");
  lua_pushinteger(L, dm_rt.handles);
  lua_setfield(L, -2, "handles");
  lua_pushinteger(L, (lua_Integer)dm_rt.mem_used);
  lua_setfield(L, -2, "lua_bytes");
  size_t rss = 0;
  if (uv_resident_set_memory(&rss) == 0) {
    lua_pushinteger(L, (lua_Integer)rss);
    lua_setfield(L, -2, "rss_bytes");
  }
  return 1;
}

/// core.loop.embedded() -> {[path] = contents}: every file embedded at build time,
/// keyed by its path relative to the source root ("lua/async.lua").
static int l_embedded(lua_State *L) {
  lua_newtable(L);
  for (const struct dm_embedded *e = dm_embedded_files; e->path; e++) {
    lua_pushlstring(L, (const char *)e->data, e->len);
    lua_setfield(L, -2, e->path);
  }
  return 1;
}

/// core.loop.exepath() -> string | nil, msg, code: absolute path of the running binary.
static int l_exepath(lua_State *L) {
  char buf[4096];
  size_t n = sizeof buf;
  int r = uv_exepath(buf, &n);
  if (r) return dm_fail_uv(L, "exepath", r);
  lua_pushlstring(L, buf, n);
  return 1;
}

/// core.loop.getpid() -> integer
static int l_getpid(lua_State *L) {
  lua_pushinteger(L, getpid());
  return 1;
}

/// core.loop.environ() -> {"K=V", ...}: the process environment.
static int l_environ(lua_State *L) {
  extern char **environ;
  lua_newtable(L);
  int i = 1;
  for (char **e = environ; *e; e++) {
    lua_pushstring(L, *e);
    lua_rawseti(L, -2, i++);
  }
  return 1;
}

/// core.loop.setenv(name, value|nil) -> nil: sets or unsets a variable of this process.
static int l_setenv(lua_State *L) {
  const char *k = luaL_checkstring(L, 1);
  if (lua_isnoneornil(L, 2)) unsetenv(k);
  else setenv(k, luaL_checkstring(L, 2), 1);
  return 0;
}

/// core.loop.random(n) -> string: n bytes from the OS's CSPRNG (n ≤ 65536).
static int l_random(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  luaL_argcheck(L, n > 0 && n <= 65536, 1, "length must be 1..65536");
  char buf[65536];
  int r = uv_random(NULL, NULL, buf, (size_t)n, 0, NULL);
  if (r) return dm_fail_uv(L, "random", r);
  lua_pushlstring(L, buf, (size_t)n);
  return 1;
}

/// core.loop.hostname() -> string
static int l_hostname(lua_State *L) {
  char buf[256];
  size_t n = sizeof buf;
  if (uv_os_gethostname(buf, &n) != 0) strcpy(buf, "localhost");
  lua_pushstring(L, buf);
  return 1;
}

/* The Lua function errors raised by callbacks go to (core.loop.on_callback_error). */
static int sink_ref = LUA_NOREF;
static int in_sink;

static void lua_sink(void *ud, lua_State *L, const char *traceback) {
  (void)ud;
  if (in_sink || sink_ref == LUA_NOREF) { /* an error the sink itself raised */
    dm_error_to_stderr(traceback);
    return;
  }
  in_sink = 1;
  dm_push_ref(L, sink_ref);
  lua_pushstring(L, traceback);
  if (lua_pcall(L, 1, 0, 0) != LUA_OK) {
    dm_error_to_stderr(traceback);
    dm_error_to_stderr(lua_tostring(L, -1) ? lua_tostring(L, -1) : "(the error sink failed)");
    lua_pop(L, 1);
  }
  in_sink = 0;
}

/// core.loop.on_callback_error(fn | nil) -> previous fn | nil. Where an error raised by a
/// loop callback is reported: fn(traceback) (a string: the message and its traceback),
/// called from the loop; nil restores the default ("demesne: callback error: <traceback>"
/// on stderr). An error fn raises goes to stderr with the original one.
static int l_on_callback_error(lua_State *L) {
  if (!lua_isnil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_settop(L, 1);
  if (sink_ref != LUA_NOREF) {
    dm_push_ref(L, sink_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, sink_ref); /* process-wide: not counted in core.loop.stats */
  } else {
    lua_pushnil(L);
  }
  sink_ref = LUA_NOREF;
  dm_set_error_sink(NULL, NULL);
  if (!lua_isnil(L, 1)) {
    lua_pushvalue(L, 1);
    sink_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    dm_set_error_sink(lua_sink, NULL);
  }
  return 1;
}

static const luaL_Reg funcs[] = {
  {"run", l_run},
  {"stop", l_stop},
  {"now", l_now},
  {"hrtime", l_hrtime},
  {"time", l_time},
  {"stats", l_stats},
  {"embedded", l_embedded},
  {"exepath", l_exepath},
  {"getpid", l_getpid},
  {"environ", l_environ},
  {"setenv", l_setenv},
  {"random", l_random},
  {"hostname", l_hostname},
  {"on_callback_error", l_on_callback_error},
  {NULL, NULL},
};

int luaopen_core_loop(lua_State *L) {
  luaL_newlib(L, funcs);
  lua_pushstring(L, DEMESNE_VERSION);
  lua_setfield(L, -2, "version");
#ifndef DEMESNE_LIBEXEC_REL
#define DEMESNE_LIBEXEC_REL "../libexec/demesne"
#endif
  /* where `cmake --install` puts demesne-init, relative to the folder of `demesne` */
  lua_pushstring(L, DEMESNE_LIBEXEC_REL);
  lua_setfield(L, -2, "libexec_dir");
  return 1;
}
