// demesne-init: the static helper that runs as PID 1 inside every sandbox.
// Shared declarations for the modes (serve.c, run.c, kill.c) and helpers (util.c).
// Reference: docs/reference/demesne-init.md
#ifndef DEMESNE_INIT_H
#define DEMESNE_INIT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifndef DEMESNE_VERSION
#define DEMESNE_VERSION "0.1.0"
#endif

// Exit codes of demesne-init itself (see the reference page).
#define INIT_EXIT_OK 0
#define INIT_EXIT_KILL_ALIVE 1 // kill: the group still exists after signalling
#define INIT_EXIT_USAGE 2      // bad command line; nothing was written
#define INIT_EXIT_FAILURE 125  // demesne-init could not do its job (I/O, fork, cwd, stdin)
#define INIT_EXIT_NOEXEC 126   // run: the command exists but could not be executed
#define INIT_EXIT_NOTFOUND 127 // run: the command was not found

#define INIT_RUN_GRACE_MS 2000   // run: SIGTERM (or SIGINT/SIGQUIT) → SIGKILL grace
#define INIT_SERVE_GRACE_MS 5000 // serve: SIGTERM → SIGKILL grace
#define INIT_SETTLE_MS 2000      // how long to wait for SIGKILLed processes to be reaped
#define INIT_LINGER_MS 500       // run: how long descendants may finish writing after the command exits
#define INIT_POLL_MS 20          // tick while waiting for processes that send no SIGCHLD

// File names inside a run directory.
#define INIT_FILE_PID "pid"
#define INIT_FILE_STATUS "status.json"
#define INIT_FILE_STDOUT "stdout.log"
#define INIT_FILE_STDERR "stderr.log"
#define INIT_FILE_CANCEL "cancel"

/// `demesne-init serve`: PID 1 of a persistent sandbox. argv[0] is "serve".
/// Returns the process exit code.
int init_serve(int argc, char **argv);

/// `demesne-init run ...`: runs one command and records it in --dir. argv[0] is "run".
/// Returns the process exit code (the command's exit code, or 2/125/126/127).
int init_run(int argc, char **argv);

/// `demesne-init wait --control PATH ...`: PID 1 of a warm one-shot sandbox; runs the one
/// command the host sends over the control socket. argv[0] is "wait". Returns the process
/// exit code (the command's, as init_run; 0 when stopped or abandoned before a command).
int init_wait(int argc, char **argv);

/// `demesne-init kill ...`: signals the process group recorded in --dir. argv[0] is "kill".
/// Returns 0 when the group is gone, 1 when it remains, 2 on usage errors, 125 on I/O errors.
int init_kill(int argc, char **argv);

/// `demesne-init connect 127.x.y.z:PORT`: pipes stdin to a TCP connection to that port and
/// the connection to stdout (connect.c), for port previews. argv[0] is "connect". Returns 0
/// when the connection ended, 2 on usage errors, 125 when nothing accepts on the port.
int init_connect(int argc, char **argv);
/// `demesne-init pty --connect PATH [--cwd DIR] -- ARGV...`: runs ARGV on a new PTY and
/// carries it over the unix socket at PATH in frames (frame.h; pty.c). argv[0] is "pty".
/// Returns the shell's exit code (128+N for signal N), 2 on usage errors, 125 when the
/// socket or the PTY cannot be had.
int init_pty(int argc, char **argv);
/// `demesne-init probe [--timeout-ms N] ADDR:PORT...`: tries a TCP connection to each IPv4
/// target and prints "reached"/"blocked" per target and "default-route yes|no" (probe.c).
/// argv[0] is "probe". Returns 0 when nothing was reached, 1 when a target was, 2 on usage
/// errors.
int init_probe(int argc, char **argv);
/// `demesne-init hold [--env K=V]... [--workdir DIR] [--user UID[:GID]] GATE -- PROGRAM
/// [ARG...]`: waits until GATE exists, then applies the options and execs PROGRAM (hold.c).
/// argv[0] is "hold". Returns only on failure: 2 usage, 125, 126, 127, 128+N (signal N).
int init_hold(int argc, char **argv);
/// `demesne-init release GATE`: creates GATE so that `hold` goes on (hold.c). Returns 0,
/// 2 usage, 125 when it cannot be made.
int init_release(int argc, char **argv);

// The control socket (control.c). Reference: docs/reference/demesne-init.md.
#define CONTROL_MAGIC "DMI1"
#define CONTROL_MAX (4u << 20)  // bytes of one request's payload (argv + environment)
#define CONTROL_ITEMS_MAX 16384 // arguments + variables of one request
#define CONTROL_READ_MS 10000   // a request must arrive whole within this

/// One parsed request. argv[0] is the op ("run" or "kill"); argv and env are
/// NULL-terminated; all strings point into the payload buffer it was parsed from.
struct control_request {
	const char *op;
	int argc;
	char **argv;
	int envc;
	char **env;
};

/// Parses a request's payload (len bytes at buf; the strings stay in buf): OP, N, ARG1…ARGN,
/// M, ENV1…ENVM, each NUL-terminated, nothing after; OP "run" or "kill"; N + M at most
/// CONTROL_ITEMS_MAX; every ENV "NAME=value" with a non-empty NAME. `items` (at least
/// CONTROL_ITEMS_MAX + 3 slots) receives the pointers. Pure (parse.c). Returns 0, or -1.
int control_request_parse(char *buf, size_t len, char **items, struct control_request *req);

/// Binds and listens on the unix socket at path (mode 0600, given to the owner of its
/// folder: the host's user; a file already there is unlinked first). Returns the
/// non-blocking listening fd, or -1 (errno set).
int control_listen(const char *path);

/// Accepts the next connection from a peer allowed to give commands: as PID 1 only a
/// process outside the sandbox's PID namespace (SO_PEERCRED pid 0), otherwise only our own
/// uid; others are closed. Returns a blocking fd, or -1 (EAGAIN: no more pending).
int control_accept(int lfd);

/// Reads one request within timeout_ms. Returns 0, 1 when the peer hung up before sending
/// anything, or -1 (errno: EPROTO for a malformed request, ETIMEDOUT, ECONNRESET, …).
int control_read(int fd, struct control_request *req, int timeout_ms);

/// Sends one printf-formatted line to the peer without blocking; errors are ignored.
void control_reply(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/// In a child forked by `serve` for connection fd: reads one request, answers "ok", runs
/// it (`run` with the request's environment, or `kill`), answers "exit CODE" and exits.
_Noreturn void control_child(int fd);

/// Before init_run: use the relay already running as `relay` (0: none of ours) instead of
/// starting one from --relay.
void run_use_relay(pid_t relay);

/// Before init_run: send "started PID" to fd once the command has its own process group.
void run_notify_to(int fd);

/// Before init_run: whether status.json is fsynced (the default). `wait` turns it off: its
/// host is connected, reads the record at once and removes the sandbox after.
void run_sync_status(bool sync);

/// One relay route: 127.0.0.1:port inside the sandbox -> the unix socket at path.
struct relay_route {
	int port;
	const char *path;
};
#define INIT_RELAY_MAX 8 // routes per demesne-init (proxy, vendor API, MCP, ...)

/// Makes the relay copy each connection's bytes (a child per connection) instead of passing
/// the accepted socket to the host: for kernels that cannot pass it (gVisor's), where the
/// relay also switches by itself after the first failed attempt. Call before relay_start.
void relay_copy(void);

/// Binds every route's listening socket, then forks the relay process that serves them
/// (it dies with its parent: PR_SET_PDEATHSIG). `routes` (n <= INIT_RELAY_MAX) must stay
/// valid in the child (they point into argv). Returns its pid, 0 when there is no route,
/// or -1 when nothing could be started (reported; the sandbox then has no relay).
pid_t relay_start(const struct relay_route *routes, size_t n);

// ---- parse.c: the pure parsers (no I/O but diag() for usage errors, no global state) ----

/// Matches "--name VALUE" or "--name=VALUE" at argv[*i]. Returns 1 (*value set, *i moved
/// past the value), 0 (argv[*i] is something else) or -1 (value missing; reported).
int opt_value(int argc, char **argv, int *i, const char *name, const char **value);

/// Parses a duration in seconds ("5", "0.5"; 0 ≤ s ≤ 10,000,000) into *ms.
/// Returns 0, or -1 when s is not such a number.
int parse_seconds(const char *s, int64_t *ms);

/// Signal number for "TERM", "SIGTERM", "term" or "15" (a small fixed set), or -1.
int signal_from_name(const char *s);

/// Short name ("TERM") of a signal in that set, or "?".
const char *signal_name(int sig);

/// The options of `run` (argv[0] is "run"). Strings point into argv.
struct run_args {
	const char *id, *dir, *cwd, *stdin_path;
	const char *stdout_path, *stderr_path; // NULL: DIR/stdout.log, DIR/stderr.log
	int64_t timeout_ms;                    // 0: none
	bool kill_group_on_exit;
	bool relay_copy; // --relay-copy: the relay copies bytes (relay_copy())
	char **argv;     // the command: argv[0] non-empty, NULL-terminated
	struct relay_route relays[INIT_RELAY_MAX];
	size_t nrelays;
};

/// Parses `run`'s command line: "--" or the first argument not starting with '-' starts
/// the command. Returns 0 (parsed), 1 (--help seen: nothing else checked) or -1 (usage
/// error, reported with diag).
int run_args_parse(struct run_args *a, int argc, char **argv);

/// The options of `kill` (argv[0] is "kill").
struct kill_args {
	const char *dir;  // points into argv
	int sig;          // from --signal, default SIGTERM
	int64_t grace_ms; // -1: no --grace
};

/// Parses `kill`'s command line. Returns 0, 1 (--help) or -1 (usage error, reported).
int kill_args_parse(struct kill_args *a, int argc, char **argv);

/// The options of `serve` (argv[0] is "serve").
struct serve_args {
	struct relay_route relays[INIT_RELAY_MAX];
	size_t nrelays;
	const char *control; // --control PATH (absolute), or NULL; points into argv
	bool relay_copy;     // --relay-copy
};

/// The options of `wait` (argv[0] is "wait"): the control socket is required.
struct wait_args {
	struct relay_route relays[INIT_RELAY_MAX];
	size_t nrelays;
	const char *control; // absolute; points into argv
	bool relay_copy;     // --relay-copy
};

/// Parses `wait`'s command line. Returns 0, 1 (--help) or -1 (usage error, reported).
int wait_args_parse(struct wait_args *a, int argc, char **argv);

/// Parses `serve`'s command line. Returns 0, 1 (--help) or -1 (usage error, reported).
int serve_args_parse(struct serve_args *a, int argc, char **argv);

/// Parses a "--relay PORT=PATH" value (PATH absolute, shorter than a sockaddr_un path)
/// into *out (path points into spec). Returns 0, or -1 (reported) when malformed.
int relay_route_parse(const char *spec, struct relay_route *out);

/// The process group in a DIR/pid record ("1234\n"; trailing spaces and newlines allowed):
/// > 1, or -1 with errno EINVAL for anything else (0 and 1 are never a group to signal).
pid_t pgid_record_parse(const char *buf);

/// The parent pid in the text of /proc/<pid>/stat (after the last ')', as comm may hold
/// spaces and parentheses), or -1.
pid_t stat_ppid_parse(const char *buf);

/// The signal named in a DIR/cancel record ("TERM\n"): cuts `buf` at the first blank and
/// returns signal_from_name of the rest (-1 when unknown).
int cancel_record_parse(char *buf);

/// Writes the usage text to fd (1 or 2).
void init_usage(int fd);

/// Prints "demesne-init: <message>\n" on stderr with one write(2); never fails.
void diag(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/// Writes all of buf to fd, retrying on EINTR and short writes. Returns 0 or -1 (errno set).
int write_all(int fd, const void *buf, size_t len);

/// Joins dir and name into out (cap bytes). Returns 0, or -1 with errno ENAMETOOLONG.
int path_join(char *out, size_t cap, const char *dir, const char *name);

/// Creates path and any missing parents (mode for new ones); succeeds if it is already a
/// directory. Returns 0 or -1 (errno set).
int mkdir_p(const char *path, mode_t mode);

/// Writes dir/name atomically: a temporary file in dir, fsync, then rename over name.
/// Returns 0 or -1 (errno set; the temporary file is removed).
int atomic_write(const char *dir, const char *name, const void *buf, size_t len);

/// atomic_write, with the fsync only when `sync`: for a file that means nothing once the
/// machine has crashed (the pid of a process that is gone with it).
int atomic_write_sync(const char *dir, const char *name, const void *buf, size_t len, bool sync);

/// Reads at most cap-1 bytes of dir/name into buf and NUL-terminates it. Returns the
/// length, or -1 (errno set; ENOENT when the file does not exist).
ssize_t read_small(const char *dir, const char *name, char *buf, size_t cap);

/// Removes dir/name; a missing file is not an error. Returns 0 or -1 (errno set).
int unlink_in(const char *dir, const char *name);

/// True when dir/name exists (any type).
bool exists_in(const char *dir, const char *name);

/// Milliseconds since the Unix epoch (CLOCK_REALTIME).
int64_t now_real_ms(void);

/// Milliseconds on CLOCK_MONOTONIC, for deadlines.
int64_t now_mono_ms(void);

/// Sleeps ms milliseconds, resuming after EINTR.
void sleep_ms(int64_t ms);

/// Blocks SIGCHLD, SIGTERM, SIGINT and SIGQUIT and returns a non-blocking signalfd that
/// reads them; resets those to SIG_DFL and ignores SIGPIPE and SIGHUP. Returns -1 on error.
int signals_open(void);

/// In a forked child before exec: every signal back to SIG_DFL, empty signal mask.
void signals_reset_for_exec(void);

/// Reaps every exited child without blocking. When `watch` (> 0) is reaped, its wait
/// status goes to *status and *done becomes true. Returns 1 if children remain,
/// 0 if none, -1 on an unexpected waitpid error.
int reap_children(pid_t watch, int *status, bool *done);

/// True while process group pgid has a member (zombies included). pgid must be > 1;
/// any other value answers false, so kill(-1)/kill(0) can never be reached through it.
bool group_exists(pid_t pgid);

/// Sends sig to process group pgid (> 1, else EINVAL). Returns 0 or -1 (errno set).
int group_signal(pid_t pgid, int sig);

/// Sends sig to every descendant of this process (found through /proc parent links), except
/// `spare` (0 = none; the descendants of `spare` are still signalled). Returns how many were
/// signalled, -1 on error. Reaches processes that left the command's process group with
/// setsid(). Used by serve (not PID 1 of a namespace) and by run (the command's leftovers).
int signal_descendants(int sig, pid_t spare);

/// Makes fds 0, 1 and 2 valid (opens /dev/null on closed ones) so later opens never land there.
void ensure_std_fds(void);

/// Marks every descriptor >= lowfd close-on-exec.
void cloexec_from(int lowfd);

/// A fixed-size text buffer that records overflow instead of growing.
struct sbuf {
	char *p;
	size_t cap, len;
	bool overflow;
};

/// Starts an empty buffer over mem (cap bytes, cap > 0).
void sb_init(struct sbuf *b, char *mem, size_t cap);
/// Appends a NUL-terminated string.
void sb_puts(struct sbuf *b, const char *s);
/// Appends printf-formatted text.
void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/// Appends s (n bytes) as a quoted JSON string: valid UTF-8 kept, control characters,
/// quote and backslash escaped, each invalid byte replaced by U+FFFD.
void sb_json_string(struct sbuf *b, const char *s, size_t n);

#endif
