#ifndef DEMESNE_WS_H
#define DEMESNE_WS_H
/*
 * The WebSocket client engine (RFC 6455) on a libuv loop. It knows nothing of Lua;
 * core/bind/ws.c translates.
 *
 * libcurl (CURLOPT_CONNECT_ONLY, HTTP/1.1 forced, a private multi handle driven by
 * curl_multi_socket_action from uv_poll/uv_timer callbacks) makes the TCP and TLS
 * connection; then this file writes the HTTP/1.1 Upgrade request itself
 * (curl_easy_send), parses the 101 answer with llhttp, checks Sec-WebSocket-Accept, and
 * moves frames (core/ws_frame.c) with readiness from a uv_poll on CURLINFO_ACTIVESOCKET.
 * Nothing blocks the loop.
 *
 * Callback contract for a connection started with dm_ws_connect():
 *  - on_open is called at most once, when the handshake succeeded;
 *  - on_message for each whole text or binary message after that;
 *  - exactly one of on_close and on_error ends the connection, always from a loop callback,
 *    never from inside dm_ws_connect/send/close/discard; the engine frees the connection
 *    after it returns;
 *  - after dm_ws_discard() none is called again.
 * Any callback may call dm_ws_send, dm_ws_close and dm_ws_discard on its connection.
 * Pings are answered with pongs by the engine, and never reported.
 */
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct dm_ws dm_ws;

/// An operational failure: a message and a short stable code.
typedef struct dm_ws_err {
  char msg[512];
  const char *code; ///< static string ("ECONNREFUSED", "ETIMEDOUT", "EHANDSHAKE", "EPROTO", ...)
  long status;      ///< the HTTP status of a refused handshake, else 0
} dm_ws_err;

/// One request header of the Upgrade request; copied by dm_ws_connect().
typedef struct dm_ws_header {
  const char *name;
  const char *value;
} dm_ws_header;

/// How to connect. Everything is copied during dm_ws_connect(); the caller keeps ownership.
typedef struct dm_ws_opts {
  const char *url;             ///< ws://, wss://, http:// or https:// (http(s) = ws(s))
  const dm_ws_header *headers; ///< extra request headers (no CR/LF; not the WebSocket ones)
  size_t nheaders;
  const char *const *protocols; ///< Sec-WebSocket-Protocol offers, in order of preference
  size_t nprotocols;
  const char *ca_pem; ///< PEM certificate authorities verifying the server (wss), or NULL
  size_t ca_len;
  const char *cert_pem; ///< PEM client certificate (wss), or NULL
  size_t cert_len;
  const char *key_pem; ///< PEM private key of the client certificate, or NULL
  size_t key_len;
  long timeout_ms;       ///< connect + TLS + handshake limit, 0 = 30000
  long close_timeout_ms; ///< how long dm_ws_close waits for the server's close frame, 0 = 2000
  uint64_t max_message;  ///< largest message accepted in bytes, 0 = 64 MiB (else close 1009)
} dm_ws_opts;

/// Connection callbacks; `ud` is the pointer given to dm_ws_connect().
typedef struct dm_ws_handler {
  /// The handshake succeeded; `protocol` is the Sec-WebSocket-Protocol the server chose
  /// ("" when none), valid during the call.
  void (*on_open)(void *ud, dm_ws *ws, const char *protocol);
  /// A whole message; `data` is valid during the call. `binary`: 1 binary, 0 text.
  void (*on_message)(void *ud, dm_ws *ws, const uint8_t *data, size_t len, int binary);
  /// The connection ended by a close handshake, or by the server going away: `code` is the
  /// server's close code (1005 when its close frame had none, 1006 when the connection
  /// ended without a close frame or dm_ws_close waited in vain, RFC 6455 7.1.5), `reason`
  /// its reason (valid during the call).
  void (*on_close)(void *ud, dm_ws *ws, int code, const char *reason, size_t reason_len);
  /// The connection failed (connect, TLS, handshake, protocol or I/O error, timeout).
  void (*on_error)(void *ud, dm_ws *ws, const dm_ws_err *err);
} dm_ws_handler;

/// Starts connecting. Returns the connection (owned by the engine until its last callback
/// returned or dm_ws_discard was called), or NULL with `err` filled when the options are
/// invalid ("EINVAL": bad URL or scheme, CR/LF in a header) or memory runs out ("ENOMEM").
dm_ws *dm_ws_connect(uv_loop_t *loop, const dm_ws_opts *opts, const dm_ws_handler *handler, void *ud, dm_ws_err *err);

/// Queues one message (binary: 1 binary, 0 text; the caller checks that text is UTF-8) as
/// one masked frame. Returns 0, or -1 with `err` ("ENOTCONN" before open, "ECLOSED" once
/// closing or closed, "E2BIG" above max_message, "ENOMEM").
int dm_ws_send(dm_ws *ws, const uint8_t *data, size_t len, int binary, dm_ws_err *err);

/// Starts the close handshake (RFC 6455 7.1.2): sends a close frame with `code` (0: none;
/// else dm_ws_close_code_valid) and `reason` (cut to 123 bytes), then waits up to
/// close_timeout_ms for the server's close frame, and ends with on_close. Before the
/// connection is open it aborts it: on_close(1006, "closed before the handshake"), later.
/// No effect once closing.
void dm_ws_close(dm_ws *ws, int code, const char *reason, size_t reason_len);

/// Ends the connection silently: no callback is called again; the socket is closed and the
/// memory freed (now, or when the current callback returns). For owners going away (__gc).
void dm_ws_discard(dm_ws *ws);

/// Bytes queued for sending and not yet written to the socket.
size_t dm_ws_queued(const dm_ws *ws);

#endif
