/* demesne: entry point. Creates the runtime, runs lua/boot.lua (from the source tree when
 * DEMESNE_SOURCE_DIR is set, otherwise the copy embedded in the binary) with the command
 * line, and exits with the status it returns. */
#include "runtime.h"
#include "bind/bind.h"
#include "embedded.h"
#include <locale.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define LUA_MEM_CAP ((size_t)1 << 30) /* 1 GiB: a runaway allocation fails, it does not OOM the host */

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

/* Raises the soft open-file limit to the hard one. Clients start servers with the soft
 * limit they got (often 1024); every sandbox's proxy connections and every engine call
 * hold descriptors, and the per-sandbox ceilings (core/proxy.c) are sized against the
 * hard limit. Nothing is said when it cannot be raised: the ceilings then read the
 * lower limit. */
static void raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  rlim_t want = rl.rlim_max;
  if (want == RLIM_INFINITY) {
    /* setrlimit refuses more than fs.nr_open */
    want = 1 << 20;
    FILE *f = fopen("/proc/sys/fs/nr_open", "r");
    unsigned long n;
    if (f) {
      if (fscanf(f, "%lu", &n) == 1 && n > 0) want = (rlim_t)n;
      fclose(f);
    }
  }
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur >= want) return;
  rl.rlim_cur = want;
  setrlimit(RLIMIT_NOFILE, &rl);
}

static int traceback(lua_State *L) {
  luaL_traceback(L, L, lua_tostring(L, 1), 1);
  return 1;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  raise_nofile();
  /* UTF-8 file names in tars (libarchive converts names through the locale's charset) */
  if (!setlocale(LC_CTYPE, "C.UTF-8")) setlocale(LC_CTYPE, "");
  if (dm_runtime_init(LUA_MEM_CAP) != 0) return 70;
  lua_State *L = dm_rt.L;
  dm_open_bindings(L); /* the composition root: the runtime knows no binding */
  int status = 70;
  lua_pushcfunction(L, traceback);
  if (load_boot(L) != LUA_OK) {
    fprintf(stderr, "demesne: %s\n", lua_tostring(L, -1));
  } else {
    lua_createtable(L, argc, 0);
    for (int i = 1; i < argc; i++) {
      lua_pushstring(L, argv[i]);
      lua_rawseti(L, -2, i);
    }
    if (lua_pcall(L, 1, 1, 1) != LUA_OK) {
      fprintf(stderr, "demesne: fatal: %s\n", lua_tostring(L, -1));
    } else {
      status = lua_isinteger(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    }
  }
  dm_runtime_close();
  return status;
}
