/* A minimal DNS client over UDP on the loop (test mode of the egress proxy). See dns.h. */
#include "dns.h"
#include <stdlib.h>
#include <string.h>

struct dm_dns_query {
  uv_udp_t udp;
  uv_timer_t timer;
  struct sockaddr_storage server;
  unsigned char msg[512];
  size_t msg_len;
  unsigned id;
  unsigned timeout_ms;
  int tries;
  int closing; /* handles being closed: 2 close callbacks to come */
  int done;    /* callback called (or cancelled) */
  dm_dns_cb cb;
  void *ud;
};

size_t dm_dns_encode_query(const char *name, unsigned id, unsigned char *out, size_t cap) {
  size_t n = strlen(name);
  if (n == 0 || n > 253 || cap < 12 + n + 2 + 4) return 0;
  unsigned char *p = out;
  *p++ = (unsigned char)(id >> 8);
  *p++ = (unsigned char)id;
  *p++ = 0x01; /* RD */
  *p++ = 0x00;
  *p++ = 0;
  *p++ = 1; /* QDCOUNT */
  memset(p, 0, 6);
  p += 6;
  const char *s = name;
  while (*s) {
    const char *dot = strchr(s, '.');
    size_t l = dot ? (size_t)(dot - s) : strlen(s);
    if (l == 0 || l > 63) return 0;
    *p++ = (unsigned char)l;
    memcpy(p, s, l);
    p += l;
    s += l;
    if (*s == '.') s++;
  }
  *p++ = 0;
  *p++ = 0;
  *p++ = 1; /* QTYPE A */
  *p++ = 0;
  *p++ = 1; /* QCLASS IN */
  return (size_t)(p - out);
}

/* Skips a (possibly compressed) name at off; returns the offset after it or 0. */
static size_t skip_name(const unsigned char *m, size_t len, size_t off) {
  for (int hops = 0; off < len && hops < 128; hops++) {
    unsigned l = m[off];
    if (l == 0) return off + 1;
    if ((l & 0xc0) == 0xc0) return off + 2 <= len ? off + 2 : 0;
    if (l & 0xc0) return 0;
    off += 1 + l;
  }
  return 0;
}

int dm_dns_decode_answer(const unsigned char *m, size_t len, unsigned id, struct sockaddr_in *out, size_t max) {
  if (len < 12) return UV_EPROTO;
  if (((unsigned)m[0] << 8 | m[1]) != (id & 0xffff)) return UV_EPROTO;
  if (!(m[2] & 0x80)) return UV_EPROTO; /* not a response */
  int rcode = m[3] & 0x0f;
  if (rcode == 3) return UV_ENOENT;
  if (rcode != 0) return UV_EPROTO;
  unsigned qd = (unsigned)m[4] << 8 | m[5], an = (unsigned)m[6] << 8 | m[7];
  size_t off = 12;
  for (unsigned i = 0; i < qd; i++) {
    off = skip_name(m, len, off);
    if (!off || off + 4 > len) return UV_EPROTO;
    off += 4;
  }
  size_t n = 0;
  for (unsigned i = 0; i < an; i++) {
    off = skip_name(m, len, off);
    if (!off || off + 10 > len) return UV_EPROTO;
    unsigned type = (unsigned)m[off] << 8 | m[off + 1];
    unsigned cls = (unsigned)m[off + 2] << 8 | m[off + 3];
    unsigned rdlen = (unsigned)m[off + 8] << 8 | m[off + 9];
    off += 10;
    if (off + rdlen > len) return UV_EPROTO;
    if (type == 1 && cls == 1 && rdlen == 4 && n < max) {
      memset(&out[n], 0, sizeof out[n]);
      out[n].sin_family = AF_INET;
      memcpy(&out[n].sin_addr, m + off, 4);
      n++;
    }
    off += rdlen;
  }
  return n ? (int)n : UV_ENOENT;
}

static void closed(uv_handle_t *h) {
  dm_dns_query *q = h->data;
  if (--q->closing == 0) free(q);
}

static void finish(dm_dns_query *q, int status, const struct sockaddr_in *a, size_t n) {
  if (q->done) return;
  q->done = 1;
  uv_udp_recv_stop(&q->udp);
  uv_timer_stop(&q->timer);
  if (q->cb) q->cb(q->ud, status, a, n);
  q->closing = 2;
  uv_close((uv_handle_t *)&q->udp, closed);
  uv_close((uv_handle_t *)&q->timer, closed);
}

static void sent(uv_udp_send_t *req, int status) { free(req); }

static int send_query(dm_dns_query *q) {
  uv_udp_send_t *req = malloc(sizeof *req);
  if (!req) return UV_ENOMEM;
  uv_buf_t b = uv_buf_init((char *)q->msg, (unsigned)q->msg_len);
  int r = uv_udp_send(req, &q->udp, &b, 1, (const struct sockaddr *)&q->server, sent);
  if (r) free(req);
  q->tries++;
  return r;
}

static void on_timer(uv_timer_t *t) {
  dm_dns_query *q = t->data;
  if (q->tries < 2 && send_query(q) == 0) {
    uv_timer_start(&q->timer, on_timer, q->timeout_ms - q->timeout_ms / 2, 0);
    return;
  }
  finish(q, UV_ETIMEDOUT, NULL, 0);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  static char space[1500]; /* the loop is single-threaded; each datagram is parsed at once */
  *buf = uv_buf_init(space, sizeof space);
}

static int same_addr(const struct sockaddr *a, const struct sockaddr_storage *b) {
  if (!a || a->sa_family != b->ss_family) return 0;
  if (a->sa_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
    return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
  }
  const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
  return x->sin6_port == y->sin6_port && !memcmp(&x->sin6_addr, &y->sin6_addr, 16);
}

static void on_recv(uv_udp_t *u, ssize_t n, const uv_buf_t *buf, const struct sockaddr *from, unsigned flags) {
  dm_dns_query *q = u->data;
  if (n <= 0 || q->done || !same_addr(from, &q->server)) return; /* not our server's answer: ignore */
  struct sockaddr_in addrs[DM_DNS_MAX_ADDRS];
  int r = dm_dns_decode_answer((const unsigned char *)buf->base, (size_t)n, q->id, addrs, DM_DNS_MAX_ADDRS);
  unsigned id = (unsigned)(unsigned char)buf->base[0] << 8 | (unsigned char)buf->base[1];
  if (r == UV_EPROTO && id != (q->id & 0xffff)) return; /* a stale answer to an earlier query: keep waiting */
  if (r < 0) finish(q, r, NULL, 0);
  else finish(q, 0, addrs, (size_t)r);
}

dm_dns_query *dm_dns_resolve(uv_loop_t *loop, const struct sockaddr *server, const char *name, unsigned timeout_ms,
                             dm_dns_cb cb, void *ud, int *err) {
  dm_dns_query *q = calloc(1, sizeof *q);
  if (!q) {
    *err = UV_ENOMEM;
    return NULL;
  }
  unsigned char rnd[2];
  if (uv_random(NULL, NULL, rnd, 2, 0, NULL) != 0) rnd[0] = rnd[1] = 0x5a;
  q->id = (unsigned)rnd[0] << 8 | rnd[1];
  q->msg_len = dm_dns_encode_query(name, q->id, q->msg, sizeof q->msg);
  if (!q->msg_len) {
    free(q);
    *err = UV_EINVAL;
    return NULL;
  }
  memcpy(&q->server, server, server->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
  q->timeout_ms = timeout_ms ? timeout_ms : 5000;
  q->cb = cb;
  q->ud = ud;
  uv_udp_init(loop, &q->udp);
  uv_timer_init(loop, &q->timer);
  q->udp.data = q->timer.data = q;
  /* sending first binds the socket to the any-address of the server's family */
  int r = send_query(q);
  if (!r) r = uv_udp_recv_start(&q->udp, alloc_cb, on_recv);
  if (r) {
    q->done = 1;
    q->closing = 2;
    uv_close((uv_handle_t *)&q->udp, closed);
    uv_close((uv_handle_t *)&q->timer, closed);
    *err = r;
    return NULL;
  }
  uv_timer_start(&q->timer, on_timer, q->timeout_ms / 2, 0);
  return q;
}

void dm_dns_cancel(dm_dns_query *q) {
  if (!q || q->done) return;
  q->cb = NULL;
  finish(q, 0, NULL, 0);
}
