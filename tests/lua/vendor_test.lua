-- The vendor route (lua/vendor.lua) in process: request parsing, and one route driven over
-- loopback TCP (the relay's handover is replaced by listen_tcp) against a scripted upstream
-- on 127.0.0.1 — token check, path check, credential swap, SSE passed through, usage.json.
local vendor = require("demesne.vendor")
local providers = require("demesne.providers")
local json = require("demesne.json")
local stream = require("core.stream")
local http = require("core.http")
local fs = require("core.fs")
local loop = require("core.loop")
local async = require("demesne.async")

local tests = {}

local request = async.wrap(http.request)

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

function tests.parse_head_reads_request_line_and_headers(t)
  local r = assert(vendor.parse_head("POST /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\nX-Api-Key: abc\r\nContent-Length: 5"))
  t:eq(r.method, "POST")
  t:eq(r.target, "/v1/messages?beta=true")
  t:eq(r.headers["x-api-key"], "abc")
  t:eq(r.headers["content-length"], "5")
  local a = assert(vendor.parse_head("POST http://127.0.0.1:3129/v1/responses HTTP/1.1\r\nHost: x"))
  t:eq(a.target, "/v1/responses", "absolute form keeps the path")
  local bad, status = vendor.parse_head("GARBAGE")
  t:eq(bad, nil)
  t:eq(status, 400)
  local _, s2 = vendor.parse_head("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2")
  t:eq(s2, 400, "conflicting Content-Length")
end

-- A scripted upstream: answers POST with an Anthropic SSE stream, records the x-api-key.
local function upstream(limited)
  local seen = {}
  limited = limited or 0
  local srv = {}
  local function on_client(c)
    local buf = ""
    c:read_start(function(data)
      if not data then c:close() return end
      buf = buf .. data
      local s, e = buf:find("\r\n\r\n", 1, true)
      if not s then return end
      local head = buf:sub(1, s - 1)
      local len = tonumber(head:lower():match("content%-length:%s*(%d+)") or "0")
      if #buf - e < len then return end
      c:read_stop()
      seen[#seen + 1] = { head = head, key = head:lower():match("\nx%-api%-key:%s*([^\r\n]+)") }
      if #seen <= limited then
        local eb = '{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}'
        c:write(("HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
          .. "content-length: %d\r\n\r\n%s"):format(#eb, eb), function() c:close() end)
        return
      end
      local events = {
        'event: message_start\ndata: {"type":"message_start","message":{"id":"m1","model":"claude-sonnet-5",'
          .. '"usage":{"input_tokens":10,"output_tokens":1}}}\n\n',
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":7}}\n\n',
      }
      local body = table.concat(events)
      c:write(("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"):format(#body, body),
        function() c:close() end)
    end)
  end
  srv.listener, srv.port = assert(stream.listen_tcp("127.0.0.1", 0, on_client))
  srv.seen = seen
  return srv
end

function tests.route_checks_token_and_path_swaps_credential_and_counts_usage(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local up = upstream()
  local reg = providers.load({ user_dir = false, quiet = true })
  local p = reg:get("claude_code")
  local old = os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM")
  local cred = setmetatable({ present = true, kind = "api_key", value = function() return "real-secret" end }, {})
  -- the upstream is read from the environment; point the adapter at the loopback server instead
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local route = assert(vendor.start({ run_id = "vt", run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-good", credential = cred }))
  -- stand-in for the relay: a TCP listener whose connections go to the route
  local front, fport = assert(stream.listen_tcp("127.0.0.1", 0, function(c) route:accept(c) end))
  local base = "http://127.0.0.1:" .. fport
  local ok, err = pcall(function()
    if old and old ~= "" then return end
    local chunks = {}
    local res = assert(request({ url = base .. "/v1/messages?beta=true", method = "POST",
      headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" }, body = '{"stream":true}',
      on_data = function(c) chunks[#chunks + 1] = c end }))
    t:eq(res.status, 200)
    t:ok(table.concat(chunks):find("message_delta", 1, true), "the SSE body is passed through")
    t:eq(up.seen[1].key, "real-secret", "the upstream sees the real credential")
    t:ok(up.seen[1].head:find("^POST /v1/messages%?beta=true "), "path and query kept")
    local wrong = assert(request({ url = base .. "/v1/messages", method = "POST", headers = { ["x-api-key"] = "nope" },
      body = "{}" }))
    t:eq(wrong.status, 401)
    local path = assert(request({ url = base .. "/v1/models", headers = { ["x-api-key"] = "dmsn-good" } }))
    t:eq(path.status, 403)
    local head = assert(request({ url = base .. "/", method = "HEAD" }))
    t:eq(head.status, 200, "the warm-up HEAD is answered locally")
    t:eq(#up.seen, 1, "refused requests never reach the upstream")
  end)
  route:stop()
  front:close()
  up.listener:close()
  p.vendor.upstream = saved
  if not ok then fs.remove_tree(dir) error(err, 0) end
  if not (old and old ~= "") then
    local usage = json.decode(assert(fs.read_file(dir .. "/out/usage.json")))
    t:eq(usage.models["claude-sonnet-5"].input, 10)
    t:eq(usage.models["claude-sonnet-5"].output, 7)
    t:ok(math.abs(usage.cost_usd - (10 * 3 + 7 * 15) / 1e6) < 1e-12)
    local lines = assert(fs.read_file(dir .. "/out/usage.jsonl"))
    t:ok(not lines:find("real-secret", 1, true), "usage.jsonl does not hold the credential")
    local n = 0
    for _ in lines:gmatch("[^\n]+") do n = n + 1 end
    t:eq(n, 4, "one line per request")
  end
  fs.remove_tree(dir)
end

function tests.parse_reset_reads_the_vendors_formats(t)
  local now = 1800000000 -- 2027-01-15T08:00:00Z
  t:eq(vendor.parse_reset("2", now), 2)
  t:eq(vendor.parse_reset("2027-01-15T08:00:30Z", now), 30)
  t:eq(vendor.parse_reset("2027-01-15T09:00:30+01:00", now), 30)
  t:eq(vendor.parse_reset("Fri, 15 Jan 2027 08:01:00 GMT", now), 60)
  t:eq(vendor.parse_reset("1m30s", now), 90)
  t:eq(vendor.parse_reset("250ms", now), 0.25)
  t:eq(vendor.parse_reset("soon", now), nil)
  t:eq(vendor.reset_wait({ ["retry-after"] = "5", ["anthropic-ratelimit-requests-reset"] = "2027-01-15T08:01:00Z" }, now), 5)
  t:eq(vendor.reset_wait({ ["anthropic-ratelimit-requests-reset"] = "2027-01-15T08:00:10Z",
    ["anthropic-ratelimit-tokens-reset"] = "2027-01-15T08:00:20Z" }, now), 20)
  t:eq(vendor.reset_wait({ ["x-ratelimit-reset-requests"] = "3s" }, now), 3)
  t:eq(vendor.reset_wait({}, now), nil)
end

-- One route against an upstream that answers the first `limited` POSTs with 429
-- (retry-after: 1). Returns the status the agent saw, usage.jsonl's lines and the route.
local function rate_run(limited, budget)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local up = upstream(limited)
  local reg = providers.load({ user_dir = false, quiet = true })
  local p = reg:get("claude_code")
  local cred = setmetatable({ present = true, kind = "api_key", value = function() return "real-secret" end }, {})
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local route = assert(vendor.start({ run_id = "vr", run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-good", credential = cred, rate_limit_retries = budget }))
  local front, fport = assert(stream.listen_tcp("127.0.0.1", 0, function(c) route:accept(c) end))
  local ok, res = pcall(request, { url = "http://127.0.0.1:" .. fport .. "/v1/messages", method = "POST",
    headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" }, body = '{"stream":true}' })
  route:stop()
  front:close()
  up.listener:close()
  p.vendor.upstream = saved
  local lines = {}
  for l in (fs.read_file(dir .. "/out/usage.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
  local usage = json.decode(fs.read_file(dir .. "/out/usage.json") or "{}")
  fs.remove_tree(dir)
  if not ok then error(res, 0) end
  return res.status, lines, usage, #up.seen
end

function tests.route_waits_out_a_429_and_sends_the_request_again(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  local started = loop.hrtime()
  local status, lines, usage, n = rate_run(1, 3)
  t:eq(status, 200, "the agent sees the answer after the reset")
  t:eq(n, 2, "the upstream was asked twice")
  t:ok((loop.hrtime() - started) / 1e6 >= 1000, "the retry waited for the reset")
  t:eq(lines[1].status, 429)
  t:eq(lines[1].rate_limited, true)
  t:ok(lines[1].retry_in_ms >= 1000)
  t:eq(lines[2].status, 200)
  t:eq(lines[2].retry, true)
  t:eq(usage.rate_limited.answers, 1)
  t:eq(usage.rate_limited.retried, 1)
end

function tests.route_passes_the_429_on_when_the_budget_is_spent(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  local status, lines, usage, n = rate_run(5, 1)
  t:eq(status, 429, "the budget of 1 is spent: the agent gets the 429")
  t:eq(n, 2)
  t:eq(lines[#lines].status, 429)
  t:eq(lines[#lines].rate_limit, "retry budget of 1 exhausted")
  t:eq(usage.rate_limited.why, "retry budget of 1 exhausted")
  t:eq(require("demesne.agent").rate_reason(usage.rate_limited):match("^(.-) %("),
    "rate limited by the vendor; retry budget of 1 exhausted")
end

return tests
