/* The HTTP/1.1 server: listeners, connections, llhttp parsing, per-listener checks,
 * whole and streamed answers. See httpd.h for the contract.
 *
 * A connection moves through these states:
 *   READ    parsing a request (timer: idle until the first byte, then request_timeout_ms)
 *   BUSY    the request went to the owner; bytes that arrive are held, unparsed
 *   STREAM  a streamed answer is open
 *   CLOSING handles closing; on_close runs from the last close callback
 * After an answer ends the connection goes back to READ (keep-alive), parsing what it
 * held from a zero timer, so an owner call never re-enters the owner; or it closes once
 * its writes are flushed.
 */
#include "httpd.h"
#include "relay.h"
#include <llhttp.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define READ_CHUNK 65536

enum { S_READ, S_BUSY, S_STREAM, S_CLOSING };

typedef struct listener {
  dm_httpd *s;
  struct listener *next;
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  int is_unix, open;
  int removed;                        /* dm_httpd_unlisten: freed once its handle, connections and relays are gone */
  size_t nconns;                      /* connections of this listener now (handed relays included) */
  dm_relay *relay;                    /* a relay listener's connections waiting for their hand-over */
  int relay_closing;                  /* dm_relay_close called: relay is freed from the loop */
  size_t max_conns;                   /* 0: no cap of its own */
  size_t ncapped;                     /* its connections counted against the caps (all, or the authenticated ones) */
  size_t max_preauth;                 /* 0: no pre-authentication queue (counted at accept) */
  size_t npreauth;                    /* connections in the queue below */
  dm_httpd_conn *pre_head, *pre_tail; /* not yet past the checks, oldest first */
  char *path;
  dev_t dev;
  ino_t ino;
  char *tag;
  char *token;
  char **hosts;
  size_t nhosts;
} listener;

typedef struct span {
  size_t off, len;
} span;

struct dm_httpd_conn {
  dm_httpd *s;
  listener *l;
  dm_httpd_conn *prev, *next;
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  uv_timer_t timer;
  int open_handles;
  int state;
  int handed;     /* reached on_head or on_request: on_close is owed */
  int capped;     /* counted against the connection caps (l->ncapped, s->nshared) */
  int preauth;    /* in its listener's pre-authentication queue */
  int head_timed; /* head_timeout_ms runs: its first head has not passed the checks yet */
  dm_httpd_conn *pre_prev, *pre_next;
  int in_head;     /* inside on_head: dm_httpd_respond refuses the request */
  long long clen;  /* the request's announced body length, -1 chunked */
  size_t counted;  /* body bytes of this connection counted in the server's `buffered` */
  const char *why; /* reason given to on_close */
  llhttp_t parser;
  /* the request being parsed: url and header bytes in hb, spans into it */
  char *hb;
  size_t hb_len, hb_cap;
  span url;
  span hname[DM_HTTPD_HEADERS_MAX], hval[DM_HTTPD_HEADERS_MAX];
  size_t nh;
  int field_open, value_open; /* a header name / value is being collected */
  size_t seen;                /* bytes of the current request seen so far */
  char *body;
  size_t body_len, body_cap;
  int complete; /* on_message_complete fired */
  /* the CRLF that ends a chunk's data: llhttp 8 skips those two bytes unchecked, so they are
     checked here; crlf_left says how many of them are still to come in the next read */
  const char *exec_end; /* end of the bytes llhttp_execute is running over */
  size_t crlf_left;
  int refused; /* a refusal was decided during parsing */
  int refuse_status;
  const char *refuse_why;
  int refuse_auth; /* 401: add WWW-Authenticate; 2 = a token was presented */
  /* bytes read while busy, parsed once the answer ends */
  char *held;
  size_t held_len;
  int reading, eof;
  int keep_alive, http10;
  int close_after; /* close once the writes are flushed */
  int lingering;   /* write side shut; reading and dropping until EOF or a short timer */
  uv_shutdown_t shut;
  size_t queued;
  int want_drain;
  void *data;
};

struct dm_httpd {
  uv_loop_t *loop;
  dm_httpd_opts o;
  char *error_body, *error_type, *busy_why;
  size_t buffered; /* body bytes read and not yet handed over, all connections (max_buffered) */
  dm_httpd_handler cb;
  void *ud;
  listener *listeners;
  dm_httpd_conn *conns;
  size_t nconns;
  size_t nshared; /* counted connections of listeners with no cap of their own (max_conns) */
  int closing;
  int open_listeners;
  uv_timer_t closer; /* closed last, so on_closed always comes from the loop */
};

typedef struct {
  uv_write_t req;
  dm_httpd_conn *c;
  size_t len;
  char data[];
} owned_write;

static llhttp_settings_t settings;
static int settings_ready;

static void listener_release(listener *l);
static void conn_close(dm_httpd_conn *c, const char *why);
static void process_held(dm_httpd_conn *c);
static void start_reading(dm_httpd_conn *c);
static void on_resume(uv_timer_t *t);
static void linger(dm_httpd_conn *c);
static void fill_request(dm_httpd_conn *c, dm_httpd_header *hs, char *target, dm_httpd_request *req);
static void on_timeout(uv_timer_t *t);

/* ------------------------------------------------------------------------------------ */
/* Small helpers                                                                          */

int dm_httpd_token_equal(const char *got, size_t n, const char *want) {
  size_t wn = strlen(want);
  unsigned diff = (unsigned)(n != wn);
  for (size_t i = 0; i < wn; i++) {
    unsigned char g = i < n ? (unsigned char)got[i] : 0;
    diff |= (unsigned)(g ^ (unsigned char)want[i]);
  }
  return diff == 0;
}

static const char *reason_of(int status) {
  switch (status) {
  case 100: return "Continue";
  case 200: return "OK";
  case 201: return "Created";
  case 202: return "Accepted";
  case 204: return "No Content";
  case 303: return "See Other";
  case 400: return "Bad Request";
  case 401: return "Unauthorized";
  case 403: return "Forbidden";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 406: return "Not Acceptable";
  case 408: return "Request Timeout";
  case 409: return "Conflict";
  case 411: return "Length Required";
  case 413: return "Content Too Large";
  case 414: return "URI Too Long";
  case 415: return "Unsupported Media Type";
  case 421: return "Misdirected Request";
  case 426: return "Upgrade Required";
  case 429: return "Too Many Requests";
  case 431: return "Request Header Fields Too Large";
  case 500: return "Internal Server Error";
  case 501: return "Not Implemented";
  case 503: return "Service Unavailable";
  case 505: return "HTTP Version Not Supported";
  default: return status < 300 ? "OK" : status < 500 ? "Client Error" : "Server Error";
  }
}

static char *dupstr(const char *s) {
  if (!s) return NULL;
  size_t n = strlen(s);
  char *d = malloc(n + 1);
  if (d) memcpy(d, s, n + 1);
  return d;
}

/* ------------------------------------------------------------------------------------ */
/* Lifetime                                                                               */

static void maybe_free_server(dm_httpd *s) {
  if (!s->closing || s->open_listeners || s->conns) return;
  while (s->listeners) {
    listener *l = s->listeners;
    s->listeners = l->next;
    for (size_t i = 0; i < l->nhosts; i++) free(l->hosts[i]);
    free(l->hosts);
    if (l->token) {
      memset(l->token, 0, strlen(l->token));
      free(l->token);
    }
    free(l->tag);
    free(l->path);
    free(l);
  }
  void (*on_closed)(void *) = s->cb.on_closed;
  void *ud = s->ud;
  free(s->error_body);
  free(s->error_type);
  free(s->busy_why);
  free(s);
  if (on_closed) on_closed(ud);
}

/* The connection's body bytes no longer count against max_buffered (handed over or dropped). */
static void uncount(dm_httpd_conn *c) {
  c->s->buffered -= c->counted;
  if (c->s->o.pool) c->s->o.pool->used -= c->counted;
  c->counted = 0;
}

/* Takes the connection out of its listener's pre-authentication queue, if it is in it. */
static void preauth_leave(dm_httpd_conn *c) {
  if (!c->preauth) return;
  listener *l = c->l;
  if (c->pre_prev) c->pre_prev->pre_next = c->pre_next;
  else l->pre_head = c->pre_next;
  if (c->pre_next) c->pre_next->pre_prev = c->pre_prev;
  else l->pre_tail = c->pre_prev;
  c->pre_prev = c->pre_next = NULL;
  c->preauth = 0;
  l->npreauth--;
}

static void uncap(dm_httpd_conn *c) {
  if (!c->capped) return;
  c->capped = 0;
  c->l->ncapped--;
  if (!c->l->max_conns) c->s->nshared--;
}

/* Counts the connection against its caps: its listener's max_conns when it has one, else
 * the server's. Returns 0, or -1 when that cap is full (the connection is not counted). */
static int cap_take(dm_httpd_conn *c) {
  listener *l = c->l;
  dm_httpd *s = c->s;
  if (l->max_conns ? l->ncapped >= l->max_conns : s->nshared >= s->o.max_conns) return -1;
  c->capped = 1;
  l->ncapped++;
  if (!l->max_conns) s->nshared++;
  return 0;
}

static void conn_finalize(dm_httpd_conn *c) {
  if (c->open_handles) return;
  dm_httpd *s = c->s;
  listener *l = c->l;
  uncount(c);
  if (c->handed && s->cb.on_close) s->cb.on_close(s->ud, c, c->why);
  if (c->prev) c->prev->next = c->next;
  else s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  s->nconns--;
  l->nconns--;
  uncap(c);
  free(c->hb);
  free(c->body);
  free(c->held);
  free(c);
  listener_release(l);
  maybe_free_server(s);
}

static void handle_closed(uv_handle_t *h) {
  dm_httpd_conn *c = h->data;
  c->open_handles--;
  conn_finalize(c);
}

static void conn_close(dm_httpd_conn *c, const char *why) {
  if (c->state == S_CLOSING) return;
  c->state = S_CLOSING;
  preauth_leave(c);
  if (!c->why) c->why = why;
  uv_close((uv_handle_t *)&c->timer, handle_closed);
  uv_close((uv_handle_t *)&c->h, handle_closed);
}

static void listener_closed(uv_handle_t *h) {
  /* a listener, or the server's closer (data NULL: the server is its container) */
  dm_httpd *s = h->data ? ((listener *)h->data)->s : (dm_httpd *)((char *)h - offsetof(dm_httpd, closer));
  s->open_listeners--;
  maybe_free_server(s);
}

/* ------------------------------------------------------------------------------------ */
/* Writing                                                                                */

static void after_write(uv_write_t *req, int status) {
  owned_write *w = (owned_write *)req;
  dm_httpd_conn *c = w->c;
  c->queued -= w->len;
  free(w);
  if (c->state == S_CLOSING) return;
  if (status < 0) {
    conn_close(c, "client closed");
    return;
  }
  if (c->close_after && c->queued == 0) {
    linger(c);
    return;
  }
  if (c->want_drain && c->queued <= c->s->o.max_output / 8) {
    c->want_drain = 0;
    if (c->s->cb.on_drain) c->s->cb.on_drain(c->s->ud, c);
  }
}

/* Queues n bytes (copied). Returns 0 or -1 (the connection is then closing). */
static int queue_bytes(dm_httpd_conn *c, const char *a, size_t an, const char *b, size_t bn, const char *z, size_t zn) {
  size_t n = an + bn + zn;
  owned_write *w = malloc(sizeof *w + (n ? n : 1));
  if (!w) {
    conn_close(c, "out of memory");
    return -1;
  }
  memcpy(w->data, a, an);
  if (bn) memcpy(w->data + an, b, bn);
  if (zn) memcpy(w->data + an + bn, z, zn);
  w->c = c;
  w->len = n;
  uv_buf_t buf = uv_buf_init(w->data, (unsigned)n);
  int r = uv_write(&w->req, (uv_stream_t *)&c->h, &buf, 1, after_write);
  if (r) {
    free(w);
    conn_close(c, "client closed");
    return -1;
  }
  c->queued += n;
  return 0;
}

/* Appends to a growing head buffer. */
typedef struct {
  char *p;
  size_t len, cap;
  int bad;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
  if (b->bad) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 512;
    while (b->len + n + 1 > cap) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->bad = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_fmt(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_fmt(sbuf *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  sb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static int header_ok(const dm_httpd_header *h) {
  if (!h->name_len) return 0;
  for (size_t i = 0; i < h->name_len; i++) {
    unsigned char ch = (unsigned char)h->name[i];
    if (ch <= 32 || ch >= 127 || ch == ':') return 0;
  }
  for (size_t i = 0; i < h->value_len; i++) {
    unsigned char ch = (unsigned char)h->value[i];
    if (ch == '\r' || ch == '\n' || ch == 0) return 0;
  }
  static const char *const reserved[] = {"content-length", "transfer-encoding", "connection", NULL};
  for (const char *const *r = reserved; *r; r++)
    if (h->name_len == strlen(*r) && !strncasecmp(h->name, *r, h->name_len)) return 0;
  return 1;
}

/* Builds a response head. `length` < 0: a streamed body. */
static int build_head(dm_httpd_conn *c, sbuf *b, int status, const dm_httpd_header *hs, size_t n, long long length) {
  for (size_t i = 0; i < n; i++)
    if (!header_ok(&hs[i])) return -1;
  sb_fmt(b, "HTTP/1.1 %d %s\r\n", status, reason_of(status));
  for (size_t i = 0; i < n; i++) {
    sb_add(b, hs[i].name, hs[i].name_len);
    sb_add(b, ": ", 2);
    sb_add(b, hs[i].value, hs[i].value_len);
    sb_add(b, "\r\n", 2);
  }
  if (length >= 0) {
    sb_fmt(b, "Content-Length: %lld\r\n", length);
  } else if (!c->http10) {
    sb_add(b, "Transfer-Encoding: chunked\r\n", 28);
  } else {
    c->keep_alive = 0;
  }
  if (c->s->closing) c->keep_alive = 0;
  sb_add(b, c->keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n", c->keep_alive ? 26 : 21);
  return b->bad ? -1 : 0;
}

static void linger_timeout(uv_timer_t *t) { conn_close(t->data, NULL); }
static void after_shutdown(uv_shutdown_t *req, int status) {
  (void)req;
  (void)status;
}

/* Everything is written and the connection ends: shut the write side, then read and drop
 * what the client still sends (a body we refused) until it closes or 2 s pass, so that
 * unread bytes do not turn the close into a reset that loses the answer. */
static void linger(dm_httpd_conn *c) {
  if (c->lingering || c->state == S_CLOSING) return;
  c->lingering = 1;
  uv_timer_stop(&c->timer);
  uv_timer_start(&c->timer, linger_timeout, 2000, 0);
  if (uv_shutdown(&c->shut, (uv_stream_t *)&c->h, after_shutdown) != 0 || c->eof) {
    conn_close(c, NULL);
    return;
  }
  if (!c->reading) start_reading(c);
}

/* The answer ended: go back to reading (keep-alive), or close once flushed. */
static void answer_done(dm_httpd_conn *c) {
  if (!c->keep_alive || c->s->closing) {
    c->close_after = 1;
    c->state = S_BUSY; /* nothing more is parsed */
    if (c->queued == 0) linger(c);
    return;
  }
  c->state = S_READ;
  c->complete = 0;
  c->seen = 0;
  uv_timer_stop(&c->timer);
  /* parse what arrived meanwhile from the loop, never from inside the owner's call */
  uv_timer_start(&c->timer, on_resume, 0, 0);
}

int dm_httpd_respond(dm_httpd_conn *c, int status, const dm_httpd_header *hs, size_t n, const char *body, size_t len) {
  /* from on_head: a refusal before the body is read; the connection ends with the answer */
  int from_head = c->in_head && c->state == S_READ && !c->close_after;
  if (!from_head && (c->state != S_BUSY || c->close_after)) return -1;
  int keep = c->keep_alive;
  if (from_head) c->keep_alive = 0;
  sbuf b = {0};
  if (build_head(c, &b, status, hs, n, (long long)len) < 0) {
    free(b.p);
    c->keep_alive = keep;
    return -2;
  }
  if (from_head) {
    c->state = S_BUSY;
    c->close_after = 1;
    uv_timer_stop(&c->timer);
    if (c->reading) {
      uv_read_stop((uv_stream_t *)&c->h);
      c->reading = 0;
    }
  }
  int r = queue_bytes(c, b.p, b.len, body, len, NULL, 0);
  free(b.p);
  if (r < 0) return -1;
  if (!from_head) answer_done(c);
  return 0;
}

int dm_httpd_stream_start(dm_httpd_conn *c, int status, const dm_httpd_header *hs, size_t n) {
  if (c->state != S_BUSY || c->close_after) return -1;
  sbuf b = {0};
  if (build_head(c, &b, status, hs, n, -1) < 0) {
    free(b.p);
    return -2;
  }
  int r = queue_bytes(c, b.p, b.len, NULL, 0, NULL, 0);
  free(b.p);
  if (r < 0) return -1;
  c->state = S_STREAM;
  return 0;
}

int dm_httpd_stream_write(dm_httpd_conn *c, const char *data, size_t len) {
  if (c->state != S_STREAM) return -1;
  if (len == 0) return 0;
  if (c->queued + len > c->s->o.max_output) {
    conn_close(c, "slow reader");
    return -1;
  }
  if (c->http10) return queue_bytes(c, data, len, NULL, 0, NULL, 0);
  char pre[32];
  int pn = snprintf(pre, sizeof pre, "%zx\r\n", len);
  return queue_bytes(c, pre, (size_t)pn, data, len, "\r\n", 2);
}

int dm_httpd_stream_end(dm_httpd_conn *c) {
  if (c->state != S_STREAM) return -1;
  if (!c->http10 && queue_bytes(c, "0\r\n\r\n", 5, NULL, 0, NULL, 0) < 0) return -1;
  c->state = S_BUSY;
  answer_done(c);
  return 0;
}

size_t dm_httpd_queued(const dm_httpd_conn *c) { return c->queued; }

int dm_httpd_want_drain(dm_httpd_conn *c) {
  if (c->state == S_CLOSING || c->queued <= c->s->o.max_output / 8) return 0;
  c->want_drain = 1;
  return 1;
}

void dm_httpd_conn_close(dm_httpd_conn *c, const char *why) { conn_close(c, why); }
void dm_httpd_conn_set_data(dm_httpd_conn *c, void *data) { c->data = data; }
void *dm_httpd_conn_data(const dm_httpd_conn *c) { return c->data; }
size_t dm_httpd_connections(const dm_httpd *s) { return s->nconns; }
size_t dm_httpd_buffered(const dm_httpd *s) { return s->buffered; }

/* The server's own answer to a request it will not hand over; the connection then closes. */
static void refuse(dm_httpd_conn *c, int status, const char *why, int auth) {
  if (c->state == S_CLOSING) return;
  dm_httpd *s = c->s;
  char body[512];
  int bn = snprintf(body, sizeof body, s->error_body, why);
  if (bn < 0) bn = 0;
  if ((size_t)bn >= sizeof body) bn = sizeof body - 1;
  sbuf b = {0};
  sb_fmt(&b, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n", status, reason_of(status), s->error_type,
         bn);
  if (auth) {
    const char *wa = auth == 2 ? "WWW-Authenticate: Bearer realm=\"demesne\", error=\"invalid_token\"\r\n"
                               : "WWW-Authenticate: Bearer realm=\"demesne\"\r\n";
    sb_add(&b, wa, strlen(wa));
  }
  sb_add(&b, "Connection: close\r\n\r\n", 21);
  c->keep_alive = 0;
  c->close_after = 1;
  c->state = S_BUSY;
  uv_timer_stop(&c->timer);
  if (c->reading) {
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
  }
  if (b.bad) conn_close(c, "out of memory");
  else queue_bytes(c, b.p, b.len, body, (size_t)bn, NULL, 0);
  free(b.p);
}

/* ------------------------------------------------------------------------------------ */
/* Parsing                                                                                */

static dm_httpd_conn *conn_of(llhttp_t *p) { return (dm_httpd_conn *)p->data; }

static int hb_add(dm_httpd_conn *c, const char *at, size_t len) {
  if (c->hb_len + len > c->s->o.max_head) {
    c->refused = 1;
    c->refuse_status = 431;
    c->refuse_why = "request head too large";
    return -1;
  }
  if (c->hb_len + len > c->hb_cap) {
    size_t cap = c->hb_cap ? c->hb_cap : 2048;
    while (c->hb_len + len > cap) cap *= 2;
    char *nb = realloc(c->hb, cap);
    if (!nb) {
      c->refused = 1;
      c->refuse_status = 500;
      c->refuse_why = "out of memory";
      return -1;
    }
    c->hb = nb;
    c->hb_cap = cap;
  }
  memcpy(c->hb + c->hb_len, at, len);
  c->hb_len += len;
  return 0;
}

static int on_message_begin(llhttp_t *p) {
  dm_httpd_conn *c = conn_of(p);
  c->hb_len = 0;
  c->url.off = c->url.len = 0;
  c->nh = 0;
  c->field_open = c->value_open = 0;
  c->body_len = 0;
  uncount(c);
  c->complete = 0;
  c->crlf_left = 0;
  return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len) {
  dm_httpd_conn *c = conn_of(p);
  if (!c->url.len) c->url.off = c->hb_len;
  if (hb_add(c, at, len) < 0) return -1;
  c->url.len += len;
  return 0;
}

static int new_header(dm_httpd_conn *c) {
  if (c->nh >= DM_HTTPD_HEADERS_MAX) {
    c->refused = 1;
    c->refuse_status = 431;
    c->refuse_why = "too many header lines";
    return -1;
  }
  c->nh++;
  c->hname[c->nh - 1].off = c->hb_len;
  c->hname[c->nh - 1].len = 0;
  c->hval[c->nh - 1].off = c->hb_len;
  c->hval[c->nh - 1].len = 0;
  c->field_open = 1;
  c->value_open = 0;
  return 0;
}

static int on_field(llhttp_t *p, const char *at, size_t len) {
  dm_httpd_conn *c = conn_of(p);
  if (!c->field_open && new_header(c) < 0) return -1;
  if (hb_add(c, at, len) < 0) return -1;
  c->hname[c->nh - 1].len += len;
  return 0;
}

static int on_field_complete(llhttp_t *p) {
  conn_of(p)->field_open = 0;
  return 0;
}

static int on_value(llhttp_t *p, const char *at, size_t len) {
  dm_httpd_conn *c = conn_of(p);
  if (c->nh == 0) return 0;
  span *v = &c->hval[c->nh - 1];
  if (!c->value_open) {
    v->off = c->hb_len;
    v->len = 0;
    c->value_open = 1;
  }
  if (hb_add(c, at, len) < 0) return -1;
  v->len += len;
  return 0;
}

static int on_value_complete(llhttp_t *p) {
  conn_of(p)->value_open = 0;
  return 0;
}

static int name_is(const dm_httpd_conn *c, size_t i, const char *name) {
  return c->hname[i].len == strlen(name) && !strncasecmp(c->hb + c->hname[i].off, name, c->hname[i].len);
}

static void trim(const char **s, size_t *n) {
  while (*n && (**s == ' ' || **s == '\t')) (*s)++, (*n)--;
  while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t')) (*n)--;
}

/* The host part of "host[:port]" or "[v6][:port]"; NULL when malformed. */
static const char *host_part(const char *v, size_t n, size_t *hl) {
  if (n && v[0] == '[') {
    const char *close = memchr(v, ']', n);
    if (!close) return NULL;
    *hl = (size_t)(close - v) + 1;
    if (*hl < n && v[*hl] != ':') return NULL;
    return v;
  }
  const char *colon = memchr(v, ':', n);
  *hl = colon ? (size_t)(colon - v) : n;
  if (colon && memchr(colon + 1, ':', n - *hl - 1)) return NULL;
  return *hl ? v : NULL;
}

static int host_allowed(const listener *l, const char *h, size_t n) {
  for (size_t i = 0; i < l->nhosts; i++)
    if (strlen(l->hosts[i]) == n && !strncasecmp(l->hosts[i], h, n)) return 1;
  return 0;
}

static int check_head(dm_httpd_conn *c) {
  listener *l = c->l;
  const char *host = NULL, *origin = NULL, *auth = NULL;
  size_t host_n = 0, origin_n = 0, auth_n = 0;
  int hosts = 0;
  ssize_t auth_i = -1;
  for (size_t i = 0; i < c->nh; i++) {
    const char *v = c->hb + c->hval[i].off;
    size_t vn = c->hval[i].len;
    trim(&v, &vn);
    if (name_is(c, i, "host")) {
      hosts++;
      host = v;
      host_n = vn;
    } else if (name_is(c, i, "origin")) {
      origin = v;
      origin_n = vn;
    } else if (name_is(c, i, "authorization")) {
      auth = v;
      auth_n = vn;
      auth_i = (ssize_t)i;
    }
  }
  if (hosts > 1) {
    refuse(c, 400, "more than one Host header", 0);
    return -1;
  }
  if (!c->http10 && !hosts) {
    refuse(c, 400, "no Host header", 0);
    return -1;
  }
  if (l->hosts) {
    size_t hl = 0;
    const char *h = host ? host_part(host, host_n, &hl) : NULL;
    if (host && (!h || !host_allowed(l, h, hl))) {
      refuse(c, 421, "the Host header names another server (DNS rebinding protection)", 0);
      return -1;
    }
    if (origin) {
      const char *hp = NULL;
      size_t rest = 0;
      if (origin_n > 7 && !strncasecmp(origin, "http://", 7)) hp = origin + 7, rest = origin_n - 7;
      else if (origin_n > 8 && !strncasecmp(origin, "https://", 8)) hp = origin + 8, rest = origin_n - 8;
      const char *slash = hp ? memchr(hp, '/', rest) : NULL;
      if (slash) rest = (size_t)(slash - hp);
      size_t ol = 0;
      const char *oh = hp ? host_part(hp, rest, &ol) : NULL;
      if (!oh || !host_allowed(l, oh, ol)) {
        refuse(c, 403, "requests from this Origin are not allowed", 0);
        return -1;
      }
    }
  }
  if (l->token) {
    int ok = 0;
    if (auth && auth_n > 7 && !strncasecmp(auth, "bearer ", 7)) {
      const char *t = auth + 7;
      size_t tn = auth_n - 7;
      trim(&t, &tn);
      ok = dm_httpd_token_equal(t, tn, l->token);
    }
    if (!ok) {
      refuse(c, 401, auth ? "the bearer token is not valid" : "a bearer token is required (Authorization: Bearer)",
             auth ? 2 : 1);
      return -1;
    }
    /* the owner never sees the token */
    memset(c->hb + c->hval[auth_i].off, 0, c->hval[auth_i].len);
    c->hname[auth_i].len = 0;
  }
  return 0;
}

static int on_headers_complete(llhttp_t *p) {
  dm_httpd_conn *c = conn_of(p);
  c->http10 = p->http_major == 1 && p->http_minor == 0;
  c->keep_alive = llhttp_should_keep_alive(p);
  if (p->upgrade || p->method == HTTP_CONNECT) {
    c->refused = 1;
    c->refuse_status = 501;
    c->refuse_why = "upgrade and CONNECT are not supported";
    return HPE_PAUSED;
  }
  if (c->url.len >= 8192) {
    c->refused = 1;
    c->refuse_status = 414;
    c->refuse_why = "the request target is too long";
    return HPE_PAUSED;
  }
  if (check_head(c) < 0) return HPE_PAUSED;
  if (c->preauth) {
    /* past the listener's checks (its token, when it has one): counted from now on */
    preauth_leave(c);
    if (cap_take(c) < 0) {
      refuse(c, 503, "too many connections", 0);
      return HPE_PAUSED;
    }
  }
  if (c->head_timed) {
    /* the head came in time: the rest of the request has request_timeout_ms */
    c->head_timed = 0;
    uv_timer_stop(&c->timer);
    uv_timer_start(&c->timer, on_timeout, c->s->o.request_timeout_ms, 0);
  }
  if ((p->flags & F_CONTENT_LENGTH) && p->content_length > c->s->o.max_body) {
    c->refused = 1;
    c->refuse_status = 413;
    c->refuse_why = "the request body is larger than the server accepts";
    return HPE_PAUSED;
  }
  c->clen = (p->flags & F_CHUNKED) ? -1 : (p->flags & F_CONTENT_LENGTH) ? (long long)p->content_length : 0;
  dm_httpd *s = c->s;
  if (s->cb.on_head) {
    /* the owner judges the head before any body byte is read; it may refuse it here */
    dm_httpd_header hs[DM_HTTPD_HEADERS_MAX];
    char target[8192];
    dm_httpd_request req;
    fill_request(c, hs, target, &req);
    req.body = "";
    req.body_len = 0;
    c->handed = 1;
    c->in_head = 1;
    s->cb.on_head(s->ud, c, &req);
    c->in_head = 0;
    if (c->state != S_READ) return HPE_PAUSED; /* refused (or closed) by the owner */
  }
  for (size_t i = 0; i < c->nh; i++) {
    if (!name_is(c, i, "expect")) continue;
    const char *v = c->hb + c->hval[i].off;
    size_t vn = c->hval[i].len;
    trim(&v, &vn);
    if (vn == 12 && !strncasecmp(v, "100-continue", 12))
      queue_bytes(c, "HTTP/1.1 100 Continue\r\n\r\n", 25, NULL, 0, NULL, 0);
  }
  return 0;
}

static const char CHUNK_END[] = "\r\n";

/* Checks up to `avail` bytes at `q` against the last `need` bytes of a chunk's CRLF; those
   beyond `avail` are left to the next read (crlf_left). -1 (refused) on a mismatch. */
static int check_chunk_end(dm_httpd_conn *c, const char *q, size_t avail, size_t need) {
  size_t k = avail < need ? avail : need;
  if (memcmp(q, CHUNK_END + (2 - need), k) != 0) {
    c->refused = 1;
    c->refuse_status = 400;
    c->refuse_why = "chunk data not followed by CRLF";
    return -1;
  }
  c->crlf_left = need - k;
  return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len) {
  dm_httpd_conn *c = conn_of(p);
  /* the end of a chunk's data: what follows must be its CRLF */
  if ((p->flags & F_CHUNKED) && p->content_length == 0 &&
      check_chunk_end(c, at + len, (size_t)(c->exec_end - (at + len)), 2) < 0)
    return -1;
  dm_httpd *s = c->s;
  if (s->o.max_buffered && s->buffered + len > s->o.max_buffered) {
    c->refused = 1;
    c->refuse_status = 503;
    c->refuse_why = s->busy_why;
    return -1;
  }
  dm_httpd_pool *pool = s->o.pool;
  if (pool && pool->max && pool->used + len > pool->max) {
    c->refused = 1;
    c->refuse_status = 503;
    c->refuse_why = pool->why[0] ? pool->why : s->busy_why;
    return -1;
  }
  if (c->body_len + len > c->s->o.max_body) {
    c->refused = 1;
    c->refuse_status = 413;
    c->refuse_why = "the request body is larger than the server accepts";
    return -1;
  }
  if (c->body_len + len + 1 > c->body_cap) {
    size_t cap = c->body_cap ? c->body_cap : 4096;
    while (c->body_len + len + 1 > cap) cap *= 2;
    char *nb = realloc(c->body, cap);
    if (!nb) {
      c->refused = 1;
      c->refuse_status = 500;
      c->refuse_why = "out of memory";
      return -1;
    }
    c->body = nb;
    c->body_cap = cap;
  }
  memcpy(c->body + c->body_len, at, len);
  c->body_len += len;
  c->counted += len;
  s->buffered += len;
  if (pool) pool->used += len;
  return 0;
}

static int on_message_complete(llhttp_t *p) {
  conn_of(p)->complete = 1;
  return HPE_PAUSED;
}

static void init_settings(void) {
  if (settings_ready) return;
  llhttp_settings_init(&settings);
  settings.on_message_begin = on_message_begin;
  settings.on_url = on_url;
  settings.on_header_field = on_field;
  settings.on_header_value = on_value;
  settings.on_header_field_complete = on_field_complete;
  settings.on_header_value_complete = on_value_complete;
  settings.on_headers_complete = on_headers_complete;
  settings.on_body = on_body;
  settings.on_message_complete = on_message_complete;
  settings_ready = 1;
}

/* The request as the owner sees it: headers into hs (DM_HTTPD_HEADERS_MAX), the target
 * copied NUL-terminated into target (8192 bytes), the body as read so far. */
static void fill_request(dm_httpd_conn *c, dm_httpd_header *hs, char *target, dm_httpd_request *req) {
  size_t n = 0;
  for (size_t i = 0; i < c->nh; i++) {
    if (!c->hname[i].len) continue;
    hs[n].name = c->hb + c->hname[i].off;
    hs[n].name_len = c->hname[i].len;
    const char *v = c->hb + c->hval[i].off;
    size_t vn = c->hval[i].len;
    trim(&v, &vn);
    hs[n].value = v;
    hs[n].value_len = vn;
    n++;
  }
  /* NUL-terminate the target: it is followed in hb by the first header name, so copy */
  size_t tn = c->url.len < 8192 ? c->url.len : 8191;
  memcpy(target, c->hb + c->url.off, tn);
  target[tn] = '\0';
  *req = (dm_httpd_request){
    .method = llhttp_method_name((llhttp_method_t)c->parser.method),
    .target = target,
    .http_major = c->parser.http_major,
    .http_minor = c->parser.http_minor,
    .headers = hs,
    .nheaders = n,
    .body = c->body ? c->body : "",
    .body_len = c->body_len,
    .listener = c->l->tag,
    .keep_alive = c->keep_alive,
    .content_length = c->clen,
  };
}

/* Hands the complete request to the owner. */
static void deliver(dm_httpd_conn *c) {
  dm_httpd *s = c->s;
  dm_httpd_header hs[DM_HTTPD_HEADERS_MAX];
  char target[8192];
  if (!c->body) {
    c->body = malloc(1);
    c->body_cap = c->body ? 1 : 0;
  }
  if (c->body) c->body[c->body_len] = '\0';
  dm_httpd_request req;
  fill_request(c, hs, target, &req);
  c->state = S_BUSY;
  c->handed = 1;
  uncount(c); /* handed over: the owner's to bound from here */
  uv_timer_stop(&c->timer);
  if (s->cb.on_request) s->cb.on_request(s->ud, c, &req);
  /* a large body is not kept across keep-alive requests */
  if (c->body_cap > 65536) {
    free(c->body);
    c->body = NULL;
    c->body_cap = 0;
  }
  c->body_len = 0;
}

static void on_timeout(uv_timer_t *t) {
  dm_httpd_conn *c = t->data;
  if (c->state != S_READ) return;
  if (c->seen == 0) conn_close(c, NULL); /* an idle keep-alive connection */
  else refuse(c, 408, "the request did not arrive in time", 0);
}

/* Runs bytes through the parser in READ state. Returns the number consumed. */
static size_t parse(dm_httpd_conn *c, const char *data, size_t n) {
  if (c->seen == 0 && n && !c->head_timed) {
    uv_timer_stop(&c->timer);
    uv_timer_start(&c->timer, on_timeout, c->s->o.request_timeout_ms, 0);
  }
  c->seen += n;
  if (c->crlf_left && n && check_chunk_end(c, data, n, c->crlf_left) < 0) {
    refuse(c, c->refuse_status, c->refuse_why, 0);
    return n;
  }
  c->exec_end = data + n;
  llhttp_errno_t e = llhttp_execute(&c->parser, data, n);
  size_t used = n;
  if (e == HPE_PAUSED || e == HPE_PAUSED_UPGRADE) {
    used = (size_t)(llhttp_get_error_pos(&c->parser) - data);
    llhttp_resume(&c->parser);
    if (e == HPE_PAUSED_UPGRADE) c->refused = 1;
  } else if (e != HPE_OK) {
    if (!c->refused) {
      c->refused = 1;
      c->refuse_status = 400;
      c->refuse_why = "malformed HTTP request";
    }
  }
  if (c->state != S_READ) return used; /* a refusal was already written by check_head */
  if (c->refused) {
    refuse(c, c->refuse_status ? c->refuse_status : 400, c->refuse_why ? c->refuse_why : "malformed HTTP request", 0);
    return n;
  }
  if (c->complete) deliver(c);
  return used;
}

/* Stores bytes read while busy; stops reading when too many are held. */
static void hold(dm_httpd_conn *c, const char *data, size_t n) {
  if (c->close_after) return;
  char *nb = realloc(c->held, c->held_len + n);
  if (!nb) return;
  c->held = nb;
  memcpy(c->held + c->held_len, data, n);
  c->held_len += n;
  if (c->held_len > c->s->o.max_head && c->reading) {
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
  }
}

static void process_held(dm_httpd_conn *c) {
  if (c->state != S_READ) return;
  uv_timer_start(&c->timer, on_timeout, c->s->o.idle_timeout_ms, 0);
  while (c->held_len && c->state == S_READ) {
    char *buf = c->held;
    size_t len = c->held_len;
    c->held = NULL;
    c->held_len = 0;
    size_t used = parse(c, buf, len);
    if (used < len && c->state != S_CLOSING && !c->close_after) {
      /* keep the unparsed rest (a further pipelined request) */
      char *rest = malloc(len - used);
      if (rest) {
        memcpy(rest, buf + used, len - used);
        free(c->held);
        c->held = rest;
        c->held_len = len - used;
      }
    }
    free(buf);
  }
  if (c->state == S_READ && c->eof) {
    if (c->seen) refuse(c, 400, "the request was cut off", 0);
    else conn_close(c, NULL);
    return;
  }
  if (c->state != S_CLOSING && !c->reading && !c->eof && !c->close_after) start_reading(c);
}

static void on_resume(uv_timer_t *t) { process_held(t->data); }

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  (void)suggested;
  buf->base = malloc(READ_CHUNK);
  buf->len = buf->base ? READ_CHUNK : 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  dm_httpd_conn *c = st->data;
  if (n == 0) {
    free(buf->base);
    return;
  }
  if (c->state == S_CLOSING) {
    free(buf->base);
    return;
  }
  if (c->lingering) {
    free(buf->base);
    if (n < 0) conn_close(c, NULL);
    return;
  }
  if (n < 0) {
    free(buf->base);
    uv_read_stop(st);
    c->reading = 0;
    c->eof = 1;
    if (c->state == S_READ) {
      if (c->seen && !c->held_len) refuse(c, 400, "the request was cut off", 0);
      else if (!c->held_len) conn_close(c, NULL);
    } else if (!c->close_after) {
      /* the client went away while its answer was being prepared or streamed */
      conn_close(c, "client closed");
    }
    return;
  }
  if (c->state != S_READ || c->held_len) {
    hold(c, buf->base, (size_t)n);
    free(buf->base);
    return;
  }
  size_t used = parse(c, buf->base, (size_t)n);
  if (used < (size_t)n && c->state != S_CLOSING) hold(c, buf->base + used, (size_t)n - used);
  free(buf->base);
}

static void start_reading(dm_httpd_conn *c) {
  if (uv_read_start((uv_stream_t *)&c->h, alloc_cb, on_read) == 0) c->reading = 1;
  else conn_close(c, "client closed");
}

/* ------------------------------------------------------------------------------------ */
/* Listeners                                                                              */

/* A new connection of listener l: its handle initialised (TCP or a unix pipe), not yet
 * opened; linked and counted. NULL when out of memory. */
static dm_httpd_conn *conn_new(listener *l, int tcp) {
  dm_httpd *s = l->s;
  dm_httpd_conn *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->s = s;
  c->l = l;
  c->state = S_READ;
  if (tcp) uv_tcp_init(s->loop, &c->h.tcp);
  else uv_pipe_init(s->loop, &c->h.pipe, 0);
  uv_timer_init(s->loop, &c->timer);
  c->h.pipe.data = c;
  c->timer.data = c;
  c->open_handles = 2;
  c->next = s->conns;
  if (s->conns) s->conns->prev = c;
  s->conns = c;
  s->nconns++;
  l->nconns++;
  init_settings();
  llhttp_init(&c->parser, HTTP_REQUEST, &settings);
  c->parser.data = c;
  return c;
}

/* 1 when the client has sent nothing on c: no byte parsed and none waiting in the socket
 * (a client that hung up has sent nothing either), or c was refused and only drains. */
static int conn_silent(dm_httpd_conn *c) {
  if (c->close_after) return 1; /* refused: it only waits for its answer to drain */
  if (c->seen || c->held_len || c->state != S_READ) return 0;
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&c->h, &fd) != 0) return 1;
  char b;
  ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return r <= 0;
}

/* The connection a full pre-authentication queue gives up: its oldest that has sent
 * nothing, so a client whose head is already waiting to be read (accepted before a burst
 * of others) is kept; when every one has sent something, the oldest. */
static dm_httpd_conn *preauth_victim(listener *l) {
  for (dm_httpd_conn *c = l->pre_head; c; c = c->pre_next)
    if (conn_silent(c)) return c;
  return l->pre_head;
}

/* A new connection's timer: head_timeout_ms for its first head, from now, when set; else
 * idle_timeout_ms until its first byte (then request_timeout_ms). */
static void conn_start_timer(dm_httpd_conn *c) {
  c->head_timed = c->s->o.head_timeout_ms != 0;
  uv_timer_start(&c->timer, on_timeout, c->head_timed ? c->s->o.head_timeout_ms : c->s->o.idle_timeout_ms, 0);
}

/* Starts serving an opened connection. Without a pre-authentication queue it is counted
 * now (503 over the caps); with one it joins the queue (its oldest closed when full) and is
 * counted once its first head passes the listener's checks. Then it is read. */
static void conn_begin(dm_httpd_conn *c) {
  listener *l = c->l;
  if (!l->max_preauth) {
    if (cap_take(c) < 0) {
      refuse(c, 503, "too many connections", 0);
      return;
    }
    conn_start_timer(c);
    start_reading(c);
    return;
  }
  /* not counted until it passes the listener's checks; a full queue gives up its oldest
     silent one, so connections that never present a token cannot keep out the ones that do */
  if (l->npreauth >= l->max_preauth && l->pre_head)
    conn_close(preauth_victim(l), "too many connections before authentication");
  c->preauth = 1;
  c->pre_prev = l->pre_tail;
  if (l->pre_tail) l->pre_tail->pre_next = c;
  else l->pre_head = c;
  l->pre_tail = c;
  l->npreauth++;
  conn_start_timer(c);
  start_reading(c);
}

static void free_handle(uv_handle_t *h) { free(h); }

/* Accepts a connection from the listening socket `from` as a new HTTP connection of l. */
static void accept_conn(listener *l, uv_stream_t *from, int tcp) {
  dm_httpd_conn *c = conn_new(l, tcp);
  if (!c) return;
  if (uv_accept(from, (uv_stream_t *)&c->h) != 0) {
    conn_close(c, NULL);
    return;
  }
  if (tcp) uv_tcp_nodelay(&c->h.tcp, 1);
  conn_begin(c);
}

static void on_connection(uv_stream_t *server, int status) {
  listener *l = server->data;
  if (status < 0 || l->s->closing || l->removed) return;
  accept_conn(l, server, !l->is_unix);
}

/* Relay listeners: demesne-init's relay in a sandbox connects to the unix socket and hands
 * over the TCP socket it accepted, or copies the client's bytes over the unix connection
 * where a socket cannot be passed (gVisor): core/relay.c reads the hand-over and bounds the
 * connections that wait for one. The handed socket (or the copying unix connection) becomes
 * an HTTP connection of the listener, so its identity is the socket it came through, never
 * anything the client says. A client on the unix socket itself is refused. */
static void on_handover(void *ud, dm_relay_kind kind, uv_pipe_t *from) {
  listener *l = ud;
  if (l->s->closing || l->removed) return;
  dm_httpd_conn *c = conn_new(l, kind == DM_RELAY_SOCKET);
  if (!c) return;
  if (dm_relay_take(from, kind, (uv_stream_t *)&c->h) != 0) {
    conn_close(c, NULL);
    return;
  }
  if (kind == DM_RELAY_SOCKET) uv_tcp_nodelay(&c->h.tcp, 1);
  conn_begin(c);
}

static void on_relay_connection(uv_stream_t *server, int status) {
  listener *l = server->data;
  if (status < 0) return; /* EMFILE/ENFILE: libuv has accepted and closed what was pending */
  if (l->s->closing || l->removed || !l->relay) {
    /* take it anyway: libuv accepts no other until it is taken */
    uv_pipe_t *drop = malloc(sizeof *drop);
    if (!drop) return;
    uv_pipe_init(l->s->loop, drop, 0);
    uv_accept(server, (uv_stream_t *)drop);
    uv_close((uv_handle_t *)drop, free_handle);
    return;
  }
  dm_relay_accept(l->relay, server);
}

static void relay_closed(void *ud) {
  listener *l = ud;
  dm_httpd *s = l->s;
  l->relay = NULL;
  s->open_listeners--;
  listener_release(l);
  maybe_free_server(s);
}

/* Closes the listener's waiting relay connections (once). */
static void relay_stop(listener *l) {
  if (!l->relay || l->relay_closing) return;
  l->relay_closing = 1;
  dm_relay_close(l->relay, relay_closed, l);
}

static listener *listener_new(dm_httpd *s, const dm_httpd_listen_opts *o) {
  listener *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  l->s = s;
  l->max_conns = o->max_conns;
  l->max_preauth = o->max_preauth ? o->max_preauth : s->o.max_preauth;
  l->tag = dupstr(o->tag ? o->tag : "");
  l->token = o->token && *o->token ? dupstr(o->token) : NULL;
  if (o->hosts && o->nhosts) {
    l->hosts = calloc(o->nhosts, sizeof *l->hosts);
    for (size_t i = 0; l->hosts && i < o->nhosts; i++) l->hosts[i] = dupstr(o->hosts[i]);
    l->nhosts = o->nhosts;
  }
  return l;
}

static void listener_free(listener *l) {
  for (size_t i = 0; i < l->nhosts; i++) free(l->hosts[i]);
  free(l->hosts);
  if (l->token) memset(l->token, 0, strlen(l->token));
  free(l->token);
  free(l->tag);
  free(l->path);
  free(l);
}

static void listener_free_cb(uv_handle_t *h) { listener_free(h->data); }

int dm_httpd_listen_tcp(dm_httpd *s, const char *ip, int port, const dm_httpd_listen_opts *o, int *bound_port) {
  struct sockaddr_storage addr;
  int v6 = 0;
  if (uv_ip4_addr(ip, port, (struct sockaddr_in *)&addr) != 0) {
    if (uv_ip6_addr(ip, port, (struct sockaddr_in6 *)&addr) != 0) return UV_EINVAL;
    v6 = 1;
  }
  listener *l = listener_new(s, o);
  if (!l) return UV_ENOMEM;
  uv_tcp_init(s->loop, &l->h.tcp);
  l->h.tcp.data = l;
  int r = uv_tcp_bind(&l->h.tcp, (struct sockaddr *)&addr, v6 && o->ipv6_only ? UV_TCP_IPV6ONLY : 0);
  if (!r) r = uv_listen((uv_stream_t *)&l->h.tcp, 511, on_connection);
  if (r) {
    uv_close((uv_handle_t *)&l->h.tcp, listener_free_cb);
    return r;
  }
  struct sockaddr_storage bound;
  int len = sizeof bound;
  uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&bound, &len);
  if (bound_port)
    *bound_port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                              : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  l->open = 1;
  l->next = s->listeners;
  s->listeners = l;
  s->open_listeners++;
  return 0;
}

static int listen_unix_with(dm_httpd *s, const char *path, const dm_httpd_listen_opts *o, int relay) {
  if (strlen(path) > 107) return UV_ENAMETOOLONG;
  struct stat st;
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return UV_EEXIST;
    unlink(path);
  }
  listener *l = listener_new(s, o);
  if (!l) return UV_ENOMEM;
  l->is_unix = 1;
  l->path = dupstr(path);
  uv_pipe_init(s->loop, &l->h.pipe, 0);
  l->h.pipe.data = l;
  mode_t old = umask(0177);
  int r = uv_pipe_bind(&l->h.pipe, path);
  umask(old);
  if (!r && relay && !(l->relay = dm_relay_new(s->loop, on_handover, l))) r = UV_ENOMEM;
  if (!r) r = uv_listen((uv_stream_t *)&l->h.pipe, 511, relay ? on_relay_connection : on_connection);
  if (r) {
    if (l->relay) dm_relay_close(l->relay, NULL, NULL); /* nothing waits in it yet */
    uv_close((uv_handle_t *)&l->h.pipe, listener_free_cb);
    return r;
  }
  if (l->relay) s->open_listeners++; /* its set closes from the loop: relay_closed */
  if (lstat(path, &st) == 0) {
    l->dev = st.st_dev;
    l->ino = st.st_ino;
  }
  l->open = 1;
  l->next = s->listeners;
  s->listeners = l;
  s->open_listeners++;
  return 0;
}

int dm_httpd_listen_unix(dm_httpd *s, const char *path, const dm_httpd_listen_opts *o) {
  return listen_unix_with(s, path, o, 0);
}

int dm_httpd_listen_relay(dm_httpd *s, const char *path, const dm_httpd_listen_opts *o) {
  return listen_unix_with(s, path, o, 1);
}

/* An unlistened listener leaves the server's list and is freed once its handle is closed
 * and no connection or relay hand-over refers to it any more. */
static void listener_release(listener *l) {
  if (!l->removed || l->open || l->nconns || l->relay) return;
  dm_httpd *s = l->s;
  for (listener **p = &s->listeners; *p; p = &(*p)->next) {
    if (*p == l) {
      *p = l->next;
      break;
    }
  }
  listener_free(l);
}

static void unlisten_closed(uv_handle_t *h) {
  listener *l = h->data;
  dm_httpd *s = l->s;
  l->open = 0;
  s->open_listeners--;
  listener_release(l);
  maybe_free_server(s);
}

int dm_httpd_unlisten(dm_httpd *s, const char *tag) {
  int n = 0;
  if (s->closing) return 0;
  for (listener *l = s->listeners; l; l = l->next) {
    if (l->removed || !l->open || strcmp(l->tag, tag) != 0) continue;
    l->removed = 1;
    n++;
    if (l->is_unix && l->path) {
      struct stat st;
      if (lstat(l->path, &st) == 0 && st.st_dev == l->dev && st.st_ino == l->ino) unlink(l->path);
    }
    /* l->open stays 1 until the handle is closed: listener_release waits for it */
    uv_close((uv_handle_t *)&l->h, unlisten_closed);
    for (dm_httpd_conn *c = s->conns, *next; c; c = next) {
      next = c->next;
      if (c->l == l) conn_close(c, "listener closed");
    }
    relay_stop(l);
  }
  return n;
}

dm_httpd *dm_httpd_new(uv_loop_t *loop, const dm_httpd_opts *opts, const dm_httpd_handler *handler, void *ud) {
  dm_httpd *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->loop = loop;
  if (opts) s->o = *opts;
  if (!s->o.max_body) s->o.max_body = 4u << 20;
  if (!s->o.max_head) s->o.max_head = 64u << 10;
  if (!s->o.max_output) s->o.max_output = 16u << 20;
  if (!s->o.max_conns) s->o.max_conns = 1024;
  if (!s->o.request_timeout_ms) s->o.request_timeout_ms = 30000;
  if (!s->o.idle_timeout_ms) s->o.idle_timeout_ms = 120000;
  s->error_body = dupstr(s->o.error_body ? s->o.error_body : "%s\n");
  s->error_type = dupstr(s->o.error_type ? s->o.error_type : "text/plain; charset=utf-8");
  s->busy_why =
    dupstr(s->o.max_buffered_why ? s->o.max_buffered_why : "the server holds too many request body bytes at once");
  s->o.error_body = s->o.error_type = s->o.max_buffered_why = NULL;
  if (handler) s->cb = *handler;
  s->ud = ud;
  if (!s->error_body || !s->error_type || !s->busy_why) {
    free(s->error_body);
    free(s->error_type);
    free(s->busy_why);
    free(s);
    return NULL;
  }
  uv_timer_init(loop, &s->closer);
  s->closer.data = NULL;
  return s;
}

void dm_httpd_close(dm_httpd *s) {
  if (s->closing) return;
  s->closing = 1;
  for (listener *l = s->listeners; l; l = l->next) {
    if (!l->open || l->removed) continue; /* an unlistened one is already closing */
    l->open = 0;
    if (l->is_unix && l->path) {
      struct stat st;
      if (lstat(l->path, &st) == 0 && st.st_dev == l->dev && st.st_ino == l->ino) unlink(l->path);
    }
    uv_close((uv_handle_t *)&l->h, listener_closed);
  }
  for (dm_httpd_conn *c = s->conns, *next; c; c = next) {
    next = c->next;
    conn_close(c, "server closing");
  }
  for (listener *l = s->listeners; l; l = l->next) relay_stop(l);
  /* on_closed comes from the loop, after this handle's close callback at the latest */
  s->open_listeners++;
  uv_close((uv_handle_t *)&s->closer, listener_closed);
}
