/* core.proxy: the egress proxy (core/proxy.c) seen from Lua. One listener per sandbox;
 * Lua gives each connection its verdict, C does the rest. */
#include "runtime.h"
#include "bind/bind.h"
#include "proxy.h"
#include <arpa/inet.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LISTENER_MT "core.proxy.listener"
#define CONN_MT "core.proxy.conn"

/* Owned by the engine's lifetime, not by the userdata: freed in on_closed. */
typedef struct lproxy {
  dm_proxy *p;
  int req_ref, done_ref, close_ref, self_ref, refused_ref;
  int closed;
} lproxy;

typedef struct {
  lproxy *lp;
} listener_ud;

typedef struct {
  dm_proxy_conn *c; /* NULL once the connection is done */
} conn_ud;

static const char *form_name(dm_proxy_form f) {
  return f == DM_FORM_CONNECT ? "connect" : f == DM_FORM_ABSOLUTE ? "absolute" : "origin";
}

static void on_request(void *ud, dm_proxy_conn *c, const dm_proxy_request *req) {
  lproxy *lp = ud;
  lua_State *L = dm_rt.L;
  if (!L || lp->req_ref == LUA_NOREF) {
    dm_proxy_deny(c, "the policy is gone");
    return;
  }
  dm_push_ref(L, lp->req_ref);
  conn_ud *cu = lua_newuserdatauv(L, sizeof *cu, 0);
  cu->c = c;
  luaL_setmetatable(L, CONN_MT);
  lua_pushvalue(L, -1);
  intptr_t ref = dm_ref(L);
  dm_proxy_conn_set_data(c, (void *)ref);
  lua_createtable(L, 0, 8); // [fn, conn, req]
  lua_pushstring(L, req->method);
  lua_setfield(L, -2, "method");
  lua_pushstring(L, req->host);
  lua_setfield(L, -2, "host");
  lua_pushinteger(L, req->port);
  lua_setfield(L, -2, "port");
  if (req->ip) {
    lua_pushinteger(L, req->ip);
    lua_setfield(L, -2, "ip");
  }
  lua_pushstring(L, form_name(req->form));
  lua_setfield(L, -2, "form");
  lua_pushstring(L, req->path);
  lua_setfield(L, -2, "path");
  if (req->host_header) {
    lua_pushstring(L, req->host_header);
    lua_setfield(L, -2, "host_header");
  }
  if (dm_call(L, 2) != 0) dm_proxy_deny(c, "the policy failed"); /* no-op when it answered */
}

static void on_done(void *ud, dm_proxy_conn *c, const dm_proxy_result *res) {
  lproxy *lp = ud;
  int ref = (int)(intptr_t)dm_proxy_conn_data(c);
  lua_State *L = dm_rt.L;
  if (!L) {
    dm_unref(NULL, &ref);
    return;
  }
  dm_push_ref(L, ref);
  conn_ud *cu = lua_touserdata(L, -1);
  if (cu) cu->c = NULL;
  if (lp->done_ref == LUA_NOREF) {
    lua_pop(L, 1);
    dm_unref(L, &ref);
    return;
  }
  dm_push_ref(L, lp->done_ref);
  lua_insert(L, -2); // [fn, conn]
  lua_createtable(L, 0, 8);
  lua_pushinteger(L, (lua_Integer)res->bytes_up);
  lua_setfield(L, -2, "bytes_up");
  lua_pushinteger(L, (lua_Integer)res->bytes_down);
  lua_setfield(L, -2, "bytes_down");
  lua_pushinteger(L, res->status);
  lua_setfield(L, -2, "status");
  lua_pushboolean(L, res->denied);
  lua_setfield(L, -2, "denied");
  if (res->rule >= 0) {
    lua_pushinteger(L, res->rule);
    lua_setfield(L, -2, "rule");
  }
  if (res->address && *res->address) {
    lua_pushstring(L, res->address);
    lua_setfield(L, -2, "address");
  }
  if (res->error) {
    lua_pushstring(L, res->error);
    lua_setfield(L, -2, "error");
  }
  if (res->code) {
    lua_pushstring(L, res->code);
    lua_setfield(L, -2, "code");
  }
  if (res->via) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "via");
  }
  dm_call(L, 2);
  dm_unref(L, &ref);
}

static void on_refused(void *ud, const dm_proxy_refusal *r) {
  lproxy *lp = ud;
  lua_State *L = dm_rt.L;
  if (!L || lp->refused_ref == LUA_NOREF) return;
  dm_push_ref(L, lp->refused_ref);
  lua_createtable(L, 0, 5);
  lua_pushstring(L, r->limit);
  lua_setfield(L, -2, "limit");
  lua_pushinteger(L, r->active);
  lua_setfield(L, -2, "active");
  lua_pushinteger(L, r->ceiling);
  lua_setfield(L, -2, "ceiling");
  lua_pushboolean(L, r->answered);
  lua_setfield(L, -2, "answered");
  lua_pushstring(L, r->message);
  lua_setfield(L, -2, "message");
  dm_call(L, 1);
}

static void on_closed(void *ud) {
  lproxy *lp = ud;
  lua_State *L = dm_rt.L;
  if (L && lp->close_ref != LUA_NOREF) {
    dm_push_ref(L, lp->close_ref);
    dm_call(L, 0);
  }
  dm_unref(L, &lp->req_ref);
  dm_unref(L, &lp->done_ref);
  dm_unref(L, &lp->close_ref);
  dm_unref(L, &lp->self_ref);
  dm_unref(L, &lp->refused_ref);
  dm_handle_count(-1);
  free(lp);
}

/// core.proxy.listen(path, opts, on_request, on_done) -> listener | nil, msg, code.
/// Listens on the unix socket `path` (an existing file is replaced). opts: resolver
/// ("ip:port" of a test DNS server; default getaddrinfo), rules (list of {cidr = string,
/// allow = boolean, port = integer|nil, index = integer|nil}: address rules in order),
/// head_timeout_ms, connect_timeout_ms, max_conns (connections at once, default 256), max_fds
/// (descriptors the connections hold, default 1024), ceiling_hint (text added to a refusal),
/// on_refused (function(info) per connection refused for a ceiling, info = {limit =
/// "connections"|"descriptors"|"server", active, ceiling, answered, message}; the sandbox
/// gets a 503 carrying `message` when answered). on_request(conn, req) for each request head, req =
/// {method, host, port, ip = 4|6|nil, form = "connect"|"absolute"|"origin", path,
/// host_header}; the callback answers with conn:allow(), conn:allow_via(host, port, auth) or
/// conn:deny(reason), now or later.
/// on_done(conn, res) once per connection that reached on_request, res = {bytes_up,
/// bytes_down, status, denied, rule, address, error, code, via = true|nil}.
static int l_listen(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  dm_proxy_opts o = {.path = path};
  lua_getfield(L, 2, "resolver");
  o.resolver = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_pop(L, 1); /* the string stays alive in opts */
  o.head_timeout_ms = (unsigned)dm_opt_count(L, 2, "head_timeout_ms", 0);
  o.connect_timeout_ms = (unsigned)dm_opt_count(L, 2, "connect_timeout_ms", 0);
  int max_conns = (int)dm_opt_count(L, 2, "max_conns", 0), max_fds = (int)dm_opt_count(L, 2, "max_fds", 0);
  luaL_argcheck(L, max_conns >= 0 && max_fds >= 0, 2, "max_conns and max_fds must not be negative");
  o.max_conns = (unsigned)max_conns;
  o.max_fds = (unsigned)max_fds;
  lua_getfield(L, 2, "ceiling_hint");
  o.ceiling_hint = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_pop(L, 1); /* the string stays alive in opts */
  lua_getfield(L, 2, "on_refused");
  luaL_argcheck(L, lua_isnil(L, -1) || lua_isfunction(L, -1), 2, "on_refused must be a function");
  lua_pop(L, 1);
  lua_getfield(L, 2, "rules");
  size_t n = lua_istable(L, -1) ? lua_rawlen(L, -1) : 0;
  dm_proxy_rule *rules = n ? calloc(n, sizeof *rules) : NULL;
  if (n && !rules) return luaL_error(L, "out of memory");
  for (size_t i = 0; i < n; i++) {
    lua_rawgeti(L, -1, (lua_Integer)i + 1);
    if (!lua_istable(L, -1)) {
      free(rules);
      return luaL_error(L, "opts.rules[%d]: must be a table", (int)i + 1);
    }
    lua_getfield(L, -1, "cidr");
    const char *cidr = lua_tostring(L, -1);
    if (!cidr || dm_proxy_parse_cidr(cidr, &rules[i]) < 0) {
      free(rules);
      return luaL_error(L, "opts.rules[%d].cidr: not a CIDR", (int)i + 1);
    }
    lua_pop(L, 1);
    lua_getfield(L, -1, "allow");
    rules[i].allow = lua_toboolean(L, -1);
    lua_pop(L, 1);
    /* read without raising: a raise here would leak `rules` */
    lua_getfield(L, -1, "port");
    lua_getfield(L, -2, "index");
    if ((!lua_isnil(L, -2) && (!lua_isinteger(L, -2) || lua_tointeger(L, -2) < 0)) ||
        (!lua_isnil(L, -1) && (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0))) {
      free(rules);
      return luaL_error(L, "opts.rules[%d]: port and index must be non-negative integers", (int)i + 1);
    }
    rules[i].port = lua_isnil(L, -2) ? 0 : (int)lua_tointeger(L, -2);
    rules[i].index = lua_isnil(L, -1) ? (int)i + 1 : (int)lua_tointeger(L, -1);
    lua_pop(L, 3);
  }
  lua_pop(L, 1);
  o.rules = rules;
  o.nrules = n;
  lproxy *lp = calloc(1, sizeof *lp);
  if (!lp) {
    free(rules);
    return luaL_error(L, "out of memory");
  }
  lp->req_ref = lp->done_ref = lp->close_ref = lp->self_ref = lp->refused_ref = LUA_NOREF;
  dm_proxy_handler h = {on_request, on_done, on_closed, on_refused};
  int err = 0;
  lp->p = dm_proxy_new(dm_rt.loop, &o, &h, lp, &err);
  free(rules);
  if (!lp->p) {
    free(lp);
    if (err == UV_EINVAL) return dm_fail(L, "listen: opts.resolver is not ip:port", "EINVAL");
    return dm_fail_uv(L, "listen", err);
  }
  dm_handle_count(1);
  lua_pushvalue(L, 3);
  lp->req_ref = dm_ref(L);
  lua_pushvalue(L, 4);
  lp->done_ref = dm_ref(L);
  lua_getfield(L, 2, "on_refused");
  if (lua_isfunction(L, -1)) lp->refused_ref = dm_ref(L);
  else lua_pop(L, 1);
  listener_ud *u = lua_newuserdatauv(L, sizeof *u, 0);
  u->lp = lp;
  luaL_setmetatable(L, LISTENER_MT);
  lua_pushvalue(L, -1);
  lp->self_ref = dm_ref(L); /* an open listener is never collected */
  return 1;
}

static listener_ud *check_listener(lua_State *L) { return luaL_checkudata(L, 1, LISTENER_MT); }

/// listener:close([callback]) -> nil. Stops listening, removes the socket file and aborts
/// live connections (their on_done still comes, with code "ECANCELED"); callback() once
/// everything is closed. Idempotent (a second callback is not kept). Also __gc.
static int l_listener_close(lua_State *L) {
  listener_ud *u = check_listener(L);
  lproxy *lp = u->lp;
  if (!lp || lp->closed) return 0;
  lp->closed = 1;
  if (lua_isfunction(L, 2)) {
    lua_pushvalue(L, 2);
    lp->close_ref = dm_ref(L);
  }
  dm_unref(dm_rt.L ? L : NULL, &lp->self_ref);
  u->lp = NULL;
  dm_proxy_close(lp->p);
  return 0;
}

/// listener:active() -> integer: live connections (0 once closed).
static int l_listener_active(lua_State *L) {
  listener_ud *u = check_listener(L);
  lua_pushinteger(L, u->lp ? (lua_Integer)dm_proxy_active(u->lp->p) : 0);
  return 1;
}

/// listener:descriptors() -> integer: descriptors its connections hold now (0 once closed).
static int l_listener_descriptors(lua_State *L) {
  listener_ud *u = check_listener(L);
  lua_pushinteger(L, u->lp ? (lua_Integer)dm_proxy_fds(u->lp->p) : 0);
  return 1;
}

/// core.proxy.descriptors() -> held, cap: descriptors the connections of every egress
/// listener hold now, and the most they may hold together (the soft RLIMIT_NOFILE less a
/// reserve kept for the rest of the server).
static int l_descriptors(lua_State *L) {
  size_t cap;
  lua_pushinteger(L, (lua_Integer)dm_proxy_fds_total(&cap));
  lua_pushinteger(L, (lua_Integer)cap);
  return 2;
}

static dm_proxy_conn *check_conn(lua_State *L) {
  conn_ud *cu = luaL_checkudata(L, 1, CONN_MT);
  return cu->c;
}

/// conn:allow() -> boolean: the verdict "allow" (false when the connection is gone or
/// already answered). C resolves the name, checks each address, dials and splices.
static int l_conn_allow(lua_State *L) {
  dm_proxy_conn *c = check_conn(L);
  if (c) dm_proxy_allow(c);
  lua_pushboolean(L, c != NULL);
  return 1;
}

/// conn:allow_via(host, port[, proxy_authorization]) -> boolean: the verdict "allow", sent on
/// through the upstream proxy host:port (the host's own proxy; its addresses are not
/// checked, the target's name is never resolved here), with `proxy_authorization` as the
/// Proxy-Authorization value (e.g. "Basic …"). false when the connection is gone or
/// already answered. See dm_proxy_allow_via.
static int l_conn_allow_via(lua_State *L) {
  dm_proxy_conn *c = check_conn(L);
  const char *host = luaL_checkstring(L, 2);
  lua_Integer port = luaL_checkinteger(L, 3);
  const char *auth = luaL_optstring(L, 4, NULL);
  luaL_argcheck(L, port >= 1 && port <= 65535, 3, "a port from 1 to 65535");
  if (c) dm_proxy_allow_via(c, host, (int)port, auth);
  lua_pushboolean(L, c != NULL);
  return 1;
}

/// conn:hold(ms) -> boolean: keeps a connection waiting for its verdict `ms` more
/// milliseconds (1 to 86400000) before the proxy denies it itself (see dm_proxy_hold).
static int l_conn_hold(lua_State *L) {
  dm_proxy_conn *c = check_conn(L);
  lua_Integer ms = luaL_checkinteger(L, 2);
  luaL_argcheck(L, ms >= 1 && ms <= 86400000, 2, "milliseconds from 1 to 86400000");
  if (c) dm_proxy_hold(c, (unsigned)ms);
  lua_pushboolean(L, c != NULL);
  return 1;
}

/// conn:deny([reason]) -> boolean: the verdict "deny": a 403 carrying `reason`, then close.
static int l_conn_deny(lua_State *L) {
  dm_proxy_conn *c = check_conn(L);
  const char *why = luaL_optstring(L, 2, NULL);
  if (c) dm_proxy_deny(c, why);
  lua_pushboolean(L, c != NULL);
  return 1;
}

/// core.proxy.normalize_host(s) -> host, ip | nil, msg, "EINVAL". The proxy's own
/// normalisation (lowercase, trailing dot, IPv4 spellings); ip is 0, 4 or 6.
static int l_normalize_host(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  char out[DM_PROXY_HOST_MAX];
  int ip;
  const char *why;
  if (dm_proxy_normalize_host(s, len, out, sizeof out, &ip, &why) < 0) return dm_fail(L, why, "EINVAL");
  lua_pushstring(L, out);
  lua_pushinteger(L, ip);
  return 2;
}

/// core.proxy.split_authority(s [, default_port]) -> host, port, ip | nil, msg, "EINVAL".
/// "host[:port]" or "[v6]:port"; without default_port the port is required.
static int l_split_authority(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  int def = (int)luaL_optinteger(L, 2, -1);
  char host[DM_PROXY_HOST_MAX];
  int port, ip;
  const char *why;
  if (dm_proxy_split_authority(s, len, def, host, sizeof host, &port, &ip, &why) < 0) return dm_fail(L, why, "EINVAL");
  lua_pushstring(L, host);
  lua_pushinteger(L, port);
  lua_pushinteger(L, ip);
  return 3;
}

static int to_sockaddr(const char *ip, struct sockaddr_storage *a) {
  memset(a, 0, sizeof *a);
  if (inet_pton(AF_INET, ip, &((struct sockaddr_in *)a)->sin_addr) == 1) {
    a->ss_family = AF_INET;
    return 0;
  }
  if (inet_pton(AF_INET6, ip, &((struct sockaddr_in6 *)a)->sin6_addr) == 1) {
    a->ss_family = AF_INET6;
    return 0;
  }
  return -1;
}

/// core.proxy.classify(ip) -> class | nil, msg, "EINVAL": "public", "loopback", "private",
/// "link-local", "metadata", "shared", "unspecified", "multicast", "broadcast", "reserved"
/// or "ipv6".
static int l_classify(lua_State *L) {
  struct sockaddr_storage a;
  if (to_sockaddr(luaL_checkstring(L, 1), &a) < 0) return dm_fail(L, "not an IP address", "EINVAL");
  lua_pushstring(L, dm_proxy_classify((struct sockaddr *)&a));
  return 1;
}

/// core.proxy.match_cidr(cidr, ip) -> boolean | nil, msg, "EINVAL". With ip omitted, only
/// checks that cidr parses (true or nil, msg).
static int l_match_cidr(lua_State *L) {
  dm_proxy_rule r = {0};
  if (dm_proxy_parse_cidr(luaL_checkstring(L, 1), &r) < 0)
    return dm_fail(L, "not a CIDR (a.b.c.d/n or v6/n)", "EINVAL");
  if (lua_isnoneornil(L, 2)) {
    lua_pushboolean(L, 1);
    return 1;
  }
  struct sockaddr_storage a;
  if (to_sockaddr(luaL_checkstring(L, 2), &a) < 0) return dm_fail(L, "not an IP address", "EINVAL");
  r.allow = 1;
  const char *why;
  int rule;
  int ok = dm_proxy_check_address((struct sockaddr *)&a, 0, &r, 1, &why, &rule);
  lua_pushboolean(L, ok && rule >= 0);
  return 1;
}

static const luaL_Reg listener_methods[] = {
  {"close", l_listener_close}, {"active", l_listener_active}, {"descriptors", l_listener_descriptors}, {NULL, NULL}};
static const luaL_Reg conn_methods[] = {
  {"allow", l_conn_allow}, {"allow_via", l_conn_allow_via}, {"deny", l_conn_deny}, {"hold", l_conn_hold}, {NULL, NULL}};
static const luaL_Reg funcs[] = {
  {"listen", l_listen},
  {"normalize_host", l_normalize_host},
  {"split_authority", l_split_authority},
  {"classify", l_classify},
  {"match_cidr", l_match_cidr},
  {"descriptors", l_descriptors},
  {NULL, NULL},
};

int luaopen_core_proxy(lua_State *L) {
  dm_metatable(L, LISTENER_MT, listener_methods, l_listener_close, l_listener_close);
  dm_metatable(L, CONN_MT, conn_methods, NULL, NULL);
  lua_pushinteger(L, DM_PROXY_PORT);
  luaL_newlib(L, funcs);
  lua_insert(L, -2);
  lua_setfield(L, -2, "PORT");
  return 1;
}
