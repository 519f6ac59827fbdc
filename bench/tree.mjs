#!/usr/bin/env node
// Benchmark (not a test): what a child costs when a sandbox spawns it through the in-sandbox
// MCP endpoint, against the same work from the host and against the raw engine, in the same
// run on the same image and command:
//   raw engine run of `true`                 (`podman run --rm --network none IMAGE true`, or docker)
//   host sandbox_script `true`               (SDK client over stdio)
//   child sandbox_script `true`              (from inside a root sandbox: tests/fixtures/tree/mcp-client.py)
//   child sandbox_jobs                       (the endpoint alone: no container, a relayed round trip)
// The in-sandbox times are taken inside the sandbox around each client call, so they include
// the client's own start (python3) and the relay; `python3 -c pass` is measured there too.
// Usage: node bench/tree.mjs [runs=10]   (DEMESNE_ENGINE picks the engine; default Podman)
import { createRequire } from "node:module";
import { execFileSync, execFile } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const require = createRequire(path.join(root, "tests/integration/package.json"));
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");

const runs = Number(process.argv[2] || 10);
const engine = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const cli = engine.includes("docker") ? "docker" : "podman";
const bin = path.join(root, "build/demesne");
const fix = path.join(root, "tests/fixtures/tree");
const work = mkdtempSync(path.join(tmpdir(), "demesne-bench-tree-"));
const env = { ...process.env, DEMESNE_ENGINE: engine, DEMESNE_OUTPUT_ROOT: `${work}/out`, DEMESNE_STATE_DIR: `${work}/state`,
  DEMESNE_ALLOWED_PATHS: fix, DEMESNE_LOG_LEVEL: "warning" };
delete env.DEMESNE_SOURCE_DIR;

const image = execFileSync(bin, ["images", "build", "base"], { env, encoding: "utf8" }).trim().split(/\s+/)[1];
execFileSync(bin, ["images", "build", "python"], { env });
const cliHost = cli === "docker" ? ["-H", engine] : ["--url", engine];
const run = (args) => new Promise((res, rej) => execFile(cli, [...cliHost, ...args], (e) => (e ? rej(e) : res())));
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]; };
async function time(fn) { const t = process.hrtime.bigint(); await fn(); return Number(process.hrtime.bigint() - t) / 1e6; }
async function series(fn) { await fn(); const xs = []; for (let i = 0; i < runs; i++) xs.push(await time(fn)); return xs; }
const fmt = (xs) => `p50 ${pct(xs, 50).toFixed(0).padStart(5)} ms  p95 ${pct(xs, 95).toFixed(0).padStart(5)} ms`;

const transport = new StdioClientTransport({ command: bin, args: ["serve"], env, stderr: "ignore" });
const client = new Client({ name: "bench", version: "1" });
await client.connect(transport);
const call = async (name, args) => {
  const r = await client.callTool({ name, arguments: args }, undefined, { timeout: 600_000 });
  if (r.isError) throw new Error(r.content[0].text);
  return r.structuredContent;
};

console.log(`engine ${engine}, image ${image}, ${runs} runs each`);
const raw = await series(() => run(["run", "--rm", "--network", "none", image, "true"]));
const host = await series(() => call("sandbox_script", { command: "true", image: "base" }));
const sb = await call("sandbox_create", { image: "python", mcp: true, egress: "none", directories: [fix],
  tree: { children: 200 } });
// one shell loop inside the root: each client call timed there, in ms
const loop = (n, cmd) => `for i in $(seq 0 ${n}); do s=$(date +%s%N); ${cmd} >/dev/null || exit 1; e=$(date +%s%N); `
  + `echo $(( (e - s) / 1000000 )); done`;
const inside = async (cmd) => {
  const r = await call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: loop(runs, cmd), timeout_seconds: 1200 });
  if (r.exit_code !== 0) throw new Error(r.stderr);
  return r.stdout.trim().split("\n").map(Number).slice(1); // the first is the warm-up
};
const py = await inside("python3 -c pass");
const jobs = await inside("python3 /in/tree/mcp-client.py sandbox_jobs '{}'");
const child = await inside(`python3 /in/tree/mcp-client.py sandbox_script "{\\"name\\":\\"c$i\\",\\"command\\":\\"true\\",\\"image\\":\\"base\\"}"`);
await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });

const ratio = (xs) => (pct(xs, 50) / pct(raw, 50)).toFixed(2);
console.log(`raw ${cli} run true           ${fmt(raw)}`);
console.log(`host sandbox_script true     ${fmt(host)}  x${ratio(host)} of raw`);
console.log(`child sandbox_script true    ${fmt(child)}  x${ratio(child)} of raw (client start included)`);
console.log(`child sandbox_jobs           ${fmt(jobs)}  (the endpoint round trip, client start included)`);
console.log(`python3 -c pass in sandbox   ${fmt(py)}  (the client's own start)`);
await client.close();
rmSync(work, { recursive: true, force: true });
