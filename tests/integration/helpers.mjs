// Shared helpers for the integration tests: start build/demesne over stdio, either behind
// the official MCP SDK client (connect) or as a raw process for malformed frames (spawnRaw),
// or over Streamable HTTP on a free loopback port (startHttp).
// The binary runs its embedded runtime (DEMESNE_SOURCE_DIR is removed from its environment)
// and a fresh, empty XDG_CONFIG_HOME unless the caller passes one.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { spawn } from "node:child_process";
import http from "node:http";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

/** The repository root. */
export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
/** The binary under test: $DEMESNE_BIN, default <repo>/build/demesne. */
export const BIN = process.env.DEMESNE_BIN || path.join(ROOT, "build/demesne");
/** The fixture tools folder passed with --fixtures. */
export const FIXTURES = path.join(ROOT, "tests/fixtures/tools");

const scratch = [];
process.on("exit", () => {
  for (const d of scratch) rmSync(d, { recursive: true, force: true });
});

/** The child's environment: ours + `env`, without DEMESNE_SOURCE_DIR, with an empty XDG_CONFIG_HOME. */
export function serverEnv(env = {}) {
  const out = { ...process.env };
  delete out.DEMESNE_SOURCE_DIR;
  // a write of a sandbox plan's undeclared field raises (lua/sandbox/plan.lua)
  out.DEMESNE_STRICT ??= "1";
  if (!("XDG_CONFIG_HOME" in env)) {
    out.XDG_CONFIG_HOME = mkdtempSync(path.join(tmpdir(), "demesne-xdg-"));
    scratch.push(out.XDG_CONFIG_HOME);
  }
  return { ...out, ...env };
}

function argv(args, fixtures) {
  return [...args, ...(fixtures ? ["--fixtures", typeof fixtures === "string" ? fixtures : FIXTURES] : []), "serve"];
}

/**
 * Starts `demesne serve` behind the SDK client and completes the initialize handshake.
 * @param {object} [o]
 * @param {Record<string,string>} [o.env]   extra environment variables for the server
 * @param {string[]} [o.args]               extra options placed before `serve`
 * @param {boolean|string} [o.fixtures=true] load tests/fixtures/tools (or the given folder)
 * @param {object} [o.capabilities]         client capabilities to declare
 * @param {string[]} [o.wrap]               a command line that runs the server (e.g. ["prlimit", "--nofile=1024:"]):
 *   it must exec the binary, so that transport.pid is the server's
 * @returns {Promise<{client: Client, transport: StdioClientTransport, stderr: () => string}>}
 *   stderr() returns everything the server wrote to stderr so far.
 */
export async function connect({ env = {}, args = [], fixtures = true, capabilities = {}, wrap = [] } = {}) {
  const transport = new StdioClientTransport({
    command: wrap.length ? wrap[0] : BIN,
    args: [...wrap.slice(1), ...(wrap.length ? [BIN] : []), ...argv(args, fixtures)],
    env: serverEnv(env),
    stderr: "pipe",
    cwd: ROOT,
  });
  let err = "";
  transport.stderr?.on("data", (chunk) => {
    err += chunk.toString();
    if (process.env.DEMESNE_TEST_VERBOSE) process.stderr.write(chunk);
  });
  const client = new Client({ name: "demesne-tests", version: "1.0.0" }, { capabilities });
  await client.connect(transport);
  isolate(client);
  return { client, transport, stderr: () => err };
}

/** The tools that make a sandbox, and so take `isolation`. */
export const ISOLATED_TOOLS = new Set(["sandbox_script", "sandbox_create", "sandbox_agent", "sandbox_research"]);

/**
 * DEMESNE_TEST_ISOLATION=gvisor (tests/run's gVisor suites): every call of a tool that makes a
 * sandbox asks for that isolation, unless the test names one itself.
 */
function isolate(client) {
  const isolation = process.env.DEMESNE_TEST_ISOLATION;
  if (!isolation) return;
  const callTool = client.callTool.bind(client);
  client.callTool = (params, ...rest) => {
    const args = params?.arguments;
    if (!ISOLATED_TOOLS.has(params?.name) || !args || "isolation" in args) return callTool(params, ...rest);
    return callTool({ ...params, arguments: { ...args, isolation } }, ...rest);
  };
}

/**
 * Starts `demesne serve` as a plain child process for raw JSON-RPC lines.
 * @returns {{proc, send: (msg: object|string) => void, next: (pred?: (m: object) => boolean, ms?: number) => Promise<object>,
 *   request: (method: string, params?: object, id?: string|number) => Promise<object>,
 *   initialize: (version?: string) => Promise<object>, exited: Promise<{code: number|null, signal: string|null}>,
 *   stderr: () => string, close: () => Promise<void>}}
 *   next() resolves with the next message matching pred (messages are queued until taken).
 */
export function spawnRaw({ env = {}, args = [], fixtures = true } = {}) {
  const proc = spawn(BIN, argv(args, fixtures), { env: serverEnv(env), cwd: ROOT, stdio: ["pipe", "pipe", "pipe"] });
  const queue = [];
  const waiters = [];
  let buf = "";
  let err = "";
  let nextId = 1;
  proc.stdout.setEncoding("utf8");
  proc.stdout.on("data", (chunk) => {
    buf += chunk;
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (!line.trim()) continue;
      // stdout must carry only JSON-RPC: anything else fails the test; .raw keeps the text
      queue.push(Object.defineProperty(JSON.parse(line), "raw", { value: line }));
      deliver();
    }
  });
  proc.stderr.on("data", (c) => {
    err += c.toString();
    if (process.env.DEMESNE_TEST_VERBOSE) process.stderr.write(c);
  });
  proc.stdin.on("error", () => {});
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  function deliver() {
    for (let i = 0; i < waiters.length; i++) {
      const w = waiters[i];
      const idx = queue.findIndex(w.pred);
      if (idx >= 0) {
        const [m] = queue.splice(idx, 1);
        waiters.splice(i, 1);
        i--;
        clearTimeout(w.timer);
        w.resolve(m);
      }
    }
  }
  function next(pred = () => true, ms = 10000) {
    return new Promise((resolve, reject) => {
      const w = { pred, resolve };
      w.timer = setTimeout(() => {
        waiters.splice(waiters.indexOf(w), 1);
        reject(new Error(`no matching message within ${ms} ms; stderr:\n${err}`));
      }, ms);
      waiters.push(w);
      deliver();
    });
  }
  function send(msg) {
    proc.stdin.write(typeof msg === "string" ? msg : JSON.stringify(msg) + "\n");
  }
  function request(method, params, id = `raw-${nextId++}`) {
    send({ jsonrpc: "2.0", id, method, ...(params === undefined ? {} : { params }) });
    return next((m) => m.id === id && m.method === undefined);
  }
  async function initialize(version = "2025-11-25") {
    const r = await request("initialize", { protocolVersion: version, capabilities: {}, clientInfo: { name: "raw", version: "1" } });
    send({ jsonrpc: "2.0", method: "notifications/initialized" });
    return r;
  }
  async function close() {
    proc.stdin.end();
    const t = setTimeout(() => proc.kill("SIGKILL"), 5000);
    await exited;
    clearTimeout(t);
  }
  return { proc, send, next, request, initialize, exited, stderr: () => err, close };
}

/**
 * Starts `demesne serve --http 127.0.0.1:0` (or `addr`) with a fresh bearer token and waits
 * for the URL it prints on stderr.
 * @param {object} [o]
 * @param {Record<string,string>} [o.env]
 * @param {string[]} [o.args]   extra options placed before `serve`
 * @param {boolean|string} [o.fixtures=true]
 * @param {string[]} [o.listen] --http addresses (default ["127.0.0.1:0"])
 * @param {boolean} [o.group]   start in its own process group (detached), for signals to the group
 * @returns {Promise<{url: string, token: string, proc, pid: number, stderr: () => string,
 *   exited: Promise<{code: number|null, signal: string|null}>, stop: (sig?: string) => Promise<object>}>}
 */
export async function startHttp({ env = {}, args = [], fixtures = true, listen = ["127.0.0.1:0"], group = false } = {}) {
  const token = randomToken();
  const argv = [...args, ...(fixtures ? ["--fixtures", typeof fixtures === "string" ? fixtures : FIXTURES] : []), "serve"];
  for (const a of listen) argv.push("--http", a);
  const proc = spawn(BIN, argv, {
    env: serverEnv({ DEMESNE_HTTP_TOKEN: token, ...env }), cwd: ROOT, stdio: ["ignore", "pipe", "pipe"], detached: group,
  });
  let err = "";
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no URL on stderr within 10 s:\n${err}`)), 10000);
    proc.stderr.on("data", (c) => {
      err += c.toString();
      if (process.env.DEMESNE_TEST_VERBOSE) process.stderr.write(c);
      const m = err.match(/serving MCP over HTTP on (http:\/\/\S+|unix:\S+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    proc.on("exit", (code) => { clearTimeout(timer); reject(new Error(`exited with ${code}:\n${err}`)); });
  });
  async function stop(sig = "SIGTERM") {
    proc.kill(sig);
    const t = setTimeout(() => proc.kill("SIGKILL"), 30000);
    const r = await exited;
    clearTimeout(t);
    return r;
  }
  return { url, token, proc, pid: proc.pid, stderr: () => err, exited, stop };
}

function randomToken() {
  return randomBytes(24).toString("hex");
}

/**
 * Whether an engine container (a /containers/json entry) is a warm sandbox of the pool that
 * no call has claimed yet: it carries io.demesne.pool and its server still keeps the marker
 * <state_dir>/pool/<run id> (lua/pool.lua). A live server keeps such sandboxes on purpose.
 * @param {{Labels: Record<string,string>}} c
 * @returns {boolean}
 */
export function isWarm(c) {
  const l = c.Labels || {};
  const m = /^(.*)\/run\/([^/]+)$/.exec(l["io.demesne.run_dir"] || "");
  return Boolean(l["io.demesne.pool"] && m && existsSync(path.join(m[1], "pool", m[2])));
}

/**
 * Whether a warm sandbox (isWarm) is ready for a call to take: its marker says "ready"
 * (it says "filling" while the pool starts it).
 * @param {{Labels: Record<string,string>}} c
 * @returns {boolean}
 */
export function isReady(c) {
  if (!isWarm(c)) return false;
  const m = /^(.*)\/run\/([^/]+)$/.exec(c.Labels["io.demesne.run_dir"]);
  try { return readFileSync(path.join(m[1], "pool", m[2]), "utf8") === "ready\n"; } catch { return false; }
}

/**
 * The exit reaper a server started beside itself (`demesne reap --after-exit HOST/PID/START`,
 * lua/sandbox/reaper.lua), found by its command line in /proc: {pid, sid} (sid = its
 * session id), or null when none runs for server `serverPid`.
 * @param {number} serverPid
 * @returns {{pid: number, sid: number} | null}
 */
export function exitReaperOf(serverPid) {
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    let argv, stat;
    try {
      argv = readFileSync(`/proc/${d}/cmdline`, "utf8").split("\0");
      stat = readFileSync(`/proc/${d}/stat`, "utf8");
    } catch { continue; }
    const i = argv.indexOf("--after-exit");
    if (i > 0 && argv[i - 1] === "reap" && new RegExp(`/${serverPid}/\\d+$`).test(argv[i + 1] || "")) {
      const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      if (f[0] === "Z") continue; // exited, not yet waited for
      return { pid: Number(d), sid: Number(f[3]) };
    }
  }
  return null;
}

/**
 * The session id of process `pid` (field 6 of /proc/PID/stat), or null when it is gone.
 * @param {number} pid
 * @returns {number | null}
 */
export function sessionOf(pid) {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[3]);
  } catch { return null; }
}

/**
 * One request to the Docker Engine API at `engine` (unix:///path): `method` and `path`
 * ("/containers/json?all=true"). Resolves to the parsed JSON body, or null when it is empty.
 * @param {string} engine
 * @param {string} method
 * @param {string} path
 * @returns {Promise<any>}
 */
export function engineRequest(engine, method, path) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: engine.replace(/^unix:\/\//, ""), path, method }, (res) => {
      let data = "";
      res.on("data", (d) => (data += d));
      res.on("end", () => resolve(data ? JSON.parse(data) : null));
    });
    req.on("error", reject);
    req.end();
  });
}

/**
 * The demesne containers of the engine at `engine` (unix:///path), in all states, as the
 * Docker Engine API's GET /containers/json lists them (Labels, Names, State, …).
 * @param {string} engine
 * @returns {Promise<Array<{Id: string, Names: string[], State: string, Labels: Record<string,string>}>>}
 */
export async function engineContainers(engine) {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
  return (await engineRequest(engine, "GET", `/containers/json?all=true&filters=${filters}`)) || [];
}

/**
 * The slowest answer (ms) to an MCP ping that still counts as "the server was not held up"
 * while a test floods it. A server that handles the flood on its event loop (buffering,
 * parsing or logging all of it) is silent while it does; on a 2-core machine running two
 * engine lanes and the flooder itself, a server that is not held up was seen answering in up
 * to 1.7 s, so the bound is loose. Speed as such is measured in bench/, not here.
 */
export const PING_MAX_MS = 5000;
