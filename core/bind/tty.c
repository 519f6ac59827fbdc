/* core.tty: the user's terminal, for `demesne attach` (lua/cmd/attach.lua). The host's half
 * of the framed PTY stream of `demesne-init pty` (core/init/frame.h): attach() puts the
 * terminal in raw mode and pumps bytes between it and the sandbox's connection until the
 * shell ends, the user detaches, or the connection closes. It blocks the thread (the CLI
 * has nothing else to do meanwhile) and restores the terminal on every way out.
 * Everything the sandbox sends is parsed strictly (frame_parse) and bounded. */
#include "runtime.h"
#include "bind/bind.h"
#include "init/frame.h"

#include <errno.h>
#include <poll.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#define TTY_PENDING_MAX (256 * 1024) /* bytes queued for the sandbox before stdin is no longer read */

/// core.tty.isatty(fd) -> boolean.
static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
  return 1;
}

/// core.tty.size(fd) -> rows, cols | nil: the terminal's window size.
static int l_size(lua_State *L) {
  struct winsize ws;
  if (ioctl((int)luaL_checkinteger(L, 1), TIOCGWINSZ, &ws) < 0 || ws.ws_row == 0 || ws.ws_col == 0) return 0;
  lua_pushinteger(L, ws.ws_row);
  lua_pushinteger(L, ws.ws_col);
  return 2;
}

/* The self-pipe of attach()'s signal handler: the signal's number, one byte each. */
static int sig_pipe[2] = {-1, -1};

static void on_signal(int signo) {
  int saved = errno;
  uint8_t b = (uint8_t)signo;
  if (sig_pipe[1] >= 0) (void)!write(sig_pipe[1], &b, 1);
  errno = saved;
}

static int write_fd(int fd, const uint8_t *p, size_t n) {
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) {
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      poll(&pf, 1, -1);
      continue;
    }
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

typedef struct {
  uint8_t *buf;
  size_t len;
} queue;

static int enqueue(queue *q, const uint8_t *p, size_t n) {
  uint8_t *b = realloc(q->buf, q->len + n);
  if (!b) return -1;
  q->buf = b;
  memcpy(b + q->len, p, n);
  q->len += n;
  return 0;
}

static int enqueue_data(queue *q, const uint8_t *p, size_t n) {
  while (n) {
    size_t k = n > FRAME_MAX ? FRAME_MAX : n;
    uint8_t head[FRAME_HEAD];
    frame_head(head, FRAME_DATA, k);
    if (enqueue(q, head, sizeof head) < 0 || enqueue(q, p, k) < 0) return -1;
    p += k;
    n -= k;
  }
  return 0;
}

static int enqueue_size(queue *q, int fd) {
  struct winsize ws;
  if (ioctl(fd, TIOCGWINSZ, &ws) < 0 || ws.ws_row == 0 || ws.ws_col == 0) return 0;
  uint8_t f[FRAME_HEAD + 4];
  frame_winsize(f, ws.ws_row > FRAME_WINSIZE_MAX ? FRAME_WINSIZE_MAX : ws.ws_row,
                ws.ws_col > FRAME_WINSIZE_MAX ? FRAME_WINSIZE_MAX : ws.ws_col);
  return enqueue(q, f, sizeof f);
}

/// core.tty.attach(sock_fd, opts) -> how, value. Pumps the user's terminal (fd 0 in, fd 1
/// out) to and from the sandbox's connection sock_fd (dup'ed; the caller keeps its own)
/// until one of:
///   "exit", code       the shell ended with code (0..255; 128+N for signal N)
///   "detached"         the user typed the detach byte (opts.detach, default 0x1d: Ctrl-])
///                      or stdin ended
///   "closed"           the connection ended without an exit status (the sandbox went away)
///   "signal", signo    the CLI got SIGTERM, SIGHUP or SIGQUIT
///   "error", message   a malformed frame from the sandbox, or an I/O error
/// opts.raw (default true): put the terminal on fd 0 into raw mode meanwhile (Ctrl-C then
/// reaches the sandbox's PTY as a byte, which sends SIGINT to its foreground group).
/// The window size of fd 0 is sent first and again on every SIGWINCH.
static int l_attach(lua_State *L) {
  int sock = dup((int)luaL_checkinteger(L, 1));
  if (sock < 0) return dm_fail(L, strerror(errno), "EIO");
  if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
    int e = errno;
    close(sock);
    return dm_fail(L, strerror(e), "EIO");
  }
  int detach = 0x1d, raw = 1;
  if (lua_istable(L, 2)) {
    lua_getfield(L, 2, "detach");
    if (lua_isinteger(L, -1)) detach = (int)lua_tointeger(L, -1);
    else if (lua_isboolean(L, -1) && !lua_toboolean(L, -1)) detach = -1;
    lua_pop(L, 1);
    lua_getfield(L, 2, "raw");
    if (!lua_isnil(L, -1)) raw = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  struct termios saved;
  int restored = 1;
  if (raw && tcgetattr(0, &saved) == 0) {
    struct termios t = saved;
    cfmakeraw(&t);
    if (tcsetattr(0, TCSANOW, &t) == 0) restored = 0;
  }
  /* The signals come through a self-pipe written by a handler, not a signalfd: a signalfd
   * only sees signals blocked in every thread, and the loop's thread pool (libuv's workers,
   * started by earlier file work) does not block them, so the kernel could hand SIGWINCH to a
   * worker, whose default action drops it (a resize lost), or SIGTERM to one (the process
   * killed with the terminal left raw). A handler runs in whichever thread gets it. */
  static const int sigs[] = {SIGWINCH, SIGTERM, SIGHUP, SIGQUIT, SIGINT};
  struct sigaction saved_act[sizeof sigs / sizeof sigs[0]];
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(sigs[i], &sa, &saved_act[i]);
  }
  int sfd = sig_pipe[0];

  queue out = {0};
  static uint8_t in[2 * (FRAME_HEAD + FRAME_MAX)];
  size_t inlen = 0;
  const char *how = NULL;
  lua_Integer value = 0;
  char msg[160] = "";
  enqueue_size(&out, 0);
  while (!how) {
    struct pollfd p[3] = {
      {.fd = out.len < TTY_PENDING_MAX ? 0 : -1, .events = POLLIN},
      {.fd = sock, .events = POLLIN | (out.len ? POLLOUT : 0)},
      {.fd = sfd, .events = POLLIN},
    };
    if (poll(p, 3, -1) < 0) {
      if (errno == EINTR) continue;
      how = "error", snprintf(msg, sizeof msg, "poll: %s", strerror(errno));
      break;
    }
    if (p[2].revents & POLLIN) {
      uint8_t signos[64];
      ssize_t n;
      while ((n = read(sfd, signos, sizeof signos)) > 0) {
        for (ssize_t i = 0; i < n; i++) {
          if (signos[i] == SIGWINCH) enqueue_size(&out, 0);
          else if (signos[i] != SIGINT) how = "signal", value = signos[i];
        }
      }
      if (how) break;
    }
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      uint8_t b[FRAME_MAX];
      ssize_t n = read(0, b, sizeof b);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) {
        how = "detached";
        break;
      }
      uint8_t *d = detach >= 0 ? memchr(b, detach, (size_t)n) : NULL;
      if (d) n = d - b;
      if (n > 0 && enqueue_data(&out, b, (size_t)n) < 0) how = "error", snprintf(msg, sizeof msg, "out of memory");
      if (d) {
        how = "detached";
        write_fd(sock, out.buf, out.len); /* what came before the key */
        break;
      }
    }
    if (out.len && (p[1].revents & POLLOUT)) {
      ssize_t w = write(sock, out.buf, out.len);
      if (w > 0) {
        memmove(out.buf, out.buf + w, out.len - (size_t)w);
        out.len -= (size_t)w;
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        how = "closed";
        break;
      }
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = read(sock, in + inlen, sizeof in - inlen);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) {
        how = "closed";
        break;
      }
      inlen += (size_t)n;
      size_t off = 0;
      struct frame f;
      int used;
      while (!how && (used = frame_parse(in + off, inlen - off, &f)) != 0) {
        if (used < 0 || f.type == FRAME_WINSIZE) {
          how = "error", snprintf(msg, sizeof msg, "the sandbox sent a malformed frame");
          break;
        }
        off += (size_t)used;
        if (f.type == FRAME_EXIT) how = "exit", value = f.status;
        else if (write_fd(1, f.data, f.len) < 0)
          how = "error", snprintf(msg, sizeof msg, "stdout: %s", strerror(errno));
      }
      memmove(in, in + off, inlen - off);
      inlen -= off;
    }
  }
  free(out.buf);
  close(sock);
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &saved_act[i], NULL);
  if (sig_pipe[0] >= 0) close(sig_pipe[0]), close(sig_pipe[1]);
  sig_pipe[0] = sig_pipe[1] = -1;
  if (!restored) tcsetattr(0, TCSANOW, &saved);
  lua_pushstring(L, how);
  if (strcmp(how, "exit") == 0 || strcmp(how, "signal") == 0) lua_pushinteger(L, value);
  else if (strcmp(how, "error") == 0) lua_pushstring(L, msg);
  else lua_pushnil(L);
  return 2;
}

static const luaL_Reg funcs[] = {
  {"isatty", l_isatty},
  {"size", l_size},
  {"attach", l_attach},
  {NULL, NULL},
};

int luaopen_core_tty(lua_State *L) {
  luaL_newlib(L, funcs);
  return 1;
}
