// No root on the host: against a real engine (DEMESNE_ENGINE), what a process that is root
// in a sandbox leaves in /out. Where the engine gives sandboxes a user namespace (Docker's
// userns-remap, rootless Podman, rootful Podman from 4.4; `demesne doctor` says which),
// a file root writes in /out belongs to an unprivileged uid on the host, a setuid-root
// binary planted there is not root when the host runs it, and uploads, downloads, execs
// and the host's own reading and removing of the output folder still work. Where the
// engine gives none, the test checks that doctor says so and that such a file is indeed
// root's, as docs/explanation/trust-boundary.md states. tests/run runs this file on each
// engine and on a Docker with userns-remap (tests/setup-host starts one).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { chmodSync, existsSync, lstatSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, connect, engineContainers, isReady, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-userns-"));
chmodSync(work, 0o755); // the planted binary is run as nobody, who must reach it
const inputs = path.join(work, "in");
execFileSync("mkdir", ["-p", inputs]);
// Under userns-remap, gVisor's gofer opens the mounts as the remapped root, which must pass
// through the output and state folders: they are made 0755 here (demesne makes them 0700 when
// it creates them; under a user namespace nothing a sandbox leaves there is root's). See
// docs/explanation/trust-boundary.md, "gVisor: a second wall".
execFileSync("mkdir", ["-m", "755", "-p", path.join(work, "out"), path.join(work, "state")]);
writeFileSync(path.join(inputs, "data.txt"), "from the host\n");
const env = (extra = {}) => ({ DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"), DEMESNE_ALLOWED_PATHS: inputs, ...extra });

// doctor's userns line: "on: …" or "not available: …" / "off …"
// (doctor exits 1 here for the folders opened above; its lines are what is read)
const doctor = spawnSync(BIN, ["doctor"], { env: serverEnv(env()), encoding: "utf8" }).stdout.split("\n")
  .find((l) => /^\S+\s+userns\s/.test(l)) ?? "";
const ON = /^ok\s+userns\s+on: /.test(doctor);
const GVISOR = existsSync("/usr/bin/runsc") && !ENGINE.includes("podman"); // Podman's gVisor is another service
let conn;

before(async () => { conn = await connect({ fixtures: false, env: env() }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const containers = () => engineContainers(ENGINE);

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function ok(name, args, c = conn) {
  const res = await c.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}
const PLANT = "id -u > /out/uid.txt; touch /out/by-root; mkdir /out/dir; cp /usr/bin/id /out/suid-id; "
  + "chown 0:0 /out/suid-id; chmod 4755 /out/suid-id";
// What the host sees of a planted setuid binary: its owner, its setuid bit, and the
// effective uid it gives when nobody runs it.
function planted(out) {
  const st = lstatSync(path.join(out, "suid-id"));
  const euid = execFileSync("setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", path.join(out, "suid-id"), "-u"],
    { encoding: "utf8" }).trim();
  return { owner: st.uid, setuid: (st.mode & 0o4000) !== 0, euid: Number(euid) };
}

test(`doctor says which user-namespace mode is in effect (${ENGINE})`, () => {
  assert.match(doctor, /^ok\s+userns\s+(on|not available|off)/, doctor);
});

test("root in the sandbox writes /out: the host sees an unprivileged owner, and a planted setuid binary is not root",
  async () => {
    const r = await ok("sandbox_script", { image: "base", command: PLANT, isolation: "container" });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(readFileSync(path.join(r.output_dir, "uid.txt"), "utf8"), "0\n", "root inside the sandbox");
    const owner = lstatSync(path.join(r.output_dir, "by-root")).uid;
    const p = planted(r.output_dir);
    assert.equal(p.setuid, true, "the setuid bit is there");
    if (ON) {
      assert.ok(owner >= 1000, `a file root wrote is owned by uid ${owner} on the host, not a system user`);
      assert.equal(p.owner, owner, "the planted binary belongs to the same unprivileged uid");
      assert.equal(p.euid, owner, "run by nobody on the host it gives that uid, not root");
    } else {
      // the documented state without a user namespace: root's file is root's on the host
      assert.equal(owner, 0, doctor);
      assert.equal(p.euid, 0, "without a user namespace a planted setuid-root binary is root on the host (trust-boundary.md)");
    }
    rmSync(r.output_dir, { recursive: true }); // the host user can remove what the sandbox wrote
    assert.equal(existsSync(r.output_dir), false);
  });

test("a warm sandbox from the pool is mapped as a fresh one: root's files and a planted setuid binary are not root's",
  async () => {
    const state = path.join(work, "state-pool");
    execFileSync("mkdir", ["-m", "755", "-p", state]);
    const c = await connect({ fixtures: false, env: env({ DEMESNE_STATE_DIR: state, DEMESNE_POOL_IMAGES: "base",
      DEMESNE_POOL_SIZE: "1" }) });
    try {
      let warm = [];
      for (let i = 0; i < 240 && warm.length === 0; i++) {
        warm = (await containers()).filter((x) => isReady(x) && x.State === "running"
          && (x.Labels["io.demesne.run_dir"] || "").startsWith(state));
        if (warm.length === 0) await new Promise((r) => setTimeout(r, 250));
      }
      assert.equal(warm.length, 1, "a warm sandbox");
      const r = await ok("sandbox_script", { image: "base", command: PLANT, isolation: "container" }, c);
      assert.equal(r.run_id, warm[0].Labels["io.demesne.run_id"], "the call took the warm sandbox");
      assert.equal(readFileSync(path.join(r.output_dir, "uid.txt"), "utf8"), "0\n", "root inside the sandbox");
      const owner = lstatSync(path.join(r.output_dir, "by-root")).uid;
      const p = planted(r.output_dir);
      if (ON) {
        assert.ok(owner >= 1000, `a file root wrote is owned by uid ${owner} on the host, not a system user`);
        assert.equal(p.euid, owner, "run by nobody on the host the planted binary gives that uid, not root");
      } else {
        assert.equal(owner, 0, doctor);
      }
    } finally {
      await c.client.close();
    }
  });

test("with the mapping, host inputs, uploads, downloads and execs still work", { skip: !ON && "no user namespace here" },
  async () => {
    const sb = await ok("sandbox_create", { image: "base", directories: [inputs] });
    try {
      const e1 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /in/in/data.txt; echo made > /out/made.txt; id -u" });
      assert.equal(e1.stdout, "from the host\n0\n", e1.stderr);
      writeFileSync(path.join(inputs, "up.txt"), "uploaded\n");
      await ok("sandbox_upload", { sandbox_id: sb.sandbox_id, src: path.join(inputs, "up.txt"), dst: "/tmp/up.txt" });
      const e2 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "cat /tmp/up.txt; cp /tmp/up.txt /out/copied.txt" });
      assert.equal(e2.stdout, "uploaded\n", e2.stderr);
      const d = await ok("sandbox_download", { sandbox_id: sb.sandbox_id, src: "/out/made.txt" });
      assert.equal(readFileSync(d.path, "utf8"), "made\n", "downloaded");
      assert.equal(readFileSync(path.join(sb.output_dir, "copied.txt"), "utf8"), "uploaded\n", "the host reads /out");
      assert.notEqual(lstatSync(path.join(sb.output_dir, "made.txt")).uid, 0, "written by the mapped root");
    } finally {
      await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
    }
  });

test("userns = false turns the mapping off", { skip: !ON && "no user namespace here" }, async () => {
  const c = await connect({ fixtures: false, env: env({ DEMESNE_USERNS: "false" }) });
  try {
    const r = await ok("sandbox_script", { image: "base", command: "touch /out/by-root" }, c);
    assert.equal(lstatSync(path.join(r.output_dir, "by-root")).uid, 0, "root's file is root's on the host");
  } finally {
    await c.client.close();
  }
});

test("a gVisor sandbox gets the mapping too", { skip: !(ON && GVISOR) && "no user namespace or no gVisor runtime here" },
  async () => {
    const r = await ok("sandbox_script", { image: "base", command: PLANT + "; dmesg | head -n 1", isolation: "gvisor" });
    assert.match(r.stdout, /Starting gVisor/, r.stderr);
    const p = planted(r.output_dir);
    assert.ok(p.owner >= 1000, `owned by uid ${p.owner} on the host`);
    assert.equal(p.euid, p.owner, "not root when the host runs it");
  });
