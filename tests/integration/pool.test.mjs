// The warm pool (lua/pool.lua) and demesne-init's control socket over MCP against a real
// engine: a call takes a warm sandbox and sees a fresh one, no sandbox is handed out
// twice, a warm sandbox that dies is replaced, a call that finds the pool empty makes its
// own, a pooled sandbox has exactly the egress and limits its call asked for, a server
// killed with SIGKILL leaves nothing behind (its exit reaper removes it), and a sandbox
// can neither use the control socket itself nor lead the host elsewhere through it. The
// engine comes from DEMESNE_ENGINE.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { connect, exitReaperOf, isReady, sessionOf } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const work = mkdtempSync(path.join(tmpdir(), "demesne-pool-"));
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_POOL_IMAGES: "base",
  DEMESNE_POOL_SIZE: "2",
  DEMESNE_MEMORY_MB_MAX: "4096",
};
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

async function ok(c, name, args) {
  const res = await c.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
function engine(method, p, body) {
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
async function containers(label) {
  const filters = encodeURIComponent(JSON.stringify({ label: [label] }));
  return (await engine("GET", `/containers/json?all=true&filters=${filters}`)).body;
}
// this file's containers (their run folders are under `work`)
const ours = async () => (await containers("io.demesne.managed=1"))
  .filter((c) => (c.Labels["io.demesne.run_dir"] || "").startsWith(work));

// The warm sandboxes of the server whose pid is `pid`, ready for a call, whose labels
// match `want`; waits (at most 60 s) until there are `n` of them.
async function warm(n, want = {}, pid = conn.transport.pid) {
  let list = [];
  for (let i = 0; i < 240; i++) {
    list = (await ours()).filter((c) => isReady(c) && c.State === "running"
      && (c.Labels["io.demesne.owner"] || "").split("/")[1] === String(pid)
      && Object.entries(want).every(([k, v]) => c.Labels[`io.demesne.${k}`] === v));
    if (list.length >= n) return list;
    await sleep(250);
  }
  throw new Error(`only ${list.length} of ${n} warm sandboxes (${JSON.stringify(want)}) appeared`);
}
const runIds = (list) => new Set(list.map((c) => c.Labels["io.demesne.run_id"]));

// What a command sees of its sandbox: the processes (their names), /tmp, /out, its env.
// (processes outside the command's own session: the command's shell leads a new one)
const LOOK = `cd /proc; for p in [0-9]*; do read -r st < $p/stat 2>/dev/null || continue; set -- \${st##*) };
    [ "$4" = "$$" ] || { read -r c < $p/comm; echo "proc $c"; }; done | sort;
  ls -A /tmp | sed 's/^/tmp /'; ls -A /out | sed 's/^/out /' | sort; env | grep -v '^DEMESNE_RUN_ID=' | sort | sed 's/^/env /'`;

test("a call takes a warm sandbox and sees what a fresh one shows: no earlier process, clean /tmp, own /out and env", async () => {
  const pre = runIds(await warm(2, { image: "base" }));
  const pooled = await ok(conn, "sandbox_script", { command: LOOK, image: "base", env: { CALLER: "mine" } });
  assert.ok(pre.has(pooled.run_id), "the call ran in a warm sandbox");
  const fresh = await connect({ env: { ...env, DEMESNE_POOL_SIZE: "0" }, fixtures: false });
  let plain;
  try {
    plain = await ok(fresh, "sandbox_script", { command: LOOK, image: "base", env: { CALLER: "mine" } });
  } finally {
    await fresh.client.close();
  }
  assert.equal(pooled.exit_code, 0, pooled.stderr);
  assert.equal(pooled.stdout, plain.stdout, "the same processes, /tmp, /out and environment as a fresh sandbox");
  assert.match(pooled.stdout, /^env CALLER=mine$/m, "the caller's environment reached the command");
  assert.match(pooled.stdout, /^proc init$/m, "demesne-init is there");
  assert.doesNotMatch(pooled.stdout, /^tmp /m, "/tmp is empty");
  assert.deepEqual(pooled.stdout.match(/^proc .*$/gm), ["proc demesne-relay", "proc init"],
    "no process outside the command's own but demesne-init and its relay");
  assert.equal(pooled.output_dir, path.join(work, "out", pooled.run_id), "its own output folder");
  assert.equal(readFileSync(path.join(pooled.output_dir, "stdout.log"), "utf8"), pooled.stdout);
});

test("no warm sandbox is handed out twice; each call gets a new one", async () => {
  const seen = new Set();
  for (let i = 0; i < 5; i++) {
    const pre = runIds(await warm(1, { image: "base" }));
    const r = await ok(conn, "sandbox_script", { image: "base", command: "test -e /tmp/used && echo REUSED; touch /tmp/used /out/used" });
    assert.equal(r.stdout, "", `call ${i}: a new filesystem`);
    assert.ok(pre.has(r.run_id), `call ${i} took a warm sandbox`);
    assert.ok(!seen.has(r.run_id), `call ${i}: never one handed out before`);
    seen.add(r.run_id);
  }
  for (const id of seen) {
    let left = [];
    for (let i = 0; i < 40; i++) {
      left = await containers(`io.demesne.run_id=${id}`);
      if (left.length === 0) break;
      await sleep(250);
    }
    assert.deepEqual(left, [], `${id} was removed after its call`);
  }
});

test("a warm sandbox killed while it waits is replaced, and no call gets it", async () => {
  const list = await warm(2, { image: "base" });
  const victim = list[0];
  const id = victim.Labels["io.demesne.run_id"];
  assert.ok([204, 304].includes((await engine("POST", `/containers/${victim.Id}/kill?signal=KILL`)).status));
  let gone = false;
  for (let i = 0; i < 120 && !gone; i++) {
    await sleep(250);
    gone = (await containers(`io.demesne.run_id=${id}`)).length === 0;
  }
  assert.ok(gone, "the dead sandbox was removed");
  const now = runIds(await warm(2, { image: "base" }));
  assert.ok(!now.has(id), "and replaced by another");
  // (its folders go right after its container)
  for (let i = 0; i < 40 && existsSync(path.join(work, "out", id)); i++) await sleep(250);
  assert.ok(!existsSync(path.join(work, "out", id)), "its unused output folder is gone");
  assert.ok(!existsSync(path.join(work, "state", "pool", id)), "and its marker");
  const r = await ok(conn, "sandbox_script", { image: "base", command: "echo alive" });
  assert.equal(r.stdout, "alive\n");
  assert.notEqual(r.run_id, id);
});

test("a call that finds the pool empty makes a fresh sandbox", async () => {
  const c = await connect({ env: { ...env, DEMESNE_POOL_SIZE: "1" }, fixtures: false });
  try {
    const pre = runIds(await warm(1, { image: "base" }, c.transport.pid));
    const results = await Promise.all([0, 1, 2].map((i) =>
      ok(c, "sandbox_script", { image: "base", command: `sleep 1; echo call-${i}` })));
    results.forEach((r, i) => assert.equal(r.stdout, `call-${i}\n`));
    const pooled = results.filter((r) => pre.has(r.run_id));
    assert.equal(pooled.length, 1, "one took the warm sandbox");
    assert.equal(new Set(results.map((r) => r.run_id)).size, 3, "the others made their own");
  } finally {
    await c.client.close();
  }
});

test("a warm sandbox has exactly the egress policy and limits of the call that takes it", async () => {
  const kind = { image: "base", egress: "none", limits: { memory_mb: 320, cpus: 0.5, pids: 77 } };
  const LIMITS = `cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes;
    cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max;
    curl -s -o /dev/null -w '%{http_code}\\n' http://blocked.invalid/ || true`;
  const first = await ok(conn, "sandbox_script", { ...kind, command: LIMITS }); // teaches the pool this kind
  const list = await warm(2, { image: "base", egress: "none" });
  for (const c of list) {
    const hc = (await engine("GET", `/containers/${c.Id}/json`)).body.HostConfig;
    assert.deepEqual([hc.Memory, hc.NanoCpus, hc.PidsLimit, hc.NetworkMode], [320 * 1024 * 1024, 5e8, 77, "none"],
      "the warm sandbox's limits and network");
  }
  const r = await ok(conn, "sandbox_script", { ...kind, command: LIMITS });
  assert.ok(runIds(list).has(r.run_id), "the second call of this kind took a warm one");
  assert.notEqual(r.run_id, first.run_id);
  assert.deepEqual(r.stdout, first.stdout, "inside, the same limits as the fresh first call");
  assert.match(r.stdout, new RegExp(`^${320 * 1024 * 1024}\\n77\\n403\\n$`), "memory, pids, and the proxy refusing");
  const log = readFileSync(path.join(r.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
  assert.deepEqual(log.map((e) => [e.host, e.verdict, e.rule]), [["blocked.invalid", "deny", "none:default-deny"]],
    "the call's own policy judged it, in its own egress.jsonl");
  const other = await ok(conn, "sandbox_script", { image: "base", command: LIMITS });
  assert.ok(!runIds(list).has(other.run_id), "a call of another kind never gets one of these");
  assert.match(other.stdout, /^2147483648\n1024\n/, "it has the default limits");
});

test("a server killed with SIGKILL leaves nothing behind: its exit reaper removes the warm sandboxes at once", async () => {
  const state = path.join(work, "state-kill");
  const kenv = { ...env, DEMESNE_STATE_DIR: state, DEMESNE_OUTPUT_ROOT: path.join(work, "out-kill") };
  const a = await connect({ env: kenv, fixtures: false });
  const warmA = runIds(await warm(2, { image: "base" }, a.transport.pid));
  const claimed = await ok(a, "sandbox_script", { image: "base", command: "echo kept > /out/result.txt" });
  // the exit reaper runs beside the server, in a session of its own: a client that signals
  // the server's process group (Codex does) does not reach it
  const pidA = a.transport.pid;
  const reaper = exitReaperOf(pidA);
  assert.ok(reaper, "the server started its exit reaper");
  assert.notEqual(reaper.sid, sessionOf(pidA), "in a session of its own");
  a.transport._process.kill("SIGKILL");
  // no next server: what the dead one left goes anyway
  const ids = [...warmA].filter((id) => id !== claimed.run_id);
  let left = [];
  for (let i = 0; i < 120; i++) {
    left = (await containers("io.demesne.managed=1")).filter((c) => warmA.has(c.Labels["io.demesne.run_id"])
      || (c.Labels["io.demesne.run_dir"] || "").startsWith(state));
    if (left.length === 0) break;
    await sleep(250);
  }
  assert.deepEqual(left.map((c) => c.Names), [], "the dead server's warm sandboxes (and the one refilled) are removed");
  const anyLeft = () => ids.some((id) => ["out-kill", "state/run", "state/pool"].some((d) =>
    existsSync(path.join(work, d.replace("state", "state-kill"), id))));
  for (let i = 0; i < 40 && anyLeft(); i++) await sleep(250);
  for (const id of ids) {
    assert.ok(!existsSync(path.join(work, "out-kill", id)), `${id}: no empty output folder`);
    assert.ok(!existsSync(path.join(state, "run", id)), `${id}: no run folder`);
    assert.ok(!existsSync(path.join(state, "pool", id)), `${id}: no marker`);
  }
  assert.equal(readFileSync(path.join(claimed.output_dir, "result.txt"), "utf8"), "kept\n", "a call's output is kept");
  for (let i = 0; i < 120 && exitReaperOf(pidA); i++) await sleep(250); // its last pass runs 15 s after the end
  assert.equal(exitReaperOf(pidA), null, "the exit reaper has exited");
  const said = readFileSync(path.join(state, "exit-reaper.log"), "utf8");
  assert.match(said, new RegExp(`the server [^ ]*/${pidA}/\\d+ has ended: [1-9]\\d* container\\(s\\) removed`));
  for (const id of ids) assert.match(said, new RegExp(`removed ${id} \\(owner gone\\)`));

  // the next server has its own, and a graceful stop removes them (its exit reaper then finds nothing)
  const b = await connect({ env: kenv, fixtures: false });
  try {
    const mine = await warm(2, { image: "base" }, b.transport.pid);
    assert.equal(mine.filter((c) => warmA.has(c.Labels["io.demesne.run_id"])).length, 0, "the new server has its own");
  } finally {
    await b.client.close();
  }
  const afterStop = (await containers("io.demesne.managed=1"))
    .filter((c) => (c.Labels["io.demesne.run_dir"] || "").startsWith(state));
  assert.deepEqual(afterStop.map((c) => c.Names), [], "a graceful stop removes the warm sandboxes");
});

test("the control socket: a process in the sandbox cannot use it, and a link planted there is never followed", async () => {
  const sb = await ok(conn, "sandbox_create", { image: "base" });
  try {
    // a well-formed run request, sent from inside the sandbox
    const inside = `perl -MIO::Socket::UNIX -e '
      $SIG{PIPE} = "IGNORE"; # demesne-init may have closed the connection before the write
      my $s = IO::Socket::UNIX->new(Peer => "/.demesne/run/init.sock") or do { print "noconnect\\n"; exit };
      my @p = ("run", "7", "--id", "evil", "--dir", "/.demesne/run/exec/evil", "--", "touch", "/out/evil", "0");
      my $pl = join("\\0", @p) . "\\0";
      syswrite($s, "DMI1" . pack("N", length($pl)) . $pl);
      my ($r, $b) = ("", "");
      while (sysread($s, $b, 4096)) { $r .= $b }
      print $r eq "" ? "refused\\n" : "answered: $r\\n";'`;
    const r = await ok(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: inside });
    assert.equal(r.stdout, "refused\n", r.stderr);
    await sleep(300);
    assert.ok(!existsSync(path.join(sb.output_dir, "evil")), "the request from inside ran nothing");
    // the socket replaced by a link to another socket: the host never connects through it
    await ok(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id,
      command: "rm /.demesne/run/init.sock && ln -s /.demesne/run/egress.sock /.demesne/run/init.sock" });
    const after = await ok(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo still; ls -l /.demesne/run/init.sock | cut -c1" });
    assert.equal(after.stdout, "still\nl\n", "the command ran (through the engine's exec API) and the link is still a link");
    assert.equal(after.exit_code, 0);
  } finally {
    await ok(conn, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});
