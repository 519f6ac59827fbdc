#!/usr/bin/env python3
# The host's half of `demesne-init pty` for tests/init/run_tests.sh: listens on a unix
# socket, runs demesne-init pty against it, sends the given frames, prints what came back.
# usage: pty-host.py BIN SOCK MODE   (MODE: session | malformed | hangup)
import os, socket, struct, subprocess, sys, time

bin_, path, mode = sys.argv[1:4]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)
argv = [bin_, "pty", "--connect", path, "--", "sh", "-c",
        "stty size; read l; echo got-$l; exit 3" if mode == "session" else "sleep 30"]
p = subprocess.Popen(argv)
srv.settimeout(10)
c, _ = srv.accept()
frame = lambda t, b: t + struct.pack(">H", len(b)) + b
if mode == "session":
    c.sendall(frame(b"w", struct.pack(">HH", 33, 101)))
    time.sleep(0.3)
    c.sendall(frame(b"d", b"x42\r"))
elif mode == "malformed":
    c.sendall(b"q\x00\x01z")
else:
    time.sleep(0.3)
    c.close()
data, status = b"", None
try:
    c.settimeout(10)
    buf = b""
    while True:
        chunk = c.recv(65536)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 3:
            t, n = buf[0:1], struct.unpack(">H", buf[1:3])[0]
            if len(buf) < 3 + n:
                break
            body, buf = buf[3:3 + n], buf[3 + n:]
            if t == b"d":
                data += body
            elif t == b"x":
                status = body[0]
except OSError:
    pass
rc = p.wait(timeout=10)
print(f"rc={rc} status={status} data={data!r}")
