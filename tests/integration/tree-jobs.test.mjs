// Nested sandboxes: what a child can no longer do to the host or to its parent (issue 23),
// over MCP (the official SDK client on the host, stdio) against a real container engine,
// driven by script orchestrators (tests/fixtures/tree-jobs, calling the in-sandbox endpoint
// with tests/fixtures/tree/mcp-client.py):
//   * background jobs of a tree are bounded: tree.jobs running at once, tree.job_records
//     kept (the tree's oldest finished records go first), refused naming the limit;
//   * a research child's /out is not visible to its parent (/out/child/<name>) nor to a
//     later sibling (/in/previous-jobs) while it runs, so a unix socket bound there is no
//     live channel; it is handed over when the child ends (its agent played by the
//     scripted vendor, tests/integration/scripted-vendor.mjs, on 127.0.0.1);
//   * a script node's final usage.json holds the host's numbers, not what the sandbox wrote.
// The engine comes from DEMESNE_ENGINE (run the file once per engine).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, ROOT } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const FIX = path.join(ROOT, "tests/fixtures/tree");
const JOBS_FIX = path.join(ROOT, "tests/fixtures/tree-jobs");
const SECRET = "sk-test-tree-jobs-0123456789";
const work = mkdtempSync(path.join(tmpdir(), "demesne-tree-jobs-"));
const STATE = path.join(work, "state");
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const INPUTS = { directories: [FIX, JOBS_FIX], image: "default", egress: "none" };
const read = (...p) => readFileSync(path.join(...p), "utf8");

let conn, vendor;
before(async () => {
  vendor = await startVendor({ secret: SECRET });
  conn = await connect({ fixtures: false, env: {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: STATE,
    DEMESNE_ALLOWED_PATHS: `${FIX}:${JOBS_FIX}`, DEMESNE_PROGRESS_INTERVAL: "1", DEMESNE_JOBS_POLL_INTERVAL: "0.5",
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", DEMESNE_CODEX_ENABLED: "false",
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  } });
});
after(async () => {
  await conn?.client.close();
  await vendor?.close();
  const left = (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(work));
  rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

async function ok(name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}\n${conn.stderr().slice(-3000)}`);
  return res.structuredContent;
}

// the job records in the state folder of the jobs run in sandbox `id`
function recordsOf(id) {
  const dir = path.join(STATE, "jobs");
  return readdirSync(dir).filter((f) => f.endsWith(".json"))
    .map((f) => JSON.parse(read(dir, f))).filter((r) => r.sandbox_id === id).map((r) => r.job_id).sort();
}

test("background jobs of a tree are bounded: tree.jobs running at once, tree.job_records kept", async () => {
  const root = await ok("sandbox_create", { ...INPUTS, mcp: true, tree: { jobs: 2, job_records: 4 } });
  const out = root.output_dir;
  const run = await ok("sandbox_exec", { sandbox_id: root.sandbox_id, command: "sh /in/tree-jobs/execs.sh",
    timeout_seconds: 300 });
  assert.equal(run.exit_code, 0, run.stderr);
  assert.match(read(out, "refuse-running.txt"),
    /this tree already runs 2 background jobs, its limit \(tree\.jobs\); wait for one to end/);
  assert.deepEqual(read(out, "short-status.txt").trim().split("\n"), Array(6).fill("succeeded"));
  const [long1, long2] = read(out, "long.txt").trim().split(" ");
  const short = read(out, "short.txt").trim().split("\n");
  assert.equal(short.length, 6);
  // 2 cancelled + 6 short ones started, 4 kept: the newest four, the oldest finished gone
  const seen = JSON.parse(read(out, "jobs.json")).jobs.map((j) => j.job_id).sort();
  assert.deepEqual(seen, short.slice(2).sort(), "the root sees the four kept records");
  const box = JSON.parse(read(out, "jobs.json")).jobs[0].sandbox_id;
  assert.deepEqual(recordsOf(box), short.slice(2).sort(), "the state folder keeps four records of the tree");
  for (const gone of [long1, long2, short[0], short[1]]) {
    const res = await conn.client.callTool({ name: "sandbox_status", arguments: { job_id: gone } });
    assert.equal(res.isError, true, `${gone} is gone`);
    assert.match(res.content[0].text, /no job .* \(unknown, or its record was pruned/);
  }
  await ok("sandbox_destroy", { sandbox_id: root.sandbox_id });
});

test("a research child's /out is not reachable while it runs (no live socket to its parent), and is handed over when it ends", async () => {
  // the research child's plan: write a file, bind a unix socket in /out, answer every
  // connection for 8 s, then end
  const server = [
    "use IO::Socket::UNIX;",
    'my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Local => "/out/s.sock", Listen => 5) or die "bind: $!";',
    '$SIG{ALRM} = sub { exit 0 }; alarm 8;',
    'while (my $c = $s->accept) { print $c "hello from the research child\\n";',
    '  open(my $f, ">>", "/out/accepted.txt"); print $f "accepted\\n"; close $f; close $c }',
  ].join("\n");
  const b64 = Buffer.from(server).toString("base64");
  vendor.plan("sock", [
    { shell: `echo ready > /out/ready.txt && echo ${b64} | base64 -d > /tmp/serve.pl && perl /tmp/serve.pl; echo served` },
    { final: "socket served" },
  ], { input: 10, output: 5 });
  const root = await ok("sandbox_script", { ...INPUTS, mcp: true, command: "sh /in/tree-jobs/research-parent.sh",
    timeout_seconds: 400 });
  assert.equal(root.exit_code, 0, root.stderr);
  const out = root.output_dir;
  assert.equal(read(out, "research-status.txt").trim(), "succeeded");
  const probe = JSON.parse(read(out, "probe.json"));
  assert.ok(probe.polls > 0, "the parent looked while the child ran");
  assert.deepEqual(probe.seen_while_running, [], "nothing of the child's /out is visible in /out/child/web while it runs");
  assert.equal(probe.connected, false, `the parent could not connect to the child's socket (${probe.received})`);
  assert.ok(!existsSync(path.join(out, "child/web/accepted.txt")), "no connection reached the child");
  assert.equal(probe.peek, 0, "the sibling ran");
  assert.doesNotMatch(read(out, "child/peek/previous-jobs.txt"), /web/, "a later sibling does not see it either");
  // handed over: the parent saw it after the end, where the host reads it
  const after = read(out, "after.txt").trim().split("\n");
  for (const f of ["ready.txt", "s.sock", "results.json", "transcript.jsonl", "usage.json"]) {
    assert.ok(after.includes(f), `${f} is in /out/child/web after the end (${after})`);
  }
  assert.equal(read(out, "child/web/ready.txt"), "ready\n");
  const results = JSON.parse(read(out, "results.json"));
  const web = results.children.find((c) => c.name === "web");
  assert.deepEqual([web.kind, web.status, web.output_dir], ["research", "succeeded", path.join(out, "child/web")]);
  assert.ok(!existsSync(path.join(work, "out", web.run_id)), "nothing is left where it ran");
  const status = await ok("sandbox_status", { job_id: read(out, "research-job.txt").trim() });
  assert.equal(status.output_dir, path.join(out, "child/web"), "the job's record follows the folder");
  assert.equal(status.agent?.answer, "socket served", "its results.json is read where it now is");
});

test("a script node's final usage.json holds the host's numbers, not what the sandbox wrote", async () => {
  const fake = JSON.stringify({ cost_usd: 999, input: 5, models: { forged: { requests: 1, cost_usd: 999 } } });
  const root = await ok("sandbox_script", { ...INPUTS, mcp: true, command:
    `echo '${fake}' > /out/usage.json && python3 /in/tree/mcp-client.py sandbox_script '{"name":"kid","command":"true"}'` });
  assert.equal(root.exit_code, 0, root.stderr);
  const usage = JSON.parse(read(root.output_dir, "usage.json"));
  assert.equal(usage.cost_usd, 0, "the host's cost of a script node");
  assert.equal(usage.input, 0);
  assert.deepEqual(usage.models, {});
  assert.deepEqual([usage.subtree.nodes, usage.subtree.cost_usd], [2, 0]);
});

// The output quota is the root's, a research child's folder of its own included while it runs
// (it is under the output root, outside the root's folder, until it is handed over)
test("a research child's /out counts against its root's output quota while it runs", async () => {
  const MB = 1024 * 1024;
  vendor.plan("fill", [
    // 30 MB: under the quota on its own (its own watch does not stop it), over it with the root's 30 MB
    { shell: "head -c 30000000 /dev/zero > /out/data && echo wrote; sleep 30" },
    { final: "filled" },
  ], { input: 10, output: 5 });
  const c = await connect({ fixtures: false, env: {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out-quota"), DEMESNE_STATE_DIR: path.join(work, "state-quota"),
    DEMESNE_ALLOWED_PATHS: `${FIX}:${JOBS_FIX}`, DEMESNE_OUTPUT_MAX_BYTES: String(50 * MB), DEMESNE_POOL_SIZE: "0",
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", DEMESNE_CODEX_ENABLED: "false",
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  } });
  try {
    const spawn = JSON.stringify({ name: "filler", prompt: "Fill /out. PLAN:fill", model: "sonnet", timeout_seconds: 120 });
    const res = await c.client.callTool({ name: "sandbox_script", arguments: { ...INPUTS, mcp: true, timeout_seconds: 150,
      command: `head -c 30000000 /dev/zero > /out/mine && python3 /in/tree/mcp-client.py sandbox_research '${spawn}' > /out/filler.json; echo child-done; sleep 60` } },
    undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const root = res.structuredContent;
    assert.equal(root.reason, "output quota exceeded", JSON.stringify(root));
    assert.doesNotMatch(root.stdout, /child-done/, "the root was stopped while its research child wrote");
    assert.ok(root.output_quota.written_bytes > 50 * MB, String(root.output_quota.written_bytes));
  } finally {
    await c.client.close();
  }
});
