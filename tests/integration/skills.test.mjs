// Every shipped skill end to end: a scripted loopback vendor (scripted-vendor.mjs) plays the
// orchestrator through the skill's procedure with the real Claude Code CLI in its real image
// (Codex for one reviewer of demesne-build-and-land), on a real engine (Podman in CI), with
// real child sandboxes in the images the skill names. The calls the orchestrator makes are
// the skill's own call blocks, read from its SKILL.md, with their <templates> filled (and a
// PLAN:<id> marker appended to a child agent's prompt so the vendor knows which plan plays
// it); every call block of the skill must be played, or be named as one a scenario skips.
// Each test then asserts the skill's output contract (the files exist and have the declared
// shape) and that the tree ran as the procedure says: the children and their names, kinds
// and statuses in results.json, and a sandbox_wait on every background child.
//
// These tests prove the plumbing each skill relies on, not the quality of a model's work:
// every answer is scripted.
//
// DEMESNE_SKILL_TESTS=0 skips the file (tests/run runs it on Podman only, where the working
// images are built); DEMESNE_SKILL_TEST=<skill> runs one skill.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect, engineContainers, engineRequest, ROOT } from "./helpers.mjs";
import { startVendor, jobOf, stillRunning, statusOf } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SKIP = process.env.DEMESNE_SKILL_TESTS === "0" ? "DEMESNE_SKILL_TESTS=0" : false;
const ONLY = process.env.DEMESNE_SKILL_TEST;
const work = mkdtempSync(path.join(tmpdir(), "demesne-skills-"));
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 900_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const read = (...p) => readFileSync(path.join(...p), "utf8");
const readJson = (...p) => JSON.parse(read(...p));
const firstLine = (s) => s.split("\n")[0];

let vendor;
let conn;

// ---- the skill's text --------------------------------------------------------------------

/** A shipped skill: its SKILL.md, its call blocks, and which of them a test has played. */
class Skill {
  constructor(name) {
    this.name = name;
    this.text = readFileSync(path.join(ROOT, "skills", name, "SKILL.md"), "utf8");
    this.blocks = [];
    const lines = this.text.split("\n");
    for (let i = 0; i < lines.length; i++) {
      const open = lines[i].match(/^(\s*)```call (host|child)\s*$/);
      if (!open) continue;
      const body = [];
      let j = i + 1;
      for (; j < lines.length && !/^\s*```\s*$/.test(lines[j]); j++) body.push(lines[j]);
      const m = body.join("\n").match(/^\s*([\w.-]+)([\s\S]*)$/);
      this.blocks.push({ surface: open[2], tool: m[1], args: JSON.parse(m[2].trim() || "{}"), line: i + 1 });
      i = j;
    }
    this.used = new Set();
  }

  /** The call block of `tool` on `surface` (with args.name `name`, when given). */
  block(surface, tool, name) {
    const b = this.blocks.find((x) => x.surface === surface && x.tool === tool && (name === undefined || x.args.name === name));
    assert.ok(b, `${this.name}: no \`\`\`call ${surface} block for ${tool}${name ? ` named ${name}` : ""}`);
    this.used.add(b);
    return b;
  }

  /** A section of the body, from its "## " heading to the next. */
  section(title) {
    const m = this.text.match(new RegExp(`\\n(## ${title}\\n[\\s\\S]*?)(?=\\n## |$)`));
    assert.ok(m, `${this.name}: no section ${title}`);
    return m[1];
  }

  /** Every child call block has been played, except those `skipped` (by name or tool). */
  assertCovered(skipped = []) {
    const missing = this.blocks.filter((b) => b.surface === "child" && !this.used.has(b)
      && !skipped.includes(b.args.name || b.tool));
    assert.deepEqual(missing.map((b) => `${b.tool} ${b.args.name || ""} (line ${b.line})`), [],
      `${this.name}: call blocks the scenario did not play`);
  }
}

// Replaces every <template> in the strings of `v`: fills[key] (a value or ctx => value), else
// "job_id of X" is the job of step X; an unknown template is an error of the scenario.
function fillDeep(v, fills, ctx) {
  if (typeof v === "string") {
    return v.replace(/<([^<>]*)>/g, (_, key) => {
      if (key in fills) return String(typeof fills[key] === "function" ? fills[key](ctx) : fills[key]);
      const job = key.match(/^job_id of (.+)$/);
      if (job && ctx) return ctx.job(job[1]);
      throw new Error(`no value for the template <${key}>`);
    });
  }
  if (Array.isArray(v)) return v.map((x) => fillDeep(x, fills, ctx));
  if (v && typeof v === "object") return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, fillDeep(x, fills, ctx)]));
  return v;
}
// Replaces `from` by `to` in every string of `v` (a block shown for one child, played for another).
function replaceDeep(v, from, to) {
  if (typeof v === "string") return v.split(from).join(to);
  if (Array.isArray(v)) return v.map((x) => replaceDeep(x, from, to));
  if (v && typeof v === "object") return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, replaceDeep(x, from, to)]));
  return v;
}

/**
 * A step that plays the skill's child call block of `tool` named `name`: as another child
 * (`as`, and more `replace` pairs of [from, to] in its strings), with templates filled
 * (`fill`), a child agent's plan marker (`plan`), and a last `edit(args, ctx)`.
 */
function spawn(skill, tool, name, o = {}) {
  const b = skill.block("child", tool, name);
  const id = o.as || name;
  return { id, tool, again: o.again, next: o.next, args: (ctx) => {
    let a = structuredClone(b.args);
    if (o.as) a = replaceDeep(a, name, o.as);
    for (const [from, to] of o.replace || []) a = replaceDeep(a, from, to);
    a = fillDeep(a, o.fill || {}, ctx);
    if (o.plan) a.prompt = `${a.prompt}\n\nPLAN:${o.plan}`;
    return o.edit ? o.edit(a, ctx) : a;
  } };
}

/** A sandbox_wait on the job of step `of`, played from the skill's wait block, repeated while running. */
function wait(skill, of) {
  const b = skill.block("child", "sandbox_wait");
  const key = JSON.stringify(b.args).match(/<(job_id of [^<>]*)>/)[1];
  return { id: `wait-${of}`, tool: "sandbox_wait", again: stillRunning,
    args: (ctx) => fillDeep(b.args, { [key]: (c) => c.job(of) }, ctx) };
}

const sh = (shell, o = {}) => ({ shell, ...o });

/** A child agent's plan: shell commands, then a final answer. */
function agentPlan(id, ...commands) {
  return vendor.plan(id, [...commands.map((c) => sh(c)), { final: `${id} done` }], { input: 300, output: 30 });
}

// ---- running a skill ------------------------------------------------------------------------

/**
 * Launches the skill's orchestrator from its host call block (the prompt holding the task
 * and the skill's Procedure and Output contract, as the Launch section says), waits for it
 * with the host wait block, and returns {out, started, done, plan, results}.
 */
async function runSkill(skill, { task, fill = {}, steps }) {
  const planId = vendor.plan(`${skill.name}-orch`, [...steps, { final: "orchestrated" }], { input: 1000, output: 100 });
  const launch = skill.block("host", "sandbox_agent");
  const sections = `${skill.section("Procedure")}\n${skill.section("Output contract")}`;
  // the prompt's first template is the task the user's agent writes
  const launchArgs = structuredClone(launch.args);
  launchArgs.prompt = launchArgs.prompt.replace(/<[^<>]*>/, "\u0000task\u0000");
  const args = fillDeep(launchArgs, { ...fill, "this skill's Procedure and Output contract sections": sections });
  args.prompt = `${args.prompt.replace("\u0000task\u0000", task)}\n\nPLAN:${planId}`;
  // (the prompt holds the procedure, templates and all, for the orchestrator to read)
  for (const k of Object.keys(args)) if (k !== "prompt" && /<[^<>]*>/.test(JSON.stringify(args[k]))) throw new Error(`unfilled ${k}`);
  const started = await call("sandbox_agent", args);
  assert.equal(started.status, "running", "the orchestrator runs in the background");
  const hostWait = skill.block("host", "sandbox_wait");
  let done;
  for (let i = 0; i < 20; i++) {
    done = await call("sandbox_wait", fillDeep(hostWait.args, { "job_id of the orchestrator": started.job_id }));
    if (done.status !== "running") break;
  }
  const p = vendor.plans.get(planId);
  const out = started.output_dir;
  const diag = () => `\n${JSON.stringify(p.taken.map((t, i) => ({ step: t.id ?? t.index, tool: t.tool, shell: t.shell?.slice(0, 200),
    result: (p.results[i] || "").slice(0, 600) })), null, 1).slice(-12000)}\n${p.error || ""}\n${conn.stderr().slice(-3000)}`;
  assert.equal(done.status, "succeeded", `the orchestrator: ${JSON.stringify(done).slice(0, 2000)}${diag()}`);
  assert.ok(!p.error, p.error);
  const last = p.taken[p.taken.length - 1];
  assert.equal(last.final, "orchestrated", `the orchestrator played its plan to the end${diag()}`);
  for (const [i, r] of p.results.entries()) {
    assert.doesNotMatch(r, /requires approval|permission to use|not allowed/i, `step ${i}: ${r.slice(0, 500)}`);
  }
  return { out, started, done, plan: p, diag };
}

async function call(name, args) {
  const res = await conn.client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name}: ${res.content?.[0]?.text}\n${conn.stderr().slice(-4000)}`);
  return res.structuredContent;
}

/**
 * The tree as the procedure says: results.json lists exactly `children` ([name, kind,
 * status]), and every child started in the background was waited on until it ended.
 */
function assertTree(r, children) {
  const results = readJson(r.out, "results.json");
  const got = (results.children || []).map((c) => [c.name, c.kind, c.status]).sort();
  assert.deepEqual(got, [...children].sort(), `the children of the orchestrator${r.diag()}`);
  const { taken, results: texts } = r.plan;
  const background = taken.map((t, i) => (t.tool && t.tool !== "sandbox_wait" && t.args?.background ? jobOf(texts[i]) : null))
    .filter(Boolean);
  assert.ok(background.length > 0 || children.every((c) => c[1] === "script"), "background children were started");
  for (const job of background) {
    const waits = taken.map((t, i) => (t.tool === "sandbox_wait" && t.args.job_id === job ? texts[i] : null)).filter((x) => x !== null);
    assert.ok(waits.length > 0, `job ${job} was waited on`);
    assert.ok(statusOf(waits[waits.length - 1]), `the last wait on ${job} saw it end: ${waits[waits.length - 1]}`);
  }
  // every spawn's name is unique, as the habits say
  const names = taken.filter((t) => t.args?.name).map((t) => t.args.name);
  assert.equal(new Set(names).size, names.length, `unique child names: ${names}`);
  return results;
}

const exitOf = (text) => Number((text || "").match(/"?exit_code"?\s*[:=]\s*(-?\d+)/)?.[1]);
const isPng = (file) => readFileSync(file).subarray(0, 8).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));
const pngWidth = (file) => readFileSync(file).readUInt32BE(16);
const git = (cwd, ...a) => execFileSync("git", ["-c", "user.name=t", "-c", "user.email=t@localhost", ...a], { cwd, encoding: "utf8" }).trim();

function makeRepo(name, files) {
  const dir = path.join(work, "inputs", name);
  for (const [rel, data] of Object.entries(files)) {
    mkdirSync(path.dirname(path.join(dir, rel)), { recursive: true });
    writeFileSync(path.join(dir, rel), data);
  }
  git(dir, "init", "-q");
  git(dir, "add", "-A");
  git(dir, "commit", "-qm", "start");
  return dir;
}

// ---- the engine and the server --------------------------------------------------------------

const engine = (method, p) => engineRequest(ENGINE, method, p);
async function containersUnder(dir) {
  return (await engineContainers(ENGINE)).filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(dir));
}

before(async () => {
  if (SKIP) return;
  vendor = await startVendor({ secret: SECRET });
  conn = await connect({ fixtures: false, env: {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_ALLOWED_PATHS: path.join(work, "inputs"),
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendor.port}/openai/v1`,
    CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
    DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "2", DEMESNE_JOBS_POLL_INTERVAL: "0.5",
  } });
});

after(async () => {
  if (SKIP) return;
  await conn?.client.close();
  await vendor?.close();
  const left = await containersUnder(work);
  for (const c of left) await engine("DELETE", `/containers/${c.Id}?force=true`);
  if (!process.env.DEMESNE_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

function skillTest(name, fn) {
  const skip = SKIP || (ONLY && ONLY !== name ? `DEMESNE_SKILL_TEST=${ONLY}` : false);
  test(name, { timeout: 900_000, skip }, () => fn(new Skill(name)));
}

// ---- the skills -----------------------------------------------------------------------------

skillTest("demesne-bisect-hunt", async (skill) => {
  const repo = path.join(work, "inputs", "bisect-repo");
  mkdirSync(repo, { recursive: true });
  git(repo, "init", "-q");
  const shas = [];
  for (let i = 1; i <= 8; i++) {
    writeFileSync(path.join(repo, "value.txt"), `${i < 5 ? "pass" : "fail"} ${i}\n`);
    git(repo, "add", "-A");
    git(repo, "commit", "-qm", `commit ${i}`);
    shas.push(git(repo, "rev-parse", "HEAD"));
  }
  const [good, bad, culprit] = [shas[0], shas[7], shas[4]];
  const check = "grep -q pass value.txt";
  const shaOf = (text) => (text || "").match(/\[([0-9a-f]{40})\]/)?.[1] || "no-commit-named";
  const explain = agentPlan("bisect-explain",
    "test -s /workspace/culprit.patch && grep -q fail /workspace/culprit.patch && "
    + "printf '# Why\\nvalue.txt says fail from this commit on.\\n' > /out/EXPLANATION.md");
  const before = { head: git(repo, "rev-parse", "HEAD"), status: git(repo, "status", "--porcelain") };
  const r = await runSkill(skill, {
    task: `Good revision ${good}, bad revision ${bad}, check command: ${check} (image default). Fix it too.`,
    fill: { "absolute path of the repository": repo },
    steps: [
      sh("git clone -q \"$DEMESNE_REPO_PATH\" /workspace/repo && git -C /workspace/repo log --oneline | wc -l"),
      spawn(skill, "sandbox_script", "probe-good", { fill: { "good revision": good, "check command": check } }),
      spawn(skill, "sandbox_script", "probe-good", { as: "probe-bad", fill: { "good revision": bad, "check command": check } }),
      wait(skill, "probe-good"),
      wait(skill, "probe-bad"),
      sh(`cat /out/child/probe-good/verdict /out/child/probe-bad/verdict; cd /workspace/repo && git bisect start ${bad} ${good}`),
      spawn(skill, "sandbox_script", "probe-<first 10 hex digits of the commit>", {
        fill: {
          "first 10 hex digits of the commit": (c) => shaOf(c.last).slice(0, 10),
          commit: (c) => shaOf(c.last), "check command": check,
        } }),
      sh((c) => {
        const v = exitOf(c.last) === 0 ? "good" : "bad";
        return `cd /workspace/repo && printf '{"commit": "%s", "exit_code": %d, "verdict": "${v}"}\\n' "$(git rev-parse HEAD)" `
          + `${exitOf(c.last)} >> /out/probes.jsonl && git bisect ${v}`;
      }, { id: "verdict", next: (r) => (/is the first bad commit/.test(r) ? undefined : "probe-<first 10 hex digits of the commit>") }),
      sh("cd /workspace/repo && git show --stat --patch refs/bisect/bad > /out/culprit.patch && git bisect log > /out/bisect.log "
        + "&& cp /out/culprit.patch /workspace/culprit.patch "
        + "&& cp /out/child/probe-$(git rev-parse refs/bisect/bad | cut -c1-10)/check.log /workspace/culprit-check.log"),
      spawn(skill, "sandbox_agent", "explain", { plan: explain }),
      // the fix: made in the orchestrator's clone, checked on a copy, committed on its branch
      sh("cd \"$DEMESNE_REPO_PATH\" && sed -i 's/^fail/pass/' value.txt && git diff --stat"),
      spawn(skill, "sandbox_script", "probe-fix", { fill: { "path of your clone": "/workspace/bisect-repo", "check command": check } }),
      sh((c) => `test ${exitOf(c.last)} = 0 && git -C "$DEMESNE_REPO_PATH" commit -qam "Fix: value.txt says pass again"`),
      sh("cd /workspace/repo && b=$(git rev-parse refs/bisect/bad) && "
        + "{ echo \"first bad commit: $b $(git log -1 --format=%s $b)\"; echo; echo \"probes: $(wc -l < /out/probes.jsonl)\"; "
        + "cat /out/probes.jsonl; echo; cat /out/child/explain/EXPLANATION.md; echo 'fix: verified'; } > /out/BISECT.md && "
        + "cp /out/child/explain/EXPLANATION.md /out/"),
    ],
  });
  // the output contract
  assert.equal(firstLine(read(r.out, "BISECT.md")), `first bad commit: ${culprit} commit 5`);
  const probes = read(r.out, "probes.jsonl").trim().split("\n").map((l) => JSON.parse(l));
  assert.ok(probes.length >= 2 && probes.length <= 4, `probes: ${JSON.stringify(probes)}`);
  for (const p of probes) {
    const i = shas.indexOf(p.commit);
    assert.ok(i > 0 && i < 7, `a probed commit lies inside the range: ${p.commit}`);
    assert.equal(p.verdict, i < 4 ? "good" : "bad", `the verdict of commit ${i + 1}`);
    assert.equal(p.exit_code === 0, i < 4);
  }
  assert.match(read(r.out, "culprit.patch"), new RegExp(`^commit ${culprit}[\\s\\S]*\\+fail 5`));
  assert.match(read(r.out, "bisect.log"), /git bisect start/);
  assert.match(read(r.out, "EXPLANATION.md"), /says fail/);
  // the fix came back as the orchestrator's branch in the host repository, nothing else
  const lines = read(r.out, "BISECT.md").trim().split("\n");
  assert.equal(lines[lines.length - 1], "fix: verified");
  const b = r.done.branch;
  assert.equal(b?.error, undefined, JSON.stringify(b));
  assert.equal(b.base, bad, "from the host's HEAD, the bad revision");
  assert.deepEqual(b.commits.map((c) => c.subject), ["Fix: value.txt says pass again"]);
  assert.deepEqual(b.diffstat, { files: 1, insertions: 1, deletions: 1 });
  assert.equal(git(repo, "show", `${b.branch}:value.txt`), "pass 8");
  assert.deepEqual({ head: git(repo, "rev-parse", "HEAD"), status: git(repo, "status", "--porcelain") }, before,
    "the host's HEAD and work tree are untouched");
  assert.equal(read(r.out, "child/probe-fix/verdict").trim(), "0", "the fix passed the check");
  // the tree: two end probes in the background, one probe per bisect step, one explainer, the fix's probe
  const children = [["probe-good", "script", "succeeded"], ["probe-bad", "script", "failed"], ["explain", "agent", "succeeded"],
    ["probe-fix", "script", "succeeded"]];
  for (const p of probes) {
    const i = shas.indexOf(p.commit);
    children.push([`probe-${p.commit.slice(0, 10)}`, "script", i < 4 ? "succeeded" : "failed"]);
  }
  assertTree(r, children);
  assert.equal(read(r.out, "child/probe-good/verdict").trim(), "0");
  assert.equal(read(r.out, "child/probe-bad/verdict").trim(), "1");
  skill.assertCovered();
});

skillTest("demesne-benchmark-compare", async (skill) => {
  const repo = makeRepo("bench-repo", { "bench.sh": "echo warming up\necho 2.0\n" });
  const baseline = git(repo, "rev-parse", "HEAD");
  writeFileSync(path.join(repo, "bench.sh"), "echo warming up\necho 1.0\n");
  git(repo, "commit", "-qam", "faster");
  const candidate = git(repo, "rev-parse", "HEAD");
  const build = "echo built > built.txt";
  const bench = "test -f built.txt && sh bench.sh";
  const toCandidate = [["baseline", "candidate"]];
  const run = (version, i) => spawn(skill, "sandbox_script", "run-baseline-1", {
    as: `run-${version}-${i}`, replace: version === "candidate" ? toCandidate : [], fill: { "benchmark command": bench } });
  const r = await runSkill(skill, {
    task: `Baseline ${baseline}, candidate ${candidate}; build: ${build}; benchmark: ${bench} (seconds, lower is better); 2 runs per version; image default.`,
    fill: { "absolute path of the repository": repo },
    steps: [
      sh(`cp -r /in/bench-repo /workspace/baseline && git -C /workspace/baseline checkout -q ${baseline} && `
        + `cp -r /in/bench-repo /workspace/candidate && git -C /workspace/candidate checkout -q ${candidate}`),
      spawn(skill, "sandbox_script", "build-baseline", { fill: { "build command": build } }),
      spawn(skill, "sandbox_script", "build-baseline", { as: "build-candidate", replace: toCandidate, fill: { "build command": build } }),
      wait(skill, "build-baseline"),
      wait(skill, "build-candidate"),
      run("baseline", 1), run("candidate", 1), run("baseline", 2), run("candidate", 2),
      spawn(skill, "sandbox_script", "stats", { fill: { "lower|higher": "lower" } }),
      sh("mkdir -p /out/runs && cp /out/child/stats/results.json /out/RESULTS.json && "
        + "for d in /out/child/run-*; do cp $d/run.log /out/runs/$(basename $d).log; done && "
        + "node -e 'const r=require(\"/out/RESULTS.json\");const p=Math.round(Math.abs(1-r.ratio)*100);"
        + "require(\"fs\").writeFileSync(\"/out/BENCHMARK.md\",`candidate is ${r.candidate_is} by ${p}%\\n\\nmedians: ${JSON.stringify(r.median)}\\nratio: ${r.ratio}\\n`)'"),
    ],
  });
  const res = readJson(r.out, "RESULTS.json");
  assert.deepEqual(res.runs, { baseline: [2, 2], candidate: [1, 1] }, "each version's runs, from their own sandboxes");
  assert.deepEqual(res.median, { baseline: 2, candidate: 1 });
  assert.equal(res.ratio, 0.5);
  assert.equal(res.better, "lower");
  assert.equal(res.candidate_is, "faster");
  assert.equal(firstLine(read(r.out, "BENCHMARK.md")), "candidate is faster by 50%");
  for (const n of ["run-baseline-1", "run-baseline-2", "run-candidate-1", "run-candidate-2"]) {
    assert.equal(read(r.out, "runs", `${n}.log`), `warming up\n${n.includes("baseline") ? "2.0" : "1.0"}\n`);
  }
  assertTree(r, ["build-baseline", "build-candidate", "run-baseline-1", "run-candidate-1", "run-baseline-2", "run-candidate-2",
    "stats"].map((n) => [n, "script", "succeeded"]));
  // the measured runs never overlap: each is a blocking call, made after the one before returned
  const runs = r.plan.taken.filter((t) => t.tool === "sandbox_script" && /^run-/.test(t.args.name));
  assert.deepEqual(runs.map((t) => [t.args.name, Boolean(t.args.background)]),
    [["run-baseline-1", false], ["run-candidate-1", false], ["run-baseline-2", false], ["run-candidate-2", false]]);
  skill.assertCovered();
});

skillTest("demesne-build-and-land", async (skill) => {
  const repo = makeRepo("calc-repo", {
    "calc.py": "def add(a, b):\n    return a + b\n",
    "test_calc.py": "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
      + "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
  });
  const testCommand = "python3 -m unittest -q";
  const impl = agentPlan("land-impl",
    "cd /workspace/repo && printf '\\ndef mul(a, b):\\n    return a * b\\n' >> calc.py && "
    + "printf '\\n\\nclass M(unittest.TestCase):\\n    def test_mul(self):\\n        from calc import mul\\n        self.assertEqual(mul(2, 3), 6)\\n' >> test_calc.py && "
    + "printf '# Summary\\n- calc.py: mul(a, b)\\n- test_calc.py: a test of mul\\n' > /out/SUMMARY.md");
  const reviewA = agentPlan("land-review-a",
    "grep -q 'def mul' /workspace/impl.patch && printf 'verdict: fail\\n- calc.py:4: mul has no docstring; add one\\n' > /out/REVIEW.md");
  const reviewB = agentPlan("land-review-b",
    "grep -q 'def mul' /workspace/impl.patch && printf 'verdict: pass\\n' > /out/REVIEW.md");
  const fix = agentPlan("land-fix",
    "cd /workspace/repo && grep -q 'verdict: fail' /in/previous-jobs/review-a/REVIEW.md && "
    + "sed -i 's/^def mul(a, b):$/def mul(a, b):\\n    \"\"\"The product of a and b.\"\"\"/' calc.py && "
    + "printf -- '- calc.py:4: added a docstring\\n' > /out/FIXES.md");
  const capture = "cd /workspace/repo && git add -A && git diff --cached demesne-base > /workspace/impl.patch && grep -c '^diff --git' /workspace/impl.patch";
  const r = await runSkill(skill, {
    task: `Add mul(a, b) to calc.py, with a test. Test command: ${testCommand} (image default). Reviewer models: sonnet and gpt-5.6-luna.`,
    fill: { "absolute path of the repository": repo },
    steps: [
      sh("ln -sfn \"$DEMESNE_REPO_PATH\" /workspace/repo && cd /workspace/repo && git tag -f demesne-base && "
        + "printf '# Plan\\nmul(a, b) in calc.py; acceptance: mul(2, 3) == 6\\n' > /workspace/PLAN.md"),
      spawn(skill, "sandbox_agent", "impl", { plan: impl }),
      sh(capture),
      spawn(skill, "sandbox_agent", "review-a", { plan: reviewA, fill: { "reviewer model of the first provider": "sonnet" } }),
      spawn(skill, "sandbox_agent", "review-b", { plan: reviewB, fill: { "reviewer model of the second provider": "gpt-5.6-luna" } }),
      wait(skill, "review-a"),
      wait(skill, "review-b"),
      spawn(skill, "sandbox_agent", "fix", { plan: fix }),
      sh(capture),
      spawn(skill, "sandbox_script", "verify", { fill: { "test command": testCommand } }),
      sh("cd /workspace/repo && git add -A && git commit -qm 'Add mul(a, b), with a test' && "
        + "cp /out/child/impl/SUMMARY.md /out/SUMMARY.md && "
        + "cp /out/child/review-a/REVIEW.md /out/REVIEW-A.md && cp /out/child/review-b/REVIEW.md /out/REVIEW-B.md && "
        + "cp /out/child/fix/FIXES.md /out/FIXES.md && e=$(cat /out/child/verify/exit_code) && "
        + "{ if [ \"$e\" = 0 ]; then echo 'verdict: verified'; else echo 'verdict: failed'; fi; "
        + `echo 'command: ${testCommand}'; echo "exit code: $e"; tail -n 50 /out/child/verify/test.log; } > /out/VERIFY.md && `
        + "{ echo '# Add mul'; for c in impl review-a review-b fix verify; do echo \"- $c: succeeded\"; done; head -1 /out/VERIFY.md; } > /out/REPORT.md"),
    ],
  });
  // the change came back as the orchestrator's branch in the host repository, nothing else
  const b = r.done.branch;
  assert.equal(b?.error, undefined, JSON.stringify(b));
  assert.deepEqual(b.commits.map((c) => c.subject), ["Add mul(a, b), with a test"]);
  assert.deepEqual(b.diffstat, { files: 2, insertions: 10, deletions: 0 });
  const patch = git(repo, "diff", b.base, b.branch);
  assert.match(patch, /^\+def mul\(a, b\):\n\+    """The product of a and b\."""\n\+    return a \* b$/m, "the fixed change");
  assert.match(patch, /\+    def test_mul\(self\):/);
  assert.equal(git(repo, "status", "--porcelain"), "", "the host's work tree is untouched");
  assert.equal(git(repo, "rev-parse", "HEAD"), b.host_head);
  assert.match(read(r.out, "SUMMARY.md"), /mul\(a, b\)/);
  assert.equal(firstLine(read(r.out, "REVIEW-A.md")), "verdict: fail");
  assert.equal(firstLine(read(r.out, "REVIEW-B.md")), "verdict: pass");
  assert.match(read(r.out, "FIXES.md"), /docstring/);
  const verify = read(r.out, "VERIFY.md");
  assert.equal(firstLine(verify), "verdict: verified", verify);
  assert.match(verify, /^exit code: 0$/m);
  assert.match(read(r.out, "child/verify/test.log"), /Ran 2 tests/, "the repository's own tests ran in the script sandbox");
  assert.match(read(r.out, "REPORT.md"), /- verify: succeeded/);
  assertTree(r, [["impl", "agent", "succeeded"], ["review-a", "agent", "succeeded"], ["review-b", "agent", "succeeded"],
    ["fix", "agent", "succeeded"], ["verify", "script", "succeeded"]]);
  // the two reviewers ran on models of two providers: Claude Code and Codex
  assert.ok(readJson(r.out, "child/review-a/usage.json").models["claude-sonnet-5"], "review-a on Claude");
  assert.ok(readJson(r.out, "child/review-b/usage.json").models["gpt-5.6-luna"], "review-b on Codex");
  skill.assertCovered();
});

skillTest("demesne-migration-sweep", async (skill) => {
  const files = { "api.py": "def new_api(x):\n    return x\n" };
  for (let i = 0; i < 41; i++) files[`mods/mod${String(i).padStart(2, "0")}.py`] = `from api import new_api as old_api\n\n\ndef f():\n    return old_api(${i})\n`;
  const repo = makeRepo("sweep-repo", files);
  const pattern = "old_api\\(";
  const testCommand = "python3 -m compileall -q .";
  // a slice agent applies the migration to its files; slice-01's first run writes nothing (a
  // failed child by the skill's rule: no DONE.md), so the orchestrator retries it
  const slicePlan = (n) => agentPlan(`sweep-slice-${n}`,
    `cd /workspace/repo && for f in $(cat /workspace/slices/slice-${n}); do sed -i 's/old_api(/new_api(/; s/import new_api as old_api/import new_api/' $f && echo "$f changed"; done > /out/DONE.md`);
  const lazy = agentPlan("sweep-slice-01-lazy", "true");
  const slice = (n, plan, o = {}) => spawn(skill, "sandbox_agent", "slice-00", { as: o.as || `slice-${n}`,
    replace: [["slice-00", `slice-${n}`]], plan, edit: o.edit });
  const r = await runSkill(skill, {
    task: `Replace old_api( with new_api( everywhere (and import new_api itself). Pattern: ${pattern}. Test command: ${testCommand} (image default).`,
    fill: { "absolute path of the repository": repo },
    steps: [
      sh("ln -sfn \"$DEMESNE_REPO_PATH\" /workspace/repo && cd /workspace/repo && git tag -f demesne-base && "
        + "printf 'old: old_api(x)\\nnew: new_api(x)\\n' > /workspace/MIGRATION.md && "
        + `git grep -lE '${pattern}' > /workspace/files.txt && mkdir -p /workspace/slices && `
        + "split -l 20 -d -a 2 /workspace/files.txt /workspace/slices/slice- && ls /workspace/slices"),
      slice("00", slicePlan("00")),
      slice("01", lazy),
      slice("02", slicePlan("02")),
      wait(skill, "slice-00"), wait(skill, "slice-01"), wait(skill, "slice-02"),
      sh("for n in 00 01 02; do test -s /out/child/slice-$n/DONE.md && echo \"slice-$n ok\" || echo \"slice-$n failed\"; done"),
      { ...slice("01", slicePlan("01"), { as: "slice-01-retry" }), id: "slice-01-retry" },
      wait(skill, "slice-01-retry"),
      spawn(skill, "sandbox_script", "verify", { fill: { pattern, "test command": testCommand } }),
      sh("cd /workspace/repo && git add -A && git commit -qm 'Replace old_api with new_api' && "
        + "{ for n in 00 01 02; do d=/out/child/slice-$n; [ -s $d/DONE.md ] || d=/out/child/slice-$n-retry; "
        + "s=succeeded; r=no; [ $d = /out/child/slice-$n ] || r=yes; echo \"slice-$n | $(wc -l < /workspace/slices/slice-$n) files | $s | retried: $r\"; done; "
        + "for d in /out/child/slice-*; do [ -s $d/DONE.md ] && cat $d/DONE.md; done; } > /out/SLICES.md && "
        + "e=$(cat /out/child/verify/exit_code) && { if [ \"$e\" = 0 ] && [ ! -s /out/child/verify/leftovers.txt ]; then echo 'verdict: verified'; else echo 'verdict: failed'; fi; "
        + "cat /out/child/verify/leftovers.txt; tail -n 50 /out/child/verify/test.log; } > /out/VERIFY.md && "
        + "{ echo \"matched: $(wc -l < /workspace/files.txt)\"; echo \"changed: $(git -C /workspace/repo diff --name-only demesne-base | wc -l)\"; "
        + "echo \"left over: $(wc -l < /out/child/verify/leftovers.txt)\"; echo 'failed slices: none'; head -1 /out/VERIFY.md; } > /out/REPORT.md"),
    ],
  });
  const b = r.done.branch;
  assert.equal(b?.error, undefined, JSON.stringify(b));
  assert.deepEqual(b.commits.map((c) => c.subject), ["Replace old_api with new_api"]);
  assert.deepEqual(b.diffstat, { files: 41, insertions: 82, deletions: 82 }, "every matching file, on the branch");
  const patch = git(repo, "diff", b.base, b.branch);
  assert.equal(patch.match(/^diff --git/gm).length, 41, "every matching file is in the branch");
  assert.equal(git(repo, "status", "--porcelain"), "", "the host's work tree is untouched");
  assert.equal(patch.match(/^\+    return new_api\(\d+\)$/gm).length, 41);
  const slices = read(r.out, "SLICES.md").split("\n");
  assert.deepEqual(slices.slice(0, 3), ["slice-00 | 20 files | succeeded | retried: no",
    "slice-01 | 20 files | succeeded | retried: yes", "slice-02 | 1 files | succeeded | retried: no"]);
  assert.equal(firstLine(read(r.out, "VERIFY.md")), "verdict: verified");
  assert.equal(read(r.out, "child/verify/leftovers.txt"), "", "no old form is left");
  assert.match(read(r.out, "REPORT.md"), /^matched: 41\nchanged: 41\nleft over: 0\n/);
  assertTree(r, [["slice-00", "agent", "succeeded"], ["slice-01", "agent", "succeeded"], ["slice-02", "agent", "succeeded"],
    ["slice-01-retry", "agent", "succeeded"], ["verify", "script", "succeeded"]]);
  assert.ok(!existsSync(path.join(r.out, "child/slice-01/DONE.md")), "the first slice-01 owed its DONE.md: it was retried");
  skill.assertCovered();
});

skillTest("demesne-defect-survey", async (skill) => {
  const repo = makeRepo("survey-repo", { "parse.py": "def parse(s):\n    return int(s)\n", "README.md": "A parser.\n" });
  const lenses = ["correctness", "security", "resources", "errors", "tests"];
  const lensPlan = (lens, i) => agentPlan(`survey-${lens}`,
    `test -f /in/survey-repo/parse.py && printf '[{"file": "parse.py", "line": 2, "severity": "${["high", "medium", "low"][i % 3]}", `
    + `"title": "${lens} issue", "evidence": "int(s) raises on bad input", "lens": "${lens}"}]' > /out/findings.json`);
  const reduce = agentPlan("survey-reduce",
    "node -e 'const fs=require(\"fs\");const all=[];for(const d of fs.readdirSync(\"/in/previous-jobs\").filter(x=>x.startsWith(\"lens-\")).sort())"
    + "for(const f of JSON.parse(fs.readFileSync(`/in/previous-jobs/${d}/findings.json`)))all.push({...f,lens:[f.lens]});"
    + "const rank={high:0,medium:1,low:2};all.sort((a,b)=>rank[a.severity]-rank[b.severity]);"
    + "fs.writeFileSync(\"/out/defects.json\",JSON.stringify(all,null,1));"
    + "fs.writeFileSync(\"/out/DEFECTS.md\",\"| severity | where | title | lenses |\\n|---|---|---|---|\\n\"+all.map(f=>`| ${f.severity} | ${f.file}:${f.line} | ${f.title} | ${f.lens.join(\", \")} |`).join(\"\\n\")+\"\\n\")'");
  const lensStep = (lens, i) => spawn(skill, "sandbox_agent", "lens-correctness", { as: `lens-${lens}`,
    replace: [["correctness defects", `${lens} defects`], ['lens \\"correctness\\"', `lens \\"${lens}\\"`]], plan: lensPlan(lens, i) });
  const r = await runSkill(skill, {
    task: "Survey the parser before its release; all five lenses.",
    fill: { "absolute path of the repository": repo },
    steps: [
      sh("printf '# Scope\\nEverything but README.md. Findings: /out/findings.json, a JSON array of {file, line, severity, title, evidence, lens}.\\n' > /workspace/SCOPE.md"),
      ...lenses.map(lensStep),
      ...lenses.map((l) => wait(skill, `lens-${l}`)),
      spawn(skill, "sandbox_script", "validate"),
      spawn(skill, "sandbox_agent", "reduce", { plan: reduce }),
      sh("mkdir -p /out/lenses && cp /out/child/reduce/DEFECTS.md /out/child/reduce/defects.json /out/ && "
        + "for l in correctness security resources errors tests; do cp /out/child/lens-$l/findings.json /out/lenses/$l.json; done && "
        + "node -e 'const fs=require(\"fs\");const d=JSON.parse(fs.readFileSync(\"/out/defects.json\"));"
        + "const by={};for(const f of d)by[f.severity]=(by[f.severity]||0)+1;"
        + "fs.writeFileSync(\"/out/REPORT.md\",[\"correctness\",\"security\",\"resources\",\"errors\",\"tests\"].map(l=>`- ${l}: succeeded, ${JSON.parse(fs.readFileSync(`/out/lenses/${l}.json`)).length} finding(s)`).join(\"\\n\")+`\\ntotals: ${JSON.stringify(by)}\\n`)'"),
    ],
  });
  const defects = readJson(r.out, "defects.json");
  assert.equal(defects.length, 5);
  for (const d of defects) {
    assert.deepEqual(Object.keys(d).sort(), ["evidence", "file", "lens", "line", "severity", "title"]);
    assert.ok(Array.isArray(d.lens) && d.lens.length === 1);
  }
  assert.deepEqual(defects.map((d) => d.severity), ["high", "high", "medium", "medium", "low"], "ranked by severity");
  assert.match(read(r.out, "DEFECTS.md"), /^\| severity \| where \| title \| lenses \|/);
  for (const l of lenses) assert.equal(readJson(r.out, "lenses", `${l}.json`)[0].lens, l);
  assert.match(read(r.out, "REPORT.md"), /- tests: succeeded, 1 finding\(s\)\ntotals: \{"high":2,"medium":2,"low":1\}/);
  assert.equal(read(r.out, "child/validate/validate.txt"), "", "every lens's findings have the agreed shape");
  assertTree(r, [...lenses.map((l) => [`lens-${l}`, "agent", "succeeded"]), ["validate", "script", "succeeded"],
    ["reduce", "agent", "succeeded"]]);
  skill.assertCovered();
});

skillTest("demesne-corpus-map-reduce", async (skill) => {
  const docs = {};
  for (let i = 1; i <= 30; i++) {
    docs[`doc-${String(i).padStart(2, "0")}.txt`] = `date: 2026-11-${String(i).padStart(2, "0")}\ncustomer: ${i % 3 === 0 ? "acme" : "globex"}\n`
      + `complaint: ${i % 2 ? "slow delivery" : "wrong size"}\n\nThe rest of the letter.\n`;
  }
  const dir = path.join(work, "inputs", "letters");
  for (const [n, t] of Object.entries(docs)) { mkdirSync(dir, { recursive: true }); writeFileSync(path.join(dir, n), t); }
  const fields = "date,customer,complaint";
  const mapPlan = (n) => agentPlan(`corpus-map-${n}`,
    `node -e 'const fs=require("fs");const out=[];for(const p of fs.readFileSync("/workspace/batches/batch-${n}","utf8").split("\\n").filter(Boolean)){`
    + `const r={};for(const l of fs.readFileSync(p,"utf8").split("\\n")){const m=l.match(/^(date|customer|complaint): (.*)$/);if(m)r[m[1]]=m[2];}`
    + `r.source=p;out.push(JSON.stringify(r));}fs.writeFileSync("/out/records.jsonl",out.join("\\n")+"\\n")'`);
  const reduce = agentPlan("corpus-reduce",
    "cat /in/previous-jobs/map-*/records.jsonl | node -e 'const rs=require(\"fs\").readFileSync(0,\"utf8\").split(\"\\n\").filter(Boolean).map(JSON.parse);"
    + "const by={};for(const r of rs)by[r.complaint]=(by[r.complaint]||0)+1;const fs=require(\"fs\");"
    + "fs.writeFileSync(\"/out/summary.json\",JSON.stringify({records:rs.length,by_complaint:by}));"
    + "fs.writeFileSync(\"/out/REPORT.md\",`# Complaints\\n${Object.entries(by).map(([k,v])=>`- ${k}: ${v}`).join(\"\\n\")}\\n\\nSources: ${rs[0].source}, …\\n`)'");
  const r = await runSkill(skill, {
    task: `What do customers complain about? Fields: date (YYYY-MM-DD), customer (string), complaint (string).`,
    fill: { "absolute path of the folder of documents": dir },
    steps: [
      sh("find /in/letters -type f | sort > /workspace/docs.txt && mkdir -p /workspace/batches && "
        + "split -l 25 -d -a 2 /workspace/docs.txt /workspace/batches/batch- && "
        + "printf 'Question: what do customers complain about?\\nFields: date, customer, complaint; plus source.\\n' > /workspace/SCHEMA.md && ls /workspace/batches"),
      spawn(skill, "sandbox_agent", "map-00", { plan: mapPlan("00") }),
      spawn(skill, "sandbox_agent", "map-00", { as: "map-01", replace: [["batch-00", "batch-01"]], plan: mapPlan("01") }),
      wait(skill, "map-00"), wait(skill, "map-01"),
      spawn(skill, "sandbox_script", "validate", { fill: { "field1,field2,...": fields } }),
      spawn(skill, "sandbox_agent", "reduce", { plan: reduce }),
      sh("cat /out/child/map-00/records.jsonl /out/child/map-01/records.jsonl > /out/records.jsonl && "
        + "cp /out/child/reduce/REPORT.md /out/child/reduce/summary.json /out/ && "
        + "printf 'documents listed: %s\\nrecords written: %s\\nnot read: none\\n' $(wc -l < /workspace/docs.txt) $(wc -l < /out/records.jsonl) > /out/COVERAGE.md"),
    ],
  });
  const records = read(r.out, "records.jsonl").trim().split("\n").map((l) => JSON.parse(l));
  assert.equal(records.length, 30, "a record per document");
  assert.deepEqual(records.map((x) => x.source), Object.keys(docs).map((n) => `/in/letters/${n}`));
  for (const x of records) assert.deepEqual(Object.keys(x).sort(), ["complaint", "customer", "date", "source"]);
  assert.equal(records[6].date, "2026-11-07");
  assert.deepEqual(readJson(r.out, "summary.json"), { records: 30, by_complaint: { "slow delivery": 15, "wrong size": 15 } });
  assert.match(read(r.out, "REPORT.md"), /- slow delivery: 15/);
  assert.equal(read(r.out, "COVERAGE.md"), "documents listed: 30\nrecords written: 30\nnot read: none\n");
  assert.equal(read(r.out, "child/validate/validate.txt"), "", "every record has every field, every document a record");
  assertTree(r, [["map-00", "agent", "succeeded"], ["map-01", "agent", "succeeded"], ["validate", "script", "succeeded"],
    ["reduce", "agent", "succeeded"]]);
  skill.assertCovered();
});

skillTest("demesne-design-panel", async (skill) => {
  const ctxDir = makeRepo("panel-context", { "README.md": "A queue service; today one process, in memory.\n" });
  const designPlan = (x) => agentPlan(`panel-design-${x}`,
    `test -f /workspace/PROBLEM.md && printf '# Summary\\nDesign ${x.toUpperCase()} for the queue.\\n## simplicity\\n## robustness\\n' > /out/DESIGN.md`);
  // every judge prefers 2.md on simplicity and 3.md on robustness; judge-3 less so (the dissent)
  const scores = (s2) => JSON.stringify({
    "1.md": { simplicity: { score: 4, why: "." }, robustness: { score: 6, why: "." } },
    "2.md": { simplicity: { score: s2, why: "." }, robustness: { score: 5, why: "." } },
    "3.md": { simplicity: { score: 5, why: "." }, robustness: { score: 9, why: "." } },
  });
  const judgePlan = (n, s2) => agentPlan(`panel-judge-${n}`,
    `ls /workspace/designs/1.md /workspace/designs/2.md /workspace/designs/3.md && printf '%s' '${scores(s2)}' > /out/scores.json && `
    + "printf '# Objections\\n- 2.md: one node only\\n' > /out/NOTES.md");
  const design = (x) => spawn(skill, "sandbox_agent", "design-a", { as: `design-${x}`, plan: designPlan(x) });
  const judge = (n, model, s2) => spawn(skill, "sandbox_agent", "judge-1", { as: `judge-${n}`, plan: judgePlan(n, s2),
    fill: { "a judge model, or leave model out": model } });
  const r = await runSkill(skill, {
    task: "Make the queue survive a restart. Criteria: simplicity (weight 2), robustness (weight 1).",
    fill: { "absolute path of the repository, if any": ctxDir },
    steps: [
      sh("printf '# Problem\\nMake the queue survive a restart.\\nCriteria: simplicity (2), robustness (1).\\n' > /workspace/PROBLEM.md && "
        + "printf '{\"simplicity\": 2, \"robustness\": 1}' > /workspace/weights.json"),
      design("a"), design("b"), design("c"),
      wait(skill, "design-a"), wait(skill, "design-b"), wait(skill, "design-c"),
      sh("mkdir -p /workspace/designs && cp /out/child/design-c/DESIGN.md /workspace/designs/1.md && "
        + "cp /out/child/design-a/DESIGN.md /workspace/designs/2.md && cp /out/child/design-b/DESIGN.md /workspace/designs/3.md && "
        + "printf '{\"1.md\": \"design-c\", \"2.md\": \"design-a\", \"3.md\": \"design-b\"}' > /workspace/designs.key"),
      judge(1, "sonnet", 9), judge(2, "haiku", 9), judge(3, "sonnet", 6),
      wait(skill, "judge-1"), wait(skill, "judge-2"), wait(skill, "judge-3"),
      spawn(skill, "sandbox_script", "tally"),
      sh("mkdir -p /out/designs /out/scores && for x in a b c; do cp /out/child/design-$x/DESIGN.md /out/designs/design-$x.md; done && "
        + "for n in 1 2 3; do cp /out/child/judge-$n/scores.json /out/scores/judge-$n.json; done && cp /out/child/tally/tally.json /out/ && "
        + "node -e 'const fs=require(\"fs\");const t=JSON.parse(fs.readFileSync(\"/out/tally.json\"));const k=JSON.parse(fs.readFileSync(\"/workspace/designs.key\"));"
        + "fs.writeFileSync(\"/out/DECISION.md\",`winner: ${k[t.winner]} (${t.winner})\\n\\n| design | weighted mean |\\n|---|---|\\n`"
        + "+Object.entries(t.weighted_mean).map(([d,m])=>`| ${k[d]} | ${m.toFixed(2)} |`).join(\"\\n\")+\"\\n\\ndissent: judge-3 scores design-a lower on simplicity\\n\")'"),
    ],
  });
  for (const x of ["a", "b", "c"]) assert.match(read(r.out, "designs", `design-${x}.md`), new RegExp(`Design ${x.toUpperCase()}`));
  for (const n of [1, 2, 3]) assert.equal(readJson(r.out, "scores", `judge-${n}.json`)["3.md"].robustness.score, 9);
  const tally = readJson(r.out, "tally.json");
  assert.equal(tally.judges, 3);
  assert.equal(tally.winner, "2.md");
  assert.ok(Math.abs(tally.weighted_mean["2.md"] - 63 / 9) < 1e-9, JSON.stringify(tally));
  assert.ok(Math.abs(tally.weighted_mean["3.md"] - 19 / 3) < 1e-9);
  assert.ok(Math.abs(tally.weighted_mean["1.md"] - 14 / 3) < 1e-9);
  assert.equal(firstLine(read(r.out, "DECISION.md")), "winner: design-a (2.md)");
  assertTree(r, [..."abc"].map((x) => [`design-${x}`, "agent", "succeeded"]).concat(
    [1, 2, 3].map((n) => [`judge-${n}`, "agent", "succeeded"]), [["tally", "script", "succeeded"]]));
  assert.ok(readJson(r.out, "child/judge-2/usage.json").models["claude-haiku-4-5-20251001"], "judge-2 on its own model");
  skill.assertCovered();
});

skillTest("demesne-appearance-review", async (skill) => {
  const site = path.join(work, "inputs", "site");
  mkdirSync(site, { recursive: true });
  writeFileSync(path.join(site, "style.css"), "body{margin:0;font-family:sans-serif}header{background:#1d2b53;color:#fff;padding:24px}"
    + ".box{height:400px;background:#ff004d}\n");
  for (const [n, t] of [["index.html", "Home"], ["about.html", "About"]]) {
    writeFileSync(path.join(site, n), `<!doctype html><html><head><link rel="stylesheet" href="style.css"></head>`
      + `<body><header><h1>${t}</h1></header><div class="box"></div></body></html>\n`);
  }
  const lensPlan = (lens) => agentPlan(`appearance-${lens}`,
    `test $(ls /in/previous-jobs/shots/shots/*.png | wc -l) = 6 && printf -- '- medium | index_html-phone.png | ${lens}: the header crowds the title | add padding\\n' > /out/FINDINGS.md`);
  const lens = (name) => spawn(skill, "sandbox_agent", "lens-layout", { as: `lens-${name}`, plan: lensPlan(name) });
  const r = await runSkill(skill, {
    task: "Review index.html and about.html, the two pages of a small company site.",
    fill: { "absolute path of the folder with the pages": site },
    steps: [
      sh("printf 'index.html\\nabout.html\\n' > /workspace/pages.txt"),
      spawn(skill, "sandbox_script", "shots", { fill: { folder: "site" } }),
      lens("layout"), lens("type"), lens("access"),
      wait(skill, "lens-layout"), wait(skill, "lens-type"), wait(skill, "lens-access"),
      sh("mkdir -p /out/shots /out/findings && cp /out/child/shots/shots/*.png /out/shots/ && "
        + "for l in layout type access; do cp /out/child/lens-$l/FINDINGS.md /out/findings/$l.md; done && "
        + "{ echo '# Appearance review'; echo; echo \"render problems: $(grep -c failed /out/child/shots/render.jsonl)\"; echo; "
        + "cat /out/findings/*.md | sort | sed 's/| \\([^ ]*\\.png\\) |/| [\\1](shots\\/\\1) |/'; } > /out/REVIEW.md"),
    ],
  });
  const widths = { phone: 390, tablet: 768, desktop: 1440 };
  const shots = readdirSync(path.join(r.out, "shots")).sort();
  assert.deepEqual(shots, ["about_html-desktop.png", "about_html-phone.png", "about_html-tablet.png",
    "index_html-desktop.png", "index_html-phone.png", "index_html-tablet.png"]);
  for (const f of shots) {
    const file = path.join(r.out, "shots", f);
    assert.ok(isPng(file), `${f} is a PNG`);
    assert.equal(pngWidth(file), widths[f.match(/-(\w+)\.png$/)[1]], `${f} is as wide as its viewport`);
  }
  const renders = read(r.out, "child/shots/render.jsonl").trim().split("\n").map((l) => JSON.parse(l));
  assert.equal(renders.length, 6);
  for (const x of renders) assert.deepEqual(x.console_errors, [], JSON.stringify(x));
  for (const l of ["layout", "type", "access"]) {
    assert.match(read(r.out, "findings", `${l}.md`), /^- medium \| index_html-phone\.png \| /);
  }
  const review = read(r.out, "REVIEW.md");
  assert.match(review, /render problems: 0/);
  assert.equal(review.match(/\[index_html-phone\.png\]\(shots\/index_html-phone\.png\)/g).length, 3);
  assertTree(r, [["shots", "script", "succeeded"], ["lens-layout", "agent", "succeeded"], ["lens-type", "agent", "succeeded"],
    ["lens-access", "agent", "succeeded"]]);
  skill.assertCovered();
});

skillTest("demesne-web-game", async (skill) => {
  const keys = "ArrowRight:300,Space";
  const dev = agentPlan("game-dev",
    "cd /workspace/game && sed -i 's/Phaser 4 template: arrow keys move, Space recolours/Dodge: arrow keys move/; s/0.4 \\* delta/0.5 * delta/' "
    + "src/scenes/MainScene.ts && grep -q Dodge src/scenes/MainScene.ts && "
    + "printf 'Arrow keys move the square; Space recolours it.\\n__GAME_INFO__: scene, player {x, y}, presses\\n' > /out/NOTES.md");
  const playA = agentPlan("game-playtest-a",
    "grep -q '\"ready\": *true' /in/previous-jobs/build-1/report.json && ls /in/previous-jobs/build-1/playtest/*.png && "
    + "printf 'verdict: fail\\n- ArrowRight:300: the square is hard to see; make it larger\\n' > /out/PLAYTEST.md");
  const playB = agentPlan("game-playtest-b", "printf 'verdict: pass\\n' > /out/PLAYTEST.md");
  const fix = agentPlan("game-fix",
    "cd /workspace/game && sed -i 's/rectangle(400, 300, 64, 64/rectangle(400, 300, 96, 96/' src/scenes/MainScene.ts && "
    + "grep -q '96, 96' src/scenes/MainScene.ts && printf -- '- the square is hard to see: 96 px instead of 64\\n' > /out/FIXES.md");
  const r = await runSkill(skill, {
    task: `A square dodging game. Controls: arrow keys move, Space recolours. A playtest must show the square moving right when ArrowRight is held (${keys}).`,
    steps: [
      sh(`printf '# Brief\\nA square dodging game.\\nKeys: ${keys}\\n' > /workspace/BRIEF.md`),
      spawn(skill, "sandbox_script", "template"),
      spawn(skill, "sandbox_agent", "dev", { plan: dev }),
      spawn(skill, "sandbox_script", "build-1", { fill: { "key steps from BRIEF.md": keys } }),
      spawn(skill, "sandbox_agent", "playtest-a", { plan: playA }),
      spawn(skill, "sandbox_agent", "playtest-a", { as: "playtest-b", plan: playB }),
      wait(skill, "playtest-a"), wait(skill, "playtest-b"),
      spawn(skill, "sandbox_agent", "fix", { plan: fix }),
      spawn(skill, "sandbox_script", "build-1", { as: "build-2", fill: { "key steps from BRIEF.md": keys } }),
      sh("mkdir -p /out/game /out/playtest && cp -r /workspace/game/dist/. /out/game/ && cp -r /out/child/build-2/playtest/. /out/playtest/ && "
        + "cp /out/child/build-2/report.json /out/playtest/report.json && cp /out/child/playtest-a/PLAYTEST.md /out/PLAYTEST-A.md && "
        + "cp /out/child/playtest-b/PLAYTEST.md /out/PLAYTEST-B.md && cp /out/child/fix/FIXES.md /out/FIXES.md && "
        + "{ cat /workspace/BRIEF.md; cat /out/child/dev/NOTES.md; for b in build-1 build-2; do echo \"$b: built, $(grep -o '\"ready\": *[a-z]*' /out/child/$b/report.json)\"; done; "
        + "head -1 /out/PLAYTEST-A.md /out/PLAYTEST-B.md; cat /out/FIXES.md; } > /out/REPORT.md"),
    ],
  });
  assert.match(read(r.out, "game/index.html"), /<script/);
  assert.ok(readdirSync(path.join(r.out, "game", "assets")).some((f) => f.endsWith(".js")), "the built game's bundle");
  const bundle = readdirSync(path.join(r.out, "game", "assets")).filter((f) => f.endsWith(".js"))
    .map((f) => read(r.out, "game", "assets", f)).join("");
  assert.match(bundle, /Dodge: arrow keys move/, "the developer's change is in the build");
  const report = readJson(r.out, "playtest", "report.json");
  assert.equal(report.ready, true);
  assert.deepEqual(report.console_errors, []);
  assert.deepEqual(report.page_errors, []);
  assert.equal(report.screenshots.length, 3, "a screenshot when ready and after each of the two key steps");
  for (const s of report.screenshots) assert.ok(isPng(path.join(r.out, "playtest", path.basename(s.file))), s.file);
  assert.ok(report.screenshots[1].info.player.x > 400, `ArrowRight moved the square: ${JSON.stringify(report.screenshots[1].info)}`);
  assert.equal(firstLine(read(r.out, "PLAYTEST-A.md")), "verdict: fail");
  assert.equal(firstLine(read(r.out, "PLAYTEST-B.md")), "verdict: pass");
  assert.match(read(r.out, "FIXES.md"), /96 px/);
  assert.match(read(r.out, "REPORT.md"), /build-2: built, "ready": ?true/);
  assertTree(r, [["template", "script", "succeeded"], ["dev", "agent", "succeeded"], ["build-1", "script", "succeeded"],
    ["playtest-a", "agent", "succeeded"], ["playtest-b", "agent", "succeeded"], ["fix", "agent", "succeeded"],
    ["build-2", "script", "succeeded"]]);
  skill.assertCovered();
});

skillTest("demesne-research-brief", async (skill) => {
  const claimsOf = (n) => JSON.stringify([
    { claim: `Fact ${n}a.`, source: `https://example.invalid/${n}a`, quote: `fact ${n}a`, date: "2026-01-01" },
    { claim: `Fact ${n}b.`, source: `https://example.invalid/${n}b`, quote: `fact ${n}b`, date: "2026-02-01" },
  ]);
  const researcher = (n) => agentPlan(`research-${n}`,
    `test ! -e /in/previous-jobs && printf '%s' '${claimsOf(n)}' > /out/claims.json && printf 'searched: sub-question ${n}\\n' > /out/NOTES.md`);
  const verifier = agentPlan("research-verify",
    "printf '[{\"id\": \"c1\", \"verdict\": \"supported\", \"note\": \"quoted\"}, {\"id\": \"c2\", \"verdict\": \"unsupported\", \"note\": \"not in the page\"}, "
    + "{\"id\": \"c3\", \"verdict\": \"supported\", \"note\": \"quoted\"}, {\"id\": \"c4\", \"verdict\": \"unreachable\", \"note\": \"timeout\"}]' > /out/verdicts.json");
  const writer = agentPlan("research-write",
    "node -e 'const fs=require(\"fs\");const c=JSON.parse(fs.readFileSync(\"/workspace/claims.json\"));"
    + "const v=Object.fromEntries(JSON.parse(fs.readFileSync(\"/in/previous-jobs/verify/verdicts.json\")).map(x=>[x.id,x.verdict]));"
    + "const ok=c.filter(x=>v[x.id]===\"supported\");"
    + "fs.writeFileSync(\"/out/BRIEF.md\",`# Brief\\n\\n${ok.map((x,i)=>`${x.claim} [${i+1}]`).join(\"\\n\")}\\n\\n## Sources\\n${ok.map((x,i)=>`${i+1}. ${x.source}`).join(\"\\n\")}\\n`)'");
  const research = (n, q) => spawn(skill, "sandbox_research", "research-1", { as: `research-${n}`, plan: researcher(n),
    fill: { "sub-question 1, with the scope": q } });
  const r = await runSkill(skill, {
    task: "What changed in the queueing standards in 2026? Scope: 2026 only.",
    steps: [
      sh("printf '1. What changed in standard A?\\n2. What changed in standard B?\\n' > /workspace/QUESTIONS.md"),
      research(1, "What changed in standard A in 2026"), research(2, "What changed in standard B in 2026"),
      wait(skill, "research-1"), wait(skill, "research-2"),
      sh("node -e 'const fs=require(\"fs\");let n=0;const all=[];for(const k of [1,2])for(const c of JSON.parse(fs.readFileSync(`/out/child/research-${k}/claims.json`)))"
        + "all.push({id:`c${++n}`,subquestion:k,...c});fs.writeFileSync(\"/workspace/claims.json\",JSON.stringify(all))' && cat /workspace/claims.json"),
      spawn(skill, "sandbox_research", "verify", { plan: verifier, fill: { "the contents of /workspace/claims.json": (c) => c.last.trim() } }),
      spawn(skill, "sandbox_agent", "write", { plan: writer }),
      sh("mkdir -p /out/notes && cp /out/child/write/BRIEF.md /out/ && for k in 1 2; do cp /out/child/research-$k/NOTES.md /out/notes/research-$k.md; done && "
        + "node -e 'const fs=require(\"fs\");const c=JSON.parse(fs.readFileSync(\"/workspace/claims.json\"));"
        + "const v=Object.fromEntries(JSON.parse(fs.readFileSync(\"/out/child/verify/verdicts.json\")).map(x=>[x.id,x]));"
        + "const all=c.map(x=>({...x,verdict:v[x.id].verdict}));fs.writeFileSync(\"/out/claims.json\",JSON.stringify(all,null,1));"
        + "const by={};for(const x of all)(by[x.source]=by[x.source]||[]).push(x.id);"
        + "fs.writeFileSync(\"/out/sources.json\",JSON.stringify(Object.entries(by).map(([url,claims])=>({url,claims}))));"
        + "const n=k=>all.filter(x=>x.verdict===k).length;"
        + "fs.writeFileSync(\"/out/VERIFICATION.md\",`supported: ${n(\"supported\")}\\nunsupported: ${n(\"unsupported\")}\\nunreachable: ${n(\"unreachable\")}\\n`"
        + "+all.filter(x=>x.verdict===\"unsupported\").map(x=>`- ${x.id}: ${x.claim} (${v[x.id].note})`).join(\"\\n\")+\"\\n\")'"),
    ],
  });
  const brief = read(r.out, "BRIEF.md");
  assert.match(brief, /Fact 1a\. \[1\]\nFact 2a\. \[2\]/, "only the supported claims, cited");
  assert.doesNotMatch(brief, /Fact 1b|Fact 2b/);
  assert.match(brief, /## Sources\n1\. https:\/\/example\.invalid\/1a\n2\. https:\/\/example\.invalid\/2a/);
  const claims = readJson(r.out, "claims.json");
  assert.deepEqual(claims.map((c) => [c.id, c.subquestion, c.verdict]),
    [["c1", 1, "supported"], ["c2", 1, "unsupported"], ["c3", 2, "supported"], ["c4", 2, "unreachable"]]);
  assert.equal(readJson(r.out, "sources.json").length, 4);
  assert.match(read(r.out, "VERIFICATION.md"), /^supported: 2\nunsupported: 1\nunreachable: 1\n- c2: Fact 1b\./);
  for (const k of [1, 2]) assert.match(read(r.out, "notes", `research-${k}.md`), new RegExp(`sub-question ${k}`));
  // research children get nothing of the parent: the verifier's claims came in its prompt
  const verifyCall = r.plan.taken.find((t) => t.args?.name === "verify");
  assert.match(verifyCall.args.prompt, /Claims: \[\{"id":"c1"/);
  assertTree(r, [["research-1", "research", "succeeded"], ["research-2", "research", "succeeded"],
    ["verify", "research", "succeeded"], ["write", "agent", "succeeded"]]);
  skill.assertCovered();
});
