// demesne-init run: run one command in its own session/process group and record it in --dir.
//
// The parent waits for its direct child only (never for EOF on output: the output goes to
// files), reaps every other child it inherits (it is a subreaper, or PID 1), enforces the
// timeout, turns SIGTERM/SIGINT/SIGQUIT and the kill mode's cancel marker into a group
// kill, and writes status.json atomically before it exits with the command's exit code.
#include "init.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

// What the child reports on the report pipe (8-byte records, atomic on a pipe).
enum stage { ST_READY = 0, ST_SETSID, ST_STDIO, ST_STDIN, ST_CHDIR, ST_EXEC };
struct report {
	int32_t stage;
	int32_t err;
};

// RUNNING: nothing asked to stop it. STOPPING: first signal sent, SIGKILL at kill_at.
// KILLED: SIGKILL sent, waiting (up to give_up_at) for the group to be reaped.
enum phase { PH_RUNNING, PH_STOPPING, PH_KILLED };

#define ERROR_MAX 600 // bytes of the status.json "error" text before escaping

struct run {
	struct run_args opt; // the command line (parse.c)
	// state
	pid_t child; // also the process group id once the child reported ST_READY
	int ep;      // read end of the report pipe, -1 once closed
	bool session_ready, child_done;
	int wstatus;
	int fail_stage, fail_errno; // fail_stage 0: the child reported no failure
	bool timed_out, cancelled;
	uint32_t host_line;   // the last four bytes of the host's current line (run_read_host)
	int host_len;         // its length so far, at most 5
	long long oom_before; // the sandbox cgroup's OOM-kill count at the start; -1: unknown
	enum phase phase;
	int64_t start_real, start_mono, end_real, end_mono;
	int64_t timeout_at, kill_at, give_up_at;
};

// Human-readable reason for a setup failure reported by the child.
static void describe_failure(const struct run *r, int stage, int err, char *buf, size_t cap)
{
	const char *e = strerror(err);
	switch (stage) {
	case ST_SETSID: snprintf(buf, cap, "cannot start a new session: %s", e); break;
	case ST_STDIO: snprintf(buf, cap, "cannot redirect output to %s: %s", r->opt.dir, e); break;
	case ST_STDIN:
		snprintf(buf, cap, "cannot open stdin file '%s': %s",
			 r->opt.stdin_path ? r->opt.stdin_path : "/dev/null", e);
		break;
	case ST_CHDIR: snprintf(buf, cap, "cannot change directory to '%s': %s", r->opt.cwd, e); break;
	case ST_EXEC: snprintf(buf, cap, "cannot execute '%s': %s", r->opt.argv[0], e); break;
	default: snprintf(buf, cap, "setup failed: %s", e); break;
	}
}

static void child_report(int ep, int stage, int err)
{
	struct report m = { stage, err };
	(void)write_all(ep, &m, sizeof m); // the parent also learns the outcome from the exit status
}

// The forked child: new session, files on 0/1/2, cwd, clean signals, exec. Never returns.
static _Noreturn void run_child(const struct run *r, int out, int err, int ep)
{
	int stage = ST_SETSID, in = -1;
	if (setsid() < 0)
		goto fail;
	child_report(ep, ST_READY, 0);
	stage = ST_STDIO;
	if (dup2(out, 1) < 0 || dup2(err, 2) < 0)
		goto fail;
	stage = ST_STDIN; // opened before chdir: a relative --stdin is relative to the caller
	do
		in = open(r->opt.stdin_path ? r->opt.stdin_path : "/dev/null", O_RDONLY | O_CLOEXEC);
	while (in < 0 && errno == EINTR);
	if (in < 0 || dup2(in, 0) < 0)
		goto fail;
	stage = ST_CHDIR;
	if (r->opt.cwd && chdir(r->opt.cwd) < 0)
		goto fail;
	cloexec_from(3);
	signals_reset_for_exec();
	execvp(r->opt.argv[0], r->opt.argv);
	stage = ST_EXEC;
fail:;
	int e = errno;
	char msg[PATH_MAX + 128];
	describe_failure(r, stage, e, msg, sizeof msg - 1);
	size_t n = strlen(msg);
	memcpy(msg + n, "\n", 1);
	(void)write_all(2, "demesne-init: ", 14);
	(void)write_all(2, msg, n + 1);
	child_report(ep, stage, e);
	if (stage != ST_EXEC)
		_exit(INIT_EXIT_FAILURE);
	_exit(e == ENOENT || e == ENOTDIR ? INIT_EXIT_NOTFOUND : INIT_EXIT_NOEXEC);
}

// Sends sig to the command's group; before the child has its own group, to the child alone.
static void run_signal(struct run *r, int sig)
{
	if (group_signal(r->child, sig) == 0)
		return;
	if (errno == ESRCH && !r->child_done && !r->session_ready) {
		if (kill(r->child, sig) < 0 && errno != ESRCH)
			diag("kill %d: %s", (int)r->child, strerror(errno));
	} else if (errno != ESRCH) {
		diag("kill -%d: %s", (int)r->child, strerror(errno));
	}
}

// Asks the command to stop: sig to the group, then SIGKILL after the grace. A second
// request, or SIGKILL, goes straight to SIGKILL.
static pid_t relay_pid; // the egress relay we forked, if any: it is not part of the command

// Hooks set by the control socket (control.c) before init_run: the relay that `wait` (or
// `serve`) already runs, the connection that hears "started PID" (control.c sends the
// "exit CODE" line once init_run has returned), and whether status.json is fsynced.
static pid_t given_relay = -1; // -1: start our own from --relay
static int notify_fd = -1;
static bool sync_status = true;

void run_use_relay(pid_t relay)
{
	given_relay = relay;
}
void run_notify_to(int fd)
{
	notify_fd = fd;
}
void run_sync_status(bool sync)
{
	sync_status = sync;
}

// One line to the control connection, if there is one; never blocks, never fails.
static void notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void notify(const char *fmt, ...)
{
	if (notify_fd < 0)
		return;
	char line[64];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (n > 0 && (size_t)n < sizeof line)
		(void)send(notify_fd, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void run_stop(struct run *r, int sig)
{
	int64_t now = now_mono_ms();
	if (r->phase == PH_KILLED)
		return;
	// Descendants that left the group with setsid() are reparented to us (we are a
	// subreaper, or PID 1): a timeout or cancel reaches them too.
	(void)signal_descendants(sig == SIGKILL || r->phase == PH_STOPPING ? SIGKILL : sig, relay_pid);
	if (sig == SIGKILL || r->phase == PH_STOPPING) {
		run_signal(r, SIGKILL);
		r->phase = PH_KILLED;
		r->give_up_at = now + INIT_SETTLE_MS;
		return;
	}
	run_signal(r, sig);
	r->phase = PH_STOPPING;
	r->kill_at = now + INIT_RUN_GRACE_MS;
}

// The child has its own session: publish the pgid, then honour a cancel that arrived first.
// (kill writes the marker before it reads pid, run writes pid before it reads the marker,
// so one of the two always sees the other.)
static void run_session_ready(struct run *r)
{
	char buf[32];
	r->session_ready = true;
	int n = snprintf(buf, sizeof buf, "%d\n", (int)r->child);
	// not fsynced: after a crash of the machine the process it names is gone anyway, and the
	// fsync would sit on the path of every command's start
	if (atomic_write_sync(r->opt.dir, INIT_FILE_PID, buf, (size_t)n, false) < 0)
		diag("run: cannot write %s/%s: %s", r->opt.dir, INIT_FILE_PID, strerror(errno));
	notify("started %d\n", (int)r->child);
	if (read_small(r->opt.dir, INIT_FILE_CANCEL, buf, sizeof buf) >= 0) {
		int sig = cancel_record_parse(buf);
		r->cancelled = true;
		run_stop(r, sig > 0 ? sig : SIGTERM);
	}
}

static void run_read_reports(struct run *r)
{
	struct report m[4];
	for (;;) {
		ssize_t n = read(r->ep, m, sizeof m);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			if (n < 0)
				diag("run: report pipe: %s", strerror(errno));
			(void)close(r->ep); // read end: nothing to flush
			r->ep = -1;
			return;
		}
		// Records are 8 bytes written whole, so reads return whole records.
		for (size_t i = 0; i < (size_t)n / sizeof m[0]; i++) {
			if (m[i].stage == ST_READY)
				run_session_ready(r);
			else if (r->fail_stage == 0) {
				r->fail_stage = m[i].stage;
				r->fail_errno = m[i].err;
			}
		}
	}
}

static void run_read_signals(struct run *r, int sfd)
{
	struct signalfd_siginfo si;
	for (;;) {
		ssize_t n = read(sfd, &si, sizeof si);
		if (n < 0 && errno == EINTR)
			continue;
		if (n != (ssize_t)sizeof si) {
			if (n < 0 && errno != EAGAIN)
				diag("run: signalfd: %s", strerror(errno));
			return;
		}
		int sig = (int)si.ssi_signo;
		// A cancel always sends SIGTERM: a non-interactive shell starts background jobs
		// with SIGINT and SIGQUIT ignored, so forwarding those would only wait for SIGKILL.
		if (sig == SIGTERM || sig == SIGINT || sig == SIGQUIT) {
			r->cancelled = true;
			run_stop(r, SIGTERM);
		} // SIGCHLD: the loop reaps on every turn
	}
}

static void run_deadlines(struct run *r, int64_t now)
{
	if (r->phase == PH_RUNNING && !r->child_done && r->opt.timeout_ms > 0 && now >= r->timeout_at) {
		r->timed_out = true;
		run_stop(r, SIGTERM);
	}
	if (r->phase == PH_STOPPING && now >= r->kill_at)
		run_stop(r, SIGKILL);
}

static bool run_done(struct run *r, int64_t now)
{
	if (!r->child_done)
		return false; // always wait for the direct child: its status is the result
	switch (r->phase) {
	case PH_RUNNING:
		if (!group_exists(r->child))
			return true;
		if (!r->cancelled && exists_in(r->opt.dir, INIT_FILE_CANCEL)) {
			// `demesne-init kill` has signalled the group: give the rest of it the same
			// grace as our own cancel (without signalling twice), reaping as it goes.
			r->cancelled = true;
			r->phase = PH_STOPPING;
			r->kill_at = now + INIT_RUN_GRACE_MS;
			return false;
		}
		// Finished on its own. Background members of its group stay unless asked otherwise.
		if (!r->opt.kill_group_on_exit)
			return true;
		run_stop(r, SIGKILL);
		return false;
	case PH_STOPPING: return !group_exists(r->child);
	case PH_KILLED: return !group_exists(r->child) || now >= r->give_up_at;
	}
	return true;
}

// Milliseconds poll() may sleep: until the next deadline, or a short tick while waiting for
// group members that are not our children (their exit sends us no SIGCHLD).
static int run_wakeup(const struct run *r, int64_t now)
{
	int64_t at = INT64_MAX;
	if (r->phase == PH_RUNNING && !r->child_done && r->opt.timeout_ms > 0)
		at = r->timeout_at;
	if (r->phase == PH_STOPPING && r->kill_at < at)
		at = r->kill_at;
	if (r->phase == PH_KILLED && r->give_up_at < at)
		at = r->give_up_at;
	if (r->child_done && now + INIT_POLL_MS < at)
		at = now + INIT_POLL_MS;
	if (at == INT64_MAX)
		return -1;
	if (at <= now)
		return 0;
	return at - now > INT_MAX ? INT_MAX : (int)(at - now);
}

// The host's "kill" line on the control connection (docs/reference/demesne-init.md,
// "Control socket"): SIGKILL to the whole command at once, without the engine's kill (the
// output quota's stop, lua/sandbox/oneshot.lua). Bytes are read without waiting; any other
// line the host sends is ignored. Returns false once the host hung up (or the socket
// failed): the connection is no longer watched.
static bool run_read_host(struct run *r, int fd)
{
	unsigned char b[64];
	for (;;) {
		ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return true;
		if (n <= 0)
			return false;
		for (ssize_t i = 0; i < n; i++) {
			// the current line's last four bytes and its length (up to 5: "longer")
			if (b[i] == '\n') {
				if (r->host_len == 4 &&
				    r->host_line == ((uint32_t)'k' << 24 | (uint32_t)'i' << 16 | 'l' << 8 | 'l'))
					run_stop(r, SIGKILL);
				r->host_line = 0;
				r->host_len = 0;
			} else {
				r->host_line = r->host_line << 8 | b[i];
				r->host_len += r->host_len < 5;
			}
		}
	}
}

static void run_loop(struct run *r, int sfd)
{
	int host = notify_fd; // the control connection's host, watched for "kill"
	for (;;) {
		if (!r->child_done) {
			(void)reap_children(r->child, &r->wstatus, &r->child_done);
			if (r->child_done) {
				r->end_real = now_real_ms();
				r->end_mono = now_mono_ms();
			}
		} else {
			(void)reap_children(0, NULL, NULL);
		}
		if (r->child_done && r->ep >= 0)
			run_read_reports(r); // the writer is gone: everything it said is in the pipe
		int64_t now = now_mono_ms();
		run_deadlines(r, now);
		if (run_done(r, now))
			return;
		// (poll ignores an entry whose fd is negative)
		struct pollfd pfd[3] = { { .fd = sfd, .events = POLLIN },
					 { .fd = r->ep, .events = POLLIN },
					 { .fd = host, .events = POLLIN } };
		int n = poll(pfd, 3, run_wakeup(r, now));
		if (n < 0) {
			if (errno != EINTR) {
				diag("run: poll: %s", strerror(errno));
				sleep_ms(INIT_POLL_MS);
			}
			continue;
		}
		if (pfd[0].revents)
			run_read_signals(r, sfd);
		if (r->ep >= 0 && pfd[1].revents)
			run_read_reports(r);
		if (host >= 0 && pfd[2].revents && !run_read_host(r, host))
			host = -1;
	}
}

// After the command exits, its descendants get a short while to finish on their own: a
// `tee` fed by `exec > >(tee log)` still has the last lines to write (case C03). Returns
// when none is left or after INIT_LINGER_MS, whichever comes first; a grandchild that
// lives on (case C02) costs at most that long.
static void linger(void)
{
	// the egress relay is ours, not the command's: it would keep the wait going to the end
	if (relay_pid > 0 && kill(relay_pid, SIGKILL) == 0)
		(void)waitpid(relay_pid, NULL, 0);
	int64_t until = now_mono_ms() + INIT_LINGER_MS;
	while (reap_children(0, NULL, NULL) > 0 && now_mono_ms() < until)
		sleep_ms(5);
}

// PID 1 of a one-shot container: nothing may outlive the command.
static void kill_everything(void)
{
	if (kill(-1, SIGKILL) < 0 && errno != ESRCH)
		diag("run: kill(-1): %s", strerror(errno));
	int64_t until = now_mono_ms() + INIT_SETTLE_MS;
	for (;;) {
		(void)reap_children(0, NULL, NULL);
		if (kill(-1, 0) < 0 && errno == ESRCH)
			return;
		if (now_mono_ms() >= until) {
			diag("run: some processes survived SIGKILL");
			return;
		}
		sleep_ms(5);
	}
}

// The number of processes the kernel's OOM killer has killed in this sandbox's memory
// cgroup: the "oom_kill" line of memory.events (cgroup v2) or of memory/memory.oom_control
// (cgroup v1, Linux >= 4.13), as seen from inside the container's cgroup namespace.
// Returns -1 when neither file can be read.
static long long oom_kills(void)
{
	static const char *const files[] = { "/sys/fs/cgroup/memory.events",
					     "/sys/fs/cgroup/memory/memory.oom_control" };
	for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
		FILE *f = fopen(files[i], "re");
		if (!f)
			continue;
		char line[128];
		long long n = -1;
		while (fgets(line, sizeof line, f)) {
			if (sscanf(line, "oom_kill %lld", &n) == 1)
				break;
		}
		fclose(f);
		if (n >= 0)
			return n;
	}
	return -1;
}

static void run_write_status(const struct run *r, int code, int sig, const char *error)
{
	char mem[8192];
	struct sbuf b;
	sb_init(&b, mem, sizeof mem);
	sb_puts(&b, "{\"id\":");
	sb_json_string(&b, r->opt.id, strlen(r->opt.id));
	sb_printf(&b, ",\"exit_code\":%d,\"signal\":", code);
	if (sig > 0)
		sb_printf(&b, "%d", sig);
	else
		sb_puts(&b, "null");
	sb_printf(&b,
		  ",\"timed_out\":%s,\"cancelled\":%s,\"started_at\":%lld,\"finished_at\":%lld,\"duration_ms\":%lld",
		  r->timed_out ? "true" : "false", r->cancelled ? "true" : "false", (long long)r->start_real,
		  (long long)r->end_real, (long long)(r->end_mono - r->start_mono));
	long long oom_after = r->oom_before >= 0 ? oom_kills() : -1;
	if (oom_after >= 0)
		sb_printf(&b, ",\"oom_kills\":%lld", oom_after > r->oom_before ? oom_after - r->oom_before : 0LL);
	if (error && *error) {
		sb_puts(&b, ",\"error\":");
		sb_json_string(&b, error, strlen(error));
	}
	sb_puts(&b, "}\n");
	if (b.overflow) // cannot happen with the bounded id and error; keep the file valid anyway
		diag("run: status too long");
	else if (atomic_write_sync(r->opt.dir, INIT_FILE_STATUS, b.p, b.len, sync_status) < 0)
		diag("run: cannot write %s/%s: %s", r->opt.dir, INIT_FILE_STATUS, strerror(errno));
}

// demesne-init failed before the command could start: record why and return 125.
static int run_abort(struct run *r, const char *what, int err)
{
	char msg[ERROR_MAX];
	snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
	diag("run: %s", msg);
	r->end_real = now_real_ms();
	r->end_mono = now_mono_ms();
	run_write_status(r, INIT_EXIT_FAILURE, 0, msg);
	return INIT_EXIT_FAILURE;
}

// After the loop: the result from the wait status, then the PID 1 sweep, then status.json.
static int run_finish(struct run *r)
{
	int code = INIT_EXIT_FAILURE, sig = 0;
	if (WIFEXITED(r->wstatus))
		code = WEXITSTATUS(r->wstatus);
	else if (WIFSIGNALED(r->wstatus)) {
		sig = WTERMSIG(r->wstatus);
		code = 128 + sig;
	}
	char error[ERROR_MAX] = "";
	if (r->fail_stage != 0)
		describe_failure(r, r->fail_stage, r->fail_errno, error, sizeof error);
	if (!r->cancelled && exists_in(r->opt.dir, INIT_FILE_CANCEL))
		r->cancelled = true; // `demesne-init kill` signalled the group
	if (!r->timed_out && !r->cancelled)
		linger();
	if (getpid() == 1)
		kill_everything();
	run_write_status(r, code, sig, error);
	return code;
}

// Opens the log `file` when given (its folder is created), else DIR/name.
static int open_log(const char *dir, const char *name, const char *file)
{
	char path[PATH_MAX];
	if (file) {
		if (strlen(file) >= sizeof path) {
			errno = ENAMETOOLONG;
			return -1;
		}
		strcpy(path, file);
		char *slash = strrchr(path, '/');
		if (slash && slash != path) {
			*slash = '\0';
			if (mkdir_p(path, 0755) < 0)
				return -1;
			*slash = '/';
		}
	} else if (path_join(path, sizeof path, dir, name) < 0) {
		return -1;
	}
	int fd;
	do
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
	while (fd < 0 && errno == EINTR);
	return fd;
}

int init_run(int argc, char **argv)
{
	struct run r = { .ep = -1, .oom_before = -1 };
	int rc = run_args_parse(&r.opt, argc, argv);
	if (rc > 0)
		init_usage(1);
	if (rc != 0)
		return rc > 0 ? INIT_EXIT_OK : INIT_EXIT_USAGE;
	r.oom_before = oom_kills();
	r.start_real = now_real_ms();
	r.start_mono = now_mono_ms();
	// Signals first: a SIGTERM that arrives during setup waits in the signalfd and cancels
	// the command as soon as it runs, instead of killing us before anything is recorded.
	int sfd = signals_open(), e = errno;
	// Orphaned descendants come to us (as PID 1 they do anyway), so we reap them and can
	// tell when the whole group is gone.
	if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		diag("run: cannot become a subreaper: %s", strerror(errno));
	if (mkdir_p(r.opt.dir, 0755) < 0) {
		diag("run: cannot create %s: %s", r.opt.dir, strerror(errno));
		if (sfd >= 0)
			(void)close(sfd);
		return INIT_EXIT_FAILURE; // nowhere to record anything
	}
	int out = -1, err = -1, ep[2] = { -1, -1 };
	pid_t pid = -1;
	const char *what = "cannot set up signals";
	if (sfd < 0)
		goto abort;
	what = "cannot remove an old status.json or pid";
	if (unlink_in(r.opt.dir, INIT_FILE_STATUS) < 0 || unlink_in(r.opt.dir, INIT_FILE_PID) < 0)
		goto abort_errno;
	what = "cannot create stdout.log";
	if ((out = open_log(r.opt.dir, INIT_FILE_STDOUT, r.opt.stdout_path)) < 0)
		goto abort_errno;
	what = "cannot create stderr.log";
	if ((err = open_log(r.opt.dir, INIT_FILE_STDERR, r.opt.stderr_path)) < 0)
		goto abort_errno;
	what = "cannot create a pipe";
	if (pipe2(ep, O_CLOEXEC) < 0 || fcntl(ep[0], F_SETFL, O_NONBLOCK) < 0)
		goto abort_errno;
	// --relay routes (egress): listening before the command starts, unless `wait` started them
	if (r.opt.relay_copy)
		relay_copy();
	relay_pid = given_relay >= 0 ? given_relay : relay_start(r.opt.relays, r.opt.nrelays);
	what = "cannot fork";
	if ((pid = fork()) < 0)
		goto abort_errno;
	if (pid == 0) {
		(void)close(ep[0]);
		(void)close(sfd);
		run_child(&r, out, err, ep[1]);
	}
	(void)close(ep[1]);
	(void)close(out); // the child holds its own copies; nothing to flush here
	(void)close(err);
	r.child = pid;
	r.ep = ep[0];
	r.timeout_at = r.start_mono + r.opt.timeout_ms;

	run_loop(&r, sfd);
	(void)close(sfd);
	if (r.ep >= 0)
		(void)close(r.ep);
	return run_finish(&r);

abort_errno:
	e = errno;
abort:
	for (int i = 0; i < 2; i++)
		if (ep[i] >= 0)
			(void)close(ep[i]);
	if (out >= 0)
		(void)close(out);
	if (err >= 0)
		(void)close(err);
	if (sfd >= 0)
		(void)close(sfd);
	return run_abort(&r, what, e);
}
