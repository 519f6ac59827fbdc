/* Tar pack / extract / list with libarchive. See archive.h for the contract.
 *
 * Extraction is defended in two layers: our own checks on every header (names, types,
 * link targets, writes through links) and a post-pass that resolves every extracted
 * symlink the way the kernel would, then libarchive's ARCHIVE_EXTRACT_SECURE_* flags
 * underneath. libarchive's NOABSOLUTEPATHS check needs relative names, so extraction runs
 * with the working directory set to the destination (fchdir there and back; nothing else
 * in the process resolves relative paths while this synchronous call runs).
 */
#define DM_ARCHIVE_LIBARCHIVE
#include <archive.h> /* this engine's header, then libarchive's (see archive.h) */
#include <archive_entry.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 65536

static const char *errno_code(int e) {
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
  default: return "EIO";
  }
}

static void set_err(dm_archive_err *err, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(dm_archive_err *err, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  err->code = code;
}

static void set_errno(dm_archive_err *err, int e, const char *what, const char *path) {
  set_err(err, errno_code(e), "%s %s: %s", what, path, strerror(e));
}

/* libarchive failure: an errno name when it carries one, else `fallback` */
static void set_archive_err(dm_archive_err *err, struct archive *a, const char *fallback,
                            const char *what) {
  int e = archive_errno(a);
  const char *s = archive_error_string(a);
  const char *code = fallback;
  /* libarchive's private "file format" and "programmer" codes are EILSEQ and EINVAL */
  if (e > 0 && e != EILSEQ && e != EINVAL) code = errno_code(e);
  set_err(err, code, "%s: %s", what, s ? s : "archive error");
}

/* Normalises a relative archive name into out: drops "" and "." components.
 * Returns 0, or -1 if the name is absolute or has a ".." component (or is too long). */
static int normalize(const char *in, char *out, size_t outlen) {
  if (!in || in[0] == '/') return -1;
  size_t o = 0;
  const char *p = in;
  while (*p) {
    const char *s = p;
    while (*p && *p != '/') p++;
    size_t n = (size_t)(p - s);
    if (*p) p++;
    if (n == 0 || (n == 1 && s[0] == '.')) continue;
    if (n == 2 && s[0] == '.' && s[1] == '.') return -1;
    if (o + n + 2 > outlen) return -1;
    if (o) out[o++] = '/';
    memcpy(out + o, s, n);
    o += n;
  }
  out[o] = '\0';
  return 0;
}

/* ================================ pack ================================ */

typedef struct {
  struct archive *a;
  dm_archive_stats *st;
  dm_archive_err *err;
  dev_t out_dev;
  ino_t out_ino;
  char *buf;
} packer;

static int write_header(packer *p, struct archive_entry *e, const char *name) {
  if (archive_write_header(p->a, e) != ARCHIVE_OK) {
    set_archive_err(p->err, p->a, "EIO", name);
    return -1;
  }
  return 0;
}

static int write_data(packer *p, const char *data, size_t len, const char *name) {
  while (len) {
    la_ssize_t w = archive_write_data(p->a, data, len);
    if (w <= 0) {
      set_archive_err(p->err, p->a, "EIO", name);
      return -1;
    }
    data += w;
    len -= (size_t)w;
  }
  return 0;
}

static struct archive_entry *new_entry(const char *name, const struct stat *st, mode_t type) {
  struct archive_entry *e = archive_entry_new();
  if (!e) return NULL;
  archive_entry_copy_pathname(e, name);
  archive_entry_set_filetype(e, type);
  archive_entry_set_perm(e, st->st_mode & 07777);
  archive_entry_set_uid(e, st->st_uid);
  archive_entry_set_gid(e, st->st_gid);
  archive_entry_set_mtime(e, st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
  return e;
}

static int pack_file(packer *p, const char *src, const char *name, const struct stat *lst) {
  int fd = open(src, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    set_errno(p->err, errno, "open", src);
    if (fd >= 0) close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode) || st.st_ino != lst->st_ino || st.st_dev != lst->st_dev) {
    close(fd);
    set_err(p->err, "EAGAIN", "%s: changed while being packed", src);
    return -1;
  }
  struct archive_entry *e = new_entry(name, &st, AE_IFREG);
  if (!e) {
    close(fd);
    set_err(p->err, "ENOMEM", "out of memory");
    return -1;
  }
  archive_entry_set_size(e, st.st_size);
  int rc = write_header(p, e, name);
  archive_entry_free(e);
  off_t left = st.st_size;
  while (rc == 0 && left > 0) {
    ssize_t n = read(fd, p->buf, left < BLOCK ? (size_t)left : BLOCK);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      set_errno(p->err, errno, "read", src);
      rc = -1;
    } else if (n == 0) {
      set_err(p->err, "EAGAIN", "%s: shrank while being packed", src);
      rc = -1;
    } else {
      rc = write_data(p, p->buf, (size_t)n, name);
      left -= n;
    }
  }
  close(fd);
  if (rc == 0) {
    p->st->files++;
    p->st->bytes += (uint64_t)st.st_size;
  }
  return rc;
}

static int pack_path(packer *p, const char *src, const char *name);

static int pack_dir(packer *p, const char *src, const char *name, const struct stat *st) {
  if (*name) {
    struct archive_entry *e = new_entry(name, st, AE_IFDIR);
    if (!e) {
      set_err(p->err, "ENOMEM", "out of memory");
      return -1;
    }
    int rc = write_header(p, e, name);
    archive_entry_free(e);
    if (rc) return rc;
  }
  struct dirent **list;
  int n = scandir(src, &list, NULL, alphasort);
  if (n < 0) {
    set_errno(p->err, errno, "scandir", src);
    return -1;
  }
  int rc = 0;
  for (int i = 0; i < n; i++) {
    const char *d = list[i]->d_name;
    if (rc == 0 && strcmp(d, ".") && strcmp(d, "..")) {
      size_t sl = strlen(src) + strlen(d) + 2, nl = strlen(name) + strlen(d) + 2;
      char *csrc = malloc(sl), *cname = malloc(nl);
      if (!csrc || !cname) {
        set_err(p->err, "ENOMEM", "out of memory");
        rc = -1;
      } else {
        snprintf(csrc, sl, "%s/%s", src, d);
        if (*name) snprintf(cname, nl, "%s/%s", name, d);
        else snprintf(cname, nl, "%s", d);
        rc = pack_path(p, csrc, cname);
      }
      free(csrc);
      free(cname);
    }
    free(list[i]);
  }
  free(list);
  return rc;
}

static int pack_path(packer *p, const char *src, const char *name) {
  struct stat st;
  if (lstat(src, &st) != 0) {
    set_errno(p->err, errno, "lstat", src);
    return -1;
  }
  if (st.st_dev == p->out_dev && st.st_ino == p->out_ino) return 0; /* the output itself */
  if (S_ISDIR(st.st_mode)) return pack_dir(p, src, name, &st);
  if (!*name) {
    set_err(p->err, "EINVAL", "%s: an empty archive name is only allowed for a folder", src);
    return -1;
  }
  if (S_ISREG(st.st_mode)) return pack_file(p, src, name, &st);
  if (!S_ISLNK(st.st_mode)) return 0; /* sockets, devices, fifos: skipped */
  char target[PATH_MAX];
  ssize_t n = readlink(src, target, sizeof target - 1);
  if (n < 0) {
    set_errno(p->err, errno, "readlink", src);
    return -1;
  }
  target[n] = '\0';
  struct archive_entry *e = new_entry(name, &st, AE_IFLNK);
  if (!e) {
    set_err(p->err, "ENOMEM", "out of memory");
    return -1;
  }
  archive_entry_set_perm(e, 0777);
  archive_entry_copy_symlink(e, target);
  int rc = write_header(p, e, name);
  archive_entry_free(e);
  return rc;
}

static int pack_data(packer *p, const dm_archive_entry *en, const char *name) {
  if (!*name) {
    set_err(p->err, "EINVAL", "in-memory entry: the name must not be empty");
    return -1;
  }
  struct archive_entry *e = archive_entry_new();
  if (!e) {
    set_err(p->err, "ENOMEM", "out of memory");
    return -1;
  }
  archive_entry_copy_pathname(e, name);
  archive_entry_set_filetype(e, AE_IFREG);
  archive_entry_set_perm(e, (mode_t)(en->mode & 07777));
  archive_entry_set_size(e, (la_int64_t)en->data_len);
  archive_entry_set_mtime(e, time(NULL), 0);
  int rc = write_header(p, e, name);
  archive_entry_free(e);
  if (rc == 0 && en->data_len) rc = write_data(p, en->data, en->data_len, name);
  if (rc == 0) {
    p->st->files++;
    p->st->bytes += en->data_len;
  }
  return rc;
}

int dm_archive_pack(const char *out_path, const dm_archive_entry *entries, size_t n,
                    dm_archive_stats *st, dm_archive_err *err) {
  memset(st, 0, sizeof *st);
  int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    set_errno(err, errno, "open", out_path);
    return -1;
  }
  packer p = {0};
  p.st = st;
  p.err = err;
  struct stat ost;
  fstat(fd, &ost);
  p.out_dev = ost.st_dev;
  p.out_ino = ost.st_ino;
  p.buf = malloc(BLOCK);
  p.a = archive_write_new();
  int rc = 0;
  if (!p.buf || !p.a) {
    set_err(err, "ENOMEM", "out of memory");
    rc = -1;
  } else if (archive_write_set_format_pax_restricted(p.a) != ARCHIVE_OK ||
             // names as the bytes they are: a file name that is not UTF-8 is still a
             // valid name on Linux (pax "hdrcharset=BINARY", POSIX.1-2008 pax format)
             archive_write_set_format_option(p.a, "pax", "hdrcharset", "BINARY") != ARCHIVE_OK ||
             archive_write_open_fd(p.a, fd) != ARCHIVE_OK) {
    set_archive_err(err, p.a, "EIO", out_path);
    rc = -1;
  }
  char name[PATH_MAX];
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const dm_archive_entry *en = &entries[i];
    if (normalize(en->name, name, sizeof name) != 0) {
      set_err(err, "EINVAL", "entry %zu: name '%s' must be relative without '..'", i + 1,
              en->name ? en->name : "(null)");
      rc = -1;
    } else if (en->src) {
      rc = pack_path(&p, en->src, name);
    } else {
      rc = pack_data(&p, en, name);
    }
  }
  if (p.a) {
    if (rc == 0 && archive_write_close(p.a) != ARCHIVE_OK) {
      set_archive_err(err, p.a, "EIO", out_path);
      rc = -1;
    }
    archive_write_free(p.a);
  }
  free(p.buf);
  if (close(fd) != 0 && rc == 0) {
    set_errno(err, errno, "close", out_path);
    rc = -1;
  }
  if (rc != 0) unlink(out_path);
  return rc;
}

/* ================================ extract ================================ */

/* Removes everything below `root`, and `root` too when `self` is set. */
static int rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  if (ftw->level == 0) return 0;
  remove(path);
  return 0;
}

static void remove_tree(const char *root, int self) {
  nftw(root, rm_cb, 32, FTW_DEPTH | FTW_PHYS);
  if (self) rmdir(root);
}

static int dir_is_empty(const char *path, int *is_empty) {
  DIR *d = opendir(path);
  if (!d) return -1;
  struct dirent *de;
  *is_empty = 1;
  while ((de = readdir(d)))
    if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
      *is_empty = 0;
      break;
    }
  closedir(d);
  return 0;
}

static size_t depth_of(const char *rel) {
  size_t d = 0;
  for (const char *p = rel; *p; p++)
    if (*p == '/') d++;
  return *rel ? d + 1 : 0;
}

/* Does `target`, read in the folder `dir` (normalised, "" = root), stay below the root
 * when taken literally (no link on the way)? */
static int lexically_inside(const char *dir, const char *target) {
  long depth = (long)depth_of(dir);
  const char *p = target;
  while (*p) {
    const char *s = p;
    while (*p && *p != '/') p++;
    size_t n = (size_t)(p - s);
    if (*p) p++;
    if (n == 0 || (n == 1 && s[0] == '.')) continue;
    if (n == 2 && s[0] == '.' && s[1] == '.') {
      if (--depth < 0) return 0;
    } else {
      depth++;
    }
  }
  return 1;
}

/* Resolves `rel` below the folder `dfd` the way the kernel would, following every
 * symlink on the way (components that do not exist are taken literally). Returns 1 when
 * it stays below dfd, 0 when it leaves it, points at an absolute path or loops. */
static int resolves_inside(int dfd, const char *rel) {
  char cur[PATH_MAX] = "";
  size_t cl = 0;
  char *pending = strdup(rel);
  if (!pending) return 0;
  size_t pi = 0;
  int follows = 0, missing = 0, inside = 1;
  while (pending[pi]) {
    const char *s = pending + pi;
    size_t n = strcspn(s, "/");
    pi += n + (s[n] == '/');
    if (n == 0 || (n == 1 && s[0] == '.')) continue;
    if (n == 2 && s[0] == '.' && s[1] == '.') {
      if (cl == 0) {
        inside = 0;
        break;
      }
      while (cl && cur[cl - 1] != '/') cl--;
      if (cl) cl--;
      cur[cl] = '\0';
      continue;
    }
    size_t before = cl;
    if (cl + n + 2 > sizeof cur) {
      inside = 0;
      break;
    }
    if (cl) cur[cl++] = '/';
    memcpy(cur + cl, s, n);
    cl += n;
    cur[cl] = '\0';
    if (missing) continue;
    struct stat st;
    if (fstatat(dfd, cur, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      missing = 1;
      continue;
    }
    if (!S_ISLNK(st.st_mode)) continue;
    char target[PATH_MAX];
    ssize_t tl = readlinkat(dfd, cur, target, sizeof target - 1);
    if (tl <= 0 || ++follows > 40) {
      inside = 0;
      break;
    }
    target[tl] = '\0';
    if (target[0] == '/') {
      inside = 0;
      break;
    }
    cl = before; /* the link's folder; continue with target + the rest */
    cur[cl] = '\0';
    const char *rest = pending + pi;
    size_t nl = (size_t)tl + strlen(rest) + 2;
    char *np = malloc(nl);
    if (!np) {
      inside = 0;
      break;
    }
    snprintf(np, nl, "%s/%s", target, rest);
    free(pending);
    pending = np;
    pi = 0;
  }
  free(pending);
  return inside;
}

typedef struct {
  char **v;
  size_t n, cap;
} strvec;

static int strvec_push(strvec *sv, const char *s) {
  if (sv->n == sv->cap) {
    size_t cap = sv->cap ? sv->cap * 2 : 64;
    char **nv = realloc(sv->v, cap * sizeof *nv);
    if (!nv) return -1;
    sv->v = nv;
    sv->cap = cap;
  }
  char *d = strdup(s);
  if (!d) return -1;
  sv->v[sv->n++] = d;
  return 0;
}

void dm_archive_names_free(char **names, size_t n) {
  if (!names) return;
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
}

static int open_reader(struct archive **out, const char *tar_path, dm_archive_err *err) {
  struct archive *a = archive_read_new();
  if (!a) {
    set_err(err, "ENOMEM", "out of memory");
    return -1;
  }
  archive_read_support_format_tar(a);
  archive_read_support_filter_gzip(a);
  if (archive_read_open_filename(a, tar_path, BLOCK) != ARCHIVE_OK) {
    set_archive_err(err, a, "EARCHIVE", tar_path);
    archive_read_free(a);
    return -1;
  }
  *out = a;
  return 0;
}

/* The one place that refuses an entry: checks that need no disk state. */
static int check_entry(struct archive_entry *e, const char *raw, char *rel, size_t rlen,
                       dm_archive_err *err) {
  if (!raw || !*raw) {
    set_err(err, "EUNSAFE", "unsafe entry: empty name");
    return -1;
  }
  if (raw[0] == '/') {
    set_err(err, "EUNSAFE", "unsafe entry '%s': absolute name", raw);
    return -1;
  }
  if (normalize(raw, rel, rlen) != 0) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': '..' component", raw);
    return -1;
  }
  mode_t t = archive_entry_filetype(e);
  if (t != AE_IFREG && t != AE_IFDIR && t != AE_IFLNK) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': devices, fifos and sockets are refused", raw);
    return -1;
  }
  if (!*rel && t != AE_IFDIR) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': names the destination itself", raw);
    return -1;
  }
  if (t == AE_IFLNK) {
    const char *target = archive_entry_symlink(e);
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", rel);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else dir[0] = '\0';
    if (!target || !*target || target[0] == '/' || !lexically_inside(dir, target)) {
      set_err(err, "EUNSAFE", "unsafe entry '%s': symlink to '%s' leads outside the destination",
              raw, target ? target : "");
      return -1;
    }
  }
  return 0;
}

/* Refuses writing `rel` through a symlink already on disk (relative to the cwd = dest). */
static int check_parents(const char *raw, const char *rel, dm_archive_err *err) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", rel);
  for (char *p = path; (p = strchr(p, '/')); p++) {
    *p = '\0';
    struct stat st;
    int r = lstat(path, &st);
    if (r == 0 && S_ISLNK(st.st_mode)) {
      set_err(err, "EUNSAFE", "unsafe entry '%s': would be written through the symlink '%s'", raw, path);
      return -1;
    }
    *p = '/';
    if (r != 0) break;
  }
  return 0;
}

/* A hard link entry (the cwd is the destination): allowed only to a regular file that an
 * earlier entry extracted inside the destination, neither name passing through a symlink;
 * made with link(2), so both names share the data as they did in the sandbox. */
static int extract_hardlink(struct archive_entry *e, const char *raw, char *rel, size_t rlen,
                            dm_archive_err *err) {
  const char *target = archive_entry_hardlink(e);
  char trel[PATH_MAX];
  if (!raw || !*raw || raw[0] == '/' || normalize(raw, rel, rlen) != 0 || !*rel) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': bad name for a hard link", raw ? raw : "");
    return -1;
  }
  if (!target || !*target || target[0] == '/' || normalize(target, trel, sizeof trel) != 0 || !*trel) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': hard link to '%s' leads outside the destination", raw,
            target ? target : "");
    return -1;
  }
  if (check_parents(raw, rel, err) != 0 || check_parents(raw, trel, err) != 0) return -1;
  struct stat ts;
  if (lstat(trel, &ts) != 0 || !S_ISREG(ts.st_mode)) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': hard link to '%s', which is not a file extracted before it", raw,
            target);
    return -1;
  }
  if (link(trel, rel) != 0) {
    set_errno(err, errno, "link", raw);
    return -1;
  }
  return 0;
}

static int copy_data(struct archive *in, struct archive *out, const char *raw, uint64_t *bytes,
                     uint64_t max_bytes, dm_archive_err *err) {
  for (;;) {
    const void *buf;
    size_t len;
    la_int64_t off;
    int r = archive_read_data_block(in, &buf, &len, &off);
    if (r == ARCHIVE_EOF) return 0;
    if (r < ARCHIVE_WARN) {
      set_archive_err(err, in, "EARCHIVE", raw);
      return -1;
    }
    *bytes += len;
    if (max_bytes && *bytes > max_bytes) {
      set_err(err, "E2BIG", "archive content exceeds max_bytes (%llu)", (unsigned long long)max_bytes);
      return -1;
    }
    if (archive_write_data_block(out, buf, len, off) < ARCHIVE_WARN) {
      set_archive_err(err, out, "EIO", raw);
      return -1;
    }
  }
}

int dm_archive_extract(const char *tar_path, const char *dest_dir, const dm_archive_limits *lim,
                       dm_archive_stats *st, char ***names, size_t *nnames, dm_archive_err *err) {
  memset(st, 0, sizeof *st);
  if (names) *names = NULL;
  if (nnames) *nnames = 0;
  static const dm_archive_limits none = {0, 0};
  if (!lim) lim = &none;

  int created = 0;
  struct stat dst;
  if (stat(dest_dir, &dst) != 0) {
    if (errno != ENOENT || mkdir(dest_dir, 0755) != 0) {
      set_errno(err, errno, "dest_dir", dest_dir);
      return -1;
    }
    created = 1;
  } else {
    int empty = 0;
    if (!S_ISDIR(dst.st_mode)) {
      set_errno(err, ENOTDIR, "dest_dir", dest_dir);
      return -1;
    }
    if (dir_is_empty(dest_dir, &empty) != 0) {
      set_errno(err, errno, "dest_dir", dest_dir);
      return -1;
    }
    if (!empty) {
      set_err(err, "ENOTEMPTY", "dest_dir %s: must be empty", dest_dir);
      return -1;
    }
  }
  char root[PATH_MAX];
  if (!realpath(dest_dir, root)) {
    set_errno(err, errno, "dest_dir", dest_dir);
    if (created) rmdir(dest_dir);
    return -1;
  }

  struct archive *in = NULL, *out = NULL;
  strvec all = {0}, links = {0};
  int rc = 0, cwd = -1, dfd = -1;
  if (open_reader(&in, tar_path, err) != 0) {
    rc = -1;
    goto done;
  }
  cwd = open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  dfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (cwd < 0 || dfd < 0 || fchdir(dfd) != 0) {
    set_errno(err, errno, "chdir", root);
    rc = -1;
    goto done;
  }
  out = archive_write_disk_new();
  if (!out) {
    set_err(err, "ENOMEM", "out of memory");
    rc = -1;
    goto done;
  }
  archive_write_disk_set_options(out, ARCHIVE_EXTRACT_SECURE_NODOTDOT | ARCHIVE_EXTRACT_SECURE_SYMLINKS |
                                          ARCHIVE_EXTRACT_SECURE_NOABSOLUTEPATHS | ARCHIVE_EXTRACT_TIME |
                                          ARCHIVE_EXTRACT_PERM);
  uint64_t count = 0, declared = 0;
  char rel[PATH_MAX];
  for (;;) {
    struct archive_entry *e;
    int r = archive_read_next_header(in, &e);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      set_archive_err(err, in, "EARCHIVE", tar_path);
      rc = -1;
      break;
    }
    const char *raw = archive_entry_pathname(e);
    if (lim->max_entries && ++count > lim->max_entries) {
      set_err(err, "E2BIG", "archive has more than max_entries (%llu) entries",
              (unsigned long long)lim->max_entries);
      rc = -1;
      break;
    }
    if (archive_entry_hardlink(e)) {
      if (extract_hardlink(e, raw, rel, sizeof rel, err) != 0) {
        rc = -1;
        break;
      }
      if (strvec_push(&all, raw) != 0) {
        set_err(err, "ENOMEM", "out of memory");
        rc = -1;
        break;
      }
      st->files++;
      continue;
    }
    if (check_entry(e, raw, rel, sizeof rel, err) != 0 || check_parents(raw, rel, err) != 0) {
      rc = -1;
      break;
    }
    if (!*rel) continue; /* "./": the destination itself */
    mode_t t = archive_entry_filetype(e);
    if (t == AE_IFREG) {
      la_int64_t sz = archive_entry_size(e);
      declared += sz > 0 ? (uint64_t)sz : 0;
      if (lim->max_bytes && declared > lim->max_bytes) {
        set_err(err, "E2BIG", "archive content exceeds max_bytes (%llu) at '%s'",
                (unsigned long long)lim->max_bytes, raw);
        rc = -1;
        break;
      }
      archive_entry_set_perm(e, archive_entry_perm(e) & 0777);
    } else if (t == AE_IFDIR) {
      archive_entry_set_perm(e, (archive_entry_perm(e) & 0777) | 0700);
    }
    if (strvec_push(&all, raw) != 0 || (t == AE_IFLNK && strvec_push(&links, rel) != 0)) {
      set_err(err, "ENOMEM", "out of memory");
      rc = -1;
      break;
    }
    archive_entry_copy_pathname(e, rel);
    if (archive_write_header(out, e) < ARCHIVE_WARN) {
      set_archive_err(err, out, "EUNSAFE", raw);
      rc = -1;
      break;
    }
    if (t == AE_IFREG) {
      if (copy_data(in, out, raw, &st->bytes, lim->max_bytes, err) != 0) {
        rc = -1;
        break;
      }
      st->files++;
    }
    if (archive_write_finish_entry(out) < ARCHIVE_WARN) {
      set_archive_err(err, out, "EIO", raw);
      rc = -1;
      break;
    }
  }
  if (archive_write_close(out) < ARCHIVE_WARN && rc == 0) { /* folder modes and times */
    set_archive_err(err, out, "EIO", tar_path);
    rc = -1;
  }
  /* a link that was fine alone may leave through links added after it */
  for (size_t i = 0; rc == 0 && i < links.n; i++) {
    if (!resolves_inside(dfd, links.v[i])) {
      set_err(err, "EUNSAFE", "unsafe entry '%s': symlink resolves outside the destination", links.v[i]);
      rc = -1;
    }
  }
done:
  if (cwd >= 0) {
    if (fchdir(cwd) != 0) { /* cannot happen unless the old cwd vanished */
      if (rc == 0) set_errno(err, errno, "chdir", "(previous working directory)");
      rc = -1;
    }
    close(cwd);
  }
  if (dfd >= 0) close(dfd);
  if (out) archive_write_free(out);
  if (in) archive_read_free(in);
  dm_archive_names_free(links.v, links.n);
  if (rc != 0) {
    remove_tree(root, created);
    dm_archive_names_free(all.v, all.n);
    memset(st, 0, sizeof *st);
    return -1;
  }
  if (names) {
    *names = all.v;
    *nnames = all.n;
  } else {
    dm_archive_names_free(all.v, all.n);
  }
  return 0;
}

/* ================================ list ================================ */

static const char *type_name(struct archive_entry *e) {
  if (archive_entry_hardlink(e)) return "hardlink";
  switch (archive_entry_filetype(e)) {
  case AE_IFREG: return "file";
  case AE_IFDIR: return "directory";
  case AE_IFLNK: return "link";
  case AE_IFCHR: return "char";
  case AE_IFBLK: return "block";
  case AE_IFIFO: return "fifo";
  case AE_IFSOCK: return "socket";
  default: return "other";
  }
}

void dm_archive_items_free(dm_archive_item *items, size_t n) {
  if (!items) return;
  for (size_t i = 0; i < n; i++) {
    free(items[i].name);
    free(items[i].target);
  }
  free(items);
}

int dm_archive_list(const char *tar_path, dm_archive_item **items, size_t *n, dm_archive_err *err) {
  *items = NULL;
  *n = 0;
  struct archive *a;
  if (open_reader(&a, tar_path, err) != 0) return -1;
  dm_archive_item *v = NULL;
  size_t cnt = 0, cap = 0;
  int rc = 0;
  for (;;) {
    struct archive_entry *e;
    int r = archive_read_next_header(a, &e);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      set_archive_err(err, a, "EARCHIVE", tar_path);
      rc = -1;
      break;
    }
    if (cnt == cap) {
      size_t nc = cap ? cap * 2 : 64;
      dm_archive_item *nv = realloc(v, nc * sizeof *nv);
      if (!nv) {
        set_err(err, "ENOMEM", "out of memory");
        rc = -1;
        break;
      }
      v = nv;
      cap = nc;
    }
    dm_archive_item *it = &v[cnt];
    const char *name = archive_entry_pathname(e);
    const char *target = archive_entry_hardlink(e);
    if (!target && archive_entry_filetype(e) == AE_IFLNK) target = archive_entry_symlink(e);
    it->name = strdup(name ? name : "");
    it->target = target ? strdup(target) : NULL;
    it->type = type_name(e);
    it->size = archive_entry_filetype(e) == AE_IFREG && !archive_entry_hardlink(e) ? archive_entry_size(e) : 0;
    it->mode = (int)(archive_entry_perm(e) & 07777);
    cnt++;
    if (!it->name || (target && !it->target)) {
      set_err(err, "ENOMEM", "out of memory");
      rc = -1;
      break;
    }
    archive_read_data_skip(a);
  }
  archive_read_free(a);
  if (rc != 0) {
    dm_archive_items_free(v, cnt);
    return -1;
  }
  *items = v;
  *n = cnt;
  return 0;
}
