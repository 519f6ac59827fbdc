// The sandbox tools over MCP (official SDK client, stdio) against a real container engine.
// The engine comes from DEMESNE_ENGINE (tests/run runs this file once per engine).
// Cases C01–C13 from shared/cases are named in the test titles.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, symlinkSync, readdirSync, rmSync, lstatSync, truncateSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const work = mkdtempSync(path.join(tmpdir(), "demesne-it-"));
const allowed = path.join(work, "allowed1");
mkdirSync(path.join(allowed, "data"), { recursive: true });
mkdirSync(path.join(work, "allowed10"), { recursive: true });
writeFileSync(path.join(allowed, "input.txt"), "input-contents\n");
writeFileSync(path.join(allowed, "data", "a.csv"), "x,y\n1,2\n");
writeFileSync(path.join(work, "allowed10", "x"), "outside\n");
symlinkSync("/etc", path.join(allowed, "etc-link"));
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_ALLOWED_PATHS: allowed,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
};

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function call(name, args, opts = {}) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, { ...LONG, ...opts });
  return res;
}
async function ok(name, args, opts) {
  const res = await call(name, args, opts);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
async function err(name, args) {
  const res = await call(name, args);
  assert.equal(res.isError, true, `${name} should fail: ${JSON.stringify(res.structuredContent)}`);
  return res.content[0].text;
}

function engineGet(p) {
  return new Promise((resolve, reject) => {
    http.get({ socketPath: SOCKET, path: p }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve(JSON.parse(body)));
    }).on("error", reject);
  });
}
function engineSend(method, p, body) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: p, method, headers: { "Content-Type": "application/json" } }, (res) => {
      let data = "";
      res.on("data", (c) => (data += c));
      res.on("end", () => resolve({ status: res.statusCode, body: data ? JSON.parse(data) : null }));
    });
    req.on("error", reject);
    req.end(body ? JSON.stringify(body) : undefined);
  });
}
async function containersWithLabel(label) {
  const filters = encodeURIComponent(JSON.stringify({ label: [label] }));
  return engineGet(`/containers/json?all=true&filters=${filters}`);
}
// A one-shot's container is removed right after its answer, in the background: the
// containers with `label` once that is done (at most 15 s).
async function containersLeft(label) {
  let left = [];
  for (let i = 0; i < 60; i++) {
    left = await containersWithLabel(label);
    if (left.length === 0) break;
    await new Promise((r) => setTimeout(r, 250));
  }
  return left;
}

test("sandbox_script runs on the engine: output, /out kept, container removed", async () => {
  const r = await ok("sandbox_script", { command: "uname -s; python3 --version; echo hi > /out/hello.txt" });
  assert.equal(r.exit_code, 0);
  assert.match(r.stdout, /Linux/);
  assert.match(r.stdout + r.stderr, /Python 3\./);
  assert.equal(readFileSync(path.join(r.output_dir, "hello.txt"), "utf8"), "hi\n");
  assert.match(readFileSync(path.join(r.output_dir, "stdout.log"), "utf8"), /Linux/);
  assert.equal(r.timed_out, false);
  assert.equal(r.truncated, false);
  assert.deepEqual(await containersLeft(`io.demesne.run_id=${r.run_id}`), []);
});

test("a sandbox's container carries its run_id label while it lives (what the removal checks look for)", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  const live = await containersWithLabel(`io.demesne.run_id=${sb.sandbox_id}`);
  assert.equal(live.length, 1, "found by its run_id label");
  assert.equal(live[0].Labels["io.demesne.kind"], "persistent");
  await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  assert.deepEqual(await containersWithLabel(`io.demesne.run_id=${sb.sandbox_id}`), []);
});

test("exit code and stderr come back", async () => {
  const r = await ok("sandbox_script", { command: "echo oops >&2; exit 3", image: "base" });
  assert.equal(r.exit_code, 3);
  assert.equal(r.stderr, "oops\n");
});

test("inputs are mounted read-only at /in", async () => {
  const r = await ok("sandbox_script", {
    command: "cat /in/input.txt; cat /in/data/a.csv; touch /in/input.txt 2>/dev/null && echo WRITABLE || echo readonly",
    files: [path.join(allowed, "input.txt")],
    directories: [path.join(allowed, "data")],
    image: "base",
  });
  assert.equal(r.stdout, "input-contents\nx,y\n1,2\nreadonly\n");
});

test("C12: paths outside the allowed roots are refused with the field and reason", async () => {
  const cases = [
    [path.join(allowed, "../../../etc/passwd"), /files\[0\].*not inside the allowed paths/],
    [path.join(work, "allowed10", "x"), /files\[0\].*not inside the allowed paths/],
    [path.join(allowed, "etc-link", "passwd"), /files\[0\].*resolves to \/etc\/passwd.*not inside/],
    [path.join(allowed, "%2e%2e", "%2e%2e", "etc", "passwd"), /files\[0\].*cannot resolve/],
  ];
  for (const [p, re] of cases) assert.match(await err("sandbox_script", { command: "true", files: [p] }), re);
  assert.match(await err("sandbox_script", { command: "true", directories: [path.join(allowed, "etc-link")] }),
    /directories\[0\].*resolves to \/etc/);
});

test("env is passed; demesne's own variables cannot be overridden", async () => {
  const r = await ok("sandbox_script", { command: 'echo "$GREETING $DEMESNE_RUN_ID"', env: { GREETING: "hello" }, image: "base" });
  assert.equal(r.stdout, `hello ${r.run_id}\n`);
  assert.match(await err("sandbox_script", { command: "true", env: { DEMESNE_RUN_ID: "x" } }), /env\.DEMESNE_RUN_ID/);
  const p = await ok("sandbox_script", { command: 'echo "$PATH"', env: { PATH: "/usr/bin:/bin" }, image: "base" });
  assert.equal(p.stdout, "/usr/bin:/bin\n", "the caller's PATH wins over demesne's default");
});

test("invalid arguments name the field", async () => {
  assert.match(await err("sandbox_script", { command: "true", timeout_seconds: "soon" }), /timeout_seconds/);
  assert.match(await err("sandbox_script", { command: "true", limits: { memory_mb: 10 ** 9 } }), /limits\.memory_mb/);
  assert.match(await err("sandbox_script", { command: "true", image: "no-such-image-xyz" }), /image.*built-in/);
});

test("a timeout kills the command and says so", async () => {
  const t0 = Date.now();
  const r = await ok("sandbox_script", { command: "echo before; sleep 120; echo after", timeout_seconds: 1, image: "base" });
  assert.equal(r.timed_out, true);
  assert.equal(r.stdout, "before\n");
  assert.notEqual(r.exit_code, 0);
  assert.ok(Date.now() - t0 < 30_000, "returned long before the sleep would have ended");
});

test("C02: a grandchild holding stdout does not delay the result", async () => {
  const t0 = Date.now();
  const r = await ok("sandbox_script", { command: "(sleep 600 &) ; echo started", image: "base" });
  assert.equal(r.exit_code, 0);
  assert.equal(r.stdout, "started\n");
  assert.ok(Date.now() - t0 < 30_000);
  assert.deepEqual(await containersLeft(`io.demesne.run_id=${r.run_id}`), []);
});

test("C03: exec with process substitution finishes", async () => {
  const r = await ok("sandbox_script", { command: "bash -c 'exec > >(tee -a /tmp/log) 2>&1; echo done'", image: "base" });
  assert.equal(r.exit_code, 0);
  assert.match(r.stdout, /done/);
});

test("C07: over 1 MB of multi-byte text: log byte-identical, result valid UTF-8 and cut on code points", async () => {
  const r = await ok("sandbox_script", { command: "python3 -c 'print(\"日本語🎉\"*60000)'" });
  const expected = Buffer.from("日本語🎉".repeat(60000) + "\n", "utf8");
  assert.ok(readFileSync(path.join(r.output_dir, "stdout.log")).equals(expected));
  assert.equal(r.truncated, true);
  assert.match(r.stdout, /bytes omitted; full output in .*stdout\.log/);
  assert.ok(!r.stdout.includes("\uFFFD"), "no code point was split");
  assert.ok(Buffer.byteLength(r.stdout) < 70_000);
});

test("C08: random bytes and exit 3 give a valid response", async () => {
  const r = await ok("sandbox_script", { command: "head -c 65536 /dev/urandom; echo; exit 3", image: "base" });
  assert.equal(r.exit_code, 3);
  assert.equal(typeof r.stdout, "string");
});

test("C10: 1 MiB of control bytes stays within the message bound", async () => {
  const r = await ok("sandbox_script", { command: "head -c 1048576 /dev/zero | tr '\\0' '\\1'", image: "base" });
  assert.equal(r.exit_code, 0);
  assert.equal(r.truncated, true);
  assert.ok(JSON.stringify(r).length < 1_000_000);
});

test("C09: endless output keeps server memory flat while another call answers", async () => {
  const pid = conn.transport.pid;
  const rss = () => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, "utf8"))[1]) * 1024;
  const before = rss();
  // 2 GiB of output (far past any buffer) then a wait, so the call still runs when the other
  // answers; `yes` for the whole 15 s wrote 10-20 GB to the host's disk per run
  const flood = ok("sandbox_script", { command: "timeout 15 sh -c 'yes | head -c 2G; sleep 15'; true", image: "base" });
  await new Promise((r) => setTimeout(r, 3000));
  const quick = await ok("sandbox_script", { command: "echo quick", image: "base" });
  assert.equal(quick.stdout, "quick\n");
  const r = await flood;
  assert.equal(r.truncated, true);
  assert.ok(rss() - before < 50 * 1024 * 1024, `server RSS grew by ${(rss() - before) >> 20} MiB`);
  rmSync(r.output_dir, { recursive: true, force: true });
});

test("C05: 20 concurrent sandbox_script calls each answer with their own result, nothing left behind", async () => {
  const calls = Array.from({ length: 20 }, (_, i) => ok("sandbox_script", { command: `echo call-${i} $RANDOM`, image: "base" }));
  const results = await Promise.all(calls);
  // /bin/sh is dash, which has no $RANDOM: the line is "call-i " plus digits or nothing
  results.forEach((r, i) => assert.match(r.stdout, new RegExp(`^call-${i} ?\\d*\\n$`)));
  assert.equal(new Set(results.map((r) => r.run_id)).size, 20);
  for (const r of results) assert.deepEqual(await containersLeft(`io.demesne.run_id=${r.run_id}`), []);
});

test("persistent sandbox: create, exec, upload, download, list, destroy", async () => {
  const sb = await ok("sandbox_create", { image: "base", files: [path.join(allowed, "input.txt")] });
  assert.match(sb.sandbox_id, /^\d{8}T\d{6}Z-[0-9a-f]{8}$/);
  try {
    const e1 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo state > /tmp/s; cat /in/input.txt" });
    assert.equal(e1.stdout, "input-contents\n");
    const e2 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/s; pwd", cwd: "/tmp" });
    assert.equal(e2.stdout, "state\n/tmp\n");
    assert.ok(existsSync(path.join(e2.log_dir, "stdout.log")));
    const list = await ok("sandbox_list", {});
    assert.ok(list.sandboxes.some((s) => s.sandbox_id === sb.sandbox_id));
    // tmpfs paths too (the engine's archive API cannot see them on Docker)
    await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "data"), dst: "/tmp/data" });
    await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "input.txt"), dst: "/workspace/in.txt" });
    const e3 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/data/a.csv /workspace/in.txt; echo t > /tmp/made.txt" });
    assert.equal(e3.stdout, "x,y\n1,2\ninput-contents\n");
    const d0 = await ok("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/made.txt" });
    assert.equal(readFileSync(d0.path, "utf8"), "t\n");
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "mkdir -p /tmp/adir; echo keep > /tmp/afile" });
    assert.match(await err("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "input.txt"), dst: "/tmp/adir" }),
      /dst: \/tmp\/adir is a folder/);
    assert.match(await err("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "data"), dst: "/tmp/afile" }),
      /dst: \/tmp\/afile exists .* not a folder/);
    assert.equal((await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/afile" })).stdout, "keep\n");
    assert.match(await err("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "input.txt"), dst: "/nonexistent/x" }),
      /dst: the folder \/nonexistent does not exist/);
    assert.match(await err("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/nonexistent" }), /src: \/nonexistent does not exist/);
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "mkdir -p /out/res && echo r1 > /out/res/one.txt" });
    const d = await ok("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/out/res" });
    assert.equal(readFileSync(path.join(d.path, "one.txt"), "utf8"), "r1\n");
    assert.equal(d.path, path.join(sb.output_dir, "downloads", "res"));
  } finally {
    const x = await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
    assert.equal(x.status, "destroyed");
  }
  assert.match(await err("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" }), /no sandbox/);
});

test("an out-of-memory kill is named in the result, for a script and an exec", async () => {
  const hog = "head -c 300M /dev/zero | tail > /dev/null; echo after";
  const r = await ok("sandbox_script", { command: hog, limits: { memory_mb: 64 } });
  assert.equal(r.stdout, "after\n", "the shell itself went on");
  assert.match(r.oom_killed, /^the kernel killed 1 process in the sandbox for lack of memory \(its limit is 64 MiB\)/);
  const calm = await ok("sandbox_script", { command: "echo calm", limits: { memory_mb: 64 } });
  assert.equal(calm.oom_killed, undefined);
  const sb = await ok("sandbox_create", { image: "base", limits: { memory_mb: 64 } });
  try {
    const e = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "head -c 300M /dev/zero | tail > /dev/null" });
    assert.equal(e.exit_code, 137);
    assert.match(e.oom_killed, /lack of memory \(its limit is 64 MiB\); files in \/tmp and \/workspace count/);
    const fine = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo fine" });
    assert.equal(fine.oom_killed, undefined, "counted per command");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("numbers beyond any ceiling are refused naming the field, not with a runtime error", async () => {
  for (const [name, args, field] of [
    ["sandbox_script", { command: "true", timeout_seconds: 1e20 }, "timeout_seconds"],
    ["sandbox_script", { command: "true", limits: { memory_mb: 1e20 } }, "limits.memory_mb"],
    ["sandbox_script", { command: "true", limits: { pids: 1e300 } }, "limits.pids"],
    ["sandbox_create", { ttl_seconds: 1e20 }, "ttl_seconds"],
    ["sandbox_status", { job_id: "job-20260101T000000Z-0123456789", since: 1e20 }, "since"],
  ]) {
    const text = await err(name, args);
    assert.ok(text.includes(field), `${name} ${JSON.stringify(args)}: ${text}`);
    assert.ok(!/lua\/|no integer representation/.test(text), `${name}: ${text}`);
  }
});

test("transfers: non-UTF-8 names, hard links inside a tree, and /proc files", async () => {
  const odd = path.join(allowed, "odd");
  mkdirSync(odd, { recursive: true });
  writeFileSync(Buffer.concat([Buffer.from(odd + "/bad"), Buffer.from([0xff]), Buffer.from(".txt")]), "latin\n");
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const up = await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: odd, dst: "/tmp/odd" });
    assert.equal(up.files, 1);
    const ls = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/odd/bad*.txt; ls /tmp/odd | od -An -tx1 | tr -d ' \n'" });
    assert.equal(ls.stdout, "latin\n626164ff2e7478740a", "the name arrives byte for byte");
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "mkdir -p /out/h && echo shared > /out/h/orig && ln /out/h/orig /out/h/link" });
    const d = await ok("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/out/h" });
    assert.equal(readFileSync(path.join(d.path, "link"), "utf8"), "shared\n");
    assert.equal(lstatSync(path.join(d.path, "link")).ino, lstatSync(path.join(d.path, "orig")).ino, "still one file");
    assert.match(await err("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/proc/self/status" }),
      /src: \/proc\/self\/status is under \/proc/);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("an upload over upload_max_bytes is refused before anything is copied (sparse files count in full)", async () => {
  const big = path.join(allowed, "sparse-big");
  writeFileSync(big, "");
  truncateSync(big, 8 * 1024 * 1024); // 8 MiB apparent, nothing on disk
  const c2 = await connect({ env: { ...env, DEMESNE_UPLOAD_MAX_BYTES: String(1024 * 1024) }, fixtures: false });
  try {
    const sb = (await c2.client.callTool({ name: "sandbox_create", arguments: { image: "base" } }, undefined, LONG)).structuredContent;
    try {
      const r = await c2.client.callTool({ name: "sandbox_upload", arguments: { sandbox_id: sb.sandbox_id, src: big, dst: "/tmp/big" } });
      assert.equal(r.isError, true);
      assert.match(r.content[0].text, /src: .*sparse-big holds more than 1048576 bytes of files, over upload_max_bytes/);
      const small = await c2.client.callTool({ name: "sandbox_upload", arguments: { sandbox_id: sb.sandbox_id,
        src: path.join(allowed, "input.txt"), dst: "/tmp/in.txt" } });
      assert.ok(!small.isError, small.content?.[0]?.text);
    } finally {
      await c2.client.callTool({ name: "sandbox_destroy", arguments: { sandbox_id: sb.sandbox_id } });
    }
  } finally {
    await c2.client.close();
    rmSync(big, { force: true });
  }
});

test("C11: uploads of 0 B to 64 MiB arrive with the same sha256", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    for (const size of [0, 1024, 17 * 1024, 18 * 1024, 19 * 1024, 1 << 20, 64 << 20]) {
      const data = randomBytes(size);
      const f = path.join(allowed, `up-${size}.bin`);
      writeFileSync(f, data);
      const u = await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: f, dst: `/out/up-${size}.bin` });
      assert.equal(u.bytes, size);
      const e = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `sha256sum /out/up-${size}.bin | cut -d' ' -f1` });
      assert.equal(e.stdout.trim(), createHash("sha256").update(data).digest("hex"), `size ${size}`);
      rmSync(f);
    }
    assert.match(await err("sandbox_upload", { sandbox_id: sb.sandbox_id, src: "/etc/passwd", dst: "/out/p" }), /src.*not inside/);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("C13: downloads never write or read outside the sandbox's output folder", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "ln -s /etc/shadow /out/shadow-link; mkdir -p /tmp/d && ln -s ../../../../etc /tmp/d/up" });
    // the engine resolves a link inside the container (or hands over the link itself):
    // either way the host's /etc/shadow is never read, and nothing outside downloads/ is written
    const host = readFileSync("/etc/shadow");
    const res = await call("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/out/shadow-link" });
    if (!res.isError) {
      const p = res.structuredContent.path;
      assert.ok(p.startsWith(path.join(sb.output_dir, "downloads") + "/"));
      assert.ok(!lstatSync(p).isSymbolicLink());
      assert.ok(!readFileSync(p).equals(host), "host /etc/shadow was read");
    }
    assert.match(await err("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/d" }), /refused|unsafe|link/i);
    assert.ok(!existsSync(path.join(sb.output_dir, "downloads", "d")));
    assert.match(await err("sandbox_download", { sandbox_id: sb.sandbox_id, src: "../../x" }), /src/);
    // a downloads link planted from inside the sandbox is not followed
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "rm -rf /out/downloads && ln -s /etc /out/downloads; echo x > /tmp/f" });
    assert.match(await err("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/f" }), /downloads/);
    assert.ok(!existsSync("/etc/f"));
    assert.ok(lstatSync(path.join(sb.output_dir, "downloads")).isSymbolicLink());
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("C01: a timed-out exec kills its whole process group", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const t0 = Date.now();
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "sleep 300 & echo $! > /tmp/pid; wait", timeout_seconds: 1 });
    assert.equal(r.timed_out, true);
    assert.ok(Date.now() - t0 < 20_000);
    const k = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "kill -0 $(cat /tmp/pid) 2>/dev/null && echo alive || echo gone" });
    assert.equal(k.stdout, "gone\n");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("C01 kind: a timeout also kills processes that left the group with setsid", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "setsid sh -c 'sleep 300' & sleep 60", timeout_seconds: 1 });
    assert.equal(r.timed_out, true);
    const k = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "ps -eo args | grep -c '^sleep 300' || true" });
    assert.equal(k.stdout.trim(), "0");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("commands that cannot be run are refused with the field and reason", async () => {
  assert.match(await err("sandbox_script", { command: "echo " + "a".repeat(140 * 1024) }), /command: \d+ bytes is more than/);
  assert.match(await err("sandbox_script", { command: "echo a\u0000b" }), /command: contains a NUL byte/);
  assert.match(await err("sandbox_script", { command: "true", env: { BIG: "x".repeat(200 * 1024) } }), /env\.BIG: \d+ bytes/);
});

test("uploads keep UTF-8 names and the mode of an existing folder; open sandboxes take no host files", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const f = path.join(allowed, "日本 🎉.txt");
    writeFileSync(f, "utf8\n");
    await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: f, dst: "/tmp/日本 🎉.txt" });
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat '/tmp/日本 🎉.txt'; stat -c %a /tmp" });
    assert.equal(r.stdout, "utf8\n1777\n");
    rmSync(f);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  const open = await ok("sandbox_create", { image: "base", egress: "open" });
  try {
    assert.match(await err("sandbox_upload", { sandbox_id: open.sandbox_id, src: path.join(allowed, "input.txt"), dst: "/tmp/x" }), /open egress/);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: open.sandbox_id });
  }
});

test("an exec longer than the sandbox's TTL keeps the sandbox alive", async () => {
  const sb = await ok("sandbox_create", { image: "base", ttl_seconds: 60 });
  try {
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true", timeout_seconds: 3600 });
    assert.ok(Date.parse(r.expires_at) - Date.now() > 3600 * 1000, `expires_at ${r.expires_at}`);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("C04: cancelling a running exec kills the command in the container", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const ac = new AbortController();
    const p = conn.client.callTool({ name: "sandbox_exec", arguments: { sandbox_id: sb.sandbox_id, command: "sleep 600" } },
      undefined, { signal: ac.signal, timeout: 120_000 });
    await new Promise((r) => setTimeout(r, 2500));
    ac.abort("test cancels");
    await assert.rejects(p);
    let left = "";
    for (let i = 0; i < 20; i++) {
      await new Promise((r) => setTimeout(r, 500));
      left = (await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "ps -eo comm | grep -c '^sleep$' || true" })).stdout.trim();
      if (left === "0") break;
    }
    assert.equal(left, "0");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("C06 kind: destroying a sandbox under a running exec says so", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  const running = call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "sleep 30" });
  await new Promise((r) => setTimeout(r, 1500));
  await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  const res = await running;
  assert.equal(res.isError, true, JSON.stringify(res.structuredContent));
  assert.match(res.content[0].text, /was destroyed|stopped while/);
});

test("C06: destroy twice at once, and destroy of a gone sandbox, both succeed", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  const [a, b] = await Promise.all([
    ok("sandbox_destroy", { sandbox_id: sb.sandbox_id }),
    ok("sandbox_destroy", { sandbox_id: sb.sandbox_id }),
  ]);
  for (const s of [a.status, b.status]) assert.ok(["destroyed", "already gone"].includes(s), s);
  assert.ok([a.status, b.status].includes("destroyed"));
  const c = await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  assert.equal(c.status, "already gone");
});

test("a sandbox cannot extend its own life; exec renews by its own ttl_seconds", async () => {
  const sb = await ok("sandbox_create", { image: "base", ttl_seconds: 600 });
  try {
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo 4102444800 > /.demesne/run/expires_at; true", timeout_seconds: 10 });
    const mine = (await ok("sandbox_list", {})).sandboxes.find((s) => s.sandbox_id === sb.sandbox_id);
    const left = (Date.parse(mine.expires_at) - Date.now()) / 1000;
    assert.ok(left > 500 && left <= 601, `expires in ${left} s`);
    const st = lstatSync(sb.output_dir);
    assert.equal(st.mode & 0o777, 0o755, "output folder is rwxr-xr-x");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("a persistent sandbox survives a server restart and is used again by id", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo kept > /tmp/k" });
  await conn.client.close();
  conn = await connect({ env, fixtures: false });
  const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/k" });
  assert.equal(r.stdout, "kept\n");
  await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
});

test("the reaper removes expired sandboxes and one-shot containers whose server is gone", async () => {
  const imgs = await engineGet(`/images/json?filters=${encodeURIComponent(JSON.stringify({ label: ["io.demesne.image=base"] }))}`);
  assert.ok(imgs.length > 0, "base image present");
  const image = imgs[0].Id;
  const host = (await import("node:os")).hostname();
  const make = async (labels) => {
    const r = await engineSend("POST", "/v1.41/containers/create", {
      Image: image, Cmd: ["sleep", "600"], HostConfig: { NetworkMode: "none" },
      Labels: { "io.demesne.managed": "1", ...labels },
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    await engineSend("POST", `/v1.41/containers/${r.body.Id}/start`);
    return r.body.Id;
  };
  const past = String(Math.floor(Date.now() / 1000) - 10);
  const future = String(Math.floor(Date.now() / 1000) + 3600);
  const orphan = await make({ "io.demesne.kind": "oneshot", "io.demesne.owner": `${host}/999999/1`, "io.demesne.expires_at": future, "io.demesne.run_id": "reap-orphan" });
  const expired = await make({ "io.demesne.kind": "persistent", "io.demesne.owner": `${host}/1/1`, "io.demesne.expires_at": past, "io.demesne.run_id": "reap-expired" });
  const live = await make({ "io.demesne.kind": "persistent", "io.demesne.owner": `${host}/999999/1`, "io.demesne.expires_at": future, "io.demesne.run_id": "reap-live" });
  try {
    await conn.client.close();
    conn = await connect({ env, fixtures: false }); // the reaper runs at start
    let left = [];
    for (let i = 0; i < 40; i++) {
      left = (await containersWithLabel("io.demesne.managed=1")).map((c) => c.Id);
      if (!left.includes(orphan) && !left.includes(expired)) break;
      await new Promise((r) => setTimeout(r, 250));
    }
    assert.ok(!left.includes(orphan), "one-shot container of a dead server removed");
    assert.ok(!left.includes(expired), "expired sandbox removed");
    assert.ok(left.includes(live), "a live persistent sandbox is kept");
  } finally {
    for (const id of [orphan, expired, live]) await engineSend("DELETE", `/v1.41/containers/${id}?force=true`);
  }
});

test("no engine: the tools answer with the sockets tried and how to start one", async () => {
  const c2 = await connect({ env: { ...env, DEMESNE_ENGINE: "unix:///nonexistent/engine.sock" }, fixtures: false });
  try {
    const res = await c2.client.callTool({ name: "sandbox_script", arguments: { command: "true" } });
    assert.equal(res.isError, true);
    assert.match(res.content[0].text, /\/nonexistent\/engine\.sock/);
    assert.match(res.content[0].text, /podman system service|dockerd/);
  } finally {
    await c2.client.close();
  }
});

// A user engine adapter: a Lua file in $XDG_CONFIG_HOME/demesne/engines/ chosen with
// DEMESNE_ENGINE_ADAPTER. tests/fixtures/engines/recording.lua (the example in
// docs/reference/engines.md) wraps the Docker Engine API adapter and writes each container
// call it sees to a file, so the test can tell that sandboxes went through it.
const RECORDING_ADAPTER = readFileSync(new URL("../fixtures/engines/recording.lua", import.meta.url), "utf8");

test("a user engine adapter file is loaded and used; a missing one is a clear error", async () => {
  const xdg = mkdtempSync(path.join(tmpdir(), "demesne-xdg-engine-"));
  mkdirSync(path.join(xdg, "demesne", "engines"), { recursive: true });
  writeFileSync(path.join(xdg, "demesne", "engines", "recording.lua"), RECORDING_ADAPTER);
  const logPath = path.join(xdg, "calls.log");
  const c2 = await connect({ env: { ...env, XDG_CONFIG_HOME: xdg, DEMESNE_ENGINE_ADAPTER: "recording",
    RECORDING_ADAPTER_LOG: logPath }, fixtures: false });
  try {
    const res = await c2.client.callTool({ name: "sandbox_script", arguments: { command: "echo via-adapter" } },
      undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    assert.equal(res.structuredContent.stdout, "via-adapter\n");
    // the call's sandbox was made (by the call, or ahead of it by the warm pool), started and,
    // after the answer, removed: all through the adapter
    let calls = [];
    for (let i = 0; i < 60 && !calls.includes("remove"); i++) {
      await new Promise((r) => setTimeout(r, 250));
      calls = readFileSync(logPath, "utf8").trim().split("\n");
    }
    assert.deepEqual([...new Set(calls)].sort(), ["create", "remove", "start"], calls.join(" "));
  } finally {
    await c2.client.close();
  }
  const c3 = await connect({ env: { ...env, XDG_CONFIG_HOME: xdg, DEMESNE_ENGINE_ADAPTER: "nosuch" }, fixtures: false });
  try {
    const res = await c3.client.callTool({ name: "sandbox_script", arguments: { command: "true" } });
    assert.equal(res.isError, true);
    assert.match(res.content[0].text, /engine_adapter: no adapter "nosuch" \(built in: docker, kubernetes; no file .*engines\/nosuch\.lua\)/);
  } finally {
    await c3.client.close();
    rmSync(xdg, { recursive: true, force: true });
  }
});
