// A tree's budget_usd on the vendor route is a reservation (issue 23), end to end: the real
// Claude Code CLI in its real image on a real engine (DEMESNE_ENGINE; run the file once per
// engine), its model the scripted vendor on 127.0.0.1 (scripted-vendor.mjs). The plan's first
// turn is a Bash tool call running node inside the sandbox, which sends model requests straight
// to the vendor route (127.0.0.1:3129 with $DEMESNE_VENDOR_TOKEN, as every agent sandbox can):
// twenty at once under a $1 budget, each reserving about $0.25 (its 2 KB body as input, its
// max_tokens of 16000 as output), which the vendor holds until no new one has come for a while
// and then answers using all 16000 output tokens; then one that the script hangs up on after
// message_start. Checked: what the vendor served stays within the budget (plus at most one
// reservation), the others were refused budget_exceeded naming the budget, the spend and the
// reserved amount, and usage.json and sandbox_usage_report cost exactly what the vendor
// served at demesne's price table, the cut answer charged its input and its whole max_tokens.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, engineRequest } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-agent-budget-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 400_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const read = (...p) => readFileSync(path.join(...p), "utf8");

// demesne's price table for the model used (lua/providers/claude_code.lua), USD per million tokens
const SONNET = { input: 3, output: 15, cache_creation: 3.75, cache_read: 0.3 };
const costOf = (model, u) => ((model || "").startsWith("claude-sonnet-5")
  ? ((u.input || 0) * SONNET.input + (u.output || 0) * SONNET.output) / 1e6 : 0);

const N = 20;
const MAX_TOKENS = 16000;
const CUT_MAX_TOKENS = 1000;
const HOLD_MAX_TOKENS = 2000;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function until(what, fn, ms) {
  const end = Date.now() + ms;
  while (!(await fn())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(200);
  }
}

let vendor;
const burst = { seen: 0, held: [], timer: null }; // the twenty: held until no new one for 2 s
const cut = { seen: 0, res: [], input: 0 };
const hold = { seen: 0, res: [], input: 0 }; // answers held until the tree is cancelled

function sse(res, events, end) {
  for (const ev of events) res.write(`event: ${ev.type}\ndata: ${JSON.stringify(ev)}\n\n`);
  if (end) res.end();
}
const start = (model, input) => ({ type: "message_start", message: { id: "msg_" + randomBytes(6).toString("hex"),
  type: "message", role: "assistant", content: [], model, stop_reason: null,
  usage: { input_tokens: input, output_tokens: 1, cache_read_input_tokens: 0, cache_creation_input_tokens: 0 } } });

function releaseBurst() {
  for (const h of burst.held.splice(0)) {
    sse(h.res, [
      { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } },
      { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: "x" } },
      { type: "content_block_stop", index: 0 },
      { type: "message_delta", delta: { stop_reason: "max_tokens", stop_sequence: null }, usage: { output_tokens: h.output } },
      { type: "message_stop" },
    ], true);
    vendor.served.push({ model: h.model, input: h.input, output: h.output });
  }
}

function intercept(kind, body, res, size) {
  const text = JSON.stringify(body.messages || []);
  const marker = text.includes("BURST-REQ") ? "burst" : text.includes("CUT-REQ") ? "cut"
    : text.includes("HOLD-REQ") ? "hold" : null;
  if (kind !== "anthropic" || !marker) return false;
  const model = body.model;
  const input = Math.ceil(size / 4); // about four bytes a token, as real text goes
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  sse(res, [start(model, input)], false);
  if (marker === "cut" || marker === "hold") {
    const x = marker === "cut" ? cut : hold;
    x.seen++;
    x.input = input;
    x.res.push(res); // never finished: the agent hangs up, or the tree is cancelled
    return true;
  }
  burst.seen++;
  burst.held.push({ res, model, input, output: body.max_tokens });
  clearTimeout(burst.timer);
  burst.timer = setTimeout(releaseBurst, 2000);
  return true;
}

before(async () => { vendor = await startVendor({ secret: SECRET, intercept }); });
after(async () => {
  clearTimeout(burst.timer);
  releaseBurst();
  for (const r of [...cut.res, ...hold.res]) r.destroy();
  await vendor.close();
  // what a closed server removes after its answers (and a killed one's exit reaper: passes at
  // 0, 3 and 15 s) may still be going
  const mine = async () => (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "")
    .startsWith(work));
  let left = await mine();
  for (let i = 0; i < 40 && left.length; i++) {
    await new Promise((r) => setTimeout(r, 500));
    left = await mine();
  }
  for (const c of left) await engineRequest(ENGINE, "DELETE", `/containers/${c.Id}?force=true`);
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

// The script's own report: the line "REPORT {json}" it printed, found in the tool result
// that the transcript (JSON lines) carries.
function report(transcript) {
  let found;
  const walk = (v) => {
    if (typeof v === "string") {
      const m = v.match(/REPORT (\{.*\})/);
      if (m) found = JSON.parse(m[1]);
    } else if (v && typeof v === "object") for (const x of Object.values(v)) walk(x);
  };
  for (const line of transcript.split("\n")) {
    try { walk(JSON.parse(line)); } catch { /* not a JSON line */ }
  }
  assert.ok(found, `the script reported: ${transcript.slice(-1500)}`);
  return found;
}

// The sandbox's script: N requests at once, then one it hangs up on after message_start.
const SCRIPT = `
const http = require("http");
const mode = process.argv[2];
const tok = process.env.DEMESNE_VENDOR_TOKEN;
// A connection the route's server did not take (more than 16 handed over at once and not yet
// taken up: RELAY_PENDING_MAX in core/httpd.c) is reset before its request is read: sent again.
function post(body, onRes, tries = 0) {
  const r = http.request({ host: "127.0.0.1", port: 3129, path: "/v1/messages", method: "POST", agent: false,
    headers: { "x-api-key": tok, "content-type": "application/json", "anthropic-version": "2023-06-01",
      "content-length": Buffer.byteLength(body) } }, (res) => { r.answered = true; onRes(res); });
  r.on("error", (e) => {
    if (r.answered || r.destroyedByUs) return;
    out.errors = out.errors || [];
    out.errors.push(e.code || e.message);
    if (e.code === "ECONNRESET" && tries < 20) setTimeout(() => post(body, onRes, tries + 1), 20);
    else if (onRes.settle) onRes.settle();
  });
  r.end(body);
  return r;
}
const out = { codes: {}, messages: [] };
let done = 0;
if (mode === "hold") {
  post(JSON.stringify({ model: "claude-sonnet-5", max_tokens: ${HOLD_MAX_TOKENS}, stream: true,
    messages: [{ role: "user", content: "HOLD-REQ" }] }), (res) => { res.on("data", () => {}); });
  setTimeout(() => process.exit(0), 300000);
} else {
const body = JSON.stringify({ model: "claude-sonnet-5", max_tokens: ${MAX_TOKENS}, stream: true,
  messages: [{ role: "user", content: "BURST-REQ " + "x".repeat(2000) }] });
for (let i = 0; i < ${N}; i++) {
  const settle = () => { if (++done === ${N}) cutOne(); };
  const onRes = (res) => {
    let t = "";
    res.on("data", (d) => { t += d; });
    res.on("end", () => {
      out.codes[res.statusCode] = (out.codes[res.statusCode] || 0) + 1;
      if (res.statusCode === 400 && out.messages.length < 3) out.messages.push(t);
      settle();
    });
  };
  onRes.settle = settle;
  post(body, onRes);
}
}
function cutOne() {
  const cb = JSON.stringify({ model: "claude-sonnet-5", max_tokens: ${CUT_MAX_TOKENS}, stream: true,
    messages: [{ role: "user", content: "CUT-REQ" }] });
  post(cb, (res) => {
    out.cut = res.statusCode;
    res.on("data", (d) => { if (String(d).includes("message_start")) { res.req.destroyedByUs = true; res.req.destroy(); finish(); } });
  });
}
function finish() { setTimeout(() => { console.log("REPORT " + JSON.stringify(out)); process.exit(0); }, 1000); }
setTimeout(() => { console.log("REPORT " + JSON.stringify({ ...out, timeout: true })); process.exit(0); }, 120000);
`;

function server(name) {
  return connect({ fixtures: false, env: {
    DEMESNE_ENGINE: ENGINE, DEMESNE_POOL_SIZE: "0", DEMESNE_OUTPUT_ROOT: path.join(work, name, "out"),
    DEMESNE_STATE_DIR: path.join(work, name, "state"),
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  } });
}
const command = (mode) => `echo ${Buffer.from(SCRIPT).toString("base64")} | base64 -d > /tmp/b.js && node /tmp/b.js ${mode}`;

test("twenty concurrent model requests under a $1 budget: forwarded within the budget, the rest refused, "
  + "everything served charged (a cut answer too)", LONG, async () => {
  const conn = await server("burst");
  try {
    const id = vendor.plan(`budget-${randomBytes(3).toString("hex")}`, [{ shell: command("burst") }, { final: "BUDGET-DONE" }],
      { input: 100, output: 10 });
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: `PLAN:${id} run the burst`, model: "sonnet", budget_usd: 1, timeout_seconds: 240 } }, undefined, LONG);
    assert.ok(!res.isError, `the agent run: ${res.content?.[0]?.text}\n${conn.stderr().slice(-2000)}`);
    const r = res.structuredContent;
    const outDir = r.output_dir;
    const body = JSON.stringify({ model: "claude-sonnet-5", max_tokens: MAX_TOKENS, stream: true,
      messages: [{ role: "user", content: "BURST-REQ " + "x".repeat(2000) }] });
    const reservation = (Buffer.byteLength(body) * SONNET.cache_creation + MAX_TOKENS * SONNET.output) / 1e6;

    // what the vendor served of the twenty fits the budget, plus at most one reservation
    assert.ok(burst.seen >= 1, "some of the burst was forwarded");
    const burstCost = vendor.served.filter((s) => s.output === MAX_TOKENS).reduce((a, s) => a + costOf(s.model, s), 0);
    assert.ok(burstCost <= 1 + reservation, `the vendor served ${burst.seen} of ${N} ($${burstCost.toFixed(4)})`);
    assert.ok(burst.seen <= 5, `${burst.seen} of ${N} requests of about $0.25 were forwarded under a $1 budget`);

    // the others were refused with budget_exceeded (usage.jsonl, and what the sandbox saw)
    const lines = read(outDir, "usage.jsonl").trim().split("\n").map((l) => JSON.parse(l));
    const denied = lines.filter((l) => l.verdict === "deny" && l.status === 400);
    const rep = report(read(outDir, "transcript.jsonl"));
    assert.equal(denied.length, N - burst.seen, `${JSON.stringify(rep)}\n${lines.map((l) => JSON.stringify(l)).join("\n")}`);
    assert.match(denied[0].reason,
      /^budget of \$1\.00: \$\d+\.\d+ spent and \$0\.\d\d reserved by the model requests in flight leave no room for this one's \$0\.25/);
    assert.equal(rep.codes["400"], N - burst.seen, JSON.stringify(rep));
    assert.equal(rep.codes["200"], burst.seen, JSON.stringify(rep));
    const refusal = JSON.parse(rep.messages[0]).error;
    assert.equal(refusal.code, "budget_exceeded");
    assert.match(refusal.message, /^demesne vendor route: budget of \$1\.00: .* reserved by the model requests in flight/);

    // the cut answer: forwarded, hung up on after message_start, charged input and its whole max_tokens
    assert.equal(cut.seen, 1, "the cut request reached the vendor");
    const cutLine = lines.find((l) => l.charged === "cut");
    assert.ok(cutLine, `a usage.jsonl line for the cut answer: ${JSON.stringify(lines.slice(-3))}`);
    assert.deepEqual([cutLine.input, cutLine.output], [cut.input, CUT_MAX_TOKENS]);
    const cutCost = costOf("claude-sonnet-5", { input: cut.input, output: CUT_MAX_TOKENS });
    assert.ok(Math.abs(cutLine.cost_usd - cutCost) < 1e-9, `${cutLine.cost_usd} != ${cutCost}`);

    // usage.json and the tree's report cost exactly what was served (and the cut answer's charge)
    const served = vendor.served.reduce((a, s) => a + costOf(s.model, s), 0) + cutCost;
    const usage = JSON.parse(read(outDir, "usage.json"));
    assert.ok(Math.abs(usage.cost_usd - served) < 1e-9, `usage.json says $${usage.cost_usd}, the vendor served $${served}`);
    const usageReport = await conn.client.callTool({ name: "sandbox_usage_report", arguments: { run_id: r.run_id } });
    assert.ok(!usageReport.isError, usageReport.content?.[0]?.text);
    const sc = usageReport.structuredContent;
    assert.ok(Math.abs(sc.total_cost_usd - served) < 1e-9, `sandbox_usage_report says $${sc.total_cost_usd}`);
    assert.ok(Math.abs(sc.tree_spent_usd - served) < 1e-9, `the tree spent $${sc.tree_spent_usd}`);
    assert.equal(sc.budget_usd, 1);
    assert.equal(sc.tree_reserved_usd, 0, "nothing is left reserved once every request ended");
  } finally {
    await conn.client.close();
  }
});

test("a tree cancelled while a model answer streams: the answer is still charged", LONG, async () => {
  const conn = await server("cancel");
  const before = vendor.served.length;
  try {
    const id = vendor.plan(`hold-${randomBytes(3).toString("hex")}`, [{ shell: command("hold") }, { final: "not reached" }],
      { input: 100, output: 10 });
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: `PLAN:${id} hold an answer`, model: "sonnet", budget_usd: 5, background: true, timeout_seconds: 240 } },
    undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const started = res.structuredContent;
    await until("the held request at the vendor", () => hold.seen === 1, 180_000);
    const cancelled = await conn.client.callTool({ name: "sandbox_cancel", arguments: { job_id: started.job_id } });
    assert.ok(!cancelled.isError, cancelled.content?.[0]?.text);
    const linesOf = () => {
      try {
        return read(started.output_dir, "usage.jsonl").trim().split("\n").map((l) => JSON.parse(l));
      } catch { return []; }
    };
    await until("the held answer's line in usage.jsonl", () => linesOf().some((l) => l.charged === "cut"), 60_000);
    const line = linesOf().find((l) => l.charged === "cut");
    assert.deepEqual([line.input, line.output], [hold.input, HOLD_MAX_TOKENS]);
    const charge = costOf("claude-sonnet-5", { input: hold.input, output: HOLD_MAX_TOKENS });
    assert.ok(Math.abs(line.cost_usd - charge) < 1e-9, `${line.cost_usd} != ${charge}`);
    // the CLI's own first turn, served whole, and the held answer: nothing else, nothing lost
    const served = vendor.served.slice(before).reduce((a, s) => a + costOf(s.model, s), 0);
    const rep = (await conn.client.callTool({ name: "sandbox_usage_report", arguments: { run_id: started.run_id } }))
      .structuredContent;
    assert.ok(Math.abs(rep.tree_spent_usd - (served + charge)) < 1e-9,
      `the tree spent $${rep.tree_spent_usd}; served $${served} and the held answer $${charge}`);
    await until("the usage.json total", () => {
      const u = JSON.parse(read(started.output_dir, "usage.json"));
      return Math.abs(u.cost_usd - rep.tree_spent_usd) < 1e-9;
    }, 30_000);
  } finally {
    await conn.client.close();
  }
});

test("a server killed while a model answer streams: the next server charges its reservation in full", LONG, async () => {
  // no warm sandboxes: the killed server's would wait for its exit reaper's later passes
  const env = { DEMESNE_ENGINE: ENGINE, DEMESNE_POOL_SIZE: "0", DEMESNE_OUTPUT_ROOT: path.join(work, "kill", "out"),
    DEMESNE_STATE_DIR: path.join(work, "kill", "state"),
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false" };
  let a = await connect({ fixtures: false, env });
  let b;
  const before = vendor.served.length;
  const held = hold.seen;
  try {
    const id = vendor.plan(`kill-${randomBytes(3).toString("hex")}`, [{ shell: command("hold") }, { final: "not reached" }],
      { input: 100, output: 10 });
    const res = await a.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: `PLAN:${id} hold an answer`, model: "sonnet", budget_usd: 5, background: true, timeout_seconds: 240 } },
    undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const started = res.structuredContent;
    await until("the held request at the vendor", () => hold.seen === held + 1, 180_000);
    process.kill(a.transport.pid, "SIGKILL");
    await a.client.close().catch(() => {});
    a = null;
    b = await connect({ fixtures: false, env });
    // what the held request reserved when it was admitted: its body at the dearest input rate, its max_tokens
    const body = JSON.stringify({ model: "claude-sonnet-5", max_tokens: HOLD_MAX_TOKENS, stream: true,
      messages: [{ role: "user", content: "HOLD-REQ" }] });
    const reservation = (Buffer.byteLength(body) * SONNET.cache_creation + HOLD_MAX_TOKENS * SONNET.output) / 1e6;
    const served = vendor.served.slice(before).reduce((a, s) => a + costOf(s.model, s), 0);
    const rep = (await b.client.callTool({ name: "sandbox_usage_report", arguments: { run_id: started.run_id } }))
      .structuredContent;
    assert.ok(Math.abs(rep.tree_spent_usd - (served + reservation)) < 1e-9,
      `the tree spent $${rep.tree_spent_usd}; served $${served} and the reservation $${reservation}\n${b.stderr().slice(-3000)}`);
    assert.ok(Math.abs(rep.total_cost_usd - rep.tree_spent_usd) < 1e-9, "charged to the run that made the request");
    assert.match(b.stderr(), /was in flight when its server stopped; charged its reservation/);
    await b.client.callTool({ name: "sandbox_cancel", arguments: { job_id: started.job_id } });
    const done = await b.client.callTool({ name: "sandbox_wait", arguments: { job_id: started.job_id,
      timeout_seconds: 120 } }, undefined, LONG);
    assert.equal(done.structuredContent?.status, "cancelled", JSON.stringify(done.structuredContent));
    // read again by a third server: charged once
    await b.client.close();
    b = await connect({ fixtures: false, env });
    const again = (await b.client.callTool({ name: "sandbox_usage_report", arguments: { run_id: started.run_id } }))
      .structuredContent;
    assert.ok(Math.abs(again.tree_spent_usd - rep.tree_spent_usd) < 1e-9, `charged once: $${again.tree_spent_usd}`);
  } finally {
    if (a) await a.client.close().catch(() => {});
    if (b) await b.client.close();
  }
});
