// Follow-ups continue the run (issue 25): `sandbox_agent {continue: "<run_id>", prompt}` with
// the real Claude Code and Codex CLIs in their real images on a real engine (DEMESNE_ENGINE;
// run the file once per engine) and the scripted vendor of the suite (scripted-vendor.mjs)
// on 127.0.0.1, reached only through each run's vendor route.
//
// Covered: for both CLIs, the continue resumes the CLI's own session (the vendor sees the
// first run's turns in the second run's request: the same plan, its tool result, its final
// answer, and the new prompt) in the same /workspace (a file written in run 1 is read in run
// 2), with the same provider and model, and says which run it continues; sandbox_usage_report
// shows both runs; the first run cannot be continued again (the chain's latest can, in the
// background too).
// Refusals naming `continue`: an unknown run, a run still running, a run whose keep expired
// (workspace_keep_seconds tiny: its folder is gone from the host too), a different model.
// From inside a tree: a script node with mcp: true spawns an agent and continues it (the
// continuation is a new child, the session resumed), and a continue of the first run again
// or of a host run outside its tree is refused. No container is left behind.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, engineRequest, ROOT } from "./helpers.mjs";
import { startVendor, NEW_TURN } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-continue-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const FIX = path.join(ROOT, "tests/fixtures");
const MODULES = path.join(ROOT, "tests/integration/node_modules"); // the official SDK, for sdk-call.mjs inside
const read = (...p) => readFileSync(path.join(...p), "utf8");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

let vendor;
const conns = [];

const engine = (method, p) => engineRequest(ENGINE, method, p);
async function containersUnder(dir) {
  return (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir));
}

before(async () => { vendor = await startVendor({ secret: SECRET }); });

after(async () => {
  for (const c of conns) await c.client.close().catch(() => {});
  await vendor.close();
  const left = await containersUnder(work);
  for (const c of left) await engine("DELETE", `/containers/${c.Id}?force=true`);
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

function serverEnv(name, extra = {}) {
  const base = path.join(work, name);
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(base, "out"), DEMESNE_STATE_DIR: path.join(base, "state"),
    DEMESNE_ALLOWED_PATHS: `${FIX}:${MODULES}`, HOME: path.join(base, "home"),
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendor.port}/openai/v1`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "1", DEMESNE_JOBS_POLL_INTERVAL: "0.5",
    DEMESNE_POOL_SIZE: "0", // no warm sandboxes: every container of this file is a run it checks
    ...extra,
  };
}

async function open(name, extra) {
  const c = await connect({ fixtures: false, env: serverEnv(name, extra) });
  conns.push(c);
  return c;
}

async function call(conn, name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name}: ${res.content?.[0]?.text}\n${conn.stderr().slice(-4000)}`);
  return res.structuredContent;
}

async function refused(conn, args, why) {
  const res = await conn.client.callTool({ name: "sandbox_agent", arguments: args }, undefined, LONG);
  assert.equal(res.isError, true, `refused: ${JSON.stringify(res.structuredContent ?? res.content)}`);
  assert.match(res.content[0].text, why);
}

// Run 1 writes a note in /workspace and answers; the continue (turn 2 of the same session)
// copies the note to /out and answers again.
async function continueRun({ tag, model, cli }) {
  const conn = await open(tag);
  const note = `note-${tag}-${randomBytes(4).toString("hex")}`;
  const id = vendor.plan(tag, [
    { shell: `echo ${note} > /workspace/note.txt && echo wrote` },
    { final: "first done" },
    { shell: "cp /workspace/note.txt /out/seen.txt && echo copied" },
    { final: "second done" },
  ], undefined, { turns: true });
  const p = vendor.plans.get(id);
  const r1 = await call(conn, "sandbox_agent", { prompt: `PLAN:${id} Write the note.`, model, timeout_seconds: 300 });
  assert.equal(r1.exit_code, 0, r1.stderr + conn.stderr().slice(-4000));
  assert.equal(r1.answer, "first done", JSON.stringify(p.taken));
  assert.equal(typeof r1.session_id, "string", `${cli} named its session: ${JSON.stringify(r1)}`);
  assert.equal(r1.continues, undefined, "a first run continues nothing");
  const servedFirst = p.served;

  const r2 = await call(conn, "sandbox_agent", { continue: r1.run_id, prompt: "A reviewer asks: copy the note to /out.",
    timeout_seconds: 300 });
  assert.equal(r2.exit_code, 0, r2.stderr + conn.stderr().slice(-4000));
  assert.equal(r2.continues, r1.run_id, "the result names the run it continues");
  assert.notEqual(r2.run_id, r1.run_id, "a continue is a run of its own");
  assert.deepEqual([r2.provider, r2.model], [r1.provider, r1.model], "the same provider and model");
  assert.equal(r2.answer, "second done", JSON.stringify(p.taken));
  // the same workspace: run 1's file, read in run 2
  assert.equal(read(r2.output_dir, "seen.txt").trim(), note);
  // the session resumed: the second run's requests carry the first run's turns
  assert.ok(p.served > servedFirst, "the second run asked the vendor");
  assert.deepEqual(p.results.slice(0, 2).map((x, i) => (i === 1 ? x : /wrote/.test(x))), [true, NEW_TURN],
    `the first run's tool result and then a new turn: ${JSON.stringify(p.results)}`);
  const body = JSON.stringify(p.body);
  for (const s of [`PLAN:${id} Write the note.`, "first done", "A reviewer asks: copy the note to /out."]) {
    assert.ok(body.includes(s), `the resumed request holds ${JSON.stringify(s)}`);
  }
  assert.match(r2.stderr + read(r2.output_dir, "transcript.jsonl"), new RegExp(r1.session_id.replace(/[-]/g, "\\-")),
    "the CLI resumed the first run's session");

  // both runs in the usage report
  const u = await call(conn, "sandbox_usage_report", { run_id: r2.run_id });
  assert.deepEqual(u.continuation.runs.map((x) => [x.run_id, x.continues ?? null]),
    [[r1.run_id, null], [r2.run_id, r1.run_id]], "the chain, first to latest");
  assert.deepEqual(u.continuation.runs.map((x) => x.cost_usd), [r1.cost_usd, r2.cost_usd], "each run's own cost");
  assert.ok(Math.abs(u.continuation.total_cost_usd - (r1.cost_usd + r2.cost_usd)) < 1e-9);

  // the first run was continued: only the latest can be, and another model is refused
  await refused(conn, { continue: r1.run_id, prompt: "again" },
    new RegExp(`^continue: run ${r1.run_id} was continued by run ${r2.run_id}; continue ${r2.run_id} instead`));
  await refused(conn, { continue: r2.run_id, prompt: "again", model: cli === "claude" ? "opus" : "gpt-5.6-luna" },
    /^model: a continue runs with the model of run/);
  // the latest goes on, in the background too: a third turn of the same session
  const bg = await call(conn, "sandbox_agent", { continue: r2.run_id, prompt: "One more thing.", background: true,
    timeout_seconds: 300 });
  const done = await call(conn, "sandbox_wait", { job_id: bg.job_id, timeout_seconds: 300 });
  assert.equal(done.status, "succeeded", JSON.stringify(done));
  assert.deepEqual([done.agent.continues, done.agent.answer], [r2.run_id, "done"], JSON.stringify(done.agent));
  assert.deepEqual(p.results.slice(1), [NEW_TURN, p.results[2], NEW_TURN], "three turns of one session");
  assert.deepEqual(await containersUnder(path.join(work, tag)), [], "no container left");
}

test("claude_code: continue resumes the session in the same workspace", { timeout: 600_000 }, async () => {
  await continueRun({ tag: "ct-claude", model: "sonnet", cli: "claude" });
});

test("codex: continue resumes the thread in the same workspace", { timeout: 600_000 }, async () => {
  await continueRun({ tag: "ct-codex", model: "gpt-5.6-sol", cli: "codex" });
});

test("a continue of an unknown, still running or expired run is refused with the reason", { timeout: 600_000 }, async () => {
  const conn = await open("ct-refuse", { DEMESNE_WORKSPACE_KEEP_SECONDS: "1" });
  await refused(conn, { continue: "no-such-run", prompt: "x" }, /^continue: no run no-such-run to continue \(unknown/);
  await refused(conn, { continue: "../etc", prompt: "x" }, /^continue: "\.\.\/etc" is not a run id/);

  const slow = vendor.plan("ct-slow", [{ shell: "sleep 600" }, { final: "slept" }]);
  const bg = await call(conn, "sandbox_agent", { prompt: `PLAN:${slow} Sleep.`, model: "sonnet", background: true,
    timeout_seconds: 300 });
  await refused(conn, { continue: bg.run_id, prompt: "x" },
    new RegExp(`^continue: run ${bg.run_id} is still running; wait for it to end`));
  await call(conn, "sandbox_cancel", { job_id: bg.job_id });

  const quick = vendor.plan("ct-quick", [{ final: "quick" }]);
  const r = await call(conn, "sandbox_agent", { prompt: `PLAN:${quick} Answer.`, model: "sonnet", timeout_seconds: 300 });
  assert.equal(r.answer, "quick");
  await sleep(1500); // past workspace_keep_seconds = 1
  await refused(conn, { continue: r.run_id, prompt: "x" },
    new RegExp(`^continue: run ${r.run_id} has expired: its workspace and session were kept for workspace_keep_seconds \\(1 s\\)`));
  const kept = path.join(work, "ct-refuse", "state", "kept");
  assert.equal(existsSync(path.join(kept, r.run_id)), false, "the expired workspace is gone from the host");
  assert.deepEqual(readdirSync(kept).filter((n) => !n.endsWith(".json") && n !== "runs" && n !== "claims")
    .filter((n) => n === r.run_id), [], "no folder of it is left");
  assert.deepEqual(await containersUnder(path.join(work, "ct-refuse")), [], "no container left");
});

test("inside a tree: a script orchestrator spawns an agent and continues it with a reviewer's findings", { timeout: 600_000 }, async () => {
  const conn = await open("ct-tree");
  // a host run: outside the tree, so the script may not continue it
  const hostPlan = vendor.plan("ct-host", [{ final: "host run" }]);
  const host = await call(conn, "sandbox_agent", { prompt: `PLAN:${hostPlan} Answer.`, model: "sonnet", timeout_seconds: 300 });
  const id = vendor.plan("ct-impl", [
    { shell: "echo implemented > /workspace/impl.txt && echo wrote" },
    { final: "implemented" },
    { shell: "cat /workspace/impl.txt > /out/fixed.txt && echo fixed >> /out/fixed.txt && echo done" },
    { final: "fixed" },
  ], undefined, { turns: true });
  const p = vendor.plans.get(id);
  const root = await call(conn, "sandbox_script", { directories: [path.join(FIX, "tree"), path.join(FIX, "continue"),
    MODULES], image: "default", mcp: true, egress: "none", timeout_seconds: 600,
    command: `sh /in/continue/tree.sh ${id} ${host.run_id} sonnet` });
  const out = root.output_dir;
  assert.equal(root.exit_code, 0, `${read(out, "first.err")}\n${existsSync(path.join(out, "second.err")) ? read(out, "second.err") : ""}`);
  const first = JSON.parse(read(out, "first.json"));
  const second = JSON.parse(read(out, "second.json"));
  assert.deepEqual([first.exit_code, first.answer], [0, "implemented"]);
  assert.deepEqual([second.exit_code, second.answer, second.continues], [0, "fixed", first.run_id],
    "the continuation answers in the resumed session and names the run it continues");
  assert.equal(second.output_dir, "/out/child/impl-fix", "a new child of the caller");
  assert.equal(read(out, "child", "impl-fix", "fixed.txt"), "implemented\nfixed\n", "the same /workspace");
  const body = JSON.stringify(p.body);
  assert.ok(body.includes(`PLAN:${id} Implement it.`) && body.includes("A reviewer found a bug: fix it."),
    "the continuation's request holds the first run's prompt and the reviewer's findings");
  assert.equal(p.results[1], NEW_TURN, JSON.stringify(p.results));
  assert.match(read(out, "refused-again.txt"),
    new RegExp(`continue: run ${first.run_id} was continued by run ${second.run_id}[^]*exit 2`));
  assert.match(read(out, "refused-host.txt"),
    new RegExp(`continue: no run ${host.run_id} to continue \\(unknown, not a sandbox_agent run of this sandbox's tree[^]*exit 2`));
  const u = await call(conn, "sandbox_usage_report", { run_id: root.run_id });
  assert.deepEqual(u.nodes.map((n) => [n.path, n.status]).filter(([x]) => x.startsWith("impl")),
    [["impl", "succeeded"], ["impl-fix", "succeeded"]], JSON.stringify(u.nodes));
  await refused(conn, { continue: second.run_id, prompt: "from the host" },
    new RegExp(`^continue: run ${second.run_id} is a child in the tree of ${root.run_id}; only a sandbox of that tree`));
  assert.deepEqual(await containersUnder(path.join(work, "ct-tree")), [], "no container left");
});
