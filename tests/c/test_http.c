/* core/http.c without Lua: a request against a loopback libuv server, cancel (deferred,
 * once), discard (silent), and freeing the engine with requests in flight (no leaks: run
 * under the sanitizer build with ASAN_OPTIONS=detect_leaks=1). */
#include "http.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "check.h"

static uv_loop_t loop;

/* ---- a loopback server: answers GET /hello, never answers anything else ---- */
#define MAX_CLIENTS 16
static uv_tcp_t server;
static uv_tcp_t *clients[MAX_CLIENTS];
static int port;

static void client_closed(uv_handle_t *h) { free(h); }

static void drop_client(uv_tcp_t *c) {
  for (int i = 0; i < MAX_CLIENTS; i++)
    if (clients[i] == c) clients[i] = NULL;
  if (!uv_is_closing((uv_handle_t *)c)) uv_close((uv_handle_t *)c, client_closed);
}

static void alloc_cb(uv_handle_t *h, size_t n, uv_buf_t *b) {
  static char buf[65536];
  *b = uv_buf_init(buf, sizeof buf);
}

static void written(uv_write_t *w, int status) { free(w); }

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  if (n < 0) {
    drop_client((uv_tcp_t *)s);
    return;
  }
  if (n > 0 && memmem(b->base, (size_t)n, "GET /hello ", 11)) {
    static const char resp[] = "HTTP/1.1 200 OK\r\nX-Thing: a\r\nX-Thing: b\r\nContent-Length: 5\r\n\r\nhello";
    uv_write_t *w = malloc(sizeof *w);
    uv_buf_t out = uv_buf_init((char *)resp, sizeof resp - 1);
    uv_write(w, s, &out, 1, written);
  }
}

static void on_conn(uv_stream_t *srv, int status) {
  uv_tcp_t *c = malloc(sizeof *c);
  uv_tcp_init(&loop, c);
  if (uv_accept(srv, (uv_stream_t *)c) != 0) {
    uv_close((uv_handle_t *)c, client_closed);
    return;
  }
  for (int i = 0; i < MAX_CLIENTS; i++)
    if (!clients[i]) {
      clients[i] = c;
      break;
    }
  uv_read_start((uv_stream_t *)c, alloc_cb, on_read);
}

static void server_start(void) {
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  uv_tcp_init(&loop, &server);
  uv_tcp_bind(&server, (struct sockaddr *)&a, 0);
  uv_listen((uv_stream_t *)&server, 16, on_conn);
  struct sockaddr_in b;
  int len = sizeof b;
  uv_tcp_getsockname(&server, (struct sockaddr *)&b, &len);
  port = ntohs(b.sin_port);
}

static void server_stop(void) {
  for (int i = 0; i < MAX_CLIENTS; i++)
    if (clients[i]) drop_client(clients[i]);
  uv_close((uv_handle_t *)&server, NULL);
}

/* ---- request bookkeeping ---- */
typedef struct {
  int headers, done;
  long status;
  char code[32];
  char msg[512];
  char body[64];
  char thing[32];
  int inside_call; /* set while dm_http_start/cancel runs: on_done must not fire then */
} probe;

static void p_headers(void *ud, dm_http_req *r) {
  probe *p = ud;
  p->headers++;
  p->status = dm_http_status(r);
}

static void p_data(void *ud, dm_http_req *r, const char *d, size_t n) {}

static void p_done(void *ud, dm_http_req *r, const dm_http_err *err) {
  probe *p = ud;
  CHECK(!p->inside_call, "on_done re-entrant");
  p->done++;
  snprintf(p->code, sizeof p->code, "%s", err ? err->code : "OK");
  snprintf(p->msg, sizeof p->msg, "%s", err ? err->msg : "");
  if (!err) {
    size_t len;
    const char *b = dm_http_body(r, &len);
    snprintf(p->body, sizeof p->body, "%.*s", (int)len, b);
    for (size_t i = 0; i < dm_http_header_count(r); i++) {
      const char *n, *v;
      dm_http_header_at(r, i, &n, &v);
      if (!strcmp(n, "x-thing")) strncat(p->thing, v, sizeof p->thing - strlen(p->thing) - 1);
    }
  }
}

static const dm_http_handler H = {p_headers, p_data, p_done};

static dm_http_req *start(dm_http *h, const char *path, probe *p) {
  char url[128];
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
  dm_http_opts o;
  memset(&o, 0, sizeof o);
  o.url = url;
  dm_http_err err;
  p->inside_call = 1;
  dm_http_req *r = dm_http_start(h, &o, &H, p, &err);
  p->inside_call = 0;
  CHECK(r != NULL, "start %s: %s", path, r ? "" : err.msg);
  return r;
}

static void run_until(int *flag, int want) {
  for (int i = 0; i < 2000 && *flag < want; i++) uv_run(&loop, UV_RUN_ONCE);
}

static void spin(int ms) {
  uint64_t end = uv_now(&loop) + (uint64_t)ms;
  while (uv_now(&loop) < end) {
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_sleep(1);
    uv_update_time(&loop);
  }
}

int main(void) {
  uv_loop_init(&loop);
  server_start();
  dm_http *h = dm_http_new(&loop);
  CHECK(h != NULL, "engine");

  /* a plain GET */
  probe a = {0};
  start(h, "/hello", &a);
  CHECK(a.done == 0, "not completed synchronously");
  run_until(&a.done, 1);
  CHECK(a.done == 1 && !strcmp(a.code, "OK"), "GET: %s", a.code);
  CHECK(a.headers == 1 && a.status == 200, "head once: %d %ld", a.headers, a.status);
  CHECK(!strcmp(a.body, "hello"), "body '%s'", a.body);
  CHECK(!strcmp(a.thing, "ab"), "both repeated headers kept in order: '%s'", a.thing);
  CHECK(dm_http_active(h) == 0, "nothing active");

  /* out of descriptors: the request fails with an error that names it, and the next one
   * works once descriptors are free again (issue 10: never a silent success) */
  {
    dm_http *h2 = dm_http_new(&loop); /* its own connection cache: the request needs a new socket */
    struct rlimit old, low;
    getrlimit(RLIMIT_NOFILE, &old);
    low = old;
    low.rlim_cur = 64;
    setrlimit(RLIMIT_NOFILE, &low);
    int held[64], n = 0;
    for (int fd; n < 64 && (fd = dup(0)) >= 0;) held[n++] = fd;
    probe e = {0};
    start(h2, "/hello", &e);
    run_until(&e.done, 1);
    CHECK(e.done == 1 && !strcmp(e.code, "EMFILE"), "out of descriptors: %s", e.code);
    CHECK(strcasestr(e.msg, "too many open files"), "the message names it: %s", e.msg);
    while (n > 0) close(held[--n]);
    setrlimit(RLIMIT_NOFILE, &old);
    probe e2 = {0};
    start(h2, "/hello", &e2);
    run_until(&e2.done, 1);
    CHECK(e2.done == 1 && !strcmp(e2.code, "OK"), "descriptors back: %s", e2.code);
    dm_http_free(h2);
  }

  /* cancel: once, later */
  probe c = {0};
  dm_http_req *rc = start(h, "/hang", &c);
  spin(30);
  c.inside_call = 1;
  dm_http_cancel(rc);
  dm_http_cancel(rc);
  c.inside_call = 0;
  CHECK(c.done == 0, "cancel does not complete synchronously");
  run_until(&c.done, 1);
  spin(10);
  CHECK(c.done == 1 && !strcmp(c.code, "ECANCELED"), "cancel: %d %s", c.done, c.code);

  /* discard: silent */
  probe d = {0};
  dm_http_req *rd = start(h, "/hang", &d);
  spin(30);
  dm_http_discard(rd);
  spin(20);
  CHECK(d.done == 0, "no callback after discard");
  CHECK(dm_http_active(h) == 0, "discarded request freed");

  /* a synchronous failure */
  dm_http_opts o;
  memset(&o, 0, sizeof o);
  o.url = "http://127.0.0.1:1/";
  o.body_file = "/nonexistent/body";
  dm_http_err err;
  CHECK(dm_http_start(h, &o, &H, &d, &err) == NULL && !strcmp(err.code, "ENOENT"), "missing body_file");

  /* free with requests in flight: each completes once with ECANCELED, nothing leaks */
  probe f[3] = {{0}};
  for (int i = 0; i < 3; i++) start(h, i == 0 ? "/hang" : "/hello", &f[i]);
  spin(30); /* /hang is waiting; the others may have finished */
  probe q = {0};
  start(h, "/hang", &q); /* still queued: never added to curl */
  dm_http_free(h);
  for (int i = 0; i < 3; i++) CHECK(f[i].done == 1, "request %d completed once (%d)", i, f[i].done);
  CHECK(!strcmp(f[0].code, "ECANCELED"), "in flight: %s", f[0].code);
  CHECK(q.done == 1 && !strcmp(q.code, "ECANCELED"), "queued: %s", q.code);

  server_stop();
  uv_run(&loop, UV_RUN_DEFAULT);
  int rcl = uv_loop_close(&loop);
  CHECK(rcl == 0, "every handle closed: %s", uv_strerror(rcl));
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("test_http: all checks passed\n");
  return 0;
}
