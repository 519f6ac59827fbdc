#ifndef DEMESNE_HTTPD_H
#define DEMESNE_HTTPD_H
/*
 * An HTTP/1.1 server on the loop: listeners on TCP ports and unix sockets, requests parsed
 * with llhttp, whole request bodies handed to the owner, responses written whole or
 * streamed (chunked), keep-alive and pipelining. It knows nothing of Lua or MCP.
 *
 * Each listener carries an identity (a tag the owner chooses) and its own checks, applied
 * in C as soon as the head is complete, before any body byte is read or the owner sees
 * anything:
 *   - Host: when the listener has a host list, the Host header's name (port ignored) must
 *     be one of them, else 421; Origin, when present, must be http(s)://<one of them>[:port],
 *     else 403 ("null" and any other value too);
 *   - Authorization: when the listener has a token, "Bearer <token>" is required (compared
 *     in constant time), else 401 with WWW-Authenticate: Bearer; the header is then removed
 *     from what the owner sees;
 *   - Content-Length over max_body: 413 at once (a chunked body: as soon as it crosses it).
 * Refusals close the connection. The token is never logged or echoed.
 *
 * Connections before their first head passes those checks: with head_timeout_ms, a new
 * connection that has not sent a whole head within it is closed (408 after part of one).
 * With a pre-authentication queue (max_preauth), a new connection joins its listener's
 * queue and counts against max_conns only once a head passes (503 then when full); a full
 * queue closes its oldest connection that has sent nothing (its oldest when all have), so
 * connections without the token cannot keep out one with it. A listener's own max_conns is
 * its own: its connections do not count against the server's.
 *
 * Body bytes being read are bounded for the whole server too: when max_buffered is set, the
 * body bytes its connections hold (read and not yet handed to on_request) never pass it; the
 * request whose bytes would is answered 503 (max_buffered_why) and its connection closed; a
 * pool (dm_httpd_pool) bounds them the same way across several servers.
 *
 * Callback contract (dm_httpd_handler):
 *  - on_head (optional) is called once per request, from the loop, when its head is complete
 *    and passed the listener's checks, before any byte of its body is read: `req` has no
 *    body yet (body "" and body_len 0; content_length says what is announced). The owner
 *    may refuse it there with dm_httpd_respond() (the connection closes after the answer
 *    and the body is never kept) or dm_httpd_conn_close(); when it does neither, the body is
 *    read and on_request follows. A streamed answer cannot start from on_head;
 *  - on_request is called once per complete request, from the loop, with the connection
 *    busy: the owner answers with dm_httpd_respond() or dm_httpd_stream_start() + _write()
 *    + _end(), at once or later. Bytes the client sends meanwhile (a pipelined request) are
 *    held (up to max_head) and parsed after the answer ends;
 *  - on_drain is called from the loop after dm_httpd_want_drain() once the bytes queued on
 *    the connection fall to max_output / 8 or less;
 *  - on_close is called exactly once for every connection that reached on_head or on_request, from
 *    the loop, after its handles are closed; the connection is freed when it returns.
 *    `why` is NULL after an orderly end, else a short reason ("client closed", "slow
 *    reader", "server closing", "timeout");
 *  - on_closed is called once after dm_httpd_close(), when every listener and connection
 *    is gone; the server is then freed.
 * No owner call ever re-enters a callback: closing a connection from inside a call only
 * schedules its on_close.
 */
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define DM_HTTPD_HEADERS_MAX 100 ///< most header lines accepted (431 above)

typedef struct dm_httpd dm_httpd;
typedef struct dm_httpd_conn dm_httpd_conn;

/// One header of a request or a response. Strings need not be NUL-terminated.
typedef struct dm_httpd_header {
  const char *name;
  size_t name_len;
  const char *value;
  size_t value_len;
} dm_httpd_header;

/// A request, valid during on_head / on_request only (copy what you keep); in on_head its
/// body is not read yet.
typedef struct dm_httpd_request {
  const char *method; ///< "GET", "POST"… (NUL-terminated)
  const char *target; ///< the request target as sent ("/mcp?x=1"), NUL-terminated
  int http_major, http_minor;
  const dm_httpd_header *headers; ///< as received, Authorization removed when the listener checked it
  size_t nheaders;
  const char *body; ///< the whole body (chunked bodies decoded); "" when none
  size_t body_len;
  const char *listener;     ///< the tag of the listener the connection arrived on
  int keep_alive;           ///< 1 when the connection stays open after the answer
  long long content_length; ///< the announced body length in bytes (0: none), -1 for a chunked body
} dm_httpd_request;

/// Owner callbacks; `ud` is the pointer given to dm_httpd_new().
typedef struct dm_httpd_handler {
  void (*on_request)(void *ud, dm_httpd_conn *c, const dm_httpd_request *req);
  void (*on_drain)(void *ud, dm_httpd_conn *c);
  void (*on_close)(void *ud, dm_httpd_conn *c, const char *why);
  void (*on_closed)(void *ud);
  void (*on_head)(void *ud, dm_httpd_conn *c, const dm_httpd_request *head); ///< optional, see above
} dm_httpd_handler;

/// A budget of request body bytes being read, shared by several servers (the caller's: it
/// must outlive them). The request whose bytes would take `used` past `max` (0: no cap) is
/// answered 503 with `why` (plain ASCII without quotes; default as max_buffered_why).
typedef struct dm_httpd_pool {
  size_t used; ///< body bytes the servers' connections hold now while reading them
  size_t max;
  char why[512];
} dm_httpd_pool;

/// Server settings; 0 picks the default. Copied by dm_httpd_new().
typedef struct dm_httpd_opts {
  size_t max_body;              ///< largest request body in bytes (413 above); default 4 MiB
  size_t max_head;              ///< largest request head in bytes (431 above); default 64 KiB
  size_t max_output;            ///< bytes queued on one connection before it is cut as a slow reader; default 16 MiB
  size_t max_conns;             ///< connections at once of the listeners with no max_conns of their own (503
                                ///< above: at accept, or with a pre-authentication queue when a connection
                                ///< passes the checks); default 1024
  unsigned request_timeout_ms;  ///< a request must arrive whole within this, from its first byte (408); default 30000
  unsigned idle_timeout_ms;     ///< an idle keep-alive connection is closed after this; default 120000
  unsigned head_timeout_ms;     ///< a new connection must send its first request head whole within this, from
                                ///< accept: else it is closed (408 when part of a head came); the rest of that
                                ///< request then has request_timeout_ms. 0: idle_timeout_ms until the first byte
  size_t max_preauth;           ///< default of dm_httpd_listen_opts.max_preauth; 0: none
  const char *error_body;       ///< body of the server's own refusals: a printf format with one %s (the
                                ///< reason, plain ASCII without quotes); default "%s\n"
  const char *error_type;       ///< Content-Type of those bodies; default "text/plain; charset=utf-8"
  size_t max_buffered;          ///< body bytes all connections may hold while being read (503 above); 0: no cap
                                ///< but max_body per connection
  const char *max_buffered_why; ///< the reason in that 503 (plain ASCII without quotes); default
                                ///< "the server holds too many request body bytes at once"
  dm_httpd_pool *pool;          ///< a budget shared with other servers, checked beside max_buffered; NULL: none
} dm_httpd_opts;

/// Settings of one listener. Strings are copied.
typedef struct dm_httpd_listen_opts {
  const char *tag;          ///< identity handed to the owner with each request (required)
  const char *token;        ///< bearer token every request must carry, or NULL for none
  const char *const *hosts; ///< accepted Host names ("localhost", "127.0.0.1", "[::1]"), or NULL: any
  size_t nhosts;
  int ipv6_only;      ///< TCP on an IPv6 address: do not also take IPv4
  size_t max_conns;   ///< connections of this listener at once (503 above), not counted in the server's
                      ///< max_conns; 0: the server's cap
  size_t max_preauth; ///< connections of this listener that have not yet passed its checks (Host, Origin,
                      ///< token) kept at once: a new one past it closes the oldest such. They do not count
                      ///< against max_conns until they pass (then 503 when it is full). 0: the server's
                      ///< max_preauth; when both are 0 there is no queue and max_conns counts at accept
} dm_httpd_listen_opts;

/// Creates a server with no listener yet. Returns NULL when out of memory.
dm_httpd *dm_httpd_new(uv_loop_t *loop, const dm_httpd_opts *opts, const dm_httpd_handler *handler, void *ud);

/// Listens on a numeric IPv4/IPv6 address and port (0 = any free port). Returns 0 and
/// *bound_port, or a libuv error (UV_EINVAL for a non-numeric address).
int dm_httpd_listen_tcp(dm_httpd *s, const char *ip, int port, const dm_httpd_listen_opts *o, int *bound_port);

/// Listens on a unix socket at `path`, created mode 0600. An existing socket file there is
/// replaced; any other file is left alone (UV_EEXIST). The file is removed at close if it
/// is still the one bound. Returns 0 or a libuv error (UV_ENAMETOOLONG over 107 bytes).
int dm_httpd_listen_unix(dm_httpd *s, const char *path, const dm_httpd_listen_opts *o);

/// Listens on a unix socket for demesne-init's relay (`--relay PORT=PATH`): each connection
/// hands over one accepted TCP socket (SCM_RIGHTS, with one byte) and hangs up; the handed
/// socket becomes an HTTP connection of this listener, tagged with its identity. A
/// connection that hands nothing over is closed. Socket file rules as listen_unix.
int dm_httpd_listen_relay(dm_httpd *s, const char *path, const dm_httpd_listen_opts *o);

/// Stops the listeners tagged `tag` (their socket files removed, as at close) and cuts
/// their connections and relay hand-overs in progress (each handed connection gets
/// on_close "listener closed"); the others go on. Returns how many listeners it stopped.
int dm_httpd_unlisten(dm_httpd *s, const char *tag);

/// Stops every listener, removes their socket files, aborts every connection (each
/// handed one gets on_close "server closing"); on_closed follows. Idempotent.
void dm_httpd_close(dm_httpd *s);

/// Connections open now.
size_t dm_httpd_connections(const dm_httpd *s);

/// Request body bytes held now while being read (all connections; what max_buffered bounds).
size_t dm_httpd_buffered(const dm_httpd *s);

/// Answers the request in progress with a whole response. `headers` must not include
/// Content-Length, Transfer-Encoding or Connection (the server sets them). From on_head it
/// refuses the request before its body is read: the connection closes after the answer.
/// Returns 0, or -1 when the connection has no request waiting (closed, or already
/// answered), -2 for a header it may not carry.
int dm_httpd_respond(dm_httpd_conn *c, int status, const dm_httpd_header *headers, size_t n, const char *body,
                     size_t len);

/// Starts a streamed answer (chunked on HTTP/1.1; on HTTP/1.0 the connection closes at the
/// end). Same header rules and returns as dm_httpd_respond().
int dm_httpd_stream_start(dm_httpd_conn *c, int status, const dm_httpd_header *headers, size_t n);

/// Queues `len` bytes of a streamed answer. Returns 0, or -1 when the stream is not open or
/// the bytes would push the connection's queue over max_output: the connection is then cut
/// (on_close "slow reader" follows from the loop).
int dm_httpd_stream_write(dm_httpd_conn *c, const char *data, size_t len);

/// Ends a streamed answer. Returns 0, or -1 when no stream is open.
int dm_httpd_stream_end(dm_httpd_conn *c);

/// Bytes queued on the connection and not yet taken by the kernel.
size_t dm_httpd_queued(const dm_httpd_conn *c);

/// Asks for one on_drain once the queue falls to max_output / 8 or less. Returns 1 when
/// on_drain will come (or on_close first), 0 when the queue is already that low (nothing
/// will be called).
int dm_httpd_want_drain(dm_httpd_conn *c);

/// Cuts the connection now (on_close follows from the loop with `why`, a static string).
void dm_httpd_conn_close(dm_httpd_conn *c, const char *why);

/// The owner's pointer for the connection (NULL until set).
void dm_httpd_conn_set_data(dm_httpd_conn *c, void *data);
void *dm_httpd_conn_data(const dm_httpd_conn *c);

/// Constant-time comparison of `got` (n bytes) with the NUL-terminated `want`: its time
/// depends only on strlen(want). Returns 1 when equal.
int dm_httpd_token_equal(const char *got, size_t n, const char *want);

#endif
