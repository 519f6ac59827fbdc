/* Fuzz harness: tar extraction (what archive.extract runs on a tar a sandbox produced).
 *
 * Each input is written to a file and extracted into a folder that does not exist yet,
 * beside a canary folder; the archive is listed too. The one call into the extraction code
 * is extract() below, so that it can be re-pointed when the engine's entry point changes.
 *
 * Findings (besides ASan/UBSan): after a success, anything in the destination other than
 * folders, regular files and symlinks, or a symlink that resolves outside it (openat2
 * RESOLVE_BENEATH says EXDEV or ELOOP); after a failure, a destination left behind, or an
 * error without a code and message; in either case, any change beside the destination.
 *
 * The work folder is under /dev/shm when it can be (extraction writes a lot), else $TMPDIR;
 * it is removed at exit. */
#include "fuzz.h"
#include "tar.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_BYTES (1u << 20) /* limits, so an input cannot fill the disk */
#define MAX_ENTRIES 256

static char base[4096], tar_path[4200], dest[4200], outside[4200], canary[4300];
static struct stat canary_st;

/* The extraction under test. Re-point here when dm_archive_extract changes. Returns 0 on
 * success; on failure fills *err and returns -1. */
static int extract(const char *tar, const char *dir, char ***names, size_t *n, dm_archive_err *err) {
  dm_archive_limits lim = {.max_bytes = MAX_BYTES, .max_entries = MAX_ENTRIES};
  dm_archive_stats st;
  return dm_archive_extract(tar, dir, &lim, &st, names, n, err);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)ftw;
  if (flag == FTW_DP || (st && S_ISDIR(st->st_mode))) rmdir(path);
  else unlink(path);
  return 0;
}

static void remove_tree(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0) return;
  nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void at_exit(void) { remove_tree(base); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  const char *root = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
  snprintf(base, sizeof base, "%s/demesne-fuzz-archive-XXXXXX", root && *root ? root : "/tmp");
  FUZZ_CHECK(mkdtemp(base), "mkdtemp: %s", strerror(errno));
  atexit(at_exit);
  snprintf(tar_path, sizeof tar_path, "%s/in.tar", base);
  snprintf(dest, sizeof dest, "%s/dest", base);
  snprintf(outside, sizeof outside, "%s/outside", base);
  snprintf(canary, sizeof canary, "%s/canary", outside);
  FUZZ_CHECK(mkdir(outside, 0755) == 0, "mkdir");
  int fd = open(canary, O_WRONLY | O_CREAT | O_EXCL, 0644);
  FUZZ_CHECK(fd >= 0 && write(fd, "canary\n", 7) == 7, "canary");
  close(fd);
  FUZZ_CHECK(lstat(canary, &canary_st) == 0, "stat canary");
  return 0;
}

/* Nothing beside the destination changed: base holds in.tar, outside (and dest). */
static void check_outside(void) {
  DIR *d = opendir(base);
  FUZZ_CHECK(d, "opendir %s", base);
  struct dirent *e;
  while ((e = readdir(d)))
    FUZZ_CHECK(!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, "in.tar") ||
                 !strcmp(e->d_name, "outside") || !strcmp(e->d_name, "dest"),
               "'%s' appeared beside the destination", e->d_name);
  closedir(d);
  d = opendir(outside);
  FUZZ_CHECK(d, "opendir %s", outside);
  while ((e = readdir(d)))
    FUZZ_CHECK(!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, "canary"),
               "'%s' appeared in the canary folder", e->d_name);
  closedir(d);
  struct stat st;
  FUZZ_CHECK(lstat(canary, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == canary_st.st_size &&
               st.st_mtim.tv_sec == canary_st.st_mtim.tv_sec && st.st_mtim.tv_nsec == canary_st.st_mtim.tv_nsec &&
               st.st_mode == canary_st.st_mode,
             "the canary changed");
}

static int dest_fd = -1;
static size_t dest_len;

static int check_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)ftw;
  FUZZ_CHECK(flag != FTW_NS && flag != FTW_DNR, "cannot read %s", path);
  FUZZ_CHECK(S_ISDIR(st->st_mode) || S_ISREG(st->st_mode) || S_ISLNK(st->st_mode), "%s has mode %o", path, st->st_mode);
  FUZZ_CHECK(!(st->st_mode & (S_ISUID | S_ISGID)), "%s is setuid or setgid", path);
  if (S_ISLNK(st->st_mode)) {
    const char *rel = path + dest_len + 1;
    struct open_how how = {.flags = O_PATH, .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
    long fd = syscall(SYS_openat2, dest_fd, rel, &how, sizeof how);
    FUZZ_CHECK(fd >= 0 || (errno != EXDEV && errno != ELOOP), "the symlink %s resolves outside the destination (%s)",
               rel, strerror(errno));
    if (fd >= 0) close((int)fd);
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int fd = open(tar_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  FUZZ_CHECK(fd >= 0, "open %s", tar_path);
  FUZZ_CHECK(size == 0 || write(fd, data, size) == (ssize_t)size, "write");
  close(fd);

  char **names = NULL;
  size_t n = 0;
  dm_archive_err err = {{0}, NULL};
  int r = extract(tar_path, dest, &names, &n, &err);
  if (r == 0) {
    dest_fd = open(dest, O_RDONLY | O_DIRECTORY);
    FUZZ_CHECK(dest_fd >= 0, "the destination is missing after a success");
    dest_len = strlen(dest);
    nftw(dest, check_entry, 16, FTW_PHYS);
    close(dest_fd);
    FUZZ_CHECK(n <= MAX_ENTRIES, "%zu names", n);
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(names[i], "names[%zu] is NULL", i);
    dm_archive_names_free(names, n);
  } else {
    struct stat st;
    FUZZ_CHECK(err.code && *err.code && err.msg[0], "a failure without a code or message");
    FUZZ_CHECK(names == NULL, "names after a failure");
    FUZZ_CHECK(lstat(dest, &st) != 0, "the destination is left behind after a failure (%s: %s)", err.code, err.msg);
  }
  check_outside();
  remove_tree(dest);

  dm_archive_item *items = NULL;
  dm_archive_err lerr = {{0}, NULL};
  if (dm_archive_list(tar_path, &items, &n, &lerr) == 0) {
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(items[i].name && items[i].type, "item %zu", i);
    dm_archive_items_free(items, n);
  } else {
    FUZZ_CHECK(lerr.code && lerr.msg[0], "a failure without a code or message");
  }
  return 0;
}
