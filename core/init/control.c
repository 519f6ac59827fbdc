// demesne-init's control socket: the host hands commands to demesne-init through a unix
// socket in the host-bound run folder (/.demesne/run/init.sock) instead of the engine's
// exec API, which costs an engine round trip, a process in the engine and polling.
//
//   wait --control PATH [--relay PORT=PATH]...  PID 1 of a warm one-shot sandbox: waits for
//        one `run` request on one connection, then runs it exactly as `run` does as PID 1
//        (the command's environment comes with the request) and exits with its code.
//   serve --control PATH ...                     PID 1 of a persistent sandbox: each
//        connection is served by a forked child that runs one `run` or `kill`.
//
// Protocol (docs/reference/demesne-init.md, "Control socket"): one request per connection,
//   "DMI1", u32 big-endian payload length, payload = NUL-terminated strings
//   OP, N, ARG1 … ARGN, M, ENV1 … ENVM        (OP "run" or "kill"; N, M in decimal)
// answered by lines: "ok" (accepted), "started PID" (run: the command has its own
// process group), "exit CODE" (what `run`/`kill` exits with), "error TEXT".
//
// The socket folder is writable from inside the sandbox, so demesne-init serves only peers
// outside the sandbox's PID namespace when it is PID 1 (SO_PEERCRED reports pid 0 for
// them): a process in the sandbox cannot pose as the host. The host, for its part, treats
// whatever answers on the socket as the sandbox's (docs/explanation/trust-boundary.md).
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
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

// The request buffer lives in .bss: only the pages a request touches cost memory, and each
// forked `serve` child has its own copy.
static char buf[CONTROL_MAX];
static char *items[CONTROL_ITEMS_MAX + 3];

// The socket belongs to whoever owns the folder it is in: the run folder the host made
// and bind-mounted, i.e. the host's user. So a server that is not root (a member of the
// docker group, with no user namespace: the sandbox's root is the host's root) can connect
// to its 0600 socket, and no other local user can. Without CAP_CHOWN it stays ours.
static void give_to_folder_owner(const char *path)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	const char *slash = strrchr(path, '/');
	if (slash == NULL || (size_t)(slash - path) >= sizeof dir)
		return;
	size_t n = slash == path ? 1 : (size_t)(slash - path);
	memcpy(dir, path, n);
	dir[n] = '\0';
	int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
	struct stat st;
	if (dfd < 0)
		return;
	if (fstat(dfd, &st) == 0 && (st.st_uid != geteuid() || st.st_gid != getegid()) &&
	    fchownat(dfd, slash + 1, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) < 0)
		diag("control: cannot give %s to the owner of its folder (%d): %s", path, (int)st.st_uid,
		     strerror(errno));
	(void)close(dfd);
}

int control_listen(const char *path)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof a.sun_path) {
		errno = ENAMETOOLONG;
		return -1;
	}
	strcpy(a.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -1;
	(void)unlink(path);       // an earlier PID 1's socket (or whatever was put there)
	mode_t old = umask(0177); // 0600: its owner only (and the host's root)
	int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
	(void)umask(old);
	if (rc == 0)
		give_to_folder_owner(path);
	if (rc < 0 || listen(fd, 16) < 0) {
		int e = errno;
		(void)close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

int control_accept(int lfd)
{
	static bool told;
	for (;;) {
		int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			return -1;
		}
		struct ucred cr = { 0 };
		socklen_t len = sizeof cr;
		bool ok = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0;
		// As PID 1 of the sandbox, only a peer outside its PID namespace (the host: pid 0
		// here) is served. Started any other way (tests on a host), only our own user.
		if (ok)
			ok = getpid() == 1 ? cr.pid == 0 : cr.uid == geteuid();
		if (ok)
			return fd;
		if (!told) {
			diag("control: refused a connection from pid %d inside the sandbox (said once)", (int)cr.pid);
			told = true;
		}
		(void)close(fd);
	}
}

void control_reply(int fd, const char *fmt, ...)
{
	char line[256];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof line) {
		n = sizeof line - 1;
		line[n - 1] = '\n';
	}
	(void)send(fd, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT); // the host may be gone
}

// Reads n bytes before the deadline. Returns 0, 1 when the peer hung up before the first
// byte and `first` is set, or -1 (errno: ETIMEDOUT, ECONNRESET for a cut request, …).
static int read_full(int fd, char *p, size_t n, int64_t deadline, bool first)
{
	while (n > 0) {
		int64_t left = deadline - now_mono_ms();
		if (left <= 0) {
			errno = ETIMEDOUT;
			return -1;
		}
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		int r = poll(&pfd, 1, left > INT_MAX ? INT_MAX : (int)left);
		if (r < 0 && errno != EINTR)
			return -1;
		if (r <= 0)
			continue;
		ssize_t k = read(fd, p, n);
		if (k < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			return -1;
		}
		if (k == 0) {
			if (first)
				return 1;
			errno = ECONNRESET;
			return -1;
		}
		first = false;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

int control_read(int fd, struct control_request *req, int timeout_ms)
{
	unsigned char head[8];
	int64_t deadline = now_mono_ms() + timeout_ms;
	int rc = read_full(fd, (char *)head, sizeof head, deadline, true);
	if (rc != 0)
		return rc;
	uint32_t len = (uint32_t)head[4] << 24 | (uint32_t)head[5] << 16 | (uint32_t)head[6] << 8 | head[7];
	if (memcmp(head, CONTROL_MAGIC, 4) != 0 || len == 0 || len > CONTROL_MAX) {
		errno = EPROTO;
		return -1;
	}
	if (read_full(fd, buf, len, deadline, false) < 0)
		return -1;
	if (control_request_parse(buf, len, items, req) < 0) {
		errno = EPROTO;
		return -1;
	}
	return 0;
}

// The request's variables over the environment demesne-init was started with, as the
// engine's exec API puts the exec's Env over the container's.
static void apply_env(const struct control_request *req)
{
	for (int i = 0; i < req->envc; i++)
		(void)putenv(req->env[i]); // the strings live in the static buffer
}

static void refuse(int fd, int rc)
{
	if (rc < 0)
		control_reply(fd, "error %s\n", errno == EPROTO ? "malformed request" : strerror(errno));
}

_Noreturn void control_child(int fd)
{
	struct control_request req;
	int rc = control_read(fd, &req, CONTROL_READ_MS);
	if (rc != 0) {
		refuse(fd, rc);
		_exit(INIT_EXIT_USAGE);
	}
	control_reply(fd, "ok\n");
	int code;
	if (strcmp(req.op, "run") == 0) {
		apply_env(&req);
		run_use_relay(0); // serve's relay carries the sandbox's connections, not this run's
		run_notify_to(fd);
		code = init_run(req.argc, req.argv);
	} else {
		code = init_kill(req.argc, req.argv);
	}
	control_reply(fd, "exit %d\n", code);
	_exit(code);
}

int init_wait(int argc, char **argv)
{
	struct wait_args a;
	int rc0 = wait_args_parse(&a, argc, argv);
	if (rc0 > 0) {
		init_usage(1);
		return INIT_EXIT_OK;
	}
	if (rc0 < 0)
		return INIT_EXIT_USAGE;
	const char *path = a.control;
	if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		diag("wait: cannot become a subreaper: %s", strerror(errno));
	int sfd = signals_open();
	if (sfd < 0) {
		diag("wait: cannot set up signals: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	if (a.relay_copy)
		relay_copy();
	pid_t relay = relay_start(a.relays, a.nrelays); // listening before the host is told we are ready
	int lfd = control_listen(path);
	if (lfd < 0) {
		diag("wait: cannot listen on %s: %s", path, strerror(errno));
		if (relay > 0)
			(void)kill(relay, SIGKILL);
		return INIT_EXIT_FAILURE;
	}
	int host = -1, code = INIT_EXIT_OK;
	for (;;) {
		(void)reap_children(0, NULL, NULL);
		struct pollfd pfd[2] = { { .fd = sfd, .events = POLLIN },
					 { .fd = host >= 0 ? host : lfd, .events = POLLIN } };
		if (poll(pfd, 2, -1) < 0) {
			if (errno != EINTR) {
				diag("wait: poll: %s", strerror(errno));
				sleep_ms(INIT_POLL_MS);
			}
			continue;
		}
		if (pfd[0].revents) {
			struct signalfd_siginfo si;
			bool stop = false;
			while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
				stop = stop || si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT ||
				       si.ssi_signo == SIGQUIT;
			if (stop)
				break; // stopped before any command: nothing ran, nothing to record
		}
		if (!pfd[1].revents)
			continue;
		if (host < 0) {
			int fd;
			while ((fd = control_accept(lfd)) >= 0) {
				if (host < 0)
					host = fd; // the first connection is the host's; it holds it until the claim
				else
					(void)close(fd);
			}
			continue;
		}
		struct control_request req;
		int rc = control_read(host, &req, CONTROL_READ_MS);
		if (rc == 0 && strcmp(req.op, "run") == 0) {
			(void)close(lfd);
			(void)unlink(path); // one command only: nobody else may connect now
			(void)close(sfd);   // init_run opens its own; a pending SIGTERM stays pending
			apply_env(&req);
			run_use_relay(relay);
			run_notify_to(host);
			run_sync_status(false); // the host reads it at once and removes the sandbox after
			control_reply(host, "ok\n");
			code = init_run(req.argc, req.argv);
			control_reply(host, "exit %d\n", code);
			return code;
		}
		if (rc == 1)
			break; // the host hung up without a command: none will come
		if (rc == 0)
			errno = EPROTO; // a kill before any run: there is nothing to kill
		refuse(host, -1);
		(void)close(host);
		host = -1;
	}
	(void)close(lfd);
	(void)unlink(path);
	if (host >= 0)
		(void)close(host);
	if (relay > 0 && kill(relay, SIGKILL) == 0)
		(void)waitpid(relay, NULL, 0);
	(void)close(sfd);
	return code;
}
