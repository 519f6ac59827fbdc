#ifndef DEMESNE_CONFINE_H
#define DEMESNE_CONFINE_H
/*
 * Confined file operations: everything the host does inside a tree a sandbox can write
 * (its output folder, its run folder, a staging folder) goes through here.
 *
 * Every name is resolved below a directory descriptor the caller holds, never from a
 * path string: on Linux with openat2(2) and RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
 * RESOLVE_NO_MAGICLINKS, so a symlink anywhere on the way, a ".." or an absolute name
 * fails instead of leading out. Files are type-checked before they are opened for data
 * (an O_PATH descriptor first; a FIFO or a device is never opened), opened O_NOFOLLOW |
 * O_NONBLOCK, and created O_EXCL. Deletes are unlinkat(2) on held directory descriptors.
 *
 * A sandbox that swaps a folder for a symlink while the host works can therefore make an
 * operation fail, never redirect it: a held descriptor keeps pointing at the folder it
 * was opened on, and that folder can only be moved within the sandbox's own mount.
 *
 * No Lua, no loop: every function is safe to call from a worker thread. Names are
 * relative paths ("exec/x/status.json"); "" and "." name the held folder itself where
 * that makes sense. Functions return -1 with errno set, or fill a dm_err.
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

/// Deepest folder level the host creates, walks or packs below a held folder: deeper
/// trees are refused with "E2BIG" and a message naming the path. Tree removal has no
/// depth limit (it holds at most DM_CF_RM_FDS descriptors and flattens what lies deeper).
#define DM_TREE_MAX_DEPTH 256

/// Descriptors one tree removal holds at most.
#define DM_CF_RM_FDS 32

/// An operational failure: a message and a short stable code ("ENOENT", "EUNSAFE", ...).
typedef struct dm_err {
  char msg[1024];
  const char *code; ///< static string
} dm_err;

/// The errno name of `e` ("ENOENT", "ELOOP", ...); "EIO" for the rare ones.
const char *dm_errno_code(int e);

/// Fills *err with `code` and a printf-formatted message.
void dm_err_set(dm_err *err, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/// Fills *err from errno value `e`: "<what> <name>: <reason>", code dm_errno_code(e).
/// ELOOP reads "a symlink is in the way (never followed)", EXDEV "leads outside".
void dm_err_errno(dm_err *err, int e, const char *what, const char *name);

/// A short name for the file type in st_mode: "file", "directory", "symlink", "fifo",
/// "socket", "character device", "block device".
const char *dm_cf_type_name(mode_t m);

/// Checks a relative name: not empty, not absolute, no ".." component, shorter than
/// PATH_MAX. Returns 0, or -1 with errno EINVAL (empty/absolute), EXDEV ("..") or
/// ENAMETOOLONG.
int dm_cf_check_rel(const char *rel);

/// Number of components of a relative name ("a/b/c" -> 3, "" and "." -> 0).
size_t dm_cf_depth(const char *rel);

/// openat2(dfd, rel, flags | O_NOFOLLOW | O_CLOEXEC, mode) resolved beneath dfd with no
/// symlink and no magic link (a component-by-component O_NOFOLLOW walk where the kernel
/// has no openat2). "" or "." opens dfd itself again. Returns a descriptor or -1/errno.
int dm_cf_openat(int dfd, const char *rel, int flags, mode_t mode);

/// Opens the folder `rel` below dfd (O_RDONLY | O_DIRECTORY), confined. -1/errno.
int dm_cf_open_dir(int dfd, const char *rel);

/// Opens the folder that holds the last component of `rel`, confined, and copies that
/// component into base (cap bytes). `rel` must name something below dfd (not "" or ".").
/// Returns the folder's descriptor or -1/errno.
int dm_cf_parent(int dfd, const char *rel, char *base, size_t cap);

/// What dm_cf_open_file opens for.
typedef enum {
  DM_CF_READ,   ///< read an existing regular file
  DM_CF_APPEND, ///< append to a regular file, created (perm) when missing
  DM_CF_CREATE, ///< create a new regular file (O_EXCL): EEXIST when anything is there
} dm_cf_mode;

/// Opens a regular file below dfd, confined. Its type is checked on an O_PATH descriptor
/// before it is opened for data, so a FIFO, a socket or a device is refused without being
/// opened; the data descriptor is O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC. Fills *st (may be
/// NULL). Returns the descriptor, or -1 with *err filled ("EINVAL" with the type named
/// for anything but a regular file; "ENOENT" for a missing one; "ELOOP" for a symlink).
int dm_cf_open_file(int dfd, const char *rel, dm_cf_mode mode, mode_t perm, struct stat *st, dm_err *err);

/// Describes `rel` below dfd without following anything (a symlink at the end is
/// described itself). -1/errno.
int dm_cf_lstat(int dfd, const char *rel, struct stat *st);

/// Creates the folder `rel` (its parent must exist), confined. -1/errno (EEXIST).
int dm_cf_mkdir(int dfd, const char *rel, mode_t mode);

/// Removes the file or symlink `rel` (not a folder), confined. -1/errno.
int dm_cf_unlink(int dfd, const char *rel);

/// Renames `from` below from_dfd to `to` below to_dfd, both confined (renameat2 on the
/// two parent folders; `noreplace` refuses an existing target with EEXIST). -1/errno.
int dm_cf_rename(int from_dfd, const char *from, int to_dfd, const char *to, int noreplace);

/// Writes `data` to `rel` so that nothing can redirect it: a new temporary file created
/// O_EXCL in the held parent folder, fsynced, then renamed over `rel` in that same folder.
/// Readers see the old contents or the new. Returns 0, or -1 with *err filled.
int dm_cf_write_atomic(int dfd, const char *rel, const void *data, size_t len, mode_t mode, dm_err *err);

/// Sets the permission bits of `rel` (a file, folder or socket; never through or of a
/// symlink: ELOOP), confined: chmod on the inode an O_PATH descriptor holds. -1/errno.
int dm_cf_chmod(int dfd, const char *rel, mode_t mode);

/// Removes `rel` below dfd and, for a folder, everything in it, by unlinkat on held
/// folder descriptors (never by path, never through a link; symlinks are removed). A
/// missing `rel` is success. Returns 0, or -1 with *err filled naming what failed.
int dm_cf_remove_tree(int dfd, const char *rel, dm_err *err);

/// Removes everything inside the folder `folder` (not the folder itself). 0 or -1/*err.
int dm_cf_remove_contents(int folder, dm_err *err);

/// Fills buf with `n` random bytes (getrandom). 0 or -1/errno.
int dm_cf_random(void *buf, size_t n);

/// What dm_cf_usage measured of a tree.
typedef struct dm_cf_usage_t {
  uint64_t bytes;      ///< allocated bytes (st_blocks * 512) of every entry, a hard-linked file once
  uint64_t entries;    ///< entries seen below the folder (folders, files, links, FIFOs ...)
  uint64_t unreadable; ///< folders that could not be opened (their own blocks count, not their contents)
  const char *limit;   ///< NULL, or why the walk stopped early: "bytes", "entries" or "depth" (static)
  char where[256];     ///< the first unreadable or too deep folder (relative), or ""
} dm_cf_usage_t;

/// Measures the disk space the tree below the folder `dfd` takes, without following a
/// link or opening anything but folders (O_NOFOLLOW | O_NONBLOCK, checked to be the folder
/// that was listed): every entry's allocated blocks (st_blocks * 512, so a sparse file
/// counts what it holds, not its length), a file with several hard links once. Stops early
/// (u->limit) past `stop_bytes` bytes (0: never), `max_entries` entries, or a folder
/// `max_depth` levels down (at most DM_TREE_MAX_DEPTH; one descriptor held per level).
/// Entries that vanish meanwhile are skipped. `cancel` (may be NULL) set to 1 stops it.
/// Returns 0 (with *u filled, also when a limit stopped it), or -1 with *err filled.
int dm_cf_usage(int dfd, uint64_t stop_bytes, uint64_t max_entries, unsigned max_depth, atomic_int *cancel,
                dm_cf_usage_t *u, dm_err *err);

#endif
