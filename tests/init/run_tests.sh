#!/bin/sh
# Tests for demesne-init (core/init). Builds nothing.
#
#   tests/init/run_tests.sh path/to/demesne-init
#
# Runs on the host as root (no container needed). Prints TAP-style lines and a final
# "N passed, N failed"; exits non-zero when a test failed. When podman (or docker) and a
# local image are available, a last section repeats the key cases inside real containers:
# DEMESNE_INIT_TEST_IMAGE picks the image (default: the first local demesne base image:
# demesne-base, demesne/base, debian-rootfs or demesne-default); DEMESNE_INIT_TEST_ENGINE=none
# skips that section, DEMESNE_INIT_TEST_ENGINE=docker picks docker over podman.
set -u

BIN=${1:?usage: $0 path/to/demesne-init}
case $BIN in /*) ;; *) BIN=$(pwd)/$BIN ;; esac
[ -x "$BIN" ] || { echo "not executable: $BIN" >&2; exit 2; }

T=$(mktemp -d /tmp/demesne-init-test.XXXXXX)
PASS=0 FAIL=0 N=0
STRAYS=""   # pids to kill on exit, whatever happens

cleanup() {
	for p in $STRAYS; do kill -9 "$p" 2>/dev/null; done
	rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ok() { N=$((N + 1)); PASS=$((PASS + 1)); echo "ok $N - $1"; }
not_ok() { N=$((N + 1)); FAIL=$((FAIL + 1)); echo "not ok $N - $1"; shift; for l in "$@"; do echo "#   $l"; done; }
skip() { N=$((N + 1)); echo "ok $N - $1 # SKIP $2"; }
check() { # check NAME COMMAND...: passes when COMMAND succeeds
	name=$1; shift
	if "$@"; then ok "$name"; else not_ok "$name" "failed: $*"; fi
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
alive() { kill -0 "$1" 2>/dev/null; }
# Value of a status.json field, as JSON text (null, true, 3, "x").
field() { python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$1" "$2"; }
valid_json() { python3 -m json.tool "$1" >/dev/null 2>&1; }
eq() { [ "$1" = "$2" ] || { echo "#   expected '$2', got '$1'"; return 1; }; }
between() { [ "$1" -ge "$2" ] && [ "$1" -le "$3" ] || { echo "#   $1 not in [$2, $3]"; return 1; }; }
wait_file() { # wait_file PATH SECONDS
	i=0; while [ ! -s "$1" ] && [ $i -lt $(($2 * 50)) ]; do sleep 0.02; i=$((i + 1)); done; [ -s "$1" ]
}
# Every status.json must be valid JSON with the documented fields.
status_ok() {
	valid_json "$1/status.json" && python3 - "$1/status.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
keys = {"id", "exit_code", "signal", "timed_out", "cancelled", "started_at", "finished_at", "duration_ms"}
assert keys <= set(s) <= keys | {"error", "oom_kills"}, sorted(s)
assert "oom_kills" not in s or (isinstance(s["oom_kills"], int) and s["oom_kills"] >= 0), s
assert isinstance(s["exit_code"], int) and (s["signal"] is None or isinstance(s["signal"], int))
assert isinstance(s["timed_out"], bool) and isinstance(s["cancelled"], bool)
assert s["started_at"] > 1.6e12 and s["finished_at"] >= s["started_at"] and s["duration_ms"] >= 0
EOF
}

echo "# demesne-init tests: $BIN (work dir $T)"

# --- CLI -------------------------------------------------------------------------------
check "--version prints the version" sh -c '"$1" --version | grep -q "^demesne-init [0-9]"' _ "$BIN"
check "--help exits 0" sh -c '"$1" --help | grep -q "demesne-init run"' _ "$BIN"
"$BIN" >/dev/null 2>&1; check "no arguments: exit 2" eq $? 2
"$BIN" run --dir "$T/u" -- true 2>/dev/null; check "run without --id: exit 2" eq $? 2
"$BIN" run --id u --dir "$T/u" 2>/dev/null; check "run without a command: exit 2" eq $? 2
"$BIN" run --id u --dir "$T/u" --timeout abc -- true 2>/dev/null; check "run with a bad --timeout: exit 2" eq $? 2
"$BIN" kill 2>/dev/null; check "kill without --dir: exit 2" eq $? 2
"$BIN" kill --dir "$T/u" --signal BOGUS 2>/dev/null; check "kill with an unknown signal: exit 2" eq $? 2

# --- exit codes and status.json ---------------------------------------------------------
D=$T/exit3
"$BIN" run --id exit3 --dir "$D" -- sh -c 'echo out; echo err >&2; exit 3'
check "exit code 3 propagates" eq $? 3
check "status.json is valid JSON with the documented fields" status_ok "$D"
check "status.exit_code is 3" eq "$(field "$D/status.json" exit_code)" 3
check "status.signal is null" eq "$(field "$D/status.json" signal)" null
check "status.timed_out and cancelled are false" eq "$(field "$D/status.json" timed_out)$(field "$D/status.json" cancelled)" falsefalse
check "status.id is the id" eq "$(field "$D/status.json" id)" '"exit3"'
check "stdout.log holds stdout" eq "$(cat "$D/stdout.log")" out
check "stderr.log holds stderr" eq "$(cat "$D/stderr.log")" err
check "pid file holds a pid" grep -qx '[0-9][0-9]*' "$D/pid"
check "no temporary files are left" eq "$(ls -A "$D" | tr '\n' ' ')" "pid status.json stderr.log stdout.log "

D=$T/json
"$BIN" run --id "$(printf 'a"b\\c\n\001d\351')" --dir "$D" -- true
check "an id with quotes, control and invalid bytes still gives valid JSON" status_ok "$D"
check "that id is escaped faithfully" eq "$(field "$D/status.json" id)" '"a\"b\\c\n\u0001d\ufffd"'

D=$T/sig
"$BIN" run --id sig --dir "$D" -- sh -c 'kill -9 $$'
check "killed by SIGKILL: exit 137" eq $? 137
check "status.signal is 9, exit_code 137" eq "$(field "$D/status.json" signal)/$(field "$D/status.json" exit_code)" 9/137

# --- output files ----------------------------------------------------------------------
head -c 1048576 /dev/urandom >"$T/blob1"
head -c 1048576 /dev/urandom >"$T/blob2"
D=$T/bytes
"$BIN" run --id bytes --dir "$D" -- sh -c 'cat "$1"; cat "$2" >&2' _ "$T/blob1" "$T/blob2"
check "1 MiB of binary stdout is byte-exact" cmp -s "$T/blob1" "$D/stdout.log"
check "1 MiB of binary stderr is byte-exact" cmp -s "$T/blob2" "$D/stderr.log"
"$BIN" run --id bytes --dir "$D" -- printf short
check "a rerun truncates stdout.log" eq "$(cat "$D/stdout.log")" short
D=$T/stdin
"$BIN" run --id stdin --dir "$D" --stdin "$T/blob1" -- cat
check "--stdin FILE feeds the command byte-exact" cmp -s "$T/blob1" "$D/stdout.log"
"$BIN" run --id stdin2 --dir "$T/stdin2" -- sh -c 'wc -c'
check "stdin defaults to /dev/null" eq "$(cat "$T/stdin2/stdout.log")" 0
"$BIN" run --id cwd --dir "$T/cwd" --cwd / -- pwd
check "--cwd sets the working directory" eq "$(cat "$T/cwd/stdout.log")" /
exec 7>"$T/fd7"
"$BIN" run --id fds --dir "$T/fds" -- sh -c 'ls /proc/self/fd' 7>&7
exec 7>&-
check "only fds 0, 1, 2 reach the command" eq "$(grep -vx '[012]' "$T/fds/stdout.log" | wc -l)" 1 # ls's own dir fd

# --- setup failures --------------------------------------------------------------------
D=$T/enoent
"$BIN" run --id enoent --dir "$D" -- /nonexistent/cmd
check "command not found: exit 127" eq $? 127
check "stderr.log says why" grep -q "cannot execute '/nonexistent/cmd': No such file" "$D/stderr.log"
check "status.json has exit_code 127 and an error" eq "$(field "$D/status.json" exit_code)$(field "$D/status.json" error | cut -c1-15)" '127"cannot execute'
check "exec-failure status.json is valid" status_ok "$D"
printf 'echo hi\n' >"$T/noexec"; chmod 0644 "$T/noexec"
"$BIN" run --id eacces --dir "$T/eacces" -- "$T/noexec"
check "command not executable: exit 126" eq $? 126
"$BIN" run --id path --dir "$T/path" -- no-such-command-demesne
check "command not on PATH: exit 127" eq $? 127
"$BIN" run --id badcwd --dir "$T/badcwd" --cwd /nonexistent -- true
check "bad --cwd: exit 125" eq $? 125
check "bad --cwd: status error names the directory" grep -q "cannot change directory to '/nonexistent'" "$T/badcwd/status.json"
"$BIN" run --id badin --dir "$T/badin" --stdin /nonexistent -- true
check "bad --stdin: exit 125" eq $? 125
mkdir -p "$T/ro"; : >"$T/ro/file"
"$BIN" run --id baddir --dir "$T/ro/file/x" -- true 2>/dev/null
check "DIR cannot be created: exit 125" eq $? 125

# --- C01: timeout kills the whole process group ----------------------------------------
D=$T/c01
t0=$(now_ms)
"$BIN" run --id c01 --dir "$D" --timeout 1 -- sh -c "sleep 300 & echo \$! > $T/c01.bgpid; wait"
rc=$?; el=$(($(now_ms) - t0))
check "C01 timeout returns in 1-3 s (${el} ms)" between "$el" 900 3000
check "C01 exit code is 128+SIGTERM" eq "$rc" 143
check "C01 status.timed_out is true" eq "$(field "$D/status.json" timed_out)" true
check "C01 status is valid" status_ok "$D"
BG=$(cat "$T/c01.bgpid"); STRAYS="$STRAYS $BG"
check "C01 the background sleep no longer exists" sh -c '! kill -0 "$1" 2>/dev/null' _ "$BG"

D=$T/c01k
t0=$(now_ms)
"$BIN" run --id c01k --dir "$D" --timeout 0.5 -- sh -c "trap '' TERM; sleep 300 & echo \$! > $T/c01k.bgpid; wait"
rc=$?; el=$(($(now_ms) - t0))
BG=$(cat "$T/c01k.bgpid"); STRAYS="$STRAYS $BG"
check "timeout with SIGTERM ignored: SIGKILL after the 2 s grace (${el} ms)" between "$el" 2300 4000
check "  exit 137, signal 9, timed_out" eq "$rc/$(field "$D/status.json" signal)/$(field "$D/status.json" timed_out)" 137/9/true
check "  the background sleep no longer exists" sh -c '! kill -0 "$1" 2>/dev/null' _ "$BG"

# --- C02: a grandchild holding stdout open does not delay completion --------------------
D=$T/c02
t0=$(now_ms)
out=$(timeout 20 "$BIN" run --id c02 --dir "$D" -- sh -c "(sleep 600 & echo \$! > $T/c02.gpid); echo started")
rc=$?; el=$(($(now_ms) - t0))
GP=$(cat "$T/c02.gpid"); STRAYS="$STRAYS $GP"
check "C02 returns at once (${el} ms), even under \$(...)" between "$el" 0 1000
check "C02 exit 0" eq "$rc" 0
check "C02 stdout.log is 'started'" eq "$(cat "$D/stdout.log")" started
check "C02 demesne-init itself prints nothing" eq "$out" ""
check "C02 without --kill-group-on-exit the grandchild is left alone" alive "$GP"
kill -9 "$GP" 2>/dev/null
D=$T/c02k
t0=$(now_ms)
"$BIN" run --id c02k --dir "$D" --kill-group-on-exit -- sh -c "(sleep 600 & echo \$! > $T/c02k.gpid); echo started"
rc=$?; el=$(($(now_ms) - t0))
GP=$(cat "$T/c02k.gpid"); STRAYS="$STRAYS $GP"
check "C02 --kill-group-on-exit returns at once (${el} ms) with exit 0" eq "$rc/$((el < 1500))" 0/1
check "C02 --kill-group-on-exit: the grandchild is gone" sh -c '! kill -0 "$1" 2>/dev/null' _ "$GP"

D=$T/c03
t0=$(now_ms)
if command -v bash >/dev/null; then
	"$BIN" run --id c03 --dir "$D" -- bash -c "exec > >(tee -a $T/c03.log) 2>&1; echo done"
	rc=$?; el=$(($(now_ms) - t0))
	check "C03 process substitution: exit 0 in well under 2 s (${el} ms)" eq "$rc/$((el < 2000))" 0/1
else
	skip "C03 process substitution" "no bash"
fi

# --- C04: cancel from another process --------------------------------------------------
D=$T/c04
"$BIN" run --id c04 --dir "$D" -- sleep 600 &
RUN=$!; STRAYS="$STRAYS $RUN"
wait_file "$D/pid" 5
PG=$(cat "$D/pid")
check "C04 pid file is the command's process group" eq "$(ps -o pgid= -p "$PG" | tr -d ' ')" "$PG"
t0=$(now_ms)
"$BIN" kill --dir "$D" --grace 2
rc=$?; el=$(($(now_ms) - t0))
check "C04 kill --dir exits 0 (${el} ms)" eq "$rc/$((el < 2000))" 0/1
wait "$RUN"; rc=$?
check "C04 run exits 143 after the cancel" eq "$rc" 143
check "C04 status: cancelled, signal 15" eq "$(field "$D/status.json" cancelled)/$(field "$D/status.json" signal)" true/15
check "C04 no process of the group remains" sh -c '! kill -0 -"$1" 2>/dev/null' _ "$PG"
check "C04 status is valid" status_ok "$D"

D=$T/c04k
"$BIN" run --id c04k --dir "$D" -- sh -c "trap '' TERM; sleep 600" &
RUN=$!; STRAYS="$STRAYS $RUN"
wait_file "$D/pid" 5; PG=$(cat "$D/pid")
t0=$(now_ms)
"$BIN" kill --dir "$D" --grace 1
rc=$?; el=$(($(now_ms) - t0))
check "C04 SIGTERM ignored: kill escalates to SIGKILL after --grace 1 (${el} ms)" eq "$rc/$((el >= 900 && el < 2500))" 0/1
wait "$RUN"; rc=$?
check "  run exits 137, status cancelled" eq "$rc/$(field "$D/status.json" cancelled)" 137/true

D=$T/c04n
"$BIN" run --id c04n --dir "$D" -- sh -c "trap '' TERM; sleep 600" &
RUN=$!; STRAYS="$STRAYS $RUN"
wait_file "$D/pid" 5; PG=$(cat "$D/pid")
"$BIN" kill --dir "$D" 2>/dev/null
check "kill without --grace on a group ignoring SIGTERM: exit 1" eq $? 1
"$BIN" kill --dir "$D" --signal KILL
check "kill --signal KILL: exit 0" eq $? 0
wait "$RUN"

"$BIN" kill --dir "$T/exit3"
check "kill on a finished run: exit 0" eq $? 0

D=$T/early
t0=$(now_ms)
"$BIN" kill --dir "$D"
rc=$?; el=$(($(now_ms) - t0))
check "kill before the run started: exit 0 (${el} ms)" eq "$rc/$((el < 1500))" 0/1
t0=$(now_ms)
"$BIN" run --id early --dir "$D" -- sleep 600
rc=$?; el=$(($(now_ms) - t0))
check "  a run started after that is cancelled at once (${el} ms)" eq "$rc/$((el < 1000))/$(field "$D/status.json" cancelled)" 143/1/true

# --- signals to demesne-init run itself --------------------------------------------------
for s in TERM INT; do
	D=$T/sig$s
	"$BIN" run --id "sig$s" --dir "$D" -- sh -c "sleep 600 & echo \$! > $T/sig$s.bg; wait" &
	RUN=$!; STRAYS="$STRAYS $RUN"
	wait_file "$T/sig$s.bg" 5; BG=$(cat "$T/sig$s.bg"); STRAYS="$STRAYS $BG"
	t0=$(now_ms)
	kill -s "$s" "$RUN"
	wait "$RUN"; rc=$?; el=$(($(now_ms) - t0))
	check "SIG$s to run: SIGTERM to the group, exits promptly (${el} ms)" eq "$((el < 1500))/$rc" 1/143
	check "  status cancelled, group gone" eq "$(field "$D/status.json" cancelled)/$(alive "$BG" && echo alive || echo gone)" true/gone
done

# --- serve (not PID 1 here: it signals only its own descendants) ------------------------
"$BIN" serve &
SV=$!; STRAYS="$STRAYS $SV"
sleep 0.2
t0=$(now_ms)
kill -TERM "$SV"; wait "$SV"; rc=$?; el=$(($(now_ms) - t0))
check "serve exits 0 on SIGTERM (${el} ms)" eq "$rc/$((el < 1000))" 0/1

# A shell that execs serve leaves serve with children: a grandchild must get SIGTERM too.
sh -c 'sh -c "sleep 600 & echo \$! > $1/svdesc.pid; wait" & exec "$2" serve' _ "$T" "$BIN" &
SV=$!; STRAYS="$STRAYS $SV"
wait_file "$T/svdesc.pid" 5; GC=$(cat "$T/svdesc.pid"); STRAYS="$STRAYS $GC"
t0=$(now_ms)
kill -TERM "$SV"; wait "$SV"; rc=$?; el=$(($(now_ms) - t0))
check "serve (not PID 1) signals its descendants and exits 0 promptly (${el} ms)" eq "$rc/$((el < 1000))" 0/1
check "  the grandchild is gone" sh -c '! kill -0 "$1" 2>/dev/null' _ "$GC"

if unshare --pid --fork --mount-proc true 2>/dev/null && command -v nsenter >/dev/null; then
	unshare --pid --fork --mount-proc "$BIN" serve &
	US=$!; STRAYS="$STRAYS $US"
	i=0; SV=""
	while [ -z "$SV" ] && [ $i -lt 100 ]; do SV=$(cat /proc/$US/task/$US/children 2>/dev/null | tr -d ' '); sleep 0.02; i=$((i + 1)); done
	STRAYS="$STRAYS $SV"
	# An orphan that exits must be reaped by serve (PID 1 of that namespace).
	nsenter -t "$SV" -p -m sh -c '(sleep 0.2 &); (sleep 600 &); (sh -c "trap \"\" TERM; sleep 600" &)'
	sleep 0.6
	kids=$(cat /proc/$SV/task/$SV/children)
	zombies=0
	for k in $kids; do grep -q '^State:.*Z' /proc/$k/status 2>/dev/null && zombies=$((zombies + 1)); done
	check "serve as PID 1 adopts orphans (2 running) and reaps zombies (0)" eq "$(echo $kids | wc -w)/$zombies" 2/0
	t0=$(now_ms)
	kill -TERM "$SV"; wait "$US"; el=$(($(now_ms) - t0))
	check "serve as PID 1: SIGTERM to all, SIGKILL after 5 s, exit 0 (${el} ms)" eq "$((el >= 4800 && el < 7000))" 1
	for k in $kids; do STRAYS="$STRAYS $k"; done
	check "  no adopted process survives" sh -c 'for k; do kill -0 "$k" 2>/dev/null && exit 1; done; exit 0' _ $kids
else
	skip "serve as PID 1 of a PID namespace" "unshare --pid not available"
fi

# --- the control socket -------------------------------------------------------------------
# ctl SOCKET OP ARGS... [--env=K=V]...: sends one request, prints every reply line (and
# "refused" when the connection is closed without one). `ctl SOCKET raw HEX` sends bytes.
cat >"$T/ctl.py" <<'PY'
import os, socket, struct, sys, time
path, op, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
env = [a[6:] for a in rest if a.startswith("--env=")]
args = [a for a in rest if not a.startswith("--env=")]
if op == "raw":
    frame = bytes.fromhex(args[0])
else:
    parts = [op, str(len(args))] + args + [str(len(env))] + env
    payload = b"".join(p.encode() + b"\0" for p in parts)
    frame = b"DMI1" + struct.pack(">I", len(payload)) + payload
s = socket.socket(socket.AF_UNIX)
s.connect(path)
try:
    s.sendall(frame)
except OSError:
    pass
data = b""
# CTL_THEN: bytes sent once "started" arrives, each "|" a pause between two sends
then = os.environ.get("CTL_THEN", "").encode().decode("unicode_escape").encode()
while True:
    if then and b"started" in data:
        for i, part in enumerate(then.split(b"|")):
            if i: time.sleep(0.2)
            s.sendall(part)
        then = b""
    try:
        d = s.recv(4096)
    except OSError:
        break
    if not d:
        break
    data += d
sys.stdout.write(data.decode() if data else "refused\n")
PY
ctl() { python3 "$T/ctl.py" "$@"; }
wait_sock() { i=0; while [ ! -S "$1" ] && [ $i -lt 250 ]; do sleep 0.02; i=$((i + 1)); done; [ -S "$1" ]; }

C=$T/control; mkdir -p "$C"
"$BIN" serve --control "$C/init.sock" 2>"$C/serve.err" &
SP=$!; STRAYS="$STRAYS $SP"
wait_sock "$C/init.sock"
check "serve --control: the socket is there, mode 600" eq "$(stat -c %a "$C/init.sock")" 600
out=$(ctl "$C/init.sock" run --id r1 --dir "$C/r1" --env=FOO=bar -- sh -c 'echo "$FOO"; exit 3')
check "control run: ok, started PID, exit 3" sh -c 'printf "%s\n" "$1" | tr "\n" " " | grep -Eq "^ok started [0-9]+ exit 3 $"' _ "$out"
check "  the request's environment reaches the command, status.json written" eq "$(cat "$C/r1/stdout.log")/$(field "$C/r1/status.json" exit_code)" bar/3
ctl "$C/init.sock" run --id r2 --dir "$C/r2" -- sh -c 'sleep 600 & wait' >"$C/r2.out" &
CP=$!
wait_file "$C/r2/pid" 10
G=$(cat "$C/r2/pid")
out=$(ctl "$C/init.sock" kill --dir "$C/r2" --grace 1)
wait "$CP"
check "control kill: ok, exit 0; the run answers exit 143" eq "$(echo $out)/$(tail -n 1 "$C/r2.out")" "ok exit 0/exit 143"
check "  cancelled, and its group is gone" sh -c '[ "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[\"cancelled\"])" "$1/r2/status.json")" = True ] && ! kill -0 -"$2" 2>/dev/null' _ "$C" "$G"
check "a malformed request is refused" eq "$(ctl "$C/init.sock" raw 444d4931000000027800)" "error malformed request"
check "an unknown op is refused" eq "$(ctl "$C/init.sock" raw 444d4931000000086578656300300030 | cut -c1-5)" "error"
kill -TERM "$SP"; wait "$SP"
check "serve removes the socket when it stops" sh -c '[ ! -e "$1" ]' _ "$C/init.sock"
if id nobody >/dev/null 2>&1; then
	mkdir -p "$C/owned"; chown nobody "$C/owned"
	"$BIN" serve --control "$C/owned/init.sock" 2>/dev/null &
	SP=$!; STRAYS="$STRAYS $SP"
	wait_sock "$C/owned/init.sock"
	check "the socket belongs to the owner of its folder (the host's user), mode 600" eq "$(stat -c %U/%a "$C/owned/init.sock")" nobody/600
	kill -TERM "$SP"; wait "$SP"
fi

"$BIN" wait --control "$C/w.sock" 2>"$C/wait.err" &
WP=$!; STRAYS="$STRAYS $WP"
wait_sock "$C/w.sock"
out=$(ctl "$C/w.sock" run --id main --dir "$C/w" --stdout "$C/w.out" --env=X=1 -- sh -c 'echo "x=$X"; exit 5')
wait "$WP"; rc=$?
check "wait: runs the one command it is sent, exits with its code" eq "$(echo $out | sed 's/started [0-9]*/started/')/$rc/$(cat "$C/w.out")" "ok started exit 5/5/x=1"
check "  and its socket is gone: nobody can send a second one" sh -c '[ ! -e "$1" ]' _ "$C/w.sock"
"$BIN" wait --control "$C/wk.sock" 2>"$C/wk.err" &
WP=$!; STRAYS="$STRAYS $WP"
wait_sock "$C/wk.sock"
out=$(CTL_THEN='xkill\nkil|l\n' timeout 30 python3 "$T/ctl.py" "$C/wk.sock" run --id wk --dir "$C/wk" -- sh -c 'sleep 600 & wait')
wait "$WP"; rc=$?
check "wait: the host's \"kill\" line (after another line, split over two writes) SIGKILLs the command" \
	eq "$(echo $out | sed 's/started [0-9]*/started/')/$rc/$(field "$C/wk/status.json" signal)" "ok started exit 137/137/9"
"$BIN" wait --control "$C/w2.sock" 2>/dev/null &
WP=$!; STRAYS="$STRAYS $WP"
wait_sock "$C/w2.sock"
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.close()' "$C/w2.sock"
wait "$WP"; rc=$?
check "wait: the host hanging up before a command ends it, exit 0, nothing ran" eq "$rc/$(ls "$C" | grep -c '^w2$')" 0/0
"$BIN" wait 2>/dev/null; check "wait without --control: exit 2" eq $? 2

if unshare --pid --fork --mount-proc true 2>/dev/null && command -v nsenter >/dev/null; then
	unshare --pid --fork --mount-proc "$BIN" serve --control "$C/ns.sock" 2>"$C/ns.err" &
	US=$!; STRAYS="$STRAYS $US"
	wait_sock "$C/ns.sock"
	SV=$(cat /proc/$US/task/$US/children 2>/dev/null | tr -d ' ')
	STRAYS="$STRAYS $SV"
	inside=$(nsenter -t "$SV" -p -m python3 "$T/ctl.py" "$C/ns.sock" run --id in --dir "$C/in" -- true)
	check "as PID 1, a client inside the PID namespace is refused, nothing runs" eq "$inside/$(ls "$C" | grep -c '^in$')" refused/0
	outside=$(ctl "$C/ns.sock" run --id out --dir "$C/nsout" -- true | tail -n 1)
	check "  and the host (outside it) is served" eq "$outside" "exit 0"
	kill -TERM "$SV"; wait "$US"
else
	skip "control socket peers inside a PID namespace" "unshare --pid not available"
fi
# --- the relay: --relay PORT=PATH ---------------------------------------------------------
# A host end that records how each connection arrived: "handover" (the byte 'F' with the
# accepted socket) or "copy" (the byte '\0', then the client's bytes on the unix connection),
# answers "pong" to "ping" and hangs up.
relay_host() { # relay_host SOCKET LOG CONNECTIONS
	python3 - "$@" <<'EOF'
import array, os, socket, sys
path, log, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path + ".new")  # listening before the name appears: the caller waits for the name
os.chmod(path + ".new", 0o666)
s.listen(8)
os.rename(path + ".new", path)
s.settimeout(20)
out = open(log, "w")
for _ in range(count):
    c, _ = s.accept()
    byte, anc, _, _ = c.recvmsg(1, socket.CMSG_LEN(4))
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:4])
    if byte == b"F" and len(fds) == 1:
        c.close()
        c, mode = socket.socket(fileno=fds[0]), "handover"
    elif byte == b"\0" and len(fds) == 0:
        mode = "copy"
    else:
        mode = "bad %r %d" % (byte, len(fds))
    c.settimeout(20)  # the relay's socket arrives non-blocking
    got = b""
    while not got.endswith(b"ping"):
        d = c.recv(100)
        if not d:
            break
        got += d
    c.sendall(b"pong")
    c.shutdown(socket.SHUT_WR)
    rest = c.recv(100)  # the client's end of the stream, after its half-close
    c.close()
    out.write("%s %r %r\n" % (mode, got, rest))
    out.flush()
EOF
}
RPORT=$((20000 + $$ % 40000))
CLIENT='import socket,sys; c=socket.create_connection(("127.0.0.1",int(sys.argv[1]))); c.sendall(b"ping"); c.shutdown(socket.SHUT_WR); d=b""
while True:
    x=c.recv(100)
    if not x: break
    d+=x
print(d.decode())'
for mode in handover copy; do
	rm -f "$T/relay.sock"
	relay_host "$T/relay.sock" "$T/relay-$mode.log" 2 &
	HOSTP=$!; STRAYS="$STRAYS $HOSTP"
	i=0; while [ ! -S "$T/relay.sock" ] && [ $i -lt 250 ]; do sleep 0.02; i=$((i + 1)); done
	extra=""; [ $mode = copy ] && extra=--relay-copy
	"$BIN" run --id relay-$mode --dir "$T/relay-$mode" --relay "$RPORT=$T/relay.sock" $extra -- \
		sh -c 'python3 -c "$1" "$2" && python3 -c "$1" "$2"' _ "$CLIENT" "$RPORT"
	rc=$?
	wait "$HOSTP"
	check "relay ($mode): two connections, the client reads pong, exit 0" \
		eq "$rc/$(tr '\n' ' ' < "$T/relay-$mode/stdout.log")" "0/pong pong "
	check "  the host saw $mode, ping and the client's half-close, twice" \
		eq "$(cat "$T/relay-$mode.log")" "$(printf "%s b'ping' b''\n%s b'ping' b''" $mode $mode)"
done

# --- connect 127.0.0.1:PORT (port previews) -----------------------------------------------
for bad in "10.0.0.1:80" "127.0.0.1:0" "127.0.0.1:65536" "127.0.0.1:x" "127.0.0.1" ""; do
	"$BIN" connect "$bad" </dev/null >/dev/null 2>"$T/connect.err"
	check "connect '$bad': usage error 2" eq "$?" 2
done
CPORT=$((20000 + ($$ + 7) % 40000))
"$BIN" connect "127.0.0.1:$CPORT" </dev/null >/dev/null 2>"$T/connect.err"
rc=$?
check "connect to a port nobody listens on: 125, and stderr says so" \
	eq "$rc/$(cat "$T/connect.err")" "125/demesne-init: connect: nothing accepts connections on 127.0.0.1:$CPORT (Connection refused)"
# a service that reads to the end of its input, then answers with what it got: the half-close
# of stdin reaches it, and its answer comes back after it
python3 -c 'import socket,sys
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); s.bind(("127.0.0.1",int(sys.argv[1]))); s.listen(1)
open(sys.argv[2],"w").close()
c,_=s.accept(); d=b""
while True:
    x=c.recv(100)
    if not x: break
    d+=x
c.sendall(b"got "+d); c.close()' "$CPORT" "$T/connect.ready" &
SRVP=$!; STRAYS="$STRAYS $SRVP"
i=0; while [ ! -e "$T/connect.ready" ] && [ $i -lt 250 ]; do sleep 0.02; i=$((i + 1)); done
out=$(printf 'hello' | "$BIN" connect "127.0.0.1:$CPORT")
rc=$?
wait "$SRVP"
check "connect: stdin to the port, its end as a half-close, the answer to stdout, exit 0" eq "$rc/$out" "0/got hello"
# --- hold GATE / release GATE (the Kubernetes adapter's create-before-start gate) -----------
H=$T/hold
mkdir -p "$H"
"$BIN" hold --env X=5 --env Y=a=b --workdir /tmp "$H/gate" -- sh -c 'echo "$X $Y $(pwd)" >"$1"; exit 7' sh "$H/out" &
HP=$!
STRAYS="$STRAYS $HP"
sleep 0.3
check "hold: the program waits while the gate is shut" eq "$(alive "$HP" && echo holding)/$(cat "$H/out" 2>/dev/null)" "holding/"
"$BIN" release "$H/gate"
check "release: exit 0" eq "$?" 0
wait "$HP"
check "hold: once released, the program runs with --env, --workdir and its exit code" eq "$?/$(cat "$H/out")" "7/5 a=b /tmp"
"$BIN" release "$H/gate"
check "release of an open gate: exit 0" eq "$?" 0
out=$("$BIN" hold --user 1000:1001 "$H/gate" -- sh -c 'echo "$(id -u):$(id -g):$(id -G)"')
check "hold --user UID:GID: the program's uid, gid and no other group" eq "$out" "1000:1001:1001"
st=$("$BIN" hold "$H/gate" -- cat /proc/self/status)
out="$(echo "$st" | awk '/^SigBlk:/ { print $2 }')/$(( 0x$(echo "$st" | awk '/^SigCgt:/ { print $2 }') & 0x4002 ))"
check "hold: the program starts with no signal blocked and no SIGTERM or SIGINT handler" eq "$out" "0000000000000000/0"
"$BIN" hold "$H/gate" -- demesne-init-no-such-program 2>"$H/err"
check "hold of a program not found: 127, named" eq "$?/$(grep -c 'demesne-init-no-such-program' "$H/err")" "127/1"
for bad in "" "$H/gate" "--env NOEQ $H/gate -- true" "--user root $H/gate -- true" "$H/gate extra -- true" "--workdir"; do
	# shellcheck disable=SC2086  # the words of each case
	"$BIN" hold $bad 2>/dev/null
	check "hold '$bad': usage error 2" eq "$?" 2
done
"$BIN" hold --workdir /no/such/dir "$H/gate" -- true 2>"$H/err"
check "hold --workdir of a missing folder: 125, named" eq "$?/$(grep -c '/no/such/dir' "$H/err")" "125/1"
ln -s /no/such/target "$H/link"
"$BIN" hold "$H/link" -- true
check "hold: a dangling symlink at the gate counts as present (lstat, never followed)" eq "$?" 0
"$BIN" hold "$H/shut" -- true &
HP=$!
STRAYS="$STRAYS $HP"
sleep 0.3
t0=$(now_ms)
kill -TERM "$HP"
wait "$HP"
rc=$?
check "hold: SIGTERM while the gate is shut exits 143 at once" eq "$rc/$(($(now_ms) - t0 < 2000))" "143/1"
"$BIN" release /no/such/dir/gate 2>"$H/err"
check "release into a missing folder: 125, the path named" eq "$?/$(grep -c '/no/such/dir/gate' "$H/err")" "125/1"
ln -s "$H/elsewhere" "$H/trap"
"$BIN" release "$H/trap"
check "release never writes through a symlink" eq "$?/$([ -e "$H/elsewhere" ] && echo made)" "0/"
# --- probe ADDR:PORT... (is the container's network closed?) -----------------------------
PPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -c 'import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); s.bind(("127.0.0.1",int(sys.argv[1]))); s.listen(4); open(sys.argv[2],"w").close(); time.sleep(10)' "$PPORT" "$T/probe.ready" &
STRAYS="$STRAYS $!"
i=0; while [ ! -e "$T/probe.ready" ] && [ $i -lt 250 ]; do sleep 0.02; i=$((i + 1)); done
out=$("$BIN" probe --timeout-ms 1000 "127.0.0.1:$PPORT")
check "probe: a listener is reached (exit 1)" eq "$?/$(echo "$out" | head -1)" "1/reached 127.0.0.1:$PPORT"
out=$("$BIN" probe --timeout-ms 1000 127.0.0.1:1)
check "probe: a refusal is an answer, so reached (exit 1)" eq "$?/$(echo "$out" | head -1)" \
	"1/reached 127.0.0.1:1 (refused: its host answered)"
# a network namespace of its own, with its loopback down: nothing answers
out=$(unshare -n "$BIN" probe --timeout-ms 1000 127.0.0.1:1)
check "probe in a closed network: nothing reached (exit 0), the reason, no default route" \
	eq "$?/$(echo "$out" | head -1)/$(echo "$out" | tail -1)" "0/blocked 127.0.0.1:1: Network is unreachable/default-route no"
for bad in "" "x" "127.0.0.1" "127.0.0.1:0" "::1:80" "--timeout-ms 0 127.0.0.1:1"; do
	# shellcheck disable=SC2086  # the words of each case
	"$BIN" probe $bad >/dev/null 2>&1
	check "probe '$bad': usage error 2" eq "$?" 2
done
# --- pty: the shell of demesne attach ------------------------------------------------------
PTYHOST="$(dirname "$0")/pty-host.py"
r=$(python3 "$PTYHOST" "$BIN" "$T/pty.sock" session 2>&1)
check "pty: the window size frame reaches the PTY (stty size)" sh -c 'echo "$1" | grep -q "33 101"' _ "$r"
check "pty: typed data reaches the shell, its output comes back" sh -c 'echo "$1" | grep -q "got-x42"' _ "$r"
check "pty: the shell's exit code is the exit frame and demesne-init's" sh -c 'echo "$1" | grep -q "^rc=3 status=3 "' _ "$r"
rm -f "$T/pty.sock"
r=$(python3 "$PTYHOST" "$BIN" "$T/pty.sock" malformed 2>&1)
check "pty: a malformed frame hangs the shell up (SIGHUP: 129), no exit frame" sh -c 'echo "$1" | grep -q "^rc=129 status=None "' _ "$r"
rm -f "$T/pty.sock"
r=$(python3 "$PTYHOST" "$BIN" "$T/pty.sock" hangup 2>&1)
check "pty: the host hanging up ends the shell (SIGHUP: 129)" sh -c 'echo "$1" | grep -q "^rc=129 "' _ "$r"
rm -f "$T/pty.sock"
"$BIN" pty -- sh >/dev/null 2>&1
check "pty: no --connect is a usage error (2)" eq $? 2

# --- inside a real container -------------------------------------------------------------
ENGINE=${DEMESNE_INIT_TEST_ENGINE:-}
if [ -z "$ENGINE" ]; then
	for e in podman docker; do command -v $e >/dev/null && { ENGINE=$e; break; }; done
fi
IMAGE=${DEMESNE_INIT_TEST_IMAGE:-}
if [ -n "$ENGINE" ] && [ "$ENGINE" != none ] && [ -z "$IMAGE" ]; then
	IMAGE=$($ENGINE images --format '{{.Repository}}:{{.Tag}}' 2>/dev/null |
		grep -E '(demesne-base|demesne/base|debian-rootfs|demesne-default):' | grep -v '<none>' | head -n 1)
fi
if [ -z "$ENGINE" ] || [ "$ENGINE" = none ] || [ -z "$IMAGE" ]; then
	skip "container tests" "no engine or no local image (set DEMESNE_INIT_TEST_IMAGE)"
else
	echo "# container tests: $ENGINE, $IMAGE"
	O=$T/ctr; mkdir -p "$O"
	R="$ENGINE run --rm --network none -v $BIN:/.demesne/init:ro -v $O:/out"
	$R "$IMAGE" /.demesne/init run --id t --dir /out/t -- sh -c 'echo hi; exit 4'
	check "container: one-shot run as PID 1, exit code 4" eq $? 4
	check "  stdout.log and status.json on the host" eq "$(cat "$O/t/stdout.log")/$(field "$O/t/status.json" exit_code)" hi/4
	t0=$(now_ms)
	$R "$IMAGE" /.demesne/init run --id c02 --dir /out/c02 -- sh -c '(sleep 600 &) ; echo started'
	rc=$?; el=$(($(now_ms) - t0))
	check "container C02: exit 0, the container stops at once (${el} ms)" eq "$rc/$(cat "$O/c02/stdout.log")" 0/started
	t0=$(now_ms)
	$R "$IMAGE" /.demesne/init run --id c01 --dir /out/c01 --timeout 1 -- sh -c 'sleep 300 & wait'
	rc=$?; el=$(($(now_ms) - t0))
	check "container C01: timeout, exit 143, timed_out" eq "$rc/$(field "$O/c01/status.json" timed_out)" 143/true

	# Under gVisor the relay cannot pass a socket to the host: it must find that out and copy.
	GV=""
	if [ "$ENGINE" = podman ] && [ -x /usr/bin/runsc ]; then
		GV="podman --runtime /usr/bin/runsc --runtime-flag network=none --runtime-flag host-uds=open run --rm --network none"
	elif [ "$ENGINE" = docker ] && docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; then
		GV="docker run --rm --network none --runtime runsc"
	fi
	if [ -z "$GV" ]; then
		skip "container under gVisor: the relay copies" "runsc is not installed for $ENGINE"
	else
		mkdir -p "$O/gv"
		rm -f "$O/gv/relay.sock"
		relay_host "$O/gv/relay.sock" "$T/relay-gv.log" 1 &
		HOSTP=$!; STRAYS="$STRAYS $HOSTP"
		i=0; while [ ! -S "$O/gv/relay.sock" ] && [ $i -lt 250 ]; do sleep 0.02; i=$((i + 1)); done
		$GV -v "$BIN:/.demesne/init:ro" -v "$O:/out" "$IMAGE" /.demesne/init run --id gv --dir /out/gv/run \
			--relay "3128=/out/gv/relay.sock" -- bash -c 'dmesg | head -n 1; exec 3<>/dev/tcp/127.0.0.1/3128; printf ping >&3; cat <&3; echo'
		rc=$?
		wait "$HOSTP"
		check "container under gVisor: the kernel is gVisor's, the client reads pong" \
			eq "$rc/$(tr '\n' ' ' < "$O/gv/run/stdout.log" | sed 's/^\[[ 0-9.]*\] //')" "0/Starting gVisor... pong "
		check "  the relay found it cannot pass sockets and copied" eq "$(cat "$T/relay-gv.log")" "copy b'ping' b''"
	fi

	NAME=demesne-init-stop-$$
	$ENGINE run -d --rm --name "$NAME" --network none -v "$BIN:/.demesne/init:ro" -v "$O:/out" "$IMAGE" \
		/.demesne/init run --id stop --dir /out/stop -- sh -c 'sleep 600 & wait' >/dev/null
	wait_file "$O/stop/pid" 10
	t0=$(now_ms)
	$ENGINE stop -t 10 "$NAME" >/dev/null 2>&1
	el=$(($(now_ms) - t0))
	check "container: stop of a one-shot run is prompt (${el} ms), status cancelled" eq "$((el < 4000))/$(field "$O/stop/status.json" cancelled)" 1/true
	$ENGINE rm -f "$NAME" >/dev/null 2>&1

	NAME=demesne-init-wait-$$
	$ENGINE run -d --rm --name "$NAME" --network none -v "$BIN:/.demesne/init:ro" -v "$O:/out" "$IMAGE" \
		/.demesne/init wait --control /out/w.sock >/dev/null
	wait_sock "$O/w.sock"
	out=$(ctl "$O/w.sock" run --id w --dir /out/w --env=V=sent -- sh -c 'echo "$V"; exit 6' | tail -n 1)
	check "container: wait as PID 1 runs the command the host sends (exit 6, its env)" eq "$out/$(cat "$O/w/stdout.log")" "exit 6/sent"
	$ENGINE rm -f "$NAME" >/dev/null 2>&1

	NAME=demesne-init-test-$$
	$ENGINE run -d --rm --name "$NAME" --network none -v "$BIN:/.demesne/init:ro" -v "$O:/out" "$IMAGE" /.demesne/init serve >/dev/null
	check "container: serve starts" eq $? 0
	$ENGINE exec "$NAME" /.demesne/init run --id bg --dir /out/bg -- sh -c '(sleep 0.1 &); (sleep 600 &); echo started'
	check "container exec: C02 in a persistent sandbox returns 0" eq $? 0
	sleep 0.5
	z=$($ENGINE exec "$NAME" sh -c 'grep -l "^State:.*Z" /proc/[0-9]*/status 2>/dev/null | wc -l')
	check "container: serve reaps orphaned zombies" eq "$z" 0
	timeout -s KILL 1 $ENGINE exec "$NAME" /.demesne/init run --id gone --dir /out/gone -- sh -c 'sleep 2; echo done' >/dev/null 2>&1
	wait_file "$O/gone/status.json" 10
	check "container: status.json is written after the exec client was killed" eq "$(field "$O/gone/status.json" exit_code 2>/dev/null)/$(cat "$O/gone/stdout.log")" 0/done
	$ENGINE exec "$NAME" /.demesne/init run --id c04 --dir /out/c04 -- sleep 600 &
	EX=$!
	wait_file "$O/c04/pid" 10
	t0=$(now_ms)
	$ENGINE exec "$NAME" /.demesne/init kill --dir /out/c04 --grace 2
	rc=$?; el=$(($(now_ms) - t0))
	wait "$EX"
	check "container C04: kill --dir through a second exec (${el} ms)" eq "$rc/$(field "$O/c04/status.json" cancelled)" 0/true
	n=$($ENGINE exec "$NAME" sh -c 'for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr "\0" " "; echo; done | grep -c "^sleep 600 $"')
	check "  only the deliberate background sleep is left (1)" eq "$n" 1
	t0=$(now_ms)
	$ENGINE stop -t 10 "$NAME" >/dev/null
	el=$(($(now_ms) - t0))
	check "container: stop is prompt (${el} ms): serve forwards SIGTERM" eq "$((el < 4000))" 1
	$ENGINE rm -f "$NAME" >/dev/null 2>&1
fi

echo "$PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
