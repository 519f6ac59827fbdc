/* core.timer: one-shot and repeating timers on the loop. */
#include "runtime.h"
#include "bind/bind.h"
#include <stdlib.h>

#define TIMER_MT "core.timer"

typedef struct {
  uv_timer_t *h; /* heap: freed by the close callback */
  int cb_ref;
  int self_ref; /* keeps the userdata alive while the timer is armed */
  int repeat;
  int autoclose; /* one-shot from core.timer.after: close the handle after firing */
} dm_timer;

static void on_close(uv_handle_t *h) {
  free(h);
  dm_handle_count(-1);
}

static void timer_release(lua_State *L, dm_timer *t) {
  dm_unref(L, &t->cb_ref);
  dm_unref(L, &t->self_ref);
}

static void on_timer(uv_timer_t *h) {
  dm_timer *t = h->data;
  lua_State *L = dm_rt.L;
  if (!L || !t) return;
  dm_push_ref(L, t->cb_ref);
  if (!t->repeat) {
    /* one-shot: disarm before the call so the callback can re-arm */
    int cb = t->cb_ref, self = t->self_ref;
    t->cb_ref = LUA_NOREF;
    t->self_ref = LUA_NOREF;
    if (t->autoclose) {
      h->data = NULL;
      uv_close((uv_handle_t *)h, on_close);
      t->h = NULL;
    }
    dm_call(L, 0);
    dm_unref(L, &cb);
    dm_unref(L, &self);
  } else {
    dm_call(L, 0);
  }
}

static dm_timer *check_timer(lua_State *L, int idx) {
  dm_timer *t = luaL_checkudata(L, idx, TIMER_MT);
  luaL_argcheck(L, t->h != NULL, idx, "timer is closed");
  return t;
}

/// core.timer.new() -> timer. A stopped timer; start it with timer:start().
static int l_new(lua_State *L) {
  dm_timer *t = lua_newuserdatauv(L, sizeof *t, 0);
  t->h = malloc(sizeof *t->h);
  if (!t->h) return luaL_error(L, "out of memory");
  uv_timer_init(dm_rt.loop, t->h);
  dm_handle_count(1);
  t->h->data = t;
  t->cb_ref = t->self_ref = LUA_NOREF;
  t->repeat = 0;
  t->autoclose = 0;
  luaL_setmetatable(L, TIMER_MT);
  return 1;
}

/// timer:start(timeout_ms, repeat_ms, callback) -> timer. Calls callback() after timeout_ms,
/// then every repeat_ms if repeat_ms > 0. Restarting replaces the previous callback. The
/// timeout counts from the call, not from the loop's last tick (uv_update_time first: after
/// a long callback the loop's cached time is behind, and the timer would fire early).
static int l_start(lua_State *L) {
  dm_timer *t = check_timer(L, 1);
  lua_Integer timeout = luaL_checkinteger(L, 2);
  lua_Integer repeat = luaL_checkinteger(L, 3);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  luaL_argcheck(L, timeout >= 0, 2, "timeout must be >= 0 ms");
  luaL_argcheck(L, repeat >= 0, 3, "repeat must be >= 0 ms");
  timer_release(L, t);
  lua_pushvalue(L, 4);
  t->cb_ref = dm_ref(L);
  lua_pushvalue(L, 1);
  t->self_ref = dm_ref(L);
  t->repeat = repeat > 0;
  uv_update_time(dm_rt.loop);
  uv_timer_start(t->h, on_timer, (uint64_t)timeout, (uint64_t)repeat);
  lua_settop(L, 1);
  return 1;
}

/// timer:stop() -> nil. Disarms; the callback is not called.
static int l_stop(lua_State *L) {
  dm_timer *t = luaL_checkudata(L, 1, TIMER_MT);
  if (t->h) uv_timer_stop(t->h);
  timer_release(L, t);
  return 0;
}

/// timer:close() -> nil. Stops and frees the timer; idempotent. Also __gc and __close.
static int l_close(lua_State *L) {
  dm_timer *t = luaL_checkudata(L, 1, TIMER_MT);
  if (t->h) {
    uv_timer_stop(t->h);
    t->h->data = NULL;
    uv_close((uv_handle_t *)t->h, on_close);
    t->h = NULL;
  }
  timer_release(dm_rt.L ? L : NULL, t);
  return 0;
}

/// core.timer.after(ms, callback) -> timer: a one-shot timer, already started.
static int l_after(lua_State *L) {
  luaL_checkinteger(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);
  l_new(L); /* [ms, cb, t] */
  lua_pushcfunction(L, l_start);
  lua_pushvalue(L, 3);
  lua_pushvalue(L, 1);
  lua_pushinteger(L, 0);
  lua_pushvalue(L, 2);
  lua_call(L, 4, 1);
  ((dm_timer *)lua_touserdata(L, -1))->autoclose = 1;
  return 1;
}

static const luaL_Reg methods[] = {
  {"start", l_start},
  {"stop", l_stop},
  {"close", l_close},
  {NULL, NULL},
};
static const luaL_Reg funcs[] = {{"new", l_new}, {"after", l_after}, {NULL, NULL}};

int luaopen_core_timer(lua_State *L) {
  dm_metatable(L, TIMER_MT, methods, l_close, l_close);
  luaL_newlib(L, funcs);
  return 1;
}
