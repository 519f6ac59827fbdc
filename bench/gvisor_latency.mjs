#!/usr/bin/env node
// Benchmark (not a test): what the second wall costs. Start and exec latency of gVisor
// sandboxes (isolation "gvisor") against plain ones (isolation "container"), through
// demesne's MCP server and on the raw engine, measured in the same run on the same image:
//   sandbox_script `true`, container vs gvisor     podman|docker run --rm, runc/crun vs runsc
//     (back to back, and paced so that each call takes a warm sandbox of the pool)
//   sandbox_exec `true`, container vs gvisor       podman|docker exec, runc/crun vs runsc
// Usage: node bench/gvisor_latency.mjs [runs=10]
//   DEMESNE_ENGINE picks the engine (default Podman); on Podman, DEMESNE_GVISOR_ENGINE names
//   the Podman service whose runtime is gVisor (tests/setup-host starts one).
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
const gvisorEngine = process.env.DEMESNE_GVISOR_ENGINE || "unix:///run/podman/podman-gvisor.sock";
const bin = path.join(root, "build/demesne");
const work = mkdtempSync(path.join(tmpdir(), "demesne-bench-"));
const env = { ...process.env, DEMESNE_ENGINE: engine, DEMESNE_GVISOR_ENGINE: gvisorEngine,
  DEMESNE_OUTPUT_ROOT: `${work}/out`, DEMESNE_STATE_DIR: `${work}/state` };

const image = execFileSync(bin, ["images", "build", "base"], { env, encoding: "utf8" }).trim().split(/\s+/)[1];
// the raw engine: Docker picks the runtime per container; Podman's gVisor is its own service
const raw = cli === "docker"
  ? { plain: ["-H", engine], gvisor: ["-H", engine], run: [], runGvisor: ["--runtime", "runsc"] }
  : { plain: ["--url", engine], gvisor: ["--url", gvisorEngine], run: [], runGvisor: [] };
const sh = (args) => new Promise((res, rej) => execFile(cli, args, (e, out) => (e ? rej(e) : res(out.trim()))));
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]; };
async function time(fn) { const t = process.hrtime.bigint(); await fn(); return Number(process.hrtime.bigint() - t) / 1e6; }
async function series(fn) { await fn(); const xs = []; for (let i = 0; i < runs; i++) xs.push(await time(fn)); return xs; }
const fmt = (xs) => `p50 ${pct(xs, 50).toFixed(0).padStart(5)} ms  p95 ${pct(xs, 95).toFixed(0).padStart(5)} ms`;
const ratio = (a, b) => (pct(a, 50) / pct(b, 50)).toFixed(2);

const transport = new StdioClientTransport({ command: bin, args: ["serve"], env, stderr: "ignore" });
const client = new Client({ name: "bench", version: "1" });
await client.connect(transport);
const call = async (name, args) => {
  const r = await client.callTool({ name, arguments: args }, undefined, { timeout: 600_000 });
  if (r.isError) throw new Error(r.content[0].text);
  return r.structuredContent;
};

console.log(`engine ${engine}${cli === "podman" ? ` (gVisor: ${gvisorEngine})` : " (gVisor: runtime runsc)"}, image ${image}, ${runs} runs each`);
const script = await series(() => call("sandbox_script", { command: "true", image: "base", isolation: "container" }));
const scriptG = await series(() => call("sandbox_script", { command: "true", image: "base", isolation: "gvisor" }));
const rawRun = await series(() => sh([...raw.plain, "run", "--rm", "--network", "none", image, "true"]));
const rawRunG = await series(() => sh([...raw.gvisor, "run", "--rm", ...raw.runGvisor, "--network", "none", image, "true"]));
console.log(`start  sandbox_script, container  ${fmt(script)}`);
console.log(`start  sandbox_script, gvisor     ${fmt(scriptG)}   ratio gvisor/container ${ratio(scriptG, script)}`);
console.log(`start  ${cli} run, default runtime ${fmt(rawRun)}`);
console.log(`start  ${cli} run, runsc           ${fmt(rawRunG)}   ratio runsc/default    ${ratio(rawRunG, rawRun)}`);
// the calls above come back to back, so most find their kind's warm sandbox still refilling;
// paced (3 s between calls) each takes a warm one: a gVisor one gets its command through the
// exec API, a plain one over the control socket
const pause = () => new Promise((r) => setTimeout(r, 3000));
async function paced(fn) { await fn(); const xs = []; for (let i = 0; i < runs; i++) { await pause(); xs.push(await time(fn)); } return xs; }
const warmC = await paced(() => call("sandbox_script", { command: "true", image: "base", isolation: "container" }));
const warmG = await paced(() => call("sandbox_script", { command: "true", image: "base", isolation: "gvisor" }));
console.log(`start  sandbox_script, container, warm pool (paced) ${fmt(warmC)}   ratio over ${cli} run ${ratio(warmC, rawRun)}`);
console.log(`start  sandbox_script, gvisor, warm pool (paced)    ${fmt(warmG)}   ratio over ${cli} run runsc ${ratio(warmG, rawRunG)}`);

const execs = {};
for (const isolation of ["container", "gvisor"]) {
  const sb = await call("sandbox_create", { image: "base", isolation });
  execs[isolation] = await series(() => call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" }));
  execs[`raw-${isolation}`] = await series(() => sh([...raw.plain, "exec", `demesne-${sb.sandbox_id}`, "true"]));
  await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
}
console.log(`exec   sandbox_exec, container    ${fmt(execs.container)}`);
console.log(`exec   sandbox_exec, gvisor       ${fmt(execs.gvisor)}   ratio gvisor/container ${ratio(execs.gvisor, execs.container)}`);
console.log(`exec   ${cli} exec, default runtime ${fmt(execs["raw-container"])}`);
console.log(`exec   ${cli} exec, runsc          ${fmt(execs["raw-gvisor"])}   ratio runsc/default    ${ratio(execs["raw-gvisor"], execs["raw-container"])}`);
console.log(`demesne over the raw engine, p50: start ${ratio(script, rawRun)} (container) ${ratio(scriptG, rawRunG)} (gvisor); `
  + `exec ${ratio(execs.container, execs["raw-container"])} (container) ${ratio(execs.gvisor, execs["raw-gvisor"])} (gvisor)`);
await client.close();
rmSync(work, { recursive: true, force: true });
