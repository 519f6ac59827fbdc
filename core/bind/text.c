/* core.text: byte-level text helpers that would be slow in Lua. */
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
  else if (c == 0xE0) { len = 3; lo = 0xA0; }
  else if (c >= 0xE1 && c <= 0xEC) len = 3;
  else if (c == 0xED) { len = 3; hi = 0x9F; }
  else if (c >= 0xEE && c <= 0xEF) len = 3;
  else if (c == 0xF0) { len = 4; lo = 0x90; }
  else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else if (c == 0xF4) { len = 4; hi = 0x8F; }
  else return 0;
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
  while (j <= (lua_Integer)n && (s[j - 1] & 0xC0) == 0x80 && steps < 3) { j++; steps++; }
  if (j <= (lua_Integer)n && (s[j - 1] & 0xC0) == 0x80) j = i;
  lua_pushinteger(L, j);
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

static const luaL_Reg funcs[] = {
  {"hash", l_hash},
  {"utf8_clean", l_utf8_clean}, {"utf8_floor", l_utf8_floor}, {"utf8_ceil", l_utf8_ceil},
  {NULL, NULL},
};

int luaopen_core_text(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
