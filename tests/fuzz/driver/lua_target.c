/* The libFuzzer driver of the Lua harnesses: tests/fuzz/<name>.lua runs inside the real
 * runtime, as `demesne` runs Lua (core/main.c): one loop, one Lua state with every core.*
 * binding, lua/boot.lua's module searcher over the embedded sources (or DEMESNE_SOURCE_DIR).
 *
 * The harness file is loaded once; it returns function(data), called once per input at
 * the top level (not in a task; it may spawn tasks and run the loop). A Lua error that
 * escapes it is a finding: the driver prints the traceback and aborts, so libFuzzer keeps
 * the input. After each input the registry refs and loop handles the bindings count
 * (core.loop.stats) must be back where they were, as the test runner demands of a test
 * (lua/testing.lua); Lua memory is checked every few thousand inputs.
 *
 * libFuzzer only sees the C it instruments, and the Lua interpreter comes from Debian
 * uninstrumented. So a line hook feeds the Lua code's own coverage to libFuzzer: each
 * (previous line, line) pair bumps a counter in the __libfuzzer_extra_counters section,
 * which libFuzzer reads as coverage. At exit the driver prints how many distinct Lua lines
 * ran ("fuzz: Lua lines covered").
 *
 * Lua frees lazily (garbage collection), so libFuzzer's per-input malloc/free balance would
 * run LeakSanitizer after nearly every input and slow the harness tenfold. The driver puts
 * -detect_leaks=0 in front of the command line (a -detect_leaks=1 given later wins): the
 * ref and handle checks stand for it per input, and LeakSanitizer still runs at exit.
 *
 * Isolation: HOME, XDG_CONFIG_HOME, DEMESNE_STATE_DIR and DEMESNE_OUTPUT_ROOT point into a
 * fresh folder ($FUZZ_TMPDIR) under /dev/shm, or $TMPDIR when that cannot be written,
 * removed at exit: no user configuration, tool or state is read and nothing outside it is
 * written. Logging is off unless DEMESNE_LOG_LEVEL is set. */

#include "embedded.h"
#include "runtime.h"
#include "bind/bind.h"
#include <ftw.h>
#include <locale.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FUZZ_TARGET_LUA
#error "FUZZ_TARGET_LUA must name the harness's Lua file"
#endif

#define LUA_MEM_CAP ((size_t)1 << 30)      /* as core/main.c */
#define MEM_GROWTH_MAX ((size_t)256 << 20) /* Lua memory an input may leave behind, in total */
#define MEM_CHECK_EVERY 4096
#define EDGES (1u << 16)
#define LINES_BITS (1u << 20)

__attribute__((used, section("__libfuzzer_extra_counters"))) static uint8_t lua_edges[EDGES];
static uint8_t lines_seen[LINES_BITS / 8];
static size_t lines_covered;
static uintptr_t prev_loc;
static const char *last_source; /* one-entry cache of the chunk name's hash */
static uint32_t last_source_hash;

static int target_ref = LUA_NOREF;
static long base_refs, base_handles;
static size_t base_mem;
static unsigned long inputs;
static char tmpdir[4096];

static uint32_t hash_str(const char *s) {
  uint32_t h = 2166136261u;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
  return h;
}

/* Chunk names are hashed by content: a chunk loaded again gets a new string. */
static void line_hook(lua_State *L, lua_Debug *ar) {
  if (!lua_getinfo(L, "S", ar) || !ar->source) return;
  if (ar->source != last_source) {
    last_source = ar->source;
    last_source_hash = hash_str(ar->source);
  }
  uint32_t loc = (last_source_hash ^ ((uint32_t)ar->currentline * 2654435761u));
  lua_edges[(loc ^ prev_loc) % EDGES]++;
  prev_loc = loc >> 1;
  uint32_t bit = loc % LINES_BITS;
  if (!(lines_seen[bit / 8] & (1u << (bit % 8)))) {
    lines_seen[bit / 8] |= (uint8_t)(1u << (bit % 8));
    lines_covered++;
  }
}

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  remove(path);
  return 0;
}

/* The count goes to $FUZZ_LUA_STATS when set (tests/fuzz/run: libFuzzer's -close_fd_mask
 * closes stderr), else to stderr. */
static void at_exit(void) {
  const char *stats = getenv("FUZZ_LUA_STATS");
  FILE *f = stats && *stats ? fopen(stats, "w") : NULL;
  if (f) {
    fprintf(f, "%zu\n", lines_covered);
    fclose(f);
  } else {
    fprintf(stderr, "fuzz: Lua lines covered: %zu\n", lines_covered);
  }
  if (tmpdir[0]) nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int load_boot(lua_State *L) {
  const char *dir = getenv("DEMESNE_SOURCE_DIR");
  if (dir && *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/lua/boot.lua", dir);
    return luaL_loadfile(L, path);
  }
  for (const struct dm_embedded *e = dm_embedded_files; e->path; e++)
    if (!strcmp(e->path, "lua/boot.lua"))
      return luaL_loadbufferx(L, (const char *)e->data, e->len, "@lua/boot.lua", "t");
  lua_pushstring(L, "lua/boot.lua is not embedded in this binary");
  return LUA_ERRFILE;
}

static void fail(const char *what, lua_State *L) {
  fprintf(stderr, "fuzz: %s: %s\n", what, L ? lua_tostring(L, -1) : "");
  abort();
}

static void settle(void) {
  lua_gc(dm_rt.L, LUA_GCCOLLECT);
  lua_gc(dm_rt.L, LUA_GCCOLLECT);
  uv_run(dm_rt.loop, UV_RUN_NOWAIT); /* close callbacks of collected handles */
}

/* libFuzzer parses its flags after LLVMFuzzerInitialize returns: a flag put right after
 * argv[0] is taken unless the command line gives it again. */
static void default_flag(int *argc, char ***argv, const char *flag) {
  char **v = malloc(((size_t)*argc + 2) * sizeof *v);
  if (!v) return;
  v[0] = (*argv)[0];
  v[1] = (char *)flag;
  for (int i = 1; i < *argc; i++) v[i + 1] = (*argv)[i];
  v[*argc + 1] = NULL;
  *argv = v; /* kept for the life of the process, as libFuzzer keeps argv */
  (*argc)++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  default_flag(argc, argv, "-detect_leaks=0");
  signal(SIGPIPE, SIG_IGN);
  if (!setlocale(LC_CTYPE, "C.UTF-8")) setlocale(LC_CTYPE, "");
  /* harnesses write files per input (fsync included): on /dev/shm when it can be */
  const char *t = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
  snprintf(tmpdir, sizeof tmpdir, "%s/demesne-fuzz-XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(tmpdir)) {
    perror("fuzz: mkdtemp");
    exit(1);
  }
  atexit(at_exit);
  char path[4200];
  setenv("HOME", tmpdir, 1);
  snprintf(path, sizeof path, "%s/config", tmpdir);
  setenv("XDG_CONFIG_HOME", path, 1);
  snprintf(path, sizeof path, "%s/state", tmpdir);
  setenv("DEMESNE_STATE_DIR", path, 1);
  snprintf(path, sizeof path, "%s/out", tmpdir);
  setenv("DEMESNE_OUTPUT_ROOT", path, 1);
  setenv("DEMESNE_LOG_LEVEL", "emergency", 0);
  setenv("FUZZ_TMPDIR", tmpdir, 1);

  if (dm_runtime_init(LUA_MEM_CAP) != 0) exit(1);
  lua_State *L = dm_rt.L;
  dm_open_bindings(L); /* the composition root: the runtime knows no binding */
  lua_pushcfunction(L, traceback);
  if (load_boot(L) != LUA_OK) fail("lua/boot.lua", L);
  if (lua_pcall(L, 0, 0, -2) != LUA_OK) fail("lua/boot.lua", L);
  /* the harnesses' shared helpers: tests/fuzz/lib/<name>.lua */
  lua_getglobal(L, "package");
  lua_pushfstring(L, "%s/tests/fuzz/lib/?.lua", FUZZ_SOURCE_DIR);
  lua_setfield(L, -2, "path");
  lua_pop(L, 1);
  lua_pushstring(L, FUZZ_SOURCE_DIR);
  lua_setglobal(L, "FUZZ_SOURCE_DIR");
  if (luaL_loadfile(L, FUZZ_TARGET_LUA) != LUA_OK) fail(FUZZ_TARGET_LUA, L);
  if (lua_pcall(L, 0, 1, -2) != LUA_OK) fail(FUZZ_TARGET_LUA, L);
  if (!lua_isfunction(L, -1)) {
    lua_pushstring(L, "must return function(data)");
    fail(FUZZ_TARGET_LUA, L);
  }
  target_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pop(L, 1); /* traceback */
  settle();
  base_refs = dm_rt.refs;
  base_handles = dm_rt.handles;
  base_mem = dm_rt.mem_used;
  lua_sethook(L, line_hook, LUA_MASKLINE, 0);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  lua_State *L = dm_rt.L;
  int top = lua_gettop(L);
  lua_pushcfunction(L, traceback);
  lua_rawgeti(L, LUA_REGISTRYINDEX, target_ref);
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 1, 0, top + 1) != LUA_OK) fail("a Lua error escaped the harness", L);
  lua_settop(L, top);
  uv_run(dm_rt.loop, UV_RUN_NOWAIT);
  if (dm_rt.refs != base_refs || dm_rt.handles != base_handles) {
    settle();
    if (dm_rt.refs != base_refs || dm_rt.handles != base_handles) {
      fprintf(stderr, "fuzz: the input leaked %ld registry refs and %ld loop handles\n", dm_rt.refs - base_refs,
              dm_rt.handles - base_handles);
      abort();
    }
  }
  if (++inputs % MEM_CHECK_EVERY == 0) {
    settle();
    if (dm_rt.mem_used > base_mem + MEM_GROWTH_MAX) {
      fprintf(stderr, "fuzz: Lua memory grew from %zu to %zu bytes across %lu inputs\n", base_mem, dm_rt.mem_used,
              inputs);
      abort();
    }
  }
  return 0;
}
