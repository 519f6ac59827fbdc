// demesne-init --relay PORT=PATH: the in-sandbox half of egress.
//
// The sandbox has no network interface but loopback. For each route, a relay process
// forked by demesne-init listens on 127.0.0.1:PORT. For every connection it accepts, it
// opens a connection to the unix socket PATH — a socket the host bind-mounts into the
// sandbox (/.demesne/run/…), one folder per sandbox, so the host knows which sandbox is
// calling without trusting anything it says — and hands the accepted TCP socket over it
// (SCM_RIGHTS, with the byte 'F'), then closes its own copies. The host proxy then reads and
// writes the sandbox's socket itself: no byte is copied here, and the relay keeps no state
// per connection. A host that cannot be reached closes the sandbox's connection.
//
// Under gVisor a TCP socket lives in the sandbox's own network stack and cannot be passed to
// the host (sendmsg fails with EINVAL). Then the relay sends the byte '\0' instead, with no
// descriptor, and a child process copies the bytes both ways between the TCP socket and the
// unix connection until both directions have ended; the host treats that unix connection
// as the client itself. The relay switches to copying on the first such failure and stays;
// --relay-copy starts it copying.
#include "init.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static struct relay_route routes[INIT_RELAY_MAX];
static size_t nroutes;
static int listeners[INIT_RELAY_MAX]; // in the relay process: the bound sockets, -1 for none
static bool copying;                  // descriptors cannot be passed to the host (gVisor): copy bytes instead

// The first byte on a relay's unix connection (docs/reference/demesne-init.md).
#define RELAY_BYTE_HANDOVER 'F' // sent with the accepted socket (SCM_RIGHTS)
#define RELAY_BYTE_COPY '\0'    // no socket: the client's bytes follow on this connection
#define RELAY_COPY_BUF 65536

void relay_copy(void)
{
	copying = true;
}

static int listen_on(int port)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -1;
	int one = 1;
	(void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = { .sin_family = AF_INET,
				 .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 512) < 0) {
		int e = errno;
		(void)close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

// Sends the byte 'F' with the accepted socket `a` over the unix connection `u`. Returns 0,
// or -1 with errno set (EINVAL: this kernel cannot pass the socket, e.g. gVisor's).
static int send_socket(int u, int a)
{
	char byte = RELAY_BYTE_HANDOVER;
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(sizeof(int))];
	} ctl;
	memset(&ctl, 0, sizeof ctl);
	struct msghdr msg = {
		.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl.space
	};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &a, sizeof(int));
	ssize_t n;
	do
		n = sendmsg(u, &msg, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	return n == 1 ? 0 : -1;
}

// One direction of a copy: bytes read from `from`, not yet written to `to`.
struct flow {
	int from, to;
	char *buf;
	size_t len, off;
	bool eof; // `from` has ended (or failed): `to` is shut down once buf is written
	bool done;
};

// Moves what it can without blocking. Returns -1 when the flow failed for good.
static int flow_step(struct flow *f, short from_ev, short to_ev)
{
	if (f->done)
		return 0;
	if (f->len == 0 && !f->eof && (from_ev & (POLLIN | POLLHUP | POLLERR))) {
		ssize_t n = read(f->from, f->buf, RELAY_COPY_BUF);
		if (n > 0) {
			f->len = (size_t)n;
			f->off = 0;
		} else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
			f->eof = true;
		}
	}
	if (f->len > 0 && (to_ev & (POLLOUT | POLLERR | POLLHUP))) {
		ssize_t n = send(f->to, f->buf + f->off, f->len, MSG_NOSIGNAL);
		if (n > 0) {
			f->off += (size_t)n;
			f->len -= (size_t)n;
		} else if (n < 0 && errno != EAGAIN && errno != EINTR) {
			return -1;
		}
	}
	if (f->eof && f->len == 0) {
		(void)shutdown(f->to, SHUT_WR);
		f->done = true;
	}
	return 0;
}

// The copying child: moves bytes both ways between the sandbox's TCP socket `a` and the
// unix connection `u` until both directions have ended or one fails, then exits.
static _Noreturn void copy_both_ways(int a, int u)
{
	static char b1[RELAY_COPY_BUF], b2[RELAY_COPY_BUF];
	struct flow up = { .from = a, .to = u, .buf = b1 }, down = { .from = u, .to = a, .buf = b2 };
	while (!(up.done && down.done)) {
		// read only into an empty buffer, write only a full one: memory stays bounded
		struct pollfd p[2] = {
			{ .fd = a,
			  .events = (short)((!up.eof && up.len == 0 ? POLLIN : 0) | (down.len > 0 ? POLLOUT : 0)) },
			{ .fd = u,
			  .events = (short)((!down.eof && down.len == 0 ? POLLIN : 0) | (up.len > 0 ? POLLOUT : 0)) },
		};
		for (int i = 0; i < 2; i++)
			if (p[i].events == 0)
				p[i].fd = -1; // nothing wanted: a hang-up there must not wake the loop
		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			_exit(1);
		}
		if (flow_step(&up, p[0].revents, p[1].revents) < 0 || flow_step(&down, p[1].revents, p[0].revents) < 0)
			_exit(1); // a peer is gone: closing both ends tells the other
	}
	_exit(0);
}

// Hands the connection `a` to the host: over a new connection to `path`, as the socket
// itself or, where sockets cannot be passed, as a copy of its bytes made by a child.
static void hand_over(int a, const char *path)
{
	int one = 1;
	(void)setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	strcpy(addr.sun_path, path); // length checked by relay_route_parse
	// non-blocking: a unix socket takes the connection at once or refuses it (EAGAIN when
	// the host's backlog is full), and the send fits in an empty socket buffer
	if (u < 0 || connect(u, (struct sockaddr *)&addr, sizeof addr) < 0) {
		diag("relay: cannot reach %s: %s", path, strerror(errno));
	} else if (!copying && send_socket(u, a) == 0) {
		// the host holds its own reference now
	} else if (!copying && errno != EINVAL && errno != EOPNOTSUPP) {
		diag("relay: cannot hand a connection to %s: %s", path, strerror(errno));
	} else {
		copying = true;
		char byte = RELAY_BYTE_COPY;
		ssize_t n;
		do
			n = send(u, &byte, 1, MSG_NOSIGNAL);
		while (n < 0 && errno == EINTR);
		pid_t pid = n == 1 ? fork() : -1;
		if (pid == 0) {
			(void)prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
			for (size_t i = 0; i < nroutes; i++)
				if (listeners[i] >= 0)
					(void)close(listeners[i]);
			copy_both_ways(a, u);
		}
		if (pid < 0)
			diag("relay: cannot copy a connection to %s: %s", path,
			     n == 1 ? strerror(errno) : "send failed");
	}
	if (u >= 0)
		(void)close(u);
	(void)close(a); // the host or the copying child holds its own reference now (or the sandbox sees a close)
}

static _Noreturn void relay_loop(const int *lfds)
{
	struct pollfd pfd[INIT_RELAY_MAX];
	for (size_t i = 0; i < nroutes; i++) {
		listeners[i] = lfds[i];
		pfd[i] = (struct pollfd){ .fd = lfds[i], .events = POLLIN };
	}
	for (;;) {
		if (poll(pfd, nroutes, -1) < 0) {
			if (errno != EINTR)
				sleep_ms(INIT_POLL_MS);
			continue;
		}
		for (size_t i = 0; i < nroutes; i++) {
			if (!(pfd[i].revents & POLLIN))
				continue;
			for (;;) {
				int a = accept4(lfds[i], NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
				if (a < 0) {
					if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
						sleep_ms(INIT_POLL_MS); // out of resources: let the host catch up
					break;
				}
				hand_over(a, routes[i].path);
			}
		}
	}
}

pid_t relay_start(const struct relay_route *r, size_t n)
{
	if (n > INIT_RELAY_MAX)
		n = INIT_RELAY_MAX;
	memcpy(routes, r, n * sizeof *r);
	nroutes = n;
	if (nroutes == 0)
		return 0;
	int lfds[INIT_RELAY_MAX];
	size_t ok = 0;
	for (size_t i = 0; i < nroutes; i++) {
		lfds[i] = listen_on(routes[i].port);
		if (lfds[i] < 0)
			diag("relay: cannot listen on 127.0.0.1:%d: %s", routes[i].port, strerror(errno));
		else
			ok++;
	}
	if (ok == 0)
		return -1;
	pid_t parent = getpid();
	pid_t pid = fork();
	if (pid < 0) {
		diag("relay: cannot fork: %s", strerror(errno));
		for (size_t i = 0; i < nroutes; i++)
			if (lfds[i] >= 0)
				(void)close(lfds[i]);
		return -1;
	}
	if (pid == 0) {
		signals_reset_for_exec();
		(void)signal(SIGPIPE, SIG_IGN);
		(void)signal(SIGCHLD, SIG_IGN); // copying children are reaped by the kernel
		(void)prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
		if (getppid() != parent)
			_exit(0); // the parent is already gone
		(void)prctl(PR_SET_NAME, "demesne-relay", 0, 0, 0);
		// keep only the listeners (and stdio for diagnostics): not the command's log files
		// or demesne-init's own pipes, whose ends must close when their owners do
		for (int fd = 3; fd < 1024; fd++) {
			bool mine = false;
			for (size_t i = 0; i < nroutes; i++)
				mine = mine || lfds[i] == fd;
			if (!mine)
				(void)close(fd);
		}
		relay_loop(lfds);
	}
	// The listening sockets are bound before we return: a command started next can connect.
	for (size_t i = 0; i < nroutes; i++)
		if (lfds[i] >= 0)
			(void)close(lfds[i]);
	return pid;
}
