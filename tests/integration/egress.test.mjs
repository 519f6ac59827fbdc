// Egress over MCP against a real engine (DEMESNE_ENGINE; tests/run runs this once per
// engine). Sandboxes have no network; the host proxy judges every name. The test hosts are
// loopback servers (allowed.test = 127.0.0.2, other.test = 127.0.0.3) named by a test DNS
// server on loopback that the proxy asks (DEMESNE_EGRESS_RESOLVER), an IPv6 host in a
// network namespace made here (C20), and nothing else. Cases C14–C20 are in the titles.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import http from "node:http";
import net from "node:net";
import { createHash } from "node:crypto";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { connect } from "./helpers.mjs";
import { dnsServer, selfSigned, testHost, ipv6Host } from "./egress-fixtures.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-egress-"));
const xdg = path.join(work, "xdg");
const inputs = path.join(work, "inputs");
mkdirSync(path.join(xdg, "demesne", "policies"), { recursive: true });
mkdirSync(inputs, { recursive: true });
writeFileSync(path.join(inputs, "secret.txt"), "secret\n");

let dns, hostA, hostB, conn;
const tls = selfSigned(["allowed.test", "*.allowed.test", "other.test"]);

before(async () => {
  dns = await dnsServer({
    "allowed.test": "127.0.0.2", "sub.allowed.test": "127.0.0.2", "a.b.allowed.test": "127.0.0.2",
    "other.test": "127.0.0.3", "private.test": "10.255.255.1", "registry.allowed.test": "127.0.0.2",
  });
  hostA = await testHost("host-a", "127.0.0.2", tls);
  hostB = await testHost("host-b", "127.0.0.3", tls);
  // The test policy: names first, then the one loopback address the allowed names resolve to.
  writeFileSync(path.join(xdg, "demesne", "policies", "test.lua"), `
    return {
      description = "egress integration tests",
      rules = {
        { DENY, host = ".denied.test", name = "denied" },
        { ALLOW, host = { "allowed.test", "*.allowed.test", "private.test" }, name = "allowed" },
        { ALLOW, cidr = "127.0.0.2/32", name = "test-host-a" },
      },
    }`);
  conn = await connect({ fixtures: false, env: serverEnv() });
});

function serverEnv() {
  return {
    DEMESNE_ENGINE: ENGINE, DEMESNE_ALLOWED_PATHS: inputs, XDG_CONFIG_HOME: xdg,
    DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    DEMESNE_EGRESS_RESOLVER: `127.0.0.1:${dns.port}`,
  };
}

after(async () => {
  await conn?.client.close();
  await hostA?.close();
  await hostB?.close();
  await dns?.close();
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
async function script(command, extra = {}) {
  return ok("sandbox_script", { command, image: "base", egress: "test", ...extra });
}
function egressLog(r) {
  const p = path.join(r.output_dir, "egress.jsonl");
  if (!existsSync(p)) return [];
  return readFileSync(p, "utf8").split("\n").filter(Boolean).map((l) => JSON.parse(l));
}
const A = () => (hostA.httpsPort === 443 ? "allowed.test" : `allowed.test:${hostA.httpsPort}`);
const Ahttp = () => (hostA.httpPort === 80 ? "allowed.test" : `allowed.test:${hostA.httpPort}`);
const CURL = "curl -sS --max-time 10";

test("curl over HTTP and HTTPS (CONNECT) reaches an allowed test host; each connection is logged", async () => {
  const before = hostA.hits;
  const r = await script(`${CURL} http://${Ahttp()}/plain; ${CURL} -k https://${A()}/tls; echo "proxy=$HTTPS_PROXY"`);
  assert.equal(r.exit_code, 0, r.stderr);
  assert.match(r.stdout, /^host-a GET \/plain host=allowed\.test/m);
  assert.match(r.stdout, /^host-a GET \/tls host=allowed\.test/m);
  assert.match(r.stdout, /proxy=http:\/\/127\.0\.0\.1:3128/);
  assert.equal(hostA.hits - before, 2);
  const log = egressLog(r);
  assert.equal(log.length, 2);
  assert.deepEqual(log.map((l) => [l.method, l.host, l.verdict, l.rule]),
    [["GET", "allowed.test", "allow", "test#2 allowed"], ["CONNECT", "allowed.test", "allow", "test#2 allowed"]]);
  for (const l of log) {
    assert.ok(l.bytes_up > 0 && l.bytes_down > 0, JSON.stringify(l));
    assert.match(l.address, /^127\.0\.0\.2:\d+$/);
    assert.ok(l.time && l.sandbox === r.run_id);
  }
  assert.ok(dns.queries.includes("allowed.test"), "the proxy asked the test resolver");
});

test("C18: https://allowed.test, :443, a *.allowed.test name and http://allowed.test:80 all succeed", async () => {
  const urls = [`https://${A()}/`, `https://allowed.test:${hostA.httpsPort}/`, `https://sub.${A()}/`,
    `http://allowed.test:${hostA.httpPort}/`, `https://a.b.${A()}/`];
  const r = await script(urls.map((u) => `${CURL} -k -o /dev/null -w '%{http_code}\\n' ${u}`).join("; "));
  assert.equal(r.exit_code, 0, r.stderr);
  assert.deepEqual(r.stdout.trim().split("\n"), urls.map(() => "200"));
  // one logged connection per URL, each allowed by the rule for allowed.test (a log that
  // is missing or short fails here, where `every` over it would pass)
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.rule]), [
    ["allowed.test", "allow", "test#2 allowed"], ["allowed.test", "allow", "test#2 allowed"],
    ["sub.allowed.test", "allow", "test#2 allowed"], ["allowed.test", "allow", "test#2 allowed"],
    ["a.b.allowed.test", "allow", "test#2 allowed"]], JSON.stringify(log));
});

// The host's own proxy (a corporate HTTPS_PROXY): a loopback upstream proxy that reaches the
// test hosts by its own name table. Allowed requests go through it with its credentials, the
// policy still decides first (a denied name never reaches it), NO_PROXY names are dialled
// directly, and its refusal (407) reaches the sandbox as a 502 that says so.
async function upstreamProxy() {
  const names = { "allowed.test": "127.0.0.2", "sub.allowed.test": "127.0.0.2", "a.b.allowed.test": "127.0.0.2" };
  const state = { seen: [] };
  const authOk = (req) => req.headers["proxy-authorization"] === `Basic ${Buffer.from("corp:pa:ss").toString("base64")}`;
  state.server = http.createServer((req, res) => { // absolute-form plain HTTP
    const u = new URL(req.url);
    state.seen.push({ method: req.method, target: req.url, auth: authOk(req), sandboxAuth: req.headers["x-sandbox-auth"] });
    const headers = { ...req.headers };
    delete headers["proxy-authorization"];
    const fwd = http.request({ host: names[u.hostname], port: hostA.httpPort, path: u.pathname, method: req.method, headers }, (up) => { res.writeHead(up.statusCode, up.headers); up.pipe(res); });
    fwd.on("error", () => { res.writeHead(502); res.end(); });
    req.pipe(fwd);
  });
  state.server.on("connect", (req, sock, head) => {
    state.seen.push({ method: "CONNECT", target: req.url, auth: authOk(req) });
    const [host, port] = req.url.split(":");
    if (!authOk(req) || host === "a.b.allowed.test") {
      sock.end("HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=corp\r\nContent-Length: 0\r\n\r\n");
      return;
    }
    const up = net.connect(port === "443" ? hostA.httpsPort : Number(port), names[host], () => {
      sock.write("HTTP/1.1 200 Connection established\r\n\r\n");
      up.write(head);
      up.pipe(sock);
      sock.pipe(up);
    });
    up.on("error", () => sock.destroy());
    sock.on("error", () => up.destroy());
  });
  await new Promise((r) => state.server.listen(0, "127.0.0.1", r));
  state.port = state.server.address().port;
  state.close = () => new Promise((r) => { state.server.closeAllConnections?.(); state.server.close(r); });
  return state;
}

test("the host's own proxy: allowed requests go through HTTPS_PROXY/HTTP_PROXY, denied ones never reach it, NO_PROXY is dialled directly", async () => {
  const up = await upstreamProxy();
  const c = await connect({ fixtures: false, env: { ...serverEnv(), DEMESNE_STATE_DIR: path.join(work, "state-upstream"),
    DEMESNE_EGRESS_HTTPS_PROXY: `http://corp:pa%3Ass@127.0.0.1:${up.port}`,
    DEMESNE_EGRESS_HTTP_PROXY: `http://corp:pa%3Ass@127.0.0.1:${up.port}/`,
    DEMESNE_EGRESS_NO_PROXY: "localhost, .sub.allowed.test" } });
  try {
    const before = hostA.hits;
    const queries = dns.queries.length;
    const res = await c.client.callTool({ name: "sandbox_script", arguments: { image: "base", egress: "test", command:
      `${CURL} -k https://${A()}/via-tls; ${CURL} -H 'x-sandbox-auth: 1' -H 'Proxy-Authorization: Basic c2FuZGJveA==' http://${Ahttp()}/via-plain; `
      + `${CURL} -k -o /dev/null -w '%{http_code}\\n' https://denied.test/ 2>&1; `
      + `${CURL} -k https://sub.${A()}/direct; `
      + `${CURL} -k -o /dev/null https://a.b.${A()}/ 2>&1; echo "refused=$?"` } }, undefined, LONG);
    assert.ok(!res.isError, res.content?.[0]?.text);
    const r = res.structuredContent;
    assert.match(r.stdout, /^host-a GET \/via-tls host=allowed\.test/m);
    assert.match(r.stdout, /^host-a GET \/via-plain host=allowed\.test/m);
    assert.match(r.stdout, /^host-a GET \/direct host=sub\.allowed\.test/m, "a NO_PROXY name is dialled directly");
    assert.match(r.stdout, /refused=56/, "curl: the CONNECT tunnel failed");
    assert.equal(hostA.hits - before, 3);
    // what the upstream proxy saw: the two allowed requests with the host's credentials, the
    // refused one, never the denied name nor the NO_PROXY one, never the sandbox's Proxy-Authorization
    assert.deepEqual(up.seen.map((x) => [x.method, x.target, x.auth]), [
      ["CONNECT", `allowed.test:${hostA.httpsPort}`, true],
      ["GET", `http://${Ahttp()}/via-plain`, true],
      ["CONNECT", `a.b.allowed.test:${hostA.httpsPort}`, true]]);
    assert.equal(up.seen[1].sandboxAuth, "1", "the sandbox's own headers are forwarded");
    // a record is written when its connection ends (the plain GET's may come after the next
    // curl's refusal), so in the order the requests began (`time`; the curls run one by one)
    const log = egressLog(r).sort((a, b) => Date.parse(a.time) - Date.parse(b.time));
    assert.deepEqual(log.map((l) => [l.method, l.host, l.verdict, l.via ?? null]), [
      ["CONNECT", "allowed.test", "allow", `http://…@127.0.0.1:${up.port}`],
      ["GET", "allowed.test", "allow", `http://…@127.0.0.1:${up.port}`],
      ["CONNECT", "denied.test", "deny", null],
      ["CONNECT", "sub.allowed.test", "allow", null],
      ["CONNECT", "a.b.allowed.test", "allow", `http://…@127.0.0.1:${up.port}`]], JSON.stringify(log));
    assert.equal(log[0].address, `127.0.0.1:${up.port}`, "the address dialled is the upstream proxy's");
    assert.match(log[4].error, /answered CONNECT with "HTTP\/1\.1 407 Proxy Authentication Required"/);
    assert.equal(log[4].status, 502);
    // the names that went through the upstream proxy were never looked up on this host
    const asked = dns.queries.slice(queries);
    assert.ok(!asked.includes("allowed.test") && !asked.includes("a.b.allowed.test"), JSON.stringify(asked));
    assert.ok(asked.includes("sub.allowed.test"), "the NO_PROXY name was resolved here");
    for (const l of log) assert.ok(!JSON.stringify(l).includes("pa:ss") && !JSON.stringify(l).includes("corp:"), "no credential in egress.jsonl");
  } finally {
    await c.client.close();
    await up.close();
  }
});

test("a host proxy setting that is not a proxy URL fails the sandbox's start naming the setting", async () => {
  const c = await connect({ fixtures: false, env: { ...serverEnv(), DEMESNE_STATE_DIR: path.join(work, "state-upstream-bad"),
    DEMESNE_EGRESS_HTTPS_PROXY: "socks5://127.0.0.1:1080" } });
  try {
    const res = await c.client.callTool({ name: "sandbox_script", arguments: { image: "base", egress: "test", command: "true" } },
      undefined, LONG);
    assert.equal(res.isError, true);
    assert.match(res.content[0].text, /egress_https_proxy: "socks5:\/\/127\.0\.0\.1:1080": only http:\/\/ proxies are supported/);
  } finally {
    await c.client.close();
  }
});

test("C17: 50 times each of 7 spellings of a denied name: every attempt denied", async () => {
  const before = hostA.hits + hostB.hits;
  const spellings = ["https://denied.test", "http://denied.test", "denied.test:8443", "https://DENIED.TEST",
    "https://denied.test.", "https://allowed.test.denied.test", "https://denied-allowed.test"];
  const r = await script(`for i in $(seq 50); do for u in ${spellings.join(" ")}; do ` +
    `curl -s -k -o /dev/null --max-time 5 -w '%{http_code}/%{http_connect}\\n' "$u"; done; done`);
  const codes = r.stdout.trim().split("\n");
  assert.equal(codes.length, 350);
  assert.ok(codes.every((c) => c.includes("403") && !c.includes("200")), `not all denied: ${[...new Set(codes)]}`);
  const log = egressLog(r);
  assert.equal(log.length, 350);
  assert.ok(log.every((l) => l.verdict === "deny" && l.bytes_down === 0 && !l.address), "all logged as denied");
  assert.equal(hostA.hits + hostB.hits, before, "no test host was reached");
  assert.ok(!dns.queries.some((q) => q.includes("denied")), "no denied name was looked up");
});

test("C14: a denied name is never looked up: no DNS query for exfil-<random>.denied.test", async () => {
  const name = `exfil-${Math.random().toString(36).slice(2, 10)}.denied.test`;
  const r = await ok("sandbox_script", { image: "default", egress: "test", command:
    `getent hosts ${name}; echo getent=$?; ` +
    `python3 -c "import socket; socket.gethostbyname('${name}')" 2>/dev/null; echo python=$?; ` +
    `${CURL} -k https://${name}/ 2>&1; echo curl=$?` });
  assert.match(r.stdout, /getent=2/);
  assert.match(r.stdout, /python=1/);
  assert.match(r.stdout, /curl=56/);
  assert.ok(!dns.queries.some((q) => q.includes("exfil")), `queried: ${dns.queries}`);
  const log = egressLog(r);
  assert.equal(log.length, 1);
  assert.deepEqual([log[0].host, log[0].verdict, log[0].rule], [name, "deny", "test#1 denied"]);
});

test("C15: --resolve to another test host and a CONNECT with a different Host header reach only the resolved address", async () => {
  const before = hostB.hits;
  const r = await script(
    `${CURL} -k --resolve allowed.test:${hostA.httpsPort}:127.0.0.3 https://${A()}/resolve; ` +
    `${CURL} -k --proxy-header 'Host: other.test:${hostB.httpsPort}' https://${A()}/hosthdr; ` +
    `${CURL} -k --proxy-header 'Host: allowed.test:${hostA.httpsPort}' https://denied.test/ 2>&1; echo denied=$?`);
  assert.match(r.stdout, /^host-a GET \/resolve/m);
  assert.match(r.stdout, /^host-a GET \/hosthdr/m);
  assert.match(r.stdout, /denied=56/);
  assert.equal(hostB.hits, before, "the other test host was never reached");
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict]), [["allowed.test", "allow"], ["allowed.test", "allow"], ["denied.test", "deny"]]);
  assert.ok(log.slice(0, 2).every((l) => l.address.startsWith("127.0.0.2:")));
});

test("C16: a relay inside the sandbox in front of the proxy is still denied", async () => {
  const relay = "import socket,threading\n" +
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 9999)); s.listen()\n" +
    "def pipe(a, b):\n" +
    "  while (d := a.recv(65536)): b.sendall(d)\n" +
    "  b.shutdown(socket.SHUT_WR)\n" +
    "while True:\n" +
    "  c, _ = s.accept(); u = socket.create_connection(('127.0.0.1', 3128))\n" +
    "  threading.Thread(target=pipe, args=(c, u), daemon=True).start(); threading.Thread(target=pipe, args=(u, c), daemon=True).start()\n";
  const r = await ok("sandbox_script", { image: "default", egress: "test", command:
    `cat > /tmp/relay.py <<'EOF'\n${relay}EOF\npython3 /tmp/relay.py & sleep 1; ` +
    `${CURL} -k -x http://127.0.0.1:9999 https://denied.test/ 2>&1; echo relayed=$?; ` +
    `${CURL} -k --noproxy '*' https://denied.test/ 2>&1; echo direct=$?; ` +
    `bash -c 'exec 3<>/dev/tcp/127.0.0.2/${hostA.httpPort}' 2>/dev/null; echo devtcp=$?` });
  assert.match(r.stdout, /relayed=56/);
  assert.match(r.stdout, /direct=6/);
  assert.match(r.stdout, /devtcp=1/);
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict]), [["denied.test", "deny"]]);
});

test("C19: caller-set HTTPS_PROXY and NO_PROXY=* change nothing: there is no way out", async () => {
  const before = hostA.hits + hostB.hits;
  // 192.0.2.1 is TEST-NET-1 (unroutable anywhere); the sandbox has no route at all anyway
  const r = await script(
    `HTTPS_PROXY=http://192.0.2.1:8080 NO_PROXY='*' ${CURL} -k https://denied.test/ 2>&1; echo a=$?; ` +
    `HTTPS_PROXY=http://192.0.2.1:8080 https_proxy=http://192.0.2.1:8080 ${CURL} -k --connect-timeout 3 https://denied.test/ 2>&1; echo b=$?; ` +
    `NO_PROXY='*' no_proxy='*' ${CURL} -k https://denied.test/ 2>&1; echo c=$?`);
  assert.match(r.stdout, /a=56\b/); // curl prefers our https_proxy: the proxy says no
  assert.match(r.stdout, /b=7\b/);  // another proxy: unreachable, there is no network
  assert.match(r.stdout, /c=6\b/);  // no proxy: no name resolution, there is no network
  assert.equal(hostA.hits + hostB.hits, before);
  assert.deepEqual(egressLog(r).map((l) => [l.host, l.verdict]), [["denied.test", "deny"]]);
});

test("C20: IPv6 toward a test host with an IPv6 address fails, directly and through the proxy", async (t) => {
  const v6 = await ipv6Host();
  if (!v6) return t.skip("cannot create a network namespace with a free IPv6 prefix here");
  try {
    const url = `http://[${v6.address}]:8080/`;
    // the host itself reaches it (through the test's own veth): the test host is real
    assert.match(execFileSync("curl", ["-s", "-6", "--noproxy", "*", "--interface", v6.hostIf, "--max-time", "3", url]).toString(), /v6-host/);
    const r = await script(
      `curl -sS -6 --noproxy '*' --max-time 5 ${url} 2>&1; echo direct=$?; ` +
      `${CURL} -o /dev/null -w '%{http_code}\\n' ${url}; echo proxied=$?; ` +
      `${CURL} -k https://[${v6.address}]:8080/ 2>&1; echo connect=$?`);
    assert.match(r.stdout, /direct=7/);
    assert.match(r.stdout, /^403$/m);
    assert.match(r.stdout, /connect=56/);
    const log = egressLog(r);
    assert.deepEqual(log.map((l) => [l.host, l.verdict]), [[v6.address, "deny"], [v6.address, "deny"]]);
  } finally {
    await v6.close();
  }
});

test("a name that resolves to a private address, and the metadata address, are refused", async () => {
  const r = await script(`${CURL} -k https://private.test/ 2>&1; echo private=$?; ` +
    `${CURL} http://169.254.169.254/latest/meta-data/ 2>&1; echo metadata=$?`);
  assert.match(r.stdout, /private=56/);
  const log = egressLog(r);
  assert.deepEqual(log.map((l) => [l.host, l.verdict, l.rule]),
    [["private.test", "deny", "address:private"], ["169.254.169.254", "deny", "test:default-deny"]]);
  assert.match(log[0].error, /10\.255\.255\.1:443 is private/);
});

test("egress none denies everything; the default (package-managers) sets the proxy up; open is refused with inputs", async () => {
  const r = await ok("sandbox_script", { image: "base", egress: "none", command: `${CURL} -k https://${A()}/ 2>&1; echo rc=$?` });
  assert.match(r.stdout, /rc=56/);
  assert.deepEqual(egressLog(r).map((l) => [l.host, l.rule]), [["allowed.test", "none:default-deny"]]);
  const d = await ok("sandbox_script", { image: "base", command: "echo $HTTPS_PROXY $NO_PROXY $DO_NOT_TRACK; cat /proc/net/dev | grep -c :" });
  assert.equal(d.stdout, "http://127.0.0.1:3128 localhost,127.0.0.1,::1 1\n1\n");
  const res = await call("sandbox_script", { image: "base", egress: "open", command: "true", files: [path.join(inputs, "secret.txt")] });
  assert.equal(res.isError, true);
  assert.match(res.content[0].text, /exfiltration/);
  const unknown = await call("sandbox_script", { image: "base", egress: "nope", command: "true" });
  assert.equal(unknown.isError, true);
  assert.match(unknown.content[0].text, /no policy "nope"/);
});

test("a persistent sandbox keeps its proxy for every exec until destroyed", async () => {
  const sb = await ok("sandbox_create", { image: "base", egress: "test" });
  try {
    const r1 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `${CURL} -k https://${A()}/one` });
    assert.match(r1.stdout, /^host-a GET \/one/);
    const r2 = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `${CURL} -k https://denied.test/ 2>&1; echo rc=$?` });
    assert.match(r2.stdout, /rc=56/);
    const log = readFileSync(path.join(sb.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    assert.deepEqual(log.map((l) => [l.host, l.verdict]), [["allowed.test", "allow"], ["denied.test", "deny"]]);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
  assert.ok(!existsSync(path.join(work, "state", "run", sb.sandbox_id, "egress.sock")));
});

test("after a server restart, a persistent sandbox gets its proxy back on the next exec", async () => {
  const sb = await ok("sandbox_create", { image: "base", egress: "test" });
  const first = conn;
  conn = await connect({ fixtures: false, env: serverEnv() });
  await first.client.close(); // the old server goes, and its listener with it
  try {
    const r = await ok("sandbox_exec", { sandbox_id: sb.sandbox_id, command: `${CURL} -k https://${A()}/again; ${CURL} -k https://denied.test/ 2>&1; echo rc=$?` });
    assert.match(r.stdout, /^host-a GET \/again/);
    assert.match(r.stdout, /rc=56/);
    const log = readFileSync(path.join(sb.output_dir, "egress.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
    // a line is written when its connection ends: the tunnel's close can reach the proxy
    // after the next request's refusal, so the lines are compared in host order
    assert.deepEqual(log.map((l) => [l.host, l.verdict]).sort(), [["allowed.test", "allow"], ["denied.test", "deny"]]);
  } finally {
    await ok("sandbox_destroy", { sandbox_id: sb.sandbox_id });
  }
});

// A package registry on the allowed test host: a PyPI simple index with one wheel and an
// npm registry with one package, both made here.
function makePackages() {
  const dir = path.join(work, "pkgs");
  mkdirSync(path.join(dir, "npm", "package"), { recursive: true });
  execFileSync("python3", ["-c", `
import zipfile, sys
files = {"demopkg/__init__.py": "VALUE = 42\\n",
  "demopkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\\nName: demopkg\\nVersion: 0.1\\n",
  "demopkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: demesne-tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
files["demopkg-0.1.dist-info/RECORD"] = "".join(f"{n},,\\n" for n in files) + "demopkg-0.1.dist-info/RECORD,,\\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for n, c in files.items(): z.writestr(n, c)
`, path.join(dir, "demopkg-0.1-py3-none-any.whl")]);
  writeFileSync(path.join(dir, "npm", "package", "package.json"), JSON.stringify({ name: "demopkg", version: "1.0.0", main: "index.js" }));
  writeFileSync(path.join(dir, "npm", "package", "index.js"), "module.exports = 42;\n");
  execFileSync("tar", ["-czf", path.join(dir, "demopkg-1.0.0.tgz"), "-C", path.join(dir, "npm"), "package"]);
  return { wheel: readFileSync(path.join(dir, "demopkg-0.1-py3-none-any.whl")), tgz: readFileSync(path.join(dir, "demopkg-1.0.0.tgz")) };
}

test("positive matrix: pip download and npm pack from a local test registry, through the proxy", async () => {
  const { wheel, tgz } = makePackages();
  const sha256 = createHash("sha256").update(wheel).digest("hex");
  let base;
  const registry = await testHost("registry", "127.0.0.2", tls, (req, res) => {
    const send = (type, body) => { res.setHeader("content-type", type); res.end(body); };
    if (req.url === "/simple/demopkg/") {
      return send("text/html", `<html><body><a href="/files/demopkg-0.1-py3-none-any.whl#sha256=${sha256}">demopkg-0.1-py3-none-any.whl</a></body></html>`);
    }
    if (req.url === "/files/demopkg-0.1-py3-none-any.whl") return send("application/octet-stream", wheel);
    if (req.url === "/demopkg") {
      return send("application/json", JSON.stringify({
        name: "demopkg", "dist-tags": { latest: "1.0.0" },
        versions: { "1.0.0": { name: "demopkg", version: "1.0.0", dist: {
          tarball: `${base}/demopkg/-/demopkg-1.0.0.tgz`,
          shasum: createHash("sha1").update(tgz).digest("hex"),
          integrity: `sha512-${createHash("sha512").update(tgz).digest("base64")}` } } },
      }));
    }
    if (req.url === "/demopkg/-/demopkg-1.0.0.tgz") return send("application/octet-stream", tgz);
    res.statusCode = 404;
    res.end("not found\n");
  });
  try {
    base = `http://registry.allowed.test:${registry.httpPort}`;
    const r = await ok("sandbox_script", { image: "default", egress: "test", timeout_seconds: 300, command:
      `pip download --no-deps --index-url ${base}/simple/ --trusted-host registry.allowed.test -d /out/pip demopkg 2>&1 | tail -3; ` +
      `cd /out && npm pack demopkg --registry ${base}/ 2>&1 | tail -3; ls /out/pip /out/*.tgz` });
    assert.equal(r.exit_code, 0, r.stdout + r.stderr);
    assert.ok(readFileSync(path.join(r.output_dir, "pip", "demopkg-0.1-py3-none-any.whl")).equals(wheel), r.stdout);
    assert.ok(readFileSync(path.join(r.output_dir, "demopkg-1.0.0.tgz")).equals(tgz), r.stdout);
    const log = egressLog(r);
    assert.ok(log.length >= 4 && log.every((l) => l.host === "registry.allowed.test" && l.verdict === "allow"), JSON.stringify(log));
    assert.ok(registry.requests.some((q) => q.startsWith("GET /files/demopkg")) && registry.requests.some((q) => q.startsWith("GET /demopkg/-/")));
  } finally {
    await registry.close();
  }
});
