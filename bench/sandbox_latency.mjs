#!/usr/bin/env node
// Benchmark (not a test): sandbox latency through demesne's MCP server against the raw
// engine, measured in the same run on the same image and command.
//   sandbox_script `true`   vs  `podman run --rm --network none IMAGE true` (and docker run)
//   sandbox_exec `true`     vs  `podman exec CONTAINER true`
//   20 concurrent sandbox_script calls, with the server's peak RSS
// Usage: node bench/sandbox_latency.mjs [runs=15]   (DEMESNE_ENGINE picks the engine; default Podman)
// Targets (issue 3): script p50 within 1.3x of the raw run, exec p50 at or below podman
// exec, server RSS under 30 MB during the concurrent run.
import { createRequire } from "node:module";
import { execFileSync, execFile } from "node:child_process";
import { readFileSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const require = createRequire(path.join(root, "tests/integration/package.json"));
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");

const runs = Number(process.argv[2] || 15);
const engine = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const cli = engine.includes("docker") ? "docker" : "podman";
const bin = path.join(root, "build/demesne");
const work = mkdtempSync(path.join(tmpdir(), "demesne-bench-"));
const env = { ...process.env, DEMESNE_ENGINE: engine, DEMESNE_OUTPUT_ROOT: `${work}/out`, DEMESNE_STATE_DIR: `${work}/state` };

const image = execFileSync(bin, ["images", "build", "base"], { env, encoding: "utf8" }).trim().split(/\s+/)[1];
const cliHost = cli === "docker" ? ["-H", engine] : ["--url", engine];
const run = (args) => new Promise((res, rej) => execFile(cli, [...cliHost, ...args], (e) => (e ? rej(e) : res())));
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]; };
async function time(fn) { const t = process.hrtime.bigint(); await fn(); return Number(process.hrtime.bigint() - t) / 1e6; }
async function series(fn) { await fn(); const xs = []; for (let i = 0; i < runs; i++) xs.push(await time(fn)); return xs; }
const fmt = (xs) => `p50 ${pct(xs, 50).toFixed(0)} ms  p95 ${pct(xs, 95).toFixed(0)} ms`;

const transport = new StdioClientTransport({ command: bin, args: ["serve"], env, stderr: "ignore" });
const client = new Client({ name: "bench", version: "1" });
await client.connect(transport);
const call = async (name, args) => {
  const r = await client.callTool({ name, arguments: args }, undefined, { timeout: 600_000 });
  if (r.isError) throw new Error(r.content[0].text);
  return r.structuredContent;
};
const rss = () => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${transport.pid}/status`, "utf8"))[1]) / 1024;

console.log(`engine ${engine}, image ${image}, ${runs} runs each`);
const script = await series(() => call("sandbox_script", { command: "true", image: "base" }));
const raw = await series(() => run(["run", "--rm", "--network", "none", image, "true"]));
console.log(`sandbox_script        ${fmt(script)}`);
console.log(`${cli} run --rm        ${fmt(raw)}`);
console.log(`ratio script/raw p50  ${(pct(script, 50) / pct(raw, 50)).toFixed(2)}  (target <= 1.3)`);

const sb = await call("sandbox_create", { image: "base" });
const exec = await series(() => call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" }));
const rawExec = await series(() => run(["exec", `demesne-${sb.sandbox_id}`, "true"]));
await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
console.log(`sandbox_exec          ${fmt(exec)}`);
console.log(`${cli} exec           ${fmt(rawExec)}`);
console.log(`ratio exec/raw p50    ${(pct(exec, 50) / pct(rawExec, 50)).toFixed(2)}  (target <= 1.0)`);

let peak = rss();
const sampler = setInterval(() => { peak = Math.max(peak, rss()); }, 50);
const t20 = await time(() => Promise.all(Array.from({ length: 20 }, () => call("sandbox_script", { command: "true", image: "base" }))));
clearInterval(sampler);
const raw20 = await time(() => Promise.all(Array.from({ length: 20 }, () => run(["run", "--rm", "--network", "none", image, "true"]))));
console.log(`20 concurrent sandbox_script  ${t20.toFixed(0)} ms   20 concurrent ${cli} run  ${raw20.toFixed(0)} ms   ratio ${(t20 / raw20).toFixed(2)}`);
console.log(`server RSS peak during the concurrent run  ${peak.toFixed(1)} MB  (target < 30 MB)`);
await client.close();
rmSync(work, { recursive: true, force: true });
