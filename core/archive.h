/* This header shares its name with libarchive's <archive.h>, and core/ is on the include
 * path, so <archive.h> finds this file first. A file that needs libarchive itself defines
 * DM_ARCHIVE_LIBARCHIVE before `#include <archive.h>`: the real header then follows. */
#if defined(DM_ARCHIVE_LIBARCHIVE) && !defined(ARCHIVE_H_INCLUDED)
#include_next <archive.h>
#endif
#ifndef DEMESNE_ARCHIVE_H
#define DEMESNE_ARCHIVE_H
/*
 * Tar archives with libarchive, synchronous (local files, run on the loop thread).
 * It knows nothing of Lua; core/bind/archive.c translates.
 *
 * pack writes a POSIX tar (ustar, with pax extended headers only where a name or size
 * needs them) streaming file contents in blocks. extract writes into one fresh folder
 * and refuses anything that could land or point outside it.
 */
#include <stddef.h>
#include <stdint.h>

/// An operational failure: a message and a short stable code ("ENOENT", "EUNSAFE", ...).
typedef struct dm_archive_err {
  char msg[1024];
  const char *code; ///< static string
} dm_archive_err;

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

/// Caps for extract; 0 = no cap. Exceeding one fails with "E2BIG".
typedef struct dm_archive_limits {
  uint64_t max_bytes;   ///< total size of regular files, in bytes
  uint64_t max_entries; ///< number of entries of any type
} dm_archive_limits;

/// Writes `n` entries to a new tar file at `out_path` (created or truncated, mode 0644).
/// Returns 0 and fills *st, or -1 with *err filled; on failure `out_path` is removed.
/// Codes: errno names for I/O ("ENOENT" for a missing src), "EINVAL" for a bad name.
int dm_archive_pack(const char *out_path, const dm_archive_entry *entries, size_t n,
                    dm_archive_stats *st, dm_archive_err *err);

/// Extracts the tar (optionally gzip-compressed) at `tar_path` into `dest_dir`, which must
/// be missing (it is then created, its parent must exist) or an empty folder.
/// Refused with "EUNSAFE" (the message names the entry): absolute names, any ".."
/// component, hardlinks, devices, fifos, sockets, symlinks whose target is absolute or
/// resolves outside dest_dir (also through other links of the archive), and entries that
/// would be written through a symlink. Regular files keep their permission bits (masked
/// to 0777), folders get at least 0700; owners are not restored.
/// On success returns 0, fills *st and, if `names` is not NULL, sets *names to a
/// malloc'd array of *nnames malloc'd entry names (free with dm_archive_names_free).
/// On failure returns -1 with *err filled, and everything extracted so far is removed
/// (dest_dir too if this call created it); *names is then NULL.
int dm_archive_extract(const char *tar_path, const char *dest_dir, const dm_archive_limits *lim,
                       dm_archive_stats *st, char ***names, size_t *nnames, dm_archive_err *err);

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
