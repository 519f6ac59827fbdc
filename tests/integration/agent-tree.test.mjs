// Multi-agent trees with the real agent CLIs in their real images (agent-claude_code,
// agent-codex) on a real engine (DEMESNE_ENGINE; run the file once per engine). The CLIs call
// demesne's in-sandbox MCP server (server `demesne`: Claude Code's mcp__demesne__<tool>,
// Codex's namespace mcp__demesne) to spawn children; the model is a scripted vendor on
// 127.0.0.1 in this test (Anthropic Messages with SSE, OpenAI Responses), reached only
// through each run's vendor route. Each agent's prompt names a plan (PLAN:<id>): the vendor
// answers each turn with the plan's next step, chosen from the tool results in the history,
// and bills every response with token counts unique to that plan and step, so a usage sum
// that drops or repeats a request is wrong.
//
// Covered: a Claude Code and a Codex orchestrator each running a script child and a
// background agent child that runs a script grandchild, waiting on both, reading
// /out/child/… and writing a summary (results.json, usage.json and sandbox_usage_report on
// the host, summed exactly); refusals through the CLI (depth, a duplicate name, open egress
// for a non-research child, a job outside the subtree); a tree whose budget is spent
// mid-run; a host cancel of the root; a server killed with SIGKILL mid-tree and started
// again; and no container left behind.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, engineRequest, isWarm } from "./helpers.mjs";
import { jobOf, startVendor, stillRunning } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-agent-tree-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const read = (...p) => readFileSync(path.join(...p), "utf8");
const readJson = (...p) => JSON.parse(read(...p));

// ---- the scripted vendor (scripted-vendor.mjs): what the model does for each agent --------

let vendor, vendorPort, plans, plan;

before(async () => {
  vendor = await startVendor({ secret: SECRET });
  ({ port: vendorPort, plans, plan } = vendor);
});

after(async () => {
  await vendor.close();
  const left = await containersUnder(work);
  for (const c of left) await engine("DELETE", `/containers/${c.Id}?force=true`);
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

// ---- the engine and the server --------------------------------------------------------------

const engine = (method, p) => engineRequest(ENGINE, method, p);
// demesne's containers whose output folder is under `dir`
async function containersUnder(dir) {
  return (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir) && !isWarm(c));
}
async function until(what, fn, ms = 120_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(200);
  }
}

function serverEnv(name, extra = {}) {
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, name, "out"),
    DEMESNE_STATE_DIR: path.join(work, name, "state"), DEMESNE_ALLOWED_PATHS: work,
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendorPort}`,
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendorPort}/openai/v1`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "1", DEMESNE_JOBS_POLL_INTERVAL: "0.5",
    ...extra,
  };
}

async function call(conn, name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name}: ${res.content?.[0]?.text}\n${conn.stderr().slice(-4000)}`);
  return res.structuredContent;
}

// The tokens a plan's responses were billed with, in demesne's terms.
function billed(...ids) {
  const t = { input: 0, output: 0, cache_read: 0, requests: 0 };
  for (const id of ids) {
    for (const u of plans.get(id).responses) {
      t.input += u.input; t.output += u.output; t.cache_read += u.cache_read; t.requests++;
    }
  }
  return t;
}

// ---- the tree ------------------------------------------------------------------------------

// An orchestrator that runs a script child and an agent child in the background, waits on
// both, and writes a summary from their outputs; the agent child runs a script grandchild.
function treePlans(tag, childModel, tokens) {
  const helper = plan(`${tag}-helper`, [
    { tool: "sandbox_script", args: () => ({ name: "grand", image: "base",
      command: "echo grand-ok > /out/grand.txt; echo shared-by-grand > /workspace/from-grand.txt; echo grand-stdout" }) },
    { shell: "cp /out/child/grand/grand.txt /out/helper.txt && cp /in/previous-jobs/lint/result.txt /out/saw-lint.txt" },
    { final: "helper done" },
  ], tokens.helper);
  const orch = plan(`${tag}-orch`, [
    { tool: "sandbox_script", args: () => ({ name: "lint", image: "base", background: true,
      command: "echo lint-ok > /out/result.txt" }) },
    { tool: "sandbox_agent", args: () => ({ name: "helper", prompt: `PLAN:${helper} Run a script grandchild.`,
      model: childModel, background: true }) },
    { tool: "sandbox_wait", args: (c) => ({ job_id: jobOf(c.result(0)) }), again: stillRunning },
    { tool: "sandbox_wait", args: (c) => ({ job_id: jobOf(c.result(1)) }), again: stillRunning },
    { shell: "cat /out/child/lint/result.txt /out/child/helper/helper.txt /out/child/helper/child/grand/grand.txt "
      + "/workspace/from-grand.txt > /out/summary.txt" },
    { final: "orchestrated" },
  ], tokens.orch);
  return { orch, helper };
}

async function runTree(conn, { tag, model, childModel, tokens, price }) {
  const { orch, helper } = treePlans(tag, childModel, tokens);
  const started = await call(conn, "sandbox_agent", { prompt: `PLAN:${orch} Orchestrate.`, model, background: true,
    timeout_seconds: 300 });
  const done = await call(conn, "sandbox_wait", { job_id: started.job_id, timeout_seconds: 400 });
  assert.equal(done.status, "succeeded", JSON.stringify(done) + conn.stderr().slice(-4000));
  const out = started.output_dir;

  // the CLIs saw demesne's tools under the server name `demesne`, and every call came back
  const o = plans.get(orch);
  // Claude Code offers mcp__demesne__<tool>; Codex in code mode nests them in `exec` (tools.mcp__demesne__<tool>)
  assert.ok(o.codeMode || o.offered.some((n) => /^mcp__demesne(__|:)sandbox_agent$/.test(n)), `offered: ${o.offered}`);
  assert.equal(o.served, 6, `one request per step: ${JSON.stringify(o.responses)}`);
  assert.equal(plans.get(helper).served, 3);
  for (const r of [...o.results, ...plans.get(helper).results]) {
    assert.doesNotMatch(r, /requires approval|user cancelled|not allowed/i, r.slice(0, 2000));
  }
  assert.match(o.results[3], /succeeded/, "the wait on the agent child saw it succeed");

  // outputs, where the orchestrator read them
  assert.equal(read(out, "summary.txt"), "lint-ok\ngrand-ok\ngrand-ok\nshared-by-grand\n");
  assert.equal(read(out, "child/helper/saw-lint.txt"), "lint-ok\n", "an earlier sibling's output at /in/previous-jobs");
  assert.equal(read(out, "child/helper/child/grand/stdout.log"), "grand-stdout\n");

  // results.json lists the children, usage.json its own usage and the subtree's
  const results = readJson(out, "results.json");
  assert.equal(results.answer, "orchestrated");
  const kids = Object.fromEntries(results.children.map((c) => [c.name, c]));
  assert.deepEqual(Object.keys(kids).sort(), ["helper", "lint"]);
  assert.equal(kids.lint.kind, "script");
  assert.equal(kids.lint.status, "succeeded");
  assert.equal(kids.helper.kind, "agent");
  assert.equal(kids.helper.status, "succeeded");
  const helperResults = readJson(out, "child/helper/results.json");
  assert.deepEqual(helperResults.children.map((c) => [c.name, c.kind, c.status]), [["grand", "script", "succeeded"]]);

  const own = billed(orch);
  const sub = billed(orch, helper);
  const usage = readJson(out, "usage.json");
  assert.equal(usage.input, own.input, "usage.json: the orchestrator's own input tokens");
  assert.equal(usage.output, own.output);
  assert.equal(usage.cache_read, own.cache_read);
  assert.equal(usage.subtree.input, sub.input, "usage.json: the subtree's input tokens");
  assert.equal(usage.subtree.output, sub.output);
  assert.equal(usage.subtree.cache_read, sub.cache_read);
  const cost = price(orch) + price(helper);
  assert.ok(Math.abs(usage.subtree.cost_usd - cost) < 1e-9, `subtree cost ${usage.subtree.cost_usd} vs ${cost}`);
  assert.ok(Math.abs(results.total_cost_usd - cost) < 1e-9);

  // the host's report of the tree
  const rep = await call(conn, "sandbox_usage_report", { run_id: started.run_id });
  assert.deepEqual(rep.tokens, { input: sub.input, output: sub.output, cache_creation: 0, cache_read: sub.cache_read });
  assert.ok(Math.abs(rep.total_cost_usd - cost) < 1e-9);
  const rows = Object.fromEntries(rep.nodes.map((n) => [n.path || "(root)", n]));
  assert.deepEqual(Object.keys(rows).sort(), ["(root)", "helper", "helper/grand", "lint"]);
  assert.deepEqual([rows["(root)"].depth, rows.helper.depth, rows["helper/grand"].depth, rows.lint.depth], [0, 1, 2, 1]);
  assert.deepEqual([rows.helper.kind, rows["helper/grand"].kind, rows.lint.kind], ["agent", "script", "script"]);
  assert.ok(Math.abs(rows.helper.cost_usd - price(helper)) < 1e-9, "the helper's own cost");
  assert.equal(rows.lint.cost_usd, 0);
  const byModel = Object.fromEntries(rep.by_model.map((m) => [m.model, m]));
  return { started, rep, byModel, out, orch, helper };
}

// USD of a plan's responses at a price table (USD per million tokens)
const priceOf = (rates) => (id) => plans.get(id).responses.reduce((s, u) => {
  const r = rates(u.model);
  return s + (u.input * r.input + u.output * r.output + u.cache_read * r.cache_read) / 1e6;
}, 0);
const CLAUDE_RATES = (m) => (m.startsWith("claude-haiku-4-5") ? { input: 1, output: 5, cache_read: 0.10 }
  : { input: 3, output: 15, cache_read: 0.30 });
const CODEX_RATES = (m) => (m === "gpt-5.6-luna" ? { input: 1, output: 6, cache_read: 0.10 }
  : { input: 5, output: 30, cache_read: 0.50 });

test("Claude Code orchestrates a tree: a script child, an agent child with a script grandchild, a summary", { timeout: 600_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv("claude-tree") });
  try {
    const r = await runTree(conn, { tag: "claude", model: "sonnet", childModel: "haiku", price: priceOf(CLAUDE_RATES),
      tokens: { orch: { input: 1100, output: 110, cache_read: 11 }, helper: { input: 2300, output: 230, cache_read: 23 } } });
    assert.deepEqual(Object.keys(r.byModel).sort(), ["claude-haiku-4-5-20251001", "claude-sonnet-5"]);
    assert.equal(r.byModel["claude-haiku-4-5-20251001"].input, billed(r.helper).input);
    assert.equal(r.byModel["claude-sonnet-5"].input, billed(r.orch).input);
  } finally {
    await conn.client.close();
  }
});

test("Codex orchestrates the same tree through its mcp__demesne namespace", { timeout: 600_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv("codex-tree") });
  try {
    const r = await runTree(conn, { tag: "codex", model: "gpt-5.6-sol", childModel: "gpt-5.6-luna",
      price: priceOf(CODEX_RATES),
      tokens: { orch: { input: 3700, output: 370, cache_read: 37 }, helper: { input: 4900, output: 490, cache_read: 49 } } });
    assert.deepEqual(Object.keys(r.byModel).sort(), ["gpt-5.6-luna", "gpt-5.6-sol"]);
    assert.equal(r.byModel["gpt-5.6-luna"].cache_read, billed(r.helper).cache_read);
    assert.equal(r.byModel["gpt-5.6-sol"].output, billed(r.orch).output);
  } finally {
    await conn.client.close();
  }
});


// ---- refusals through the CLI ---------------------------------------------------------------

test("refusals reach the CLI as tool errors: a duplicate name, open egress, a job outside the subtree, depth", { timeout: 600_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv("refusals") });
  try {
    const outside = await call(conn, "sandbox_script", { image: "base", background: true, command: "sleep 30" });
    const deep = plan("refuse-deep", [
      { tool: "sandbox_script", args: () => ({ name: "too-deep", image: "base", command: "true" }) },
      { final: "could not go deeper" },
    ], { input: 510, output: 51, cache_read: 5 });
    const orch = plan("refuse-orch", [
      { tool: "sandbox_script", args: () => ({ name: "first", image: "base", command: "echo first" }) },
      { tool: "sandbox_script", args: () => ({ name: "first", image: "base", command: "echo again" }) },
      { tool: "sandbox_script", args: () => ({ name: "wide", image: "base", egress: "open", command: "true" }) },
      { tool: "sandbox_status", args: () => ({ job_id: outside.job_id }) },
      { tool: "sandbox_agent", args: () => ({ name: "deep", prompt: `PLAN:${deep} Spawn one more.`, model: "haiku" }) },
      { final: "refusals seen" },
    ], { input: 610, output: 61, cache_read: 6 });
    const r = await call(conn, "sandbox_agent", { prompt: `PLAN:${orch} Try what is refused.`, model: "sonnet",
      tree: { depth: 1 }, timeout_seconds: 300 });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, "refusals seen");
    const res = plans.get(orch).results;
    assert.match(res[0], /first/, "the first spawn ran");
    assert.match(res[1], /name: "first" is already used by a child of this sandbox/);
    assert.match(res[2], /egress: "open" is not permitted for a child sandbox_script/);
    assert.match(res[3], new RegExp(`job_id: no job ${outside.job_id} \\(unknown`), "a job outside the subtree is unknown");
    assert.match(plans.get(deep).results[0], /depth: a child here would be at depth 2, below the tree's limit of 1/);
    assert.match(res[4], /could not go deeper/, "the child agent ran and answered");
    // what was refused left nothing: one script child and the agent child
    assert.deepEqual(r.children.map((c) => [c.name, c.status]).sort(), [["deep", "succeeded"], ["first", "succeeded"]]);
    assert.ok(!existsSync(path.join(r.output_dir, "child", "wide")), "no folder for a refused spawn");
    await call(conn, "sandbox_cancel", { job_id: outside.job_id });
  } finally {
    await conn.client.close();
  }
});

// ---- the budget ------------------------------------------------------------------------------

test("a tree's budget spent mid-run: every run ends with the budget reason and no container is left", { timeout: 600_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv("budget") });
  try {
    // each response costs (100000 × 3 + 10000 × 15) / 1e6 = $0.45 at sonnet's prices: the
    // fifth or so response of the tree crosses $2, while both agents still have steps to take
    const steps = (n) => Array.from({ length: n }, () => ({ shell: "true" }));
    const child = plan("budget-child", [...steps(12), { final: "never reached" }], { input: 100000, output: 10000, cache_read: 0 });
    const orch = plan("budget-orch", [
      { tool: "sandbox_agent", args: () => ({ name: "spender", prompt: `PLAN:${child} Spend.`, model: "sonnet",
        background: true }) },
      ...steps(12), { final: "never reached" },
    ], { input: 100000, output: 10000, cache_read: 0 });
    const started = await call(conn, "sandbox_agent", { prompt: `PLAN:${orch} Spend.`, model: "sonnet",
      budget_usd: 2, background: true, timeout_seconds: 300 });
    const done = await call(conn, "sandbox_wait", { job_id: started.job_id, timeout_seconds: 300 });
    assert.notEqual(done.status, "succeeded", JSON.stringify(done).slice(0, 2000));
    const out = started.output_dir;
    await until("no container of the tree", async () => (await containersUnder(out)).length === 0, 60_000);
    const results = readJson(out, "results.json");
    assert.equal(results.reason, "budget of $2.00 spent", JSON.stringify(results).slice(0, 2000));
    const spender = results.children.find((c) => c.name === "spender");
    assert.equal(spender.reason, "budget of $2.00 spent", JSON.stringify(spender));
    assert.equal(readJson(out, "child/spender/results.json").reason, "budget of $2.00 spent");
    const rep = await call(conn, "sandbox_usage_report", { run_id: started.run_id });
    assert.equal(rep.budget_usd, 2);
    assert.equal(rep.budget_spent, true);
    assert.ok(rep.tree_spent_usd >= 2, `spent ${rep.tree_spent_usd}`);
    const served = billed(orch, child).requests;
    assert.ok(served < 26, `the agents stopped before their plans' ends (${served} requests)`);
    // every request that reached the vendor was counted; none went after the tree stopped
    const cost = priceOf(CLAUDE_RATES)(orch) + priceOf(CLAUDE_RATES)(child);
    assert.ok(Math.abs(rep.tree_spent_usd - cost) < 1e-9, `${rep.tree_spent_usd} for ${served} responses (${cost})`);
    assert.ok(Math.abs(rep.total_cost_usd - cost) < 1e-9);
    await sleep(2000);
    assert.equal(billed(orch, child).requests, served, "no model request after the stop");
    // a request that came in after the budget was spent got the vendor-shaped refusal
    for (const f of [path.join(out, "usage.jsonl"), path.join(out, "child/spender/usage.jsonl")]) {
      for (const l of read(f).split("\n").filter((x) => x).map((x) => JSON.parse(x))) {
        if (l.verdict === "deny") assert.deepEqual([l.status, l.reason], [400, "budget of $2.00 spent"]);
      }
    }
    const again = await conn.client.callTool({ name: "sandbox_agent", arguments: { prompt: "x", model: "sonnet",
      budget_usd: 2, tree: { depth: 1 } } }, undefined, LONG);
    assert.ok(!again.isError || !/budget/.test(again.content[0].text), "another tree has a budget of its own");
  } finally {
    await conn.client.close();
  }
});

// ---- a host cancel -------------------------------------------------------------------------

test("cancelling the root on the host takes the whole tree within seconds", { timeout: 600_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv("cancel") });
  try {
    const worker = plan("cancel-worker", [
      { tool: "sandbox_script", args: () => ({ name: "grand", image: "base", command: "sleep 300" }) },
      { final: "not reached" },
    ], { input: 710, output: 71, cache_read: 7 });
    const orch = plan("cancel-orch", [
      { tool: "sandbox_script", args: () => ({ name: "sleeper", image: "base", background: true, command: "sleep 300" }) },
      { tool: "sandbox_agent", args: () => ({ name: "worker", prompt: `PLAN:${worker} Work long.`, model: "gpt-5.6-luna",
        background: true }) },
      { tool: "sandbox_wait", args: (c) => ({ job_id: jobOf(c.result(1)) }), again: stillRunning },
      { final: "not reached" },
    ], { input: 810, output: 81, cache_read: 8 });
    const started = await call(conn, "sandbox_agent", { prompt: `PLAN:${orch} Run long.`, model: "gpt-5.6-sol",
      background: true, timeout_seconds: 300 });
    const out = started.output_dir;
    // the whole tree is up: the root, the sleeper, the worker and its grandchild
    await until("four containers", async () => (await containersUnder(out)).length >= 4, 180_000);
    const t0 = Date.now();
    const cancelled = await call(conn, "sandbox_cancel", { job_id: started.job_id });
    assert.equal(cancelled.status, "cancelled");
    await until("no container of the tree", async () => (await containersUnder(out)).length === 0, 60_000)
      .catch(async (e) => {
        const left = (await containersUnder(out)).map((c) => `${c.Names} ${c.State}`);
        throw new Error(`${e.message}: ${left.join(", ")}\n${conn.stderr().slice(-6000)}`);
      });
    const gone = (Date.now() - t0) / 1000;
    console.log(`# the tree's four containers were gone ${gone.toFixed(1)} s after the cancel`);
    assert.ok(gone < 30, `gone within seconds (${gone} s)`);
    const rep = await call(conn, "sandbox_usage_report", { run_id: started.run_id });
    const rows = Object.fromEntries(rep.nodes.map((n) => [n.path || "(root)", n.status]));
    assert.deepEqual(rows, { "(root)": "cancelled", sleeper: "cancelled", worker: "cancelled", "worker/grand": "cancelled" });
    assert.match(readJson(out, "results.json").reason, /^cancelled/);
    assert.ok(existsSync(path.join(out, "child/worker/results.json")), "the worker's results.json says how it ended");
  } finally {
    await conn.client.close();
  }
});

// ---- a server killed mid-tree ----------------------------------------------------------------
// With Codex: its MCP client sees the call in flight fail at once ("Transport closed") and
// the next call opens a new session on the new server. Claude Code 2.1.197 recovers too,
// but reports the lost call only about 120 s later (measured here), too slow for CI.

test("a server killed with SIGKILL mid-tree: the next server takes the tree up and it completes", { timeout: 600_000 }, async () => {
  const env = serverEnv("restart");
  let a = await connect({ fixtures: false, env });
  let b;
  try {
    const helper = plan("restart-helper", [
      { shell: "sleep 8; echo helped > /out/helped.txt" }, // within exec_command's first 10 s
      { final: "helped" },
    ], { input: 920, output: 92, cache_read: 9 });
    const orch = plan("restart-orch", [
      { tool: "sandbox_script", args: () => ({ name: "slow", image: "base", background: true,
        command: "sleep 12; echo slow-done > /out/done.txt" }) },
      { tool: "sandbox_agent", args: () => ({ name: "helper", prompt: `PLAN:${helper} Help slowly.`, model: "gpt-5.6-luna",
        background: true }) },
      { tool: "sandbox_wait", args: (c) => ({ job_id: jobOf(c.result(0)) }), again: stillRunning },
      { tool: "sandbox_wait", args: (c) => ({ job_id: jobOf(c.result(1)) }), again: stillRunning },
      { shell: "cat /out/child/slow/done.txt /out/child/helper/helped.txt > /out/summary.txt" },
      { final: "survived" },
    ], { input: 1020, output: 102, cache_read: 10 });
    const started = await call(a, "sandbox_agent", { prompt: `PLAN:${orch} Survive.`, model: "gpt-5.6-sol",
      background: true, timeout_seconds: 300 });
    // the orchestrator waits on its children, the helper sleeps, and the responses that led
    // there are counted (a response cut off by the kill is billed by the vendor but never
    // counted: that is not what this test is about): kill the server now
    const counted = (f) => (existsSync(f) ? read(f).split("\n").filter((l) => l.includes('"verdict":"forward"')).length : 0);
    await until("the orchestrator waiting", async () => plans.get(orch).served >= 3
      && plans.get(helper).served >= 1 && counted(path.join(started.output_dir, "usage.jsonl")) >= 3
      && counted(path.join(started.output_dir, "child/helper/usage.jsonl")) >= 1, 180_000);
    process.kill(a.transport.pid, "SIGKILL");
    await a.client.close().catch(() => {});
    a = null;
    b = await connect({ fixtures: false, env });
    const done = await call(b, "sandbox_wait", { job_id: started.job_id, timeout_seconds: 300 });
    assert.equal(done.status, "succeeded", JSON.stringify(done).slice(0, 3000) + b.stderr().slice(-3000));
    const out = started.output_dir;
    assert.equal(read(out, "summary.txt"), "slow-done\nhelped\n");
    const results = readJson(out, "results.json");
    assert.equal(results.answer, "survived");
    assert.deepEqual(results.children.map((c) => [c.name, c.status]).sort(), [["helper", "succeeded"], ["slow", "succeeded"]]);
    const rep = await call(b, "sandbox_usage_report", { run_id: started.run_id });
    const sub = billed(orch, helper);
    assert.deepEqual(rep.tokens, { input: sub.input, output: sub.output, cache_creation: 0, cache_read: sub.cache_read },
      "every response of both servers' time counted once");
  } finally {
    if (a) await a.client.close().catch(() => {});
    if (b) await b.client.close();
  }
});
