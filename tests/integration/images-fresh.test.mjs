// `demesne images outdated` and `images build --refresh` on a real engine: a user image
// built FROM base is current; once its Containerfile changes it is reported outdated (by
// the hash of its inputs, naming the tag it was built as), `images build` says so before it
// builds it, and `--refresh` builds it again without the cache. The package check (newer
// Debian and npm packages, in a sandbox of the image with the package-managers egress)
// would ask the package registries, which tests do not reach; so its test image swaps
// Debian's sources for a local flat repository (file:, inside the image) that offers a
// newer bash: apt in the sandbox reads only that, and nothing leaves the machine. npm's
// half (`npm outdated -g`) is not run by these tests (it needs registry.npmjs.org).
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, mkdirSync, writeFileSync, appendFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { BIN, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const work = mkdtempSync(path.join(tmpdir(), "demesne-fresh-"));
const xdg = path.join(work, "config");
const NAME = `fresh-${randomBytes(4).toString("hex")}`;
const PKGS = `pkgs-${randomBytes(4).toString("hex")}`;
const dir = path.join(xdg, "demesne", "images", NAME);
mkdirSync(dir, { recursive: true });
writeFileSync(path.join(dir, "Containerfile"), "FROM base\nRUN echo one > /one\n");
mkdirSync(path.join(xdg, "demesne", "images", PKGS), { recursive: true });
writeFileSync(path.join(xdg, "demesne", "images", PKGS, "Containerfile"), `FROM base
RUN rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && mkdir -p /srv/repo \\
 && printf 'Package: bash\\nVersion: 99.0-1\\nArchitecture: amd64\\nMaintainer: t <t@example.invalid>\\nInstalled-Size: 1\\nFilename: ./bash_99.0-1_amd64.deb\\nSize: 1\\nSHA256: ${"0".repeat(64)}\\nDescription: a newer bash\\n\\n' > /srv/repo/Packages \\
 && echo 'deb [trusted=yes] file:/srv/repo ./' > /etc/apt/sources.list
`);
const env = serverEnv({
  DEMESNE_ENGINE: ENGINE, XDG_CONFIG_HOME: xdg, DEMESNE_STATE_DIR: path.join(work, "state"),
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_NO_PULL: "1",
});

function demesne(...args) {
  const r = spawnSync(BIN, ["images", ...args], { env, encoding: "utf8", timeout: 600_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}
function engine(method, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: "/v1.41" + p, method }, (res) => {
      let data = "";
      res.on("data", (d) => (data += d));
      res.on("end", () => resolve({ status: res.statusCode, body: data }));
    });
    req.on("error", reject);
    req.end();
  });
}
async function builtIds(name) {
  const f = encodeURIComponent(JSON.stringify({ label: [`io.demesne.image=${name}`] }));
  return JSON.parse((await engine("GET", `/images/json?all=true&filters=${f}`)).body).map((i) => i.Id);
}

after(async () => {
  for (const name of [NAME, PKGS]) {
    for (const id of await builtIds(name)) await engine("DELETE", `/images/${id}?force=true`);
  }
  rmSync(work, { recursive: true, force: true });
});

test("an image whose inputs changed is reported outdated, and --refresh rebuilds it", async () => {
  let r = demesne("outdated", "--no-packages", NAME);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, new RegExp(`^${NAME} +demesne/${NAME}:[0-9a-f]{12} +not built$`, "m"));

  r = demesne("build", NAME);
  assert.equal(r.status, 0, r.stderr);
  const first = r.stdout.match(new RegExp(`demesne/${NAME}:[0-9a-f]{12}`))[0];
  r = demesne("outdated", "--no-packages", NAME);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, new RegExp(`^${NAME} +${first} +current inputs$`, "m"));

  appendFileSync(path.join(dir, "Containerfile"), "RUN echo two > /two\n");
  r = demesne("outdated", "--no-packages", NAME);
  assert.equal(r.status, 1, "outdated exits 1 when an image is outdated");
  const m = r.stdout.match(new RegExp(`^${NAME} +(demesne/${NAME}:[0-9a-f]{12}) +outdated: its inputs changed since `
    + `${first} \\(not built from them yet\\)$`, "m"));
  assert.ok(m, r.stdout);
  const second = m[1];
  assert.notEqual(second, first);

  r = demesne("build", NAME);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, new RegExp(`^${NAME} +outdated: its inputs changed since ${first}; building ${second}$`, "m"));
  r = demesne("outdated", "--no-packages", NAME);
  assert.equal(r.status, 0, r.stdout);
  assert.match(r.stdout, new RegExp(`^${NAME} +${second} +current inputs$`, "m"));

  const before = (await engine("GET", `/images/${encodeURIComponent(second)}/json`)).body;
  r = demesne("build", "--refresh", NAME);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, new RegExp(`^${NAME} +${second} \\([0-9.]+ s\\), rebuilt without the cache$`, "m"));
  const afterInspect = (await engine("GET", `/images/${encodeURIComponent(second)}/json`)).body;
  assert.notEqual(JSON.parse(afterInspect).Id, JSON.parse(before).Id, "the tag names a new image");
});

test("an image with a newer Debian package on offer is reported outdated, from a sandbox of it", async () => {
  let r = demesne("build", PKGS);
  assert.equal(r.status, 0, r.stderr);
  r = demesne("outdated", PKGS);
  assert.equal(r.status, 1, r.stdout + r.stderr);
  assert.match(r.stdout, new RegExp(`^${PKGS} +demesne/${PKGS}:[0-9a-f]{12} +current inputs$`, "m"));
  assert.match(r.stdout, /^ {4}deb bash 5\.\S+ -> 99\.0-1$/m);
  assert.match(r.stdout, new RegExp(`^ {4}outdated: 1 Debian and 0 npm packages have newer versions \\(\`demesne images build --refresh ${PKGS}\`\\)$`, "m"));
  assert.doesNotMatch(r.stdout, /not checked/);
});
