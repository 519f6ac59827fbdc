#!/usr/bin/env node
// Benchmark (not a test): MCP over Streamable HTTP against MCP over stdio, measured in the
// same run with the official SDK clients on the same binary:
//   * a tools/call round trip (fixture_echo, no engine involved): stdio (SDK v1), HTTP
//     2025-11-25 (SDK v1, JSON answers in a session) and HTTP 2026-07-28 (SDK v2, stateless),
//     sequential and 8 at a time;
//   * the server's RSS idle, then with 100 open HTTP sessions (each with its GET stream).
// Usage: node bench/http.mjs [calls=300]
// Env:   DEMESNE_BIN (default build/demesne); DEMESNE_BASELINE_BIN: a second binary (an
//        older build) whose stdio round trip is measured too, to see that stdio did not
//        get slower.
import { createRequire } from "node:module";
import { spawn } from "node:child_process";
import { readFileSync, mkdtempSync, rmSync } from "node:fs";
import { randomBytes } from "node:crypto";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const require = createRequire(path.join(root, "tests/integration/package.json"));
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");
const v2 = await import(require.resolve("@modelcontextprotocol/client"));

const calls = Number(process.argv[2] || 300);
const bin = process.env.DEMESNE_BIN || path.join(root, "build/demesne");
const fixtures = path.join(root, "tests/fixtures/tools");
const work = mkdtempSync(path.join(tmpdir(), "demesne-bench-http-"));
const env = { ...process.env, DEMESNE_OUTPUT_ROOT: `${work}/out`, DEMESNE_STATE_DIR: `${work}/state`,
  XDG_CONFIG_HOME: `${work}/xdg`, DEMESNE_LOG_LEVEL: "warning" };
delete env.DEMESNE_SOURCE_DIR;

const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]; };
const fmt = (xs) => `p50 ${pct(xs, 50).toFixed(2)} ms  p95 ${pct(xs, 95).toFixed(2)} ms`;
const rss = (pid) => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, "utf8"))[1]) / 1024;

async function roundTrips(client, callTool) {
  for (let i = 0; i < 20; i++) await callTool(client); // warm up
  const seq = [];
  for (let i = 0; i < calls; i++) {
    const t = process.hrtime.bigint();
    await callTool(client);
    seq.push(Number(process.hrtime.bigint() - t) / 1e6);
  }
  const t = process.hrtime.bigint();
  const batch = 8;
  for (let i = 0; i < calls; i += batch) await Promise.all(Array.from({ length: batch }, () => callTool(client)));
  const conc = Number(process.hrtime.bigint() - t) / 1e6 / calls;
  return { seq, conc };
}
const echo1 = (c) => c.callTool({ name: "fixture_echo", arguments: { text: "bench" } });
const echo2 = (c) => c.callTool({ name: "fixture_echo", arguments: { text: "bench" } });

async function stdio(binary) {
  const t = new StdioClientTransport({ command: binary, args: ["--fixtures", fixtures, "serve"], env, stderr: "ignore" });
  const c = new Client({ name: "bench", version: "1" });
  await c.connect(t);
  const r = await roundTrips(c, echo1);
  await c.close();
  return r;
}

async function startHttp() {
  const token = randomBytes(24).toString("hex");
  const proc = spawn(bin, ["--fixtures", fixtures, "serve", "--http", "127.0.0.1:0"], {
    env: { ...env, DEMESNE_LOG_LEVEL: "notice", DEMESNE_HTTP_TOKEN: token }, stdio: ["ignore", "ignore", "pipe"] });
  let err = "";
  const url = await new Promise((resolve, reject) => {
    proc.stderr.on("data", (d) => {
      err += d;
      const m = err.match(/serving MCP over HTTP on (http:\/\/\S+)/);
      if (m) resolve(m[1]);
    });
    proc.on("exit", (code) => reject(new Error(`exited ${code}: ${err}`)));
  });
  return { proc, url: new URL(url), headers: { Authorization: `Bearer ${token}` } };
}

const out = [];
const s = await stdio(bin);
out.push(["stdio (SDK v1)", s]);
let base;
if (process.env.DEMESNE_BASELINE_BIN) {
  base = await stdio(process.env.DEMESNE_BASELINE_BIN);
  out.push([`stdio, baseline ${path.basename(path.dirname(path.dirname(process.env.DEMESNE_BASELINE_BIN)))}`, base]);
}

const h = await startHttp();
const idle = rss(h.proc.pid);
const c1 = new Client({ name: "bench-v1", version: "1" });
await c1.connect(new StreamableHTTPClientTransport(h.url, { requestInit: { headers: h.headers } }));
out.push(["HTTP 2025-11-25 (SDK v1)", await roundTrips(c1, echo1)]);
const c2 = new v2.Client({ name: "bench-v2", version: "2" }, { versionNegotiation: { mode: "auto" } });
await c2.connect(new v2.StreamableHTTPClientTransport(h.url, { requestInit: { headers: h.headers } }));
out.push([`HTTP ${c2.getNegotiatedProtocolVersion()} (SDK v2)`, await roundTrips(c2, echo2)]);

console.log(`tools/call round trip of fixture_echo, ${calls} calls each (same binary, same run)`);
for (const [name, r] of out) {
  console.log(`${name.padEnd(32)} sequential ${fmt(r.seq)}   8 at a time ${r.conc.toFixed(2)} ms/call`);
}
const p50 = (r) => pct(r.seq, 50);
console.log(`ratio HTTP 2025/stdio p50 ${(p50(out.find((o) => o[0].startsWith("HTTP 2025"))[1]) / p50(s)).toFixed(2)}, `
  + `HTTP 2026/stdio p50 ${(p50(out[out.length - 1][1]) / p50(s)).toFixed(2)}`);
if (base) console.log(`ratio stdio/baseline stdio p50 ${(p50(s) / p50(base)).toFixed(2)} (at or under 1.0: stdio did not get slower)`);

// 100 open sessions, each with its GET stream
const sessions = [];
for (let i = 0; i < 100; i++) {
  const c = new Client({ name: `s${i}`, version: "1" });
  await c.connect(new StreamableHTTPClientTransport(h.url, { requestInit: { headers: h.headers } }));
  sessions.push(c);
}
await new Promise((r) => setTimeout(r, 1000));
const with100 = rss(h.proc.pid);
console.log(`server RSS idle ${idle.toFixed(1)} MB, with 100 open sessions ${with100.toFixed(1)} MB `
  + `(${((with100 - idle) * 1024 / 100).toFixed(0)} KB per session)`);
for (const c of sessions) await c.close();
await c1.close();
await c2.close();
h.proc.kill("SIGTERM");
await new Promise((r) => h.proc.on("exit", r));
rmSync(work, { recursive: true, force: true });
