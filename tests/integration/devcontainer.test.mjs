// image: "devcontainer" (docs/how-to/use-a-devcontainer.md) on a real engine (DEMESNE_ENGINE),
// over MCP (official SDK client): a repository whose .devcontainer builds FROM demesne's base
// image (a file, variables, a build argument, a target stage), with containerEnv, remoteEnv
// and create commands: the sandbox sees all of them; a folder's image-based
// .devcontainer.json in a persistent sandbox with previews; an agent run (the real Claude
// Code CLI, driven by the scripted vendor) in the same environment; and the refusals, each
// naming its field. No build here reaches a network (the build's network is none).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import http from "node:http";
import { randomBytes } from "node:crypto";
import { chmodSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, connect, engineContainers, engineRequest, serverEnv } from "./helpers.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-devcontainer-"));
const repos = path.join(work, "repos");
mkdirSync(repos);
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
const LONG = { timeout: 900_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const G = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"];
const git = (cwd, ...args) => execFileSync("git", [...G, ...args], { cwd, encoding: "utf8" }).trim();

let vendor;
let conn;
const env = () => ({
  DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_ALLOWED_PATHS: repos, HOME: path.join(work, "home"), DEMESNE_NO_PULL: "1",
  ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
  CLAUDE_CODE_OAUTH_TOKEN: "", ANTHROPIC_AUTH_TOKEN: "", CODEX_HOME: path.join(work, "no-codex-home"),
  DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false", DEMESNE_PROGRESS_INTERVAL: "1",
});

before(async () => {
  vendor = await startVendor({ secret: SECRET });
  conn = await connect({ env: env(), fixtures: false });
});
after(async () => {
  await conn?.client.close();
  await vendor?.close();
  const left = (await engineContainers(ENGINE))
    .filter((c) => (c.Labels["io.demesne.output_dir"] || "").startsWith(work));
  for (const c of left) await engineRequest(ENGINE, "DELETE", `/containers/${c.Id}?force=true`);
  // the images built from this file's repositories go too (newest first: a layer before its base)
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.origin=devcontainer"] }));
  const mine = ((await engineRequest(ENGINE, "GET", `/images/json?filters=${filters}`)) || [])
    .filter((i) => (i.Labels?.["io.demesne.devcontainer.source"] || "").startsWith(work))
    .sort((a, b) => b.Created - a.Created);
  for (const i of mine) await engineRequest(ENGINE, "DELETE", `/images/${i.Id}?force=true`);
  rmSync(work, { recursive: true, force: true });
  assert.deepEqual(left.map((c) => c.Names), [], "no sandbox of this file is left on the engine");
});

// Builds `dockerfile` into `tag` on the engine itself (POST /build, as `docker build` does),
// for an image demesne did not make. Resolves to the build's output text.
const DOCKER_FORMAT = encodeURIComponent("application/vnd.docker.distribution.manifest.v2+json");
function engineBuild(tag, dockerfile) {
  const dir = mkdtempSync(path.join(work, "ctx-"));
  writeFileSync(path.join(dir, "Dockerfile"), dockerfile);
  const tar = execFileSync("tar", ["-cf", "-", "-C", dir, "Dockerfile"]);
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: ENGINE.replace(/^unix:\/\//, ""), method: "POST",
      // Podman keeps ONBUILD only in the Docker image format (outputformat; Docker ignores it)
      path: `/build?t=${encodeURIComponent(tag)}&dockerfile=Dockerfile&rm=true&outputformat=${DOCKER_FORMAT}`,
      headers: { "Content-Type": "application/x-tar", "Content-Length": tar.length } }, (res) => {
      let out = "";
      res.on("data", (d) => (out += d));
      res.on("end", () => resolve(out));
    });
    req.on("error", reject);
    req.end(tar);
  });
}

// The tag of demesne's base image (the newest the engine has).
async function baseTag() {
  const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.image=base"] }));
  const list = ((await engineRequest(ENGINE, "GET", `/images/json?filters=${filters}`)) || [])
    .filter((i) => (i.RepoTags || []).some((t) => /(^|\/)demesne\/base:/.test(t)))
    .sort((a, b) => b.Created - a.Created);
  assert.ok(list.length > 0, "demesne's base image is in the engine");
  return list[0].RepoTags.find((t) => /(^|\/)demesne\/base:/.test(t));
}

function write(root, files) {
  for (const [name, data] of Object.entries(files)) {
    mkdirSync(path.dirname(path.join(root, name)), { recursive: true });
    writeFileSync(path.join(root, name), data);
  }
}

// The repository's Dockerfile: FROM demesne's base (by name), files and variables, a build
// argument, and a later stage that fails (the target stops before it). No RUN: an engine
// that does not keep a build step off the network refuses RUN (the build-network test).
const DOCKERFILE = `FROM base AS dev
ARG GREETING=unset
COPY tool.txt /opt/tool.txt
COPY dc-tool /opt/dc/bin/dc-tool
ENV DC_IMAGE_ENV=$GREETING PATH=/opt/dc/bin:$PATH
FROM dev AS never
COPY this-stage-is-not-the-target /never
`;

const DEVCONTAINER = `// the team's environment
{
  "name": "app",
  "build": { "dockerfile": "Dockerfile", "context": "..", "args": { "GREETING": "hello-arg" }, "target": "dev", },
  "containerEnv": { "DC_VAR": "from-containerEnv" },
  "remoteEnv": { "DC_REMOTE": "\${containerEnv:DC_VAR}-and-remote" }, /* resolved in the sandbox's variables */
  "onCreateCommand": ["sh", "-c", "echo on-create > /tmp/dc-oncreate"],
  "postCreateCommand": "echo made-by-postCreateCommand > /tmp/dc-marker && pwd > /tmp/dc-pwd",
  "customizations": { "vscode": { "extensions": ["x.y"] } },
}
`;

function makeRepo(name) {
  const h = path.join(repos, name);
  mkdirSync(h, { recursive: true });
  git(h, "init", "-q");
  write(h, { "tool.txt": "the repository's tool file\n", ".devcontainer/devcontainer.json": DEVCONTAINER,
    ".devcontainer/Dockerfile": DOCKERFILE, "app.py": "def add(a, b):\n    return a - b\n",
    "dc-tool": "#!/bin/sh\necho dc-tool runs\n" });
  chmodSync(path.join(h, "dc-tool"), 0o755);
  git(h, "add", ".");
  git(h, "commit", "-qm", "app with a devcontainer");
  return h;
}

const SEES = "cat /opt/tool.txt; echo \"$DC_VAR|$DC_REMOTE|$DC_IMAGE_ENV\"; dc-tool; cat /tmp/dc-marker /tmp/dc-oncreate "
  + "/tmp/dc-pwd; pwd; id -u";

test("a repository's Dockerfile devcontainer: the sandbox sees its file, variables and create commands", async () => {
  const h = makeRepo("app");
  const res = await conn.client.callTool({ name: "sandbox_script", arguments: {
    command: SEES, image: "devcontainer", repository: h, branch: "dc",
  } }, undefined, LONG);
  assert.ok(!res.isError, res.content?.[0]?.text);
  const r = res.structuredContent;
  assert.equal(r.exit_code, 0, r.stderr);
  assert.deepEqual(r.stdout.trim().split("\n"), [
    "the repository's tool file", "from-containerEnv|from-containerEnv-and-remote|hello-arg", "dc-tool runs",
    "made-by-postCreateCommand", "on-create", "/workspace/app", "/workspace/app", "0",
  ]);
  const log = readFileSync(path.join(r.output_dir, "devcontainer.log"), "utf8");
  assert.match(log, /== onCreateCommand\n== postCreateCommand\n/);
  // the image is kept by the hash of its inputs, with the repository it came from
  const list = execFileSync(BIN, ["images", "list"], { env: serverEnv(env()), encoding: "utf8" });
  assert.match(list, new RegExp(`demesne/devcontainer-app:[0-9a-f]{12} +from ${h}`));
  // a second run finds the image: no build (no build progress), the same answer
  const again = await conn.client.callTool({ name: "sandbox_script", arguments: {
    command: "echo $DC_IMAGE_ENV", image: "devcontainer", repository: h, branch: "dc2",
  } }, undefined, LONG);
  assert.equal(again.structuredContent.stdout.trim(), "hello-arg");
});

test("a folder's .devcontainer.json image in a persistent sandbox: object-form commands, forwardPorts previews", async () => {
  const d = path.join(repos, "folder");
  write(d, { ".devcontainer.json": JSON.stringify({
    image: "base", containerEnv: { FOLDER_VAR: "folder" }, forwardPorts: [8123],
    postCreateCommand: { one: "echo one > /tmp/one", two: ["sh", "-c", "echo two > /tmp/two"] },
  }) });
  const res = await conn.client.callTool({ name: "sandbox_create", arguments: {
    image: "devcontainer", directories: [d], ttl_seconds: 600,
  } }, undefined, LONG);
  assert.ok(!res.isError, res.content?.[0]?.text);
  const sb = res.structuredContent;
  try {
    assert.equal(sb.image, "devcontainer");
    assert.deepEqual(sb.previews.map((p) => p.port), [8123]);
    const ex = await conn.client.callTool({ name: "sandbox_exec", arguments: {
      sandbox_id: sb.sandbox_id, command: "cat /tmp/one /tmp/two; echo $FOLDER_VAR; ls /in",
    } });
    assert.equal(ex.structuredContent.exit_code, 0, ex.structuredContent.stderr);
    assert.deepEqual(ex.structuredContent.stdout.trim().split("\n"), ["one", "two", "folder", "folder"]);
  } finally {
    await conn.client.callTool({ name: "sandbox_destroy", arguments: { sandbox_id: sb.sandbox_id } });
  }
});

test("an agent run with the scripted vendor works inside the repository's devcontainer", async () => {
  const h = makeRepo("agent-app");
  const plan = vendor.plan("dc-agent", [
    { shell: `(${SEES}) > /out/sees.txt 2>&1; sed -i 's/a - b/a + b/' app.py && git commit -qam 'fix add' && echo ok` },
    { final: "Fixed add inside the devcontainer." },
  ]);
  const res = await conn.client.callTool({ name: "sandbox_agent", arguments: {
    prompt: `PLAN:${plan} Fix add.`, model: "sonnet", image: "devcontainer", repository: h, branch: "dc-agent",
  } }, undefined, LONG);
  assert.ok(!res.isError, res.content?.[0]?.text);
  const r = res.structuredContent;
  assert.equal(r.exit_code, 0, r.stderr);
  assert.deepEqual(readFileSync(path.join(r.output_dir, "sees.txt"), "utf8").trim().split("\n"), [
    "the repository's tool file", "from-containerEnv|from-containerEnv-and-remote|hello-arg", "dc-tool runs",
    "made-by-postCreateCommand", "on-create", "/workspace/agent-app", "/workspace/agent-app", "0",
  ]);
  assert.deepEqual(r.branch.commits.map((c) => c.subject), ["fix add"]);
  assert.equal(git(h, "show", "demesne/dc-agent:app.py"), "def add(a, b):\n    return a + b");
});

test("a Codex agent run with the scripted vendor works inside the repository's devcontainer too", async () => {
  const h = makeRepo("codex-app");
  const plan = vendor.plan("dc-codex", [
    { shell: `(${SEES}) > /out/sees.txt 2>&1; command -v node > /out/node.txt || echo none > /out/node.txt; echo ok` },
    { final: "Looked around inside the devcontainer." },
  ]);
  const c = await connect({ fixtures: false, env: { ...env(), DEMESNE_STATE_DIR: path.join(work, "state-codex"),
    OPENAI_API_KEY: SECRET, DEMESNE_CODEX_UPSTREAM: `http://127.0.0.1:${vendor.port}/openai/v1`,
    DEMESNE_CLAUDE_CODE_ENABLED: "false", ANTHROPIC_API_KEY: "" } });
  try {
    const res = await c.client.callTool({ name: "sandbox_agent", arguments: {
      prompt: `PLAN:${plan} Look around.`, model: "gpt-5.6-sol", image: "devcontainer", repository: h,
    } }, undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const r = res.structuredContent;
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.answer, "Looked around inside the devcontainer.");
    assert.deepEqual(readFileSync(path.join(r.output_dir, "sees.txt"), "utf8").trim().split("\n"), [
      "the repository's tool file", "from-containerEnv|from-containerEnv-and-remote|hello-arg", "dc-tool runs",
      "made-by-postCreateCommand", "on-create", "/workspace/codex-app", "/workspace/codex-app", "0",
    ]);
    assert.equal(r.devcontainer?.file ?? ".devcontainer/devcontainer.json", ".devcontainer/devcontainer.json");
  } finally {
    await c.client.close();
  }
});

test("what cannot work is refused, naming the field", async () => {
  const cases = {
    "features.ghcr.io/devcontainers/features/node:1": { "ghcr.io/devcontainers/features/node:1": {} },
    mounts: ["source=/,target=/host,type=bind"],
    runArgs: ["--privileged"], privileged: true, capAdd: ["SYS_ADMIN"], securityOpt: ["seccomp=unconfined"],
    initializeCommand: "touch /tmp/pwned-on-the-host", dockerComposeFile: "compose.yml",
  };
  for (const [field, value] of Object.entries(cases)) {
    // (a feature from a registry config.lua does not name: refused naming the feature)
    const key = field.startsWith("features.") ? "features" : field;
    const d = path.join(repos, `refuse-${key}`);
    write(d, { ".devcontainer/devcontainer.json": JSON.stringify({ image: "base", [key]: value }) });
    const res = await conn.client.callTool({ name: "sandbox_script", arguments: {
      command: "true", image: "devcontainer", directories: [d] } });
    assert.ok(res.isError, field);
    assert.match(res.content[0].text, new RegExp(`devcontainer\\.json: ${field.replace(/[.]/g, "\\.")}: refused: `), field);
  }
  const bad = async (name, files, pattern) => {
    const d = path.join(repos, name);
    write(d, files);
    const res = await conn.client.callTool({ name: "sandbox_script", arguments: {
      command: "true", image: "devcontainer", directories: [d] } }, undefined, LONG);
    assert.ok(res.isError, name);
    assert.match(res.content[0].text, pattern, name);
  };
  await bad("no-dockerfile", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}' },
    /build\.dockerfile: \.devcontainer\/Dockerfile does not exist in the repository/);
  await bad("dotdot", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile", "context": "../.."}}',
    ".devcontainer/Dockerfile": "FROM base\n" }, /build\.context: \.\.\/\.\. leads out of the repository/);
  // the git folder (its config may hold credential URLs) never goes into a build
  await bad("dotgit", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile", "context": "../.git"}}',
    ".devcontainer/Dockerfile": "FROM base\nCOPY config /leaked\n", ".git/config": "[remote]\n url = https://u:t@x/r\n" },
  /build\.context: \.\.\/\.git goes through \.git, refused/);
  await bad("dotgit-dockerfile", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "../.git/Dockerfile"}}',
    ".git/Dockerfile": "FROM base\n" }, /build\.dockerfile: \.\.\/\.git\/Dockerfile goes through \.git, refused/);
  const linked = path.join(repos, "linked");
  write(linked, { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile", "context": "ctx"}}',
    ".devcontainer/Dockerfile": "FROM base\n" });
  symlinkSync(work, path.join(linked, ".devcontainer/ctx"));
  await bad("linked", {}, /build\.context: \.devcontainer\/ctx is \(or passes through\) the symbolic link/);
  // CVE-2024-9675: on Podman 4.3 a cache mount's id out of the cache folder is any host path
  await bad("cache-mount", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
    ".devcontainer/Dockerfile": "FROM base\nRUN --mount=type=cache,target=/h,id=../../../../../../tmp/x ls /h\n" },
  /Dockerfile line 2: RUN --mount is refused \(any type\)/);
  // the Dockerfile is read as the engine reads it: a `# escape=` backtick continues a line
  await bad("escape", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
    ".devcontainer/Dockerfile": "# escape=`\nFROM base\nADD `\n  http://127.0.0.1:9/x /x\n" },
  /Dockerfile line 3: ADD of a URL or git source/);
  await bad("onbuild", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
    ".devcontainer/Dockerfile": "FROM base\nONBUILD ADD http://127.0.0.1:9/x /x\n" },
  /Dockerfile line 2: ONBUILD is refused/);
  await bad("syntax", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
    ".devcontainer/Dockerfile": "# syntax=docker.io/docker/dockerfile:1\nFROM base\n" },
  /Dockerfile line 1: the parser directive # syntax= is refused/);
  await bad("jsonc", { ".devcontainer.json": '{ "image": "base", /* never closed' },
    /\.devcontainer\.json is not valid JSON with comments: line 1: the comment/);
  // an image whose config carries ONBUILD triggers (made here, on the engine, not by demesne)
  const trig = `demesne-test/onbuild-${randomBytes(4).toString("hex")}:1`;
  const out = await engineBuild(trig, `FROM ${await baseTag()}\nONBUILD RUN echo the-trigger-ran\n`);
  try {
    // (Podman's inspect leaves OnBuild out, and runs the trigger all the same: its history shows it)
    const hist = await engineRequest(ENGINE, "GET", `/images/${encodeURIComponent(trig)}/history`);
    assert.match(hist?.[0]?.CreatedBy || "", /ONBUILD RUN echo the-trigger-ran/, out);
    await bad("onbuild-image", { ".devcontainer.json": JSON.stringify({ image: trig }) },
      /\.devcontainer\.json: the image demesne-test\/onbuild-\w+:1 carries ONBUILD triggers \(RUN echo the-trigger-ran\), refused/);
    // with features, whose layer is built FROM it: refused before that build, not after it
    await bad("onbuild-image-features", { ".devcontainer.json": JSON.stringify({ image: trig, features: { "./f": {} } }),
      "f/devcontainer-feature.json": '{"id": "f"}', "f/install.sh": "#!/bin/sh\ntrue\n" },
      /\.devcontainer\.json: the image demesne-test\/onbuild-\w+:1 carries ONBUILD triggers \(RUN echo the-trigger-ran\), refused: they would run when demesne builds the features on it/);
    await bad("onbuild-from", { ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
      ".devcontainer/Dockerfile": `FROM ${trig}\nENV A=1\n` },
    /Dockerfile line 1: FROM demesne-test\/onbuild-\w+:1: the image carries ONBUILD triggers \(RUN echo the-trigger-ran\), refused/);
  } finally {
    await engineRequest(ENGINE, "DELETE", `/images/${encodeURIComponent(trig)}?force=true`);
  }
  const none = await conn.client.callTool({ name: "sandbox_script", arguments: { command: "true", image: "devcontainer" } });
  assert.ok(none.isError);
  assert.match(none.content[0].text, /image: devcontainer needs repository, or a directories entry holding/);
});

// Whether the engine keeps a build step off the network when the build asks for none
// (devcontainer_build_network = "none"): Docker does; this machine's Podman 4.3 runs the
// steps in the host's network, so there a Dockerfile with RUN is refused, naming why, unless
// the configuration says "host".
test("a build step's network: none where the engine keeps steps off it, else RUN is refused unless \"host\"", async () => {
  const version = await engineRequest(ENGINE, "GET", "/version");
  const podman = (version?.Components || []).some((c) => /podman/i.test(c.Name));
  // a listener on the host's loopback that no build step may reach
  const reached = [];
  const listener = net.createServer((c) => { reached.push(c.remoteAddress); c.destroy(); });
  await new Promise((r) => listener.listen(0, "127.0.0.1", r));
  const port = listener.address().port;
  const files = (run) => ({ ".devcontainer/devcontainer.json": '{"build": {"dockerfile": "Dockerfile"}}',
    ".devcontainer/Dockerfile": `FROM base\n${run}\n` });
  const script = (c, name, run) => {
    const d = path.join(repos, name);
    write(d, files(run));
    return c.client.callTool({ name: "sandbox_script", arguments: {
      command: "cat /opt/net-result", image: "devcontainer", directories: [d] } }, undefined, LONG);
  };
  let hostConn;
  try {
    const res = await script(conn, "net-none", `RUN if bash -c 'exec 3<>/dev/tcp/127.0.0.1/${port}'; then `
      + "echo reached-the-host; exit 1; fi; echo no-connection > /opt/net-result");
    if (podman) {
      assert.ok(res.isError, "Podman 4.3 runs build steps in the host's network: RUN is refused");
      assert.match(res.content[0].text, new RegExp("\\.devcontainer/devcontainer\\.json \\(\\.devcontainer/Dockerfile line 2\\): "
        + "RUN is refused: the engine \\(podman at .*\\) does not keep a build step off the network \\(a build step "
        + "reached a listener on the host's 127\\.0\\.0\\.1:\\d+\\).*devcontainer_build_network = \"host\""));
    } else {
      assert.ok(!res.isError, res.content?.[0]?.text);
      assert.equal(res.structuredContent.stdout.trim(), "no-connection", "the step did not reach the host's loopback");
    }
    // devcontainer_build_network = "host": the build runs (its steps have the host's network)
    hostConn = await connect({ env: { ...env(), DEMESNE_DEVCONTAINER_BUILD_NETWORK: "host",
      DEMESNE_STATE_DIR: path.join(work, "state-host") }, fixtures: false });
    const host = await script(hostConn, "net-host", "RUN echo built-with-host > /opt/net-result");
    assert.ok(!host.isError, host.content?.[0]?.text);
    assert.equal(host.structuredContent.stdout.trim(), "built-with-host");
    // a failing build gives the end of its output
    const d = path.join(repos, "failing-build");
    write(d, files("RUN echo the-build-says-why && exit 7"));
    const failed = await hostConn.client.callTool({ name: "sandbox_script", arguments: {
      command: "true", image: "devcontainer", directories: [d] } }, undefined, LONG);
    assert.ok(failed.isError);
    assert.match(failed.content[0].text,
      /building image devcontainer-failing-build-base failed: .*the end of its output:\n(.*\n)*.*the-build-says-why/);
  } finally {
    await hostConn?.client.close();
    listener.close();
  }
  assert.deepEqual(reached, [], "no build step reached the test's loopback listener");
});
