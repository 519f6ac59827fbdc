/* The relay engine: reading and taking a hand-over from demesne-init's relay, and the
 * bounded set of unix connections of one listener that wait for theirs. See relay.h. */
#include "relay.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

dm_relay_kind dm_relay_kind_of(ssize_t n, const char *first, int pending, uv_handle_type type) {
  if (n <= 0) return DM_RELAY_NONE;
  if (pending > 0) return type == UV_TCP ? DM_RELAY_SOCKET : DM_RELAY_NONE;
  /* no request head starts with NUL, so a client that connects itself is never cut */
  return first[0] == '\0' ? DM_RELAY_COPY : DM_RELAY_DIRECT;
}

dm_relay_kind dm_relay_classify(uv_pipe_t *from, ssize_t n, const char *first) {
  int pending = uv_pipe_pending_count(from);
  return dm_relay_kind_of(n, first, pending, pending > 0 ? uv_pipe_pending_type(from) : UV_UNKNOWN_HANDLE);
}

int dm_relay_take(uv_pipe_t *from, dm_relay_kind kind, uv_stream_t *into) {
  if (kind == DM_RELAY_SOCKET) {
    return uv_accept((uv_stream_t *)from, into);
  }
  if (kind != DM_RELAY_COPY) return UV_EINVAL;
  uv_os_fd_t fd;
  int r = uv_fileno((uv_handle_t *)from, &fd);
  if (r != 0) return r;
  int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return uv_translate_sys_error(errno);
  r = uv_pipe_open((uv_pipe_t *)into, dup_fd);
  if (r != 0) close(dup_fd);
  return r;
}

/* ------------------------------------------------------------------------------------ */
/* The waiting set                                                                        */

typedef struct waiting {
  uv_pipe_t pipe; /* first member: the close callback frees the struct */
  dm_relay *r;
  struct waiting *prev, *next;
} waiting;

struct dm_relay {
  uv_loop_t *loop;
  dm_relay_cb cb;
  void *ud;
  waiting *head;     /* newest first */
  size_t nwaiting;   /* in the list (closing ones included) */
  uv_timer_t closer; /* closed by dm_relay_close, so on_closed always comes from the loop */
  int closing;
  void (*on_closed)(void *);
  void *closed_ud;
};

static void maybe_free(dm_relay *r) {
  if (!r->closing || r->nwaiting || r->closer.data) return;
  void (*on_closed)(void *) = r->on_closed;
  void *ud = r->closed_ud;
  free(r);
  if (on_closed) on_closed(ud);
}

static void waiting_closed(uv_handle_t *h) {
  waiting *w = (waiting *)h;
  dm_relay *r = w->r;
  if (w->prev) w->prev->next = w->next;
  else r->head = w->next;
  if (w->next) w->next->prev = w->prev;
  r->nwaiting--;
  free(w);
  maybe_free(r);
}

static void waiting_close(waiting *w) {
  if (!uv_is_closing((uv_handle_t *)&w->pipe)) uv_close((uv_handle_t *)&w->pipe, waiting_closed);
}

static void one_byte(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  static char byte;
  (void)h;
  (void)suggested;
  *buf = uv_buf_init(&byte, 1); /* one byte: what follows a copy marker is the client's */
}

static void waiting_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  waiting *w = (waiting *)st;
  dm_relay *r = w->r;
  if (n == 0) return;
  uv_read_stop(st);
  dm_relay_kind kind = dm_relay_classify(&w->pipe, n, buf->base);
  if (!r->closing && (kind == DM_RELAY_SOCKET || kind == DM_RELAY_COPY)) r->cb(r->ud, kind, &w->pipe);
  waiting_close(w); /* it has done its job; closing it drops any other descriptor sent along */
}

/* 1 when a waiting connection has nothing to read (or has hung up). */
static int silent(waiting *w) {
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&w->pipe, &fd) != 0) return 1;
  char b;
  return recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) <= 0;
}

/* When the waiting connections but w are DM_RELAY_PENDING_MAX or more, closes the oldest
 * silent one; when none is silent they are all read in this turn of the loop, and w is
 * kept beside them. */
static void make_room(dm_relay *r, waiting *w) {
  size_t live = 0;
  for (waiting *p = r->head; p; p = p->next)
    if (p != w && !uv_is_closing((uv_handle_t *)&p->pipe)) live++;
  if (live < DM_RELAY_PENDING_MAX) return;
  waiting *victim = NULL;
  for (waiting *p = r->head; p; p = p->next) /* newest first: the last found is the oldest */
    if (p != w && !uv_is_closing((uv_handle_t *)&p->pipe) && silent(p)) victim = p;
  if (victim) waiting_close(victim);
}

static void free_closed(uv_handle_t *h) { free(h); }

dm_relay *dm_relay_new(uv_loop_t *loop, dm_relay_cb cb, void *ud) {
  dm_relay *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->loop = loop;
  r->cb = cb;
  r->ud = ud;
  uv_timer_init(loop, &r->closer);
  r->closer.data = r;
  return r;
}

int dm_relay_accept(dm_relay *r, uv_stream_t *server) {
  waiting *w = calloc(1, sizeof *w);
  if (!w) {
    /* take it anyway, or libuv stops accepting: into a bare handle, closed at once */
    uv_pipe_t *spare = malloc(sizeof *spare);
    if (!spare) return UV_ENOMEM;
    uv_pipe_init(server->loop, spare, 0);
    uv_accept(server, (uv_stream_t *)spare);
    uv_close((uv_handle_t *)spare, free_closed);
    return UV_ENOMEM;
  }
  w->r = r;
  uv_pipe_init(r->loop, &w->pipe, 1); /* ipc: the relay passes sockets over it */
  w->next = r->head;
  if (r->head) r->head->prev = w;
  r->head = w;
  r->nwaiting++;
  int e = uv_accept(server, (uv_stream_t *)&w->pipe);
  if (!e && r->closing) e = UV_ECANCELED;
  if (!e) e = uv_read_start((uv_stream_t *)&w->pipe, one_byte, waiting_read);
  if (e) {
    waiting_close(w);
    return e;
  }
  make_room(r, w);
  return 0;
}

size_t dm_relay_waiting(const dm_relay *r) {
  size_t n = 0;
  for (const waiting *p = r->head; p; p = p->next)
    if (!uv_is_closing((const uv_handle_t *)&p->pipe)) n++;
  return n;
}

static void closer_closed(uv_handle_t *h) {
  dm_relay *r = h->data;
  r->closer.data = NULL;
  maybe_free(r);
}

void dm_relay_close(dm_relay *r, void (*on_closed)(void *ud), void *ud) {
  if (!r || r->closing) return;
  r->closing = 1;
  r->on_closed = on_closed;
  r->closed_ud = ud;
  for (waiting *p = r->head; p; p = p->next) waiting_close(p);
  uv_close((uv_handle_t *)&r->closer, closer_closed);
}
