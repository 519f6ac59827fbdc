// isolation "gvisor" against a real engine (DEMESNE_ENGINE; tests/run runs this once per
// engine, with DEMESNE_GVISOR_ENGINE naming Podman's gVisor service): the kernel inside is
// gVisor's, the relay reaches the host, the process and memory limits hold, and a call that
// asks for gVisor where the engine has none fails instead of running without it. Where
// runsc is not installed the file is skipped. The sandbox, egress, jobs and agent suites
// also run under gVisor (tests/run: DEMESNE_TEST_ISOLATION=gvisor, a representative subset).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, isReady } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const PODMAN = ENGINE.includes("podman");
const RUNSC = existsSync("/usr/bin/runsc");
const skip = RUNSC ? false : "runsc is not installed (tests/setup-host installs it)";
const work = mkdtempSync(path.join(tmpdir(), "demesne-gvisor-"));
let conn;

function env(extra = {}) {
  return { DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
    DEMESNE_STATE_DIR: path.join(work, "state"), ...extra };
}

before(async () => { if (RUNSC) conn = await connect({ fixtures: false, env: env() }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function call(c, name, args) { return c.client.callTool({ name, arguments: args }, undefined, LONG); }
async function ok(name, args, c = conn) {
  const res = await call(c, name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
async function refused(name, args, c = conn) {
  const res = await call(c, name, args);
  assert.equal(res.isError, true, `${name} should have been refused`);
  return res.content[0].text;
}
const containers = () => engineContainers(ENGINE);
const gvisor = (command, extra = {}) => ok("sandbox_script", { image: "base", isolation: "gvisor", command, ...extra });

test("isolation gvisor: the kernel inside is gVisor's, in a one-shot run and in a persistent sandbox", { skip }, async () => {
  const r = await gvisor("dmesg | head -n 1; uname -r");
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.stdout, /^\[ *[0-9.]+\] Starting gVisor\.\.\.\n/, "gVisor's kernel log");
  const plain = await ok("sandbox_script", { image: "base", isolation: "container", command: "dmesg | head -n 1; uname -r" });
  assert.doesNotMatch(plain.stdout + plain.stderr, /gVisor/, "a plain container is on the host's kernel");
  assert.notEqual(plain.stdout.trim().split("\n").at(-1), r.stdout.trim().split("\n").at(-1), "another kernel release");
  const sb = await ok("sandbox_create", { image: "base", isolation: "gvisor" });
  try {
    const e = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "dmesg | head -n 1" });
    assert.match(e.stdout, /Starting gVisor/, "an exec runs on gVisor too");
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("the relay reaches the host from inside gVisor: the proxy answers and logs the request", { skip }, async () => {
  // egress none: the proxy refuses every name; its 403 comes back through the relay
  const r = await gvisor("curl -s -o /dev/null -w '%{http_code}' -x http://127.0.0.1:3128 http://denied.test/x", { egress: "none" });
  assert.equal(r.stdout, "403", r.stderr);
  const log = readFileSync(path.join(r.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
  assert.deepEqual(log.map((l) => [l.host, l.verdict]), [["denied.test", "deny"]]);
});

test("the process limit holds inside gVisor: a fork beyond it fails and the sandbox goes on", { skip }, async () => {
  const r = await gvisor(`perl -e 'my $n = 0; for (1..500) { my $p = fork(); last unless defined $p; `
    + `if (!$p) { sleep 5; exit 0 } $n++ } print "forked=$n\\n"'; echo alive`,
  { limits: { pids: 64 } });
  assert.equal(r.exit_code, 0, r.stderr);
  const n = Number(/forked=(\d+)/.exec(r.stdout)?.[1]);
  assert.ok(n > 20 && n < 64, `forks stop below the limit of 64: ${r.stdout}`);
  assert.match(r.stdout, /alive\n$/, "the sandbox lived on");
});

test("over its memory limit the whole gVisor sandbox ends, and the result says so", { skip }, async () => {
  const r = await gvisor(`perl -e '$x = "a" x (400 * 1024 * 1024); print length($x), "\\n"'`, { limits: { memory_mb: 128 } });
  assert.equal(r.exit_code, 137, JSON.stringify(r));
  assert.match(r.oom_killed ?? "", /most likely for passing its memory limit of 128 MiB: under gVisor the whole sandbox ends/);
});

test("open egress cannot be given under gVisor, and says so", { skip }, async () => {
  const msg = await refused("sandbox_script", { image: "base", isolation: "gvisor", egress: "open", command: "true" });
  assert.match(msg, /^isolation: gvisor sandboxes have no network but loopback/);
});

test("gVisor where the engine has none is refused with how to offer it, never run without it", { skip }, async () => {
  // Docker: a runtime name nobody registered; Podman: no gVisor service configured
  const c = await connect({ fixtures: false, env: env(PODMAN ? { DEMESNE_GVISOR_ENGINE: "" }
    : { DEMESNE_GVISOR_RUNTIME: "no-such-runtime" }) });
  try {
    const msg = await refused("sandbox_script", { image: "base", isolation: "gvisor", command: "touch /out/ran" }, c);
    assert.match(msg, PODMAN ? /^isolation: gvisor is not available on this engine: Podman's API cannot choose a runtime per container.*; to offer it: /
      : /^isolation: gvisor is not available on this engine: Docker has no runtime named no-such-runtime .*; to offer it: /, msg);
    const c2 = await connect({ fixtures: false, env: env({ DEMESNE_ISOLATION: "gvisor", ...(PODMAN ? { DEMESNE_GVISOR_ENGINE: "" }
      : { DEMESNE_GVISOR_RUNTIME: "no-such-runtime" }) }) });
    try {
      const msg2 = await refused("sandbox_create", { image: "base" }, c2);
      assert.match(msg2, /^isolation_default \(configuration\): gvisor is not available on this engine/);
    } finally {
      await c2.client.close();
    }
  } finally {
    await c.client.close();
  }
});

test("isolation_default gvisor: a call that names none runs on gVisor; one may still ask for a container", { skip }, async () => {
  const c = await connect({ fixtures: false, env: env({ DEMESNE_ISOLATION: "gvisor" }) });
  try {
    const r = await ok("sandbox_script", { image: "base", command: "dmesg | head -n 1" }, c);
    assert.match(r.stdout, /Starting gVisor/);
    const p = await ok("sandbox_script", { image: "base", isolation: "container", command: "dmesg 2>&1 | head -n 1" }, c);
    assert.doesNotMatch(p.stdout, /gVisor/);
  } finally {
    await c.client.close();
  }
});

test("the warm pool holds gVisor sandboxes too: a call takes one, on gVisor's kernel, fresh, its command through the exec API", { skip }, async () => {
  const state = path.join(work, "state-pool");
  const c = await connect({ fixtures: false, env: env({ DEMESNE_STATE_DIR: state, DEMESNE_POOL_IMAGES: "base",
    DEMESNE_POOL_SIZE: "1", DEMESNE_ISOLATION: "gvisor" }) });
  try {
    // the warm gVisor sandbox the server filled at start (isolation_default gvisor)
    let warm = [];
    for (let i = 0; i < 240 && warm.length === 0; i++) {
      warm = (await containers()).filter((x) => isReady(x) && x.State === "running"
        && x.Labels["io.demesne.isolation"] === "gvisor" && (x.Labels["io.demesne.run_dir"] || "").startsWith(state));
      if (warm.length === 0) await new Promise((r) => setTimeout(r, 250));
    }
    assert.equal(warm.length, 1, "one warm gVisor sandbox");
    const id = warm[0].Labels["io.demesne.run_id"];
    const r = await ok("sandbox_script", { image: "base", isolation: "gvisor", env: { CALLER: "mine" },
      command: "dmesg | head -n 1; echo \"caller=$CALLER\"; ls -A /tmp | wc -l; echo made > /out/made.txt; echo; "
        + "curl -s -o /dev/null -w '%{http_code}\\n' http://blocked.invalid/; exit 3" }, c);
    assert.equal(r.run_id, id, "the call ran in the warm gVisor sandbox");
    assert.equal(r.exit_code, 3, r.stderr);
    const lines = r.stdout.split("\n");
    assert.equal(lines.length, 6, r.stdout);
    assert.match(lines[0], /Starting gVisor/, "on gVisor's kernel");
    assert.equal(lines[1], "caller=mine", "the caller's environment reached the command");
    assert.equal(lines[2], "0", "/tmp is empty");
    assert.equal(readFileSync(path.join(r.output_dir, "made.txt"), "utf8"), "made\n", "its /out is the call's output folder");
    assert.equal(r.output_dir, path.join(work, "out", id), "the warm sandbox's own output folder");
    assert.equal(lines[4], "403", "its egress proxy answers (and refuses a host the policy does not allow)");
    assert.equal(readFileSync(path.join(r.output_dir, "stdout.log"), "utf8"), r.stdout);
    let still = true;
    for (let i = 0; i < 120 && still; i++) {
      still = (await containers()).some((x) => x.Labels["io.demesne.run_id"] === id);
      if (still) await new Promise((res) => setTimeout(res, 250));
    }
    assert.equal(still, false, "used once: its container goes after the answer");
  } finally {
    await c.client.close();
  }
  const left = (await containers()).filter((x) => (x.Labels["io.demesne.run_dir"] || "").startsWith(state));
  assert.deepEqual(left.map((x) => x.Names), [], "a graceful stop removes the warm gVisor sandboxes");
});
