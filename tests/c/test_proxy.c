/* core/proxy.c without Lua: request-head parsing (the three target forms, refusals, the
 * rewrite of a plain request), host normalisation, address classes and rules, the DNS
 * codec, and the data path end to end on loopback: CONNECT, absolute-form GET, a denial,
 * an address refused by class, a test resolver, and the per-listener ceilings (connections,
 * descriptors, descriptors smuggled over the unix connection). Run under the sanitizer
 * build too. */
#include "proxy.h"
#include "dns.h"
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "check.h"

/* ---- head parsing ---- */

static int parse(dm_proxy_head *h, const char *s) {
  dm_proxy_head_init(h);
  return dm_proxy_head_feed(h, s, strlen(s));
}

static void test_heads(void) {
  dm_proxy_head h;
  int r = parse(&h, "CONNECT Allowed.Test.:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n\x16\x03");
  CHECK(r == 1, "connect parses: %d %s", r, h.why ? h.why : "");
  CHECK(h.req.form == DM_FORM_CONNECT && !strcmp(h.req.host, "allowed.test") && h.req.port == 443 && h.req.ip == 0,
        "connect target %s:%d", h.req.host, h.req.port);
  CHECK(h.req.host_header && !strcmp(h.req.host_header, "other.test:443"), "host header kept apart");
  CHECK(h.len - h.head_len == 2, "bytes after the head stay: %zu", h.len - h.head_len);
  dm_proxy_head_free(&h);

  /* in pieces, one byte at a time */
  const char *abs = "GET http://denied.test:8080/a/b?q=1 HTTP/1.1\r\nHost: x\r\nProxy-Connection: keep-alive\r\n"
                    "User-Agent: t\r\nContent-Length: 4\r\n\r\nbodyGET / HTTP/1.1\r\n";
  dm_proxy_head_init(&h);
  r = 0;
  size_t i = 0;
  for (; i < strlen(abs) && r == 0; i++) r = dm_proxy_head_feed(&h, abs + i, 1);
  CHECK(r == 1 && h.req.form == DM_FORM_ABSOLUTE && !strcmp(h.req.host, "denied.test") && h.req.port == 8080,
        "absolute form: %d %s:%d", r, h.req.host, h.req.port);
  CHECK(!strcmp(h.req.path, "/a/b?q=1"), "path %s", h.req.path);
  char out[1024];
  size_t n = dm_proxy_head_rewrite(&h, out, sizeof out);
  out[n] = '\0';
  const char *want = "GET /a/b?q=1 HTTP/1.1\r\nHost: denied.test:8080\r\n";
  CHECK(n && !strncmp(out, want, strlen(want)), "rewrite: %s", out);
  CHECK(!strstr(out, "Proxy-Connection") && !strstr(out, "Host: x") && strstr(out, "User-Agent: t\r\n") &&
          strstr(out, "Connection: close\r\n\r\n"),
        "rewrite headers: %s", out);
  /* to an upstream proxy: absolute-form, the sandbox's Proxy-* gone, the host's credential added */
  n = dm_proxy_head_rewrite_proxy(&h, out, sizeof out, "Basic Y29ycDpwdw==");
  out[n] = '\0';
  want = "GET http://denied.test:8080/a/b?q=1 HTTP/1.1\r\nHost: denied.test:8080\r\n";
  CHECK(n && !strncmp(out, want, strlen(want)), "rewrite for an upstream proxy: %s", out);
  CHECK(!strstr(out, "Proxy-Connection") &&
          strstr(out, "Proxy-Authorization: Basic Y29ycDpwdw==\r\nConnection: close\r\n\r\n"),
        "upstream proxy headers: %s", out);
  CHECK(dm_proxy_head_rewrite_proxy(&h, out, 40, NULL) == 0, "too small a buffer gives 0");
  const char *rest = abs + i;
  size_t fwd;
  r = dm_proxy_head_body(&h, rest, strlen(rest), &fwd);
  CHECK(r == 1 && fwd == 4, "one message only: %d fwd %zu", r, fwd);
  dm_proxy_head_free(&h);

  r = parse(&h, "GET /x HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n");
  CHECK(r == 1 && h.req.form == DM_FORM_ORIGIN && h.req.ip == 6 && !strcmp(h.req.host, "::1") && h.req.port == 8080,
        "origin form by Host: %s", h.req.host);
  dm_proxy_head_free(&h);

  r = parse(&h, "GET http://0x7f.1/ HTTP/1.1\r\n\r\n");
  CHECK(r == 1 && h.req.ip == 4 && !strcmp(h.req.host, "127.0.0.1") && h.req.port == 80, "numeric spelling: %s",
        h.req.host);
  dm_proxy_head_free(&h);

  struct {
    const char *head;
    int status;
  } bad[] = {
    {"GET https://a.test/ HTTP/1.1\r\n\r\n", 400},
    {"GET / HTTP/1.1\r\n\r\n", 400},
    {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
    {"CONNECT a.test HTTP/1.1\r\n\r\n", 400},
    {"CONNECT a.test:99999 HTTP/1.1\r\n\r\n", 400},
    {"GET http://user@a.test/ HTTP/1.1\r\n\r\n", 400},
    {"GET http://a..test/ HTTP/1.1\r\n\r\n", 400},
    {"GET http://a%2etest/ HTTP/1.1\r\n\r\n", 400},
    {"GET http://::1/ HTTP/1.1\r\n\r\n", 400},
    {"BREW / HTTP/1.1\r\n\r\n", 501},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    r = parse(&h, bad[k].head);
    CHECK(r == -1 && h.status == bad[k].status, "refused %s: %d %d", bad[k].head, r, h.status);
    dm_proxy_head_free(&h);
  }
  /* a head that never ends */
  dm_proxy_head_init(&h);
  dm_proxy_head_feed(&h, "GET / HTTP/1.1\r\nX: ", 19);
  char junk[4096];
  memset(junk, 'a', sizeof junk);
  r = 0;
  for (int k = 0; k < 20 && r == 0; k++) r = dm_proxy_head_feed(&h, junk, sizeof junk);
  CHECK(r == -1 && h.status == 431, "oversized head: %d %d", r, h.status);
  dm_proxy_head_free(&h);
}

/* Found by tests/fuzz/proxy_head (corpus file regression-obs-fold): llhttp reports a folded
 * header value as two pieces with the CRLF between them skipped; kept as one span, the value
 * took in the CRLF and the rewrite ended the head early, so the upstream read the headers
 * after the fold (Content-Length among them) as the start of another request. */
static void test_obs_fold_is_refused(void) {
  const char *heads[] = {
    "PUT http://registry.npmjs.org/x HTTP/1.1\r\nX-Long: a\r\n b\r\nContent-Length: 3\r\n\r\nabc",
    "GET / HTTP/1.1\r\nHost: a.test\r\nX: one\r\n\ttwo three\r\n\r\n",
  };
  for (size_t k = 0; k < sizeof heads / sizeof heads[0]; k++) {
    dm_proxy_head h;
    dm_proxy_head_init(&h);
    int r = 0;
    for (size_t i = 0; i < strlen(heads[k]) && r == 0; i++) r = dm_proxy_head_feed(&h, heads[k] + i, 1);
    CHECK(r == -1 && h.status == 400 && h.why && strstr(h.why, "obs-fold"), "folded header refused: %d %d %s", r,
          h.status, h.why ? h.why : "");
    dm_proxy_head_free(&h);
  }
  /* a value in pieces because the reads were split is one value */
  const char *split = "GET / HTTP/1.1\r\nHost: a.test\r\nX-Split: abcdef\r\n\r\n";
  dm_proxy_head h;
  dm_proxy_head_init(&h);
  int r = 0;
  for (size_t i = 0; i < strlen(split) && r == 0; i++) r = dm_proxy_head_feed(&h, split + i, 1);
  char out[512];
  size_t n = r == 1 ? dm_proxy_head_rewrite(&h, out, sizeof out - 1) : 0;
  out[n] = '\0';
  CHECK(n && strstr(out, "\r\nX-Split: abcdef\r\nConnection: close\r\n\r\n"), "split reads: %d %s", r, out);
  dm_proxy_head_free(&h);
}

/* Found by tests/fuzz/proxy_head (corpus file regression-http-version): llhttp takes a request
 * line without a version as HTTP/0.9 (headers and all) and a version such as HTTP/2.0, and
 * the proxy forwarded them rewritten as "GET / HTTP/0.9" with headers, which servers read
 * each their own way. Only HTTP/1.0 and 1.1 are proxied; the rest gets 505. */
static void test_only_http_1_is_proxied(void) {
  const char *bad[] = {
    "GET http://a.test/\r\nHost: a.test\r\nX: y\r\n\r\n",
    "GET http://a.test/ HTTP/0.9\r\n\r\n",
    "GET http://a.test/ HTTP/2.0\r\n\r\n",
    "CONNECT a.test:443\r\n\r\n",
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    dm_proxy_head h;
    int r = parse(&h, bad[k]);
    CHECK(r == -1 && h.status == 505, "%s: %d %d %s", bad[k], r, h.status, h.why ? h.why : "");
    dm_proxy_head_free(&h);
  }
  const char *good[] = {"GET http://a.test/ HTTP/1.0\r\n\r\n", "CONNECT a.test:443 HTTP/1.1\r\n\r\n"};
  for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
    dm_proxy_head h;
    int r = parse(&h, good[k]);
    CHECK(r == 1, "%s: %d %s", good[k], r, h.why ? h.why : "");
    dm_proxy_head_free(&h);
  }
}

static void test_hosts(void) {
  struct {
    const char *in;
    const char *out;
    int ip;
  } ok[] = {
    {"DENIED.TEST", "denied.test", 0}, {"denied.test.", "denied.test", 0},
    {"a_b.test", "a_b.test", 0},       {"2130706433", "127.0.0.1", 4},
    {"0177.0.0.1", "127.0.0.1", 4},    {"127.1", "127.0.0.1", 4},
    {"[FD00::1]", "fd00::1", 6},       {"169.254.169.254.", "169.254.169.254", 4},
  };
  for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
    char out[DM_PROXY_HOST_MAX];
    int ip = -1;
    const char *why = NULL;
    int r = dm_proxy_normalize_host(ok[k].in, strlen(ok[k].in), out, sizeof out, &ip, &why);
    CHECK(r == 0 && !strcmp(out, ok[k].out) && ip == ok[k].ip, "%s -> %s/%d (%s)", ok[k].in, r ? "-" : out, ip,
          why ? why : "");
  }
  const char *bad[] = {"", ".", "a..b", "-", "a b", "a/b", "é.test", "[1.2.3.4]", "x.", "."};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    char out[DM_PROXY_HOST_MAX];
    int ip;
    const char *why;
    int r = dm_proxy_normalize_host(bad[k], strlen(bad[k]), out, sizeof out, &ip, &why);
    if (!strcmp(bad[k], "-") || !strcmp(bad[k], "x.")) continue; /* single labels are names */
    CHECK(r == -1, "%s refused", bad[k]);
  }
}

static void test_classes(void) {
  struct {
    const char *ip;
    const char *cls;
  } t[] = {
    {"8.8.8.8", "public"},
    {"127.0.0.1", "loopback"},
    {"127.9.9.9", "loopback"},
    {"10.1.2.3", "private"},
    {"172.16.0.1", "private"},
    {"172.32.0.1", "public"},
    {"192.168.1.1", "private"},
    {"169.254.1.1", "link-local"},
    {"169.254.169.254", "metadata"},
    {"100.100.100.200", "metadata"},
    {"100.64.0.1", "shared"},
    {"0.0.0.0", "unspecified"},
    {"224.0.0.1", "multicast"},
    {"255.255.255.255", "broadcast"},
    {"240.0.0.1", "reserved"},
    {"192.0.2.1", "reserved"},
    {"::1", "ipv6"},
    {"2001:4860::8888", "ipv6"},
    {"::ffff:8.8.8.8", "ipv6"},
  };
  for (size_t k = 0; k < sizeof t / sizeof t[0]; k++) {
    struct sockaddr_storage a;
    memset(&a, 0, sizeof a);
    if (strchr(t[k].ip, ':')) {
      a.ss_family = AF_INET6;
      inet_pton(AF_INET6, t[k].ip, &((struct sockaddr_in6 *)&a)->sin6_addr);
    } else {
      a.ss_family = AF_INET;
      inet_pton(AF_INET, t[k].ip, &((struct sockaddr_in *)&a)->sin_addr);
    }
    const char *c = dm_proxy_classify((struct sockaddr *)&a);
    CHECK(!strcmp(c, t[k].cls), "%s is %s, not %s", t[k].ip, t[k].cls, c);
  }
  dm_proxy_rule rules[3] = {0};
  CHECK(dm_proxy_parse_cidr("127.0.0.0/8", &rules[0]) == 0, "cidr");
  rules[0].allow = 1;
  rules[0].port = 8080;
  rules[0].index = 4;
  CHECK(dm_proxy_parse_cidr("8.8.0.0/16", &rules[1]) == 0, "cidr");
  rules[1].allow = 0;
  rules[1].index = 5;
  CHECK(dm_proxy_parse_cidr("10.0.0.0/33", &rules[2]) == -1 && dm_proxy_parse_cidr("nope", &rules[2]) == -1,
        "bad cidr");
  struct sockaddr_in a = {.sin_family = AF_INET};
  const char *why;
  int rule;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  CHECK(dm_proxy_check_address((struct sockaddr *)&a, 8080, rules, 2, &why, &rule) == 1 && rule == 4,
        "loopback allowed by rule");
  CHECK(dm_proxy_check_address((struct sockaddr *)&a, 80, rules, 2, &why, &rule) == 0 && !strcmp(why, "loopback"),
        "other port: class decides (%s)", why);
  inet_pton(AF_INET, "8.8.8.8", &a.sin_addr);
  CHECK(dm_proxy_check_address((struct sockaddr *)&a, 443, rules, 2, &why, &rule) == 0 && rule == 5, "deny rule");
  inet_pton(AF_INET, "9.9.9.9", &a.sin_addr);
  CHECK(dm_proxy_check_address((struct sockaddr *)&a, 443, rules, 2, &why, &rule) == 1 && rule == -1, "public");
}

static void test_dns_codec(void) {
  unsigned char q[512];
  size_t n = dm_dns_encode_query("allowed.test", 0x1234, q, sizeof q);
  CHECK(n == 12 + 14 + 4, "query length %zu", n);
  unsigned char scratch[512];
  CHECK(dm_dns_encode_query("a..b", 1, scratch, sizeof scratch) == 0, "empty label refused");
  /* an answer: the query + flags + one A record through a compression pointer */
  unsigned char ans[512];
  memcpy(ans, q, n);
  ans[2] = 0x81;
  ans[3] = 0x80;
  ans[7] = 1;
  unsigned char rr[] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 7};
  memcpy(ans + n, rr, sizeof rr);
  struct sockaddr_in out[4];
  int r = dm_dns_decode_answer(ans, n + sizeof rr, 0x1234, out, 4);
  CHECK(r == 1 && out[0].sin_addr.s_addr == htonl(0x7f000007), "decoded %d", r);
  CHECK(dm_dns_decode_answer(ans, n + sizeof rr, 0x1235, out, 4) == UV_EPROTO, "wrong id");
  ans[3] = 0x83;
  CHECK(dm_dns_decode_answer(ans, n + sizeof rr, 0x1234, out, 4) == UV_ENOENT, "nxdomain");
}

/* ---- end to end on loopback ---- */

static uv_loop_t loop;
static uv_tcp_t upstream_srv;
static int upstream_port;
static uv_udp_t dns_srv;
static int dns_port, dns_queries;
static char last_upstream_req[2048];

static void free_close(uv_handle_t *h) { free(h); }
static void written_free(uv_write_t *w, int status) { free(w); }
static void shutdown_free(uv_shutdown_t *r, int status) { free(r); }
static void udp_sent_free(uv_udp_send_t *r, int status) { free(r); }

static void up_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  if (n < 0) {
    uv_close((uv_handle_t *)s, free_close);
    free(b->base);
    return;
  }
  if (n > 0) {
    size_t l = strlen(last_upstream_req);
    size_t k = (size_t)n < sizeof last_upstream_req - l - 1 ? (size_t)n : sizeof last_upstream_req - l - 1;
    memcpy(last_upstream_req + l, b->base, k);
    last_upstream_req[l + k] = '\0';
    if (strstr(last_upstream_req, "\r\n\r\n") || strstr(last_upstream_req, "ping")) {
      static const char resp[] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
      uv_write_t *w = malloc(sizeof *w);
      uv_buf_t o = uv_buf_init((char *)resp, sizeof resp - 1);
      uv_write(w, s, &o, 1, written_free);
      uv_shutdown_t *sd = malloc(sizeof *sd);
      uv_shutdown(sd, s, shutdown_free);
    }
  }
  free(b->base);
}

static void alloc_heap(uv_handle_t *h, size_t n, uv_buf_t *b) { *b = uv_buf_init(malloc(n), (unsigned)n); }

static void up_conn(uv_stream_t *srv, int status) {
  uv_tcp_t *c = malloc(sizeof *c);
  uv_tcp_init(&loop, c);
  uv_accept(srv, (uv_stream_t *)c);
  uv_read_start((uv_stream_t *)c, alloc_heap, up_read);
}

static void dns_recv(uv_udp_t *u, ssize_t n, const uv_buf_t *b, const struct sockaddr *from, unsigned flags) {
  if (n <= 12) {
    free(b->base);
    return;
  }
  dns_queries++;
  unsigned char *m = (unsigned char *)b->base;
  /* answer "allowed.test" with 127.0.0.1, anything else NXDOMAIN */
  int known = memmem(m, (size_t)n,
                     "\x07"
                     "allowed\x04test",
                     13) != NULL;
  static unsigned char out[512];
  memcpy(out, m, (size_t)n);
  out[2] = 0x81;
  out[3] = known ? 0x80 : 0x83;
  size_t len = (size_t)n;
  if (known) {
    out[7] = 1;
    unsigned char rr[] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 1};
    memcpy(out + len, rr, sizeof rr);
    len += sizeof rr;
  }
  uv_udp_send_t *req = malloc(sizeof *req);
  uv_buf_t o = uv_buf_init((char *)out, (unsigned)len);
  uv_udp_send(req, u, &o, 1, from, udp_sent_free);
  free(b->base);
}

static int done_count, closed;
static dm_proxy_result last;
static char last_error[256];
static const char *verdict = "allow";

static void on_request(void *ud, dm_proxy_conn *c, const dm_proxy_request *req) {
  if (!strcmp(verdict, "allow")) dm_proxy_allow(c);
  else dm_proxy_deny(c, "test says no");
}
static void on_done(void *ud, dm_proxy_conn *c, const dm_proxy_result *res) {
  done_count++;
  last = *res;
  snprintf(last_error, sizeof last_error, "%s", res->error ? res->error : "");
  last.error = last_error;
  last.address = "";
}
static void on_closed(void *ud) { closed++; }

/* A client on the proxy socket: sends `req`, collects the answer until EOF. */
typedef struct {
  uv_pipe_t pipe;
  uv_connect_t creq;
  const char *send;
  char got[4096];
  size_t len;
  int eof;
} client;

static void cl_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  client *c = s->data;
  if (n > 0) {
    size_t k = (size_t)n < sizeof c->got - c->len - 1 ? (size_t)n : sizeof c->got - c->len - 1;
    memcpy(c->got + c->len, b->base, k);
    c->len += k;
    c->got[c->len] = '\0';
    if (strstr(c->got, "200 Connection established") && c->send && strstr(c->send, "CONNECT")) {
      /* through the tunnel */
      uv_write_t *w = malloc(sizeof *w);
      uv_buf_t o = uv_buf_init("ping", 4);
      uv_write(w, s, &o, 1, written_free);
      c->send = NULL;
    }
  } else if (n < 0) {
    c->eof = 1;
    uv_close((uv_handle_t *)s, NULL);
  }
  free(b->base);
}

static void cl_connected(uv_connect_t *req, int status) {
  client *c = req->data;
  uv_write_t *w = malloc(sizeof *w);
  uv_buf_t o = uv_buf_init((char *)c->send, (unsigned)strlen(c->send));
  uv_write(w, (uv_stream_t *)&c->pipe, &o, 1, written_free);
  uv_read_start((uv_stream_t *)&c->pipe, alloc_heap, cl_read);
}

static void exchange_opt(const char *path, client *c, const char *req, int reaches_owner) {
  memset(c, 0, sizeof *c);
  c->send = req;
  uv_pipe_init(&loop, &c->pipe, 0);
  c->pipe.data = c;
  c->creq.data = c;
  uv_pipe_connect(&c->creq, &c->pipe, path, cl_connected);
  int before = done_count;
  last_upstream_req[0] = '\0';
  while ((reaches_owner && done_count == before) || !c->eof) uv_run(&loop, UV_RUN_ONCE);
}

static void exchange(const char *path, client *c, const char *req) { exchange_opt(path, c, req, 1); }

/* What demesne-init's relay does: hand an accepted TCP socket over the unix socket
 * (SCM_RIGHTS with one byte) and hang up; the proxy then talks to that socket itself. */
static void test_handover(const char *sock) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof a;
  int ok = bind(l, (struct sockaddr *)&a, sizeof a) == 0 && listen(l, 1) == 0 &&
           getsockname(l, (struct sockaddr *)&a, &alen) == 0;
  int cl = socket(AF_INET, SOCK_STREAM, 0);
  ok = ok && connect(cl, (struct sockaddr *)&a, sizeof a) == 0;
  int acc = ok ? accept(l, NULL, NULL) : -1;
  int u = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un ua = {.sun_family = AF_UNIX};
  size_t slen = strlen(sock);
  ok = ok && slen < sizeof ua.sun_path;
  if (ok) memcpy(ua.sun_path, sock, slen + 1);
  ok = ok && acc >= 0 && connect(u, (struct sockaddr *)&ua, sizeof ua) == 0;
  char byte = 'F';
  struct iovec iov = {.iov_base = &byte, .iov_len = 1};
  union {
    struct cmsghdr h;
    char space[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl.space};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &acc, sizeof(int));
  ok = ok && sendmsg(u, &msg, 0) == 1;
  CHECK(ok, "hand-over set up: %s", strerror(errno));
  close(u);
  close(acc);
  close(l);
  char req[128];
  int n = snprintf(req, sizeof req, "CONNECT allowed.test:%d HTTP/1.1\r\n\r\n", upstream_port);
  ok = ok && send(cl, req, (size_t)n, 0) == n;
  fcntl(cl, F_SETFL, O_NONBLOCK);
  char got[4096] = "";
  size_t len = 0;
  int pinged = 0, before = done_count;
  last_upstream_req[0] = '\0';
  for (int spins = 0; ok && spins < 200000 && done_count == before; spins++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    ssize_t r = cl >= 0 ? recv(cl, got + len, sizeof got - len - 1, 0) : -1;
    if (r > 0) {
      len += (size_t)r;
      got[len] = '\0';
      if (!pinged && strstr(got, "\r\n\r\n")) pinged = send(cl, "ping", 4, 0) == 4;
    } else if (r == 0 || (r < 0 && cl >= 0 && errno != EAGAIN)) {
      close(cl); /* the tunnel ended: hang up our side too, then wait for on_done */
      cl = -1;
    } else {
      usleep(50);
    }
  }
  if (cl >= 0) close(cl);
  CHECK(strstr(got, "200 Connection established") && strstr(got, "hello"), "handed-over socket: %s", got);
  CHECK(!strcmp(last_upstream_req, "ping") && last.bytes_up == 4 && last.status == 200,
        "through the handed-over socket: %s up %llu", last_upstream_req, (unsigned long long)last.bytes_up);
}

static int refused_count;
static char refused_limit[32];
static void on_refused(void *ud, const dm_proxy_refusal *r) {
  refused_count++;
  snprintf(refused_limit, sizeof refused_limit, "%s", r->limit);
}

/* A plain unix client of the proxy socket, non-blocking once connected (-1 on failure). */
static int unix_client(const char *sock) {
  int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un ua = {.sun_family = AF_UNIX};
  snprintf(ua.sun_path, sizeof ua.sun_path, "%s", sock);
  if (u < 0 || connect(u, (struct sockaddr *)&ua, sizeof ua) != 0) {
    if (u >= 0) close(u);
    return -1;
  }
  fcntl(u, F_SETFL, O_NONBLOCK);
  return u;
}

/* Turns the loop until `fd` has answered `want` (or hung up when want is NULL). */
static int await_answer(int fd, const char *want, char *got, size_t cap) {
  size_t len = 0;
  got[0] = '\0';
  for (int spins = 0; spins < 200000; spins++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    ssize_t r = recv(fd, got + len, cap - len - 1, 0);
    if (r > 0) {
      len += (size_t)r;
      got[len] = '\0';
      if (want && strstr(got, want)) return 1;
    } else if (r == 0 || (r < 0 && errno != EAGAIN)) {
      return want == NULL;
    } else {
      usleep(50);
    }
  }
  return 0;
}

static void spin(int turns) {
  for (int i = 0; i < turns; i++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    usleep(200);
  }
}

/* One sandbox must not make the server hold unbounded descriptors: a connection over the
 * ceilings is answered 503 naming the ceiling; descriptors sent after the first read end
 * the connection. */
static void test_ceilings(const char *dir) {
  char sock[160], got[4096], req[128];
  snprintf(sock, sizeof sock, "%s/ceiling.sock", dir);
  snprintf(req, sizeof req, "CONNECT allowed.test:%d HTTP/1.1\r\n\r\n", upstream_port);
  dm_proxy_rule rule = {0};
  dm_proxy_parse_cidr("127.0.0.1/32", &rule);
  rule.allow = 1;
  rule.port = upstream_port;
  rule.index = 1;
  char resolver[64];
  snprintf(resolver, sizeof resolver, "127.0.0.1:%d", dns_port);
  dm_proxy_opts o = {.path = sock,
                     .resolver = resolver,
                     .rules = &rule,
                     .nrules = 1,
                     .max_conns = 2,
                     .max_fds = 8,
                     .ceiling_hint = "(raise the test ceiling)"};
  dm_proxy_handler h = {on_request, on_done, on_closed, on_refused};
  int err = 0, closed_before = closed;
  dm_proxy *p = dm_proxy_new(&loop, &o, &h, NULL, &err);
  CHECK(p != NULL, "listen: %s", uv_strerror(err));
  if (!p) return;
  size_t g0 = dm_proxy_fds_total(NULL);

  int a = unix_client(sock), b = unix_client(sock);
  spin(50);
  CHECK(dm_proxy_active(p) == 2 && dm_proxy_fds(p) == 4, "two idle connections: %zu, %zu fds", dm_proxy_active(p),
        dm_proxy_fds(p));
  int c = unix_client(sock);
  CHECK(c >= 0 && send(c, req, strlen(req), 0) == (ssize_t)strlen(req), "third client");
  CHECK(await_answer(c, "\r\n\r\n", got, sizeof got) && strstr(got, "HTTP/1.1 503 Service Unavailable") &&
          strstr(got, "X-Demesne-Egress: ceiling") && strstr(got, "2 connections") &&
          strstr(got, "(raise the test ceiling)"),
        "over max_conns: %s", got);
  CHECK(refused_count == 1 && !strcmp(refused_limit, "connections"), "on_refused: %d %s", refused_count, refused_limit);
  CHECK(dm_proxy_active(p) == 2, "the refused one is not counted: %zu", dm_proxy_active(p));
  close(a);
  close(b);
  close(c);
  for (int i = 0; i < 2000 && (dm_proxy_active(p) || dm_proxy_fds(p)); i++) spin(1);
  CHECK(dm_proxy_active(p) == 0 && dm_proxy_fds(p) == 0, "released: %zu conns, %zu fds", dm_proxy_active(p),
        dm_proxy_fds(p));

  /* a tunnel holds 6 of the 8 descriptors: the next connection is admitted (2) but cannot dial */
  int t1 = unix_client(sock);
  CHECK(t1 >= 0 && send(t1, req, strlen(req), 0) > 0, "tunnel client");
  CHECK(await_answer(t1, "established\r\n\r\n", got, sizeof got), "tunnel: %s", got);
  CHECK(dm_proxy_fds(p) == 6, "a CONNECT tunnel holds 6 descriptors: %zu", dm_proxy_fds(p));
  int t2 = unix_client(sock);
  CHECK(t2 >= 0 && send(t2, req, strlen(req), 0) > 0, "second tunnel client");
  CHECK(await_answer(t2, "\r\n\r\n", got, sizeof got) && strstr(got, "503") && strstr(got, "ceiling of 8"),
        "over max_fds: %s", got);
  for (int i = 0; i < 2000 && dm_proxy_active(p) > 1; i++) spin(1);
  CHECK(!strcmp(last.code ? last.code : "", "ELIMIT") && last.status == 503, "on_done: %s %d", last.code, last.status);
  close(t1);
  close(t2);
  for (int i = 0; i < 2000 && dm_proxy_active(p); i++) spin(1);

  /* descriptors sent after the first read (the relay sends one, with its first byte) */
  int u = unix_client(sock);
  CHECK(u >= 0 && send(u, "GET /", 5, 0) == 5, "stray client");
  spin(20);
  int sent = 0;
  for (int i = 0; i < 20; i++) {
    int fds[8];
    for (int k = 0; k < 8; k++) fds[k] = 0; /* stdin, eight times: each arrives as a new descriptor */
    char byte = 'a';                        /* the path goes on: the head stays valid */
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
      struct cmsghdr h;
      char space[CMSG_SPACE(sizeof fds)];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr msg = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl.space};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
    if (sendmsg(u, &msg, MSG_NOSIGNAL) == 1) sent++;
    spin(5);
  }
  spin(20);
  CHECK(sent >= 1 && dm_proxy_active(p) == 0 && dm_proxy_fds(p) == 0,
        "a client that sends descriptors is cut off at once "
        "(%d sent, %zu connections)",
        sent, dm_proxy_active(p));
  CHECK(await_answer(u, NULL, got, sizeof got) && got[0] == '\0', "hung up without an answer: %s", got);
  close(u);
  for (int i = 0; i < 2000 && dm_proxy_active(p); i++) spin(1);
  CHECK(dm_proxy_active(p) == 0 && dm_proxy_fds(p) == 0 && dm_proxy_fds_total(NULL) == g0, "all released: %zu %zu",
        dm_proxy_fds(p), dm_proxy_fds_total(NULL));
  dm_proxy_close(p);
  while (closed == closed_before) uv_run(&loop, UV_RUN_ONCE);
}

/* What demesne-init's relay does where it cannot pass a socket (gVisor): the byte '\0' and
 * then the client's own bytes, copied over the unix connection; the proxy drops the byte
 * and talks to that connection as the client. */
static void test_copy_marker(const char *sock) {
  int u = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un ua = {.sun_family = AF_UNIX};
  size_t slen = strlen(sock);
  int ok = slen < sizeof ua.sun_path;
  if (ok) memcpy(ua.sun_path, sock, slen + 1);
  ok = ok && connect(u, (struct sockaddr *)&ua, sizeof ua) == 0;
  char req[128];
  req[0] = '\0';
  int n = 1 + snprintf(req + 1, sizeof req - 1, "CONNECT allowed.test:%d HTTP/1.1\r\n\r\n", upstream_port);
  ok = ok && send(u, req, (size_t)n, MSG_NOSIGNAL) == n;
  CHECK(ok, "copy-mode connection set up: %s", strerror(errno));
  fcntl(u, F_SETFL, O_NONBLOCK);
  char got[4096] = "";
  size_t len = 0;
  int pinged = 0, before = done_count;
  last_upstream_req[0] = '\0';
  for (int spins = 0; ok && spins < 200000 && done_count == before; spins++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    ssize_t r = u >= 0 ? recv(u, got + len, sizeof got - len - 1, 0) : -1;
    if (r > 0) {
      len += (size_t)r;
      got[len] = '\0';
      if (!pinged && strstr(got, "\r\n\r\n")) pinged = send(u, "ping", 4, MSG_NOSIGNAL) == 4;
    } else if (r == 0 || (r < 0 && u >= 0 && errno != EAGAIN)) {
      close(u);
      u = -1;
    } else {
      usleep(50);
    }
  }
  if (u >= 0) close(u);
  CHECK(strncmp(got, "HTTP/1.1 200 Connection established", 35) == 0 && strstr(got, "hello"), "copy mode: %s", got);
  CHECK(!strcmp(last_upstream_req, "ping") && last.bytes_up == 4 && last.status == 200,
        "through the copied connection: %s up %llu", last_upstream_req, (unsigned long long)last.bytes_up);
}

static void test_end_to_end(void) {
  uv_loop_init(&loop);
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  uv_tcp_init(&loop, &upstream_srv);
  uv_tcp_bind(&upstream_srv, (struct sockaddr *)&a, 0);
  uv_listen((uv_stream_t *)&upstream_srv, 16, up_conn);
  int len = sizeof a;
  uv_tcp_getsockname(&upstream_srv, (struct sockaddr *)&a, &len);
  upstream_port = ntohs(a.sin_port);
  uv_ip4_addr("127.0.0.1", 0, &a);
  uv_udp_init(&loop, &dns_srv);
  uv_udp_bind(&dns_srv, (struct sockaddr *)&a, 0);
  len = sizeof a;
  uv_udp_getsockname(&dns_srv, (struct sockaddr *)&a, &len);
  dns_port = ntohs(a.sin_port);
  uv_udp_recv_start(&dns_srv, alloc_heap, dns_recv);

  char path[] = "/tmp/dm-proxy-test-XXXXXX";
  CHECK(mkdtemp(path) != NULL, "mkdtemp");
  char sock[128], resolver[64];
  snprintf(sock, sizeof sock, "%s/egress.sock", path);
  snprintf(resolver, sizeof resolver, "127.0.0.1:%d", dns_port);
  dm_proxy_rule rule = {0};
  dm_proxy_parse_cidr("127.0.0.1/32", &rule);
  rule.allow = 1;
  rule.port = upstream_port;
  rule.index = 1;
  dm_proxy_opts o = {.path = sock, .resolver = resolver, .rules = &rule, .nrules = 1};
  dm_proxy_handler h = {on_request, on_done, on_closed, NULL};
  int err = 0;
  dm_proxy *p = dm_proxy_new(&loop, &o, &h, NULL, &err);
  CHECK(p != NULL, "listen: %s", uv_strerror(err));
  if (!p) return;

  client c;
  char req[256];
  snprintf(req, sizeof req, "CONNECT allowed.test:%d HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n", upstream_port);
  exchange(sock, &c, req);
  CHECK(strstr(c.got, "200 Connection established") && strstr(c.got, "hello"), "tunnel: %s", c.got);
  CHECK(!strcmp(last_upstream_req, "ping"), "upstream got %s", last_upstream_req);
  CHECK(last.status == 200 && !last.denied && last.bytes_up == 4 && last.bytes_down > 5 && last.rule == 1,
        "connect result: %d %d up %llu down %llu rule %d", last.status, last.denied, (unsigned long long)last.bytes_up,
        (unsigned long long)last.bytes_down, last.rule);
  CHECK(dns_queries == 1, "one DNS query: %d", dns_queries);

  snprintf(req, sizeof req,
           "GET http://allowed.test:%d/x HTTP/1.1\r\nHost: nope\r\nProxy-Connection: keep-alive\r\n\r\n",
           upstream_port);
  exchange(sock, &c, req);
  CHECK(strstr(c.got, "HTTP/1.1 200 OK") && strstr(c.got, "hello"), "plain GET: %s", c.got);
  CHECK(strstr(last_upstream_req, "GET /x HTTP/1.1\r\n") && strstr(last_upstream_req, "Connection: close") &&
          !strstr(last_upstream_req, "nope"),
        "rewritten: %s", last_upstream_req);

  test_handover(sock);
  test_copy_marker(sock);

  verdict = "deny";
  int q = dns_queries;
  exchange(sock, &c, "CONNECT exfil-123.denied.test:443 HTTP/1.1\r\n\r\n");
  CHECK(strstr(c.got, "403 Forbidden") && strstr(c.got, "test says no"), "denied: %s", c.got);
  CHECK(last.denied && last.status == 403 && dns_queries == q, "denied without a DNS query (%d)", dns_queries - q);

  verdict = "allow";
  exchange(sock, &c, "CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n");
  CHECK(strstr(c.got, "403") && last.denied && strstr(last.error, "loopback"), "loopback by class: %s", last.error);
  exchange(sock, &c, "CONNECT [::1]:443 HTTP/1.1\r\n\r\n");
  CHECK(strstr(c.got, "403") && strstr(last.error, "ipv6"), "ipv6: %s", last.error);
  exchange(sock, &c, "CONNECT unknown.test:443 HTTP/1.1\r\n\r\n");
  CHECK(strstr(c.got, "502") && !last.denied, "unknown name: %s", c.got);
  exchange_opt(sock, &c, "GARBAGE\r\n\r\n", 0);
  CHECK(strstr(c.got, "HTTP/1.1 501") || strstr(c.got, "HTTP/1.1 400"), "bad head: %s", c.got);

  test_ceilings(path);

  dm_proxy_close(p);
  while (!closed) uv_run(&loop, UV_RUN_ONCE);
  CHECK(access(sock, F_OK) != 0, "socket file removed");
  rmdir(path);
  uv_close((uv_handle_t *)&upstream_srv, NULL);
  uv_close((uv_handle_t *)&dns_srv, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  CHECK(uv_loop_close(&loop) == 0, "every handle closed");
}

int main(void) {
  test_heads();
  test_obs_fold_is_refused();
  test_only_http_1_is_proxied();
  test_hosts();
  test_classes();
  test_dns_codec();
  test_end_to_end();
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  else printf("test_proxy: all passed\n");
  return failures ? 1 : 0;
}
