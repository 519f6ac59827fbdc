// Host file handling under attack from inside a real sandbox (issue 10), over MCP with the
// official SDK client against a real engine (DEMESNE_ENGINE; tests/run runs this file once
// per engine). What a hostile sandbox can write — /out and /.demesne/run — it writes here
// the way an attacker would: a watcher that swaps folders for symlinks to host folders in
// a tight loop while the host transfers, FIFOs at every file the host reads, a 100 GiB
// sparse file, a 1500-deep tree, and forged exec records read by a restarted server.
// Promises checked: no host file outside the sandbox's output folder changes, the server
// answers other calls within a second throughout, nothing beyond a ceiling is written,
// and an error is an error (never a success, never an internal Lua error).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, readdirSync, rmSync, lstatSync, readlinkSync,
  existsSync } from "node:fs";
import { tmpdir, hostname } from "node:os";
import path from "node:path";
import { connect, PING_MAX_MS } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-containment-"));
const allowed = path.join(work, "allowed");
const ro = path.join(allowed, "ro"); // mounted read-only at /in/ro
const canary = path.join(work, "canary"); // never mounted anywhere
mkdirSync(path.join(ro, "sub"), { recursive: true });
mkdirSync(path.join(canary, "res"), { recursive: true });
writeFileSync(path.join(ro, "input.txt"), "read-only input\n");
writeFileSync(path.join(ro, "sub", "deep.txt"), "deeper input\n");
writeFileSync(path.join(canary, "keep.txt"), "canary\n");
writeFileSync(path.join(canary, "res", "one.txt"), "canary res\n");
writeFileSync(path.join(allowed, "up.txt"), "uploaded\n");
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
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function callOn(c, name, args) {
  return c.client.callTool({ name, arguments: args }, undefined, LONG);
}
async function okOn(c, name, args) {
  const res = await callOn(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
const ok = (name, args) => okOn(conn, name, args);
const call = (name, args) => callOn(conn, name, args);

// An error a user can act on: isError, a message, no Lua internals.
function assertClearError(res, re, what) {
  assert.equal(res.isError, true, `${what}: should fail, got ${JSON.stringify(res.structuredContent)}`);
  const text = res.content?.[0]?.text || "";
  assert.ok(!/lua\/|traceback|attempt to |nil value/.test(text), `${what}: an internal error leaked: ${text}`);
  if (re) assert.match(text, re, what);
  return text;
}

// Pings the server every 50 ms until stopped (and at least 3 times); resolves with the
// slowest answer (ms).
function pinger(c) {
  let stopped = false;
  const times = [];
  const done = (async () => {
    while (!stopped || times.length < 3) {
      const t0 = Date.now();
      await c.client.ping({ timeout: 30_000 });
      times.push(Date.now() - t0);
      await sleep(50);
    }
  })();
  return async () => {
    stopped = true;
    await done;
    return { max: Math.max(...times), count: times.length };
  };
}

// The promise of the issue: other calls keep being answered while the attack runs (within
// PING_MAX_MS), measured as the slowest of several pings (at least 3, so an idle run cannot pass).
function assertResponsive(p, what) {
  assert.ok(p.count >= 3, `${what}: too few pings (${p.count}) to judge`);
  assert.ok(p.max < PING_MAX_MS, `${what}: a ping took ${p.max} ms while the attack ran`);
}

// A digest of a host tree: every path, type, mode, size, content and link target (lstat).
function treeDigest(root) {
  const h = createHash("sha256");
  const walk = (dir, rel) => {
    for (const name of readdirSync(dir).sort()) {
      const p = path.join(dir, name);
      const st = lstatSync(p);
      h.update(`${rel}/${name}\0${st.mode}\0${st.size}\0`);
      if (st.isSymbolicLink()) h.update(readlinkSync(p));
      else if (st.isDirectory()) walk(p, `${rel}/${name}`);
      else if (st.isFile()) h.update(readFileSync(p));
    }
  };
  walk(root, "");
  return h.digest("hex");
}

// Bytes on disk under a folder (du: what was actually written, holes excluded).
function diskBytes(p) {
  return Number(execFileSync("du", ["-s", "-B1", p], { encoding: "utf8" }).split("\t")[0]);
}

// The host paths an attacker aims at: the canary and the read-only input (whose host path
// a sandbox reads in /proc/self/mountinfo).
const TARGETS = [canary, ro, path.join(canary, "res")];

// A perl loop (perl-base is in every Debian image) that swaps each path in PATHS (globs
// allowed) for a symlink to each target, over and over, until /tmp/stop exists.
const WATCHER = `
my @targets = split /:/, $ENV{TARGETS};
my @pats = split / /, $ENV{PATHS};
my $n = 0;
until (-e "/tmp/stop") {
  for my $t (@targets) {
    for my $p (map { glob($_) } @pats) {
      $p =~ s/\\.real$//;
      if (-l $p) { next; }
      if (rename($p, "$p.real")) {
        symlink($t, $p); select(undef, undef, undef, 0.0005); unlink($p); rename("$p.real", $p);
      } else {
        symlink($t, $p) and do { select(undef, undef, undef, 0.0005); unlink($p) };
      }
      $n++;
    }
  }
}
open(my $f, ">", "/tmp/swaps"); print $f "$n\\n"; close($f);
`;

test("a watcher swapping /out/downloads, the xfer folder, staging and targets for links changes no host file", async () => {
  const before = { canary: treeDigest(canary), allowed: treeDigest(allowed) };
  const sb = await ok("sandbox_create", { image: "base", directories: [ro] });
  try {
    // the host path of /in/ro is in mountinfo, as the issue says
    const mi = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "grep ' /in/ro ' /proc/self/mountinfo" });
    assert.match(mi.stdout, /\/in\/ro/);
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command:
      "mkdir -p /tmp/res/sub && echo one > /tmp/res/one.txt && echo two > /tmp/res/sub/two.txt && echo f > /tmp/f.txt "
      + "&& mkdir -p /out/downloads /.demesne/run/xfer" });
    await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "up.txt"), dst: "/tmp/up0.txt" });
    const paths = ["/out/downloads", "/.demesne/run/xfer", "/out/downloads/res", "/out/downloads/f.txt",
      "/out/downloads/.incoming-*", "/out/downloads/.incoming-*/res", "/.demesne/run/xfer/*.tar",
      "/.demesne/run/exec/xfer-*", "/.demesne/run/exec/xfer-*/status.json"].join(" ");
    // the watcher runs detached from the exec that starts it
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, env: { TARGETS: TARGETS.join(":"), PATHS: paths },
      command: `cat > /tmp/w.pl <<'EOF'\n${WATCHER}\nEOF\nsetsid perl /tmp/w.pl </dev/null >/dev/null 2>&1 &\nsleep 0.5; echo started` });
    const stop = pinger(conn);
    const results = { downloads: 0, uploads: 0, refused: [] };
    for (let i = 0; i < 12; i++) {
      for (const src of ["/tmp/res", "/tmp/f.txt"]) {
        const r = await call("sandbox_download", { sandbox_id: sb.sandbox_id, src });
        if (r.isError) results.refused.push(assertClearError(r, null, `download ${src}`));
        else {
          results.downloads++;
          const p = r.structuredContent.path;
          assert.ok(p.startsWith(path.join(sb.output_dir, "downloads") + "/"), p);
        }
      }
      const u = await call("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(allowed, "up.txt"), dst: `/tmp/up${i + 1}.txt` });
      if (u.isError) results.refused.push(assertClearError(u, null, "upload"));
      else results.uploads++;
    }
    assertResponsive(await stop(), "transfers under the watcher");
    const fin = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "touch /tmp/stop; sleep 1; cat /tmp/swaps" });
    assert.ok(Number(fin.stdout) > 100, `the watcher swapped (${fin.stdout.trim()} swaps)`);
    // some transfers went through while it swapped: the host worked in the same folders
    assert.ok(results.downloads + results.uploads > 0, `no transfer succeeded: ${results.refused.slice(0, 3).join(" | ")}`);
    // what was downloaded is the sandbox's data, in the output folder
    const check = await ok("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/res" });
    assert.equal(readFileSync(path.join(check.path, "sub", "two.txt"), "utf8"), "two\n");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  assert.equal(treeDigest(canary), before.canary, "the canary folder changed");
  assert.equal(treeDigest(allowed), before.allowed, "the read-only input (or the allowed root) changed");
  for (const n of readdirSync(work)) {
    assert.ok(["allowed", "canary", "out", "state", "state-forged"].includes(n), `${n} appeared in the test folder`);
  }
});

test("FIFOs at stdout.log, stderr.log, an exec log and a job's log: clear errors, the server keeps answering", async () => {
  const stop = pinger(conn);
  // one-shot: the command leaves a FIFO where its log was
  for (const log of ["stdout.log", "stderr.log"]) {
    const r = await call("sandbox_script", { image: "base", command: `echo hi; rm -f /out/${log}; mkfifo /out/${log}` });
    assertClearError(r, new RegExp(`${log.replace(".", "\\.")}.*not a regular file \\(a fifo\\)`), `FIFO at ${log}`);
  }
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    // exec: the command finds its own log through /proc/self/fd/1 and swaps it
    const r = await call("sandbox_exec", { sandbox_id: sb.sandbox_id,
      command: 'f=$(readlink /proc/$$/fd/1); echo out; rm "$f"; mkfifo "$f"' });
    assertClearError(r, /stdout\.log.*fifo/, "FIFO at an exec's stdout.log");
    const l = await call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: 'ln -sf /etc/shadow "$(readlink /proc/$$/fd/2)"' });
    assertClearError(l, /stderr\.log.*symlink/, "a link at an exec's stderr.log");
    // a background job's log, swapped after it ended
    const j = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, background: true, command: "echo job-out" });
    const w = await ok("sandbox_wait", { job_id: j.job_id, timeout_seconds: 60 });
    assert.equal(w.stdout, "job-out\n");
    const rel = path.relative(sb.output_dir, j.log_dir);
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `rm /out/${rel}/stdout.log; mkfifo /out/${rel}/stdout.log` });
    assertClearError(await call("sandbox_status", { job_id: j.job_id, since: 0 }), /stdout\.log.*fifo/, "sandbox_status since");
    assertClearError(await call("sandbox_status", { job_id: j.job_id, include_stdout_tail: true }), /stdout\.log.*fifo/, "sandbox_status tail");
    assertClearError(await call("sandbox_wait", { job_id: j.job_id, timeout_seconds: 1 }), /stdout\.log.*fifo/, "sandbox_wait");
    // a FIFO at the xfer folder's place: the transfer is refused, nothing blocks
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "rm -rf /.demesne/run/xfer; mkfifo /.demesne/run/xfer; echo x > /tmp/x" });
    assertClearError(await call("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/x" }), /xfer/, "FIFO as xfer");
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "rm -f /.demesne/run/xfer; rm -rf /out/downloads; mkfifo /out/downloads" });
    assertClearError(await call("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/x" }), /downloads/, "FIFO as downloads");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  assertResponsive(await stop(), "FIFO attacks");
});

test("a 100 GiB sparse file under a 10 MiB download_max_bytes is refused; no more than the ceiling is written", async () => {
  const MAX = 10 * 1024 * 1024;
  const c = await connect({ env: { ...env, DEMESNE_DOWNLOAD_MAX_BYTES: String(MAX) }, fixtures: false });
  try {
    const sb = await okOn(c, "sandbox_create", { image: "base" });
    try {
      await okOn(c, "sandbox_exec", { sandbox_id: sb.sandbox_id, command:
        "truncate -s 100G /tmp/sparse && mkdir -p /tmp/mix && truncate -s 100G /tmp/mix/hole && echo small > /tmp/mix/small" });
      const stop = pinger(c);
      for (const src of ["/tmp/sparse", "/tmp/mix"]) {
        const r = await callOn(c, "sandbox_download", { sandbox_id: sb.sandbox_id, src });
        assertClearError(r, /download_max_bytes|max_bytes/, `sparse ${src}`);
      }
      assertResponsive(await stop(), "sparse downloads");
      const out = sb.output_dir;
      assert.ok(diskBytes(out) <= MAX, `the output folder holds ${diskBytes(out)} bytes, over the ceiling`);
      const dl = path.join(out, "downloads");
      if (existsSync(dl)) assert.deepEqual(readdirSync(dl), [], "nothing left in downloads");
      const runDir = path.join(work, "state", "run", sb.sandbox_id);
      assert.deepEqual(readdirSync(path.join(runDir, "xfer")), [], "no staging tar left in the run folder");
      // a small file still comes through
      await okOn(c, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo fine > /tmp/fine" });
      const d = await okOn(c, "sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/fine" });
      assert.equal(readFileSync(d.path, "utf8"), "fine\n");
    } finally {
      await okOn(c, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
    }
  } finally {
    await c.client.close();
  }
});

test("a 1500-deep folder: the download is refused naming the depth, destroy removes it, the server answers throughout", async () => {
  const before = treeDigest(canary);
  const sb = await ok("sandbox_create", { image: "base" });
  const runDir = path.join(work, "state", "run", sb.sandbox_id);
  try {
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command:
      // (not in /out: a folder there too deep to measure stops the sandbox, its output quota's
      // rule, tests/lua/quota_test.lua)
      'p=$(printf "d/%.0s" $(seq 1500)); for r in /tmp/deep /.demesne/run/deep; do '
      + 'mkdir -p "$r/$p" && echo bottom > "$r/$p/f"; done; '
      + `ln -s ${canary} /.demesne/run/deep/d/d/canary; ln -s ${canary} /.demesne/run/deep/canary; echo made` });
    const stop = pinger(conn);
    for (let i = 0; i < 3; i++) {
      const r = await call("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/deep" });
      assertClearError(r, /more than 256 levels deep/, "1500-deep download");
      assert.match(r.content[0].text, /d\/d\/d/, "the message names the path");
    }
    assertResponsive(await stop(), "the deep download");
    assert.deepEqual(readdirSync(path.join(sb.output_dir, "downloads")), [], "nothing half-extracted is left");
  } finally {
    const stop = pinger(conn);
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
    assertResponsive(await stop(), "destroying a sandbox with a 1500-deep run folder");
  }
  assert.ok(!existsSync(runDir), "the 1500-deep run folder was removed");
  assert.equal(treeDigest(canary), before, "the links to the canary were removed, not followed");
});

// A job record as lua/jobs/ writes it, owned by a server that is gone.
function forgeRecord(stateDir, rec) {
  const id = `job-20260101T000000Z-${randomBytes(5).toString("hex")}`;
  const full = { job_id: id, status: "running", owner: `${hostname()}/999999999/1`, started_ms: Date.now(),
    timeout_seconds: 60, children: [], command: "forged", ...rec };
  mkdirSync(path.join(stateDir, "jobs"), { recursive: true });
  writeFileSync(path.join(stateDir, "jobs", `${id}.json`), JSON.stringify(full) + "\n", { mode: 0o600 });
  return id;
}

async function waitTerminal(c, id) {
  for (let i = 0; i < 100; i++) {
    const s = await okOn(c, "sandbox_status", { job_id: id });
    if (s.status !== "running") return s;
    await sleep(300);
  }
  throw new Error(`job ${id} never ended`);
}

test("a restarted server adopts jobs whose status.json, usage.json and results.json are FIFOs or forged", async () => {
  const state = path.join(work, "state-forged");
  const senv = { ...env, DEMESNE_STATE_DIR: state, ANTHROPIC_API_KEY: "sk-test-not-real" };
  const a = await connect({ env: senv, fixtures: false });
  const sb = await okOn(a, "sandbox_create", { image: "base" });
  let b;
  try {
    // from inside: a FIFO and forged records where a restarted server reads exit statuses,
    // a FIFO at usage.json (read back by the agent job's vendor route) and at results.json
    const big = "x".repeat(2 * 1024 * 1024);
    await okOn(a, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: [
      "cd /.demesne/run && mkdir -p exec/fifo exec/str exec/huge-code exec/float exec/types exec/big exec/link exec/notjson",
      "mkfifo exec/fifo/status.json",
      `echo '{"exit_code":"abc"}' > exec/str/status.json`,
      `echo '{"exit_code":1e300}' > exec/huge-code/status.json`,
      `echo '{"exit_code":0.5}' > exec/float/status.json`,
      `echo '{"exit_code":0,"timed_out":"yes","signal":"KILL"}' > exec/types/status.json`,
      `head -c ${big.length} /dev/zero | tr '\\0' x > exec/big/status.json`,
      "ln -s /etc/passwd exec/link/status.json",
      "echo '{exit' > exec/notjson/status.json",
      "mkfifo /out/usage.json /out/transcript.jsonl",
      "mkdir -p /out/r && mkfifo /out/r/results.json",
      "echo planted"].join(" && ") });
    await a.client.close();

    const runDir = path.join(state, "run", sb.sandbox_id);
    const execJob = (execId) => forgeRecord(state, { tool: "sandbox_exec", kind: "exec", exec_id: execId,
      output_dir: sb.output_dir, log_dir: path.join(sb.output_dir, "exec", execId), run_dir: runDir,
      container: `demesne-${sb.sandbox_id}`, sandbox_id: sb.sandbox_id });
    const expect = {
      fifo: /status\.json: not a regular file \(a fifo\)/,
      str: /exit_code is not an integer/,
      "huge-code": /exit_code is not an integer/,
      float: /exit_code is not an integer/,
      types: /timed_out is not a boolean/,
      big: /more than the 65536/,
      link: /symlink/,
      notjson: /not JSON/,
    };
    const ids = Object.fromEntries(Object.keys(expect).map((k) => [k, execJob(k)]));
    // an agent job: the route it restarts reads usage.json (a FIFO) before initialize is answered
    const agentRun = path.join(state, "run", "forged-agent");
    mkdirSync(agentRun, { recursive: true });
    const agentId = forgeRecord(state, { tool: "sandbox_agent", kind: "agent", exec_id: "main", run_id: "forged-agent",
      output_dir: sb.output_dir, log_dir: sb.output_dir, run_dir: agentRun, container: "demesne-forged-agent-gone",
      provider: "claude_code", model: "claude-sonnet-4-5", vendor_token: "dmsn-forged", stdout_file: "transcript.jsonl" });
    // a finished agent job whose results.json is a FIFO
    const doneId = forgeRecord(state, { tool: "sandbox_agent", kind: "agent", status: "succeeded", exit_code: 0,
      finished_ms: Date.now(), exec_id: "main", run_id: "forged-done", output_dir: path.join(sb.output_dir, "r"),
      log_dir: path.join(sb.output_dir, "r"), run_dir: path.join(state, "run", "forged-done"), container: "x" });

    const t0 = Date.now();
    b = await connect({ env: senv, fixtures: false }); // initialize answered
    assert.ok(Date.now() - t0 < 30_000, `initialize took ${Date.now() - t0} ms`);
    const stop = pinger(b);
    for (const [k, re] of Object.entries(expect)) {
      const s = await waitTerminal(b, ids[k]);
      assert.equal(s.status, "failed", `${k}: ${JSON.stringify(s)}`);
      assert.match(s.reason, re, k);
      assert.ok(!/lua\/|traceback|attempt to/.test(s.reason), `${k}: ${s.reason}`);
      assert.equal(s.exit_code, undefined, `${k}: no exit code is made up`);
    }
    const ag = await waitTerminal(b, agentId);
    assert.notEqual(ag.status, "succeeded", JSON.stringify(ag));
    const done = await okOn(b, "sandbox_status", { job_id: doneId });
    assert.equal(done.agent?.is_error, true, JSON.stringify(done));
    assert.match(done.agent.reason, /results\.json.*fifo/);
    assertResponsive(await stop(), "forged records after a restart");
    // the FIFO at usage.json was never opened: it was replaced by the route's totals
    assert.ok(lstatSync(path.join(sb.output_dir, "usage.json")).isFile());
  } finally {
    const c = b || await connect({ env: senv, fixtures: false });
    await okOn(c, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
    await c.client.close();
  }
});
