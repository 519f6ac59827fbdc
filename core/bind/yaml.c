/* core.yaml: YAML text to Lua values, read with libyaml's event parser (Debian libyaml-dev).
 * Only decoding: demesne reads YAML that others write (kubeconfigs) and writes JSON.
 *
 * Scalars follow the YAML 1.2 core schema for plain (unquoted, untagged) scalars: null, ~
 * and the empty scalar are core.yaml.null; true/false (three spellings) booleans; decimal,
 * 0o octal and 0x hex integers integers; decimal floats, .inf and .nan numbers; everything
 * else, and every quoted or block scalar, a string. Mappings are tables keyed by the key's
 * text (keys must be scalars, each once); sequences are arrays.
 *
 * Hostile input: nesting deeper than max_depth, more than max_nodes nodes (counting each
 * alias as the whole node it names, so a "billion laughs" fails at the first alias that
 * crosses the bound, in time linear in the text) and text longer than max_bytes are refused.
 * An alias gives the very table its anchor made (shared, not copied). */
#include "runtime.h"
#include "bind/bind.h"
#include <yaml.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PARSER_MT "core.yaml.parser"
#define MAX_DEPTH_DEFAULT 64
#define MAX_NODES_DEFAULT 1000000
#define MAX_BYTES_DEFAULT (16 * 1024 * 1024)

/* A parser owned by a userdata, so that a Lua error (out of memory) inside the walk still
 * frees it (__gc). */
typedef struct {
  yaml_parser_t p;
  yaml_event_t ev;
  int inited, have_ev;
  int anchors; /* stack index of the anchor -> value table */
  int sizes;   /* stack index of the anchor -> node count table */
  lua_Integer nodes, max_nodes;
  int max_depth;
  char err[256];
} ydec;

static void ydec_free(ydec *d) {
  if (d->have_ev) yaml_event_delete(&d->ev);
  d->have_ev = 0;
  if (d->inited) yaml_parser_delete(&d->p);
  d->inited = 0;
}

static int parser_gc(lua_State *L) {
  ydec_free(luaL_checkudata(L, 1, PARSER_MT));
  return 0;
}

static int fail_at(ydec *d, yaml_mark_t m, const char *what) {
  snprintf(d->err, sizeof d->err, "yaml: line %zu, column %zu: %s", m.line + 1, m.column + 1, what);
  return -1;
}

/* The next event into d->ev (the previous one freed). */
static int next(ydec *d) {
  if (d->have_ev) yaml_event_delete(&d->ev);
  d->have_ev = 0;
  if (!yaml_parser_parse(&d->p, &d->ev)) {
    const char *problem = d->p.problem ? d->p.problem : "invalid YAML";
    if (d->p.context)
      snprintf(d->err, sizeof d->err, "yaml: line %zu, column %zu: %s (%s, line %zu)", d->p.problem_mark.line + 1,
               d->p.problem_mark.column + 1, problem, d->p.context, d->p.context_mark.line + 1);
    else
      snprintf(d->err, sizeof d->err, "yaml: line %zu, column %zu: %s", d->p.problem_mark.line + 1,
               d->p.problem_mark.column + 1, problem);
    return -1;
  }
  d->have_ev = 1;
  return 0;
}

static int eq(const char *s, size_t n, const char *lit) { return n == strlen(lit) && !memcmp(s, lit, n); }

static int one_of(const char *s, size_t n, const char *a, const char *b, const char *c) {
  return eq(s, n, a) || eq(s, n, b) || eq(s, n, c);
}

/* [] -> [integer] for [-+]?[0-9]+, 0o[0-7]+, 0x[0-9a-fA-F]+ (a decimal one beyond 64 bits as a
 * float, as YAML asks no bound). Returns 0 when `s` is none of these. */
static int push_int(lua_State *L, const char *s, size_t n) {
  int base = 10;
  size_t i = 0;
  if (n > 2 && s[0] == '0' && (s[1] == 'o' || s[1] == 'x')) {
    base = s[1] == 'o' ? 8 : 16;
    i = 2;
  } else if (n > 1 && (s[0] == '-' || s[0] == '+')) {
    i = 1;
  }
  if (i >= n || n > 64) return 0;
  for (size_t k = i; k < n; k++) {
    char c = s[k];
    int ok = base == 8    ? (c >= '0' && c <= '7')
             : base == 16 ? !!strchr("0123456789abcdefABCDEF", c) && c
                          : (c >= '0' && c <= '9');
    if (!ok) return 0;
  }
  char buf[72];
  memcpy(buf, s + i, n - i);
  buf[n - i] = 0;
  errno = 0;
  unsigned long long u = strtoull(buf, NULL, base);
  int neg = base == 10 && s[0] == '-';
  if (errno == ERANGE || u > (neg ? (unsigned long long)INT64_MAX + 1 : (unsigned long long)INT64_MAX)) {
    if (base != 10) return 0; /* an oversized 0x or 0o: left as its text */
    lua_pushnumber(L, strtod(s, NULL));
    return 1;
  }
  lua_pushinteger(L, neg ? (lua_Integer)(0 - u) : (lua_Integer)u);
  return 1;
}

/* [] -> [number] for [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?, [-+]?.inf, .nan
 * (in their three spellings). Returns 0 otherwise. */
static int push_float(lua_State *L, const char *s, size_t n) {
  size_t i = 0;
  int neg = 0;
  if (n && (s[0] == '-' || s[0] == '+')) neg = s[i++] == '-';
  if (one_of(s + i, n - i, ".inf", ".Inf", ".INF")) {
    lua_pushnumber(L, neg ? -HUGE_VAL : HUGE_VAL);
    return 1;
  }
  if (!i && one_of(s, n, ".nan", ".NaN", ".NAN")) {
    lua_pushnumber(L, NAN);
    return 1;
  }
  size_t digits = 0, k = i;
  while (k < n && s[k] >= '0' && s[k] <= '9') k++, digits++;
  if (k < n && s[k] == '.') {
    k++;
    while (k < n && s[k] >= '0' && s[k] <= '9') k++, digits++;
  }
  if (!digits) return 0;
  if (k < n && (s[k] == 'e' || s[k] == 'E')) {
    k++;
    if (k < n && (s[k] == '-' || s[k] == '+')) k++;
    size_t e = k;
    while (k < n && s[k] >= '0' && s[k] <= '9') k++;
    if (k == e) return 0;
  }
  if (k != n || n > 64) return 0;
  char buf[72];
  memcpy(buf, s, n);
  buf[n] = 0;
  lua_pushnumber(L, strtod(buf, NULL));
  return 1;
}

/* [] -> [value] of a plain scalar by the core schema */
static void push_plain(lua_State *L, const char *s, size_t n) {
  if (n == 0 || eq(s, n, "~") || one_of(s, n, "null", "Null", "NULL")) lua_pushlightuserdata(L, NULL);
  else if (one_of(s, n, "true", "True", "TRUE")) lua_pushboolean(L, 1);
  else if (one_of(s, n, "false", "False", "FALSE")) lua_pushboolean(L, 0);
  else if (!push_int(L, s, n) && !push_float(L, s, n)) lua_pushlstring(L, s, n);
}

/* [] -> [value] of the scalar event in d->ev: its tag, if any, must be one the core schema
 * knows, and a plain scalar tagged !!int, !!bool, !!null or !!float must be one */
static int push_scalar(lua_State *L, ydec *d) {
  const char *s = (const char *)d->ev.data.scalar.value;
  size_t n = d->ev.data.scalar.length;
  const char *tag = (const char *)d->ev.data.scalar.tag;
  int plain = d->ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
  if (!tag || !strcmp(tag, "!")) {
    if (plain && !tag) push_plain(L, s, n);
    else lua_pushlstring(L, s, n);
    return 0;
  }
  if (!strcmp(tag, YAML_STR_TAG)) {
    lua_pushlstring(L, s, n);
    return 0;
  }
  int want = !strcmp(tag, YAML_NULL_TAG)                                    ? LUA_TLIGHTUSERDATA
             : !strcmp(tag, YAML_BOOL_TAG)                                  ? LUA_TBOOLEAN
             : (!strcmp(tag, YAML_INT_TAG) || !strcmp(tag, YAML_FLOAT_TAG)) ? LUA_TNUMBER
                                                                            : LUA_TNONE;
  if (want == LUA_TNONE) return fail_at(d, d->ev.start_mark, "unsupported tag (only the core schema's are read)");
  push_plain(L, s, n);
  if (lua_type(L, -1) != want) {
    lua_pop(L, 1);
    return fail_at(d, d->ev.start_mark, "the scalar does not match its tag");
  }
  return 0;
}

static int count_node(ydec *d, lua_Integer n, yaml_mark_t m) {
  if (n > d->max_nodes - d->nodes) return fail_at(d, m, "too many nodes (aliases count as what they name)");
  d->nodes += n;
  return 0;
}

static int push_node(lua_State *L, ydec *d, int depth);

/* [] -> [table] of the sequence or mapping whose start event is in d->ev */
static int push_collection(lua_State *L, ydec *d, int depth) {
  int mapping = d->ev.type == YAML_MAPPING_START_EVENT;
  yaml_event_type_t end = mapping ? YAML_MAPPING_END_EVENT : YAML_SEQUENCE_END_EVENT;
  const char *tag = (const char *)(mapping ? d->ev.data.mapping_start.tag : d->ev.data.sequence_start.tag);
  if (tag && strcmp(tag, "!") && strcmp(tag, mapping ? YAML_MAP_TAG : YAML_SEQ_TAG))
    return fail_at(d, d->ev.start_mark, "unsupported tag (only the core schema's are read)");
  if (depth >= d->max_depth) return fail_at(d, d->ev.start_mark, "nested too deeply");
  luaL_checkstack(L, 8, "yaml");
  lua_newtable(L);
  lua_Integer i = 0;
  for (;;) {
    if (next(d)) return -1;
    if (d->ev.type == end) return 0;
    if (!mapping) {
      if (push_node(L, d, depth + 1)) return -1;
      lua_rawseti(L, -2, ++i);
      continue;
    }
    if (d->ev.type != YAML_SCALAR_EVENT) return fail_at(d, d->ev.start_mark, "a mapping key must be a scalar");
    yaml_mark_t at = d->ev.start_mark;
    if (count_node(d, 1, at)) return -1;
    lua_pushlstring(L, (const char *)d->ev.data.scalar.value, d->ev.data.scalar.length); /* [t, key] */
    if (lua_rawget(L, -2) != LUA_TNIL) return fail_at(d, at, "a key appears twice in one mapping");
    lua_pop(L, 1);
    lua_pushlstring(L, (const char *)d->ev.data.scalar.value, d->ev.data.scalar.length);
    if (next(d) || push_node(L, d, depth + 1)) return -1; /* [t, key, value] */
    lua_rawset(L, -3);
  }
}

/* The anchor of the node event in d->ev, or NULL */
static const char *anchor_of(const yaml_event_t *ev) {
  switch (ev->type) {
  case YAML_SCALAR_EVENT: return (const char *)ev->data.scalar.anchor;
  case YAML_SEQUENCE_START_EVENT: return (const char *)ev->data.sequence_start.anchor;
  case YAML_MAPPING_START_EVENT: return (const char *)ev->data.mapping_start.anchor;
  default: return NULL;
  }
}

/* [] -> [value] of the node whose first event is in d->ev; an anchored node is recorded
 * with the number of nodes it holds, which an alias to it counts again */
static int push_node(lua_State *L, ydec *d, int depth) {
  yaml_mark_t at = d->ev.start_mark;
  luaL_checkstack(L, 8, "yaml");
  if (d->ev.type == YAML_ALIAS_EVENT) {
    lua_pushstring(L, (const char *)d->ev.data.alias.anchor);
    if (lua_rawget(L, d->sizes) != LUA_TNUMBER) return fail_at(d, at, "an alias names no anchor before it");
    lua_Integer n = lua_tointeger(L, -1);
    lua_pop(L, 1);
    if (count_node(d, n, at)) return -1;
    lua_pushstring(L, (const char *)d->ev.data.alias.anchor);
    lua_rawget(L, d->anchors);
    return 0;
  }
  const char *anchor = anchor_of(&d->ev);
  if (anchor) lua_pushstring(L, anchor); /* [name]: the events below free this one */
  lua_Integer before = d->nodes;
  if (count_node(d, 1, at)) return -1;
  if (d->ev.type == YAML_SCALAR_EVENT) {
    if (push_scalar(L, d)) return -1;
  } else if (d->ev.type == YAML_SEQUENCE_START_EVENT || d->ev.type == YAML_MAPPING_START_EVENT) {
    if (push_collection(L, d, depth)) return -1;
  } else {
    return fail_at(d, at, "unexpected event");
  }
  if (!anchor) return 0;
  lua_pushvalue(L, -2); /* [name, value, name] */
  lua_pushvalue(L, -2);
  lua_rawset(L, d->anchors);
  lua_pushvalue(L, -2);
  lua_pushinteger(L, d->nodes - before);
  lua_rawset(L, d->sizes);
  lua_remove(L, -2); /* [value] */
  return 0;
}

/* [.., ydec] -> [.., ydec, value]: the one document of the stream (none: null) */
static int decode(lua_State *L, ydec *d) {
  if (next(d)) return -1; /* STREAM-START */
  if (next(d)) return -1;
  if (d->ev.type == YAML_STREAM_END_EVENT) {
    lua_pushlightuserdata(L, NULL);
    return 0;
  }
  if (next(d)) return -1; /* past DOCUMENT-START */
  if (push_node(L, d, 0)) return -1;
  if (next(d)) return -1; /* DOCUMENT-END */
  if (next(d)) return -1;
  if (d->ev.type != YAML_STREAM_END_EVENT) return fail_at(d, d->ev.start_mark, "more than one document");
  return 0;
}

/// core.yaml.decode(text [, opts]) -> value | nil, msg, "EINVAL". Reads one YAML document
/// (an empty text gives core.yaml.null). opts: max_depth (nesting, default 64), max_nodes
/// (nodes, each alias counted as the node it names, default 1,000,000), max_bytes (length
/// of `text`, default 16 MiB). `msg` names the line and column ("yaml: line 3, column 5:
/// ..."). See docs/reference/lua-api.md.
static int l_decode(lua_State *L) {
  size_t len;
  const char *text = luaL_checklstring(L, 1, &len);
  lua_settop(L, 2);
  if (lua_isnil(L, 2)) {
    lua_newtable(L);
    lua_replace(L, 2);
  }
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_Integer max_depth = dm_opt_count(L, 2, "max_depth", MAX_DEPTH_DEFAULT);
  lua_Integer max_nodes = dm_opt_count(L, 2, "max_nodes", MAX_NODES_DEFAULT);
  lua_Integer max_bytes = dm_opt_count(L, 2, "max_bytes", MAX_BYTES_DEFAULT);
  luaL_argcheck(L, max_depth <= 1000, 2, "max_depth must be at most 1000");
  if ((lua_Integer)len > max_bytes) return dm_fail(L, "yaml: the text is longer than max_bytes", "EINVAL");
  ydec *d = lua_newuserdatauv(L, sizeof *d, 0); /* 3 */
  memset(d, 0, sizeof *d);
  luaL_setmetatable(L, PARSER_MT);
  if (!yaml_parser_initialize(&d->p)) return dm_fail(L, "yaml: out of memory", "ENOMEM");
  d->inited = 1;
  yaml_parser_set_input_string(&d->p, (const unsigned char *)text, len);
  d->max_depth = (int)max_depth;
  d->max_nodes = max_nodes;
  lua_newtable(L);
  d->anchors = lua_gettop(L);
  lua_newtable(L);
  d->sizes = lua_gettop(L);
  int rc = decode(L, d);
  ydec_free(d);
  if (rc) return dm_fail(L, d->err, "EINVAL");
  return 1;
}

static const luaL_Reg funcs[] = {{"decode", l_decode}, {NULL, NULL}};

/// Opens core.yaml: returns the module table {decode, null}; null is the light userdata
/// NULL, the same value as core.json.null.
int luaopen_core_yaml(lua_State *L) {
  dm_metatable(L, PARSER_MT, NULL, parser_gc, NULL);
  luaL_newlib(L, funcs);
  lua_pushlightuserdata(L, NULL);
  lua_setfield(L, -2, "null");
  return 1;
}
