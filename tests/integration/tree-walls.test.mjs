// A child is never more privileged than its parent (issue 23), on a real engine
// (DEMESNE_ENGINE; run the file once per engine). Each child is spawned from inside a
// sandbox made with mcp: true, by a script calling the in-sandbox endpoint
// (tests/fixtures/tree/mcp-client.py), as a hostile agent would:
//  - a gVisor parent's children run on gVisor when they name no isolation, and asking for
//    a plain container is refused (on Podman this needs DEMESNE_GVISOR_ENGINE, as tests/run sets);
//  - a child's cgroup holds its parent's memory and process limits, and asking for more
//    than the parent has is refused naming the limit;
//  - the tree's totals (tree.memory_mb) refuse a child that would not fit;
//  - an image only the engine's store holds (tagged here, removed after) is refused from
//    inside while the host may still use it, and a demesne image not built yet is not built
//    from inside.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { connect, engineContainers, engineRequest, isWarm, ROOT } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const PODMAN = ENGINE.includes("podman");
const GVISOR_ENGINE = process.env.DEMESNE_GVISOR_ENGINE || "";
const gvisorSkip = !existsSync("/usr/bin/runsc") ? "runsc is not installed (tests/setup-host installs it)"
  : PODMAN && !GVISOR_ENGINE ? "Podman offers gVisor only with DEMESNE_GVISOR_ENGINE (tests/run sets it)" : false;
const FIX = path.join(ROOT, "tests/fixtures/tree");
const work = mkdtempSync(path.join(tmpdir(), "demesne-tree-walls-"));
const xdg = path.join(work, "xdg");
const suffix = `${process.pid}-${Date.now().toString(36)}`;
// a user image that is never built: from inside, naming it must not start its build
const UNBUILT = `walls-unbuilt-${suffix}`;
mkdirSync(path.join(xdg, "demesne", "images", UNBUILT), { recursive: true });
writeFileSync(path.join(xdg, "demesne", "images", UNBUILT, "Containerfile"), `FROM base\nLABEL walls.test="${suffix}"\n`);
const SECRET_REPO = "localhost/demesne-walls-secret";
const SECRET = `${SECRET_REPO}:${suffix}`;

const env = {
  DEMESNE_ENGINE: ENGINE, XDG_CONFIG_HOME: xdg,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_ALLOWED_PATHS: FIX, DEMESNE_TREE_WAIT_SECONDS: "2",
  ...(GVISOR_ENGINE ? { DEMESNE_GVISOR_ENGINE: GVISOR_ENGINE } : {}),
};
// An engine request whose answer is not JSON (POST …/tag answers "201 Created" with no body): its status.
function engineStatus(method, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: ENGINE.replace(/^unix:\/\//, ""), path: p, method }, (res) => {
      res.resume();
      res.on("end", () => resolve(res.statusCode));
    });
    req.on("error", reject);
    req.end();
  });
}
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };

let conn;
let tagged = false;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  if (tagged) await engineStatus("DELETE", `/images/${encodeURIComponent(SECRET)}`).catch(() => {});
  // a build from inside (the bug this file checks) leaves the user image: it goes too
  const filters = encodeURIComponent(JSON.stringify({ label: [`io.demesne.image=${UNBUILT}`] }));
  for (const img of (await engineRequest(ENGINE, "GET", `/images/json?filters=${filters}`).catch(() => [])) || []) {
    await engineStatus("DELETE", `/images/${encodeURIComponent(img.Id)}?force=true`).catch(() => {});
  }
  rmSync(work, { recursive: true, force: true });
});

async function call(name, args) { return conn.client.callTool({ name, arguments: args }, undefined, LONG); }
async function ok(name, args) {
  const res = await call(name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}

// A root sandbox with the endpoint, the MCP client at /in/tree; `fn(root)` runs, then it goes.
async function withRoot(args, fn) {
  const root = await ok("sandbox_create", { image: "default", egress: "none", mcp: true, directories: [FIX], ...args });
  try {
    return await fn(root);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: root.sandbox_id });
  }
}

// Runs the child calls `calls` ([[key, tool, args]]) one after another inside `root` through
// its endpoint; returns {key: {rc, out, err}} as the sandbox saw them.
async function spawnInside(root, calls) {
  const lines = ["set +e", "c() { python3 /in/tree/mcp-client.py \"$2\" \"$3\" > /out/$1.out 2> /out/$1.err; echo $? > /out/$1.rc; }"];
  for (const [key, tool, args] of calls) lines.push(`c ${key} ${tool} '${JSON.stringify(args)}'`);
  const r = await ok("sandbox_exec", { sandbox_id: root.sandbox_id, command: lines.join("\n"), timeout_seconds: 400 });
  assert.equal(r.exit_code, 0, r.stderr);
  const out = {};
  for (const [key] of calls) {
    const f = (ext) => readFileSync(path.join(root.output_dir, `${key}.${ext}`), "utf8");
    out[key] = { rc: Number(f("rc")), out: f("out"), err: f("err") };
  }
  return out;
}
const result = (x) => {
  assert.equal(x.rc, 0, `the child call failed: ${x.err}`);
  return JSON.parse(x.out);
};

test("a gVisor parent's children run on gVisor; asking for a plain container is refused", { skip: gvisorSkip }, async () => {
  await withRoot({ isolation: "gvisor" }, async (root) => {
    const r = await spawnInside(root, [
      ["none", "sandbox_script", { name: "names-none", image: "base", command: "dmesg | head -n 1" }],
      ["weaker", "sandbox_script", { name: "weaker", image: "base", isolation: "container", command: "dmesg | head -n 1" }],
    ]);
    const child = result(r.none);
    assert.equal(child.exit_code, 0, child.stderr);
    assert.match(child.stdout, /^\[ *[0-9.]+\] Starting gVisor\.\.\.\n/, "the child's kernel is gVisor's");
    assert.equal(r.weaker.rc, 2, "an isError result");
    assert.match(r.weaker.err, /^isolation: "container" is weaker than this sandbox's own isolation \(gvisor\); a child runs on gvisor/);
    assert.equal(existsSync(path.join(root.output_dir, "child/weaker")), false, "refused before anything was made");
  });
});

// The cgroup limits a sandbox sees of itself: cgroup v2 files, or v1 (a hybrid host).
const CGROUP = "echo mem=$(cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes) "
  + "pids=$(cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max)";

test("a child's cgroup holds its parent's limits; asking for more is refused naming the limit", async () => {
  await withRoot({ limits: { memory_mb: 256, pids: 64 } }, async (root) => {
    const r = await spawnInside(root, [
      ["inherits", "sandbox_script", { name: "inherits", image: "base", command: CGROUP }],
      ["smaller", "sandbox_script", { name: "smaller", image: "base", limits: { memory_mb: 128 }, command: CGROUP }],
      ["memory", "sandbox_script", { name: "more-memory", image: "base", limits: { memory_mb: 512 }, command: "true" }],
      ["pids", "sandbox_create", { name: "more-pids", image: "base", limits: { pids: 30000 } }],
    ]);
    assert.equal(result(r.inherits).stdout.trim(), `mem=${256 * 1024 * 1024} pids=64`, "the parent's limits");
    assert.equal(result(r.smaller).stdout.trim(), `mem=${128 * 1024 * 1024} pids=64`, "less may be asked for");
    assert.equal(r.memory.rc, 2);
    assert.match(r.memory.err, /^limits\.memory_mb: 512 is more than this sandbox's own limit of 256 \(the parent's\); a child may have at most 256/);
    assert.equal(r.pids.rc, 2);
    assert.match(r.pids.err, /^limits\.pids: 30000 is more than this sandbox's own limit of 64 \(the parent's\)/);
  });
});

test("the tree's totals: a child that would not fit beside what the tree runs is refused", async () => {
  await withRoot({ limits: { memory_mb: 256 }, tree: { memory_mb: 384 } }, async (root) => {
    const r = await spawnInside(root, [
      ["big", "sandbox_script", { name: "big", image: "base", command: "true" }],
      ["bg", "sandbox_script", { name: "bg", image: "base", background: true, limits: { memory_mb: 128 }, command: "sleep 120" }],
      ["late", "sandbox_script", { name: "late", image: "base", limits: { memory_mb: 64 }, command: "true" }],
    ]);
    assert.equal(r.big.rc, 2, "a child of the parent's own size does not fit beside it");
    assert.match(r.big.err, /^limits\.memory_mb: this sandbox and those above it, which run as long as this call, hold 256 of its 384 MB \(tree\.memory_mb: the root's limits x tree\.running unless the host's call set it\), so a child of 256 does not fit/);
    const bg = result(r.bg);
    assert.equal(bg.status, "running");
    assert.equal(r.late.rc, 2, "the tree's running sandboxes hold all of it");
    assert.match(r.late.err, /^limits\.memory_mb: this tree's running sandboxes already hold 384 of its 384 MB .*so a child of 64 does not fit; waited 2 s/);
  });
});

test("from inside, an image only the engine holds is refused (the host may use it) and an unbuilt one is not built", async () => {
  const base = (await engineRequest(ENGINE, "GET", `/images/json?filters=${encodeURIComponent(JSON.stringify({ label: ["io.demesne.image=base"] }))}`)) || [];
  assert.ok(base.length > 0, "the base image is built");
  tagged = true;
  const st = await engineStatus("POST", `/images/${encodeURIComponent(base[0].Id)}/tag?repo=${encodeURIComponent(SECRET_REPO)}&tag=${suffix}`);
  assert.equal(st, 201, "tagged");
  const host = await ok("sandbox_script", { image: SECRET, command: "echo host-ok" });
  assert.equal(host.stdout, "host-ok\n", "the host may name any image its engine holds");
  await withRoot({}, async (root) => {
    const r = await spawnInside(root, [
      ["secret", "sandbox_script", { name: "secret", image: SECRET, command: "echo leaked > /workspace/leak" }],
      ["unbuilt", "sandbox_script", { name: "unbuilt", image: UNBUILT, command: "true" }],
      ["builtin", "sandbox_script", { name: "builtin", image: "base", command: "echo fine" }],
    ]);
    assert.equal(r.secret.rc, 2);
    assert.match(r.secret.err, new RegExp(`^image: "${SECRET}" is not an image a sandbox may start: from inside a sandbox only demesne's images \\(.*\\bbase\\b.*${UNBUILT}.*\\) and those the configuration lists in child_images may be named`));
    assert.equal(r.unbuilt.rc, 2);
    assert.match(r.unbuilt.err, new RegExp(`^image: "${UNBUILT}" is not built yet, and a sandbox may not start its build .*\`demesne images build ${UNBUILT}\``));
    assert.equal(result(r.builtin).stdout, "fine\n", "a built demesne image is fine");
  });
  const built = (await engineRequest(ENGINE, "GET", `/images/json?filters=${encodeURIComponent(JSON.stringify({ label: [`io.demesne.image=${UNBUILT}`] }))}`)) || [];
  assert.deepEqual(built, [], "nothing was built");
});

test("nothing is left behind", async () => {
  const left = (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(work) && !isWarm(c));
  assert.deepEqual(left.map((c) => c.Names), []);
});
