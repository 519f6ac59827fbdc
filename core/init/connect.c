// demesne-init connect HOST:PORT: pipes stdin to a TCP connection to a port inside the
// sandbox and the connection back to stdout. The host runs it through the engine's exec API
// (attached stdin and stdout) for each connection to a port preview (lua/sandbox/preview.lua):
// a channel that needs no network interface in the sandbox and works under gVisor too.
// Reference: docs/reference/demesne-init.md
#include "init.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define CONNECT_BUF 65536

// Parses "127.0.0.1:PORT" (IPv4 loopback only: a preview reaches the sandbox's own
// services, never another address). Returns the port, or 0.
static int parse_target(const char *s, struct sockaddr_in *sa)
{
	const char *colon = strrchr(s, ':');
	if (!colon || colon == s || (size_t)(colon - s) >= 16)
		return 0;
	char host[16];
	memcpy(host, s, (size_t)(colon - s));
	host[colon - s] = '\0';
	char *end;
	long port = strtol(colon + 1, &end, 10);
	if (*end != '\0' || colon[1] == '\0' || port < 1 || port > 65535)
		return 0;
	memset(sa, 0, sizeof *sa);
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, host, &sa->sin_addr) != 1)
		return 0;
	if ((ntohl(sa->sin_addr.s_addr) >> 24) != 127)
		return 0;
	return (int)port;
}

// Copies what fd `from` has to `to`. Returns the bytes copied, 0 at end of stream, -1 on error.
static ssize_t copy_once(int from, int to, char *buf)
{
	ssize_t n = read(from, buf, CONNECT_BUF);
	if (n < 0)
		return errno == EINTR || errno == EAGAIN ? 1 : -1;
	if (n > 0 && write_all(to, buf, (size_t)n) != 0)
		return -1;
	return n;
}

int init_connect(int argc, char **argv)
{
	struct sockaddr_in sa;
	if (argc != 2 || !parse_target(argv[1], &sa)) {
		diag("connect: expected one argument 127.x.y.z:PORT (PORT 1-65535)");
		return INIT_EXIT_USAGE;
	}
	signal(SIGPIPE, SIG_IGN);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
		diag("connect: nothing accepts connections on %s (%s)", argv[1], strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	char *buf = malloc(CONNECT_BUF);
	if (!buf)
		return INIT_EXIT_FAILURE;
	bool in_open = true;
	for (;;) {
		struct pollfd p[2] = { { .fd = fd, .events = POLLIN }, { .fd = 0, .events = POLLIN } };
		int r = poll(p, in_open ? 2 : 1, -1);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (p[0].revents) {
			// the service's side: its end (or a reset) ends the whole connection
			if (copy_once(fd, 1, buf) <= 0)
				break;
		}
		if (in_open && p[1].revents) {
			ssize_t n = copy_once(0, fd, buf);
			if (n < 0)
				break;
			if (n == 0) {
				// the browser's side ended: the service sees end of stream, may still answer
				in_open = false;
				shutdown(fd, SHUT_WR);
			}
		}
	}
	free(buf);
	close(fd);
	return INIT_EXIT_OK;
}
