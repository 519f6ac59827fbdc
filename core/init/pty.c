// `demesne-init pty`: an interactive shell on a new pseudo-terminal, for `demesne attach`.
// It connects to a unix socket that the host listens on in the host-mounted run folder
// (the sandbox connects out, as the egress relay does, so this needs no network interface
// and works under gVisor), runs ARGV on the PTY's slave side as a new session, and carries
// the PTY's bytes over that connection in frames (frame.h): data and window sizes from the
// host, data and the final exit status from the sandbox. The host hanging up hangs up the
// shell (SIGHUP to its session), never the sandbox.
// Reference: docs/reference/demesne-init.md#pty-an-interactive-shell-for-demesne-attach
#include "frame.h"
#include "init.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define PTY_GRACE_MS 2000 // after a hangup: SIGHUP, then SIGKILL to the shell's group

struct pty_args {
	const char *connect; // absolute unix socket path
	const char *cwd;     // or NULL
	char **argv;         // NULL-terminated, non-empty
	bool signals;        // --signals: turn ^C, ^\ and ^Z into signals here (gVisor's PTY does not)
};

// Parses `pty`'s command line (argv[0] is "pty"). Returns 0, 1 (--help) or -1 (reported).
static int pty_args_parse(struct pty_args *a, int argc, char **argv)
{
	memset(a, 0, sizeof *a);
	int i = 1;
	for (; i < argc; i++) {
		const char *v;
		int r;
		if (strcmp(argv[i], "--") == 0) {
			i++;
			break;
		}
		if (argv[i][0] != '-')
			break;
		if (strcmp(argv[i], "--help") == 0)
			return 1;
		if ((r = opt_value(argc, argv, &i, "--connect", &v)) != 0) {
			if (r < 0)
				return -1;
			a->connect = v;
			continue;
		}
		if (strcmp(argv[i], "--signals") == 0) {
			a->signals = true;
			continue;
		}
		if ((r = opt_value(argc, argv, &i, "--cwd", &v)) != 0) {
			if (r < 0)
				return -1;
			a->cwd = v;
			continue;
		}
		diag("pty: unknown option '%s'", argv[i]);
		return -1;
	}
	if (!a->connect || a->connect[0] != '/' || strlen(a->connect) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
		diag("pty: --connect needs an absolute unix socket path");
		return -1;
	}
	if (i >= argc || argv[i][0] == '\0') {
		diag("pty: no command given");
		return -1;
	}
	a->argv = argv + i;
	return 0;
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int exit_code_of(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return INIT_EXIT_FAILURE;
}

// With --signals, the session leader stays as a helper that holds the terminal: it reads
// one byte per signal from `rd` ('i' INT, 'q' QUIT, 'z' TSTP) and sends it to the
// terminal's foreground group, which only a process of the session can ask for
// (tcgetpgrp). When `rd` ends (the host hung up) the shell gets SIGHUP. Exits with the
// shell's exit code.
static _Noreturn void signal_helper(int s, int rd, pid_t shell)
{
	signal(SIGHUP, SIG_IGN); // hang_up's SIGHUP to our group: the shell gets it from us
	bool open = true;
	for (;;) {
		int status;
		if (waitpid(shell, &status, WNOHANG) == shell)
			_exit(exit_code_of(status));
		struct pollfd p = { .fd = open ? rd : -1, .events = POLLIN };
		if (poll(&p, 1, INIT_POLL_MS) <= 0)
			continue;
		char c;
		if (read(rd, &c, 1) != 1) {
			open = false;
			pid_t g = tcgetpgrp(s);
			if (g > 1)
				kill(-g, SIGHUP);
			kill(-shell, SIGHUP);
			kill(shell, SIGHUP);
			continue;
		}
		int sig = c == 'i' ? SIGINT : c == 'q' ? SIGQUIT : c == 'z' ? SIGTSTP : 0;
		pid_t g = tcgetpgrp(s);
		if (sig && g > 1)
			kill(-g, sig);
	}
}

// The child: a new session whose controlling terminal is the slave; then ARGV (with
// --signals, in a grandchild, this process staying as signal_helper).
static _Noreturn void pty_child(const char *slave, const struct pty_args *a, int rd)
{
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);
	if (setsid() < 0)
		_exit(INIT_EXIT_FAILURE);
	// O_NOCTTY, then TIOCSCTTY: gVisor refuses the ioctl for a terminal the open already made ours
	int s = open(slave, O_RDWR | O_NOCTTY);
	if (s < 0)
		_exit(INIT_EXIT_FAILURE);
	int ctty = ioctl(s, TIOCSCTTY, 0) < 0 ? errno : 0;
	if (dup2(s, 0) < 0 || dup2(s, 1) < 0 || dup2(s, 2) < 0)
		_exit(INIT_EXIT_FAILURE);
	if (ctty)
		diag("pty: the terminal is not the shell's controlling terminal (%s): Ctrl-C cannot reach it",
		     strerror(ctty));
	if (rd >= 0) {
		pid_t shell = fork();
		if (shell < 0)
			_exit(INIT_EXIT_FAILURE);
		if (shell > 0)
			signal_helper(s, rd, shell);
		close(rd);
	}
	if (s > 2)
		close(s);
	if (a->cwd && chdir(a->cwd) < 0)
		diag("pty: cannot change directory to '%s': %s", a->cwd, strerror(errno));
	execvp(a->argv[0], a->argv);
	int e = errno;
	diag("pty: cannot execute '%s': %s", a->argv[0], strerror(e));
	_exit(e == ENOENT || e == ENOTDIR ? INIT_EXIT_NOTFOUND : INIT_EXIT_NOEXEC);
}

// --signals: copies data to out without the terminal's INTR, QUIT and SUSP characters
// (while ISIG is on), writing for each the helper's byte to `wr` instead. Returns the bytes
// left in out.
static size_t take_signals(int m, int wr, const uint8_t *data, size_t len, uint8_t *out)
{
	struct termios t;
	cc_t intr = 3, quit = 28, susp = 26;
	bool isig = true;
	if (tcgetattr(m, &t) == 0) {
		isig = (t.c_lflag & ISIG) != 0;
		intr = t.c_cc[VINTR], quit = t.c_cc[VQUIT], susp = t.c_cc[VSUSP];
	}
	size_t n = 0;
	for (size_t i = 0; i < len; i++) {
		uint8_t c = data[i];
		char sig = !isig ? 0 : c == intr ? 'i' : c == quit ? 'q' : c == susp ? 'z' : 0;
		if (sig && c != _POSIX_VDISABLE)
			(void)!write(wr, &sig, 1);
		else
			out[n++] = c;
	}
	return n;
}

static int send_frame(int sock, uint8_t type, const void *buf, size_t len)
{
	uint8_t head[FRAME_HEAD];
	frame_head(head, type, len);
	if (write_all(sock, head, sizeof head) < 0)
		return -1;
	return len ? write_all(sock, buf, len) : 0;
}

// Reads what the PTY has now (non-blocking) and sends it. Returns 1 while it may have more,
// 0 when it has nothing now, -1 when the slave side is closed or the host is gone.
static int pump_out(int m, int sock)
{
	uint8_t buf[FRAME_MAX];
	ssize_t n = read(m, buf, sizeof buf);
	if (n > 0)
		return send_frame(sock, FRAME_DATA, buf, (size_t)n) < 0 ? -1 : 1;
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	return -1; // EIO: no process holds the slave open any more
}

// Hangs up the shell's session: SIGHUP (and SIGCONT, for a stopped job), then SIGKILL after
// PTY_GRACE_MS. Returns the shell's exit code once reaped.
static int hang_up(pid_t pid, int sfd)
{
	kill(-pid, SIGHUP);
	kill(-pid, SIGCONT);
	int status;
	int64_t end = now_ms() + PTY_GRACE_MS;
	bool killed = false;
	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			break;
		if (r < 0)
			return INIT_EXIT_FAILURE;
		int64_t left = end - now_ms();
		if (left <= 0) {
			if (killed)
				return INIT_EXIT_FAILURE;
			kill(-pid, SIGKILL);
			killed = true;
			end = now_ms() + INIT_SETTLE_MS;
			continue;
		}
		struct pollfd p = { .fd = sfd, .events = POLLIN };
		if (poll(&p, 1, (int)(left < INIT_POLL_MS ? left : INIT_POLL_MS)) > 0) {
			struct signalfd_siginfo si;
			(void)!read(sfd, &si, sizeof si);
		}
	}
	return exit_code_of(status);
}

int init_pty(int argc, char **argv)
{
	struct pty_args a;
	int r = pty_args_parse(&a, argc, argv);
	if (r == 1) {
		init_usage(1);
		return INIT_EXIT_OK;
	}
	if (r < 0)
		return INIT_EXIT_USAGE;

	int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	strcpy(sa.sun_path, a.connect);
	if (sock < 0 || connect(sock, (struct sockaddr *)&sa, sizeof sa) < 0) {
		diag("pty: cannot connect to '%s': %s", a.connect, strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	char slave[128];
	if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0 || ptsname_r(m, slave, sizeof slave) != 0) {
		diag("pty: cannot open a pseudo-terminal: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	struct winsize ws = { .ws_row = 24, .ws_col = 80 };
	(void)ioctl(m, TIOCSWINSZ, &ws);

	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGHUP);
	sigaddset(&set, SIGQUIT);
	signal(SIGPIPE, SIG_IGN);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		return INIT_EXIT_FAILURE;
	int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
	if (sfd < 0) {
		diag("pty: signalfd: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	int sigp[2] = { -1, -1 };
	if (a.signals && pipe2(sigp, O_CLOEXEC) < 0) {
		diag("pty: pipe: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	pid_t pid = fork();
	if (pid < 0) {
		diag("pty: fork: %s", strerror(errno));
		return INIT_EXIT_FAILURE;
	}
	if (pid == 0)
		pty_child(slave, &a, a.signals ? sigp[0] : -1);
	if (a.signals)
		close(sigp[0]);
	(void)fcntl(m, F_SETFL, fcntl(m, F_GETFL) | O_NONBLOCK);

	// bytes from the host on their way to the PTY (held while the PTY's input is full)
	static uint8_t in[FRAME_HEAD + FRAME_MAX];
	size_t inlen = 0;
	static uint8_t topty[FRAME_MAX];
	size_t toptylen = 0, toptyoff = 0;
	bool pty_open = true;
	for (;;) {
		// hand the whole frames received to the PTY, one data frame at a time
		bool bad = false;
		while (!toptylen && inlen) {
			struct frame f;
			int used = frame_parse(in, inlen, &f);
			if (used == 0)
				break;
			if (used < 0 || f.type == FRAME_EXIT) {
				bad = true;
				break;
			}
			if (f.type == FRAME_DATA) {
				toptylen = a.signals ? take_signals(m, sigp[1], f.data, f.len, topty)
						     : (memcpy(topty, f.data, f.len), f.len);
				toptyoff = 0;
			} else {
				struct winsize w = { .ws_row = (unsigned short)f.rows,
						     .ws_col = (unsigned short)f.cols };
				(void)ioctl(m, TIOCSWINSZ, &w); // the kernel sends SIGWINCH to the foreground group
			}
			memmove(in, in + used, inlen - (size_t)used);
			inlen -= (size_t)used;
		}
		if (bad) {
			diag("pty: malformed frame from the host");
			break;
		}
		if (!pty_open)
			toptylen = 0; // nobody reads it any more
		struct pollfd p[3] = {
			{ .fd = (!toptylen && inlen < sizeof in) ? sock : -1, .events = POLLIN },
			{ .fd = pty_open ? m : -1, .events = POLLIN | (toptylen ? POLLOUT : 0) },
			{ .fd = sfd, .events = POLLIN },
		};
		if (poll(p, 3, -1) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (p[2].revents & POLLIN) {
			struct signalfd_siginfo si;
			bool hup = false;
			int status = 0;
			while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
				if (si.ssi_signo != SIGCHLD)
					hup = true;
			if (waitpid(pid, &status, WNOHANG) == pid) {
				// what the shell wrote last, then its status
				while (pty_open && pump_out(m, sock) > 0)
					;
				uint8_t code = (uint8_t)exit_code_of(status);
				(void)send_frame(sock, FRAME_EXIT, &code, 1);
				close(sock);
				close(m);
				kill(-pid, SIGHUP); // what the shell left in its group
				return code;
			}
			if (hup)
				break;
		}
		if (pty_open && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
			if (pump_out(m, sock) < 0) {
				if (errno == EPIPE || errno == ECONNRESET)
					break;    // the host is gone
				pty_open = false; // the slave is closed: wait for the shell's exit
			}
		}
		if (pty_open && toptylen && (p[1].revents & POLLOUT)) {
			ssize_t n = write(m, topty + toptyoff, toptylen);
			if (n > 0) {
				toptyoff += (size_t)n;
				toptylen -= (size_t)n;
			} else if (n < 0 && errno != EAGAIN && errno != EINTR) {
				toptylen = 0;
			}
		}
		if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
			ssize_t n = read(sock, in + inlen, sizeof in - inlen);
			if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
				break; // the host hung up: detach
			if (n > 0)
				inlen += (size_t)n;
		}
	}
	close(sock);
	close(m);
	if (a.signals)
		close(sigp[1]); // the helper hangs the shell up
	return hang_up(pid, sfd);
}
