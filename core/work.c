/* The bounded work queue over uv_queue_work. See work.h. */
#include "work.h"
#include <stddef.h>

static dm_work *head, *tail; /* waiting, in order */
static int running, pending;

static void on_run(uv_work_t *req) {
  dm_work *w = req->data;
  w->run(w);
}

static void start_next(uv_loop_t *loop);

static void on_done(uv_work_t *req, int status) {
  dm_work *w = req->data;
  uv_loop_t *loop = req->loop;
  running--;
  pending--;
  start_next(loop);
  w->done(w); /* last: it may free w */
}

static void start_next(uv_loop_t *loop) {
  while (running < DM_WORK_RUNNING && head) {
    dm_work *w = head;
    head = w->next;
    if (!head) tail = NULL;
    w->req.data = w;
    running++;
    if (uv_queue_work(loop, &w->req, on_run, on_done) != 0) {
      /* cannot happen with valid callbacks; run it here rather than lose it */
      running--;
      pending--;
      w->run(w);
      w->done(w);
    }
  }
}

void dm_work_submit(uv_loop_t *loop, dm_work *w) {
  w->next = NULL;
  pending++;
  if (tail) tail->next = w;
  else head = w;
  tail = w;
  start_next(loop);
}

int dm_work_pending(void) { return pending; }
