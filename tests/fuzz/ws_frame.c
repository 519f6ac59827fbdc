/* Fuzz harness: the WebSocket client framing (core/ws_frame.c) as core/ws.c uses it. The
 * first byte picks the largest message accepted (125, 1000, 65536 bytes or no limit); the
 * rest is what a server sends, decoded once whole and once cut into socket-sized reads
 * (fuzz_chunks); then each message decoded is encoded again as client frames, in one frame
 * and in fragments, unmasked the way a server does (RFC 6455 5.3) and decoded back.
 *
 * Findings (besides ASan/UBSan): a decode that depends on how the stream was cut (the
 * messages, their order, the error and its close code); a data message above the limit; a
 * control frame over 125 bytes; a close payload read as valid with an invalid code; a frame
 * that does not decode back to the message it encodes, or whose mask is not applied. */
#include "fuzz.h"
#include "ws_frame.h"
#include <string.h>

#define LOG_MAX 4096

typedef struct {
  uint64_t digest[LOG_MAX];
  int n;
  int result; /* DM_WS_NEED or DM_WS_FAIL at the end */
  int close_code;
} decode_log;

static uint64_t digest(const dm_ws_msg *m) {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)m->opcode ^ ((uint64_t)m->len << 8);
  for (size_t i = 0; i < m->len; i++) h = (h ^ m->data[i]) * 1099511628211ull;
  return h;
}

static void check_msg(const dm_ws_msg *m, uint64_t max) {
  if (m->opcode == DM_WS_TEXT || m->opcode == DM_WS_BINARY) {
    FUZZ_CHECK(!max || m->len <= max, "a message of %zu bytes above %llu", m->len, (unsigned long long)max);
    return;
  }
  FUZZ_CHECK(m->opcode == DM_WS_CLOSE || m->opcode == DM_WS_PING || m->opcode == DM_WS_PONG, "opcode %d", m->opcode);
  FUZZ_CHECK(m->len <= 125, "a control frame of %zu bytes", m->len);
  if (m->opcode != DM_WS_CLOSE) return;
  int code;
  const uint8_t *reason;
  size_t rlen;
  if (dm_ws_close_parse(m->data, m->len, &code, &reason, &rlen) == 0) {
    FUZZ_CHECK(code == DM_WS_CLOSE_NO_STATUS ? m->len == 0 : dm_ws_close_code_valid(code), "close code %d", code);
    FUZZ_CHECK(rlen <= 123 && (m->len == 0 || reason == m->data + 2), "close reason");
  } else {
    FUZZ_CHECK(m->len == 1 || !dm_ws_close_code_valid((m->data[0] << 8) | m->data[1]), "valid close refused");
  }
}

/* Decodes the stream in reads of the sizes `chunks` gives (NULL: one read). */
static void decode(const uint8_t *data, size_t size, uint64_t max, fuzz_chunks *chunks, decode_log *log) {
  dm_ws_decoder d = {.max_message = max};
  size_t pos = 0;
  log->n = 0;
  log->result = DM_WS_NEED;
  for (;;) {
    size_t k = pos >= size ? 0 : chunks ? fuzz_chunk_next(chunks, size - pos) : size - pos;
    FUZZ_CHECK(dm_ws_feed(&d, data + pos, k) == 0, "out of memory");
    pos += k;
    dm_ws_msg m;
    const char *err;
    int code, r;
    while ((r = dm_ws_next(&d, &m, &err, &code)) == DM_WS_GOT) {
      check_msg(&m, max);
      if (log->n < LOG_MAX) log->digest[log->n] = digest(&m);
      log->n++;
    }
    if (r == DM_WS_FAIL) {
      FUZZ_CHECK(code == DM_WS_CLOSE_PROTOCOL || code == DM_WS_CLOSE_TOO_BIG, "close code %d", code);
      FUZZ_CHECK(dm_ws_next(&d, &m, &err, &code) == DM_WS_FAIL, "a failure that does not stay");
      log->result = DM_WS_FAIL;
      log->close_code = code;
      break;
    }
    if (pos >= size) break;
  }
  dm_ws_decoder_free(&d);
}

/* A client frame as a server sees it after unmasking: the mask bit cleared, the key
 * removed, the payload XORed back. Returns the new length. */
static size_t unmask(uint8_t *f, size_t n) {
  FUZZ_CHECK(n >= 6 && (f[1] & 0x80), "a client frame that is not masked");
  size_t hl = (f[1] & 0x7F) == 127 ? 10 : (f[1] & 0x7F) == 126 ? 4 : 2;
  uint8_t key[4];
  memcpy(key, f + hl, 4);
  f[1] &= 0x7F;
  memmove(f + hl, f + hl + 4, n - hl - 4);
  for (size_t i = 0; i < n - hl - 4; i++) f[hl + i] ^= key[i & 3];
  return n - 4;
}

/* Encodes `m` (in `parts` fragments for a data message), unmasks, decodes: the same message. */
static void round_trip(const dm_ws_msg *m, const uint8_t mask[4], size_t parts) {
  static uint8_t buf[2 * (1 << 20)];
  int data = m->opcode == DM_WS_TEXT || m->opcode == DM_WS_BINARY;
  if (!data) parts = 1;
  if (parts > m->len) parts = m->len ? m->len : 1;
  if (m->len + parts * DM_WS_MAX_HEADER > sizeof buf) return;
  size_t n = 0, off = 0;
  for (size_t i = 0; i < parts; i++) {
    size_t len = i + 1 == parts ? m->len - off : m->len / parts;
    size_t start = n;
    n += dm_ws_encode(buf + n, i == 0 ? m->opcode : DM_WS_CONT, i + 1 == parts, mask, m->data + off, len);
    FUZZ_CHECK(n - start == dm_ws_header_len(len) + len, "encoded length");
    n = start + unmask(buf + start, n - start);
    off += len;
  }
  dm_ws_decoder d = {.max_message = 0};
  FUZZ_CHECK(dm_ws_feed(&d, buf, n) == 0, "out of memory");
  dm_ws_msg back;
  const char *err = "";
  int code;
  FUZZ_CHECK(dm_ws_next(&d, &back, &err, &code) == DM_WS_GOT, "an encoded message does not decode: %s", err);
  FUZZ_CHECK(back.opcode == m->opcode && back.len == m->len && !memcmp(back.data, m->data, m->len), "round trip");
  FUZZ_CHECK(dm_ws_next(&d, &back, &err, &code) == DM_WS_NEED, "bytes left after the message");
  dm_ws_decoder_free(&d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint64_t limits[] = {125, 1000, 65536, 0};
  static decode_log whole, cut;
  if (size < 1) return 0;
  uint64_t max = limits[data[0] & 3];
  data++, size--;
  decode(data, size, max, NULL, &whole);
  fuzz_chunks c;
  fuzz_chunks_init(&c, data, size);
  decode(data, size, max, &c, &cut);
  FUZZ_CHECK(whole.n == cut.n, "%d messages read whole, %d read in pieces", whole.n, cut.n);
  FUZZ_CHECK(!memcmp(whole.digest, cut.digest, sizeof(uint64_t) * (size_t)(whole.n < LOG_MAX ? whole.n : LOG_MAX)),
             "messages differ by cut");
  FUZZ_CHECK(whole.result == cut.result && (whole.result != DM_WS_FAIL || whole.close_code == cut.close_code),
             "the end differs by cut");
  /* encode -> decode of what was read */
  dm_ws_decoder d = {.max_message = max};
  dm_ws_feed(&d, data, size);
  dm_ws_msg m;
  const char *err;
  int code, i = 0;
  uint8_t mask[4] = {size ? data[0] : 0, 0x5a, 0xa5, (uint8_t)size};
  while (dm_ws_next(&d, &m, &err, &code) == DM_WS_GOT) round_trip(&m, mask, (size_t)(i++ % 4) + 1);
  dm_ws_decoder_free(&d);
  /* a close payload from the input's first bytes */
  if (size >= 2) {
    int want = (data[0] << 8) | data[1];
    if (dm_ws_close_code_valid(want)) {
      uint8_t p[125];
      size_t n = dm_ws_close_payload(p, want, (const char *)data + 2, size - 2);
      const uint8_t *reason;
      size_t rlen;
      FUZZ_CHECK(dm_ws_close_parse(p, n, &code, &reason, &rlen) == 0 && code == want, "close payload round trip");
      FUZZ_CHECK(rlen == (size - 2 > 123 ? 123 : size - 2) && !memcmp(reason, data + 2, rlen),
                 "close reason round trip");
    }
  }
  return 0;
}
