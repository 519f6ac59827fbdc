#ifndef DEMESNE_PROXY_H
#define DEMESNE_PROXY_H
/*
 * The egress proxy data path: one listener per sandbox on a unix socket, the request head
 * parsed with llhttp, a verdict asked of the owner (Lua, through core/bind/proxy.c), then
 * the name resolved here, every address checked, one dialled, and bytes spliced both ways
 * on the loop. It knows nothing of Lua.
 *
 * Three request shapes are accepted:
 *   CONNECT host:port                      -> "200 Connection established", then a raw tunnel
 *   GET http://host[:port]/path (absolute)  -> forwarded as origin-form to host
 *   GET /path + Host: host[:port] (origin)  -> forwarded to the Host header's authority
 * A plain HTTP request is forwarded with "Connection: close" and nothing after its body is
 * forwarded: one request per proxy connection, so a later request can never ride to an
 * upstream that was judged for an earlier one.
 *
 * Callback contract for a listener made with dm_proxy_new():
 *  - on_request is called once per connection whose head parsed; the owner answers with
 *    dm_proxy_allow() or dm_proxy_deny(), at once (even from inside on_request) or later;
 *  - on_done is called exactly once per connection that reached on_request, always from a
 *    loop callback, after every handle of the connection is closed; the connection is
 *    freed when it returns. Connections refused before on_request (bad head, timeout) end
 *    silently;
 *  - on_refused (optional) is called once per connection refused for a ceiling, from the
 *    loop, when it is refused (such a connection never reaches on_request);
 *  - on_closed is called once, from the loop, after dm_proxy_close() when the last
 *    connection is gone and the listener's handles are closed; the listener is then freed.
 *
 * Ceilings: one sandbox must not exhaust the descriptors the server needs for everything
 * else. A listener admits at most `max_conns` connections at once, and its connections
 * together hold at most `max_fds` descriptors (counted as they open: 2 while a connection
 * reads its head, 3 while it dials, 4 for a forwarded plain request, 6 for a CONNECT
 * tunnel, whose two splice pipes hold two each). Every listener of the process together
 * stays below the soft RLIMIT_NOFILE less a reserve (a quarter of it, at least 256), so
 * the rest of the server always has descriptors. A connection over a ceiling is answered
 * "503 Service Unavailable" with a body naming the ceiling (at most DM_PROXY_REFUSING_MAX
 * such answers at once per listener, each within DM_PROXY_REFUSE_MS; beyond that it is
 * closed at once); a connection that would cross the descriptor ceiling while it dials or
 * starts its tunnel gets the same 503.
 */
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define DM_PROXY_HOST_MAX 256    ///< bytes of a normalised host name, NUL included
#define DM_PROXY_HEAD_MAX 65536  ///< largest request head accepted (431 above)
#define DM_PROXY_HEADERS_MAX 128 ///< most header lines accepted (431 above)
#define DM_PROXY_PORT 3128       ///< the proxy's port inside every sandbox
#define DM_PROXY_MAX_CONNS 256   ///< default ceiling on a listener's connections
#define DM_PROXY_MAX_FDS 1024    ///< default ceiling on the descriptors a listener's connections hold
#define DM_PROXY_CONN_FDS 6      ///< the most descriptors one connection holds (a CONNECT tunnel)
#define DM_PROXY_REFUSING_MAX 32 ///< refused connections answered (503) at once per listener
#define DM_PROXY_REFUSE_MS 2000  ///< how long a refused connection may take to send its head

typedef struct dm_proxy dm_proxy;
typedef struct dm_proxy_conn dm_proxy_conn;

/// How the request named its target.
typedef enum dm_proxy_form {
  DM_FORM_CONNECT = 1, ///< CONNECT host:port
  DM_FORM_ABSOLUTE,    ///< METHOD http://host[:port]/path
  DM_FORM_ORIGIN,      ///< METHOD /path with Host: host[:port]
} dm_proxy_form;

/// A parsed request head. Strings are NUL-terminated; `path` and `host_header` point into
/// the parser's buffer and live as long as it.
typedef struct dm_proxy_request {
  char method[24];
  char host[DM_PROXY_HOST_MAX]; ///< lowercased, one trailing dot removed, IPv6 without brackets,
                                ///< numeric IPv4 spellings ("127.1", "0x7f000001") canonical
  int port;
  int ip; ///< 0 for a name, 4 or 6 for an IP literal
  dm_proxy_form form;
  const char *path;        ///< origin-form path and query ("/" when absent; "" for CONNECT)
  const char *host_header; ///< the Host header's value, or NULL
  int http_major, http_minor;
} dm_proxy_request;

/// One header line of a parsed head, as offsets into the parser's buffer.
typedef struct dm_proxy_span {
  uint32_t name_off, name_len, value_off, value_len;
} dm_proxy_span;

/// An incremental request-head parser over a buffer it owns (DM_PROXY_HEAD_MAX bytes).
typedef struct dm_proxy_head {
  char *buf;       ///< head bytes received so far (heap)
  size_t len;      ///< bytes in buf
  size_t head_len; ///< bytes of the head once complete (what follows is body or tunnel)
  int state;       ///< 0 reading, 1 complete, -1 refused
  int status;      ///< HTTP status for a refusal (400, 405, 414, 431, 501, 505)
  const char *why; ///< static text for a refusal
  dm_proxy_request req;
  dm_proxy_span hdr[DM_PROXY_HEADERS_MAX];
  size_t nhdr;
  void *parser;    ///< llhttp_t + settings (heap)
  char *path_copy; ///< req.path (heap)
  char *host_copy; ///< req.host_header (heap)
  /* spans being collected */
  size_t url_off, url_len, method_off, method_len;
  int in_field, in_value, host_seen;
} dm_proxy_head;

/// Sets up a head parser. Returns 0, or -1 when out of memory.
int dm_proxy_head_init(dm_proxy_head *h);

/// Frees what the parser holds (not `h` itself). Safe on a zeroed or freed parser.
void dm_proxy_head_free(dm_proxy_head *h);

/// Where the next bytes must be placed (*cap bytes free). The caller writes n <= *cap
/// bytes there and calls dm_proxy_head_advance(h, n).
char *dm_proxy_head_space(dm_proxy_head *h, size_t *cap);

/// Parses n new bytes placed at dm_proxy_head_space(). Returns 0 (need more), 1 (the head
/// is complete: h->req and h->head_len are set; bytes after head_len are not parsed) or
/// -1 (refused: h->status and h->why say why). A full buffer without a complete head is
/// refused with 431.
int dm_proxy_head_advance(dm_proxy_head *h, size_t n);

/// Convenience for tests: copies `data` into the parser and advances. Same returns.
int dm_proxy_head_feed(dm_proxy_head *h, const char *data, size_t len);

/// For a plain HTTP request whose head is complete: runs `len` body bytes through the
/// parser. Returns 0 (the message goes on: forward all `len`), 1 (the message ended:
/// forward *fwd bytes, drop the rest) or -1 (malformed body: stop).
int dm_proxy_head_body(dm_proxy_head *h, const char *data, size_t len, size_t *fwd);

/// Writes the head to forward upstream for a plain HTTP request: origin-form request line,
/// Host set from the target (absolute-form), hop-by-hop and Proxy-* headers dropped,
/// "Connection: close" added. Returns the length, or 0 when `cap` is too small.
size_t dm_proxy_head_rewrite(const dm_proxy_head *h, char *out, size_t cap);
/// The same for a request sent on to an upstream proxy: the request line in absolute-form
/// (RFC 9112 3.2.2), the sandbox's Proxy-* headers dropped and `proxy_auth` (NULL: none) sent
/// as Proxy-Authorization. Returns the length, or 0 when `cap` is too small.
size_t dm_proxy_head_rewrite_proxy(const dm_proxy_head *h, char *out, size_t cap, const char *proxy_auth);

/// Normalises a host (a name, an IPv4 literal in any inet_aton spelling, or an IPv6
/// literal with or without brackets): lowercase, one trailing dot removed, IPv4 canonical.
/// Names must be LDH labels (underscore allowed), 1-253 bytes. Returns 0 with *ip = 0, 4
/// or 6, or -1 with *why set (static text).
int dm_proxy_normalize_host(const char *in, size_t len, char *out, size_t cap, int *ip, const char **why);

/// Splits "host[:port]" or "[v6][:port]" and normalises the host. A missing port gives
/// `default_port` (-1: the port is required). Returns 0 or -1 with *why set.
int dm_proxy_split_authority(const char *in, size_t len, int default_port, char *host, size_t cap, int *port, int *ip,
                             const char **why);

/// The class of an address: "public", "loopback", "private", "link-local", "metadata",
/// "shared" (100.64/10), "unspecified", "multicast", "broadcast", "reserved" or "ipv6"
/// (every IPv6 address). Everything but "public" is denied unless a rule allows it.
const char *dm_proxy_classify(const struct sockaddr *sa);

/// An address rule: a CIDR and a port (0 = any), allowing or denying.
typedef struct dm_proxy_rule {
  int family; ///< AF_INET or AF_INET6
  unsigned char addr[16];
  int prefix;
  int port;
  int allow;
  int index; ///< the owner's rule number, reported back in results
} dm_proxy_rule;

/// Parses "a.b.c.d/n", "v6/n" or a bare address (a /32 or /128) into r (port, allow and
/// index untouched). Returns 0 or -1.
int dm_proxy_parse_cidr(const char *s, dm_proxy_rule *r);

/// Checks an address against the rules (first rule whose CIDR holds the address and whose
/// port matches decides), else by class. Returns 1 (may be dialled) or 0; *why gets the
/// deciding class or "rule", and *rule the deciding rule's index (-1 when none).
int dm_proxy_check_address(const struct sockaddr *sa, int port, const dm_proxy_rule *rules, size_t n, const char **why,
                           int *rule);

/// Settings of a listener. Everything is copied by dm_proxy_new().
typedef struct dm_proxy_opts {
  const char *path;           ///< the unix socket to listen on (replaced if present)
  const char *resolver;       ///< "ip:port" of a DNS server to ask over UDP (tests), or NULL: getaddrinfo
  const dm_proxy_rule *rules; ///< address rules, in order
  size_t nrules;
  unsigned head_timeout_ms;    ///< head + verdict, default 30000
  unsigned connect_timeout_ms; ///< name lookup + dial, default 15000
  unsigned max_conns;          ///< connections at once, default DM_PROXY_MAX_CONNS
  unsigned max_fds;            ///< descriptors the connections hold, default DM_PROXY_MAX_FDS
                               ///< (raised to DM_PROXY_CONN_FDS when set below it)
  const char *ceiling_hint;    ///< appended to a refusal's text (e.g. which setting raises it), or NULL
} dm_proxy_opts;

/// A connection refused for a ceiling (valid during on_refused).
typedef struct dm_proxy_refusal {
  const char *limit;   ///< "connections" (max_conns), "descriptors" (max_fds) or "server" (the
                       ///< process-wide reserve)
  unsigned active;     ///< the listener's connections at the time
  unsigned ceiling;    ///< the ceiling crossed (connections or descriptors)
  int answered;        ///< 1: the sandbox gets a 503 naming the ceiling; 0: closed at once
  const char *message; ///< the refusal's text (what the 503 says)
} dm_proxy_refusal;

/// What became of a connection (valid during on_done).
typedef struct dm_proxy_result {
  uint64_t bytes_up;   ///< bytes from the sandbox forwarded upstream (a rewritten head included)
  uint64_t bytes_down; ///< bytes from upstream forwarded to the sandbox
  int status;          ///< status the proxy answered itself (200 CONNECT, 403, 502, 504), 0 when forwarding
  int denied;          ///< 1 when the owner denied it or the address check refused it
  int rule;            ///< index of the address rule that decided, -1 when none
  const char *address; ///< "ip:port" dialled, or "" when none (through an upstream proxy: the proxy's)
  int via;             ///< 1 when it went through an upstream proxy (dm_proxy_allow_via)
  const char *error;   ///< what went wrong, or NULL
  const char *code;    ///< short code for error ("EPOLICY", "ECONNREFUSED", "ETIMEDOUT"...), or NULL
} dm_proxy_result;

/// Callbacks; `ud` is the pointer given to dm_proxy_new().
typedef struct dm_proxy_handler {
  void (*on_request)(void *ud, dm_proxy_conn *c, const dm_proxy_request *req);
  void (*on_done)(void *ud, dm_proxy_conn *c, const dm_proxy_result *res);
  void (*on_closed)(void *ud);
  void (*on_refused)(void *ud, const dm_proxy_refusal *r); ///< optional
} dm_proxy_handler;

/// Starts listening. Returns the listener, or NULL with *err set to a libuv error number
/// (UV_ENAMETOOLONG for a socket path over 107 bytes, UV_EINVAL for a bad resolver).
dm_proxy *dm_proxy_new(uv_loop_t *loop, const dm_proxy_opts *opts, const dm_proxy_handler *handler, void *ud, int *err);

/// Stops listening, removes the socket file and aborts every connection (each gets on_done
/// later with code "ECANCELED" unless it had finished); on_closed follows. Idempotent.
void dm_proxy_close(dm_proxy *p);

/// Number of live admitted connections (refused ones being answered are not counted).
size_t dm_proxy_active(const dm_proxy *p);

/// Descriptors the listener's connections hold now (see the ceilings above).
size_t dm_proxy_fds(const dm_proxy *p);

/// Descriptors the connections of every listener of the process hold now, and the most
/// they may hold (*cap: the soft RLIMIT_NOFILE less the reserve, read at the last
/// dm_proxy_new()).
size_t dm_proxy_fds_total(size_t *cap);

/// The verdict "allow": resolve, check, dial, then answer 200 (CONNECT) or forward.
/// Ignored unless the connection is waiting for its verdict.
void dm_proxy_allow(dm_proxy_conn *c);

/// The verdict "allow", through an upstream proxy (the host's own, e.g. HTTPS_PROXY): the
/// upstream proxy's name `host` (trusted configuration: its addresses are not checked) is
/// resolved and dialled on `port`; a CONNECT is sent on as "CONNECT host:port" and the tunnel
/// spliced once the upstream proxy answers 2xx (any other answer: 502 naming it), a plain
/// request is forwarded in absolute-form. The sandbox's target is never resolved here; an IP
/// literal target is still checked against the address rules first (403 when refused).
/// `proxy_auth` (may be NULL) is the Proxy-Authorization value sent upstream (copied).
/// Ignored unless the connection is waiting for its verdict.
void dm_proxy_allow_via(dm_proxy_conn *c, const char *host, int port, const char *proxy_auth);

/// Holds a connection waiting for its verdict for `ms` more milliseconds (from now) instead
/// of what is left of head_timeout_ms: the owner is asking someone (the `ask` verdict). When
/// the time runs out the connection is denied ("no verdict in time", ETIMEDOUT). Its read
/// side stays stopped meanwhile; nothing is read from the sandbox until the verdict. Its
/// socket is peeked at every 250 ms: a client that hung up ends the connection at once
/// (ECONNRESET, "the client hung up while its connection was held for a verdict"), and
/// on_done tells the owner. Ignored unless the connection is waiting for its verdict.
void dm_proxy_hold(dm_proxy_conn *c, unsigned ms);

/// The verdict "deny": answers 403 with `reason` (copied; may be NULL) and closes.
/// Ignored unless the connection is waiting for its verdict.
void dm_proxy_deny(dm_proxy_conn *c, const char *reason);

/// An opaque pointer for the owner, NULL until set.
void dm_proxy_conn_set_data(dm_proxy_conn *c, void *data);
/// The pointer set with dm_proxy_conn_set_data.
void *dm_proxy_conn_data(const dm_proxy_conn *c);

#endif
