/* Fuzz harness: the egress proxy's request head, as core/proxy.c drives it.
 *
 * The input is what a sandbox sends to its proxy socket. It is read in the pieces a socket
 * might deliver (dm_proxy_head_space + dm_proxy_head_advance, as head_read does); a head
 * that parses is checked, rewritten for a plain request (dm_proxy_head_rewrite into the
 * buffer start_splice uses) and the rewrite parsed again: it must name the same target (it
 * may add Host and Connection, so a head at the header-line limit is not parsed again).
 * What follows the head runs through dm_proxy_head_body in pieces, as dir_pump does. */
#include "fuzz.h"
#include "proxy.h"
#include <arpa/inet.h>
#include <ctype.h>
#include <string.h>
#include <strings.h>

#define REWRITE_CAP (DM_PROXY_HEAD_MAX + 512) /* what start_splice gives the rewrite */

static void check_request(const dm_proxy_head *h) {
  const dm_proxy_request *r = &h->req;
  FUZZ_CHECK(h->head_len > 0 && h->head_len <= h->len, "head_len %zu of %zu", h->head_len, h->len);
  FUZZ_CHECK(r->method[0] && strlen(r->method) < sizeof r->method, "method");
  FUZZ_CHECK(r->port >= 1 && r->port <= 65535, "port %d", r->port);
  FUZZ_CHECK(r->host[0] && strlen(r->host) < DM_PROXY_HOST_MAX, "host");
  if (r->ip == 0) {
    size_t n = strlen(r->host);
    FUZZ_CHECK(n <= 253 && r->host[n - 1] != '.', "host name '%s'", r->host);
    for (const char *p = r->host; *p; p++)
      FUZZ_CHECK(islower((unsigned char)*p) || isdigit((unsigned char)*p) || *p == '-' || *p == '_' || *p == '.',
                 "host name '%s' has byte 0x%02x", r->host, (unsigned char)*p);
  } else {
    unsigned char a[16];
    FUZZ_CHECK(inet_pton(r->ip == 4 ? AF_INET : AF_INET6, r->host, a) == 1, "IP literal '%s'", r->host);
  }
  if (r->form == DM_FORM_CONNECT) {
    FUZZ_CHECK(r->path && r->path[0] == '\0', "CONNECT path");
  } else {
    FUZZ_CHECK(r->path && r->path[0] == '/' && !strchr(r->path, '#'), "path '%s'", r->path ? r->path : "(null)");
  }
}

/* The rewritten head of a plain request parses to the same target, and keeps no header
 * that names the proxy hop. */
static void check_rewrite(const dm_proxy_head *h) {
  static char out[REWRITE_CAP];
  size_t n = dm_proxy_head_rewrite(h, out, sizeof out);
  FUZZ_CHECK(n > 0, "the rewrite of a %zu-byte head does not fit in %d bytes", h->head_len, REWRITE_CAP);
  dm_proxy_head again;
  FUZZ_CHECK(dm_proxy_head_init(&again) == 0, "out of memory");
  int r = n <= DM_PROXY_HEAD_MAX ? dm_proxy_head_feed(&again, out, n) : -2;
  if (r == -1 && again.status == 431 && h->nhdr + 2 > DM_PROXY_HEADERS_MAX) {
    /* the rewrite may add Host and Connection to a head at the limit: upstream's business */
    dm_proxy_head_free(&again);
    return;
  }
  FUZZ_CHECK(r == 1, "the rewrite does not parse (%d: %s): %.*s", r, again.why ? again.why : "", (int)n, out);
  FUZZ_CHECK(again.head_len == n, "the rewrite has bytes after its head");
  FUZZ_CHECK(again.req.form == DM_FORM_ORIGIN, "the rewrite is not origin-form");
  FUZZ_CHECK(!strcmp(again.req.method, h->req.method), "method %s became %s", h->req.method, again.req.method);
  FUZZ_CHECK(!strcmp(again.req.host, h->req.host) && again.req.port == h->req.port, "target %s:%d became %s:%d",
             h->req.host, h->req.port, again.req.host, again.req.port);
  FUZZ_CHECK(!strcmp(again.req.path, h->req.path), "path %s became %s", h->req.path, again.req.path);
  static const char *const hop[] = {"proxy-authorization", "proxy-connection", "connection", "upgrade", NULL};
  size_t closes = 0;
  for (size_t i = 0; i < again.nhdr; i++) {
    const dm_proxy_span *s = &again.hdr[i];
    for (const char *const *d = hop; *d; d++) {
      if (s->name_len != strlen(*d) || strncasecmp(again.buf + s->name_off, *d, s->name_len)) continue;
      FUZZ_CHECK(!strcmp(*d, "connection"), "the rewrite forwards %s", *d);
      closes++;
    }
  }
  FUZZ_CHECK(closes == 1, "the rewrite has %zu Connection headers", closes);
  dm_proxy_head_free(&again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_chunks ch;
  fuzz_chunks_init(&ch, data, size);
  dm_proxy_head h;
  FUZZ_CHECK(dm_proxy_head_init(&h) == 0, "out of memory");
  size_t off = 0;
  int r = 0;
  while (r == 0 && off < size) {
    size_t cap;
    char *dst = dm_proxy_head_space(&h, &cap);
    FUZZ_CHECK(cap > 0, "a parser still reading has no space left");
    size_t n = fuzz_chunk_next(&ch, size - off < cap ? size - off : cap);
    memcpy(dst, data + off, n);
    off += n;
    r = dm_proxy_head_advance(&h, n);
  }
  if (r < 0) {
    FUZZ_CHECK(h.status >= 400 && h.status <= 599 && h.why && *h.why, "refusal %d", h.status);
  } else if (r == 1) {
    check_request(&h);
    if (h.req.form != DM_FORM_CONNECT) {
      check_rewrite(&h);
      /* the body: first what arrived with the head, then the rest of the input */
      size_t fwd = 0, given = h.len - h.head_len;
      int b = dm_proxy_head_body(&h, h.buf + h.head_len, given, &fwd);
      FUZZ_CHECK(fwd <= given, "forwarded %zu of %zu", fwd, given);
      while (b == 0 && off < size) {
        size_t n = fuzz_chunk_next(&ch, size - off);
        b = dm_proxy_head_body(&h, (const char *)data + off, n, &fwd);
        FUZZ_CHECK(fwd <= n, "forwarded %zu of %zu", fwd, n);
        off += n;
      }
    }
  }
  dm_proxy_head_free(&h);
  return 0;
}
