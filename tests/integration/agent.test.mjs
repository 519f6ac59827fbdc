// sandbox_agent end to end with the real agent CLIs in their real images (agent-claude_code,
// agent-codex) against a real engine (DEMESNE_ENGINE). No vendor is reachable: the vendor
// route's upstream (DEMESNE_<PROVIDER>_UPSTREAM) is a scripted server on 127.0.0.1 in this
// test that speaks the vendor's API (Anthropic Messages with SSE; OpenAI Responses) as
// recorded in shared/reference/agent-clis.md. Turn 1 is a tool call running a shell
// command (writes /out/answer.txt, scans the sandbox for the real credential, and probes
// the vendor port with a wrong token and a disallowed path); turn 2 is the final message.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, readdirSync, statSync, existsSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-agent-"));
// the "real" credentials the host holds; the sandbox must never see them
const SECRET_HEAD = "sk-test-real";
const SECRET_TAIL = randomBytes(12).toString("hex");
const SECRET = `${SECRET_HEAD}-${SECRET_TAIL}`;
const FINAL = "The answer is done.";

// The shell command of the scripted tool call. It rebuilds the secret from two parts, so
// that the command (which ends up in the transcript) does not hold it as one string.
// A control string (also built from parts) is written to /tmp/control.txt so the test can
// tell that the filesystem scan reached files; the per-run token is the control for the
// scan of process environments.
function probeCommand(tokenVar, authHeader, authPrefix, routes) {
  return [
    "echo done > /out/answer.txt",
    `S=$(printf '%s-%s' '${SECRET_HEAD}' '${SECRET_TAIL}')`,
    "C=$(printf '%s-%s' 'demesne-control' 'c0ffee')",
    'printf "%s" "$C" > /tmp/control.txt',
    "env > /out/env.txt",
    // the interfaces from /proc/net/dev: gVisor has no /sys/class/net
    "awk -F: 'NR > 2 { gsub(/ /, \"\", $1); print $1 }' /proc/net/dev > /out/ifaces.txt",
    // `command grep`: Claude Code's shell tool defines grep and find as functions that run its
    // own ugrep and bfs, which cannot stat files under Debian's gVisor (statx with
    // AT_NO_AUTOMOUNT, which runsc 20221219 refuses)
    'command grep -rlsF -e "$S" -e "$C" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev > /out/found.txt 2>/dev/null',
    'command grep -lsaF "$S" /proc/[0-9]*/environ /proc/[0-9]*/cmdline > /out/found_proc.txt 2>/dev/null',
    `command grep -lsaF "$${tokenVar}" /proc/[0-9]*/environ | wc -l > /out/control_proc.txt`,
    "echo scanned > /out/scan.done",
    `curl -s -o /dev/null -w '%{http_code}' -X POST -H '${authHeader}: ${authPrefix}wrong-token' -H 'content-type: application/json' `
      + `-d '{}' http://127.0.0.1:3129${routes.allowed} > /out/wrong_token.txt`,
    `curl -s -o /dev/null -w '%{http_code}' -H "${authHeader}: ${authPrefix}$${tokenVar}" http://127.0.0.1:3129${routes.denied} > /out/bad_path.txt`,
    "true",
  ].join("; ");
}

// ---- the scripted upstream --------------------------------------------------------------

const seen = []; // {provider, method, url, auth, account}
const tokenRequests = []; // bodies POSTed to /oauth/token
let upstream, port;

function sse(res, events, named = true) {
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  for (const ev of events) {
    res.write((named ? `event: ${ev.type}\n` : "") + `data: ${JSON.stringify(ev)}\n\n`);
  }
  res.end();
}

// Rate limits: a prompt holding RATELIMIT_ONCE gets one 429 (reset 2 s ahead) on its first
// turn; RATELIMIT_ALWAYS gets 429 on every turn (reset 1 s ahead).
let limitedOnce = 0;
const limited = []; // times of the 429 answers
function rateLimit(res, seconds) {
  const reset = new Date(Date.now() + seconds * 1000).toISOString().replace(/\.\d+Z$/, "Z");
  limited.push(Date.now());
  res.writeHead(429, { "content-type": "application/json", "retry-after": String(seconds),
    "anthropic-ratelimit-requests-reset": reset, "anthropic-ratelimit-requests-remaining": "0" });
  res.end(JSON.stringify({ type: "error", error: { type: "rate_limit_error", message: "Number of requests has exceeded your rate limit" } }));
}

// A prompt holding LIMIT_UNTIL_RESUMED gets 429 (reset 3 s ahead, longer than the route holds
// a request in those tests) on its tool-result turn until a request carries the prompt that
// demesne resumes a session with (lua/agent/resume.lua RESUME_PROMPT).
const RESUME_TEXT = "rate limit that has now reset";
const resumedRequests = []; // {provider, history}: requests that carried the resume prompt

function anthropic(req, res, body) {
  const msgs = body.messages || [];
  const text = JSON.stringify(msgs);
  const last = msgs[msgs.length - 1];
  const resumed = text.includes(RESUME_TEXT);
  if (resumed) resumedRequests.push({ provider: "anthropic", history: text.includes("tool_result") && text.includes("toolu_") });
  if (!(Array.isArray(body.tools) && body.tools.length === 0)) {
    if (text.includes("RATELIMIT_ALWAYS")) return rateLimit(res, 1);
    if (text.includes("RATELIMIT_LONG_HOLD")) return rateLimit(res, 8);
    if (text.includes("RATELIMIT_ONCE") && limitedOnce++ === 0) return rateLimit(res, 2);
    if (text.includes("LIMIT_UNTIL_RESUMED") && text.includes("tool_result") && !resumed) {
      return rateLimit(res, text.includes("LIMIT_UNTIL_RESUMED_SLOWLY") ? 10 : 3);
    }
  }
  const hasResult = resumed || (Array.isArray(last?.content) && last.content.some((b) => b.type === "tool_result"));
  const side = Array.isArray(body.tools) && body.tools.length === 0;
  const model = "claude-sonnet-5";
  const id = "msg_" + randomBytes(6).toString("hex");
  let blocks, stop, usage;
  if (side) {
    blocks = [{ type: "text", text: "ok" }]; stop = "end_turn"; usage = { input: 1, output: 1 };
  } else if (hasResult) {
    blocks = [{ type: "text", text: FINAL }]; stop = "end_turn"; usage = { input: 200, output: 30 };
  } else {
    let cmd = probeCommand("ANTHROPIC_API_KEY", "x-api-key", "", { allowed: "/v1/messages", denied: "/v1/models" });
    if (JSON.stringify(msgs).includes("SLOWLY")) cmd = `sleep 5; ${cmd}`; // room for a server restart
    blocks = [{ type: "tool_use", id: "toolu_" + randomBytes(6).toString("hex"), name: "Bash",
      input: { command: cmd, description: "write the answer" } }];
    stop = "tool_use"; usage = { input: 100, output: 20 };
  }
  if (body.stream === false || body.stream === undefined) {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ id, type: "message", role: "assistant", model, content: blocks, stop_reason: stop,
      usage: { input_tokens: usage.input, output_tokens: usage.output } }));
    return;
  }
  const events = [{ type: "message_start", message: { id, type: "message", role: "assistant", content: [], model,
    stop_reason: null, usage: { input_tokens: usage.input, output_tokens: 1 } } }];
  blocks.forEach((b, index) => {
    if (b.type === "text") {
      events.push({ type: "content_block_start", index, content_block: { type: "text", text: "" } });
      events.push({ type: "content_block_delta", index, delta: { type: "text_delta", text: b.text } });
    } else {
      events.push({ type: "content_block_start", index, content_block: { type: "tool_use", id: b.id, name: b.name, input: {} } });
      events.push({ type: "content_block_delta", index, delta: { type: "input_json_delta", partial_json: JSON.stringify(b.input) } });
    }
    events.push({ type: "content_block_stop", index });
  });
  events.push({ type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: usage.output } });
  events.push({ type: "message_stop" });
  sse(res, events);
}

function openai(req, res, body) {
  const input = body.input || [];
  const text = JSON.stringify(input);
  const resumed = text.includes(RESUME_TEXT);
  if (resumed) resumedRequests.push({ provider: "openai", history: input.some((i) => i.type === "function_call_output") });
  if (text.includes("LIMIT_UNTIL_RESUMED") && input.some((i) => i.type === "function_call_output") && !resumed) {
    // a ChatGPT-plan usage limit: the reset is only in the body
    limited.push(Date.now());
    res.writeHead(429, { "content-type": "application/json" });
    res.end(JSON.stringify({ error: { type: "usage_limit_reached", message: "The usage limit has been reached",
      plan_type: "plus", resets_in_seconds: 3 } }));
    return;
  }
  const hasResult = resumed || input.some((i) => i.type === "function_call_output");
  const id = "resp_" + randomBytes(6).toString("hex");
  const model = body.model;
  let item, usage;
  if (hasResult) {
    item = { type: "message", role: "assistant", id: "msg_" + id, content: [{ type: "output_text", text: FINAL }] };
    usage = { input: 300, output: 40 };
  } else {
    // exec_command takes `cmd` (agent-clis.md 3.2); other model families get other shell tools
    const param = "cmd";
    const cmd = probeCommand("AGENT_API_KEY", "authorization", "Bearer ", { allowed: "/v1/responses", denied: "/v1/models" });
    // the scan of the whole filesystem can take more than exec_command's default 10 s on a
    // loaded machine, after which Codex hands the still-running command back to the model
    item = { type: "function_call", id: "fc_" + id, call_id: "call_" + randomBytes(6).toString("hex"), name: "exec_command",
      arguments: JSON.stringify({ [param]: cmd, yield_time_ms: 30000 }) };
    usage = { input: 150, output: 25 };
  }
  sse(res, [
    { type: "response.created", response: { id, model } },
    { type: "response.output_item.done", output_index: 0, item },
    { type: "response.completed", response: { id, model, output: [item],
      usage: { input_tokens: usage.input, input_tokens_details: { cached_tokens: 0 }, output_tokens: usage.output,
        output_tokens_details: { reasoning_tokens: 0 }, total_tokens: usage.input + usage.output } } },
  ], false);
}

before(async () => {
  upstream = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      if (req.url === "/oauth/token") { // the ChatGPT login's token endpoint
        const body = JSON.parse(Buffer.concat(chunks).toString("utf8") || "{}");
        tokenRequests.push(body);
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({ access_token: SECRET, id_token: "id-new", refresh_token: "rt-new" }));
        return;
      }
      const provider = req.url.startsWith("/openai") ? "openai" : "anthropic";
      seen.push({ provider, method: req.method, url: req.url,
        auth: req.headers["x-api-key"] || req.headers.authorization || null,
        account: req.headers["chatgpt-account-id"] || null });
      if (req.method !== "POST") { res.writeHead(404); res.end(); return; }
      let body = {};
      try { body = JSON.parse(Buffer.concat(chunks).toString("utf8") || "{}"); } catch { /* empty */ }
      if (provider === "openai") openai(req, res, body); else anthropic(req, res, body);
    });
  });
  await new Promise((r) => upstream.listen(0, "127.0.0.1", r));
  port = upstream.address().port;
});

after(async () => {
  await new Promise((r) => upstream.close(r));
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
});

function serverEnv(extra) {
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_ALLOWED_PATHS: work, ...extra,
  };
}

// Every file under dir, recursively.
function filesUnder(dir) {
  const out = [];
  for (const n of readdirSync(dir)) {
    const p = path.join(dir, n);
    if (statSync(p).isDirectory()) out.push(...filesUnder(p)); else out.push(p);
  }
  return out;
}

function checkSandboxSide(outDir, tokenVar) {
  assert.equal(readFileSync(path.join(outDir, "answer.txt"), "utf8"), "done\n", "the tool call wrote /out/answer.txt");
  assert.ok(existsSync(path.join(outDir, "scan.done")), "the in-sandbox scan ran");
  assert.equal(readFileSync(path.join(outDir, "found.txt"), "utf8"), "/tmp/control.txt\n",
    "no file in the sandbox holds the real credential (and the scan found the control file)");
  assert.equal(readFileSync(path.join(outDir, "found_proc.txt"), "utf8"), "",
    "no process environment or command line in the sandbox holds the real credential");
  assert.ok(Number(readFileSync(path.join(outDir, "control_proc.txt"), "utf8")) > 0, "the process scan sees the token");
  const env = readFileSync(path.join(outDir, "env.txt"), "utf8");
  assert.match(env, new RegExp(`^${tokenVar}=dmsn-[0-9a-f]{48}$`, "m"), "the sandbox holds the per-run token instead");
  assert.equal(readFileSync(path.join(outDir, "wrong_token.txt"), "utf8"), "401", "a wrong token is refused");
  assert.equal(readFileSync(path.join(outDir, "bad_path.txt"), "utf8"), "403", "a path outside the routes is refused");
  for (const f of filesUnder(outDir)) {
    assert.ok(!readFileSync(f).includes(SECRET), `${path.relative(outDir, f)} does not hold the credential`);
  }
}

test("claude_code: scripted turn through the vendor route, credential swapped, usage counted", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    const { tools } = await conn.client.listTools();
    const t = tools.find((x) => x.name === "sandbox_agent");
    assert.ok(t, "sandbox_agent is listed");
    assert.ok(t.inputSchema.properties.model.enum.includes("sonnet"));
    assert.ok(!t.inputSchema.properties.model.enum.includes("gpt-5.6-sol"), "only providers with credentials");

    const research = tools.find((x) => x.name === "sandbox_research");
    assert.ok(research, "sandbox_research is listed");
    for (const k of ["files", "directories", "egress"]) assert.ok(!(k in research.inputSchema.properties), `research has no ${k}`);
    const open = await conn.client.callTool({ name: "sandbox_agent", arguments: { prompt: "x", egress: "open" } });
    assert.equal(open.isError, true, "sandbox_agent refuses open egress");

    const bad = await conn.client.callTool({ name: "sandbox_agent", arguments: { prompt: "x", model: "no-such-model" } });
    assert.equal(bad.isError, true);
    assert.match(bad.content[0].text, /sonnet.*no-such-model/s, "the error lists the known models");

    const before = seen.length;
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "Write done to /out/answer.txt.", model: "sonnet", timeout_seconds: 180,
      success_criteria: ["/out/answer.txt holds done"], output_path: "answer.txt",
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, FINAL);
    const outDir = r.output_dir;
    checkSandboxSide(outDir, "ANTHROPIC_API_KEY");
    assert.equal(readFileSync(path.join(outDir, "ifaces.txt"), "utf8").trim(), "lo", "egress none: no network device but lo");

    // the upstream saw only the real credential, on the two scripted turns
    const mine = seen.slice(before).filter((s) => s.provider === "anthropic");
    assert.equal(mine.filter((s) => s.method === "POST").length, 2, JSON.stringify(mine));
    for (const s of mine) assert.equal(s.auth, SECRET);
    assert.ok(mine.every((s) => s.url.startsWith("/v1/messages")), "the query is kept, the path mapped");

    // usage: two turns, 100+200 input, 20+30 output, claude-sonnet-5 at 3/15 USD per million
    const usage = JSON.parse(readFileSync(path.join(outDir, "usage.json"), "utf8"));
    assert.equal(usage.models["claude-sonnet-5"].input, 300);
    assert.equal(usage.models["claude-sonnet-5"].output, 50);
    assert.equal(usage.models["claude-sonnet-5"].requests, 2);
    const cost = (300 * 3 + 50 * 15) / 1e6;
    assert.ok(Math.abs(usage.cost_usd - cost) < 1e-9, `cost ${usage.cost_usd}`);
    assert.ok(Math.abs(r.cost_usd - cost) < 1e-9);
    assert.equal(r.usage["claude-sonnet-5"].output, 50);
    const lines = readFileSync(path.join(outDir, "usage.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    assert.equal(lines.filter((l) => l.verdict === "forward").length, 2);
    assert.ok(lines.some((l) => l.verdict === "deny" && l.status === 401));
    assert.ok(lines.some((l) => l.verdict === "deny" && l.status === 403));
    const results = JSON.parse(readFileSync(path.join(outDir, "results.json"), "utf8"));
    assert.equal(results.answer, FINAL);
    assert.ok(existsSync(path.join(outDir, "transcript.jsonl")));
    assert.ok(!conn.stderr().includes(SECRET), "the server log does not hold the credential");
  } finally {
    await conn.client.close();
  }
});

test("claude_code: a vendor 429 is waited out until its reset and the run goes on", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    limitedOnce = 0;
    const n0 = limited.length;
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "RATELIMIT_ONCE: write done to /out/answer.txt.", model: "sonnet", timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, FINAL);
    assert.equal(r.reason, undefined);
    assert.equal(limited.length - n0, 1, "one 429 was answered");
    assert.deepEqual(r.rate_limited, { answers: 1, retried: 1, held: 1, resumed: 0, budget: 3 });
    const lines = readFileSync(path.join(r.output_dir, "usage.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    const first = lines.findIndex((l) => l.status === 429);
    assert.ok(first >= 0, "the 429 is in usage.jsonl");
    assert.equal(lines[first].rate_limited, true);
    assert.ok(lines[first].retry_in_ms >= 1000, JSON.stringify(lines[first]));
    assert.equal(lines[first + 1].status, 200);
    assert.equal(lines[first + 1].retry, true, "the same request was sent again after the reset");
    const usage = JSON.parse(readFileSync(path.join(r.output_dir, "usage.json"), "utf8"));
    assert.equal(usage.rate_limited.answers, 1);
    assert.equal(usage.models["claude-sonnet-5"].requests, 2, "the 429 is not a counted model request");
    const transcript = readFileSync(path.join(r.output_dir, "transcript.jsonl"), "utf8");
    assert.ok(!transcript.includes('"api_retry"'), "the CLI never saw the 429");
  } finally {
    await conn.client.close();
  }
});

test("claude_code: a vendor that keeps answering 429 ends the run with a clear reason", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
    DEMESNE_AGENT_RATE_LIMIT_RETRIES: "1",
  }) });
  try {
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "RATELIMIT_ALWAYS: write done to /out/answer.txt.", model: "sonnet", timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.notEqual(r.exit_code, 0);
    assert.match(r.reason, /^rate limited by the vendor; retry budget of 1 exhausted \(reset at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)$/,
      JSON.stringify(r));
    assert.match(res.content[0].text, /reason: rate limited by the vendor/);
    assert.equal(r.rate_limited.retried, 1);
    assert.ok(r.rate_limited.answers >= 2);
    const results = JSON.parse(readFileSync(path.join(r.output_dir, "results.json"), "utf8"));
    assert.equal(results.reason, r.reason);
    const lines = readFileSync(path.join(r.output_dir, "usage.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    assert.ok(lines.some((l) => l.status === 429 && l.rate_limit === "retry budget of 1 exhausted"));
  } finally {
    await conn.client.close();
  }
});

// The CLI's attempt ends on a 429 whose reset is longer than the route holds a request; the
// host waits for the reset and runs the CLI again resuming its session.
async function resumeRun(t, { model, env, provider }) {
  const conn = await connect({ fixtures: false, env: serverEnv({ DEMESNE_AGENT_RATE_LIMIT_HOLD_SECONDS: "1", ...env }) });
  try {
    const n0 = limited.length;
    const r0 = resumedRequests.length;
    const started = Date.now();
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "LIMIT_UNTIL_RESUMED: write done to /out/answer.txt.", model, timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, JSON.stringify(r) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.answer, FINAL);
    assert.equal(r.reason, undefined);
    assert.equal(readFileSync(path.join(r.output_dir, "answer.txt"), "utf8"), "done\n", "turn 1's work is kept");
    assert.ok(limited.length - n0 >= 1, "the vendor answered 429");
    assert.equal(r.rate_limited.resumed, 1, JSON.stringify(r.rate_limited));
    assert.equal(r.rate_limited.held, 0, "a 3 s reset is longer than the 1 s hold");
    assert.equal(r.rate_limited.retried, 1);
    const mine = resumedRequests.slice(r0).filter((x) => x.provider === provider);
    assert.ok(mine.length >= 1, "the CLI ran again with the resume prompt");
    assert.ok(mine.every((x) => x.history), "the resumed request carries the session's history (turn 1's tool call)");
    const firstLimit = limited[n0];
    assert.ok(Date.now() - started >= 3000 && Date.now() - firstLimit >= 3000, "the resume waited for the reset");
    const stderr = readFileSync(path.join(r.output_dir, "stderr.log"), "utf8");
    assert.match(stderr, /resuming session \S+ \(attempt 2\)/);
    const lines = readFileSync(path.join(r.output_dir, "usage.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    const att = lines.filter((l) => l.path === "/.demesne/attempt");
    assert.deepEqual(att.map((l) => [l.attempt, l.decision]), [[1, "resume"], [2, "stop"]], JSON.stringify(att));
    assert.ok(att[0].resume_in_ms >= 1000, JSON.stringify(att[0]));
    assert.ok(lines.some((l) => l.status === 429 && l.resume === true), "the 429 went to the CLI marked for a resume");
    const results = JSON.parse(readFileSync(path.join(r.output_dir, "results.json"), "utf8"));
    assert.equal(results.rate_limited.resumed, 1);
    return r;
  } finally {
    await conn.client.close();
  }
}

test("claude_code: a rate limit longer than the hold ends the attempt; the session is resumed after the reset", { timeout: 240_000 }, async (t) => {
  await resumeRun(t, { model: "sonnet", provider: "anthropic", env: {
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  } });
});

test("codex: a usage limit whose reset is only in the body is waited out by resuming the thread", { timeout: 240_000 }, async (t) => {
  await resumeRun(t, { model: "gpt-5.6-sol", provider: "openai", env: {
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${port}/openai/v1`,
    DEMESNE_CLAUDE_CODE_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
    ANTHROPIC_API_KEY: "", CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "",
    CODEX_HOME: path.join(work, "no-codex-home"),
  } });
});

test("codex: scripted turn through the vendor route, credential swapped, usage counted", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${port}/openai/v1`,
    DEMESNE_CLAUDE_CODE_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
    ANTHROPIC_API_KEY: "", CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "",
    CODEX_HOME: path.join(work, "no-codex-home"),
  }) });
  try {
    const before = seen.length;
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "Write done to /out/answer.txt.", model: "gpt-5.6-sol", timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, FINAL);
    const outDir = r.output_dir;
    checkSandboxSide(outDir, "AGENT_API_KEY");

    const mine = seen.slice(before).filter((s) => s.provider === "openai");
    assert.equal(mine.length, 2, JSON.stringify(mine));
    for (const s of mine) {
      assert.equal(s.auth, `Bearer ${SECRET}`);
      assert.equal(s.url, "/openai/v1/responses");
    }
    // usage: 150+300 input, 25+40 output, gpt-5.6-sol at 5/30 USD per million
    const usage = JSON.parse(readFileSync(path.join(outDir, "usage.json"), "utf8"));
    assert.equal(usage.models["gpt-5.6-sol"].input, 450);
    assert.equal(usage.models["gpt-5.6-sol"].output, 65);
    const cost = (450 * 5 + 65 * 30) / 1e6;
    assert.ok(Math.abs(usage.cost_usd - cost) < 1e-9, `cost ${usage.cost_usd}`);
    assert.ok(Math.abs(r.cost_usd - cost) < 1e-9);
    assert.ok(!conn.stderr().includes(SECRET), "the server log does not hold the credential");
  } finally {
    await conn.client.close();
  }
});

test("claude_code in the background: the job ends, results.json and usage.json are written", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    const started = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "Write done to /out/answer.txt.", timeout_seconds: 180, background: true,
    } });
    assert.ok(!started.isError, JSON.stringify(started.content));
    const { job_id: jobId, output_dir: outDir } = started.structuredContent;
    assert.match(jobId, /^job-/);
    const done = await conn.client.callTool({ name: "sandbox_wait", arguments: { job_id: jobId, timeout_seconds: 200 } },
      undefined, { timeout: 230_000 });
    assert.equal(done.structuredContent.status, "succeeded", JSON.stringify(done.structuredContent));
    assert.match(done.structuredContent.stdout, /"type":"result"/, "the job's stdout is the transcript");
    assert.equal(done.structuredContent.agent.answer, FINAL, "sandbox_wait carries the agent's answer");
    assert.ok(Math.abs(done.structuredContent.agent.cost_usd - (300 * 3 + 50 * 15) / 1e6) < 1e-9);
    assert.match(done.content[0].text, /--- answer ---\nThe answer is done\./);
    assert.equal(readFileSync(path.join(outDir, "answer.txt"), "utf8"), "done\n");
    const results = JSON.parse(readFileSync(path.join(outDir, "results.json"), "utf8"));
    assert.equal(results.answer, FINAL);
    assert.equal(results.model, "sonnet");
    assert.ok(Math.abs(results.cost_usd - (300 * 3 + 50 * 15) / 1e6) < 1e-9);
    const usage = JSON.parse(readFileSync(path.join(outDir, "usage.json"), "utf8"));
    assert.equal(usage.models["claude-sonnet-5"].input, 300);
  } finally {
    await conn.client.close();
  }
});

// issue 24 §3: tasks/result of a task-augmented sandbox_agent is the agent's result (its
// answer, cost and usage), not a script's exit code and stdout
test("claude_code as an MCP task: tasks/result carries the answer and the cost", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    const { tools } = await conn.client.listTools();
    assert.equal(tools.find((x) => x.name === "sandbox_agent").execution?.taskSupport, "optional");
    const seenTypes = [];
    let result;
    for await (const m of conn.client.experimental.tasks.callToolStream({ name: "sandbox_agent", arguments: {
      prompt: "Write done to /out/answer.txt.", timeout_seconds: 180 } }, undefined, { task: { ttl: 600000 }, timeout: 230_000 })) {
      seenTypes.push(m.type);
      if (m.type === "result") result = m.result;
      if (m.type === "error") assert.fail(`${m.error.code}: ${m.error.message}`);
    }
    assert.equal(seenTypes[0], "taskCreated");
    assert.ok(result, `a result arrived (${seenTypes.join(",")})`);
    assert.ok(!result.isError, JSON.stringify(result.content));
    const r = result.structuredContent;
    assert.equal(r.exit_code, 0);
    assert.equal(r.answer, FINAL, "the agent's answer, as the call without a task gives it");
    assert.ok(Math.abs(r.cost_usd - (300 * 3 + 50 * 15) / 1e6) < 1e-9, `cost ${r.cost_usd}`);
    assert.equal(r.usage["claude-sonnet-5"].output, 50);
    assert.equal(r.provider, "claude_code");
    assert.match(r.run_id, /^\d{8}T\d{6}Z-/);
    assert.equal(r.stdout, undefined, "not a script's result");
    assert.match(result.content[0].text, /--- answer ---\nThe answer is done\./);
    assert.equal(readFileSync(path.join(r.output_dir, "answer.txt"), "utf8"), "done\n");
  } finally {
    await conn.client.close();
  }
});

test("a background agent survives a server restart: the vendor route comes back, usage is kept", { timeout: 240_000 }, async () => {
  const env = serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
    DEMESNE_STATE_DIR: path.join(work, "state-restart"),
  });
  const a = await connect({ fixtures: false, env });
  const before = seen.length;
  const started = await a.client.callTool({ name: "sandbox_agent", arguments: {
    prompt: "Write done to /out/answer.txt, SLOWLY.", timeout_seconds: 180, background: true,
  } });
  assert.ok(!started.isError, JSON.stringify(started.content));
  const { job_id: jobId, output_dir: outDir } = started.structuredContent;
  // turn 1 (the tool call, which sleeps 5 s) has been answered: stop the server meanwhile
  const t0 = Date.now();
  while (!seen.slice(before).some((s) => s.method === "POST") && Date.now() - t0 < 60_000) {
    await new Promise((r) => setTimeout(r, 100));
  }
  await a.client.close(); // a graceful stop leaves the job running
  const b = await connect({ fixtures: false, env });
  try {
    const done = await b.client.callTool({ name: "sandbox_wait", arguments: { job_id: jobId, timeout_seconds: 200 } },
      undefined, { timeout: 230_000 });
    assert.equal(done.structuredContent.status, "succeeded", JSON.stringify(done.structuredContent));
    assert.equal(readFileSync(path.join(outDir, "answer.txt"), "utf8"), "done\n");
    const results = JSON.parse(readFileSync(path.join(outDir, "results.json"), "utf8"));
    assert.equal(results.answer, FINAL);
    const usage = JSON.parse(readFileSync(path.join(outDir, "usage.json"), "utf8"));
    assert.equal(usage.models["claude-sonnet-5"].requests, 2, "turn 1 (first server) and turn 2 (second) both counted");
    assert.equal(usage.models["claude-sonnet-5"].input, 300);
    for (const s of seen.slice(before)) assert.equal(s.auth, SECRET);
  } finally {
    await b.client.close();
  }
});

test("a server restart while a session resume waits for the reset: the wait is kept, the budget drawn on once", { timeout: 240_000 }, async () => {
  const env = serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
    DEMESNE_STATE_DIR: path.join(work, "state-resume-restart"), DEMESNE_AGENT_RATE_LIMIT_HOLD_SECONDS: "1",
  });
  const a = await connect({ fixtures: false, env });
  const n0 = limited.length;
  const r0 = resumedRequests.length;
  const started = await a.client.callTool({ name: "sandbox_agent", arguments: {
    prompt: "LIMIT_UNTIL_RESUMED_SLOWLY: write done to /out/answer.txt.", timeout_seconds: 180, background: true,
  } });
  assert.ok(!started.isError, JSON.stringify(started.content));
  const { job_id: jobId, output_dir: outDir } = started.structuredContent;
  // the 429 (reset 10 s ahead) has gone to the CLI: give the wrapper a moment to ask, then restart
  const t0 = Date.now();
  while (limited.length === n0 && Date.now() - t0 < 90_000) await new Promise((r) => setTimeout(r, 100));
  assert.ok(limited.length > n0, "the vendor answered 429");
  await new Promise((r) => setTimeout(r, 2000));
  await a.client.close();
  const b = await connect({ fixtures: false, env });
  try {
    const done = await b.client.callTool({ name: "sandbox_wait", arguments: { job_id: jobId, timeout_seconds: 200 } },
      undefined, { timeout: 230_000 });
    assert.equal(done.structuredContent.status, "succeeded", JSON.stringify(done.structuredContent) + b.stderr().slice(-3000));
    const results = JSON.parse(readFileSync(path.join(outDir, "results.json"), "utf8"));
    assert.equal(results.answer, FINAL);
    assert.equal(results.rate_limited.resumed, 1, JSON.stringify(results.rate_limited));
    assert.equal(results.rate_limited.retried, 1, "the resume granted before the restart is not granted twice");
    assert.ok(Date.now() - limited[n0] >= 10_000, "the reset was waited for");
    assert.ok(resumedRequests.slice(r0).length >= 1);
    assert.ok(!existsSync(path.join(work, "state-resume-restart", "vendor", `${results.run_id}.json`)),
      "the saved rate-limit state is removed with the run");
  } finally {
    await b.client.close();
  }
});

// Open egress gives the sandbox a bridge network. Nothing here connects anywhere: the CLIs
// make no connection but the model calls (CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, see
// agent-clis.md), which go over the vendor port's relay to this test's loopback upstream,
// and the scripted tool call only reads and writes files.
test("sandbox_research: the same agent run with open egress and no host inputs", { timeout: 240_000 }, async () => {
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    const files = await conn.client.callTool({ name: "sandbox_research", arguments: { prompt: "x", files: [work] } });
    assert.equal(files.isError, true, "sandbox_research takes no host inputs");
    assert.match(files.content[0].text, /files/);
    const res = await conn.client.callTool({ name: "sandbox_research", arguments: {
      prompt: "Write done to /out/answer.txt.", model: "sonnet", timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, FINAL);
    checkSandboxSide(r.output_dir, "ANTHROPIC_API_KEY");
    const env = readFileSync(path.join(r.output_dir, "env.txt"), "utf8");
    if (process.env.DEMESNE_TEST_ISOLATION === "gvisor") {
      // gVisor has no network but loopback: the research run's web goes through the proxy
      assert.match(env, /^HTTPS_PROXY=http:\/\/127\.0\.0\.1:3128$/m, "under gVisor: the web policy's proxy");
    } else {
      const ifaces = readFileSync(path.join(r.output_dir, "ifaces.txt"), "utf8").trim().split("\n");
      assert.ok(ifaces.some((i) => i !== "lo"), `open egress: a network device besides lo (${ifaces})`);
      assert.ok(!/^HTTPS?_PROXY=/m.test(env), "open egress: no proxy in the way");
    }
    const usage = JSON.parse(readFileSync(path.join(r.output_dir, "usage.json"), "utf8"));
    assert.equal(usage.models["claude-sonnet-5"].requests, 2);
    const context = readdirSync(r.output_dir);
    assert.ok(context.includes("results.json"));
  } finally {
    await conn.client.close();
  }
});

// A ChatGPT login (auth.json with OAuth tokens, no API key) whose access token has expired:
// the host refreshes it before the run, as the Codex CLI would, and writes it back. The
// refreshed token is the real credential here: the upstream must see it, the sandbox never.
test("codex with a ChatGPT login: an expired access token is refreshed on the host, never seen in the sandbox", { timeout: 240_000 }, async () => {
  const b64 = (o) => Buffer.from(JSON.stringify(o)).toString("base64url");
  const authFile = path.join(work, "codex-auth.json");
  writeFileSync(authFile, JSON.stringify({ OPENAI_API_KEY: null, auth_mode: "chatgpt",
    tokens: { id_token: "id-old", access_token: `${b64({ alg: "none" })}.${b64({ exp: Math.floor(Date.now() / 1000) - 60 })}.x`,
      refresh_token: "rt-old", account_id: "acct-test" }, last_refresh: "2026-01-01T00:00:00Z" }), { mode: 0o600 });
  const conn = await connect({ fixtures: false, env: serverEnv({
    OPENAI_API_KEY: "", DEMESNE_CODEX_AUTH_FILE: authFile,
    DEMESNE_CODEX_REFRESH_URL: `http://127.0.0.1:${port}/oauth/token`,
    DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${port}/openai/v1`,
    DEMESNE_CLAUDE_CODE_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  }) });
  try {
    const before = seen.length;
    const t0 = tokenRequests.length;
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "Write done to /out/answer.txt.", model: "gpt-5.6-sol", timeout_seconds: 180,
    } }, undefined, { timeout: 230_000 });
    const r = res.structuredContent;
    assert.ok(!res.isError, JSON.stringify(res.content) + "\n" + conn.stderr().slice(-3000));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, FINAL);
    assert.deepEqual(tokenRequests.slice(t0), [{ grant_type: "refresh_token", refresh_token: "rt-old",
      client_id: "app_EMoamEEZ73f0CkXaXp7hrann", scope: "openid profile email" }]);
    const auth = JSON.parse(readFileSync(authFile, "utf8"));
    assert.equal(auth.tokens.access_token, SECRET);
    assert.equal(auth.tokens.refresh_token, "rt-new");
    assert.equal(auth.tokens.account_id, "acct-test");
    assert.equal(auth.auth_mode, "chatgpt");
    assert.ok(Date.parse(auth.last_refresh) > Date.now() - 600_000, auth.last_refresh);
    assert.equal(statSync(authFile).mode & 0o777, 0o600);
    const mine = seen.slice(before).filter((x) => x.provider === "openai");
    assert.equal(mine.length, 2);
    for (const x of mine) {
      assert.equal(x.auth, `Bearer ${SECRET}`, "the upstream sees the refreshed token");
      assert.equal(x.account, "acct-test");
    }
    checkSandboxSide(r.output_dir, "AGENT_API_KEY");
    assert.ok(!conn.stderr().includes(SECRET), "the server log does not hold the token");
  } finally {
    await conn.client.close();
  }
});

test("cancelling a background agent while the route holds a rate-limited request stops the route", { timeout: 240_000 }, async () => {
  const stateDir = path.join(work, "state-cancel-hold");
  const conn = await connect({ fixtures: false, env: serverEnv({
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_STATE_DIR: stateDir,
  }) });
  try {
    const n0 = limited.length;
    const started = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: "RATELIMIT_LONG_HOLD: write done to /out/answer.txt.", timeout_seconds: 180, background: true,
    } });
    assert.ok(!started.isError, JSON.stringify(started.content));
    const { job_id: jobId, output_dir: outDir, run_id: runId } = started.structuredContent;
    const t0 = Date.now();
    while (limited.length === n0 && Date.now() - t0 < 90_000) await new Promise((r) => setTimeout(r, 100));
    assert.ok(limited.length > n0, "the vendor answered 429 (reset 8 s ahead: held in the route)");
    const cancelled = await conn.client.callTool({ name: "sandbox_cancel", arguments: { job_id: jobId } });
    assert.equal(cancelled.structuredContent.status, "cancelled", JSON.stringify(cancelled.structuredContent));
    const seenAtCancel = seen.length;
    await new Promise((r) => setTimeout(r, 10_000)); // past the reset
    assert.equal(seen.length, seenAtCancel, "the held request was not sent after the cancel");
    const results = JSON.parse(readFileSync(path.join(outDir, "results.json"), "utf8"));
    assert.match(results.reason, /^cancelled/);
    assert.ok(!existsSync(path.join(stateDir, "vendor", `${runId}.json`)), "the rate-limit state is gone with the run");
  } finally {
    await conn.client.close();
  }
});
