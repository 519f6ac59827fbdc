/* Tar pack / extract / list with libarchive. See tar.h for the contract.
 *
 * Both directions work on descriptors, never on paths below the folder they were given:
 * pack walks its sources with openat(O_NOFOLLOW) and opens a file only after checking
 * its type (core/confine.c); extract writes every entry itself (libarchive reads only)
 * with mkdirat/openat(O_EXCL|O_NOFOLLOW)/symlinkat/linkat on folder descriptors it
 * opened beneath the destination with openat2 (no symlink, no ".."). Nothing here uses
 * the working directory, so it is safe on worker threads. Extraction is defended in two
 * layers: checks on every header (names, types, link targets, sizes, depth), and a
 * post-pass that resolves every extracted symlink the way the kernel would.
 */
#include "tar.h"
#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 65536

#define set_err dm_err_set

static void set_errno(dm_archive_err *err, int e, const char *what, const char *path) {
  dm_err_errno(err, e, what, path);
}

/* libarchive failure: an errno name when it carries one, else `fallback` */
static void set_archive_err(dm_archive_err *err, struct archive *a, const char *fallback, const char *what) {
  int e = archive_errno(a);
  const char *s = archive_error_string(a);
  const char *code = fallback;
  /* libarchive's private "file format" and "programmer" codes are EILSEQ and EINVAL */
  if (e > 0 && e != EILSEQ && e != EINVAL) code = dm_errno_code(e);
  set_err(err, code, "%s: %s", what, s ? s : "archive error");
}

static int is_cancelled(atomic_int *cancel, dm_archive_err *err) {
  if (cancel && atomic_load(cancel)) {
    set_err(err, "ECANCELED", "cancelled");
    return 1;
  }
  return 0;
}

/* A name cut for a message: at most 160 bytes, "…" marking the cut. */
static const char *shown(const char *s, char *buf, size_t cap) {
  size_t n = strlen(s);
  if (n < 160 || cap < 170) return s;
  snprintf(buf, cap, "%.160s…", s);
  return buf;
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

static uint64_t depth_limit(const dm_archive_limits *lim) {
  return lim && lim->max_depth ? lim->max_depth : DM_TREE_MAX_DEPTH;
}

/* ================================ pack ================================ */

typedef struct {
  struct archive *a;
  dm_archive_stats *st;
  dm_archive_err *err;
  dev_t out_dev;
  ino_t out_ino;
  char *buf;
  uint64_t max_bytes, max_depth;
  uint64_t counted;           /* the sizing pass */
  uint64_t max_entries, seen; /* entries of every type met in this pass */
  int strict;                 /* a source must still be a file or a folder when packed */
  atomic_int *cancel;
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

static int too_big(packer *p, uint64_t total) {
  if (p->max_bytes && total > p->max_bytes) {
    set_err(p->err, "E2BIG", "the files hold more than max_bytes (%llu bytes)", (unsigned long long)p->max_bytes);
    return 1;
  }
  return 0;
}

/* Packs the regular file `n` of the folder pfd, whose lstat is *lst. */
static int pack_file(packer *p, int pfd, const char *n, const char *name, const struct stat *lst) {
  struct stat st;
  dm_err oe;
  int fd = dm_cf_open_file(pfd, n, DM_CF_READ, 0, &st, &oe);
  if (fd < 0) {
    if (!strcmp(oe.code, "EINVAL") || !strcmp(oe.code, "ELOOP")) /* swapped since the lstat */
      set_err(p->err, "EAGAIN", "%s: changed while being packed", name);
    else set_errno(p->err, errno ? errno : EIO, "open", name);
    return -1;
  }
  if (st.st_ino != lst->st_ino || st.st_dev != lst->st_dev) {
    close(fd);
    set_err(p->err, "EAGAIN", "%s: changed while being packed", name);
    return -1;
  }
  if (too_big(p, p->st->bytes + (uint64_t)st.st_size)) {
    close(fd);
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
    if (is_cancelled(p->cancel, p->err)) {
      rc = -1;
      break;
    }
    ssize_t r = read(fd, p->buf, left < BLOCK ? (size_t)left : BLOCK);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      set_errno(p->err, errno, "read", name);
      rc = -1;
    } else if (r == 0) {
      set_err(p->err, "EAGAIN", "%s: shrank while being packed", name);
      rc = -1;
    } else {
      rc = write_data(p, p->buf, (size_t)r, name);
      left -= r;
    }
  }
  close(fd);
  if (rc == 0) {
    p->st->files++;
    p->st->bytes += (uint64_t)st.st_size;
  }
  return rc;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The names in folder fd, sorted, without "." and "..": at most `max` (0 = no cap; more is
 * E2BIG, so a folder of millions of names is refused before they are all held). */
static char **list_names(int fd, size_t *n, uint64_t max, dm_archive_err *err, const char *name) {
  *n = 0;
  int d2 = dup(fd);
  DIR *d = d2 >= 0 ? fdopendir(d2) : NULL;
  if (!d) {
    set_errno(err, errno, "read folder", *name ? name : ".");
    if (d2 >= 0) close(d2);
    return NULL;
  }
  char **v = NULL;
  size_t cap = 0;
  struct dirent *de;
  errno = 0;
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (max && *n >= max) {
      closedir(d);
      for (size_t i = 0; i < *n; i++) free(v[i]);
      free(v);
      *n = 0;
      set_err(err, "E2BIG", "more than max_entries (%llu) entries", (unsigned long long)max);
      return NULL;
    }
    if (*n == cap) {
      size_t nc = cap ? cap * 2 : 32;
      char **nv = realloc(v, nc * sizeof *nv);
      if (!nv) goto oom;
      v = nv;
      cap = nc;
    }
    if (!(v[*n] = strdup(de->d_name))) goto oom;
    (*n)++;
  }
  closedir(d);
  if (*n) qsort(v, *n, sizeof *v, cmp_names);
  if (!v) v = malloc(sizeof *v); /* an empty folder: a non-NULL empty list */
  if (!v) goto oom_closed;
  return v;
oom:
  closedir(d);
oom_closed:
  for (size_t i = 0; i < *n; i++) free(v[i]);
  free(v);
  *n = 0;
  set_err(err, "ENOMEM", "out of memory");
  return NULL;
}

/* Packs (or, with `sizing`, only adds up) the entry `n` of the folder pfd under the
 * archive name `name`, `depth` folder levels below its source. */
static int pack_at(packer *p, int pfd, const char *n, const char *name, uint64_t depth, int sizing) {
  if (is_cancelled(p->cancel, p->err)) return -1;
  char cut[200];
  struct stat st;
  if (fstatat(pfd, n, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    set_errno(p->err, errno, "lstat", *name ? name : n);
    return -1;
  }
  if (st.st_dev == p->out_dev && st.st_ino == p->out_ino) return 0; /* the output itself */
  if (depth == 0 && p->strict && !S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
    /* the caller checked a file or a folder at this path; a link or anything else there now
     * means it was swapped since (by a sandbox that can write it): never pack what is there */
    set_err(p->err, "EAGAIN", "%s: changed while being packed (it is now a %s); a source must be a file or a folder",
            *name ? name : n, S_ISLNK(st.st_mode) ? "symbolic link" : dm_cf_type_name(st.st_mode));
    return -1;
  }
  if (S_ISDIR(st.st_mode)) {
    if (depth > p->max_depth) {
      set_err(p->err, "E2BIG", "%s: more than %llu folders deep (max_depth)", shown(name, cut, sizeof cut),
              (unsigned long long)p->max_depth);
      return -1;
    }
    int fd = openat(pfd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    struct stat fst;
    if (fd < 0 || fstat(fd, &fst) != 0 || fst.st_ino != st.st_ino || fst.st_dev != st.st_dev) {
      if (fd < 0 && errno != ELOOP && errno != ENOTDIR) set_errno(p->err, errno, "open", *name ? name : n);
      else set_err(p->err, "EAGAIN", "%s: changed while being packed", *name ? name : n);
      if (fd >= 0) close(fd);
      return -1;
    }
    int rc = 0;
    if (*name && !sizing) {
      struct archive_entry *e = new_entry(name, &st, AE_IFDIR);
      if (!e) {
        set_err(p->err, "ENOMEM", "out of memory");
        rc = -1;
      } else {
        rc = write_header(p, e, name);
        archive_entry_free(e);
      }
    }
    size_t cnt = 0;
    uint64_t left = p->max_entries ? (p->seen < p->max_entries ? p->max_entries - p->seen : 0) : 0;
    char **names = NULL;
    if (rc == 0 && p->max_entries && !left)
      set_err(p->err, "E2BIG", "more than max_entries (%llu) entries", (unsigned long long)p->max_entries);
    else if (rc == 0) names = list_names(fd, &cnt, left, p->err, name);
    p->seen += cnt;
    if (!names) rc = -1;
    for (size_t i = 0; i < cnt; i++) {
      if (rc == 0) {
        size_t nl = strlen(name) + strlen(names[i]) + 2;
        char *cname = malloc(nl);
        if (!cname) {
          set_err(p->err, "ENOMEM", "out of memory");
          rc = -1;
        } else {
          if (*name) snprintf(cname, nl, "%s/%s", name, names[i]);
          else snprintf(cname, nl, "%s", names[i]);
          rc = pack_at(p, fd, names[i], cname, depth + 1, sizing);
          free(cname);
        }
      }
      free(names[i]);
    }
    free(names);
    close(fd);
    return rc;
  }
  if (!*name) {
    set_err(p->err, "EINVAL", "%s: an empty archive name is only allowed for a folder", n);
    return -1;
  }
  if (S_ISREG(st.st_mode)) {
    if (sizing) {
      p->counted += (uint64_t)st.st_size;
      return too_big(p, p->counted) ? -1 : 0;
    }
    return pack_file(p, pfd, n, name, &st);
  }
  if (!S_ISLNK(st.st_mode) || sizing) return 0; /* sockets, devices, fifos: skipped */
  char target[PATH_MAX];
  ssize_t tl = readlinkat(pfd, n, target, sizeof target - 1);
  if (tl < 0) {
    set_errno(p->err, errno, "readlink", name);
    return -1;
  }
  target[tl] = '\0';
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

/* Packs (or sizes) one source path: its folder is opened (from "/" with no symlink on the
 * way when `strict`), the last component packed from there. */
static int pack_src(packer *p, const char *src, const char *name, int strict, int sizing) {
  char path[PATH_MAX];
  size_t len = strlen(src);
  if (len >= sizeof path) {
    set_err(p->err, "ENAMETOOLONG", "%s: path too long", src);
    return -1;
  }
  memcpy(path, src, len + 1);
  while (len > 1 && path[len - 1] == '/') path[--len] = '\0';
  char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
    set_err(p->err, "EINVAL", "%s: name a file or folder (not / or ending in . or ..)", src);
    return -1;
  }
  char dir[PATH_MAX];
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == path) snprintf(dir, sizeof dir, "/");
  else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
  int pfd;
  if (strict && dir[0] == '/') {
    int root = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    pfd = root < 0 ? -1 : dm_cf_open_dir(root, dir[1] ? dir + 1 : ".");
    int e = errno;
    if (root >= 0) close(root);
    errno = e;
  } else {
    pfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  if (pfd < 0) {
    set_errno(p->err, errno, "open", dir);
    return -1;
  }
  int rc = pack_at(p, pfd, base, name, 0, sizing);
  if (rc != 0 && !strcmp(p->err->code, "ENOENT") && strstr(p->err->msg, "lstat") == p->err->msg && !*name)
    set_errno(p->err, ENOENT, "lstat", src);
  close(pfd);
  return rc;
}

static int pack_data(packer *p, const dm_archive_entry *en, const char *name) {
  if (!*name) {
    set_err(p->err, "EINVAL", "in-memory entry: the name must not be empty");
    return -1;
  }
  if (too_big(p, p->st->bytes + en->data_len)) return -1;
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

int dm_archive_pack_fd(int out_fd, const dm_archive_entry *entries, size_t n, const dm_archive_limits *lim,
                       dm_archive_stats *st, dm_archive_err *err, atomic_int *cancel) {
  memset(st, 0, sizeof *st);
  packer p = {0};
  p.st = st;
  p.err = err;
  p.cancel = cancel;
  p.max_bytes = lim ? lim->max_bytes : 0;
  p.max_entries = lim ? lim->max_entries : 0;
  p.max_depth = depth_limit(lim);
  int strict = lim && lim->strict_src;
  p.strict = strict;
  struct stat ost;
  if (fstat(out_fd, &ost) != 0) {
    set_errno(err, errno, "fstat", "(output)");
    return -1;
  }
  p.out_dev = ost.st_dev;
  p.out_ino = ost.st_ino;
  char name[PATH_MAX];
  /* names first, then (with a cap) the sizes: nothing is written for a refused call */
  for (size_t i = 0; i < n; i++) {
    if (normalize(entries[i].name, name, sizeof name) != 0) {
      set_err(err, "EINVAL", "entry %zu: name '%s' must be relative without '..'", i + 1,
              entries[i].name ? entries[i].name : "(null)");
      return -1;
    }
  }
  if (p.max_bytes || p.max_entries) {
    for (size_t i = 0; i < n; i++) {
      normalize(entries[i].name, name, sizeof name);
      if (entries[i].src) {
        if (pack_src(&p, entries[i].src, name, strict, 1) != 0) return -1;
      } else {
        p.counted += entries[i].data_len;
        if (too_big(&p, p.counted)) return -1;
      }
    }
  }
  p.seen = 0;
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
             archive_write_open_fd(p.a, out_fd) != ARCHIVE_OK) {
    set_archive_err(err, p.a, "EIO", "(output)");
    rc = -1;
  }
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const dm_archive_entry *en = &entries[i];
    normalize(en->name, name, sizeof name);
    if (en->src) rc = pack_src(&p, en->src, name, strict, 0);
    else rc = pack_data(&p, en, name);
  }
  if (p.a) {
    if (rc == 0 && archive_write_close(p.a) != ARCHIVE_OK) {
      set_archive_err(err, p.a, "EIO", "(output)");
      rc = -1;
    }
    archive_write_free(p.a);
  }
  free(p.buf);
  if (rc != 0) memset(st, 0, sizeof *st);
  return rc;
}

int dm_archive_pack(const char *out_path, const dm_archive_entry *entries, size_t n, dm_archive_stats *st,
                    dm_archive_err *err) {
  memset(st, 0, sizeof *st);
  int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    set_errno(err, errno, "open", out_path);
    return -1;
  }
  int rc = dm_archive_pack_fd(fd, entries, n, NULL, st, err, NULL);
  if (close(fd) != 0 && rc == 0) {
    set_errno(err, errno, "close", out_path);
    rc = -1;
  }
  if (rc != 0) unlink(out_path);
  return rc;
}

/* ================================ extract ================================ */

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

static size_t depth_of(const char *rel) { return dm_cf_depth(rel); }

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
 * symlink on the way (components that do not exist are taken literally). Every look-up
 * is confined (core/confine.c), so a component swapped for a link meanwhile reads as
 * leaving. Returns 1 when it stays below dfd, 0 when it leaves it, points at an absolute
 * path or loops. */
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
    int lfd = dm_cf_openat(dfd, cur, O_PATH, 0);
    if (lfd < 0) {
      if (errno == ENOENT) {
        missing = 1;
        continue;
      }
      inside = 0; /* a link on the way that was not there when we resolved it */
      break;
    }
    struct stat st;
    if (fstat(lfd, &st) != 0) {
      close(lfd);
      inside = 0;
      break;
    }
    if (!S_ISLNK(st.st_mode)) {
      close(lfd);
      continue;
    }
    char target[PATH_MAX];
    ssize_t tl = readlinkat(lfd, "", target, sizeof target - 1);
    close(lfd);
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

/* The one place that refuses an entry: checks that need no disk state. */
static int check_entry(struct archive_entry *e, const char *raw, char *rel, size_t rlen, uint64_t max_depth,
                       dm_archive_err *err) {
  char cut[200];
  if (!raw || !*raw) {
    set_err(err, "EUNSAFE", "unsafe entry: empty name");
    return -1;
  }
  if (raw[0] == '/') {
    set_err(err, "EUNSAFE", "unsafe entry '%s': absolute name", shown(raw, cut, sizeof cut));
    return -1;
  }
  if (normalize(raw, rel, rlen) != 0) {
    if (strlen(raw) >= rlen - 1)
      set_err(err, "EUNSAFE", "unsafe entry '%s': name too long", shown(raw, cut, sizeof cut));
    else set_err(err, "EUNSAFE", "unsafe entry '%s': '..' component", shown(raw, cut, sizeof cut));
    return -1;
  }
  if (depth_of(rel) > max_depth) {
    set_err(err, "E2BIG", "entry '%s' is more than %llu levels deep (max_depth)", shown(raw, cut, sizeof cut),
            (unsigned long long)max_depth);
    return -1;
  }
  mode_t t = archive_entry_filetype(e);
  if (t != AE_IFREG && t != AE_IFDIR && t != AE_IFLNK) {
    set_err(err, "EUNSAFE", "unsafe entry '%s': devices, fifos and sockets are refused", shown(raw, cut, sizeof cut));
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
      char cut2[200];
      set_err(err, "EUNSAFE", "unsafe entry '%s': symlink to '%s' leads outside the destination",
              shown(raw, cut, sizeof cut), shown(target ? target : "", cut2, sizeof cut2));
      return -1;
    }
  }
  return 0;
}

/* A folder whose mode and mtime are set once everything is in it. */
typedef struct {
  char *rel;
  mode_t perm;
  time_t mtime;
  long mtime_ns;
} dirfix;

typedef struct {
  int dest;
  const dm_archive_limits *lim;
  dm_archive_stats *st;
  dm_archive_err *err;
  atomic_int *cancel;
  uint64_t declared, max_depth;
  int pfd;             /* the folder of the last entry, cached */
  char prel[PATH_MAX]; /* its name below dest */
  dirfix *dirs;
  size_t ndirs, capdirs;
} xstate;

/* Opens (creating what is missing, mode 0755) the folder `dir` below dest, one component
 * at a time with O_NOFOLLOW: a symlink or a file on the way refuses the entry `raw`. */
static int walk_create(xstate *x, const char *raw, const char *dir) {
  char buf[PATH_MAX], cut[200];
  snprintf(buf, sizeof buf, "%s", dir);
  int cur = dup(x->dest);
  if (cur < 0) {
    set_errno(x->err, errno, "open", ".");
    return -1;
  }
  char *p = buf;
  while (*p) {
    char *s = p;
    while (*p && *p != '/') p++;
    char c = *p;
    *p = '\0';
    int fd = openat(cur, s, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
      if (mkdirat(cur, s, 0755) != 0 && errno != EEXIST) {
        set_errno(x->err, errno, "mkdir", buf);
        close(cur);
        return -1;
      }
      fd = openat(cur, s, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      int e = errno;
      struct stat st;
      if (e == ELOOP || e == ENOTDIR) {
        if (fstatat(cur, s, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
          set_err(x->err, "EUNSAFE", "unsafe entry '%s': would be written through the symlink '%s'",
                  shown(raw, cut, sizeof cut), buf);
        else if (fstatat(cur, s, &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode))
          set_err(x->err, "EUNSAFE", "unsafe entry '%s': '%s' is a %s, not a folder", shown(raw, cut, sizeof cut), buf,
                  dm_cf_type_name(st.st_mode));
        else /* a link or a file a moment ago: someone swaps it */
          set_err(x->err, "EUNSAFE", "unsafe entry '%s': the folder '%s' was swapped while being written into",
                  shown(raw, cut, sizeof cut), buf);
      } else {
        set_errno(x->err, e, "open", buf);
      }
      close(cur);
      return -1;
    }
    close(cur);
    cur = fd;
    *p = c;
    if (*p) p++;
  }
  return cur;
}

/* The folder of entry `rel` (named `raw` in the archive), held; *base its last name. */
static int entry_parent(xstate *x, const char *raw, const char *rel, const char **base) {
  const char *slash = strrchr(rel, '/');
  char dir[PATH_MAX];
  size_t dl = slash ? (size_t)(slash - rel) : 0;
  memcpy(dir, rel, dl);
  dir[dl] = '\0';
  *base = slash ? slash + 1 : rel;
  if (x->pfd >= 0 && !strcmp(x->prel, dir)) return x->pfd;
  if (x->pfd >= 0) close(x->pfd);
  x->pfd = -1;
  int fd = dm_cf_open_dir(x->dest, dir);
  if (fd < 0) fd = walk_create(x, raw, dir); /* missing folders, or a precise refusal */
  if (fd < 0) return -1;
  x->pfd = fd;
  memcpy(x->prel, dir, dl + 1);
  return fd;
}

/* An existing entry where a new one goes: a file or a link is replaced (a later archive
 * member wins, as with tar), a folder is not. Returns 0 when it was removed. */
static int replace_nondir(xstate *x, int pfd, const char *base, const char *raw) {
  struct stat st;
  char cut[200];
  if (fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
    set_err(x->err, "EUNSAFE", "unsafe entry '%s': a folder of that name is already there",
            shown(raw, cut, sizeof cut));
    return -1;
  }
  if (unlinkat(pfd, base, 0) != 0 && errno != ENOENT) {
    set_errno(x->err, errno, "replace", raw);
    return -1;
  }
  return 0;
}

static int pwrite_all(int fd, const char *p, size_t len, off_t off) {
  while (len) {
    ssize_t n = pwrite(fd, p, len, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
    off += n;
  }
  return 0;
}

static void entry_times(struct archive_entry *e, struct timespec ts[2]) {
  ts[0].tv_sec = ts[1].tv_sec = archive_entry_mtime(e);
  ts[0].tv_nsec = ts[1].tv_nsec = archive_entry_mtime_nsec(e);
}

static int extract_file(xstate *x, struct archive *in, struct archive_entry *e, const char *raw, const char *rel) {
  char cut[200];
  la_int64_t sz = archive_entry_size(e);
  uint64_t size = sz > 0 ? (uint64_t)sz : 0;
  uint64_t max = x->lim ? x->lim->max_bytes : 0;
  x->declared += size;
  if (max && x->declared > max) {
    set_err(x->err, "E2BIG", "archive content exceeds max_bytes (%llu) at '%s'", (unsigned long long)max,
            shown(raw, cut, sizeof cut));
    return -1;
  }
  const char *base;
  int pfd = entry_parent(x, raw, rel, &base);
  if (pfd < 0) return -1;
  int fd = openat(pfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    if (replace_nondir(x, pfd, base, raw) != 0) return -1;
    fd = openat(pfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
  }
  if (fd < 0) {
    set_errno(x->err, errno, "create", raw);
    return -1;
  }
  uint64_t end = 0;
  int rc = 0;
  for (;;) {
    if (is_cancelled(x->cancel, x->err)) {
      rc = -1;
      break;
    }
    const void *buf;
    size_t len;
    la_int64_t off;
    int r = archive_read_data_block(in, &buf, &len, &off);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      set_archive_err(x->err, in, "EARCHIVE", raw);
      rc = -1;
      break;
    }
    if (off < 0 || (uint64_t)off > size || len > size - (uint64_t)off) {
      set_err(x->err, "EARCHIVE", "entry '%s': data past its declared size of %llu bytes", shown(raw, cut, sizeof cut),
              (unsigned long long)size);
      rc = -1;
      break;
    }
    x->st->bytes += len;
    if (max && x->st->bytes > max) {
      set_err(x->err, "E2BIG", "archive content exceeds max_bytes (%llu)", (unsigned long long)max);
      rc = -1;
      break;
    }
    if (len && pwrite_all(fd, buf, len, (off_t)off) != 0) {
      set_errno(x->err, errno, "write", raw);
      rc = -1;
      break;
    }
    if ((uint64_t)off + len > end) end = (uint64_t)off + len;
  }
  if (rc == 0 && end < size && ftruncate(fd, (off_t)size) != 0) { /* a sparse file's final hole */
    set_errno(x->err, errno, "write", raw);
    rc = -1;
  }
  if (rc == 0) {
    struct timespec ts[2];
    entry_times(e, ts);
    if (fchmod(fd, archive_entry_perm(e) & 0777) != 0 || futimens(fd, ts) != 0) {
      set_errno(x->err, errno, "set mode of", raw);
      rc = -1;
    }
  }
  if (close(fd) != 0 && rc == 0) {
    set_errno(x->err, errno, "write", raw);
    rc = -1;
  }
  if (rc == 0) x->st->files++;
  return rc;
}

static int extract_dir(xstate *x, struct archive_entry *e, const char *raw, const char *rel) {
  const char *base;
  int pfd = entry_parent(x, raw, rel, &base);
  if (pfd < 0) return -1;
  if (mkdirat(pfd, base, 0700) != 0) {
    struct stat st;
    if (errno != EEXIST || fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      set_errno(x->err, errno, "mkdir", raw);
      return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (replace_nondir(x, pfd, base, raw) != 0) return -1;
      if (mkdirat(pfd, base, 0700) != 0) {
        set_errno(x->err, errno, "mkdir", raw);
        return -1;
      }
    }
  }
  if (x->ndirs == x->capdirs) {
    size_t nc = x->capdirs ? x->capdirs * 2 : 64;
    dirfix *nv = realloc(x->dirs, nc * sizeof *nv);
    if (!nv) goto oom;
    x->dirs = nv;
    x->capdirs = nc;
  }
  dirfix *d = &x->dirs[x->ndirs];
  if (!(d->rel = strdup(rel))) goto oom;
  d->perm = (archive_entry_perm(e) & 0777) | 0700;
  d->mtime = archive_entry_mtime(e);
  d->mtime_ns = archive_entry_mtime_nsec(e);
  x->ndirs++;
  return 0;
oom:
  set_err(x->err, "ENOMEM", "out of memory");
  return -1;
}

static int extract_symlink(xstate *x, struct archive_entry *e, const char *raw, const char *rel) {
  const char *base;
  int pfd = entry_parent(x, raw, rel, &base);
  if (pfd < 0) return -1;
  const char *target = archive_entry_symlink(e);
  if (symlinkat(target, pfd, base) != 0) {
    if (errno != EEXIST) {
      set_errno(x->err, errno, "symlink", raw);
      return -1;
    }
    if (replace_nondir(x, pfd, base, raw) != 0) return -1;
    if (symlinkat(target, pfd, base) != 0) {
      set_errno(x->err, errno, "symlink", raw);
      return -1;
    }
  }
  struct timespec ts[2];
  entry_times(e, ts);
  utimensat(pfd, base, ts, AT_SYMLINK_NOFOLLOW);
  return 0;
}

/* A hard link entry: allowed only to a regular file that an earlier entry extracted
 * inside the destination, neither name passing through a symlink; made with linkat on
 * held folders, so both names share the data as they did in the sandbox. */
static int extract_hardlink(xstate *x, struct archive_entry *e, const char *raw, char *rel, size_t rlen) {
  const char *target = archive_entry_hardlink(e);
  char trel[PATH_MAX], cut[200], cut2[200];
  if (!raw || !*raw || raw[0] == '/' || normalize(raw, rel, rlen) != 0 || !*rel) {
    set_err(x->err, "EUNSAFE", "unsafe entry '%s': bad name for a hard link", raw ? shown(raw, cut, sizeof cut) : "");
    return -1;
  }
  if (!target || !*target || target[0] == '/' || normalize(target, trel, sizeof trel) != 0 || !*trel) {
    set_err(x->err, "EUNSAFE", "unsafe entry '%s': hard link to '%s' leads outside the destination",
            shown(raw, cut, sizeof cut), target ? shown(target, cut2, sizeof cut2) : "");
    return -1;
  }
  if (depth_of(rel) > x->max_depth || depth_of(trel) > x->max_depth) {
    set_err(x->err, "E2BIG", "entry '%s' is more than %llu levels deep (max_depth)", shown(raw, cut, sizeof cut),
            (unsigned long long)x->max_depth);
    return -1;
  }
  char tbase[NAME_MAX + 1];
  int tp = dm_cf_parent(x->dest, trel, tbase, sizeof tbase);
  struct stat ts;
  if (tp < 0 || fstatat(tp, tbase, &ts, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(ts.st_mode)) {
    if (tp < 0 && errno == ELOOP)
      set_err(x->err, "EUNSAFE", "unsafe entry '%s': would be written through a symlink", shown(raw, cut, sizeof cut));
    else
      set_err(x->err, "EUNSAFE", "unsafe entry '%s': hard link to '%s', which is not a file extracted before it",
              shown(raw, cut, sizeof cut), shown(target, cut2, sizeof cut2));
    if (tp >= 0) close(tp);
    return -1;
  }
  const char *base;
  int pfd = entry_parent(x, raw, rel, &base);
  if (pfd < 0) {
    close(tp);
    return -1;
  }
  int r = linkat(tp, tbase, pfd, base, 0);
  if (r != 0 && errno == EEXIST) {
    if (replace_nondir(x, pfd, base, raw) != 0) {
      close(tp);
      return -1;
    }
    r = linkat(tp, tbase, pfd, base, 0);
  }
  int ee = errno;
  close(tp);
  if (r != 0) {
    set_errno(x->err, ee, "link", raw);
    return -1;
  }
  x->st->files++;
  return 0;
}

/* Reads the tar with pread from offset 0, at most `left` bytes. */
typedef struct {
  int fd;
  uint64_t off, left;
  char buf[BLOCK];
} tar_src;

static la_ssize_t src_read(struct archive *a, void *ud, const void **buf) {
  tar_src *s = ud;
  size_t want = s->left < BLOCK ? (size_t)s->left : BLOCK;
  if (!want) return 0;
  ssize_t n;
  do n = pread(s->fd, s->buf, want, (off_t)s->off);
  while (n < 0 && errno == EINTR);
  if (n < 0) {
    archive_set_error(a, errno, "read: %s", strerror(errno));
    return -1;
  }
  s->off += (uint64_t)n;
  s->left -= (uint64_t)n;
  *buf = s->buf;
  return n;
}

static int extract_impl(int tar_fd, int dest_fd, const dm_archive_limits *lim, int gzip, dm_archive_stats *st,
                        char ***names, size_t *nnames, dm_archive_err *err, atomic_int *cancel) {
  memset(st, 0, sizeof *st);
  err->code = NULL;
  if (names) *names = NULL;
  if (nnames) *nnames = 0;
  static const dm_archive_limits none = {0};
  if (!lim) lim = &none;
  xstate x = {.dest = dest_fd, .lim = lim, .st = st, .err = err, .cancel = cancel, .pfd = -1};
  x.max_depth = depth_limit(lim);
  struct stat tst;
  if (fstat(tar_fd, &tst) != 0) {
    set_errno(err, errno, "fstat", "(archive)");
    return -1;
  }
  if (!S_ISREG(tst.st_mode)) {
    set_err(err, "EINVAL", "the archive is not a regular file (a %s)", dm_cf_type_name(tst.st_mode));
    return -1;
  }
  if (lim->max_archive_bytes && (uint64_t)tst.st_size > lim->max_archive_bytes) {
    set_err(err, "E2BIG", "the archive is %llu bytes, more than %llu (max_archive_bytes)",
            (unsigned long long)tst.st_size, (unsigned long long)lim->max_archive_bytes);
    return -1;
  }
  tar_src *src = malloc(sizeof *src);
  struct archive *in = archive_read_new();
  strvec all = {0}, links = {0};
  int rc = 0;
  if (!src || !in) {
    set_err(err, "ENOMEM", "out of memory");
    rc = -1;
    goto done;
  }
  src->fd = tar_fd;
  src->off = 0;
  src->left = lim->max_archive_bytes ? lim->max_archive_bytes : UINT64_MAX;
  archive_read_support_format_tar(in);
  if (gzip) archive_read_support_filter_gzip(in);
  if (archive_read_open(in, src, NULL, src_read, NULL) != ARCHIVE_OK) {
    set_archive_err(err, in, "EARCHIVE", "(archive)");
    rc = -1;
    goto done;
  }
  uint64_t count = 0;
  char rel[PATH_MAX];
  for (;;) {
    if (is_cancelled(cancel, err)) {
      rc = -1;
      break;
    }
    struct archive_entry *e;
    int r = archive_read_next_header(in, &e);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      set_archive_err(err, in, "EARCHIVE", "(archive)");
      rc = -1;
      break;
    }
    const char *raw = archive_entry_pathname(e);
    if (lim->max_entries && ++count > lim->max_entries) {
      set_err(err, "E2BIG", "archive has more than max_entries (%llu) entries", (unsigned long long)lim->max_entries);
      rc = -1;
      break;
    }
    if (archive_entry_hardlink(e)) {
      if (extract_hardlink(&x, e, raw, rel, sizeof rel) != 0) {
        rc = -1;
        break;
      }
    } else {
      if (check_entry(e, raw, rel, sizeof rel, x.max_depth, err) != 0) {
        rc = -1;
        break;
      }
      if (!*rel) continue; /* "./": the destination itself */
      mode_t t = archive_entry_filetype(e);
      if (t == AE_IFREG) rc = extract_file(&x, in, e, raw, rel);
      else if (t == AE_IFDIR) rc = extract_dir(&x, e, raw, rel);
      else rc = extract_symlink(&x, e, raw, rel);
      if (rc != 0) break;
      if (t == AE_IFLNK && strvec_push(&links, rel) != 0) {
        set_err(err, "ENOMEM", "out of memory");
        rc = -1;
        break;
      }
    }
    if (names && strvec_push(&all, raw) != 0) {
      set_err(err, "ENOMEM", "out of memory");
      rc = -1;
      break;
    }
  }
  if (x.pfd >= 0) close(x.pfd);
  x.pfd = -1;
  /* folder modes and times, deepest last-made first (their mtimes moved as they filled) */
  for (size_t i = x.ndirs; rc == 0 && i-- > 0;) {
    int fd = dm_cf_open_dir(dest_fd, x.dirs[i].rel);
    if (fd < 0) {
      if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) continue; /* replaced by a later entry */
      set_errno(err, errno, "open", x.dirs[i].rel);
      rc = -1;
      break;
    }
    struct timespec ts[2] = {{x.dirs[i].mtime, x.dirs[i].mtime_ns}, {x.dirs[i].mtime, x.dirs[i].mtime_ns}};
    if (fchmod(fd, x.dirs[i].perm) != 0 || futimens(fd, ts) != 0) {
      set_errno(err, errno, "set mode of", x.dirs[i].rel);
      rc = -1;
    }
    close(fd);
  }
  /* a link that was fine alone may leave through links added after it */
  for (size_t i = 0; rc == 0 && i < links.n; i++) {
    if (!resolves_inside(dest_fd, links.v[i])) {
      char cut[200];
      set_err(err, "EUNSAFE", "unsafe entry '%s': symlink resolves outside the destination",
              shown(links.v[i], cut, sizeof cut));
      rc = -1;
    }
  }
done:
  if (in) archive_read_free(in);
  free(src);
  for (size_t i = 0; i < x.ndirs; i++) free(x.dirs[i].rel);
  free(x.dirs);
  dm_archive_names_free(links.v, links.n);
  if (rc != 0) {
    dm_err keep = *err;
    dm_err ignored;
    dm_cf_remove_contents(dest_fd, &ignored);
    *err = keep;
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

int dm_archive_extract_fd(int tar_fd, int dest_fd, const dm_archive_limits *lim, dm_archive_stats *st, char ***names,
                          size_t *nnames, dm_archive_err *err, atomic_int *cancel) {
  return extract_impl(tar_fd, dest_fd, lim, 0, st, names, nnames, err, cancel);
}

static int dir_is_empty(int fd, int *is_empty) {
  int d2 = dup(fd);
  DIR *d = d2 >= 0 ? fdopendir(d2) : NULL;
  if (!d) {
    if (d2 >= 0) close(d2);
    return -1;
  }
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

int dm_archive_extract(const char *tar_path, const char *dest_dir, const dm_archive_limits *lim, dm_archive_stats *st,
                       char ***names, size_t *nnames, dm_archive_err *err) {
  memset(st, 0, sizeof *st);
  if (names) *names = NULL;
  if (nnames) *nnames = 0;
  int created = 0;
  if (mkdir(dest_dir, 0755) == 0) created = 1;
  else if (errno != EEXIST) {
    set_errno(err, errno, "dest_dir", dest_dir);
    return -1;
  }
  int dfd = open(dest_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    set_errno(err, errno, "dest_dir", dest_dir);
    if (created) rmdir(dest_dir);
    return -1;
  }
  int empty = 0;
  if (!created && (dir_is_empty(dfd, &empty) != 0 || !empty)) {
    if (empty) set_errno(err, errno, "dest_dir", dest_dir);
    else set_err(err, "ENOTEMPTY", "dest_dir %s: must be empty", dest_dir);
    close(dfd);
    return -1;
  }
  int tfd = open(tar_path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  int rc;
  if (tfd < 0) {
    set_errno(err, errno, "open", tar_path);
    rc = -1;
  } else {
    rc = extract_impl(tfd, dfd, lim, 1, st, names, nnames, err, NULL);
    close(tfd);
  }
  close(dfd);
  if (rc != 0 && created) {
    dm_err ignored;
    /* dest_dir was made by this call and is empty again */
    if (rmdir(dest_dir) != 0) {
      int d = open(dest_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (d >= 0) {
        dm_cf_remove_contents(d, &ignored);
        close(d);
      }
      rmdir(dest_dir);
    }
  }
  return rc;
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
