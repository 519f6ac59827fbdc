/* core.httpd: the HTTP/1.1 server (core/httpd.c) seen from Lua. C parses, checks the
 * listener's Host/Origin/token rules and body size, and writes; Lua gets whole requests
 * and answers them, whole or streamed. */
#include "runtime.h"
#include "bind/bind.h"
#include "httpd.h"
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SERVER_MT "core.httpd.server"
#define CONN_MT "core.httpd.conn"
#define POOL_MT "core.httpd.pool"

/* Owned by the engine's lifetime, not by the userdata: freed in on_closed. */
typedef struct lserver {
  dm_httpd *s;
  int req_ref, close_ref, closed_ref, self_ref, head_ref, pool_ref;
  int closed;
} lserver;

typedef struct {
  lserver *ls;
} server_ud;

typedef struct {
  dm_httpd_conn *c; /* NULL once the connection is gone */
  int drain_ref;
  char listener[64];
} conn_ud;

static void push_conn(lua_State *L, dm_httpd_conn *c, const char *tag) {
  intptr_t ref = (intptr_t)dm_httpd_conn_data(c);
  if (ref) {
    dm_push_ref(L, (int)ref);
    return;
  }
  conn_ud *cu = lua_newuserdatauv(L, sizeof *cu, 0);
  cu->c = c;
  cu->drain_ref = LUA_NOREF;
  snprintf(cu->listener, sizeof cu->listener, "%s", tag ? tag : "");
  luaL_setmetatable(L, CONN_MT);
  lua_pushvalue(L, -1);
  dm_httpd_conn_set_data(c, (void *)(intptr_t)dm_ref(L));
}

/* Pushes the request table: {method, target, version, headers, listener, keep_alive,
 * content_length, chunked} and, when with_body, body. */
static void push_request(lua_State *L, const dm_httpd_request *req, int with_body) {
  lua_createtable(L, 0, 10);
  lua_pushstring(L, req->method);
  lua_setfield(L, -2, "method");
  lua_pushstring(L, req->target);
  lua_setfield(L, -2, "target");
  lua_pushfstring(L, "%d.%d", req->http_major, req->http_minor);
  lua_setfield(L, -2, "version");
  if (with_body) {
    lua_pushlstring(L, req->body, req->body_len);
    lua_setfield(L, -2, "body");
  }
  lua_pushstring(L, req->listener);
  lua_setfield(L, -2, "listener");
  lua_pushboolean(L, req->keep_alive);
  lua_setfield(L, -2, "keep_alive");
  lua_pushinteger(L, req->content_length < 0 ? 0 : (lua_Integer)req->content_length);
  lua_setfield(L, -2, "content_length");
  lua_pushboolean(L, req->content_length < 0);
  lua_setfield(L, -2, "chunked");
  lua_createtable(L, 0, (int)req->nheaders); // [.., req, headers]
  char name[256];
  for (size_t i = 0; i < req->nheaders; i++) {
    const dm_httpd_header *h = &req->headers[i];
    size_t n = h->name_len < sizeof name ? h->name_len : sizeof name - 1;
    for (size_t k = 0; k < n; k++) name[k] = (char)tolower((unsigned char)h->name[k]);
    lua_pushlstring(L, name, n);
    lua_pushvalue(L, -1);
    lua_rawget(L, -3); // [.., headers, name, old]
    if (lua_isnil(L, -1)) {
      lua_pop(L, 1);
      lua_pushlstring(L, h->value, h->value_len);
    } else {
      /* a repeated header: values joined with ", " (RFC 9110 5.3) */
      lua_pushliteral(L, ", ");
      lua_pushlstring(L, h->value, h->value_len);
      lua_concat(L, 3);
    }
    lua_rawset(L, -3);
  }
  lua_setfield(L, -2, "headers");
}

static void on_request(void *ud, dm_httpd_conn *c, const dm_httpd_request *req) {
  lserver *ls = ud;
  lua_State *L = dm_rt.L;
  if (!L || ls->req_ref == LUA_NOREF) {
    dm_httpd_respond(c, 503, NULL, 0, "", 0);
    return;
  }
  dm_push_ref(L, ls->req_ref);
  push_conn(L, c, req->listener);
  push_request(L, req, 1);
  if (dm_call(L, 2) != 0) dm_httpd_respond(c, 500, NULL, 0, "", 0); /* no-op when answered */
}

/* A head, before its body is read: the Lua on_head may refuse it with conn:respond(). */
static void on_head(void *ud, dm_httpd_conn *c, const dm_httpd_request *req) {
  lserver *ls = ud;
  lua_State *L = dm_rt.L;
  if (!L || ls->head_ref == LUA_NOREF) return;
  dm_push_ref(L, ls->head_ref);
  push_conn(L, c, req->listener);
  push_request(L, req, 0);
  if (dm_call(L, 2) != 0) dm_httpd_respond(c, 500, NULL, 0, "", 0); /* no-op when answered */
}

static void finish_drain(lua_State *L, conn_ud *cu, int ok) {
  if (cu->drain_ref == LUA_NOREF) return;
  int ref = cu->drain_ref;
  cu->drain_ref = LUA_NOREF;
  dm_push_ref(L, ref);
  dm_unref(L, &ref);
  lua_pushboolean(L, ok);
  dm_call(L, 1);
}

static void on_drain(void *ud, dm_httpd_conn *c) {
  (void)ud;
  lua_State *L = dm_rt.L;
  intptr_t ref = (intptr_t)dm_httpd_conn_data(c);
  if (!L || !ref) return;
  dm_push_ref(L, (int)ref);
  conn_ud *cu = lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (cu) finish_drain(L, cu, 1);
}

static void on_close(void *ud, dm_httpd_conn *c, const char *why) {
  lserver *ls = ud;
  int ref = (int)(intptr_t)dm_httpd_conn_data(c);
  lua_State *L = dm_rt.L;
  if (!ref) return;
  if (!L) {
    dm_unref(NULL, &ref);
    return;
  }
  dm_push_ref(L, ref);
  conn_ud *cu = lua_touserdata(L, -1);
  if (cu) {
    cu->c = NULL;
    finish_drain(L, cu, 0);
  }
  if (ls->close_ref != LUA_NOREF) {
    dm_push_ref(L, ls->close_ref);
    lua_insert(L, -2); // [fn, conn]
    if (why) lua_pushstring(L, why);
    else lua_pushnil(L);
    dm_call(L, 2);
  } else {
    lua_pop(L, 1);
  }
  dm_unref(L, &ref);
}

static void on_closed(void *ud) {
  lserver *ls = ud;
  lua_State *L = dm_rt.L;
  if (L && ls->closed_ref != LUA_NOREF) {
    dm_push_ref(L, ls->closed_ref);
    dm_call(L, 0);
  }
  dm_unref(L, &ls->req_ref);
  dm_unref(L, &ls->close_ref);
  dm_unref(L, &ls->closed_ref);
  dm_unref(L, &ls->self_ref);
  dm_unref(L, &ls->head_ref);
  dm_unref(L, &ls->pool_ref); /* the server is gone: it no longer uses the pool */
  dm_handle_count(-1);
  free(ls);
}

/// core.httpd.new(opts, on_request, on_close[, on_head]) -> server.
/// opts (all optional, in bytes and ms): max_body (4 MiB), max_head (64 KiB), max_output
/// (16 MiB queued per connection before it is cut as a slow reader), max_conns (1024
/// connections at once of the listeners with no max_conns of their own), request_timeout_ms
/// (30000), idle_timeout_ms (120000), head_timeout_ms (a new connection's first request head
/// must be whole within it from accept, else it is closed; 0 = none: idle_timeout_ms until
/// its first byte), max_preauth (default of the listeners' max_preauth; 0 = none), error_body (printf format with
/// one %s for the server's own refusals), error_type (their Content-Type), max_buffered
/// (body bytes all connections may hold while being read: 503 above; 0 = no cap),
/// max_buffered_why (the reason in that 503), pool (a core.httpd.pool shared with other
/// servers, checked beside max_buffered).
/// on_request(conn, req) for every complete request: req = {method, target, version
/// ("1.1"), headers = {lowercased name = value, repeats joined with ", "}, body, listener
/// (the listener's tag), keep_alive, content_length, chunked}. on_head(conn, head), when
/// given, for every request whose head passed the listener's checks, before any body byte
/// is read: head as req without body; conn:respond() there refuses the request (the
/// connection closes after the answer), else the body is read and on_request follows.
/// on_close(conn, why) once per connection that had a head or a request, when it is gone
/// (why nil after an orderly end, else "client closed", "slow reader", "server closing",
/// "timeout"…).
static int l_new(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  dm_httpd_opts o = {0};
  o.max_body = (size_t)dm_opt_count(L, 1, "max_body", 0);
  o.max_head = (size_t)dm_opt_count(L, 1, "max_head", 0);
  o.max_output = (size_t)dm_opt_count(L, 1, "max_output", 0);
  o.max_conns = (size_t)dm_opt_count(L, 1, "max_conns", 0);
  o.request_timeout_ms = (unsigned)dm_opt_count(L, 1, "request_timeout_ms", 0);
  o.idle_timeout_ms = (unsigned)dm_opt_count(L, 1, "idle_timeout_ms", 0);
  o.head_timeout_ms = (unsigned)dm_opt_count(L, 1, "head_timeout_ms", 0);
  o.max_preauth = (size_t)dm_opt_count(L, 1, "max_preauth", 0);
  o.max_buffered = (size_t)dm_opt_count(L, 1, "max_buffered", 0);
  if (!lua_isnoneornil(L, 4)) luaL_checktype(L, 4, LUA_TFUNCTION);
  lua_getfield(L, 1, "max_buffered_why");
  o.max_buffered_why = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  luaL_argcheck(L, !o.max_buffered_why || !strchr(o.max_buffered_why, '"'), 1, "max_buffered_why must hold no quote");
  lua_getfield(L, 1, "pool");
  int pool_idx = lua_gettop(L);
  if (!lua_isnil(L, pool_idx)) o.pool = luaL_checkudata(L, pool_idx, POOL_MT);
  lua_getfield(L, 1, "error_body");
  o.error_body = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_getfield(L, 1, "error_type");
  o.error_type = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  if (o.error_body) {
    /* exactly one %s and no other conversion */
    const char *p = strchr(o.error_body, '%');
    luaL_argcheck(L, p && p[1] == 's' && !strchr(p + 2, '%'), 1, "error_body must hold exactly one %s");
  }
  lserver *ls = calloc(1, sizeof *ls);
  if (!ls) return luaL_error(L, "out of memory");
  ls->req_ref = ls->close_ref = ls->closed_ref = ls->self_ref = ls->head_ref = ls->pool_ref = LUA_NOREF;
  dm_httpd_handler h = {on_request, on_drain, on_close, on_closed, lua_isfunction(L, 4) ? on_head : NULL};
  ls->s = dm_httpd_new(dm_rt.loop, &o, &h, ls);
  if (ls->s && o.pool) {
    lua_pushvalue(L, pool_idx);
    ls->pool_ref = dm_ref(L); /* the pool outlives the server */
  }
  lua_pop(L, 4);
  if (!ls->s) {
    free(ls);
    return luaL_error(L, "out of memory");
  }
  dm_handle_count(1);
  lua_pushvalue(L, 2);
  ls->req_ref = dm_ref(L);
  lua_pushvalue(L, 3);
  ls->close_ref = dm_ref(L);
  if (lua_isfunction(L, 4)) {
    lua_pushvalue(L, 4);
    ls->head_ref = dm_ref(L);
  }
  server_ud *u = lua_newuserdatauv(L, sizeof *u, 0);
  u->ls = ls;
  luaL_setmetatable(L, SERVER_MT);
  lua_pushvalue(L, -1);
  ls->self_ref = dm_ref(L); /* an open server is never collected */
  return 1;
}

static lserver *check_server(lua_State *L) {
  server_ud *u = luaL_checkudata(L, 1, SERVER_MT);
  luaL_argcheck(L, u->ls != NULL, 1, "server is closed");
  return u->ls;
}

/* Reads listener options at index `t` into o; the strings stay on the Lua stack (hosts
 * are kept in the table). Returns the host array (caller frees). */
static const char **listen_opts(lua_State *L, int t, dm_httpd_listen_opts *o) {
  luaL_checktype(L, t, LUA_TTABLE);
  memset(o, 0, sizeof *o);
  lua_getfield(L, t, "tag");
  o->tag = luaL_checkstring(L, -1);
  luaL_argcheck(L, strlen(o->tag) < 64, t, "tag is longer than 63 bytes");
  lua_pop(L, 1);
  lua_getfield(L, t, "token");
  o->token = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_pop(L, 1);
  lua_getfield(L, t, "ipv6_only");
  o->ipv6_only = lua_toboolean(L, -1);
  lua_pop(L, 1);
  lua_getfield(L, t, "max_conns");
  if (!lua_isnil(L, -1)) {
    lua_Integer n = luaL_checkinteger(L, -1);
    luaL_argcheck(L, n >= 0, t, "max_conns must be >= 0");
    o->max_conns = (size_t)n;
  }
  lua_pop(L, 1);
  lua_getfield(L, t, "max_preauth");
  if (!lua_isnil(L, -1)) {
    lua_Integer n = luaL_checkinteger(L, -1);
    luaL_argcheck(L, n >= 0, t, "max_preauth must be >= 0");
    o->max_preauth = (size_t)n;
  }
  lua_pop(L, 1);
  lua_getfield(L, t, "hosts");
  const char **hosts = NULL;
  if (lua_istable(L, -1)) {
    size_t n = lua_rawlen(L, -1);
    hosts = calloc(n + 1, sizeof *hosts);
    if (!hosts) luaL_error(L, "out of memory");
    for (size_t i = 0; i < n; i++) {
      lua_rawgeti(L, -1, (lua_Integer)i + 1);
      hosts[i] = lua_tostring(L, -1);
      lua_pop(L, 1);
      if (!hosts[i]) {
        free(hosts);
        luaL_argerror(L, t, "hosts must be a list of strings");
      }
    }
    o->hosts = hosts;
    o->nhosts = n;
  }
  lua_pop(L, 1);
  return hosts;
}

/// server:listen_tcp(ip, port, lopts) -> bound_port | nil, msg, code. Listens on a numeric
/// IPv4/IPv6 address (port 0 = any free port). lopts: tag (required: the listener's
/// identity, given with each request), token (bearer token required on every request:
/// 401 otherwise), hosts (list of accepted Host names, e.g. {"localhost", "127.0.0.1",
/// "[::1]"}: 421 for another Host, 403 for an Origin naming another host), ipv6_only,
/// max_conns (connections of this listener at once, not counted in the server's max_conns;
/// 503 above; 0/nil = the server's cap), max_preauth (connections that have not yet passed
/// the checks kept at once: a new one past it closes the oldest such; they count against
/// max_conns only once they pass; 0/nil = the server's max_preauth, none when both are 0).
static int l_listen_tcp(lua_State *L) {
  lserver *ls = check_server(L);
  const char *ip = luaL_checkstring(L, 2);
  int port = (int)luaL_checkinteger(L, 3);
  luaL_argcheck(L, port >= 0 && port <= 65535, 3, "port must be 0-65535");
  dm_httpd_listen_opts o;
  const char **hosts = listen_opts(L, 4, &o);
  int bound = 0;
  int r = dm_httpd_listen_tcp(ls->s, ip, port, &o, &bound);
  free(hosts);
  if (r == UV_EINVAL) return dm_fail(L, "listen: not a numeric IP address", "EINVAL");
  if (r) return dm_fail_uv(L, "listen", r);
  lua_pushinteger(L, bound);
  return 1;
}

/// server:listen_unix(path, lopts) -> true | nil, msg, code. Listens on a unix socket
/// created mode 0600 (an old socket file there is replaced; any other file is refused
/// with EEXIST); removed at close. lopts as listen_tcp.
static int l_listen_unix(lua_State *L) {
  lserver *ls = check_server(L);
  const char *path = luaL_checkstring(L, 2);
  dm_httpd_listen_opts o;
  const char **hosts = listen_opts(L, 3, &o);
  int r = dm_httpd_listen_unix(ls->s, path, &o);
  free(hosts);
  if (r == UV_EEXIST) return dm_fail(L, "listen: the path exists and is not a socket", "EEXIST");
  if (r) return dm_fail_uv(L, "listen", r);
  lua_pushboolean(L, 1);
  return 1;
}

/// server:listen_relay(path, lopts) -> true | nil, msg, code. Listens on a unix socket for
/// demesne-init's relay: each connection hands over one TCP socket (SCM_RIGHTS) and hangs
/// up; the handed socket is served as an HTTP connection of this listener (its tag is the
/// caller's identity). lopts and socket file rules as listen_unix.
static int l_listen_relay(lua_State *L) {
  lserver *ls = check_server(L);
  const char *path = luaL_checkstring(L, 2);
  dm_httpd_listen_opts o;
  const char **hosts = listen_opts(L, 3, &o);
  int r = dm_httpd_listen_relay(ls->s, path, &o);
  free(hosts);
  if (r == UV_EEXIST) return dm_fail(L, "listen: the path exists and is not a socket", "EEXIST");
  if (r) return dm_fail_uv(L, "listen", r);
  lua_pushboolean(L, 1);
  return 1;
}

/// server:unlisten(tag) -> integer. Stops the listeners tagged `tag` (socket files
/// removed) and cuts their connections (on_close(conn, "listener closed") for each handed
/// one); the other listeners go on. Returns how many listeners it stopped (0 once closed).
static int l_unlisten(lua_State *L) {
  server_ud *u = luaL_checkudata(L, 1, SERVER_MT);
  const char *tag = luaL_checkstring(L, 2);
  lua_pushinteger(L, u->ls && !u->ls->closed ? dm_httpd_unlisten(u->ls->s, tag) : 0);
  return 1;
}

/// server:connections() -> integer: connections open now (0 once closed).
static int l_connections(lua_State *L) {
  server_ud *u = luaL_checkudata(L, 1, SERVER_MT);
  lua_pushinteger(L, u->ls ? (lua_Integer)dm_httpd_connections(u->ls->s) : 0);
  return 1;
}

/// server:close([callback]) -> nil. Stops listening (socket files removed) and cuts every
/// connection (on_close "server closing" for each); callback() once everything is closed.
/// Idempotent. Also __gc and __close.
static int l_server_close(lua_State *L) {
  server_ud *u = luaL_checkudata(L, 1, SERVER_MT);
  lserver *ls = u->ls;
  if (!ls || ls->closed) return 0;
  ls->closed = 1;
  if (lua_isfunction(L, 2)) {
    lua_pushvalue(L, 2);
    ls->closed_ref = dm_ref(L);
  }
  dm_unref(dm_rt.L ? L : NULL, &ls->self_ref);
  u->ls = NULL;
  dm_httpd_close(ls->s);
  return 0;
}

static conn_ud *check_conn(lua_State *L) { return luaL_checkudata(L, 1, CONN_MT); }

/* Reads a header table at `idx` ({name = value} or {{name, value}, …}) into an array. */
static dm_httpd_header *read_headers(lua_State *L, int idx, size_t *n) {
  *n = 0;
  if (lua_isnoneornil(L, idx)) return NULL;
  luaL_checktype(L, idx, LUA_TTABLE);
  size_t cap = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    cap++;
    lua_pop(L, 1);
  }
  dm_httpd_header *hs = calloc(cap ? cap : 1, sizeof *hs);
  if (!hs) luaL_error(L, "out of memory");
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    dm_httpd_header *h = &hs[*n];
    if (lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TSTRING) {
      h->name = lua_tolstring(L, -2, &h->name_len);
      h->value = lua_tolstring(L, -1, &h->value_len);
    } else if (lua_istable(L, -1)) {
      lua_rawgeti(L, -1, 1);
      lua_rawgeti(L, -2, 2);
      h->name = lua_tolstring(L, -2, &h->name_len);
      h->value = lua_tolstring(L, -1, &h->value_len);
      lua_pop(L, 2); /* the strings stay alive in the table */
    }
    if (!h->name || !h->value) {
      free(hs);
      luaL_argerror(L, idx, "headers must map names to string values");
    }
    (*n)++;
    lua_pop(L, 1);
  }
  return hs;
}

static int closed_fail(lua_State *L) { return dm_fail(L, "the connection is closed", "ECONNRESET"); }

/// conn:respond(status, headers, body) -> true | nil, msg, code. Answers the request in
/// progress with a whole response. headers: {name = value} or a list of {name, value};
/// Content-Length, Transfer-Encoding and Connection are set by the server (naming them, or
/// a CR/LF in a header, raises). Fails with EALREADY when no request is waiting for an
/// answer, ECONNRESET when the connection is gone.
static int l_respond(lua_State *L) {
  conn_ud *cu = check_conn(L);
  int status = (int)luaL_checkinteger(L, 2);
  luaL_argcheck(L, status >= 100 && status <= 599, 2, "status must be 100-599");
  size_t blen = 0;
  const char *body = luaL_optlstring(L, 4, "", &blen);
  size_t n;
  dm_httpd_header *hs = read_headers(L, 3, &n);
  if (!cu->c) {
    free(hs);
    return closed_fail(L);
  }
  int r = dm_httpd_respond(cu->c, status, hs, n, body, blen);
  free(hs);
  if (r == -2)
    return luaL_argerror(L, 3, "a header is malformed or reserved (Content-Length, Transfer-Encoding, Connection)");
  if (r < 0) return dm_fail(L, "no request is waiting for an answer", "EALREADY");
  lua_pushboolean(L, 1);
  return 1;
}

/// conn:start(status, headers) -> true | nil, msg, code. Starts a streamed answer
/// (chunked). Same header rules and failures as respond.
static int l_start(lua_State *L) {
  conn_ud *cu = check_conn(L);
  int status = (int)luaL_checkinteger(L, 2);
  luaL_argcheck(L, status >= 100 && status <= 599, 2, "status must be 100-599");
  size_t n;
  dm_httpd_header *hs = read_headers(L, 3, &n);
  if (!cu->c) {
    free(hs);
    return closed_fail(L);
  }
  int r = dm_httpd_stream_start(cu->c, status, hs, n);
  free(hs);
  if (r == -2)
    return luaL_argerror(L, 3, "a header is malformed or reserved (Content-Length, Transfer-Encoding, Connection)");
  if (r < 0) return dm_fail(L, "no request is waiting for an answer", "EALREADY");
  lua_pushboolean(L, 1);
  return 1;
}

/// conn:write(data) -> true | nil, msg, code. Queues bytes of a streamed answer. When the
/// connection already holds max_output queued bytes it is cut ("slow reader", code
/// ENOBUFS) and on_close follows; ECONNRESET when it is gone, EALREADY with no stream open.
static int l_write(lua_State *L) {
  conn_ud *cu = check_conn(L);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  if (!cu->c) return closed_fail(L);
  if (dm_httpd_stream_write(cu->c, data, len) < 0) {
    return dm_fail(L, "the stream is not open or the client does not read it (slow reader)", "ENOBUFS");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/// conn:finish() -> true | nil, msg, code. Ends a streamed answer; the connection then
/// serves the next request (keep-alive) or closes.
static int l_finish(lua_State *L) {
  conn_ud *cu = check_conn(L);
  if (!cu->c) return closed_fail(L);
  if (dm_httpd_stream_end(cu->c) < 0) return dm_fail(L, "no stream is open", "EALREADY");
  lua_pushboolean(L, 1);
  return 1;
}

/// conn:queued() -> integer: bytes written and not yet taken by the client's socket (0
/// once the connection is gone).
static int l_queued(lua_State *L) {
  conn_ud *cu = check_conn(L);
  lua_pushinteger(L, cu->c ? (lua_Integer)dm_httpd_queued(cu->c) : 0);
  return 1;
}

/// conn:drain(callback) -> boolean. When the queue holds more than max_output / 8 bytes,
/// returns true and calls callback(true) once it falls to that, or callback(false) if the
/// connection goes first. Returns false (and never calls back) when there is nothing to
/// wait for. One callback at a time: while one is pending, fails with EBUSY.
static int l_drain(lua_State *L) {
  conn_ud *cu = check_conn(L);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (!cu->c || !dm_httpd_want_drain(cu->c)) {
    lua_pushboolean(L, 0);
    return 1;
  }
  if (cu->drain_ref != LUA_NOREF) return dm_fail(L, "a drain callback is already pending", "EBUSY");
  lua_pushvalue(L, 2);
  cu->drain_ref = dm_ref(L);
  lua_pushboolean(L, 1);
  return 1;
}

/// conn:close() -> nil. Cuts the connection (on_close follows with "closed by the server").
/// Idempotent.
static int l_conn_close(lua_State *L) {
  conn_ud *cu = check_conn(L);
  if (cu->c) dm_httpd_conn_close(cu->c, "closed by the server");
  return 0;
}

/// conn:is_open() -> boolean.
static int l_is_open(lua_State *L) {
  lua_pushboolean(L, check_conn(L)->c != NULL);
  return 1;
}

/// conn:listener() -> string: the tag of the listener the connection arrived on.
static int l_listener(lua_State *L) {
  lua_pushstring(L, check_conn(L)->listener);
  return 1;
}

/// core.httpd.token_equal(a, b) -> boolean: constant-time comparison (time depends on #b only).
static int l_token_equal(lua_State *L) {
  size_t n;
  const char *a = luaL_checklstring(L, 1, &n);
  const char *b = luaL_checkstring(L, 2);
  lua_pushboolean(L, dm_httpd_token_equal(a, n, b));
  return 1;
}

/// core.httpd.pool(max[, why]) -> pool. A budget of request body bytes being read, shared
/// by the servers given it (opts.pool): past `max` bytes (0 = no cap) the request whose
/// bytes would pass it is answered 503 with `why` (the reason, at most 511 bytes, no `"`).
static int l_pool(lua_State *L) {
  lua_Integer max = luaL_checkinteger(L, 1);
  luaL_argcheck(L, max >= 0, 1, "max must be >= 0");
  size_t wn = 0;
  const char *why = luaL_optlstring(L, 2, "", &wn);
  luaL_argcheck(L, wn < sizeof(((dm_httpd_pool *)0)->why) && !strchr(why, '"'), 2,
                "why must be under 512 bytes with no quote");
  dm_httpd_pool *p = lua_newuserdatauv(L, sizeof *p, 0);
  memset(p, 0, sizeof *p);
  p->max = (size_t)max;
  memcpy(p->why, why, wn + 1);
  luaL_setmetatable(L, POOL_MT);
  return 1;
}

/// pool:set_max(max) -> nil. Changes the cap (bytes; 0 = none) for the bytes read from now on.
static int l_pool_set_max(lua_State *L) {
  dm_httpd_pool *p = luaL_checkudata(L, 1, POOL_MT);
  lua_Integer max = luaL_checkinteger(L, 2);
  luaL_argcheck(L, max >= 0, 2, "max must be >= 0");
  p->max = (size_t)max;
  return 0;
}

/// pool:used() -> integer: body bytes the servers sharing the pool hold now while reading.
static int l_pool_used(lua_State *L) {
  dm_httpd_pool *p = luaL_checkudata(L, 1, POOL_MT);
  lua_pushinteger(L, (lua_Integer)p->used);
  return 1;
}

static const luaL_Reg pool_methods[] = {{"set_max", l_pool_set_max}, {"used", l_pool_used}, {NULL, NULL}};

static const luaL_Reg server_methods[] = {
  {"listen_tcp", l_listen_tcp},
  {"listen_unix", l_listen_unix},
  {"listen_relay", l_listen_relay},
  {"unlisten", l_unlisten},
  {"connections", l_connections},
  {"close", l_server_close},
  {NULL, NULL},
};
static const luaL_Reg conn_methods[] = {
  {"respond", l_respond},   {"start", l_start}, {"write", l_write},      {"finish", l_finish},
  {"queued", l_queued},     {"drain", l_drain}, {"close", l_conn_close}, {"is_open", l_is_open},
  {"listener", l_listener}, {NULL, NULL},
};
static const luaL_Reg funcs[] = {{"new", l_new}, {"pool", l_pool}, {"token_equal", l_token_equal}, {NULL, NULL}};

int luaopen_core_httpd(lua_State *L) {
  dm_metatable(L, SERVER_MT, server_methods, l_server_close, l_server_close);
  dm_metatable(L, CONN_MT, conn_methods, NULL, NULL);
  dm_metatable(L, POOL_MT, pool_methods, NULL, NULL);
  luaL_newlib(L, funcs);
  return 1;
}
