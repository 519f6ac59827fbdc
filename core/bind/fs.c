/* core.fs: synchronous filesystem helpers (local, short operations on the loop thread). */
#include "runtime.h"
#include "bind/bind.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FILE_MT "core.fs.file"

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

/// core.fs.write_atomic(path, data [, mode=0644]) -> true | nil, msg, code.
/// Writes to a temporary file in the same folder, fsyncs, then renames over `path`:
/// readers see the old or the new contents, never a half-written file.
static int l_write_atomic(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  mode_t mode = (mode_t)luaL_optinteger(L, 3, 0644);
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", p, (int)getpid()) >= (int)sizeof tmp)
    return dm_fail(L, "write: path too long", "ENAMETOOLONG");
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
  if (fd < 0) return fail_errno(L, "write", tmp);
  size_t off = 0;
  while (off < len) {
    ssize_t n = write(fd, data + off, len - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      unlink(tmp);
      errno = e;
      return fail_errno(L, "write", tmp);
    }
    off += (size_t)n;
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    unlink(tmp);
    return fail_errno(L, "write", tmp);
  }
  if (rename(tmp, p) != 0) {
    int e = errno;
    unlink(tmp);
    errno = e;
    return fail_errno(L, "rename", p);
  }
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
  const char *t = S_ISREG(st->st_mode)   ? "file"
                  : S_ISDIR(st->st_mode) ? "directory"
                  : S_ISLNK(st->st_mode) ? "link"
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

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
  return remove(p);
}

/// core.fs.remove_tree(path) -> true | nil, msg, code. Removes a file or a folder with
/// everything in it; symlinks are removed, never followed. A missing path is fine.
static int l_remove_tree(lua_State *L) {
  const char *p = luaL_checkstring(L, 1);
  struct stat st;
  if (lstat(p, &st) != 0 && errno == ENOENT) {
    lua_pushboolean(L, 1);
    return 1;
  }
  if (nftw(p, rm_entry, 32, FTW_DEPTH | FTW_PHYS) != 0) return fail_errno(L, "remove", p);
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
/// (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), so a sandbox that planted a link in its
/// output folder cannot make the host read a file outside it.
static int l_open_beneath(lua_State *L) {
  const char *root = luaL_checkstring(L, 1);
  const char *rel = luaL_checkstring(L, 2);
  int dfd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return fail_errno(L, "open", root);
  struct open_how how;
  memset(&how, 0, sizeof how);
  how.flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  int fd = (int)syscall(SYS_openat2, dfd, rel, &how, sizeof how);
  int e = errno;
  close(dfd);
  errno = e;
  if (fd < 0) return fail_errno(L, "open", rel);
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return dm_fail(L, "open: not a regular file", "EINVAL");
  }
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

static const luaL_Reg file_methods[] = {
  {"write", l_file_write}, {"read", l_file_read}, {"size", l_file_size},
  {"close", l_file_close}, {NULL, NULL},
};
static const luaL_Reg funcs[] = {
  {"mkdir_p", l_mkdir_p}, {"write_atomic", l_write_atomic}, {"realpath", l_realpath},
  {"stat", l_stat}, {"lstat", l_lstat}, {"read_file", l_read_file}, {"readdir", l_readdir},
  {"unlink", l_unlink}, {"rename", l_rename}, {"remove_tree", l_remove_tree},
  {"chmod", l_chmod}, {"lchown", l_lchown}, {"open", l_open}, {"open_beneath", l_open_beneath}, {NULL, NULL},
};

int luaopen_core_fs(lua_State *L) {
  luaL_newmetatable(L, FILE_MT);
  luaL_newlib(L, file_methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, l_file_close);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, l_file_close);
  lua_setfield(L, -2, "__close");
  lua_pop(L, 1);
  luaL_newlib(L, funcs);
  return 1;
}
