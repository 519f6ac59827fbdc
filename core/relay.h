#ifndef DEMESNE_RELAY_H
#define DEMESNE_RELAY_H
/*
 * The relay engine: how a server takes a connection handed over from inside a sandbox.
 *
 * demesne-init's relay (core/init/relay.c) listens on a TCP port inside the sandbox,
 * connects to a unix socket of the host for each connection it accepts, and either
 *  - hands the accepted TCP socket over (SCM_RIGHTS, with one byte) and hangs up: the
 *    server then talks to the sandbox's socket itself (DM_RELAY_SOCKET), or
 *  - where a socket cannot be passed (gVisor), sends the byte '\0' with no socket and
 *    copies the client's bytes over the unix connection, which is then the client
 *    itself (DM_RELAY_COPY).
 * A unix connection whose first byte is anything else with no socket is a client that
 * connected to the socket itself (DM_RELAY_DIRECT): the egress proxy serves it, the HTTP
 * server and core.stream refuse it. A socket of another kind than TCP is refused.
 *
 * Two levels:
 *  - dm_relay_kind_of() and dm_relay_take() read and take one hand-over on a unix
 *    connection opened for IPC (uv_pipe_init(..., 1)); the egress proxy, which counts a
 *    connection from the moment it is accepted, uses them on its own connections;
 *  - a dm_relay is the set of unix connections of one listener that have not handed over
 *    yet: dm_relay_accept() from the listener's connection callback, and the owner's
 *    callback gets each hand-over. At most DM_RELAY_PENDING_MAX wait (each holds a
 *    descriptor); past it the oldest that has sent nothing is closed, so a burst of silent
 *    connections cannot push out a hand-over whose byte is already waiting to be read;
 *    when every waiting one has sent its byte (they are read in this turn of the loop)
 *    the new one is kept beside them.
 * Everything runs on one libuv loop; nothing here knows of Lua or HTTP.
 */
#include <stddef.h>
#include <sys/types.h>
#include <uv.h>

#define DM_RELAY_PENDING_MAX 16 ///< unix connections of one listener waiting for their hand-over

/// What the first read of a unix connection carries.
typedef enum dm_relay_kind {
  DM_RELAY_NONE = 0,   ///< nothing usable: it hung up, failed, or sent a socket that is not TCP
  DM_RELAY_SOCKET = 1, ///< a TCP socket handed over (dm_relay_take() into a uv_tcp_t)
  DM_RELAY_COPY = 2,   ///< the byte '\0' and no socket: the unix connection carries the client's bytes
  DM_RELAY_DIRECT = 3, ///< another first byte and no socket: a client on the unix socket itself
} dm_relay_kind;

/// Classifies the first read of a relay connection: `n` as a read callback got it (<= 0:
/// end or error), `first` its first byte (read only when n >= 1), `pending` the sockets
/// queued with it (uv_pipe_pending_count) and `type` the first one's type
/// (uv_pipe_pending_type; ignored when pending is 0). Pure: no call into libuv.
dm_relay_kind dm_relay_kind_of(ssize_t n, const char *first, int pending, uv_handle_type type);

/// Reads the hand-over of `from` (an IPC pipe whose read callback just got n bytes at
/// `first`): dm_relay_kind_of() with its queued sockets.
dm_relay_kind dm_relay_classify(uv_pipe_t *from, ssize_t n, const char *first);

/// Takes a hand-over of `from` into `into`, a handle initialised on the same loop and not
/// yet opened: for DM_RELAY_SOCKET a uv_tcp_t (the queued socket is accepted into it), for DM_RELAY_COPY a uv_pipe_t opened on a duplicate of from's descriptor (bytes not
/// read yet stay in the socket; `from` is still the caller's to close). Returns 0, or a
/// libuv error (UV_EINVAL for another kind); on error `into` is left unopened, still to close.
int dm_relay_take(uv_pipe_t *from, dm_relay_kind kind, uv_stream_t *into);

/// The waiting unix connections of one listener.
typedef struct dm_relay dm_relay;

/// Called once for each connection that hands over a socket (DM_RELAY_SOCKET) or a copy
/// marker (DM_RELAY_COPY), from the loop: the owner calls dm_relay_take(from, kind, its
/// handle) to take it, or does nothing to refuse it. `from` is closed when this returns.
typedef void (*dm_relay_cb)(void *ud, dm_relay_kind kind, uv_pipe_t *from);

/// A new, empty set on `loop`; NULL when out of memory.
dm_relay *dm_relay_new(uv_loop_t *loop, dm_relay_cb cb, void *ud);

/// From a listening unix socket's connection callback (status >= 0): accepts the
/// connection into the set and reads its hand-over. Every call takes the connection (libuv
/// accepts no other until it is taken), closing it at once when out of memory, when the
/// set is closing or when it cannot be read. Returns 0 or a libuv error.
int dm_relay_accept(dm_relay *r, uv_stream_t *server);

/// Unix connections of the set still waiting for their hand-over.
size_t dm_relay_waiting(const dm_relay *r);

/// Closes every waiting connection and frees the set once their handles are closed; then
/// on_closed(ud) (may be NULL), from the loop. The callback is never called again.
void dm_relay_close(dm_relay *r, void (*on_closed)(void *ud), void *ud);

#endif
