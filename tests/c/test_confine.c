/* core/confine.c: confined opens (links, "..", FIFOs, devices), atomic writes, deep tree
 * removal, and the attacks a sandbox can mount on a tree the host works in: a thread that
 * swaps folders for symlinks to a canary folder while the host removes, writes or
 * extracts. The canary must never change. */
#include "tar.h"
#include <archive.h>
#include <archive_entry.h>
#include "confine.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
static char base[512];

static const char *P(const char *rel) {
  static char bufs[8][PATH_MAX];
  static int i;
  char *b = bufs[i++ % 8];
  snprintf(b, PATH_MAX, "%s/%s", base, rel);
  return b;
}

static void write_file(const char *p, const char *data) {
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || write(fd, data, strlen(data)) != (ssize_t)strlen(data)) {
    perror(p);
    exit(2);
  }
  close(fd);
}

static int exists(const char *p) {
  struct stat st;
  return lstat(p, &st) == 0;
}

static void rm_rf(const char *p) {
  char cmd[PATH_MAX + 32];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
  if (system(cmd) != 0) fprintf(stderr, "rm -rf %s failed\n", p);
}

/* The canary: a folder outside every tree under attack, with one file. Returns 1 when it
 * holds exactly that file with its contents and mode. */
static void make_canary(void) {
  mkdir(P("canary"), 0755);
  write_file(P("canary/keep"), "canary\n");
  chmod(P("canary/keep"), 0600);
}

static int canary_intact(void) {
  DIR *d = opendir(P("canary"));
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  char buf[64] = {0};
  int fd = open(P("canary/keep"), O_RDONLY);
  if (fd < 0) return 0;
  ssize_t r = read(fd, buf, sizeof buf - 1);
  close(fd);
  struct stat st;
  stat(P("canary/keep"), &st);
  return n == 1 && r == 7 && !strcmp(buf, "canary\n") && (st.st_mode & 0777) == 0600;
}

static void test_open(void) {
  mkdir(P("t"), 0755);
  write_file(P("t/f"), "hello");
  mkdir(P("t/sub"), 0755);
  write_file(P("t/sub/g"), "g");
  symlink(P("canary/keep"), P("t/link"));
  symlink("sub", P("t/sublink"));
  mkfifo(P("t/fifo"), 0644);
  int root = open(P("t"), O_RDONLY | O_DIRECTORY);
  dm_err err;
  struct stat st;

  int fd = dm_cf_open_file(root, "f", DM_CF_READ, 0, &st, &err);
  CHECK(fd >= 0 && st.st_size == 5, "read a regular file: %s", fd < 0 ? err.msg : "");
  if (fd >= 0) {
    CHECK(fcntl(fd, F_GETFL) & O_NONBLOCK, "O_NONBLOCK");
    close(fd);
  }
  fd = dm_cf_open_file(root, "sub/g", DM_CF_READ, 0, NULL, &err);
  CHECK(fd >= 0, "below a folder");
  if (fd >= 0) close(fd);

  /* the FIFO is refused without being opened: alarm() would kill a blocked open */
  alarm(10);
  fd = dm_cf_open_file(root, "fifo", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EINVAL") && strstr(err.msg, "fifo"), "fifo: %s", err.msg);
  fd = dm_cf_open_file(root, "fifo", DM_CF_APPEND, 0644, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EINVAL"), "fifo append: %s", err.msg);
  alarm(0);

  fd = dm_cf_open_file(root, "link", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "ELOOP"), "final symlink: %s", err.code);
  fd = dm_cf_open_file(root, "sublink/g", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "ELOOP"), "symlink on the way: %s", err.code);
  fd = dm_cf_open_file(root, "../canary/keep", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EXDEV"), "dotdot: %s", err.code);
  fd = dm_cf_open_file(root, "sub/../../canary/keep", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EXDEV"), "inner dotdot: %s", err.code);
  fd = dm_cf_open_file(root, P("canary/keep"), DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EINVAL"), "absolute: %s", err.code);
  fd = dm_cf_open_file(root, "sub", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EINVAL") && strstr(err.msg, "directory"), "folder: %s", err.msg);
  fd = dm_cf_open_file(root, "missing", DM_CF_READ, 0, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "ENOENT"), "missing: %s", err.code);
  if (geteuid() == 0 && mknod(P("t/null"), S_IFCHR | 0666, makedev(1, 3)) == 0) {
    fd = dm_cf_open_file(root, "null", DM_CF_READ, 0, NULL, &err);
    CHECK(fd < 0 && strstr(err.msg, "character device"), "device: %s", err.msg);
  }

  /* append creates, then appends; create refuses anything there, even a dangling link */
  fd = dm_cf_open_file(root, "log", DM_CF_APPEND, 0640, NULL, &err);
  CHECK(fd >= 0, "append creates: %s", fd < 0 ? err.msg : "");
  if (fd >= 0) {
    CHECK(write(fd, "a", 1) == 1, "write");
    close(fd);
  }
  fd = dm_cf_open_file(root, "log", DM_CF_APPEND, 0640, NULL, &err);
  if (fd >= 0) {
    CHECK(write(fd, "b", 1) == 1, "write");
    close(fd);
  }
  CHECK(dm_cf_lstat(root, "log", &st) == 0 && st.st_size == 2, "appended");
  fd = dm_cf_open_file(root, "link", DM_CF_APPEND, 0644, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "ELOOP"), "append through a link: %s", err.code);
  symlink(P("canary/new"), P("t/dangling"));
  fd = dm_cf_open_file(root, "dangling", DM_CF_CREATE, 0644, NULL, &err);
  CHECK(fd < 0 && !strcmp(err.code, "EEXIST"), "create over a dangling link: %s", err.code);
  CHECK(!exists(P("canary/new")), "nothing made through the link");

  /* lstat, mkdir, unlink, rename, chmod: confined */
  CHECK(dm_cf_lstat(root, "link", &st) == 0 && S_ISLNK(st.st_mode), "lstat describes the link");
  CHECK(dm_cf_mkdir(root, "sublink/x", 0755) < 0 && errno == ELOOP, "mkdir through a link");
  CHECK(dm_cf_chmod(root, "link", 0777) < 0 && errno == ELOOP, "chmod of a link");
  CHECK(dm_cf_chmod(root, "f", 0600) == 0 && dm_cf_lstat(root, "f", &st) == 0 && (st.st_mode & 0777) == 0600, "chmod");
  CHECK(dm_cf_unlink(root, "sublink/g") < 0 && errno == ELOOP, "unlink through a link");
  CHECK(dm_cf_rename(root, "f", root, "sublink/f", 0) < 0 && errno == ELOOP, "rename through a link");
  write_file(P("t/f2"), "2");
  CHECK(dm_cf_rename(root, "f2", root, "f", 1) < 0 && errno == EEXIST, "noreplace");
  CHECK(dm_cf_rename(root, "f2", root, "sub/f2", 1) == 0 && exists(P("t/sub/f2")), "rename");

  /* write_atomic replaces a FIFO or a link at the target, never writes through it */
  alarm(10);
  CHECK(dm_cf_write_atomic(root, "fifo", "x", 1, 0644, &err) == 0, "write over a fifo: %s", err.msg);
  CHECK(dm_cf_write_atomic(root, "link", "x", 1, 0644, &err) == 0, "write over a link: %s", err.msg);
  alarm(0);
  CHECK(dm_cf_lstat(root, "fifo", &st) == 0 && S_ISREG(st.st_mode), "the fifo became a file");
  CHECK(dm_cf_lstat(root, "link", &st) == 0 && S_ISREG(st.st_mode), "the link became a file");
  CHECK(dm_cf_write_atomic(root, "sublink/x", "x", 1, 0644, &err) < 0 && !strcmp(err.code, "ELOOP"),
        "write through a link: %s", err.code);
  CHECK(canary_intact(), "canary intact after the open tests");
  close(root);
  rm_rf(P("t"));
}

/* A folder `depth` levels deep made with mkdirat on held descriptors (no path limit). */
static void make_deep(const char *top, int depth, int with_links) {
  mkdir(top, 0755);
  int fd = open(top, O_RDONLY | O_DIRECTORY);
  for (int i = 0; i < depth; i++) {
    if (with_links && i % 100 == 0) {
      symlinkat(P("canary"), fd, "to-canary");
      int f = openat(fd, "file", O_WRONLY | O_CREAT, 0644);
      if (f >= 0) close(f);
    }
    mkdirat(fd, "a", 0755);
    int n = openat(fd, "a", O_RDONLY | O_DIRECTORY);
    close(fd);
    fd = n;
    if (fd < 0) {
      perror("make_deep");
      exit(2);
    }
  }
  close(fd);
}

static void test_remove_deep(void) {
  make_deep(P("deep"), 3000, 1);
  int root = open(base, O_RDONLY | O_DIRECTORY);
  dm_err err;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int r = dm_cf_remove_tree(root, "deep", &err);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  CHECK(r == 0, "remove 3000 levels: %s", r ? err.msg : "");
  CHECK(!exists(P("deep")), "gone");
  CHECK(canary_intact(), "links to the canary removed, not followed");
  if (getenv("VERBOSE"))
    fprintf(stderr, "removed 3000 levels in %.3f s\n", (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
  CHECK(dm_cf_remove_tree(root, "deep", &err) == 0, "a missing tree is success");
  /* a link as the tree itself: the link goes, its target stays */
  symlink(P("canary"), P("lnk"));
  CHECK(dm_cf_remove_tree(root, "lnk", &err) == 0 && !exists(P("lnk")), "link removed");
  CHECK(canary_intact(), "canary intact");
  close(root);
}

/* ---- races: a thread swaps a folder under the host's feet ---- */

typedef struct {
  char dir[PATH_MAX]; /* the folder to swap (a copy: P() buffers are not thread-safe) */
  atomic_int stop;
  long swaps;
} swapper;

static void swapper_init(swapper *s, const char *dir) {
  memset(s, 0, sizeof *s);
  snprintf(s->dir, sizeof s->dir, "%s", dir);
}

static void *swap_loop(void *arg) {
  swapper *s = arg;
  char aside[PATH_MAX + 8], canary[PATH_MAX];
  snprintf(aside, sizeof aside, "%s.aside", s->dir);
  snprintf(canary, sizeof canary, "%s/canary", base);
  while (!atomic_load(&s->stop)) {
    if (rename(s->dir, aside) == 0) {
      symlink(canary, s->dir);
      for (volatile int i = 0; i < 200; i++) {}
      unlink(s->dir);
      rename(aside, s->dir);
      s->swaps++;
    } else {
      symlink(canary, s->dir); /* gone already: plant a link where it was */
      for (volatile int i = 0; i < 200; i++) {}
      unlink(s->dir);
    }
  }
  return NULL;
}

static void fill(const char *dir, int files) {
  mkdir(dir, 0755);
  char p[PATH_MAX];
  for (int i = 0; i < files; i++) {
    snprintf(p, sizeof p, "%s/f%d", dir, i);
    write_file(p, "data");
    if (i % 50 == 0) {
      snprintf(p, sizeof p, "%s/d%d", dir, i);
      mkdir(p, 0755);
      snprintf(p, sizeof p, "%s/d%d/x", dir, i);
      write_file(p, "x");
    }
  }
}

static void test_remove_race(void) {
  int root = open(base, O_RDONLY | O_DIRECTORY);
  for (int round = 0; round < 20; round++) {
    fill(P("victim"), 300);
    fill(P("victim/sub"), 300);
    swapper s;
    swapper_init(&s, P("victim/sub"));
    pthread_t t;
    pthread_create(&t, NULL, swap_loop, &s);
    dm_err err;
    dm_cf_remove_tree(root, "victim", &err); /* may fail under the attack; must not leave */
    atomic_store(&s.stop, 1);
    pthread_join(t, NULL);
    CHECK(canary_intact(), "round %d: the canary survived a swapping removal", round);
    rm_rf(P("victim"));
    rm_rf(P("victim.aside"));
    rm_rf(P("victim/sub.aside"));
  }
  close(root);
}

static void test_write_race(void) {
  mkdir(P("w"), 0755);
  int root = open(P("w"), O_RDONLY | O_DIRECTORY);
  mkdir(P("w/out"), 0755);
  swapper s;
  swapper_init(&s, P("w/out"));
  pthread_t t;
  pthread_create(&t, NULL, swap_loop, &s);
  int ok = 0, refused = 0;
  for (int i = 0; i < 2000; i++) {
    dm_err err;
    if (dm_cf_write_atomic(root, "out/usage.json", "{}", 2, 0644, &err) == 0) ok++;
    else refused++;
    int fd = dm_cf_open_file(root, "out/usage.jsonl", DM_CF_APPEND, 0644, NULL, &err);
    if (fd >= 0) {
      if (write(fd, "x\n", 2) != 2) refused++;
      close(fd);
    }
  }
  atomic_store(&s.stop, 1);
  pthread_join(t, NULL);
  CHECK(canary_intact(), "writes under a swapping folder never land in the canary (%d ok, %d refused)", ok, refused);
  CHECK(ok > 0, "some writes went through");
  close(root);
  rm_rf(P("w"));
}

static void test_extract_race(void) {
  /* a tar of many small files in two folders */
  char tar[PATH_MAX];
  snprintf(tar, sizeof tar, "%s", P("race.tar"));
  struct archive *a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  archive_write_open_filename(a, tar);
  for (int i = 0; i < 3000; i++) {
    struct archive_entry *e = archive_entry_new();
    char name[64];
    snprintf(name, sizeof name, "%s/f%d", i % 2 ? "d" : "e", i);
    archive_entry_set_pathname(e, name);
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_size(e, 4);
    archive_write_header(a, e);
    archive_write_data(a, "data", 4);
    archive_entry_free(e);
  }
  archive_write_close(a);
  archive_write_free(a);
  for (int round = 0; round < 10; round++) {
    mkdir(P("dest"), 0755);
    mkdir(P("dest/d"), 0755);
    int dest = open(P("dest"), O_RDONLY | O_DIRECTORY);
    int tfd = open(tar, O_RDONLY);
    swapper s;
    swapper_init(&s, P("dest/d"));
    pthread_t t;
    pthread_create(&t, NULL, swap_loop, &s);
    dm_archive_stats st;
    dm_archive_err err;
    int rc = dm_archive_extract_fd(tfd, dest, NULL, &st, NULL, NULL, &err, NULL);
    atomic_store(&s.stop, 1);
    pthread_join(t, NULL);
    if (getenv("VERBOSE"))
      fprintf(stderr, "extract race round %d: %s %s\n", round, rc ? err.code : "ok", rc ? err.msg : "");
    CHECK(canary_intact(), "round %d: extraction under a swapping folder never writes the canary", round);
    CHECK(rc != 0 || st.files == 3000, "round %d: a finished extraction has every file", round);
    CHECK(rc == 0 || !strcmp(err.code, "EUNSAFE") || !strcmp(err.code, "ENOENT") || !strcmp(err.code, "EAGAIN"),
          "round %d: refused as unsafe, not broken: %s %s", round, err.code, err.msg);
    close(tfd);
    close(dest);
    rm_rf(P("dest"));
    rm_rf(P("dest/d.aside"));
  }
}

int main(void) {
  snprintf(base, sizeof base, "%s/dm-confine-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(base)) {
    perror("mkdtemp");
    return 2;
  }
  make_canary();
  test_open();
  test_remove_deep();
  test_remove_race();
  test_write_race();
  test_extract_race();
  CHECK(canary_intact(), "canary intact at the end");
  rm_rf(base);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("test_confine: all checks passed\n");
  return 0;
}
