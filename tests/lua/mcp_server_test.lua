-- The MCP server over an in-memory transport: lifecycle and version negotiation, JSON-RPC
-- errors, tools/list and tools/call, concurrency, cancellation, progress, logging and the
-- bound on outgoing messages.
local async = require("demesne.async")
local json = require("demesne.json")
local server = require("demesne.mcp.server")
local tools = require("demesne.tools")

local tests = {}

local SLEEP = {
  name = "sleep",
  description = "sleeps",
  inputSchema = { type = "object", properties = { ms = { type = "integer", minimum = 0 } }, required = { "ms" } },
  run = function(ctx, args)
    ctx.state.started = true
    local _ <close> = setmetatable({}, { __close = function() ctx.state.cleaned = true end })
    async.sleep(args.ms)
    return { slept = args.ms }
  end,
}

local ECHO = {
  name = "echo",
  title = "Echo",
  description = "echoes",
  inputSchema = { type = "object", additionalProperties = false, required = { "text" },
    properties = { text = { type = "string" }, n = { type = "integer", default = 1 } } },
  outputSchema = { type = "object", properties = { text = { type = "string" } } },
  annotations = { readOnlyHint = true },
  run = function(ctx, args) return { text = args.text:rep(args.n) } end,
}

local function harness(descs, opts)
  opts = opts or {}
  local state = {}
  local reg = tools.registry()
  for _, d in ipairs(descs or {}) do
    local run = d.run
    local copy = {}
    for k, v in pairs(d) do copy[k] = v end
    copy.run = function(ctx, args) ctx.state = state; return run(ctx, args) end
    reg:add(copy)
  end
  local h = { out = {}, raw = {}, state = state }
  h.srv = server.new({
    send = function(line)
      h.raw[#h.raw + 1] = line
      h.out[#h.out + 1] = assert(json.decode(line))
      return true
    end,
    registry = reg,
    max_message_bytes = opts.max_message_bytes,
  })
  function h.send(msg) h.srv:receive(type(msg) == "string" and msg or json.encode(msg)) end
  function h.call(id, method, params) h.send({ jsonrpc = "2.0", id = id, method = method, params = params }) end
  function h.take()
    local out = h.out
    h.out, h.raw = {}, {}
    return out
  end
  -- the responses (messages with an id and no method), in order
  function h.responses()
    local r = {}
    for _, m in ipairs(h.take()) do if m.method == nil then r[#r + 1] = m end end
    return r
  end
  function h.init(version)
    h.call(0, "initialize", { protocolVersion = version or "2025-11-25", capabilities = { sampling = {} },
      clientInfo = { name = "test", version = "1" } })
    h.send({ jsonrpc = "2.0", method = "notifications/initialized" })
    return h.responses()[1]
  end
  setmetatable(h, { __close = function() h.srv:close() end })
  return h
end

function tests.version_negotiation(t)
  for _, case in ipairs({ { "2025-06-18", "2025-06-18" }, { "2025-11-25", "2025-11-25" }, { "2024-11-05", "2025-11-25" },
                          { "1999-01-01", "2025-11-25" } }) do
    local h <close> = harness()
    local r = h.init(case[1])
    t:eq(r.id, 0)
    t:eq(r.result.protocolVersion, case[2], "answer to " .. case[1])
    t:eq(r.result.serverInfo.name, "demesne")
    t:eq(r.result.serverInfo.version, require("core.loop").version)
    t:eq(r.result.capabilities.tools, { listChanged = false })
    t:ok(r.result.capabilities.logging, "logging capability")
    t:ok(type(r.result.instructions) == "string", "instructions")
  end
end

-- Found by tests/fuzz/mcp_server (corpus file regression-long-numeric-id): the answer to a
-- numeric id of 15 digits or more carried another id (lua-cjson writes 14 significant
-- digits), so the client never matched it.
function tests.long_numeric_id_is_answered_unchanged(t)
  local h <close> = harness()
  for _, id in ipairs({ 123456789012345, 9007199254740991, 0.30000000000000004, 6.6666666666666666e55 }) do
    h.send(('{"jsonrpc":"2.0","id":%s,"method":"ping"}'):format(("%.17g"):format(id)))
    local r = h.responses()[1]
    t:eq(r and r.id, id + 0.0, "the id of the answer to " .. ("%.17g"):format(id))
  end
end

function tests.initialize_twice_is_refused(t)
  local h <close> = harness()
  h.init()
  h.call(1, "initialize", { protocolVersion = "2025-06-18" })
  local r = h.responses()[1]
  t:eq(r.error.code, server.INVALID_REQUEST)
end

function tests.initialize_wrong_param_types(t)
  local h <close> = harness()
  h.call(1, "initialize", { protocolVersion = 20250618 })
  local r = h.responses()[1]
  t:eq(r.error.code, server.INVALID_PARAMS)
  t:match(r.error.message, "params%.protocolVersion")
end

function tests.ping_returns_empty_object(t)
  local h <close> = harness()
  h.call("abc", "ping")
  t:match(h.raw[1], '"result":{}', "an empty object, not []")
  t:eq(h.out[1], { jsonrpc = "2.0", id = "abc", result = {} })
end

function tests.jsonrpc_errors(t)
  local h <close> = harness({ ECHO })
  h.init()
  local cases = {
    { '{"jsonrpc":"2.0","id":1,"method":"ping"', server.PARSE_ERROR, json.null },
    { '[{"jsonrpc":"2.0","id":1,"method":"ping"}]', server.INVALID_REQUEST, json.null },
    { '[]', server.INVALID_REQUEST, json.null },
    { '42', server.INVALID_REQUEST, json.null },
    { '"ping"', server.INVALID_REQUEST, json.null },
    { 'null', server.INVALID_REQUEST, json.null },
    { '{"jsonrpc":"1.0","id":2,"method":"ping"}', server.INVALID_REQUEST, 2 },
    { '{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', server.INVALID_REQUEST, json.null },
    { '{"jsonrpc":"2.0","id":3,"method":7}', server.INVALID_REQUEST, 3 },
    { '{"jsonrpc":"2.0","id":4}', server.INVALID_REQUEST, 4 },
    { '{"jsonrpc":"2.0","id":5,"method":"prompts/list"}', server.METHOD_NOT_FOUND, 5 },
    { '{"jsonrpc":"2.0","id":6,"method":"tools/call","params":"x"}', server.INVALID_PARAMS, 6 },
    { '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":5}}', server.INVALID_PARAMS, 7, "params%.name" },
    { '{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"echo","arguments":[1]}}', server.INVALID_PARAMS, 8,
      "params%.arguments" },
    { '{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"nope"}}', server.INVALID_PARAMS, 9, "Unknown tool: nope" },
    { '{"jsonrpc":"2.0","id":10,"method":"logging/setLevel","params":{"level":"loud"}}', server.INVALID_PARAMS, 10,
      "params%.level" },
    { '{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"echo","_meta":{"progressToken":true}}}',
      server.INVALID_PARAMS, 11, "progressToken" },
    { '{"jsonrpc":"2.0","id":12,"method":"tools/list","params":{"cursor":5}}', server.INVALID_PARAMS, 12, "params%.cursor" },
  }
  for _, c in ipairs(cases) do
    h.send(c[1])
    local out = h.take()
    t:eq(#out, 1, "one response to " .. c[1])
    t:eq(out[1].error and out[1].error.code, c[2], "code for " .. c[1])
    t:eq(out[1].id, c[3], "id for " .. c[1])
    if c[4] then t:match(out[1].error.message, c[4], "message for " .. c[1]) end
  end
  h.call(99, "ping")
  t:eq(h.responses()[1].result, {}, "still serving")
end

function tests.notifications_get_no_response(t)
  local h <close> = harness()
  h.init()
  h.send({ jsonrpc = "2.0", method = "notifications/initialized" })
  h.send({ jsonrpc = "2.0", method = "notifications/whatever", params = { x = 1 } })
  h.send({ jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = 12345 } })
  h.send({ jsonrpc = "2.0", method = "nonexistent/notification" })
  t:eq(#h.responses(), 0)
end

function tests.tools_list_is_sorted_with_schemas(t)
  local h <close> = harness({ SLEEP, ECHO })
  h.init()
  h.call(1, "tools/list", {})
  local line = h.raw[1]
  local r = h.responses()[1].result
  t:eq(#r.tools, 2)
  t:eq(r.tools[1].name, "echo")
  t:eq(r.tools[2].name, "sleep")
  t:eq(r.tools[1].title, "Echo")
  t:eq(r.tools[1].inputSchema.required, { "text" })
  t:eq(r.tools[1].outputSchema.type, "object")
  t:eq(r.tools[1].annotations, { readOnlyHint = true })
  t:eq(r.nextCursor, nil)
  t:match(line, '"required":%["text"%]')
end

function tests.tools_call_structured_and_text(t)
  local h <close> = harness({ ECHO })
  h.init()
  h.call(1, "tools/call", { name = "echo", arguments = { text = "ab", n = 2 } })
  local r = h.responses()[1].result
  t:eq(r.structuredContent, { text = "abab" })
  t:eq(r.content[1].type, "text")
  t:eq(json.decode(r.content[1].text), { text = "abab" })
  t:eq(r.isError, false)
end

function tests.invalid_arguments_are_a_tool_error_naming_the_field(t)
  local h <close> = harness({ ECHO })
  h.init()
  h.call(1, "tools/call", { name = "echo", arguments = { text = 5, extra = true } })
  local r = h.responses()[1].result
  t:eq(r.isError, true)
  t:match(r.content[1].text, "text: expected string, got integer 5")
  t:match(r.content[1].text, "extra: is not an allowed property")
  h.call(2, "tools/call", { name = "echo" })
  r = h.responses()[1].result
  t:eq(r.isError, true)
  t:match(r.content[1].text, "text: is required")
end

function tests.tool_failures_become_is_error(t)
  local h <close> = harness({
    { name = "fails", description = "d", inputSchema = { type = "object" },
      run = function() error(tools.fail("path: no such file", { path = "/x" })) end },
    { name = "crashes", description = "d", inputSchema = { type = "object" },
      run = function() local x = nil; return x.y end },
    { name = "sandbox_style", description = "d", inputSchema = { type = "object" },
      run = function() error({ demesne_error = true, message = "image: not found", code = "ENOENT" }, 0) end },
  })
  h.init()
  h.call(1, "tools/call", { name = "fails" })
  local r = h.responses()[1].result
  t:eq(r.isError, true)
  t:eq(r.content[1].text, "path: no such file")
  t:eq(json.decode(r.content[2].text), { path = "/x" })
  h.call(2, "tools/call", { name = "crashes" })
  r = h.responses()[1].result
  t:eq(r.isError, true)
  t:match(r.content[1].text, "^Tool crashes failed: .*attempt to index a nil value")
  t:ok(not r.content[1].text:find("\n"), "one line, no traceback")
  h.call(3, "tools/call", { name = "sandbox_style" })
  r = h.responses()[1].result
  t:eq(r.content[1].text, "image: not found")
end

function tests.raw_call_tool_result_passes_through(t)
  local h <close> = harness({
    { name = "img", description = "d", inputSchema = { type = "object" },
      run = function() return { content = { { type = "image", data = "AAAA", mimeType = "image/png" } } } end },
  })
  h.init()
  h.call(1, "tools/call", { name = "img", arguments = {} })
  local r = h.responses()[1].result
  t:eq(r.content, { { type = "image", data = "AAAA", mimeType = "image/png" } })
  t:eq(r.structuredContent, nil)
end

function tests.requests_run_concurrently_and_answer_out_of_order(t)
  local h <close> = harness({ SLEEP, ECHO })
  h.init()
  h.call("slow", "tools/call", { name = "sleep", arguments = { ms = 60 } })
  h.call("fast", "tools/call", { name = "echo", arguments = { text = "x" } })
  h.call("ping", "ping")
  local first = h.responses()
  t:eq(#first, 2)
  t:eq(first[1].id, "fast")
  t:eq(first[2].id, "ping")
  async.sleep(100)
  local later = h.responses()
  t:eq(#later, 1)
  t:eq(later[1].id, "slow")
  t:eq(later[1].result.structuredContent, { slept = 60 })
end

function tests.cancelled_request_runs_cleanup_and_gets_no_response(t)
  local h <close> = harness({ SLEEP })
  h.init()
  h.call(7, "tools/call", { name = "sleep", arguments = { ms = 60000 } })
  t:ok(h.state.started, "tool started")
  h.send({ jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = 7, reason = "user" } })
  t:ok(h.state.cleaned, "<close> handler ran")
  async.sleep(10)
  t:eq(#h.responses(), 0, "no response for a cancelled request")
  t:eq(h.srv:pending(), 0)
  -- a second cancel for the same id is ignored; the id can be reused
  h.send({ jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = 7 } })
  h.call(7, "ping")
  t:eq(h.responses()[1].result, {})
end

function tests.duplicate_id_in_flight_is_refused(t)
  local h <close> = harness({ SLEEP })
  h.init()
  h.call(1, "tools/call", { name = "sleep", arguments = { ms = 30 } })
  h.call(1, "ping")
  local r = h.responses()
  t:eq(r[1].error.code, server.INVALID_REQUEST)
  async.sleep(50)
  t:eq(h.responses()[1].result.structuredContent, { slept = 30 })
end

-- Found by tests/fuzz/mcp_server (corpus file regression-duplicate-huge-id): the refusal of
-- a reused id named it with ("%d"):format(id), which raises for a float with no integer
-- form (6.6e55): the error escaped receive and the client got no answer at all.
function tests.duplicate_huge_numeric_id_is_refused(t)
  local h <close> = harness({ SLEEP })
  h.init()
  for _, id in ipairs({ 6.6e55, 1.5, 2 ^ 63 }) do
    h.call(id, "tools/call", { name = "sleep", arguments = { ms = 30 } })
    h.call(id, "ping")
    local r = h.responses()
    t:eq(#r, 1, "one answer to the reused id " .. tostring(id))
    t:eq(r[1].error and r[1].error.code, server.INVALID_REQUEST)
    t:eq(r[1].id, json.null)
    t:match(r[1].error.message, "already in use")
  end
  async.sleep(60)
  t:eq(#h.responses(), 3, "the first requests are answered")
end

function tests.progress_only_with_a_token_and_strictly_increasing(t)
  local calls = {}
  local h <close> = harness({
    { name = "prog", description = "d", inputSchema = { type = "object" }, run = function(ctx)
      calls[#calls + 1] = ctx.progress(0, 10)
      calls[#calls + 1] = ctx.progress(5, 10, "half")
      calls[#calls + 1] = ctx.progress(5, 10) -- not increasing: refused
      calls[#calls + 1] = ctx.progress(4.5)   -- going back: refused
      calls[#calls + 1] = ctx.progress(10, 10)
      return {}
    end },
  })
  h.init()
  h.call(1, "tools/call", { name = "prog", _meta = { progressToken = "tok" } })
  async.sleep(60) -- the response waits a moment after the last progress
  local out = h.take()
  local progress = {}
  for _, m in ipairs(out) do
    if m.method == "notifications/progress" then
      t:eq(m.params.progressToken, "tok")
      progress[#progress + 1] = m.params.progress
    end
  end
  t:eq(progress, { 0, 5, 10 })
  t:eq(calls, { true, true, false, false, true })
  t:eq(out[#out].id, 1, "the response comes after the progress")
  calls = {}
  h.call(2, "tools/call", { name = "prog" })
  out = h.take()
  t:eq(#out, 1, "no progress without a token")
  t:eq(calls, { false, false, false, false, false })
end

function tests.logging_honours_set_level_and_names_the_logger(t)
  local h <close> = harness({
    { name = "talk", description = "d", inputSchema = { type = "object" }, run = function(ctx)
      ctx.log("debug", "d-msg")
      ctx.log("info", "i-msg")
      ctx.log("warning", "w-msg", { k = 1 })
      ctx.log("error", "e-msg\nstack traceback:\n\tsecret")
      return {}
    end },
  })
  h.init()
  h.call(1, "logging/setLevel", { level = "warning" })
  t:eq(h.responses()[1].result, {})
  h.call(2, "tools/call", { name = "talk" })
  local msgs = {}
  for _, m in ipairs(h.take()) do
    if m.method == "notifications/message" and m.params.logger == "demesne.tools.talk" then msgs[#msgs + 1] = m.params end
  end
  t:eq(#msgs, 2)
  t:eq(msgs[1].level, "warning")
  t:eq(msgs[1].data, { message = "w-msg", data = { k = 1 } })
  t:eq(msgs[2].level, "error")
  t:eq(msgs[2].data, "e-msg", "the traceback stays in the stderr log")
  h.call(3, "logging/setLevel", { level = "debug" })
  h.take()
  h.call(4, "tools/call", { name = "talk" })
  local n = 0
  for _, m in ipairs(h.take()) do
    if m.method == "notifications/message" and m.params.logger == "demesne.tools.talk" then n = n + 1 end
  end
  t:eq(n, 4)
end

function tests.no_log_notifications_before_initialize(t)
  local h <close> = harness()
  require("demesne.log").warning("demesne.test", "before init")
  t:eq(#h.take(), 0)
end

function tests.a_job_end_before_initialize_is_sent_after_it(t)
  local h <close> = harness()
  local log = require("demesne.log")
  log.log("info", "demesne.jobs", "background job job-x succeeded", { job_id = "job-x", status = "succeeded", exit_code = 0 })
  log.info("demesne.jobs", "job-y: re-attaching")
  t:eq(#h.take(), 0, "nothing goes out before initialize")
  h.call(0, "initialize", { protocolVersion = "2025-11-25", capabilities = {}, clientInfo = { name = "test", version = "1" } })
  local got = {}
  for _, m in ipairs(h.take()) do
    if m.method == "notifications/message" and m.params.logger == "demesne.jobs" then got[#got + 1] = m.params end
  end
  t:eq(#got, 1, "the job end, once; not the other records")
  t:eq(got[1].data.data, { job_id = "job-x", status = "succeeded", exit_code = 0 })
end

function tests.oversized_result_becomes_is_error(t)
  -- case C10: control bytes grow six-fold when JSON-escaped
  local h <close> = harness({
    { name = "flood", description = "d", inputSchema = { type = "object" },
      run = function() return { content = { { type = "text", text = ("\1"):rep(2000) } } } end },
    { name = "fits", description = "d", inputSchema = { type = "object" },
      run = function() return { content = { { type = "text", text = ("a"):rep(500) } } } end },
  }, { max_message_bytes = 4000 })
  h.init()
  h.call(1, "tools/call", { name = "flood" })
  local raw = h.raw[#h.raw]
  local r = h.responses()[1]
  t:ok(#raw <= 4000, "the message sent is within the bound")
  t:eq(r.result.isError, true)
  t:match(r.result.content[1].text, "too large")
  h.call(2, "tools/call", { name = "fits" })
  t:eq(h.responses()[1].result.content[1].text, ("a"):rep(500))
end

function tests.invalid_utf8_is_replaced_on_the_way_out(t)
  local h <close> = harness({
    { name = "bin", description = "d", inputSchema = { type = "object" }, run = function() return "ok\255\254" end },
  })
  h.init()
  h.call(1, "tools/call", { name = "bin" })
  local raw = h.raw[1]
  t:ok(utf8.len(raw) ~= nil, "valid UTF-8 on the wire")
  t:eq(h.responses()[1].result.content[1].text, "ok\u{FFFD}\u{FFFD}")
end

function tests.server_to_client_request(t)
  local h <close> = harness({
    { name = "ask", description = "d", inputSchema = { type = "object" }, run = function(ctx)
      local r, err = ctx.request("sampling/createMessage", { messages = json.array(), maxTokens = 5 })
      if not r then return { err = err } end
      return { reply = r.content.text }
    end },
  })
  h.init()
  h.call(1, "tools/call", { name = "ask" })
  local out = h.take()
  t:eq(#out, 1)
  t:eq(out[1].method, "sampling/createMessage")
  t:ok(out[1].id ~= nil, "a request carries an id")
  h.send({ jsonrpc = "2.0", id = out[1].id, result = { role = "assistant", content = { type = "text", text = "hi" } } })
  t:eq(h.responses()[1].result.structuredContent, { reply = "hi" })
  -- an error response
  h.call(2, "tools/call", { name = "ask" })
  out = h.take()
  h.send({ jsonrpc = "2.0", id = out[1].id, error = { code = -1, message = "no" } })
  t:eq(h.responses()[1].result.structuredContent, { err = "no" })
end

function tests.shutdown_cancels_in_flight_requests_and_waits_for_cleanup(t)
  local h <close> = harness({ SLEEP })
  h.init()
  h.call(1, "tools/call", { name = "sleep", arguments = { ms = 60000 } })
  h.call(2, "tools/call", { name = "sleep", arguments = { ms = 60000 } })
  t:eq(h.srv:pending(), 2)
  local ok = h.srv:shutdown(2000)
  t:eq(ok, true)
  t:ok(h.state.cleaned, "cleanup ran")
  t:eq(h.srv:pending(), 0)
  t:eq(#h.responses(), 0)
  h.call(3, "ping")
  t:eq(h.responses()[1].error.code, server.INTERNAL_ERROR, "no new work after shutdown")
end


-- 2026-07-28: the stateless request shape, next to legacy sessions on the same server.
local MODERN = { ["io.modelcontextprotocol/protocolVersion"] = "2026-07-28",
  ["io.modelcontextprotocol/clientCapabilities"] = {}, ["io.modelcontextprotocol/clientInfo"] = { name = "m", version = "2" } }
local function meta(extra)
  local m = {}
  for k, v in pairs(MODERN) do m[k] = v end
  for k, v in pairs(extra or {}) do m[k] = v end
  return m
end

function tests.modern_discover_without_initialize(t)
  local h <close> = harness({ ECHO })
  h.call(1, "server/discover", { _meta = meta() })
  local r = h.responses()[1].result
  t:eq(r.supportedVersions, { "2026-07-28", "2025-11-25", "2025-06-18" })
  t:eq(r.resultType, "complete")
  t:eq(r._meta["io.modelcontextprotocol/serverInfo"].name, "demesne")
  t:ok(r.capabilities.tools and r.capabilities.resources.subscribe, "tools and resource subscriptions")
  t:eq(r.capabilities.logging, nil, "logging is deprecated in 2026-07-28: not declared")
  -- tools/list and tools/call, no initialize ever sent
  h.call(2, "tools/list", { _meta = meta() })
  r = h.responses()[1].result
  t:eq({ r.tools[1].name, r.resultType, r.cacheScope, r.ttlMs }, { "echo", "complete", "private", 300000 })
  h.call(3, "tools/call", { name = "echo", arguments = { text = "hi" }, _meta = meta() })
  r = h.responses()[1].result
  t:eq({ r.structuredContent.text, r.resultType, r._meta["io.modelcontextprotocol/serverInfo"].version },
    { "hi", "complete", require("core.loop").version })
end

function tests.modern_envelope_errors(t)
  local h <close> = harness({ ECHO })
  local function err(params, method)
    h.call(7, method or "server/discover", params)
    local r = h.responses()[1]
    return r.error and r.error.code, r.error, r.id
  end
  t:eq(err({ _meta = { ["io.modelcontextprotocol/protocolVersion"] = "2026-07-28" } }), server.INVALID_PARAMS,
    "no clientCapabilities")
  local code, e, id = err({ _meta = meta({ ["io.modelcontextprotocol/protocolVersion"] = "2099-01-01" }) })
  t:eq({ code, id, e.data.requested }, { server.UNSUPPORTED_PROTOCOL_VERSION, 7, "2099-01-01" })
  t:eq(e.data.supported, server.SUPPORTED_VERSIONS)
  for _, m in ipairs({ "initialize", "ping", "logging/setLevel", "tasks/list", "nope/nope" }) do
    t:eq(err({ _meta = meta() }, m), server.METHOD_NOT_FOUND, m .. " is not a 2026-07-28 method")
  end
  -- the same server still speaks the legacy era
  t:eq(h.init().result.protocolVersion, "2025-11-25")
end

function tests.modern_logs_only_with_a_log_level(t)
  local h <close> = harness({ { name = "talk", description = "d", inputSchema = { type = "object" }, run = function(ctx)
    ctx.log("info", "hello")
    ctx.log("debug", "detail")
    return {}
  end } })
  h.call(1, "tools/call", { name = "talk", _meta = meta() })
  local out = h.take()
  t:eq(#out, 1, "no notifications/message without a logLevel")
  h.call(2, "tools/call", { name = "talk", _meta = meta({ ["io.modelcontextprotocol/logLevel"] = "info" }) })
  out = h.take()
  t:eq({ #out, out[1].method, out[1].params.data, out[1].params.logger }, { 2, "notifications/message", "hello",
    "demesne.tools.talk" })
end

function tests.modern_listen_acknowledges_and_reports_job_ends(t)
  local log = require("demesne.log")
  local h <close> = harness()
  h.call("listen:0", "subscriptions/listen", { _meta = meta(), notifications = { toolsListChanged = true,
    resourceSubscriptions = { "demesne://jobs", "file:///etc/passwd" } } })
  local out = h.take()
  t:eq(#out, 1)
  t:eq(out[1].method, "notifications/subscriptions/acknowledged")
  t:eq(out[1].params._meta["io.modelcontextprotocol/subscriptionId"], "listen:0")
  t:eq(out[1].params.notifications, { resourceSubscriptions = { "demesne://jobs" } }, "only what is honoured")
  log.log("info", "demesne.jobs", "background job job-x-1 succeeded", { job_id = "job-x-1", status = "succeeded" })
  out = h.take()
  t:eq(#out, 1)
  t:eq({ out[1].method, out[1].params.uri, out[1].params._meta["io.modelcontextprotocol/subscriptionId"] },
    { "notifications/resources/updated", "demesne://jobs/job-x-1", "listen:0" })
  -- a stop ends it with the completion result
  local stopped = async.spawn("stop", function() return h.srv:shutdown(1000) end)
  stopped:wait()
  out = h.take()
  t:eq(#out, 1)
  t:eq({ out[1].id, out[1].result.resultType, out[1].result._meta["io.modelcontextprotocol/subscriptionId"] },
    { "listen:0", "complete", "listen:0" })
end

function tests.modern_listen_cancelled_gets_no_response(t)
  local h <close> = harness()
  h.call(5, "subscriptions/listen", { _meta = meta(), notifications = {} })
  t:eq(h.take()[1].method, "notifications/subscriptions/acknowledged")
  h.send({ jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = 5 } })
  async.sleep(5)
  t:eq(#h.take(), 0)
  t:eq(h.srv:pending(), 0)
end

function tests.ids_round_trip_exactly(t)
  local h <close> = harness({ SLEEP })
  h.init()
  for _, id in ipairs({ "9007199254740993", "-9223372036854775809", "12345678901234567890123", "123456789012345", "99999999999999", "1.5", "1e3", "1.0",
    '"s"', "0", "-7" }) do
    h.send('{"jsonrpc":"2.0","id":' .. id .. ',"method":"ping"}')
    local raw = h.raw[1]
    h.take()
    t:match(raw, '"id":' .. id:gsub("%p", "%%%0") .. '[,}]', "id " .. id .. " in " .. tostring(raw))
  end
  -- a string id with escapes comes back as the same string
  h.send('{"jsonrpc":"2.0","id":"\\u00e9\\/x","method":"ping"}')
  t:eq(h.take()[1].id, "é/x")
  -- an error answer keeps the id too, and cancellation finds a request by its exact id
  h.send('{"jsonrpc":"2.0","id":9007199254740993,"method":"nope"}')
  t:match(h.raw[1], '"id":9007199254740993[,}]')
  h.take()
  h.send('{"jsonrpc":"2.0","id":9007199254740993,"method":"tools/call","params":{"name":"sleep","arguments":{"ms":60000}}}')
  h.send('{"jsonrpc":"2.0","id":9007199254740992,"method":"tools/call","params":{"name":"sleep","arguments":{"ms":20}}}')
  h.send('{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":9007199254740993}}')
  async.sleep(60)
  local answered = {}
  for _, line in ipairs(h.raw) do if not line:find('"method"', 1, true) then answered[#answered + 1] = line end end
  t:eq(#answered, 1, "only the other call answered: " .. table.concat(answered, " | "))
  t:match(answered[1], '"id":9007199254740992[,}]')
  t:eq(h.srv:pending(), 0)
end

return tests
