// demesne-init helpers: I/O with write(2), atomic files, time, signals, reaping, JSON text.
// (The parsers are in parse.c.)
#include "init.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

void diag(const char *fmt, ...)
{
	char buf[1024];
	int saved = errno;
	size_t n = (size_t)snprintf(buf, sizeof buf, "demesne-init: ");
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
	va_end(ap);
	if (m < 0)
		m = 0;
	n += (size_t)m < sizeof buf - n - 1 ? (size_t)m : sizeof buf - n - 2;
	buf[n++] = '\n';
	(void)write_all(2, buf, n); // nothing more to do if stderr is gone
	errno = saved;
}

int write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;
	while (len > 0) {
		ssize_t n = write(fd, p, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

int path_join(char *out, size_t cap, const char *dir, const char *name)
{
	int n = snprintf(out, cap, "%s/%s", dir, name);
	if (n < 0 || (size_t)n >= cap) {
		errno = ENAMETOOLONG;
		return -1;
	}
	return 0;
}

int mkdir_p(const char *path, mode_t mode)
{
	char buf[PATH_MAX];
	size_t len = strlen(path);
	if (len == 0) {
		errno = ENOENT;
		return -1;
	}
	if (len >= sizeof buf) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(buf, path, len + 1);
	for (char *p = buf + 1;; p++) {
		if (*p != '/' && *p != '\0')
			continue;
		char c = *p;
		*p = '\0';
		if (mkdir(buf, mode) < 0 && errno != EEXIST)
			return -1;
		*p = c;
		if (c == '\0')
			break;
	}
	struct stat st;
	if (stat(path, &st) < 0)
		return -1;
	if (!S_ISDIR(st.st_mode)) {
		errno = ENOTDIR;
		return -1;
	}
	return 0;
}

int atomic_write(const char *dir, const char *name, const void *buf, size_t len)
{
	return atomic_write_sync(dir, name, buf, len, true);
}

int atomic_write_sync(const char *dir, const char *name, const void *buf, size_t len, bool sync)
{
	char tmp[PATH_MAX], dst[PATH_MAX], tname[128];
	snprintf(tname, sizeof tname, ".%s.tmp.%ld", name, (long)getpid());
	if (path_join(tmp, sizeof tmp, dir, tname) < 0 || path_join(dst, sizeof dst, dir, name) < 0)
		return -1;
	int fd;
	do
		fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
	while (fd < 0 && errno == EINTR);
	if (fd < 0)
		return -1;
	int rc = write_all(fd, buf, len);
	// fsync so that a crash never leaves an empty file under the final name; file systems
	// without fsync (EINVAL) are accepted as they are.
	if (rc == 0 && sync && fsync(fd) < 0 && errno != EINVAL && errno != EROFS)
		rc = -1;
	int saved = errno;
	if (close(fd) < 0 && rc == 0 && errno != EINTR) {
		rc = -1;
		saved = errno;
	}
	if (rc == 0 && rename(tmp, dst) < 0) {
		rc = -1;
		saved = errno;
	}
	if (rc < 0) {
		(void)unlink(tmp);
		errno = saved;
	}
	return rc;
}

ssize_t read_small(const char *dir, const char *name, char *buf, size_t cap)
{
	char path[PATH_MAX];
	if (cap == 0 || path_join(path, sizeof path, dir, name) < 0)
		return -1;
	int fd;
	do
		fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	while (fd < 0 && errno == EINTR);
	if (fd < 0)
		return -1;
	size_t len = 0;
	while (len < cap - 1) {
		ssize_t n = read(fd, buf + len, cap - 1 - len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			int saved = errno;
			(void)close(fd);
			errno = saved;
			return -1;
		}
		if (n == 0)
			break;
		len += (size_t)n;
	}
	(void)close(fd); // read-only: nothing to lose on close
	buf[len] = '\0';
	return (ssize_t)len;
}

int unlink_in(const char *dir, const char *name)
{
	char path[PATH_MAX];
	if (path_join(path, sizeof path, dir, name) < 0)
		return -1;
	if (unlink(path) < 0 && errno != ENOENT)
		return -1;
	return 0;
}

bool exists_in(const char *dir, const char *name)
{
	char path[PATH_MAX];
	struct stat st;
	return path_join(path, sizeof path, dir, name) == 0 && lstat(path, &st) == 0;
}

static int64_t clock_ms(clockid_t id)
{
	struct timespec ts;
	if (clock_gettime(id, &ts) < 0) // cannot fail for these clocks; keep the value defined
		return 0;
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t now_real_ms(void)
{
	return clock_ms(CLOCK_REALTIME);
}
int64_t now_mono_ms(void)
{
	return clock_ms(CLOCK_MONOTONIC);
}

void sleep_ms(int64_t ms)
{
	if (ms <= 0)
		return;
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000 };
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

int signals_open(void)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGQUIT);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		return -1;
	// Inherited dispositions are not trusted: SIGCHLD set to SIG_IGN would auto-reap the
	// command and lose its status; a shell's background job inherits SIGINT ignored.
	struct sigaction dfl = { .sa_handler = SIG_DFL }, ign = { .sa_handler = SIG_IGN };
	sigemptyset(&dfl.sa_mask);
	sigemptyset(&ign.sa_mask);
	if (sigaction(SIGCHLD, &dfl, NULL) < 0 || sigaction(SIGTERM, &dfl, NULL) < 0 ||
	    sigaction(SIGINT, &dfl, NULL) < 0 || sigaction(SIGQUIT, &dfl, NULL) < 0 ||
	    sigaction(SIGPIPE, &ign, NULL) < 0 || sigaction(SIGHUP, &ign, NULL) < 0)
		return -1;
	return signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
}

void signals_reset_for_exec(void)
{
	struct sigaction dfl = { .sa_handler = SIG_DFL };
	sigemptyset(&dfl.sa_mask);
	for (int sig = 1; sig < NSIG; sig++)
		if (sig != SIGKILL && sig != SIGSTOP)
			(void)sigaction(sig, &dfl, NULL); // EINVAL for glibc-reserved RT signals: fine
	sigset_t none;
	sigemptyset(&none);
	(void)sigprocmask(SIG_SETMASK, &none, NULL); // cannot fail with a valid set
}

int reap_children(pid_t watch, int *status, bool *done)
{
	for (;;) {
		int st;
		pid_t p = waitpid(-1, &st, WNOHANG);
		if (p > 0) {
			if (watch > 0 && p == watch) {
				*status = st;
				*done = true;
			}
			continue;
		}
		if (p == 0)
			return 1;
		if (errno == EINTR)
			continue;
		if (errno == ECHILD)
			return 0;
		diag("waitpid: %s", strerror(errno));
		return -1;
	}
}

bool group_exists(pid_t pgid)
{
	if (pgid <= 1)
		return false;
	// EPERM means a member exists that we may not signal.
	return kill(-pgid, 0) == 0 || errno == EPERM;
}

int group_signal(pid_t pgid, int sig)
{
	if (pgid <= 1) {
		errno = EINVAL;
		return -1;
	}
	return kill(-pgid, sig);
}

struct proc {
	pid_t pid, ppid;
	bool mine;
};

// Parent pid of pid from /proc/<pid>/stat, or -1.
static pid_t read_ppid(pid_t pid)
{
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/%d", (int)pid);
	if (read_small(path, "stat", buf, sizeof buf) < 0)
		return -1;
	return stat_ppid_parse(buf);
}

int signal_descendants(int sig, pid_t spare)
{
	DIR *d = opendir("/proc");
	if (d == NULL) {
		diag("/proc: %s", strerror(errno));
		return -1;
	}
	struct proc *v = NULL;
	size_t n = 0, cap = 0;
	int rc = 0;
	for (;;) {
		errno = 0; // readdir reports errors only through errno
		struct dirent *e = readdir(d);
		if (e == NULL) {
			if (errno != 0)
				rc = -1;
			break;
		}
		if (!isdigit((unsigned char)e->d_name[0]))
			continue;
		pid_t pid = (pid_t)atoi(e->d_name);
		pid_t ppid = read_ppid(pid);
		if (ppid < 0)
			continue; // exited meanwhile
		if (n == cap) {
			size_t ncap = cap ? cap * 2 : 256;
			struct proc *nv = realloc(v, ncap * sizeof *nv);
			if (nv == NULL) {
				rc = -1;
				break;
			}
			v = nv;
			cap = ncap;
		}
		v[n++] = (struct proc){ pid, ppid, false };
	}
	int saved = errno;
	(void)closedir(d);
	if (rc < 0) {
		diag("listing /proc: %s", strerror(saved ? saved : ENOMEM));
		free(v);
		return -1;
	}
	// Mark the closure of "parent is us or marked". Passes repeat until nothing changes;
	// process trees are shallow, so this stays cheap.
	pid_t self = getpid();
	for (bool changed = true; changed;) {
		changed = false;
		for (size_t i = 0; i < n; i++) {
			if (v[i].mine)
				continue;
			bool mine = v[i].ppid == self;
			for (size_t j = 0; j < n && !mine; j++)
				mine = v[j].mine && v[j].pid == v[i].ppid;
			if (mine) {
				v[i].mine = changed = true;
				if (v[i].pid == spare)
					continue;
				if (kill(v[i].pid, sig) == 0)
					rc++;
				else if (errno != ESRCH)
					diag("kill %d: %s", (int)v[i].pid, strerror(errno));
			}
		}
	}
	free(v);
	return rc;
}

void ensure_std_fds(void)
{
	for (int fd = 0; fd <= 2; fd++) {
		if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF)
			continue;
		int n = open("/dev/null", O_RDWR); // lowest free descriptor: this one
		if (n >= 0 && n != fd)
			(void)close(n);
	}
}

void cloexec_from(int lowfd)
{
#ifdef SYS_close_range
	if (syscall(SYS_close_range, (unsigned)lowfd, ~0U, CLOSE_RANGE_CLOEXEC) == 0)
		return;
#endif
	// The descriptors that are open, from /proc: gVisor refuses CLOSE_RANGE_CLOEXEC, and a
	// fcntl on every possible descriptor costs it about a second per command
	int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
	if (d != NULL) {
		struct dirent *e;
		while ((e = readdir(d)) != NULL) {
			char *end;
			long fd = strtol(e->d_name, &end, 10);
			if (*end != '\0' || end == e->d_name || fd < lowfd || fd == dfd)
				continue;
			int fl = fcntl((int)fd, F_GETFD);
			if (fl >= 0 && !(fl & FD_CLOEXEC))
				(void)fcntl((int)fd, F_SETFD, fl | FD_CLOEXEC);
		}
		(void)closedir(d);
		return;
	}
	if (dfd >= 0)
		(void)close(dfd);
	struct rlimit rl;
	long max = 1024;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
		max = rl.rlim_cur < 65536 ? (long)rl.rlim_cur : 65536;
	for (long fd = lowfd; fd < max; fd++) {
		int fl = fcntl((int)fd, F_GETFD);
		if (fl >= 0 && !(fl & FD_CLOEXEC))
			(void)fcntl((int)fd, F_SETFD, fl | FD_CLOEXEC);
	}
}

void sb_init(struct sbuf *b, char *mem, size_t cap)
{
	b->p = mem;
	b->cap = cap;
	b->len = 0;
	b->overflow = false;
	mem[0] = '\0';
}

static void sb_add(struct sbuf *b, const char *s, size_t n)
{
	if (b->len + n >= b->cap) {
		b->overflow = true;
		return;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

void sb_puts(struct sbuf *b, const char *s)
{
	sb_add(b, s, strlen(s));
}

void sb_printf(struct sbuf *b, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= b->cap - b->len) {
		b->overflow = true;
		b->p[b->len] = '\0';
		return;
	}
	b->len += (size_t)n;
}

// Length of the valid UTF-8 sequence at s (n bytes left), or 0 if it is not valid.
static size_t utf8_len(const unsigned char *s, size_t n)
{
	unsigned c = s[0];
	size_t len;
	unsigned min;
	if (c < 0x80)
		return 1;
	if (c >= 0xc2 && c <= 0xdf)
		len = 2, min = 0x80;
	else if (c >= 0xe0 && c <= 0xef)
		len = 3, min = 0x800;
	else if (c >= 0xf0 && c <= 0xf4)
		len = 4, min = 0x10000;
	else
		return 0;
	if (n < len)
		return 0;
	unsigned cp = c & (0x7f >> len);
	for (size_t i = 1; i < len; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = (cp << 6) | (s[i] & 0x3f);
	}
	if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	return len;
}

void sb_json_string(struct sbuf *b, const char *s, size_t n)
{
	const unsigned char *u = (const unsigned char *)s;
	sb_add(b, "\"", 1);
	for (size_t i = 0; i < n;) {
		unsigned c = u[i];
		if (c == '"' || c == '\\') {
			char e[2] = { '\\', (char)c };
			sb_add(b, e, 2);
			i++;
		} else if (c < 0x20) {
			char e[8];
			const char *named = c == '\n' ? "\\n" : c == '\t' ? "\\t" : c == '\r' ? "\\r" : NULL;
			if (named)
				sb_puts(b, named);
			else {
				snprintf(e, sizeof e, "\\u%04x", c);
				sb_puts(b, e);
			}
			i++;
		} else {
			size_t l = utf8_len(u + i, n - i);
			if (l == 0) {
				sb_puts(b, "\\ufffd");
				i++;
			} else {
				sb_add(b, s + i, l);
				i += l;
			}
		}
	}
	sb_add(b, "\"", 1);
}
