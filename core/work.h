#ifndef DEMESNE_WORK_H
#define DEMESNE_WORK_H
/*
 * Heavy file work off the loop: extraction, packing, tree removal run on libuv's thread
 * pool (uv_queue_work), at most DM_WORK_RUNNING at a time so the pool keeps threads for
 * name resolution (the egress proxy's getaddrinfo). Further work waits in a FIFO queue.
 *
 * A work item's `run` runs on a worker thread (no Lua, no loop); its `done` runs on the
 * loop thread exactly once, after `run` returned, never from inside dm_work_submit.
 * `cancel` may be set from the loop at any time; `run` checks it and stops early.
 */
#include <stdatomic.h>
#include <uv.h>

/// Work items running on the thread pool at once; more wait in order.
#define DM_WORK_RUNNING 2

typedef struct dm_work dm_work;
struct dm_work {
  uv_work_t req;
  void (*run)(dm_work *w);  ///< on a worker thread
  void (*done)(dm_work *w); ///< on the loop thread, once; may free w
  atomic_int cancel;        ///< set to 1 to ask `run` to stop early
  dm_work *next;            ///< queue link (private)
};

/// Queues `w` (run, done set; cancel 0) on `loop`. Never calls back before it returns.
void dm_work_submit(uv_loop_t *loop, dm_work *w);

/// Items queued or running (for tests and shutdown).
int dm_work_pending(void);

#endif
