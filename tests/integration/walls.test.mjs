// The walls between a sandbox and the host, each checked from inside a sandbox on a real
// engine (DEMESNE_ENGINE), in the default set-up (isolation container). One test per row of
// the table in docs/explanation/trust-boundary.md; the user namespace and gVisor rows are
// tests/integration/userns.test.mjs and gvisor.test.mjs, the proxy's judgement egress.test.mjs.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-walls-"));
const inputs = path.join(work, "in");
mkdirSync(inputs);
writeFileSync(path.join(inputs, "data.txt"), "input\n");
const secret = path.join(work, "host-only.txt");
writeFileSync(secret, "host only\n");
let conn;

before(async () => {
  conn = await connect({ fixtures: false, env: { DEMESNE_ENGINE: ENGINE, DEMESNE_ALLOWED_PATHS: inputs,
    DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state") } });
});
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

async function sh(command, extra = {}) {
  const res = await conn.client.callTool({ name: "sandbox_script", arguments: { image: "base", isolation: "container",
    command, ...extra } }, undefined, { timeout: 600_000 });
  assert.ok(!res.isError, res.content?.[0]?.text);
  return res.structuredContent;
}
const field = (status, name) => new RegExp(`^${name}:\\s*(\\S+)`, "m").exec(status)?.[1];

test("namespaces: the sandbox sees its own processes, host name and files, not the host's", async () => {
  const r = await sh(`tr '\\0' ' ' < /proc/1/cmdline; echo; ls -d /proc/[0-9]* | wc -l; hostname; `
    + `(kill -0 ${process.pid}) 2>&1; test -e ${secret} && echo host-file-visible || echo no-host-file`);
  const [init, procs, host, kill, file] = r.stdout.split("\n").filter(Boolean);
  assert.match(init, /^\/\.demesne\/init (run|wait) /, "PID 1 is the sandbox's own demesne-init");
  assert.ok(Number(procs) < 10, `only the sandbox's processes (${procs})`);
  assert.equal(host, "sandbox");
  assert.match(kill, /No such process/, "the test runner's pid does not exist in there");
  assert.equal(file, "no-host-file", "a host file outside the mounts is not there");
});

test("seccomp: the engine's filter is on", async () => {
  const r = await sh("cat /proc/self/status");
  assert.equal(field(r.stdout, "Seccomp"), "2", "filter mode");
});

test("capabilities: no raw sockets, no mounts; no_new_privileges is set", async () => {
  const r = await sh(`grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; `
    + `perl -e 'socket(S, 2, 3, 1) or die "raw: $!\\n"'; mount -t tmpfs none /mnt 2>/dev/null || echo mount-refused`);
  const eff = BigInt(`0x${field(r.stdout, "CapEff")}`);
  for (const [name, bit] of [["NET_RAW", 13n], ["SYS_ADMIN", 21n], ["SYS_MODULE", 16n], ["SYS_PTRACE", 19n], ["NET_ADMIN", 12n]]) {
    assert.equal((eff >> bit) & 1n, 0n, `no CAP_${name} (CapEff ${eff.toString(16)})`);
  }
  assert.equal(field(r.stdout, "NoNewPrivs"), "1", "setuid binaries cannot gain privileges");
  assert.match(r.stderr, /raw: Operation not permitted/);
  assert.match(r.stdout, /mount-refused/);
});

test("read-only mounts: host inputs, the root filesystem and demesne-init cannot be changed", async () => {
  // demesne-init is running, so writing it says "Text file busy" first: its mount flags tell
  const r = await sh("for p in /in/in/data.txt /etc/x; do touch $p 2>&1 | grep -o 'Read-only file system' || echo $p-writable; done; "
    + "awk '$5 == \"/.demesne/init\" || $5 == \"/in/in\" { split($6, o, \",\"); print $5, o[1] }' /proc/self/mountinfo; "
    + "touch /out/x /tmp/x && echo out-and-tmp-writable", { directories: [inputs] });
  const lines = r.stdout.split("\n");
  // the mount table's order is the engine's
  assert.deepEqual([...lines.slice(0, 2), ...lines.slice(2, 4).sort(), ...lines.slice(4)],
    ["Read-only file system", "Read-only file system", "/.demesne/init ro", "/in/in ro", "out-and-tmp-writable", ""]);
  assert.equal(readFileSync(path.join(inputs, "data.txt"), "utf8"), "input\n");
});

test("no network interface but loopback: nothing leaves except through the host's proxy", async () => {
  const r = await sh(`awk -F: 'NR > 2 { gsub(/ /, "", $1); print $1 }' /proc/net/dev; `
    + `curl -s --noproxy '*' --max-time 5 http://10.255.255.1/ 2>&1; echo direct=$?; echo $HTTPS_PROXY`, { egress: "none" });
  const lines = r.stdout.trim().split("\n");
  assert.equal(lines[0], "lo", "only loopback");
  assert.equal(lines.length, 3, r.stdout);
  assert.match(lines[1], /^direct=(7|28)$/, "a direct connection has no route");
  assert.equal(lines[2], "http://127.0.0.1:3128", "the proxy relayed to the host");
});
