/* core.http: HTTP requests on the loop (the engine is core/http.c; this file translates). */
#include "runtime.h"
#include "bind/bind.h"
#include "http.h"
#include <string.h>

#define REQ_MT "core.http.request"
#define ENGINE_MT "core.http.engine"

/* The `core.http.request` userdata. While the request is in flight it holds a ref to
 * itself, so it is only collected in flight when the whole state closes. */
typedef struct {
  dm_http_req *req; /* NULL once completed or discarded */
  int cb_ref, data_ref, headers_ref, self_ref;
  int want_body; /* res.body is delivered (neither on_data nor output_file) */
} lreq;

static dm_http *engine;    /* one per runtime; freed by the registry sentinel's __gc */
static int engine_closing; /* inside dm_http_free: completions must not enter Lua */

typedef struct {
  lreq *lr;
  dm_http_req *req;
  const char *data;
  size_t len;
  const dm_http_err *err;
} deliver;

static void release(lreq *lr) {
  lua_State *L = dm_rt.L;
  dm_unref(L, &lr->cb_ref);
  dm_unref(L, &lr->data_ref);
  dm_unref(L, &lr->headers_ref);
  dm_unref(L, &lr->self_ref);
}

/* [] -> [headers]: lowercased name -> value; repeated headers are joined with ", " */
static void push_headers(lua_State *L, dm_http_req *req) {
  size_t n = dm_http_header_count(req);
  lua_createtable(L, 0, (int)n);
  for (size_t i = 0; i < n; i++) {
    const char *name, *value;
    dm_http_header_at(req, i, &name, &value);
    if (lua_getfield(L, -1, name) == LUA_TSTRING) { /* [headers, prev] */
      lua_pushliteral(L, ", ");
      lua_pushstring(L, value);
      lua_concat(L, 3);
    } else {
      lua_pop(L, 1);
      lua_pushstring(L, value);
    }
    lua_setfield(L, -2, name);
  }
}

/* Protected deliveries: everything that may raise (allocation) happens inside dm_call. */
static int p_headers(lua_State *L) {
  deliver *d = lua_touserdata(L, 1);
  dm_push_ref(L, d->lr->headers_ref);
  lua_pushinteger(L, dm_http_status(d->req));
  push_headers(L, d->req);
  lua_call(L, 2, 0);
  return 0;
}

static int p_data(lua_State *L) {
  deliver *d = lua_touserdata(L, 1);
  dm_push_ref(L, d->lr->data_ref);
  lua_pushlstring(L, d->data, d->len);
  lua_call(L, 1, 0);
  return 0;
}

static int p_done(lua_State *L) {
  deliver *d = lua_touserdata(L, 1);
  dm_push_ref(L, d->lr->cb_ref);
  if (d->err) {
    lua_pushnil(L);
    lua_pushstring(L, d->err->msg);
    lua_pushstring(L, d->err->code);
    lua_call(L, 3, 0);
    return 0;
  }
  lua_createtable(L, 0, 3); /* [cb, res] */
  lua_pushinteger(L, dm_http_status(d->req));
  lua_setfield(L, -2, "status");
  push_headers(L, d->req);
  lua_setfield(L, -2, "headers");
  if (d->lr->want_body) {
    size_t len;
    const char *body = dm_http_body(d->req, &len);
    lua_pushlstring(L, body, len);
    lua_setfield(L, -2, "body");
  }
  lua_call(L, 1, 0);
  return 0;
}

static void run_protected(lua_CFunction fn, deliver *d) {
  lua_State *L = dm_rt.L;
  lua_pushcfunction(L, fn);
  lua_pushlightuserdata(L, d);
  dm_call(L, 1);
}

static void on_headers(void *ud, dm_http_req *req) {
  lreq *lr = ud;
  if (!dm_rt.L || engine_closing || lr->headers_ref == LUA_NOREF) return;
  deliver d = {lr, req, NULL, 0, NULL};
  run_protected(p_headers, &d);
}

static void on_data(void *ud, dm_http_req *req, const char *data, size_t len) {
  lreq *lr = ud;
  if (!dm_rt.L || engine_closing || lr->data_ref == LUA_NOREF) return;
  deliver d = {lr, req, data, len, NULL};
  run_protected(p_data, &d);
}

static void on_done(void *ud, dm_http_req *req, const dm_http_err *err) {
  lreq *lr = ud;
  lr->req = NULL;
  if (dm_rt.L && !engine_closing && lr->cb_ref != LUA_NOREF) {
    deliver d = {lr, req, NULL, 0, err};
    run_protected(p_done, &d);
  }
  release(lr);
  dm_handle_count(-1);
}

static const dm_http_handler handler = {on_headers, on_data, on_done};

static int engine_gc(lua_State *L) {
  engine_closing = 1;
  dm_http_free(engine);
  engine = NULL;
  engine_closing = 0;
  return 0;
}

/* The engine is created on first use and owned by a registry sentinel whose __gc (run by
 * lua_close) frees it, so its handles are closed before the loop is. */
static dm_http *get_engine(lua_State *L) {
  if (engine) return engine;
  engine = dm_http_new(dm_rt.loop);
  if (!engine) return NULL;
  lua_newuserdatauv(L, 1, 0);
  if (luaL_newmetatable(L, ENGINE_MT)) {
    lua_pushcfunction(L, engine_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, ENGINE_MT);
  return engine;
}

/* [opts, cb, ...] -> [..., value]: an optional field of type `t` (nil allowed) */
static int opt_field(lua_State *L, const char *k, int t, const char *what) {
  int got = lua_getfield(L, 1, k);
  if (got != LUA_TNIL && got != t) {
    const char *msg = lua_pushfstring(L, "field '%s' must be %s", k, what);
    return luaL_argerror(L, 1, msg);
  }
  return got != LUA_TNIL;
}

static const char *opt_string(lua_State *L, const char *k, size_t *len) {
  if (!opt_field(L, k, LUA_TSTRING, "a string")) return NULL;
  return lua_tolstring(L, -1, len); /* left on the stack: anchored */
}

static long opt_ms(lua_State *L, const char *k) {
  if (!opt_field(L, k, LUA_TNUMBER, "an integer")) return 0;
  lua_Integer v = 0;
  if (!lua_isinteger(L, -1) || (v = lua_tointeger(L, -1)) < 0)
    return luaL_argerror(L, 1, lua_pushfstring(L, "field '%s' must be an integer >= 0", k));
  return (long)v;
}

static int is_token(const char *s) {
  if (!*s) return 0;
  for (; *s; s++)
    if (*s <= ' ' || *s >= 0x7f || strchr("\"(),/:;<=>?@[\\]{}", *s)) return 0;
  return 1;
}

/* [opts, cb, ...] -> [..., anchor, array]: the headers table as engine header pairs whose
 * strings are anchored by `anchor` */
static size_t collect_headers(lua_State *L, dm_http_header **out) {
  *out = NULL;
  if (!opt_field(L, "headers", LUA_TTABLE, "a table of name = value")) return 0;
  int t = lua_gettop(L);
  size_t n = 0;
  lua_pushnil(L);
  while (lua_next(L, t)) {
    n++;
    lua_pop(L, 1);
  }
  lua_createtable(L, (int)(2 * n), 0); /* anchor */
  int anchor = lua_gettop(L);
  dm_http_header *hv = lua_newuserdatauv(L, (n ? n : 1) * sizeof *hv, 0);
  size_t i = 0;
  lua_pushnil(L);
  while (lua_next(L, t)) { /* [.., key, value] */
    if (lua_type(L, -2) != LUA_TSTRING || !is_token(lua_tostring(L, -2)))
      return luaL_argerror(L, 1, "headers: every name must be an HTTP token string");
    int vt = lua_type(L, -1);
    if (vt != LUA_TSTRING && vt != LUA_TNUMBER)
      return luaL_argerror(L, 1, lua_pushfstring(L, "headers: value of '%s' must be a string", lua_tostring(L, -2)));
    const char *v = luaL_tolstring(L, -1, NULL); /* [.., key, value, vstr] */
    if (strpbrk(v, "\r\n"))
      return luaL_argerror(L, 1, lua_pushfstring(L, "headers: value of '%s' holds CR or LF", lua_tostring(L, -3)));
    lua_pushvalue(L, -3);
    lua_rawseti(L, anchor, (lua_Integer)(2 * i + 1));
    lua_rawseti(L, anchor, (lua_Integer)(2 * i + 2)); /* [.., key, value] */
    lua_rawgeti(L, anchor, (lua_Integer)(2 * i + 1));
    hv[i].name = lua_tostring(L, -1);
    lua_rawgeti(L, anchor, (lua_Integer)(2 * i + 2));
    hv[i].value = lua_tostring(L, -1);
    lua_pop(L, 3); /* [.., key] */
    i++;
  }
  *out = hv;
  return n;
}

/// core.http.request(opts, callback) -> request | nil, msg, code. See
/// docs/reference/lua-api.md. callback(res) or callback(nil, msg, code) is called once,
/// later, from the loop.
static int l_request(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);
  luaL_checkstack(L, 40, NULL); /* option values stay on the stack (anchored) */
  dm_http_opts o;
  memset(&o, 0, sizeof o);
  o.url = opt_string(L, "url", NULL);
  luaL_argcheck(L, o.url && *o.url, 1, "field 'url' is required");
  o.method = opt_string(L, "method", NULL);
  luaL_argcheck(L, !o.method || is_token(o.method), 1, "field 'method' must be an HTTP token");
  o.unix_socket = opt_string(L, "unix_socket", NULL);
  o.body = opt_string(L, "body", &o.body_len);
  o.body_file = opt_string(L, "body_file", NULL);
  o.output_file = opt_string(L, "output_file", NULL);
  o.ca_file = opt_string(L, "ca_file", NULL);
  o.ca_pem = opt_string(L, "ca_pem", &o.ca_pem_len);
  o.cert_pem = opt_string(L, "cert_pem", &o.cert_pem_len);
  o.key_pem = opt_string(L, "key_pem", &o.key_pem_len); /* never logged nor put in a message */
  luaL_argcheck(L, !(o.ca_file && o.ca_pem), 1, "fields 'ca_file' and 'ca_pem' exclude each other");
  luaL_argcheck(L, !o.cert_pem == !o.key_pem, 1, "fields 'cert_pem' and 'key_pem' go together");
  if (opt_field(L, "insecure", LUA_TBOOLEAN, "a boolean")) o.insecure = lua_toboolean(L, -1);
  luaL_argcheck(L, !(o.insecure && (o.ca_file || o.ca_pem)), 1, "field 'insecure' excludes 'ca_file' and 'ca_pem'");
  luaL_argcheck(L, !(o.body && o.body_file), 1, "fields 'body' and 'body_file' exclude each other");
  int data_idx = opt_field(L, "on_data", LUA_TFUNCTION, "a function") ? lua_gettop(L) : 0;
  int head_idx = opt_field(L, "on_headers", LUA_TFUNCTION, "a function") ? lua_gettop(L) : 0;
  luaL_argcheck(L, !(data_idx && o.output_file), 1, "fields 'on_data' and 'output_file' exclude each other");
  o.stream = data_idx != 0;
  o.timeout_ms = opt_ms(L, "timeout_ms");
  o.connect_timeout_ms = opt_ms(L, "connect_timeout_ms");
  if (opt_field(L, "max_body_bytes", LUA_TNUMBER, "an integer")) {
    lua_Integer v = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : -1;
    luaL_argcheck(L, v >= 0, 1, "field 'max_body_bytes' must be an integer >= 0");
    o.max_body_bytes = (uint64_t)v;
  }
  dm_http_header *hv;
  o.nheaders = collect_headers(L, &hv);
  o.headers = hv;

  lreq *lr = lua_newuserdatauv(L, sizeof *lr, 0);
  memset(lr, 0, sizeof *lr);
  lr->cb_ref = lr->data_ref = lr->headers_ref = lr->self_ref = LUA_NOREF;
  lr->want_body = !o.stream && !o.output_file;
  luaL_setmetatable(L, REQ_MT);
  int self = lua_gettop(L);
  dm_http *h = get_engine(L);
  if (!h) return dm_fail(L, "http: cannot initialise libcurl", "ENOMEM");
  dm_http_err err;
  dm_http_req *req = dm_http_start(h, &o, &handler, lr, &err);
  if (!req) return dm_fail(L, err.msg, err.code);
  lr->req = req;
  dm_handle_count(1);
  lua_pushvalue(L, 2);
  lr->cb_ref = dm_ref(L);
  if (data_idx) {
    lua_pushvalue(L, data_idx);
    lr->data_ref = dm_ref(L);
  }
  if (head_idx) {
    lua_pushvalue(L, head_idx);
    lr->headers_ref = dm_ref(L);
  }
  lua_pushvalue(L, self);
  lr->self_ref = dm_ref(L);
  lua_settop(L, self);
  return 1;
}

/// request:cancel() -> nil. Aborts the request; its callback is then called once, later,
/// with nil, "cancelled", "ECANCELED". No effect once the request has completed.
/// Also __close.
static int l_cancel(lua_State *L) {
  lreq *lr = luaL_checkudata(L, 1, REQ_MT);
  if (lr->req) dm_http_cancel(lr->req);
  return 0;
}

/* Only reached in flight when the state closes: drop the request without callbacks. */
static int l_gc(lua_State *L) {
  lreq *lr = luaL_checkudata(L, 1, REQ_MT);
  if (lr->req) {
    dm_http_discard(lr->req);
    lr->req = NULL;
    release(lr);
    dm_handle_count(-1);
  }
  return 0;
}

static const luaL_Reg methods[] = {{"cancel", l_cancel}, {NULL, NULL}};
static const luaL_Reg funcs[] = {{"request", l_request}, {NULL, NULL}};

/// Opens core.http: registers the `core.http.request` metatable and returns the module
/// table {request}. The engine (libcurl multi on dm_rt.loop) is created on first use and
/// freed when the state closes.
int luaopen_core_http(lua_State *L) {
  dm_metatable(L, REQ_MT, methods, l_gc, l_cancel);
  luaL_newlib(L, funcs);
  return 1;
}
