// Attacks on the vendor route from inside a real agent sandbox (the break-it pass of issue
// 10), over MCP with the official SDK client against a real engine (DEMESNE_ENGINE; run
// once per engine). The agent is the real Claude Code CLI in its real image; its "model" is
// a scripted Anthropic upstream on 127.0.0.1 in this test whose first turn is a Bash tool
// call running the attack (node, which the image has), and whose next turn ends the run.
// The attack knows what every agent sandbox knows: 127.0.0.1:3129 is the vendor route and
// $DEMESNE_VENDOR_TOKEN its token. Promises checked: the server keeps answering other calls
// within a second, its memory stays bounded, its log and the client's notifications are not
// flooded with the sandbox's text, and the attacker is told the ceiling it hit.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { LoggingMessageNotificationSchema } from "@modelcontextprotocol/sdk/types.js";
import { connect, PING_MAX_MS } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-vendor-attack-"));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the scripted upstream: turn 1 runs the command in the prompt (CMD:<base64>), turn 2 ends

function sse(res, events) {
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  for (const ev of events) res.write(`event: ${ev.type}\ndata: ${JSON.stringify(ev)}\n\n`);
  res.end();
}

function answer(res, body) {
  const msgs = body.messages || [];
  const last = msgs[msgs.length - 1];
  const side = Array.isArray(body.tools) && body.tools.length === 0;
  const done = Array.isArray(last?.content) && last.content.some((b) => b.type === "tool_result");
  const m = JSON.stringify(msgs).match(/CMD:([A-Za-z0-9+/=]+)/);
  const id = "msg_" + randomBytes(6).toString("hex");
  let blocks, stop;
  if (side || done || !m) {
    blocks = [{ type: "text", text: "FINAL" }];
    stop = "end_turn";
  } else {
    blocks = [{ type: "tool_use", id: "toolu_" + randomBytes(6).toString("hex"), name: "Bash",
      input: { command: Buffer.from(m[1], "base64").toString(), description: "run", timeout: 300000 } }];
    stop = "tool_use";
  }
  const events = [{ type: "message_start", message: { id, type: "message", role: "assistant", content: [],
    model: "claude-sonnet-5", stop_reason: null, usage: { input_tokens: 10, output_tokens: 1 } } }];
  blocks.forEach((b, index) => {
    if (b.type === "text") {
      events.push({ type: "content_block_start", index, content_block: { type: "text", text: "" } });
      events.push({ type: "content_block_delta", index, delta: { type: "text_delta", text: b.text } });
    } else {
      events.push({ type: "content_block_start", index, content_block: { type: "tool_use", id: b.id, name: b.name, input: {} } });
      events.push({ type: "content_block_delta", index, delta: { type: "input_json_delta", partial_json: JSON.stringify(b.input) } });
    }
    events.push({ type: "content_block_stop", index });
  });
  events.push({ type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: 5 } });
  events.push({ type: "message_stop" });
  sse(res, events);
}

let upstream, port;
before(async () => {
  upstream = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      let body = {};
      try { body = JSON.parse(Buffer.concat(chunks).toString("utf8") || "{}"); } catch { /* junk */ }
      if (req.method !== "POST") { res.writeHead(404); res.end(); return; }
      answer(res, body);
    });
  });
  await new Promise((r) => upstream.listen(0, "127.0.0.1", r));
  port = upstream.address().port;
});
after(async () => {
  await new Promise((r) => upstream.close(r));
  rmSync(work, { recursive: true, force: true });
});

async function server() {
  const conn = await connect({ fixtures: false, env: {
    DEMESNE_ENGINE: ENGINE, DEMESNE_OUTPUT_ROOT: path.join(work, "out"), DEMESNE_STATE_DIR: path.join(work, "state"),
    ANTHROPIC_API_KEY: "sk-test-real-" + randomBytes(8).toString("hex"),
    DEMESNE_CLAUDE_CODE_UPSTREAM: `http://127.0.0.1:${port}`,
    DEMESNE_CODEX_ENABLED: "false", DEMESNE_OPENAI_COMPATIBLE_ENABLED: "false",
  } });
  return conn;
}

// Runs `js` (node) as the agent's tool call; the tool's output comes back as the transcript.
// Meanwhile pings the server every 200 ms. Returns {result, pings: {max, count}}.
async function attack(conn, js) {
  const cmd = `echo ${Buffer.from(js).toString("base64")} | base64 -d > /tmp/a.js && node /tmp/a.js`;
  const prompt = "Run the task. CMD:" + Buffer.from(cmd).toString("base64");
  let finished = false;
  const run = conn.client.callTool({ name: "sandbox_agent", arguments: { prompt, model: "sonnet", timeout_seconds: 240 } },
    undefined, { timeout: 300_000 }).finally(() => { finished = true; });
  const times = [];
  while (!finished || times.length < 3) {
    const t0 = Date.now();
    await conn.client.ping({ timeout: 120_000 });
    times.push(Date.now() - t0);
    await sleep(200);
  }
  const res = await run;
  assert.ok(!res.isError, `the agent run: ${res.content?.[0]?.text}\n${conn.stderr().slice(-2000)}`);
  const transcript = readFileSync(path.join(res.structuredContent.output_dir, "transcript.jsonl"), "utf8");
  return { result: res.structuredContent, transcript, pings: { max: Math.max(...times), count: times.length } };
}

// The attack's own report: the line "REPORT {json}" it printed, found in the tool result
// that the transcript (JSON lines) carries.
function report(transcript) {
  let found;
  const walk = (v) => {
    if (typeof v === "string") {
      const m = v.match(/REPORT (\{.*\})/);
      if (m) found = JSON.parse(m[1]);
    } else if (v && typeof v === "object") for (const x of Object.values(v)) walk(x);
  };
  for (const line of transcript.split("\n")) {
    try { walk(JSON.parse(line)); } catch { /* not a JSON line */ }
  }
  assert.ok(found, `the attack reported: ${transcript.slice(-1500)}`);
  return found;
}

function peakRss(pid) {
  const s = readFileSync(`/proc/${pid}/status`, "utf8");
  return Number(s.match(/VmHWM:\s+(\d+) kB/)[1]) * 1024;
}

test("huge request bodies on the vendor route are refused past a ceiling; the server's memory stays bounded", { timeout: 400_000 }, async () => {
  const conn = await server();
  try {
    // 15 connections each send a 64 MiB body (the per-request maximum): 960 MiB if all were kept
    const { transcript, pings } = await attack(conn, `
      const net = require("net");
      const N = 15, SIZE = 64 * 1024 * 1024, codes = {};
      let done = 0;
      for (let i = 0; i < N; i++) {
        const s = net.connect(3129, "127.0.0.1", () => {
          s.write("POST /v1/messages HTTP/1.1\\r\\nHost: x\\r\\nx-api-key: " + process.env.DEMESNE_VENDOR_TOKEN
            + "\\r\\nContent-Length: " + SIZE + "\\r\\n\\r\\n");
          const buf = Buffer.alloc(1024 * 1024, 65);
          let sent = 0;
          const pump = () => { while (sent < SIZE) { sent += buf.length; if (!s.write(buf)) return s.once("drain", pump); } };
          pump();
        });
        let head = "";
        s.on("data", (d) => { head += d; });
        s.on("error", () => {});
        s.on("close", () => {
          const code = (head.match(/^HTTP\\/1\\.1 (\\d+)/) || [])[1] || "none";
          codes[code] = (codes[code] || 0) + 1;
          if (/vendor_max_buffered_bytes/.test(head)) codes.named = (codes.named || 0) + 1;
          if (++done === N) { console.log("REPORT " + JSON.stringify(codes)); process.exit(0); }
        });
      }`);
    const codes = report(transcript);
    assert.ok(!/not enough memory/.test(conn.stderr()), `the server ran out of Lua memory:\n${conn.stderr().slice(-1500)}`);
    assert.ok((codes["503"] || 0) >= 1 && codes.named >= 1, `the flooder is told the ceiling: ${JSON.stringify(codes)}`);
    const rss = peakRss(conn.transport.pid);
    assert.ok(rss < 512 * 1024 * 1024, `the server's peak memory was ${Math.round(rss / 1048576)} MiB`);
    assert.ok(pings.max < PING_MAX_MS, `a ping took ${pings.max} ms during the flood`);
  } finally {
    await conn.client.close();
  }
});

test("a flood of attempt reports on the vendor route does not hold up the server", { timeout: 400_000 }, async () => {
  const conn = await server();
  try {
    // an 8 MiB transcript of small lines (the most the route reads), then 32 reporters that
    // keep asking about new attempts for 30 s
    const { transcript, pings } = await attack(conn, `
      const fs = require("fs"), http = require("http");
      const line = JSON.stringify({ type: "assistant", message: { content: [{ type: "text", text: "x".repeat(40) }] } }) + "\\n";
      const fd = fs.openSync("/out/transcript.jsonl", "a");
      const chunk = line.repeat(1000);
      for (let s = 0; s < 8 * 1024 * 1024; s += chunk.length) fs.writeSync(fd, chunk);
      const t0 = Date.now(), codes = {};
      let live = 0;
      function one(i) {
        live++;
        const body = JSON.stringify({ attempt: 2 + (i % 900), exit_code: 1 });
        const r = http.request({ host: "127.0.0.1", port: 3129, path: "/.demesne/attempt", method: "POST", headers: {
          authorization: "Bearer " + process.env.DEMESNE_VENDOR_TOKEN, "content-type": "application/json",
          "content-length": body.length } }, (res) => {
          codes[res.statusCode] = (codes[res.statusCode] || 0) + 1;
          res.resume();
          res.on("end", () => { live--; if (Date.now() - t0 < 30000) one(i + 32); else if (!live) finish(); });
        });
        r.on("error", () => { live--; if (!live) finish(); });
        r.end(body);
      }
      function finish() { console.log("REPORT " + JSON.stringify(codes)); process.exit(0); }
      for (let i = 0; i < 32; i++) one(i);
      setTimeout(finish, 90000);`);
    const codes = report(transcript);
    assert.ok(Object.values(codes).reduce((a, b) => a + b, 0) > 32, `the flood ran: ${JSON.stringify(codes)}`);
    assert.ok(pings.count >= 3 && pings.max < PING_MAX_MS, `a ping took ${pings.max} ms during the flood`);
  } finally {
    await conn.client.close();
  }
});

test("a flood of refused vendor requests floods neither the server's log nor the client's notifications", { timeout: 400_000 }, async () => {
  const conn = await server();
  const notes = [];
  conn.client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => notes.push(n.params));
  const before = conn.stderr().length;
  try {
    // 16 connections for 15 s, every other request with a 30 KB path holding a terminal escape
    // (llhttp refuses it in C: 400, never logged) and the rest with a 7 KB printable path that
    // the provider does not allow (refused by the route, which reports refusals at a bounded rate)
    const { transcript } = await attack(conn, `
      const net = require("net");
      const paths = ["/v1/" + String.fromCharCode(27) + "[31mEVIL" + "A".repeat(30000), "/v1/evil-" + "A".repeat(7000)];
      let n = 0;
      const t0 = Date.now();
      function one() {
        const path = paths[n % 2];
        const s = net.connect(3129, "127.0.0.1", () => s.write("POST " + path + " HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n\\r\\n"));
        s.on("data", () => {});
        s.on("error", () => {});
        s.on("close", () => { n++; if (Date.now() - t0 < 15000) one(); });
      }
      for (let i = 0; i < 16; i++) one();
      setTimeout(() => { console.log("REPORT " + JSON.stringify({ requests: n })); process.exit(0); }, 16000);`);
    const { requests } = report(transcript);
    assert.ok(requests > 100, `the flood ran (${requests} requests)`);
    const err = conn.stderr().slice(before);
    assert.ok(!err.includes("\u001b"), "a terminal escape from the sandbox reached the server's log");
    assert.ok(err.length < 256 * 1024, `the server logged ${err.length} bytes for ${requests} refused requests`);
    const vendorNotes = notes.filter((p) => p.logger === "demesne.vendor");
    assert.ok(vendorNotes.length <= 20, `${vendorNotes.length} notifications for ${requests} refused requests`);
    assert.ok(vendorNotes.length >= 1, "the refusals are still reported");
  } finally {
    await conn.client.close();
  }
});

test("text built to make the route's parsers backtrack (a long run of blanks) does not hold up the server", { timeout: 400_000 }, async () => {
  const conn = await server();
  try {
    // a request head whose header value ends in 60 000 tabs before its last byte, then a
    // transcript line whose text is a megabyte of blanks, read when the attempt is reported
    const { transcript, pings } = await attack(conn, `
      const net = require("net"), fs = require("fs"), http = require("http");
      const codes = {};
      const s = net.connect(3129, "127.0.0.1", () =>
        s.write("POST /v1/messages HTTP/1.1\\r\\nHost: x\\r\\nX-Pad: a" + "\\t".repeat(60000) + "b\\r\\nContent-Length: 0\\r\\n\\r\\n"));
      let head = "";
      s.on("data", (d) => { head += d; });
      s.on("error", () => {});
      s.on("close", () => {
        codes.head = (head.match(/^HTTP\\/1\\.1 (\\d+)/) || [])[1] || "none";
        fs.appendFileSync("/out/transcript.jsonl", JSON.stringify({ type: "assistant", message: { id: "pad",
          content: [{ type: "text", text: "a" + " ".repeat(1000000) + "b" }] } }) + "\\n");
        const body = JSON.stringify({ attempt: 1, exit_code: 1 });
        const r = http.request({ host: "127.0.0.1", port: 3129, path: "/.demesne/attempt", method: "POST", headers: {
          authorization: "Bearer " + process.env.DEMESNE_VENDOR_TOKEN, "content-type": "application/json",
          "content-length": body.length } }, (res) => {
          let t = "";
          res.on("data", (d) => { t += d; });
          res.on("end", () => { codes.attempt = res.statusCode + " " + t.trim(); console.log("REPORT " + JSON.stringify(codes)); process.exit(0); });
        });
        r.on("error", (e) => { console.log("REPORT " + JSON.stringify({ error: e.message })); process.exit(0); });
        r.end(body);
      });`);
    const codes = report(transcript);
    assert.equal(codes.head, "401", `the padded request is judged (no token): ${JSON.stringify(codes)}`);
    assert.equal(codes.attempt, "200 stop", `the attempt is decided: ${JSON.stringify(codes)}`);
    assert.ok(pings.count >= 3 && pings.max < PING_MAX_MS, `a ping took ${pings.max} ms`);
  } finally {
    await conn.client.close();
  }
});
