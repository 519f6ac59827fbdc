/* core.archive: tar pack / extract / list (the engine is core/archive.c; this file
 * translates). Synchronous: meant for local files on the loop thread. */
#include "runtime.h"
#include "bind/bind.h"
#include "archive.h"
#include <string.h>

/* [.., tbl] raw field `k` of the table at `t` as a string or NULL; errors name entries[i] */
static const char *raw_string(lua_State *L, int t, const char *k, lua_Integer i, size_t *len) {
  lua_pushstring(L, k);
  int ty = lua_rawget(L, t);
  const char *s = NULL;
  if (ty == LUA_TSTRING) s = lua_tolstring(L, -1, len); /* anchored by the entry table */
  else if (ty != LUA_TNIL)
    luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d].%s must be a string", (int)i, k));
  lua_pop(L, 1);
  return s;
}

/// core.archive.pack(output_path, entries) -> {files=n, bytes=n} | nil, msg, code.
/// entries: list of {src=host_path, name=archive_name} or {name=, data=string, mode=0644}.
static int l_pack(lua_State *L) {
  const char *out = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_Integer n = luaL_len(L, 2);
  dm_archive_entry *v = lua_newuserdatauv(L, (size_t)(n > 0 ? n : 1) * sizeof *v, 0);
  for (lua_Integer i = 1; i <= n; i++) {
    if (lua_rawgeti(L, 2, i) != LUA_TTABLE) /* [.., entry] */
      return luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d] must be a table", (int)i));
    int t = lua_gettop(L);
    dm_archive_entry *e = &v[i - 1];
    memset(e, 0, sizeof *e);
    e->src = raw_string(L, t, "src", i, NULL);
    e->name = raw_string(L, t, "name", i, NULL);
    e->data = raw_string(L, t, "data", i, &e->data_len);
    if (!e->name)
      return luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d].name is required", (int)i));
    if (!e->src == !e->data)
      return luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d] needs exactly one of src, data", (int)i));
    lua_pushliteral(L, "mode");
    int mt = lua_rawget(L, t);
    e->mode = 0644;
    if (mt != LUA_TNIL) {
      if (!lua_isinteger(L, -1) || !e->data || lua_tointeger(L, -1) < 0 || lua_tointeger(L, -1) > 07777)
        return luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d].mode must be an integer "
                                                      "permission (in-memory entries only)", (int)i));
      e->mode = (int)lua_tointeger(L, -1);
    }
    lua_pop(L, 2);
  }
  dm_archive_stats st;
  dm_archive_err err;
  if (dm_archive_pack(out, v, (size_t)n, &st, &err) != 0) return dm_fail(L, err.msg, err.code);
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)st.files);
  lua_setfield(L, -2, "files");
  lua_pushinteger(L, (lua_Integer)st.bytes);
  lua_setfield(L, -2, "bytes");
  return 1;
}

static uint64_t opt_limit(lua_State *L, const char *k) {
  if (!lua_istable(L, 3)) return 0;
  int t = lua_getfield(L, 3, k);
  lua_Integer v = 0;
  if (t != LUA_TNIL) {
    if (!lua_isinteger(L, -1) || (v = lua_tointeger(L, -1)) < 0)
      luaL_argerror(L, 3, lua_pushfstring(L, "opts.%s must be an integer >= 0", k));
  }
  lua_pop(L, 1);
  return (uint64_t)v;
}

typedef struct {
  dm_archive_stats st;
  char **names;
  size_t n;
  dm_archive_item *items;
} result;

/* Protected builders: C arrays are freed by the caller even if Lua runs out of memory. */
static int p_extract_result(lua_State *L) {
  result *r = lua_touserdata(L, 1);
  lua_createtable(L, 0, 3);
  lua_pushinteger(L, (lua_Integer)r->st.files);
  lua_setfield(L, -2, "files");
  lua_pushinteger(L, (lua_Integer)r->st.bytes);
  lua_setfield(L, -2, "bytes");
  lua_createtable(L, (int)r->n, 0);
  for (size_t i = 0; i < r->n; i++) {
    lua_pushstring(L, r->names[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  lua_setfield(L, -2, "entries");
  return 1;
}

static int p_list_result(lua_State *L) {
  result *r = lua_touserdata(L, 1);
  lua_createtable(L, (int)r->n, 0);
  for (size_t i = 0; i < r->n; i++) {
    dm_archive_item *it = &r->items[i];
    lua_createtable(L, 0, 5);
    lua_pushstring(L, it->name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, it->type);
    lua_setfield(L, -2, "type");
    lua_pushinteger(L, (lua_Integer)it->size);
    lua_setfield(L, -2, "size");
    lua_pushinteger(L, it->mode);
    lua_setfield(L, -2, "mode");
    if (it->target) {
      lua_pushstring(L, it->target);
      lua_setfield(L, -2, "target");
    }
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

/// core.archive.extract(tar_path, dest_dir [, opts]) -> {files=n, bytes=n, entries={name...}}
///   | nil, msg, code. opts: max_bytes, max_entries. Unsafe entries fail with "EUNSAFE".
static int l_extract(lua_State *L) {
  const char *tar = luaL_checkstring(L, 1);
  const char *dest = luaL_checkstring(L, 2);
  if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
  dm_archive_limits lim = {opt_limit(L, "max_bytes"), opt_limit(L, "max_entries")};
  result r;
  memset(&r, 0, sizeof r);
  dm_archive_err err;
  if (dm_archive_extract(tar, dest, &lim, &r.st, &r.names, &r.n, &err) != 0)
    return dm_fail(L, err.msg, err.code);
  lua_pushcfunction(L, p_extract_result);
  lua_pushlightuserdata(L, &r);
  int rc = lua_pcall(L, 1, 1, 0);
  dm_archive_names_free(r.names, r.n);
  if (rc != LUA_OK) return lua_error(L);
  return 1;
}

/// core.archive.list(tar_path) -> {{name=, type=, size=, mode=, target=?}, ...} | nil, msg, code
static int l_list(lua_State *L) {
  const char *tar = luaL_checkstring(L, 1);
  result r;
  memset(&r, 0, sizeof r);
  dm_archive_err err;
  if (dm_archive_list(tar, &r.items, &r.n, &err) != 0) return dm_fail(L, err.msg, err.code);
  lua_pushcfunction(L, p_list_result);
  lua_pushlightuserdata(L, &r);
  int rc = lua_pcall(L, 1, 1, 0);
  dm_archive_items_free(r.items, r.n);
  if (rc != LUA_OK) return lua_error(L);
  return 1;
}

static const luaL_Reg funcs[] = {
  {"pack", l_pack}, {"extract", l_extract}, {"list", l_list}, {NULL, NULL},
};

/// Opens core.archive: returns the module table {pack, extract, list}.
int luaopen_core_archive(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
