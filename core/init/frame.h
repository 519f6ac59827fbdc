// The framed stream of `demesne-init pty` (the PTY of `demesne attach`): shared by
// demesne-init (core/init/pty.c) and the host's side (core/bind/tty.c). Pure code, no I/O.
// Reference: docs/reference/demesne-init.md#pty-an-interactive-shell-for-demesne-attach
#ifndef DEMESNE_FRAME_H
#define DEMESNE_FRAME_H

#include <stddef.h>
#include <stdint.h>

// One frame: TYPE (1 byte), LENGTH (2 bytes, unsigned big-endian), LENGTH bytes of payload.
#define FRAME_HEAD 3
#define FRAME_MAX 4096 // payload bytes of one frame, at most

#define FRAME_DATA 'd'    // bytes for the PTY (host → sandbox) or from it (sandbox → host), 1..FRAME_MAX
#define FRAME_WINSIZE 'w' // host → sandbox: rows, cols (2 bytes each, big-endian, 1..FRAME_WINSIZE_MAX)
#define FRAME_EXIT 'x'    // sandbox → host: the shell's exit status, 1 byte (0..255, 128+N for signal N)

#define FRAME_WINSIZE_MAX 10000 // rows or columns, at most

/// A parsed frame; `data` points into the buffer it was parsed from.
struct frame {
	uint8_t type;
	size_t len;
	const uint8_t *data;
	unsigned rows, cols; // FRAME_WINSIZE
	int status;          // FRAME_EXIT
};

/// Parses the first frame of buf (len bytes). Returns the bytes it takes (> 0) and fills
/// *f; 0 when buf does not hold a whole frame yet; -1 when it is malformed: an unknown
/// type, a payload of the wrong length for its type (empty or above FRAME_MAX for data,
/// not 4 for a window size, not 1 for an exit), a window size of 0 or above
/// FRAME_WINSIZE_MAX. A malformed head is found as soon as its 3 bytes are there.
int frame_parse(const uint8_t *buf, size_t len, struct frame *f);

/// Writes the head of a frame of `type` carrying `len` payload bytes (len ≤ FRAME_MAX) into
/// out (FRAME_HEAD bytes).
void frame_head(uint8_t *out, uint8_t type, size_t len);

/// Writes a whole window-size frame (FRAME_HEAD + 4 bytes) into out.
void frame_winsize(uint8_t *out, unsigned rows, unsigned cols);

#endif
