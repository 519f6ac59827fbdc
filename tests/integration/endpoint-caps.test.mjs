// Each sandbox's in-sandbox MCP endpoint (127.0.0.1:3130 inside it, relayed to the host's one
// HTTP server) has connection and session caps of its own: a sandbox holding many silent
// connections and many sessions on its endpoint neither locks out its own client that has
// the token nor another sandbox's endpoint. Official SDK client over stdio on the host, a
// standard-library Python script inside (tests/fixtures/endpoint-caps/hold.py), real engine
// from DEMESNE_ENGINE (run the file once per engine).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, ROOT } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const FIX = path.join(ROOT, "tests/fixtures/endpoint-caps");
const TREE = path.join(ROOT, "tests/fixtures/tree"); // mcp-client.py
const work = mkdtempSync(path.join(tmpdir(), "demesne-endpoint-caps-"));
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_ALLOWED_PATHS: `${FIX}:${TREE}`,
  // the host's own session table (serve --http): a sandbox's sessions must not count in it
  DEMESNE_HTTP_MAX_SESSIONS: "4",
};
const LONG = { timeout: 300_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

async function ok(name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
async function until(what, fn, ms = 120_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(250);
  }
}

test("a sandbox holding 40 silent connections and 6 sessions on its endpoint: its own client and another sandbox's are served", LONG, async () => {
  const a = await ok("sandbox_create", { mcp: true, image: "default", egress: "none", directories: [FIX] });
  const b = await ok("sandbox_create", { mcp: true, image: "default", egress: "none", directories: [TREE] });
  try {
    // in a: 6 sessions never ended (more than the host's table of 4), then 40 silent
    // connections (more than its cap of 32) kept open for 20 s, each one closed opened again
    const hold = await ok("sandbox_exec", { sandbox_id: a.sandbox_id, background: true, timeout_seconds: 150,
      command: "python3 /in/endpoint-caps/hold.py 6 40 20" });
    const ready = path.join(a.output_dir, "ready.json");
    await until("a's connections to be held", () => existsSync(ready));
    const first = JSON.parse(readFileSync(ready, "utf8"));
    assert.equal(first.sessions, 6, "a's sessions are its own, apart from the host's http_max_sessions");
    assert.deepEqual(first.served, [200, 200],
      `a's client with the token is served beside its 40 silent connections (${first.errors.join("; ")})`);
    // b's endpoint answers while a holds them (a new session, a tool call)
    const call = await ok("sandbox_exec", { sandbox_id: b.sandbox_id, timeout_seconds: 60,
      command: "python3 /in/tree/mcp-client.py sandbox_jobs '{}'" });
    assert.equal(call.exit_code, 0, call.stderr);
    assert.deepEqual(JSON.parse(call.stdout).jobs, [], "b sees its own (empty) subtree");
    // every silent connection is closed by the server (the oldest when newer ones fill a's
    // queue of connections without the token, the rest at the head timeout)
    const result = path.join(a.output_dir, "result.json");
    await until("a's script to end", () => existsSync(result), 150_000);
    const r = JSON.parse(readFileSync(result, "utf8"));
    assert.equal(r.left_open, 0, "the server closed every silent connection");
    assert.ok(r.closed_by_server >= 40, `closed by the server: ${r.closed_by_server}`);
    assert.ok(hold.job_id);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: a.sandbox_id });
    await ok("sandbox_destroy", { sandbox_id: b.sandbox_id });
  }
});
