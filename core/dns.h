#ifndef DEMESNE_DNS_H
#define DEMESNE_DNS_H
/*
 * A minimal DNS client over UDP on the loop: one A query to one server, two tries.
 * The egress proxy uses it in test mode, where names like allowed.test are served by a
 * test resolver on loopback; in normal use the proxy calls getaddrinfo instead.
 *
 * The callback is called exactly once, from the loop, unless dm_dns_cancel() was called.
 */
#include <stddef.h>
#include <uv.h>

typedef struct dm_dns_query dm_dns_query;

#define DM_DNS_MAX_ADDRS 16

/// Answer of a query: status 0 with n >= 1 IPv4 addresses (port 0), or a negative libuv
/// error: UV_ENOENT (NXDOMAIN or no A record), UV_ETIMEDOUT, UV_EPROTO (bad answer).
typedef void (*dm_dns_cb)(void *ud, int status, const struct sockaddr_in *addrs, size_t n);

/// Sends an A query for `name` to `server` (an IPv4 or IPv6 sockaddr). The whole query
/// gives up after `timeout_ms` (a second try is sent half-way). Returns the query, or NULL
/// with *err set (UV_EINVAL for a name that cannot be encoded, or a libuv error).
dm_dns_query *dm_dns_resolve(uv_loop_t *loop, const struct sockaddr *server, const char *name, unsigned timeout_ms,
                             dm_dns_cb cb, void *ud, int *err);

/// Cancels a query: its callback is not called; memory goes from a close callback.
void dm_dns_cancel(dm_dns_query *q);

/// Encodes an A query for `name` with `id` into out (cap bytes). Returns the length or 0.
size_t dm_dns_encode_query(const char *name, unsigned id, unsigned char *out, size_t cap);

/// Decodes an answer to query `id`: fills up to max addresses. Returns the count (>= 0),
/// or a negative libuv error (UV_ENOENT for NXDOMAIN, UV_EPROTO for a malformed answer or
/// another id).
int dm_dns_decode_answer(const unsigned char *msg, size_t len, unsigned id, struct sockaddr_in *out, size_t max);

#endif
