// Nested sandboxes over MCP (the official SDK client on the host, stdio) against a real
// container engine, driven by SCRIPT orchestrators: sandboxes made with mcp: true whose
// commands call the in-sandbox endpoint to spawn children and grandchildren, with the
// official SDK client (tests/fixtures/tree/sdk-call.mjs, this suite's node_modules mounted
// read-only: the sandbox has no network) and a standard-library Python client
// (tests/fixtures/tree/mcp-client.py) for revision 2026-07-28, a wrong token and a forged header. Checks the tree's outputs (/out/child/<name>), inheritance (/in,
// /workspace, /in/previous-jobs), results.json and sandbox_usage_report, the refusals (depth,
// duplicate name, open egress, ids outside the subtree, a wrong or another run's token, a
// forged header, a planted child/<name> link), a host cancel of the root, a parent that
// ends, a server killed with SIGKILL mid-tree, and that nothing is left behind.
// The engine comes from DEMESNE_ENGINE (run the file once per engine).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { connect, isWarm, ROOT } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const FIX = path.join(ROOT, "tests/fixtures/tree");
const work = mkdtempSync(path.join(tmpdir(), "demesne-tree-"));
const DATA = path.join(work, "data");
mkdirSync(DATA);
writeFileSync(path.join(DATA, "in.txt"), "input from the host\n");
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_ALLOWED_PATHS: `${FIX}:${DATA}:${path.join(ROOT, "tests/integration/node_modules")}`,
  DEMESNE_PROGRESS_INTERVAL: "1",
  DEMESNE_JOBS_POLL_INTERVAL: "0.5",
};
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const MODULES = path.join(ROOT, "tests/integration/node_modules"); // the official SDK, for sdk-call.mjs inside
const INPUTS = { directories: [FIX, DATA, MODULES], image: "default" };

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

async function callOn(c, name, args) { return c.client.callTool({ name, arguments: args }, undefined, LONG); }
async function okOn(c, name, args) {
  const res = await callOn(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
const ok = (name, args) => okOn(conn, name, args);
const read = (...p) => readFileSync(path.join(...p), "utf8");

function engine(method, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: p, method }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve({ status: res.statusCode, body: body ? JSON.parse(body) : null }));
    });
    req.on("error", reject);
    req.end();
  });
}
// containers whose output folder is under `dir` (this file's, or one tree's)
async function containersUnder(dir) {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
  const list = (await engine("GET", `/containers/json?all=true&filters=${filters}`)).body;
  return list.filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir) && !isWarm(c));
}
async function until(what, fn, ms = 60_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(250);
  }
}
const report = (run_id) => ok("sandbox_usage_report", { run_id });

test("a script orchestrator runs a tree: children, a background child with a grandchild, outputs, results and the usage report", async (t) => {
  // another tree, and a job outside both, for the refusals
  const other = await ok("sandbox_create", { mcp: true, image: "base", egress: "none" });
  const outside = await ok("sandbox_script", { image: "base", background: true, command: "sleep 30" });
  const root = await ok("sandbox_create", { ...INPUTS, mcp: true, egress: "none", tree: { depth: 2 } });
  assert.equal(root.mcp.url, "http://127.0.0.1:3130/mcp");
  const out = root.output_dir;
  const t0 = Date.now();
  const run = await ok("sandbox_exec", { sandbox_id: root.sandbox_id, command: "sh /in/tree/orchestrate.sh",
    env: { OTHER_JOB: outside.job_id, OTHER_SANDBOX: other.sandbox_id, OTHER_TOKEN: other.mcp.token },
    timeout_seconds: 400 });
  assert.equal(run.exit_code, 0, run.stderr);
  assert.match(run.stdout, /orchestrated/);
  t.diagnostic(`orchestrator (4 children, a grandchild, 8 refusals) ran in ${Date.now() - t0} ms`);

  // outputs, read by the host where the parent reads them (/out/child/<name>)
  assert.equal(read(out, "child/first/copy.txt"), "input from the host\n", "the child saw the parent's /in");
  assert.equal(read(out, "child/second/prev.txt"), "first\n", "the second child saw the first's output");
  assert.equal(read(out, "child/bg/prev.txt"), "first\nsecond\n");
  assert.equal(read(out, "child/bg/child/grand/ws.txt"), "shared\n", "the grandchild shares the root's /workspace");
  assert.equal(read(out, "bg-status.txt").trim(), "succeeded");
  const first = JSON.parse(read(out, "first.json"));
  assert.equal(first.output_dir, "/out/child/first", "a child sees its children's folders as it mounts them");
  assert.match(read(out, "second.err"), /progress notifications: [1-9]/, "a blocking child call sent progress");
  assert.equal(JSON.parse(read(out, "after-sessions.json")).jobs.length, 1,
    "20 sessions left open by a client do not lock the endpoint");

  // refusals, each with a clear message
  assert.match(read(out, "refuse-duplicate.txt"), /name: "first" is already used by a child of this sandbox/);
  assert.match(read(out, "refuse-open.txt"), /egress: "open" is not permitted for a child sandbox_script/);
  assert.match(read(out, "refuse-job.txt"), new RegExp(`job_id: no job ${outside.job_id} \\(unknown`));
  assert.match(read(out, "refuse-sandbox.txt"), new RegExp(`sandbox_id: no sandbox ${other.sandbox_id}`));
  assert.match(read(out, "refuse-token.txt"), /HTTP 401/);
  assert.match(read(out, "refuse-other-token.txt"), /HTTP 401/, "another run's token does not open this endpoint");
  assert.match(read(out, "child/bg/child/grand/refuse-depth.txt"), /depth 3, below the tree's limit of 2/);
  const forged = JSON.parse(read(out, "jobs-forged.json"));
  assert.deepEqual(forged.jobs.map((j) => j.job_id), [read(out, "bg-job.txt").trim()],
    "a forged header changes nothing: the caller sees its own subtree's job only");
  assert.match(read(out, "plant.txt"), /Read-only file system/, "the parent cannot plant a link in /out/child");
  assert.ok(!read(out, "plant.txt").includes("planted"));
  assert.equal(read(out, "child/evil/real.txt"), "real\n", "the child's folder is a real one");

  // the host destroys the root: results.json and usage.json list the tree
  const host = await ok("sandbox_jobs", {});
  assert.ok(host.jobs.some((j) => j.job_id === read(out, "bg-job.txt").trim()), "the host sees every job");
  await ok("sandbox_destroy", { sandbox_id: root.sandbox_id });
  const results = JSON.parse(read(out, "results.json"));
  // (the refused spawns took no name: they were refused before the child existed)
  assert.deepEqual(results.children.map((c) => [c.name, c.kind, c.status]), [["first", "script", "succeeded"],
    ["second", "script", "succeeded"], ["bg", "script", "succeeded"], ["evil", "script", "succeeded"]]);
  assert.equal(results.children.find((c) => c.name === "first").exit_code, 0);
  assert.equal(results.children.find((c) => c.name === "bg").output_dir, path.join(out, "child/bg"));
  const bgResults = JSON.parse(read(out, "child/bg/results.json"));
  assert.deepEqual(bgResults.children.map((c) => [c.name, c.status]), [["grand", "succeeded"]]);
  const usage = JSON.parse(read(out, "usage.json"));
  assert.equal(usage.subtree.nodes, 6);
  assert.equal(usage.subtree.cost_usd, 0);

  const r = await report(root.sandbox_id);
  assert.deepEqual(r.nodes.map((n) => [n.path, n.depth, n.kind, n.status]), [
    ["", 0, "create", "destroyed"], ["first", 1, "script", "succeeded"], ["second", 1, "script", "succeeded"],
    ["bg", 1, "script", "succeeded"], ["bg/grand", 2, "script", "succeeded"], ["evil", 1, "script", "succeeded"]]);
  assert.equal(r.total_cost_usd, 0);
  assert.deepEqual(r.tokens, { input: 0, output: 0, cache_creation: 0, cache_read: 0 });
  const byJob = await ok("sandbox_usage_report", { job_id: read(out, "bg-job.txt").trim() });
  assert.deepEqual(byJob.nodes.map((n) => n.path), ["", "grand"], "a job's report is its subtree");

  await ok("sandbox_destroy", { sandbox_id: other.sandbox_id });
  await ok("sandbox_cancel", { job_id: outside.job_id });
  assert.deepEqual(await containersUnder(out), [], "no container of the tree is left");
});

test("host cancel of the root mid-run takes the whole tree within seconds", async (t) => {
  const root = await ok("sandbox_script", { ...INPUTS, mcp: true, background: true, egress: "none",
    command: "sh /in/tree/fanout.sh" });
  const out = root.output_dir;
  await until("three running sandboxes", async () => (await containersUnder(out)).filter((c) => c.State === "running").length === 3);
  const bg = JSON.parse(await until("the background child's job", () => existsSync(path.join(out, "bg.json")) && read(out, "bg.json")));
  const live = await ok("sandbox_status", { job_id: root.job_id });
  assert.deepEqual([live.tree.root, live.tree.nodes, live.tree.running, live.tree.cost_usd],
    [root.run_id, 3, 3, 0], "the host sees the running tree and its live cost");
  const started = Date.now();
  const c = await ok("sandbox_cancel", { job_id: root.job_id });
  assert.equal(c.status, "cancelled");
  await until("no container left", async () => (await containersUnder(out)).length === 0, 20_000);
  const took = Date.now() - started;
  t.diagnostic(`cancel of a root with 2 children: every container gone ${took} ms after sandbox_cancel was sent`);
  assert.ok(took < 30_000, `the tree went in ${took} ms`);
  const child = await ok("sandbox_status", { job_id: bg.job_id });
  assert.equal(child.status, "cancelled");
  assert.equal(child.reason, "parent cancelled");
  const r = await report(root.run_id);
  assert.deepEqual(r.nodes.map((n) => [n.path, n.status]),
    [["", "cancelled"], ["bg-sleeper", "cancelled"], ["fg-sleeper", "cancelled"]]);
});

test("a parent that ends takes its running children with it: parent ended", async () => {
  const root = await ok("sandbox_script", { ...INPUTS, mcp: true, egress: "none", command: "sh /in/tree/parent-ends.sh" });
  assert.equal(root.exit_code, 0, root.stderr);
  assert.match(root.stdout, /spawned/);
  const orphan = JSON.parse(read(root.output_dir, "orphan.json"));
  const s = await ok("sandbox_wait", { job_id: orphan.job_id, timeout_seconds: 30 });
  assert.equal(s.status, "cancelled");
  assert.equal(s.reason, "parent ended");
  const results = JSON.parse(read(root.output_dir, "results.json"));
  assert.deepEqual(results.children.map((c) => [c.name, c.status, c.reason]), [["orphan", "cancelled", "parent ended"]]);
  assert.deepEqual(await containersUnder(root.output_dir), []);
});

test("server SIGKILL mid-tree: the restarted server re-attaches the tree and it completes", async () => {
  const state = { DEMESNE_STATE_DIR: path.join(work, "state-restart") };
  const a = await connect({ env: { ...env, ...state }, fixtures: false });
  let b;
  try {
    const root = await okOn(a, "sandbox_script", { ...INPUTS, mcp: true, background: true, egress: "none",
      command: "sh /in/tree/restart.sh", timeout_seconds: 300 });
    const out = root.output_dir;
    const kid = await until("the child spawned", () => existsSync(path.join(out, "spawned")) && read(out, "spawned").trim());
    const pid = a.transport.pid;
    const exited = new Promise((resolve) => a.transport._process.once("exit", resolve));
    process.kill(pid, "SIGKILL");
    await exited;
    await a.client.close().catch(() => {});
    await sleep(2000); // the orchestrator's calls now fail; it retries

    b = await connect({ env: { ...env, ...state }, fixtures: false });
    const s = await okOn(b, "sandbox_wait", { job_id: root.job_id, timeout_seconds: 240 });
    assert.equal(s.status, "succeeded", s.reason);
    assert.equal(read(out, "kid-status.txt").trim(), "succeeded");
    assert.equal(read(out, "summary.txt"), "child-done\n", "the root read its child's output after the restart");
    const k = await okOn(b, "sandbox_status", { job_id: kid });
    assert.equal(k.status, "succeeded");
    const r = await okOn(b, "sandbox_usage_report", { job_id: root.job_id });
    assert.deepEqual(r.nodes.map((n) => [n.path, n.status]), [["", "succeeded"], ["kid", "succeeded"]]);
    await until("no container left", async () => (await containersUnder(out)).length === 0, 20_000);
  } finally {
    await b?.client.close();
  }
});

test("nothing is left behind: containers, workspaces, endpoint sockets", async () => {
  assert.deepEqual(await containersUnder(work), []);
  for (const st of ["state", "state-restart"]) {
    const ws = path.join(work, st, "workspaces");
    assert.deepEqual(existsSync(ws) ? readdirSync(ws) : [], [], `${st}/workspaces`);
    const runs = path.join(work, st, "run");
    const sockets = existsSync(runs) ? readdirSync(runs).filter((d) => existsSync(path.join(runs, d, "mcp.sock"))) : [];
    assert.deepEqual(sockets, [], `${st}: endpoint sockets`);
  }
});
