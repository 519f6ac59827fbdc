#ifndef DEMESNE_HTTP_H
#define DEMESNE_HTTP_H
/*
 * The HTTP engine: libcurl's multi interface driven by a libuv loop
 * (curl_multi_socket_action + one uv_poll per socket + one uv_timer).
 * It knows nothing of Lua; core/bind/http.c translates.
 *
 * Threading: everything runs on the loop thread.
 *
 * Callback contract for a request started with dm_http_start():
 *  - on_headers (optional) is called at most once, when the head of the final response
 *    (status >= 200) is complete, before any body data;
 *  - on_data (only when opts.stream is set) is called for each body chunk as it arrives;
 *  - on_done is called exactly once, always from a loop callback and never from inside
 *    dm_http_start() or dm_http_cancel(), except that dm_http_free() completes every live
 *    request synchronously with code "ECANCELED";
 *  - after dm_http_discard() none of them is called again.
 * All three may call dm_http_start() and dm_http_cancel() (the work is deferred to the
 * loop: libcurl forbids re-entering the multi handle from its callbacks).
 */
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct dm_http dm_http;
typedef struct dm_http_req dm_http_req;

/// An operational failure: a message and a short stable code ("ENOENT", "ETIMEDOUT", ...).
typedef struct dm_http_err {
  char msg[512];
  const char *code; ///< static string
} dm_http_err;

/// One request header. Both strings are copied by dm_http_start().
typedef struct dm_http_header {
  const char *name;
  const char *value;
} dm_http_header;

/// What to send and how to receive. Every string is copied (or only used) during
/// dm_http_start(); the caller keeps ownership.
typedef struct dm_http_opts {
  const char *url;               ///< required; http:// or https:// only
  const char *method;            ///< NULL = "GET"
  const dm_http_header *headers; ///< request headers (names/values must not hold CR/LF)
  size_t nheaders;
  const char *unix_socket; ///< connect to this unix socket instead of TCP (or NULL)
  const char *body;        ///< request body (copied), or NULL
  size_t body_len;
  const char *body_file;   ///< request body streamed from this file (or NULL)
  const char *output_file; ///< response body streamed to this file (or NULL)
  int stream;              ///< nonzero: response body goes to on_data, not memory
  long timeout_ms;         ///< total time limit, 0 = none
  long connect_timeout_ms; ///< connect phase limit, 0 = curl's default (300 s)
  uint64_t max_body_bytes; ///< response body cap in bytes, 0 = none ("E2BIG")
  const char *ca_file;     ///< PEM certificate authorities that verify the server (https),
                           ///< in place of the system's (CURLOPT_CAINFO), or NULL
  const char *ca_pem;      ///< the same from memory (CURLOPT_CAINFO_BLOB, copied), or NULL;
  size_t ca_pem_len;       ///< excludes ca_file
  const char *cert_pem;    ///< PEM client certificate (CURLOPT_SSLCERT_BLOB, copied), or NULL
  size_t cert_pem_len;
  const char *key_pem; ///< PEM private key of cert_pem (CURLOPT_SSLKEY_BLOB, copied), or
  size_t key_pem_len;  ///< NULL; required with cert_pem and only with it
  int insecure;        ///< nonzero: the server's certificate and name are not verified
} dm_http_opts;

/// Request callbacks; `ud` is the pointer given to dm_http_start().
typedef struct dm_http_handler {
  /// Head of the final response complete: read dm_http_status()/dm_http_header_at().
  void (*on_headers)(void *ud, dm_http_req *req);
  /// A chunk of the response body (opts.stream only). `data` is valid during the call.
  void (*on_data)(void *ud, dm_http_req *req, const char *data, size_t len);
  /// The request finished: err == NULL on success (any HTTP status), else the failure.
  /// `req` and everything read from it stay valid until on_done returns, then it is freed.
  void (*on_done)(void *ud, dm_http_req *req, const dm_http_err *err);
} dm_http_handler;

/// Creates an engine on `loop`. Its internal handles do not keep the loop alive while no
/// request is in flight. Returns NULL when libcurl cannot be initialised.
dm_http *dm_http_new(uv_loop_t *loop);

/// Destroys the engine: every live request is completed at once through on_done with
/// "ECANCELED" (synchronously, unless it was discarded), curl is cleaned up and the
/// handles are closed; the memory is freed from the close callbacks, so the loop must
/// run (one UV_RUN_NOWAIT is enough) before uv_loop_close. Must not be called from an
/// engine callback. NULL is ignored.
void dm_http_free(dm_http *h);

/// Starts a request. Returns the request (owned by the engine, valid until on_done has
/// returned or dm_http_discard() was called), or NULL with `err` filled for failures
/// found synchronously: a missing/unreadable body_file or an output_file that cannot be
/// created (errno code), an invalid option ("EINVAL"), out of memory ("ENOMEM").
/// On success the callbacks of `handler` (copied) are later called with `ud`.
dm_http_req *dm_http_start(dm_http *h, const dm_http_opts *opts, const dm_http_handler *handler, void *ud,
                           dm_http_err *err);

/// Aborts a request: no more on_headers/on_data calls; on_done is called once later, from
/// the loop, with "cancelled"/"ECANCELED". No effect on a request already cancelled.
void dm_http_cancel(dm_http_req *req);

/// Aborts a request silently: no callback is called again and the engine frees the
/// request (now, or from the loop). For owners that are going away (Lua's __gc).
void dm_http_discard(dm_http_req *req);

/// Status code of the final response (0 before the head is complete).
long dm_http_status(const dm_http_req *req);

/// Number of response headers of the final response.
size_t dm_http_header_count(const dm_http_req *req);

/// The i-th response header (0-based, in arrival order): name lowercased, value trimmed.
/// The strings belong to the request. Returns 0, or -1 when i is out of range.
int dm_http_header_at(const dm_http_req *req, size_t i, const char **name, const char **value);

/// The accumulated response body (neither opts.stream nor opts.output_file): a pointer
/// owned by the request (valid during on_done) and its length in *len. Never NULL.
const char *dm_http_body(const dm_http_req *req, size_t *len);

/// Number of requests started and not yet completed or discarded.
size_t dm_http_active(const dm_http *h);

#endif
