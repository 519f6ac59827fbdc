/* Fuzz harness: demesne-init's parsers (core/init/parse.c) and the JSON text it writes.
 *
 * The first byte picks what the rest is:
 *   0 run, 1 kill, 2 serve  a command line: NUL-separated arguments after the mode's name
 *                           (the host builds it, with the caller's id, paths and timeout)
 *   3                       a DIR/pid record, read as run.c and kill.c read it (31 bytes)
 *   4                       a DIR/cancel record (31 bytes)
 *   5                       a /proc/<pid>/stat line (511 bytes; a process names its comm)
 *   6                       an id or error text written into status.json (sb_json_string)
 * (other values: the same, modulo 7). DIR/pid and DIR/cancel live in the run folder, which
 * a process in the sandbox can write.
 *
 * Findings (besides ASan/UBSan): parsed options that break the parser's promises (an id
 * over 256 bytes, an empty command, a relay path that is not absolute or too long, more
 * than INIT_RELAY_MAX routes, a negative timeout); a pgid of 0, 1 or a negative one; JSON
 * text that is not one valid string literal of valid UTF-8.
 *
 * Usage errors are reported on stderr: run with -close_fd_mask=2 (tests/fuzz/run does). */
#include "fuzz.h"
#include "init.h"
#include <signal.h>
#include <string.h>
#include <sys/un.h>

#define MAX_ARGS 64

static void check_route(const struct relay_route *r) {
  FUZZ_CHECK(r->port >= 1 && r->port <= 65535, "relay port %d", r->port);
  FUZZ_CHECK(r->path && r->path[0] == '/' && strlen(r->path) < sizeof(((struct sockaddr_un *)0)->sun_path),
             "relay path '%s'", r->path ? r->path : "(null)");
}

static void args(int mode, const uint8_t *data, size_t size) {
  static const char *const names[] = {"run", "kill", "serve"};
  /* the arguments: NUL-separated, the last one ends at the end of the input */
  char *copy = malloc(size + 1);
  FUZZ_CHECK(copy, "out of memory");
  memcpy(copy, data, size);
  copy[size] = '\0';
  char *argv[MAX_ARGS + 2];
  int argc = 0;
  argv[argc++] = (char *)names[mode];
  for (char *p = copy; argc <= MAX_ARGS && p <= copy + size; p += strlen(p) + 1) argv[argc++] = p;
  argv[argc] = NULL;
  if (mode == 0) {
    struct run_args a;
    if (run_args_parse(&a, argc, argv) == 0) {
      FUZZ_CHECK(a.id && a.id[0] && strlen(a.id) <= 256, "id");
      FUZZ_CHECK(a.dir && a.dir[0], "dir");
      FUZZ_CHECK(!a.cwd || a.cwd[0], "cwd");
      FUZZ_CHECK(!a.stdin_path || a.stdin_path[0], "stdin");
      FUZZ_CHECK(a.timeout_ms >= 0 && a.timeout_ms <= 10000000000LL, "timeout %lld", (long long)a.timeout_ms);
      FUZZ_CHECK(a.argv && a.argv[0] && a.argv[0][0] && a.argv >= argv + 1 && a.argv < argv + argc, "command");
      FUZZ_CHECK(a.nrelays <= INIT_RELAY_MAX, "%zu relays", a.nrelays);
      for (size_t i = 0; i < a.nrelays; i++) check_route(&a.relays[i]);
    }
  } else if (mode == 1) {
    struct kill_args a;
    if (kill_args_parse(&a, argc, argv) == 0) {
      FUZZ_CHECK(a.dir && a.dir[0], "dir");
      FUZZ_CHECK(a.sig > 0 && strcmp(signal_name(a.sig), "?"), "signal %d", a.sig);
      FUZZ_CHECK(a.grace_ms >= -1 && a.grace_ms <= 10000000000LL, "grace %lld", (long long)a.grace_ms);
    }
  } else {
    struct serve_args a;
    if (serve_args_parse(&a, argc, argv) == 0) {
      FUZZ_CHECK(a.nrelays <= INIT_RELAY_MAX, "%zu relays", a.nrelays);
      for (size_t i = 0; i < a.nrelays; i++) check_route(&a.relays[i]);
    }
  }
  free(copy);
}

/* A record as read_small delivers it: at most cap-1 bytes, NUL-terminated. */
static char *record(const uint8_t *data, size_t size, size_t cap) {
  char *buf = malloc(cap);
  FUZZ_CHECK(buf, "out of memory");
  size_t n = size < cap - 1 ? size : cap - 1;
  memcpy(buf, data, n);
  buf[n] = '\0';
  return buf;
}

/* One JSON string literal of valid UTF-8 with no raw control byte (RFC 8259 section 7). */
static void check_json_string(const char *s, size_t n) {
  FUZZ_CHECK(n >= 2 && s[0] == '"' && s[n - 1] == '"', "not quoted");
  for (size_t i = 1; i < n - 1; i++) {
    unsigned char c = (unsigned char)s[i];
    FUZZ_CHECK(c >= 0x20, "raw control byte 0x%02x", c);
    FUZZ_CHECK(c != '"', "an unescaped quote at %zu", i);
    if (c == '\\') {
      char e = s[++i];
      FUZZ_CHECK(i < n - 1 && strchr("\"\\/bfnrtu", e), "bad escape at %zu", i);
      if (e == 'u') {
        for (int k = 1; k <= 4; k++) FUZZ_CHECK(i + k < n - 1 && strchr("0123456789abcdefABCDEF", s[i + k]), "\\u");
        i += 4;
      }
      continue;
    }
    if (c < 0x80) continue;
    size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
    FUZZ_CHECK(c >= 0xc2 && c <= 0xf4 && i + len <= n - 1, "a bad lead byte 0x%02x", c);
    unsigned cp = c & (0x7f >> len);
    for (size_t k = 1; k < len; k++) {
      unsigned char t = (unsigned char)s[i + k];
      FUZZ_CHECK((t & 0xc0) == 0x80, "a bad continuation byte");
      cp = (cp << 6) | (t & 0x3f);
    }
    FUZZ_CHECK(cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff),
               "an invalid code point U+%X", cp);
    i += len - 1;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  int mode = data[0] % 7;
  data++, size--;
  if (mode <= 2) {
    args(mode, data, size);
  } else if (mode == 3) {
    char *buf = record(data, size, 32); /* kill.c read_pgid */
    pid_t p = pgid_record_parse(buf);
    FUZZ_CHECK(p == -1 || p > 1, "pgid %d", (int)p);
    free(buf);
  } else if (mode == 4) {
    char *buf = record(data, size, 32); /* run.c run_session_ready */
    int sig = cancel_record_parse(buf);
    FUZZ_CHECK(sig == -1 || (sig > 0 && sig < NSIG && strcmp(signal_name(sig), "?")), "signal %d", sig);
    free(buf);
  } else if (mode == 5) {
    char *buf = record(data, size, 512); /* serve.c read_ppid */
    (void)stat_ppid_parse(buf);
    free(buf);
  } else {
    static char mem[8192]; /* run.c run_write_status: the id is at most 256 bytes, the error 600 */
    struct sbuf b;
    sb_init(&b, mem, sizeof mem);
    size_t n = size > 600 ? 600 : size;
    sb_json_string(&b, (const char *)data, n);
    FUZZ_CHECK(!b.overflow, "%zu bytes overflow the status buffer", n);
    check_json_string(b.p, b.len);
  }
  return 0;
}
