#ifndef DEMESNE_WS_FRAME_H
#define DEMESNE_WS_FRAME_H
/*
 * WebSocket framing for the client side (RFC 6455), with no I/O: encoding of client frames
 * (always masked), an incremental decoder of server frames that reassembles fragmented
 * messages, close-frame payloads and the Sec-WebSocket-Accept value. core/ws.c drives it.
 */
#include <stddef.h>
#include <stdint.h>

/// Opcodes (RFC 6455 5.2).
enum {
  DM_WS_CONT = 0x0,
  DM_WS_TEXT = 0x1,
  DM_WS_BINARY = 0x2,
  DM_WS_CLOSE = 0x8,
  DM_WS_PING = 0x9,
  DM_WS_PONG = 0xA,
};

/// Close codes the decoder reports with its errors (RFC 6455 7.4.1).
enum {
  DM_WS_CLOSE_NORMAL = 1000,
  DM_WS_CLOSE_PROTOCOL = 1002,
  DM_WS_CLOSE_NO_STATUS = 1005,
  DM_WS_CLOSE_ABNORMAL = 1006,
  DM_WS_CLOSE_TOO_BIG = 1009,
};

/// Largest client frame header: 2 bytes, a 64-bit length and the 4-byte mask.
#define DM_WS_MAX_HEADER 14

/// Size of the header of a client frame carrying `len` payload bytes: 2 + (0, 2 or 8
/// length bytes: 7-, 16- or 64-bit length) + 4 (mask).
size_t dm_ws_header_len(uint64_t len);

/// Encodes one client frame (RFC 6455 5.2): FIN when `fin`, `opcode` (one of DM_WS_*), the
/// shortest length form, the 4-byte `mask` (the caller draws it at random for each frame,
/// 5.3) and the payload masked with it. `out` must have dm_ws_header_len(len) + len bytes;
/// `payload` may be NULL when len is 0. Returns the bytes written. Control frames (close,
/// ping, pong) must carry at most 125 bytes and have fin set; the caller keeps to that.
size_t dm_ws_encode(uint8_t *out, int opcode, int fin, const uint8_t mask[4], const uint8_t *payload, uint64_t len);

/// What the decoder found (dm_ws_next).
typedef struct dm_ws_msg {
  int opcode;          ///< DM_WS_TEXT/BINARY (a whole message) or DM_WS_CLOSE/PING/PONG
  const uint8_t *data; ///< payload, valid until the next dm_ws_feed/dm_ws_next/dm_ws_decoder_free
  size_t len;
} dm_ws_msg;

/// The incremental decoder of server frames. Zero-initialise it, then set max_message.
typedef struct dm_ws_decoder {
  uint64_t max_message; ///< largest message (all its fragments) in bytes; 0 = no limit
  uint8_t *in;          ///< bytes fed and not yet decoded: in[off .. len)
  size_t off, len, cap;
  uint8_t *msg; ///< payload of a fragmented message being reassembled
  size_t msg_len, msg_cap;
  int msg_op; ///< its opcode, 0 when no fragmented message is open
  int failed; ///< an error was returned: every later call returns it again
} dm_ws_decoder;

/// Appends `len` bytes read from the server. Returns 0, or -1 when out of memory.
int dm_ws_feed(dm_ws_decoder *d, const uint8_t *data, size_t len);

/// Results of dm_ws_next.
enum { DM_WS_NEED = 0, DM_WS_GOT = 1, DM_WS_FAIL = -1 };

/// Decodes the next whole message or control frame from the bytes fed so far. Returns
/// DM_WS_GOT with *out set; DM_WS_NEED when more bytes are needed (the fragments of an
/// unfinished message are kept); DM_WS_FAIL with *err (a static message) and *close_code
/// (1002 protocol error, 1009 too big) when the stream breaks RFC 6455: a masked frame (5.1),
/// RSV bits set (no extension is negotiated, 5.2), an unknown opcode, a control frame longer
/// than 125 bytes or fragmented (5.5), a 64-bit length with its top bit set, a continuation
/// with no message open or a new message inside one (5.4), a message larger than
/// max_message, or out of memory. After a failure every call fails the same way.
int dm_ws_next(dm_ws_decoder *d, dm_ws_msg *out, const char **err, int *close_code);

/// Frees the decoder's buffers (the struct itself belongs to the caller) and zeroes it,
/// keeping max_message.
void dm_ws_decoder_free(dm_ws_decoder *d);

/// Whether `code` may be sent or received in a close frame (RFC 6455 7.4.1 and 7.4.2, plus
/// the IANA-registered 1012-1014): 1000-1003, 1007-1014, 3000-4999.
int dm_ws_close_code_valid(int code);

/// Writes a close payload (RFC 6455 5.5.1): the 2-byte code, big-endian, then the reason,
/// cut to fit 123 bytes. Code 0 writes an empty payload (no status). `out` has 125 bytes.
/// Returns the payload length.
size_t dm_ws_close_payload(uint8_t out[125], int code, const char *reason, size_t reason_len);

/// Reads a close payload: an empty one gives code 1005 (no status received) and an empty
/// reason; otherwise the code and the reason (pointing into `data`). Returns 0, or -1 when
/// the payload is 1 byte long or the code is not valid (dm_ws_close_code_valid).
int dm_ws_close_parse(const uint8_t *data, size_t len, int *code, const uint8_t **reason, size_t *reason_len);

/// The Sec-WebSocket-Accept value for a Sec-WebSocket-Key (RFC 6455 4.2.2): base64 of the
/// SHA-1 of the key followed by the GUID 258EAFA5-E914-47DA-95CA-C5AB0DC85B11 (OpenSSL's
/// libcrypto). `out` gets 28 characters and a NUL. Returns 0, or -1 when libcrypto fails.
int dm_ws_accept(const char *key, char out[29]);

/// A fresh Sec-WebSocket-Key (RFC 6455 4.1): base64 of 16 random bytes from `random16`.
/// `out` gets 24 characters and a NUL.
void dm_ws_key(const uint8_t random16[16], char out[25]);

#endif
