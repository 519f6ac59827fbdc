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
import { BIN, connect, engineContainers, engineRequest, ROOT, serverEnv as withServerEnv } from "./helpers.mjs";
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
    DEMESNE_ALLOWED_PATHS: `${path.join(work, "repos")}:${path.join(ROOT, "tests/fixtures/tree")}`, HOME: path.join(base, "home"),
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
    // demesne branches: the run, its status and cost, the diffstat
    const listed = JSON.parse(execFileSync(BIN, ["branches", h, "--json"], { env: withServerEnv(serverEnv(tag)),
      encoding: "utf8" }));
    assert.deepEqual(listed.branches.map((x) => [x.name, x.run_id, x.status, x.head, x.cost_usd]),
      [[`demesne/${tag}`, r.run_id, "succeeded", b.head, r.cost_usd]]);
    assert.ok(r.cost_usd > 0, `the scripted vendor's usage has a cost: ${r.cost_usd}`);
    assert.deepEqual(listed.branches[0].diffstat, { files: 2, insertions: 2, deletions: 1 });
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
    // with the host's uncommitted work (demesne's first commit on the branch)
    writeFileSync(path.join(h, "TODO.md"), "todo\n");
    let before = snapshot(h);
    const r1 = await call({ prompt: `PLAN:${id} Fix add in app.py and commit.`, model: "sonnet", repository: h, branch: tag,
      include_uncommitted: true });
    assert.deepEqual(r1.branch.commits.map((c) => c.subject), ["fix add"]);
    assert.deepEqual(snapshot(h), before, "the host's work tree, index, HEAD and config are untouched");
    // the host moves on meanwhile: the continue still adds to its own branch, from its kept clone
    writeFileSync(path.join(h, "host.txt"), "host\n");
    git(h, "add", "host.txt");
    git(h, "commit", "-qm", "host moved on");
    before = snapshot(h);
    const r2 = await call({ continue: r1.run_id, prompt: "The reviewer asks for a sub function too." });
    assert.equal(r2.continues, r1.run_id);
    // the same clone: run 1's commit is there when run 2 starts
    const demesneCommit = `demesne: uncommitted changes of the host's work tree at the start of run ${r1.run_id}`;
    assert.deepEqual(readFileSync(path.join(r2.output_dir, "log-before.txt"), "utf8").trim().split("\n"),
      ["fix add", demesneCommit, "app with a bug"]);
    const b = r2.branch;
    assert.equal(b.error, undefined, JSON.stringify(b));
    assert.equal(b.branch, `demesne/${tag}`, "the same branch");
    assert.equal(b.base, r1.branch.base, "the same start");
    assert.deepEqual(b.commits.map((c) => c.subject), ["add sub", "fix add"]);
    assert.equal(git(h, "rev-parse", `demesne/${tag}`), b.head);
    assert.deepEqual(git(h, "log", "--format=%s", `demesne/${tag}`).split("\n"),
      ["add sub", "fix add", demesneCommit, "app with a bug"]);
    assert.equal(git(h, "rev-parse", `demesne/${tag}~1`), r1.branch.head, "fast-forwarded from run 1's head");
    assert.deepEqual(snapshot(h), before, "the host's work tree, index, HEAD and config are untouched");
  } finally {
    await conn.client.close();
  }
});

// issue 25, from inside a tree: an orchestrator sends a reviewer's findings back to the
// implementer it spawned with repository: true; the continuation works on in the child's
// clone and fast-forwards the child's branch in the host repository
test("inside a tree: a continue of a child with repository: true adds to the child's branch", async () => {
  const tag = "tree-cont";
  const h = makeRepo(tag);
  const before = snapshot(h);
  const id = vendor.plan(tag, [
    { shell: "echo impl > impl.txt && git add impl.txt && git commit -qm impl && echo committed" },
    { final: "Implemented." },
    { shell: "git log --format=%s > /out/log-before.txt && echo fixed >> impl.txt && git commit -qam fix && echo committed" },
    { final: "Fixed." },
  ], undefined, { turns: true });
  const mcp = (args) => `python3 /in/tree/mcp-client.py sandbox_agent '${JSON.stringify(args)}'`;
  const conn = await connect({ env: serverEnv(tag), fixtures: false });
  try {
    const res = await conn.client.callTool({ name: "sandbox_script", arguments: {
      repository: h, branch: "orch", mcp: true, image: "default", egress: "none", timeout_seconds: 600,
      directories: [path.join(ROOT, "tests/fixtures/tree")], command: [
        "set -e", "echo plan > plan.txt", "git add plan.txt", "git commit -qm 'root: plan'",
        `${mcp({ name: "impl", repository: true, prompt: `PLAN:${id} Implement it.`, model: "sonnet" })} > /out/first.json`,
        `a2=$(python3 -c 'import json; r = json.load(open("/out/first.json")); print(json.dumps({"name": "impl-fix", `
          + `"continue": r["run_id"], "prompt": "A reviewer found a bug: fix it."}))')`,
        "python3 /in/tree/mcp-client.py sandbox_agent \"$a2\" > /out/second.json",
      ].join("\n") } }, undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const r = res.structuredContent;
    assert.equal(r.exit_code, 0, r.stderr);
    const first = JSON.parse(readFileSync(path.join(r.output_dir, "first.json"), "utf8"));
    const second = JSON.parse(readFileSync(path.join(r.output_dir, "second.json"), "utf8"));
    assert.equal(first.branch.error, undefined, JSON.stringify(first.branch));
    assert.equal(first.branch.branch, "demesne/orch--impl");
    assert.deepEqual(first.branch.commits.map((c) => c.subject), ["impl"]);
    assert.equal(second.continues, first.run_id);
    assert.equal(second.branch?.error, undefined, JSON.stringify(second.branch));
    assert.equal(second.branch.branch, "demesne/orch--impl", "the child's branch, not a new one");
    assert.deepEqual(second.branch.commits.map((c) => c.subject), ["fix", "impl"], "against the child's start");
    assert.deepEqual(readFileSync(path.join(r.output_dir, "child", "impl-fix", "log-before.txt"), "utf8").trim().split("\n"),
      ["impl", "root: plan", "app with a bug"], "the same clone");
    assert.equal(git(h, "rev-parse", "demesne/orch--impl"), second.branch.head);
    assert.equal(git(h, "rev-parse", "demesne/orch--impl~1"), first.branch.head, "fast-forwarded");
    assert.deepEqual(snapshot(h), before, "the host's work tree, index, HEAD and config are untouched");
  } finally {
    await conn.client.close();
  }
});
