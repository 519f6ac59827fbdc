/* core/ws_frame.c on the examples of RFC 6455: the Sec-WebSocket-Accept of 1.3, the frames
 * of 5.7 (an unmasked and a masked "Hello", "Hel" + "lo" fragmented, a ping, 256 bytes and
 * 64 KiB with the 16- and 64-bit lengths), close payloads (5.5.1, 7.4) and the refusals of
 * the decoder, each fed one byte at a time as well as whole. Run under the sanitizer build too. */
#include "ws_frame.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* Decodes `n` bytes (one at a time when `bytewise`); the first message or failure. */
static int decode_one(const uint8_t *b, size_t n, int bytewise, uint64_t max, dm_ws_msg *m, uint8_t *copy, int *code) {
  dm_ws_decoder d = {.max_message = max};
  const char *err = NULL;
  int r = DM_WS_NEED;
  for (size_t i = 0; i < n && r == DM_WS_NEED; i += bytewise ? 1 : n) {
    dm_ws_feed(&d, b + i, bytewise ? 1 : n);
    r = dm_ws_next(&d, m, &err, code);
  }
  if (r == DM_WS_GOT) {
    memcpy(copy, m->data, m->len);
    m->data = copy;
  }
  dm_ws_decoder_free(&d);
  return r;
}

static void test_accept(void) {
  char out[29];
  CHECK(dm_ws_accept("dGhlIHNhbXBsZSBub25jZQ==", out) == 0 && !strcmp(out, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "%s", out);
  uint8_t r[16] = {0};
  char key[25];
  dm_ws_key(r, key);
  CHECK(!strcmp(key, "AAAAAAAAAAAAAAAAAAAAAA=="), "%s", key);
}

static void test_rfc_frames(void) {
  static uint8_t copy[70000];
  const uint8_t hello[] = {0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f};
  const uint8_t masked[] = {0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58};
  const uint8_t frag[] = {0x01, 0x03, 0x48, 0x65, 0x6c, 0x89, 0x00, 0x80, 0x02, 0x6c, 0x6f};
  for (int bw = 0; bw < 2; bw++) {
    dm_ws_msg m;
    int code = 0;
    CHECK(decode_one(hello, sizeof hello, bw, 0, &m, copy, &code) == DM_WS_GOT && m.opcode == DM_WS_TEXT &&
            m.len == 5 && !memcmp(m.data, "Hello", 5),
          "unmasked Hello");
    CHECK(decode_one(masked, sizeof masked, bw, 0, &m, copy, &code) == DM_WS_FAIL && code == 1002, "masked: %d", code);
    /* "Hel", then a ping between the fragments, then "lo": the ping comes first */
    dm_ws_decoder d = {0};
    const char *err;
    dm_ws_feed(&d, frag, sizeof frag);
    CHECK(dm_ws_next(&d, &m, &err, &code) == DM_WS_GOT && m.opcode == DM_WS_PING && m.len == 0, "ping");
    CHECK(dm_ws_next(&d, &m, &err, &code) == DM_WS_GOT && m.opcode == DM_WS_TEXT && m.len == 5 &&
            !memcmp(m.data, "Hello", 5),
          "fragments");
    CHECK(dm_ws_next(&d, &m, &err, &code) == DM_WS_NEED, "nothing more");
    dm_ws_decoder_free(&d);
  }
  /* the encoder gives the RFC's masked Hello */
  uint8_t out[32];
  const uint8_t key[4] = {0x37, 0xfa, 0x21, 0x3d};
  size_t n = dm_ws_encode(out, DM_WS_TEXT, 1, key, (const uint8_t *)"Hello", 5);
  CHECK(n == sizeof masked && !memcmp(out, masked, n), "masked Hello encodes as in 5.7");
  /* 256 bytes: 16-bit length; 65536 bytes: 64-bit length */
  static uint8_t big[70000 + 14];
  uint8_t payload[65536];
  memset(payload, 'x', sizeof payload);
  n = dm_ws_encode(big, DM_WS_BINARY, 1, key, payload, 256);
  CHECK(n == 8 + 256 && big[1] == (0x80 | 126) && big[2] == 0x01 && big[3] == 0x00, "16-bit length");
  n = dm_ws_encode(big, DM_WS_BINARY, 1, key, payload, 65536);
  const uint8_t len64[] = {0x80 | 127, 0, 0, 0, 0, 0, 1, 0, 0};
  CHECK(n == 14 + 65536 && !memcmp(big + 1, len64, sizeof len64), "64-bit length");
  CHECK(dm_ws_header_len(125) == 6 && dm_ws_header_len(126) == 8 && dm_ws_header_len(65535) == 8 &&
          dm_ws_header_len(65536) == 14,
        "header lengths");
}

static void test_refusals(void) {
  static uint8_t copy[512];
  struct {
    const char *name;
    uint8_t b[16];
    size_t n;
    uint64_t max;
    int code;
  } cases[] = {
    {"RSV1", {0xc1, 0x00}, 2, 0, 1002},
    {"opcode 3", {0x83, 0x00}, 2, 0, 1002},
    {"opcode 11", {0x8b, 0x00}, 2, 0, 1002},
    {"fragmented ping", {0x09, 0x00}, 2, 0, 1002},
    {"ping of 126 bytes", {0x89, 126, 0x00, 126}, 4, 0, 1002},
    {"64-bit top bit", {0x82, 127, 0x80, 0, 0, 0, 0, 0, 0, 1}, 10, 0, 1002},
    {"continuation with nothing open", {0x80, 0x00}, 2, 0, 1002},
    {"new message inside one", {0x01, 0x01, 'a', 0x81, 0x01, 'b'}, 6, 0, 1002},
    {"above max_message", {0x82, 0x05, 1, 2, 3, 4, 5}, 7, 4, 1009},
    {"fragments above max_message", {0x02, 0x03, 1, 2, 3, 0x80, 0x02, 4, 5}, 9, 4, 1009},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    for (int bw = 0; bw < 2; bw++) {
      dm_ws_msg m;
      int code = 0;
      int r = decode_one(cases[i].b, cases[i].n, bw, cases[i].max, &m, copy, &code);
      CHECK(r == DM_WS_FAIL && code == cases[i].code, "%s: %d %d", cases[i].name, r, code);
    }
  }
}

static void test_close(void) {
  uint8_t p[125];
  int code;
  const uint8_t *reason;
  size_t rlen;
  size_t n = dm_ws_close_payload(p, 4001, "bye now", 7);
  CHECK(n == 9 && p[0] == 0x0f && p[1] == 0xa1, "close payload");
  CHECK(dm_ws_close_parse(p, n, &code, &reason, &rlen) == 0 && code == 4001 && rlen == 7 &&
          !memcmp(reason, "bye now", 7),
        "close parse");
  CHECK(dm_ws_close_parse(p, 0, &code, &reason, &rlen) == 0 && code == 1005, "empty close");
  CHECK(dm_ws_close_parse(p, 1, &code, &reason, &rlen) < 0, "1-byte close");
  const int bad[] = {999, 1004, 1005, 1006, 1015, 2999, 5000};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t b[2] = {(uint8_t)(bad[i] >> 8), (uint8_t)bad[i]};
    CHECK(!dm_ws_close_code_valid(bad[i]) && dm_ws_close_parse(b, 2, &code, &reason, &rlen) < 0, "code %d", bad[i]);
  }
  char longr[200];
  memset(longr, 'r', sizeof longr);
  CHECK(dm_ws_close_payload(p, 1000, longr, sizeof longr) == 125, "the reason is cut to 123 bytes");
  CHECK(dm_ws_close_payload(p, 0, "x", 1) == 0, "code 0: no status");
}

int main(void) {
  test_accept();
  test_rfc_frames();
  test_refusals();
  test_close();
  if (failures) fprintf(stderr, "%d failures\n", failures);
  else printf("ok - ws_frame\n");
  return failures != 0;
}
