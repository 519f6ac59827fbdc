// demesne-init serve: PID 1 of a persistent sandbox.
//
// Reaps every zombie; on SIGTERM/SIGINT/SIGQUIT sends SIGTERM to every process,
// waits for them to go (5 s), SIGKILLs what is left and exits 0. The loop is poll()-based
// on a signalfd. The egress relay (--relay, relay.c) is a child process with its own loop.
// With --control PATH it also serves the control socket (control.c): each connection is
// handed to a forked child that runs one command (`run`) or cancels one (`kill`).
//
// "Every process" is kill(-1) only when we really are PID 1 of a PID namespace. Started
// any other way (tests on a host, an engine's --init in front of us) we signal only our
// own descendants, found in /proc (signal_descendants, util.c): kill(-1) there would hit
// the whole machine.
#include "init.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <unistd.h>

static void forward(bool pid1, int sig)
{
	if (pid1) {
		if (kill(-1, sig) < 0 && errno != ESRCH)
			diag("serve: kill(-1, %s): %s", signal_name(sig), strerror(errno));
	} else {
		(void)signal_descendants(sig, 0);
	}
}

// After reaping: does anything we are responsible for still exist?
static bool others_remain(bool pid1, int children)
{
	if (pid1)
		return kill(-1, 0) == 0 || errno != ESRCH;
	return children != 0; // a subreaper without children has no descendants
}

// Hands each pending connection of the control socket to a child of its own.
static void serve_connections(int lfd, int sfd)
{
	int fd;
	while ((fd = control_accept(lfd)) >= 0) {
		pid_t pid = fork();
		if (pid == 0) {
			(void)close(lfd);
			(void)close(sfd);
			control_child(fd);
		}
		if (pid < 0)
			control_reply(fd, "error cannot fork: %s\n", strerror(errno));
		(void)close(fd);
	}
}

int init_serve(int argc, char **argv)
{
	struct serve_args a;
	int rc = serve_args_parse(&a, argc, argv);
	if (rc > 0) {
		init_usage(1);
		return INIT_EXIT_OK;
	}
	if (rc < 0)
		return INIT_EXIT_USAGE;
	bool pid1 = getpid() == 1;
	if (!pid1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		diag("serve: cannot become a subreaper: %s", strerror(errno));
	int sfd = signals_open();
	if (sfd < 0) {
		diag("serve: cannot set up signals: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	if (a.relay_copy)
		relay_copy();
	(void)relay_start(a.relays, a.nrelays); // --relay routes (egress): a child process with its own poll loop
	int lfd = -1;
	if (a.control && (lfd = control_listen(a.control)) < 0) // the host falls back to the exec API
		diag("serve: cannot listen on %s: %s", a.control, strerror(errno));
	enum { RUNNING, STOPPING, KILLED } phase = RUNNING;
	int64_t deadline = 0;
	for (;;) {
		int children = reap_children(0, NULL, NULL);
		int64_t now = now_mono_ms();
		if (phase != RUNNING) {
			if (!others_remain(pid1, children))
				break;
			if (now >= deadline) {
				if (phase == KILLED) {
					diag("serve: some processes survived SIGKILL; exiting anyway");
					break;
				}
				forward(pid1, SIGKILL);
				phase = KILLED;
				deadline = now + INIT_SETTLE_MS;
			}
		}
		int timeout = -1; // running: sleep until a signal
		if (phase != RUNNING)
			timeout = deadline - now <= 0             ? 0
				  : deadline - now < INIT_POLL_MS ? (int)(deadline - now)
								  : INIT_POLL_MS;
		if (phase != RUNNING && lfd >= 0) { // stopping: no new commands
			(void)close(lfd);
			(void)unlink(a.control);
			lfd = -1;
		}
		struct pollfd pfd[2] = { { .fd = sfd, .events = POLLIN }, { .fd = lfd, .events = POLLIN } };
		int n = poll(pfd, lfd >= 0 ? 2 : 1, timeout);
		if (n < 0) {
			if (errno != EINTR) {
				diag("serve: poll: %s", strerror(errno));
				sleep_ms(INIT_POLL_MS);
			}
			continue;
		}
		if (lfd >= 0 && pfd[1].revents)
			serve_connections(lfd, sfd);
		if (!pfd[0].revents)
			continue;
		struct signalfd_siginfo si;
		ssize_t r;
		while ((r = read(sfd, &si, sizeof si)) == (ssize_t)sizeof si || (r < 0 && errno == EINTR)) {
			if (r < 0)
				continue;
			int sig = (int)si.ssi_signo;
			if (sig != SIGTERM && sig != SIGINT && sig != SIGQUIT)
				continue;       // SIGCHLD: reaped at the top of the loop
			if (phase == RUNNING) { // SIGTERM whatever the signal: see run.c run_read_signals
				forward(pid1, SIGTERM);
				phase = STOPPING;
				deadline = now_mono_ms() + INIT_SERVE_GRACE_MS;
			} else if (phase == STOPPING) { // asked twice: no more grace
				forward(pid1, SIGKILL);
				phase = KILLED;
				deadline = now_mono_ms() + INIT_SETTLE_MS;
			}
		}
		if (r < 0 && errno != EAGAIN)
			diag("serve: signalfd: %s", strerror(errno));
	}
	if (lfd >= 0) {
		(void)close(lfd);
		(void)unlink(a.control);
	}
	(void)close(sfd);
	return INIT_EXIT_OK;
}
