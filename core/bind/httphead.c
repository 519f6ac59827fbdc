/* core.httphead: one HTTP/1.x request head parsed with llhttp, for relays that check the
 * head and then carry the connection's raw bytes (the port previews, lua/sandbox/preview.lua). */
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

static const luaL_Reg funcs[] = {{"parse", l_parse}, {NULL, NULL}};

int luaopen_core_httphead(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
