// Containment limits over MCP against a real engine (DEMESNE_ENGINE; run once per engine):
// each attack comes from inside a real sandbox (issue 10, items 5 and 6).
//  - a connection flood on the sandbox's egress proxy must not starve the server or other
//    sandboxes, and the flooder is told the ceiling;
//  - a sandbox that stops its demesne-init (SIGSTOP) must not hold a call or a cancel;
//  - image names are checked and escaped before they reach the engine's API path;
//  - open egress is a property of the policy, not its name;
//  - what a SIGKILL of the server leaves is reaped at the next start.
// The server starts with a soft open-file limit of 1024 (as MCP clients start it) to show
// that it raises it. No network traffic leaves loopback: the flood targets the sandbox's
// own proxy, whose policy is `none`.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, rmSync, utimesSync, readdirSync } from "node:fs";
import { tmpdir, hostname } from "node:os";
import path from "node:path";
import http from "node:http";
import { connect, exitReaperOf } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const work = mkdtempSync(path.join(tmpdir(), "demesne-limits-"));
const xdg = path.join(work, "xdg");
const inputs = path.join(work, "inputs");
mkdirSync(path.join(xdg, "demesne", "policies"), { recursive: true });
mkdirSync(inputs, { recursive: true });
writeFileSync(path.join(inputs, "secret.txt"), "secret\n");
// an open policy that is not called "open": a rule list that allows every host
writeFileSync(path.join(xdg, "demesne", "policies", "wideopen.lua"),
  `return { description = "every host, by rule", rules = { { ALLOW, host = "*" }, { ALLOW, cidr = "0.0.0.0/0" } } }`);
const GRACE = 5;

function serverEnv(extra = {}) {
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_ALLOWED_PATHS: inputs, XDG_CONFIG_HOME: xdg,
    DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_EXEC_GRACE_SECONDS: String(GRACE), ...extra,
  };
}

let conn;
const created = []; // sandboxes to destroy even when a test fails half-way
before(async () => {
  conn = await connect({ fixtures: false, env: serverEnv(), wrap: ["prlimit", "--nofile=1024:"] });
});
after(async () => {
  for (const id of created) await call(conn, "sandbox_destroy", { sandbox_id: id }).catch(() => {});
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function call(c, name, args, opts = {}) {
  return c.client.callTool({ name, arguments: args }, undefined, { ...LONG, ...opts });
}
async function ok(c, name, args) {
  const res = await call(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  if (name === "sandbox_create") created.push(res.structuredContent.sandbox_id);
  return res.structuredContent;
}
async function fails(c, name, args) {
  const res = await call(c, name, args);
  assert.equal(res.isError, true, `${name} should fail: ${JSON.stringify(res.structuredContent)}`);
  return res.content[0].text;
}

function engineGet(p) {
  return new Promise((resolve, reject) => {
    http.get({ socketPath: SOCKET, path: p }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve({ status: res.statusCode, body: body ? JSON.parse(body) : null }));
    }).on("error", reject);
  });
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// The flooder: opens `n` connections to its proxy and holds them, then probes until the
// proxy answers with its ceiling, and keeps holding for `hold` seconds.
const FLOOD = `
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = 1700 if hard == resource.RLIM_INFINITY else min(hard, 1700)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
held, failed = [], 0
for i in range(1500):
    try:
        held.append(socket.create_connection(("127.0.0.1", 3128), timeout=5))
    except OSError:
        failed += 1
print("opened", len(held), "failed", failed, flush=True)
answer = b""
for attempt in range(80):
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
        s.sendall(b"CONNECT flood.test:443 HTTP/1.1\\r\\nHost: flood.test:443\\r\\n\\r\\n")
        data = b""
        while True:
            c = s.recv(4096)
            if not c:
                break
            data += c
        s.close()
        if b" 503 " in data:
            answer = data
            break
    except OSError:
        pass
    time.sleep(0.25)
print(answer.decode(errors="replace"), flush=True)
time.sleep(float(sys.argv[1]))
`;

test("a connection flood on one sandbox's proxy: the server and another sandbox answer, the flooder is told the ceiling", async (t) => {
  try {
    await floodAndCheck(t);
  } catch (e) {
    t.diagnostic(`server stderr (end): ${conn.stderr().slice(-3000)}`); // which step stalled, if one did
    throw e;
  }
});

async function floodAndCheck(t) {
  const limits = readFileSync(`/proc/${conn.transport.pid}/limits`, "utf8");
  const hard = Number(execFileSync("sh", ["-c", "ulimit -Hn"]).toString().trim()) || 0;
  const soft = Number(limits.match(/Max open files\s+(\d+)/)?.[1]);
  assert.ok(soft > 1024 && (!hard || soft === hard), `the server raised its soft open-file limit: ${soft} (hard ${hard})`);

  const fds = () => readdirSync(`/proc/${conn.transport.pid}/fd`).length;
  const baseline = fds();
  const flooder = await ok(conn, "sandbox_create", { image: "python", egress: "none" });
  await ok(conn, "sandbox_upload", { sandbox_id: flooder.sandbox_id, src: writeFlood(), dst: "/tmp/flood.py" });
  const floodRun = call(conn, "sandbox_exec", { sandbox_id: flooder.sandbox_id, command: "python3 /tmp/flood.py 25", timeout_seconds: 120 });
  // while it floods: another sandbox's script and a ping, again and again
  await sleep(3000);
  const pings = [];
  const scripts = [];
  let peak = 0;
  for (let i = 0; i < 3; i++) {
    peak = Math.max(peak, fds());
    const t0 = Date.now();
    await conn.client.ping().catch((e) => { throw new Error(`ping ${i} during the flood: ${e.message}`); });
    pings.push(Date.now() - t0);
    const r = await ok(conn, "sandbox_script", { image: "python", egress: "none", command: `echo other-${i}; python3 -c 'print(6*7)'` });
    scripts.push(r);
    await sleep(1000);
  }
  const fr = await floodRun;
  assert.ok(!fr.isError, `the flooding exec ends normally: ${fr.content?.[0]?.text}`);
  const out = fr.structuredContent.stdout;
  assert.match(out, /opened \d+ failed \d+/, "the flood ran");
  assert.match(out, /HTTP\/1\.1 503 Service Unavailable/, `the flooder sees the ceiling: ${out.slice(0, 600)}`);
  assert.match(out, /egress_max_connections/, "the answer names the setting");
  for (const [i, r] of scripts.entries()) {
    assert.equal(r.exit_code, 0, `other sandbox run ${i}`);
    assert.equal(r.stdout, `other-${i}\n42\n`, `other sandbox output ${i}`);
  }
  t.diagnostic(`${out.split("\n")[0]}; pings during the flood: ${pings.join(", ")} ms; server descriptors: ${baseline} before, ${peak} at most during`);
  // the ceiling holds on the host: 256 idle connections hold 2 descriptors each, and at most
  // 32 refused ones are being answered (2 each); the rest is the server's own and the other sandbox's
  assert.ok(peak - baseline <= 256 * 2 + 32 * 2 + 64, `the server held ${peak - baseline} more descriptors during the flood`);
  for (const ms of pings) assert.ok(ms < 2000, `ping answered promptly during the flood: ${pings}`);
  // and afterwards the flooder's own proxy works again
  const after = await ok(conn, "sandbox_exec", { sandbox_id: flooder.sandbox_id, timeout_seconds: 30,
    command: "python3 -c \"import urllib.request as u\ntry: u.urlopen('http://flood.test/', timeout=10)\nexcept Exception as e: print(getattr(e, 'code', e))\"" });
  assert.match(after.stdout, /403/, `a new request is judged again (403 under 'none'): ${after.stdout}`);
  await ok(conn, "sandbox_destroy", { sandbox_id: flooder.sandbox_id }); // egress.jsonl is complete once it is gone
  const log = readFileSync(path.join(flooder.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
  const ceiling = log.filter((l) => l.rule === "ceiling");
  assert.ok(ceiling.length >= 1, "egress.jsonl records the refusals");
  // how many of the 1500 reach the host depends on the relay and the socket's backlog; every one that does past the ceiling is counted
  assert.ok(ceiling.reduce((n, l) => n + l.refused, 0) >= 1, `refusals are counted: ${JSON.stringify(ceiling)}`);
  assert.equal(ceiling[0].limit, "connections");
  t.diagnostic(`refused: ${ceiling.reduce((n, l) => n + l.refused, 0)} in ${ceiling.length} egress.jsonl line(s)`);
}

function writeFlood() {
  const p = path.join(inputs, "flood.py");
  writeFileSync(p, FLOOD);
  return p;
}

test("a sandbox that stops its demesne-init: sandbox_exec returns an error within timeout + grace, the sandbox is stopped", async () => {
  const sb = await ok(conn, "sandbox_create", { image: "python", egress: "none" });
  const t0 = Date.now();
  const text = await fails(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, timeout_seconds: 5,
    command: "kill -STOP $PPID; sleep 1; echo after" });
  const took = (Date.now() - t0) / 1000;
  assert.match(text, /did not end within its timeout \(5 s\) plus a grace of 5 s/, text);
  assert.match(text, /not responding/, text);
  assert.match(text, /was stopped/, text);
  // bounded, not hanging until a client gives up: the stop of the unresponsive sandbox takes
  // the engine some seconds more on a loaded machine (Podman: 20 s seen with two lanes running)
  assert.ok(took < 5 + GRACE + 60, `bounded: ${took} s`);
  const info = await engineGet(`/containers/demesne-${sb.sandbox_id}/json`);
  assert.equal(info.body?.State?.Running, false, "the unresponsive sandbox was stopped");
  const again = await fails(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" });
  assert.match(again, /is not running/);
  await ok(conn, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
});

test("sandbox_cancel of a background exec whose demesne-init is stopped, in a sandbox that stops every kill, completes", async () => {
  const sb = await ok(conn, "sandbox_create", { image: "python", egress: "none" });
  // a watcher that stops every `demesne-init kill` the host sends ("[i]" keeps it from matching itself);
  // the sandbox first removes demesne-init's control socket, so the host falls back to the
  // engine's exec API for its execs and kills (as for a sandbox made before the socket existed)
  await ok(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, timeout_seconds: 10,
    command: "rm -f /.demesne/run/init.sock; nohup sh -c 'while :; do pkill -STOP -f \"[i]nit kill\"; sleep 0.05; done' >/dev/null 2>&1 &" });
  const job = await ok(conn, "sandbox_exec", { sandbox_id: sb.sandbox_id, background: true, timeout_seconds: 300,
    command: "kill -STOP $PPID; sleep 300" });
  await sleep(2000);
  const t0 = Date.now();
  const r = await ok(conn, "sandbox_cancel", { job_id: job.job_id });
  const took = (Date.now() - t0) / 1000;
  assert.equal(r.status, "cancelled");
  assert.deepEqual(r.cancelled, [job.job_id]);
  assert.match(r.reason, /demesne-init kill did not end/, r.reason);
  assert.ok(took < 60 + 10, `bounded: ${took} s`);
  const info = await engineGet(`/containers/demesne-${sb.sandbox_id}/json`);
  assert.equal(info.body?.State?.Running, false, "the sandbox that blocked the kill was stopped");
  await ok(conn, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
});

test("image names that are not OCI references are refused naming `image`, before the engine is asked", async () => {
  const cases = ["../events?x=", "../images/x/get?x=", "UPPER/case", "", "a".repeat(300)];
  for (const image of cases) {
    const t0 = Date.now();
    const text = await fails(conn, "sandbox_script", { image, command: "true" });
    assert.match(text, /^image: /, `${JSON.stringify(image)}: ${text}`);
    if (image !== "") assert.match(text, /not a valid image reference/, text);
    assert.ok(Date.now() - t0 < 10000, `answered at once: ${image}`);
  }
  const text = await fails(conn, "sandbox_create", { image: "../images/x/get?x=" });
  assert.match(text, /^image: .*not a valid image reference/);
});

test("a user policy that is open but not named open is refused for uploads and host inputs", async () => {
  const withInputs = await fails(conn, "sandbox_create", { egress: "wideopen", image: "python",
    files: [path.join(inputs, "secret.txt")] });
  assert.match(withInputs, /egress: "wideopen" is not permitted for a call that mounts files or directories: it gives open egress/);
  const script = await fails(conn, "sandbox_script", { egress: "wideopen", image: "python", command: "true",
    directories: [inputs] });
  assert.match(script, /gives open egress/);
  const sb = await ok(conn, "sandbox_create", { egress: "wideopen", image: "python" });
  const up = await fails(conn, "sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(inputs, "secret.txt"), dst: "/tmp/secret.txt" });
  assert.match(up, /has open egress \(policy "wideopen"\); host files cannot be uploaded into it/);
  const labels = (await engineGet(`/containers/demesne-${sb.sandbox_id}/json`)).body.Config.Labels;
  assert.equal(labels["io.demesne.egress_unrestricted"], "1", "the property is recorded at create");
  // the sandbox really could reach any host: prove the policy, not the name, decided
  const restricted = await ok(conn, "sandbox_create", { egress: "none", image: "python" });
  await ok(conn, "sandbox_upload", { sandbox_id: restricted.sandbox_id, src: path.join(inputs, "secret.txt"), dst: "/tmp/secret.txt" });
  await ok(conn, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
  await ok(conn, "sandbox_destroy", { sandbox_id: restricted.sandbox_id });
});

test("SIGKILL of the server mid-run: the next server reaps the run folder and the container, and keeps live ones", async () => {
  const state = path.join(work, "state-kill");
  const env = serverEnv({ DEMESNE_STATE_DIR: state });
  const a = await connect({ fixtures: false, env });
  const live = await ok(a, "sandbox_create", { image: "python", egress: "none" });
  const job = await ok(a, "sandbox_exec", { sandbox_id: live.sandbox_id, background: true, timeout_seconds: 120,
    command: "sleep 20; echo done" });
  const running = call(a, "sandbox_script", { image: "python", egress: "none", command: "sleep 120" }).catch(() => null);
  let oneshot;
  for (let i = 0; i < 100 && !oneshot; i++) {
    await sleep(200);
    const runs = readdirSync(path.join(state, "run")).filter((d) => d !== live.sandbox_id);
    for (const id of runs) {
      const c = await engineGet(`/containers/demesne-${id}/json`);
      if (c.status === 200 && c.body.State.Running) oneshot = id;
    }
  }
  assert.ok(oneshot, "the one-shot sandbox runs");
  // leftovers of earlier crashes: a folder claimed by a dead server on this engine, one claimed
  // on another engine, an old folder without a claim, a young one, and an orphan expiry file
  const dead = `${hostname()}/999999999/1`;
  const plant = (id, claim, old) => {
    mkdirSync(path.join(state, "run", id, "exec"), { recursive: true });
    writeFileSync(path.join(state, "run", id, "egress.sock"), "");
    if (claim) writeFileSync(path.join(state, "claims", id), JSON.stringify(claim));
    if (old) utimesSync(path.join(state, "run", id), new Date(Date.now() - 10 * 86400e3), new Date(Date.now() - 10 * 86400e3));
  };
  mkdirSync(path.join(state, "claims"), { recursive: true });
  plant("20200101T000000Z-deadbeef", { engine: SOCKET, owner: dead });
  plant("20200101T000000Z-0therea9", { engine: "/elsewhere/engine.sock", owner: dead });
  plant("20200101T000000Z-01d01d01", null, true);
  plant("20200101T000000Z-y0un9000", null, false);
  mkdirSync(path.join(state, "expiry"), { recursive: true });
  writeFileSync(path.join(state, "expiry", "20200101T000000Z-0rphan00"), "1");

  // a crash that takes the server's exit reaper too (the OOM killer, `pkill -9 demesne`): the
  // next server's reaper is what cleans up (pool.test.mjs shows the exit reaper alone)
  const exitReaper = exitReaperOf(a.transport.pid);
  assert.ok(exitReaper, "the server's exit reaper runs");
  process.kill(exitReaper.pid, "SIGKILL");
  process.kill(a.transport.pid, "SIGKILL");
  await running;
  await a.client.close().catch(() => {});
  assert.ok(existsSync(path.join(state, "run", oneshot)), "SIGKILL left the one-shot's run folder");

  const b = await connect({ fixtures: false, env });
  try {
    let gone = false;
    for (let i = 0; i < 100 && !gone; i++) {
      await sleep(200);
      // (the orphan expiry file goes later in the same reaper pass than the folders: waited for too)
      gone = (await engineGet(`/containers/demesne-${oneshot}/json`)).status === 404 &&
        !existsSync(path.join(state, "run", oneshot)) && !existsSync(path.join(state, "run", "20200101T000000Z-deadbeef")) &&
        !existsSync(path.join(state, "expiry", "20200101T000000Z-0rphan00"));
    }
    assert.ok(gone, "the one-shot's container and run folder, and the dead server's leftover, are gone");
    assert.equal(existsSync(path.join(state, "run", "20200101T000000Z-01d01d01")), false, "an old unclaimed folder is gone");
    assert.equal(existsSync(path.join(state, "expiry", "20200101T000000Z-0rphan00")), false, "an orphan expiry file is gone");
    assert.equal(existsSync(path.join(state, "claims", "20200101T000000Z-deadbeef")), false, "its claim too");
    assert.equal(existsSync(path.join(state, "run", "20200101T000000Z-0therea9")), true, "another engine's folder is kept");
    assert.equal(existsSync(path.join(state, "run", "20200101T000000Z-y0un9000")), true, "a young unclaimed folder is kept");
    assert.equal(existsSync(path.join(state, "run", live.sandbox_id)), true, "the live persistent sandbox's folder is kept");
    assert.equal(existsSync(path.join(state, "run", live.sandbox_id, "egress.sock")), true, "with its proxy socket");
    const w = await ok(b, "sandbox_wait", { job_id: job.job_id, timeout_seconds: 60 });
    assert.equal(w.status, "succeeded", `the running job was adopted and finished: ${JSON.stringify(w)}`);
    const e = await ok(b, "sandbox_exec", { sandbox_id: live.sandbox_id, command: "echo alive" });
    assert.equal(e.stdout, "alive\n");
    await ok(b, "sandbox_destroy", { sandbox_id: live.sandbox_id });
  } finally {
    await b.client.close();
  }
});
