/* Fuzz harness: the relay engine (core/relay.c) as a sandbox drives it.
 *
 * A real relay listener on a unix socket in a private folder, on a real loop. The input is
 * a script of what clients inside a sandbox do to that socket, two bytes a step (an
 * operation and its argument):
 *   connect a new client; send one byte with no descriptor; send one byte with a TCP socket
 *   (what demesne-init's relay sends); with a unix socket (refused); with two TCP sockets;
 *   send some bytes; hang up; turn the loop.
 * Every hand-over the engine delivers is taken (dm_relay_take) and closed. Checks: only a
 * TCP socket or the copy marker '\0' is delivered, taking it succeeds and opens the
 * owner's handle, and no more are delivered than were sent; once the loop is quiet, at most
 * DM_RELAY_PENDING_MAX connections wait; after closing every client and the set, no
 * handle is left on the loop (and ASan finds no leak). The unsent socket descriptors are
 * never connected: no byte leaves the machine. */
#include "fuzz.h"
#include "relay.h"
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_CLIENTS 48

static uv_loop_t loop;
static uv_pipe_t server;
static char sock_path[108];
static dm_relay *relay;
static int clients[MAX_CLIENTS], nclients;
static size_t delivered;
static int set_closed;

static void free_closed(uv_handle_t *h) { free(h); }

static void on_handover(void *ud, dm_relay_kind kind, uv_pipe_t *from) {
  (void)ud;
  FUZZ_CHECK(kind == DM_RELAY_SOCKET || kind == DM_RELAY_COPY, "delivered kind %d", (int)kind);
  uv_stream_t *h;
  if (kind == DM_RELAY_SOCKET) {
    h = malloc(sizeof(uv_tcp_t));
    FUZZ_CHECK(h, "out of memory");
    uv_tcp_init(&loop, (uv_tcp_t *)h);
  } else {
    h = malloc(sizeof(uv_pipe_t));
    FUZZ_CHECK(h, "out of memory");
    uv_pipe_init(&loop, (uv_pipe_t *)h, 0);
  }
  int r = dm_relay_take(from, kind, h);
  FUZZ_CHECK(r == 0, "take: %s", uv_strerror(r));
  uv_os_fd_t fd;
  FUZZ_CHECK(uv_fileno((uv_handle_t *)h, &fd) == 0, "the taken handle is open");
  FUZZ_CHECK(dm_relay_take(from, DM_RELAY_NONE, h) == UV_EINVAL, "take of another kind");
  delivered++;
  uv_close((uv_handle_t *)h, free_closed);
}

static void on_connection(uv_stream_t *s, int status) {
  if (status < 0) return;
  dm_relay_accept(relay, s);
}

static void on_set_closed(void *ud) {
  (void)ud;
  set_closed = 1;
}

static void walk_count(uv_handle_t *h, void *arg) {
  if (h != (uv_handle_t *)&server && !uv_is_closing(h)) ++*(int *)arg;
}

static void setup(void) {
  static int ready;
  if (ready) return;
  ready = 1;
  uv_loop_init(&loop);
  char dir[] = "/tmp/demesne-fuzz-relay.XXXXXX";
  FUZZ_CHECK(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
  snprintf(sock_path, sizeof sock_path, "%s/relay.sock", dir);
  uv_pipe_init(&loop, &server, 0);
  FUZZ_CHECK(uv_pipe_bind(&server, sock_path) == 0, "bind");
  FUZZ_CHECK(uv_listen((uv_stream_t *)&server, 128, on_connection) == 0, "listen");
}

static void turn(int n) {
  for (int i = 0; i < n; i++) uv_run(&loop, UV_RUN_NOWAIT);
}

static void client_connect(void) {
  if (nclients >= MAX_CLIENTS) return;
  int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  FUZZ_CHECK(u >= 0, "socket: %s", strerror(errno));
  struct sockaddr_un ua = {.sun_family = AF_UNIX};
  snprintf(ua.sun_path, sizeof ua.sun_path, "%s", sock_path);
  FUZZ_CHECK(connect(u, (struct sockaddr *)&ua, sizeof ua) == 0, "connect: %s", strerror(errno));
  fcntl(u, F_SETFL, O_NONBLOCK);
  clients[nclients++] = u;
}

/* Sends `byte` on client fd u with `nfds` descriptors of the given family. */
static void client_send(int u, char byte, int nfds, int family) {
  int fds[2] = {-1, -1}, pair[2] = {-1, -1};
  for (int i = 0; i < nfds; i++) {
    if (family == AF_UNIX) {
      FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0, "socketpair");
      fds[i] = pair[0];
    } else {
      fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0); /* never connected */
      FUZZ_CHECK(fds[i] >= 0, "socket: %s", strerror(errno));
    }
  }
  struct iovec iov = {.iov_base = &byte, .iov_len = 1};
  union {
    struct cmsghdr h;
    char space[CMSG_SPACE(sizeof fds)];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds) {
    msg.msg_control = ctl.space;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
  }
  (void)sendmsg(u, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  for (int i = 0; i < nfds; i++) close(fds[i]);
  if (pair[1] >= 0) close(pair[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  /* the pure classification: every shape of a first read */
  if (size >= 3) {
    dm_relay_kind k = dm_relay_kind_of((ssize_t)(int8_t)data[0], (const char *)&data[1], data[2] % 3,
                                       data[2] & 4 ? UV_TCP : UV_NAMED_PIPE);
    FUZZ_CHECK(k >= DM_RELAY_NONE && k <= DM_RELAY_DIRECT, "kind %d", (int)k);
    if ((int8_t)data[0] <= 0) FUZZ_CHECK(k == DM_RELAY_NONE, "a hung-up connection hands nothing over");
    if (k == DM_RELAY_COPY) FUZZ_CHECK(data[1] == 0 && data[2] % 3 == 0, "copy only on the marker, no socket");
  }
  relay = dm_relay_new(&loop, on_handover, NULL);
  FUZZ_CHECK(relay, "out of memory");
  nclients = 0;
  delivered = 0;
  set_closed = 0;
  size_t sent_handover = 0;
  for (size_t i = 0; i + 1 < size && i < 400; i += 2) {
    unsigned op = data[i] % 8, arg = data[i + 1];
    int u = nclients ? clients[arg % (unsigned)nclients] : -1;
    switch (op) {
    case 0: client_connect(); break;
    case 1:
      if (u >= 0) client_send(u, (char)arg, 0, 0), sent_handover++;
      break;
    case 2:
      if (u >= 0) client_send(u, (char)arg, 1, AF_INET), sent_handover++;
      break;
    case 3:
      if (u >= 0) client_send(u, (char)arg, 1, AF_UNIX);
      break;
    case 4:
      if (u >= 0) client_send(u, (char)arg, 2, AF_INET), sent_handover++;
      break;
    case 5:
      if (u >= 0) (void)send(u, data + i, size - i < 64 ? size - i : 64, MSG_NOSIGNAL | MSG_DONTWAIT), sent_handover++;
      break;
    case 6:
      if (u >= 0) shutdown(u, SHUT_RDWR);
      break;
    default: turn(1 + (int)(arg % 4)); break;
    }
  }
  turn(8);
  FUZZ_CHECK(dm_relay_waiting(relay) <= DM_RELAY_PENDING_MAX, "%zu connections wait, more than %d",
             dm_relay_waiting(relay), DM_RELAY_PENDING_MAX);
  FUZZ_CHECK(delivered <= sent_handover, "%zu delivered of %zu sent", delivered, sent_handover);
  for (int i = 0; i < nclients; i++) close(clients[i]);
  dm_relay_close(relay, on_set_closed, NULL);
  for (int i = 0; i < 10000 && !set_closed; i++) uv_run(&loop, UV_RUN_ONCE);
  FUZZ_CHECK(set_closed, "the set never closed");
  turn(2);
  int open = 0;
  uv_walk(&loop, walk_count, &open);
  FUZZ_CHECK(open == 0, "%d handles left on the loop", open);
  return 0;
}
