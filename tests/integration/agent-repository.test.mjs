// sandbox_agent with a host repository (docs/how-to/hand-back-a-branch.md): the real Claude
// Code and Codex CLIs in their real images on a real engine (DEMESNE_ENGINE), driven by the
// scripted vendor (scripted-vendor.mjs) to edit and commit with their own shell tools, and
// to leave one change uncommitted. The branch appears in the host repository with the
// commits and the diffstat; the host's work tree, index, HEAD and config are untouched.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, engineRequest } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-agent-repo-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const G = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"];
const git = (cwd, ...args) => execFileSync("git", [...G, ...args], { cwd, encoding: "utf8" }).trim();

let vendor;
before(async () => { vendor = await startVendor({ secret: SECRET }); });
after(async () => {
  await vendor.close();
  const left = (await engineContainers(ENGINE))
    .filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(work));
  for (const c of left) await engineRequest(ENGINE, "DELETE", `/containers/${c.Id}?force=true`);
  rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

function serverEnv(name) {
  const base = path.join(work, name);
  mkdirSync(base, { recursive: true });
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(base, "out"), DEMESNE_STATE_DIR: path.join(base, "state"),
    DEMESNE_ALLOWED_PATHS: path.join(work, "repos"), HOME: path.join(base, "home"),
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendor.port}/openai/v1`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "1",
  };
}

function makeRepo(name) {
  const h = path.join(work, "repos", name);
  mkdirSync(h, { recursive: true });
  git(h, "init", "-q");
  writeFileSync(path.join(h, "app.py"), "def add(a, b):\n    return a - b\n");
  git(h, "add", ".");
  git(h, "commit", "-qm", "app with a bug");
  return h;
}

function snapshot(h) {
  return {
    status: git(h, "status", "--porcelain"), head: git(h, "rev-parse", "HEAD"), sym: git(h, "symbolic-ref", "HEAD"),
    config: readFileSync(path.join(h, ".git/config"), "utf8"),
    index: readFileSync(path.join(h, ".git/index")).toString("base64"),
  };
}

async function agentRun({ tag, model }) {
  const h = makeRepo(tag);
  const before = snapshot(h);
  const plan = vendor.plan(tag, [
    { shell: "pwd > /out/pwd.txt && git branch --show-current > /out/branch.txt && "
      + "sed -i 's/a - b/a + b/' app.py && git commit -qam 'fix add' && echo committed" },
    { shell: "echo '# notes' > NOTES.md && echo left" }, // left uncommitted: demesne commits it
    { final: "Fixed add." },
  ]);
  const conn = await connect({ env: serverEnv(tag), fixtures: false });
  try {
    const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: `PLAN:${plan} Fix add in app.py and commit.`, model, repository: h, branch: tag,
    } }, undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const r = res.structuredContent;
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(readFileSync(path.join(r.output_dir, "pwd.txt"), "utf8").trim(), `/workspace/${tag}`);
    assert.equal(readFileSync(path.join(r.output_dir, "branch.txt"), "utf8").trim(), `demesne/${tag}`);
    const b = r.branch;
    assert.equal(b.error, undefined, JSON.stringify(b));
    assert.equal(b.branch, `demesne/${tag}`);
    assert.deepEqual(b.commits.map((c) => c.subject), [`demesne: work left uncommitted at the end of run ${r.run_id}`,
      "fix add"]);
    assert.deepEqual(b.diffstat, { files: 2, insertions: 2, deletions: 1 }, git(h, "diff", "--stat", b.base, b.head));
    assert.equal(git(h, "show", `demesne/${tag}:app.py`), "def add(a, b):\n    return a + b");
    assert.equal(git(h, "show", `demesne/${tag}:NOTES.md`), "# notes");
    assert.deepEqual(snapshot(h), before, "the host's work tree, index, HEAD and config are untouched");
    const results = JSON.parse(readFileSync(path.join(r.output_dir, "results.json"), "utf8"));
    assert.equal(results.branch.head, b.head, "results.json says the same");
  } finally {
    await conn.client.close();
  }
}

test("Claude Code edits and commits in the clone; the branch comes back", async () => {
  await agentRun({ tag: "repo-claude", model: "sonnet" });
});

test("Codex edits and commits in the clone; the branch comes back", async () => {
  await agentRun({ tag: "repo-codex", model: "gpt-5.6-sol" });
});

// issue 25: a follow-up continues the run in the same clone and adds to the same branch
test("a continue of a repository run adds its commit to the same branch, fast-forwarded", async () => {
  const tag = "cont";
  const h = makeRepo(tag);
  const before = snapshot(h);
  const id = vendor.plan(tag, [
    { shell: "sed -i 's/a - b/a + b/' app.py && git commit -qam 'fix add' && echo committed" },
    { final: "Fixed add." },
    { shell: "git log --format=%s > /out/log-before.txt && printf 'def sub(a, b):\\n    return a - b\\n' >> app.py "
      + "&& git commit -qam 'add sub' && echo committed" },
    { final: "Added sub." },
  ], undefined, { turns: true });
  const conn = await connect({ env: serverEnv(tag), fixtures: false });
  try {
    const call = async (args) => {
      const res = await conn.client.callTool({ name: "sandbox_agent", arguments: args }, undefined, LONG);
      assert.ok(!res.isError, res.content?.[0]?.text);
      assert.equal(res.structuredContent.exit_code, 0, res.structuredContent.stderr);
      return res.structuredContent;
    };
    const r1 = await call({ prompt: `PLAN:${id} Fix add in app.py and commit.`, model: "sonnet", repository: h, branch: tag });
    assert.deepEqual(r1.branch.commits.map((c) => c.subject), ["fix add"]);
    const r2 = await call({ continue: r1.run_id, prompt: "The reviewer asks for a sub function too." });
    assert.equal(r2.continues, r1.run_id);
    // the same clone: run 1's commit is there when run 2 starts
    assert.deepEqual(readFileSync(path.join(r2.output_dir, "log-before.txt"), "utf8").trim().split("\n"),
      ["fix add", "app with a bug"]);
    const b = r2.branch;
    assert.equal(b.error, undefined, JSON.stringify(b));
    assert.equal(b.branch, `demesne/${tag}`, "the same branch");
    assert.equal(git(h, "rev-parse", `demesne/${tag}`), b.head);
    assert.deepEqual(git(h, "log", "--format=%s", `demesne/${tag}`).split("\n"), ["add sub", "fix add", "app with a bug"]);
    assert.equal(git(h, "rev-parse", `demesne/${tag}~1`), r1.branch.head, "fast-forwarded from run 1's head");
    assert.deepEqual(snapshot(h), before, "the host's work tree, index, HEAD and config are untouched");
  } finally {
    await conn.client.close();
  }
});
