// `demesne attach` (issue 27) on a real engine (DEMESNE_ENGINE; run the file once per
// engine): the CLI runs on a real pseudo-terminal (tests/fixtures/attach/pty-drive.py, the
// python3 pty module), against sandboxes made over MCP with egress none:
//  - a command's output, a resize that `stty size` inside sees, Ctrl-C interrupting a
//    `sleep 100` without ending the shell, Ctrl-] detaching; the sandbox runs on;
//  - the shell's exit closes the terminal with its status; a sandbox destroyed while
//    attached closes it with a status and says so;
//  - a gone sandbox, an id that names nothing and a stdin that is no terminal are refused;
//  - under gVisor (Podman: DEMESNE_GVISOR_ENGINE) the same shell works;
//  - `--follow` of a background agent run (the agent image, the scripted vendor of
//    scripted-vendor.mjs) prints its transcript as lines, escape sequences neutralised.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { BIN, connect, ROOT, serverEnv } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const PODMAN = ENGINE.includes("podman");
const GVISOR_ENGINE = process.env.DEMESNE_GVISOR_ENGINE || "";
const gvisorSkip = !existsSync("/usr/bin/runsc") ? "runsc is not installed (tests/setup-host installs it)"
  : PODMAN && !GVISOR_ENGINE ? "Podman offers gVisor only with DEMESNE_GVISOR_ENGINE (tests/run sets it)" : false;
const DRIVE = path.join(ROOT, "tests/fixtures/attach/pty-drive.py");
const work = mkdtempSync(path.join(tmpdir(), "demesne-attach-"));
const SECRET = "sk-test-attach-0123456789";
let vendor;
const env = {
  DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
  XDG_CONFIG_HOME: path.join(work, "xdg"),
  ...(GVISOR_ENGINE ? { DEMESNE_GVISOR_ENGINE: GVISOR_ENGINE } : {}),
};

let conn;
before(async () => {
  vendor = await startVendor({ secret: SECRET });
  Object.assign(env, {
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", DEMESNE_CODEX_ENABLED: "false",
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  });
  conn = await connect({ env, fixtures: false });
});
// every driver started, so that a failed test cannot leave one waiting for its next step
// (its stdin open), which would keep this file from ever ending
const drivers = [];
after(async () => {
  for (const d of drivers) { d.stdin.end(); if (d.exitCode === null) d.kill("SIGKILL"); }
  await conn?.client.close(); await vendor?.close();
});

async function call(name, args) {
  const r = await conn.client.callTool({ name, arguments: args }, undefined, { timeout: 300_000 });
  assert.ok(!r.isError, `${name}: ${r.content?.[0]?.text}`);
  return r.structuredContent;
}

/** `demesne attach ARGS` on a pseudo-terminal of 24x80; request(obj) sends one step. */
function attach(...args) {
  const child = spawn("python3", [DRIVE, BIN, "attach", ...args], { env: { ...serverEnv(env), TERM: "xterm" } });
  drivers.push(child);
  const lines = createInterface({ input: child.stdout });
  const waiting = [];
  lines.on("line", (l) => waiting.shift()?.(JSON.parse(l)));
  let stderr = "";
  child.stderr.on("data", (d) => { stderr += d; });
  const request = (obj) => new Promise((resolve) => { waiting.push(resolve); child.stdin.write(JSON.stringify(obj) + "\n"); });
  return {
    send: (text) => request({ send: text }),
    resize: (rows, cols) => request({ resize: [rows, cols] }),
    signal: (n) => request({ signal: n }),
    async expect(rx) {
      const r = await request({ expect: rx, timeout: 60 });
      assert.ok(r.ok, `expected /${rx}/ on the terminal; it showed: ${JSON.stringify(r.out)} (driver: ${stderr})`);
      return r.out;
    },
    async wait() {
      const r = await request({ wait: 60 });
      child.stdin.end();
      return r;
    },
  };
}

async function shellSession(sb) {
  const t = attach(sb.sandbox_id);
  await t.expect("attached to " + sb.sandbox_id);
  // a marker computed by the shell, so that the echo of what was typed cannot match
  await t.send("echo out-$((6*7))\r");
  await t.expect("out-42");
  await t.resize(33, 101);
  // the new size travels as a frame of its own once the CLI sees SIGWINCH: a command typed at
  // once may still see the old one, so ask again until it shows (a few tries, each waiting
  // for the shell's answer however slow a loaded machine makes it, then a short pause)
  let resized = false, sizes = [];
  for (let i = 0; i < 5 && !resized; i++) {
    if (i > 0) await new Promise((r) => setTimeout(r, 500));
    await t.send(`stty size; echo size-${i}-$((1+${i}))\r`);
    const out = await t.expect(`size-${i}-${i + 1}`);
    const m = out.match(/(\d+ \d+)\r?\nsize-\d+-\d+$/);
    sizes.push(m ? m[1] : out);
    resized = m?.[1] === "33 101";
  }
  assert.ok(resized, `the resize reached the shell (stty size said ${JSON.stringify(sizes)})`);
  // Ctrl-C goes through the PTY to the foreground job, not to the shell
  // the marker comes from the job itself (which then becomes the sleep), so the Ctrl-C
  // cannot reach the shell before the job is in the foreground
  await t.send("sh -c 'echo sleeping-$((1+2)); exec sleep 100' && echo slept-$((1+1))\r");
  await t.expect("sleeping-3");
  await t.send("\x03");
  await t.send("echo alive-$((2+2))\r");
  const out = await t.expect("alive-4");
  assert.doesNotMatch(out, /slept-2/, "the sleep was interrupted (it did not succeed)");
  await t.send("\x1d");
  const end = await t.wait();
  assert.equal(end.exit, 0, end.out);
  assert.match(end.out, /detached from .*it keeps running/);
  const e = await call("sandbox_exec", { sandbox_id: sb.sandbox_id, command: "echo still-$((3+3))" });
  assert.equal(e.exit_code, 0);
  assert.match(e.stdout, /still-6/);
}

test("attach: a shell at egress none: a command, a resize, Ctrl-C, detach; the sandbox runs on", { timeout: 300_000 }, async () => {
  const sb = await call("sandbox_create", { image: "base", egress: "none" });
  try {
    await shellSession(sb);
    // the shell's own exit ends the terminal with its status
    const t = attach(sb.sandbox_id);
    await t.expect("attached to");
    await t.send("exit 7\r");
    const end = await t.wait();
    assert.equal(end.exit, 7, end.out);
    assert.match(end.out, /exited with 7/);
    // SIGTERM to the CLI detaches with a message (whichever of its threads the kernel hands it to)
    const k = attach(sb.sandbox_id);
    await k.expect("attached to");
    await k.send("echo term-$((4*4))\r");
    await k.expect("term-16");
    await k.signal(15);
    const killed = await k.wait();
    assert.equal(killed.exit, 128 + 15, killed.out);
    assert.match(killed.out, /detached from .* by signal 15; it keeps running/);
  } finally {
    await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("attach: a sandbox destroyed while attached closes the terminal with a status; a gone one is refused", { timeout: 300_000 }, async () => {
  const sb = await call("sandbox_create", { image: "base", egress: "none" });
  const t = attach(sb.sandbox_id);
  try {
    await t.expect("attached to");
    await t.send("echo ready-$((5*5))\r");
    await t.expect("ready-25");
  } finally {
    await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  const end = await t.wait();
  // the status printed is the one it exits with: the container's exit code, or 255 once removed
  const m = end.out.match(new RegExp(`sandbox ${sb.sandbox_id} (was destroyed|stopped)[^\\]]*; exit status (\\d+)\\]`));
  assert.ok(m, end.out);
  assert.equal(end.exit, Number(m[2]), end.out);
  const gone = attach(sb.sandbox_id);
  const r = await gone.wait();
  assert.equal(r.exit, 1, r.out);
  assert.match(r.out, new RegExp(`no sandbox, run or job ${sb.sandbox_id}`));
});

test("attach: an id that names nothing, and a stdin that is no terminal, are refused", async () => {
  const none = attach("20260101T000000Z-00000000");
  const r = await none.wait();
  assert.equal(r.exit, 1);
  assert.match(r.out, /no sandbox, run or job 20260101T000000Z-00000000/);
  const p = spawnSync(BIN, ["attach", "20260101T000000Z-00000000"], { env: serverEnv(env), input: "", encoding: "utf8" });
  assert.equal(p.status, 1);
  assert.match(p.stderr, /stdin is not a terminal/);
});

test("attach: a shell in a gVisor sandbox", { skip: gvisorSkip, timeout: 300_000 }, async () => {
  const sb = await call("sandbox_create", { image: "base", egress: "none", isolation: "gvisor" });
  try {
    await shellSession(sb);
  } finally {
    await call("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

test("attach --follow: a background agent's transcript as lines, escape sequences neutralised", { timeout: 300_000 }, async () => {
  // the agent's tool output and its answer carry escape sequences: a colour, a window
  // title, a screen clear, a clipboard write (OSC 52)
  vendor.plan("follow", [
    { shell: "printf 'shell-\\033[31mRED\\033]0;title\\007-end\\n'" },
    { final: "follow-answer \x1b[2J \x1b]52;c;aGk=\x07 ok" },
  ]);
  const started = await call("sandbox_agent", { prompt: "PLAN:follow go", timeout_seconds: 180, background: true });
  const p = spawn(BIN, ["attach", "--follow", started.job_id], { env: serverEnv(env) });
  let out = "", err = "";
  p.stdout.on("data", (d) => { out += d; });
  p.stderr.on("data", (d) => { err += d; });
  const code = await new Promise((resolve) => p.on("close", resolve));
  assert.equal(code, 0, err);
  assert.match(out, /assistant: follow-answer \^\[\[2J \^\[\]52;c;aGk=\^G ok/, out);
  assert.match(out, /tool result: .*shell-\^\[\[31mRED\^\[\]0;title\^G-end/, out);
  assert.match(out, /^\[result\] follow-answer/m, out);
  assert.doesNotMatch(out, /[\x00-\x08\x0b-\x1f\x7f]/, "no control character reaches the terminal");
  assert.match(err, new RegExp(`${started.job_id} succeeded, exit code 0`));
});

// issue 27: a shell in the sandbox a background run works in (an agent's is the same kind of
// one-shot sandbox), named by its job id; leaving it does not end the run
test("attach: a shell in a running background job's sandbox, by its job id; the job goes on", { timeout: 300_000 }, async () => {
  const j = await call("sandbox_script", { image: "base", egress: "none", background: true,
    command: "echo working > /out/progress.txt; sleep 40; echo done" });
  try {
    let t;
    for (let i = 0; i < 40; i++) {
      const s = await call("sandbox_status", { job_id: j.job_id });
      if (s.status === "running") break;
      await new Promise((r) => setTimeout(r, 250));
    }
    t = attach(j.job_id);
    await t.expect("attached to");
    await t.send("cat /out/progress.txt; echo seen-$((5*5))\r");
    const out = await t.expect("seen-25");
    assert.match(out, /working/, "the shell is in the job's own sandbox");
    await t.send("\x1d");
    const end = await t.wait();
    assert.equal(end.exit, 0, end.out);
    const s = await call("sandbox_status", { job_id: j.job_id });
    assert.equal(s.status, "running", "detaching left the job running");
  } finally {
    await call("sandbox_cancel", { job_id: j.job_id });
  }
});
