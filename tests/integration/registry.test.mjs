// Private registries: a real registry (Debian's docker-registry, the CNCF distribution
// registry) on 127.0.0.1 with htpasswd logins, over TLS with the certificate
// tests/setup-host made (/etc/demesne-test/registry, trusted by both engines through
// certs.d for 127.0.0.1:5043-5046). A demesne image is pushed to it with the engine, then
// demesne pulls it with the host's credentials: a sandbox whose image is the registry
// reference, a user image built FROM it, a wrong password, and a scan of everything the
// run left (containers, server log, job records, output, the built image) for the secret.
// DEMESNE_NO_PULL=1 stays set: config.lua's `registries` names the loopback registry, the
// one place demesne may pull from.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, readdirSync, lstatSync, existsSync, rmSync,
  chmodSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import https from "node:https";
import { connect } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const CERTS = "/etc/demesne-test/registry";
const PORTS = [5043, 5044, 5045, 5046];
const registryBin = spawnSync("sh", ["-c", "command -v docker-registry"]).stdout.toString().trim();
const htpasswdBin = spawnSync("sh", ["-c", "command -v htpasswd"]).stdout.toString().trim();
const SKIP = !registryBin || !htpasswdBin || !existsSync(path.join(CERTS, "server.key"))
  ? "needs docker-registry, htpasswd and /etc/demesne-test/registry (run tests/setup-host)" : false;

const work = mkdtempSync(path.join(tmpdir(), "demesne-registry-"));
const USER = "tester";
const PASSWORD = "pw-" + randomBytes(12).toString("hex");
const WRONG = "wrong-" + randomBytes(12).toString("hex");
const RUN = randomBytes(4).toString("hex");
const SECRETS = [PASSWORD, WRONG, Buffer.from(`${USER}:${PASSWORD}`).toString("base64"),
  Buffer.from(`${USER}:${WRONG}`).toString("base64")];
let registry, port, ref, base;
const made = []; // image references this file made in the engine, removed at the end

function engine(method, p, { headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: "/v1.41" + p, method, headers }, (res) => {
      let data = "";
      res.on("data", (d) => (data += d));
      res.on("end", () => resolve({ status: res.statusCode, body: data }));
    });
    req.on("error", reject);
    req.end(body);
  });
}
const q = encodeURIComponent;

// GET with our login: 200 only from our own registry (another run's, on a port we also
// tried, has another password and answers 401)
function get(url) {
  return new Promise((resolve) => {
    https.get(url, { ca: readFileSync(path.join(CERTS, "ca.crt")),
      headers: { Authorization: "Basic " + Buffer.from(`${USER}:${PASSWORD}`).toString("base64") } },
    (res) => { res.resume(); resolve(res.statusCode); }).on("error", () => resolve(0));
  });
}

// Starts the registry on the first free port of PORTS; resolves once /v2/ lets our login in.
async function startRegistry() {
  const htpasswd = spawnSync(htpasswdBin, ["-Bbn", USER, PASSWORD]);
  assert.equal(htpasswd.status, 0, htpasswd.stderr.toString());
  writeFileSync(path.join(work, "htpasswd"), htpasswd.stdout);
  for (const p of PORTS) {
    const conf = path.join(work, `registry-${p}.yml`);
    writeFileSync(conf, `version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: ${work}/registry-data
http:
  addr: 127.0.0.1:${p}
  secret: ${randomBytes(8).toString("hex")}
  tls:
    certificate: ${CERTS}/server.crt
    key: ${CERTS}/server.key
auth:
  htpasswd:
    realm: demesne-test
    path: ${work}/htpasswd
`);
    const proc = spawn(registryBin, ["serve", conf], { stdio: ["ignore", "ignore", "pipe"] });
    let exited = false;
    proc.on("exit", () => { exited = true; });
    proc.stderr.resume();
    for (let i = 0; i < 200 && !exited; i++) {
      if (await get(`https://127.0.0.1:${p}/v2/`) === 200) return { proc, port: p };
      await new Promise((r) => setTimeout(r, 50));
    }
    proc.kill("SIGKILL");
  }
  throw new Error(`no port of ${PORTS.join(", ")} was free for the test registry`);
}

function authHeader(user, password, server) {
  // base64url with its padding: Podman 4.3 refuses it without ("unexpected EOF")
  return Buffer.from(JSON.stringify({ username: user, password, serveraddress: server })).toString("base64")
    .replace(/\+/g, "-").replace(/\//g, "_");
}

async function untag(r) {
  const res = await engine("DELETE", `/images/${q(r)}`);
  assert.ok([200, 404].includes(res.status), `untag ${r}: ${res.status} ${res.body}`);
}

before(async () => {
  if (SKIP) return;
  ({ proc: registry, port } = await startRegistry());
  const list = JSON.parse((await engine("GET", `/images/json?filters=${q(JSON.stringify({ label: ["io.demesne.image=base"] }))}`)).body);
  base = list.flatMap((i) => i.RepoTags || []).find((t) => /demesne\/base:[0-9a-f]{12}$/.test(t));
  assert.ok(base, "a built demesne base image is in the engine (demesne images build base)");
  ref = `127.0.0.1:${port}/dmtest/base:${RUN}`;
  const [repo, tag] = [ref.slice(0, ref.lastIndexOf(":")), RUN];
  let res = await engine("POST", `/images/${q(base)}/tag?repo=${q(repo)}&tag=${tag}`);
  assert.equal(res.status, 201, res.body);
  made.push(ref);
  res = await engine("POST", `/images/${q(repo)}/push?tag=${tag}`,
    { headers: { "X-Registry-Auth": authHeader(USER, PASSWORD, `127.0.0.1:${port}`) } });
  assert.equal(res.status, 200, res.body);
  assert.doesNotMatch(res.body, /"error"/, `the push failed: ${res.body.slice(-500)}`);
  await untag(ref); // now only the registry has it
});

after(async () => {
  for (const r of made) await engine("DELETE", `/images/${q(r)}?force=true`).catch(() => {});
  // the devcontainer images the feature run built (demesne/devcontainer-feature-repo and its
  // -base / -features stages): about 175 MB each, left on the engine by every run otherwise
  const built = await engine("GET", `/images/json?filters=${q(JSON.stringify({ reference: ["demesne/devcontainer-feature-repo*"] }))}`)
    .then((r) => JSON.parse(r.body)).catch(() => []);
  for (const i of built) await engine("DELETE", `/images/${i.Id}?force=true`).catch(() => {});
  registry?.kill("SIGKILL");
  rmSync(work, { recursive: true, force: true });
});

// One demesne server with its own HOME, config folder and credentials.
async function server(name, { files = {}, extraEnv = {} } = {}) {
  const root = path.join(work, name);
  const xdg = path.join(root, "config");
  mkdirSync(path.join(xdg, "demesne"), { recursive: true });
  writeFileSync(path.join(xdg, "demesne", "config.lua"),
    `return { registries = { ["127.0.0.1:${port}"] = {} } }\n`);
  for (const [f, text] of Object.entries(files)) {
    mkdirSync(path.dirname(path.join(root, f)), { recursive: true });
    writeFileSync(path.join(root, f), text);
  }
  const env = {
    DEMESNE_ENGINE: ENGINE,
    DEMESNE_OUTPUT_ROOT: path.join(root, "out"),
    DEMESNE_STATE_DIR: path.join(root, "state"),
    DEMESNE_POOL_SIZE: "0",
    DEMESNE_NO_PULL: "1",
    XDG_CONFIG_HOME: xdg,
    HOME: path.join(root, "home"),
    XDG_RUNTIME_DIR: path.join(root, "run"),
    DOCKER_CONFIG: path.join(root, "home", ".docker"),
    REGISTRY_AUTH_FILE: "",
    ...extraEnv,
  };
  const conn = await connect({ env, fixtures: false });
  return { conn, root, xdg };
}

const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const call = (conn, name, args) => conn.client.callTool({ name, arguments: args }, undefined, LONG);

// Every file under `dir`, read (bounded), with its path.
function filesUnder(dir, out = []) {
  if (!existsSync(dir)) return out;
  for (const n of readdirSync(dir)) {
    const p = path.join(dir, n);
    const st = lstatSync(p);
    if (st.isDirectory()) filesUnder(p, out);
    else if (st.isFile() && st.size < 64 * 1024 * 1024) out.push([p, readFileSync(p, "latin1")]);
  }
  return out;
}
function assertNoSecret(where, text) {
  for (const s of SECRETS) assert.ok(!text.includes(s), `${where} holds a credential byte string`);
}

const logs = [];
const roots = [];

test("a sandbox runs from an image in a private registry, pulled with a credential helper's answer",
  { skip: SKIP }, async () => {
    const helper = `#!/bin/sh\nread server\n[ "$server" = "127.0.0.1:${port}" ] || exit 1\n`
      + `printf '{"ServerURL":"%s","Username":"${USER}","Secret":"${PASSWORD}"}' "$server"\n`;
    const s = await server("helper", {
      files: {
        "home/.docker/config.json": JSON.stringify({ credHelpers: { [`127.0.0.1:${port}`]: "dmtest" } }),
        "bin/docker-credential-dmtest": helper,
        [`config/demesne/images/regmine-${RUN}/Containerfile`]: `FROM ${ref}\nRUN echo built-from-the-registry > /marker\n`,
      },
      extraEnv: { PATH: `${path.join(work, "helper", "bin")}:${process.env.PATH}` },
    });
    chmodSync(path.join(s.root, "bin", "docker-credential-dmtest"), 0o755);
    roots.push(s.root);
    try {
      let r = await call(s.conn, "sandbox_script", { image: ref, command: "echo from-registry; env", egress: "none" });
      assert.ok(!r.isError, r.content?.[0]?.text);
      assert.equal(r.structuredContent.exit_code, 0);
      assert.match(r.structuredContent.stdout, /^from-registry$/m);
      assertNoSecret("the sandbox's environment", r.structuredContent.stdout);
      const pulled = await engine("GET", `/images/${q(ref)}/json`);
      assert.equal(pulled.status, 200, "the reference is in the engine now");

      // a persistent sandbox of it: its container, alive, holds no credential either
      await untag(ref);
      const sb = await call(s.conn, "sandbox_create", { image: ref, egress: "none" });
      assert.ok(!sb.isError, sb.content?.[0]?.text);
      const id = sb.structuredContent.sandbox_id;
      const listed = JSON.parse((await engine("GET", `/containers/json?all=true&filters=${q(JSON.stringify({
        label: ["io.demesne.managed=1"] }))}`)).body).filter((c) => c.Image === ref || c.Labels["io.demesne.image"] === ref);
      assert.ok(listed.length >= 1, "the sandbox's container is found by its image");
      for (const c of listed) assertNoSecret(`container ${c.Id}`, (await engine("GET", `/containers/${c.Id}/json`)).body);
      const envOut = await call(s.conn, "sandbox_exec", { sandbox_id: id, command: "env; cat /proc/1/environ | tr '\\0' '\\n'" });
      assert.ok(!envOut.isError, envOut.content?.[0]?.text);
      assertNoSecret("the persistent sandbox's environment", JSON.stringify(envOut.structuredContent));
      await call(s.conn, "sandbox_destroy", { sandbox_id: id });

      // a user image FROM the registry reference: the build's FROM is pulled the same way
      await untag(ref);
      r = await call(s.conn, "sandbox_script", { image: `regmine-${RUN}`, command: "cat /marker", egress: "none" });
      assert.ok(!r.isError, r.content?.[0]?.text);
      assert.equal(r.structuredContent.stdout.trim(), "built-from-the-registry");
      const imgs = JSON.parse((await engine("GET",
        `/images/json?filters=${q(JSON.stringify({ label: [`io.demesne.image=regmine-${RUN}`] }))}`)).body);
      assert.equal(imgs.length, 1, "the user image was built");
      for (const t of imgs[0].RepoTags || []) made.push(t);
      const inspect = await engine("GET", `/images/${q(imgs[0].Id)}/json`);
      const history = await engine("GET", `/images/${q(imgs[0].Id)}/history`);
      assertNoSecret("the built image's configuration", inspect.body);
      assertNoSecret("the built image's history", history.body);
    } finally {
      await s.conn.client.close();
      logs.push(["helper server log", s.conn.stderr()]);
    }
  });

test("a wrong password is refused with an error that names the registry and holds no secret",
  { skip: SKIP }, async () => {
    const authFile = JSON.stringify({ auths: { [`127.0.0.1:${port}`]: {
      auth: Buffer.from(`${USER}:${WRONG}`).toString("base64") } } });
    const s = await server("wrong", { files: { "auth.json": authFile },
      extraEnv: { REGISTRY_AUTH_FILE: path.join(work, "wrong", "auth.json") } });
    roots.push(s.root);
    try {
      await untag(ref);
      const r = await call(s.conn, "sandbox_script", { image: ref, command: "true", egress: "none" });
      assert.equal(r.isError, true, JSON.stringify(r.structuredContent));
      const text = r.content[0].text;
      assert.match(text, new RegExp(`registry 127\\.0\\.0\\.1:${port} refused the credentials for ${ref.replace(/[.]/g, "\\.")} `
        + `\\(from ${path.join(s.root, "auth.json").replace(/[.]/g, "\\.")}\\)`));
      assertNoSecret("the error", text);
      const gone = await engine("GET", `/images/${q(ref)}/json`);
      assert.equal(gone.status, 404, "nothing was pulled");
    } finally {
      await s.conn.client.close();
      logs.push(["wrong-password server log", s.conn.stderr()]);
    }
  });

// An HTTPS request to the test registry with our login: {status, headers, body}.
function registryRequest(method, p, { headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const req = https.request(p.startsWith("https://") ? p : `https://127.0.0.1:${port}${p}`, { method,
      ca: readFileSync(path.join(CERTS, "ca.crt")), headers: { ...headers,
        Authorization: "Basic " + Buffer.from(`${USER}:${PASSWORD}`).toString("base64") } }, (res) => {
      const chunks = [];
      res.on("data", (d) => chunks.push(d));
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

// Pushes a Dev Container Feature (an OCI artifact: config application/vnd.devcontainers,
// one layer application/vnd.devcontainers.layer.v1+tar, as `devcontainer features publish`
// makes it) of the folder `dir` to repo:tag in the test registry, with the OCI distribution API.
async function pushFeature(dir, repo, tag) {
  const blob = async (data) => {
    const digest = "sha256:" + createHash("sha256").update(data).digest("hex");
    const up = await registryRequest("POST", `/v2/${repo}/blobs/uploads/`);
    assert.equal(up.status, 202, `upload start: ${up.status} ${up.body}`);
    const loc = new URL(up.headers.location, `https://127.0.0.1:${port}`);
    loc.searchParams.set("digest", digest);
    const put = await registryRequest("PUT", loc.toString(), { body: data,
      headers: { "Content-Type": "application/octet-stream", "Content-Length": data.length } });
    assert.equal(put.status, 201, `blob put: ${put.status} ${put.body}`);
    return { digest, size: data.length };
  };
  // entries named ./x, as the devcontainer CLI packs them
  const tar = spawnSync("tar", ["-cf", "-", "--owner=0", "--group=0", "-C", dir, "."]);
  assert.equal(tar.status, 0, tar.stderr.toString());
  const config = await blob(Buffer.from("{}"));
  const layer = await blob(tar.stdout);
  const manifest = Buffer.from(JSON.stringify({ schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: { mediaType: "application/vnd.devcontainers", ...config },
    layers: [{ mediaType: "application/vnd.devcontainers.layer.v1+tar", ...layer,
      annotations: { "org.opencontainers.image.title": "devcontainer-feature-hello.tgz" } }] }));
  const m = await registryRequest("PUT", `/v2/${repo}/manifests/${tag}`, { body: manifest,
    headers: { "Content-Type": "application/vnd.oci.image.manifest.v1+json", "Content-Length": manifest.length } });
  assert.equal(m.status, 201, `manifest put: ${m.status} ${m.body}`);
}

test("a devcontainer of the private registry's image, with features: one from that registry (the host's login), one from the repository",
  { skip: SKIP }, async () => {
    const feature = path.join(work, "feature-src");
    mkdirSync(feature, { recursive: true });
    writeFileSync(path.join(feature, "devcontainer-feature.json"), JSON.stringify({ id: "hello", version: "1.0.0",
      options: { greeting: { type: "string", default: "hello" }, loud: { type: "boolean", default: false } },
      containerEnv: { HELLO_FEATURE: "installed", PATH: "/opt/hello/bin:${PATH}" } }));
    writeFileSync(path.join(feature, "install.sh"), "#!/bin/sh\nset -e\nmkdir -p /opt/hello/bin\n"
      + "echo \"$GREETING from the feature (loud=$LOUD, user=$_REMOTE_USER)\" > /usr/local/share/hello-feature\n"
      + "printf '#!/bin/sh\\necho hello-tool\\n' > /opt/hello/bin/hello-tool && chmod +x /opt/hello/bin/hello-tool\n");
    const fref = `127.0.0.1:${port}/dmtest/features/hello:${RUN}`;
    await pushFeature(feature, "dmtest/features/hello", RUN);
    const repo = path.join(work, "feature-repo");
    const dc = path.join(repo, ".devcontainer");
    mkdirSync(path.join(dc, "local-feature"), { recursive: true });
    // the devcontainer's image is the private registry's too: pulled with the same login
    await untag(ref);
    writeFileSync(path.join(dc, "devcontainer.json"), JSON.stringify({ image: ref,
      features: { [fref]: { greeting: "hi" }, "./local-feature": {} } }));
    writeFileSync(path.join(dc, "local-feature", "devcontainer-feature.json"), JSON.stringify({ id: "local-feature",
      installsAfter: [fref.replace(/:[^:]*$/, "")] }));
    writeFileSync(path.join(dc, "local-feature", "install.sh"),
      "#!/bin/sh\ncat /usr/local/share/hello-feature > /usr/local/share/local-feature\n");
    const authFile = JSON.stringify({ auths: { [`127.0.0.1:${port}`]: {
      auth: Buffer.from(`${USER}:${PASSWORD}`).toString("base64") } } });
    const version = JSON.parse((await engine("GET", "/version")).body);
    const podman = (version?.Components || []).some((c) => /podman/i.test(c.Name));
    const s = await server("feature", { files: { "auth.json": authFile },
      // Podman 4.3 runs build steps in the host's network whatever a build asks (devcontainer.test.mjs)
      extraEnv: { REGISTRY_AUTH_FILE: path.join(work, "feature", "auth.json"), DEMESNE_ALLOWED_PATHS: repo,
        ...(podman ? { DEMESNE_DEVCONTAINER_BUILD_NETWORK: "host" } : {}) } });
    roots.push(s.root);
    try {
      const r = await call(s.conn, "sandbox_script", { image: "devcontainer", directories: [repo], egress: "none",
        command: "cat /usr/local/share/hello-feature /usr/local/share/local-feature; echo \"$HELLO_FEATURE\"; hello-tool" });
      assert.ok(!r.isError, r.content?.[0]?.text);
      assert.equal(r.structuredContent.exit_code, 0, r.structuredContent.stderr);
      assert.equal(r.structuredContent.stdout, "hi from the feature (loud=false, user=root)\n".repeat(2)
        + "installed\nhello-tool\n", "the option over its default, the local feature after the registry's, "
        + "the feature's containerEnv and PATH");
      assert.deepEqual(r.structuredContent.devcontainer.features, [fref, "./local-feature"], "installsAfter decides the order");
      // the pulled tar is not left in the state folder
      assert.deepEqual(readdirSync(path.join(s.root, "state", "features")), [], "nothing left of the pull");
    } finally {
      await s.conn.client.close();
      logs.push(["feature server log", s.conn.stderr()]);
    }
  });

test("no credential byte in any container, server log, job record or output of the runs", { skip: SKIP }, async () => {
  assert.equal(roots.length, 3, "the three runs above ran");
  for (const [where, text] of logs) {
    assert.match(text, /pulling 127\.0\.0\.1/, `${where} shows the pull`);
    assertNoSecret(where, text);
  }
  const files = roots.flatMap((r) => filesUnder(path.join(r, "state")).concat(filesUnder(path.join(r, "out"))));
  assert.ok(files.some(([p]) => p.endsWith("stdout.log")), "the runs' output folders are scanned");
  for (const [p, text] of files) assertNoSecret(p, text);
  // the live sandbox's container was scanned in the first test; whatever containers are
  // left on the engine now (another file's, the warm pool's: maybe none) are scanned too
  const list = JSON.parse((await engine("GET", "/containers/json?all=true")).body);
  assert.ok(Array.isArray(list), "the engine lists containers");
  for (const c of list) {
    const inspect = await engine("GET", `/containers/${c.Id}/json`);
    if (inspect.status === 200) assertNoSecret(`container ${c.Id}`, inspect.body);
  }
});
