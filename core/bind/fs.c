/* core.fs: filesystem helpers. Path-based functions are for the host's own files; a
 * `core.fs.dir` handle (core/confine.c underneath) is for every tree a sandbox can write:
 * each name is resolved below the held folder with no symlink and no "..", files are
 * type-checked before they are opened, and heavy work (tree removal) runs off the loop
 * as a `core.fs.work`. Short operations run on the loop thread. */
#include "runtime.h"
#include "bind/bind.h"
#include "confine.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define FILE_MT "core.fs.file"
#define DIR_MT "core.fs.dir"
#define WORK_MT "core.fs.work"

static int fail_errno(lua_State *L, const char *what, const char *path) {
  int e = errno;
  lua_pushnil(L);
  lua_pushfstring(L, "%s %s: %s", what, path, strerror(e));
  lua_pushstring(L, uv_err_name(uv_translate_sys_error(e)));
  return 3;
}

static int mkdir_p(char *path, mode_t mode) {
  size_t len = strlen(path);
  for (size_t i = 1; i <= len; i++) {
    if (path[i] == '/' || path[i] == '\0') {
      char c = path[i];
      path[i] = '\0';
      if (mkdir(path, mode) != 0 && errno != EEXIST) return -1;
      path[i] = c;
    }
  }
  struct stat st;
  if (stat(path, &st) != 0) return -1;
  if (!S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    return -1;
  }
  return 0;
}

/// core.fs.mkdir_p(path [, mode=0755]) -> true | nil, msg, code. Creates every missing
/// parent; an existing directory is fine, an existing non-directory fails with ENOTDIR.
static int l_mkdir_p(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  mode_t mode = (mode_t)luaL_optinteger(L, 2, 0755);
  char buf[PATH_MAX];
  if (strlen(p) >= sizeof buf) return dm_fail(L, "mkdir: path too long", "ENAMETOOLONG");
  strcpy(buf, p);
  if (mkdir_p(buf, mode) != 0) return fail_errno(L, "mkdir", p);
  lua_pushboolean(L, 1);
  return 1;
}

/* Splits `path` into its folder (opened, following links: the host's own path) and last
 * name. Returns the folder's descriptor or -1/errno. */
static int open_parent_path(const char *path, char *base, size_t cap) {
  size_t len = strlen(path);
  while (len > 1 && path[len - 1] == '/') len--;
  size_t b = len;
  while (b > 0 && path[b - 1] != '/') b--;
  size_t bl = len - b;
  if (bl == 0 || bl >= cap || (bl == 1 && path[b] == '.') || (bl == 2 && path[b] == '.' && path[b + 1] == '.')) {
    errno = bl >= cap ? ENAMETOOLONG : EINVAL;
    return -1;
  }
  memcpy(base, path + b, bl);
  base[bl] = '\0';
  char dir[PATH_MAX];
  if (b >= sizeof dir) {
    errno = ENAMETOOLONG;
    return -1;
  }
  if (b == 0) strcpy(dir, ".");
  else if (b == 1) strcpy(dir, "/");
  else {
    memcpy(dir, path, b - 1);
    dir[b - 1] = '\0';
  }
  return open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

/// core.fs.write_atomic(path, data [, mode=0644]) -> true | nil, msg, code.
/// Writes to a new temporary file (O_EXCL) in the same folder, fsyncs, then renames it over
/// `path` within that held folder: readers see the old or the new contents, never a
/// half-written file.
static int l_write_atomic(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  mode_t mode = (mode_t)luaL_optinteger(L, 3, 0644);
  char base[NAME_MAX + 1];
  int pfd = open_parent_path(p, base, sizeof base);
  if (pfd < 0) return fail_errno(L, "write", p);
  dm_err err;
  int r = dm_cf_write_atomic(pfd, base, data, len, mode, &err);
  close(pfd);
  if (r != 0) return dm_fail(L, lua_pushfstring(L, "%s (%s)", err.msg, p), err.code);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.realpath(path) -> string | nil, msg, code: absolute, symlinks resolved.
static int l_realpath(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  char buf[PATH_MAX];
  if (!realpath(p, buf)) return fail_errno(L, "realpath", p);
  lua_pushstring(L, buf);
  return 1;
}

static void push_stat(lua_State *L, const struct stat *st) {
  lua_createtable(L, 0, 6);
  const char *t = S_ISREG(st->st_mode)    ? "file"
                  : S_ISDIR(st->st_mode)  ? "directory"
                  : S_ISLNK(st->st_mode)  ? "link"
                  : S_ISSOCK(st->st_mode) ? "socket"
                                          : "other";
  lua_pushstring(L, t);
  lua_setfield(L, -2, "type");
  lua_pushinteger(L, (lua_Integer)st->st_size);
  lua_setfield(L, -2, "size");
  lua_pushinteger(L, (lua_Integer)(st->st_mode & 07777));
  lua_setfield(L, -2, "mode");
  lua_pushinteger(L, (lua_Integer)st->st_mtime);
  lua_setfield(L, -2, "mtime");
  lua_pushinteger(L, (lua_Integer)st->st_uid);
  lua_setfield(L, -2, "uid");
}

/// core.fs.stat(path) -> {type, size, mode, mtime, uid} | nil, msg, code (follows links).
/// type is "file", "directory", "link", "socket" or "other".
static int l_stat(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  struct stat st;
  if (stat(p, &st) != 0) return fail_errno(L, "stat", p);
  push_stat(L, &st);
  return 1;
}

/// core.fs.lstat(path) -> like stat, without following a final symlink.
static int l_lstat(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  struct stat st;
  if (lstat(p, &st) != 0) return fail_errno(L, "lstat", p);
  push_stat(L, &st);
  return 1;
}

static int read_fd(lua_State *L, int fd, lua_Integer offset, lua_Integer max, const char *path) {
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  lua_Integer left = max < 0 ? LUA_MAXINTEGER : max;
  char buf[65536];
  while (left > 0) {
    size_t want = left < (lua_Integer)sizeof buf ? (size_t)left : sizeof buf;
    ssize_t n = offset >= 0 ? pread(fd, buf, want, offset) : read(fd, buf, want);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    luaL_addlstring(&b, buf, (size_t)n);
    if (offset >= 0) offset += n;
    left -= n;
  }
  luaL_pushresult(&b);
  return 0;
}

/// core.fs.read_file(path [, offset=0 [, max_bytes]]) -> string | nil, msg, code.
/// Reads up to max_bytes (default: all) starting at byte `offset`.
static int l_read_file(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  lua_Integer off = luaL_optinteger(L, 2, 0);
  lua_Integer max = luaL_optinteger(L, 3, -1);
  int fd = open(p, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail_errno(L, "open", p);
  int r = read_fd(L, fd, off, max, p);
  int e = errno;
  close(fd);
  errno = e;
  if (r) return fail_errno(L, "read", p);
  return 1;
}

/// core.fs.readdir(path) -> {name, ...} (sorted, without "." and "..") | nil, msg, code
static int l_readdir(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  struct dirent **list;
  int n = scandir(p, &list, NULL, alphasort);
  if (n < 0) return fail_errno(L, "readdir", p);
  lua_createtable(L, n, 0);
  int j = 1;
  for (int i = 0; i < n; i++) {
    if (strcmp(list[i]->d_name, ".") && strcmp(list[i]->d_name, "..")) {
      lua_pushstring(L, list[i]->d_name);
      lua_rawseti(L, -2, j++);
    }
    free(list[i]);
  }
  free(list);
  return 1;
}

/// core.fs.unlink(path) -> true | nil, msg, code
static int l_unlink(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  if (unlink(p) != 0) return fail_errno(L, "unlink", p);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.rename(from, to) -> true | nil, msg, code
static int l_rename(lua_State *L) {
  const char *a = luaL_checkstring(L, 1), *b = luaL_checkstring(L, 2);
  if (rename(a, b) != 0) return fail_errno(L, "rename", a);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.remove_tree(path) -> true | nil, msg, code. Removes a file or a folder with
/// everything in it, synchronously, by unlinkat on held folder descriptors; symlinks are
/// removed, never followed. A missing path is fine. For the host's own folders; a tree a
/// sandbox can write goes through dir:remove_tree (off the loop).
static int l_remove_tree(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  char base[NAME_MAX + 1];
  int pfd = open_parent_path(p, base, sizeof base);
  if (pfd < 0) {
    if (errno == ENOENT) {
      lua_pushboolean(L, 1);
      return 1;
    }
    return fail_errno(L, "remove", p);
  }
  dm_err err;
  int r = dm_cf_remove_tree(pfd, base, &err);
  close(pfd);
  if (r != 0) return dm_fail(L, lua_pushfstring(L, "%s (%s)", err.msg, p), err.code);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.chmod(path, mode) -> true | nil, msg, code
static int l_chmod(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  if (chmod(p, (mode_t)luaL_checkinteger(L, 2)) != 0) return fail_errno(L, "chmod", p);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.lchown(path, uid, gid) -> true | nil, msg, code. Changes the owner of `path`
/// itself (a symlink is not followed). Needs CAP_CHOWN for another user's ids.
static int l_lchown(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  lua_Integer uid = luaL_checkinteger(L, 2), gid = luaL_checkinteger(L, 3);
  luaL_argcheck(L, uid >= 0 && uid <= 0xfffffffe, 2, "not a uid");
  luaL_argcheck(L, gid >= 0 && gid <= 0xfffffffe, 3, "not a gid");
  if (lchown(p, (uid_t)uid, (gid_t)gid) != 0) return fail_errno(L, "lchown", p);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.symlink(target, path) -> true | nil, msg, code. Creates the symbolic link `path`
/// holding `target` (not checked: a link may dangle). An existing `path` fails with EEXIST.
static int l_symlink(lua_State *L) {
  const char *target = luaL_checkstring(L, 1), *p = luaL_checkstring(L, 2);
  if (symlink(target, p) != 0) return fail_errno(L, "symlink", p);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.fs.readlink(path) -> string | nil, msg, code. The target a symbolic link holds, as
/// written (not resolved). A path that is not a link fails with EINVAL.
static int l_readlink(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  char buf[PATH_MAX];
  ssize_t n = readlink(p, buf, sizeof buf);
  if (n < 0) return fail_errno(L, "readlink", p);
  if ((size_t)n >= sizeof buf) return dm_fail(L, "readlink: target too long", "ENAMETOOLONG");
  lua_pushlstring(L, buf, (size_t)n);
  return 1;
}

typedef struct {
  int fd;
} dm_file;

static dm_file *check_file(lua_State *L) {
  dm_file *f = luaL_checkudata(L, 1, FILE_MT);
  luaL_argcheck(L, f->fd >= 0, 1, "file is closed");
  return f;
}

static int push_file(lua_State *L, int fd) {
  dm_file *f = lua_newuserdatauv(L, sizeof *f, 0);
  f->fd = fd;
  luaL_setmetatable(L, FILE_MT);
  return 1;
}

static int open_flags(lua_State *L, const char *mode) {
  if (!strcmp(mode, "r")) return O_RDONLY;
  if (!strcmp(mode, "w")) return O_WRONLY | O_CREAT | O_TRUNC;
  if (!strcmp(mode, "a")) return O_WRONLY | O_CREAT | O_APPEND;
  if (!strcmp(mode, "wx")) return O_WRONLY | O_CREAT | O_EXCL;
  return luaL_error(L, "mode must be 'r', 'w', 'a' or 'wx'");
}

/// core.fs.open(path, mode [, perm=0644]) -> file | nil, msg, code.
/// mode: "r", "w" (truncate), "a" (append) or "wx" (must not exist). Never follows a
/// final symlink.
static int l_open(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  int flags = open_flags(L, luaL_checkstring(L, 2));
  int fd = open(p, flags | O_CLOEXEC | O_NOFOLLOW, (mode_t)luaL_optinteger(L, 3, 0644));
  if (fd < 0) return fail_errno(L, "open", p);
  return push_file(L, fd);
}

/// core.fs.open_beneath(root, relpath) -> file | nil, msg, code. Opens `relpath` for
/// reading only if it lies beneath `root` with no symlink and no ".." on the way
/// (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) and is a
/// regular file (checked before it is opened for data: a FIFO or device is never opened;
/// the descriptor is O_NONBLOCK), so a sandbox that planted a link or a FIFO in its
/// output folder cannot make the host read a file outside it or block.
static int l_open_beneath(lua_State *L) {
  const char *root = luaL_checkstring(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  int dfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return fail_errno(L, "open", root);
  dm_err err;
  int fd = dm_cf_open_file(dfd, rel, DM_CF_READ, 0, NULL, &err);
  close(dfd);
  if (fd < 0) return dm_fail(L, err.msg, err.code);
  return push_file(L, fd);
}

/// file:write(data) -> true | nil, msg, code. Writes all of `data`.
static int l_file_write(lua_State *L) {
  dm_file *f = check_file(L);
  size_t len;
  const char *d = luaL_checklstring(L, 2, &len);
  size_t off = 0;
  while (off < len) {
    ssize_t n = write(f->fd, d + off, len - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail_errno(L, "write", "file");
    }
    off += (size_t)n;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/// file:read([max_bytes [, offset]]) -> string | nil, msg, code. Without offset reads from
/// the current position.
static int l_file_read(lua_State *L) {
  dm_file *f = check_file(L);
  lua_Integer max = luaL_optinteger(L, 2, -1);
  lua_Integer off = luaL_optinteger(L, 3, -1);
  if (read_fd(L, f->fd, off, max, "file")) return fail_errno(L, "read", "file");
  return 1;
}

/// file:size() -> integer | nil, msg, code
static int l_file_size(lua_State *L) {
  dm_file *f = check_file(L);
  struct stat st;
  if (fstat(f->fd, &st) != 0) return fail_errno(L, "fstat", "file");
  lua_pushinteger(L, (lua_Integer)st.st_size);
  return 1;
}

/// file:close() -> nil. Idempotent; also __gc and __close.
static int l_file_close(lua_State *L) {
  dm_file *f = luaL_checkudata(L, 1, FILE_MT);
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  return 0;
}

/* ================================ core.fs.work ================================ */

typedef struct {
  dm_lwork *lw; /* NULL once the work is done */
} work_ud;

static int lwork_call(lua_State *L) {
  dm_lwork *lw = lua_touserdata(L, 1);
  dm_push_ref(L, lw->cb_ref);
  int n = lw->push(L, lw);
  lua_call(L, n, 0);
  return 0;
}

static void lwork_done(dm_work *w) {
  dm_lwork *lw = (dm_lwork *)w;
  lua_State *L = dm_rt.L;
  if (L && lw->ud) ((work_ud *)lw->ud)->lw = NULL; /* after lua_close the handle is gone */
  if (L) {
    lua_pushcfunction(L, lwork_call);
    lua_pushlightuserdata(L, lw);
    dm_call(L, 1);
  }
  dm_unref(L, &lw->cb_ref);
  dm_unref(L, &lw->ud_ref);
  lw->release(lw);
  free(lw);
  dm_handle_count(-1);
}

int dm_lwork_start(lua_State *L, dm_lwork *lw, int cb) {
  luaL_checktype(L, cb, LUA_TFUNCTION);
  work_ud *u = lua_newuserdatauv(L, sizeof *u, 0); /* [.., work] */
  u->lw = lw;
  luaL_setmetatable(L, WORK_MT);
  lua_pushvalue(L, -1);
  lw->ud_ref = dm_ref(L); /* the handle lives while the work is pending */
  lua_pushvalue(L, cb);
  lw->cb_ref = dm_ref(L);
  lw->ud = u;
  lw->w.done = lwork_done;
  atomic_store(&lw->w.cancel, 0);
  dm_handle_count(1);
  dm_work_submit(dm_rt.loop, &lw->w);
  return 1;
}

/// work:cancel() -> nil. Asks the work to stop early; its callback is still called once,
/// later, with nil, "cancelled", "ECANCELED" (unless it had already finished). Work that
/// was stopped half-way cleans up after itself. Does nothing once the work is done.
static int l_work_cancel(lua_State *L) {
  work_ud *u = luaL_checkudata(L, 1, WORK_MT);
  if (u->lw) atomic_store(&u->lw->w.cancel, 1);
  return 0;
}

/* ================================ core.fs.dir ================================ */

typedef struct {
  int fd;
  char *path; /* for messages */
} dm_dir;

static dm_dir *check_dir(lua_State *L, int idx) {
  dm_dir *d = luaL_checkudata(L, idx, DIR_MT);
  luaL_argcheck(L, d->fd >= 0, idx, "folder is closed");
  return d;
}

int dm_fs_check_dir(lua_State *L, int idx, const char **path) {
  dm_dir *d = check_dir(L, idx);
  if (path) *path = d->path;
  return d->fd;
}

int dm_fs_check_file(lua_State *L, int idx) {
  dm_file *f = luaL_checkudata(L, idx, FILE_MT);
  luaL_argcheck(L, f->fd >= 0, idx, "file is closed");
  return f->fd;
}

/* Pushes a dir handle around fd (owned) named `path` (or parent/rel). */
static int push_dir(lua_State *L, int fd, const char *parent, const char *rel) {
  dm_dir *d = lua_newuserdatauv(L, sizeof *d, 0);
  d->fd = -1;
  d->path = NULL;
  luaL_setmetatable(L, DIR_MT);
  size_t n = strlen(parent) + (rel ? strlen(rel) + 1 : 0) + 1;
  d->path = malloc(n);
  if (!d->path) {
    close(fd);
    return luaL_error(L, "out of memory");
  }
  if (rel) snprintf(d->path, n, "%s/%s", parent, rel);
  else snprintf(d->path, n, "%s", parent);
  d->fd = fd;
  return 1;
}

/* nil, "<what> <dir>/<rel>: <reason>", code from errno */
static int fail_at(lua_State *L, const char *what, dm_dir *d, const char *rel, int e) {
  dm_err err;
  char name[PATH_MAX + 64];
  snprintf(name, sizeof name, "%s/%s", d->path, rel && *rel ? rel : ".");
  dm_err_errno(&err, e, what, name);
  return dm_fail(L, err.msg, err.code);
}

static int fail_err(lua_State *L, dm_dir *d, const dm_err *err) {
  lua_pushnil(L);
  lua_pushfstring(L, "%s (in %s)", err->msg, d->path);
  lua_pushstring(L, err->code);
  return 3;
}

/// core.fs.opendir(path) -> dir | nil, msg, code. Opens a folder the host made (an output
/// folder, a run folder) and holds it: every name given to the handle's methods is then
/// resolved below it with no symlink, no ".." and no magic link. A final symlink at `path`
/// is not followed (ELOOP).
static int l_opendir(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return fail_errno(L, "open", p);
  return push_dir(L, fd, p, NULL);
}

/// dir:opendir(rel) -> dir | nil, msg, code: a folder below this one, confined.
static int l_dir_opendir(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  int fd = dm_cf_open_dir(d->fd, rel);
  if (fd < 0) return fail_at(L, "open", d, rel, errno);
  return push_dir(L, fd, d->path, rel);
}

/// dir:open(rel, mode [, perm=0644]) -> file | nil, msg, code. mode "r" (read), "a"
/// (append; created when missing) or "wx" (create; EEXIST when anything is there).
/// Regular files only, type-checked before they are opened; O_NONBLOCK | O_NOFOLLOW.
static int l_dir_open(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  const char *m = luaL_checkstring(L, 3);
  mode_t perm = (mode_t)luaL_optinteger(L, 4, 0644);
  dm_cf_mode mode;
  if (!strcmp(m, "r")) mode = DM_CF_READ;
  else if (!strcmp(m, "a")) mode = DM_CF_APPEND;
  else if (!strcmp(m, "wx")) mode = DM_CF_CREATE;
  else return luaL_argerror(L, 3, "mode must be 'r', 'a' or 'wx'");
  dm_err err;
  int fd = dm_cf_open_file(d->fd, rel, mode, perm, NULL, &err);
  if (fd < 0) return fail_err(L, d, &err);
  return push_file(L, fd);
}

/// dir:read(rel, max_bytes) -> string | nil, msg, code. The whole regular file `rel`, at
/// most max_bytes: a longer one fails with EFBIG (nothing is returned). Confined and
/// non-blocking like dir:open(rel, "r").
static int l_dir_read(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  lua_Integer max = luaL_checkinteger(L, 3);
  luaL_argcheck(L, max >= 0 && max < LUA_MAXINTEGER, 3, "max_bytes must be >= 0");
  dm_err err;
  struct stat st;
  int fd = dm_cf_open_file(d->fd, rel, DM_CF_READ, 0, &st, &err);
  if (fd < 0) return fail_err(L, d, &err);
  if (st.st_size > max) {
    close(fd);
    lua_pushnil(L);
    lua_pushfstring(L, "read %s/%s: %I bytes, more than the %I read at most", d->path, rel, (lua_Integer)st.st_size,
                    max);
    lua_pushliteral(L, "EFBIG");
    return 3;
  }
  int r = read_fd(L, fd, 0, max + 1, rel);
  int e = errno;
  close(fd);
  if (r) return fail_at(L, "read", d, rel, e);
  if ((lua_Integer)lua_rawlen(L, -1) > max) {
    lua_pushnil(L);
    lua_pushfstring(L, "read %s/%s: grew past the %I read at most", d->path, rel, max);
    lua_pushliteral(L, "EFBIG");
    return 3;
  }
  return 1;
}

/// dir:list([rel], max) -> {name...}, more | nil, msg, code. The names in the folder `rel`
/// ("" or none: the held folder itself), at most `max` of them, in the order the file system
/// gives (sort them yourself); `more` is true when the folder holds more. Confined like
/// dir:open (no link followed on the way, the folder itself not a link); reads at most
/// `max` + 1 entries, so a folder of a million names costs no more than one of `max`.
static int l_dir_list(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  int top = lua_gettop(L);
  const char *rel = top >= 3 ? luaL_optstring(L, 2, "") : "";
  lua_Integer max = luaL_checkinteger(L, top >= 3 ? 3 : 2);
  luaL_argcheck(L, max >= 0 && max <= 1000000, top >= 3 ? 3 : 2, "max must be 0 to 1000000");
  int fd = dm_cf_open_dir(d->fd, rel);
  if (fd < 0) return fail_at(L, "list", d, rel, errno);
  DIR *dir = fdopendir(fd);
  if (!dir) {
    int e = errno;
    close(fd);
    return fail_at(L, "list", d, rel, e);
  }
  lua_createtable(L, max < 64 ? (int)max : 64, 0);
  lua_Integer n = 0;
  int more = 0;
  struct dirent *de;
  errno = 0;
  while ((de = readdir(dir)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (n >= max) {
      more = 1;
      break;
    }
    lua_pushstring(L, de->d_name);
    lua_rawseti(L, -2, ++n);
  }
  int e = errno;
  closedir(dir);
  if (!de && e) return fail_at(L, "list", d, rel, e);
  lua_pushboolean(L, more);
  return 2;
}

/// dir:stat([rel]) -> {type, size, mode, mtime, uid} | nil, msg, code. Follows nothing: a
/// symlink at the end is described itself (type "link"); "" or none is the folder itself.
static int l_dir_stat(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_optstring(L, 2, "");
  struct stat st;
  if (dm_cf_lstat(d->fd, rel, &st) != 0) return fail_at(L, "stat", d, rel, errno);
  push_stat(L, &st);
  return 1;
}

/// dir:mkdir(rel [, mode=0755]) -> true | nil, msg, code (EEXIST when something is there).
static int l_dir_mkdir(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  if (dm_cf_mkdir(d->fd, rel, (mode_t)luaL_optinteger(L, 3, 0755)) != 0) return fail_at(L, "mkdir", d, rel, errno);
  lua_pushboolean(L, 1);
  return 1;
}

/// dir:unlink(rel) -> true | nil, msg, code. A file or symlink (not a folder).
static int l_dir_unlink(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  if (dm_cf_unlink(d->fd, rel) != 0) return fail_at(L, "unlink", d, rel, errno);
  lua_pushboolean(L, 1);
  return 1;
}

/// dir:rename(from, to_dir, to [, noreplace]) -> true | nil, msg, code. Moves `from` (below
/// this folder) to `to` below the handle to_dir (may be this one), both confined; with
/// noreplace an existing `to` fails with EEXIST instead of being replaced.
static int l_dir_rename(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *from = luaL_checkstring(L, 2);
  dm_dir *t = check_dir(L, 3);
  const char *to = luaL_checkstring(L, 4);
  if (dm_cf_rename(d->fd, from, t->fd, to, lua_toboolean(L, 5)) != 0) return fail_at(L, "rename", d, from, errno);
  lua_pushboolean(L, 1);
  return 1;
}

/// dir:write_atomic(rel, data [, mode=0644]) -> true | nil, msg, code. A new temporary file
/// (O_EXCL) in the held folder of `rel`, fsynced, renamed over `rel` within that folder.
static int l_dir_write_atomic(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  size_t len;
  const char *data = luaL_checklstring(L, 3, &len);
  dm_err err;
  if (dm_cf_write_atomic(d->fd, rel, data, len, (mode_t)luaL_optinteger(L, 4, 0644), &err) != 0)
    return fail_err(L, d, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/// dir:chmod(rel, mode) -> true | nil, msg, code. Never of or through a symlink (ELOOP).
static int l_dir_chmod(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  if (dm_cf_chmod(d->fd, rel, (mode_t)luaL_checkinteger(L, 3)) != 0) return fail_at(L, "chmod", d, rel, errno);
  lua_pushboolean(L, 1);
  return 1;
}

typedef struct {
  dm_lwork lw;
  int fd;
  char *rel;
  char *path;
  int rc;
  dm_err err;
} rm_job;

static void rm_run(dm_work *w) {
  rm_job *j = (rm_job *)w;
  j->rc = dm_cf_remove_tree(j->fd, j->rel, &j->err);
}

static int rm_push(lua_State *L, dm_lwork *lw) {
  rm_job *j = (rm_job *)lw;
  if (j->rc == 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushfstring(L, "%s (in %s)", j->err.msg, j->path);
  lua_pushstring(L, j->err.code);
  return 3;
}

static void rm_release(dm_lwork *lw) {
  rm_job *j = (rm_job *)lw;
  if (j->fd >= 0) close(j->fd);
  free(j->rel);
  free(j->path);
}

/// dir:remove_tree(rel, callback) -> work | nil, msg, code. Removes `rel` (a file, a link,
/// or a folder with everything in it; "." empties this folder) off the loop, by unlinkat
/// on held folder descriptors: never through a link, at most 32 descriptors held however
/// deep the tree. A missing `rel` is success. callback(true) | callback(nil, msg, code).
static int l_dir_remove_tree(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  if (strcmp(rel, ".") && *rel && dm_cf_check_rel(rel) != 0) return fail_at(L, "remove", d, rel, errno);
  rm_job *j = calloc(1, sizeof *j);
  if (!j) return dm_fail(L, "remove: out of memory", "ENOMEM");
  j->fd = fcntl(d->fd, F_DUPFD_CLOEXEC, 0);
  j->rel = strdup(rel);
  j->path = strdup(d->path);
  if (j->fd < 0 || !j->rel || !j->path) {
    int e = errno;
    rm_release(&j->lw);
    free(j);
    return fail_at(L, "remove", d, rel, e ? e : ENOMEM);
  }
  j->lw.w.run = rm_run;
  j->lw.push = rm_push;
  j->lw.release = rm_release;
  return dm_lwork_start(L, &j->lw, 3);
}

typedef struct {
  dm_lwork lw;
  int fd;
  char *path;
  uint64_t stop_bytes, max_entries;
  unsigned max_depth;
  int rc;
  dm_cf_usage_t u;
  dm_err err;
} usage_job;

static void usage_run(dm_work *w) {
  usage_job *j = (usage_job *)w;
  j->rc = dm_cf_usage(j->fd, j->stop_bytes, j->max_entries, j->max_depth, &w->cancel, &j->u, &j->err);
}

static int usage_push(lua_State *L, dm_lwork *lw) {
  usage_job *j = (usage_job *)lw;
  if (j->rc != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s (in %s)", j->err.msg, j->path);
    lua_pushstring(L, j->err.code);
    return 3;
  }
  lua_createtable(L, 0, 5);
  lua_pushinteger(L, (lua_Integer)j->u.bytes);
  lua_setfield(L, -2, "bytes");
  lua_pushinteger(L, (lua_Integer)j->u.entries);
  lua_setfield(L, -2, "entries");
  lua_pushinteger(L, (lua_Integer)j->u.unreadable);
  lua_setfield(L, -2, "unreadable");
  if (j->u.limit) {
    lua_pushstring(L, j->u.limit);
    lua_setfield(L, -2, "limit");
  }
  if (j->u.where[0]) {
    lua_pushstring(L, j->u.where);
    lua_setfield(L, -2, "where");
  }
  return 1;
}

static void usage_release(dm_lwork *lw) {
  usage_job *j = (usage_job *)lw;
  if (j->fd >= 0) close(j->fd);
  free(j->path);
}

/// dir:usage(opts, callback) -> work | nil, msg, code. Measures, off the loop, the disk
/// space the tree below this folder takes: every entry's allocated blocks (st_blocks * 512:
/// a sparse file counts what it holds, not its length; a file with several hard links
/// once; folders, links and FIFOs their own blocks), never following a link or opening
/// anything but a folder (one descriptor per level). opts: stop_bytes (stop once past it;
/// 0 = never), max_entries (default 1000000), max_depth (folder levels, default and at most
/// 256). callback({bytes, entries, unreadable, limit?, where?}): limit is "bytes",
/// "entries" or "depth" when the walk stopped there (bytes and entries then count what was
/// seen so far); unreadable counts folders the host could not open (where names the
/// first, or the folder too deep); or callback(nil, msg, code).
static int l_dir_usage(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  lua_Integer stop = dm_opt_count(L, 2, "stop_bytes", 0);
  lua_Integer maxe = dm_opt_count(L, 2, "max_entries", 1000000);
  lua_Integer maxd = dm_opt_count(L, 2, "max_depth", DM_TREE_MAX_DEPTH);
  luaL_argcheck(L, maxd <= DM_TREE_MAX_DEPTH, 2, "max_depth must be at most 256");
  usage_job *j = calloc(1, sizeof *j);
  if (!j) return dm_fail(L, "usage: out of memory", "ENOMEM");
  j->fd = fcntl(d->fd, F_DUPFD_CLOEXEC, 0);
  j->path = strdup(d->path);
  if (j->fd < 0 || !j->path) {
    int e = errno;
    usage_release(&j->lw);
    free(j);
    return fail_at(L, "usage", d, "", e ? e : ENOMEM);
  }
  j->stop_bytes = (uint64_t)stop;
  j->max_entries = (uint64_t)maxe;
  j->max_depth = (unsigned)maxd;
  j->lw.w.run = usage_run;
  j->lw.push = usage_push;
  j->lw.release = usage_release;
  return dm_lwork_start(L, &j->lw, 3);
}

/// dir:statvfs() -> {avail_bytes, free_bytes, total_bytes, avail_files} | nil, msg, code.
/// The filesystem that holds this folder (fstatvfs on the held descriptor): avail_bytes is
/// what an unprivileged writer may still use (f_bavail * f_frsize), free_bytes counts the
/// blocks reserved for root too, avail_files the inodes left.
static int l_dir_statvfs(lua_State *L) {
  dm_dir *d = check_dir(L, 1);
  struct statvfs v;
  if (fstatvfs(d->fd, &v) != 0) return fail_at(L, "statvfs", d, "", errno);
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, (lua_Integer)((uint64_t)v.f_bavail * v.f_frsize));
  lua_setfield(L, -2, "avail_bytes");
  lua_pushinteger(L, (lua_Integer)((uint64_t)v.f_bfree * v.f_frsize));
  lua_setfield(L, -2, "free_bytes");
  lua_pushinteger(L, (lua_Integer)((uint64_t)v.f_blocks * v.f_frsize));
  lua_setfield(L, -2, "total_bytes");
  lua_pushinteger(L, (lua_Integer)v.f_favail);
  lua_setfield(L, -2, "avail_files");
  return 1;
}

/// dir:close() -> nil. Idempotent; also __gc and __close.
static int l_dir_close(lua_State *L) {
  dm_dir *d = luaL_checkudata(L, 1, DIR_MT);
  if (d->fd >= 0) close(d->fd);
  d->fd = -1;
  free(d->path);
  d->path = NULL;
  return 0;
}

static const luaL_Reg dir_methods[] = {
  {"opendir", l_dir_opendir},
  {"open", l_dir_open},
  {"read", l_dir_read},
  {"stat", l_dir_stat},
  {"list", l_dir_list},
  {"mkdir", l_dir_mkdir},
  {"unlink", l_dir_unlink},
  {"rename", l_dir_rename},
  {"write_atomic", l_dir_write_atomic},
  {"chmod", l_dir_chmod},
  {"remove_tree", l_dir_remove_tree},
  {"usage", l_dir_usage},
  {"statvfs", l_dir_statvfs},
  {"close", l_dir_close},
  {NULL, NULL},
};
static const luaL_Reg work_methods[] = {{"cancel", l_work_cancel}, {NULL, NULL}};

static const luaL_Reg file_methods[] = {
  {"write", l_file_write}, {"read", l_file_read}, {"size", l_file_size}, {"close", l_file_close}, {NULL, NULL},
};
static const luaL_Reg funcs[] = {
  {"mkdir_p", l_mkdir_p},   {"write_atomic", l_write_atomic},
  {"realpath", l_realpath}, {"stat", l_stat},
  {"lstat", l_lstat},       {"read_file", l_read_file},
  {"readdir", l_readdir},   {"unlink", l_unlink},
  {"rename", l_rename},     {"remove_tree", l_remove_tree},
  {"chmod", l_chmod},       {"lchown", l_lchown},
  {"symlink", l_symlink},   {"readlink", l_readlink},
  {"open", l_open},         {"open_beneath", l_open_beneath},
  {"opendir", l_opendir},   {NULL, NULL},
};

int luaopen_core_fs(lua_State *L) {
  dm_metatable(L, FILE_MT, file_methods, l_file_close, l_file_close);
  dm_metatable(L, DIR_MT, dir_methods, l_dir_close, l_dir_close);
  dm_metatable(L, WORK_MT, work_methods, NULL, NULL);
  luaL_newlib(L, funcs);
  return 1;
}
