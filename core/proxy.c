/* The egress proxy data path: listener, request head, verdict, resolution, address check,
 * dial and splice, all on the loop. See proxy.h for the contract.
 *
 * A connection moves through these states:
 *   HEAD     reading the request head from the sandbox (timer: head_timeout_ms)
 *   VERDICT  on_request was called; waiting for dm_proxy_allow/deny (same timer)
 *   RESOLVE  looking the name up: getaddrinfo, or the test resolver (timer: connect_timeout_ms)
 *   DIAL     connecting to the next address that passed the checks (same timer)
 *   VIA      through an upstream proxy: its answer to our CONNECT is being read (same timer)
 *   SPLICE   bytes flow both ways; each direction reads only while its write side keeps up
 *   REPLY    writing the proxy's own answer (403, 502…), then closing
 *   CLOSING  handles closing; on_done runs from the last close callback
 *
 * In SPLICE the sockets are driven as raw descriptors: each direction moves bytes with
 * splice(2) through a pipe of its own (never through user space), and reads only while its
 * pipe is empty, so a slow reader stops the reading on the other side: at most one pipe per
 * direction is held, whatever the peers do. The request side of a plain HTTP request is
 * the exception: it is copied through a 64 KiB buffer, as its body is parsed so that
 * nothing after it is forwarded.
 *
 * The parsing (hosts, addresses, the request head) is in proxy_parse.c.
 */
#include "proxy.h"
#include "relay.h"
#include "dns.h"
#include <arpa/inet.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#define SPLICE_BUF 65536 /* copy-mode buffer (the request side of plain HTTP) */
#define SPLICE_PIPE \
  (256 * 1024) /* pipe size asked for the download direction; the upload
                                    direction keeps the default (pipe pages count against
                                    the user's pipe-user-pages-soft budget) */
#define MAX_ADDRS 16
#define VIA_HEAD_MAX 16384 /* the most an upstream proxy's answer to CONNECT may take */

/* ------------------------------------------------------------------------------------ */
/* Listener and connections                                                               */

enum { C_HEAD, C_VERDICT, C_RESOLVE, C_DIAL, C_VIA, C_SPLICE, C_REPLY, C_CLOSING };

/* One direction of a spliced connection, on raw descriptors. */
typedef struct dir {
  int from, to;
  int pipe[2];     /* bytes read and not yet written, moved by splice(2): never copied here */
  size_t held;     /* bytes in the pipe */
  size_t cap;      /* the pipe's capacity */
  char *buf;       /* bytes to write before the pipe's: the first ones, or all in copy mode */
  size_t off, len; /* [off, len) of buf is still to be written */
  int copy;        /* read with recv() into buf: the request side of a plain request, whose
                      body is parsed so that nothing after it is forwarded */
  int eof;         /* `from` ended (or, for a plain request, its message did) */
  int done;        /* nothing more will be written to `to` */
  uint64_t bytes;
} dir;

struct dm_proxy_conn {
  dm_proxy *p;
  dm_proxy_conn *prev, *next;
  uv_stream_t *client; /* heap: the unix connection, or the TCP socket it handed over */
  int handed;          /* the relay's first byte is dealt with (a socket taken, or a copy marker) */
  uv_tcp_t *upstream;  /* heap: one per dial attempt, freed in its close callback */
  uv_timer_t timer;
  int upstream_open;
  int open_handles;
  int state;
  int notified;
  int plain;
  dm_proxy_head head;
  dir up, down;
  int raw;                  /* SPLICE: the descriptors below carry the bytes */
  int cfd, ufd;             /* dups of the sandbox's and the upstream's sockets */
  uv_poll_t *cpoll, *upoll; /* heap; each closes its descriptor in its close callback */
  uv_getaddrinfo_t gai;
  int gai_pending;
  dm_dns_query *dnsq;
  struct sockaddr_storage addrs[MAX_ADDRS];
  size_t naddrs, next_addr;
  uv_connect_t creq;
  int status, denied, rule;
  char address[64];
  char error[512];
  const char *code;
  void *data;
  int via; /* through an upstream proxy (dm_proxy_allow_via) */
  char via_host[DM_PROXY_HOST_MAX];
  int via_port;
  char *via_auth; /* Proxy-Authorization to send, or NULL (heap) */
  char *via_buf;  /* the upstream proxy's answer to CONNECT so far (heap) */
  size_t via_len;
  size_t fds;          /* descriptors counted against the ceilings (fds_take) */
  int refused;         /* over a ceiling: answered 503 once its head is in, never judged */
  uint64_t hold_until; /* dm_proxy_hold: the loop time (ms) the hold ends, 0 when not held */
};

struct dm_proxy {
  uv_loop_t *loop;
  uv_pipe_t server;
  char *path;
  dev_t dev; /* the socket file we bound: removed at close only if it is still ours */
  ino_t ino;
  struct sockaddr_storage resolver;
  int has_resolver;
  dm_proxy_rule *rules;
  size_t nrules;
  unsigned head_timeout_ms, connect_timeout_ms;
  dm_proxy_handler cb;
  void *ud;
  dm_proxy_conn *conns; /* admitted and refused connections alike */
  size_t nconns;        /* admitted connections */
  size_t nrefusing;     /* refused connections being answered */
  size_t max_conns, max_fds, fds;
  char *hint;
  uv_pipe_t spare; /* accepts (and closes) a connection when no memory is left */
  int spare_busy;
  int closing, server_open;
};

/* Descriptors held by the connections of every listener, and the most they may hold. */
static size_t g_fds, g_fds_cap = 768;

/* The soft RLIMIT_NOFILE less a reserve (a quarter, at least 256) for the rest of the server. */
static void fds_cap_update(void) {
  struct rlimit rl;
  size_t soft = 1024;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) soft = rl.rlim_cur == RLIM_INFINITY ? (size_t)1 << 20 : (size_t)rl.rlim_cur;
  size_t reserve = soft / 4 > 256 ? soft / 4 : 256;
  g_fds_cap = soft > 2 * reserve ? soft - reserve : soft / 2;
}

/* Counts n more descriptors for c. Returns 0, or -1 with *limit naming the ceiling that
 * n more would cross ("descriptors": the listener's, "server": the process-wide one). */
static int fds_take(dm_proxy_conn *c, size_t n, const char **limit) {
  dm_proxy *p = c->p;
  if (!c->refused && p->fds + n > p->max_fds) {
    *limit = "descriptors";
    return -1;
  }
  if (g_fds + n > g_fds_cap) {
    *limit = "server";
    return -1;
  }
  if (!c->refused) p->fds += n;
  g_fds += n;
  c->fds += n;
  return 0;
}

static void fds_release(dm_proxy_conn *c) {
  if (!c->refused) c->p->fds -= c->fds;
  g_fds -= c->fds;
  c->fds = 0;
}

/* The text of a refusal for a ceiling. */
static void ceiling_text(const dm_proxy *p, const char *limit, char *out, size_t cap) {
  if (!strcmp(limit, "connections"))
    snprintf(out, cap,
             "this sandbox has %zu connections open through its egress proxy, its ceiling; close some and retry%s%s",
             p->nconns, p->hint ? " " : "", p->hint ? p->hint : "");
  else if (!strcmp(limit, "descriptors"))
    snprintf(out, cap,
             "this sandbox's egress connections hold %zu descriptors on the host, its ceiling of %zu; "
             "close some connections and retry%s%s",
             p->fds, p->max_fds, p->hint ? " " : "", p->hint ? p->hint : "");
  else
    snprintf(out, cap,
             "the host's egress proxies hold %zu descriptors, all they may (the rest is kept for the server); "
             "retry later",
             g_fds);
}

typedef struct {
  uv_write_t req;
  dm_proxy_conn *c;
  int then_close; /* close the connection once written */
  char data[];
} owned_write;

static void conn_close(dm_proxy_conn *c, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void start_splice(dm_proxy_conn *c);

static void maybe_free_proxy(dm_proxy *p) {
  if (!p->closing || p->server_open || p->conns || p->spare_busy) return;
  void *ud = p->ud;
  void (*on_closed)(void *) = p->cb.on_closed;
  free(p->rules);
  free(p->path);
  free(p->hint);
  free(p);
  if (on_closed) on_closed(ud);
}

static void conn_finalize(dm_proxy_conn *c) {
  if (c->open_handles || c->gai_pending) return;
  dm_proxy *p = c->p;
  if (c->notified && p->cb.on_done) {
    dm_proxy_result res = {
      .bytes_up = c->up.bytes,
      .bytes_down = c->down.bytes,
      .status = c->status,
      .denied = c->denied,
      .rule = c->rule,
      .address = c->address,
      .error = c->error[0] ? c->error : NULL,
      .code = c->code,
      .via = c->via,
    };
    p->cb.on_done(p->ud, c, &res);
  }
  if (c->prev) c->prev->next = c->next;
  else p->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  if (c->refused) p->nrefusing--;
  else p->nconns--;
  dm_proxy_head_free(&c->head);
  free(c->via_auth);
  free(c->via_buf);
  dir *ds[2] = {&c->up, &c->down};
  for (int i = 0; i < 2; i++) {
    free(ds[i]->buf);
    for (int k = 0; k < 2; k++)
      if (ds[i]->pipe[k] >= 0) close(ds[i]->pipe[k]);
  }
  if (c->cfd >= 0) close(c->cfd);
  if (c->ufd >= 0) close(c->ufd);
  fds_release(c);
  free(c);
  maybe_free_proxy(p);
}

static void handle_closed(uv_handle_t *h) {
  dm_proxy_conn *c = h->data;
  c->open_handles--;
  conn_finalize(c);
}

static void heap_handle_closed(uv_handle_t *h) {
  dm_proxy_conn *c = h->data;
  free(h);
  c->open_handles--;
  conn_finalize(c);
}

static void poll_closed(uv_handle_t *h) {
  dm_proxy_conn *c = h->data; /* its descriptor is closed by conn_finalize */
  free(h);
  c->open_handles--;
  conn_finalize(c);
}

static void upstream_closed(uv_handle_t *h) {
  dm_proxy_conn *c = h->data;
  free(h);
  c->open_handles--;
  conn_finalize(c);
}

static void close_upstream(dm_proxy_conn *c) {
  if (!c->upstream_open) return;
  c->upstream_open = 0;
  uv_close((uv_handle_t *)c->upstream, upstream_closed);
  c->upstream = NULL;
}

static void conn_close(dm_proxy_conn *c, const char *code, const char *fmt, ...) {
  if (c->state == C_CLOSING) return;
  c->state = C_CLOSING;
  if (code && !c->code) {
    c->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
  }
  if (c->dnsq) {
    dm_dns_cancel(c->dnsq);
    c->dnsq = NULL;
  }
  if (c->gai_pending) uv_cancel((uv_req_t *)&c->gai);
  if (c->client) uv_close((uv_handle_t *)c->client, heap_handle_closed);
  c->client = NULL;
  uv_close((uv_handle_t *)&c->timer, handle_closed);
  close_upstream(c);
  if (c->cpoll) uv_close((uv_handle_t *)c->cpoll, poll_closed);
  if (c->upoll) uv_close((uv_handle_t *)c->upoll, poll_closed);
  c->cpoll = c->upoll = NULL;
}

static const char *status_text(int status) {
  switch (status) {
  case 400: return "Bad Request";
  case 403: return "Forbidden";
  case 408: return "Request Timeout";
  case 414: return "URI Too Long";
  case 431: return "Request Header Fields Too Large";
  case 501: return "Not Implemented";
  case 505: return "HTTP Version Not Supported";
  case 502: return "Bad Gateway";
  case 503: return "Service Unavailable";
  case 504: return "Gateway Timeout";
  default: return "Error";
  }
}

static void owned_written(uv_write_t *req, int status) {
  owned_write *w = (owned_write *)req;
  dm_proxy_conn *c = w->c;
  int then_close = w->then_close;
  free(w);
  if (c->state == C_CLOSING) return;
  if (status < 0) conn_close(c, uv_err_name(status), "write: %s", uv_strerror(status));
  else if (then_close) conn_close(c, NULL, NULL);
}

/* Queues a copy of data on s. Returns 0 or a libuv error. */
static int write_copy(dm_proxy_conn *c, uv_stream_t *s, const char *data, size_t len, int then_close) {
  owned_write *w = malloc(sizeof *w + len);
  if (!w) return UV_ENOMEM;
  w->c = c;
  w->then_close = then_close;
  memcpy(w->data, data, len);
  uv_buf_t b = uv_buf_init(w->data, (unsigned)len);
  int r = uv_write(&w->req, s, &b, 1, owned_written);
  if (r) free(w);
  return r;
}

/* The proxy's own answer to the sandbox, then close. */
static void reply(dm_proxy_conn *c, int status, const char *reason) {
  if (c->state == C_CLOSING || c->state == C_REPLY) return;
  uv_timer_stop(&c->timer);
  uv_read_stop(c->client);
  c->state = C_REPLY;
  c->status = status;
  char body[512], msg[1024];
  const dm_proxy_request *r = &c->head.req;
  int bl;
  if (c->head.state == 1)
    bl = snprintf(body, sizeof body, "demesne egress: %s %s:%d: %s\n", r->method, r->host, r->port,
                  reason ? reason : status_text(status));
  else bl = snprintf(body, sizeof body, "demesne egress: %s\n", reason ? reason : status_text(status));
  if (bl < 0 || (size_t)bl >= sizeof body) bl = (int)strlen(body);
  int n = snprintf(msg, sizeof msg,
                   "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
                   "Connection: close\r\nX-Demesne-Egress: %s\r\n\r\n%s",
                   status, status_text(status), bl,
                   status == 403   ? "denied"
                   : status == 503 ? "ceiling"
                                   : "error",
                   body);
  if (n < 0 || (size_t)n >= sizeof msg) n = (int)strlen(msg);
  if (write_copy(c, c->client, msg, (size_t)n, 1) != 0) conn_close(c, NULL, NULL);
}

/* How often a held connection's client is looked at (ms): one that hung up ends its hold. */
#define HOLD_PEEK_MS 250

/* Whether the client of a connection waiting for its verdict has hung up: a peek at its
 * socket reads end of file (or an error). Bytes waiting (a request body) mean it has not. */
static int client_gone(dm_proxy_conn *c) {
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)c->client, &fd) != 0) return 0;
  char b;
  ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static void on_timeout(uv_timer_t *t) {
  dm_proxy_conn *c = t->data;
  if (c->state == C_VERDICT && c->hold_until) {
    uint64_t now = uv_now(c->p->loop);
    if (client_gone(c)) {
      conn_close(c, "ECONNRESET", "the client hung up while its connection was held for a verdict");
      return;
    }
    if (now < c->hold_until) {
      uint64_t left = c->hold_until - now;
      uv_timer_start(&c->timer, on_timeout, left < HOLD_PEEK_MS ? left : HOLD_PEEK_MS, 0);
      return;
    }
  }
  switch (c->state) {
  case C_HEAD:
    if (c->refused) reply(c, 503, c->error);
    else reply(c, 408, "no complete request head in time");
    break;
  case C_VERDICT:
    snprintf(c->error, sizeof c->error, "no verdict in time");
    c->code = "ETIMEDOUT";
    c->denied = 1;
    reply(c, 403, "no verdict in time");
    break;
  case C_RESOLVE:
  case C_DIAL:
  case C_VIA:
    snprintf(c->error, sizeof c->error, "%s timed out",
             c->state == C_RESOLVE ? "name lookup"
             : c->state == C_DIAL  ? "connect"
                                   : "the upstream proxy's answer");
    c->code = "ETIMEDOUT";
    if (c->dnsq) {
      dm_dns_cancel(c->dnsq);
      c->dnsq = NULL;
    }
    close_upstream(c); /* its connect callback then fires with UV_ECANCELED and is ignored */
    reply(c, 504, c->error);
    break;
  default: break;
  }
}

/* ---- splice ---- */

static void raw_update(dm_proxy_conn *c);

/* Moves what it can in direction d without blocking. Returns 0, or -1 after closing the
 * connection on an error. */
static int dir_pump(dm_proxy_conn *c, dir *d) {
  for (;;) {
    while (d->off < d->len) {
      ssize_t w = send(d->to, d->buf + d->off, d->len - d->off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) return 0;
        conn_close(c, uv_err_name(uv_translate_sys_error(errno)), "write: %s", strerror(errno));
        return -1;
      }
      d->off += (size_t)w;
    }
    d->off = d->len = 0;
    while (d->held > 0) {
      ssize_t w = splice(d->pipe[0], NULL, d->to, NULL, d->held, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) return 0;
        conn_close(c, uv_err_name(uv_translate_sys_error(errno)), "write: %s", strerror(errno));
        return -1;
      }
      d->held -= (size_t)w;
    }
    if (d->eof) {
      if (!d->done) {
        /* never half-close the upstream of a plain request: servers take it as an abort */
        if (!(c->plain && d == &c->up)) shutdown(d->to, SHUT_WR);
        d->done = 1;
      }
      return 0;
    }
    ssize_t r;
    if (d->copy) {
      r = recv(d->from, d->buf, SPLICE_BUF, MSG_DONTWAIT);
    } else {
      r = splice(d->from, NULL, d->pipe[1], NULL, d->cap, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return 0;
      conn_close(c, uv_err_name(uv_translate_sys_error(errno)), "read: %s", strerror(errno));
      return -1;
    }
    if (r == 0) {
      d->eof = 1;
      continue;
    }
    if (!d->copy) {
      d->held = (size_t)r;
      d->bytes += (uint64_t)r;
      continue;
    }
    size_t fwd = (size_t)r;
    int end = 0;
    if (c->plain && d == &c->up) {
      int e = dm_proxy_head_body(&c->head, d->buf, (size_t)r, &fwd);
      if (e < 0) {
        conn_close(c, "EPROTO", "malformed request body");
        return -1;
      }
      end = e == 1;
    }
    d->len = fwd;
    d->bytes += fwd;
    if (end) d->eof = 1;
  }
}

/* What each descriptor waits for: reading while its direction holds nothing, writing while
 * the other direction has bytes for it. */
static int wants(const dir *in, const dir *out) {
  int ev = 0;
  if (!in->eof && in->held == 0 && in->off >= in->len) ev |= UV_READABLE;
  if (out->held > 0 || out->off < out->len) ev |= UV_WRITABLE;
  return ev;
}

static void on_poll(uv_poll_t *h, int status, int events) {
  dm_proxy_conn *c = h->data;
  if (c->state != C_SPLICE) return;
  if (dir_pump(c, &c->up) < 0 || dir_pump(c, &c->down) < 0) return;
  raw_update(c);
}

static void raw_update(dm_proxy_conn *c) {
  if (c->up.done && c->down.done) {
    conn_close(c, NULL, NULL);
    return;
  }
  int ce = wants(&c->up, &c->down), ue = wants(&c->down, &c->up);
  if (ce) uv_poll_start(c->cpoll, ce, on_poll);
  else uv_poll_stop(c->cpoll);
  if (ue) uv_poll_start(c->upoll, ue, on_poll);
  else uv_poll_stop(c->upoll);
}

static int dir_init(dir *d, int from, int to, int copy, int pipe_size) {
  d->from = from;
  d->to = to;
  d->copy = copy;
  d->buf = malloc(copy ? SPLICE_BUF : 1024);
  if (!d->buf) return -1;
  if (copy) return 0;
  if (pipe2(d->pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
    d->pipe[0] = d->pipe[1] = -1;
    return -1;
  }
  if (pipe_size) fcntl(d->pipe[1], F_SETPIPE_SZ, pipe_size); /* refused: the default is fine too */
  int sz = fcntl(d->pipe[1], F_GETPIPE_SZ);
  d->cap = sz > 0 ? (size_t)sz : 65536;
  return 0;
}

/* Queues `n` bytes to be written by direction d before anything it reads. */
static int dir_preload(dir *d, const char *data, size_t n) {
  if (!n) return 0;
  char *b = realloc(d->buf, d->len + n > SPLICE_BUF ? d->len + n : SPLICE_BUF);
  if (!b) return -1;
  d->buf = b;
  memcpy(d->buf + d->len, data, n);
  d->len += n;
  return 0;
}

/* Connected: from here on both sockets are driven as raw descriptors (dups, so that the
 * libuv stream handles can close), the bytes moving with splice(2). */
static void start_splice(dm_proxy_conn *c) {
  c->state = C_SPLICE;
  uv_timer_stop(&c->timer);
  uv_os_fd_t cfd = -1, ufd = -1;
  uv_fileno((uv_handle_t *)c->client, &cfd);
  uv_fileno((uv_handle_t *)c->upstream, &ufd);
  c->cfd = cfd >= 0 ? fcntl(cfd, F_DUPFD_CLOEXEC, 3) : -1;
  c->ufd = ufd >= 0 ? fcntl(ufd, F_DUPFD_CLOEXEC, 3) : -1;
  uv_read_stop(c->client);
  uv_close((uv_handle_t *)c->client, heap_handle_closed);
  c->client = NULL;
  close_upstream(c);
  c->raw = 1;
  dm_proxy_head *h = &c->head;
  const char *rest = h->buf + h->head_len;
  size_t rest_len = h->len - h->head_len;
  int bad = c->cfd < 0 || c->ufd < 0;
  c->cpoll = malloc(sizeof *c->cpoll);
  c->upoll = malloc(sizeof *c->upoll);
  if (bad || !c->cpoll || !c->upoll) {
    free(c->cpoll);
    free(c->upoll);
    c->cpoll = c->upoll = NULL;
    conn_close(c, "ENOMEM", "cannot set up the splice");
    return;
  }
  uv_poll_init(c->p->loop, c->cpoll, c->cfd);
  uv_poll_init(c->p->loop, c->upoll, c->ufd);
  c->cpoll->data = c->upoll->data = c;
  c->open_handles += 2;
  bad = dir_init(&c->up, c->cfd, c->ufd, c->plain, 0) < 0 || dir_init(&c->down, c->ufd, c->cfd, 0, SPLICE_PIPE) < 0;
  if (!bad && !c->plain) {
    static const char ok[] = "HTTP/1.1 200 Connection established\r\n\r\n";
    c->status = 200;
    bad = dir_preload(&c->down, ok, sizeof ok - 1) < 0 || dir_preload(&c->up, rest, rest_len) < 0;
    c->up.bytes += rest_len;
    /* what the upstream proxy sent after its answer is the tunnel's first bytes */
    if (!bad && c->via && c->via_len) {
      const char *end = memmem(c->via_buf, c->via_len, "\r\n\r\n", 4);
      size_t after = end ? c->via_len - (size_t)(end + 4 - c->via_buf) : 0;
      bad = dir_preload(&c->down, end ? end + 4 : "", after) < 0;
      c->down.bytes += after;
    }
  } else if (!bad) {
    char *out = malloc(DM_PROXY_HEAD_MAX + 1024);
    size_t cap = DM_PROXY_HEAD_MAX + 1024;
    size_t n = !out     ? 0
               : c->via ? dm_proxy_head_rewrite_proxy(h, out, cap, c->via_auth)
                        : dm_proxy_head_rewrite(h, out, cap);
    bad = !n || dir_preload(&c->up, out, n) < 0;
    free(out);
    c->up.bytes += n;
    size_t fwd = 0;
    int end = dm_proxy_head_body(h, rest, rest_len, &fwd);
    if (end < 0) {
      conn_close(c, "EPROTO", "malformed request body");
      return;
    }
    if (!bad) bad = dir_preload(&c->up, rest, fwd) < 0;
    c->up.bytes += fwd;
    if (end == 1) c->up.eof = 1;
  }
  if (bad) {
    conn_close(c, "ENOMEM", "cannot set up the splice");
    return;
  }
  if (dir_pump(c, &c->up) < 0 || dir_pump(c, &c->down) < 0) return;
  raw_update(c);
}

/* ---- resolve and dial ---- */

static void dial_next(dm_proxy_conn *c);

/* ---- through an upstream proxy ---- */

static void via_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  dm_proxy_conn *c = h->data;
  (void)suggested;
  if (!c->via_buf) c->via_buf = malloc(VIA_HEAD_MAX);
  size_t room = c->via_buf ? VIA_HEAD_MAX - c->via_len : 0;
  *buf = uv_buf_init(room ? c->via_buf + c->via_len : NULL, (unsigned)room);
}

/* The upstream proxy's answer to our CONNECT: 2xx starts the tunnel, anything else is a 502
 * that quotes its status line. */
static void via_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  dm_proxy_conn *c = s->data;
  (void)buf;
  if (c->state != C_VIA) return;
  if (n == 0) return;
  if (n < 0 || !c->via_buf) {
    snprintf(c->error, sizeof c->error, "the upstream proxy %s:%d closed before answering CONNECT", c->via_host,
             c->via_port);
    c->code = "EPROTO";
    close_upstream(c);
    reply(c, 502, c->error);
    return;
  }
  c->via_len += (size_t)n;
  const char *end = memmem(c->via_buf, c->via_len, "\r\n\r\n", 4);
  if (!end) {
    if (c->via_len < VIA_HEAD_MAX) return;
    snprintf(c->error, sizeof c->error, "the upstream proxy %s:%d sent an answer head over %d bytes", c->via_host,
             c->via_port, VIA_HEAD_MAX);
    c->code = "EPROTO";
    close_upstream(c);
    reply(c, 502, c->error);
    return;
  }
  int status = 0;
  if (c->via_len >= 12 && memcmp(c->via_buf, "HTTP/1.", 7) == 0 && c->via_buf[8] == ' ')
    for (int i = 9; i < 12 && c->via_buf[i] >= '0' && c->via_buf[i] <= '9'; i++)
      status = status * 10 + c->via_buf[i] - '0';
  if (status < 200 || status > 299) {
    const char *eol = memchr(c->via_buf, '\r', (size_t)(end - c->via_buf) + 1);
    int line = (int)((eol ? eol : end) - c->via_buf);
    if (line > 120) line = 120;
    char shown[128];
    int k = 0;
    for (int i = 0; i < line; i++) shown[k++] = c->via_buf[i] >= 0x20 && c->via_buf[i] < 0x7f ? c->via_buf[i] : '?';
    shown[k] = 0;
    snprintf(c->error, sizeof c->error, "the upstream proxy %s:%d answered CONNECT with \"%s\"", c->via_host,
             c->via_port, shown);
    c->code = status == 407 ? "EACCES" : "EPROTO";
    close_upstream(c);
    reply(c, 502, c->error);
    return;
  }
  uv_read_stop(s);
  start_splice(c);
}

/* Connected to the upstream proxy: asks it for a tunnel to the sandbox's target. */
static void via_handshake(dm_proxy_conn *c) {
  const dm_proxy_request *r = &c->head.req;
  char msg[DM_PROXY_HOST_MAX * 2 + 1024];
  const char *lb = r->ip == 6 ? "[" : "", *rb = r->ip == 6 ? "]" : "";
  int n = snprintf(msg, sizeof msg, "CONNECT %s%s%s:%d HTTP/1.1\r\nHost: %s%s%s:%d\r\n%s%s%s\r\n", lb, r->host, rb,
                   r->port, lb, r->host, rb, r->port, c->via_auth ? "Proxy-Authorization: " : "",
                   c->via_auth ? c->via_auth : "", c->via_auth ? "\r\n" : "");
  c->state = C_VIA;
  if (n < 0 || (size_t)n >= sizeof msg || write_copy(c, (uv_stream_t *)c->upstream, msg, (size_t)n, 0) != 0 ||
      uv_read_start((uv_stream_t *)c->upstream, via_alloc, via_read) != 0) {
    snprintf(c->error, sizeof c->error, "cannot ask the upstream proxy %s:%d for a tunnel", c->via_host, c->via_port);
    c->code = "EPROTO";
    close_upstream(c);
    reply(c, 502, c->error);
  }
}

static void on_connect(uv_connect_t *req, int status) {
  dm_proxy_conn *c = req->data;
  if (c->state != C_DIAL) return; /* closing, or timed out and replying */
  if (status == 0) {
    /* the tunnel holds two descriptors more than the dial (dups of both sockets replace
     * them, plus the pipes: two per direction for CONNECT, the download's for plain) */
    const char *limit;
    if (fds_take(c, c->plain ? 1 : 3, &limit) < 0) {
      char why[400];
      ceiling_text(c->p, limit, why, sizeof why);
      snprintf(c->error, sizeof c->error, "%s", why);
      c->code = "ELIMIT";
      close_upstream(c);
      reply(c, 503, c->error);
      return;
    }
    uv_tcp_nodelay(c->upstream, 1);
    if (c->via && !c->plain) via_handshake(c);
    else start_splice(c);
    return;
  }
  snprintf(c->error, sizeof c->error, "connect %s: %s", c->address, uv_strerror(status));
  c->code = uv_err_name(status);
  /* a failed attempt leaves the handle unusable: close it and try the next address */
  close_upstream(c);
  dial_next(c);
}

static void format_addr(const struct sockaddr *sa, char *out, size_t cap) {
  char ip[INET6_ADDRSTRLEN] = "?";
  int port;
  if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const void *)sa;
    inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    port = ntohs(a->sin6_port);
    snprintf(out, cap, "[%s]:%d", ip, port);
  } else {
    const struct sockaddr_in *a = (const void *)sa;
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    port = ntohs(a->sin_port);
    snprintf(out, cap, "%s:%d", ip, port);
  }
}

static void dial_next(dm_proxy_conn *c) {
  if (c->next_addr >= c->naddrs) {
    if (!c->code) c->code = "ECONNREFUSED";
    reply(c, 502, c->error[0] ? c->error : "cannot connect");
    return;
  }
  const struct sockaddr *sa = (const struct sockaddr *)&c->addrs[c->next_addr++];
  format_addr(sa, c->address, sizeof c->address);
  c->upstream = malloc(sizeof *c->upstream);
  if (!c->upstream) {
    conn_close(c, "ENOMEM", "out of memory");
    return;
  }
  uv_tcp_init(c->p->loop, c->upstream);
  c->upstream->data = c;
  c->upstream_open = 1;
  c->open_handles++;
  c->creq.data = c;
  int r = uv_tcp_connect(&c->creq, c->upstream, sa, on_connect);
  if (r) {
    snprintf(c->error, sizeof c->error, "connect %s: %s", c->address, uv_strerror(r));
    c->code = uv_err_name(r);
    close_upstream(c);
    dial_next(c);
  }
}

/* Keeps the addresses that pass the checks, in order, then dials. */
static void resolved(dm_proxy_conn *c, const struct sockaddr *const *list, size_t n) {
  const char *why = NULL, *first_why = NULL;
  char first[64] = "";
  int rule = -1;
  c->naddrs = 0;
  for (size_t i = 0; i < n && c->naddrs < MAX_ADDRS; i++) {
    struct sockaddr_storage a;
    memcpy(&a, list[i], list[i]->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
    if (a.ss_family == AF_INET) ((struct sockaddr_in *)&a)->sin_port = htons((uint16_t)c->head.req.port);
    else ((struct sockaddr_in6 *)&a)->sin6_port = htons((uint16_t)c->head.req.port);
    int ok = dm_proxy_check_address((struct sockaddr *)&a, c->head.req.port, c->p->rules, c->p->nrules, &why, &rule);
    if (ok) {
      if (c->naddrs == 0) c->rule = rule;
      c->addrs[c->naddrs++] = a;
    } else if (!first_why) {
      first_why = strcmp(why, "rule") == 0 ? "denied by an address rule" : why;
      format_addr((struct sockaddr *)&a, first, sizeof first);
      if (c->rule < 0) c->rule = rule;
    }
  }
  if (c->naddrs == 0) {
    c->denied = 1;
    c->code = "EPOLICY";
    snprintf(c->error, sizeof c->error, "address %s is %s", first[0] ? first : "?", first_why ? first_why : "refused");
    snprintf(c->address, sizeof c->address, "%s", first);
    reply(c, 403, c->error);
    return;
  }
  c->state = C_DIAL;
  dial_next(c);
}

/* The upstream proxy's addresses (configuration, not the sandbox's: not checked), then dials. */
static void resolved_via(dm_proxy_conn *c, const struct sockaddr *const *list, size_t n) {
  c->naddrs = 0;
  for (size_t i = 0; i < n && c->naddrs < MAX_ADDRS; i++) {
    struct sockaddr_storage a;
    memcpy(&a, list[i], list[i]->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
    if (a.ss_family == AF_INET) ((struct sockaddr_in *)&a)->sin_port = htons((uint16_t)c->via_port);
    else ((struct sockaddr_in6 *)&a)->sin6_port = htons((uint16_t)c->via_port);
    c->addrs[c->naddrs++] = a;
  }
  if (c->naddrs == 0) {
    snprintf(c->error, sizeof c->error, "the upstream proxy %s has no address", c->via_host);
    c->code = "ENOTFOUND";
    reply(c, 502, c->error);
    return;
  }
  c->state = C_DIAL;
  dial_next(c);
}

static void on_gai(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
  dm_proxy_conn *c = req->data;
  c->gai_pending = 0;
  if (c->state != C_RESOLVE) {
    if (res) uv_freeaddrinfo(res);
    conn_finalize(c); /* closing: this callback may have been the last thing it waited for */
    return;
  }
  if (status < 0) {
    snprintf(c->error, sizeof c->error, "cannot resolve %s%s: %s", c->via ? "the upstream proxy " : "",
             c->via ? c->via_host : c->head.req.host, uv_strerror(status));
    c->code = status == UV_EAI_NONAME ? "ENOTFOUND" : uv_err_name(status);
    reply(c, 502, c->error);
    return;
  }
  const struct sockaddr *list[MAX_ADDRS];
  size_t n = 0;
  for (struct addrinfo *ai = res; ai && n < MAX_ADDRS; ai = ai->ai_next)
    if (ai->ai_family == AF_INET || ai->ai_family == AF_INET6) list[n++] = ai->ai_addr;
  if (c->via) resolved_via(c, list, n);
  else resolved(c, list, n);
  uv_freeaddrinfo(res);
}

static void on_dns(void *ud, int status, const struct sockaddr_in *addrs, size_t n) {
  dm_proxy_conn *c = ud;
  c->dnsq = NULL;
  if (c->state != C_RESOLVE) return;
  if (status < 0) {
    snprintf(c->error, sizeof c->error, "cannot resolve %s: %s", c->head.req.host, uv_strerror(status));
    c->code = status == UV_ENOENT ? "ENOTFOUND" : uv_err_name(status);
    reply(c, 502, c->error);
    return;
  }
  const struct sockaddr *list[DM_DNS_MAX_ADDRS];
  for (size_t i = 0; i < n; i++) list[i] = (const struct sockaddr *)&addrs[i];
  resolved(c, list, n);
}

void dm_proxy_allow(dm_proxy_conn *c) {
  if (!c || c->state != C_VERDICT) return;
  dm_proxy *p = c->p;
  const dm_proxy_request *r = &c->head.req;
  const char *limit;
  if (fds_take(c, 1, &limit) < 0) { /* the upstream socket */
    ceiling_text(p, limit, c->error, sizeof c->error);
    c->code = "ELIMIT";
    reply(c, 503, c->error);
    return;
  }
  c->plain = r->form != DM_FORM_CONNECT;
  c->state = C_RESOLVE;
  uv_timer_start(&c->timer, on_timeout, p->connect_timeout_ms, 0);
  if (r->ip) {
    struct sockaddr_storage a;
    memset(&a, 0, sizeof a);
    if (r->ip == 4) {
      a.ss_family = AF_INET;
      inet_pton(AF_INET, r->host, &((struct sockaddr_in *)&a)->sin_addr);
    } else {
      a.ss_family = AF_INET6;
      inet_pton(AF_INET6, r->host, &((struct sockaddr_in6 *)&a)->sin6_addr);
    }
    const struct sockaddr *list[1] = {(const struct sockaddr *)&a};
    resolved(c, list, 1);
    return;
  }
  int err = 0;
  if (p->has_resolver) {
    c->dnsq =
      dm_dns_resolve(p->loop, (struct sockaddr *)&p->resolver, r->host, p->connect_timeout_ms / 2, on_dns, c, &err);
  } else {
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    c->gai.data = c;
    err = uv_getaddrinfo(p->loop, &c->gai, on_gai, r->host, NULL, &hints);
    if (!err) c->gai_pending = 1;
  }
  if (err) {
    snprintf(c->error, sizeof c->error, "cannot resolve %s: %s", r->host, uv_strerror(err));
    c->code = uv_err_name(err);
    reply(c, 502, c->error);
  }
}

void dm_proxy_allow_via(dm_proxy_conn *c, const char *host, int port, const char *proxy_auth) {
  if (!c || c->state != C_VERDICT) return;
  dm_proxy *p = c->p;
  const dm_proxy_request *r = &c->head.req;
  const char *limit;
  if (!host || !*host || strlen(host) >= sizeof c->via_host || port < 1 || port > 65535) {
    dm_proxy_deny(c, "the upstream proxy setting is not a host and port");
    return;
  }
  if (r->ip) { /* a literal is judged here as without the upstream proxy */
    struct sockaddr_storage a;
    memset(&a, 0, sizeof a);
    const char *why;
    int rule = -1, ok;
    if (r->ip == 4) {
      a.ss_family = AF_INET;
      inet_pton(AF_INET, r->host, &((struct sockaddr_in *)&a)->sin_addr);
    } else {
      a.ss_family = AF_INET6;
      inet_pton(AF_INET6, r->host, &((struct sockaddr_in6 *)&a)->sin6_addr);
    }
    ok = dm_proxy_check_address((struct sockaddr *)&a, r->port, p->rules, p->nrules, &why, &rule);
    if (!ok) {
      c->rule = rule;
      c->denied = 1;
      c->code = "EPOLICY";
      snprintf(c->error, sizeof c->error, "address %s is %s", r->host,
               strcmp(why, "rule") == 0 ? "denied by an address rule" : why);
      reply(c, 403, c->error);
      return;
    }
    c->rule = rule;
  }
  if (fds_take(c, 1, &limit) < 0) { /* the upstream socket */
    ceiling_text(p, limit, c->error, sizeof c->error);
    c->code = "ELIMIT";
    reply(c, 503, c->error);
    return;
  }
  c->via = 1;
  snprintf(c->via_host, sizeof c->via_host, "%s", host);
  c->via_port = port;
  if (proxy_auth && *proxy_auth && !(c->via_auth = strdup(proxy_auth))) {
    conn_close(c, "ENOMEM", "out of memory");
    return;
  }
  c->plain = r->form != DM_FORM_CONNECT;
  c->state = C_RESOLVE;
  uv_timer_start(&c->timer, on_timeout, p->connect_timeout_ms, 0);
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  c->gai.data = c;
  int err = uv_getaddrinfo(p->loop, &c->gai, on_gai, c->via_host, NULL, &hints);
  if (err) {
    snprintf(c->error, sizeof c->error, "cannot resolve the upstream proxy %s: %s", c->via_host, uv_strerror(err));
    c->code = uv_err_name(err);
    reply(c, 502, c->error);
    return;
  }
  c->gai_pending = 1;
}

void dm_proxy_hold(dm_proxy_conn *c, unsigned ms) {
  if (!c || c->state != C_VERDICT) return;
  c->hold_until = uv_now(c->p->loop) + ms;
  uv_timer_start(&c->timer, on_timeout, ms < HOLD_PEEK_MS ? ms : HOLD_PEEK_MS, 0);
}

void dm_proxy_deny(dm_proxy_conn *c, const char *reason) {
  if (!c || c->state != C_VERDICT) return;
  c->denied = 1;
  c->code = "EPOLICY";
  snprintf(c->error, sizeof c->error, "%s", reason && *reason ? reason : "denied by policy");
  reply(c, 403, c->error);
}

void dm_proxy_conn_set_data(dm_proxy_conn *c, void *data) { c->data = data; }
void *dm_proxy_conn_data(const dm_proxy_conn *c) { return c->data; }

/* ---- the head ---- */

static void head_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  dm_proxy_conn *c = h->data;
  size_t cap;
  char *p = dm_proxy_head_space(&c->head, &cap);
  *buf = uv_buf_init(p, (unsigned)cap);
}

static void head_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf);

/* The relay in the sandbox hands over the accepted TCP socket and hangs up: from then on
 * the proxy talks to the sandbox's socket itself, and no byte is copied by the relay
 * (core/relay.c reads the hand-over). Where sockets cannot be passed (gVisor) the relay
 * sends the byte '\0' and then copies the client's bytes over this connection. A
 * connection that starts with anything else is the client itself. Returns 1 when a socket
 * was taken (the byte that carried it is no part of any request), 0 when the connection's
 * bytes are the client's (*marker: the first is the copy marker), -1 to hang up. */
static int take_handover(dm_proxy_conn *c, ssize_t n, const char *first, int *marker) {
  uv_pipe_t *pipe = (uv_pipe_t *)c->client;
  dm_relay_kind kind = dm_relay_classify(pipe, n, first);
  *marker = kind == DM_RELAY_COPY;
  if (kind == DM_RELAY_COPY || kind == DM_RELAY_DIRECT) return 0;
  if (kind != DM_RELAY_SOCKET) return -1;
  uv_tcp_t *tcp = malloc(sizeof *tcp);
  if (!tcp) return -1;
  uv_tcp_init(c->p->loop, tcp);
  tcp->data = c;
  c->open_handles++;
  if (dm_relay_take(pipe, kind, (uv_stream_t *)tcp) != 0) {
    uv_close((uv_handle_t *)tcp, heap_handle_closed);
    return -1;
  }
  /* the unix connection has done its job; it also drops any other descriptor sent along */
  uv_close((uv_handle_t *)pipe, heap_handle_closed);
  c->client = (uv_stream_t *)tcp;
  c->handed = 1;
  return uv_read_start(c->client, head_alloc, head_read) == 0 ? 1 : -1;
}

static void head_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  dm_proxy_conn *c = s->data;
  if (c->state != C_HEAD || s != c->client) return;
  if (n == 0) return;
  if (n < 0) {
    conn_close(c, NULL, NULL); /* gone before asking anything: nothing to report */
    return;
  }
  if (!c->handed && c->head.len == 0) {
    int marker = 0, t = take_handover(c, n, buf->base, &marker);
    if (t < 0) {
      conn_close(c, NULL, NULL);
      return;
    }
    if (t > 0) return; /* the byte that carried the socket is not part of any request */
    if (marker) {
      /* the relay copies the client's bytes over this connection: drop its marker byte */
      c->handed = 1;
      memmove(buf->base, buf->base + 1, (size_t)n - 1);
      if (--n == 0) return;
    }
  }
  if (!c->handed && uv_pipe_pending_count((uv_pipe_t *)c->client) > 0) {
    /* descriptors sent after the first read would pile up in libuv's queue, each one held
     * by this process: a client that sends them is cut off */
    conn_close(c, NULL, NULL);
    return;
  }
  int r = dm_proxy_head_advance(&c->head, (size_t)n);
  if (r == 0) return;
  if (c->refused) {
    reply(c, 503, c->error);
    return;
  }
  if (r < 0) {
    reply(c, c->head.status, c->head.why);
    return;
  }
  uv_read_stop(s);
  c->state = C_VERDICT;
  c->notified = 1;
  dm_proxy *p = c->p;
  if (p->cb.on_request) p->cb.on_request(p->ud, c, &c->head.req);
  else dm_proxy_deny(c, "no policy");
}

static void spare_closed(uv_handle_t *h) {
  dm_proxy *p = h->data;
  p->spare_busy = 0;
  maybe_free_proxy(p);
}

static void free_closed(uv_handle_t *h) { free(h); }

/* Takes the connection libuv has accepted and closes it: libuv stops accepting until
 * uv_accept() is called, so every path of on_connection must take the connection. */
static void drop_connection(dm_proxy *p, uv_pipe_t *pipe) {
  if (!pipe && !p->spare_busy) {
    pipe = &p->spare;
    p->spare_busy = 1;
  }
  if (!pipe) return; /* out of memory twice in one loop turn: nothing left to accept with */
  uv_pipe_init(p->loop, pipe, 0);
  pipe->data = p;
  uv_accept((uv_stream_t *)&p->server, (uv_stream_t *)pipe);
  uv_close((uv_handle_t *)pipe, pipe == &p->spare ? spare_closed : free_closed);
}

static void on_connection(uv_stream_t *server, int status) {
  dm_proxy *p = server->data;
  /* EMFILE/ENFILE: libuv has already accepted and closed what was pending (its reserve
   * descriptor) and keeps listening */
  if (status < 0) return;
  uv_pipe_t *pipe = malloc(sizeof *pipe);
  if (p->closing) {
    drop_connection(p, pipe);
    return;
  }
  const char *limit = NULL;
  if (p->nconns >= p->max_conns) limit = "connections";
  else if (p->fds + 2 > p->max_fds) limit = "descriptors";
  else if (g_fds + 2 > g_fds_cap) limit = "server";
  int refused = limit != NULL;
  char why[400] = "";
  if (refused) ceiling_text(p, limit, why, sizeof why);
  int answer = !refused || (p->nrefusing < DM_PROXY_REFUSING_MAX && g_fds + 2 <= g_fds_cap);
  dm_proxy_conn *c = answer && pipe ? calloc(1, sizeof *c) : NULL;
  if (c && dm_proxy_head_init(&c->head) != 0) {
    free(c);
    c = NULL;
  }
  if (refused && p->cb.on_refused) {
    dm_proxy_refusal r = {.limit = limit,
                          .active = (unsigned)p->nconns,
                          .ceiling = (unsigned)(!strcmp(limit, "connections")   ? p->max_conns
                                                : !strcmp(limit, "descriptors") ? p->max_fds
                                                                                : g_fds_cap),
                          .answered = c != NULL,
                          .message = why};
    p->cb.on_refused(p->ud, &r);
  }
  if (c && p->closing) { /* the owner closed the listener from on_refused */
    dm_proxy_head_free(&c->head);
    free(c);
    c = NULL;
  }
  if (!c) {
    drop_connection(p, pipe);
    return;
  }
  c->p = p;
  c->rule = -1;
  c->cfd = c->ufd = -1;
  c->refused = refused;
  c->up.pipe[0] = c->up.pipe[1] = c->down.pipe[0] = c->down.pipe[1] = -1;
  if (refused) snprintf(c->error, sizeof c->error, "%s", why);
  uv_pipe_init(p->loop, pipe, 1); /* ipc: the relay passes sockets over it */
  c->client = (uv_stream_t *)pipe;
  uv_timer_init(p->loop, &c->timer);
  c->client->data = c->timer.data = c;
  c->open_handles = 2;
  c->next = p->conns;
  if (p->conns) p->conns->prev = c;
  p->conns = c;
  if (refused) p->nrefusing++;
  else p->nconns++;
  fds_take(c, 2, &limit); /* the unix connection and the socket it hands over; room checked above */
  if (uv_accept(server, c->client) != 0) {
    conn_close(c, NULL, NULL);
    return;
  }
  uv_timer_start(&c->timer, on_timeout, refused ? DM_PROXY_REFUSE_MS : p->head_timeout_ms, 0);
  uv_read_start(c->client, head_alloc, head_read);
}

static int parse_resolver(const char *s, struct sockaddr_storage *out) {
  char host[64];
  const char *colon = strrchr(s, ':');
  if (!colon) return -1;
  int port = atoi(colon + 1);
  size_t hl = (size_t)(colon - s);
  if (hl >= sizeof host || port <= 0 || port > 65535) return -1;
  memcpy(host, s, hl);
  host[hl] = '\0';
  if (host[0] == '[' && hl > 2 && host[hl - 1] == ']') {
    host[hl - 1] = '\0';
    return uv_ip6_addr(host + 1, port, (struct sockaddr_in6 *)out) ? -1 : 0;
  }
  return uv_ip4_addr(host, port, (struct sockaddr_in *)out) ? -1 : 0;
}

static void server_closed(uv_handle_t *h) {
  dm_proxy *p = h->data;
  p->server_open = 0;
  maybe_free_proxy(p);
}

dm_proxy *dm_proxy_new(uv_loop_t *loop, const dm_proxy_opts *opts, const dm_proxy_handler *handler, void *ud,
                       int *err) {
  if (!opts->path || strlen(opts->path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
    *err = UV_ENAMETOOLONG;
    return NULL;
  }
  dm_proxy *p = calloc(1, sizeof *p);
  if (!p) {
    *err = UV_ENOMEM;
    return NULL;
  }
  p->loop = loop;
  p->cb = *handler;
  p->ud = ud;
  p->head_timeout_ms = opts->head_timeout_ms ? opts->head_timeout_ms : 30000;
  p->connect_timeout_ms = opts->connect_timeout_ms ? opts->connect_timeout_ms : 15000;
  p->max_conns = opts->max_conns ? opts->max_conns : DM_PROXY_MAX_CONNS;
  p->max_fds = opts->max_fds ? opts->max_fds : DM_PROXY_MAX_FDS;
  if (p->max_fds < DM_PROXY_CONN_FDS) p->max_fds = DM_PROXY_CONN_FDS;
  fds_cap_update();
  if (opts->resolver && *opts->resolver) {
    if (parse_resolver(opts->resolver, &p->resolver) < 0) {
      free(p);
      *err = UV_EINVAL;
      return NULL;
    }
    p->has_resolver = 1;
  }
  p->path = strdup(opts->path);
  if (opts->ceiling_hint && *opts->ceiling_hint) p->hint = strdup(opts->ceiling_hint);
  if (opts->nrules) {
    p->rules = malloc(opts->nrules * sizeof *p->rules);
    if (p->rules) memcpy(p->rules, opts->rules, opts->nrules * sizeof *p->rules);
    p->nrules = opts->nrules;
  }
  if (!p->path || (opts->nrules && !p->rules)) {
    free(p->path);
    free(p->hint);
    free(p->rules);
    free(p);
    *err = UV_ENOMEM;
    return NULL;
  }
  unlink(p->path);
  uv_pipe_init(loop, &p->server, 0);
  p->server.data = p;
  p->server_open = 1;
  int r = uv_pipe_bind(&p->server, p->path);
  if (!r) r = uv_listen((uv_stream_t *)&p->server, 256, on_connection);
  struct stat st; /* lstat: the socket's folder is the sandbox's to write, never follow a link */
  if (!r && lstat(p->path, &st) == 0) {
    p->dev = st.st_dev;
    p->ino = st.st_ino;
  }
  if (r) {
    p->closing = 1;
    p->cb.on_closed = NULL; /* a failed start reports only through *err */
    uv_close((uv_handle_t *)&p->server, server_closed);
    *err = r;
    return NULL;
  }
  return p;
}

void dm_proxy_close(dm_proxy *p) {
  if (!p || p->closing) return;
  p->closing = 1;
  struct stat st; /* another server may have taken the path over since: leave its socket */
  if (lstat(p->path, &st) == 0 && st.st_dev == p->dev && st.st_ino == p->ino) unlink(p->path);
  uv_close((uv_handle_t *)&p->server, server_closed);
  for (dm_proxy_conn *c = p->conns; c; c = c->next)
    if (c->state != C_CLOSING) conn_close(c, "ECANCELED", "the sandbox's proxy was closed");
}

size_t dm_proxy_active(const dm_proxy *p) { return p->nconns; }

size_t dm_proxy_fds(const dm_proxy *p) { return p->fds; }

size_t dm_proxy_fds_total(size_t *cap) {
  if (cap) *cap = g_fds_cap;
  return g_fds;
}
