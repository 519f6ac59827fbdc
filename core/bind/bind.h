#ifndef DEMESNE_BIND_H
#define DEMESNE_BIND_H
/* Lua bindings: one file per core.* module, each exporting one luaopen_core_<mod>. */
#include <lua.h>
#include <lauxlib.h>
#include <uv.h>
#include "work.h"

/// Registers every core.* module in package.preload (core/bind/registry.c). The
/// composition root (core/main.c, and embedders such as the fuzz driver) calls it once
/// after dm_runtime_init.
void dm_open_bindings(lua_State *L);

int luaopen_core_loop(lua_State *L);
int luaopen_core_timer(lua_State *L);
int luaopen_core_signal(lua_State *L);
int luaopen_core_stream(lua_State *L);
int luaopen_core_process(lua_State *L);
int luaopen_core_fs(lua_State *L);
int luaopen_core_http(lua_State *L);
int luaopen_core_json(lua_State *L);
int luaopen_core_yaml(lua_State *L);
int luaopen_core_text(lua_State *L);
int luaopen_core_archive(lua_State *L);
int luaopen_core_proxy(lua_State *L);
int luaopen_core_httpd(lua_State *L);
int luaopen_core_httphead(lua_State *L);
int luaopen_core_tty(lua_State *L);
int luaopen_core_ws(lua_State *L);

/// A libuv stream (pipe or TCP) owned by Lua as a `core.stream` userdata (core/bind/stream.c).
/// `h` is heap-allocated and freed in its close callback, after the userdata may be gone.
typedef struct dm_stream dm_stream;

/// Pushes a new `core.stream` userdata around an initialised, not yet used, heap-allocated
/// uv_pipe_t or uv_tcp_t; takes ownership of `h`.
dm_stream *dm_stream_push(lua_State *L, uv_stream_t *h);

/// Allocates and initialises a uv_pipe_t on the runtime loop (counted as a handle).
uv_pipe_t *dm_pipe_new(void);

/// Heavy work with a Lua callback (core/bind/fs.c): the binding allocates a struct whose
/// first member is a dm_lwork, sets `w.run` (worker thread), `push` and `release`, and
/// calls dm_lwork_start. On the loop, once `run` returned, the callback is called (through
/// dm_call) with what `push` leaves on the stack; then `release` frees what the job owns
/// and the struct is freed.
typedef struct dm_lwork dm_lwork;
struct dm_lwork {
  dm_work w;                               ///< first member
  int (*push)(lua_State *L, dm_lwork *lw); ///< pushes the callback's arguments, returns how many
  void (*release)(dm_lwork *lw);           ///< frees what the job owns (not the struct)
  int cb_ref, ud_ref;
  void *ud; ///< the core.fs.work handle while the work is pending
};

/// Queues `lw` (heap-allocated) with the Lua function at stack index `cb` as its callback
/// and pushes a `core.fs.work` handle (work:cancel()). Returns 1. Never calls back before
/// it returns.
int dm_lwork_start(lua_State *L, dm_lwork *lw, int cb);

/// The optional integer field `k` of the options table at stack index `t` (a count, a size
/// in bytes or a time in ms): `def` when the field is nil. Raises "<k> must be a
/// non-negative integer" when it is a negative integer, and Lua's own error when it is not
/// an integer. Shared by the bindings that take an options table (httpd, proxy).
lua_Integer dm_opt_count(lua_State *L, int t, const char *k, lua_Integer def);

/// Makes the metatable `name` of a binding's userdata (in the registry, where
/// luaL_checkudata finds it): __index a table of `methods` (NULL: none), __gc `gc` and
/// __close `close` (NULL: not set; a handle that owns a resource sets both, so a
/// `local x <close>` releases it at the end of its scope and the collector at the latest),
/// and __tostring "<name>: 0x<address>". Leaves the stack as it was.
void dm_metatable(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction close);

/// The descriptor of the open `core.fs.file` at `idx` (raises when it is not one or closed).
int dm_fs_check_file(lua_State *L, int idx);

/// The descriptor of the open `core.fs.dir` at `idx` (raises when it is not one or closed);
/// *path (may be NULL) gets the folder's path for messages.
int dm_fs_check_dir(lua_State *L, int idx, const char **path);

#endif
