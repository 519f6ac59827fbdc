/* Named tar.h, not archive.h: core/ is on the include path, so a header of that name
 * would shadow libarchive's <archive.h>. The engine is core/archive.c, the binding
 * core/bind/archive.c (core.archive). */
#ifndef DEMESNE_ARCHIVE_H
#define DEMESNE_ARCHIVE_H
/*
 * Tar archives with libarchive. It knows nothing of Lua or the loop: every function is
 * safe on a worker thread; core/bind/archive.c translates and runs the heavy ones off
 * the loop (core/work.c).
 *
 * pack writes a POSIX tar (ustar, with pax extended headers only where a name or size
 * needs them) streaming file contents in blocks. extract writes into one folder it holds
 * by descriptor and refuses anything that could land or point outside it.
 */
#include "confine.h"
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/// An operational failure: a message and a short stable code ("ENOENT", "EUNSAFE", ...).
typedef dm_err dm_archive_err;

/// One thing to put in an archive: either a host path (`src`, a file or a folder added
/// recursively; symlinks stored as symlinks, sockets/devices/fifos skipped) or, when
/// `src` is NULL, an in-memory file of `data_len` bytes with permission bits `mode`.
/// `name` is the path inside the archive: relative, no ".." component; "." or "" is
/// allowed for a folder and puts its contents at the top of the archive.
typedef struct dm_archive_entry {
  const char *src;
  const char *name;
  const char *data;
  size_t data_len;
  int mode;
} dm_archive_entry;

/// Counts: `files` regular files and `bytes` of their contents.
typedef struct dm_archive_stats {
  uint64_t files;
  uint64_t bytes;
} dm_archive_stats;

/// Caps; 0 = the default (no cap, except max_depth: DM_TREE_MAX_DEPTH). Exceeding one
/// fails with "E2BIG" and a message naming the entry or path.
typedef struct dm_archive_limits {
  uint64_t max_bytes;         ///< total size of regular files, in bytes (apparent size: holes count)
  uint64_t max_entries;       ///< number of entries of any type (extract; pack: below each src)
  uint64_t max_depth;         ///< folder levels below the top
  uint64_t max_archive_bytes; ///< extract: bytes of the tar itself read at most
  int strict_src;             ///< pack: resolve each src from "/" with no symlink on the way
} dm_archive_limits;

/// Writes `n` entries as a POSIX tar to the open descriptor `out_fd` (from its current
/// position). Sources are walked by descriptors (openat O_NOFOLLOW, never by path below
/// `src`), regular files opened only after their type is checked, at most lim->max_depth
/// levels deep. With lim->max_bytes the sizes are summed first (nothing is written when
/// they exceed it) and the cap is enforced again while writing. `cancel` (may be NULL)
/// stops the work early with "ECANCELED". Returns 0 and fills *st, or -1 with *err
/// filled. Codes: errno names for I/O ("ENOENT" for a missing src), "EINVAL" for a bad
/// name, "E2BIG" for a cap, "EAGAIN" when a file changed while being packed.
int dm_archive_pack_fd(int out_fd, const dm_archive_entry *entries, size_t n, const dm_archive_limits *lim,
                       dm_archive_stats *st, dm_archive_err *err, atomic_int *cancel);

/// dm_archive_pack_fd into a new file at `out_path` (created or truncated, mode 0644, not
/// through a final symlink); on failure `out_path` is removed.
int dm_archive_pack(const char *out_path, const dm_archive_entry *entries, size_t n, dm_archive_stats *st,
                    dm_archive_err *err);

/// Extracts the tar read from `tar_fd` (with pread from offset 0; plain tar only, at
/// most lim->max_archive_bytes of it) into the folder `dest_fd`, which should be empty.
/// Every entry is written by this code, never by libarchive's disk writer: its folder is
/// opened below dest_fd with openat2 (no symlink, no ".."), files are created O_EXCL |
/// O_NOFOLLOW, folders with mkdirat, links with symlinkat/linkat, all on held folder
/// descriptors, so a concurrent swap of any folder cannot redirect a write.
/// Refused with "EUNSAFE" (the message names the entry): absolute names, any ".."
/// component, devices, fifos, sockets, symlinks whose target is absolute or resolves
/// outside dest (also through other links of the archive), hard links to anything but a
/// regular file extracted before them, and entries that would be written through a
/// symlink. "E2BIG" for a cap: max_bytes counts each file's declared (apparent) size
/// before any of it is written and the bytes written while writing; data past an entry's
/// declared size is refused ("EARCHIVE"), so a sparse or lying archive cannot write more
/// than the cap. Regular files keep their permission bits (masked to 0777), folders get
/// at least 0700, mtimes are restored, owners are not.
/// On success returns 0, fills *st and, if `names` is not NULL, sets *names to a
/// malloc'd array of *nnames malloc'd entry names (free with dm_archive_names_free).
/// On failure returns -1 with *err filled and everything inside dest_fd removed; *names
/// is then NULL. `cancel` (may be NULL) stops the work early with "ECANCELED".
int dm_archive_extract_fd(int tar_fd, int dest_fd, const dm_archive_limits *lim, dm_archive_stats *st, char ***names,
                          size_t *nnames, dm_archive_err *err, atomic_int *cancel);

/// Extracts the tar (optionally gzip-compressed) at `tar_path` into `dest_dir`, which must
/// be missing (it is then created, its parent must exist) or an empty folder: opens both
/// and runs the checks of dm_archive_extract_fd. On failure everything extracted so far
/// is removed (dest_dir too if this call created it).
int dm_archive_extract(const char *tar_path, const char *dest_dir, const dm_archive_limits *lim, dm_archive_stats *st,
                       char ***names, size_t *nnames, dm_archive_err *err);

/// Frees a name array returned by dm_archive_extract.
void dm_archive_names_free(char **names, size_t n);

/// One entry of dm_archive_list.
typedef struct dm_archive_item {
  char *name;
  const char *type; ///< "file", "directory", "link" (symlink), "hardlink", "char",
                    ///< "block", "fifo", "socket" or "other" (static string)
  int64_t size;     ///< bytes of content (0 for non-files)
  int mode;         ///< permission bits
  char *target;     ///< link target for "link"/"hardlink", else NULL
} dm_archive_item;

/// Lists the entries of the tar at `tar_path` without extracting. On success returns 0
/// and sets *items to a malloc'd array of *n items (free with dm_archive_items_free).
/// On failure returns -1 with *err filled.
int dm_archive_list(const char *tar_path, dm_archive_item **items, size_t *n, dm_archive_err *err);

/// Frees an item array returned by dm_archive_list.
void dm_archive_items_free(dm_archive_item *items, size_t n);

#endif
