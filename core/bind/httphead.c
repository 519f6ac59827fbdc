/* core.httphead: HTTP/1.x request heads parsed with llhttp, for relays that check each
 * request's head and carry the connection's raw bytes (the port previews,
 * lua/sandbox/preview.lua): parse() reads one head, stream() finds where each request of a
 * keep-alive connection ends (Content-Length, chunked, an upgrade) so the next head can be
 * checked before it is carried. */
#include "runtime.h"
#include "bind/bind.h"
#include <llhttp.h>
#include <string.h>

#define HEAD_HEADERS_MAX 128

typedef struct {
  const char *url;
  size_t url_len;
  const char *name[HEAD_HEADERS_MAX], *value[HEAD_HEADERS_MAX];
  size_t name_len[HEAD_HEADERS_MAX], value_len[HEAD_HEADERS_MAX];
  int n;        /* headers seen (the one being read is n - 1) */
  int in_value; /* the last callback was a value */
  int too_many; /* more than HEAD_HEADERS_MAX headers */
  int complete; /* on_headers_complete ran */
} head_state;

/* llhttp gives a span in pieces only across llhttp_execute calls; one call over one buffer
 * gives contiguous pieces, so a span grows by its length. */
static int on_url(llhttp_t *p, const char *at, size_t len) {
  head_state *h = p->data;
  if (!h->url) h->url = at;
  h->url_len += len;
  return 0;
}

static int on_field(llhttp_t *p, const char *at, size_t len) {
  head_state *h = p->data;
  if (h->n == 0 || h->in_value) {
    if (h->n == HEAD_HEADERS_MAX) {
      h->too_many = 1;
      return HPE_USER;
    }
    h->name[h->n] = at;
    h->name_len[h->n] = 0;
    h->value[h->n] = at + len;
    h->value_len[h->n] = 0;
    h->n++;
    h->in_value = 0;
  }
  h->name_len[h->n - 1] += len;
  return 0;
}

static int on_value(llhttp_t *p, const char *at, size_t len) {
  head_state *h = p->data;
  if (h->n == 0) return 0;
  if (!h->in_value) h->value[h->n - 1] = at;
  h->in_value = 1;
  h->value_len[h->n - 1] += len;
  return 0;
}

static int on_headers_complete(llhttp_t *p) {
  ((head_state *)p->data)->complete = 1;
  return HPE_PAUSED;
}

/* core.httphead.parse(bytes): the request head at the start of `bytes`.
 * Returns {method, target, version ("1.1"), headers = {{name (lower case), value}, …},
 * upgrade (boolean: Connection: upgrade with an Upgrade header), length (bytes of the head)};
 * nil, "incomplete", "EAGAIN" when the head has not ended yet; nil, msg, "EPROTO" when it
 * is not a well-formed HTTP/1.x request head (or has more than 128 headers). */
static int l_parse(lua_State *L) {
  size_t len;
  const char *data = luaL_checklstring(L, 1, &len);
  llhttp_settings_t settings;
  llhttp_settings_init(&settings);
  settings.on_url = on_url;
  settings.on_header_field = on_field;
  settings.on_header_value = on_value;
  settings.on_headers_complete = on_headers_complete;
  llhttp_t parser;
  llhttp_init(&parser, HTTP_REQUEST, &settings);
  head_state h;
  memset(&h, 0, sizeof h);
  parser.data = &h;
  llhttp_errno_t e = llhttp_execute(&parser, data, len);
  if (h.too_many) return dm_fail(L, "the request has more than 128 headers", "EPROTO");
  if (e == HPE_OK && !h.complete) return dm_fail(L, "incomplete", "EAGAIN");
  if (e != HPE_PAUSED || !h.complete) {
    const char *reason = llhttp_get_error_reason(&parser);
    return dm_fail(L, reason ? reason : llhttp_errno_name(e), "EPROTO");
  }
  size_t used = (size_t)(llhttp_get_error_pos(&parser) - data);
  lua_createtable(L, 0, 6);
  lua_pushstring(L, llhttp_method_name((llhttp_method_t)parser.method));
  lua_setfield(L, -2, "method");
  lua_pushlstring(L, h.url ? h.url : "", h.url_len);
  lua_setfield(L, -2, "target");
  lua_pushfstring(L, "%d.%d", (int)parser.http_major, (int)parser.http_minor);
  lua_setfield(L, -2, "version");
  lua_createtable(L, h.n, 0);
  for (int i = 0; i < h.n; i++) {
    lua_createtable(L, 2, 0);
    luaL_Buffer b;
    char *lower = luaL_buffinitsize(L, &b, h.name_len[i]);
    for (size_t k = 0; k < h.name_len[i]; k++) {
      char c = h.name[i][k];
      lower[k] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
    }
    luaL_pushresultsize(&b, h.name_len[i]);
    lua_rawseti(L, -2, 1);
    lua_pushlstring(L, h.value[i], h.value_len[i]);
    lua_rawseti(L, -2, 2);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "headers");
  lua_pushboolean(L, parser.upgrade);
  lua_setfield(L, -2, "upgrade");
  lua_pushinteger(L, (lua_Integer)used);
  lua_setfield(L, -2, "length");
  return 1;
}

/* The requests of one connection, fed in order: llhttp keeps its place across calls and
 * pauses at the end of each request (or at an upgrade) so the caller learns the boundary. */
#define STREAM_MT "core.httphead.stream"

typedef struct {
  llhttp_t parser;
  llhttp_settings_t settings;
  int ended; /* on_message_complete ran in this call */
  int upgraded;
  int failed;
} head_stream;

static int on_message_complete(llhttp_t *p) {
  if (p->upgrade) return 0; /* llhttp then stops with HPE_PAUSED_UPGRADE */
  ((head_stream *)p->data)->ended = 1;
  return HPE_PAUSED;
}

/* core.httphead.stream(): a parser of the requests of one connection. */
static int l_stream(lua_State *L) {
  head_stream *s = lua_newuserdatauv(L, sizeof *s, 0);
  memset(s, 0, sizeof *s);
  llhttp_settings_init(&s->settings);
  s->settings.on_message_complete = on_message_complete;
  llhttp_init(&s->parser, HTTP_REQUEST, &s->settings);
  s->parser.data = s;
  luaL_setmetatable(L, STREAM_MT);
  return 1;
}

/* stream:execute(bytes): reads `bytes`, the next bytes of the connection from the client.
 * Returns n, state: n bytes of `bytes` were read, and state is "more" (all of them, the
 * request not ended yet), "ended" (a request ended after n bytes: the next byte starts the
 * next request's head, which the caller checks before it feeds it), or "upgraded" (a
 * request asked for an upgrade and its head ended after n bytes: what follows is another
 * protocol, not HTTP). nil, msg, "EPROTO" when the bytes are not well-formed HTTP/1.x
 * requests; after that, or after "upgraded", every call fails the same way. */
static int l_stream_execute(lua_State *L) {
  head_stream *s = luaL_checkudata(L, 1, STREAM_MT);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  if (s->failed || s->upgraded) return dm_fail(L, "the connection is no longer HTTP/1.x requests", "EPROTO");
  if (llhttp_get_errno(&s->parser) == HPE_PAUSED) llhttp_resume(&s->parser);
  s->ended = 0;
  llhttp_errno_t e = llhttp_execute(&s->parser, data, len);
  if (e == HPE_OK) {
    lua_pushinteger(L, (lua_Integer)len);
    lua_pushliteral(L, "more");
    return 2;
  }
  if (e == HPE_PAUSED && s->ended) {
    lua_pushinteger(L, (lua_Integer)(llhttp_get_error_pos(&s->parser) - data));
    lua_pushliteral(L, "ended");
    return 2;
  }
  if (e == HPE_PAUSED_UPGRADE) {
    s->upgraded = 1;
    lua_pushinteger(L, (lua_Integer)(llhttp_get_error_pos(&s->parser) - data));
    lua_pushliteral(L, "upgraded");
    return 2;
  }
  s->failed = 1;
  const char *reason = llhttp_get_error_reason(&s->parser);
  return dm_fail(L, reason ? reason : llhttp_errno_name(e), "EPROTO");
}

static const luaL_Reg stream_methods[] = {{"execute", l_stream_execute}, {NULL, NULL}};

static const luaL_Reg funcs[] = {{"parse", l_parse}, {"stream", l_stream}, {NULL, NULL}};

int luaopen_core_httphead(lua_State *L) {
  dm_metatable(L, STREAM_MT, stream_methods, NULL, NULL);
  luaL_newlib(L, funcs);
  return 1;
}
