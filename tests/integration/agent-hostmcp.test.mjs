// Host MCP servers offered inside agent sandboxes (issue 18), end to end: real MCP servers
// from the npm registry as upstreams on the host (@modelcontextprotocol/server-everything
// and server-memory, run offline from tests/integration/node_modules), the real agent CLIs
// in their real images on a real engine (DEMESNE_ENGINE; run the file once per engine), and
// a scripted model vendor on 127.0.0.1 (scripted-vendor.mjs) that decides the CLI's tool
// calls. Each offered host server reaches the CLI as an MCP server of its own on demesne's
// in-sandbox endpoint (http://127.0.0.1:3130/mcp/host/<server>, the run's bearer token).
//
// Configured: `everything` (tools echo and get-sum), `readonly` (the same server, tools
// "read-only"), and `imported` (server-memory, imported from a ~/.claude.json written here,
// no tools named). Covered: the CLI is offered exactly the allowed tools (never get-env of
// `everything`; for `readonly` exactly the tools whose real listing sets readOnlyHint; none
// of `imported`), calls echo and gets the upstream's real answer; forged requests from
// inside the sandbox (a direct tools/call of get-env, the path of a server not offered, a
// wrong token) are refused; mcp.jsonl in the run's output folder records the calls; the
// context file lists each server with its tools; a child agent narrows the set, and one
// asking for more than its parent has is refused; an unknown name at the host is refused
// naming the field.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { connect, engineContainers, engineRequest, ROOT } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-agent-hostmcp-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const MODULES = path.join(ROOT, "tests/integration/node_modules/@modelcontextprotocol");
const EVERYTHING = path.join(MODULES, "server-everything/dist/index.js");
const MEMORY = path.join(MODULES, "server-memory/dist/index.js");
const read = (...p) => readFileSync(path.join(...p), "utf8");

let vendor;
let readOnlyTools; // the names server-everything marks readOnlyHint, from its real listing

const engine = (method, p) => engineRequest(ENGINE, method, p);
async function containersUnder(dir) {
  return (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir));
}

before(async () => {
  vendor = await startVendor({ secret: SECRET });
  // what the upstream itself says, through the official SDK client (stdio)
  const client = new Client({ name: "demesne-tests", version: "1.0.0" });
  await client.connect(new StdioClientTransport({ command: "node", args: [EVERYTHING, "stdio"], stderr: "ignore" }));
  const { tools } = await client.listTools();
  await client.close();
  readOnlyTools = tools.filter((t) => t.annotations?.readOnlyHint === true).map((t) => t.name).sort();
  assert.ok(readOnlyTools.length > 0 && readOnlyTools.length < tools.length,
    `server-everything marks some tools read-only, not all: ${readOnlyTools}`);
  assert.ok(readOnlyTools.includes("get-env"), "get-env is marked read-only (the reason read-only is not harmless)");
});

after(async () => {
  await vendor.close();
  const left = await containersUnder(work);
  for (const c of left) await engine("DELETE", `/containers/${c.Id}?force=true`);
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

// A server environment with the three host servers configured (config.lua and ~/.claude.json).
function serverEnv(name) {
  const base = path.join(work, name);
  const xdg = path.join(base, "xdg");
  const home = path.join(base, "home");
  mkdirSync(path.join(xdg, "demesne"), { recursive: true });
  mkdirSync(home, { recursive: true });
  writeFileSync(path.join(xdg, "demesne", "config.lua"), `return {
  host_mcp = {
    everything = { command = "node", args = { ${JSON.stringify(EVERYTHING)}, "stdio" }, tools = { "echo", "get-sum" } },
    readonly = { command = "node", args = { ${JSON.stringify(EVERYTHING)}, "stdio" }, tools = "read-only" },
  },
}
`);
  writeFileSync(path.join(home, ".claude.json"), JSON.stringify({
    mcpServers: { imported: { type: "stdio", command: "node", args: [MEMORY] } } }));
  return {
    XDG_CONFIG_HOME: xdg, HOME: home, DEMESNE_HOST_MCP_IMPORT: "claude_code",
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(base, "out"),
    DEMESNE_STATE_DIR: path.join(base, "state"), DEMESNE_ALLOWED_PATHS: work,
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendor.port}/openai/v1`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "1", DEMESNE_JOBS_POLL_INTERVAL: "0.5",
  };
}

// Forged requests from inside the sandbox (node's fetch, in the CLI's shell): a session on
// /mcp/host/everything that lists the tools and calls get-env directly, the path of a server
// not offered, and a wrong token. Written to /out/forged.json.
const FORGE = `
const base = process.env.DEMESNE_MCP_URL.replace(/\\/mcp$/, "");
const token = process.env.DEMESNE_MCP_TOKEN;
async function rpc(p, body, sid, tok = token) {
  const h = { "content-type": "application/json", accept: "application/json, text/event-stream",
    authorization: "Bearer " + tok, "mcp-protocol-version": "2025-06-18" };
  if (sid) h["mcp-session-id"] = sid;
  const r = await fetch(base + p, { method: "POST", headers: h, body: JSON.stringify(body) });
  return { status: r.status, sid: r.headers.get("mcp-session-id"), text: await r.text() };
}
const init = { jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18",
  capabilities: {}, clientInfo: { name: "forger", version: "1" } } };
const out = {};
const s = await rpc("/mcp/host/everything", init);
out.init = s.status;
out.initText = s.text;
await rpc("/mcp/host/everything", { jsonrpc: "2.0", method: "notifications/initialized" }, s.sid);
out.list = await rpc("/mcp/host/everything", { jsonrpc: "2.0", id: 2, method: "tools/list" }, s.sid);
out.getenv = await rpc("/mcp/host/everything", { jsonrpc: "2.0", id: 3, method: "tools/call",
  params: { name: "get-env", arguments: {} } }, s.sid);
out.resources = await rpc("/mcp/host/everything", { jsonrpc: "2.0", id: 4, method: "resources/list" }, s.sid);
out.imported = await rpc("/mcp/host/imported", init);
out.unknown = await rpc("/mcp/host/nosuch", init);
out.badToken = await rpc("/mcp/host/everything", init, null, "0".repeat(64));
(await import("node:fs")).writeFileSync("/out/forged.json", JSON.stringify(out));
`;

async function call(conn, name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name}: ${res.content?.[0]?.text}\n${conn.stderr().slice(-4000)}`);
  return res.structuredContent;
}

// The tools of `server` among those a CLI offered the model: Claude Code's mcp__<server>__<tool>,
// Codex's namespace mcp__<server> (offered as "mcp__<server>:<tool>").
const hostTools = (offered, server) => offered
  .map((n) => (typeof n === "string" ? n.match(new RegExp(`^mcp__${server}(?:__|:)(.+)$`))?.[1] : null))
  .filter(Boolean).sort();

// What a run's CLI offered of the host servers. Codex defers MCP tools (code mode: nested in
// `exec`, found through ALL_TOOLS), so its request names only the namespaces.
async function hostToolsRun({ tag, env, model, childModel, contextFile, deferred = false }) {
  const conn = await connect({ fixtures: false, env: serverEnv(env) });
  try {
    // at the host: a name that is not configured, and one that offers no tools, are refused naming the field
    for (const [names, why] of [[["nosuch"], /host_mcp\[1\]: no host MCP server is named "nosuch"/],
      [["everything", "imported"], /host_mcp\[2\]: host MCP server imported offers no tools/]]) {
      const res = await conn.client.callTool({ name: "sandbox_agent", arguments: { prompt: "PLAN:none x",
        model, host_mcp: names } }, undefined, LONG);
      assert.equal(res.isError, true, JSON.stringify(res));
      assert.match(res.content[0].text, why);
    }

    const greedy = vendor.plan(`${tag}-greedy`, [{ final: "greedy ran" }]);
    const kid = vendor.plan(`${tag}-kid`, [
      { tool: "sandbox_agent", args: () => ({ name: "greedy", prompt: `PLAN:${greedy} Wants more.`, model: childModel,
        host_mcp: ["readonly"] }) },
      { final: "kid done" },
    ]);
    const orch = vendor.plan(`${tag}-orch`, [
      { tool: "echo", server: "everything", args: () => ({ message: "hello from the sandbox" }) },
      { tool: "get-sum", server: "everything", args: () => ({ a: 19, b: 23 }) },
      { shell: `node --input-type=module -e '${FORGE}' && cp /.demesne/agent/${contextFile} /out/context.md` },
      { tool: "sandbox_agent", args: () => ({ name: "kid", prompt: `PLAN:${kid} Narrowed.`, model: childModel,
        host_mcp: ["everything"] }) },
      { tool: "sandbox_agent", args: () => ({ name: "imp", prompt: "PLAN:none x", model: childModel,
        host_mcp: ["imported"] }) },
      { final: "host tools used" },
    ]);
    const r = await call(conn, "sandbox_agent", { prompt: `PLAN:${orch} Use the host tools.`, model,
      timeout_seconds: 300 });
    const p = vendor.plans.get(orch);
    assert.equal(r.exit_code, 0, r.stderr + conn.stderr().slice(-4000));
    assert.equal(r.answer, "host tools used", JSON.stringify(p.results));

    // offered: exactly the allowed tools of each server, none of the imported one
    if (deferred) {
      const text = JSON.stringify(p.body);
      for (const ns of ["mcp__demesne", "mcp__everything", "mcp__readonly"]) assert.ok(text.includes(`- ${ns}: `), ns);
      assert.ok(!text.includes("mcp__imported"), "an imported server with no tools named is not wired");
    } else {
      assert.deepEqual(hostTools(p.offered, "everything"), ["echo", "get-sum"], `offered: ${p.offered}`);
      assert.deepEqual(hostTools(p.offered, "readonly"), readOnlyTools, "read-only = exactly the readOnlyHint tools");
      assert.deepEqual(hostTools(p.offered, "imported"), [], "an imported server with no tools named offers none");
      assert.ok(hostTools(p.offered, "demesne").includes("sandbox_agent"), "demesne's own server is still there");
    }

    // the calls reached the real upstream and came back
    assert.match(p.results[0], /Echo: hello from the sandbox/);
    assert.match(p.results[1], /42/);

    // forged requests from inside the sandbox
    const forged = JSON.parse(read(r.output_dir, "forged.json"));
    assert.equal(forged.init, 200, forged.initText);
    assert.match(forged.initText, /"listChanged":true/, "the host server announces list_changed");
    assert.doesNotMatch(forged.initText, /"resources"/, "and offers tools only");
    assert.doesNotMatch(forged.list.text, /get-env/, "get-env is not listed");
    assert.match(forged.list.text, /"echo"/);
    assert.match(forged.getenv.text, /"isError":true/, forged.getenv.text);
    assert.match(forged.getenv.text, /get-env of host MCP server everything is not allowed here/);
    assert.doesNotMatch(forged.getenv.text, /PATH=|HOME/, "nothing of the host's environment came back");
    assert.match(forged.resources.text, /"code":-32601/, "tools only: demesne's resources are not offered there");
    assert.equal(forged.imported.status, 404, "the path of a server not offered is not found");
    assert.equal(forged.unknown.status, 404);
    assert.equal(forged.badToken.status, 401);

    // children: one narrows its set; its own child asking for a server it lacks is refused
    const k = vendor.plans.get(kid);
    assert.equal(k.served, 2, "the narrowed child ran");
    if (deferred) {
      const text = JSON.stringify(k.body);
      assert.ok(text.includes("- mcp__everything: ") && !text.includes("mcp__readonly"), "the child asked for everything only");
    } else {
      assert.deepEqual(hostTools(k.offered, "everything"), ["echo", "get-sum"], `kid offered: ${k.offered}`);
      assert.deepEqual(hostTools(k.offered, "readonly"), [], "the child asked for everything only");
    }
    assert.match(k.results[0], /host_mcp\[1\]: host MCP server readonly is not offered to the parent run/, k.results[0]);
    assert.equal(vendor.plans.get(greedy).served, 0, "the refused grandchild never ran");
    assert.match(p.results[4], /host_mcp\[1\]: host MCP server imported offers no tools/, p.results[4]);

    // the record, in this run's output folder
    const recs = read(r.output_dir, "mcp.jsonl").trim().split("\n").map((l) => JSON.parse(l));
    const byTool = Object.fromEntries(recs.map((x) => [`${x.server}/${x.tool}`, x]));
    assert.equal(byTool["everything/echo"].ok, true, JSON.stringify(recs));
    assert.equal(byTool["everything/get-sum"].ok, true);
    assert.ok(byTool["everything/echo"].response_bytes > 0 && byTool["everything/echo"].request_bytes > 0);
    assert.equal(byTool["everything/get-env"].ok, false, "the forged call is recorded as refused");
    assert.match(byTool["everything/get-env"].error, /not allowed/);
    assert.equal(recs.length, 3, JSON.stringify(recs));

    // the context file names each offered server with its tools
    const ctx = read(r.output_dir, "context.md");
    assert.match(ctx, /## Host tools/);
    assert.match(ctx, /- `everything`: 2 tools\n  - `echo`/);
    assert.match(ctx, /- `readonly`:/);
    assert.doesNotMatch(ctx, /`imported`/);
    assert.doesNotMatch(ctx.split("- `readonly`")[0], /get-env/, "get-env is not listed for everything");
  } finally {
    await conn.client.close();
  }
}

test("Claude Code uses the allowed tools of host MCP servers; the rest is neither listed nor callable", { timeout: 600_000 }, async () => {
  await hostToolsRun({ tag: "hm-claude", env: "claude", model: "sonnet", childModel: "haiku", contextFile: "CLAUDE.md" });
});

test("Codex gets the same host MCP servers as [mcp_servers.<server>]", { timeout: 600_000 }, async () => {
  // code mode (gpt-5.6-*): MCP tools are nested in `exec` (tools.mcp__<server>__<tool>), deferred
  await hostToolsRun({ tag: "hm-codex", env: "codex", model: "gpt-5.6-sol", childModel: "gpt-5.6-luna", contextFile: "AGENTS.md",
    deferred: true });
});
