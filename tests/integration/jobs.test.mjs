// Background jobs over MCP (official SDK client, stdio) against a real container engine:
// background: true on sandbox_script and sandbox_exec, sandbox_status with a byte cursor,
// sandbox_wait, sandbox_cancel, sandbox_jobs, the one terminal notifications/message per
// job, and re-attaching after the server was killed with SIGKILL.
// The engine comes from DEMESNE_ENGINE (tests/run runs this file once per engine).
// Cases C01, C04 and C22 from shared/cases are named in the test titles.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { LoggingMessageNotificationSchema } from "@modelcontextprotocol/sdk/types.js";
import { connect, isWarm } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const work = mkdtempSync(path.join(tmpdir(), "demesne-jobs-"));
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_PROGRESS_INTERVAL: "1",
  DEMESNE_JOBS_POLL_INTERVAL: "0.5",
};
const LINES = 20; // the issue asks for 150 s; 20 keeps CI time down with the same structure
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Every connection's demesne.jobs notifications, by job id.
const jobMessages = new Map();
async function open(extra = {}) {
  const conn = await connect({ env: { ...env, ...extra }, fixtures: false });
  conn.client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => {
    if (n.params.logger !== "demesne.jobs") return;
    const id = n.params.data?.data?.job_id;
    jobMessages.set(id, [...(jobMessages.get(id) || []), n.params]);
  });
  return conn;
}

let conn;
before(async () => { conn = await open(); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

async function callOn(c, name, args, opts = {}) {
  return c.client.callTool({ name, arguments: args }, undefined, { ...LONG, ...opts });
}
async function okOn(c, name, args, opts) {
  const res = await callOn(c, name, args, opts);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
const ok = (name, args, opts) => okOn(conn, name, args, opts);

function engine(method, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: p, method }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve({ status: res.statusCode, body: body ? JSON.parse(body) : null }));
    });
    req.on("error", reject);
    req.end();
  });
}
async function containersWithLabel(label) {
  const filters = encodeURIComponent(JSON.stringify({ label: [label] }));
  return (await engine("GET", `/containers/json?all=true&filters=${filters}`)).body;
}
// containers this file made (their output folders are under `work`), but not the warm
// sandboxes a running server keeps on purpose
async function ours() {
  const list = await containersWithLabel("io.demesne.managed=1");
  return list.filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(work) && !isWarm(c));
}

// Reads a job's stdout through sandbox_status with the cursor until eof.
async function readAll(c, jobId, { maxBytes, every = 700, onChunk } = {}) {
  let cursor = 0;
  let text = "";
  for (let i = 0; i < 1000; i++) {
    const s = await okOn(c, "sandbox_status", { job_id: jobId, since: cursor, ...(maxBytes ? { max_bytes: maxBytes } : {}) });
    assert.ok(s.next_cursor >= cursor, "the cursor never goes back");
    assert.equal(Buffer.byteLength(s.stdout), s.next_cursor - cursor, "stdout is exactly the bytes between the cursors");
    text += s.stdout;
    cursor = s.next_cursor;
    onChunk?.(s);
    if (s.eof) return { text, cursor, status: s };
    if (s.stdout === "") await sleep(every);
  }
  throw new Error("never reached eof");
}

test("a background job returns at once; its stdout read with the cursor misses and repeats no line; wait gives the result", async () => {
  const t0 = Date.now();
  const started = await ok("sandbox_script", {
    image: "base", background: true,
    command: `for i in $(seq 1 ${LINES}); do echo "line $i — ünïcödé ✓"; sleep 1; done; echo done >&2`,
  });
  assert.ok(Date.now() - t0 < 10_000, "background returns at once");
  assert.match(started.job_id, /^job-/);
  assert.equal(started.status, "running");
  assert.ok(started.output_dir.startsWith(path.join(work, "out")));

  // a short wait times out: status running with a message, not an error
  const early = await callOn(conn, "sandbox_wait", { job_id: started.job_id, timeout_seconds: 1 });
  assert.ok(!early.isError);
  assert.equal(early.structuredContent.status, "running");
  assert.match(early.structuredContent.message, /still running/);

  let chunks = 0;
  const { text, cursor, status } = await readAll(conn, started.job_id, { onChunk: (s) => { if (s.stdout) chunks++; } });
  assert.ok(chunks >= 3, `stdout came in several reads while the job ran (${chunks})`);
  const lines = text.split("\n").filter(Boolean);
  assert.deepEqual(lines, Array.from({ length: LINES }, (_, i) => `line ${i + 1} — ünïcödé ✓`));
  assert.equal(cursor, readFileSync(path.join(started.output_dir, "stdout.log")).length);
  assert.equal(status.status, "succeeded");

  const done = await ok("sandbox_wait", { job_id: started.job_id });
  assert.equal(done.status, "succeeded");
  assert.equal(done.exit_code, 0);
  assert.match(done.stdout, new RegExp(`line ${LINES} `));
  assert.match(done.stderr, /done/);
  assert.ok(done.finished_at && done.elapsed_seconds >= LINES - 1);
  // elapsed_seconds is frozen once the job ended
  await sleep(1100);
  const later = await ok("sandbox_status", { job_id: started.job_id, include_stdout_tail: true });
  assert.equal(later.elapsed_seconds, done.elapsed_seconds);
  assert.match(later.stdout_tail, new RegExp(`line ${LINES} — ünïcödé ✓\\n$`));
  assert.deepEqual(await containersWithLabel(`io.demesne.job_id=${started.job_id}`), []);
});

test("the cursor cuts on UTF-8 code points: small reads of multi-byte text reassemble byte for byte", async () => {
  const j = await ok("sandbox_script", { image: "base", background: true,
    command: "i=0; while [ $i -lt 300 ]; do printf '日本語🎉%03d\\n' $i; i=$((i+1)); done" });
  await ok("sandbox_wait", { job_id: j.job_id });
  const { text } = await readAll(conn, j.job_id, { maxBytes: 1025 });
  assert.ok(!text.includes("\uFFFD"), "no code point was split");
  assert.equal(text, readFileSync(path.join(j.output_dir, "stdout.log"), "utf8"));
});

test("C22: sandbox_wait with a progressToken gets strictly increasing progress, then the result", async () => {
  const j = await ok("sandbox_script", { image: "base", background: true, command: "sleep 5; exit 4" });
  const seen = [];
  const r = await ok("sandbox_wait", { job_id: j.job_id, timeout_seconds: 120 }, { onprogress: (p) => seen.push(p), timeout: 3000 });
  assert.equal(r.status, "failed");
  assert.equal(r.exit_code, 4);
  assert.match(r.reason, /exited with code 4/);
  assert.ok(seen.length >= 3, `progress while waiting (${seen.length})`);
  for (let i = 1; i < seen.length; i++) assert.ok(seen[i].progress > seen[i - 1].progress, "strictly increasing");
  assert.ok(seen.every((p) => p.total === 120));
});

test("C22: a synchronous sandbox_script with a progressToken gets progress while it runs", async () => {
  const seen = [];
  const r = await ok("sandbox_script", { image: "base", command: "sleep 4; echo ok" }, { onprogress: (p) => seen.push(p), timeout: 3000 });
  assert.equal(r.stdout, "ok\n");
  assert.ok(seen.length >= 2, `progress while running (${seen.length})`);
  for (let i = 1; i < seen.length; i++) assert.ok(seen[i].progress > seen[i - 1].progress);
});

test("sandbox_cancel of a one-shot job: container gone, status cancelled; again returns its status", async () => {
  const j = await ok("sandbox_script", { image: "base", background: true, command: "echo started; sleep 300" });
  for (let i = 0; i < 100; i++) {
    const s = await ok("sandbox_status", { job_id: j.job_id, since: 0 });
    if (s.stdout.includes("started")) break;
    await sleep(200);
  }
  assert.equal((await containersWithLabel(`io.demesne.job_id=${j.job_id}`)).length, 1);
  const c = await ok("sandbox_cancel", { job_id: j.job_id });
  assert.equal(c.status, "cancelled");
  assert.deepEqual(c.cancelled, [j.job_id]);
  assert.ok(c.finished_at);
  assert.deepEqual(await containersWithLabel(`io.demesne.job_id=${j.job_id}`), []);
  const w = await ok("sandbox_wait", { job_id: j.job_id, timeout_seconds: 5 });
  assert.equal(w.status, "cancelled");
  const again = await ok("sandbox_cancel", { job_id: j.job_id });
  assert.equal(again.status, "cancelled");
  assert.deepEqual(again.cancelled, []);
  assert.match(again.message, /already ended/);
});

test("C01/C04: sandbox_cancel of an exec job kills its whole process group", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    const j = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, background: true,
      command: "sleep 300 & echo $! > /tmp/pid; echo started; wait" });
    assert.equal(j.status, "running");
    assert.ok(j.log_dir.startsWith(sb.output_dir + "/exec/"));
    for (let i = 0; i < 100; i++) {
      const s = await ok("sandbox_status", { job_id: j.job_id, since: 0 });
      if (s.stdout.includes("started")) break;
      await sleep(200);
    }
    const c = await ok("sandbox_cancel", { job_id: j.job_id });
    assert.equal(c.status, "cancelled");
    const probe = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "kill -0 $(cat /tmp/pid) 2>/dev/null && echo alive || echo gone; pgrep -x sleep || true" });
    assert.equal(probe.stdout, "gone\n", "no sleep is left in the sandbox");
    assert.equal((await ok("sandbox_status", { job_id: j.job_id })).status, "cancelled");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("cancelling a finished job returns its status and changes nothing", async () => {
  const j = await ok("sandbox_script", { image: "base", background: true, command: "echo hi" });
  const w = await ok("sandbox_wait", { job_id: j.job_id });
  assert.equal(w.status, "succeeded");
  const c = await ok("sandbox_cancel", { job_id: j.job_id });
  assert.equal(c.status, "succeeded");
  assert.equal(c.exit_code, 0);
  assert.deepEqual(c.cancelled, []);
});

test("unknown and malformed job ids are clear errors", async () => {
  for (const id of ["job-nope", "../../etc/passwd"]) {
    const r = await callOn(conn, "sandbox_status", { job_id: id });
    assert.equal(r.isError, true);
    assert.match(r.content[0].text, /job_id: no job/);
  }
});

test("sandbox_jobs lists running jobs first and filters by status", async () => {
  const run = await ok("sandbox_script", { image: "base", background: true, command: "sleep 60" });
  try {
    const all = await ok("sandbox_jobs", {});
    assert.ok(all.jobs.length >= 5);
    assert.equal(all.jobs[0].status, "running");
    const firstDone = all.jobs.findIndex((x) => x.status !== "running");
    assert.ok(firstDone > 0, "the list holds running and finished jobs");
    assert.ok(all.jobs.slice(firstDone).every((x) => x.status !== "running"), "running ones come first");
    assert.ok(all.jobs.some((x) => x.job_id === run.job_id && x.command === "sleep 60"));
    const cancelled = await ok("sandbox_jobs", { status: "cancelled" });
    assert.ok(cancelled.jobs.length >= 2 && cancelled.jobs.every((x) => x.status === "cancelled"));
    const limited = await ok("sandbox_jobs", { limit: 1 });
    assert.equal(limited.jobs.length, 1);
    assert.equal(limited.matched, all.matched);
  } finally {
    await ok("sandbox_cancel", { job_id: run.job_id });
  }
});

test("exactly one notifications/message per job end, honouring logging/setLevel", async () => {
  await sleep(300);
  const list = await ok("sandbox_jobs", {});
  assert.ok(list.jobs.length >= 6);
  for (const j of list.jobs) {
    const msgs = jobMessages.get(j.job_id) || [];
    assert.equal(msgs.length, 1, `${j.job_id} (${j.status}): ${msgs.length} messages`);
    assert.equal(msgs[0].data.data.status, j.status);
    assert.equal(msgs[0].level, "info");
  }
  await conn.client.setLoggingLevel("warning");
  try {
    const j = await ok("sandbox_script", { image: "base", background: true, command: "true" });
    await ok("sandbox_wait", { job_id: j.job_id });
    await sleep(300);
    assert.equal(jobMessages.get(j.job_id), undefined, "an info record is not sent at level warning");
  } finally {
    await conn.client.setLoggingLevel("info");
  }
});

test("MCP tasks (2025-11-25): a task-augmented tools/call is a background job", async () => {
  assert.deepEqual(conn.client.getServerCapabilities().tasks, { list: {}, cancel: {}, requests: { tools: { call: {} } } });
  const { tools } = await conn.client.listTools();
  assert.equal(tools.find((x) => x.name === "sandbox_script").execution?.taskSupport, "optional");
  assert.equal(tools.find((x) => x.name === "sandbox_status").execution, undefined);
  const t = conn.client.experimental.tasks;
  const seen = [];
  let result;
  for await (const m of t.callToolStream({ name: "sandbox_script", arguments: { image: "base", command: "sleep 2; echo hi; exit 3" } },
    undefined, { task: { ttl: 60000 } })) {
    seen.push(m.type === "result" ? "result" : `${m.type}:${m.task?.status ?? m.error?.code}`);
    if (m.type === "result") result = m.result;
  }
  assert.equal(seen[0], "taskCreated:working");
  assert.equal(seen.at(-2), "taskStatus:completed");
  assert.equal(result.structuredContent.exit_code, 3, "the result the call would have given without a task");
  assert.equal(result.structuredContent.stdout, "hi\n");
  const id = result._meta["io.modelcontextprotocol/related-task"].taskId;
  // the task is the job
  assert.equal((await ok("sandbox_status", { job_id: id })).exit_code, 3);
  assert.equal((await t.getTask(id)).status, "completed");
  assert.ok((await t.listTasks()).tasks.some((x) => x.taskId === id));
  await assert.rejects(t.cancelTask(id), (e) => e.code === -32602 && /already ended/.test(e.message));
  // tasks/cancel cancels the job
  const started = await ok("sandbox_script", { image: "base", background: true, command: "sleep 100" });
  const c = await t.cancelTask(started.job_id);
  assert.equal(c.status, "cancelled");
  assert.equal((await ok("sandbox_status", { job_id: started.job_id })).status, "cancelled");
  assert.deepEqual(await containersWithLabel(`io.demesne.job_id=${started.job_id}`), []);
  // a tool without task support, and arguments the tool refuses
  const errors = [];
  for (const args of [{ name: "sandbox_list", arguments: {} }, { name: "sandbox_script", arguments: { command: "x", bogus: 1 } }]) {
    for await (const m of t.callToolStream(args, undefined, { task: {} })) if (m.type === "error") errors.push(m.error.code);
  }
  assert.deepEqual(errors, [-32601, -32602]);
});

// A server of its own, to be killed with SIGKILL; the next one shares its folders.
async function killHard(c) {
  const pid = c.transport.pid;
  const exited = new Promise((resolve) => c.transport._process.once("exit", resolve));
  process.kill(pid, "SIGKILL");
  await exited;
  await c.client.close().catch(() => {});
}

test("SIGKILL mid-job: a new server re-attaches a one-shot and an exec job; right exit code and full log", async () => {
  const state = { DEMESNE_STATE_DIR: path.join(work, "state-restart") };
  const a = await open(state);
  const sb = await okOn(a, "sandbox_create", { image: "base" });
  let b;
  try {
    const script = await okOn(a, "sandbox_script", { image: "base", background: true,
      command: "for i in $(seq 1 8); do echo \"script $i\"; sleep 1; done; exit 7" });
    const exec = await okOn(a, "sandbox_exec", { sandbox_id: sb.sandbox_id, background: true,
      command: "for i in $(seq 1 8); do echo \"exec $i\"; sleep 1; done; exit 5" });
    await sleep(3000);
    const mid = await okOn(a, "sandbox_status", { job_id: script.job_id, since: 0 });
    assert.equal(mid.status, "running");
    assert.match(mid.stdout, /script 1\n/);
    await killHard(a);

    b = await open(state);
    const s = await okOn(b, "sandbox_wait", { job_id: script.job_id, timeout_seconds: 60 });
    assert.equal(s.status, "failed");
    assert.equal(s.exit_code, 7);
    assert.match(s.reason, /exited with code 7/);
    assert.equal(readFileSync(path.join(script.output_dir, "stdout.log"), "utf8"),
      Array.from({ length: 8 }, (_, i) => `script ${i + 1}\n`).join(""));
    assert.equal(s.stdout, Array.from({ length: 8 }, (_, i) => `script ${i + 1}\n`).join(""));
    assert.deepEqual(await containersWithLabel(`io.demesne.job_id=${script.job_id}`), [], "the re-attached container is removed");

    const e = await okOn(b, "sandbox_wait", { job_id: exec.job_id, timeout_seconds: 60 });
    assert.equal(e.status, "failed");
    assert.equal(e.exit_code, 5);
    assert.equal(readFileSync(path.join(exec.log_dir, "stdout.log"), "utf8"),
      Array.from({ length: 8 }, (_, i) => `exec ${i + 1}\n`).join(""));
    // the log read through the cursor after the restart is whole too
    const { text } = await readAll(b, exec.job_id);
    assert.equal(text, Array.from({ length: 8 }, (_, i) => `exec ${i + 1}\n`).join(""));
  } finally {
    if (b) {
      await okOn(b, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
      await b.client.close();
    }
  }
});

test("a graceful stop leaves background jobs running; the next server re-attaches them", async () => {
  const state = { DEMESNE_STATE_DIR: path.join(work, "state-graceful") };
  const a = await open(state);
  const sb = await okOn(a, "sandbox_create", { image: "base" });
  const j = await okOn(a, "sandbox_script", { image: "base", background: true, command: "sleep 3; echo after" });
  const x = await okOn(a, "sandbox_exec", { sandbox_id: sb.sandbox_id, background: true, command: "sleep 3; echo exec-after; exit 2" });
  await a.client.close(); // stdin closed: the server stops, the jobs do not
  assert.equal((await containersWithLabel(`io.demesne.job_id=${j.job_id}`)).length, 1);
  const b = await open(state);
  try {
    const w = await okOn(b, "sandbox_wait", { job_id: j.job_id, timeout_seconds: 60 });
    assert.equal(w.status, "succeeded");
    assert.equal(w.stdout, "after\n");
    assert.deepEqual(await containersWithLabel(`io.demesne.job_id=${j.job_id}`), []);
    const e = await okOn(b, "sandbox_wait", { job_id: x.job_id, timeout_seconds: 60 });
    assert.equal(e.status, "failed");
    assert.equal(e.exit_code, 2);
    assert.equal(e.stdout, "exec-after\n");
  } finally {
    await okOn(b, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
    await b.client.close();
  }
});

test("a job whose container was removed while no server ran is lost, with the reason", async () => {
  const state = { DEMESNE_STATE_DIR: path.join(work, "state-lost") };
  const a = await open(state);
  const sb = await okOn(a, "sandbox_create", { image: "base" });
  const script = await okOn(a, "sandbox_script", { image: "base", background: true, command: "echo up; sleep 300" });
  const exec = await okOn(a, "sandbox_exec", { sandbox_id: sb.sandbox_id, background: true, command: "sleep 300" });
  await sleep(1500);
  await killHard(a);
  let removed = 0;
  for (const c of await ours()) {
    if (c.Labels["io.demesne.job_id"] === script.job_id || c.Labels["io.demesne.run_id"] === sb.sandbox_id) {
      assert.ok([200, 204].includes((await engine("DELETE", `/containers/${c.Id}?force=true&v=true`)).status));
      removed++;
    }
  }
  assert.equal(removed, 2, "the job's container and the sandbox were removed behind the server's back");
  const b = await open(state);
  try {
    const s = await okOn(b, "sandbox_wait", { job_id: script.job_id, timeout_seconds: 30 });
    assert.equal(s.status, "lost");
    assert.match(s.reason, /no longer exists/);
    const e = await okOn(b, "sandbox_wait", { job_id: exec.job_id, timeout_seconds: 30 });
    assert.equal(e.status, "lost");
    assert.match(e.reason, new RegExp(`sandbox ${sb.sandbox_id} no longer exists`));
    const listed = await okOn(b, "sandbox_jobs", { status: "lost" });
    assert.deepEqual(listed.jobs.map((x) => x.job_id).sort(), [script.job_id, exec.job_id].sort());
  } finally {
    await b.client.close();
  }
});

test("a background exec whose sandbox is destroyed under it is lost, with the reason", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  const started = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "sleep 60", background: true });
  await sleep(1000);
  await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  const done = await ok("sandbox_wait", { job_id: started.job_id, timeout_seconds: 60 });
  assert.equal(done.status, "lost", JSON.stringify(done));
  assert.match(done.reason, /destroyed|removed|no longer exists|stopped/);
});

test("no container is left behind", async () => {
  // first, that ours() sees this file's containers at all: an empty list from a filter
  // that matches nothing would pass the check below whatever was left
  const j = await ok("sandbox_script", { image: "base", background: true, command: "sleep 60" });
  assert.deepEqual((await ours()).filter((c) => c.Labels["io.demesne.job_id"] === j.job_id).length, 1,
    "a running job's container is one of ours");
  await ok("sandbox_cancel", { job_id: j.job_id });
  await sleep(500);
  assert.deepEqual((await ours()).map((c) => c.Names), []);
});
