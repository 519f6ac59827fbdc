/* The egress proxy's pure parts: host names, authorities, address classes and rules, and
 * the request head (llhttp) with the rewrite of a plain request. No I/O; see proxy.h. */
#include "proxy.h"
#include <llhttp.h>
#include <arpa/inet.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ------------------------------------------------------------------------------------ */
/* Hosts, authorities, addresses                                                          */

int dm_proxy_normalize_host(const char *in, size_t len, char *out, size_t cap, int *ip, const char **why) {
  char tmp[DM_PROXY_HOST_MAX];
  *ip = 0;
  if (len == 0) {
    *why = "empty host";
    return -1;
  }
  if (len >= sizeof tmp) {
    *why = "host name too long";
    return -1;
  }
  int bracketed = in[0] == '[';
  if (bracketed) {
    if (len < 3 || in[len - 1] != ']') {
      *why = "malformed IPv6 literal";
      return -1;
    }
    in++;
    len -= 2;
  }
  for (size_t i = 0; i < len; i++) tmp[i] = (char)tolower((unsigned char)in[i]);
  tmp[len] = '\0';
  if (bracketed || memchr(tmp, ':', len)) {
    struct in6_addr a6;
    if (inet_pton(AF_INET6, tmp, &a6) != 1 || !inet_ntop(AF_INET6, &a6, out, (socklen_t)cap)) {
      *why = "malformed IPv6 literal";
      return -1;
    }
    *ip = 6;
    return 0;
  }
  if (len > 1 && tmp[len - 1] == '.') tmp[--len] = '\0';
  /* Every spelling that inet_aton takes is an IPv4 literal to the resolver too
   * ("127.1", "0x7f000001", "2130706433", "0177.0.0.1"): judge it as the address it is. */
  if (strspn(tmp, "0123456789abcdefx.") == len) {
    struct in_addr a4;
    if (inet_aton(tmp, &a4)) {
      if (!inet_ntop(AF_INET, &a4, out, (socklen_t)cap)) {
        *why = "host name too long";
        return -1;
      }
      *ip = 4;
      return 0;
    }
  }
  if (len > 253) {
    *why = "host name too long";
    return -1;
  }
  size_t label = 0;
  for (size_t i = 0; i < len; i++) {
    char ch = tmp[i];
    if (ch == '.') {
      if (label == 0) {
        *why = "empty label in host name";
        return -1;
      }
      label = 0;
      continue;
    }
    if (!(isalnum((unsigned char)ch) || ch == '-' || ch == '_')) {
      *why = "invalid character in host name";
      return -1;
    }
    if (++label > 63) {
      *why = "label longer than 63 bytes in host name";
      return -1;
    }
  }
  if (label == 0) {
    *why = "empty label in host name";
    return -1;
  }
  if (len + 1 > cap) {
    *why = "host name too long";
    return -1;
  }
  memcpy(out, tmp, len + 1);
  return 0;
}

static int parse_port(const char *s, size_t n, int *port) {
  if (n == 0 || n > 5) return -1;
  int v = 0;
  for (size_t i = 0; i < n; i++) {
    if (!isdigit((unsigned char)s[i])) return -1;
    v = v * 10 + (s[i] - '0');
  }
  if (v < 1 || v > 65535) return -1;
  *port = v;
  return 0;
}

int dm_proxy_split_authority(const char *in, size_t len, int default_port, char *host, size_t cap, int *port, int *ip,
                             const char **why) {
  const char *hs = in, *ps = NULL;
  size_t hl = len, pl = 0;
  if (len && in[0] == '[') {
    const char *close = memchr(in, ']', len);
    if (!close) {
      *why = "malformed IPv6 literal";
      return -1;
    }
    hl = (size_t)(close - in) + 1;
    if (hl < len) {
      if (in[hl] != ':') {
        *why = "malformed authority";
        return -1;
      }
      ps = in + hl + 1;
      pl = len - hl - 1;
    }
  } else {
    const char *colon = NULL;
    for (size_t i = 0; i < len; i++)
      if (in[i] == ':') {
        if (colon) {
          *why = "an IPv6 literal needs brackets";
          return -1;
        }
        colon = in + i;
      }
    if (colon) {
      hl = (size_t)(colon - in);
      ps = colon + 1;
      pl = len - hl - 1;
    }
  }
  if (ps) {
    if (parse_port(ps, pl, port) < 0) {
      *why = "invalid port";
      return -1;
    }
  } else if (default_port < 0) {
    *why = "a port is required";
    return -1;
  } else {
    *port = default_port;
  }
  return dm_proxy_normalize_host(hs, hl, host, cap, ip, why);
}

const char *dm_proxy_classify(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET6) return "ipv6";
  if (sa->sa_family != AF_INET) return "reserved";
  uint32_t a = ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr);
#define IN(net, bits) ((a & (bits ? ~0u << (32 - bits) : 0)) == (uint32_t)(net))
  if (IN(0x00000000, 8)) return "unspecified";
  if (IN(0x0a000000, 8)) return "private";
  if (a == 0x646464c8) return "metadata"; /* 100.100.100.200 */
  if (IN(0x64400000, 10)) return "shared";
  if (IN(0x7f000000, 8)) return "loopback";
  if (a == 0xa9fea9fe) return "metadata"; /* 169.254.169.254 */
  if (IN(0xa9fe0000, 16)) return "link-local";
  if (IN(0xac100000, 12)) return "private";
  if (IN(0xc0000000, 24) || IN(0xc0000200, 24) || IN(0xc0586300, 24)) return "reserved";
  if (IN(0xc0a80000, 16)) return "private";
  if (IN(0xc6120000, 15) || IN(0xc6336400, 24) || IN(0xcb007100, 24)) return "reserved";
  if (a == 0xffffffff) return "broadcast";
  if (IN(0xe0000000, 4)) return "multicast";
  if (IN(0xf0000000, 4)) return "reserved";
#undef IN
  return "public";
}

int dm_proxy_parse_cidr(const char *s, dm_proxy_rule *r) {
  char buf[64];
  size_t n = strlen(s);
  if (n == 0 || n >= sizeof buf) return -1;
  memcpy(buf, s, n + 1);
  int prefix = -1;
  char *slash = strchr(buf, '/');
  if (slash) {
    *slash = '\0';
    char *end;
    long v = strtol(slash + 1, &end, 10);
    if (*end || end == slash + 1 || v < 0 || v > 128) return -1;
    prefix = (int)v;
  }
  memset(r->addr, 0, sizeof r->addr);
  if (inet_pton(AF_INET, buf, r->addr) == 1) {
    r->family = AF_INET;
    if (prefix < 0) prefix = 32;
    if (prefix > 32) return -1;
  } else if (inet_pton(AF_INET6, buf, r->addr) == 1) {
    r->family = AF_INET6;
    if (prefix < 0) prefix = 128;
  } else {
    return -1;
  }
  r->prefix = prefix;
  return 0;
}

static int prefix_match(const unsigned char *a, const unsigned char *b, int bits) {
  int whole = bits / 8, rest = bits % 8;
  if (memcmp(a, b, (size_t)whole)) return 0;
  if (!rest) return 1;
  unsigned char mask = (unsigned char)(0xff << (8 - rest));
  return (a[whole] & mask) == (b[whole] & mask);
}

int dm_proxy_check_address(const struct sockaddr *sa, int port, const dm_proxy_rule *rules, size_t n, const char **why,
                           int *rule) {
  const unsigned char *bytes = sa->sa_family == AF_INET
                                 ? (const unsigned char *)&((const struct sockaddr_in *)sa)->sin_addr
                                 : (const unsigned char *)&((const struct sockaddr_in6 *)sa)->sin6_addr;
  *rule = -1;
  for (size_t i = 0; i < n; i++) {
    const dm_proxy_rule *r = &rules[i];
    if (r->family != sa->sa_family || (r->port && r->port != port)) continue;
    if (!prefix_match(bytes, r->addr, r->prefix)) continue;
    *rule = r->index;
    *why = "rule";
    return r->allow ? 1 : 0;
  }
  *why = dm_proxy_classify(sa);
  return strcmp(*why, "public") == 0;
}

/* ------------------------------------------------------------------------------------ */
/* The request head                                                                       */

typedef struct {
  llhttp_t p;
  llhttp_settings_t s;
  dm_proxy_head *h;
  int headers_done, message_done;
  int hstate; /* 0 none, 1 in a field, 2 in a value */
} parser_box;

/* A span is kept as one (offset, length) in the buffer, so each piece llhttp reports must
 * continue the one before. Pieces of a read that was split do; a gap means llhttp skipped
 * bytes inside the span, which it does for obsolete line folding ("X: a\r\n b" gives "a"
 * and " b"): refused (RFC 9112 section 5.2 allows a 400), as the span would otherwise take in
 * the CRLF and cut the value, and the rewrite would end the head early upstream. */
static int continues(dm_proxy_head *h, size_t off, size_t len, const char *at) {
  if (at == h->buf + off + len) return 1;
  h->status = 400;
  h->why = "obsolete line folding (obs-fold) is not accepted";
  return 0;
}

static int span_method(llhttp_t *p, const char *at, size_t len) {
  parser_box *b = (parser_box *)p;
  dm_proxy_head *h = b->h;
  if (b->headers_done) return 0;
  if (!h->method_len) h->method_off = (size_t)(at - h->buf);
  else if (!continues(h, h->method_off, h->method_len, at)) return -1;
  h->method_len += len;
  return 0;
}

static int span_url(llhttp_t *p, const char *at, size_t len) {
  parser_box *b = (parser_box *)p;
  dm_proxy_head *h = b->h;
  if (b->headers_done) return 0;
  if (!h->url_len) h->url_off = (size_t)(at - h->buf);
  else if (!continues(h, h->url_off, h->url_len, at)) return -1;
  h->url_len += len;
  return 0;
}

static int span_field(llhttp_t *p, const char *at, size_t len) {
  parser_box *b = (parser_box *)p;
  dm_proxy_head *h = b->h;
  if (b->headers_done) return 0; /* trailers of a chunked body: not ours to keep */
  if (b->hstate != 1) {
    if (b->hstate == 2) h->nhdr++;
    if (h->nhdr >= DM_PROXY_HEADERS_MAX) {
      h->status = 431;
      h->why = "too many header lines";
      return -1;
    }
    dm_proxy_span *s = &h->hdr[h->nhdr];
    s->name_off = (uint32_t)(at - h->buf);
    s->name_len = 0;
    s->value_off = s->name_off;
    s->value_len = 0;
    b->hstate = 1;
  } else if (!continues(h, h->hdr[h->nhdr].name_off, h->hdr[h->nhdr].name_len, at)) {
    return -1;
  }
  h->hdr[h->nhdr].name_len += (uint32_t)len;
  return 0;
}

static int span_value(llhttp_t *p, const char *at, size_t len) {
  parser_box *b = (parser_box *)p;
  dm_proxy_head *h = b->h;
  if (b->headers_done) return 0;
  dm_proxy_span *s = &h->hdr[h->nhdr];
  if (b->hstate == 1) {
    s->value_off = (uint32_t)(at - h->buf);
    s->value_len = 0;
    b->hstate = 2;
  } else if (!continues(h, s->value_off, s->value_len, at)) {
    return -1;
  }
  s->value_len += (uint32_t)len;
  return 0;
}

static int headers_complete(llhttp_t *p) {
  parser_box *b = (parser_box *)p;
  if (b->hstate) b->h->nhdr++;
  b->hstate = 0;
  b->headers_done = 1;
  return HPE_PAUSED;
}

static int message_complete(llhttp_t *p) {
  ((parser_box *)p)->message_done = 1;
  return HPE_PAUSED;
}

int dm_proxy_head_init(dm_proxy_head *h) {
  memset(h, 0, sizeof *h);
  h->buf = malloc(DM_PROXY_HEAD_MAX);
  parser_box *b = calloc(1, sizeof *b);
  if (!h->buf || !b) {
    free(h->buf);
    free(b);
    h->buf = NULL;
    return -1;
  }
  llhttp_settings_init(&b->s);
  b->s.on_method = span_method;
  b->s.on_url = span_url;
  b->s.on_header_field = span_field;
  b->s.on_header_value = span_value;
  b->s.on_headers_complete = headers_complete;
  b->s.on_message_complete = message_complete;
  llhttp_init(&b->p, HTTP_REQUEST, &b->s);
  b->h = h;
  h->parser = b;
  return 0;
}

void dm_proxy_head_free(dm_proxy_head *h) {
  free(h->buf);
  free(h->parser);
  free(h->path_copy);
  free(h->host_copy);
  h->buf = NULL;
  h->parser = NULL;
  h->path_copy = h->host_copy = NULL;
}

char *dm_proxy_head_space(dm_proxy_head *h, size_t *cap) {
  *cap = DM_PROXY_HEAD_MAX - h->len;
  return h->buf + h->len;
}

static int refuse(dm_proxy_head *h, int status, const char *why) {
  h->state = -1;
  h->status = status;
  h->why = why;
  return -1;
}

static void trim(const char **s, size_t *n) {
  while (*n && (**s == ' ' || **s == '\t')) (*s)++, (*n)--;
  while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t')) (*n)--;
}

static int name_is(const dm_proxy_head *h, const dm_proxy_span *s, const char *name) {
  return s->name_len == strlen(name) && !strncasecmp(h->buf + s->name_off, name, s->name_len);
}

/* The head is complete: work out the target. */
static int build_request(dm_proxy_head *h) {
  parser_box *b = h->parser;
  dm_proxy_request *r = &h->req;
  const char *why = NULL;
  if (h->method_len == 0 || h->method_len >= sizeof r->method) return refuse(h, 501, "unsupported method");
  memcpy(r->method, h->buf + h->method_off, h->method_len);
  r->method[h->method_len] = '\0';
  r->http_major = b->p.http_major;
  r->http_minor = b->p.http_minor;
  /* llhttp also takes a request line without a version (HTTP/0.9) and versions such as
   * HTTP/2.0, headers and all; forwarded as they came, servers would read them each their
   * own way. Only what this proxy speaks goes on. */
  if (r->http_major != 1 || r->http_minor > 1) return refuse(h, 505, "only HTTP/1.0 and HTTP/1.1 are proxied");
  const char *url = h->buf + h->url_off;
  size_t ulen = h->url_len;
  const char *host_val = NULL;
  size_t host_len = 0;
  for (size_t i = 0; i < h->nhdr; i++) {
    if (!name_is(h, &h->hdr[i], "host")) continue;
    if (host_val) return refuse(h, 400, "more than one Host header");
    host_val = h->buf + h->hdr[i].value_off;
    host_len = h->hdr[i].value_len;
    trim(&host_val, &host_len);
  }
  if (host_val) {
    h->host_copy = malloc(host_len + 1);
    if (!h->host_copy) return refuse(h, 500, "out of memory");
    memcpy(h->host_copy, host_val, host_len);
    h->host_copy[host_len] = '\0';
    r->host_header = h->host_copy;
  }
  const char *path = "";
  size_t plen = 0;
  if (b->p.method == HTTP_CONNECT) {
    r->form = DM_FORM_CONNECT;
    if (dm_proxy_split_authority(url, ulen, -1, r->host, sizeof r->host, &r->port, &r->ip, &why) < 0)
      return refuse(h, 400, why);
  } else if (ulen && url[0] == '/') {
    r->form = DM_FORM_ORIGIN;
    if (!host_val) return refuse(h, 400, "no Host header");
    if (dm_proxy_split_authority(host_val, host_len, 80, r->host, sizeof r->host, &r->port, &r->ip, &why) < 0)
      return refuse(h, 400, why);
    path = url;
    plen = ulen;
  } else if (ulen > 7 && !strncasecmp(url, "http://", 7)) {
    r->form = DM_FORM_ABSOLUTE;
    const char *a = url + 7;
    size_t alen = strcspn(a, "/?# \r\n");
    if (alen > ulen - 7) alen = ulen - 7;
    if (memchr(a, '@', alen)) return refuse(h, 400, "credentials in the URL are not accepted");
    if (dm_proxy_split_authority(a, alen, 80, r->host, sizeof r->host, &r->port, &r->ip, &why) < 0)
      return refuse(h, 400, why);
    path = a + alen;
    plen = ulen - 7 - alen;
  } else if (ulen > 8 && !strncasecmp(url, "https://", 8)) {
    return refuse(h, 400, "https:// through the proxy needs CONNECT");
  } else {
    return refuse(h, 400, "unsupported request target");
  }
  if (r->form != DM_FORM_CONNECT) {
    int need_slash = plen == 0 || path[0] != '/';
    h->path_copy = malloc(plen + 2);
    if (!h->path_copy) return refuse(h, 500, "out of memory");
    char *q = h->path_copy;
    if (need_slash) *q++ = '/';
    memcpy(q, path, plen);
    q[plen] = '\0';
    char *hash = strchr(h->path_copy, '#');
    if (hash) *hash = '\0';
    r->path = h->path_copy;
  } else {
    r->path = "";
  }
  h->state = 1;
  return 1;
}

int dm_proxy_head_advance(dm_proxy_head *h, size_t n) {
  if (h->state) return h->state;
  parser_box *b = h->parser;
  const char *start = h->buf + h->len;
  h->len += n;
  llhttp_errno_t e = llhttp_execute(&b->p, start, n);
  if (e == HPE_PAUSED && b->headers_done) {
    h->head_len = (size_t)(llhttp_get_error_pos(&b->p) - h->buf);
    return build_request(h);
  }
  if (e != HPE_OK) {
    if (h->status) return refuse(h, h->status, h->why);
    if (e == HPE_INVALID_METHOD) return refuse(h, 501, "unsupported method");
    return refuse(h, 400, "malformed request head");
  }
  if (h->len >= DM_PROXY_HEAD_MAX) return refuse(h, 431, "request head too large");
  return 0;
}

int dm_proxy_head_feed(dm_proxy_head *h, const char *data, size_t len) {
  size_t cap;
  char *dst = dm_proxy_head_space(h, &cap);
  if (len > cap) len = cap;
  memcpy(dst, data, len);
  return dm_proxy_head_advance(h, len);
}

int dm_proxy_head_body(dm_proxy_head *h, const char *data, size_t len, size_t *fwd) {
  parser_box *b = h->parser;
  *fwd = 0;
  if (b->message_done) return 1;
  if (len == 0) return 0;
  llhttp_resume(&b->p);
  llhttp_errno_t e = llhttp_execute(&b->p, data, len);
  if (e == HPE_OK) {
    *fwd = len;
    return 0;
  }
  if ((e == HPE_PAUSED || e == HPE_PAUSED_UPGRADE) && b->message_done) {
    *fwd = (size_t)(llhttp_get_error_pos(&b->p) - data);
    return 1;
  }
  return -1;
}

/* Appends s (n bytes) at *o if it fits. */
static int put(char *out, size_t cap, size_t *o, const char *s, size_t n) {
  if (*o + n > cap) return -1;
  memcpy(out + *o, s, n);
  *o += n;
  return 0;
}

/* The head to forward for a plain request: the request line in origin-form (to the
 * target) or in absolute-form (to an upstream proxy, with `proxy_auth` as its
 * Proxy-Authorization when not NULL), Host from the target where the sandbox sent an
 * absolute URL, hop-by-hop and the sandbox's Proxy-* headers dropped, Connection: close. */
static size_t rewrite(const dm_proxy_head *h, char *out, size_t cap, int absolute, const char *proxy_auth) {
  static const char *const drop[] = {"connection",         "proxy-connection", "keep-alive", "proxy-authorization",
                                     "proxy-authenticate", "upgrade",          "te",         NULL};
  const dm_proxy_request *r = &h->req;
  size_t o = 0;
  char line[64];
  int bad = 0, n;
  bad |= put(out, cap, &o, r->method, strlen(r->method));
  bad |= put(out, cap, &o, " ", 1);
  if (absolute) {
    bad |= put(out, cap, &o, "http://", 7);
    if (r->ip == 6) bad |= put(out, cap, &o, "[", 1);
    bad |= put(out, cap, &o, r->host, strlen(r->host));
    if (r->ip == 6) bad |= put(out, cap, &o, "]", 1);
    if (r->port != 80) {
      n = snprintf(line, sizeof line, ":%d", r->port);
      bad |= put(out, cap, &o, line, (size_t)n);
    }
  }
  bad |= put(out, cap, &o, r->path, strlen(r->path));
  n = snprintf(line, sizeof line, " HTTP/%d.%d\r\n", r->http_major, r->http_minor);
  bad |= put(out, cap, &o, line, (size_t)n);
  if (r->form == DM_FORM_ABSOLUTE) {
    bad |= put(out, cap, &o, "Host: ", 6);
    if (r->ip == 6) bad |= put(out, cap, &o, "[", 1);
    bad |= put(out, cap, &o, r->host, strlen(r->host));
    if (r->ip == 6) bad |= put(out, cap, &o, "]", 1);
    if (r->port != 80) {
      n = snprintf(line, sizeof line, ":%d", r->port);
      bad |= put(out, cap, &o, line, (size_t)n);
    }
    bad |= put(out, cap, &o, "\r\n", 2);
  }
  for (size_t i = 0; i < h->nhdr; i++) {
    const dm_proxy_span *s = &h->hdr[i];
    int skip = r->form == DM_FORM_ABSOLUTE && name_is(h, s, "host");
    for (const char *const *d = drop; *d && !skip; d++) skip = name_is(h, s, *d);
    if (skip) continue;
    const char *v = h->buf + s->value_off;
    size_t vl = s->value_len;
    trim(&v, &vl);
    bad |= put(out, cap, &o, h->buf + s->name_off, s->name_len);
    bad |= put(out, cap, &o, ": ", 2);
    bad |= put(out, cap, &o, v, vl);
    bad |= put(out, cap, &o, "\r\n", 2);
  }
  if (absolute && proxy_auth) {
    bad |= put(out, cap, &o, "Proxy-Authorization: ", 21);
    bad |= put(out, cap, &o, proxy_auth, strlen(proxy_auth));
    bad |= put(out, cap, &o, "\r\n", 2);
  }
  bad |= put(out, cap, &o, "Connection: close\r\n\r\n", 21);
  return bad ? 0 : o;
}

size_t dm_proxy_head_rewrite(const dm_proxy_head *h, char *out, size_t cap) { return rewrite(h, out, cap, 0, NULL); }

size_t dm_proxy_head_rewrite_proxy(const dm_proxy_head *h, char *out, size_t cap, const char *proxy_auth) {
  return rewrite(h, out, cap, 1, proxy_auth);
}
