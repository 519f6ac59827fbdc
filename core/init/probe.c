// demesne-init probe [--timeout-ms N] ADDR:PORT...: whether this container's network is
// closed. It tries a TCP connection to each IPv4 ADDR:PORT (at once, each bounded by the
// timeout, default 3000 ms) and prints one line per target, "reached ADDR:PORT" (a refusal
// counts: the host answered) or "blocked ADDR:PORT: REASON" (unreachable, no answer within
// the timeout), then "default-route yes" or "default-route no" from
// /proc/net/route. Exit 0 when no target was reached, 1 when one was, 2 on a usage error.
// Made for `demesne doctor`'s check of a Kubernetes cluster (issue 28; not wired yet): run in
// a probe Pod with the labels of demesne's sandboxes, so that the deny-all NetworkPolicy
// applies, against a listener on demesne's host, since a NetworkPolicy is only enforced by a
// network plugin that implements it, which no API shows.
// Reference: docs/reference/demesne-init.md
#include "init.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PROBE_MAX 64

// Parses "A.B.C.D:PORT" into sa. Returns 0, or -1.
static int parse_addr(const char *s, struct sockaddr_in *sa)
{
	const char *colon = strrchr(s, ':');
	if (!colon || colon == s || (size_t)(colon - s) >= 16)
		return -1;
	char host[16];
	memcpy(host, s, (size_t)(colon - s));
	host[colon - s] = '\0';
	char *end;
	errno = 0;
	long port = strtol(colon + 1, &end, 10);
	if (errno || *end || end == colon + 1 || port < 1 || port > 65535)
		return -1;
	memset(sa, 0, sizeof *sa);
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)port);
	return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// Whether /proc/net/route has a route to 0.0.0.0/0: 1, 0, or -1 when it cannot be read.
static int default_route(void)
{
	FILE *f = fopen("/proc/net/route", "re");
	if (!f)
		return -1;
	char line[256];
	int found = 0;
	if (!fgets(line, sizeof line, f)) { // the header
		fclose(f);
		return 0;
	}
	while (fgets(line, sizeof line, f)) {
		char ifname[64], dest[16];
		if (sscanf(line, "%63s %15s", ifname, dest) == 2 && strcmp(dest, "00000000") == 0)
			found = 1;
	}
	fclose(f);
	return found;
}

/// `demesne-init probe [--timeout-ms N] ADDR:PORT...` (argv[0] is "probe"). Prints a line
/// per target and the default route's presence; returns 0 (nothing reached), 1 (a target
/// was reached) or INIT_EXIT_USAGE.
int init_probe(int argc, char **argv)
{
	long timeout_ms = 3000;
	int i = 1;
	if (i + 1 < argc && strcmp(argv[i], "--timeout-ms") == 0) {
		char *end;
		errno = 0;
		timeout_ms = strtol(argv[i + 1], &end, 10);
		if (errno || *end || timeout_ms < 1 || timeout_ms > 60000) {
			diag("probe: --timeout-ms: '%s' is not a number of milliseconds from 1 to 60000", argv[i + 1]);
			return INIT_EXIT_USAGE;
		}
		i += 2;
	}
	int n = argc - i;
	if (n < 1 || n > PROBE_MAX) {
		diag("probe: name 1 to %d targets ADDR:PORT", PROBE_MAX);
		return INIT_EXIT_USAGE;
	}
	struct pollfd pfd[PROBE_MAX];
	int done[PROBE_MAX] = { 0 };
	int reached = 0;
	for (int k = 0; k < n; k++) {
		struct sockaddr_in sa;
		pfd[k].fd = -1;
		pfd[k].events = POLLOUT;
		if (parse_addr(argv[i + k], &sa) != 0) {
			diag("probe: '%s' is not an IPv4 ADDR:PORT", argv[i + k]);
			for (int j = 0; j < k; j++)
				if (pfd[j].fd >= 0)
					close(pfd[j].fd);
			return INIT_EXIT_USAGE;
		}
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd < 0) {
			printf("blocked %s: socket: %s\n", argv[i + k], strerror(errno));
			done[k] = 1;
			continue;
		}
		if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
			printf("reached %s\n", argv[i + k]);
			reached = 1;
			done[k] = 1;
			close(fd);
			continue;
		}
		if (errno == ECONNREFUSED) {
			printf("reached %s (refused: its host answered)\n", argv[i + k]);
			reached = 1;
			done[k] = 1;
			close(fd);
			continue;
		}
		if (errno != EINPROGRESS) {
			printf("blocked %s: %s\n", argv[i + k], strerror(errno));
			done[k] = 1;
			close(fd);
			continue;
		}
		pfd[k].fd = fd;
	}
	long long deadline = now_ms() + timeout_ms;
	for (;;) {
		int pending = 0;
		for (int k = 0; k < n; k++)
			pending += !done[k];
		long long left = deadline - now_ms();
		if (!pending || left <= 0)
			break;
		int r = poll(pfd, (nfds_t)n, (int)left);
		if (r < 0 && errno != EINTR)
			break;
		for (int k = 0; r > 0 && k < n; k++) {
			if (done[k] || !pfd[k].revents)
				continue;
			int err = 0;
			socklen_t len = sizeof err;
			getsockopt(pfd[k].fd, SOL_SOCKET, SO_ERROR, &err, &len);
			if (err == 0) {
				printf("reached %s\n", argv[i + k]);
				reached = 1;
			} else if (err == ECONNREFUSED || err == ECONNRESET) {
				// a refusal is an answer: the packets got there and back
				printf("reached %s (refused: its host answered)\n", argv[i + k]);
				reached = 1;
			} else {
				printf("blocked %s: %s\n", argv[i + k], strerror(err));
			}
			done[k] = 1;
			close(pfd[k].fd);
			pfd[k].fd = -1;
		}
	}
	for (int k = 0; k < n; k++) {
		if (!done[k]) {
			printf("blocked %s: no answer within %ld ms\n", argv[i + k], timeout_ms);
			close(pfd[k].fd);
		}
	}
	int route = default_route();
	printf("default-route %s\n", route < 0 ? "unknown" : route ? "yes" : "no");
	fflush(stdout);
	return reached ? 1 : 0;
}
