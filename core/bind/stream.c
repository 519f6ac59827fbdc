/* core.stream: byte streams on the loop — pipes (stdio, child processes, unix sockets) and TCP. */
#include "runtime.h"
#include "bind/bind.h"
#include "relay.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STREAM_MT "core.stream"

struct dm_stream {
  uv_stream_t *h;  /* heap: freed by the close callback */
  int read_ref;    /* read callback while reading */
  int self_ref;    /* keeps the userdata alive while reading or with writes pending */
  int pending;     /* writes + shutdown + connect in flight */
  int server_ref;  /* listen callback */
  dm_relay *relay; /* relay listeners: connections that have not handed over yet */
};

typedef struct {
  uv_write_t req;
  int cb_ref;
  dm_stream *s;
  char *buf;
} write_req;

static void on_close(uv_handle_t *h) {
  free(h);
  dm_handle_count(-1);
}

static void hold(lua_State *L, dm_stream *s, int idx) {
  if (s->self_ref == LUA_NOREF) {
    lua_pushvalue(L, idx);
    s->self_ref = dm_ref(L);
  }
}

static void maybe_release(lua_State *L, dm_stream *s) {
  if (s->pending == 0 && s->read_ref == LUA_NOREF && s->server_ref == LUA_NOREF) dm_unref(L, &s->self_ref);
}

uv_pipe_t *dm_pipe_new(void) {
  uv_pipe_t *p = malloc(sizeof *p);
  if (!p) return NULL;
  uv_pipe_init(dm_rt.loop, p, 0);
  dm_handle_count(1);
  return p;
}

dm_stream *dm_stream_push(lua_State *L, uv_stream_t *h) {
  dm_stream *s = lua_newuserdatauv(L, sizeof *s, 0);
  s->h = h;
  s->read_ref = s->self_ref = s->server_ref = LUA_NOREF;
  s->pending = 0;
  s->relay = NULL;
  h->data = s;
  luaL_setmetatable(L, STREAM_MT);
  return s;
}

static void stream_close(lua_State *L, dm_stream *s);

static dm_stream *check_stream(lua_State *L, int idx) {
  dm_stream *s = luaL_checkudata(L, idx, STREAM_MT);
  luaL_argcheck(L, s->h != NULL, idx, "stream is closed");
  return s;
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  buf->base = malloc(65536);
  buf->len = buf->base ? 65536 : 0;
}

static void on_read(uv_stream_t *h, ssize_t n, const uv_buf_t *buf) {
  dm_stream *s = h->data;
  lua_State *L = dm_rt.L;
  if (!L || !s || s->read_ref == LUA_NOREF || n == 0) {
    free(buf->base);
    return;
  }
  dm_push_ref(L, s->read_ref);
  if (n > 0) {
    lua_pushlstring(L, buf->base, (size_t)n);
    free(buf->base);
    dm_call(L, 1);
    return;
  }
  free(buf->base);
  /* EOF or error: reading stops, the callback learns it once */
  uv_read_stop(h);
  int cb = s->read_ref;
  s->read_ref = LUA_NOREF;
  if (n == UV_EOF) {
    lua_pushnil(L);
    dm_call(L, 1);
  } else {
    lua_pushnil(L);
    lua_pushfstring(L, "read: %s", uv_strerror((int)n));
    lua_pushstring(L, uv_err_name((int)n));
    dm_call(L, 3);
  }
  dm_unref(L, &cb);
  if (h->data) maybe_release(L, s);
}

/// stream:read_start(callback) -> true | nil, msg, code.
/// callback(data) for each chunk (string); callback(nil) once at EOF;
/// callback(nil, msg, code) once on error. Reading stops after EOF or error.
static int l_read_start(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (s->read_ref != LUA_NOREF) return dm_fail(L, "read: already reading", "EALREADY");
  int r = uv_read_start(s->h, alloc_cb, on_read);
  if (r) return dm_fail_uv(L, "read", r);
  lua_pushvalue(L, 2);
  s->read_ref = dm_ref(L);
  hold(L, s, 1);
  lua_pushboolean(L, 1);
  return 1;
}

/// stream:read_stop() -> nil. Stops reading; the read callback is not called again.
static int l_read_stop(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  uv_read_stop(s->h);
  dm_unref(L, &s->read_ref);
  maybe_release(L, s);
  return 0;
}

static void on_write(uv_write_t *req, int status) {
  write_req *w = (write_req *)req;
  lua_State *L = dm_rt.L;
  dm_stream *s = w->s;
  free(w->buf);
  if (L) {
    if (w->cb_ref != LUA_NOREF) {
      dm_push_ref(L, w->cb_ref);
      if (status == 0) {
        lua_pushboolean(L, 1);
        dm_call(L, 1);
      } else {
        lua_pushnil(L);
        lua_pushfstring(L, "write: %s", uv_strerror(status));
        lua_pushstring(L, uv_err_name(status));
        dm_call(L, 3);
      }
      dm_unref(L, &w->cb_ref);
    }
    if (s) {
      s->pending--;
      maybe_release(L, s);
    }
  }
  free(w);
}

/// stream:write(data [, callback]) -> true | nil, msg, code.
/// Queues `data` (string); callback(true) or callback(nil, msg, code) once when written.
static int l_write(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  write_req *w = calloc(1, sizeof *w);
  if (!w) return luaL_error(L, "out of memory");
  w->buf = malloc(len ? len : 1);
  if (!w->buf) {
    free(w);
    return luaL_error(L, "out of memory");
  }
  memcpy(w->buf, data, len);
  w->s = s;
  w->cb_ref = LUA_NOREF;
  uv_buf_t b = uv_buf_init(w->buf, (unsigned)len);
  int r = uv_write(&w->req, s->h, &b, 1, on_write);
  if (r) {
    free(w->buf);
    free(w);
    return dm_fail_uv(L, "write", r);
  }
  if (lua_isfunction(L, 3)) {
    lua_pushvalue(L, 3);
    w->cb_ref = dm_ref(L);
  }
  s->pending++;
  hold(L, s, 1);
  lua_pushboolean(L, 1);
  return 1;
}

/// stream:write_queue_size() -> integer: bytes queued and not yet written.
static int l_write_queue_size(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  lua_pushinteger(L, (lua_Integer)uv_stream_get_write_queue_size(s->h));
  return 1;
}

typedef struct {
  uv_shutdown_t req;
  int cb_ref;
  dm_stream *s;
} shutdown_req;

static void on_shutdown(uv_shutdown_t *req, int status) {
  shutdown_req *q = (shutdown_req *)req;
  lua_State *L = dm_rt.L;
  if (L) {
    if (q->cb_ref != LUA_NOREF) {
      dm_push_ref(L, q->cb_ref);
      lua_pushboolean(L, status == 0);
      dm_call(L, 1);
      dm_unref(L, &q->cb_ref);
    }
    if (q->s) {
      q->s->pending--;
      maybe_release(L, q->s);
    }
  }
  free(q);
}

/// stream:shutdown([callback]) -> true | nil, msg, code. Half-closes the write side after
/// queued writes; callback(ok) once.
static int l_shutdown(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  shutdown_req *q = calloc(1, sizeof *q);
  if (!q) return luaL_error(L, "out of memory");
  q->cb_ref = LUA_NOREF;
  q->s = s;
  int r = uv_shutdown(&q->req, s->h, on_shutdown);
  if (r) {
    free(q);
    return dm_fail_uv(L, "shutdown", r);
  }
  if (lua_isfunction(L, 2)) {
    lua_pushvalue(L, 2);
    q->cb_ref = dm_ref(L);
  }
  s->pending++;
  hold(L, s, 1);
  lua_pushboolean(L, 1);
  return 1;
}

/// stream:close() -> nil. Closes the stream; pending read callbacks are dropped, pending
/// write callbacks get an ECANCELED failure. Idempotent. Also __gc and __close.
static int l_close(lua_State *L) {
  stream_close(L, luaL_checkudata(L, 1, STREAM_MT));
  return 0;
}

/* What stream:close() does, on a stream anywhere on the stack. */
static void stream_close(lua_State *L, dm_stream *s) {
  if (s->h) {
    s->h->data = NULL;
    if (!uv_is_closing((uv_handle_t *)s->h)) uv_close((uv_handle_t *)s->h, on_close);
    s->h = NULL;
  }
  if (s->relay) dm_relay_close(s->relay, NULL, NULL); /* no hand-over is delivered after this */
  s->relay = NULL;
  lua_State *Lr = dm_rt.L ? L : NULL;
  dm_unref(Lr, &s->read_ref);
  dm_unref(Lr, &s->server_ref);
  /* self_ref goes when the last pending request completes (their callbacks still run) */
  if (s->pending == 0) dm_unref(Lr, &s->self_ref);
}

/// stream:fileno() -> integer | nil, msg, code
static int l_fileno(lua_State *L) {
  dm_stream *s = check_stream(L, 1);
  uv_os_fd_t fd;
  int r = uv_fileno((uv_handle_t *)s->h, &fd);
  if (r) return dm_fail_uv(L, "fileno", r);
  lua_pushinteger(L, fd);
  return 1;
}

/// core.stream.open_fd(fd) -> stream | nil, msg, code. Wraps an inherited descriptor
/// (0 = stdin, 1 = stdout) that is a pipe, socket or terminal.
static int l_open_fd(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  uv_handle_type t = uv_guess_handle(fd);
  if (t == UV_TTY) {
    uv_tty_t *tty = malloc(sizeof *tty);
    int r = uv_tty_init(dm_rt.loop, tty, fd, 0);
    if (r) {
      free(tty);
      return dm_fail_uv(L, "open_fd", r);
    }
    dm_handle_count(1);
    dm_stream_push(L, (uv_stream_t *)tty);
    return 1;
  }
  if (t != UV_NAMED_PIPE && t != UV_TCP) {
    return dm_fail(L, "open_fd: descriptor is not a pipe, socket or terminal", "EINVAL");
  }
  uv_pipe_t *p = dm_pipe_new();
  if (!p) return luaL_error(L, "out of memory");
  int r = uv_pipe_open(p, fd);
  if (r) {
    uv_close((uv_handle_t *)p, on_close);
    return dm_fail_uv(L, "open_fd", r);
  }
  dm_stream_push(L, (uv_stream_t *)p);
  return 1;
}

typedef struct {
  uv_connect_t req;
  int cb_ref;
  int stream_ref;
} connect_req;

static void on_connect(uv_connect_t *req, int status) {
  connect_req *c = (connect_req *)req;
  lua_State *L = dm_rt.L;
  if (L) {
    dm_push_ref(L, c->cb_ref);
    if (status == 0) {
      dm_push_ref(L, c->stream_ref);
      dm_call(L, 1);
    } else {
      dm_push_ref(L, c->stream_ref);
      dm_stream *s = lua_touserdata(L, -1);
      lua_pop(L, 1);
      if (s && s->h) {
        s->h->data = NULL;
        uv_close((uv_handle_t *)s->h, on_close);
        s->h = NULL;
      }
      lua_pushnil(L);
      lua_pushfstring(L, "connect: %s", uv_strerror(status));
      lua_pushstring(L, uv_err_name(status));
      dm_call(L, 3);
    }
    dm_unref(L, &c->cb_ref);
    dm_unref(L, &c->stream_ref);
  }
  free(c);
}

/// core.stream.connect_unix(path, callback) -> true | nil, msg, code.
/// callback(stream) once connected, or callback(nil, msg, code).
static int l_connect_unix(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  uv_pipe_t *p = dm_pipe_new();
  if (!p) return luaL_error(L, "out of memory");
  connect_req *c = calloc(1, sizeof *c);
  dm_stream_push(L, (uv_stream_t *)p);
  c->stream_ref = dm_ref(L);
  lua_pushvalue(L, 2);
  c->cb_ref = dm_ref(L);
  uv_pipe_connect(&c->req, p, path, on_connect);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.stream.connect_unix_at(dir, name, callback) -> true | nil, msg, code.
/// Connects to the unix socket `name` (one path component) in folder `dir` without
/// following a symbolic link there: `name` is opened O_PATH|O_NOFOLLOW, must be a socket,
/// and the connection goes through /proc/self/fd/N, so it reaches that very inode. For
/// sockets in folders a sandbox can write (the control socket in a run folder). A missing
/// name, a link or another file type fails synchronously (ENOENT, ENOTSOCK); the rest
/// arrives through callback(stream) or callback(nil, msg, code) as for connect_unix.
static int l_connect_unix_at(lua_State *L) {
  const char *dir = luaL_checkstring(L, 1);
  const char *name = luaL_checkstring(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  luaL_argcheck(L, name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 && strcmp(name, "..") != 0, 2,
                "must be a single file name");
  int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return dm_fail_uv(L, "connect", uv_translate_sys_error(errno));
  int fd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  int e = errno;
  close(dfd);
  if (fd < 0) return dm_fail_uv(L, "connect", uv_translate_sys_error(e));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    close(fd);
    return dm_fail(L, "connect: not a socket (a link or another kind of file is never followed)", "ENOTSOCK");
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  uv_pipe_t *p = dm_pipe_new();
  connect_req *c = calloc(1, sizeof *c);
  if (!p || !c) {
    close(fd);
    free(c);
    if (p) uv_close((uv_handle_t *)p, on_close);
    return luaL_error(L, "out of memory");
  }
  dm_stream_push(L, (uv_stream_t *)p);
  c->stream_ref = dm_ref(L);
  lua_pushvalue(L, 3);
  c->cb_ref = dm_ref(L);
  uv_pipe_connect(&c->req, p, path, on_connect); /* connect(2) runs now; the result comes later */
  close(fd);
  lua_pushboolean(L, 1);
  return 1;
}

/// core.stream.connect_tcp(ip, port, callback) -> true | nil, msg, code.
/// `ip` is a numeric IPv4/IPv6 address (no name lookup). callback as connect_unix.
static int l_connect_tcp(lua_State *L) {
  const char *ip = luaL_checkstring(L, 1);
  int port = (int)luaL_checkinteger(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  struct sockaddr_storage addr;
  if (uv_ip4_addr(ip, port, (struct sockaddr_in *)&addr) != 0 &&
      uv_ip6_addr(ip, port, (struct sockaddr_in6 *)&addr) != 0)
    return dm_fail(L, "connect: not a numeric IP address", "EINVAL");
  uv_tcp_t *t = malloc(sizeof *t);
  uv_tcp_init(dm_rt.loop, t);
  dm_handle_count(1);
  connect_req *c = calloc(1, sizeof *c);
  dm_stream_push(L, (uv_stream_t *)t);
  c->stream_ref = dm_ref(L);
  int r = uv_tcp_connect(&c->req, t, (struct sockaddr *)&addr, on_connect);
  if (r) {
    dm_push_ref(L, c->stream_ref);
    dm_unref(L, &c->stream_ref);
    free(c);
    l_close(L);
    return dm_fail_uv(L, "connect", r);
  }
  lua_pushvalue(L, 3);
  c->cb_ref = dm_ref(L);
  lua_pushboolean(L, 1);
  return 1;
}

static void on_connection(uv_stream_t *server, int status) {
  dm_stream *s = server->data;
  lua_State *L = dm_rt.L;
  /* EMFILE/ENFILE: libuv has accepted and closed what was pending and keeps listening */
  if (status < 0) return;
  uv_stream_t *client;
  if (server->type == UV_TCP) {
    client = malloc(sizeof(uv_tcp_t));
    if (client) {
      uv_tcp_init(dm_rt.loop, (uv_tcp_t *)client);
      dm_handle_count(1);
    }
  } else {
    client = (uv_stream_t *)dm_pipe_new();
  }
  if (!client) return; /* out of memory: libuv accepts again at the next uv_accept */
  /* every path takes the connection: libuv accepts no other until it is taken */
  if (uv_accept(server, client) != 0 || !L || !s || s->server_ref == LUA_NOREF) {
    uv_close((uv_handle_t *)client, on_close);
    return;
  }
  dm_push_ref(L, s->server_ref);
  dm_stream_push(L, client);
  dm_call(L, 1);
}

/* Binds and listens on a unix socket at arg 1 (replacing an old socket file), with arg 2
 * as the Lua callback and `cb` as the libuv connection callback. Pushes the server. */
static int listen_unix_with(lua_State *L, uv_connection_cb cb, dm_relay_cb relay) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  unlink(path);
  uv_pipe_t *p = dm_pipe_new();
  dm_stream *s = dm_stream_push(L, (uv_stream_t *)p);
  int r = uv_pipe_bind(p, path);
  if (!r && relay && !(s->relay = dm_relay_new(dm_rt.loop, relay, s))) r = UV_ENOMEM;
  if (!r) r = uv_listen((uv_stream_t *)p, 128, cb);
  if (r) {
    stream_close(L, s);
    return dm_fail_uv(L, "listen", r);
  }
  lua_pushvalue(L, 2);
  s->server_ref = dm_ref(L);
  hold(L, s, -1);
  return 1;
}

/// core.stream.listen_unix(path, callback) -> server | nil, msg, code.
/// Binds a unix socket at `path` (an existing socket file is replaced) and calls
/// callback(client_stream) for each connection until server:close().
static int l_listen_unix(lua_State *L) { return listen_unix_with(L, on_connection, NULL); }

/// core.stream.listen_tcp(ip, port, callback) -> server, bound_port | nil, msg, code.
/// port 0 picks a free port. callback(client_stream) per connection.
static int l_listen_tcp(lua_State *L) {
  const char *ip = luaL_checkstring(L, 1);
  int port = (int)luaL_checkinteger(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  struct sockaddr_storage addr;
  if (uv_ip4_addr(ip, port, (struct sockaddr_in *)&addr) != 0 &&
      uv_ip6_addr(ip, port, (struct sockaddr_in6 *)&addr) != 0)
    return dm_fail(L, "listen: not a numeric IP address", "EINVAL");
  uv_tcp_t *t = malloc(sizeof *t);
  uv_tcp_init(dm_rt.loop, t);
  dm_handle_count(1);
  dm_stream *s = dm_stream_push(L, (uv_stream_t *)t);
  int r = uv_tcp_bind(t, (struct sockaddr *)&addr, 0);
  if (!r) r = uv_listen((uv_stream_t *)t, 128, on_connection);
  if (r) {
    l_close(L);
    return dm_fail_uv(L, "listen", r);
  }
  lua_pushvalue(L, 3);
  s->server_ref = dm_ref(L);
  hold(L, s, -1);
  struct sockaddr_storage bound;
  int len = sizeof bound;
  uv_tcp_getsockname(t, (struct sockaddr *)&bound, &len);
  int bport = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                          : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  lua_pushinteger(L, bport);
  return 2;
}

/* Relay listeners: demesne-init's relay in a sandbox connects to a unix socket and hands
 * over the TCP socket it accepted, or copies the client's bytes over the unix connection
 * where a socket cannot be passed (gVisor); core/relay.c reads the hand-over and bounds the
 * connections that wait for one (DM_RELAY_PENDING_MAX). A client on the socket itself is
 * refused. */
static void on_handover(void *ud, dm_relay_kind kind, uv_pipe_t *from) {
  dm_stream *s = ud;
  lua_State *L = dm_rt.L;
  if (!L || s->server_ref == LUA_NOREF) return;
  uv_stream_t *h;
  if (kind == DM_RELAY_SOCKET) {
    h = malloc(sizeof(uv_tcp_t));
    if (h) uv_tcp_init(dm_rt.loop, (uv_tcp_t *)h);
  } else {
    h = malloc(sizeof(uv_pipe_t));
    if (h) uv_pipe_init(dm_rt.loop, (uv_pipe_t *)h, 0);
  }
  if (!h) return;
  dm_handle_count(1);
  if (dm_relay_take(from, kind, h) != 0) {
    uv_close((uv_handle_t *)h, on_close);
    return;
  }
  dm_push_ref(L, s->server_ref);
  dm_stream_push(L, h);
  dm_call(L, 1);
}

static void on_relay_connection(uv_stream_t *server, int status) {
  dm_stream *s = server->data;
  /* EMFILE/ENFILE: libuv has accepted and closed what was pending and keeps listening */
  if (status < 0) return;
  if (s && s->relay) {
    dm_relay_accept(s->relay, server);
    return;
  }
  /* every path takes the connection: libuv accepts no other until it is taken */
  uv_pipe_t *drop = dm_pipe_new();
  if (!drop) return;
  uv_accept(server, (uv_stream_t *)drop);
  uv_close((uv_handle_t *)drop, on_close);
}

/// core.stream.listen_relay(path, callback) -> server | nil, msg, code.
/// Like listen_unix, for demesne-init's --relay: each connection hands over one TCP
/// socket (SCM_RIGHTS) and hangs up; callback(tcp_stream) gets the handed socket. A
/// connection that starts with the byte '\0' and no socket (the relay copies, under
/// gVisor) is itself the client: callback(stream) gets it. Other connections are closed.
static int l_listen_relay(lua_State *L) { return listen_unix_with(L, on_relay_connection, on_handover); }

static const luaL_Reg methods[] = {
  {"read_start", l_read_start}, {"read_stop", l_read_stop},
  {"write", l_write},           {"write_queue_size", l_write_queue_size},
  {"shutdown", l_shutdown},     {"close", l_close},
  {"fileno", l_fileno},         {NULL, NULL},
};
static const luaL_Reg funcs[] = {
  {"open_fd", l_open_fd},
  {"connect_unix", l_connect_unix},
  {"connect_unix_at", l_connect_unix_at},
  {"connect_tcp", l_connect_tcp},
  {"listen_unix", l_listen_unix},
  {"listen_relay", l_listen_relay},
  {"listen_tcp", l_listen_tcp},
  {NULL, NULL},
};

int luaopen_core_stream(lua_State *L) {
  dm_metatable(L, STREAM_MT, methods, l_close, l_close);
  luaL_newlib(L, funcs);
  return 1;
}
