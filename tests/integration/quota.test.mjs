// The output quota (lua/sandbox/quota.lua) over MCP against a real engine: a sandbox that
// writes past output_max_bytes is stopped with reason "output quota exceeded" and its
// output folder stays within the documented overshoot; a sparse file or hard links do not
// fool the count either way; the free-space reserve refuses a start; a persistent sandbox
// and a background job over quota are stopped and say why. Every writer here stops by
// itself after at most 2 GiB, so a quota that does not hold fails the test without
// filling the disk.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, statSync, statfsSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, ROOT } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-quota-"));
const MB = 1000 * 1000;
const QUOTA = 50 * MB;
// The overshoot docs/reference/configuration.md states ("the output quota"): what a writer
// at full speed writes while the watcher notices (10 ms) and the sandbox is killed
// (demesne-init at once, or the engine, up to a second or more when loaded): at most this
// past the quota; under gVisor, whose own page cache holds writes the host sees later, more.
const OVERSHOOT = (process.env.DEMESNE_TEST_ISOLATION === "gvisor" ? 1536 : 1024) * 1024 * 1024;
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_OUTPUT_MAX_BYTES: String(QUOTA),
};

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 300_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function callOn(c, name, args) {
  return c.client.callTool({ name, arguments: args }, undefined, LONG);
}
async function ok(name, args, c = conn) {
  const res = await callOn(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
async function err(name, args, c = conn) {
  const res = await callOn(c, name, args);
  assert.equal(res.isError, true, `${name} should fail: ${JSON.stringify(res.structuredContent)}`);
  return res.content[0].text;
}

// Allocated bytes under `dir` as du counts them (hard links once, links not followed).
function du(dir) {
  return Number(execFileSync("du", ["-s", "-B1", dir], { encoding: "utf8" }).split(/\s/)[0]);
}

async function containersOf(runId) {
  let left = [];
  for (let i = 0; i < 60; i++) {
    left = (await engineContainers(ENGINE)).filter((c) => c.Labels?.["io.demesne.run_id"] === runId);
    if (left.length === 0) break;
    await new Promise((r) => setTimeout(r, 250));
  }
  return left;
}

// 8 MB files of zeros as fast as head writes them, at most 256 of them (2 GiB), then a wait
// past the timeout: a sandbox the quota does not stop ends timed out, not with the quota's reason
const WRITER = "i=0; while [ $i -lt 256 ]; do head -c 8000000 /dev/zero > /out/f$i || exit 3; i=$((i+1)); done; sleep 60";

// One file, as fast as dd writes (into the page cache), at most 2 GiB
const DD = "dd if=/dev/zero of=/out/big bs=1M count=2048 2>/dev/null || exit 3; sleep 60";

for (const [what, command] of [["many files", WRITER], ["one dd", DD]]) test(`a sandbox writing past its /out quota is stopped: output quota exceeded, within the overshoot (${what})`, async () => {
  const r = await ok("sandbox_script", { command, image: "base", timeout_seconds: 30 });
  assert.equal(r.reason, "output quota exceeded", JSON.stringify(r));
  assert.equal(r.timed_out, false);
  assert.equal(r.exit_code, 137, "killed as a timeout's SIGKILL");
  assert.equal(r.output_quota.max_bytes, QUOTA);
  assert.match(r.output_quota.detail, /output_max_bytes \(50000000 bytes\)/);
  const used = du(r.output_dir);
  assert.ok(used > QUOTA, `the writer got past the quota: ${used}`);
  assert.ok(used <= QUOTA + OVERSHOOT, `the output folder takes ${used} bytes, more than ${QUOTA} + ${OVERSHOOT}`);
  // what the result says was written is what the folder holds (measured once it stopped)
  assert.ok(Math.abs(r.output_quota.written_bytes - used) < 1024 * 1024,
    `written_bytes ${r.output_quota.written_bytes}, du ${used}`);
  assert.deepEqual(await containersOf(r.run_id), []);
  console.log(`# quota ${QUOTA}: the folder took ${used} bytes (overshoot ${used - QUOTA})`);
});

test("blocks count, not lengths: a 100 GiB sparse file and 500 hard links pass, fallocate'd space does not", async () => {
  // 100 GiB long but holding one block, and one 10 MB file under 500 names: 10 MB on disk
  const fine = await ok("sandbox_script", {
    command: "truncate -s 100G /out/sparse && head -c 10000000 /dev/zero > /out/real && "
      + "i=0; while [ $i -lt 500 ]; do ln /out/real /out/l$i; i=$((i+1)); done; sleep 3; echo done",
    image: "base", timeout_seconds: 30,
  });
  assert.equal(fine.reason, undefined, JSON.stringify(fine));
  assert.equal(fine.exit_code, 0);
  assert.equal(fine.stdout, "done\n");
  // space allocated past the end of a file (st_size 0): counted, so stopped (gVisor has no
  // keep-size fallocate: there the file is as long as what it holds)
  const gvisor = process.env.DEMESNE_TEST_ISOLATION === "gvisor";
  const hidden = await ok("sandbox_script", {
    command: `: > /out/hidden && fallocate ${gvisor ? "" : "-n"} -l 200000000 /out/hidden && sleep 60`,
    image: "base", timeout_seconds: 30,
  });
  assert.equal(hidden.reason, "output quota exceeded", JSON.stringify(hidden));
  if (!gvisor) assert.equal(statSync(path.join(hidden.output_dir, "hidden")).size, 0, "the file's length is 0");
  assert.ok(hidden.output_quota.written_bytes >= 200000000, String(hidden.output_quota.written_bytes));
});

test("the free-space reserve: a sandbox does not start when output_root's filesystem has less free", async () => {
  const free = statfsSync(work).bavail * statfsSync(work).bsize;
  const c = await connect({ env: { ...env, DEMESNE_OUTPUT_MIN_FREE_BYTES: String(free + 1024 ** 4) }, fixtures: false });
  try {
    const msg = await err("sandbox_script", { command: "echo never", image: "base" }, c);
    assert.match(msg, /output quota exceeded: the filesystem of output_root .* below the reserve .*output_min_free_bytes/);
    const msg2 = await err("sandbox_create", { image: "base" }, c);
    assert.match(msg2, /output_min_free_bytes/);
    // (the warm pool's sandboxes of the first server live there too: they are not calls')
    const mine = (await engineContainers(ENGINE)).filter((x) => x.Labels?.["io.demesne.output_dir"]?.startsWith(work)
      && !x.Labels?.["io.demesne.pool"]);
    assert.deepEqual(mine.map((x) => x.Names), [], "no container was made");
  } finally {
    await c.client.close();
  }
});

test("a persistent sandbox over its quota is stopped and says why; destroy still removes it", async () => {
  const sb = await ok("sandbox_create", { image: "base" });
  try {
    await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo small > /out/small" });
    const during = await err("sandbox_exec", { sandbox_id: sb.sandbox_id, command: WRITER, timeout_seconds: 30 });
    assert.match(during, /output quota exceeded/, during);
    const after = await err("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" });
    assert.match(after, /is not running \(output quota exceeded: the output folder takes more than output_max_bytes .* bytes were written\)/);
    const used = du(sb.output_dir);
    assert.ok(used > QUOTA && used <= QUOTA + OVERSHOOT, `the output folder takes ${used} bytes`);
  } finally {
    const x = await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
    assert.equal(x.status, "destroyed");
  }
  assert.deepEqual(await containersOf(sb.sandbox_id), []);
});

test("a background job over its quota fails with the quota's reason and how much was written", async () => {
  const started = await ok("sandbox_script", { command: WRITER, image: "base", timeout_seconds: 30, background: true });
  const done = await ok("sandbox_wait", { job_id: started.job_id, timeout_seconds: 120 });
  assert.equal(done.status, "failed", JSON.stringify(done));
  assert.match(done.reason, /^output quota exceeded: the output folder takes more than output_max_bytes \(50000000 bytes\); \d+ bytes were written$/);
  assert.equal(done.exit_code, 137);
  const used = du(started.output_dir);
  assert.ok(used > QUOTA && used <= QUOTA + OVERSHOOT, `the output folder takes ${used} bytes`);
});

test("a persistent sandbox is watched again by the next server (its reaper pass at start)", async () => {
  const first = await connect({ env, fixtures: false });
  const sb = await ok("sandbox_create", { image: "base" }, first);
  await first.client.close(); // a graceful stop: the sandbox goes on
  const next = await connect({ env, fixtures: false });
  try {
    const during = await err("sandbox_exec", { sandbox_id: sb.sandbox_id, command: WRITER, timeout_seconds: 30 }, next);
    assert.match(during, /output quota exceeded/, during);
    const used = du(sb.output_dir);
    assert.ok(used > QUOTA && used <= QUOTA + OVERSHOOT, `the output folder takes ${used} bytes`);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id }, next);
    await next.client.close();
  }
  assert.deepEqual(await containersOf(sb.sandbox_id), []);
});

test("a tree shares its root's quota: two children, each under it alone, over it together, stop the root", async () => {
  const FIX = path.join(ROOT, "tests/fixtures/tree");
  const c = await connect({ env: { ...env, DEMESNE_ALLOWED_PATHS: FIX }, fixtures: false });
  try {
    // each child writes 30 MB into its own /out (the root's <out>/child/<name>) and ends; then the root waits
    const child = (name) => `python3 /in/tree/mcp-client.py sandbox_script '${JSON.stringify({ name, image: "base",
      command: "head -c 30000000 /dev/zero > /out/data && echo wrote" })}' > /out/${name}.json`;
    const root = await ok("sandbox_script", { directories: [FIX], image: "default", mcp: true, egress: "none",
      timeout_seconds: 60, command: `${child("one")} && ${child("two")}; echo children-done; sleep 60` }, c);
    // the root is stopped while the second child writes: the tree's total passed the quota
    assert.equal(root.reason, "output quota exceeded", JSON.stringify(root));
    assert.doesNotMatch(root.stdout, /children-done/);
    const one = JSON.parse(readFileSync(path.join(root.output_dir, "one.json"), "utf8"));
    assert.equal(one.exit_code, 0, JSON.stringify(one));
    assert.equal(one.reason, undefined, "the first child alone was under the quota");
    assert.equal(statSync(path.join(root.output_dir, "child/one/data")).size, 30 * MB);
    assert.ok(statSync(path.join(root.output_dir, "child/two")).isDirectory(), "the second child ran");
    assert.ok(root.output_quota.written_bytes > QUOTA, String(root.output_quota.written_bytes));
    assert.ok(du(root.output_dir) <= QUOTA + OVERSHOOT);
  } finally {
    await c.client.close();
  }
});
