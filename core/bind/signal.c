/* core.signal: watch process signals on the loop. */
#include "runtime.h"
#include "bind/bind.h"
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#define SIGNAL_MT "core.signal"

typedef struct {
  uv_signal_t *h;
  int cb_ref;
  int self_ref;
} dm_signal;

static void on_close(uv_handle_t *h) {
  free(h);
  dm_handle_count(-1);
}

static void on_signal(uv_signal_t *h, int signum) {
  dm_signal *s = h->data;
  lua_State *L = dm_rt.L;
  if (!L || !s) return;
  dm_push_ref(L, s->cb_ref);
  lua_pushinteger(L, signum);
  dm_call(L, 1);
}

/// core.signal.watch(name, callback) -> watcher | nil, msg, code.
/// name: "INT", "TERM", "HUP" or "CHLD"; callback(signum) on every delivery until
/// watcher:close(). The watcher does not keep the loop alive (unref'd).
static int l_watch(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  int sig = !strcmp(name, "INT")    ? SIGINT
            : !strcmp(name, "TERM") ? SIGTERM
            : !strcmp(name, "HUP")  ? SIGHUP
            : !strcmp(name, "CHLD") ? SIGCHLD
                                    : 0;
  luaL_argcheck(L, sig != 0, 1, "signal must be INT, TERM, HUP or CHLD");
  dm_signal *s = lua_newuserdatauv(L, sizeof *s, 0);
  s->h = malloc(sizeof *s->h);
  uv_signal_init(dm_rt.loop, s->h);
  dm_handle_count(1);
  s->h->data = s;
  luaL_setmetatable(L, SIGNAL_MT);
  int r = uv_signal_start(s->h, on_signal, sig);
  if (r) {
    uv_close((uv_handle_t *)s->h, on_close);
    s->h = NULL;
    s->cb_ref = s->self_ref = LUA_NOREF;
    return dm_fail_uv(L, "signal", r);
  }
  uv_unref((uv_handle_t *)s->h);
  lua_pushvalue(L, 2);
  s->cb_ref = dm_ref(L);
  lua_pushvalue(L, -1);
  s->self_ref = dm_ref(L);
  return 1;
}

/// watcher:close() -> nil. Idempotent.
static int l_close(lua_State *L) {
  dm_signal *s = luaL_checkudata(L, 1, SIGNAL_MT);
  if (s->h) {
    s->h->data = NULL;
    uv_close((uv_handle_t *)s->h, on_close);
    s->h = NULL;
  }
  lua_State *Lr = dm_rt.L ? L : NULL;
  dm_unref(Lr, &s->cb_ref);
  dm_unref(Lr, &s->self_ref);
  return 0;
}

static const luaL_Reg methods[] = {{"close", l_close}, {NULL, NULL}};
static const luaL_Reg funcs[] = {{"watch", l_watch}, {NULL, NULL}};

int luaopen_core_signal(lua_State *L) {
  dm_metatable(L, SIGNAL_MT, methods, l_close, l_close);
  luaL_newlib(L, funcs);
  return 1;
}
