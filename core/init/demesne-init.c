// demesne-init: a small static binary bind-mounted read-only into every sandbox at
// /.demesne/init and run as the container's PID 1 (serve, or run for one-shot containers),
// and through `exec` to run or cancel single commands. Reference: docs/reference/demesne-init.md
#include "init.h"

#include <string.h>

static const char usage_text[] =
	"usage: demesne-init serve [--control PATH] [--relay PORT=PATH]... [--relay-copy]\n"
	"       demesne-init wait --control PATH [--relay PORT=PATH]... [--relay-copy]\n"
	"       demesne-init run --id ID --dir DIR [--cwd CWD] [--timeout SECONDS]\n"
	"                        [--stdin FILE] [--stdout FILE] [--stderr FILE]\n"
	"                        [--kill-group-on-exit] [--relay PORT=PATH]... [--relay-copy]\n"
	"                        -- ARGV...\n"
	"       demesne-init kill --dir DIR [--signal TERM|KILL|INT|QUIT|HUP|USR1|USR2]\n"
	"                         [--grace SECONDS]\n"
	"       demesne-init connect 127.0.0.1:PORT\n"
	"       demesne-init pty --connect PATH [--cwd DIR] [--signals] -- ARGV...\n"
	"       demesne-init probe [--timeout-ms N] ADDR:PORT...\n"
	"       demesne-init hold [--env K=V]... [--workdir DIR] [--user UID[:GID]] GATE\n"
	"                         -- PROGRAM [ARG...]\n"
	"       demesne-init release GATE\n"
	"       demesne-init --version | --help\n"
	"\n"
	"serve  PID 1 of a persistent sandbox: reaps zombies; on SIGTERM/SIGINT signals every\n"
	"       process, SIGKILLs what is left after 5 s, exits 0.\n"
	"run    runs ARGV in a new session; writes DIR/pid, DIR/stdout.log, DIR/stderr.log and,\n"
	"       when it ends, DIR/status.json; exits with the command's exit code (128+N when\n"
	"       killed by signal N). --timeout or SIGTERM/SIGINT: the group gets SIGTERM, then\n"
	"       SIGKILL after 2 s. As PID 1 it kills every process before exiting.\n"
	"wait   PID 1 of a warm one-shot sandbox: waits for one run request on the control\n"
	"       socket, then runs it as `run` does and exits with its code.\n"
	"--control PATH (serve, wait): the control socket, a unix socket at PATH on which the\n"
	"       host sends run and kill requests (only from outside the sandbox).\n"
	"--relay PORT=PATH (serve, wait, run): listen on 127.0.0.1:PORT and carry each connection\n"
	"       to the unix socket PATH (egress); a child process that dies with demesne-init.\n"
	"       It passes the accepted socket to the host, or, with --relay-copy or where that\n"
	"       fails (gVisor), copies the connection's bytes.\n"
	"kill   signals the group recorded in DIR/pid (default TERM); with --grace, SIGKILL\n"
	"       after that many seconds. Exits 0 when the group is gone, 1 when it remains.\n"
	"connect pipes stdin to a TCP connection to 127.0.0.1:PORT and the connection to\n"
	"       stdout, until the port's side ends (port previews, through the engine's exec).\n"
	"pty    runs ARGV on a new pseudo-terminal and carries it over the unix socket PATH in\n"
	"       frames (demesne attach); the host hanging up sends SIGHUP to its session.\n"
	"probe  tries a TCP connection to each IPv4 ADDR:PORT and prints reached or blocked for\n"
	"       each, then default-route yes|no; exits 0 when nothing was reached, else 1.\n"
	"hold   waits until the file GATE exists (release makes it), then applies --env,\n"
	"       --workdir and --user and becomes PROGRAM (a Pod's create-before-start gate, and\n"
	"       how an exec on Kubernetes gets its environment and folder).\n"
	"\n"
	"exit codes: 2 usage, 125 demesne-init failed, 126 cannot execute, 127 not found.\n";

void init_usage(int fd)
{
	(void)write_all(fd, usage_text, sizeof usage_text - 1);
}

int main(int argc, char **argv)
{
	ensure_std_fds();
	if (argc < 2) {
		init_usage(2);
		return INIT_EXIT_USAGE;
	}
	const char *cmd = argv[1];
	if (strcmp(cmd, "serve") == 0)
		return init_serve(argc - 1, argv + 1);
	if (strcmp(cmd, "run") == 0)
		return init_run(argc - 1, argv + 1);
	if (strcmp(cmd, "wait") == 0)
		return init_wait(argc - 1, argv + 1);
	if (strcmp(cmd, "kill") == 0)
		return init_kill(argc - 1, argv + 1);
	if (strcmp(cmd, "connect") == 0)
		return init_connect(argc - 1, argv + 1);
	if (strcmp(cmd, "pty") == 0)
		return init_pty(argc - 1, argv + 1);
	if (strcmp(cmd, "probe") == 0)
		return init_probe(argc - 1, argv + 1);
	if (strcmp(cmd, "hold") == 0)
		return init_hold(argc - 1, argv + 1);
	if (strcmp(cmd, "release") == 0)
		return init_release(argc - 1, argv + 1);
	if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "-V") == 0) {
		static const char v[] = "demesne-init " DEMESNE_VERSION "\n";
		return write_all(1, v, sizeof v - 1) == 0 ? INIT_EXIT_OK : INIT_EXIT_FAILURE;
	}
	if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
		init_usage(1);
		return INIT_EXIT_OK;
	}
	diag("unknown command '%s'", cmd);
	init_usage(2);
	return INIT_EXIT_USAGE;
}
