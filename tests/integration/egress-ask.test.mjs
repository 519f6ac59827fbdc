// The egress verdict `ask` over MCP against a real engine (DEMESNE_ENGINE): a sandbox's
// curl to a name its policy asks about is held while the host client is asked through MCP
// elicitation (the official SDK client, which declares the capability and answers), then
// goes through or is refused; egress.jsonl says who decided and how. The test host is a
// loopback server (asked.test = 127.0.0.2) named by a test DNS server on loopback that the
// proxy asks (DEMESNE_EGRESS_RESOLVER); nothing else is reached.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { connect, startHttp, ROOT } from "./helpers.mjs";
import { dnsServer, selfSigned, testHost } from "./egress-fixtures.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-ask-"));
const xdg = path.join(work, "xdg");
const inputs = path.join(work, "inputs");
const TREE_FIX = path.join(ROOT, "tests/fixtures/tree"); // mcp-client.py: a script calls its in-sandbox endpoint
mkdirSync(path.join(xdg, "demesne", "policies"), { recursive: true });
mkdirSync(inputs, { recursive: true });
writeFileSync(path.join(inputs, "secret.txt"), "secret\n");

let dns, host, conn;
const tls = selfSigned(["asked.test", "*.asked.test"]);
// what the client answers to the next elicitation: a function of the request's params
let answer = () => ({ action: "decline" });
const asked = []; // every elicitation/create params the client received

before(async () => {
  dns = await dnsServer({ "asked.test": "127.0.0.2", "again.asked.test": "127.0.0.2", "__b__.asked.test": "127.0.0.2" });
  host = await testHost("asked-host", "127.0.0.2", tls);
  writeFileSync(path.join(xdg, "demesne", "policies", "asktest.lua"), `
    return {
      description = "ask integration tests",
      rules = {
        { ASK, host = ".asked.test", name = "asked" },
        { ALLOW, cidr = "127.0.0.2/32", name = "test-host" },
      },
    }`);
  // a short hold, so that the unanswered case ends soon (the test's own configuration)
  writeFileSync(path.join(xdg, "demesne", "config.lua"), "return { ask_timeout_seconds = 5 }\n");
  conn = await connect({ fixtures: false, env: serverEnv(), capabilities: { elicitation: { form: {} } } });
  conn.client.setRequestHandler(ElicitRequestSchema, async (req) => {
    asked.push(req.params);
    return answer(req.params);
  });
});

function serverEnv() {
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_ALLOWED_PATHS: `${inputs}:${TREE_FIX}`, XDG_CONFIG_HOME: xdg,
    DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_EGRESS_RESOLVER: `127.0.0.1:${dns.port}`,
  };
}

after(async () => {
  await conn?.client.close();
  await host?.close();
  await dns?.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function script(command, extra = {}, c = conn) {
  const res = await c.client.callTool({ name: "sandbox_script", arguments: { command, image: "base", egress: "asktest", ...extra } },
    undefined, LONG);
  assert.ok(!res.isError, `sandbox_script failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
function egressLog(r) {
  const p = path.join(r.output_dir, "egress.jsonl");
  if (!existsSync(p)) return [];
  return readFileSync(p, "utf8").split("\n").filter(Boolean).map((l) => JSON.parse(l));
}
const url = (name, p = "/x") => `https://${name}${host.httpsPort === 443 ? "" : `:${host.httpsPort}`}${p}`;
const CURL = "curl -sS -k --max-time 60";

test("the client accepts once: the held curl goes through, the question named the run, host and port", async () => {
  asked.length = 0;
  answer = () => ({ action: "accept", content: { decision: "once" } });
  const before = host.hits;
  const r = await script(`${CURL} ${url("asked.test", "/once")}`);
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.stdout, /^asked-host GET \/once host=asked\.test/m);
  assert.equal(host.hits - before, 1);
  assert.equal(asked.length, 1, "one elicitation");
  const m = asked[0].message;
  assert.ok(m.includes(`run ${r.run_id}`), m);
  assert.ok(m.includes(`asked.test port ${host.httpsPort}`), m);
  assert.match(m, /^This sandbox holds no host inputs\./);
  assert.deepEqual(asked[0].requestedSchema.required, ["decision"]);
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.method, l.host, l.verdict, l.decision, l.decided_by, l.rule]),
    [["CONNECT", "asked.test", "allow", "once", "elicitation", "asktest#1 asked"]], JSON.stringify(log));
});

test("the client declines: curl fails with the proxy's 403 and the host is never reached", async () => {
  asked.length = 0;
  answer = () => ({ action: "decline" });
  const before = host.hits;
  const r = await script(`${CURL} ${url("asked.test", "/declined")}; echo "rc=$?"`);
  assert.doesNotMatch(r.stdout, /asked-host/);
  assert.doesNotMatch(r.stdout, /rc=0/);
  assert.match(r.stderr, /403/);
  assert.equal(host.hits - before, 0);
  assert.equal(asked.length, 1);
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decision, l.decided_by]),
    [["asked.test", "deny", "deny", "elicitation"]], JSON.stringify(log));
});

test("nobody answers: the connection is denied after ask_timeout_seconds, decided by the timeout", async () => {
  asked.length = 0;
  answer = () => new Promise(() => {}); // the person never answers
  const before = host.hits;
  const r = await script(`${CURL} ${url("asked.test", "/late")}; echo "rc=$?"`);
  assert.doesNotMatch(r.stdout, /rc=0/);
  assert.equal(host.hits - before, 0);
  assert.equal(asked.length, 1, "the client was asked");
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decision, l.decided_by]),
    [["asked.test", "deny", "deny", "timeout"]], JSON.stringify(log));
});

test("a held connection whose client gives up ends at once and leaves its question, not at the timeout", async () => {
  asked.length = 0;
  answer = () => new Promise(() => {}); // nobody answers; the client hangs up first
  const r = await script(`curl -sS -k --max-time 1 ${url("asked.test", "/gave-up")}; echo "rc=$?"; sleep 2; echo done`);
  assert.match(r.stdout, /rc=28/, "curl gave up (its --max-time)");
  assert.equal(asked.length, 1, "the client was asked");
  const log = egressLog(r);
  assert.equal(log.length, 1, JSON.stringify(log));
  assert.equal(log[0].verdict, "deny");
  assert.equal(log[0].decided_by, undefined, "nobody decided: not the timeout, not the client");
  assert.equal(log[0].error, "the client hung up while its connection was held for a verdict", JSON.stringify(log[0]));
});

test("allow for this run: a second connection to the same name and port goes through without a second question", async () => {
  asked.length = 0;
  answer = () => ({ action: "accept", content: { decision: "run" } });
  const before = host.hits;
  const r = await script(`${CURL} ${url("asked.test", "/first")} && ${CURL} ${url("asked.test", "/second")}`);
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.stdout, /GET \/first/);
  assert.match(r.stdout, /GET \/second/);
  assert.equal(host.hits - before, 2);
  assert.equal(asked.length, 1, "asked once");
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.verdict, l.decision, l.decided_by, l.granted ?? false]),
    [["allow", "run", "elicitation", false], ["allow", "run", "elicitation", true]], JSON.stringify(log));
});

test("a sandbox with host inputs says so first; a name with markup reaches the client as the plain text it is", async () => {
  asked.length = 0;
  answer = () => ({ action: "decline" });
  // a name is LDH and '_': markdown's emphasis is all the markup it can carry. One with HTML
  // in it never becomes a question: the proxy refuses the request head (400) first.
  const r = await script(`${CURL} ${url("__b__.asked.test")}; curl -s -o /dev/null -w '%{http_code}\\n' --noproxy '*' `
    + `--request-target 'http://<img src=x onerror=alert(1)>.asked.test/' http://127.0.0.1:3128/`,
  { files: [path.join(inputs, "secret.txt")] });
  assert.equal(asked.length, 1, JSON.stringify(asked));
  const m = asked[0].message;
  assert.match(m, /^WARNING: this sandbox HOLDS HOST INPUTS/);
  assert.ok(m.includes(`connect to __b__.asked.test port ${host.httpsPort}.`), m);
  assert.ok(!m.includes("<"), m);
  assert.ok(!m.includes("\\_"), "nothing escaped: plain text, not markdown");
  assert.match(r.stdout, /^400$/m);
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decided_by]), [["__b__.asked.test", "deny", "elicitation"]]);
});

test("a client that did not declare elicitation is not asked: the timeout denies", async () => {
  const plain = await connect({ fixtures: false, env: serverEnv() });
  asked.length = 0;
  try {
    const r = await script(`${CURL} ${url("again.asked.test")}; echo "rc=$?"`, {}, plain);
    assert.doesNotMatch(r.stdout, /rc=0/);
    const log = egressLog(r);
    assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decided_by]), [["again.asked.test", "deny", "timeout"]]);
  } finally {
    await plain.client.close();
  }
  assert.equal(asked.length, 0, "the other client was not asked either");
});

test("a child sandbox's question goes to the root's host client, naming the child and its tree", async () => {
  asked.length = 0;
  answer = () => ({ action: "accept", content: { decision: "run" } });
  const before = host.hits;
  const child = JSON.stringify({ name: "fetch", command: `${CURL} ${url("asked.test", "/child")}`, image: "base" });
  const r = await script(`python3 /in/tree/mcp-client.py sandbox_script '${child}'`,
    { image: "default", mcp: true, directories: [TREE_FIX] });
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.stdout, /asked-host GET \/child host=asked\.test/);
  assert.equal(host.hits - before, 1);
  assert.equal(asked.length, 1, "the host client was asked once");
  const m = asked[0].message;
  assert.match(m, /^WARNING: this sandbox HOLDS HOST INPUTS/, "the child holds its parent's inputs");
  assert.ok(m.includes(`in the tree of ${r.run_id}`), m);
  const childId = JSON.parse(r.stdout).run_id;
  assert.ok(childId && m.includes(`run ${childId} `), m);
  const log = egressLog({ output_dir: path.join(r.output_dir, "child", "fetch") });
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decision, l.decided_by, l.sandbox]),
    [["asked.test", "allow", "run", "elicitation", childId]], JSON.stringify(log));
});

test("a persistent sandbox is asked about during a later exec, after the call that made it has ended", async () => {
  asked.length = 0;
  answer = () => ({ action: "accept", content: { decision: "run" } });
  const call = async (name, args) => {
    const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
    assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
    return res.structuredContent;
  };
  const sb = await call("sandbox_create", { image: "base", egress: "asktest" });
  try {
    const r1 = await call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `${CURL} ${url("asked.test", "/exec1")}` });
    assert.match(r1.stdout, /GET \/exec1/);
    const r2 = await call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `${CURL} ${url("asked.test", "/exec2")}` });
    assert.match(r2.stdout, /GET \/exec2/);
    assert.equal(asked.length, 1, "asked once: the answer holds for the sandbox's run");
    assert.ok(asked[0].message.includes(`run ${sb.sandbox_id}`), asked[0].message);
  } finally {
    await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  const log = readFileSync(path.join(sb.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
  assert.deepEqual(log.map((l) => [l.verdict, l.decision, l.decided_by, l.granted ?? false]),
    [["allow", "run", "elicitation", false], ["allow", "run", "elicitation", true]]);
});

test("over Streamable HTTP (2025-11-25): the question reaches the client on its call's stream", async () => {
  const s = await startHttp({ fixtures: false, env: serverEnv() });
  const client = new Client({ name: "demesne-ask-http", version: "1.0.0" }, { capabilities: { elicitation: {} } });
  const got = [];
  client.setRequestHandler(ElicitRequestSchema, async (req) => {
    got.push(req.params);
    return { action: "accept", content: { decision: "once" } };
  });
  try {
    await client.connect(new StreamableHTTPClientTransport(new URL(s.url),
      { requestInit: { headers: { Authorization: `Bearer ${s.token}` } } }));
    const r = await script(`${CURL} ${url("asked.test", "/http")}`, {}, { client });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.match(r.stdout, /GET \/http host=asked\.test/);
    assert.equal(got.length, 1);
    assert.ok(got[0].message.includes(`run ${r.run_id}`), got[0].message);
    assert.deepEqual(egressLog(r).map((l) => [l.verdict, l.decision, l.decided_by]), [["allow", "once", "elicitation"]]);
  } finally {
    await client.close();
    await s.stop();
  }
});
