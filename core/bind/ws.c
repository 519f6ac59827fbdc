/* core.ws: WebSocket client connections on the loop (the engine is core/ws.c; this file
 * translates). */
#include "runtime.h"
#include "bind/bind.h"
#include "ws.h"
#include "ws_frame.h"
#include <string.h>

#define WS_MT "core.ws.conn"

/* The `core.ws.conn` userdata. It holds no ref to itself: a connection nobody references
 * is collected and its socket closed without a close handshake. */
typedef struct {
  dm_ws *ws; /* NULL once ended or discarded */
  int cb_ref;
} lws;

typedef struct {
  lws *lw;
  const char *kind;
  const char *s; /* protocol, data, reason or message */
  size_t len;
  int n;            /* binary flag or close code */
  const char *code; /* error code */
  long status;
} deliver;

static void release(lws *lw) {
  if (lw->ws) dm_handle_count(-1);
  lw->ws = NULL;
  dm_unref(dm_rt.L, &lw->cb_ref);
}

/* [] -> []: on_event(kind, ...), inside dm_call (so allocation errors are caught) */
static int p_event(lua_State *L) {
  deliver *d = lua_touserdata(L, 1);
  dm_push_ref(L, d->lw->cb_ref);
  lua_pushstring(L, d->kind);
  int n = 1;
  if (!strcmp(d->kind, "open")) {
    lua_pushstring(L, d->s);
    n = 2;
  } else if (!strcmp(d->kind, "message")) {
    lua_pushlstring(L, d->s, d->len);
    lua_pushstring(L, d->n ? "binary" : "text");
    n = 3;
  } else if (!strcmp(d->kind, "close")) {
    lua_pushinteger(L, d->n);
    lua_pushlstring(L, d->s, d->len);
    n = 3;
  } else {
    lua_pushstring(L, d->s);
    lua_pushstring(L, d->code);
    if (d->status) lua_pushinteger(L, d->status);
    else lua_pushnil(L);
    n = 4;
  }
  lua_call(L, n, 0);
  return 0;
}

static void emit(deliver *d) {
  lua_State *L = dm_rt.L;
  if (!L || d->lw->cb_ref == LUA_NOREF) return;
  lua_pushcfunction(L, p_event);
  lua_pushlightuserdata(L, d);
  dm_call(L, 1);
}

static void on_open(void *ud, dm_ws *ws, const char *protocol) {
  (void)ws;
  deliver d = {.lw = ud, .kind = "open", .s = protocol};
  emit(&d);
}

static void on_message(void *ud, dm_ws *ws, const uint8_t *data, size_t len, int binary) {
  (void)ws;
  deliver d = {.lw = ud, .kind = "message", .s = (const char *)data, .len = len, .n = binary};
  emit(&d);
}

static void on_close(void *ud, dm_ws *ws, int code, const char *reason, size_t len) {
  (void)ws;
  lws *lw = ud;
  dm_handle_count(-1);
  lw->ws = NULL; /* the engine frees it after this returns */
  deliver d = {.lw = lw, .kind = "close", .s = reason, .len = len, .n = code};
  emit(&d);
  release(lw);
}

static void on_error(void *ud, dm_ws *ws, const dm_ws_err *err) {
  (void)ws;
  lws *lw = ud;
  dm_handle_count(-1);
  lw->ws = NULL;
  deliver d = {.lw = lw, .kind = "error", .s = err->msg, .code = err->code, .status = err->status};
  emit(&d);
  release(lw);
}

static const dm_ws_handler handler = {on_open, on_message, on_close, on_error};

/* [opts, ...] -> [..., value]: an optional string field (left on the stack: anchored) */
static const char *opt_string(lua_State *L, const char *k, size_t *len) {
  int t = lua_getfield(L, 1, k);
  if (t == LUA_TNIL) return NULL;
  if (t != LUA_TSTRING) luaL_argerror(L, 1, lua_pushfstring(L, "field '%s' must be a string", k));
  return lua_tolstring(L, -1, len);
}

/* [opts, ...] -> [..., list]: the strings of a list field, or of a list of pairs
 * ({{name, value}, ...}: `pairs` = 1), into an array allocated as a userdata (anchored). */
static size_t opt_list(lua_State *L, const char *k, int pairs, const char ***out) {
  *out = NULL;
  int t = lua_getfield(L, 1, k);
  if (t == LUA_TNIL) return 0;
  if (t != LUA_TTABLE) luaL_argerror(L, 1, lua_pushfstring(L, "field '%s' must be a list", k));
  int list = lua_gettop(L); /* stays on the stack: it anchors the strings */
  size_t n = (size_t)luaL_len(L, list), w = pairs ? 2 : 1;
  const char **a = lua_newuserdatauv(L, (n * w + 1) * sizeof *a, 0); /* [.., list, array] */
  for (size_t i = 0; i < n; i++) {
    lua_geti(L, list, (lua_Integer)i + 1); /* [.., list, array, item] */
    if (pairs && lua_type(L, -1) != LUA_TTABLE)
      luaL_argerror(L, 1, lua_pushfstring(L, "%s[%d] must be {name, value}", k, (int)i + 1));
    for (size_t j = 0; j < w; j++) {
      if (pairs) lua_geti(L, -1, (lua_Integer)j + 1); /* [.., item, string] */
      if (lua_type(L, -1) != LUA_TSTRING)
        luaL_argerror(L, 1, lua_pushfstring(L, "%s[%d] must hold strings", k, (int)i + 1));
      a[i * w + j] = lua_tostring(L, -1); /* anchored by the list */
      if (pairs) lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  *out = a;
  return n;
}

static int l_connect(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);
  luaL_checkstack(L, 20, NULL);
  dm_ws_opts o = {0};
  o.url = opt_string(L, "url", NULL);
  if (!o.url) return luaL_argerror(L, 1, "field 'url' is required");
  const char **hs, **ps;
  size_t nh = opt_list(L, "headers", 1, &hs);
  o.nprotocols = opt_list(L, "protocols", 0, &ps);
  o.protocols = ps;
  dm_ws_header *headers = lua_newuserdatauv(L, (nh + 1) * sizeof *headers, 0);
  for (size_t i = 0; i < nh; i++) headers[i] = (dm_ws_header){hs[2 * i], hs[2 * i + 1]};
  o.headers = headers;
  o.nheaders = nh;
  o.ca_pem = opt_string(L, "ca_pem", &o.ca_len);
  o.cert_pem = opt_string(L, "cert_pem", &o.cert_len);
  o.key_pem = opt_string(L, "key_pem", &o.key_len);
  o.timeout_ms = (long)dm_opt_count(L, 1, "timeout_ms", 0);
  o.close_timeout_ms = (long)dm_opt_count(L, 1, "close_timeout_ms", 0);
  o.max_message = (uint64_t)dm_opt_count(L, 1, "max_message", 0);
  lws *lw = lua_newuserdatauv(L, sizeof *lw, 0);
  lw->ws = NULL;
  lw->cb_ref = LUA_NOREF;
  luaL_setmetatable(L, WS_MT);
  dm_ws_err err;
  dm_ws *ws = dm_ws_connect(dm_rt.loop, &o, &handler, lw, &err);
  if (!ws) return dm_fail(L, err.msg, err.code);
  lw->ws = ws;
  dm_handle_count(1);
  lua_pushvalue(L, 2);
  lw->cb_ref = dm_ref(L);
  return 1; /* the userdata, on top */
}

static lws *check_ws(lua_State *L) { return luaL_checkudata(L, 1, WS_MT); }

static int l_send(lua_State *L) {
  lws *lw = check_ws(L);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  static const char *const kinds[] = {"text", "binary", NULL};
  int binary = luaL_checkoption(L, 3, "binary", kinds);
  if (!lw->ws) return dm_fail(L, "ws: closed", "ECLOSED");
  dm_ws_err err;
  if (dm_ws_send(lw->ws, (const uint8_t *)data, len, binary, &err) < 0) return dm_fail(L, err.msg, err.code);
  lua_pushboolean(L, 1);
  return 1;
}

static int l_close(lua_State *L) {
  lws *lw = check_ws(L);
  lua_Integer code = luaL_optinteger(L, 2, DM_WS_CLOSE_NORMAL);
  size_t len = 0;
  const char *reason = luaL_optlstring(L, 3, "", &len);
  if (code != 0 && !dm_ws_close_code_valid((int)code))
    return luaL_argerror(L, 2, "not a close code one may send (RFC 6455 7.4: 1000-1003, 1007-1014, 3000-4999)");
  if (len > 123) return luaL_argerror(L, 3, "a close reason holds at most 123 bytes (RFC 6455 5.5)");
  if (lw->ws) dm_ws_close(lw->ws, (int)code, reason, len);
  return 0;
}

static int l_queued(lua_State *L) {
  lws *lw = check_ws(L);
  lua_pushinteger(L, lw->ws ? (lua_Integer)dm_ws_queued(lw->ws) : 0);
  return 1;
}

static int l_is_open(lua_State *L) {
  lws *lw = check_ws(L);
  lua_pushboolean(L, lw->ws != NULL);
  return 1;
}

/* __gc and __close: the connection ends silently. */
static int l_gc(lua_State *L) {
  lws *lw = check_ws(L);
  if (lw->ws) dm_ws_discard(lw->ws);
  release(lw);
  return 0;
}

static const luaL_Reg methods[] = {
  {"send", l_send}, {"close", l_close}, {"queued", l_queued}, {"is_open", l_is_open}, {NULL, NULL},
};

static const luaL_Reg funcs[] = {{"connect", l_connect}, {NULL, NULL}};

int luaopen_core_ws(lua_State *L) {
  dm_metatable(L, WS_MT, methods, l_gc, l_gc);
  luaL_newlib(L, funcs);
  return 1;
}
