/* core/archive.c: extract path checks against hostile tars built here with libarchive,
 * limits, list, and pack -> extract round trips with sha256-identical contents. */
#include "tar.h"
#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "check.h"
static char base[512];

/* ---- SHA-256 (FIPS 180-4), small and slow, for comparing contents ---- */
typedef struct {
  uint32_t h[8];
  uint64_t len;
  unsigned char buf[64];
  size_t n;
} sha256_ctx;

static const uint32_t K[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_ctx *c, const unsigned char *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3], e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
    h = g, g = f, f = e, e = d + t1, d = cc, cc = b, b = a, a = t1 + t2;
  }
  c->h[0] += a, c->h[1] += b, c->h[2] += cc, c->h[3] += d;
  c->h[4] += e, c->h[5] += f, c->h[6] += g, c->h[7] += h;
}

static void sha256_init(sha256_ctx *c) {
  static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, iv, sizeof iv);
  c->len = 0;
  c->n = 0;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t len) {
  const unsigned char *p = data;
  c->len += len;
  while (len) {
    size_t k = 64 - c->n < len ? 64 - c->n : len;
    memcpy(c->buf + c->n, p, k);
    c->n += k, p += k, len -= k;
    if (c->n == 64) {
      sha256_block(c, c->buf);
      c->n = 0;
    }
  }
}

static void sha256_hex(sha256_ctx *c, char out[65]) {
  uint64_t bits = c->len * 8;
  unsigned char pad = 0x80, zero = 0, lenb[8];
  sha256_update(c, &pad, 1);
  while (c->n != 56) sha256_update(c, &zero, 1);
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)(bits >> (56 - 8 * i));
  sha256_update(c, lenb, 8);
  for (int i = 0; i < 8; i++) sprintf(out + 8 * i, "%08x", c->h[i]);
}

static void sha256_mem(const void *data, size_t len, char out[65]) {
  sha256_ctx c;
  sha256_init(&c);
  sha256_update(&c, data, len);
  sha256_hex(&c, out);
}

static int sha256_file(const char *path, char out[65]) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  sha256_ctx c;
  sha256_init(&c);
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) sha256_update(&c, buf, (size_t)n);
  close(fd);
  sha256_hex(&c, out);
  return 0;
}

/* ---- helpers ---- */

static const char *path_in(const char *rel) {
  static char bufs[8][PATH_MAX];
  static int i;
  char *b = bufs[i++ % 8];
  snprintf(b, PATH_MAX, "%s/%s", base, rel);
  return b;
}

static int rm_cb(const char *p, const struct stat *sb, int f, struct FTW *ftw) { return remove(p); }
static void rm_rf(const char *p) { nftw(p, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

static int exists(const char *p) {
  struct stat st;
  return lstat(p, &st) == 0;
}

static int is_empty_dir(const char *p) {
  char cmd[PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", p);
  return system(cmd) == 0;
}

static void write_file(const char *p, const void *data, size_t len) {
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || write(fd, data, len) != (ssize_t)len) {
    perror(p);
    exit(2);
  }
  close(fd);
}

/* One entry of a hand-made tar. */
typedef struct {
  const char *name;
  char type;          /* 'f' file, 'd' dir, 'l' symlink, 'h' hardlink, 'p' fifo, 'c' char device */
  const char *target; /* link target */
  const char *data;   /* file contents */
} spec;

static void build_tar(const char *path, const spec *s, size_t n) {
  struct archive *a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  if (archive_write_open_filename(a, path) != ARCHIVE_OK) {
    fprintf(stderr, "build_tar: %s\n", archive_error_string(a));
    exit(2);
  }
  for (size_t i = 0; i < n; i++) {
    struct archive_entry *e = archive_entry_new();
    archive_entry_set_pathname(e, s[i].name);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_mtime(e, 1700000000, 0);
    switch (s[i].type) {
    case 'f':
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_set_size(e, (la_int64_t)strlen(s[i].data ? s[i].data : ""));
      break;
    case 'd':
      archive_entry_set_filetype(e, AE_IFDIR);
      archive_entry_set_perm(e, 0755);
      break;
    case 'l':
      archive_entry_set_filetype(e, AE_IFLNK);
      archive_entry_set_symlink(e, s[i].target);
      break;
    case 'h':
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_set_hardlink(e, s[i].target);
      archive_entry_set_size(e, 0);
      break;
    case 'p': archive_entry_set_filetype(e, AE_IFIFO); break;
    case 'c':
      archive_entry_set_filetype(e, AE_IFCHR);
      archive_entry_set_rdev(e, makedev(1, 3));
      break;
    }
    archive_write_header(a, e);
    if (s[i].type == 'f' && s[i].data) archive_write_data(a, s[i].data, strlen(s[i].data));
    archive_entry_free(e);
  }
  archive_write_close(a);
  archive_write_free(a);
}

/* Extracting `s` must fail with EUNSAFE naming `culprit`, leaving nothing behind, both into
 * a missing dest (removed again) and into an existing empty one (left empty). */
static void expect_unsafe(const char *label, const spec *s, size_t n, const char *culprit) {
  const char *tar = path_in("unsafe.tar");
  build_tar(tar, s, n);
  for (int pre = 0; pre < 2; pre++) {
    char dest[PATH_MAX];
    snprintf(dest, sizeof dest, "%s/dest-%s-%d", base, label, pre);
    if (pre) mkdir(dest, 0755);
    dm_archive_stats st;
    dm_archive_err err;
    char **names = (char **)1;
    size_t nn = 99;
    int rc = dm_archive_extract(tar, dest, NULL, &st, &names, &nn, &err);
    CHECK(rc == -1, "%s: extract should fail", label);
    if (rc == -1) {
      if (getenv("VERBOSE")) fprintf(stderr, "%s: %s: %s\n", label, err.code, err.msg);
      CHECK(!strcmp(err.code, "EUNSAFE"), "%s: code %s (%s)", label, err.code, err.msg);
      CHECK(strstr(err.msg, culprit) != NULL, "%s: message '%s' should name '%s'", label, err.msg, culprit);
    }
    CHECK(names == NULL && nn == 0, "%s: no names on failure", label);
    if (pre) CHECK(is_empty_dir(dest), "%s: existing dest left empty", label);
    else CHECK(!exists(dest), "%s: created dest removed", label);
    rm_rf(dest);
  }
  /* the escape never happened */
  CHECK(!exists(path_in("evil")), "%s: nothing written outside", label);
}

static void test_unsafe_entries(void) {
  spec abs[] = {{"good.txt", 'f', NULL, "fine"}, {"/tmp/dm-evil-abs", 'f', NULL, "x"}};
  expect_unsafe("absolute", abs, 2, "/tmp/dm-evil-abs");
  CHECK(!exists("/tmp/dm-evil-abs"), "absolute: not written");

  spec dotdot[] = {{"good.txt", 'f', NULL, "fine"}, {"../evil", 'f', NULL, "x"}};
  expect_unsafe("dotdot", dotdot, 2, "../evil");

  spec deep[] = {{"a/", 'd', NULL, NULL}, {"a/../../evil", 'f', NULL, "x"}};
  expect_unsafe("deep-dotdot", deep, 2, "a/../../evil");

  spec inner[] = {{"a/../b", 'f', NULL, "x"}};
  expect_unsafe("inner-dotdot", inner, 1, "a/../b");

  spec labs[] = {{"l", 'l', "/etc", NULL}};
  expect_unsafe("symlink-absolute", labs, 1, "'l'");

  spec lrel[] = {{"d/", 'd', NULL, NULL}, {"d/l", 'l', "../../evil", NULL}};
  expect_unsafe("symlink-escape", lrel, 2, "d/l");

  /* each link is lexically fine; together "l" -> "s/.." -> "./.." leaves the root */
  spec chain[] = {{"l", 'l', "s/..", NULL}, {"s", 'l', ".", NULL}};
  expect_unsafe("symlink-chain", chain, 2, "'l'");

  spec through[] = {{"sub/", 'd', NULL, NULL}, {"a", 'l', "sub", NULL}, {"a/x", 'f', NULL, "x"}};
  expect_unsafe("through-symlink", through, 3, "a/x");

  /* a hard link only to a regular file extracted before it, inside the destination */
  spec hard_out[] = {{"h", 'h', "/etc/passwd", NULL}};
  expect_unsafe("hardlink-outside", hard_out, 1, "'h'");

  spec hard_up[] = {{"h", 'h', "../x", NULL}};
  expect_unsafe("hardlink-dotdot", hard_up, 1, "'h'");

  spec hard_later[] = {{"h", 'h', "file", NULL}, {"file", 'f', NULL, "data"}};
  expect_unsafe("hardlink-before-target", hard_later, 2, "'h'");

  spec hard_sym[] = {{"l", 'l', "x", NULL}, {"h", 'h', "l", NULL}};
  expect_unsafe("hardlink-to-symlink", hard_sym, 2, "'h'");

  spec fifo[] = {{"p", 'p', NULL, NULL}};
  expect_unsafe("fifo", fifo, 1, "'p'");

  spec dev[] = {{"dev/null", 'c', NULL, NULL}};
  expect_unsafe("device", dev, 1, "dev/null");
}

static void test_safe_links_and_limits(void) {
  const char *tar = path_in("safe.tar");
  spec ok[] = {
    {"./", 'd', NULL, NULL},
    {"./data/", 'd', NULL, NULL},
    {"./data/file", 'f', NULL, "hello"},
    {"./lib/", 'd', NULL, NULL},
    {"./lib/link", 'l', "../data/file", NULL},
    {"./self", 'l', ".", NULL},
    {"./dangling", 'l', "nowhere/x", NULL},
  };
  build_tar(tar, ok, 7);
  const char *dest = path_in("safe-dest");
  dm_archive_stats st;
  dm_archive_err err;
  char **names;
  size_t nn;
  int rc = dm_archive_extract(tar, dest, NULL, &st, &names, &nn, &err);
  CHECK(rc == 0, "safe extract: %s %s", rc ? err.code : "", rc ? err.msg : "");
  if (rc == 0) {
    CHECK(st.files == 1 && st.bytes == 5, "stats %llu %llu", (unsigned long long)st.files,
          (unsigned long long)st.bytes);
    CHECK(nn == 6, "6 names (root skipped), got %zu", nn);
    char buf[64] = {0};
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/lib/link", dest);
    int fd = open(p, O_RDONLY);
    CHECK(fd >= 0 && read(fd, buf, sizeof buf) == 5 && !strcmp(buf, "hello"), "link reads the file");
    if (fd >= 0) close(fd);
    dm_archive_names_free(names, nn);
  }
  rm_rf(dest);

  dm_archive_limits lim = {.max_entries = 3};
  rc = dm_archive_extract(tar, dest, &lim, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG"), "max_entries: %s", rc ? err.code : "ok");
  CHECK(!exists(dest), "max_entries: dest removed");

  lim.max_entries = 0;
  lim.max_bytes = 4;
  rc = dm_archive_extract(tar, dest, &lim, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG"), "max_bytes: %s", rc ? err.code : "ok");
  CHECK(!exists(dest), "max_bytes: dest removed");

  lim.max_bytes = 5;
  rc = dm_archive_extract(tar, dest, &lim, &st, NULL, NULL, &err);
  CHECK(rc == 0, "max_bytes at the cap: %s", rc ? err.msg : "ok");
  rm_rf(dest);

  /* a non-empty destination is refused and left alone */
  mkdir(dest, 0755);
  char keep[PATH_MAX];
  snprintf(keep, sizeof keep, "%s/keep", dest);
  write_file(keep, "k", 1);
  rc = dm_archive_extract(tar, dest, NULL, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "ENOTEMPTY"), "non-empty dest: %s", rc ? err.code : "ok");
  CHECK(exists(keep), "existing file kept");
  rm_rf(dest);

  rc = dm_archive_extract(path_in("missing.tar"), dest, NULL, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "ENOENT"), "missing tar: %s", rc ? err.code : "ok");
  CHECK(!exists(dest), "missing tar: dest removed");

  write_file(path_in("garbage.tar"), "this is not a tar archive at all", 32);
  rc = dm_archive_extract(path_in("garbage.tar"), dest, NULL, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "EARCHIVE"), "garbage: %s", rc ? err.code : "ok");

  dm_archive_item *items;
  size_t ni;
  rc = dm_archive_list(tar, &items, &ni, &err);
  CHECK(rc == 0 && ni == 7, "list: %zu", ni);
  if (rc == 0) {
    CHECK(!strcmp(items[2].name, "./data/file") && !strcmp(items[2].type, "file") && items[2].size == 5,
          "list file: %s %s", items[2].name, items[2].type);
    CHECK(!strcmp(items[4].type, "link") && !strcmp(items[4].target, "../data/file"), "list link");
    CHECK(!strcmp(items[1].type, "directory"), "list dir");
    dm_archive_items_free(items, ni);
  }
  spec h[] = {{"f", 'f', NULL, "x"}, {"h", 'h', "f", NULL}, {"p", 'p', NULL, NULL}};
  build_tar(path_in("types.tar"), h, 3);
  rc = dm_archive_list(path_in("types.tar"), &items, &ni, &err);
  CHECK(rc == 0 && ni == 3 && !strcmp(items[1].type, "hardlink") && !strcmp(items[2].type, "fifo"),
        "list hardlink/fifo");
  if (rc == 0) dm_archive_items_free(items, ni);
}

static void fill_random(unsigned char *p, size_t n, unsigned seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    p[i] = (unsigned char)x;
  }
}

static void test_round_trip(void) {
  static const size_t sizes[] = {0, 1024, 17 * 1024, 18 * 1024, 19 * 1024, 1024 * 1024};
  const char *src = path_in("src");
  mkdir(src, 0755);
  char p[PATH_MAX], want[6][65];
  unsigned char *buf = malloc(1024 * 1024);
  for (int i = 0; i < 6; i++) {
    fill_random(buf, sizes[i], (unsigned)i + 1);
    sha256_mem(buf, sizes[i], want[i]);
    snprintf(p, sizeof p, "%s/f%zu", src, sizes[i]);
    write_file(p, buf, sizes[i]);
  }
  free(buf);
  snprintf(p, sizeof p, "%s/sub", src);
  mkdir(p, 0750);
  snprintf(p, sizeof p, "%s/sub/run.sh", src);
  write_file(p, "#!/bin/sh\n", 10);
  chmod(p, 0755);
  snprintf(p, sizeof p, "%s/link", src);
  if (symlink("f1024", p) != 0) perror("symlink");
  snprintf(p, sizeof p, "%s/abs-link", src); /* stored as is: never followed when packing */
  if (symlink("/etc/hostname", p) != 0) perror("symlink");
  snprintf(p, sizeof p, "%s/sock", src); /* sockets are skipped */
  int sfd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(p) < sizeof sa.sun_path) memcpy(sa.sun_path, p, strlen(p) + 1);
  int bound = bind(sfd, (struct sockaddr *)&sa, sizeof sa) == 0;

  const char *data = "FROM scratch\n";
  dm_archive_entry entries[] = {
    {.src = src, .name = "tree"},
    {.src = NULL, .name = "ctx/Containerfile", .data = data, .data_len = strlen(data), .mode = 0600},
  };
  const char *tar = path_in("round.tar");
  dm_archive_stats st;
  dm_archive_err err;
  int rc = dm_archive_pack(tar, entries, 2, &st, &err);
  CHECK(rc == 0, "pack: %s", rc ? err.msg : "");
  uint64_t total = strlen(data) + 10;
  for (int i = 0; i < 6; i++) total += sizes[i];
  CHECK(st.files == 8 && st.bytes == total, "pack stats %llu %llu", (unsigned long long)st.files,
        (unsigned long long)st.bytes);

  dm_archive_item *items;
  size_t ni;
  if (dm_archive_list(tar, &items, &ni, &err) == 0) {
    int saw_sock = 0, saw_abs = 0;
    for (size_t i = 0; i < ni; i++) {
      if (strstr(items[i].name, "sock")) saw_sock = 1;
      if (strstr(items[i].name, "abs-link") && !strcmp(items[i].type, "link")) saw_abs = 1;
    }
    CHECK(!saw_sock, "socket skipped");
    CHECK(saw_abs, "absolute symlink stored as a link");
    dm_archive_items_free(items, ni);
  }

  /* the absolute link is refused on extract: pack a copy without it for the round trip */
  snprintf(p, sizeof p, "%s/abs-link", src);
  unlink(p);
  rc = dm_archive_pack(tar, entries, 2, &st, &err);
  CHECK(rc == 0, "pack: %s", rc ? err.msg : "");

  const char *dest = path_in("round-dest");
  char **names;
  size_t nn;
  rc = dm_archive_extract(tar, dest, NULL, &st, &names, &nn, &err);
  CHECK(rc == 0, "extract: %s %s", rc ? err.code : "", rc ? err.msg : "");
  if (rc == 0) {
    CHECK(st.files == 8 && st.bytes == total, "extract stats");
    dm_archive_names_free(names, nn);
  }
  for (int i = 0; i < 6; i++) {
    char got[65] = "";
    snprintf(p, sizeof p, "%s/tree/f%zu", dest, sizes[i]);
    CHECK(sha256_file(p, got) == 0 && !strcmp(got, want[i]), "sha256 of f%zu: %s != %s", sizes[i], got, want[i]);
  }
  char got[65] = "", wantd[65];
  sha256_mem(data, strlen(data), wantd);
  snprintf(p, sizeof p, "%s/ctx/Containerfile", dest);
  CHECK(sha256_file(p, got) == 0 && !strcmp(got, wantd), "in-memory entry contents");
  struct stat sst;
  CHECK(stat(p, &sst) == 0 && (sst.st_mode & 0777) == 0600, "in-memory mode 0600");
  snprintf(p, sizeof p, "%s/tree/sub/run.sh", dest);
  CHECK(stat(p, &sst) == 0 && (sst.st_mode & 0777) == 0755, "executable bit kept");
  char target[64] = "";
  snprintf(p, sizeof p, "%s/tree/link", dest);
  CHECK(readlink(p, target, sizeof target - 1) > 0 && !strcmp(target, "f1024"), "symlink kept: %s", target);
  rm_rf(dest);

  /* "." puts a folder's contents at the top */
  dm_archive_entry flat[] = {{.src = src, .name = "."}};
  rc = dm_archive_pack(tar, flat, 1, &st, &err);
  CHECK(rc == 0, "pack '.': %s", rc ? err.msg : "");
  rc = dm_archive_extract(tar, dest, NULL, &st, NULL, NULL, &err);
  snprintf(p, sizeof p, "%s/f0", dest);
  CHECK(rc == 0 && exists(p), "flat layout");
  rm_rf(dest);

  /* bad names fail and leave no output */
  dm_archive_entry bad[] = {{.src = src, .name = "../up"}};
  rc = dm_archive_pack(tar, bad, 1, &st, &err);
  CHECK(rc == -1 && !strcmp(err.code, "EINVAL"), "bad name: %s", rc ? err.code : "ok");
  CHECK(!exists(tar), "no output left");
  dm_archive_entry missing[] = {{.src = path_in("nope"), .name = "x"}};
  rc = dm_archive_pack(tar, missing, 1, &st, &err);
  CHECK(rc == -1 && !strcmp(err.code, "ENOENT"), "missing src: %s", rc ? err.code : "ok");

  /* packing a folder into a file inside it skips the output itself */
  char inner_tar[PATH_MAX];
  snprintf(inner_tar, sizeof inner_tar, "%s/self.tar", src);
  rc = dm_archive_pack(inner_tar, flat, 1, &st, &err);
  CHECK(rc == 0 && st.files == 7, "self-containing pack: %d files", (int)st.files);
  unlink(inner_tar);
  CHECK(bound, "socket bound");
  close(sfd);
}

/* A pax tar with one sparse file of `realsize` bytes whose only data is `data` at offset 0
 * (GNU.sparse 1.0 map, written by libarchive), then a plain file "after". */
static void build_sparse_tar(const char *path, int64_t realsize, const char *data) {
  struct archive *a = archive_write_new();
  archive_write_set_format_pax(a);
  archive_write_open_filename(a, path);
  struct archive_entry *e = archive_entry_new();
  archive_entry_set_pathname(e, "sparse.bin");
  archive_entry_set_filetype(e, AE_IFREG);
  archive_entry_set_perm(e, 0644);
  archive_entry_set_size(e, realsize);
  archive_entry_sparse_add_entry(e, 0, (la_int64_t)strlen(data));
  archive_write_header(a, e);
  archive_write_data(a, data, strlen(data));
  archive_entry_free(e);
  e = archive_entry_new();
  archive_entry_set_pathname(e, "after");
  archive_entry_set_filetype(e, AE_IFREG);
  archive_entry_set_perm(e, 0644);
  archive_entry_set_size(e, 1);
  archive_write_header(a, e);
  archive_write_data(a, "z", 1);
  archive_entry_free(e);
  archive_write_close(a);
  archive_write_free(a);
}

static long long disk_bytes(const char *path) {
  char cmd[PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "du -s -B1 '%s' | cut -f1", path);
  FILE *f = popen(cmd, "r");
  long long n = -1;
  if (f) {
    if (fscanf(f, "%lld", &n) != 1) n = -1;
    pclose(f);
  }
  return n;
}

static void test_sparse_and_lying(void) {
  /* 100 GiB apparent, 5 bytes of data: refused on the declared size, nothing written */
  const char *tar = path_in("sparse.tar");
  build_sparse_tar(tar, 100LL << 30, "hello");
  dm_archive_item *items;
  size_t ni;
  dm_archive_err err;
  if (dm_archive_list(tar, &items, &ni, &err) == 0) {
    CHECK(ni == 2 && items[0].size == (100LL << 30), "the tar declares 100 GiB: %lld", (long long)items[0].size);
    dm_archive_items_free(items, ni);
  }
  const char *dest = path_in("sparse-dest");
  dm_archive_limits lim = {.max_bytes = 10 << 20};
  dm_archive_stats st;
  int rc = dm_archive_extract(tar, dest, &lim, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG") && strstr(err.msg, "sparse.bin"), "100 GiB sparse under 10 MiB: %s %s",
        rc ? err.code : "ok", rc ? err.msg : "");
  CHECK(!exists(dest), "nothing left of the refused extraction");

  /* a small sparse file within the cap: holes stay holes, the apparent size is right */
  build_sparse_tar(tar, 1 << 20, "hello");
  rc = dm_archive_extract(tar, dest, &lim, &st, NULL, NULL, &err);
  CHECK(rc == 0, "1 MiB sparse: %s", rc ? err.msg : "");
  if (rc == 0) {
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/sparse.bin", dest);
    struct stat sst;
    CHECK(stat(p, &sst) == 0 && sst.st_size == (1 << 20), "apparent size 1 MiB");
    CHECK(st.bytes == 6, "bytes counts what was written (5 + 1): %llu", (unsigned long long)st.bytes);
    CHECK(disk_bytes(dest) < (512 << 10), "the holes were not written: %lld bytes on disk", disk_bytes(dest));
    char buf[8] = {0};
    int fd = open(p, O_RDONLY);
    CHECK(fd >= 0 && read(fd, buf, 5) == 5 && !strcmp(buf, "hello"), "data at offset 0");
    if (fd >= 0) close(fd);
  }
  rm_rf(dest);

  /* a tar cut short: the header promises more data than there is */
  spec one[] = {{"big", 'f', NULL, "0123456789abcdef0123456789abcdef"}};
  build_tar(tar, one, 1);
  int fd = open(tar, O_WRONLY);
  CHECK(fd >= 0 && ftruncate(fd, 512 + 10) == 0, "truncate");
  if (fd >= 0) close(fd);
  rc = dm_archive_extract(tar, dest, NULL, &st, NULL, NULL, &err);
  CHECK(rc == -1 && !strcmp(err.code, "EARCHIVE"), "truncated: %s %s", rc ? err.code : "ok", rc ? err.msg : "");
  CHECK(!exists(dest), "nothing left of the truncated extraction");

  /* a tar larger than max_archive_bytes is refused before anything is read */
  build_tar(tar, one, 1);
  int tfd = open(tar, O_RDONLY);
  mkdir(dest, 0755);
  int dfd = open(dest, O_RDONLY | O_DIRECTORY);
  dm_archive_limits small = {.max_archive_bytes = 1024};
  rc = dm_archive_extract_fd(tfd, dfd, &small, &st, NULL, NULL, &err, NULL);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG") && strstr(err.msg, "max_archive_bytes"), "max_archive_bytes: %s",
        rc ? err.msg : "ok");
  /* cancelled before it starts: ECANCELED, nothing written */
  atomic_int cancel = 1;
  rc = dm_archive_extract_fd(tfd, dfd, NULL, &st, NULL, NULL, &err, &cancel);
  CHECK(rc == -1 && !strcmp(err.code, "ECANCELED"), "cancel: %s", rc ? err.code : "ok");
  CHECK(is_empty_dir(dest), "nothing written when cancelled");
  /* the archive must be a regular file */
  rc = dm_archive_extract_fd(dfd, dfd, NULL, &st, NULL, NULL, &err, NULL);
  CHECK(rc == -1 && !strcmp(err.code, "EINVAL"), "a folder as the archive: %s", rc ? err.code : "ok");
  close(dfd);
  close(tfd);
  rm_rf(dest);
}

/* Names `depth` levels deep: "a/a/.../f". */
static void test_depth(void) {
  const char *tar = path_in("deep.tar");
  for (int depth = 250; depth <= 300; depth += 50) {
    struct archive *a = archive_write_new();
    archive_write_set_format_pax_restricted(a);
    archive_write_open_filename(a, tar);
    char name[PATH_MAX] = "";
    for (int i = 0; i < depth; i++) strcat(name, "a/");
    struct archive_entry *e = archive_entry_new();
    strcat(name, "f");
    archive_entry_set_pathname(e, name);
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_size(e, 1);
    archive_write_header(a, e);
    archive_write_data(a, "x", 1);
    archive_entry_free(e);
    archive_write_close(a);
    archive_write_free(a);
    const char *dest = path_in("deep-dest");
    dm_archive_stats st;
    dm_archive_err err;
    int rc = dm_archive_extract(tar, dest, NULL, &st, NULL, NULL, &err);
    if (depth + 1 <= DM_TREE_MAX_DEPTH) {
      CHECK(rc == 0 && st.files == 1, "%d levels extract: %s", depth, rc ? err.msg : "");
    } else {
      CHECK(rc == -1 && !strcmp(err.code, "E2BIG") && strstr(err.msg, "a/a/a") && strstr(err.msg, "256 levels"),
            "%d levels refused naming the path: %s %s", depth, rc ? err.code : "ok", rc ? err.msg : "");
      CHECK(!exists(dest), "nothing left");
    }
    rm_rf(dest);
  }
}

/* pack_fd: sizes are summed first (nothing written over the cap), folders too deep refused. */
static void test_pack_limits(void) {
  const char *src = path_in("psrc");
  mkdir(src, 0755);
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/big", src);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0 && ftruncate(fd, 100LL << 30) == 0, "a 100 GiB sparse source");
  if (fd >= 0) close(fd);
  const char *out = path_in("p.tar");
  int ofd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dm_archive_entry en[] = {{.src = src, .name = "psrc"}};
  dm_archive_limits lim = {.max_bytes = 1 << 20, .strict_src = 1};
  dm_archive_stats st;
  dm_archive_err err;
  int rc = dm_archive_pack_fd(ofd, en, 1, &lim, &st, &err, NULL);
  struct stat ost;
  fstat(ofd, &ost);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG"), "over the cap: %s", rc ? err.code : "ok");
  CHECK(ost.st_size == 0, "nothing written when over the cap: %lld bytes", (long long)ost.st_size);
  close(ofd);
  unlink(p);
  /* an entry cap: refused in the sizing pass, nothing written */
  ofd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (int i = 0; i < 20; i++) {
    snprintf(p, sizeof p, "%s/n%d", src, i);
    int nf = open(p, O_WRONLY | O_CREAT, 0644);
    if (nf >= 0) close(nf);
  }
  dm_archive_limits few = {.max_entries = 10};
  rc = dm_archive_pack_fd(ofd, en, 1, &few, &st, &err, NULL);
  fstat(ofd, &ost);
  CHECK(rc == -1 && !strcmp(err.code, "E2BIG") && ost.st_size == 0, "max_entries: %s, %lld bytes written",
        rc ? err.code : "ok", (long long)ost.st_size);
  close(ofd);
  snprintf(p, sizeof p, "%s/big", src);
  /* a source through a symlink is refused in strict mode */
  char link[PATH_MAX + 16], via[PATH_MAX + 32];
  snprintf(link, sizeof link, "%s/plink", base);
  symlink(src, link);
  mkdir(p, 0755); /* psrc/big, now a folder */
  snprintf(via, sizeof via, "%s/big", link);
  ofd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dm_archive_entry en2[] = {{.src = via, .name = "v"}};
  rc = dm_archive_pack_fd(ofd, en2, 1, &lim, &st, &err, NULL);
  CHECK(rc == -1 && !strcmp(err.code, "ELOOP"), "strict: a link on the way is refused: %s", rc ? err.code : "ok");
  lim.strict_src = 0;
  rc = dm_archive_pack_fd(ofd, en2, 1, &lim, &st, &err, NULL);
  CHECK(rc == 0, "not strict: the host's own link is followed: %s", rc ? err.msg : "ok");
  close(ofd);
  /* strict: a source that is itself a link now (a live sandbox swapped its folder for one
   * after the caller's path was checked) is refused, never packed as a link entry */
  char top[PATH_MAX + 16];
  snprintf(top, sizeof top, "%s/toplink", base);
  CHECK(symlink(src, top) == 0, "the top-level link");
  ofd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dm_archive_entry en3[] = {{.src = top, .name = "t"}};
  lim.strict_src = 1;
  lim.max_bytes = 0;
  lim.max_entries = 0;
  rc = dm_archive_pack_fd(ofd, en3, 1, &lim, &st, &err, NULL);
  fstat(ofd, &ost);
  CHECK(rc == -1 && !strcmp(err.code, "EAGAIN"), "strict: a source that is a link is refused: %s",
        rc ? err.code : "packed");
  CHECK(rc == -1 && strstr(err.msg, "link"), "the message says it is a link: %s", rc ? err.msg : "");
  close(ofd);
  unlink(top);
  unlink(out);
}

int main(void) {
  snprintf(base, sizeof base, "%s/dm-archive-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(base)) {
    perror("mkdtemp");
    return 2;
  }
  test_unsafe_entries();
  test_safe_links_and_limits();
  test_round_trip();
  test_sparse_and_lying();
  test_depth();
  test_pack_limits();
  rm_rf(base);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("test_archive: all checks passed\n");
  return 0;
}
