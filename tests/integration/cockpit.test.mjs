// The cockpit (`demesne ui`, `demesne ps`, `logs`, `cancel`) against a real engine
// (DEMESNE_ENGINE; run the file once per engine), in Chromium (playwright-core, Debian's
// /usr/bin/chromium): two servers of one user, a stdio one (the SDK client) and an HTTP one,
// registered in one control folder; a script tree of three levels (root -> mid -> leaf,
// tests/fixtures/cockpit) that appears on the page while it grows; a line of mid's output
// that streams in once the host says go; a Claude Code agent run (the scripted vendor,
// tests/integration/scripted-vendor.mjs) whose stream-json transcript streams in rendered,
// markup and all as text; the XSS matrix (a file named <img onerror>, output
// lines with <script>, an SVG and an HTML file with script, egress and MCP records with
// markup: nothing runs, no dialog opens); the page's own guards (cookie, Host, Origin, CSRF);
// a cancel of a subtree from the page that removes its containers; a budget raised and a TTL
// extended from the page; egress `ask` questions answered from the page (allow once: the
// held curl goes through; deny: it fails), with a loopback test host named by a loopback
// DNS server (tests/integration/egress-fixtures.mjs); the CLI's ps, logs and cancel;
// sandboxes that are no tree node (a foreground sandbox_script run, background jobs, a
// persistent sandbox) on the page and in ps, with the memory a job's shell holds (20 MB,
// the engine's stats), cancelled, killed and destroyed from the page and the CLI.
// Screenshots go to build/test-output/cockpit/.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFile } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { randomBytes } from "node:crypto";
import { tmpdir } from "node:os";
import path from "node:path";
import http from "node:http";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { BIN, ROOT, connect, isWarm, serverEnv } from "./helpers.mjs";
import { dnsServer, selfSigned, testHost } from "./egress-fixtures.mjs";
import { startVendor } from "./scripted-vendor.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const SOCKET = ENGINE.replace(/^unix:\/\//, "");
const FIX = path.join(ROOT, "tests/fixtures/cockpit");
const TREE_FIX = path.join(ROOT, "tests/fixtures/tree");
const SHOTS = path.join(ROOT, "build", "test-output", "cockpit");
const work = mkdtempSync(path.join(tmpdir(), "demesne-cockpit-"));
const CTL = path.join(work, "ctl");
const base = (tag) => ({
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_OUTPUT_ROOT: path.join(work, `out-${tag}`),
  DEMESNE_STATE_DIR: path.join(work, `state-${tag}`),
  DEMESNE_CONTROL_DIR: CTL,
  DEMESNE_ALLOWED_PATHS: `${FIX}:${TREE_FIX}`,
  DEMESNE_JOBS_POLL_INTERVAL: "0.5",
});
const LONG = { timeout: 600_000, resetTimeoutOnProgress: true, onprogress: () => {} };
const TOKEN = randomBytes(24).toString("hex");

let stdio, httpProc, httpClient, ui, uiUrl, browser, page, rootA, rootB, dns, askHost, vendor;
const SECRET = `sk-test-real-${randomBytes(12).toString("hex")}`;
// the stdio server's configuration: a policy that asks about *.asked.test, a long hold (the
// page answers), the test DNS server as the proxy's resolver
const XDG = path.join(work, "xdg");
mkdirSync(path.join(XDG, "demesne", "policies"), { recursive: true });
writeFileSync(path.join(XDG, "demesne", "policies", "asktest.lua"), `
  return { description = "cockpit ask tests", rules = {
    { ASK, host = ".asked.test", name = "asked" }, { ALLOW, cidr = "127.0.0.7/32", name = "test-host" } } }`);
writeFileSync(path.join(XDG, "demesne", "config.lua"), "return { ask_timeout_seconds = 300 }\n");
const dialogs = [];
const leftover = { jobs: [], sandboxes: [] }; // a failed test's background jobs and sandboxes (after() ends them)

async function okOn(client, name, args) {
  const res = await client.callTool({ name, arguments: args }, undefined, LONG);
  assert.ok(!res.isError, `${name} failed: ${res.content?.[0]?.text}`);
  return res.structuredContent;
}

/** Runs the CLI with this test's control folder. */
function cli(...args) {
  return new Promise((resolve) => {
    execFile(BIN, args, { env: serverEnv({ DEMESNE_CONTROL_DIR: CTL }), timeout: 300_000 }, (err, stdout, stderr) =>
      resolve({ code: err ? (err.code ?? 1) : 0, stdout, stderr }));
  });
}

function engine(method, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath: SOCKET, path: p, method }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve({ status: res.statusCode, body: body ? JSON.parse(body) : null }));
    });
    req.on("error", reject);
    req.end();
  });
}
const containerState = async (run) => {
  const r = await engine("GET", `/containers/demesne-${run}/json`);
  return r.status === 404 ? "gone" : r.body?.State?.Status;
};

/** A raw request to the page's server (node's http: it can send any Host and Origin). */
function raw(port, { method = "GET", pathname = "/", headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: "127.0.0.1", port, method, path: pathname, headers }, (res) => {
      let b = "";
      res.on("data", (c) => (b += c));
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: b }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

before(async () => {
  mkdirSync(SHOTS, { recursive: true });
  dns = await dnsServer({ "asked.test": "127.0.0.7" });
  askHost = await testHost("asked-host", "127.0.0.7", selfSigned(["asked.test"]));
  vendor = await startVendor({ secret: SECRET }); // the model of the agent run (Claude Code's API, scripted)
  stdio = await connect({ env: { ...base("a"), XDG_CONFIG_HOME: XDG, DEMESNE_EGRESS_RESOLVER: `127.0.0.1:${dns.port}`,
    ANTHROPIC_API_KEY: SECRET, DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${vendor.port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false" }, fixtures: false });
  // the HTTP server: port 0, the URL read from its log
  httpProc = spawn(BIN, ["serve", "--http", "127.0.0.1:0"], { env: serverEnv({ ...base("b"), DEMESNE_HTTP_TOKEN: TOKEN }),
    stdio: ["ignore", "ignore", "pipe"] });
  const mcpUrl = await new Promise((resolve, reject) => {
    let err = "";
    httpProc.stderr.on("data", (c) => {
      err += c;
      const m = err.match(/serving MCP over HTTP on (http:\/\/127\.0\.0\.1:\d+\/mcp)/);
      if (m) resolve(m[1]);
    });
    httpProc.on("exit", () => reject(new Error(`the HTTP server exited:\n${err}`)));
  });
  httpClient = new Client({ name: "cockpit-test", version: "1.0.0" });
  await httpClient.connect(new StreamableHTTPClientTransport(new URL(mcpUrl),
    { requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } } }));
  ui = spawn(BIN, ["ui", "--no-open"], { env: serverEnv({ DEMESNE_CONTROL_DIR: CTL }), stdio: ["ignore", "pipe", "pipe"] });
  uiUrl = await new Promise((resolve, reject) => {
    let out = "";
    ui.stdout.on("data", (c) => {
      out += c;
      const m = out.match(/(http:\/\/localhost:\d+\/login\?t=[0-9a-f]+)/);
      if (m) resolve(m[1]);
    });
    ui.on("exit", () => reject(new Error(`demesne ui exited:\n${out}`)));
  });
  const { chromium } = await import("playwright-core");
  browser = await chromium.launch({ executablePath: "/usr/bin/chromium", args: ["--headless", "--no-sandbox",
    "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run"] });
  page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  page.on("dialog", (d) => { dialogs.push(d.message()); d.dismiss().catch(() => {}); });
});

after(async () => {
  await browser?.close();
  ui?.kill("SIGTERM");
  for (const id of leftover.jobs) {
    await stdio?.client.callTool({ name: "sandbox_cancel", arguments: { job_id: id } }).catch(() => {});
  }
  for (const id of leftover.sandboxes) {
    await stdio?.client.callTool({ name: "sandbox_destroy", arguments: { sandbox_id: id } }).catch(() => {});
  }
  for (const [c, r] of [[stdio?.client, rootA], [httpClient, rootB]]) {
    if (c && r) await c.callTool({ name: "sandbox_destroy", arguments: { sandbox_id: r.sandbox_id } }).catch(() => {});
  }
  await stdio?.client.close();
  await httpClient?.close().catch(() => {});
  if (httpProc && httpProc.exitCode === null) {
    const gone = new Promise((r) => httpProc.on("exit", r));
    httpProc.kill("SIGTERM");
    await gone;
  }
  await askHost?.close();
  await vendor?.close();
  await dns?.close();
  rmSync(work, { recursive: true, force: true });
});

let leafRun;
const leafId = () => leafRun;
const nodeOf = (name) => page.locator(`[data-testid=node]:has([data-testid=node-name]:text-is("${name}"))`);

test("two servers on one page; a three-level tree appears and grows live; a line streams in; ps and logs", LONG,
  async () => {
    rootA = await okOn(stdio.client, "sandbox_create", { directories: [FIX, TREE_FIX], mcp: true, image: "default",
      egress: "none" });
    rootB = await okOn(httpClient, "sandbox_create", { mcp: true, image: "base", egress: "none", budget_usd: 2 });
    const res = await page.goto(uiUrl);
    assert.equal(res.status(), 200);
    assert.equal(new URL(page.url()).pathname, "/", "the one-time link sets the cookie and goes to the page");
    await page.waitForSelector("[data-testid=conn]:text-is('live')");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=server]").length === 2);
    assert.match(await page.locator("[data-testid=server][data-transport=http] h2").textContent(),
      /\(http:\/\/127\.0\.0\.1:\d+\/mcp\)/, "the HTTP server's URL, with the port it bound");
    const transports = await page.$$eval("[data-testid=server]", (xs) => xs.map((x) => x.getAttribute("data-transport")));
    assert.deepEqual(transports.sort(), ["http", "stdio"]);
    await page.waitForSelector(`[data-testid=tree][data-root="${rootA.sandbox_id}"]`);
    await page.waitForSelector(`[data-testid=tree][data-root="${rootB.sandbox_id}"]`);

    // the tree grows while the page is open: mid, then leaf, appear without a reload
    const run = await okOn(stdio.client, "sandbox_exec", { sandbox_id: rootA.sandbox_id, command: "sh /in/cockpit/root.sh",
      timeout_seconds: 120 });
    assert.equal(run.exit_code, 0, run.stderr);
    const treeA = page.locator(`[data-testid=tree][data-root="${rootA.sandbox_id}"]`);
    await treeA.locator("[data-testid=node-name]:text-is('leaf')").waitFor({ timeout: 120_000 });
    assert.deepEqual(await treeA.locator("[data-testid=node-name]").allTextContents(), ["(root)", "mid", "leaf"]);
    await page.waitForFunction((root) => [...document.querySelectorAll(`[data-root="${root}"] [data-testid=node]`)]
      .filter((n) => n.getAttribute("data-status") === "running").length === 3, rootA.sandbox_id, { timeout: 60_000 });
    const mid = await nodeOf("mid").getAttribute("data-run");
    const leaf = await nodeOf("leaf").getAttribute("data-run");

    // mid's output streams in: its first line, then the one it prints once the host says go
    await nodeOf("mid").click();
    await page.locator("[data-testid=transcript-line]", { hasText: "mid started leaf" }).waitFor({ timeout: 60_000 });
    assert.equal(await page.locator("[data-testid=transcript-line]", { hasText: "LINE-AFTER-GO" }).count(), 0);
    await okOn(stdio.client, "sandbox_exec", { sandbox_id: rootA.sandbox_id, command: "touch /workspace/go" });
    await page.locator("[data-testid=transcript-line]", { hasText: "LINE-AFTER-GO from mid" }).waitFor({ timeout: 60_000 });
    await page.screenshot({ path: path.join(SHOTS, "cockpit-tree.png"), fullPage: true });

    // the CLI sees the same: every node of both servers, mid's output
    const ps = await cli("ps");
    assert.equal(ps.code, 0, ps.stderr);
    for (const id of [rootA.sandbox_id, mid, leaf, rootB.sandbox_id]) assert.match(ps.stdout, new RegExp(id));
    assert.match(ps.stdout, /^stdio\/\d+ .*\bmid\b.*\bscript +default +container +none +running\b/m);
    assert.match(ps.stdout, /^http\/\d+ .*\bcreate\b.*\$2\.0000/m, "the HTTP server's tree, with its budget left");
    const logs = await cli("logs", mid);
    assert.equal(logs.code, 0, logs.stderr);
    assert.match(logs.stdout, /^mid started leaf job-/m);
    assert.match(logs.stdout, /^LINE-AFTER-GO from mid$/m);
    const unknown = await cli("logs", "no-such-run");
    assert.equal(unknown.code, 1);
    assert.match(unknown.stderr, /no run no-such-run \(tree node, job or sandbox\) in the 2 running demesne server\(s\)/);
  });

test("the XSS matrix: nothing a sandbox wrote runs in the page", LONG, async () => {
  await page.evaluate(() => { window.__pwned = undefined; });
  leafRun = await nodeOf("leaf").getAttribute("data-run");
  await nodeOf("leaf").click();
  await page.locator("[data-testid=transcript-line]", { hasText: "leaf is running" }).waitFor({ timeout: 60_000 });
  // the output lines are there as text
  const lines = await page.locator("[data-testid=transcript-line]").allTextContents();
  assert.ok(lines.includes("<script>window.__pwned=1</script>"), lines.join("\n"));
  assert.ok(lines.includes('<img src=x onerror="window.__pwned=1">'));
  // the file named <img …>, listed as text
  const names = await page.locator("[data-testid=file-name]").allTextContents();
  assert.ok(names.includes("<img src=x onerror=window.__pwned=1>"), names.join("\n"));
  // the egress and MCP records with markup, as text
  const detail = await page.locator("[data-testid=detail]").textContent();
  assert.ok(detail.includes("<img src=x onerror=window.__pwned=1>"), "the egress host name is shown as text");
  assert.ok(detail.includes("<b onmouseover=window.__pwned=1>x</b>"), "the MCP server name is shown as text");
  // each file shown: the SVG and the HTML as their source text, the PNG as an image
  for (const name of ["evil.svg", "evil.html"]) {
    await page.locator("tr", { has: page.locator(`[data-testid=file-name]:text-is("${name}")`) })
      .locator("[data-testid=file-show]").click();
    await page.locator("[data-testid=file-text]", { hasText: "<script>window.__pwned=1</script>" }).waitFor();
  }
  // the tree changes (a run of the same server comes and goes; the detail is drawn again):
  // the file being shown stays shown
  const drawn = Number(await page.locator("#detail").getAttribute("data-drawn"));
  const extra = await okOn(stdio.client, "sandbox_script", { image: "base", egress: "none", command: "true" });
  await page.locator(`[data-testid=run][data-root="${extra.run_id}"] [data-testid=node]`).waitFor({ timeout: 60_000 });
  await page.waitForFunction((n) => Number(document.querySelector("#detail")?.getAttribute("data-drawn")) > n, drawn,
    { timeout: 60_000 });
  assert.equal(await page.locator("[data-testid=file-text]", { hasText: "<script>window.__pwned=1</script>" }).count(), 1,
    "the file shown before the tree changed is still shown");
  await page.locator("tr", { has: page.locator('[data-testid=file-name]:text-is("dot.png")') })
    .locator("[data-testid=file-show]").click();
  await page.waitForFunction(() => document.querySelector("img.preview")?.naturalWidth === 1);
  await page.locator("[data-testid=node-name]:text-is('leaf')").hover(); // an onmouseover would fire now
  await page.screenshot({ path: path.join(SHOTS, "cockpit-xss.png"), fullPage: true });

  // downloads: attachment, octet-stream, nosniff, a sandboxing CSP; SVG is never an image here
  const q = (p, mode) => `/api/file?${new URLSearchParams({ server: String(stdio.transport.pid), id: leafId(), path: p,
    mode })}`;
  const head = await page.evaluate(async (urls) => Promise.all(urls.map(async (u) => {
    const r = await fetch(u);
    return { status: r.status, type: r.headers.get("content-type"), disp: r.headers.get("content-disposition"),
      nosniff: r.headers.get("x-content-type-options"), csp: r.headers.get("content-security-policy") };
  })), [q("evil.html", "download"), q("evil.svg", "download"), q("evil.svg", "image")]);
  for (const h of head.slice(0, 2)) {
    assert.equal(h.status, 200);
    assert.equal(h.type, "application/octet-stream");
    assert.match(h.disp, /^attachment; filename="evil\.(html|svg)"/);
    assert.equal(h.nosniff, "nosniff");
    assert.match(h.csp, /sandbox/);
  }
  assert.equal(head[2].status, 415, "an SVG is not served as an image");
  // opening the HTML file's URL in the page's origin downloads it: it never renders there
  const [download] = await Promise.all([page.waitForEvent("download"),
    page.evaluate((u) => { const a = document.createElement("a"); a.href = u; document.body.append(a); a.click(); },
      q("evil.html", "download"))]);
  assert.equal(download.suggestedFilename(), "evil.html");

  assert.equal(await page.evaluate(() => window.__pwned), undefined, "no payload ran");
  assert.deepEqual(dialogs, [], "no dialog opened");
});

test("an agent's transcript (Claude Code stream-json) streams in rendered, its markup as text", LONG, async () => {
  await page.evaluate(() => { window.__pwned = undefined; });
  const id = vendor.plan(`cockpit-${randomBytes(3).toString("hex")}`, [
    { shell: "echo 'AGENT-SHELL <script>window.__pwned=1</script>'" },
    { final: "AGENT-FINAL <img src=x onerror=window.__pwned=1>" }]);
  const job = await okOn(stdio.client, "sandbox_agent", { prompt: `PLAN:${id} say it`, model: "sonnet",
    background: true, timeout_seconds: 240 });
  const tree = page.locator(`[data-testid=tree][data-root="${job.run_id}"]`);
  await tree.waitFor({ timeout: 60_000 });
  await tree.locator("[data-testid=node]").click();
  const line = (text) => page.locator("[data-testid=transcript-line]", { hasText: text });
  await line("AGENT-FINAL").first().waitFor({ timeout: 240_000 });
  const lines = await page.locator("[data-testid=transcript-line]").allTextContents();
  assert.ok(lines.includes("assistant: AGENT-FINAL <img src=x onerror=window.__pwned=1>"), lines.join("\n"));
  assert.ok(lines.some((l) => /^tool result: AGENT-SHELL <script>window.__pwned=1<\/script>/.test(l)), lines.join("\n"));
  assert.ok(lines.some((l) => /^tool Bash: /.test(l)), "the tool call, rendered");
  assert.match(await page.locator("[data-testid=prompt]").textContent(), new RegExp(`^PLAN:${id} say it`));
  await tree.locator("[data-testid=node][data-status=succeeded]").waitFor({ timeout: 120_000 });
  assert.equal(await tree.locator("[data-testid=node] .meta").textContent().then((t) => /^agent · agent-claude_code/.test(t)),
    true, "kind and image");
  await page.screenshot({ path: path.join(SHOTS, "cockpit-agent.png"), fullPage: true });
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "no payload ran");
  assert.deepEqual(dialogs, []);
});

test("the page's guards: cookie, Host, Origin, CSRF", async () => {
  const port = Number(new URL(uiUrl).port);
  const cookie = (await page.context().cookies()).find((c) => c.name === "demesne_ui");
  assert.ok(cookie, "the session cookie");
  assert.equal(cookie.httpOnly, true);
  assert.equal(cookie.sameSite, "Strict");
  // the page is named localhost: a cookie of 127.0.0.1 would go to every port preview
  // (http://127.0.0.1:<port>, a sandbox's server) the person opens
  assert.equal(cookie.domain, "localhost", "the cookie is localhost's, a host no preview has");
  const host = `localhost:${port}`;
  const auth = `demesne_ui=${cookie.value}`;
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: host } })).status, 401, "no cookie");
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: host, Cookie: "demesne_ui=wrong" } })).status,
    401);
  assert.equal((await raw(port, { pathname: new URL(uiUrl).pathname + new URL(uiUrl).search,
    headers: { Host: host } })).status, 403, "the one-time link works once");
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: `evil.example:${port}`, Cookie: auth } }))
    .status, 421, "DNS rebinding: another Host");
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: `127.0.0.1:${port}`, Cookie: auth } }))
    .status, 421, "the previews' host name is not the page's");
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: host, Cookie: auth,
    Origin: "http://evil.example" } })).status, 403);
  assert.equal((await raw(port, { pathname: "/api/state", headers: { Host: host, Cookie: auth,
    Origin: `http://localhost:${port + 1}` } })).status, 403, "another port is another origin");
  const ok = await raw(port, { pathname: "/", headers: { Host: host, Cookie: auth } });
  assert.equal(ok.status, 200);
  assert.match(ok.headers["content-security-policy"], /script-src 'self';/);
  assert.doesNotMatch(ok.headers["content-security-policy"], /unsafe-inline|unsafe-eval/);
  assert.doesNotMatch(ok.body, /<script>/, "no inline script in the page");
  // an action without the CSRF token, or from another origin, is refused (and does nothing)
  const body = JSON.stringify({ server: stdio.transport.pid, action: "cancel", id: leafRun });
  const post = (headers) => raw(port, { method: "POST", pathname: "/api/action", body,
    headers: { Host: host, Cookie: auth, "Content-Type": "application/json", ...headers } });
  assert.equal((await post({ Origin: `http://${host}` })).status, 403, "no CSRF token");
  assert.equal((await post({ Origin: `http://${host}`, "X-Demesne-CSRF": "0".repeat(64) })).status, 403);
  const csrf = JSON.parse((await raw(port, { pathname: "/api/session", headers: { Host: host, Cookie: auth } })).body).csrf;
  assert.equal((await post({ Origin: "http://evil.example", "X-Demesne-CSRF": csrf })).status, 403);
  assert.equal((await post({ "X-Demesne-CSRF": csrf })).status, 403, "an action must name its Origin");
  assert.equal(await containerState(leafRun), "running", "no refused action touched the run");
});

test("egress questions at the top of the page: allow once lets the held curl through, deny refuses it", LONG,
  async () => {
    const url = (p) => `https://asked.test${askHost.httpsPort === 443 ? "" : `:${askHost.httpsPort}`}${p}`;
    const script = (p) => okOn(stdio.client, "sandbox_script", { image: "base", egress: "asktest",
      command: `curl -sS -k --max-time 200 ${url(p)}; echo "rc=$?"` });
    const asks = page.locator("[data-testid=ask]");
    for (const [p, button] of [["/once", "ask-once"], ["/denied", "ask-deny"]]) {
      const before = askHost.hits;
      const call = script(p); // held until the page answers
      await asks.first().waitFor({ timeout: 120_000 });
      assert.equal(await asks.count(), 1, "one question");
      assert.equal(await asks.locator("[data-testid=ask-host]").textContent(), `asked.test:${askHost.httpsPort}`);
      assert.match(await asks.textContent(), /no host inputs/);
      if (p === "/once") await page.screenshot({ path: path.join(SHOTS, "cockpit-ask.png"), fullPage: true });
      assert.equal(askHost.hits, before, "nothing reached the host while the question waits");
      await asks.locator(`[data-testid=${button}]`).click();
      const r = await call;
      await page.waitForFunction(() => document.querySelectorAll("[data-testid=ask]").length === 0);
      const logPath = path.join(r.output_dir, "egress.jsonl");
      const log = existsSync(logPath) ? readFileSync(logPath, "utf8").split("\n").filter(Boolean).map((l) => JSON.parse(l))
        : [];
      if (p === "/once") {
        assert.match(r.stdout, /^asked-host GET \/once host=asked\.test/m);
        assert.match(r.stdout, /rc=0/);
        assert.equal(askHost.hits - before, 1);
        assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decision, l.decided_by]),
          [["asked.test", "allow", "once", "cockpit"]], JSON.stringify(log));
      } else {
        assert.doesNotMatch(r.stdout, /asked-host|rc=0/);
        assert.match(r.stderr, /403/);
        assert.equal(askHost.hits - before, 0, "a denied request never reaches the host");
        assert.deepEqual(log.map((l) => [l.host, l.verdict, l.decision, l.decided_by]),
          [["asked.test", "deny", "deny", "cockpit"]], JSON.stringify(log));
      }
    }
  });

test("sandboxes that are no tree node: a background job, a persistent sandbox and a foreground run on the page and in "
  + "ps, with the memory they use; cancel and destroy from the page, cancel by job id from the CLI", LONG, async () => {
  // a foreground run that has ended: kept, with its exit code
  const fg = await okOn(stdio.client, "sandbox_script", { command: "echo FG-RAN", image: "base", egress: "none" });
  assert.equal(fg.exit_code, 0);
  // a background job whose shell holds 20 MB in a variable, and a persistent sandbox
  const job = await okOn(stdio.client, "sandbox_script", { background: true, image: "base", egress: "none",
    limits: { memory_mb: 512 },
    timeout_seconds: 900, command: "x=$(head -c 20000000 /dev/zero | tr '\\0' a); echo JOB-HOLDS; sleep 600" });
  const job2 = await okOn(stdio.client, "sandbox_script", { background: true, image: "base", egress: "none",
    command: "echo JOB2; sleep 600" });
  const sb = await okOn(stdio.client, "sandbox_create", { image: "base", egress: "none", limits: { memory_mb: 384 } });
  leftover.jobs.push(job.job_id, job2.job_id);
  leftover.sandboxes.push(sb.sandbox_id);
  for (const r of [job.run_id, job2.run_id, sb.sandbox_id]) assert.equal(await containerState(r), "running");
  const runOf = (id) => page.locator(`[data-testid=run][data-root="${id}"] [data-testid=node]`);
  for (const id of [fg.run_id, job.run_id, job2.run_id, sb.sandbox_id]) await runOf(id).waitFor({ timeout: 60_000 });
  assert.equal(await runOf(fg.run_id).getAttribute("data-status"), "succeeded");
  // (a run is listed first as "starting": the page shows "running" with the next state event)
  for (const id of [job.run_id, sb.sandbox_id]) {
    await page.waitForFunction((r) => document.querySelector(`[data-testid=run][data-root="${r}"] [data-testid=node]`)
      ?.getAttribute("data-status") === "running", id, { timeout: 60_000 });
    assert.equal(await runOf(id).getAttribute("data-status"), "running");
  }
  assert.match(await runOf(job.run_id).textContent(), new RegExp(`sandbox_script \\(${job.job_id}\\).*script · base · `
    + "(container|gvisor) · egress none · .*512 MB \\d+(\\.\\d+)? CPU \\d+ pids"));
  assert.match(await runOf(sb.sandbox_id).textContent(), /persistent sandbox.*create · base · .*384 MB.* · expires /);
  // memory used: the job's shell holds its 20 MB (the engine's stats, not its limit)
  await page.waitForFunction((id) => {
    const m = document.querySelector(`[data-testid=run][data-root="${id}"] [data-testid=node-memory]`);
    return m && parseFloat(m.textContent) >= 15;
  }, job.run_id, { timeout: 60_000 });
  const used = parseFloat(await runOf(job.run_id).locator("[data-testid=node-memory]").textContent());
  assert.ok(used >= 15 && used < 512, `the job uses about 20 MB: ${used} MB`);
  const total = parseFloat(await page.locator("[data-testid=memory-used]").textContent());
  assert.ok(total >= used, `the totals' memory used (${total} MB) counts the job's (${used} MB)`);
  assert.match(await page.locator("[data-testid=memory-reserved]").textContent(), /^\d+ MB$/);
  await page.screenshot({ path: path.join(SHOTS, "cockpit-runs.png"), fullPage: true });

  // the CLI: the same rows; logs and cancel by job id
  const ps = await cli("ps");
  assert.equal(ps.code, 0, ps.stderr);
  assert.match(ps.stdout, new RegExp(`^stdio/\\d+ +${job.run_id} +job-.* script +base .* running .* \\d+\\.\\dM/512M`, "m"));
  assert.match(ps.stdout, new RegExp(`^stdio/\\d+ +${sb.sandbox_id} +\\(persistent\\) +create +base .* running `, "m"));
  assert.match(ps.stdout, new RegExp(`^stdio/\\d+ +${fg.run_id} +\\(sandbox_script\\) +script +base .* succeeded `, "m"));
  const logs = await cli("logs", job.job_id);
  assert.equal(logs.code, 0, logs.stderr);
  assert.match(logs.stdout, /^JOB-HOLDS$/m);
  const c2 = await cli("cancel", job2.job_id);
  assert.equal(c2.code, 0, c2.stderr);
  assert.match(c2.stdout, new RegExp(`^${job2.job_id}: cancelled$`, "m"));
  assert.equal(await containerState(job2.run_id), "gone");

  // the page: the job's detail (its command, its output), cancelled; the sandbox's TTL, then destroyed
  await runOf(job.run_id).click();
  await page.locator("[data-testid=detail-title]", { hasText: job.run_id }).waitFor();
  assert.match(await page.locator("[data-testid=prompt]").textContent(), /echo JOB-HOLDS/);
  await page.locator("[data-testid=transcript-line]", { hasText: "JOB-HOLDS" }).waitFor({ timeout: 30_000 });
  assert.equal(await page.locator("[data-testid=cancel-subtree]").count(), 0, "no subtree to a run of its own");
  await page.locator("[data-testid=cancel-node]").click();
  await page.waitForFunction((id) => document.querySelector(`[data-testid=run][data-root="${id}"] [data-testid=node]`)
    ?.getAttribute("data-status") === "cancelled", job.run_id, { timeout: 120_000 });
  assert.equal(await containerState(job.run_id), "gone");
  const gone = await okOn(stdio.client, "sandbox_status", { job_id: job.job_id });
  assert.equal(gone.status, "cancelled");

  // a foreground run a call waits for: found by the CLI, killed by `demesne cancel`; the call answers
  const call = stdio.client.callTool({ name: "sandbox_script", arguments: { image: "base", egress: "none",
    command: "echo FG-LONG; sleep 600" } }, undefined, LONG);
  let fgLong;
  while (!fgLong) {
    const js = await cli("ps", "--json");
    assert.equal(js.code, 0, js.stderr);
    fgLong = JSON.parse(js.stdout).servers.flatMap((x) => x.trees).flatMap((t) => t.nodes)
      .find((n) => n.standalone && n.kind === "script" && n.active && !n.job_id && n.status === "running");
    if (!fgLong) await new Promise((r) => setTimeout(r, 300));
  }
  assert.equal(fgLong.tool, "sandbox_script");
  assert.equal(await containerState(fgLong.run_id), "running");
  const killed = await cli("cancel", fgLong.run_id);
  assert.equal(killed.code, 0, killed.stderr);
  assert.match(killed.stdout, new RegExp(`^${fgLong.run_id}: killed$`, "m"));
  const answered = await call;
  assert.ok(answered.isError || answered.structuredContent?.exit_code === 137,
    `the call ends: ${JSON.stringify(answered.structuredContent ?? answered.content)}`);
  await runOf(fgLong.run_id).waitFor({ timeout: 60_000 });
  await page.waitForFunction((id) => document.querySelector(`[data-testid=run][data-root="${id}"] [data-testid=node]`)
    ?.getAttribute("data-status") !== "running", fgLong.run_id, { timeout: 60_000 });
  assert.equal(await containerState(fgLong.run_id), "gone");

  await runOf(sb.sandbox_id).click();
  await page.locator("[data-testid=detail-title]", { hasText: sb.sandbox_id }).waitFor();
  const expiry = async () => (await okOn(stdio.client, "sandbox_list", {})).sandboxes
    .find((x) => x.sandbox_id === sb.sandbox_id).expires_at;
  const before = await expiry();
  await page.locator("[data-testid=ttl-seconds]").fill("1200");
  await page.locator("[data-testid=extend-ttl]").click();
  await page.locator("[data-testid=action-note]", { hasText: /^extend TTL: (?!…)/ }).waitFor();
  assert.equal(await page.locator("[data-testid=action-note]").textContent(), "extend TTL: done");
  assert.ok(Date.parse(await expiry()) >= Date.parse(before) + 1200_000 - 1000, "expires_at moved by 1200 s");
  assert.equal(await page.locator("[data-testid=cancel-node]").textContent(), "destroy");
  await page.locator("[data-testid=cancel-node]").click();
  await page.locator(`[data-testid=run][data-root="${sb.sandbox_id}"]`).waitFor({ state: "detached", timeout: 60_000 });
  assert.equal(await containerState(sb.sandbox_id), "gone");
});

test("cancel of a subtree from the page removes its containers; budget and TTL from the page; CLI cancel", LONG,
  async () => {
    const mid = await nodeOf("mid").getAttribute("data-run");
    const refused = await cli("cancel", mid);
    assert.equal(refused.code, 1);
    assert.match(refused.stderr, /has 1 running child run\(s\): cancel its subtree/);
    assert.equal(await containerState(mid), "running");

    await nodeOf("mid").click();
    await page.locator("[data-testid=detail-title]", { hasText: mid }).waitFor();
    await page.locator("[data-testid=cancel-subtree]").click();
    // the page updates on its own: both end
    for (const name of ["mid", "leaf"]) {
      await page.waitForFunction((n) => [...document.querySelectorAll("[data-testid=node]")].some((x) =>
        x.querySelector("[data-testid=node-name]")?.textContent === n && x.getAttribute("data-status") !== "running"),
      name, { timeout: 120_000 });
    }
    assert.equal(await containerState(mid), "gone");
    assert.equal(await containerState(leafRun), "gone");
    // an ended run's output, followed: printed whole, then the command ends
    const followed = await cli("logs", "--follow", mid);
    assert.equal(followed.code, 0, followed.stderr);
    assert.match(followed.stdout, /^mid started leaf job-.*\nLINE-AFTER-GO from mid\n$/);
    assert.equal(await containerState(rootA.sandbox_id), "running", "the root goes on");
    assert.equal(await page.locator(`[data-testid=tree][data-root="${rootA.sandbox_id}"] > li > [data-testid=node]`)
      .getAttribute("data-status"), "running");

    // the HTTP server's tree: its budget raised, its sandbox's TTL extended, from the page
    const treeB = page.locator(`[data-testid=tree][data-root="${rootB.sandbox_id}"]`);
    await treeB.locator("[data-testid=node]").click();
    await page.locator("[data-testid=detail-title]", { hasText: rootB.sandbox_id }).waitFor();
    await page.locator("[data-testid=budget-usd]").fill("7.5");
    await page.locator("[data-testid=raise-budget]").click();
    await treeB.locator("[data-testid=node]", { hasText: "budget left $7.5000" }).waitFor({ timeout: 30_000 });
    assert.equal(await page.locator(`[data-testid=server][data-transport=http] [data-testid=burn]`).getAttribute("max"),
      "7.5", "the burn-down bar follows the budget");
    assert.equal(await page.locator("[data-testid=attach]").textContent(), `demesne attach ${rootB.sandbox_id}`);
    const expiry = async () => (await okOn(httpClient, "sandbox_list", {})).sandboxes
      .find((x) => x.sandbox_id === rootB.sandbox_id).expires_at;
    const before = await expiry();
    await page.locator("[data-testid=ttl-seconds]").fill("1800");
    await page.locator("[data-testid=extend-ttl]").click();
    await page.locator("[data-testid=action-note]", { hasText: /^extend TTL: (?!…)/ }).waitFor();
    assert.equal(await page.locator("[data-testid=action-note]").textContent(), "extend TTL: done");
    const afterTtl = await expiry();
    assert.ok(Date.parse(afterTtl) >= Date.parse(before) + 1800_000 - 1000,
      `expires_at moved by 1800 s: ${before} -> ${afterTtl}`);
    await page.screenshot({ path: path.join(SHOTS, "cockpit-cancelled.png"), fullPage: true });

    // the CLI cancels the HTTP server's root
    const c = await cli("cancel", rootB.sandbox_id);
    assert.equal(c.code, 0, c.stderr);
    assert.match(c.stdout, new RegExp(`^${rootB.sandbox_id}: (cancelled|destroyed)`, "m"));
    assert.equal(await containerState(rootB.sandbox_id), "gone");
    rootB = null;

    // nothing is left behind once the stdio server's root goes too
    await okOn(stdio.client, "sandbox_destroy", { sandbox_id: rootA.sandbox_id });
    rootA = null;
    const filters = encodeURIComponent(JSON.stringify({ label: ["io.demesne.managed=1"] }));
    const left = (await engine("GET", `/containers/json?all=true&filters=${filters}`)).body
      .filter((x) => (x.Labels["io.demesne.output_dir"] || "").startsWith(work) && !isWarm(x));
    assert.deepEqual(left.map((x) => x.Names), [], "no container of this test is left (but the warm pool's)");
  });
