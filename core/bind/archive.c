/* core.archive: tar pack / extract / list (the engine is core/archive.c; this file
 * translates). pack, extract and list are synchronous, for the host's own local files;
 * pack_to and extract_at run off the loop (core/work.c) on descriptors, for transfers
 * through trees a sandbox can write. */
#include "runtime.h"
#include "bind/bind.h"
#include "tar.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* [.., tbl] raw field `k` of the table at `t` as a string or NULL; errors name entries[i] */
static const char *raw_string(lua_State *L, int t, const char *k, lua_Integer i, size_t *len) {
  lua_pushstring(L, k);
  int ty = lua_rawget(L, t);
  const char *s = NULL;
  if (ty == LUA_TSTRING) s = lua_tolstring(L, -1, len); /* anchored by the entry table */
  else if (ty != LUA_TNIL) luaL_argerror(L, 2, lua_pushfstring(L, "entries[%d].%s must be a string", (int)i, k));
  lua_pop(L, 1);
  return s;
}

/* Reads the entries list at stack index `idx` into a userdata array left on the stack;
 * the strings stay anchored by the entry tables. Raises on malformed entries. */
static dm_archive_entry *check_entries(lua_State *L, int idx, lua_Integer *count) {
  luaL_checktype(L, idx, LUA_TTABLE);
  lua_Integer n = luaL_len(L, idx);
  dm_archive_entry *v = lua_newuserdatauv(L, (size_t)(n > 0 ? n : 1) * sizeof *v, 0);
  for (lua_Integer i = 1; i <= n; i++) {
    if (lua_rawgeti(L, idx, i) != LUA_TTABLE) /* [.., entry] */
      luaL_argerror(L, idx, lua_pushfstring(L, "entries[%d] must be a table", (int)i));
    int t = lua_gettop(L);
    dm_archive_entry *e = &v[i - 1];
    memset(e, 0, sizeof *e);
    e->src = raw_string(L, t, "src", i, NULL);
    e->name = raw_string(L, t, "name", i, NULL);
    e->data = raw_string(L, t, "data", i, &e->data_len);
    if (!e->name) luaL_argerror(L, idx, lua_pushfstring(L, "entries[%d].name is required", (int)i));
    if (!e->src == !e->data)
      luaL_argerror(L, idx, lua_pushfstring(L, "entries[%d] needs exactly one of src, data", (int)i));
    lua_pushliteral(L, "mode");
    int mt = lua_rawget(L, t);
    e->mode = 0644;
    if (mt != LUA_TNIL) {
      if (!lua_isinteger(L, -1) || !e->data || lua_tointeger(L, -1) < 0 || lua_tointeger(L, -1) > 07777)
        luaL_argerror(L, idx,
                      lua_pushfstring(L,
                                      "entries[%d].mode must be an integer "
                                      "permission (in-memory entries only)",
                                      (int)i));
      e->mode = (int)lua_tointeger(L, -1);
    }
    lua_pop(L, 2);
  }
  *count = n;
  return v;
}

static void push_stats(lua_State *L, const dm_archive_stats *st) {
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)st->files);
  lua_setfield(L, -2, "files");
  lua_pushinteger(L, (lua_Integer)st->bytes);
  lua_setfield(L, -2, "bytes");
}

/// core.archive.pack(output_path, entries) -> {files=n, bytes=n} | nil, msg, code.
/// entries: list of {src=host_path, name=archive_name} or {name=, data=string, mode=0644}.
static int l_pack(lua_State *L) {
  const char *out = luaL_checkstring(L, 1);
  lua_Integer n;
  dm_archive_entry *v = check_entries(L, 2, &n);
  dm_archive_stats st;
  dm_archive_err err;
  if (dm_archive_pack(out, v, (size_t)n, &st, &err) != 0) return dm_fail(L, err.msg, err.code);
  push_stats(L, &st);
  return 1;
}

static uint64_t opt_limit(lua_State *L, int idx, const char *k) {
  if (!lua_istable(L, idx)) return 0;
  int t = lua_getfield(L, idx, k);
  lua_Integer v = 0;
  if (t != LUA_TNIL) {
    if (!lua_isinteger(L, -1) || (v = lua_tointeger(L, -1)) < 0)
      luaL_argerror(L, idx, lua_pushfstring(L, "opts.%s must be an integer >= 0", k));
  }
  lua_pop(L, 1);
  return (uint64_t)v;
}

static dm_archive_limits check_limits(lua_State *L, int idx) {
  if (!lua_isnoneornil(L, idx)) luaL_checktype(L, idx, LUA_TTABLE);
  dm_archive_limits lim;
  memset(&lim, 0, sizeof lim);
  lim.max_bytes = opt_limit(L, idx, "max_bytes");
  lim.max_entries = opt_limit(L, idx, "max_entries");
  lim.max_depth = opt_limit(L, idx, "max_depth");
  lim.max_archive_bytes = opt_limit(L, idx, "max_archive_bytes");
  if (lua_istable(L, idx)) {
    lua_getfield(L, idx, "strict");
    lim.strict_src = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  return lim;
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
///   | nil, msg, code. opts: max_bytes, max_entries, max_depth. Unsafe entries fail with "EUNSAFE".
static int l_extract(lua_State *L) {
  const char *tar = luaL_checkstring(L, 1);
  const char *dest = luaL_checkstring(L, 2);
  dm_archive_limits lim = check_limits(L, 3);
  result r;
  memset(&r, 0, sizeof r);
  dm_archive_err err;
  if (dm_archive_extract(tar, dest, &lim, &r.st, &r.names, &r.n, &err) != 0) return dm_fail(L, err.msg, err.code);
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

/* ---------------- off the loop: pack_to, extract_at ---------------- */

typedef struct {
  dm_lwork lw;
  int out_fd;
  dm_archive_entry *entries;
  size_t n;
  char **strings; /* copies of every src/name/data, owned */
  size_t nstrings;
  dm_archive_limits lim;
  dm_archive_stats st;
  int rc;
  dm_archive_err err;
} pack_job;

static void pack_run(dm_work *w) {
  pack_job *j = (pack_job *)w;
  j->rc = dm_archive_pack_fd(j->out_fd, j->entries, j->n, &j->lim, &j->st, &j->err, &w->cancel);
}

static int job_push(lua_State *L, int rc, const dm_archive_stats *st, const dm_archive_err *err) {
  if (rc != 0) return dm_fail(L, err->msg, err->code);
  push_stats(L, st);
  return 1;
}

static int pack_push(lua_State *L, dm_lwork *lw) {
  pack_job *j = (pack_job *)lw;
  return job_push(L, j->rc, &j->st, &j->err);
}

static void pack_release(dm_lwork *lw) {
  pack_job *j = (pack_job *)lw;
  if (j->out_fd >= 0) close(j->out_fd);
  for (size_t i = 0; i < j->nstrings; i++) free(j->strings[i]);
  free(j->strings);
  free(j->entries);
}

static char *own(pack_job *j, const char *s, size_t len) {
  if (!s) return NULL;
  char *c = malloc(len + 1);
  if (!c) return NULL;
  memcpy(c, s, len);
  c[len] = '\0';
  j->strings[j->nstrings++] = c;
  return c;
}

/// core.archive.pack_to(file, entries, opts, callback) -> work | nil, msg, code. Writes a
/// tar of `entries` (as for pack) to the open, writable core.fs.file `file`, off the loop.
/// opts: max_bytes (sizes summed before anything is written, and enforced while writing),
/// max_entries, max_depth (folder levels, default 256), strict (resolve each src from "/" with no
/// symlink on the way). callback({files, bytes} | nil, msg, code).
static int l_pack_to(lua_State *L) {
  int fd = dm_fs_check_file(L, 1);
  lua_Integer n;
  dm_archive_entry *v = check_entries(L, 2, &n);
  dm_archive_limits lim = check_limits(L, 3);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  pack_job *j = calloc(1, sizeof *j);
  if (!j) return dm_fail(L, "pack: out of memory", "ENOMEM");
  j->out_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  j->entries = calloc((size_t)(n > 0 ? n : 1), sizeof *j->entries);
  j->strings = calloc((size_t)(n > 0 ? n : 1) * 3, sizeof *j->strings);
  int ok = j->out_fd >= 0 && j->entries && j->strings;
  for (lua_Integer i = 0; ok && i < n; i++) {
    dm_archive_entry *e = &j->entries[i];
    *e = v[i];
    e->src = v[i].src ? own(j, v[i].src, strlen(v[i].src)) : NULL;
    e->name = own(j, v[i].name, strlen(v[i].name));
    e->data = v[i].data ? own(j, v[i].data, v[i].data_len) : NULL;
    ok = (!v[i].src || e->src) && e->name && (!v[i].data || e->data);
  }
  if (!ok) {
    int e = errno;
    pack_release(&j->lw);
    free(j);
    return dm_fail(L, lua_pushfstring(L, "pack: %s", strerror(e ? e : ENOMEM)), "ENOMEM");
  }
  j->n = (size_t)n;
  j->lim = lim;
  j->lw.w.run = pack_run;
  j->lw.push = pack_push;
  j->lw.release = pack_release;
  return dm_lwork_start(L, &j->lw, 4);
}

typedef struct {
  dm_lwork lw;
  int tar_fd, dir_fd;
  char *name, *path;
  dm_archive_limits lim;
  dm_archive_stats st;
  int rc;
  dm_archive_err err;
} extract_job;

static void extract_run(dm_work *w) {
  extract_job *j = (extract_job *)w;
  if (mkdirat(j->dir_fd, j->name, 0700) != 0) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", j->path, j->name);
    dm_err_errno(&j->err, errno, "mkdir", p);
    j->rc = -1;
    return;
  }
  int dest = dm_cf_open_dir(j->dir_fd, j->name);
  if (dest < 0) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", j->path, j->name);
    dm_err_errno(&j->err, errno, "open", p);
    j->rc = -1;
  } else {
    j->rc = dm_archive_extract_fd(j->tar_fd, dest, &j->lim, &j->st, NULL, NULL, &j->err, &w->cancel);
    close(dest);
  }
  if (j->rc != 0) { /* nothing half-written is left */
    dm_err ignored;
    dm_cf_remove_tree(j->dir_fd, j->name, &ignored);
  }
}

static int extract_push(lua_State *L, dm_lwork *lw) {
  extract_job *j = (extract_job *)lw;
  return job_push(L, j->rc, &j->st, &j->err);
}

static void extract_release(dm_lwork *lw) {
  extract_job *j = (extract_job *)lw;
  if (j->tar_fd >= 0) close(j->tar_fd);
  if (j->dir_fd >= 0) close(j->dir_fd);
  free(j->name);
  free(j->path);
}

/// core.archive.extract_at(file, dir, name, opts, callback) -> work | nil, msg, code.
/// Extracts the plain tar in the core.fs.file `file` (read with pread from its start) into
/// a new folder `name` that it creates (mkdirat: it must not exist) in the core.fs.dir
/// `dir`, off the loop, with the checks of core.archive.extract and every write on held
/// folder descriptors. On failure or cancel the folder `name` is removed again.
/// opts: max_bytes, max_entries, max_depth (default 256), max_archive_bytes (bytes of
/// the tar itself). callback({files, bytes} | nil, msg, code).
static int l_extract_at(lua_State *L) {
  int tfd = dm_fs_check_file(L, 1);
  const char *dpath;
  int dfd = dm_fs_check_dir(L, 2, &dpath);
  const char *name = luaL_checkstring(L, 3);
  dm_archive_limits lim = check_limits(L, 4);
  luaL_checktype(L, 5, LUA_TFUNCTION);
  if (!*name || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
    return luaL_argerror(L, 3, "name must be one path component");
  extract_job *j = calloc(1, sizeof *j);
  if (!j) return dm_fail(L, "extract: out of memory", "ENOMEM");
  j->tar_fd = fcntl(tfd, F_DUPFD_CLOEXEC, 0);
  j->dir_fd = fcntl(dfd, F_DUPFD_CLOEXEC, 0);
  j->name = strdup(name);
  j->path = strdup(dpath);
  if (j->tar_fd < 0 || j->dir_fd < 0 || !j->name || !j->path) {
    int e = errno;
    extract_release(&j->lw);
    free(j);
    return dm_fail(L, lua_pushfstring(L, "extract: %s", strerror(e ? e : ENOMEM)), dm_errno_code(e ? e : ENOMEM));
  }
  j->lim = lim;
  j->lw.w.run = extract_run;
  j->lw.push = extract_push;
  j->lw.release = extract_release;
  return dm_lwork_start(L, &j->lw, 5);
}

static const luaL_Reg funcs[] = {
  {"pack", l_pack},       {"extract", l_extract},       {"list", l_list},
  {"pack_to", l_pack_to}, {"extract_at", l_extract_at}, {NULL, NULL},
};

/// Opens core.archive: returns the module table {pack, extract, list, pack_to, extract_at}.
int luaopen_core_archive(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
