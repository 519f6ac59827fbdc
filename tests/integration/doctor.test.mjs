// `demesne doctor` against a real container engine: the engine it names is the one behind
// DEMESNE_ENGINE (tests/run runs this file once per engine, after `demesne images build`),
// every check passes and the exit status is 0; with no engine it names the problem and the
// fix and exits 1. The problems each check finds are tested in tests/lua/doctor_test.lua,
// and doctor inside a fresh Debian root in tests/package/run.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const KIND = SOCKET.includes("podman") ? "podman" : "docker";

function doctor(env) {
  return new Promise((resolve) => {
    execFile(BIN, ["doctor"], { env: serverEnv(env), timeout: 60_000 }, (err, stdout, stderr) => {
      resolve({ status: err ? err.code : 0, stdout, stderr });
    });
  });
}

test(`doctor finds ${KIND} at ${SOCKET} and passes every check`, async () => {
  const work = mkdtempSync(path.join(tmpdir(), "demesne-doctor-"));
  try {
    const r = await doctor({ DEMESNE_ENGINE: ENGINE, DEMESNE_STATE_DIR: path.join(work, "state"),
      DEMESNE_OUTPUT_ROOT: path.join(work, "out") });
    const lines = r.stdout.trimEnd().split("\n");
    const engine = lines.find((l) => /^\S+\s+engine\s/.test(l));
    assert.match(engine ?? "", new RegExp(`^ok\\s+engine\\s+${KIND} \\S+, Docker Engine API 1\\.\\d+, at ${ENGINE.replace(/[.*+?^${}()|[\]\\/]/g, "\\$&")} \\(the engine setting\\)$`), r.stdout);
    const verdicts = lines.filter((l) => !/^\s/.test(l) && !l.startsWith("demesne doctor:")).map((l) => l.split(/\s+/).slice(0, 2).join(" "));
    assert.deepEqual(verdicts, ["ok engine", "ok images", "ok agent-clis", "ok config", "ok folders", "ok demesne-init", "ok gvisor",
      "ok userns", "ok limits", "ok network"], r.stdout);
    // Podman and Docker give network none no interface but loopback: nothing to probe (the
    // Kubernetes adapter's probe Pod is checked in tests/kubernetes/lane)
    assert.match(lines.find((l) => /^ok\s+network\s/.test(l)) ?? "",
      /^ok\s+network\s+network none gives a sandbox no interface but loopback$/, r.stdout);
    // which wall is in effect: Debian's Podman 4.3 and Docker without userns-remap give no user namespace
    const userns = lines.find((l) => /^ok\s+userns\s/.test(l));
    assert.match(userns, KIND === "podman"
      ? /^ok\s+userns\s+(not available: rootful Podman 4\.3\.\d+: uid 0 in a sandbox is uid 0 on the host|on: rootful Podman: each sandbox gets its own user namespace)/
      : /^ok\s+userns\s+(not available: Docker without userns-remap|on: Docker's userns-remap is on)/, r.stdout);
    assert.match(lines.find((l) => /^ok\s+limits\s/.test(l)) ?? "", KIND === "podman"
      ? /^ok\s+limits\s+memory, process and CPU limits: enforced \(cgroup v[12]\)$/
      : /^ok\s+limits\s+memory, process and CPU limits: enforced$/, r.stdout);
    assert.match(lines.find((l) => /^ok\s+agent-clis\s/.test(l)) ?? "",
      /^ok\s+agent-clis\s+Claude Code \d+\.\d+\.\d+ in agent-claude_code, installed \d+ days? ago; Codex \d+\.\d+\.\d+ in agent-codex, installed \d+ days? ago \(within agent_cli_max_age_days = 30\)$/,
      r.stdout);
    assert.equal(lines.at(-1), "demesne doctor: all 10 checks passed");
    assert.equal(r.status, 0, r.stdout + r.stderr);
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
});

test("doctor says when the agent CLI in an agent image is older than agent_cli_max_age_days", async () => {
  const work = mkdtempSync(path.join(tmpdir(), "demesne-doctor-"));
  try {
    // a second's fraction of a day: the agent images built for this run are older than that
    const r = await doctor({ DEMESNE_ENGINE: ENGINE, DEMESNE_STATE_DIR: path.join(work, "state"),
      DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_AGENT_CLI_MAX_AGE_DAYS: "0.00001" });
    const lines = r.stdout.trimEnd().split("\n");
    const i = lines.findIndex((l) => /^FAIL\s+agent-clis\s/.test(l));
    assert.ok(i >= 0, r.stdout);
    assert.match(lines[i], /Claude Code \d+\.\d+\.\d+ in agent-claude_code, installed \d+ days? ago; .*older than agent_cli_max_age_days = 1e-05 \(the CLIs release weekly\)$/);
    assert.match(lines[i + 1], /fix: a user image agent-claude_code \(FROM agent-claude_code, then RUN npm install -g @anthropic-ai\/claude-code@<newer version>\)/);
    assert.equal(lines.at(-1), "demesne doctor: 1 problem (agent-clis)");
    assert.equal(r.status, 1);
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
});

test("doctor without an engine names the problem and the fix and exits 1", async () => {
  const work = mkdtempSync(path.join(tmpdir(), "demesne-doctor-"));
  try {
    const sock = path.join(work, "no-engine.sock");
    const r = await doctor({ DEMESNE_ENGINE: `unix://${sock}`, DEMESNE_STATE_DIR: path.join(work, "state"),
      DEMESNE_OUTPUT_ROOT: path.join(work, "out") });
    const lines = r.stdout.trimEnd().split("\n");
    assert.equal(lines[0], `FAIL  engine        the engine setting ($DEMESNE_ENGINE) names ${sock}, which is not a socket`);
    assert.match(lines[1], /^\s+fix: start the engine there, or correct the setting/);
    assert.equal(lines[2], "skip  images        needs an engine");
    assert.equal(lines[3], "skip  agent-clis    needs an engine");
    assert.equal(lines.at(-1), "demesne doctor: 1 problem (engine)");
    assert.equal(r.status, 1);
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
});
