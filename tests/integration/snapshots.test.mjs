// Snapshots, forks and pause (issue 27) over MCP (official SDK, stdio) against a real
// engine (DEMESNE_ENGINE; Podman and Docker): a snapshot keeps /workspace and, with a
// writable root, the root filesystem's changes; a fork's sandboxes each see them and not
// each other's writes; sandbox_create {snapshot}; list, delete and retention; pause refuses
// exec until resume; every refusal names its field and leaves no image or container; one
// fork under gVisor (DEMESNE_GVISOR_ENGINE on Podman, the runsc runtime on Docker).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, ROOT, connect, engineContainers, engineRequest, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const RUNSC = existsSync("/usr/bin/runsc");
const work = mkdtempSync(path.join(tmpdir(), "demesne-snap-"));

// one state folder per server: a snapshot is labelled with its server's state folder
function env(name, extra = {}) {
  return { DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, name, "out"),
    DEMESNE_STATE_DIR: path.join(work, name, "state"), DEMESNE_POOL_SIZE: "0", ...extra };
}
const ENVS = {
  rw: env("rw", { DEMESNE_READONLY_ROOTFS: "0", DEMESNE_SNAPSHOT_MAX_BYTES: String(8 * 1024 * 1024),
    DEMESNE_FORK_MAX_COUNT: "3" }),
  ro: env("ro"),
  keep: env("keep", { DEMESNE_SNAPSHOT_KEEP_SECONDS: "3" }),
  cap: env("cap", { DEMESNE_SNAPSHOT_MAX_COUNT: "1" }),
  tree: env("tree", { DEMESNE_ALLOWED_PATHS: path.join(ROOT, "tests/fixtures/tree") }),
};
const conns = {};

before(async () => {
  for (const [k, e] of Object.entries(ENVS)) conns[k] = await connect({ env: e, fixtures: false });
});
after(async () => {
  for (const c of Object.values(conns)) await c?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function call(c, name, args) { return conns[c].client.callTool({ name, arguments: args }, undefined, LONG); }
async function ok(c, name, args) {
  const res = await call(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
async function refused(c, name, args) {
  const res = await call(c, name, args);
  assert.equal(res.isError, true, `${name} should have been refused: ${JSON.stringify(res.structuredContent)}`);
  return res.content[0].text;
}
async function sh(c, id, command) {
  const r = await ok(c, "sandbox_exec", { sandbox_id: id, command });
  assert.equal(r.exit_code, 0, `${command}: ${r.stderr}`);
  return r.stdout;
}
// the engine's images and containers of one server (its state folder)
async function imagesOf(c) {
  const f = encodeURIComponent(JSON.stringify({ label: [`io.demesne.snapshot_state=${ENVS[c].DEMESNE_STATE_DIR}`] }));
  return (await engineRequest(ENGINE, "GET", `/images/json?filters=${f}`)) || [];
}
async function containersOf(c) {
  const state = ENVS[c].DEMESNE_STATE_DIR;
  return (await engineContainers(ENGINE)).filter((x) => (x.Labels?.["io.demesne.run_dir"] || "").startsWith(state + "/")
    || (x.Names || []).some((n) => /demesne-snap-/.test(n)) && x.Labels?.["io.demesne.kind"] === "snapshot");
}

test("a snapshot keeps the root filesystem and /workspace; a fork of three each sees them and only its own writes", async () => {
  const src = await ok("rw", "sandbox_create", { image: "base", mcp: true, egress: "none" });
  await sh("rw", src.sandbox_id, "echo root-data > /etc/demesne-snap && mkdir -p /workspace/proj && "
    + "echo ws-data > /workspace/proj/a.txt && echo out-data > /out/o.txt && sleep 1000 > /dev/null 2>&1 &");
  const fork = await ok("rw", "sandbox_fork", { sandbox_id: src.sandbox_id, count: 3, name: "prepared" });
  assert.match(fork.snapshot_id, /^snap-/);
  assert.equal(fork.sandboxes.length, 3);
  const ids = fork.sandboxes.map((s) => s.sandbox_id);
  assert.equal(new Set([...ids, src.sandbox_id]).size, 4, "four different sandboxes");
  assert.equal(new Set(fork.sandboxes.map((s) => s.output_dir)).size, 3, "each its own /out");
  for (const [i, id] of ids.entries()) {
    assert.equal(await sh("rw", id, "cat /etc/demesne-snap /workspace/proj/a.txt"), "root-data\nws-data\n", id);
    assert.equal(await sh("rw", id, "test -e /out/o.txt && echo present || echo absent"), "absent\n",
      "/out is not part of a snapshot");
    assert.equal(await sh("rw", id, "pgrep -x sleep || echo none"), "none\n", "processes are not part of a snapshot");
    assert.equal(await sh("rw", id, 'echo "[$DEMESNE_MCP_TOKEN]"'), "[]\n", "the source's endpoint token is not in the image");
    await sh("rw", id, `echo mine-${i} > /workspace/proj/own.txt && echo root-${i} > /etc/own && echo o-${i} > /out/mine`);
  }
  for (const [i, id] of ids.entries()) {
    assert.equal(await sh("rw", id, "cat /workspace/proj/own.txt /etc/own"), `mine-${i}\nroot-${i}\n`, "its own writes only");
    assert.equal(readFileSync(path.join(fork.sandboxes[i].output_dir, "mine"), "utf8"), `o-${i}\n`);
  }
  assert.equal(await sh("rw", src.sandbox_id, "cat /workspace/proj/own.txt 2>/dev/null || echo absent"), "absent\n",
    "the source does not see the forks' writes");
  const list = await ok("rw", "sandbox_snapshots", {});
  const s = list.snapshots.find((x) => x.snapshot_id === fork.snapshot_id);
  assert.equal(s?.name, "prepared");
  assert.equal(s.source_sandbox_id, src.sandbox_id);
  assert.equal(s.isolation, "container");
  // an image the forks use is not deleted
  assert.match(await refused("rw", "sandbox_snapshot_delete", { snapshot_id: fork.snapshot_id }),
    /^snapshot_id: sandboxes still run from snapshot snap-/);
  for (const id of [...ids, src.sandbox_id]) await ok("rw", "sandbox_destroy", { sandbox_id: id });
  assert.deepEqual(await ok("rw", "sandbox_snapshot_delete", { snapshot_id: fork.snapshot_id }),
    { snapshot_id: fork.snapshot_id, status: "deleted" });
  assert.deepEqual(await ok("rw", "sandbox_snapshot_delete", { snapshot_id: fork.snapshot_id }),
    { snapshot_id: fork.snapshot_id, status: "already gone" });
  assert.equal((await ok("rw", "sandbox_snapshots", {})).snapshots.some((x) => x.snapshot_id === fork.snapshot_id), false);
});

test("with a read-only root a snapshot keeps /workspace; sandbox_create {snapshot} starts from it", async () => {
  const src = await ok("ro", "sandbox_create", { image: "base" });
  await sh("ro", src.sandbox_id, "mkdir -p /workspace/d && printf 'x%.0s' $(seq 1 3000) > /workspace/d/big && "
    + "echo hello > /workspace/hello && ln -s hello /workspace/link");
  const snap = await ok("ro", "sandbox_snapshot", { sandbox_id: src.sandbox_id });
  assert.match(snap.snapshot_id, /^snap-/);
  assert.equal(snap.source_sandbox_id, src.sandbox_id);
  const made = await ok("ro", "sandbox_create", { snapshot: snap.snapshot_id });
  assert.equal(made.snapshot, snap.snapshot_id);
  assert.equal(await sh("ro", made.sandbox_id, "cat /workspace/hello /workspace/link; wc -c < /workspace/d/big"),
    "hello\nhello\n3000\n");
  assert.equal(await sh("ro", made.sandbox_id, "readlink /workspace/link"), "hello\n", "a link stays a link");
  await sh("ro", made.sandbox_id, "echo new > /workspace/new");
  assert.equal(await sh("ro", src.sandbox_id, "ls /workspace"), "d\nhello\nlink\n", "the source is unchanged");
  await ok("ro", "sandbox_destroy", { sandbox_id: made.sandbox_id });
  await ok("ro", "sandbox_destroy", { sandbox_id: src.sandbox_id });
  await ok("ro", "sandbox_snapshot_delete", { snapshot_id: snap.snapshot_id });
});

test("retention: the reaper removes a snapshot past snapshot_keep_seconds", async () => {
  const src = await ok("keep", "sandbox_create", { image: "base" });
  const snap = await ok("keep", "sandbox_snapshot", { sandbox_id: src.sandbox_id });
  assert.equal((await ok("keep", "sandbox_snapshots", {})).snapshots.length, 1, "kept when taken");
  await new Promise((r) => setTimeout(r, 4000)); // past its 3 s (a wait, not a timing assertion)
  execFileSync(BIN, ["reap"], { env: serverEnv(ENVS.keep), stdio: "pipe" });
  assert.deepEqual((await ok("keep", "sandbox_snapshots", {})).snapshots, [], "gone after a reaper pass");
  assert.equal((await imagesOf("keep")).length, 0, `the image ${snap.snapshot_id} is gone`);
  await ok("keep", "sandbox_destroy", { sandbox_id: src.sandbox_id });
});

test("retention: past snapshot_max_count the oldest snapshot goes", async () => {
  const src = await ok("cap", "sandbox_create", { image: "base" });
  const a = await ok("cap", "sandbox_snapshot", { sandbox_id: src.sandbox_id, name: "a" });
  const b = await ok("cap", "sandbox_snapshot", { sandbox_id: src.sandbox_id, name: "b" });
  assert.deepEqual((await ok("cap", "sandbox_snapshots", {})).snapshots.map((s) => s.snapshot_id), [b.snapshot_id],
    `${a.snapshot_id} went when ${b.snapshot_id} was taken`);
  await ok("cap", "sandbox_destroy", { sandbox_id: src.sandbox_id });
  await ok("cap", "sandbox_snapshot_delete", { snapshot_id: b.snapshot_id });
});

test("a paused sandbox refuses exec, transfers and snapshots until it is resumed", async () => {
  const sb = await ok("ro", "sandbox_create", { image: "base" });
  await sh("ro", sb.sandbox_id, "echo 1 > /workspace/n");
  const p = await ok("ro", "sandbox_pause", { sandbox_id: sb.sandbox_id });
  assert.equal(p.status, "paused");
  assert.equal((await ok("ro", "sandbox_pause", { sandbox_id: sb.sandbox_id })).status, "already paused");
  assert.match(await refused("ro", "sandbox_exec", { sandbox_id: sb.sandbox_id, command: "true" }),
    /^sandbox_id: sandbox .* is paused \(sandbox_pause\); sandbox_resume it first/);
  assert.match(await refused("ro", "sandbox_snapshot", { sandbox_id: sb.sandbox_id }), /is paused/);
  assert.match(await refused("ro", "sandbox_fork", { sandbox_id: sb.sandbox_id, count: 1 }), /is paused/);
  const list = await ok("ro", "sandbox_list", {});
  assert.equal(list.sandboxes.find((s) => s.sandbox_id === sb.sandbox_id)?.paused, true, "a paused sandbox is listed, paused");
  assert.equal((await ok("ro", "sandbox_resume", { sandbox_id: sb.sandbox_id })).status, "resumed");
  assert.equal((await ok("ro", "sandbox_resume", { sandbox_id: sb.sandbox_id })).status, "not paused");
  assert.equal(await sh("ro", sb.sandbox_id, "cat /workspace/n"), "1\n", "exec works again, state kept");
  await ok("ro", "sandbox_pause", { sandbox_id: sb.sandbox_id });
  assert.equal((await ok("ro", "sandbox_destroy", { sandbox_id: sb.sandbox_id })).status, "destroyed",
    "a paused sandbox can be destroyed");
  assert.match(await refused("ro", "sandbox_pause", { sandbox_id: sb.sandbox_id }), /^sandbox_id: no sandbox /);
});

test("refusals name the field and leave no image or container behind", async () => {
  const sb = await ok("rw", "sandbox_create", { image: "base" });
  const before = (await imagesOf("rw")).length;
  assert.match(await refused("rw", "sandbox_snapshot", { sandbox_id: "no-such-sandbox" }), /^sandbox_id: no sandbox no-such-sandbox/);
  assert.match(await refused("rw", "sandbox_snapshot", { sandbox_id: sb.sandbox_id, name: "not a/name" }),
    /^name: "not a\/name" is not a valid image reference component/);
  assert.match(await refused("rw", "sandbox_fork", { sandbox_id: sb.sandbox_id, count: 4 }),
    /^count: 4 is above the ceiling of 3 set in the configuration \(fork_max_count\)/);
  assert.match(await refused("rw", "sandbox_create", { snapshot: "snap-20260101T000000Z-00000000" }),
    /^snapshot: no snapshot snap-20260101T000000Z-00000000/);
  assert.match(await refused("rw", "sandbox_create", { snapshot: "nope" }), /^snapshot: "nope" is not a snapshot id/);
  assert.match(await refused("rw", "sandbox_create", { snapshot: "snap-x", image: "base" }),
    /^snapshot: give image or snapshot, not both/);
  // a fork that fails half-way (its snapshot taken, its first sandbox refused) keeps nothing
  const made = (await containersOf("rw")).length;
  assert.match(await refused("rw", "sandbox_fork", { sandbox_id: sb.sandbox_id, count: 2, egress: "no-such-policy" }),
    /egress/);
  assert.equal((await imagesOf("rw")).length, before, "the fork's snapshot was deleted");
  assert.equal((await containersOf("rw")).length, made, "no sandbox of the fork was kept");
  // too large: /workspace over snapshot_max_bytes (8 MiB here), found while it is packed
  await sh("rw", sb.sandbox_id, "head -c 9000000 /dev/urandom > /workspace/big");
  assert.match(await refused("rw", "sandbox_snapshot", { sandbox_id: sb.sandbox_id }),
    /^sandbox_id: the snapshot of sandbox .* would hold more than snapshot_max_bytes \(8388608 bytes/);
  // too large: the root filesystem's changes alone, found before anything is made
  await sh("rw", sb.sandbox_id, "rm /workspace/big && head -c 9000000 /dev/urandom > /var/big");
  assert.match(await refused("rw", "sandbox_fork", { sandbox_id: sb.sandbox_id, count: 2 }),
    /^sandbox_id: sandbox .* has \d+ bytes of root filesystem changes, over snapshot_max_bytes \(8388608\)/);
  assert.equal(await sh("rw", sb.sandbox_id, "ls -A / | grep -c demesne-snapshot || true"), "0\n",
    "the sandbox keeps no snapshot tar");
  assert.equal((await imagesOf("rw")).length, before, "no image was left");
  await ok("rw", "sandbox_destroy", { sandbox_id: sb.sandbox_id });
  assert.match(await refused("rw", "sandbox_snapshot", { sandbox_id: sb.sandbox_id }), /^sandbox_id: no sandbox /);
});

test("a fork of a gVisor sandbox runs on gVisor", { skip: RUNSC ? false : "runsc is not installed" }, async () => {
  const src = await ok("ro", "sandbox_create", { image: "base", isolation: "gvisor" });
  let fork;
  try {
    await sh("ro", src.sandbox_id, "echo under-gvisor > /workspace/g");
    fork = await ok("ro", "sandbox_fork", { sandbox_id: src.sandbox_id, count: 1 });
    assert.equal(fork.sandboxes[0].isolation, "gvisor");
    const id = fork.sandboxes[0].sandbox_id;
    assert.equal(await sh("ro", id, "cat /workspace/g"), "under-gvisor\n");
    assert.match(await sh("ro", id, "dmesg | head -n 1"), /gVisor/i, "its kernel is gVisor's");
    assert.match(await refused("ro", "sandbox_create", { snapshot: fork.snapshot_id, isolation: "container" }),
      /^isolation: snapshot snap-.* was taken of a gvisor sandbox/);
  } finally {
    // (a failure above must not leave its sandboxes for the last test to find)
    for (const x of [...(fork?.sandboxes || []).map((f) => f.sandbox_id), src.sandbox_id]) {
      await ok("ro", "sandbox_destroy", { sandbox_id: x });
    }
    if (fork) await ok("ro", "sandbox_snapshot_delete", { snapshot_id: fork.snapshot_id });
  }
});


test("from inside a tree a fork is a set of the caller's children, refused above the children left", async () => {
  // a gVisor source under a container parent: its forks run on gVisor (the snapshot's floor)
  const iso = RUNSC ? "gvisor" : "container";
  const FIX = path.join(ROOT, "tests/fixtures/tree");
  const other = await ok("tree", "sandbox_create", { image: "base", egress: "none" });
  const root = await ok("tree", "sandbox_create", { image: "default", mcp: true, egress: "none", directories: [FIX],
    tree: { children: 3 } });
  const C = "python3 /in/tree/mcp-client.py";
  const script = [
    "set -e",
    `src=$(${C} --field sandbox_id sandbox_create '{"name":"src","image":"base","isolation":"${iso}"}')`,
    `${C} sandbox_exec "{\\"sandbox_id\\":\\"$src\\",\\"command\\":\\"echo from-src > /workspace/s.txt\\"}" > /dev/null`,
    "set +e",
    `${C} sandbox_fork "{\\"sandbox_id\\":\\"$src\\",\\"count\\":3}" 2> /out/refuse-count.txt`,
    `${C} sandbox_snapshot '{"sandbox_id":"${other.sandbox_id}"}' 2> /out/refuse-scope.txt`,
    "set -e",
    `${C} sandbox_fork "{\\"sandbox_id\\":\\"$src\\",\\"count\\":2}" > /out/fork.json`,
    `${C} sandbox_snapshots '{}' > /out/snaps.json`,
    "echo done",
  ].join("\n");
  const run = await ok("tree", "sandbox_exec", { sandbox_id: root.sandbox_id, command: script, timeout_seconds: 300 });
  assert.equal(run.exit_code, 0, run.stderr + run.stdout);
  const out = root.output_dir;
  assert.match(readFileSync(path.join(out, "refuse-count.txt"), "utf8"),
    /count: 3 sandboxes would pass this sandbox's limit of 3 children \(tree\.children\): 2 are left/);
  assert.match(readFileSync(path.join(out, "refuse-scope.txt"), "utf8"), new RegExp(`sandbox_id: no sandbox ${other.sandbox_id}`));
  const fork = JSON.parse(readFileSync(path.join(out, "fork.json"), "utf8"));
  assert.deepEqual(fork.sandboxes.map((s) => s.output_dir), ["/out/child/fork2-1", "/out/child/fork2-2"],
    "children of the caller, as it sees their folders");
  assert.deepEqual(fork.sandboxes.map((s) => s.isolation), [iso, iso], "the source's isolation");
  const snaps = JSON.parse(readFileSync(path.join(out, "snaps.json"), "utf8")).snapshots;
  assert.deepEqual(snaps.map((s) => s.snapshot_id), [fork.snapshot_id], "the tree sees its own snapshot");
  for (const [i, s] of fork.sandboxes.entries()) {
    assert.equal(await sh("tree", s.sandbox_id, "cat /workspace/s.txt"), "from-src\n");
    await sh("tree", s.sandbox_id, `echo ${i} > /workspace/own.txt`);
  }
  for (const [i, s] of fork.sandboxes.entries()) {
    assert.equal(await sh("tree", s.sandbox_id, "cat /workspace/own.txt"), `${i}\n`, "a workspace of its own");
  }
  // the host sees the tree's snapshot too; destroying the root ends its children
  assert.ok((await ok("tree", "sandbox_snapshots", {})).snapshots.some((s) => s.snapshot_id === fork.snapshot_id));
  await ok("tree", "sandbox_destroy", { sandbox_id: root.sandbox_id });
  await ok("tree", "sandbox_destroy", { sandbox_id: other.sandbox_id });
  await ok("tree", "sandbox_snapshot_delete", { snapshot_id: fork.snapshot_id });
});

test("nothing is left behind: no snapshot image and no container of these servers", async () => {
  for (const c of Object.keys(ENVS)) {
    assert.deepEqual((await imagesOf(c)).map((i) => i.RepoTags), [], `${c}: images`);
    assert.deepEqual((await containersOf(c)).map((x) => x.Names), [], `${c}: containers`);
  }
});
