// demesne-init hold [--env K=V]... [--workdir DIR] [--user UID[:GID]] GATE -- PROGRAM [ARG...]
// demesne-init release GATE
//
// The Kubernetes adapter's create-before-start gate (lua/engines/kubernetes.lua): a Pod
// cannot be created without starting its container, so the container's PID 1 is `hold`,
// which waits until the file GATE exists and then becomes PROGRAM (execve, so PROGRAM is
// PID 1 from then on); `start` creates GATE through the API's exec (`release`). The same
// `hold`, run by exec once GATE exists, is how an exec gets an environment, folder and user
// of its own (the exec API has none): it applies --env (on top of the inherited
// environment) and --workdir, and execs at once. --user (UID[:GID]) changes user where
// hold may (as root); the adapter does not use it, since an exec there runs as the Pod's user.
// GATE lives in a folder only demesne writes (an emptyDir) before the release; it counts as
// present whatever it is (lstat: a symlink is not followed).
// Reference: docs/reference/demesne-init.md
#include "init.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HOLD_MAX_ENV 256

static volatile sig_atomic_t hold_signal;

static void on_signal(int sig)
{
	hold_signal = sig;
}

static int present(const char *gate)
{
	struct stat st;
	return fstatat(AT_FDCWD, gate, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

// Waits until GATE exists: inotify on its folder where the kernel has it, else a look every
// 50 ms. SIGTERM and SIGINT are blocked outside ppoll(2), which unblocks them atomically
// while it waits, so a signal that comes just before the wait still ends it. Returns 0, or
// the signal that ended the wait.
static int wait_gate(const char *gate, const sigset_t *waitmask)
{
	char dir[PATH_MAX];
	const char *slash = strrchr(gate, '/');
	if (slash == NULL)
		strcpy(dir, ".");
	else if (slash == gate)
		strcpy(dir, "/");
	else {
		size_t n = (size_t)(slash - gate);
		if (n >= sizeof dir)
			n = sizeof dir - 1;
		memcpy(dir, gate, n);
		dir[n] = '\0';
	}
	int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
	if (in >= 0 && inotify_add_watch(in, dir, IN_CREATE | IN_MOVED_TO | IN_ATTRIB | IN_ONLYDIR) < 0) {
		close(in);
		in = -1;
	}
	// after the watch is set: a file made before it is seen here, one made after by the watch
	while (!present(gate) && !hold_signal) {
		struct pollfd pfd = { .fd = in, .events = POLLIN };
		struct timespec tick = { 0, 50 * 1000 * 1000 };
		int r = ppoll(in >= 0 ? &pfd : NULL, in >= 0 ? 1 : 0, in >= 0 ? NULL : &tick, waitmask);
		if (r > 0) {
			char buf[4096];
			while (read(in, buf, sizeof buf) > 0)
				; // drained: which event it was does not matter, present() decides
		} else if (r < 0 && errno != EINTR && in >= 0) {
			close(in);
			in = -1;
		}
	}
	if (in >= 0)
		close(in);
	return hold_signal;
}

// UID[:GID] -> uid, gid (gid = uid's when not given). Returns 0, or -1.
static int parse_user(const char *s, uid_t *uid, gid_t *gid)
{
	char *end;
	errno = 0;
	unsigned long u = strtoul(s, &end, 10);
	if (errno || end == s || (*end && *end != ':') || u > 0x7fffffffUL)
		return -1;
	unsigned long g = u;
	if (*end == ':') {
		const char *gs = end + 1;
		g = strtoul(gs, &end, 10);
		if (errno || end == gs || *end || g > 0x7fffffffUL)
			return -1;
	}
	*uid = (uid_t)u;
	*gid = (gid_t)g;
	return 0;
}

/// `demesne-init hold [--env K=V]... [--workdir DIR] [--user UID[:GID]] GATE -- PROGRAM
/// [ARG...]` (argv[0] is "hold"). Waits for GATE, then applies the options and execs
/// PROGRAM (searched in PATH when it has no '/'). Returns only on failure: 2 usage, 125 a
/// folder or user that cannot be had, 126 cannot execute, 127 not found, 128+N when signal
/// N ended the wait.
int init_hold(int argc, char **argv)
{
	const char *workdir = NULL, *user = NULL, *gate = NULL;
	char *envs[HOLD_MAX_ENV];
	int nenv = 0, i = 1;
	for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
		const char *a = argv[i];
		if ((strcmp(a, "--env") == 0 || strcmp(a, "--workdir") == 0 || strcmp(a, "--user") == 0) &&
		    i + 1 >= argc) {
			diag("hold: %s needs a value", a);
			return INIT_EXIT_USAGE;
		}
		if (strcmp(a, "--env") == 0) {
			if (nenv == HOLD_MAX_ENV || strchr(argv[i + 1], '=') == NULL || argv[i + 1][0] == '=') {
				diag("hold: --env '%s': must be NAME=value (at most %d)", argv[i + 1], HOLD_MAX_ENV);
				return INIT_EXIT_USAGE;
			}
			envs[nenv++] = argv[++i];
		} else if (strcmp(a, "--workdir") == 0) {
			workdir = argv[++i];
		} else if (strcmp(a, "--user") == 0) {
			user = argv[++i];
		} else if (a[0] == '-' || gate != NULL) {
			diag("hold: unexpected argument '%s'", a);
			return INIT_EXIT_USAGE;
		} else {
			gate = a;
		}
	}
	if (gate == NULL || i >= argc || i + 1 >= argc) {
		diag("hold: usage: demesne-init hold [--env K=V]... [--workdir DIR] [--user UID[:GID]] GATE -- PROGRAM "
		     "[ARG...]");
		return INIT_EXIT_USAGE;
	}
	char **prog = argv + i + 1;
	uid_t uid = 0;
	gid_t gid = 0;
	if (user && parse_user(user, &uid, &gid) != 0) {
		diag("hold: --user '%s': must be UID or UID:GID (numbers)", user);
		return INIT_EXIT_USAGE;
	}
	sigset_t block, waitmask;
	sigemptyset(&block);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	sigprocmask(SIG_BLOCK, &block, &waitmask); // waitmask: the mask to wait with (unblocked)
	sigdelset(&waitmask, SIGTERM);
	sigdelset(&waitmask, SIGINT);
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_signal;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	int sig = wait_gate(gate, &waitmask);
	if (sig)
		return 128 + sig;
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	sigprocmask(SIG_UNBLOCK, &block, NULL); // a signal mask outlives execve: PROGRAM gets none
	for (int k = 0; k < nenv; k++) {
		char *eq = strchr(envs[k], '=');
		*eq = '\0';
		int r = setenv(envs[k], eq + 1, 1);
		*eq = '=';
		if (r != 0) {
			diag("hold: --env %s: %s", envs[k], strerror(errno));
			return INIT_EXIT_FAILURE;
		}
	}
	if (user) {
		if (setgroups(0, NULL) != 0 && getuid() == 0) {
			diag("hold: --user %s: setgroups: %s", user, strerror(errno));
			return INIT_EXIT_FAILURE;
		}
		if ((getgid() != gid && setgid(gid) != 0) || (getuid() != uid && setuid(uid) != 0)) {
			diag("hold: --user %s: %s", user, strerror(errno));
			return INIT_EXIT_FAILURE;
		}
	}
	if (workdir && chdir(workdir) != 0) {
		diag("hold: --workdir %s: %s", workdir, strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	execvp(prog[0], prog);
	int e = errno;
	diag("hold: %s: %s", prog[0], strerror(e));
	return e == ENOENT ? INIT_EXIT_NOTFOUND : INIT_EXIT_NOEXEC;
}

/// `demesne-init release GATE` (argv[0] is "release"): creates GATE (mode 0600, never
/// through a symlink), so that `hold GATE` goes on. An existing GATE is success. Returns 0,
/// 2 usage, 125 when it cannot be made (the message names the path).
int init_release(int argc, char **argv)
{
	if (argc != 2) {
		diag("release: usage: demesne-init release GATE");
		return INIT_EXIT_USAGE;
	}
	if (present(argv[1]))
		return INIT_EXIT_OK;
	int fd = open(argv[1], O_CREAT | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0) {
		diag("release: %s: %s", argv[1], strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	close(fd);
	return INIT_EXIT_OK;
}
