// Shutdown under the signal orders real clients use, on stdio and on HTTP, with a
// sandbox_script call in flight on a real engine: Claude Code closes its stdio server with
// SIGINT then SIGTERM 100 ms later, Codex sends SIGTERM to the process group, a terminal
// that goes away sends SIGHUP, and a client may close stdin and then signal. In every order
// the cleanup completes: the server exits 0 and leaves no run folder and no container.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, readdirSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { BIN, ROOT, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function engineGet(p) {
  return new Promise((resolve, reject) => {
    http.get({ socketPath: SOCKET, path: p }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve(JSON.parse(body)));
    }).on("error", reject);
  });
}
async function containersUnder(dir) {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
  const list = await engineGet(`/containers/json?all=true&filters=${filters}`);
  return list.filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir));
}
function runFolders(state) {
  const dir = path.join(state, "run");
  return existsSync(dir) ? readdirSync(dir) : [];
}
async function until(fn, ms, what) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(100);
  }
}

const TOKEN = "shutdown-test-token-0123456789";
const CALL = { name: "sandbox_script", arguments: { command: "sleep 300", image: "base" } };

// Starts a server (stdio or HTTP) in its own process group and puts one call in flight.
async function serverWithCall(transport) {
  const work = mkdtempSync(path.join(tmpdir(), "demesne-shutdown-"));
  const state = path.join(work, "state");
  const env = serverEnv({ DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: state,
    DEMESNE_HTTP_TOKEN: TOKEN });
  const args = transport === "http" ? ["serve", "--http", "127.0.0.1:0"] : ["serve"];
  const proc = spawn(BIN, args, { env, cwd: ROOT, stdio: ["pipe", "pipe", "pipe"], detached: true });
  let err = "";
  proc.stderr.on("data", (c) => {
    err += c;
    if (process.env.DEMESNE_TEST_VERBOSE) process.stderr.write(c);
  });
  proc.stdout.resume();
  proc.stdin.on("error", () => {});
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  if (transport === "http") {
    const url = await until(() => err.match(/serving MCP over HTTP on (http:\/\/\S+)/)?.[1], 10000, "the URL");
    const u = new URL(url);
    const body = JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/call", params: { ...CALL,
      _meta: { "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {} } } });
    const req = http.request({ host: u.hostname, port: u.port, path: "/mcp", method: "POST", headers: {
      Authorization: `Bearer ${TOKEN}`, "Content-Type": "application/json", Accept: "application/json, text/event-stream",
      "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": CALL.name } }, (res) => res.resume());
    req.on("error", () => {});
    req.end(body);
  } else {
    const send = (m) => proc.stdin.write(JSON.stringify(m) + "\n");
    send({ jsonrpc: "2.0", id: 0, method: "initialize", params: { protocolVersion: "2025-11-25", capabilities: {},
      clientInfo: { name: "shutdown-test", version: "1" } } });
    send({ jsonrpc: "2.0", method: "notifications/initialized" });
    send({ jsonrpc: "2.0", id: 1, method: "tools/call", params: CALL });
  }
  await until(async () => (await containersUnder(work)).some((c) => c.State === "running"), 90000, "the container to run");
  await until(() => runFolders(state).length > 0, 10000, "the run folder");
  return { proc, exited, work, state, stderr: () => err };
}

const ORDERS = {
  "SIGINT then SIGTERM 100 ms later (Claude Code)": async (p) => {
    p.kill("SIGINT");
    await sleep(100);
    p.kill("SIGTERM");
  },
  "SIGTERM to the process group (Codex)": async (p) => { process.kill(-p.pid, "SIGTERM"); },
  "SIGHUP": async (p) => { p.kill("SIGHUP"); },
  "stdin EOF then SIGTERM": async (p) => {
    p.stdin.end();
    await sleep(50);
    p.kill("SIGTERM");
  },
  "SIGTERM, SIGINT and SIGHUP in a burst": async (p) => {
    p.kill("SIGTERM");
    p.kill("SIGINT");
    p.kill("SIGHUP");
    await sleep(20);
    p.kill("SIGTERM");
  },
};

for (const transport of ["stdio", "http"]) {
  for (const [order, act] of Object.entries(ORDERS)) {
    test(`${transport}: ${order}: cleanup completes, no run folder or container left`, { timeout: 180_000 }, async () => {
      const s = await serverWithCall(transport);
      try {
        await act(s.proc);
        const r = await Promise.race([s.exited, sleep(60000).then(() => ({ code: "still running" }))]);
        assert.equal(r.code, 0, `exit status; stderr:\n${s.stderr()}`);
        assert.deepEqual(runFolders(s.state), [], "run folders left behind");
        assert.deepEqual((await containersUnder(s.work)).map((c) => c.Id.slice(0, 12)), [], "containers left behind");
      } finally {
        try { process.kill(-s.proc.pid, "SIGKILL"); } catch { /* gone */ }
        rmSync(s.work, { recursive: true, force: true });
      }
    });
  }
}
