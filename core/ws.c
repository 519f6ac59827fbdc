/* The WebSocket client engine: libcurl (connect only) + llhttp + RFC 6455 framing on the
 * libuv loop. See ws.h for the contract.
 *
 * Phases: CONNECTING (a private curl multi does TCP + TLS, driven by uv_poll/uv_timer),
 * HANDSHAKE (our Upgrade request out, the 101 answer in through llhttp), OPEN, CLOSING (a
 * close frame sent or received), DEAD (the last callback was made or the owner discarded
 * it). Every uv callback runs between enter() and leave(): the connection is torn down
 * only by leave() at depth 0, so a handler may discard it from inside a callback.
 */
#include "ws.h"
#include "ws_frame.h"
#include <curl/curl.h>
#include <llhttp.h>
#include <openssl/rand.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

enum { ST_CONNECTING, ST_HANDSHAKE, ST_OPEN, ST_CLOSING, ST_DEAD };

typedef struct cpoll { /* a socket curl watches while connecting */
  uv_poll_t poll;
  curl_socket_t fd;
  dm_ws *ws;
  struct cpoll *next;
} cpoll;

struct dm_ws {
  uv_loop_t *loop;
  CURLM *multi;
  CURL *easy;
  dm_ws_handler cb;
  void *ud;
  int state, depth, discarded, torn, open_handles;
  cpoll *cpolls;
  uv_timer_t ctimer;   /* curl's timer while connecting */
  uv_timer_t deadline; /* handshake timeout, then the close wait, or a deferred end */
  uv_poll_t poll;      /* the connection's socket, once curl connected */
  int poll_on, poll_events;
  long timeout_ms, close_timeout_ms;
  uint8_t *out; /* bytes to send: out[off .. len) */
  size_t out_off, out_len, out_cap;
  /* the bytes being written: a write that would block is retried with the same pointer and
   * length, as OpenSSL demands of SSL_write (no SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER) */
  uint8_t stage[16384];
  size_t stage_off, stage_len;
  char *request; /* the Upgrade request, until the connection is made */
  char key[25];
  char **protocols;
  size_t nprotocols;
  /* the 101 answer */
  llhttp_t parser;
  llhttp_settings_t settings;
  char field[64], value[512];
  size_t field_len, value_len;
  int in_value, head_done;
  char accept[64], protocol[128], upgrade[32];
  dm_ws_decoder dec;
  /* the end, when it is deferred (dm_ws_close before open, close wait) */
  int pending_close_code;
  char errbuf[CURL_ERROR_SIZE];
};

static void set_err(dm_ws_err *err, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(dm_ws_err *err, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  err->code = code;
  err->status = 0;
}

static void on_poll(uv_poll_t *p, int status, int events);
static void check_connected(dm_ws *ws);

/* ---- lifetime ---- */

static void maybe_free(dm_ws *ws) {
  if (!ws->torn || ws->open_handles) return;
  dm_ws_decoder_free(&ws->dec);
  free(ws->out);
  free(ws->request);
  for (size_t i = 0; i < ws->nprotocols; i++) free(ws->protocols[i]);
  free(ws->protocols);
  free(ws);
}

static void handle_closed(uv_handle_t *h) {
  dm_ws *ws = h->data;
  ws->open_handles--;
  maybe_free(ws);
}

static void cpoll_closed(uv_handle_t *h) {
  cpoll *c = h->data;
  dm_ws *ws = c->ws;
  free(c);
  ws->open_handles--;
  maybe_free(ws);
}

static void cpolls_close(dm_ws *ws) {
  while (ws->cpolls) {
    cpoll *c = ws->cpolls;
    ws->cpolls = c->next;
    uv_poll_stop(&c->poll);
    uv_close((uv_handle_t *)&c->poll, cpoll_closed);
  }
}

/* Stops every watcher, closes the socket (curl owns it) and frees the memory once the
 * handles' close callbacks ran. Never inside curl, never at depth > 0. */
static void teardown(dm_ws *ws) {
  if (ws->torn) return;
  ws->torn = 1;
  ws->state = ST_DEAD;
  cpolls_close(ws);
  if (ws->poll_on) uv_poll_stop(&ws->poll);
  uv_timer_stop(&ws->ctimer);
  uv_timer_stop(&ws->deadline);
  if (ws->multi) {
    curl_multi_remove_handle(ws->multi, ws->easy);
    curl_easy_cleanup(ws->easy);
    curl_multi_cleanup(ws->multi);
    ws->multi = NULL;
    ws->easy = NULL;
  }
  uv_close((uv_handle_t *)&ws->ctimer, handle_closed);
  uv_close((uv_handle_t *)&ws->deadline, handle_closed);
  if (ws->poll_on) uv_close((uv_handle_t *)&ws->poll, handle_closed);
  else ws->open_handles--; /* counted at creation, never initialised */
}

static void enter(dm_ws *ws) { ws->depth++; }

static void leave(dm_ws *ws) {
  if (--ws->depth == 0 && ws->state == ST_DEAD) teardown(ws);
}

/* The end of the connection: the one terminal callback, then teardown at depth 0. */
static void end_error(dm_ws *ws, const dm_ws_err *err) {
  if (ws->state == ST_DEAD) return;
  ws->state = ST_DEAD;
  if (!ws->discarded && ws->cb.on_error) ws->cb.on_error(ws->ud, ws, err);
}

static void end_close(dm_ws *ws, int code, const char *reason, size_t len) {
  if (ws->state == ST_DEAD) return;
  ws->state = ST_DEAD;
  if (!ws->discarded && ws->cb.on_close) ws->cb.on_close(ws->ud, ws, code, reason, len);
}

static void fail(dm_ws *ws, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(dm_ws *ws, const char *code, const char *fmt, ...) {
  dm_ws_err err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err.msg, sizeof err.msg, fmt, ap);
  va_end(ap);
  err.code = code;
  err.status = 0;
  end_error(ws, &err);
}

/* ---- the send queue ---- */

static int out_reserve(dm_ws *ws, size_t n) {
  if (ws->out_off == ws->out_len) ws->out_off = ws->out_len = 0;
  if (ws->out_len + n <= ws->out_cap) return 0;
  if (ws->out_off) {
    memmove(ws->out, ws->out + ws->out_off, ws->out_len - ws->out_off);
    ws->out_len -= ws->out_off;
    ws->out_off = 0;
  }
  size_t cap = ws->out_cap ? ws->out_cap : 4096;
  while (cap < ws->out_len + n) cap *= 2;
  if (cap == ws->out_cap) return 0;
  uint8_t *p = realloc(ws->out, cap);
  if (!p) return -1;
  ws->out = p;
  ws->out_cap = cap;
  return 0;
}

static void update_poll(dm_ws *ws) {
  if (!ws->poll_on || ws->state == ST_DEAD) return;
  int ev = UV_READABLE | (dm_ws_queued(ws) ? UV_WRITABLE : 0);
  if (ev == ws->poll_events) return;
  ws->poll_events = ev;
  uv_poll_start(&ws->poll, ev, on_poll);
}

/* Queues one frame with a fresh random mask. */
static int queue_frame(dm_ws *ws, int opcode, const uint8_t *data, size_t len) {
  uint8_t mask[4];
  if (RAND_bytes(mask, sizeof mask) != 1) return -1;
  size_t n = dm_ws_header_len(len) + len;
  if (out_reserve(ws, n) < 0) return -1;
  ws->out_len += dm_ws_encode(ws->out + ws->out_len, opcode, 1, mask, data, len);
  update_poll(ws);
  return 0;
}

static int queue_close(dm_ws *ws, int code, const char *reason, size_t len) {
  uint8_t payload[125];
  size_t n = dm_ws_close_payload(payload, code, reason, len);
  return queue_frame(ws, DM_WS_CLOSE, payload, n);
}

/* Writes what is queued until the socket would block. Returns 0, or -1 after ending. */
static int flush(dm_ws *ws) {
  for (;;) {
    if (ws->stage_off == ws->stage_len) { /* the next piece of the queue */
      size_t k = ws->out_len - ws->out_off;
      if (k > sizeof ws->stage) k = sizeof ws->stage;
      if (k == 0) break;
      memcpy(ws->stage, ws->out + ws->out_off, k);
      ws->out_off += k;
      ws->stage_off = 0;
      ws->stage_len = k;
    }
    size_t n = 0;
    CURLcode rc = curl_easy_send(ws->easy, ws->stage + ws->stage_off, ws->stage_len - ws->stage_off, &n);
    if (rc == CURLE_AGAIN) break;
    if (rc != CURLE_OK) {
      fail(ws, "EIO", "ws: send: %s", curl_easy_strerror(rc));
      return -1;
    }
    ws->stage_off += n;
  }
  update_poll(ws);
  return 0;
}

/* ---- frames in ---- */

static void on_close_frame(dm_ws *ws, const dm_ws_msg *m) {
  int code;
  const uint8_t *reason;
  size_t rlen;
  if (dm_ws_close_parse(m->data, m->len, &code, &reason, &rlen) < 0) {
    queue_close(ws, DM_WS_CLOSE_PROTOCOL, NULL, 0);
    flush(ws);
    fail(ws, "EPROTO", "ws: protocol error: a close frame with an invalid payload (RFC 6455 7.4)");
    return;
  }
  if (ws->state == ST_OPEN) { /* the server starts the close: echo its code (5.5.1) */
    queue_close(ws, code == DM_WS_CLOSE_NO_STATUS ? 0 : code, NULL, 0);
    flush(ws);
  }
  end_close(ws, code, (const char *)reason, rlen);
}

/* Handles what the decoder has; returns -1 once the connection ended. */
static int drain_frames(dm_ws *ws) {
  for (;;) {
    dm_ws_msg m;
    const char *why;
    int code;
    int r = dm_ws_next(&ws->dec, &m, &why, &code);
    if (r == DM_WS_NEED) return 0;
    if (r == DM_WS_FAIL) {
      queue_close(ws, code, NULL, 0);
      flush(ws);
      fail(ws, code == DM_WS_CLOSE_TOO_BIG ? "E2BIG" : "EPROTO", "ws: protocol error: %s", why);
      return -1;
    }
    if (m.opcode == DM_WS_CLOSE) {
      on_close_frame(ws, &m);
      return -1;
    }
    if (m.opcode == DM_WS_PING) {
      if (ws->state == ST_OPEN && queue_frame(ws, DM_WS_PONG, m.data, m.len) < 0) {
        fail(ws, "ENOMEM", "ws: out of memory");
        return -1;
      }
      continue;
    }
    if (m.opcode == DM_WS_PONG || ws->state != ST_OPEN) continue; /* after our close: dropped */
    if (ws->cb.on_message && !ws->discarded) ws->cb.on_message(ws->ud, ws, m.data, m.len, m.opcode == DM_WS_BINARY);
    if (ws->state == ST_DEAD) return -1;
  }
}

/* ---- the handshake answer (llhttp) ---- */

/* Copies a NUL-terminated string, cut to fit. */
static void copy_cut(char *dst, size_t cap, const char *src) {
  size_t n = strlen(src);
  if (n >= cap) n = cap - 1;
  memcpy(dst, src, n);
  dst[n] = 0;
}

static void header_done(dm_ws *ws) {
  if (!ws->field_len) return;
  ws->field[ws->field_len] = 0;
  ws->value[ws->value_len] = 0;
  if (!strcasecmp(ws->field, "sec-websocket-accept")) copy_cut(ws->accept, sizeof ws->accept, ws->value);
  else if (!strcasecmp(ws->field, "sec-websocket-protocol")) copy_cut(ws->protocol, sizeof ws->protocol, ws->value);
  else if (!strcasecmp(ws->field, "upgrade")) copy_cut(ws->upgrade, sizeof ws->upgrade, ws->value);
  ws->field_len = ws->value_len = 0;
  ws->in_value = 0;
}

static void append_span(char *buf, size_t cap, size_t *len, const char *at, size_t n) {
  if (*len + n > cap - 1) n = cap - 1 - *len; /* longer values are cut; none we read is long */
  memcpy(buf + *len, at, n);
  *len += n;
}

static int on_field(llhttp_t *p, const char *at, size_t n) {
  dm_ws *ws = p->data;
  if (ws->in_value) header_done(ws);
  append_span(ws->field, sizeof ws->field, &ws->field_len, at, n);
  return 0;
}

static int on_value(llhttp_t *p, const char *at, size_t n) {
  dm_ws *ws = p->data;
  ws->in_value = 1;
  append_span(ws->value, sizeof ws->value, &ws->value_len, at, n);
  return 0;
}

static int on_headers_complete(llhttp_t *p) {
  dm_ws *ws = p->data;
  header_done(ws);
  ws->head_done = 1;
  return HPE_PAUSED;
}

/* Checks a complete 101 answer (RFC 6455 4.1, the client's checks). NULL when it is good. */
static const char *check_answer(dm_ws *ws, char *why, size_t cap) {
  int status = ws->parser.status_code;
  if (status != 101) {
    snprintf(why, cap, "ws: handshake refused: HTTP %d %s", status, llhttp_status_name((llhttp_status_t)status));
    return "EHANDSHAKE";
  }
  char want[29];
  if (strcasecmp(ws->upgrade, "websocket"))
    snprintf(why, cap, "ws: bad handshake: no Upgrade: websocket in the 101 answer");
  else if (dm_ws_accept(ws->key, want) < 0) snprintf(why, cap, "ws: bad handshake: SHA-1 failed");
  else if (strcmp(ws->accept, want)) snprintf(why, cap, "ws: bad handshake: wrong Sec-WebSocket-Accept");
  else {
    int offered = !ws->protocol[0];
    for (size_t i = 0; i < ws->nprotocols && !offered; i++) offered = !strcmp(ws->protocols[i], ws->protocol);
    if (offered) return NULL;
    snprintf(why, cap, "ws: bad handshake: the server chose the subprotocol %s, which was not offered", ws->protocol);
  }
  return "EHANDSHAKE";
}

/* Feeds answer bytes; on the end of the head, opens (and hands the rest to the decoder). */
static int handshake_in(dm_ws *ws, const uint8_t *data, size_t len) {
  llhttp_errno_t e = llhttp_execute(&ws->parser, (const char *)data, len);
  if (e == HPE_OK && !ws->head_done) return 0;
  if (!ws->head_done) {
    fail(ws, "EHANDSHAKE", "ws: bad handshake: %s", llhttp_get_error_reason(&ws->parser));
    return -1;
  }
  char why[256];
  dm_ws_err err;
  const char *code = check_answer(ws, why, sizeof why);
  if (code) {
    set_err(&err, code, "%s", why);
    err.status = ws->parser.status_code;
    end_error(ws, &err);
    return -1;
  }
  size_t used = (size_t)((const uint8_t *)llhttp_get_error_pos(&ws->parser) - data);
  uv_timer_stop(&ws->deadline);
  ws->state = ST_OPEN;
  if (ws->cb.on_open && !ws->discarded) ws->cb.on_open(ws->ud, ws, ws->protocol);
  if (ws->state == ST_DEAD) return -1;
  if (dm_ws_feed(&ws->dec, data + used, len - used) < 0) {
    fail(ws, "ENOMEM", "ws: out of memory");
    return -1;
  }
  return drain_frames(ws);
}

/* Reads until the socket would block. */
static void read_all(dm_ws *ws) {
  uint8_t buf[65536];
  while (ws->state != ST_DEAD) {
    size_t n = 0;
    CURLcode rc = curl_easy_recv(ws->easy, buf, sizeof buf, &n);
    if (rc == CURLE_AGAIN) return;
    if (rc != CURLE_OK) return fail(ws, "EIO", "ws: receive: %s", curl_easy_strerror(rc));
    if (n == 0) {
      if (ws->state == ST_HANDSHAKE)
        return fail(ws, "EHANDSHAKE", "ws: bad handshake: the server closed the connection");
      return end_close(ws, DM_WS_CLOSE_ABNORMAL, "the connection ended without a close frame", 42);
    }
    if (ws->state == ST_HANDSHAKE) {
      if (handshake_in(ws, buf, n) < 0) return;
      continue;
    }
    if (dm_ws_feed(&ws->dec, buf, n) < 0) return fail(ws, "ENOMEM", "ws: out of memory");
    if (drain_frames(ws) < 0) return;
  }
}

static void on_poll(uv_poll_t *p, int status, int events) {
  dm_ws *ws = p->data;
  enter(ws);
  if (ws->pending_close_code) { /* dm_ws_close before open: the deadline ends it */
    uv_poll_stop(p);
    ws->poll_events = 0;
    leave(ws);
    return;
  }
  if (status < 0) fail(ws, "EIO", "ws: poll: %s", uv_strerror(status));
  if (ws->state != ST_DEAD && (events & UV_WRITABLE)) flush(ws);
  if (ws->state != ST_DEAD && (events & (UV_READABLE | UV_DISCONNECT))) read_all(ws);
  leave(ws);
}

/* ---- connecting (curl multi) ---- */

static void on_cpoll(uv_poll_t *p, int status, int events) {
  cpoll *c = p->data;
  dm_ws *ws = c->ws;
  int flags = status < 0 ? CURL_CSELECT_ERR : 0;
  if (events & UV_READABLE) flags |= CURL_CSELECT_IN;
  if (events & UV_WRITABLE) flags |= CURL_CSELECT_OUT;
  int running;
  enter(ws);
  curl_multi_socket_action(ws->multi, c->fd, flags, &running);
  check_connected(ws);
  leave(ws);
}

static int sock_cb(CURL *e, curl_socket_t fd, int what, void *userp, void *socketp) {
  (void)e;
  (void)socketp;
  dm_ws *ws = userp;
  cpoll **pp = &ws->cpolls;
  while (*pp && (*pp)->fd != fd) pp = &(*pp)->next;
  cpoll *c = *pp;
  if (what == CURL_POLL_REMOVE || ws->state != ST_CONNECTING) {
    if (c) {
      *pp = c->next;
      uv_poll_stop(&c->poll);
      uv_close((uv_handle_t *)&c->poll, cpoll_closed);
    }
    return 0;
  }
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c || uv_poll_init_socket(ws->loop, &c->poll, fd) < 0) {
      free(c);
      return -1;
    }
    c->fd = fd;
    c->ws = ws;
    c->poll.data = c;
    c->next = ws->cpolls;
    ws->cpolls = c;
    ws->open_handles++;
  }
  int ev = (what & CURL_POLL_IN ? UV_READABLE : 0) | (what & CURL_POLL_OUT ? UV_WRITABLE : 0);
  uv_poll_start(&c->poll, ev, on_cpoll);
  return 0;
}

static void on_ctimer(uv_timer_t *t) {
  dm_ws *ws = t->data;
  int running;
  enter(ws);
  curl_multi_socket_action(ws->multi, CURL_SOCKET_TIMEOUT, 0, &running);
  check_connected(ws);
  leave(ws);
}

static int timer_cb(CURLM *m, long ms, void *userp) {
  (void)m;
  dm_ws *ws = userp;
  if (ms < 0) uv_timer_stop(&ws->ctimer);
  else uv_timer_start(&ws->ctimer, on_ctimer, (uint64_t)ms, 0);
  return 0;
}

static const char *curl_code(CURL *e, CURLcode rc) {
  long oserr = 0;
  switch (rc) {
  case CURLE_OPERATION_TIMEDOUT: return "ETIMEDOUT";
  case CURLE_COULDNT_RESOLVE_HOST: return "EAI_NONAME";
  case CURLE_OUT_OF_MEMORY: return "ENOMEM";
  case CURLE_COULDNT_CONNECT:
    curl_easy_getinfo(e, CURLINFO_OS_ERRNO, &oserr);
    return oserr > 0 ? uv_err_name(uv_translate_sys_error((int)oserr)) : "ECONNREFUSED";
  case CURLE_SSL_CONNECT_ERROR:
  case CURLE_PEER_FAILED_VERIFICATION:
  case CURLE_SSL_CERTPROBLEM:
  case CURLE_SSL_CACERT_BADFILE: return "ETLS";
  default: return "EIO";
  }
}

/* After curl ran: once connected, hand the socket to our own poll and send the request. */
static void check_connected(dm_ws *ws) {
  CURLMsg *m;
  int left;
  while (ws->state == ST_CONNECTING && (m = curl_multi_info_read(ws->multi, &left))) {
    if (m->msg != CURLMSG_DONE) continue;
    CURLcode rc = m->data.result;
    if (rc != CURLE_OK) {
      fail(ws, curl_code(ws->easy, rc), "ws: %s", ws->errbuf[0] ? ws->errbuf : curl_easy_strerror(rc));
      return;
    }
    curl_socket_t fd = CURL_SOCKET_BAD;
    curl_easy_getinfo(ws->easy, CURLINFO_ACTIVESOCKET, &fd);
    ws->state = ST_HANDSHAKE;
    cpolls_close(ws);
    int r = fd == CURL_SOCKET_BAD ? UV_EBADF : uv_poll_init_socket(ws->loop, &ws->poll, fd);
    if (r < 0) {
      fail(ws, "EIO", "ws: cannot watch the socket: %s", uv_strerror(r));
      return;
    }
    ws->poll.data = ws;
    ws->poll_on = 1;
    size_t n = strlen(ws->request);
    if (out_reserve(ws, n) < 0) return fail(ws, "ENOMEM", "ws: out of memory");
    memcpy(ws->out + ws->out_len, ws->request, n);
    ws->out_len += n;
    free(ws->request);
    ws->request = NULL;
    update_poll(ws);
  }
}

static void on_deadline(uv_timer_t *t) {
  dm_ws *ws = t->data;
  enter(ws);
  if (ws->pending_close_code > 0) end_close(ws, ws->pending_close_code, "closed before the handshake", 27);
  else if (ws->state == ST_CLOSING) end_close(ws, DM_WS_CLOSE_ABNORMAL, "no close frame from the server in time", 38);
  else fail(ws, "ETIMEDOUT", "ws: no WebSocket connection after %ld ms", ws->timeout_ms);
  leave(ws);
}

/* ---- public API ---- */

static uv_once_t global_once = UV_ONCE_INIT;
static int global_ok;
static void global_init(void) { global_ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }

static int has_crlf(const char *s) { return strpbrk(s, "\r\n") != NULL; }

/* "ws://h:p/x?q" -> "http://h:p/x?q" (curl connects to it), or NULL. */
static char *http_url(const char *url) {
  const char *rest = NULL, *scheme = NULL;
  if (!strncasecmp(url, "ws://", 5)) rest = url + 5, scheme = "http://";
  else if (!strncasecmp(url, "wss://", 6)) rest = url + 6, scheme = "https://";
  else if (!strncasecmp(url, "http://", 7)) rest = url + 7, scheme = "http://";
  else if (!strncasecmp(url, "https://", 8)) rest = url + 8, scheme = "https://";
  if (!rest || has_crlf(url)) return NULL;
  size_t n = strlen(scheme) + strlen(rest) + 1;
  char *s = malloc(n);
  if (s) snprintf(s, n, "%s%s", scheme, rest);
  return s;
}

/* The Upgrade request (RFC 6455 4.1) for `url` (http form), or NULL with err. */
static char *build_request(dm_ws *ws, const char *url, const dm_ws_opts *o, dm_ws_err *err) {
  CURLU *u = curl_url();
  char *host = NULL, *port = NULL, *path = NULL, *query = NULL, *req = NULL;
  size_t len = 0;
  if (!u || curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK ||
      curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK) {
    set_err(err, "EINVAL", "ws: bad URL %s", o->url);
    goto out;
  }
  curl_url_get(u, CURLUPART_PORT, &port, 0);
  curl_url_get(u, CURLUPART_PATH, &path, 0);
  curl_url_get(u, CURLUPART_QUERY, &query, 0);
  FILE *f = open_memstream(&req, &len);
  if (!f) {
    set_err(err, "ENOMEM", "ws: out of memory");
    goto out;
  }
  fprintf(f, "GET %s%s%s HTTP/1.1\r\nHost: %s%s%s\r\n", path ? path : "/", query ? "?" : "", query ? query : "", host,
          port ? ":" : "", port ? port : "");
  fprintf(f, "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n",
          ws->key);
  for (size_t i = 0; i < o->nprotocols; i++)
    fprintf(f, "%s%s%s", i ? ", " : "Sec-WebSocket-Protocol: ", o->protocols[i], i + 1 == o->nprotocols ? "\r\n" : "");
  for (size_t i = 0; i < o->nheaders; i++) fprintf(f, "%s: %s\r\n", o->headers[i].name, o->headers[i].value);
  fputs("\r\n", f);
  if (fclose(f) != 0) {
    free(req);
    req = NULL;
    set_err(err, "ENOMEM", "ws: out of memory");
  }
out:
  curl_free(host);
  curl_free(port);
  curl_free(path);
  curl_free(query);
  curl_url_cleanup(u);
  return req;
}

static const char *check_opts(const dm_ws_opts *o) {
  for (size_t i = 0; i < o->nheaders; i++)
    if (!*o->headers[i].name || has_crlf(o->headers[i].name) || strchr(o->headers[i].name, ':') ||
        has_crlf(o->headers[i].value))
      return "a header name or value holds CR, LF or ':' (or the name is empty)";
  for (size_t i = 0; i < o->nprotocols; i++)
    if (!*o->protocols[i] || strpbrk(o->protocols[i], "\r\n ,;\t"))
      return "a subprotocol is empty or holds a separator";
  return NULL;
}

static CURLcode set_blob(CURL *e, CURLoption opt, const char *data, size_t len) {
  if (!data) return CURLE_OK;
  struct curl_blob b = {(void *)data, len, CURL_BLOB_COPY};
  return curl_easy_setopt(e, opt, &b);
}

static CURLcode setup_easy(dm_ws *ws, const char *url, const dm_ws_opts *o) {
  CURL *e = ws->easy;
  CURLcode c = CURLE_OK;
#define SET(opt, val) \
  if (c == CURLE_OK) c = curl_easy_setopt(e, opt, val)
  SET(CURLOPT_URL, url);
  SET(CURLOPT_CONNECT_ONLY, 1L);
  SET(CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1); /* never HTTP/2 (RFC 8441) */
  SET(CURLOPT_SSL_ENABLE_ALPN, 0L);
  SET(CURLOPT_NOSIGNAL, 1L);
  SET(CURLOPT_PROXY, ""); /* never a proxy from the environment */
  SET(CURLOPT_CONNECTTIMEOUT_MS, ws->timeout_ms);
  SET(CURLOPT_ERRORBUFFER, ws->errbuf);
  if (c == CURLE_OK) c = set_blob(e, CURLOPT_CAINFO_BLOB, o->ca_pem, o->ca_len);
  if (c == CURLE_OK) c = set_blob(e, CURLOPT_SSLCERT_BLOB, o->cert_pem, o->cert_len);
  if (c == CURLE_OK) c = set_blob(e, CURLOPT_SSLKEY_BLOB, o->key_pem, o->key_len);
  if (o->cert_pem) SET(CURLOPT_SSLCERTTYPE, "PEM");
  if (o->key_pem) SET(CURLOPT_SSLKEYTYPE, "PEM");
#undef SET
  return c;
}

/* Copies what the connection keeps of the options; 0, or -1 when out of memory. */
static int copy_opts(dm_ws *ws, const dm_ws_opts *o) {
  ws->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 30000;
  ws->close_timeout_ms = o->close_timeout_ms > 0 ? o->close_timeout_ms : 2000;
  ws->dec.max_message = o->max_message ? o->max_message : (uint64_t)64 << 20;
  if (o->nprotocols && !(ws->protocols = calloc(o->nprotocols, sizeof *ws->protocols))) return -1;
  for (size_t i = 0; i < o->nprotocols; i++, ws->nprotocols++)
    if (!(ws->protocols[i] = strdup(o->protocols[i]))) return -1;
  uint8_t rnd[16];
  if (RAND_bytes(rnd, sizeof rnd) != 1) return -1;
  dm_ws_key(rnd, ws->key);
  llhttp_settings_init(&ws->settings);
  ws->settings.on_header_field = on_field;
  ws->settings.on_header_value = on_value;
  ws->settings.on_headers_complete = on_headers_complete;
  llhttp_init(&ws->parser, HTTP_RESPONSE, &ws->settings);
  ws->parser.data = ws;
  return 0;
}

dm_ws *dm_ws_connect(uv_loop_t *loop, const dm_ws_opts *o, const dm_ws_handler *handler, void *ud, dm_ws_err *err) {
  uv_once(&global_once, global_init);
  const char *bad = check_opts(o);
  if (bad) return set_err(err, "EINVAL", "ws: %s", bad), NULL;
  char *url = o->url ? http_url(o->url) : NULL;
  if (!url) return set_err(err, "EINVAL", "ws: the URL must be ws://, wss://, http:// or https://"), NULL;
  dm_ws *ws = calloc(1, sizeof *ws);
  if (!global_ok || !ws || copy_opts(ws, o) < 0 || !(ws->multi = curl_multi_init()) || !(ws->easy = curl_easy_init())) {
    set_err(err, "ENOMEM", "ws: out of memory, or libcurl failed to start");
    goto fail_raw;
  }
  if (!(ws->request = build_request(ws, url, o, err))) goto fail_raw;
  CURLcode c = setup_easy(ws, url, o);
  if (c != CURLE_OK) {
    set_err(err, "EINVAL", "ws: %s", curl_easy_strerror(c));
    goto fail_raw;
  }
  free(url);
  ws->loop = loop;
  ws->cb = *handler;
  ws->ud = ud;
  uv_timer_init(loop, &ws->ctimer);
  uv_timer_init(loop, &ws->deadline);
  ws->ctimer.data = ws->deadline.data = ws;
  ws->open_handles = 3; /* ctimer, deadline, poll (initialised once connected) */
  curl_multi_setopt(ws->multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
  curl_multi_setopt(ws->multi, CURLMOPT_SOCKETDATA, ws);
  curl_multi_setopt(ws->multi, CURLMOPT_TIMERFUNCTION, timer_cb);
  curl_multi_setopt(ws->multi, CURLMOPT_TIMERDATA, ws);
  uv_timer_start(&ws->deadline, on_deadline, (uint64_t)ws->timeout_ms, 0);
  if (curl_multi_add_handle(ws->multi, ws->easy) != CURLM_OK) {
    set_err(err, "ENOMEM", "ws: libcurl refused the connection");
    ws->discarded = 1;
    teardown(ws);
    return NULL;
  }
  return ws;
fail_raw:
  free(url);
  if (ws) {
    if (ws->easy) curl_easy_cleanup(ws->easy);
    if (ws->multi) curl_multi_cleanup(ws->multi);
    ws->torn = 1;
    ws->open_handles = 0;
    maybe_free(ws);
  }
  return NULL;
}

int dm_ws_send(dm_ws *ws, const uint8_t *data, size_t len, int binary, dm_ws_err *err) {
  if (ws->state < ST_OPEN) return set_err(err, "ENOTCONN", "ws: not open yet"), -1;
  if (ws->state > ST_OPEN) return set_err(err, "ECLOSED", "ws: closing or closed"), -1;
  if (len > ws->dec.max_message) return set_err(err, "E2BIG", "ws: a message larger than max_message"), -1;
  if (queue_frame(ws, binary ? DM_WS_BINARY : DM_WS_TEXT, data, len) < 0)
    return set_err(err, "ENOMEM", "ws: out of memory"), -1;
  return 0;
}

void dm_ws_close(dm_ws *ws, int code, const char *reason, size_t reason_len) {
  if (ws->state == ST_CONNECTING || ws->state == ST_HANDSHAKE) {
    if (ws->pending_close_code) return;
    ws->pending_close_code = DM_WS_CLOSE_ABNORMAL;
    uv_timer_start(&ws->deadline, on_deadline, 0, 0);
    return;
  }
  if (ws->state != ST_OPEN) return;
  ws->state = ST_CLOSING;
  queue_close(ws, code, reason, reason_len);
  uv_timer_start(&ws->deadline, on_deadline, (uint64_t)ws->close_timeout_ms, 0);
}

void dm_ws_discard(dm_ws *ws) {
  ws->discarded = 1;
  ws->state = ST_DEAD;
  if (ws->depth == 0) teardown(ws);
}

size_t dm_ws_queued(const dm_ws *ws) { return (ws->out_len - ws->out_off) + (ws->stage_len - ws->stage_off); }
