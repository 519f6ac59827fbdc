// Test hosts for the egress tests and bench/egress. Everything here listens on loopback
// (127.0.0.0/8) or, for IPv6, inside a network namespace the test creates and removes —
// never any other address. Names like allowed.test are served by a tiny DNS server on
// loopback that the proxy is pointed at (DEMESNE_EGRESS_RESOLVER); it logs every query.
import dgram from "node:dgram";
import http from "node:http";
import https from "node:https";
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";

/**
 * A DNS server on 127.0.0.1 answering A queries from `map` ({name: "a.b.c.d"}); anything
 * else gets NXDOMAIN. `queries` lists every name asked, lowercased, in order.
 * @param {Record<string,string>} map
 * @returns {Promise<{port: number, queries: string[], close: () => Promise<void>}>}
 */
export async function dnsServer(map) {
  const sock = dgram.createSocket("udp4");
  const queries = [];
  sock.on("message", (msg, rinfo) => {
    if (msg.length < 12) return;
    let off = 12;
    const labels = [];
    while (off < msg.length && msg[off] !== 0) {
      const l = msg[off];
      labels.push(msg.subarray(off + 1, off + 1 + l).toString("latin1"));
      off += 1 + l;
    }
    const qend = off + 5;
    const name = labels.join(".").toLowerCase();
    queries.push(name);
    const qtype = msg.readUInt16BE(off + 1);
    const addr = map[name];
    const header = Buffer.from(msg.subarray(0, 12));
    header[2] = 0x81;
    header[3] = addr ? 0x80 : 0x83;
    header.writeUInt16BE(1, 4);
    header.writeUInt16BE(addr && qtype === 1 ? 1 : 0, 6);
    header.writeUInt32BE(0, 8);
    const parts = [header, msg.subarray(12, qend)];
    if (addr && qtype === 1) {
      const rr = Buffer.from([0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, ...addr.split(".").map(Number)]);
      parts.push(rr);
    }
    sock.send(Buffer.concat(parts), rinfo.port, rinfo.address);
  });
  await new Promise((resolve) => sock.bind(0, "127.0.0.1", resolve));
  return { port: sock.address().port, queries, close: () => new Promise((r) => sock.close(r)) };
}

/** A self-signed certificate for `names` (openssl), as {key, cert} PEM strings. */
export function selfSigned(names) {
  const dir = mkdtempSync(path.join(tmpdir(), "demesne-cert-"));
  try {
    execFileSync("openssl", ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", `/CN=${names[0]}`,
      "-addext", `subjectAltName=${names.map((n) => `DNS:${n}`).join(",")}`,
      "-keyout", path.join(dir, "key.pem"), "-out", path.join(dir, "cert.pem")], { stdio: "ignore" });
    return { key: readFileSync(path.join(dir, "key.pem")), cert: readFileSync(path.join(dir, "cert.pem")) };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/**
 * A test host: HTTP and HTTPS servers on `address` (a loopback address). Each answers
 * "<id> <METHOD> <url> host=<Host>\n", or `handler(req, res)` when given. Tries the
 * well-known ports 80/443 first (so https://allowed.test needs no port), else random ones.
 * `hits` counts requests.
 */
export async function testHost(id, address, tls, handler) {
  const state = { id, address, hits: 0, requests: [] };
  const respond = (req, res) => {
    state.hits++;
    state.requests.push(`${req.method} ${req.url} host=${req.headers.host}`);
    if (handler && handler(req, res) !== false) return;
    res.setHeader("content-type", "text/plain");
    res.end(`${id} ${req.method} ${req.url} host=${req.headers.host}\n`);
  };
  const listen = (srv, port) => new Promise((resolve) => {
    srv.once("error", () => resolve(false));
    srv.listen(port, address, () => resolve(true));
  });
  state.http = http.createServer(respond);
  state.https = https.createServer(tls, respond);
  state.httpPort = (await listen(state.http, 80)) ? 80 : (await listen(state.http, 0), state.http.address().port);
  state.httpsPort = (await listen(state.https, 443)) ? 443 : (await listen(state.https, 0), state.https.address().port);
  state.close = async () => {
    for (const s of [state.http, state.https]) {
      s.closeAllConnections?.();
      await new Promise((r) => s.close(r));
    }
  };
  return state;
}

/**
 * An IPv6-only test host in a network namespace of its own: a veth pair, <prefix>::1/64
 * inside (an HTTP server on port 8080 there), <prefix>::2/64 on the host side. The /64 is
 * a random unique-local prefix that no route of this machine covers (checked before and
 * after: the machine's own network may use a ULA such as fd00::/64). Returns null when
 * namespaces cannot be made here (not root, no iproute2) or no free prefix is found.
 * @returns {Promise<{address: string, port: number, hostIf: string, close: () => Promise<void>}|null>}
 */
export async function ipv6Host() {
  const tag = `dmeg${process.pid % 100000}`;
  const ns = `${tag}-ns`, hostIf = `${tag}h`, nsIf = `${tag}n`;
  const ip = (...a) => execFileSync("ip", a, { stdio: "pipe" }).toString();
  let routes;
  try {
    routes = ip("-6", "route", "show");
  } catch {
    return null;
  }
  // four hex digits without a leading zero: the address is then written as the proxy writes it
  const hex = () => (0x1000 + Math.floor(Math.random() * 0xf000)).toString(16);
  let prefix;
  for (let i = 0; i < 20 && !prefix; i++) {
    const p = `fd${hex().slice(2)}:${hex()}:${hex()}`;
    if (!routes.includes(p.slice(0, 4))) prefix = p; // never near a prefix in use
  }
  if (!prefix) return null;
  const address = `${prefix}::1`;
  try {
    ip("netns", "add", ns);
  } catch (e) {
    process.stderr.write(`ipv6Host: ip netns add ${ns}: ${e.stderr || e.message}\n`);
    return null;
  }
  let server;
  const close = async () => {
    if (server && server.exitCode === null) {
      server.kill("SIGKILL");
      await new Promise((r) => server.once("exit", r));
    }
    try { ip("link", "del", hostIf); } catch {}
    try { ip("netns", "del", ns); } catch {}
  };
  try {
    ip("link", "add", hostIf, "type", "veth", "peer", "name", nsIf);
    ip("link", "set", nsIf, "netns", ns);
    ip("-6", "addr", "add", `${prefix}::2/64`, "dev", hostIf, "nodad");
    ip("link", "set", hostIf, "up");
    ip("netns", "exec", ns, "ip", "-6", "addr", "add", `${address}/64`, "dev", nsIf, "nodad");
    ip("netns", "exec", ns, "ip", "link", "set", nsIf, "up");
    ip("netns", "exec", ns, "ip", "link", "set", "lo", "up");
    // traffic to the test host must leave through our veth and nowhere else
    if (!ip("-6", "route", "get", address).includes(`dev ${hostIf}`)) throw new Error("the IPv6 test prefix is routed elsewhere");
    server = spawn("ip", ["netns", "exec", ns, "python3", "-c",
      "import http.server,socket,sys\n" +
      "class S(http.server.ThreadingHTTPServer): address_family = socket.AF_INET6\n" +
      "class H(http.server.BaseHTTPRequestHandler):\n" +
      "  def do_GET(self):\n" +
      "    b = b'v6-host\\n'; self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)\n" +
      "  def log_message(self, *a): pass\n" +
      "S((sys.argv[1], 8080), H).serve_forever()\n", address], { stdio: "ignore" });
    for (let i = 0; i < 50; i++) {
      try {
        execFileSync("curl", ["-s", "-6", "--noproxy", "*", "--interface", hostIf, "--max-time", "1",
          `http://[${address}]:8080/`], { stdio: "pipe" });
        return { address, port: 8080, hostIf, close };
      } catch {
        await new Promise((r) => setTimeout(r, 200));
      }
    }
    throw new Error("the IPv6 test host did not come up");
  } catch (e) {
    await close();
    throw e;
  }
}
