-- lua/mcp/http.lua inside the binary: listen addresses, the bearer token (environment or a
-- 0600 file), and the server itself on loopback TCP (IPv4 and IPv6) driven by libcurl
-- (core.http): sessions, the session cap, 2026-07-28 requests next to 2025 ones, and a clean
-- stop with nothing left open.
local http = require("demesne.mcp.http")
local config = require("demesne.config")
local json = require("demesne.json")
local tools = require("demesne.tools")
local async = require("demesne.async")
local fs = require("core.fs")
local loop = require("core.loop")
local curl = require("core.http")
local cstream = require("core.stream")

local request = async.wrap(curl.request)
local tests = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- Runs fn with environment variables set (and config reloaded), restoring them after.
local function with_env(vars, fn)
  local old = {}
  for k, v in pairs(vars) do old[k] = os.getenv(k) or false; loop.setenv(k, v or nil) end
  config.load()
  local ok, err = pcall(fn)
  for k, v in pairs(old) do loop.setenv(k, v or nil) end
  config.load()
  if not ok then error(err, 0) end
end

local function tmpdir()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-mcp-http-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

local ECHO = { name = "echo", description = "echoes",
  inputSchema = { type = "object", properties = { text = { type = "string" } } },
  run = function(_, args) return { text = args.text } end }

local function registry()
  local reg = tools.registry()
  reg:add(ECHO)
  return reg
end

function tests.parse_addr(t)
  t:eq(http.parse_addr("127.0.0.1:8765"), { kind = "tcp", ip = "127.0.0.1", port = 8765, loopback = true, v6 = false,
    text = "127.0.0.1:8765" })
  t:eq(http.parse_addr("localhost:0").ip, "127.0.0.1")
  local v6 = http.parse_addr("[::1]:9")
  t:eq({ v6.ip, v6.port, v6.loopback, v6.v6 }, { "::1", 9, true, true })
  t:eq(http.parse_addr("0.0.0.0:80").loopback, false)
  t:eq(http.parse_addr("unix:/run/x.sock"), { kind = "unix", path = "/run/x.sock", text = "unix:/run/x.sock" })
  for _, bad in ipairs({ "", "8765", "example.com:80", "127.0.0.1:70000", "unix:relative", "[::1]", "127.0.0.1:x" }) do
    local a, err = http.parse_addr(bad)
    t:eq(a, nil, bad)
    t:ok(type(err) == "string" and #err > 0, "a reason for " .. bad)
  end
end

function tests.token_from_env_or_a_private_file(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = false }, function()
    local tok, where = http.token(false)
    t:eq({ tok, where }, { nil, d.path .. "/state/http-token" }, "no file yet, not created by a read")
    tok, where = http.token(true)
    t:ok(tok and #tok == 64, "a generated token")
    t:eq(where, d.path .. "/state/http-token")
    t:eq(fs.stat(where).mode & 511, 384, "mode 0600")
    t:eq(http.token(true), tok, "the same token next time")
    fs.chmod(where, 420) -- 0644: tightened on use
    http.token(false)
    t:eq(fs.stat(where).mode & 511, 384, "tightened back to 0600")
  end)
  with_env({ DEMESNE_HTTP_TOKEN = "short" }, function()
    local tok, err = http.token(true)
    t:eq(tok, nil)
    t:match(err, "shorter than 16")
  end)
  with_env({ DEMESNE_HTTP_TOKEN = "0123456789abcdef-from-env" }, function()
    t:eq({ http.token(true) }, { "0123456789abcdef-from-env", "$DEMESNE_HTTP_TOKEN" })
  end)
end

function tests.refuses_non_loopback_without_the_flag(t)
  local h, err = http.start({ addrs = { "0.0.0.0:0" }, registry = registry() })
  t:eq(h, nil)
  t:match(err, "not a loopback address")
end

local function post(url, token, body, headers)
  local h = { ["Content-Type"] = "application/json", Accept = "application/json, text/event-stream",
    Authorization = "Bearer " .. token }
  for k, v in pairs(headers or {}) do h[k] = v end
  return assert(request({ url = url, method = "POST", body = json.encode(body), headers = h }))
end

function tests.sessions_capped_v6_listener_and_clean_stop(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = "lua-test-token-0123456789",
    DEMESNE_HTTP_MAX_SESSIONS = "2" }, function()
    local h = assert(http.start({ addrs = { "127.0.0.1:0", "[::1]:0" }, registry = registry() }))
    t:eq(#h.urls, 2)
    local v4 = h.urls[1]:find("127.0.0.1", 1, true) and h.urls[1] or h.urls[2]
    local v6 = h.urls[1]:find("[::1]", 1, true) and h.urls[1] or h.urls[2]
    local init = { jsonrpc = "2.0", id = 1, method = "initialize",
      params = { protocolVersion = "2025-06-18", capabilities = {}, clientInfo = { name = "lua", version = "1" } } }
    local r1 = post(v4, "lua-test-token-0123456789", init)
    t:eq(r1.status, 200)
    t:eq(json.decode(r1.body).result.protocolVersion, "2025-06-18")
    local sid = r1.headers["mcp-session-id"]
    t:match(sid, "^%x+$")
    local r2 = post(v6, "lua-test-token-0123456789", init)
    t:eq(r2.status, 200, "over IPv6")
    t:eq(post(v4, "lua-test-token-0123456789", init).status, 503, "a third session over the cap")
    t:eq(h.sessions(), 2)
    -- a 2026-07-28 request needs no session and is not counted
    local m = { jsonrpc = "2.0", id = 2, method = "tools/call", params = { name = "echo", arguments = { text = "hi" },
      _meta = { ["io.modelcontextprotocol/protocolVersion"] = "2026-07-28",
        ["io.modelcontextprotocol/clientCapabilities"] = {} } } }
    local r3 = post(v4, "lua-test-token-0123456789", m, { ["MCP-Protocol-Version"] = "2026-07-28", ["Mcp-Method"] = "tools/call",
      ["Mcp-Name"] = "echo" })
    t:eq(r3.status, 200)
    t:match(r3.body, '"text":"hi"')
    -- the session answers on its id; DELETE ends it
    local r4 = post(v4, "lua-test-token-0123456789", { jsonrpc = "2.0", id = 3, method = "tools/list" },
      { ["Mcp-Session-Id"] = sid, ["MCP-Protocol-Version"] = "2025-06-18" })
    t:eq(json.decode(r4.body).result.tools[1].name, "echo")
    local del = assert(request({ url = v4, method = "DELETE", headers = { Authorization = "Bearer lua-test-token-0123456789",
      ["Mcp-Session-Id"] = sid } }))
    t:eq(del.status, 200)
    t:eq(h.sessions(), 1)
    h.stop(2000)
    t:eq(h.connections(), 0)
  end)
end

-- Resumption (Last-Event-ID): a stream whose connection is cut while its tool runs is kept;
-- its answer, sent while no client is connected, comes on the resuming GET with only the
-- last http_sse_replay_events events, once; a second resume gets 400, or, with an event id
-- that names the request, a JSON-RPC error for it.
function tests.a_cut_stream_resumes_with_its_last_events_and_the_answer_once(t)
  local d <close> = tmpdir()
  local release = async.event()
  local reg = registry()
  reg:add({ name = "slow", description = "ten progress notifications, then waits for the test",
    inputSchema = { type = "object" },
    run = function(ctx)
      for i = 1, 10 do ctx.progress(i, 10) end
      release.wait()
      return { text = "done" }
    end })
  local token = "lua-test-token-0123456789"
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = token,
    DEMESNE_HTTP_SSE_REPLAY_EVENTS = "3" }, function()
    local h = assert(http.start({ addrs = { "127.0.0.1:0" }, registry = reg }))
    local url = h.urls[1]
    local init = post(url, token, { jsonrpc = "2.0", id = 1, method = "initialize",
      params = { protocolVersion = "2025-11-25", capabilities = {}, clientInfo = { name = "lua", version = "1" } } })
    local sh = { ["Mcp-Session-Id"] = init.headers["mcp-session-id"], ["MCP-Protocol-Version"] = "2025-11-25" }
    post(url, token, { jsonrpc = "2.0", method = "notifications/initialized" }, sh)
    -- the call on a raw connection, closed once the client has read its 10th event
    local port = math.tointeger(tonumber(url:match(":(%d+)/")))
    local body = json.encode({ jsonrpc = "2.0", id = 2, method = "tools/call",
      params = { name = "slow", arguments = {}, _meta = { progressToken = "p" } } })
    local head = ("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      .. "Accept: application/json, text/event-stream\r\nAuthorization: Bearer %s\r\nMcp-Session-Id: %s\r\n"
      .. "MCP-Protocol-Version: 2025-11-25\r\nContent-Length: %d\r\n\r\n"):format(token, sh["Mcp-Session-Id"], #body)
    local seen, got = async.event(), {}
    assert(cstream.connect_tcp("127.0.0.1", port, function(c, msg)
      if not c then seen.set(msg) return end
      c:read_start(function(data)
        if data then got[#got + 1] = data end
        if not data or table.concat(got):find("\nid: 1%-10%-i2\n") then
          c:close()
          seen.set(data and "cut" or "closed")
        end
      end)
      c:write(head .. body)
    end))
    t:eq(async.timeout(5000, seen.wait), "cut", "the stream carried 10 events with ids")
    local text = table.concat(got)
    t:ok(text:find("\nid: 1%-0%-i2\ndata: \n\n") ~= nil
      and text:find("id: 1-0-i2", 1, true) < text:find("id: 1-1-i2\n", 1, true), "a priming event first")
    -- the server notices the close (no request is in progress on any connection after it)
    for _ = 1, 200 do
      if h.connections() == 0 then break end
      async.sleep(10)
    end
    release.set() -- the answer comes while no client is connected
    async.sleep(20)
    local get = { Accept = "text/event-stream", Authorization = "Bearer " .. token, ["Last-Event-ID"] = "1-0-i2" }
    for k, v in pairs(sh) do get[k] = v end
    local r = assert(request({ url = url, method = "GET", headers = get }))
    t:eq(r.status, 200, r.body)
    local ids, answers = {}, 0
    for block in r.body:gmatch("(.-)\n\n") do
      ids[#ids + 1] = block:match("^id: (%S+)")
      local m = json.decode(block:match("data: (.*)$") or "null")
      if type(m) == "table" and m.id == 2 then
        answers = answers + 1
        t:eq(m.result.structuredContent.text, "done")
      end
    end
    t:eq(ids, { "1-9-i2", "1-10-i2", "1-11-i2" }, "the last 3 events: two progress notifications and the answer")
    t:eq(answers, 1, "the answer, once")
    get["Last-Event-ID"] = "1-0"
    local again = assert(request({ url = url, method = "GET", headers = get }))
    t:eq(again.status, 400, "delivered: the stream is no longer kept")
    t:match(json.decode(again.body).error.message, "names no stream this session keeps")
    get["Last-Event-ID"] = "1-0-i2"
    local tagged = assert(request({ url = url, method = "GET", headers = get }))
    t:eq(tagged.status, 200, "an id that names its request: that request's error")
    local m = json.decode(tagged.body:match("data: ([^\n]*)"))
    t:eq({ m.id, m.error.code }, { 2, -32603 })
    h.stop(2000)
    t:eq(h.connections(), 0)
  end)
end

-- A resume that reaches a server which never had the stream (the one that had it was killed
-- and a new one started on the same address): an event id that names its request gets a
-- 200 event stream with a JSON-RPC error for that request and the end, so the client's call
-- fails at once (rmcp, Codex's MCP client, retries a 404 here with no limit); string ids too;
-- an id that names no request, or a malformed one, still gets the session's 404.
function tests.a_resume_of_a_stream_of_an_ended_server_is_answered_with_an_error_for_its_request(t)
  local d <close> = tmpdir()
  local token = "lua-test-token-0123456789"
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = token }, function()
    local h = assert(http.start({ addrs = { "127.0.0.1:0" }, registry = registry() }))
    local _ <close> = setmetatable({}, { __close = function() h.stop(2000) end })
    local function resume(last)
      return assert(request({ url = h.urls[1], method = "GET", headers = { Accept = "text/event-stream",
        Authorization = "Bearer " .. token, ["Mcp-Session-Id"] = ("ab"):rep(16), ["MCP-Protocol-Version"] = "2025-11-25",
        ["Last-Event-ID"] = last } }))
    end
    local r = resume("3-7-i41")
    t:eq(r.status, 200, r.body)
    t:match(r.headers["content-type"] or "", "text/event%-stream")
    local events = {}
    for block in r.body:gmatch("(.-)\n\n") do events[#events + 1] = json.decode(block:match("data: (.*)$")) end
    t:eq(#events, 1, "one event, then the end")
    t:eq({ events[1].id, events[1].error.code }, { 41, -32603 })
    t:match(events[1].error.message, "is lost: its session is not one this server has")
    local s = resume("1-0-s" .. ("req-\"1\""):gsub(".", function(c) return ("%02x"):format(c:byte()) end))
    t:eq(s.status, 200)
    t:eq(json.decode(s.body:match("data: ([^\n]*)")).id, 'req-"1"', "a string id, decoded")
    t:eq(resume("3-7").status, 404, "an id that names no request")
    t:eq(resume("3-7-sz1").status, 404, "a malformed request tag")
    t:eq(resume("x-i41").status, 404, "a malformed event id")
  end)
end

-- Routes (the in-sandbox endpoint's /mcp/host/<server>): a path other than /mcp is served
-- only when `routes` gives it a registry; its sessions belong to it; a registry with
-- list_changed announces it, and handle.notify reaches the route's open GET streams only.
function tests.routes_serve_their_own_registry_sessions_and_list_changed(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = "lua-test-token-0123456789" }, function()
    local other = tools.registry()
    other:add({ name = "other_tool", description = "of the other route", inputSchema = { type = "object" },
      run = function() return "from the other route" end })
    other.list_changed = true
    local asked = {}
    local h = assert(http.start({ addrs = { "127.0.0.1:0" }, registry = registry(),
      routes = function(path, listener)
        asked[#asked + 1] = listener
        if path == "/mcp/host/other" then
          return { registry = other, options = { instructions = "other's", tools_only = true } }
        end
      end }))
    local streams = {}
    -- whatever fails below, nothing is left open
    local _ <close> = setmetatable({}, { __close = function()
      for _, s in ipairs(streams) do s:cancel() end
      h.stop(2000)
    end })
    local base = h.urls[1]
    local tok = "lua-test-token-0123456789"
    local init = { jsonrpc = "2.0", id = 1, method = "initialize",
      params = { protocolVersion = "2025-06-18", capabilities = {}, clientInfo = { name = "lua", version = "1" } } }
    t:eq(post(base .. "/host/nosuch", tok, init).status, 404, "a path no route serves")
    local r = post(base .. "/host/other", tok, init)
    t:eq(r.status, 200)
    local res = json.decode(r.body).result
    t:eq(res.capabilities.tools.listChanged, true, "the route's registry announces list_changed")
    t:eq(res.instructions, "other's")
    t:eq(res.capabilities.resources, nil, "tools_only: no resources")
    t:eq(asked[1], "host", "routes hears the listener")
    local sid = r.headers["mcp-session-id"]
    local main = post(base, tok, init)
    t:eq(json.decode(main.body).result.capabilities.tools.listChanged, false, "/mcp is unchanged")
    local msid = main.headers["mcp-session-id"]
    local v = { ["MCP-Protocol-Version"] = "2025-06-18", ["Mcp-Session-Id"] = sid }
    post(base .. "/host/other", tok, { jsonrpc = "2.0", method = "notifications/initialized" }, v)
    local list = json.decode(post(base .. "/host/other", tok, { jsonrpc = "2.0", id = 2, method = "tools/list" }, v).body)
    t:eq(json.decode(post(base .. "/host/other", tok, { jsonrpc = "2.0", id = 5, method = "resources/list" }, v).body)
      .error.code, -32601, "resources/list is not found on a tools_only route")
    t:eq(#list.result.tools, 1)
    t:eq(list.result.tools[1].name, "other_tool", "the route's own registry")
    t:eq(post(base, tok, { jsonrpc = "2.0", id = 3, method = "tools/list" }, v).status, 404,
      "a session of the route is not found on /mcp")
    t:eq(post(base .. "/host/other", tok, { jsonrpc = "2.0", id = 4, method = "tools/list" },
      { ["MCP-Protocol-Version"] = "2025-06-18", ["Mcp-Session-Id"] = msid }).status, 404,
      "and a session of /mcp is not found on the route")
    t:eq(h.notify(function() return true end, "notifications/tools/list_changed"), 0, "no GET stream open: none")
    -- the route's GET stream gets list_changed; /mcp's session (also with a stream) does not
    local got, heads = { other = "", main = "" }, 0
    local function stream(url, id, key)
      streams[#streams + 1] = assert(curl.request({ url = url, headers = { Accept = "text/event-stream",
        Authorization = "Bearer " .. tok, ["Mcp-Session-Id"] = id, ["MCP-Protocol-Version"] = "2025-06-18" },
        on_headers = function() heads = heads + 1 end,
        on_data = function(c) got[key] = got[key] .. c end }, function() end))
    end
    stream(base .. "/host/other", sid, "other")
    stream(base, msid, "main")
    local deadline = loop.now() + 5000
    while heads < 2 and loop.now() < deadline do async.sleep(20) end
    async.sleep(100) -- the server has taken both streams once their heads are out
    t:eq(h.notify(function(_, path) return path == "/mcp/host/other" end, "notifications/tools/list_changed"), 1,
      "one session: the route's")
    deadline = loop.now() + 5000
    while not got.other:find("list_changed", 1, true) and loop.now() < deadline do async.sleep(20) end
    local data = got.other:match("data: ([^\n]+)")
    t:eq(data and json.decode(data), { jsonrpc = "2.0", method = "notifications/tools/list_changed" },
      "the route's stream got it")
    async.sleep(100)
    t:eq(got.main:find("list_changed", 1, true), nil, "/mcp's stream did not")
  end)
end

-- One request over a relay listener in copy mode (what demesne-init sends where a socket
-- cannot be handed over: the byte 0, then the client's bytes on the same connection).
-- Returns the status and the response text.
local function relay_post(path, token, body)
  local b = json.encode(body)
  local req = "\0POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:3130\r\nAuthorization: Bearer " .. token
    .. "\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
    .. "MCP-Protocol-Version: 2025-06-18\r\nConnection: close\r\nContent-Length: " .. #b .. "\r\n\r\n" .. b
  local got, ev = {}, async.event()
  assert(cstream.connect_unix(path, function(c, msg)
    if not c then ev.set(msg) return end
    c:read_start(function(d) if d then got[#got + 1] = d else c:close() ev.set() end end)
    c:write(req)
  end))
  async.timeout(5000, ev.wait)
  local text = table.concat(got)
  return tonumber(text:match("^HTTP/1.1 (%d+)")), text
end

-- A sandbox's endpoint (a relay listener) keeps its sessions apart from the host's
-- http_max_sessions, within its own endpoint_max_sessions.
function tests.relay_sessions_are_apart_from_the_hosts(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_STATE_DIR = d.path .. "/state", DEMESNE_HTTP_TOKEN = "lua-test-token-0123456789",
    DEMESNE_HTTP_MAX_SESSIONS = "1", DEMESNE_ENDPOINT_MAX_SESSIONS = "2" }, function()
    local h = assert(http.start({ addrs = { "127.0.0.1:0" }, registry = registry() }))
    local _ <close> = setmetatable({}, { __close = function() h.stop(2000) end })
    local sock = d.path .. "/mcp.sock"
    assert(h.listen_relay(sock, { tag = "run:a", token = "run-a-token-0123456789" }))
    local init = { jsonrpc = "2.0", id = 1, method = "initialize",
      params = { protocolVersion = "2025-06-18", capabilities = {}, clientInfo = { name = "lua", version = "1" } } }
    t:eq(post(h.urls[1], "lua-test-token-0123456789", init).status, 200)
    t:eq(post(h.urls[1], "lua-test-token-0123456789", init).status, 503, "the host's table of 1 is full")
    local st, text = relay_post(sock, "run-a-token-0123456789", init)
    t:eq(st, 200, "the sandbox's endpoint opens a session beside the full host table: " .. tostring(text))
    t:match(text, "[Mm]cp%-[Ss]ession%-[Ii]d: %x+")
    t:eq(relay_post(sock, "run-a-token-0123456789", init), 200)
    -- past its own 2, its longest-idle session gives way (nothing in progress)
    t:eq(relay_post(sock, "run-a-token-0123456789", init), 200)
    t:eq(h.sessions(), 3, "1 of the host, 2 of the sandbox")
    t:eq(relay_post(sock, "lua-test-token-0123456789", init), 401, "the host's token does not open it")
  end)
end

return tests
