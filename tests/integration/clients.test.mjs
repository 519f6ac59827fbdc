// The README's "Use it from Claude Code and Codex" snippets, run as written with the real
// CLIs on this host: Claude Code 2.1.197 and Codex 0.171.0 (the versions in the agent
// images, installed from npm into build/agent-clis), each as an MCP client of demesne over
// stdio and over HTTP. No model is reachable: ANTHROPIC_BASE_URL and a Codex custom
// provider point at a scripted model on 127.0.0.1 in this test, which calls demesne's tools
// one after the other (sandbox_script, sandbox_create, sandbox_exec, sandbox_list,
// sandbox_destroy: read-only and destructive ones) and records what each returned. Every
// call must reach the engine (DEMESNE_ENGINE for the HTTP server; discovery, as pasted, for
// the stdio ones) and come back with its result, not a refusal ("requires approval").
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import net from "node:net";
import { BIN, ROOT } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const ENGINES = ["/run/podman/podman.sock", "/var/run/docker.sock"].filter((p) => existsSync(p));
const CLAUDE_VERSION = "2.1.197";
const CODEX_VERSION = "0.171.0";
const CLIS = path.join(ROOT, "build/agent-clis");
const work = mkdtempSync(path.join(tmpdir(), "demesne-clients-"));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// --- the README snippets ------------------------------------------------------------------
function snippets() {
  const md = readFileSync(path.join(ROOT, "README.md"), "utf8");
  const out = {};
  for (const m of md.matchAll(/<!-- snippet: ([\w-]+) -->\s*```\w*\n([\s\S]*?)```/g)) out[m[1]] = m[2].trim();
  return out;
}
const SNIPPETS = snippets();

// --- the CLIs -----------------------------------------------------------------------------
function installClis() {
  const ok = (bin, want) => {
    try { return execFileSync(path.join(CLIS, "node_modules/.bin", bin), ["--version"], { encoding: "utf8" }).includes(want); }
    catch { return false; }
  };
  if (ok("claude", CLAUDE_VERSION) && ok("codex", CODEX_VERSION)) return;
  mkdirSync(CLIS, { recursive: true });
  if (!existsSync(path.join(CLIS, "package.json"))) writeFileSync(path.join(CLIS, "package.json"), '{"private": true}\n');
  execFileSync("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error",
    `@anthropic-ai/claude-code@${CLAUDE_VERSION}`, `@openai/codex@${CODEX_VERSION}`], { cwd: CLIS, stdio: "inherit" });
  assert.ok(ok("claude", CLAUDE_VERSION) && ok("codex", CODEX_VERSION), "the CLIs installed");
}

// --- the scripted model ---------------------------------------------------------------------
// Each run's prompt names the run; the model's next step is the number of tool results in
// the history so far.
const PLAN = [
  { tool: "sandbox_script", args: () => ({ command: "echo script-ok", image: "base" }) },
  { tool: "sandbox_create", args: () => ({ image: "base" }) },
  { tool: "sandbox_exec", args: (sb) => ({ sandbox_id: sb, command: "echo exec-ok > /out/exec.txt; echo exec-ok" }) },
  { tool: "sandbox_list", args: () => ({}) },
  { tool: "sandbox_destroy", args: (sb) => ({ sandbox_id: sb }) },
];
const FINAL = "All five demesne tools ran.";
const runs = new Map(); // run id -> {results: [text…], toolNames: []}
let vendor, vendorPort;

// The tool `want` among those the CLI offered: {name, namespace?}. Codex groups an MCP
// server's tools in a Responses API namespace ("mcp__demesne"), Claude Code prefixes them
// (mcp__demesne__sandbox_exec).
function toolName(tools, want) {
  for (const t of tools || []) {
    if (t?.type === "namespace" && Array.isArray(t.tools) && t.tools.some((x) => x.name === want) && /demesne/.test(t.name)) {
      return { name: want, namespace: t.name };
    }
  }
  const flat = (tools || []).map((t) => t?.name).filter((n) => typeof n === "string");
  const name = flat.find((n) => n.endsWith(`__${want}`) && /demesne/.test(n));
  return name ? { name } : null;
}
const textOf = (x) => (typeof x === "string" ? x : JSON.stringify(x));
function runOf(body) {
  const m = JSON.stringify(body).match(/demesne-run-([0-9a-f]{12})/);
  if (!m) return null;
  if (!runs.has(m[1])) runs.set(m[1], { results: [], toolNames: [] });
  return runs.get(m[1]);
}
function nextCall(run, tools) {
  const step = run.results.length;
  if (step >= PLAN.length) return null;
  const sb = (run.results[1] || "").match(/"sandbox_id":\s*"([^"]+)"/)?.[1] || "missing-sandbox-id";
  const t = toolName(tools, PLAN[step].tool);
  run.toolNames[step] = t && (t.namespace ? `${t.namespace}__${t.name}` : t.name);
  return { ...(t || { name: `mcp__demesne__${PLAN[step].tool}` }), input: PLAN[step].args(sb) };
}

function anthropic(res, body) {
  const msgs = body.messages || [];
  const side = Array.isArray(body.tools) && body.tools.length === 0;
  const run = side ? null : runOf(msgs);
  let blocks, stop;
  if (run) {
    run.results = [];
    for (const m of msgs) {
      if (m.role !== "user" || !Array.isArray(m.content)) continue;
      for (const b of m.content) if (b.type === "tool_result") run.results.push(textOf(b.content));
    }
    const call = nextCall(run, body.tools);
    if (call) {
      blocks = [{ type: "tool_use", id: "toolu_" + randomBytes(6).toString("hex"), name: call.name, input: call.input }];
      stop = "tool_use";
    }
  }
  if (!blocks) { blocks = [{ type: "text", text: side ? "ok" : FINAL }]; stop = "end_turn"; }
  const id = "msg_" + randomBytes(6).toString("hex");
  const model = "claude-sonnet-5";
  if (!body.stream) {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ id, type: "message", role: "assistant", model, content: blocks, stop_reason: stop,
      usage: { input_tokens: 10, output_tokens: 5 } }));
    return;
  }
  const events = [{ type: "message_start", message: { id, type: "message", role: "assistant", content: [], model,
    stop_reason: null, usage: { input_tokens: 10, output_tokens: 1 } } }];
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
  events.push({ type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: 5 } });
  events.push({ type: "message_stop" });
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  for (const ev of events) res.write(`event: ${ev.type}\ndata: ${JSON.stringify(ev)}\n\n`);
  res.end();
}

function openai(res, body) {
  const input = body.input || [];
  const run = runOf(input);
  let item;
  if (run) {
    run.results = input.filter((i) => typeof i.type === "string" && i.type.endsWith("_output") && i.call_id)
      .map((i) => textOf(i.output));
    const call = nextCall(run, body.tools);
    if (call) {
      item = { type: "function_call", id: "fc_" + randomBytes(6).toString("hex"), call_id: "call_" + randomBytes(6).toString("hex"),
        name: call.name, ...(call.namespace ? { namespace: call.namespace } : {}), arguments: JSON.stringify(call.input) };
    }
  }
  const id = "resp_" + randomBytes(6).toString("hex");
  if (!item) item = { type: "message", role: "assistant", id: "msg_" + id, content: [{ type: "output_text", text: FINAL }] };
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  for (const ev of [
    { type: "response.created", response: { id, model: body.model } },
    { type: "response.output_item.done", output_index: 0, item },
    { type: "response.completed", response: { id, model: body.model, output: [item], usage: { input_tokens: 10,
      input_tokens_details: { cached_tokens: 0 }, output_tokens: 5, output_tokens_details: { reasoning_tokens: 0 }, total_tokens: 15 } } },
  ]) res.write(`data: ${JSON.stringify(ev)}\n\n`);
  res.end();
}

before(async () => {
  installClis();
  vendor = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      if (req.method !== "POST") { res.writeHead(404); res.end(); return; }
      let body = {};
      try { body = JSON.parse(Buffer.concat(chunks).toString("utf8") || "{}"); } catch { /* empty */ }
      if (req.url.startsWith("/openai/")) openai(res, body); else anthropic(res, body);
    });
  });
  await new Promise((r) => vendor.listen(0, "127.0.0.1", r));
  vendorPort = vendor.address().port;
});
after(async () => {
  await new Promise((r) => vendor?.close(r) ?? r());
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
});

// --- helpers --------------------------------------------------------------------------------
function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); });
  });
}
// A new user's home: nothing of ours in the environment but HOME, PATH and the engine.
function userEnv(home, extra = {}) {
  const env = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (!/^(DEMESNE_|XDG_|CLAUDE|ANTHROPIC|CODEX|OPENAI|MCP_)/.test(k)) env[k] = v;
  }
  return { ...env, HOME: home, PATH: `${path.join(CLIS, "node_modules/.bin")}:${path.dirname(BIN)}:${process.env.PATH}`,
    NO_PROXY: "127.0.0.1,localhost", ...extra };
}
function newHome(name) {
  const home = path.join(work, name);
  mkdirSync(path.join(home, "projects"), { recursive: true });
  mkdirSync(path.join(home, "work"), { recursive: true });
  return home;
}
// The snippet as a user pastes it: only the binary's path, the example folder and the port
// are theirs.
function paste(text, home, port) {
  return text.replaceAll("/path/to/build/demesne", BIN).replaceAll("/home/me/projects", path.join(home, "projects"))
    .replaceAll("8765", String(port));
}
function run(cmd, args, { env, cwd, timeout = 240_000 }) {
  return new Promise((resolve) => {
    const p = spawn(cmd, args, { env, cwd, stdio: ["ignore", "pipe", "pipe"], detached: true });
    let out = "", err = "";
    p.stdout.on("data", (d) => (out += d));
    p.stderr.on("data", (d) => (err += d));
    const t = setTimeout(() => { try { process.kill(-p.pid, "SIGKILL"); } catch { /* gone */ } }, timeout);
    p.on("exit", (code, signal) => { clearTimeout(t); resolve({ code, signal, out, err }); });
  });
}
function engineGet(socket, p) {
  return new Promise((resolve, reject) => {
    http.get({ socketPath: socket, path: p }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve(JSON.parse(body)));
    }).on("error", reject);
  });
}
async function containersUnder(dir) {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
  const all = [];
  for (const s of ENGINES) all.push(...await engineGet(s, `/containers/json?all=true&filters=${filters}`));
  return all.filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir));
}
async function startServer(home, port) {
  const env = userEnv(home, { DEMESNE_ENGINE: ENGINE });
  const p = spawn("bash", ["-c", paste(SNIPPETS["serve-http"], home, port)],
    { env, cwd: home, stdio: ["ignore", "ignore", "pipe"], detached: true });
  let err = "";
  p.stderr.on("data", (d) => (err += d));
  const deadline = Date.now() + 15000;
  while (!/serving MCP over HTTP/.test(err)) {
    if (Date.now() > deadline || p.exitCode !== null) throw new Error(`the server did not start:\n${err}`);
    await sleep(100);
  }
  return { proc: p, stderr: () => err, stop: async () => {
    process.kill(-p.pid, "SIGTERM");
    await new Promise((r) => (p.exitCode !== null ? r() : p.on("exit", r)));
  } };
}

function checkRun(id, r, home) {
  const rec = runs.get(id);
  const why = `exit ${r.code}; stdout:\n${r.out.slice(-3000)}\nstderr:\n${r.err.slice(-3000)}`;
  assert.ok(rec, `the CLI reached the scripted model: ${why}`);
  assert.deepEqual(rec.toolNames.map((n) => n?.replace(/^.*?__(?=sandbox_)/, "")),
    PLAN.map((p) => p.tool), `the CLI offered demesne's tools to the model: ${rec.toolNames}`);
  assert.equal(rec.results.length, PLAN.length, `every tool call came back: ${JSON.stringify(rec.results)}\n${why}`);
  const [script, create, exec, list, destroy] = rec.results;
  for (const t of rec.results) assert.doesNotMatch(t, /requires approval|cancelled|denied|not allowed|permission/i, t);
  assert.match(script, /script-ok/);
  const sb = create.match(/"sandbox_id":\s*"([^"]+)"/)?.[1];
  assert.ok(sb, `sandbox_create returned an id: ${create}`);
  assert.match(exec, /exec-ok/, "sandbox_exec ran");
  assert.ok(list.includes(sb), "sandbox_list lists it");
  assert.match(destroy, /destroyed|gone|removed|true/i, destroy);
  assert.equal(r.code, 0, why);
}

async function claude(home, id) {
  return run("claude", ["-p", `Use the demesne tools (demesne-run-${id}).`, "--model", "sonnet", "--output-format", "json",
    "--allowedTools", "mcp__demesne"], { cwd: path.join(home, "work"), env: userEnv(home, {
    ANTHROPIC_BASE_URL: `http://127.0.0.1:${vendorPort}/anthropic`, ANTHROPIC_API_KEY: "sk-test-fake-key",
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: "1", CLAUDE_CODE_MAX_RETRIES: "1", MCP_TIMEOUT: "30000" }) });
}

function codexHome(home, snippet) {
  const dir = path.join(home, ".codex");
  mkdirSync(dir, { recursive: true });
  // the test's model: a custom provider at the scripted model (top-level keys before any table)
  writeFileSync(path.join(dir, "config.toml"), [
    'model_provider = "scripted"',
    "",
    "[features]",
    "plugins = false",
    "",
    "[analytics]",
    "enabled = false",
    "",
    "[model_providers.scripted]",
    'name = "scripted model"',
    `base_url = "http://127.0.0.1:${vendorPort}/openai/v1"`,
    'wire_api = "responses"',
    'env_key = "AGENT_API_KEY"',
    "request_max_retries = 0",
    "stream_max_retries = 0",
    "",
    snippet, // the README's [mcp_servers.demesne], as pasted
    "",
  ].join("\n"));
}
async function codex(home, id, extraEnv = {}) {
  return run("codex", ["exec", "--json", "--skip-git-repo-check", "-m", "gpt-5", `Use the demesne tools (demesne-run-${id}).`],
    { cwd: path.join(home, "work"), env: userEnv(home, { AGENT_API_KEY: "fake-key", ...extraEnv }) });
}

// Asserts that no sandbox of this home is left; removes any that is (ours, on either engine).
async function noContainersLeft(home) {
  // the server removes its warm sandboxes and the one-shots it answered as it shuts down,
  // which on a loaded engine takes some seconds after the client has gone
  for (let i = 0; i < 150 && (await containersUnder(home)).length; i++) await sleep(200);
  const left = await containersUnder(home);
  for (const s of ENGINES) {
    for (const c of left) {
      await new Promise((r) => http.request({ socketPath: s, path: `/containers/${c.Id}?force=true`, method: "DELETE" },
        (res) => { res.resume(); res.on("end", r); }).on("error", r).end());
    }
  }
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox left behind");
}

// --- the snippets ---------------------------------------------------------------------------
test("README snippet claude-stdio: Claude Code starts demesne over stdio and calls every kind of tool", { timeout: 300_000 }, async () => {
  const home = newHome("claude-stdio");
  const id = randomBytes(6).toString("hex");
  try {
    const add = await run("bash", ["-c", paste(SNIPPETS["claude-stdio"], home, 0)], { cwd: path.join(home, "work"), env: userEnv(home) });
    assert.equal(add.code, 0, add.err);
    const r = await claude(home, id);
    checkRun(id, r, home);
  } finally {
    await noContainersLeft(home);
  }
});

test("README snippet codex-stdio: Codex starts demesne over stdio and may call the destructive tools", { timeout: 300_000 }, async () => {
  const home = newHome("codex-stdio");
  const id = randomBytes(6).toString("hex");
  codexHome(home, paste(SNIPPETS["codex-stdio"], home, 0));
  try {
    const r = await codex(home, id);
    checkRun(id, r, home);
  } finally {
    await noContainersLeft(home);
  }
});

test("README snippets serve-http + claude-http: Claude Code over HTTP with the bearer token", { timeout: 300_000 }, async () => {
  const home = newHome("claude-http");
  const port = await freePort();
  const srv = await startServer(home, port);
  try {
    assert.ok(existsSync(path.join(home, ".local/state/demesne/http-token")), "the token file the README names");
    const id = randomBytes(6).toString("hex");
    const add = await run("bash", ["-c", paste(SNIPPETS["claude-http"], home, port)], { cwd: path.join(home, "work"), env: userEnv(home) });
    assert.equal(add.code, 0, add.err);
    const r = await claude(home, id);
    checkRun(id, r, home);
    assert.match(srv.stderr(), /session: client claude-code/i, "Claude Code connected over HTTP");
  } finally {
    await srv.stop();
    await noContainersLeft(home);
  }
});

test("README snippets serve-http + codex-http: Codex over HTTP with bearer_token_env_var", { timeout: 300_000 }, async () => {
  const home = newHome("codex-http");
  const port = await freePort();
  const srv = await startServer(home, port);
  try {
    const token = readFileSync(path.join(home, ".local/state/demesne/http-token"), "utf8").trim();
    codexHome(home, paste(SNIPPETS["codex-http"], home, port));
    const id = randomBytes(6).toString("hex");
    const r = await codex(home, id, { DEMESNE_HTTP_TOKEN: token });
    checkRun(id, r, home);
    assert.match(srv.stderr(), /session: client codex/i, "Codex connected over HTTP");
  } finally {
    await srv.stop();
    await noContainersLeft(home);
  }
});
