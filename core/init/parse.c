// demesne-init's parsers: the command lines of run, kill and serve, and the records it reads
// back from files a sandbox can write (DIR/pid, DIR/cancel) or that describe its processes
// (/proc/<pid>/stat). Pure: no I/O but diag() for usage errors, no global state, so
// tests/fuzz/init_parse can call them on any bytes.
#include "init.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>

int opt_value(int argc, char **argv, int *i, const char *name, const char **value)
{
	const char *a = argv[*i];
	size_t n = strlen(name);
	if (strncmp(a, name, n) != 0)
		return 0;
	if (a[n] == '=') {
		*value = a + n + 1;
		return 1;
	}
	if (a[n] != '\0')
		return 0;
	if (*i + 1 >= argc) {
		diag("%s needs a value", name);
		return -1;
	}
	*value = argv[++*i];
	return 1;
}

int parse_seconds(const char *s, int64_t *ms)
{
	if (s == NULL || *s == '\0' || *s == '-' || *s == '+' || *s == ' ')
		return -1;
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno != 0 || *end != '\0' || !isfinite(v) || v < 0 || v > 1e7)
		return -1;
	*ms = (int64_t)(v * 1000.0 + 0.5);
	return 0;
}

static const struct {
	const char *name;
	int sig;
} signals[] = {
	{ "HUP", SIGHUP },   { "INT", SIGINT },   { "QUIT", SIGQUIT }, { "KILL", SIGKILL },
	{ "USR1", SIGUSR1 }, { "USR2", SIGUSR2 }, { "TERM", SIGTERM },
};

int signal_from_name(const char *s)
{
	if (s == NULL)
		return -1;
	if (strncasecmp(s, "SIG", 3) == 0)
		s += 3;
	for (size_t i = 0; i < sizeof signals / sizeof signals[0]; i++) {
		char num[8];
		snprintf(num, sizeof num, "%d", signals[i].sig);
		if (strcasecmp(s, signals[i].name) == 0 || strcmp(s, num) == 0)
			return signals[i].sig;
	}
	return -1;
}

const char *signal_name(int sig)
{
	for (size_t i = 0; i < sizeof signals / sizeof signals[0]; i++)
		if (signals[i].sig == sig)
			return signals[i].name;
	return "?";
}

int relay_route_parse(const char *spec, struct relay_route *out)
{
	const char *eq = strchr(spec, '=');
	char *end;
	long port = eq ? strtol(spec, &end, 10) : 0;
	if (!eq || end != eq || port < 1 || port > 65535 || eq[1] != '/' ||
	    strlen(eq + 1) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
		diag("--relay wants PORT=/path/to/unix.sock, not '%s'", spec);
		return -1;
	}
	out->port = (int)port;
	out->path = eq + 1;
	return 0;
}

// Adds the route of one --relay value to routes[*n]. Returns 0 or -1 (reported).
static int add_relay(struct relay_route *routes, size_t *n, const char *spec)
{
	if (*n >= INIT_RELAY_MAX) {
		diag("--relay: at most %d routes", INIT_RELAY_MAX);
		return -1;
	}
	if (relay_route_parse(spec, &routes[*n]) < 0)
		return -1;
	(*n)++;
	return 0;
}

#define ID_MAX 256

int run_args_parse(struct run_args *a, int argc, char **argv)
{
	memset(a, 0, sizeof *a);
	const char *timeout = NULL;
	int i;
	for (i = 1; i < argc; i++) {
		const char *arg = argv[i];
		int m;
		if (strcmp(arg, "--") == 0) {
			i++;
			break;
		}
		if (arg[0] != '-')
			break; // the command starts here
		if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0)
			return 1;
		if (strcmp(arg, "--kill-group-on-exit") == 0) {
			a->kill_group_on_exit = true;
			continue;
		}
		if (strcmp(arg, "--relay-copy") == 0) {
			a->relay_copy = true;
			continue;
		}
		const char *relay = NULL;
		if ((m = opt_value(argc, argv, &i, "--relay", &relay))) {
			if (m < 0 || add_relay(a->relays, &a->nrelays, relay) < 0)
				return -1;
			continue;
		}
		if ((m = opt_value(argc, argv, &i, "--id", &a->id)) ||
		    (m = opt_value(argc, argv, &i, "--dir", &a->dir)) ||
		    (m = opt_value(argc, argv, &i, "--cwd", &a->cwd)) ||
		    (m = opt_value(argc, argv, &i, "--timeout", &timeout)) ||
		    (m = opt_value(argc, argv, &i, "--stdin", &a->stdin_path)) ||
		    (m = opt_value(argc, argv, &i, "--stdout", &a->stdout_path)) ||
		    (m = opt_value(argc, argv, &i, "--stderr", &a->stderr_path))) {
			if (m < 0)
				return -1;
			continue;
		}
		diag("run: unknown option '%s'", arg);
		return -1;
	}
	if (a->id == NULL || a->id[0] == '\0' || strlen(a->id) > ID_MAX) {
		diag("run: --id ID is required (1 to %d bytes)", ID_MAX);
		return -1;
	}
	if (a->dir == NULL || a->dir[0] == '\0') {
		diag("run: --dir DIR is required");
		return -1;
	}
	if ((a->cwd && a->cwd[0] == '\0') || (a->stdin_path && a->stdin_path[0] == '\0')) {
		diag("run: --cwd and --stdin need a non-empty path");
		return -1;
	}
	if (timeout && parse_seconds(timeout, &a->timeout_ms) < 0) {
		diag("run: --timeout wants seconds (a number >= 0), not '%s'", timeout);
		return -1;
	}
	if (i >= argc || argv[i][0] == '\0') {
		diag("run: no command given after --");
		return -1;
	}
	a->argv = argv + i;
	return 0;
}

int kill_args_parse(struct kill_args *a, int argc, char **argv)
{
	const char *signame = "TERM", *grace_s = NULL;
	a->dir = NULL;
	a->grace_ms = -1;
	for (int i = 1; i < argc; i++) {
		int m;
		if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
			return 1;
		if ((m = opt_value(argc, argv, &i, "--dir", &a->dir)) ||
		    (m = opt_value(argc, argv, &i, "--signal", &signame)) ||
		    (m = opt_value(argc, argv, &i, "--grace", &grace_s))) {
			if (m < 0)
				return -1;
			continue;
		}
		diag("kill: unexpected argument '%s'", argv[i]);
		return -1;
	}
	a->sig = signal_from_name(signame);
	if (a->dir == NULL || a->dir[0] == '\0') {
		diag("kill: --dir DIR is required");
		return -1;
	}
	if (a->sig < 0) {
		diag("kill: unknown signal '%s' (TERM, KILL, INT, QUIT, HUP, USR1, USR2)", signame);
		return -1;
	}
	if (grace_s && parse_seconds(grace_s, &a->grace_ms) < 0) {
		diag("kill: --grace wants seconds (a number >= 0), not '%s'", grace_s);
		return -1;
	}
	return 0;
}

// The options serve and wait share: --relay PORT=PATH (repeatable), --relay-copy and --control PATH.
// Returns 0, 1 (--help) or -1 (usage error, reported).
static int daemon_args_parse(const char *mode, struct relay_route *relays, size_t *nrelays, const char **control,
			     bool *relay_copy, int argc, char **argv)
{
	*nrelays = 0;
	*control = NULL;
	*relay_copy = false;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
			return 1;
		if (strcmp(argv[i], "--relay-copy") == 0) {
			*relay_copy = true;
			continue;
		}
		const char *v = NULL;
		int m;
		if ((m = opt_value(argc, argv, &i, "--relay", &v)) != 0) {
			if (m < 0 || add_relay(relays, nrelays, v) < 0)
				return -1;
			continue;
		}
		if ((m = opt_value(argc, argv, &i, "--control", control)) != 0) {
			if (m < 0)
				return -1;
			if ((*control)[0] != '/' || strlen(*control) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
				diag("%s: --control wants an absolute socket path, not '%s'", mode, *control);
				return -1;
			}
			continue;
		}
		diag("%s: unexpected argument '%s'", mode, argv[i]);
		return -1;
	}
	return 0;
}

int serve_args_parse(struct serve_args *a, int argc, char **argv)
{
	return daemon_args_parse("serve", a->relays, &a->nrelays, &a->control, &a->relay_copy, argc, argv);
}

int wait_args_parse(struct wait_args *a, int argc, char **argv)
{
	int rc = daemon_args_parse("wait", a->relays, &a->nrelays, &a->control, &a->relay_copy, argc, argv);
	if (rc == 0 && a->control == NULL) {
		diag("wait: --control PATH is required");
		return -1;
	}
	return rc;
}

// The next NUL-terminated string of the payload at *pos, or NULL when there is none.
static char *next_string(char *buf, size_t *pos, size_t len)
{
	if (*pos >= len)
		return NULL;
	char *s = buf + *pos;
	char *nul = memchr(s, '\0', len - *pos);
	if (nul == NULL)
		return NULL;
	*pos = (size_t)(nul - buf) + 1;
	return s;
}

// A count: 1 to 5 decimal digits, at most max. Returns it, or -1.
static int parse_count(const char *s, int max)
{
	if (s == NULL || s[0] == '\0' || strlen(s) > 5)
		return -1;
	int v = 0;
	for (const char *p = s; *p; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		v = v * 10 + (*p - '0');
	}
	return v <= max ? v : -1;
}

int control_request_parse(char *buf, size_t len, char **items, struct control_request *req)
{
	size_t pos = 0;
	char *op = next_string(buf, &pos, len);
	int argc = parse_count(next_string(buf, &pos, len), CONTROL_ITEMS_MAX);
	if (op == NULL || (strcmp(op, "run") != 0 && strcmp(op, "kill") != 0) || argc < 0)
		return -1;
	items[0] = op;
	for (int i = 1; i <= argc; i++)
		if ((items[i] = next_string(buf, &pos, len)) == NULL)
			return -1;
	items[argc + 1] = NULL;
	int envc = parse_count(next_string(buf, &pos, len), CONTROL_ITEMS_MAX - argc);
	if (envc < 0)
		return -1;
	char **env = items + argc + 2;
	for (int i = 0; i < envc; i++) {
		env[i] = next_string(buf, &pos, len);
		if (env[i] == NULL || env[i][0] == '=' || strchr(env[i], '=') == NULL)
			return -1;
	}
	env[envc] = NULL;
	if (pos != len) // trailing bytes: not a request we understand
		return -1;
	req->op = op;
	req->argc = argc + 1;
	req->argv = items;
	req->envc = envc;
	req->env = env;
	return 0;
}

pid_t pgid_record_parse(const char *buf)
{
	char *end;
	errno = 0;
	long v = strtol(buf, &end, 10);
	while (*end == '\n' || *end == ' ')
		end++;
	// Never 0 or 1: kill(-0) is our own group and kill(-1) is every process.
	if (errno != 0 || end == buf || *end != '\0' || v <= 1 || v > INT32_MAX) {
		errno = EINVAL;
		return -1;
	}
	return (pid_t)v;
}

pid_t stat_ppid_parse(const char *buf)
{
	const char *p = strrchr(buf, ')'); // comm may contain spaces and parentheses
	int ppid;
	if (p == NULL || sscanf(p + 1, " %*c %d", &ppid) != 1)
		return -1;
	return ppid;
}

int cancel_record_parse(char *buf)
{
	buf[strcspn(buf, " \t\r\n")] = '\0';
	return signal_from_name(buf);
}
