/* The HTTP engine: libcurl multi on the libuv loop. See http.h for the contract.
 *
 * Shape (the classic curl_multi_socket_action integration):
 *  - curl tells us which sockets to watch (sock_cb) -> one uv_poll per socket;
 *  - curl tells us when to call it back (timer_cb) -> one uv_timer (a 0 ms timeout fires
 *    on the next loop iteration, never synchronously);
 *  - readiness and timeouts go back through curl_multi_socket_action(), after which
 *    finished transfers are collected from curl_multi_info_read().
 * libcurl refuses multi calls from inside its callbacks, and our callers' callbacks run
 * inside those, so adding, cancelling and discarding are queued and done from a uv_async
 * ("wake"). The wake handle is also the engine's only referenced handle while requests
 * are in flight; the poll and timer handles are unreferenced, so an idle engine (or an
 * idle keep-alive connection) never keeps the loop running.
 */
#include "http.h"
#include <curl/curl.h>
#include <ctype.h>
#include <errno.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef CURL_WRITEFUNC_ERROR
#define CURL_WRITEFUNC_ERROR 0
#endif

enum { RQ_QUEUED, RQ_RUNNING, RQ_DONE };

typedef struct dm_http_sock {
  uv_poll_t poll;
  curl_socket_t fd;
  dm_http *h;
  struct dm_http_sock *prev, *next;
} dm_http_sock;

struct dm_http {
  uv_loop_t *loop;
  CURLM *multi;
  uv_timer_t *timer;          /* heap; freed in its close callback */
  uv_async_t *wake;           /* heap; deferred work + keep-alive while requests run */
  dm_http_sock *socks;        /* live poll contexts */
  dm_http_req *reqs;          /* live requests */
  dm_http_req *qhead, *qtail; /* requests with deferred work */
  size_t active;
  int in_curl; /* inside curl_multi_socket_action (and so its callbacks) */
  int closing;
  int open_handles; /* uv handles whose close callback has not run yet */
};

typedef struct {
  char *name;
  char *value;
} hdr;

struct dm_http_req {
  dm_http *h;
  CURL *easy;
  struct curl_slist *slist;
  dm_http_handler cb;
  void *ud;
  int state;
  int cancelled, discarded, queued, ok;
  int stream;
  int fd_in, fd_out;
  char *out_path;
  char *body; /* request body copy (POSTFIELDS points here) */
  long status, parsed_status;
  int head_done;
  hdr *hdrs;
  size_t nhdrs, caphdrs;
  char *buf; /* accumulated response body */
  size_t len, cap;
  uint64_t received, max_body;
  const char *fail_code; /* set when one of our callbacks aborts the transfer */
  char fail_msg[256];
  const char *sock_code; /* the last socket() failure (EMFILE...): reported if the transfer fails */
  char sock_msg[128];
  char errbuf[CURL_ERROR_SIZE];
  dm_http_req *prev, *next, *qnext;
};

static const char *errno_code(int e) { return uv_err_name(uv_translate_sys_error(e)); }

static void set_err(dm_http_err *err, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(dm_http_err *err, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  err->code = code;
}

/* ---- handles and lifetime ---- */

static void maybe_free_engine(dm_http *h) {
  if (h->closing && h->open_handles == 0) free(h);
}

static void handle_closed(uv_handle_t *hd) {
  dm_http *h = hd->data;
  free(hd);
  h->open_handles--;
  maybe_free_engine(h);
}

static void sock_closed(uv_handle_t *hd) {
  dm_http_sock *c = hd->data;
  dm_http *h = c->h;
  free(c);
  h->open_handles--;
  maybe_free_engine(h);
}

static void sock_close(dm_http_sock *c) {
  dm_http *h = c->h;
  if (c->prev) c->prev->next = c->next;
  else h->socks = c->next;
  if (c->next) c->next->prev = c->prev;
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, sock_closed);
}

static void keepalive(dm_http *h) {
  if (h->closing) return;
  if (h->active) uv_ref((uv_handle_t *)h->wake);
  else uv_unref((uv_handle_t *)h->wake);
}

static void enqueue(dm_http_req *r) {
  dm_http *h = r->h;
  if (r->queued) return;
  r->queued = 1;
  r->qnext = NULL;
  if (h->qtail) h->qtail->qnext = r;
  else h->qhead = r;
  h->qtail = r;
  if (!h->closing) uv_async_send(h->wake);
}

static void unqueue(dm_http_req *r) {
  dm_http *h = r->h;
  if (!r->queued) return;
  dm_http_req *prev = NULL;
  for (dm_http_req *q = h->qhead; q; prev = q, q = q->qnext) {
    if (q != r) continue;
    if (prev) prev->qnext = q->qnext;
    else h->qhead = q->qnext;
    if (h->qtail == q) h->qtail = prev;
    break;
  }
  r->queued = 0;
}

static void clear_headers(dm_http_req *r) {
  for (size_t i = 0; i < r->nhdrs; i++) {
    free(r->hdrs[i].name);
    free(r->hdrs[i].value);
  }
  r->nhdrs = 0;
}

/* Frees a request that was never linked into the engine. */
static void req_free_raw(dm_http_req *r) {
  if (r->easy) curl_easy_cleanup(r->easy);
  curl_slist_free_all(r->slist);
  if (r->fd_in >= 0) close(r->fd_in);
  if (r->fd_out >= 0) close(r->fd_out);
  if (r->out_path && !r->ok) unlink(r->out_path); /* no half-written download is left */
  clear_headers(r);
  free(r->hdrs);
  free(r->out_path);
  free(r->body);
  free(r->buf);
  free(r);
}

/* Unlinks and frees a request; must not run inside curl. */
static void req_destroy(dm_http_req *r) {
  dm_http *h = r->h;
  if (r->state == RQ_RUNNING && h->multi) curl_multi_remove_handle(h->multi, r->easy);
  r->state = RQ_DONE;
  unqueue(r);
  if (r->prev) r->prev->next = r->next;
  else h->reqs = r->next;
  if (r->next) r->next->prev = r->prev;
  h->active--;
  keepalive(h);
  req_free_raw(r);
}

/* Completes a request: detaches it from curl, calls on_done once, frees it. */
static void finish(dm_http_req *r, const dm_http_err *err) {
  dm_http *h = r->h;
  if (r->state == RQ_RUNNING && h->multi) curl_multi_remove_handle(h->multi, r->easy);
  r->state = RQ_DONE;
  unqueue(r);
  dm_http_err close_err;
  if (r->fd_out >= 0) {
    if (close(r->fd_out) != 0 && !err) {
      int e = errno;
      set_err(&close_err, errno_code(e), "output_file %s: %s", r->out_path, strerror(e));
      err = &close_err;
    }
    r->fd_out = -1;
  }
  r->ok = err == NULL;
  if (err && r->out_path) unlink(r->out_path); /* before on_done: the caller may look */
  free(r->out_path);                           /* and not again later: on_done may start a new download there */
  r->out_path = NULL;
  if (!r->discarded && r->cb.on_done) r->cb.on_done(r->ud, r, err);
  req_destroy(r);
}

/* ---- curl callbacks for one transfer ---- */

static int abort_with(dm_http_req *r, const char *code, const char *fmt, const char *arg) {
  r->fail_code = code;
  snprintf(r->fail_msg, sizeof r->fail_msg, fmt, arg);
  return 0;
}

/* curl's socket(), watched: when it fails, the failure is reported by its name (EMFILE,
 * ENFILE…) instead of curl's "Couldn't connect to server", which a caller would take for
 * a server that is down. Close-on-exec, so that no child process inherits it. */
static curl_socket_t open_socket_cb(void *ud, curlsocktype purpose, struct curl_sockaddr *a) {
  dm_http_req *r = ud;
  (void)purpose;
  curl_socket_t s = socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
  if (s == CURL_SOCKET_BAD) {
    int e = errno;
    r->sock_code = errno_code(e);
    snprintf(r->sock_msg, sizeof r->sock_msg, "cannot open a socket: %s (%s)", strerror(e), r->sock_code);
  }
  return s;
}

static char *dup_range(const char *p, size_t n) {
  char *s = malloc(n + 1);
  if (!s) return NULL;
  memcpy(s, p, n);
  s[n] = '\0';
  return s;
}

static int add_header(dm_http_req *r, const char *p, size_t n) {
  const char *colon = memchr(p, ':', n);
  if (!colon) return 0;
  size_t nl = (size_t)(colon - p);
  while (nl && (p[nl - 1] == ' ' || p[nl - 1] == '\t')) nl--;
  const char *v = colon + 1, *end = p + n;
  while (v < end && (*v == ' ' || *v == '\t')) v++;
  while (end > v && (end[-1] == ' ' || end[-1] == '\t')) end--;
  if (r->nhdrs == r->caphdrs) {
    size_t cap = r->caphdrs ? r->caphdrs * 2 : 16;
    hdr *nh = realloc(r->hdrs, cap * sizeof *nh);
    if (!nh) return -1;
    r->hdrs = nh;
    r->caphdrs = cap;
  }
  char *name = dup_range(p, nl), *value = dup_range(v, (size_t)(end - v));
  if (!name || !value) {
    free(name);
    free(value);
    return -1;
  }
  for (char *c = name; *c; c++) *c = (char)tolower((unsigned char)*c);
  r->hdrs[r->nhdrs].name = name;
  r->hdrs[r->nhdrs].value = value;
  r->nhdrs++;
  return 0;
}

/* obs-fold: a line starting with SP/HT continues the previous header's value */
static int fold_header(dm_http_req *r, const char *p, size_t n) {
  while (n && (*p == ' ' || *p == '\t')) p++, n--;
  hdr *last = &r->hdrs[r->nhdrs - 1];
  size_t ol = strlen(last->value);
  char *v = realloc(last->value, ol + n + 2);
  if (!v) return -1;
  v[ol] = ' ';
  memcpy(v + ol + 1, p, n);
  v[ol + 1 + n] = '\0';
  last->value = v;
  return 0;
}

static size_t header_cb(char *p, size_t size, size_t nmemb, void *ud) {
  dm_http_req *r = ud;
  size_t len = size * nmemb;
  if (r->cancelled || r->discarded) return 0;
  if (r->head_done) return len; /* trailers of a chunked body */
  if (len >= 5 && memcmp(p, "HTTP/", 5) == 0) {
    clear_headers(r); /* a new response head (after 1xx) */
    const char *sp = memchr(p, ' ', len);
    r->parsed_status = sp ? strtol(sp + 1, NULL, 10) : 0;
    return len;
  }
  size_t n = len;
  while (n && (p[n - 1] == '\r' || p[n - 1] == '\n')) n--;
  if (n == 0) {
    long code = r->parsed_status;
    if (code == 0) curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 100 && code < 200) { /* interim response: the final one follows */
      clear_headers(r);
      return len;
    }
    r->status = code;
    r->head_done = 1;
    if (r->cb.on_headers) r->cb.on_headers(r->ud, r);
    return (r->cancelled || r->discarded) ? 0 : len;
  }
  int rc = ((p[0] == ' ' || p[0] == '\t') && r->nhdrs) ? fold_header(r, p, n) : add_header(r, p, n);
  if (rc != 0) return abort_with(r, "ENOMEM", "http: %s", "out of memory");
  return len;
}

static size_t write_cb(char *p, size_t size, size_t nmemb, void *ud) {
  dm_http_req *r = ud;
  size_t len = size * nmemb;
  if (r->cancelled || r->discarded) return CURL_WRITEFUNC_ERROR;
  r->received += len;
  if (r->max_body && r->received > r->max_body) {
    char cap[32];
    snprintf(cap, sizeof cap, "%llu", (unsigned long long)r->max_body);
    abort_with(r, "E2BIG", "http: response body exceeds max_body_bytes (%s)", cap);
    return CURL_WRITEFUNC_ERROR;
  }
  if (r->fd_out >= 0) {
    size_t off = 0;
    while (off < len) {
      ssize_t k = write(r->fd_out, p + off, len - off);
      if (k < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        r->fail_code = errno_code(e);
        snprintf(r->fail_msg, sizeof r->fail_msg, "output_file %s: %s", r->out_path, strerror(e));
        return CURL_WRITEFUNC_ERROR;
      }
      off += (size_t)k;
    }
  } else if (r->stream) {
    if (r->cb.on_data && len) r->cb.on_data(r->ud, r, p, len);
    if (r->cancelled || r->discarded) return CURL_WRITEFUNC_ERROR;
  } else {
    if (r->len + len + 1 > r->cap) {
      size_t cap = r->cap ? r->cap : 16384;
      while (cap < r->len + len + 1) cap *= 2;
      char *nb = realloc(r->buf, cap);
      if (!nb) {
        abort_with(r, "ENOMEM", "http: %s", "out of memory for the response body");
        return CURL_WRITEFUNC_ERROR;
      }
      r->buf = nb;
      r->cap = cap;
    }
    memcpy(r->buf + r->len, p, len);
    r->len += len;
  }
  return len;
}

static size_t read_cb(char *p, size_t size, size_t nmemb, void *ud) {
  dm_http_req *r = ud;
  if (r->cancelled || r->discarded) return CURL_READFUNC_ABORT;
  for (;;) {
    ssize_t k = read(r->fd_in, p, size * nmemb);
    if (k >= 0) return (size_t)k;
    if (errno == EINTR) continue;
    int e = errno;
    r->fail_code = errno_code(e);
    snprintf(r->fail_msg, sizeof r->fail_msg, "body_file: %s", strerror(e));
    return CURL_READFUNC_ABORT;
  }
}

static int seek_cb(void *ud, curl_off_t off, int origin) {
  dm_http_req *r = ud;
  return lseek(r->fd_in, (off_t)off, origin) < 0 ? CURL_SEEKFUNC_CANTSEEK : CURL_SEEKFUNC_OK;
}

/* ---- completion ---- */

static void complete(dm_http_req *r, CURLcode rc) {
  dm_http_err err;
  const dm_http_err *ep = &err;
  if (r->cancelled) {
    set_err(&err, "ECANCELED", "cancelled");
  } else if (r->fail_code) {
    set_err(&err, r->fail_code, "%s", r->fail_msg);
  } else if (rc == CURLE_OK) {
    ep = NULL;
    if (!r->head_done) {
      curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
      r->head_done = 1;
    }
  } else if (r->sock_code && (rc == CURLE_COULDNT_CONNECT || rc == CURLE_OPERATION_TIMEDOUT)) {
    set_err(&err, r->sock_code, "http: %s", r->sock_msg);
  } else {
    const char *text = r->errbuf[0] ? r->errbuf : curl_easy_strerror(rc);
    const char *code = "EHTTP";
    long oserr = 0;
    switch (rc) {
    case CURLE_OPERATION_TIMEDOUT: code = "ETIMEDOUT"; break;
    case CURLE_COULDNT_RESOLVE_HOST: code = "EAI_NONAME"; break;
    case CURLE_OUT_OF_MEMORY: code = "ENOMEM"; break;
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
      curl_easy_getinfo(r->easy, CURLINFO_OS_ERRNO, &oserr);
      if (oserr > 0) code = errno_code((int)oserr);
      else if (rc == CURLE_COULDNT_CONNECT) code = "ECONNREFUSED";
      break;
    default: break;
    }
    set_err(&err, code, "http: %s", text);
  }
  finish(r, ep);
}

static void check_done(dm_http *h) {
  CURLMsg *m;
  int left;
  while (h->multi && (m = curl_multi_info_read(h->multi, &left))) {
    if (m->msg != CURLMSG_DONE) continue;
    CURLcode rc = m->data.result;
    dm_http_req *r = NULL;
    curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&r);
    if (r) complete(r, rc);
  }
}

static void socket_action(dm_http *h, curl_socket_t fd, int flags) {
  int running;
  h->in_curl++;
  curl_multi_socket_action(h->multi, fd, flags, &running);
  h->in_curl--;
  check_done(h);
}

/* ---- loop integration ---- */

static void poll_cb(uv_poll_t *p, int status, int events) {
  dm_http_sock *c = p->data;
  int flags = 0;
  if (status < 0) flags |= CURL_CSELECT_ERR;
  if (events & UV_READABLE) flags |= CURL_CSELECT_IN;
  if (events & UV_WRITABLE) flags |= CURL_CSELECT_OUT;
  socket_action(c->h, c->fd, flags); /* c may be closed by now */
}

static int sock_cb(CURL *e, curl_socket_t s, int what, void *userp, void *socketp) {
  dm_http *h = userp;
  dm_http_sock *c = socketp;
  if (what == CURL_POLL_REMOVE) {
    if (c) {
      curl_multi_assign(h->multi, s, NULL);
      sock_close(c);
    }
    return 0;
  }
  if (h->closing) return 0;
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return -1;
    if (uv_poll_init_socket(h->loop, &c->poll, s) != 0) {
      free(c);
      return -1;
    }
    c->fd = s;
    c->h = h;
    c->poll.data = c;
    uv_unref((uv_handle_t *)&c->poll);
    h->open_handles++;
    c->next = h->socks;
    if (h->socks) h->socks->prev = c;
    h->socks = c;
    curl_multi_assign(h->multi, s, c);
  }
  int ev = 0;
  if (what & CURL_POLL_IN) ev |= UV_READABLE;
  if (what & CURL_POLL_OUT) ev |= UV_WRITABLE;
  uv_poll_start(&c->poll, ev, poll_cb);
  return 0;
}

static void on_timeout(uv_timer_t *t) { socket_action(t->data, CURL_SOCKET_TIMEOUT, 0); }

static int timer_cb(CURLM *m, long timeout_ms, void *userp) {
  dm_http *h = userp;
  if (h->closing) return 0;
  if (timeout_ms < 0) uv_timer_stop(h->timer);
  else uv_timer_start(h->timer, on_timeout, (uint64_t)timeout_ms, 0); /* 0: next iteration */
  return 0;
}

static void on_wake(uv_async_t *a) {
  dm_http *h = a->data;
  size_t n = 0;
  for (dm_http_req *q = h->qhead; q; q = q->qnext) n++;
  while (n-- && h->qhead) {
    dm_http_req *r = h->qhead;
    unqueue(r);
    if (r->discarded) {
      req_destroy(r);
    } else if (r->cancelled) {
      complete(r, CURLE_OK);
    } else if (r->state == RQ_QUEUED) {
      CURLMcode mc = curl_multi_add_handle(h->multi, r->easy);
      if (mc == CURLM_OK) {
        r->state = RQ_RUNNING;
      } else {
        dm_http_err err;
        set_err(&err, "EHTTP", "http: %s", curl_multi_strerror(mc));
        finish(r, &err);
      }
    }
  }
}

/* ---- public API ---- */

static uv_once_t global_once = UV_ONCE_INIT;
static int global_ok;
static void global_init(void) { global_ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }

dm_http *dm_http_new(uv_loop_t *loop) {
  uv_once(&global_once, global_init);
  if (!global_ok) return NULL;
  dm_http *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  h->loop = loop;
  h->multi = curl_multi_init();
  h->timer = malloc(sizeof *h->timer);
  h->wake = malloc(sizeof *h->wake);
  if (!h->multi || !h->timer || !h->wake) {
    if (h->multi) curl_multi_cleanup(h->multi);
    free(h->timer);
    free(h->wake);
    free(h);
    return NULL;
  }
  curl_multi_setopt(h->multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
  curl_multi_setopt(h->multi, CURLMOPT_SOCKETDATA, h);
  curl_multi_setopt(h->multi, CURLMOPT_TIMERFUNCTION, timer_cb);
  curl_multi_setopt(h->multi, CURLMOPT_TIMERDATA, h);
  uv_timer_init(loop, h->timer);
  h->timer->data = h;
  uv_unref((uv_handle_t *)h->timer);
  uv_async_init(loop, h->wake, on_wake);
  h->wake->data = h;
  uv_unref((uv_handle_t *)h->wake);
  h->open_handles = 2;
  return h;
}

void dm_http_free(dm_http *h) {
  if (!h) return;
  h->closing = 1;
  while (h->reqs) {
    dm_http_req *r = h->reqs;
    if (r->discarded) {
      req_destroy(r);
    } else {
      dm_http_err err;
      set_err(&err, "ECANCELED", "cancelled: the HTTP engine is closing");
      finish(r, &err);
    }
  }
  curl_multi_cleanup(h->multi);
  h->multi = NULL;
  while (h->socks) sock_close(h->socks);
  uv_timer_stop(h->timer);
  uv_close((uv_handle_t *)h->timer, handle_closed);
  uv_close((uv_handle_t *)h->wake, handle_closed);
}

static int valid_header_name(const char *s) {
  if (!*s) return 0;
  for (; *s; s++)
    if (*s <= ' ' || *s == ':' || *s == 0x7f) return 0;
  return 1;
}

static int valid_header_value(const char *s) {
  for (; *s; s++)
    if (*s == '\r' || *s == '\n') return 0;
  return 1;
}

static int build_headers(dm_http_req *r, const dm_http_opts *o, int has_post, dm_http_err *err) {
  int have_expect = 0, have_ctype = 0;
  for (size_t i = 0; i < o->nheaders; i++) {
    const char *n = o->headers[i].name, *v = o->headers[i].value;
    if (!n || !v || !valid_header_name(n) || !valid_header_value(v)) {
      set_err(err, "EINVAL", "http: invalid header '%s'", n ? n : "(null)");
      return -1;
    }
    if (!strcasecmp(n, "expect")) have_expect = 1;
    if (!strcasecmp(n, "content-type")) have_ctype = 1;
    size_t len = strlen(n) + strlen(v) + 3;
    char *line = malloc(len);
    if (!line) goto oom;
    /* "Name;" is curl's spelling of a header with an empty value */
    if (*v) snprintf(line, len, "%s: %s", n, v);
    else snprintf(line, len, "%s;", n);
    struct curl_slist *s = curl_slist_append(r->slist, line);
    free(line);
    if (!s) goto oom;
    r->slist = s;
  }
  /* no "Expect: 100-continue" round trip, and no form content type curl would invent */
  const char *extra[2] = {have_expect ? NULL : "Expect:", (has_post && !have_ctype) ? "Content-Type:" : NULL};
  for (int i = 0; i < 2; i++) {
    if (!extra[i]) continue;
    struct curl_slist *s = curl_slist_append(r->slist, extra[i]);
    if (!s) goto oom;
    r->slist = s;
  }
  return 0;
oom:
  set_err(err, "ENOMEM", "http: out of memory");
  return -1;
}

dm_http_req *dm_http_start(dm_http *h, const dm_http_opts *o, const dm_http_handler *handler, void *ud,
                           dm_http_err *err) {
  if (h->closing) {
    set_err(err, "ECANCELED", "http: the engine is closing");
    return NULL;
  }
  if (!o->url || (o->body && o->body_file) || (o->stream && o->output_file)) {
    set_err(err, "EINVAL", "http: %s", !o->url ? "url is required" : "conflicting body or output options");
    return NULL;
  }
  if ((o->ca_file && o->ca_pem) || !o->cert_pem != !o->key_pem) {
    set_err(err, "EINVAL", "http: %s",
            o->ca_pem ? "ca_file and ca_pem exclude each other" : "cert_pem and key_pem go together");
    return NULL;
  }
  dm_http_req *r = calloc(1, sizeof *r);
  if (!r) {
    set_err(err, "ENOMEM", "http: out of memory");
    return NULL;
  }
  r->h = h;
  r->fd_in = r->fd_out = -1;
  r->cb = *handler;
  r->ud = ud;
  r->stream = o->stream;
  r->max_body = o->max_body_bytes;
  r->state = RQ_QUEUED;
  r->easy = curl_easy_init();
  if (!r->easy) {
    set_err(err, "ENOMEM", "http: out of memory");
    goto fail;
  }
  CURL *e = r->easy;
  CURLcode cc = CURLE_OK;
#define SET(opt, val) \
  do { \
    if (cc == CURLE_OK) cc = curl_easy_setopt(e, opt, val); \
  } while (0)
  SET(CURLOPT_URL, o->url);
  SET(CURLOPT_PROTOCOLS_STR, "http,https");
  SET(CURLOPT_NOSIGNAL, 1L);
  SET(CURLOPT_PRIVATE, (char *)r);
  SET(CURLOPT_ERRORBUFFER, r->errbuf);
  SET(CURLOPT_PROXY, "");          /* never a proxy from the environment */
  SET(CURLOPT_BUFFERSIZE, 65536L); /* fewer, larger on_data chunks and file writes */
  SET(CURLOPT_HEADERFUNCTION, header_cb);
  SET(CURLOPT_HEADERDATA, r);
  SET(CURLOPT_WRITEFUNCTION, write_cb);
  SET(CURLOPT_WRITEDATA, r);
  SET(CURLOPT_OPENSOCKETFUNCTION, open_socket_cb);
  SET(CURLOPT_OPENSOCKETDATA, r);
  if (o->unix_socket) SET(CURLOPT_UNIX_SOCKET_PATH, o->unix_socket);
  if (o->ca_file) SET(CURLOPT_CAINFO, o->ca_file);
  /* PEM from memory: curl copies each blob (CURL_BLOB_COPY), so the caller's strings may go */
  struct curl_blob ca = {(void *)o->ca_pem, o->ca_pem_len, CURL_BLOB_COPY};
  struct curl_blob cert = {(void *)o->cert_pem, o->cert_pem_len, CURL_BLOB_COPY};
  struct curl_blob key = {(void *)o->key_pem, o->key_pem_len, CURL_BLOB_COPY};
  if (o->ca_pem) SET(CURLOPT_CAINFO_BLOB, &ca);
  if (o->insecure) {
    SET(CURLOPT_SSL_VERIFYPEER, 0L);
    SET(CURLOPT_SSL_VERIFYHOST, 0L);
  }
  if (o->cert_pem) {
    SET(CURLOPT_SSLCERT_BLOB, &cert);
    SET(CURLOPT_SSLCERTTYPE, "PEM");
    SET(CURLOPT_SSLKEY_BLOB, &key);
    SET(CURLOPT_SSLKEYTYPE, "PEM");
  }
  if (o->timeout_ms > 0) SET(CURLOPT_TIMEOUT_MS, o->timeout_ms);
  if (o->connect_timeout_ms > 0) SET(CURLOPT_CONNECTTIMEOUT_MS, o->connect_timeout_ms);

  const char *m = o->method ? o->method : "GET";
  int has_body = o->body || o->body_file;
  int has_post = 0;
  if (!has_body && !strcmp(m, "GET")) {
    SET(CURLOPT_HTTPGET, 1L);
  } else if (!has_body && !strcmp(m, "HEAD")) {
    SET(CURLOPT_NOBODY, 1L);
  } else if (!has_body && strcmp(m, "POST") && strcmp(m, "PUT") && strcmp(m, "PATCH")) {
    SET(CURLOPT_HTTPGET, 1L); /* DELETE, OPTIONS...: no body, no Content-Length */
    SET(CURLOPT_CUSTOMREQUEST, m);
  } else {
    has_post = 1;
    SET(CURLOPT_POST, 1L);
    if (o->body_file) {
      r->fd_in = open(o->body_file, O_RDONLY | O_CLOEXEC);
      struct stat st;
      if (r->fd_in < 0 || fstat(r->fd_in, &st) != 0) {
        int en = errno;
        set_err(err, errno_code(en), "body_file %s: %s", o->body_file, strerror(en));
        goto fail;
      }
      if (!S_ISREG(st.st_mode)) {
        set_err(err, "EINVAL", "body_file %s: not a regular file", o->body_file);
        goto fail;
      }
      SET(CURLOPT_READFUNCTION, read_cb);
      SET(CURLOPT_READDATA, r);
      SET(CURLOPT_SEEKFUNCTION, seek_cb);
      SET(CURLOPT_SEEKDATA, r);
      SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)st.st_size);
    } else {
      r->body = malloc(o->body_len ? o->body_len : 1);
      if (!r->body) {
        set_err(err, "ENOMEM", "http: out of memory");
        goto fail;
      }
      if (o->body_len) memcpy(r->body, o->body, o->body_len);
      SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)o->body_len);
      SET(CURLOPT_POSTFIELDS, r->body);
    }
    if (strcmp(m, "POST")) SET(CURLOPT_CUSTOMREQUEST, m);
  }
  if (build_headers(r, o, has_post, err) != 0) goto fail;
  if (r->slist) SET(CURLOPT_HTTPHEADER, r->slist);
#undef SET
  if (cc != CURLE_OK) {
    set_err(err, "EINVAL", "http: %s", curl_easy_strerror(cc));
    goto fail;
  }
  if (o->output_file) {
    r->out_path = strdup(o->output_file);
    if (!r->out_path) {
      set_err(err, "ENOMEM", "http: out of memory");
      goto fail;
    }
    r->fd_out = open(o->output_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (r->fd_out < 0) {
      int en = errno;
      set_err(err, errno_code(en), "output_file %s: %s", o->output_file, strerror(en));
      free(r->out_path); /* not ours to unlink: we did not create it */
      r->out_path = NULL;
      goto fail;
    }
  }
  r->next = h->reqs;
  if (h->reqs) h->reqs->prev = r;
  h->reqs = r;
  h->active++;
  keepalive(h);
  enqueue(r); /* curl_multi_add_handle runs from the loop, outside any curl callback */
  return r;
fail:
  req_free_raw(r);
  return NULL;
}

void dm_http_cancel(dm_http_req *r) {
  if (r->state == RQ_DONE || r->cancelled || r->discarded) return;
  r->cancelled = 1;
  enqueue(r);
}

void dm_http_discard(dm_http_req *r) {
  r->discarded = 1;
  r->ud = NULL;
  if (r->state == RQ_DONE) return; /* inside on_done: freed when it returns */
  if (r->h->in_curl) enqueue(r);
  else req_destroy(r);
}

long dm_http_status(const dm_http_req *r) { return r->head_done ? r->status : 0; }

size_t dm_http_header_count(const dm_http_req *r) { return r->nhdrs; }

int dm_http_header_at(const dm_http_req *r, size_t i, const char **name, const char **value) {
  if (i >= r->nhdrs) return -1;
  *name = r->hdrs[i].name;
  *value = r->hdrs[i].value;
  return 0;
}

const char *dm_http_body(const dm_http_req *r, size_t *len) {
  *len = r->len;
  return r->buf ? r->buf : "";
}

size_t dm_http_active(const dm_http *h) { return h->active; }
