// A second break-it pass (issue 10): attacks from inside real sandboxes, over MCP with the
// official SDK client, against a real engine (DEMESNE_ENGINE; tests/run runs this file once
// per engine). Each test is named after the fault it reproduces and asserts the promise:
// no host file outside the sandbox's own output changes or is read, the server keeps
// answering, nothing is left behind.
//
// The output root is inside the allowed paths here, as it is when DEMESNE_ALLOWED_PATHS
// names a home folder and the output root is the default under it: a caller can then hand
// one sandbox's output to another, which is where the first attack aims.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, readdirSync, rmSync, statSync, chmodSync } from "node:fs";
import http from "node:http";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-breakit-"));
const home = path.join(work, "home"); // the allowed root; the output root lies inside it
const canary = path.join(work, "canary"); // outside the allowed root: must never be read
mkdirSync(home, { recursive: true });
mkdirSync(canary, { recursive: true });
writeFileSync(path.join(canary, "keep.txt"), "CANARY\n");
writeFileSync(path.join(canary, "secret.txt"), "CANARY-FILE\n");
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_ALLOWED_PATHS: home,
  DEMESNE_OUTPUT_ROOT: path.join(home, "demesne", "out"),
  DEMESNE_STATE_DIR: path.join(home, "demesne", "state"),
};

let conn;
const created = [];
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  for (const id of created) await call("sandbox_destroy", { sandbox_id: id }).catch(() => {});
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const call = (name, args) => conn.client.callTool({ name, arguments: args }, undefined, LONG);
async function ok(name, args) {
  const res = await call(name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  if (name === "sandbox_create") created.push(res.structuredContent.sandbox_id);
  return res.structuredContent;
}

// A perl loop (perl-base is in every Debian image) that keeps swapping /out/res (a folder)
// and /out/f.txt (a file) for links to the canary's host paths, until /tmp/stop exists.
// The link stays for 1 ms of every 10: the host's check mostly sees the real entry, and the
// engine's mount, a little later, sometimes the link.
const SWAPPER = `
my %t = ("/out/res" => $ENV{CANARY}, "/out/f.txt" => "$ENV{CANARY}/secret.txt");
until (-e "/tmp/stop") {
  for my $p (keys %t) {
    rename($p, "$p.real");
    symlink($t{$p}, $p);
    select(undef, undef, undef, 0.001);
    unlink($p);
    rename("$p.real", $p);
    select(undef, undef, undef, 0.01);
  }
}
`;

test("a live sandbox that swaps part of its output for a link cannot get a host folder mounted into another sandbox", async () => {
  const a = await ok("sandbox_create", { image: "base", egress: "none" });
  await ok("sandbox_exec", { sandbox_id: a.sandbox_id, env: { CANARY: canary }, command:
    "mkdir -p /out/res && echo mine > /out/res/keep.txt && echo mine > /out/f.txt && "
    + `cat > /tmp/w.pl <<'EOF'\n${SWAPPER}\nEOF\nsetsid perl /tmp/w.pl </dev/null >/dev/null 2>&1 &\nsleep 0.3; echo started` });
  const sub = path.join(a.output_dir, "res");
  const file = path.join(a.output_dir, "f.txt");
  const seen = { running: 0, resolved: 0 };
  for (let i = 0; i < 8; i++) {
    const args = i % 2 === 0
      ? { command: "cat /in/res/keep.txt", directories: [sub] }
      : { command: "cat /in/f.txt", files: [file] };
    const r = await call("sandbox_script", { image: "base", egress: "none", ...args });
    const text = r.content?.[0]?.text || "";
    assert.ok(!text.includes("CANARY"), `attempt ${i}: a host file outside the allowed paths was mounted: ${text}`);
    // refused up front, naming the field and the live sandbox whose output it is (or, when
    // the check itself met the link or the gap the swap leaves, that it leads outside the
    // allowed paths or is missing)
    assert.equal(r.isError, true, `attempt ${i}: a path inside a live sandbox's output was mounted: ${text}`);
    if (/is not inside the allowed paths|cannot resolve/.test(text)) seen.resolved++;
    else {
      assert.match(text, /(directories|files)\[0\]: .* inside the output folder of sandbox \S+, which is still running/, text);
      seen.running++;
    }
  }
  assert.ok(seen.running > 0, `every check met the link: ${JSON.stringify(seen)}`);
  // the whole output folder of a live sandbox is another matter: the sandbox cannot replace
  // the folder itself (its parent is the host's), so that mount holds
  const whole = await ok("sandbox_script", { image: "base", egress: "none", directories: [a.output_dir],
    command: `ls /in/${path.basename(a.output_dir)} >/dev/null && echo listed` });
  assert.equal(whole.stdout, "listed\n");
  // an upload reads the host side by descriptors: the swapper cannot redirect it either
  const b = await ok("sandbox_create", { image: "base", egress: "none" });
  for (let i = 0; i < 6; i++) {
    const u = await call("sandbox_upload", { sandbox_id: b.sandbox_id, src: sub, dst: `/tmp/up${i}` });
    if (u.isError) continue; // a swapped component makes it fail: that hurts only the swapper
    const cat = await ok("sandbox_exec", { sandbox_id: b.sandbox_id, command: `cat /tmp/up${i}/keep.txt` });
    assert.equal(cat.stdout, "mine\n", "an upload never packs the link's target");
  }
  await ok("sandbox_exec", { sandbox_id: a.sandbox_id, command: "touch /tmp/stop; sleep 0.2; rm -f /out/res.real /out/f.txt.real; ls /out/res" });
  await ok("sandbox_destroy", { sandbox_id: a.sandbox_id });
  // once the sandbox is gone nothing can change its output: the same paths mount
  const later = await ok("sandbox_script", { image: "base", egress: "none", directories: [sub], files: [file],
    command: "cat /in/res/keep.txt /in/f.txt" });
  assert.equal(later.stdout, "mine\nmine\n");
  // and the state folder (run folders: relay sockets, exec records) is never mountable
  const st = await call("sandbox_script", { image: "base", egress: "none", directories: [env.DEMESNE_STATE_DIR],
    command: "true" });
  assert.equal(st.isError, true, "the state folder was mounted");
  assert.match(st.content[0].text, /directories\[0\]: .*state folder/);
});

test("a sandbox cannot leave a setuid program or a device node where other host users reach it", async () => {
  // root in the sandbox is root on the host (rootful engine, no user namespace): what it
  // leaves in its output folder is owned by root there
  const r = await ok("sandbox_script", { image: "base", egress: "none", command:
    "cp /bin/cat /out/suidcat && chmod 4755 /out/suidcat && ls -l /out/suidcat; "
    + "if mknod -m 666 /out/disk b 7 0 2>/dev/null; then echo made-device; else echo no-device; fi" });
  assert.match(r.stdout, /^-rwsr-xr-x/m, "the setuid bit can be set inside (nothing stops that)");
  assert.match(r.stdout, /no-device/, "device nodes cannot be made (MKNOD is dropped)");
  // so the folders above every output and run folder are the server user's alone
  for (const dir of [env.DEMESNE_OUTPUT_ROOT, env.DEMESNE_STATE_DIR]) {
    const mode = statSync(dir).mode & 0o777;
    assert.equal(mode & 0o077, 0, `${dir} is private (mode ${mode.toString(8)})`);
  }
  if (process.getuid() === 0) {
    // another user cannot reach the setuid program (the allowed root itself is opened up for
    // the check, as a home folder often is)
    chmodSync(work, 0o755);
    chmodSync(home, 0o755);
    chmodSync(path.join(home, "demesne"), 0o755);
    const { spawnSync } = await import("node:child_process");
    const p = spawnSync("su", ["nobody", "-s", "/bin/sh", "-c", `${path.join(r.output_dir, "suidcat")} /etc/shadow`],
      { encoding: "utf8" });
    assert.notEqual(p.status, 0, `another user ran the sandbox's setuid program: ${p.stdout.slice(0, 80)}`);
    assert.match(p.stderr, /Permission denied/, p.stderr);
  }
});

function engineInspect(name) {
  const socketPath = ENGINE.replace(/^unix:\/\//, "");
  return new Promise((resolve, reject) => {
    http.get({ socketPath, path: `/v1.41/containers/${name}/json` }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve(JSON.parse(body)));
    }).on("error", reject);
  });
}

test("a sandbox that floods its main process's stdout does not grow the engine's log on the host", async () => {
  const sb = await ok("sandbox_create", { image: "base", egress: "none" });
  try {
    // PID 1 (demesne-init) has the engine's log pipe as stdout: anyone in the sandbox can write to it
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, timeout_seconds: 120,
      command: "head -c 40000000 /dev/zero | tr '\\0' A > /proc/1/fd/1; echo wrote" });
    assert.equal(r.stdout, "wrote\n");
    const info = await engineInspect(`demesne-${sb.sandbox_id}`);
    assert.ok(info.LogPath, "the engine keeps a log file");
    const dir = path.dirname(info.LogPath);
    const size = readdirSync(dir).filter((n) => n.startsWith(path.basename(info.LogPath)))
      .reduce((n, f) => n + statSync(path.join(dir, f)).size, 0);
    assert.ok(size < 4 * 1024 * 1024, `the engine's log of the sandbox holds ${size} bytes after a 40 MB flood`);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});
