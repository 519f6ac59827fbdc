/* Confined file operations below held directory descriptors. See confine.h. */
#include "confine.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RESOLVE_CONFINED (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)

const char *dm_errno_code(int e) {
  switch (e) {
  case ENOENT: return "ENOENT";
  case EACCES: return "EACCES";
  case EPERM: return "EPERM";
  case EEXIST: return "EEXIST";
  case ENOTDIR: return "ENOTDIR";
  case EISDIR: return "EISDIR";
  case ENOTEMPTY: return "ENOTEMPTY";
  case ENOSPC: return "ENOSPC";
  case EDQUOT: return "EDQUOT";
  case EROFS: return "EROFS";
  case ENAMETOOLONG: return "ENAMETOOLONG";
  case ELOOP: return "ELOOP";
  case EMFILE: return "EMFILE";
  case ENFILE: return "ENFILE";
  case ENOMEM: return "ENOMEM";
  case EINVAL: return "EINVAL";
  case EFBIG: return "EFBIG";
  case EXDEV: return "EXDEV";
  case ENXIO: return "ENXIO";
  case EAGAIN: return "EAGAIN";
  case EBUSY: return "EBUSY";
  case ECANCELED: return "ECANCELED";
  case ENOSYS: return "ENOSYS";
  case EBADF: return "EBADF";
  default: return "EIO";
  }
}

void dm_err_set(dm_err *err, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  err->code = code;
}

void dm_err_errno(dm_err *err, int e, const char *what, const char *name) {
  const char *reason = e == ELOOP   ? "a symlink is in the way (never followed)"
                       : e == EXDEV ? "leads outside the folder"
                                    : strerror(e);
  dm_err_set(err, dm_errno_code(e), "%s %s: %s", what, name, reason);
}

const char *dm_cf_type_name(mode_t m) {
  if (S_ISREG(m)) return "file";
  if (S_ISDIR(m)) return "directory";
  if (S_ISLNK(m)) return "symlink";
  if (S_ISFIFO(m)) return "fifo";
  if (S_ISSOCK(m)) return "socket";
  if (S_ISCHR(m)) return "character device";
  if (S_ISBLK(m)) return "block device";
  return "unknown type";
}

int dm_cf_random(void *buf, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t r = getrandom((char *)buf + off, n - off, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    off += (size_t)r;
  }
  return 0;
}

int dm_cf_check_rel(const char *rel) {
  if (!rel || !*rel || rel[0] == '/') {
    errno = EINVAL;
    return -1;
  }
  if (strlen(rel) >= PATH_MAX) {
    errno = ENAMETOOLONG;
    return -1;
  }
  for (const char *p = rel; *p;) {
    const char *s = p;
    while (*p && *p != '/') p++;
    if (p - s == 2 && s[0] == '.' && s[1] == '.') {
      errno = EXDEV;
      return -1;
    }
    if (*p) p++;
  }
  return 0;
}

size_t dm_cf_depth(const char *rel) {
  size_t d = 0;
  for (const char *p = rel; *p;) {
    const char *s = p;
    while (*p && *p != '/') p++;
    size_t n = (size_t)(p - s);
    if (n && !(n == 1 && s[0] == '.')) d++;
    if (*p) p++;
  }
  return d;
}

static int is_self(const char *rel) { return !rel || !*rel || !strcmp(rel, "."); }

static atomic_int no_openat2;

/* The component-by-component walk: every intermediate folder opened O_NOFOLLOW, no "..". */
static int walk_open(int dfd, const char *rel, int flags, mode_t mode) {
  char buf[PATH_MAX];
  if (strlen(rel) >= sizeof buf) {
    errno = ENAMETOOLONG;
    return -1;
  }
  strcpy(buf, rel);
  int cur = dfd;
  char *p = buf;
  for (;;) {
    while (*p == '/') p++;
    char *s = p;
    while (*p && *p != '/') p++;
    int last = 1;
    for (char *q = p; *q; q++)
      if (*q != '/') {
        last = 0;
        break;
      }
    if (*p) *p++ = '\0';
    if (!*s) s = ".";
    if (!strcmp(s, "..")) {
      if (cur != dfd) close(cur);
      errno = EXDEV;
      return -1;
    }
    int fd;
    if (last) fd = openat(cur, s, flags | O_NOFOLLOW | O_CLOEXEC, mode);
    else fd = openat(cur, s, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int e = errno;
    if (cur != dfd) close(cur);
    errno = e;
    if (fd < 0 || last) return fd;
    cur = fd;
  }
}

int dm_cf_openat(int dfd, const char *rel, int flags, mode_t mode) {
  if (is_self(rel)) rel = ".";
  else if (dm_cf_check_rel(rel) != 0) return -1;
  if (!atomic_load(&no_openat2)) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (uint64_t)(flags | O_NOFOLLOW | O_CLOEXEC);
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = RESOLVE_CONFINED;
    for (int tries = 0; tries < 8; tries++) {
      long fd = syscall(SYS_openat2, dfd, rel, &how, sizeof how);
      if (fd >= 0) return (int)fd;
      if (errno == EAGAIN || errno == EINTR) continue; /* a concurrent rename: try again */
      if (errno != ENOSYS) return -1;
      atomic_store(&no_openat2, 1);
      break;
    }
    if (!atomic_load(&no_openat2)) {
      errno = EAGAIN;
      return -1;
    }
  }
  return walk_open(dfd, rel, flags, mode);
}

int dm_cf_open_dir(int dfd, const char *rel) {
  int fd = dm_cf_openat(dfd, rel, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0 && errno == ENOTDIR) { /* a symlink at the end says ENOTDIR: say what it is */
    struct stat st;
    if (dm_cf_lstat(dfd, rel, &st) == 0 && S_ISLNK(st.st_mode)) errno = ELOOP;
    else errno = ENOTDIR;
  }
  return fd;
}

int dm_cf_parent(int dfd, const char *rel, char *base, size_t cap) {
  if (is_self(rel)) {
    errno = EINVAL;
    return -1;
  }
  if (dm_cf_check_rel(rel) != 0) return -1;
  size_t len = strlen(rel);
  while (len > 1 && rel[len - 1] == '/') len--; /* "a/b/" names b */
  size_t b = len;
  while (b > 0 && rel[b - 1] != '/') b--;
  size_t blen = len - b;
  if (blen == 0 || blen >= cap || (blen == 1 && rel[b] == '.')) {
    errno = blen >= cap ? ENAMETOOLONG : EINVAL;
    return -1;
  }
  memcpy(base, rel + b, blen);
  base[blen] = '\0';
  char dir[PATH_MAX];
  memcpy(dir, rel, b);
  dir[b] = '\0';
  return dm_cf_open_dir(dfd, dir);
}

/* Reopens an O_PATH descriptor for data through /proc/self/fd (the inode it holds, not a
 * name that could have been swapped since); -1 with errno ENOENT when /proc is missing. */
static int reopen(int pathfd, int flags) {
  char p[64];
  snprintf(p, sizeof p, "/proc/self/fd/%d", pathfd);
  return open(p, flags | O_CLOEXEC | O_NOCTTY);
}

static int same_file(const struct stat *a, const struct stat *b) {
  return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

static int open_existing(int dfd, const char *rel, int flags, struct stat *st, dm_err *err, const char *what) {
  int pfd = dm_cf_openat(dfd, rel, O_PATH, 0);
  if (pfd < 0) {
    dm_err_errno(err, errno, what, rel);
    return -1;
  }
  struct stat ps;
  if (fstat(pfd, &ps) != 0) {
    dm_err_errno(err, errno, what, rel);
    close(pfd);
    return -1;
  }
  if (!S_ISREG(ps.st_mode)) {
    close(pfd);
    if (S_ISLNK(ps.st_mode)) {
      dm_err_errno(err, ELOOP, what, rel);
      return -1;
    }
    dm_err_set(err, "EINVAL", "%s %s: not a regular file (a %s)", what, rel, dm_cf_type_name(ps.st_mode));
    return -1;
  }
  int fd = reopen(pfd, flags | O_NONBLOCK);
  if (fd < 0 && errno == ENOENT) /* no /proc: open by name, still confined and non-blocking */
    fd = dm_cf_openat(dfd, rel, flags | O_NONBLOCK, 0);
  int e = errno;
  close(pfd);
  if (fd < 0) {
    dm_err_errno(err, e, what, rel);
    return -1;
  }
  struct stat fs;
  if (fstat(fd, &fs) != 0 || !S_ISREG(fs.st_mode) || !same_file(&fs, &ps)) {
    close(fd);
    dm_err_set(err, "EAGAIN", "%s %s: changed while being opened", what, rel);
    return -1;
  }
  if (st) *st = fs;
  return fd;
}

int dm_cf_open_file(int dfd, const char *rel, dm_cf_mode mode, mode_t perm, struct stat *st, dm_err *err) {
  if (is_self(rel) || dm_cf_check_rel(rel) != 0) {
    dm_err_errno(err, is_self(rel) ? EINVAL : errno, "open", rel ? rel : "");
    return -1;
  }
  if (mode == DM_CF_READ) return open_existing(dfd, rel, O_RDONLY, st, err, "open");
  for (int tries = 0; tries < 4; tries++) {
    if (mode == DM_CF_APPEND) {
      int fd = open_existing(dfd, rel, O_WRONLY | O_APPEND, st, err, "open");
      if (fd >= 0 || strcmp(err->code, "ENOENT")) return fd;
    }
    int fd =
      dm_cf_openat(dfd, rel, O_WRONLY | O_CREAT | O_EXCL | O_NONBLOCK | (mode == DM_CF_APPEND ? O_APPEND : 0), perm);
    if (fd < 0) {
      if (errno == EEXIST && mode == DM_CF_APPEND) continue; /* made meanwhile: open that */
      dm_err_errno(err, errno, "create", rel);
      return -1;
    }
    struct stat fs;
    if (fstat(fd, &fs) != 0 || !S_ISREG(fs.st_mode)) {
      close(fd);
      dm_err_set(err, "EAGAIN", "create %s: not a regular file", rel);
      return -1;
    }
    if (st) *st = fs;
    return fd;
  }
  dm_err_set(err, "EAGAIN", "open %s: replaced again and again while being opened", rel);
  return -1;
}

int dm_cf_lstat(int dfd, const char *rel, struct stat *st) {
  int fd = dm_cf_openat(dfd, rel, O_PATH, 0);
  if (fd < 0) return -1;
  int r = fstat(fd, st);
  int e = errno;
  close(fd);
  errno = e;
  return r;
}

int dm_cf_mkdir(int dfd, const char *rel, mode_t mode) {
  char base[NAME_MAX + 1];
  int pfd = dm_cf_parent(dfd, rel, base, sizeof base);
  if (pfd < 0) return -1;
  int r = mkdirat(pfd, base, mode);
  int e = errno;
  close(pfd);
  errno = e;
  return r;
}

int dm_cf_unlink(int dfd, const char *rel) {
  char base[NAME_MAX + 1];
  int pfd = dm_cf_parent(dfd, rel, base, sizeof base);
  if (pfd < 0) return -1;
  int r = unlinkat(pfd, base, 0);
  int e = errno;
  close(pfd);
  errno = e;
  return r;
}

int dm_cf_rename(int from_dfd, const char *from, int to_dfd, const char *to, int noreplace) {
  char fb[NAME_MAX + 1], tb[NAME_MAX + 1];
  int fp = dm_cf_parent(from_dfd, from, fb, sizeof fb);
  if (fp < 0) return -1;
  int tp = dm_cf_parent(to_dfd, to, tb, sizeof tb);
  if (tp < 0) {
    int e = errno;
    close(fp);
    errno = e;
    return -1;
  }
  int r = (int)syscall(SYS_renameat2, fp, fb, tp, tb, noreplace ? RENAME_NOREPLACE : 0);
  int e = errno;
  close(fp);
  close(tp);
  errno = e;
  return r;
}

static int write_all(int fd, const void *data, size_t len) {
  const char *p = data;
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int dm_cf_write_atomic(int dfd, const char *rel, const void *data, size_t len, mode_t mode, dm_err *err) {
  char base[NAME_MAX + 1];
  int pfd = dm_cf_parent(dfd, rel, base, sizeof base);
  if (pfd < 0) {
    dm_err_errno(err, errno, "write", rel ? rel : "");
    return -1;
  }
  unsigned char rnd[8];
  char tmp[64];
  if (dm_cf_random(rnd, sizeof rnd) != 0) {
    dm_err_errno(err, errno, "write", rel);
    close(pfd);
    return -1;
  }
  snprintf(tmp, sizeof tmp, ".dm-%02x%02x%02x%02x%02x%02x%02x%02x.tmp", rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5],
           rnd[6], rnd[7]);
  int fd = openat(pfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  if (fd < 0) {
    dm_err_errno(err, errno, "write", rel);
    close(pfd);
    return -1;
  }
  if (write_all(fd, data, len) != 0 || fsync(fd) != 0) {
    dm_err_errno(err, errno, "write", rel);
    close(fd);
    unlinkat(pfd, tmp, 0);
    close(pfd);
    return -1;
  }
  if (close(fd) != 0) {
    dm_err_errno(err, errno, "write", rel);
    unlinkat(pfd, tmp, 0);
    close(pfd);
    return -1;
  }
  if (renameat(pfd, tmp, pfd, base) != 0) {
    dm_err_errno(err, errno, "rename", rel);
    unlinkat(pfd, tmp, 0);
    close(pfd);
    return -1;
  }
  close(pfd);
  return 0;
}

int dm_cf_chmod(int dfd, const char *rel, mode_t mode) {
  int fd = dm_cf_openat(dfd, rel, O_PATH, 0);
  if (fd < 0) return -1;
  struct stat st;
  int r = fstat(fd, &st);
  if (r == 0 && S_ISLNK(st.st_mode)) {
    errno = ELOOP;
    r = -1;
  }
  if (r == 0) {
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    r = chmod(p, mode);
  }
  int e = errno;
  close(fd);
  errno = e;
  return r;
}

/* ================================ tree removal ================================ */

/* One level of the removal: a folder being emptied, and its name in the level above. */
typedef struct {
  DIR *d;
  char name[NAME_MAX + 1];
  int reopened; /* times it was found non-empty after it was emptied */
} rm_level;

/* Removes the entry `n` of the folder `fd` when it is not a folder or is an empty one.
 * Returns 1 when gone, 0 when it is a non-empty folder, -1/errno on failure. */
static int rm_entry(int fd, const char *n, unsigned char type) {
  if (type != DT_DIR) {
    if (unlinkat(fd, n, 0) == 0 || errno == ENOENT) return 1;
    if (errno != EISDIR && errno != EPERM) return -1; /* EPERM: some systems say so for folders */
  }
  if (unlinkat(fd, n, AT_REMOVEDIR) == 0 || errno == ENOENT) return 1;
  if (errno == ENOTDIR) return unlinkat(fd, n, 0) == 0 || errno == ENOENT ? 1 : -1; /* swapped for a file */
  if (errno == ENOTEMPTY || errno == EEXIST) return 0;
  return -1;
}

int dm_cf_remove_contents(int folder, dm_err *err) {
  rm_level st[DM_CF_RM_FDS];
  int depth = 0, rc = 0;
  unsigned long long moved = 0, passes = 0;
  int root = dup(folder);
  if (root < 0 || !(st[0].d = fdopendir(root))) {
    dm_err_errno(err, errno, "remove", "(folder)");
    if (root >= 0) close(root);
    return -1;
  }
  st[0].name[0] = '\0';
  st[0].reopened = 0;
  int rootfd = folder; /* deep subtrees are moved up here */
  while (depth >= 0) {
    rm_level *top = &st[depth];
    int tfd = dirfd(top->d);
    errno = 0;
    struct dirent *e = readdir(top->d);
    if (!e) {
      if (errno) {
        dm_err_errno(err, errno, "remove: read folder", depth ? top->name : "(top)");
        rc = -1;
        break;
      }
      if (depth == 0) {
        /* entries moved up (or made by someone racing us) show up on another pass */
        rewinddir(top->d);
        int more = 0;
        while ((e = readdir(top->d)))
          if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            more = 1;
            break;
          }
        if (!more) break;
        if (++passes > 64 + moved) {
          dm_err_set(err, "ENOTEMPTY", "remove: the folder keeps filling up while it is removed");
          rc = -1;
          break;
        }
        rewinddir(top->d);
        continue;
      }
      char name[NAME_MAX + 1];
      memcpy(name, top->name, sizeof name);
      int reopened = top->reopened;
      closedir(top->d);
      depth--;
      int pfd = dirfd(st[depth].d);
      int r = rm_entry(pfd, name, DT_DIR);
      if (r < 0) {
        dm_err_errno(err, errno, "remove", name);
        rc = -1;
        break;
      }
      if (r == 0) { /* filled again while we emptied it: take it once more */
        if (reopened >= 8) {
          dm_err_set(err, "ENOTEMPTY", "remove %s: keeps filling up while it is removed", name);
          rc = -1;
          break;
        }
        int cfd = openat(pfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *cd = cfd >= 0 ? fdopendir(cfd) : NULL;
        if (!cd) {
          if (cfd >= 0) close(cfd);
          if (errno == ENOENT) continue;
          dm_err_errno(err, errno, "remove", name);
          rc = -1;
          break;
        }
        depth++;
        st[depth].d = cd;
        memcpy(st[depth].name, name, sizeof name);
        st[depth].reopened = reopened + 1;
      }
      continue;
    }
    const char *n = e->d_name;
    if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
    int r = rm_entry(tfd, n, e->d_type);
    if (r == 1) continue;
    if (r < 0) {
      dm_err_errno(err, errno, "remove", n);
      rc = -1;
      break;
    }
    if (depth + 1 < DM_CF_RM_FDS) {
      int cfd = openat(tfd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      DIR *cd = cfd >= 0 ? fdopendir(cfd) : NULL;
      if (!cd) {
        int ee = errno;
        if (cfd >= 0) close(cfd);
        if (ee == ENOENT) continue;
        if (ee == ELOOP || ee == ENOTDIR) { /* swapped for a link or a file meanwhile */
          if (unlinkat(tfd, n, 0) == 0 || errno == ENOENT) continue;
          ee = errno;
        }
        dm_err_errno(err, ee, "remove", n);
        rc = -1;
        break;
      }
      depth++;
      st[depth].d = cd;
      snprintf(st[depth].name, sizeof st[depth].name, "%s", n);
      st[depth].reopened = 0;
    } else {
      /* deeper than the descriptors we hold: move it up to the top (it never leaves the
       * tree) and take it from there on a later pass */
      unsigned char rnd[6];
      char tmp[64];
      dm_cf_random(rnd, sizeof rnd);
      snprintf(tmp, sizeof tmp, ".dm-rm-%llu-%02x%02x%02x%02x%02x%02x", moved, rnd[0], rnd[1], rnd[2], rnd[3], rnd[4],
               rnd[5]);
      if (renameat(tfd, n, rootfd, tmp) != 0 && errno != ENOENT) {
        dm_err_errno(err, errno, "remove: move up", n);
        rc = -1;
        break;
      }
      moved++;
    }
  }
  for (; depth >= 0; depth--) closedir(st[depth].d);
  return rc;
}

int dm_cf_remove_tree(int dfd, const char *rel, dm_err *err) {
  if (is_self(rel)) return dm_cf_remove_contents(dfd, err);
  char base[NAME_MAX + 1];
  int pfd = dm_cf_parent(dfd, rel, base, sizeof base);
  if (pfd < 0) {
    if (errno == ENOENT) return 0;
    dm_err_errno(err, errno, "remove", rel);
    return -1;
  }
  int rc = 0;
  for (int tries = 0;; tries++) {
    int r = rm_entry(pfd, base, DT_UNKNOWN);
    if (r == 1) break;
    if (r < 0) {
      dm_err_errno(err, errno, "remove", rel);
      rc = -1;
      break;
    }
    if (tries >= 8) {
      dm_err_set(err, "ENOTEMPTY", "remove %s: keeps filling up while it is removed", rel);
      rc = -1;
      break;
    }
    int fd = openat(pfd, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) break;
      if (errno == ELOOP || errno == ENOTDIR) continue; /* swapped: rm_entry takes it */
      dm_err_errno(err, errno, "remove", rel);
      rc = -1;
      break;
    }
    dm_err sub;
    int c = dm_cf_remove_contents(fd, &sub);
    close(fd);
    if (c != 0) {
      dm_err_set(err, sub.code, "%s (in %s)", sub.msg, rel);
      rc = -1;
      break;
    }
  }
  close(pfd);
  return rc;
}

/* ================================ tree usage ================================ */

/* A set of (dev, ino) of the files with several links seen so far: open addressing. */
typedef struct {
  uint64_t *keys; /* pairs: dev, ino; 0/0 = empty (no real file has inode 0) */
  size_t cap, n;
} ino_set;

/* Adds (dev, ino); returns 1 when it was new, 0 when seen, -1 out of memory. */
static int ino_add(ino_set *s, uint64_t dev, uint64_t ino) {
  if ((s->n + 1) * 2 > s->cap) {
    size_t nc = s->cap ? s->cap * 2 : 256;
    uint64_t *nk = calloc(nc, 2 * sizeof *nk);
    if (!nk) return -1;
    for (size_t i = 0; i < s->cap; i++) {
      if (!s->keys[2 * i + 1]) continue;
      size_t h = (size_t)((s->keys[2 * i] * 0x9e3779b97f4a7c15ull) ^ s->keys[2 * i + 1]) & (nc - 1);
      while (nk[2 * h + 1]) h = (h + 1) & (nc - 1);
      nk[2 * h] = s->keys[2 * i];
      nk[2 * h + 1] = s->keys[2 * i + 1];
    }
    free(s->keys);
    s->keys = nk;
    s->cap = nc;
  }
  if (!ino) ino = ~0ull; /* never the empty mark */
  size_t h = (size_t)((dev * 0x9e3779b97f4a7c15ull) ^ ino) & (s->cap - 1);
  while (s->keys[2 * h + 1]) {
    if (s->keys[2 * h] == dev && s->keys[2 * h + 1] == ino) return 0;
    h = (h + 1) & (s->cap - 1);
  }
  s->keys[2 * h] = dev;
  s->keys[2 * h + 1] = ino;
  s->n++;
  return 1;
}

typedef struct {
  uint64_t stop_bytes, max_entries;
  unsigned max_depth;
  atomic_int *cancel;
  dm_cf_usage_t *u;
  dm_err *err;
  ino_set links;
  char path[PATH_MAX]; /* the folder being walked, relative, for `where` */
} usage_walk;

static void usage_where(usage_walk *w, const char *n) {
  if (w->u->where[0]) return;
  if (snprintf(w->u->where, sizeof w->u->where, "%s%s%s", w->path, *w->path ? "/" : "", n) >= (int)sizeof w->u->where)
    memcpy(w->u->where + sizeof w->u->where - 4, "...", 4); /* cut */
}

/* Adds up the entries of the folder fd (owned: closed here), `depth` levels down.
 * Returns 0 (also when a limit stopped it), -1 with w->err filled. */
static int usage_dir(usage_walk *w, int fd, unsigned depth) {
  DIR *d = fdopendir(fd);
  if (!d) {
    dm_err_errno(w->err, errno, "read folder", *w->path ? w->path : ".");
    close(fd);
    return -1;
  }
  int rc = 0;
  size_t plen = strlen(w->path);
  while (!w->u->limit) {
    errno = 0;
    struct dirent *e = readdir(d);
    if (!e) {
      if (errno) {
        dm_err_errno(w->err, errno, "read folder", *w->path ? w->path : ".");
        rc = -1;
      }
      break;
    }
    const char *n = e->d_name;
    if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
    if (w->cancel && atomic_load(w->cancel)) {
      dm_err_set(w->err, "ECANCELED", "cancelled");
      rc = -1;
      break;
    }
    struct stat st;
    if (fstatat(fd, n, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue; /* gone meanwhile */
      dm_err_errno(w->err, errno, "stat", n);
      rc = -1;
      break;
    }
    if (++w->u->entries > w->max_entries) {
      w->u->limit = "entries";
      break;
    }
    int once = 1;
    if (!S_ISDIR(st.st_mode) && st.st_nlink > 1) {
      once = ino_add(&w->links, (uint64_t)st.st_dev, (uint64_t)st.st_ino);
      if (once < 0) {
        dm_err_set(w->err, "ENOMEM", "out of memory");
        rc = -1;
        break;
      }
    }
    if (once) w->u->bytes += (uint64_t)st.st_blocks * 512u;
    if (w->stop_bytes && w->u->bytes > w->stop_bytes) {
      w->u->limit = "bytes";
      break;
    }
    if (!S_ISDIR(st.st_mode)) continue;
    if (depth + 1 > w->max_depth) {
      usage_where(w, n);
      w->u->limit = "depth";
      break;
    }
    int cfd = openat(fd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat cst;
    if (cfd >= 0 && (fstat(cfd, &cst) != 0 || cst.st_dev != st.st_dev || cst.st_ino != st.st_ino)) {
      close(cfd); /* swapped since it was listed: taken for what it was */
      continue;
    }
    if (cfd < 0) {
      if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) continue; /* gone or swapped meanwhile */
      if (errno == EACCES || errno == EPERM) {
        w->u->unreadable++;
        usage_where(w, n);
        continue;
      }
      dm_err_errno(w->err, errno, "open", n);
      rc = -1;
      break;
    }
    size_t nl = strlen(n);
    if (plen + 1 + nl < sizeof w->path) {
      if (plen) w->path[plen] = '/';
      memcpy(w->path + plen + (plen ? 1 : 0), n, nl + 1);
    }
    rc = usage_dir(w, cfd, depth + 1);
    w->path[plen] = '\0';
    if (rc != 0) break;
  }
  closedir(d);
  return rc;
}

int dm_cf_usage(int dfd, uint64_t stop_bytes, uint64_t max_entries, unsigned max_depth, atomic_int *cancel,
                dm_cf_usage_t *u, dm_err *err) {
  memset(u, 0, sizeof *u);
  usage_walk w = {.stop_bytes = stop_bytes,
                  .max_entries = max_entries,
                  .max_depth = max_depth > DM_TREE_MAX_DEPTH ? DM_TREE_MAX_DEPTH : max_depth,
                  .cancel = cancel,
                  .u = u,
                  .err = err};
  w.path[0] = '\0';
  /* a descriptor of its own (not a dup: readdir would share the held one's offset) */
  int fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    dm_err_errno(err, errno, "read folder", ".");
    return -1;
  }
  int rc = usage_dir(&w, fd, 0);
  free(w.links.keys);
  return rc;
}
