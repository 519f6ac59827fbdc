// A host repository in, a branch out (docs/how-to/hand-back-a-branch.md), over MCP against a
// real engine, with real git on the host and in the sandbox. Every case compares the host
// repository before and after: only the run's branch may appear.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, rmSync, readdirSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, connect, engineContainers, ROOT, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-repo-"));
const allowed = path.join(work, "allowed");
mkdirSync(allowed, { recursive: true });
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_ALLOWED_PATHS: `${allowed}:${path.join(ROOT, "tests/fixtures/tree")}`,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
};

const G = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"];
function git(cwd, ...args) {
  return execFileSync("git", [...G, ...args], { cwd, encoding: "utf8" }).trim();
}

// A host repository: two commits, an uncommitted change, an untracked file, a hook that
// would leave a marker, and a remote URL with a token that must not reach the sandbox.
function makeRepo(name) {
  const h = path.join(allowed, name);
  mkdirSync(h);
  git(h, "init", "-q");
  writeFileSync(path.join(h, "a.txt"), "one\n");
  git(h, "add", "a.txt");
  git(h, "commit", "-qm", "first");
  writeFileSync(path.join(h, "a.txt"), "one\ntwo\n");
  git(h, "commit", "-qam", "second");
  git(h, "remote", "add", "origin", "https://user:SECRET-TOKEN@example.invalid/x.git");
  writeFileSync(path.join(h, "a.txt"), "one\ntwo\ndirty\n");
  writeFileSync(path.join(h, "untracked.txt"), "new\n");
  writeFileSync(path.join(h, ".git/hooks/post-merge"), `#!/bin/sh\ntouch ${work}/HOOK-RAN\n`, { mode: 0o755 });
  return h;
}

function snapshot(h) {
  return {
    status: git(h, "status", "--porcelain"),
    head: git(h, "rev-parse", "HEAD"),
    sym: git(h, "symbolic-ref", "HEAD"),
    refs: git(h, "for-each-ref", "--format=%(refname) %(objectname)").split("\n").filter(Boolean),
    config: readFileSync(path.join(h, ".git/config"), "utf8"),
    hooks: readdirSync(path.join(h, ".git/hooks")).sort(),
    index: readFileSync(path.join(h, ".git/index")).toString("base64"),
  };
}

let conn;
before(async () => { conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function call(name, args) {
  return conn.client.callTool({ name, arguments: args }, undefined, LONG);
}
async function ok(name, args) {
  const res = await call(name, args);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}

test("sandbox_script with a repository: the clone inside, the branch back, nothing else changed", async () => {
  const h = makeRepo("proj");
  const before = snapshot(h);
  const r = await ok("sandbox_script", {
    repository: h, include_uncommitted: true, branch: "fix-1", image: "base", egress: "none",
    command: [
      "set -e", "pwd", "git branch --show-current", "git remote -v | wc -l", "cat a.txt", "cat untracked.txt",
      "grep -c SECRET .git/config || true", "ls .git/hooks | wc -l",
      "echo fixed > fix.txt", "git add fix.txt", "git commit -qm 'fix: add fix.txt'",
      "echo left >> a.txt", // left uncommitted: demesne commits it at the end
      // hostile settings for the host: none of them may ever run there
      `git config core.fsmonitor 'touch ${work}/FSMONITOR-RAN'`, "git config core.hooksPath /out",
      `printf '#!/bin/sh\\ntouch ${work}/HOOK-RAN\\n' > /out/post-merge`, "chmod +x /out/post-merge",
      "git config includeIf.gitdir:/.path /out/evil",
    ].join("\n"),
  });
  assert.equal(r.exit_code, 0, r.stderr);
  const lines = r.stdout.trim().split("\n");
  assert.equal(lines[0], "/workspace/proj", "the clone is at /workspace/<basename>");
  assert.equal(lines[1], "demesne/fix-1", "on the run's branch");
  assert.equal(lines[2], "0", "no remote");
  assert.deepEqual(lines.slice(3, 6), ["one", "two", "dirty"], "with the uncommitted changes");
  assert.equal(lines[6], "new", "and the untracked file");
  assert.equal(lines[7], "0", "no token in the clone's config");
  const b = r.branch;
  assert.equal(b.error, undefined, JSON.stringify(b));
  assert.equal(b.branch, "demesne/fix-1");
  assert.equal(b.host_head, before.head);
  assert.deepEqual(b.commits.map((c) => c.subject),
    ["demesne: work left uncommitted at the end of run " + r.run_id, "fix: add fix.txt"]);
  assert.deepEqual(b.diffstat, { files: 2, insertions: 2, deletions: 0 }, git(h, "diff", "--stat", b.base, b.head));
  assert.equal(b.base_is_ancestor, true);
  assert.equal(b.bundle, "/out/demesne-branch.bundle");
  assert.ok(existsSync(path.join(r.output_dir, "demesne-branch.bundle")));
  assert.equal(git(h, "rev-parse", "refs/heads/demesne/fix-1"), b.head);
  assert.equal(git(h, "show", "demesne/fix-1:fix.txt"), "fixed");
  assert.equal(git(h, "show", `${b.base}:untracked.txt`), "new", "the base holds the host's uncommitted work");
  assert.equal(git(h, "rev-parse", `${b.base}^`), before.head);
  const now = snapshot(h);
  assert.deepEqual(now.refs, [...before.refs, `refs/heads/demesne/fix-1 ${b.head}`].sort());
  now.refs = before.refs;
  assert.deepEqual(now, before, "work tree, index, HEAD, config and hooks untouched");
  assert.ok(!existsSync(path.join(work, "HOOK-RAN")) && !existsSync(path.join(work, "FSMONITOR-RAN")),
    "nothing the sandbox wrote ran");
  // the same branch again is refused, never overwritten
  const again = await call("sandbox_script", { repository: h, branch: "fix-1", image: "base", command: "true" });
  assert.equal(again.isError, true);
  assert.match(again.content[0].text, /^branch: the branch demesne\/fix-1 already exists/);
  assert.equal(git(h, "rev-parse", "refs/heads/demesne/fix-1"), b.head);
  // the container goes after the answer (a tracked teardown): wait for it, then look
  let left = [];
  for (let i = 0; i < 120; i++) {
    left = (await engineContainers(ENGINE)).filter((c) => c.Labels?.["io.demesne.run_id"] === r.run_id);
    if (left.length === 0) break;
    await new Promise((res) => setTimeout(res, 250));
  }
  assert.deepEqual(left.map((c) => c.Names), [], "the container is gone");
});

test("sandbox_script with a repository: bad input is refused naming the field, the repository unchanged", async () => {
  const h = makeRepo("proj2");
  const before = snapshot(h);
  mkdirSync(path.join(allowed, "plain"));
  git(allowed, "init", "-q", "--bare", "bare.git");
  const cases = [
    [{ repository: path.join(allowed, "plain") }, /^repository: .* is not a git repository/],
    [{ repository: path.join(allowed, "bare.git") }, /^repository: .* is a bare repository/],
    [{ repository: path.join(work, "state") }, /^repository: .* is not inside the allowed paths/],
    [{ repository: h, branch: "bad..name" }, /^branch: "bad\.\.name" is not a valid git ref component/],
    [{ include_uncommitted: true }, /^include_uncommitted: only with repository/],
    [{ depth: 2 }, /^depth: only with repository/],
    [{ repository: h, depth: 0 }, /depth: must be >= 1 \(got 0\)/],
    [{ repository: h, depth: -1 }, /depth: must be >= 1/],
    [{ repository: h, depth: 1.5 }, /depth: .*integer/],
    [{ repository: h, depth: 1e12 }, /depth: must be <= 1000000/],
  ];
  for (const [args, want] of cases) {
    const res = await call("sandbox_script", { image: "base", command: "true", ...args });
    assert.equal(res.isError, true, JSON.stringify(args));
    assert.match(res.content[0].text, want);
  }
  // a sandbox whose branch holds an object fsck rejects: an error in the result, no branch
  const r = await ok("sandbox_script", { repository: h, image: "base", egress: "none", command:
    "t=$(git write-tree) && c=$(printf 'tree %s\\nparent %s\\nauthor nobody\\ncommitter x <x> 1 +0000\\n\\nbad\\n' "
    + "$t $(git rev-parse HEAD) | git hash-object -t commit -w --literally --stdin) && "
    + "git update-ref refs/heads/$(git branch --show-current) $c" });
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.branch.error, /failed the checks/);
  assert.equal(r.branch.head, undefined);
  const now = snapshot(h);
  assert.deepEqual(now, before, "no branch, nothing changed");
});

// issue 25, "with the history (configurable depth)": a shallow clone inside, the branch back
test("sandbox_script with a repository and depth 1: one commit of history inside, its commit back on the host's HEAD",
  async () => {
    const h = makeRepo("proj-depth");
    const before = snapshot(h);
    const r = await ok("sandbox_script", { repository: h, depth: 1, branch: "shallow-1", image: "base", egress: "none",
      command: "git rev-list --count HEAD && git rev-parse --is-shallow-repository && git log --format=%s && "
        + "git remote -v | wc -l && echo s > s.txt && git add s.txt && git commit -qm 'in a shallow clone'" });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.deepEqual(r.stdout.trim().split("\n"), ["1", "true", "second", "0"], "one commit of history, no remote");
    const b = r.branch;
    assert.equal(b.error, undefined, JSON.stringify(b));
    assert.equal(b.base, before.head);
    assert.deepEqual(b.commits.map((c) => c.subject), ["in a shallow clone"]);
    assert.equal(git(h, "rev-parse", `${b.head}^`), before.head, "its parent is the host's HEAD");
    assert.equal(git(h, "rev-list", "--count", "demesne/shallow-1"), "3", "the whole history on the host");
    const now = snapshot(h);
    assert.deepEqual(now.refs, [...before.refs, `refs/heads/demesne/shallow-1 ${b.head}`].sort());
    now.refs = before.refs;
    assert.deepEqual(now, before, "work tree, index, HEAD, config and hooks untouched");
    // a shallow host clone: refused without a depth, taken with one its history reaches
    const s = path.join(allowed, "proj-depth-shallow");
    git(allowed, "clone", "-q", "--depth", "1", `file://${h}`, s);
    const refused = await call("sandbox_script", { repository: s, image: "base", command: "true" });
    assert.equal(refused.isError, true);
    assert.match(refused.content[0].text, /^repository: .* is a shallow clone, .*; give a depth/);
    const deep = await call("sandbox_script", { repository: s, depth: 2, image: "base", command: "true" });
    assert.equal(deep.isError, true);
    assert.match(deep.content[0].text, /^depth: .* has 1 commit\(s\) of history .*, fewer than the 2 asked for/);
    writeFileSync(path.join(s, "dirty.txt"), "d\n");
    const sBefore = snapshot(s);
    const r2 = await ok("sandbox_script", { repository: s, depth: 1, include_uncommitted: true, image: "base",
      egress: "none", command: "git rev-list --count HEAD && echo t > t.txt && git add t.txt && git commit -qm t" });
    assert.equal(r2.stdout.trim(), "2", "its HEAD and demesne's commit of the uncommitted file on top");
    assert.equal(r2.branch.error, undefined, JSON.stringify(r2.branch));
    assert.equal(git(s, "rev-parse", `${r2.branch.base}^`), sBefore.head, "demesne's commit on the host's HEAD");
    assert.deepEqual(r2.branch.commits.map((c) => c.subject), ["t"]);
    assert.equal(git(s, "rev-parse", "--is-shallow-repository"), "true");
    const sNow = snapshot(s);
    sNow.refs = sBefore.refs;
    assert.deepEqual(sNow, sBefore, "the shallow host clone untouched but for the branch");
    // sandbox_create takes a depth too (its clone is made once it runs)
    const c = await ok("sandbox_create", { repository: h, depth: 1, branch: "shallow-c", image: "base", egress: "none" });
    const e = await ok("sandbox_exec", { sandbox_id: c.sandbox_id, cwd: c.repository.path,
      command: "git rev-list --count HEAD && echo c > c.txt && git add c.txt && git commit -qm c" });
    assert.equal(e.stdout.trim(), "1");
    const d = await ok("sandbox_destroy", { sandbox_id: c.sandbox_id });
    assert.equal(d.branch.error, undefined, JSON.stringify(d.branch));
    assert.equal(git(h, "rev-parse", `${d.branch.head}^`), before.head);
  });

test("a tree child with repository: true clones its parent's shallow clone, and its branch comes back", async () => {
  const h = makeRepo("proj-depth-tree");
  const before = snapshot(h);
  const child = `python3 /in/tree/mcp-client.py sandbox_script '${JSON.stringify({ name: "kid", repository: true,
    command: "git rev-list --count HEAD > /out/count.txt && echo k > k.txt && git add k.txt && git commit -qm kid" })}'`
    + " > /out/kid.json";
  const r = await ok("sandbox_script", { repository: h, depth: 1, branch: "sorch", mcp: true, image: "default",
    egress: "none", directories: [path.join(ROOT, "tests/fixtures/tree")], command: [
      "set -e", "echo plan > plan.txt", "git add plan.txt", "git commit -qm 'root: plan'", child,
    ].join("\n") });
  assert.equal(r.exit_code, 0, r.stderr);
  assert.equal(r.branch.error, undefined, JSON.stringify(r.branch));
  const res = JSON.parse(readFileSync(path.join(r.output_dir, "kid.json"), "utf8"));
  assert.equal(res.exit_code, 0, JSON.stringify(res));
  assert.equal(readFileSync(path.join(r.output_dir, "child", "kid", "count.txt"), "utf8").trim(), "2",
    "the parent's commit on its one commit of history");
  assert.equal(res.branch.error, undefined, JSON.stringify(res.branch));
  assert.deepEqual(res.branch.commits.map((x) => x.subject), ["kid"]);
  assert.equal(git(h, "log", "--format=%s", "-n", "3", "demesne/sorch--kid"), "kid\nroot: plan\nsecond");
  const now = snapshot(h);
  assert.equal(now.refs.length, before.refs.length + 2, "the root's branch and the child's");
  now.refs = before.refs;
  assert.deepEqual(now, before);
});

test("sandbox_create with a repository: hand_back on demand, then at destroy the same branch moves on", async () => {
  const h = makeRepo("proj3");
  const before = snapshot(h);
  const c = await ok("sandbox_create", { repository: h, image: "base", egress: "none", branch: "long" });
  assert.equal(c.repository.path, "/workspace/proj3");
  assert.equal(c.repository.branch, "demesne/long");
  const e1 = await ok("sandbox_exec", { sandbox_id: c.sandbox_id, cwd: c.repository.path, hand_back: true,
    command: "echo 1 > one.txt && git add one.txt && git commit -qm one && git log --format=%s -n 1" });
  assert.equal(e1.stdout.trim(), "one");
  assert.equal(e1.branch.error, undefined, JSON.stringify(e1.branch));
  assert.deepEqual(e1.branch.commits.map((x) => x.subject), ["one"]);
  assert.equal(git(h, "rev-parse", "demesne/long"), e1.branch.head);
  // more work, part of it uncommitted; destroy takes it back and fast-forwards the branch
  await ok("sandbox_exec", { sandbox_id: c.sandbox_id, cwd: c.repository.path,
    command: "echo 2 > two.txt && git add two.txt && git commit -qm two && echo 3 > three.txt" });
  const d = await ok("sandbox_destroy", { sandbox_id: c.sandbox_id });
  assert.equal(d.status, "destroyed");
  assert.equal(d.branch.error, undefined, JSON.stringify(d.branch));
  assert.deepEqual(d.branch.commits.map((x) => x.subject),
    [`demesne: work left uncommitted at the end of run ${c.sandbox_id}`, "two", "one"]);
  assert.equal(git(h, "rev-parse", `${d.branch.head}~2`), e1.branch.head, "the same branch, moved on");
  assert.equal(git(h, "rev-parse", "demesne/long"), d.branch.head);
  assert.deepEqual(d.branch.diffstat, { files: 3, insertions: 3, deletions: 0 });
  const now = snapshot(h);
  assert.deepEqual(now.refs, [...before.refs, `refs/heads/demesne/long ${d.branch.head}`].sort());
  now.refs = before.refs;
  assert.deepEqual(now, before);
  assert.ok(!existsSync(path.join(work, "state", "repo", c.sandbox_id)), "its repository folder is gone");
  const noRepo = await ok("sandbox_create", { image: "base", egress: "none" });
  const refused = await call("sandbox_exec", { sandbox_id: noRepo.sandbox_id, command: "true", hand_back: true });
  assert.equal(refused.isError, true);
  assert.match(refused.content[0].text, /^hand_back: sandbox .* was not created with a repository/);
  await ok("sandbox_destroy", { sandbox_id: noRepo.sandbox_id });
});

test("sandbox_script with a repository in the background: the job's status carries the branch", async () => {
  const h = makeRepo("proj4");
  const j = await ok("sandbox_script", { repository: h, image: "base", egress: "none", background: true,
    command: "echo bg > bg.txt && git add bg.txt && git commit -qm bg" });
  const w = await ok("sandbox_wait", { job_id: j.job_id, timeout_seconds: 120 });
  assert.equal(w.status, "succeeded");
  assert.equal(w.branch.error, undefined, JSON.stringify(w.branch));
  assert.deepEqual(w.branch.commits.map((x) => x.subject), ["bg"]);
  assert.equal(git(h, "show", `${w.branch.branch}:bg.txt`), "bg");
});

test("a tree: three children with repository: true give three branches beside the root's", async () => {
  const h = makeRepo("proj5");
  const before = snapshot(h);
  const child = (n) => `python3 /in/tree/mcp-client.py sandbox_script '${JSON.stringify({ name: n, repository: true,
    command: `pwd > /out/pwd.txt && git log --format=%s -n 1 > /out/start.txt && echo ${n} > ${n}.txt && `
      + `git add ${n}.txt && git commit -qm try-${n}` })}' > /out/${n}.json`;
  const r = await ok("sandbox_script", { repository: h, branch: "orch", mcp: true, image: "default", egress: "none",
    directories: [path.join(ROOT, "tests/fixtures/tree")], command: [
      "set -e", "echo plan > plan.txt", "git add plan.txt", "git commit -qm 'root: plan'",
      child("a"), child("b"), child("c"),
      // the orchestrator's own branch merges two of its children's (their clones share /workspace)
      "git fetch -q /workspace/proj5--a HEAD && git merge -q --ff-only FETCH_HEAD",
      "git fetch -q /workspace/proj5--b HEAD && git merge -q --no-edit -m 'root: merge b' FETCH_HEAD",
    ].join("\n") });
  assert.equal(r.exit_code, 0, r.stderr);
  assert.equal(r.branch.error, undefined, JSON.stringify(r.branch));
  assert.deepEqual(r.branch.commits.map((x) => x.subject).sort(), ["root: merge b", "root: plan", "try-a", "try-b"]);
  assert.deepEqual(["a", "b"].map((n) => git(h, "show", `demesne/orch:${n}.txt`)), ["a", "b"], "the children's work merged");
  assert.equal(git(h, "ls-tree", "--name-only", "demesne/orch", "c.txt"), "", "not c's");
  for (const n of ["a", "b", "c"]) {
    const out = path.join(r.output_dir, "child", n);
    const res = JSON.parse(readFileSync(path.join(r.output_dir, `${n}.json`), "utf8"));
    assert.equal(res.exit_code, 0, JSON.stringify(res));
    assert.equal(readFileSync(path.join(out, "pwd.txt"), "utf8").trim(), `/workspace/proj5--${n}`);
    assert.equal(readFileSync(path.join(out, "start.txt"), "utf8").trim(), "root: plan", "from the parent's commit");
    assert.equal(res.branch.error, undefined, JSON.stringify(res.branch));
    assert.equal(res.branch.branch, `demesne/orch--${n}`);
    assert.deepEqual(res.branch.commits.map((x) => x.subject), [`try-${n}`], "its own work against its base");
    assert.equal(git(h, "log", "--format=%s", "-n", "2", `demesne/orch--${n}`), `try-${n}\nroot: plan`);
  }
  const now = snapshot(h);
  assert.equal(now.refs.length, before.refs.length + 4, "the root's branch and three children's");
  now.refs = before.refs;
  assert.deepEqual(now, before);
});

test("demesne branches lists the branches demesne made, with run, status and diffstat, and deletes them", async () => {
  const h = makeRepo("proj6");
  const before = snapshot(h);
  const r = await ok("sandbox_script", { repository: h, image: "base", egress: "none", branch: "listed",
    command: "echo x > x.txt && echo y > y.txt && git add . && git commit -qm xy" });
  assert.equal(r.branch.error, undefined, JSON.stringify(r.branch));
  const cli = (...args) => JSON.parse(execFileSync(BIN, ["branches", ...args], { env: serverEnv(env), encoding: "utf8" }));
  const listed = cli(h, "--json");
  assert.equal(listed.repository, h);
  assert.deepEqual(listed.branches.map((b) => [b.name, b.run_id, b.status, b.head, b.merged]),
    [["demesne/listed", r.run_id, "ended", r.branch.head, false]]);
  assert.deepEqual(listed.branches[0].diffstat, { files: 2, insertions: 2, deletions: 0 });
  const out = execFileSync(BIN, ["branches", h, "--delete", "listed"], { env: serverEnv(env), encoding: "utf8" });
  assert.equal(out, "deleted demesne/listed\n");
  assert.deepEqual(cli(h, "--json").branches, []);
  assert.deepEqual(snapshot(h).refs, before.refs, "and nothing else went");
});

test("a background repository run re-attached by a new server after SIGKILL still hands its branch back", async () => {
  const h = makeRepo("proj7");
  const before = snapshot(h);
  const state = { ...env, DEMESNE_STATE_DIR: path.join(work, "state-restart") };
  const a = await connect({ env: state, fixtures: false });
  const started = await a.client.callTool({ name: "sandbox_script", arguments: { repository: h, image: "base",
    egress: "none", background: true, branch: "survivor",
    command: "sleep 4 && echo s > s.txt && git add s.txt && git commit -qm survived" } }, undefined, LONG);
  assert.ok(!started.isError, started.content?.[0]?.text);
  const job = started.structuredContent.job_id;
  const exited = new Promise((resolve) => a.transport._process.once("exit", resolve));
  process.kill(a.transport.pid, "SIGKILL");
  await exited;
  await a.client.close().catch(() => {});
  const b = await connect({ env: state, fixtures: false });
  try {
    const w = await b.client.callTool({ name: "sandbox_wait", arguments: { job_id: job, timeout_seconds: 120 } },
      undefined, LONG);
    const r = w.structuredContent;
    assert.equal(r.status, "succeeded", JSON.stringify(r));
    assert.equal(r.branch?.error, undefined, JSON.stringify(r.branch));
    assert.deepEqual(r.branch.commits.map((x) => x.subject), ["survived"]);
    assert.equal(git(h, "show", "demesne/survivor:s.txt"), "s");
    const now = snapshot(h);
    now.refs = before.refs;
    assert.deepEqual(now, before);
  } finally {
    await b.client.close();
  }
});

test("a run that times out, or a background run that is cancelled, still hands back what it committed and left", async () => {
  const h = makeRepo("proj8");
  const r = await ok("sandbox_script", { repository: h, image: "base", egress: "none", timeout_seconds: 2,
    branch: "timed-out", command: "echo t > t.txt && git add t.txt && git commit -qm before-timeout && echo u > u.txt && sleep 60" });
  assert.equal(r.timed_out, true);
  assert.equal(r.branch.error, undefined, JSON.stringify(r.branch));
  assert.deepEqual(r.branch.commits.map((x) => x.subject),
    [`demesne: work left uncommitted at the end of run ${r.run_id}`, "before-timeout"]);
  const j = await ok("sandbox_script", { repository: h, image: "base", egress: "none", background: true,
    branch: "cancelled", command: "echo c > c.txt && git add c.txt && git commit -qm before-cancel && touch /out/ready && sleep 120" });
  for (let i = 0; i < 240 && !existsSync(path.join(j.output_dir, "ready")); i++) await new Promise((res) => setTimeout(res, 250));
  await ok("sandbox_cancel", { job_id: j.job_id });
  const w = await ok("sandbox_wait", { job_id: j.job_id, timeout_seconds: 60 });
  assert.equal(w.status, "cancelled");
  assert.equal(w.branch?.error, undefined, JSON.stringify(w.branch));
  assert.deepEqual(w.branch.commits.map((x) => x.subject), ["before-cancel"]);
  assert.equal(git(h, "show", "demesne/cancelled:c.txt"), "c");
});

test("a foreground run whose call is cancelled still hands back what it committed and left", async () => {
  const h = makeRepo("proj9");
  const out = path.join(work, "out");
  const before = new Set(existsSync(out) ? readdirSync(out) : []);
  const ac = new AbortController();
  const call = conn.client.callTool({ name: "sandbox_script", arguments: { repository: h, image: "base", egress: "none",
    branch: "fg-cancelled", command: "echo f > f.txt && git add f.txt && git commit -qm before-cancel && echo g > g.txt "
      + "&& touch /out/ready && sleep 120" } }, undefined, { signal: ac.signal, timeout: 600_000 });
  let dir;
  for (let i = 0; i < 480 && !dir; i++) {
    await new Promise((res) => setTimeout(res, 250));
    dir = readdirSync(out).find((d) => !before.has(d) && existsSync(path.join(out, d, "ready")));
  }
  assert.ok(dir, "the run started and committed");
  ac.abort();
  await assert.rejects(call);
  // the branch lands in the host repository although nobody gets the answer
  let head = "";
  for (let i = 0; i < 120 && !head; i++) {
    await new Promise((res) => setTimeout(res, 250));
    try { head = git(h, "rev-parse", "--verify", "--quiet", "refs/heads/demesne/fg-cancelled"); } catch { head = ""; }
  }
  assert.ok(head, "the branch came back");
  assert.deepEqual(git(h, "log", "--format=%s", "demesne/fg-cancelled").split("\n").slice(0, 2),
    [`demesne: work left uncommitted at the end of run ${dir}`, "before-cancel"]);
  assert.equal(git(h, "show", "demesne/fg-cancelled:g.txt"), "g", "what it left uncommitted too");
});
