#ifndef DEMESNE_BIND_H
#define DEMESNE_BIND_H
/* Lua bindings: one file per core.* module, each exporting one luaopen_core_<mod>. */
#include <lua.h>
#include <lauxlib.h>
#include <uv.h>

int luaopen_core_loop(lua_State *L);
int luaopen_core_timer(lua_State *L);
int luaopen_core_signal(lua_State *L);
int luaopen_core_stream(lua_State *L);
int luaopen_core_process(lua_State *L);
int luaopen_core_fs(lua_State *L);
int luaopen_core_http(lua_State *L);
int luaopen_core_json(lua_State *L);
int luaopen_core_text(lua_State *L);
int luaopen_core_archive(lua_State *L);
int luaopen_core_proxy(lua_State *L);
int luaopen_core_httpd(lua_State *L);

/// A libuv stream (pipe or TCP) owned by Lua as a `core.stream` userdata (core/bind/stream.c).
/// `h` is heap-allocated and freed in its close callback, after the userdata may be gone.
typedef struct dm_stream dm_stream;

/// Pushes a new `core.stream` userdata around an initialised, not yet used, heap-allocated
/// uv_pipe_t or uv_tcp_t; takes ownership of `h`.
dm_stream *dm_stream_push(lua_State *L, uv_stream_t *h);

/// Allocates and initialises a uv_pipe_t on the runtime loop (counted as a handle).
uv_pipe_t *dm_pipe_new(void);

#endif
