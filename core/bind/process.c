/* core.process: child processes with pipes, environment, working directory and
 * process-group kill. */
#include "runtime.h"
#include "bind/bind.h"
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#define PROC_MT "core.process"

typedef struct {
  uv_process_t *h; /* heap: freed in the close callback */
  int exit_ref;
  int self_ref;
  int pid;
  int exited;
  int detached;
} dm_proc;

static void on_close(uv_handle_t *h) {
  free(h);
  dm_handle_count(-1);
}

static void on_exit_cb(uv_process_t *h, int64_t status, int term_signal) {
  dm_proc *p = h->data;
  lua_State *L = dm_rt.L;
  uv_close((uv_handle_t *)h, on_close);
  if (!p) return;
  p->h = NULL;
  p->exited = 1;
  if (!L) return;
  int cb = p->exit_ref, self = p->self_ref;
  p->exit_ref = p->self_ref = LUA_NOREF;
  if (cb != LUA_NOREF) {
    dm_push_ref(L, cb);
    lua_pushinteger(L, (lua_Integer)status);
    lua_pushinteger(L, term_signal);
    dm_call(L, 2);
  }
  dm_unref(L, &cb);
  dm_unref(L, &self);
}

static const char *opt_string(lua_State *L, int t, const char *k) {
  lua_getfield(L, t, k);
  const char *s = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_pop(L, 1);
  return s;
}

static char **string_list(lua_State *L, int t, const char *k, const char *first) {
  lua_getfield(L, t, k);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    if (!first) return NULL;
    char **v = calloc(2, sizeof *v);
    v[0] = (char *)first;
    return v;
  }
  if (!lua_istable(L, -1)) luaL_error(L, "spawn: field '%s' must be a list of strings", k);
  lua_Integer n = luaL_len(L, -1);
  int off = first ? 1 : 0;
  char **v = calloc((size_t)n + 2, sizeof *v);
  if (first) v[0] = (char *)first;
  for (lua_Integer i = 1; i <= n; i++) {
    lua_rawgeti(L, -1, i);
    if (lua_type(L, -1) != LUA_TSTRING) {
      free(v);
      luaL_error(L, "spawn: %s[%d] must be a string", k, (int)i);
    }
    v[i - 1 + off] = (char *)lua_tostring(L, -1); /* anchored by the table */
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return v;
}

/* stdio spec: nil/false = ignore, true = new pipe, "inherit" = the same fd */
static void stdio_spec(lua_State *L, int t, const char *k, int fd, uv_stdio_container_t *c, uv_pipe_t **pipe,
                       int readable) {
  lua_getfield(L, t, k);
  *pipe = NULL;
  if (lua_toboolean(L, -1) && lua_type(L, -1) == LUA_TBOOLEAN) {
    *pipe = dm_pipe_new();
    c->flags = UV_CREATE_PIPE | (readable ? UV_READABLE_PIPE : UV_WRITABLE_PIPE);
    c->data.stream = (uv_stream_t *)*pipe;
  } else if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "inherit") == 0) {
    c->flags = UV_INHERIT_FD;
    c->data.fd = fd;
  } else {
    c->flags = UV_IGNORE;
  }
  lua_pop(L, 1);
}

/// core.process.spawn(opts, on_exit) -> proc, {stdin=stream?, stdout=stream?, stderr=stream?}
///                                    | nil, msg, code
/// opts: file (string, looked up in PATH), args (list of strings, argv[1..]), env (list of
/// "K=V" strings; nil inherits), cwd (string), detached (boolean: new session and process
/// group, so proc:kill(sig, true) reaches every descendant), stdin/stdout/stderr (true = a
/// new pipe, "inherit", nil = /dev/null). on_exit(exit_status, term_signal) is called once.
static int l_spawn(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  const char *file = opt_string(L, 1, "file");
  luaL_argcheck(L, file != NULL, 1, "field 'file' is required");
  const char *cwd = opt_string(L, 1, "cwd");
  lua_getfield(L, 1, "detached");
  int detached = lua_toboolean(L, -1);
  lua_pop(L, 1);
  char **args = string_list(L, 1, "args", file);
  char **env = string_list(L, 1, "env", NULL);

  uv_stdio_container_t stdio[3];
  uv_pipe_t *pipes[3];
  stdio_spec(L, 1, "stdin", 0, &stdio[0], &pipes[0], 1);
  stdio_spec(L, 1, "stdout", 1, &stdio[1], &pipes[1], 0);
  stdio_spec(L, 1, "stderr", 2, &stdio[2], &pipes[2], 0);

  uv_process_options_t o;
  memset(&o, 0, sizeof o);
  o.file = file;
  o.args = args;
  o.env = env;
  o.cwd = cwd;
  o.flags = detached ? UV_PROCESS_DETACHED : 0;
  o.stdio_count = 3;
  o.stdio = stdio;
  o.exit_cb = on_exit_cb;

  dm_proc *p = lua_newuserdatauv(L, sizeof *p, 0);
  memset(p, 0, sizeof *p);
  p->exit_ref = p->self_ref = LUA_NOREF;
  luaL_setmetatable(L, PROC_MT);
  p->h = malloc(sizeof *p->h);
  int r = uv_spawn(dm_rt.loop, p->h, &o);
  free(args);
  free(env);
  if (r) {
    /* a handle uv_spawn refused is still in the loop's list: it must be closed, not freed */
    dm_handle_count(1);
    uv_close((uv_handle_t *)p->h, on_close);
    p->h = NULL;
    for (int i = 0; i < 3; i++)
      if (pipes[i]) uv_close((uv_handle_t *)pipes[i], on_close);
    return dm_fail_uv(L, file, r);
  }
  dm_handle_count(1);
  p->h->data = p;
  p->pid = p->h->pid;
  p->detached = detached;
  lua_pushvalue(L, 2);
  p->exit_ref = dm_ref(L);
  lua_pushvalue(L, -1); /* [opts, cb, ..., proc, proc] */
  p->self_ref = dm_ref(L);
  lua_createtable(L, 0, 3);
  static const char *names[3] = {"stdin", "stdout", "stderr"};
  for (int i = 0; i < 3; i++) {
    if (pipes[i]) {
      dm_stream_push(L, (uv_stream_t *)pipes[i]);
      lua_setfield(L, -2, names[i]);
    }
  }
  return 2;
}

static dm_proc *check_proc(lua_State *L, int idx) { return luaL_checkudata(L, idx, PROC_MT); }

/// proc:pid() -> integer
static int l_pid(lua_State *L) {
  lua_pushinteger(L, check_proc(L, 1)->pid);
  return 1;
}

/// proc:kill(signal [, group]) -> true | nil, msg, code. signal is a number or a name
/// ("TERM", "KILL", "INT"). group = true signals the whole process group (needs detached).
static int l_kill(lua_State *L) {
  dm_proc *p = check_proc(L, 1);
  int sig = SIGTERM;
  if (lua_type(L, 2) == LUA_TSTRING) {
    const char *s = lua_tostring(L, 2);
    if (!strcmp(s, "TERM")) sig = SIGTERM;
    else if (!strcmp(s, "KILL")) sig = SIGKILL;
    else if (!strcmp(s, "INT")) sig = SIGINT;
    else if (!strcmp(s, "HUP")) sig = SIGHUP;
    else return luaL_argerror(L, 2, "unknown signal name");
  } else if (!lua_isnoneornil(L, 2)) {
    sig = (int)luaL_checkinteger(L, 2);
  }
  int group = lua_toboolean(L, 3);
  if (p->exited && !group) return dm_fail(L, "kill: process has exited", "ESRCH");
  int r = uv_kill(group ? -p->pid : p->pid, sig);
  if (r) return dm_fail_uv(L, "kill", r);
  lua_pushboolean(L, 1);
  return 1;
}

/// proc:exited() -> boolean
static int l_exited(lua_State *L) {
  lua_pushboolean(L, check_proc(L, 1)->exited);
  return 1;
}

static int l_gc(lua_State *L) {
  dm_proc *p = check_proc(L, 1);
  if (p->h) {
    p->h->data = NULL; /* the exit callback closes the handle later */
  }
  lua_State *Lr = dm_rt.L ? L : NULL;
  dm_unref(Lr, &p->exit_ref);
  dm_unref(Lr, &p->self_ref);
  return 0;
}

/* __close: a process is not left behind by the scope that held it. SIGKILL to the child
 * when it has not exited (not its group: that is kill(sig, true)); its exit callback still
 * runs once it is reaped. */
static int l_close(lua_State *L) {
  dm_proc *p = check_proc(L, 1);
  if (!p->exited && p->h) uv_kill(p->pid, SIGKILL);
  return 0;
}

static const luaL_Reg methods[] = {
  {"pid", l_pid},
  {"kill", l_kill},
  {"exited", l_exited},
  {NULL, NULL},
};
static const luaL_Reg funcs[] = {{"spawn", l_spawn}, {NULL, NULL}};

int luaopen_core_process(lua_State *L) {
  /* child pipes are core.stream userdata: make sure that metatable exists */
  luaL_requiref(L, "core.stream", luaopen_core_stream, 0);
  lua_pop(L, 1);
  dm_metatable(L, PROC_MT, methods, l_gc, l_close);
  luaL_newlib(L, funcs);
  return 1;
}
