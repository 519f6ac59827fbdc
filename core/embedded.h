#ifndef DEMESNE_EMBEDDED_H
#define DEMESNE_EMBEDDED_H
#include <stddef.h>

/// One file embedded in the binary at build time (see core/embed.lua).
/// `path` is relative to the source root ("lua/async.lua"); `data` is NUL-terminated, `len` excludes the NUL.
struct dm_embedded {
  const char *path;
  const unsigned char *data;
  size_t len;
};

/// All embedded files, terminated by an entry whose path is NULL.
extern const struct dm_embedded dm_embedded_files[];

#endif
