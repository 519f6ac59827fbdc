#ifndef DEMESNE_RUNTIME_H
#define DEMESNE_RUNTIME_H
/*
 * The runtime: one libuv loop, one Lua state, and the single funnel through which
 * every loop callback re-enters Lua.
 *
 * Contract for every binding (see docs/reference/lua-api.md):
 *  - programmer mistakes (wrong argument types) raise a Lua error;
 *  - operational failures return `nil, message, code` (code is a short stable string
 *    such as "ENOENT" or "ETIMEDOUT");
 *  - an async primitive either fails synchronously or calls its callback exactly once,
 *    later, from the loop — never re-entrantly.
 */
#include <lua.h>
#include <lauxlib.h>
#include <uv.h>
#include <stddef.h>

typedef struct dm_runtime {
  uv_loop_t *loop;
  lua_State *L;    ///< main state; NULL once closed (close callbacks then skip Lua)
  long refs;       ///< live registry refs taken through dm_ref
  long handles;    ///< live libuv handles / curl requests owned by bindings
  size_t mem_used; ///< bytes allocated by Lua
  size_t mem_cap;  ///< allocation cap in bytes (0 = none)
} dm_runtime;

/// The process-wide runtime (one loop, one state).
extern dm_runtime dm_rt;

/// Creates the loop and the Lua state with the standard libraries (the composition root,
/// core/main.c, then registers the core.* bindings: dm_open_bindings in bind/bind.h). `mem_cap` is the Lua allocation cap in bytes (0 = unlimited).
/// Returns 0 or -1 (message on stderr).
int dm_runtime_init(size_t mem_cap);

/// Closes the Lua state (running __gc, which closes handles), drains the loop's close
/// callbacks and closes the loop.
void dm_runtime_close(void);

/// Pops the value on top of the stack and stores it in the registry; counted. Returns the ref.
int dm_ref(lua_State *L);

/// Releases a ref taken with dm_ref; LUA_NOREF/LUA_REFNIL are ignored. Sets *ref to LUA_NOREF.
void dm_unref(lua_State *L, int *ref);

/// Pushes the value held by `ref`.
void dm_push_ref(lua_State *L, int ref);

/// The funnel: calls the function below `nargs` arguments on the stack in protected mode
/// with a traceback. On error it hands the traceback to the error sink (dm_set_error_sink)
/// and returns -1; it never exits the process. Results are discarded. Returns 0 on success.
int dm_call(lua_State *L, int nargs);

/// Where dm_call reports an error a callback raised: sink(ud, L, traceback), called on
/// the loop with the traceback text (valid only during the call). It must not raise. The
/// default (sink NULL) writes "demesne: callback error: <traceback>" to stderr;
/// core.loop.on_callback_error points it at demesne's log.
typedef void (*dm_error_sink)(void *ud, lua_State *L, const char *traceback);

/// Replaces the error sink (NULL: the default, stderr).
void dm_set_error_sink(dm_error_sink sink, void *ud);

/// What the default sink does: "demesne: callback error: <traceback>" on stderr.
void dm_error_to_stderr(const char *traceback);

/// Counts a handle opened (+1) or closed (-1) by a binding; Lua sees the total in core.stats().
void dm_handle_count(int delta);

/// Pushes `nil, message, code` and returns 3: the operational-failure convention.
int dm_fail(lua_State *L, const char *msg, const char *code);

/// dm_fail for a libuv error number: message "<what>: <uv_strerror>", code uv_err_name.
int dm_fail_uv(lua_State *L, const char *what, int err);

#endif
