/* WebSocket client framing (RFC 6455), no I/O. See ws_frame.h for the contract. */
#include "ws_frame.h"
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>

size_t dm_ws_header_len(uint64_t len) { return 2 + (len < 126 ? 0 : len <= 0xFFFF ? 2 : 8) + 4; }

size_t dm_ws_encode(uint8_t *out, int opcode, int fin, const uint8_t mask[4], const uint8_t *payload, uint64_t len) {
  size_t n = 0;
  out[n++] = (uint8_t)((fin ? 0x80 : 0) | (opcode & 0x0F));
  if (len < 126) {
    out[n++] = (uint8_t)(0x80 | len);
  } else if (len <= 0xFFFF) {
    out[n++] = 0x80 | 126;
    out[n++] = (uint8_t)(len >> 8);
    out[n++] = (uint8_t)len;
  } else {
    out[n++] = 0x80 | 127;
    for (int i = 7; i >= 0; i--) out[n++] = (uint8_t)(len >> (8 * i));
  }
  memcpy(out + n, mask, 4);
  n += 4;
  for (uint64_t i = 0; i < len; i++) out[n + i] = payload[i] ^ mask[i & 3];
  return n + (size_t)len;
}

int dm_ws_feed(dm_ws_decoder *d, const uint8_t *data, size_t len) {
  if (d->off > 0 && d->off == d->len) d->off = d->len = 0;
  if (d->len + len > d->cap) {
    if (d->off > 0) { /* compact first: what was returned before is no longer valid */
      memmove(d->in, d->in + d->off, d->len - d->off);
      d->len -= d->off;
      d->off = 0;
    }
    size_t cap = d->cap ? d->cap : 4096;
    while (cap < d->len + len) cap *= 2;
    if (cap != d->cap) {
      uint8_t *p = realloc(d->in, cap);
      if (!p) return -1;
      d->in = p;
      d->cap = cap;
    }
  }
  if (len) memcpy(d->in + d->len, data, len);
  d->len += len;
  return 0;
}

static int fail(dm_ws_decoder *d, const char **err, int *close_code, const char *msg, int code) {
  d->failed = code;
  *err = msg;
  *close_code = code;
  return DM_WS_FAIL;
}

/* Appends a fragment's payload to the message being reassembled. */
static int append(dm_ws_decoder *d, const uint8_t *p, size_t n) {
  if (d->msg_len + n > d->msg_cap) {
    size_t cap = d->msg_cap ? d->msg_cap : 4096;
    while (cap < d->msg_len + n) cap *= 2;
    uint8_t *m = realloc(d->msg, cap);
    if (!m) return -1;
    d->msg = m;
    d->msg_cap = cap;
  }
  if (n) memcpy(d->msg + d->msg_len, p, n);
  d->msg_len += n;
  return 0;
}

/* The header of the frame at d->in + d->off: 0 when incomplete, -1 when invalid (*why), else
 * its size; *plen gets the payload length. */
static int header(const dm_ws_decoder *d, uint64_t *plen, const char **why) {
  size_t avail = d->len - d->off;
  if (avail < 2) return 0; /* (d->in may still be NULL) */
  const uint8_t *p = d->in + d->off;
  if (p[1] & 0x80) return *why = "the server sent a masked frame (RFC 6455 5.1)", -1;
  uint64_t len = p[1] & 0x7F;
  int hl = 2;
  if (len == 126) {
    if (avail < 4) return 0;
    len = ((uint64_t)p[2] << 8) | p[3];
    hl = 4;
  } else if (len == 127) {
    if (avail < 10) return 0;
    if (p[2] & 0x80) return *why = "a 64-bit frame length with its top bit set (RFC 6455 5.2)", -1;
    len = 0;
    for (int i = 2; i < 10; i++) len = (len << 8) | p[i];
    hl = 10;
  }
  *plen = len;
  return hl;
}

/* Checks the first byte and the length of a frame before its payload has arrived. */
static const char *check_frame(const dm_ws_decoder *d, int op, int fin, uint64_t len, int *code) {
  const uint8_t b0 = d->in[d->off];
  *code = DM_WS_CLOSE_PROTOCOL;
  if (b0 & 0x70) return "a frame with RSV bits set, and no extension was negotiated (RFC 6455 5.2)";
  if (op >= 0x8) {
    if (op > DM_WS_PONG) return "a frame with an unknown control opcode (RFC 6455 5.2)";
    if (!fin) return "a fragmented control frame (RFC 6455 5.5)";
    if (len > 125) return "a control frame longer than 125 bytes (RFC 6455 5.5)";
    return NULL;
  }
  if (op > DM_WS_BINARY) return "a frame with an unknown data opcode (RFC 6455 5.2)";
  if (op == DM_WS_CONT && !d->msg_op) return "a continuation frame with no message open (RFC 6455 5.4)";
  if (op != DM_WS_CONT && d->msg_op) return "a new message inside a fragmented one (RFC 6455 5.4)";
  uint64_t total = (op == DM_WS_CONT ? d->msg_len : 0) + len;
  if (d->max_message && (total > d->max_message || total < len)) {
    *code = DM_WS_CLOSE_TOO_BIG;
    return "a message larger than the largest one accepted";
  }
  return NULL;
}

int dm_ws_next(dm_ws_decoder *d, dm_ws_msg *out, const char **err, int *close_code) {
  if (d->failed) {
    *err = "the stream broke RFC 6455 earlier";
    *close_code = d->failed;
    return DM_WS_FAIL;
  }
  for (;;) {
    uint64_t len;
    const char *why = NULL;
    int hl = header(d, &len, &why);
    if (hl < 0) return fail(d, err, close_code, why, DM_WS_CLOSE_PROTOCOL);
    if (hl == 0) return DM_WS_NEED;
    const uint8_t *p = d->in + d->off;
    int op = p[0] & 0x0F, fin = !!(p[0] & 0x80), code;
    if ((why = check_frame(d, op, fin, len, &code))) return fail(d, err, close_code, why, code);
    if ((uint64_t)(d->len - d->off - (size_t)hl) < len) return DM_WS_NEED;
    const uint8_t *payload = p + hl;
    d->off += (size_t)hl + (size_t)len;
    if (op >= 0x8 || (op != DM_WS_CONT && fin)) { /* a control frame or a whole message */
      *out = (dm_ws_msg){op, payload, (size_t)len};
      return DM_WS_GOT;
    }
    if (op != DM_WS_CONT) {
      d->msg_op = op;
      d->msg_len = 0;
    }
    if (append(d, payload, (size_t)len) < 0) return fail(d, err, close_code, "out of memory", DM_WS_CLOSE_TOO_BIG);
    if (fin) {
      static const uint8_t empty[1];
      *out = (dm_ws_msg){d->msg_op, d->msg ? d->msg : empty, d->msg_len}; /* never NULL */
      d->msg_op = 0;
      return DM_WS_GOT;
    }
  }
}

void dm_ws_decoder_free(dm_ws_decoder *d) {
  uint64_t max = d->max_message;
  free(d->in);
  free(d->msg);
  memset(d, 0, sizeof *d);
  d->max_message = max;
}

int dm_ws_close_code_valid(int code) {
  return (code >= 1000 && code <= 1003) || (code >= 1007 && code <= 1014) || (code >= 3000 && code <= 4999);
}

size_t dm_ws_close_payload(uint8_t out[125], int code, const char *reason, size_t reason_len) {
  if (code == 0) return 0;
  out[0] = (uint8_t)(code >> 8);
  out[1] = (uint8_t)code;
  if (reason_len > 123) reason_len = 123;
  if (reason_len) memcpy(out + 2, reason, reason_len);
  return 2 + reason_len;
}

int dm_ws_close_parse(const uint8_t *data, size_t len, int *code, const uint8_t **reason, size_t *reason_len) {
  *reason = data;
  *reason_len = 0;
  if (len == 0) {
    *code = DM_WS_CLOSE_NO_STATUS;
    return 0;
  }
  if (len == 1) return -1;
  *code = (data[0] << 8) | data[1];
  if (!dm_ws_close_code_valid(*code)) return -1;
  *reason = data + 2;
  *reason_len = len - 2;
  return 0;
}

int dm_ws_accept(const char *key, char out[29]) {
  static const char guid[] = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
  unsigned char md[SHA_DIGEST_LENGTH];
  unsigned int mdlen = 0;
  EVP_MD_CTX *c = EVP_MD_CTX_new();
  int ok = c && EVP_DigestInit_ex(c, EVP_sha1(), NULL) && EVP_DigestUpdate(c, key, strlen(key)) &&
           EVP_DigestUpdate(c, guid, sizeof guid - 1) && EVP_DigestFinal_ex(c, md, &mdlen);
  EVP_MD_CTX_free(c);
  if (!ok || mdlen != SHA_DIGEST_LENGTH) return -1;
  EVP_EncodeBlock((unsigned char *)out, md, SHA_DIGEST_LENGTH);
  return 0;
}

void dm_ws_key(const uint8_t random16[16], char out[25]) { EVP_EncodeBlock((unsigned char *)out, random16, 16); }
