// Rootless Podman as demesne's engine (issue 17, "no root on the host"), run by tests/rootless/run
// as the unprivileged user whose Podman service DEMESNE_ENGINE names (tests/setup-host makes
// both). Skipped when the server is root: the point is a server and an engine without root.
//
// What a user of rootless Podman sees:
//  - where the engine would not enforce memory, process and CPU limits (rootless Podman on
//    cgroup v1 ignores them with a warning of its own), `demesne doctor` says so with the fix
//    and a call is refused with the same reason: never a sandbox that silently has no limits;
//    where it would (cgroup v2 with the controllers delegated), both pass;
//  - with enforce_limits = false (or limits enforced), sandboxes run: uid 0 inside is the
//    user's own uid on the host, so a file root makes in /out is the user's and a setuid-root
//    program planted there is setuid to the user, not to root; one-shot scripts, persistent
//    sandboxes with exec, upload and download, and the egress proxy all work;
//  - nothing is left on the engine.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { execFile } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const ROOT = process.getuid() === 0;
const skip = ROOT ? "run as the rootless engine's user (tests/rootless/run)" : !ENGINE ? "DEMESNE_ENGINE is not set" : false;
const LONG = { timeout: 300_000, resetTimeoutOnProgress: true, onprogress: () => {} };
let work;
let env;

function engineGet(p) {
  return new Promise((resolve, reject) => {
    http.get({ socketPath: SOCKET, path: p }, (res) => {
      let data = "";
      res.on("data", (c) => (data += c));
      res.on("end", () => resolve({ status: res.statusCode, body: data ? JSON.parse(data) : null }));
    }).on("error", reject);
  });
}
// What the engine says of itself: whether it is rootless and which cgroup controllers it can use.
async function engineHost() {
  return (await engineGet("/v4.0.0/libpod/info")).body.host;
}
const enforces = (host) => ["memory", "pids", "cpu"].every((c) => (host.cgroupControllers || []).includes(c));
async function ours() {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
  return (await engineGet(`/containers/json?all=true&filters=${filters}`)).body
    .filter((c) => (c.Labels["io.demesne.run_dir"] || "").startsWith(work));
}
function doctor(extra) {
  return new Promise((resolve) => {
    execFile(BIN, ["doctor"], { env: { ...process.env, ...env, ...extra } }, (err, stdout) => resolve({ code: err ? err.code : 0, stdout }));
  });
}
async function call(c, name, args) {
  return c.client.callTool({ name, arguments: args }, undefined, LONG);
}
async function ok(c, name, args) {
  const r = await call(c, name, args);
  assert.ok(!r.isError, `${name}: ${r.content?.[0]?.text}`);
  return r.structuredContent;
}

before(() => {
  if (skip) return;
  work = mkdtempSync(path.join(tmpdir(), "demesne-rootless-"));
  mkdirSync(path.join(work, "allowed"));
  env = { DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_ALLOWED_PATHS: path.join(work, "allowed"), DEMESNE_POOL_SIZE: "0", DEMESNE_NO_PULL: "1" };
});
after(() => { if (work) rmSync(work, { recursive: true, force: true }); });

test("the engine is rootless Podman, and the server runs without root", { skip }, async () => {
  const host = await engineHost();
  assert.equal(host.security.rootless, true, "Podman says it runs rootless");
  assert.notEqual(process.getuid(), 0);
});

test("limits: doctor and a call say whether the engine enforces them, and nothing runs without them unasked", { skip }, async () => {
  const host = await engineHost();
  const d = await doctor({});
  const line = d.stdout.split("\n").find((l) => /^\S+\s+limits\s/.test(l)) ?? "";
  const c = await connect({ env, fixtures: false });
  try {
    const r = await call(c, "sandbox_script", { image: "base", command: "echo ran" });
    if (enforces(host)) {
      assert.match(line, /^ok\s+limits\s+memory, process and CPU limits: enforced/, d.stdout);
      assert.ok(!r.isError, r.content?.[0]?.text);
      assert.equal(r.structuredContent.stdout, "ran\n");
    } else {
      const why = host.cgroupVersion === "v1" ? "rootless Podman on cgroup v1 ignores them"
        : "Podman cannot use the cgroup controller(s)";
      assert.match(line, new RegExp(`^FAIL\\s+limits\\s+not enforced: ${why}`), d.stdout);
      assert.match(d.stdout, /fix: run the engine rootful, or give rootless Podman cgroup v2 .* or set enforce_limits = false/);
      assert.equal(d.code, 1, "doctor exits 1");
      assert.equal(r.isError, true, "the call is refused");
      assert.match(r.content[0].text, new RegExp(`^limits: this engine does not enforce memory, process and CPU limits: ${why}, so demesne starts no sandbox on it; .*enforce_limits = false`));
      assert.deepEqual((await ours()).map((x) => x.Names), [], "no container was made");
    }
  } finally {
    await c.client.close();
  }
});

test("root in a rootless sandbox is the user on the host: what it makes in /out is the user's, setuid included", { skip }, async () => {
  const c = await connect({ env: { ...env, DEMESNE_ENFORCE_LIMITS: "false" }, fixtures: false });
  try {
    const r = await ok(c, "sandbox_script", { image: "base",
      command: "id -u; echo made > /out/by-root.txt; cp /bin/sh /out/sh; chmod 4755 /out/sh; stat -c '%u %a' /out/sh" });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, "0\n0 4755\n", "root inside, and inside the file is root's and setuid");
    const me = process.getuid();
    const made = statSync(path.join(r.output_dir, "by-root.txt"));
    assert.equal(made.uid, me, "the host sees the file as the user's");
    assert.equal(readFileSync(path.join(r.output_dir, "by-root.txt"), "utf8"), "made\n");
    const sh = statSync(path.join(r.output_dir, "sh"));
    assert.equal(sh.uid, me, "the setuid program belongs to the user, not to root");
    assert.notEqual(sh.uid, 0);
    assert.equal(sh.mode & 0o4000, 0o4000, "its setuid bit is set: it would run as the user only");
    if (!enforces(await engineHost())) {
      assert.match(c.stderr(), /sandboxes on this engine run WITHOUT memory, process and CPU limits \(enforce_limits = false\)/,
        "the server said once that limits are off");
    }
  } finally {
    await c.client.close();
  }
});

test("a persistent sandbox: exec, upload, download and the egress proxy work rootless", { skip }, async () => {
  const c = await connect({ env: { ...env, DEMESNE_ENFORCE_LIMITS: "false" }, fixtures: false });
  try {
    const sb = await ok(c, "sandbox_create", { image: "base", egress: "none" });
    try {
      writeFileSync(path.join(work, "allowed", "in.txt"), "uploaded\n");
      await ok(c, "sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(work, "allowed", "in.txt"),
        dst: "/workspace/in.txt" });
      const e = await ok(c, "sandbox_exec", { sandbox_id: sb.sandbox_id,
        command: "cat /workspace/in.txt; id -u; curl -s -o /dev/null -w '%{http_code}' http://example.invalid/ || true" });
      assert.equal(e.exit_code, 0, e.stderr);
      assert.equal(e.stdout, "uploaded\n0\n403", "the file, root inside, and the proxy's refusal under egress none");
      await ok(c, "sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo made > /tmp/made.txt" });
      const down = await ok(c, "sandbox_download", { sandbox_id: sb.sandbox_id, src: "/tmp/made.txt" });
      assert.equal(readFileSync(down.path, "utf8"), "made\n");
      assert.equal(statSync(down.path).uid, process.getuid(), "the download is the user's");
    } finally {
      await ok(c, "sandbox_destroy", { sandbox_id: sb.sandbox_id });
    }
  } finally {
    await c.client.close();
  }
});

test("nothing is left on the rootless engine", { skip }, async () => {
  let left = [];
  for (let i = 0; i < 120; i++) {
    left = await ours();
    if (left.length === 0) break;
    await new Promise((r) => setTimeout(r, 250));
  }
  assert.deepEqual(left.map((x) => x.Names), []);
});
