// demesne-init kill: cancel a command started by `demesne-init run`, from another process.
//
// The engine's exec does not forward signals, so the host runs this through a second exec.
// It leaves a cancel marker in DIR (so a run that has not published its pid yet cancels
// itself when it does), signals the process group recorded in DIR/pid and, with --grace,
// escalates to SIGKILL.
#include "init.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// How long to wait for DIR/pid when the run has not published it yet.
#define KILL_PID_WAIT_MS 1000

// Reads DIR/pid. Returns the pgid (> 1), 0 when there is none yet, -1 when it is garbage.
static pid_t read_pgid(const char *dir)
{
	char buf[32];
	if (read_small(dir, INIT_FILE_PID, buf, sizeof buf) < 0)
		return errno == ENOENT ? 0 : -1;
	return pgid_record_parse(buf);
}

static bool wait_gone(pid_t pgid, int64_t ms)
{
	int64_t until = now_mono_ms() + ms;
	for (;;) {
		if (!group_exists(pgid))
			return true;
		if (now_mono_ms() >= until)
			return false;
		sleep_ms(INIT_POLL_MS);
	}
}

int init_kill(int argc, char **argv)
{
	struct kill_args a;
	int rc = kill_args_parse(&a, argc, argv);
	if (rc > 0) {
		init_usage(1);
		return INIT_EXIT_OK;
	}
	if (rc < 0)
		return INIT_EXIT_USAGE;
	const char *dir = a.dir;
	int sig = a.sig;
	int64_t grace = a.grace_ms;

	// The marker first, then the pid: see run.c run_session_ready.
	const char *name = signal_name(sig);
	char marker[16];
	size_t mlen = strlen(name);
	memcpy(marker, name, mlen);
	marker[mlen++] = '\n';
	if (mkdir_p(dir, 0755) < 0 || atomic_write(dir, INIT_FILE_CANCEL, marker, mlen) < 0) {
		diag("kill: cannot write %s/%s: %s", dir, INIT_FILE_CANCEL, strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	pid_t pgid;
	int64_t until = now_mono_ms() + KILL_PID_WAIT_MS;
	while ((pgid = read_pgid(dir)) == 0) {
		if (exists_in(dir, INIT_FILE_STATUS))
			return INIT_EXIT_OK; // finished (or failed) before it had a group
		if (now_mono_ms() >= until)
			return INIT_EXIT_OK; // not started: the marker cancels it when it does
		sleep_ms(INIT_POLL_MS);
	}
	if (pgid < 0) {
		diag("kill: %s/%s: %s", dir, INIT_FILE_PID, strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	if (group_signal(pgid, sig) < 0) {
		if (errno == ESRCH)
			return INIT_EXIT_OK;
		diag("kill: kill -%s -%d: %s", name, (int)pgid, strerror(errno));
		return INIT_EXIT_KILL_ALIVE;
	}
	if (wait_gone(pgid, grace >= 0 ? grace : INIT_SETTLE_MS))
		return INIT_EXIT_OK;
	if (grace < 0 || sig == SIGKILL)
		return INIT_EXIT_KILL_ALIVE;
	if (group_signal(pgid, SIGKILL) < 0 && errno != ESRCH) {
		diag("kill: kill -KILL -%d: %s", (int)pgid, strerror(errno));
		return INIT_EXIT_KILL_ALIVE;
	}
	return wait_gone(pgid, INIT_SETTLE_MS) ? INIT_EXIT_OK : INIT_EXIT_KILL_ALIVE;
}
