/* Fuzz harness: the frames of `demesne-init pty` (core/init/frame.c), as both ends read
 * them: the host's core.tty.attach reads what the sandbox sends, demesne-init reads what
 * the host (or any process in the sandbox that reaches the socket first) sends. The input
 * is a byte stream, cut into socket-sized reads (fuzz_chunks) and parsed as the two
 * readers do: frames taken from a buffer, the rest kept for the next read.
 *
 * Findings (besides ASan/UBSan): a frame that claims more bytes than it has, or is longer
 * than FRAME_HEAD + FRAME_MAX; a data frame that is empty or over FRAME_MAX; a window size
 * of 0 or above FRAME_WINSIZE_MAX; an exit status above 255; a parse that depends on how
 * the stream was cut; a frame that does not encode back to the same bytes. */
#include "fuzz.h"
#include "frame.h"
#include <string.h>

#define BUF (2 * (FRAME_HEAD + FRAME_MAX))

/* Parses the stream in reads of the sizes `chunks` gives; appends a digest of each frame
 * to `log` (type, length, payload hash). Returns how many frames, or -1 at a malformed one. */
static int parse_stream(const uint8_t *data, size_t size, fuzz_chunks *chunks, uint64_t *log, size_t logcap) {
  static uint8_t buf[BUF];
  size_t len = 0, pos = 0;
  int n = 0;
  while (pos < size || len) {
    size_t room = BUF - len;
    size_t k = pos >= size ? 0 : chunks ? fuzz_chunk_next(chunks, size - pos) : size - pos;
    if (k > room) k = room;
    memcpy(buf + len, data + pos, k);
    len += k;
    pos += k;
    size_t off = 0;
    struct frame f;
    int used;
    while ((used = frame_parse(buf + off, len - off, &f)) != 0) {
      if (used < 0) return -1;
      FUZZ_CHECK((size_t)used == FRAME_HEAD + f.len && (size_t)used <= len - off, "frame of %d bytes", used);
      FUZZ_CHECK(f.data == buf + off + FRAME_HEAD, "payload not in the buffer");
      if (f.type == FRAME_DATA) FUZZ_CHECK(f.len >= 1 && f.len <= FRAME_MAX, "data of %zu bytes", f.len);
      else if (f.type == FRAME_WINSIZE) {
        FUZZ_CHECK(f.len == 4 && f.rows >= 1 && f.cols >= 1 && f.rows <= FRAME_WINSIZE_MAX &&
                     f.cols <= FRAME_WINSIZE_MAX,
                   "window %ux%u", f.rows, f.cols);
        uint8_t again[FRAME_HEAD + 4];
        frame_winsize(again, f.rows, f.cols);
        FUZZ_CHECK(memcmp(again, buf + off, sizeof again) == 0, "a window size does not encode back");
      } else {
        FUZZ_CHECK(f.type == FRAME_EXIT && f.len == 1 && f.status >= 0 && f.status <= 255, "type %d", f.type);
      }
      uint8_t head[FRAME_HEAD];
      frame_head(head, f.type, f.len);
      FUZZ_CHECK(memcmp(head, buf + off, FRAME_HEAD) == 0, "a head does not encode back");
      uint64_t h = 1469598103934665603ull ^ f.type ^ ((uint64_t)f.len << 8);
      for (size_t i = 0; i < f.len; i++) h = (h ^ f.data[i]) * 1099511628211ull;
      if ((size_t)n < logcap) log[n] = h;
      n++;
      off += (size_t)used;
    }
    memmove(buf, buf + off, len - off);
    len -= off;
    if (pos >= size) break; /* what is left is an incomplete frame */
  }
  return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint64_t whole[4096], cut[4096];
  int a = parse_stream(data, size, NULL, whole, 4096);
  fuzz_chunks c;
  fuzz_chunks_init(&c, data, size);
  int b = parse_stream(data, size, &c, cut, 4096);
  if (a >= 0 && b >= 0) {
    FUZZ_CHECK(a == b, "%d frames read whole, %d read in pieces", a, b);
    FUZZ_CHECK(memcmp(whole, cut, sizeof(uint64_t) * (size_t)(a < 4096 ? a : 4096)) == 0, "frames differ by cut");
  }
  return 0;
}
