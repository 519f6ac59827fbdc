// The MCP layer over stdio, driven by the official SDK client and by raw JSON-RPC lines,
// against the fixture tools in tests/fixtures/tools (no container engine needed).
import { test, describe, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { LoggingMessageNotificationSchema, McpError } from "@modelcontextprotocol/sdk/types.js";
import { Client as ClientV2 } from "@modelcontextprotocol/client";
import { StdioClientTransport as StdioV2 } from "@modelcontextprotocol/client/stdio";
import { connect, spawnRaw, BIN, FIXTURES, ROOT, serverEnv } from "./helpers.mjs";

const work = mkdtempSync(path.join(tmpdir(), "demesne-mcp-it-"));
after(() => rmSync(work, { recursive: true, force: true }));

async function waitFor(pred, ms = 5000, what = "condition") {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (pred()) return;
    await new Promise((r) => setTimeout(r, 25));
  }
  assert.fail(`timed out waiting for ${what}`);
}

describe("version negotiation (raw initialize)", () => {
  for (const [asked, want] of [["2025-11-25", "2025-11-25"], ["2025-06-18", "2025-06-18"], ["2024-01-01", "2025-11-25"]]) {
    test(`asked ${asked} -> ${want}`, async () => {
      const raw = spawnRaw({ fixtures: false });
      try {
        const r = await raw.initialize(asked);
        assert.equal(r.result.protocolVersion, want);
        assert.equal(r.result.serverInfo.name, "demesne");
        assert.match(r.result.serverInfo.version, /^\d+\.\d+\.\d+/);
        assert.deepEqual(r.result.capabilities.tools, { listChanged: false });
        assert.deepEqual(r.result.capabilities.logging, {});
        assert.equal(typeof r.result.instructions, "string");
        assert.deepEqual((await raw.request("ping")).result, {});
      } finally {
        await raw.close();
      }
    });
  }
});

describe("SDK client", () => {
  let conn;
  before(async () => {
    conn = await connect();
  });
  after(async () => {
    await conn?.client.close();
  });

  test("connects and negotiates the SDK's latest version", () => {
    const info = conn.client.getServerVersion();
    assert.equal(info.name, "demesne");
    assert.ok(conn.client.getServerCapabilities().tools);
    assert.ok(conn.client.getServerCapabilities().logging);
    assert.equal(typeof conn.client.getInstructions(), "string");
  });

  test("tools/list returns every fixture with schemas, sorted by name", async () => {
    const { tools, nextCursor } = await conn.client.listTools();
    assert.equal(nextCursor, undefined);
    const names = tools.map((t) => t.name);
    assert.deepEqual(names, [...names].sort());
    for (const n of ["fixture_echo", "fixture_sleep", "fixture_progress", "test_simple_text", "test_tool_with_progress"]) {
      assert.ok(names.includes(n), `${n} listed`);
    }
    for (const t of tools) {
      assert.equal(t.inputSchema.type, "object", `${t.name} inputSchema`);
      assert.equal(typeof t.description, "string");
    }
    const echo = tools.find((t) => t.name === "fixture_echo");
    assert.equal(echo.title, "Echo (test fixture)");
    assert.deepEqual(echo.inputSchema.required, ["text"]);
    assert.equal(echo.inputSchema.additionalProperties, false);
    assert.deepEqual(echo.inputSchema.properties.mode.enum, ["echo", "fail", "crash"]);
    assert.equal(echo.outputSchema.type, "object");
    assert.equal(echo.annotations.readOnlyHint, true);
    const js = tools.find((t) => t.name === "json_schema_2020_12_tool");
    assert.equal(js.inputSchema.$schema, "https://json-schema.org/draft/2020-12/schema");
    assert.ok(js.inputSchema.$defs.address);
  });

  test("calls fixtures: structured content, text, image, resource", async () => {
    const echo = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "ab", count: 2, options: { upper: true } } });
    assert.equal(echo.isError, false);
    assert.equal(echo.structuredContent.text, "ABAB");
    assert.equal(echo.structuredContent.count, 2);
    assert.equal(echo.content[0].text, "ABAB");
    const defaults = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "x" } });
    assert.equal(defaults.structuredContent.count, 1, "default applied");
    const simple = await conn.client.callTool({ name: "test_simple_text", arguments: {} });
    assert.deepEqual(simple.content, [{ type: "text", text: "This is a simple text response for testing." }]);
    const img = await conn.client.callTool({ name: "test_image_content", arguments: {} });
    assert.equal(img.content[0].type, "image");
    assert.equal(img.content[0].mimeType, "image/png");
    assert.ok(Buffer.from(img.content[0].data, "base64").subarray(1, 4).toString() === "PNG");
    const mixed = await conn.client.callTool({ name: "test_multiple_content_types", arguments: {} });
    assert.deepEqual(mixed.content.map((c) => c.type), ["text", "image", "resource"]);
    const utf = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "héllo ✓ \u0001" } });
    assert.equal(utf.structuredContent.text, "héllo ✓ \u0001");
  });

  test("tool failures are isError results with a one-line message", async () => {
    const err = await conn.client.callTool({ name: "test_error_handling", arguments: {} });
    assert.equal(err.isError, true);
    assert.equal(err.content[0].text, "This tool intentionally returns an error for testing");
    const fail = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "x", mode: "fail" } });
    assert.equal(fail.isError, true);
    assert.match(fail.content[0].text, /^text: the fixture was asked to fail/);
    const crash = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "x", mode: "crash" } });
    assert.equal(crash.isError, true);
    assert.match(crash.content[0].text, /^Tool fixture_echo failed: .*attempt to index a nil value/);
    assert.ok(!crash.content[0].text.includes("\n"), "no traceback in the result");
    await waitFor(() => /stack traceback/.test(conn.stderr()), 2000, "the traceback in the stderr log");
  });

  test("schema-invalid arguments are an isError result naming the field (SEP-1303)", async () => {
    const r = await conn.client.callTool({ name: "fixture_echo", arguments: { text: 5, bogus: 1, count: 0 } });
    assert.equal(r.isError, true);
    const msg = r.content[0].text;
    assert.match(msg, /text: expected string, got integer 5/);
    assert.match(msg, /bogus: is not an allowed property/);
    assert.match(msg, /count: must be >= 1 \(got 0\)/);
    const nested = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "x", options: { upper: "yes" }, tags: ["a", 1] } });
    assert.match(nested.content[0].text, /options\.upper: expected boolean/);
    assert.match(nested.content[0].text, /tags\[1\]: expected string/);
    const missing = await conn.client.callTool({ name: "fixture_echo", arguments: {} });
    assert.match(missing.content[0].text, /text: is required/);
    const en = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "x", mode: "loud" } });
    assert.match(en.content[0].text, /mode: must be one of "echo", "fail", "crash"/);
  });

  test("an unknown tool is JSON-RPC error -32602", async () => {
    await assert.rejects(conn.client.callTool({ name: "no_such_tool", arguments: {} }), (e) => {
      assert.ok(e instanceof McpError);
      assert.equal(e.code, -32602);
      assert.match(e.message, /Unknown tool: no_such_tool/);
      return true;
    });
  });

  test("C21: 8 interleaved concurrent calls; the instant ones come back first", async () => {
    const order = [];
    const started = Date.now();
    const calls = [];
    for (let i = 0; i < 8; i++) {
      const slow = i % 2 === 0;
      const label = `${slow ? "slow" : "fast"}-${i}`;
      const p = slow
        ? conn.client.callTool({ name: "fixture_sleep", arguments: { seconds: 2 + (i % 3) * 0.5, label } })
        : conn.client.callTool({ name: "fixture_echo", arguments: { text: label } });
      calls.push(p.then((r) => { order.push(label); return [label, r]; }));
    }
    const results = await Promise.all(calls);
    const elapsed = Date.now() - started;
    for (const [label, r] of results) {
      assert.equal(r.isError, false, label);
      if (label.startsWith("slow")) assert.equal(r.structuredContent.label, label, "each response matches its request");
      else assert.equal(r.structuredContent.text, label);
    }
    assert.deepEqual(order.slice(0, 4).sort(), ["fast-1", "fast-3", "fast-5", "fast-7"], `order: ${order}`);
    assert.ok(elapsed < 4500, `calls ran concurrently (${elapsed} ms)`);
  });

  test("cancellation via AbortSignal runs the tool's cleanup; the server keeps serving", async () => {
    const marker = path.join(work, "cancel-marker");
    const ac = new AbortController();
    const p = conn.client.callTool({ name: "fixture_sleep", arguments: { seconds: 60, marker } }, undefined, { signal: ac.signal });
    await new Promise((r) => setTimeout(r, 300));
    assert.ok(!existsSync(marker), "not cleaned up before the cancel");
    ac.abort("test cancels");
    await assert.rejects(p);
    await waitFor(() => existsSync(marker), 5000, "the cleanup marker");
    assert.equal(readFileSync(marker, "utf8"), "cleanup after cancel\n");
    await conn.client.ping();
    const r = await conn.client.callTool({ name: "fixture_echo", arguments: { text: "still here" } });
    assert.equal(r.structuredContent.text, "still here");
  });

  test("progress notifications arrive, strictly increasing, and reset the timeout", async () => {
    const seen = [];
    const r = await conn.client.callTool({ name: "fixture_progress", arguments: { steps: 8, delay_ms: 250 } }, undefined, {
      onprogress: (p) => seen.push(p),
      resetTimeoutOnProgress: true,
      timeout: 600, // shorter than the whole call (2 s): only progress keeps it alive
    });
    assert.equal(r.structuredContent.sent, 8);
    assert.deepEqual(seen.map((p) => p.progress), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert.ok(seen.every((p) => p.total === 8));
    assert.equal(seen[0].message, "step 1 of 8");
    const conf = [];
    await conn.client.callTool({ name: "test_tool_with_progress", arguments: {} }, undefined, { onprogress: (p) => conf.push(p) });
    assert.deepEqual(conf.map((p) => [p.progress, p.total]), [[0, 100], [50, 100], [100, 100]]);
  });

  test("logging/setLevel filters notifications/message; the logger is named", async () => {
    const got = [];
    conn.client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => got.push(n.params));
    await conn.client.setLoggingLevel("warning");
    await conn.client.callTool({ name: "fixture_log", arguments: { tag: "w" } });
    await new Promise((r) => setTimeout(r, 100));
    const mine = (tag) => got.filter((p) => p.logger === "demesne.tools.fixture_log" && p.data?.message?.startsWith(tag + " "));
    assert.deepEqual(mine("w").map((p) => p.level), ["warning", "error", "critical", "alert", "emergency"]);
    assert.deepEqual(mine("w")[0].data, { message: "w warning", data: { level: "warning" } });
    await conn.client.setLoggingLevel("debug");
    await conn.client.callTool({ name: "fixture_log", arguments: { tag: "d" } });
    await new Promise((r) => setTimeout(r, 100));
    assert.equal(mine("d").length, 8);
    await conn.client.setLoggingLevel("info");
  });

  test("C10: a result over the message bound becomes an isError result", async () => {
    // 1 MiB of control bytes encodes to 6 MiB of JSON, over the 4 MiB default bound
    const r = await conn.client.callTool({ name: "fixture_flood", arguments: { bytes: 1024 * 1024 } });
    assert.equal(r.isError, true);
    assert.match(r.content[0].text, /too large/);
    const ok = await conn.client.callTool({ name: "fixture_flood", arguments: { bytes: 1000 } });
    assert.equal(ok.isError, false);
    assert.equal(ok.content[0].text.length, 1000);
  });
});

describe("raw frames", () => {
  let raw;
  before(async () => {
    raw = spawnRaw();
    await raw.initialize();
  });
  after(async () => {
    await raw?.close();
  });

  async function expectError(line, code, id = null, message) {
    raw.send(line.endsWith("\n") ? line : line + "\n");
    const m = await raw.next((x) => x.error !== undefined);
    assert.equal(m.jsonrpc, "2.0");
    assert.equal(m.error.code, code, `code for ${line.slice(0, 80)}`);
    assert.deepEqual(m.id, id);
    if (message) assert.match(m.error.message, message);
    assert.deepEqual((await raw.request("ping")).result, {}, "a following ping works");
  }

  test("truncated JSON -> -32700", () => expectError('{"jsonrpc":"2.0","id":1,"method":"pi', -32700));
  test("a 10 MB line of junk -> -32700", () => expectError("x".repeat(10 * 1024 * 1024), -32700));
  test("a 10 MB valid request is served", async () => {
    const text = "y".repeat(10 * 1024 * 1024);
    const r = await raw.request("tools/call", { name: "fixture_echo", arguments: { text: "z" }, _meta: { pad: text } });
    assert.equal(r.result.structuredContent.text, "z");
  });
  test("a non-object -> -32600", async () => {
    await expectError("42", -32600);
    await expectError('"hello"', -32600);
    await expectError("null", -32600);
  });
  test("an array batch -> -32600", () =>
    expectError('[{"jsonrpc":"2.0","id":5,"method":"ping"},{"jsonrpc":"2.0","id":6,"method":"ping"}]', -32600, null, /batch/));
  test("a reused id of a request in progress -> -32600 with a null id; the first still answers", async () => {
    raw.send({ jsonrpc: "2.0", id: 41, method: "tools/call", params: { name: "fixture_sleep", arguments: { seconds: 1 } } });
    raw.send({ jsonrpc: "2.0", id: 41, method: "ping" });
    const e = await raw.next((x) => x.error !== undefined);
    assert.equal(e.error.code, -32600);
    assert.equal(e.id, null);
    assert.match(e.error.message, /id 41 is already in use/);
    const first = await raw.next((x) => x.id === 41);
    assert.ok(first.result, JSON.stringify(first));
  });
  test("ids beyond 2^53, fractions and strings come back exactly as sent (not as rounded floats)", async () => {
    for (const id of ["9007199254740993", "123456789012345678901234567890", "-9007199254740995", "1.25", "1e3", '"id-\\u00e9"']) {
      raw.send(`{"jsonrpc":"2.0","id":${id},"method":"ping"}\n`);
      const m = await raw.next((x) => x.method === undefined);
      assert.ok(m.raw.includes(`"id":${id.startsWith('"') ? '"id-é"' : id}`), `${id} -> ${m.raw}`);
    }
  });
  test("unknown method -> -32601", () => expectError('{"jsonrpc":"2.0","id":7,"method":"no/such"}', -32601, 7));
  test("wrong param types -> -32602 naming the field", async () => {
    await expectError('{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":42}}', -32602, 8, /params\.name/);
    await expectError('{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"fixture_echo","arguments":"x"}}', -32602, 9,
      /params\.arguments/);
    await expectError('{"jsonrpc":"2.0","id":10,"method":"logging/setLevel","params":{"level":7}}', -32602, 10, /params\.level/);
    await expectError('{"jsonrpc":"2.0","id":11,"method":"tools/call","params":[1,2]}', -32602, 11);
  });
  test("invalid JSON-RPC envelope -> -32600", async () => {
    await expectError('{"jsonrpc":"1.0","id":12,"method":"ping"}', -32600, 12);
    await expectError('{"jsonrpc":"2.0","id":true,"method":"ping"}', -32600);
  });
  test("a frame split over writes, and several frames in one write", async () => {
    raw.send('{"jsonrpc":"2.0","id":"s1",');
    await new Promise((r) => setTimeout(r, 50));
    raw.send('"method":"ping"}\n{"jsonrpc":"2.0","id":"s2","method":"ping"}\n');
    const a = await raw.next((m) => m.id === "s1");
    const b = await raw.next((m) => m.id === "s2");
    assert.deepEqual([a.result, b.result], [{}, {}]);
  });
  test("notifications get no response", async () => {
    raw.send('{"jsonrpc":"2.0","method":"notifications/initialized"}\n');
    raw.send('{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"nope"}}\n');
    raw.send('{"jsonrpc":"2.0","id":"after","method":"ping"}\n');
    const m = await raw.next();
    assert.equal(m.id, "after");
  });
});

test("SDK v2 client over stdio: probes with server/discover and speaks 2026-07-28 (stateless)", async () => {
  const transport = new StdioV2({ command: BIN, args: ["--fixtures", FIXTURES, "serve"], env: serverEnv(), cwd: ROOT, stderr: "ignore" });
  const client = new ClientV2({ name: "demesne-stdio-v2", version: "2" }, { versionNegotiation: { mode: "auto" } });
  await client.connect(transport);
  try {
    assert.equal(client.getNegotiatedProtocolVersion(), "2026-07-28");
    const { tools } = await client.listTools();
    assert.ok(tools.some((t) => t.name === "fixture_echo"));
    const seen = [];
    const r = await client.callTool({ name: "fixture_progress", arguments: { steps: 3, delay_ms: 20 } },
      { onprogress: (p) => seen.push(p.progress) });
    assert.deepEqual(r.structuredContent, { steps: 3, sent: 3 });
    assert.deepEqual(seen, [1, 2, 3]);
    const ac = new AbortController();
    const slow = client.callTool({ name: "fixture_sleep", arguments: { seconds: 30 } }, { signal: ac.signal });
    setTimeout(() => ac.abort(), 200);
    await assert.rejects(slow);
    assert.equal((await client.callTool({ name: "fixture_echo", arguments: { text: "after" } })).structuredContent.text, "after");
  } finally {
    await client.close();
  }
});

test("a line over the configured cap is discarded with -32600 and the server keeps serving", async () => {
  const raw = spawnRaw({ env: { DEMESNE_MCP_MAX_LINE_BYTES: String(1024 * 1024) } });
  try {
    await raw.initialize();
    raw.send("{" + "\"a\":1,".repeat(400000) + "\"b\":2}\n"); // 2.4 MB
    const m = await raw.next((x) => x.error !== undefined);
    assert.equal(m.error.code, -32600);
    assert.equal(m.id, null);
    assert.match(m.error.message, /exceeds the maximum of 1048576 bytes/);
    assert.deepEqual((await raw.request("ping")).result, {});
  } finally {
    await raw.close();
  }
});

test("stdin EOF: the process exits 0 promptly", async () => {
  const raw = spawnRaw();
  await raw.initialize();
  const t0 = Date.now();
  raw.proc.stdin.end();
  const { code } = await raw.exited;
  assert.equal(code, 0);
  assert.ok(Date.now() - t0 < 2000, `exited in ${Date.now() - t0} ms`);
});

test("stdin EOF with a call in flight: its cleanup runs, then exit 0", async () => {
  const raw = spawnRaw();
  await raw.initialize();
  const marker = path.join(work, "eof-marker");
  raw.send({ jsonrpc: "2.0", id: 1, method: "tools/call", params: { name: "fixture_sleep", arguments: { seconds: 60, marker } } });
  await new Promise((r) => setTimeout(r, 200));
  const t0 = Date.now();
  raw.proc.stdin.end();
  const { code } = await raw.exited;
  assert.equal(code, 0);
  assert.ok(Date.now() - t0 < 3000, `exited in ${Date.now() - t0} ms`);
  assert.equal(readFileSync(marker, "utf8"), "cleanup after cancel\n");
});

test("SIGTERM with a call in flight: its cleanup runs, then exit 0", async () => {
  const raw = spawnRaw();
  await raw.initialize();
  const marker = path.join(work, "term-marker");
  raw.send({ jsonrpc: "2.0", id: 1, method: "tools/call", params: { name: "fixture_sleep", arguments: { seconds: 60, marker } } });
  await new Promise((r) => setTimeout(r, 200));
  raw.proc.kill("SIGTERM");
  const { code } = await raw.exited;
  assert.equal(code, 0);
  assert.equal(readFileSync(marker, "utf8"), "cleanup after cancel\n");
});
