/* core.text: byte-level text helpers that would be slow in Lua. */
#include <openssl/evp.h>
#include "runtime.h"
#include "bind/bind.h"
#include <stdio.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if invalid (RFC 3629: no overlongs,
 * no surrogates, max U+10FFFF). */
static size_t utf8_seq(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c == 0xE0) {
    len = 3;
    lo = 0xA0;
  } else if (c >= 0xE1 && c <= 0xEC) len = 3;
  else if (c == 0xED) {
    len = 3;
    hi = 0x9F;
  } else if (c >= 0xEE && c <= 0xEF) len = 3;
  else if (c == 0xF0) {
    len = 4;
    lo = 0x90;
  } else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else if (c == 0xF4) {
    len = 4;
    hi = 0x8F;
  } else return 0;
  if (n < len) return 0;
  if (s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < len; i++)
    if (s[i] < 0x80 || s[i] > 0xBF) return 0;
  return len;
}

/// core.text.utf8_clean(s) -> string, replaced. Returns `s` with every byte that is not
/// part of a valid UTF-8 sequence replaced by U+FFFD, and the number of replacements.
static int l_utf8_clean(lua_State *L) {
  size_t n;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
  size_t i = 0, bad = 0;
  while (i < n) {
    size_t k = utf8_seq(s + i, n - i);
    if (!k) break;
    i += k;
  }
  if (i == n) {
    lua_settop(L, 1);
    lua_pushinteger(L, 0);
    return 2;
  }
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addlstring(&b, (const char *)s, i);
  while (i < n) {
    size_t k = utf8_seq(s + i, n - i);
    if (k) {
      luaL_addlstring(&b, (const char *)s + i, k);
      i += k;
    } else {
      luaL_addstring(&b, "\xEF\xBF\xBD");
      bad++;
      i++;
    }
  }
  luaL_pushresult(&b);
  lua_pushinteger(L, (lua_Integer)bad);
  return 2;
}

/// core.text.utf8_floor(s, i) -> integer: the largest j <= i (0 <= i <= #s) such that
/// s[1..j] does not end inside a multi-byte sequence; cut there to keep whole code points
/// at the head of a string. Bytes that are not UTF-8 are cut where asked.
static int l_utf8_floor(lua_State *L) {
  size_t n;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
  lua_Integer i = luaL_checkinteger(L, 2);
  if (i > (lua_Integer)n) i = (lua_Integer)n;
  if (i <= 0) {
    lua_pushinteger(L, 0);
    return 1;
  }
  /* find the lead byte of the sequence holding byte i (1-based) */
  lua_Integer k = i;
  while (k > 1 && i - k < 3 && (s[k - 1] & 0xC0) == 0x80) k--;
  unsigned char c = s[k - 1];
  lua_Integer len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (len == 0 || (c & 0xC0) == 0x80 || k + len - 1 <= i) lua_pushinteger(L, i);
  else lua_pushinteger(L, k - 1); /* incomplete: drop the partial sequence */
  return 1;
}

/// core.text.utf8_ceil(s, i) -> integer: the smallest j >= i (1-based) such that s[j..]
/// starts on a code-point boundary; cut there to keep whole code points at the tail.
static int l_utf8_ceil(lua_State *L) {
  size_t n;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
  lua_Integer i = luaL_checkinteger(L, 2);
  if (i < 1) i = 1;
  lua_Integer j = i, steps = 0;
  while (j <= (lua_Integer)n && (s[j - 1] & 0xC0) == 0x80 && steps < 3) {
    j++;
    steps++;
  }
  if (j <= (lua_Integer)n && (s[j - 1] & 0xC0) == 0x80) j = i;
  lua_pushinteger(L, j);
  return 1;
}

/// core.text.last_lines(s, n) -> integer: the 1-based position where the last `n` lines of
/// `s` start (lines end at "\n"; a final line break does not start another line), or 1
/// when `s` has `n` lines or fewer. Lets a reader of a file a sandbox writes take its last
/// lines without splitting all of them first.
static int l_last_lines(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  lua_Integer n = luaL_checkinteger(L, 2);
  size_t end = len;
  if (end > 0 && s[end - 1] == '\n') end--;
  size_t pos = 0; /* 0-based start of the last lines */
  if (n <= 0) {
    pos = len;
  } else {
    lua_Integer seen = 0;
    size_t i = end;
    while (i > 0) {
      if (s[i - 1] == '\n' && ++seen == n) {
        pos = i;
        break;
      }
      i--;
    }
  }
  lua_pushinteger(L, (lua_Integer)pos + 1);
  return 1;
}

/// core.text.sha256(s) -> string: the SHA-256 digest of `s` (FIPS 180-4, by OpenSSL's
/// libcrypto), 64 lower-case hex digits: an OCI content digest without its "sha256:".
static int l_sha256(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(s, n, md, &len, EVP_sha256(), NULL) != 1 || len != 32)
    return luaL_error(L, "sha256: libcrypto failed");
  char out[65];
  for (unsigned int i = 0; i < len; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
  lua_pushlstring(L, out, 64);
  return 1;
}

/// core.text.hash(s) -> string: 16 hex digits of the 64-bit FNV-1a hash of `s`.
/// A cache key (image build contexts), not a cryptographic digest.
static int l_hash(lua_State *L) {
  size_t n;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
  unsigned long long h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    h ^= s[i];
    h *= 1099511628211ULL;
  }
  char out[17];
  snprintf(out, sizeof out, "%016llx", h);
  lua_pushstring(L, out);
  return 1;
}


/* ---- json_raw: the raw text of a member of a JSON object ------------------------------ */

static const char *ws(const char *p, const char *e) {
  while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
  return p;
}

/* p at '"': returns the byte after the closing quote, or NULL. */
static const char *skip_string(const char *p, const char *e) {
  p++;
  while (p < e) {
    const char *q = memchr(p, '"', (size_t)(e - p));
    if (!q) return NULL;
    /* count the backslashes before the quote */
    const char *b = q;
    while (b > p && b[-1] == '\\') b--;
    if (((q - b) & 1) == 0) return q + 1;
    p = q + 1;
  }
  return NULL;
}

/* Returns the byte after the value at p, or NULL when malformed. */
static const char *skip_value(const char *p, const char *e) {
  if (p >= e) return NULL;
  if (*p == '"') return skip_string(p, e);
  if (*p == '{' || *p == '[') {
    size_t depth = 0;
    while (p < e) {
      char c = *p;
      if (c == '"') {
        p = skip_string(p, e);
        if (!p) return NULL;
        continue;
      }
      if (c == '{' || c == '[') depth++;
      else if (c == '}' || c == ']') {
        if (--depth == 0) return p + 1;
      }
      p++;
    }
    return NULL;
  }
  const char *s = p;
  while (p < e && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') p++;
  return p > s ? p : NULL;
}

/* Does the string token [s, t) (quotes included) spell `key`? Escapes of ASCII characters
 * are decoded; a key needing any other escape never matches. */
static int key_is(const char *s, const char *t, const char *key) {
  const char *p = s + 1, *end = t - 1;
  size_t k = 0, kn = strlen(key);
  while (p < end) {
    char c = *p++;
    if (c == '\\') {
      if (p >= end) return 0;
      char x = *p++;
      if (x == 'u') {
        if (end - p < 4) return 0;
        unsigned v = 0;
        for (int i = 0; i < 4; i++) {
          char h = p[i];
          v = v * 16 + (unsigned)(h >= '0' && h <= '9'   ? h - '0'
                                  : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                  : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                         : 99);
        }
        if (v > 127) return 0;
        c = (char)v;
        p += 4;
      } else {
        c = x == 'n' ? '\n' : x == 't' ? '\t' : x == 'r' ? '\r' : x == 'b' ? '\b' : x == 'f' ? '\f' : x;
      }
    }
    if (k >= kn || key[k] != c) return 0;
    k++;
  }
  return k == kn;
}

/* In the object at p, finds the LAST member named key (as lua-cjson keeps the last of
 * duplicates). Sets [*vs, *ve) and returns 1, or returns 0. */
static int find_member(const char *p, const char *e, const char *key, const char **vs, const char **ve) {
  p = ws(p, e);
  if (p >= e || *p != '{') return 0;
  p = ws(p + 1, e);
  int found = 0;
  if (p < e && *p == '}') return 0;
  while (p < e) {
    if (*p != '"') return found;
    const char *ks = p;
    p = skip_string(p, e);
    if (!p) return found;
    int match = key_is(ks, p, key);
    p = ws(p, e);
    if (p >= e || *p != ':') return found;
    p = ws(p + 1, e);
    const char *v = p;
    p = skip_value(p, e);
    if (!p) return found;
    if (match) {
      *vs = v;
      *ve = p;
      found = 1;
    }
    p = ws(p, e);
    if (p >= e || *p != ',') return found;
    p = ws(p + 1, e);
  }
  return found;
}

/// core.text.json_raw(s, key1 [, key2 …]) -> string | nil. The exact text of a member's
/// value in the JSON object `s` (`key2` inside the object that `key1` holds…), as sent:
/// `9007199254740993` stays those digits, a string keeps its quotes and escapes. Of
/// duplicate keys the last counts (as lua-cjson decodes). nil when absent or malformed.
/// Used for JSON-RPC ids, which must go back exactly as they came (lua-cjson decodes every
/// number to a double).
static int l_json_raw(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  int nkeys = lua_gettop(L) - 1;
  luaL_argcheck(L, nkeys >= 1, 2, "at least one key");
  const char *p = s, *e = s + n, *vs = NULL, *ve = NULL;
  for (int i = 0; i < nkeys; i++) {
    if (!find_member(p, e, luaL_checkstring(L, i + 2), &vs, &ve)) {
      lua_pushnil(L);
      return 1;
    }
    p = vs;
    e = ve;
  }
  lua_pushlstring(L, vs, (size_t)(ve - vs));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"hash", l_hash},
  {"sha256", l_sha256},
  {"json_raw", l_json_raw},
  {"utf8_clean", l_utf8_clean},
  {"utf8_floor", l_utf8_floor},
  {"utf8_ceil", l_utf8_ceil},
  {"last_lines", l_last_lines},
  {NULL, NULL},
};

int luaopen_core_text(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
