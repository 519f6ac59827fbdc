-- The vendor route (lua/vendor/) in process: one route driven over loopback TCP (the
-- relay's handover is replaced by a TCP listener of its server) against a scripted upstream
-- on 127.0.0.1 — token check, path check, credential swap, SSE passed through, usage.json.
local vendor = require("demesne.vendor")
local providers = require("demesne.providers")
local json = require("demesne.json")
local layer = require("demesne.layer")
local stream = require("core.stream")
local http = require("core.http")
local fs = require("core.fs")
local loop = require("core.loop")
local async = require("demesne.async")
local agent = require("demesne.agent")
local resume = require("demesne.agent.resume")

local tests = {}

local request = async.wrap(http.request)

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- A scripted upstream: answers POST with an Anthropic SSE stream, records the x-api-key;
-- the first `limited` POSTs get a 429 with `retry-after: <retry_after or 1>`.
local function upstream(limited, retry_after)
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
        c:write(("HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: %s\r\n"
          .. "content-length: %d\r\n\r\n%s"):format(retry_after or "1", #eb, eb), function() c:close() end)
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
  -- stand-in for the relay: a TCP listener of the route's own HTTP server
  local fport = assert(route.server:listen_tcp("127.0.0.1", 0, { tag = "test" }))
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
  vendor.forget(route.run_id) -- (the host's copy of its totals, in the state folder)
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

-- One agent sandbox must not make the server hold unbounded connections: past
-- vendor_max_connections a request is answered 503 naming the ceiling (and connections
-- that send nothing are cut by the server a little further on).
function tests.route_refuses_connections_over_its_ceiling(t)
  local config = require("demesne.config")
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  loop.setenv("DEMESNE_VENDOR_MAX_CONNECTIONS", "2")
  config.load()
  local reg = providers.load({ user_dir = false, quiet = true })
  local p = reg:get("claude_code")
  local cred = { present = true, kind = "api_key", value = function() return "real-secret" end }
  local route = assert(vendor.start({ run_id = "vc", run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-good", credential = cred }))
  local fport = assert(route.server:listen_tcp("127.0.0.1", 0, { tag = "test" }))
  local connect = async.wrap(stream.connect_tcp)
  local ok, err = pcall(function()
    -- two idle connections (no request yet) fill the ceiling
    local a = assert(connect("127.0.0.1", fport))
    local b = assert(connect("127.0.0.1", fport))
    for _ = 1, 50 do
      if route.server:connections() == 2 then break end
      async.sleep(10)
    end
    t:eq(route.server:connections(), 2, "two connections held")
    local res = assert(request({ url = ("http://127.0.0.1:%d/v1/messages"):format(fport), method = "POST",
      headers = { ["x-api-key"] = "dmsn-good" }, body = "{}", timeout_ms = 5000 }))
    t:eq(res.status, 503, "the third is refused")
    t:match(res.body, "vendor_max_connections", "the answer names the ceiling")
    a:close()
    b:close()
    for _ = 1, 100 do
      if route.server:connections() <= 1 then break end
      async.sleep(10)
    end
    t:ok(route.server:connections() <= 1, "released (the refused request's connection may stay for its next one)")
    res = assert(request({ url = ("http://127.0.0.1:%d/v1/models"):format(fport), method = "GET",
      headers = { ["x-api-key"] = "dmsn-good" }, timeout_ms = 5000 }))
    t:eq(res.status, 403, "under the ceiling again, requests are served")
  end)
  route:stop()
  vendor.forget(route.run_id) -- (the host's copy of its totals, in the state folder)
  loop.setenv("DEMESNE_VENDOR_MAX_CONNECTIONS", nil)
  config.load()
  local lines = fs.read_file(dir .. "/out/usage.jsonl") or ""
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
  t:match(lines, '"status":503', "usage.jsonl records the refusal")
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
-- (retry-after: 1, or `retry_after`). Returns the status the agent saw, usage.jsonl's lines
-- and the route.
local function rate_run(limited, budget, holds, retry_after)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  local run_id = "vr-" .. hex(loop.random(4)) -- the rate state is saved by run id
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local up = upstream(limited, retry_after)
  local reg = providers.load({ user_dir = false, quiet = true })
  local p = reg:get("claude_code")
  local cred = setmetatable({ present = true, kind = "api_key", value = function() return "real-secret" end }, {})
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local route = assert(vendor.start({ run_id = run_id, run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-good", credential = cred, rate_limit_retries = budget, holds = holds }))
  -- stand-in for the relay: a TCP listener of the route's own HTTP server
  local fport = assert(route.server:listen_tcp("127.0.0.1", 0, { tag = "test" }))
  local ok, res = pcall(request, { url = "http://127.0.0.1:" .. fport .. "/v1/messages", method = "POST", timeout_ms = 20000,
    headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" }, body = '{"stream":true}' })
  route:stop()
  up.listener:close()
  p.vendor.upstream = saved
  local lines = {}
  for l in (fs.read_file(dir .. "/out/usage.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
  local usage = json.decode(fs.read_file(dir .. "/out/usage.json") or "{}")
  fs.remove_tree(dir)
  vendor.forget(run_id)
  if not ok then error(res, 0) end
  return res.status, lines, usage, #up.seen, res, route
end

-- The tree's budget (lua/tree) through the route's hooks: each counted request is charged
-- with its cost and usage; once admit says no, a model request is answered 400 in both
-- vendors' error shape (neither CLI retries it) and never reaches the upstream.
function tests.route_charges_each_request_and_refuses_once_the_budget_is_spent(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local up = upstream()
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local cred = setmetatable({ present = true, kind = "api_key", value = function() return "real-secret" end }, {})
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local charged, spent = {}, nil
  local admit = function(run_id)
    if spent then return nil, spent end
    return run_id == "vb" or nil, "not this run"
  end
  local released = 0
  local charge = function(run_id, usd, usage)
    if usage == nil then released = released + 1 return end -- a reservation given back
    charged[#charged + 1] = { run_id = run_id, usd = usd, usage = usage }
  end
  layer.install({ name = "vendor_test budget", vendor_admit = admit, vendor_charge = charge })
  local route = assert(vendor.start({ run_id = "vb", run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-good", credential = cred }))
  -- stand-in for the relay: a TCP listener of the route's own HTTP server
  local fport = assert(route.server:listen_tcp("127.0.0.1", 0, { tag = "test" }))
  local function post()
    local chunks = {}
    local res = assert(request({ url = "http://127.0.0.1:" .. fport .. "/v1/messages?beta=true", method = "POST",
      headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" }, body = '{"stream":true}',
      on_data = function(c) chunks[#chunks + 1] = c end }))
    return res.status, table.concat(chunks)
  end
  local ok, err = pcall(function()
    t:eq((post()), 200)
    t:eq(#charged, 1, "the counted request was charged")
    t:eq(charged[1].run_id, "vb")
    t:ok(math.abs(charged[1].usd - (10 * 3 + 7 * 15) / 1e6) < 1e-15, "with its cost")
    t:eq({ charged[1].usage.model, charged[1].usage.input, charged[1].usage.output }, { "claude-sonnet-5", 10, 7 })
    spent = "budget of $0.0001 spent"
    local status, body = post()
    t:eq(status, 400, "refused with a status neither CLI retries")
    t:eq(json.decode(body), { type = "error", error = { type = "invalid_request_error", code = "budget_exceeded",
      message = "demesne vendor route: budget of $0.0001 spent; no further model requests are sent for this tree" } })
    t:eq(#up.seen, 1, "the refused request never reached the upstream")
    t:eq(#charged, 1, "nothing charged for it")
    t:eq(released, 1, "its reservation was given back")
  end)
  route:stop()
  vendor.forget(route.run_id) -- (the host's copy of its totals, in the state folder)
  up.listener:close()
  p.vendor.upstream = saved
  layer.uninstall("vendor_test budget")
  local lines = {}
  for l in (fs.read_file(dir .. "/out/usage.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
  t:eq({ lines[2].verdict, lines[2].status, lines[2].reason }, { "deny", 400, "budget of $0.0001 spent" },
    "usage.jsonl says why")
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
  local status, lines, usage, n, res = rate_run(5, 1)
  t:eq(res.headers["x-should-retry"], "false", "the run cannot wait: the CLI must not retry into the limit")
  t:eq(res.headers["retry-after"], nil)
  t:eq(status, 429, "the budget of 1 is spent: the agent gets the 429")
  t:eq(n, 2)
  t:eq(lines[#lines].status, 429)
  t:eq(lines[#lines].rate_limit, "retry budget of 1 exhausted")
  t:eq(usage.rate_limited.why, "retry budget of 1 exhausted")
  t:eq(agent.rate_reason(usage.rate_limited):match("^(.-) %("),
    "rate limited by the vendor; retry budget of 1 exhausted")
end

-- Found by tests/fuzz/vendor_usage (corpus file regression-endless-reset): a reset of
-- 1e300 s, or 400 digits read as infinity, reached ("reset in %d s"):format(math.ceil(w)),
-- which raises for a number with no integer form: the 429 answer died in the route's
-- callback and the agent's request was never answered. Waits are now at most 2^31 s.
function tests.reset_too_far_away_is_passed_on(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  for _, ra in ipairs({ "1" .. ("0"):rep(300), ("9"):rep(400) }) do
    local status, lines, _, n, res = rate_run(1, 3, nil, ra)
    t:eq(status, 429, "the agent gets the 429")
    t:eq(n, 1, "not sent again")
    t:eq(res.headers["x-should-retry"], "false")
    t:match(lines[1].rate_limit, "^reset in 2147483648 s is beyond the longest wait")
  end
  local now = 1800000000
  t:eq(vendor.reset_wait({ ["x-ratelimit-reset-requests"] = ("9"):rep(400) .. "h" }, now), 2 ^ 31)
  t:eq(vendor.body_reset('{"error":{"resets_in_seconds":1e400}}', now), 2 ^ 31)
  t:eq(vendor.body_reset('{"resets_at":1e308}', now), 2 ^ 31)
end

function tests.body_reset_reads_a_usage_limit_body(t)
  local now = 1800000000
  t:eq(vendor.body_reset('{"error":{"type":"usage_limit_reached","plan_type":"plus","resets_at":1800000090}}', now), 90)
  t:eq(vendor.body_reset('{"error":{"type":"usage_limit_reached","resets_in_seconds":120}}', now), 120)
  t:eq(vendor.body_reset('{"error":{"resets_at":"2027-01-15T08:00:30Z"}}', now), 30)
  t:eq(vendor.body_reset('{"resets_in_seconds":5}', now), 5)
  t:eq(vendor.body_reset('{"error":{"type":"rate_limit_error","message":"slow down"}}', now), nil)
  t:eq(vendor.body_reset("not json", now), nil)
  t:eq(vendor.body_reset(nil, now), nil)
end

function tests.route_passes_a_long_429_on_for_a_session_resume(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  -- holds = false: every reset is "longer than a request is held"
  local status, lines, usage, n, res, route = rate_run(1, 3, false)
  t:eq(status, 429, "the agent gets the 429 at once")
  t:eq(n, 1, "the route did not send the request again")
  t:eq(res.headers["x-should-retry"], "false", "the CLI is told not to retry by itself")
  t:eq(res.headers["retry-after"], nil)
  t:ok(res.body:find("rate_limit_error", 1, true), "the vendor's body is passed on")
  t:eq(lines[1].resume, true)
  t:eq(usage.rate_limited.answers, 1)
  t:eq(usage.rate_limited.retried, 0, "nothing spent until a resume is granted")
  t:eq(usage.rate_limited.why, nil, "not a reason to end the run")
  t:ok(type(route.rate.passed_at) == "number")
  t:ok(type(route.rate.reset_at) == "number")
end

-- A route stand-in for resume.decide: the rate state and a save that counts.
local function fake_route(rate, deadline)
  local r = { rate = rate, deadline = deadline, saves = 0 }
  function r.save_rate(self) self.saves = self.saves + 1 end
  return r
end

local function with_transcript(name, fn)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-decide-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir, 493))
  local src = os.getenv("DEMESNE_SOURCE_DIR") or "."
  local text = name and assert(fs.read_file(src .. "/tests/fixtures/providers/" .. name)) or ""
  assert(fs.write_atomic(dir .. "/transcript.jsonl", text))
  local ok, err = pcall(fn, dir)
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

function tests.decide_resumes_a_rate_limited_session_once_per_attempt(t)
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  with_transcript("claude_code_transcript_429.jsonl", function(dir)
    local now = loop.time()
    local route = fake_route({ budget = 2, used = 0, limited = 3, reset_at = now + 5, passed_at = now }, now + 600)
    local d = resume.decide(p, dir, route, { attempt = 1, exit_code = 1 })
    t:eq(d.action, "resume")
    t:eq(d.session, "77e1c0aa-2f44-4d0b-8c1e-6a1b2c3d4e5f")
    t:ok(d.at >= now + 5 and d.at <= now + 7, "after the reset")
    t:eq(route.rate.used, 1)
    t:eq(route.rate.resumed, 1)
    local again = resume.decide(p, dir, route, { attempt = 1, exit_code = 1 })
    t:eq(again.session, d.session, "asked again (a restarted server): the same answer")
    t:eq(route.rate.used, 1, "and the budget is drawn on once")
    -- attempt 2 ends rate limited again: the budget of 2 allows one more
    route.rate.passed_at = loop.time() + 10
    t:eq(resume.decide(p, dir, route, { attempt = 2, exit_code = 1 }).action, "resume")
    route.rate.passed_at = loop.time() + 20
    local spent = resume.decide(p, dir, route, { attempt = 3, exit_code = 1 })
    t:eq(spent.action, "stop")
    t:eq(spent.why, "retry budget of 2 exhausted")
    t:eq(route.rate.why, "retry budget of 2 exhausted", "the run's reason")
  end)
end

-- Found by tests/fuzz/agent_transcript (corpus file regression-far-reset): a transcript's
-- rate_limit_event with resetsAt 1e300 reached os.date(math.floor(x)) in agent.finish, which
-- raises for a number with no integer form: the run's result and results.json were lost.
-- A reset time is now used only from 0 to 2^33 s.
function tests.far_reset_in_a_transcript_is_ignored(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-far-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/out", 493))
  assert(fs.mkdir_p(dir .. "/run", 493))
  local ok, err = pcall(function()
    local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
    for _, at in ipairs({ "1e300", "1e400", "-5", "8589934592" }) do
      assert(fs.write_atomic(dir .. "/out/transcript.jsonl",
        '{"type":"system","subtype":"init","session_id":"s-1"}\n'
        .. '{"type":"rate_limit_event","rate_limit_info":{"status":"rejected","resetsAt":' .. at .. '},"session_id":"s-1"}\n'))
      local r = agent.finish({ provider = p, model = "claude-sonnet-5", output_dir = dir .. "/out", run_dir = dir .. "/run",
        exec_id = "e1", run_id = "far-" .. hex(loop.random(4)) }, 1, nil, 10)
      t:eq(r.reason, "rate limited by the vendor; the CLI gave up", "no reset time shown for " .. at)
      t:ok(json.decode(assert(fs.read_file(dir .. "/out/results.json"))), "results.json written for " .. at)
      local route = { rate = { budget = 3, used = 0, limited = 1, passed_at = 1, attempt_started = 0 },
        save_rate = function() end }
      t:eq(resume.decide(p, dir .. "/out", route, { attempt = 1, exit_code = 1 }).why, "no reset time in the answer")
    end
  end)
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

function tests.decide_stops_when_a_resume_cannot_help(t)
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  with_transcript("claude_code_transcript_429.jsonl", function(dir)
    local now = loop.time()
    local ok0 = fake_route({ budget = 3, used = 0, limited = 1, reset_at = now + 5, passed_at = now }, now + 600)
    t:eq(resume.decide(p, dir, ok0, { attempt = 1, exit_code = 0 }).action, "stop", "a clean exit is final")
    local late = fake_route({ budget = 3, used = 0, limited = 1, reset_at = now + 500, passed_at = now }, now + 300)
    local d = resume.decide(p, dir, late, { attempt = 1, exit_code = 1 })
    t:eq(d.action, "stop")
    t:eq(d.why, "reset is after the run's timeout")
    local unknown = fake_route({ budget = 3, used = 0, limited = 1, passed_at = now }, now + 600)
    t:eq(resume.decide(p, dir, unknown, { attempt = 1, exit_code = 1 }).why, "no reset time in the answer")
  end)
  with_transcript("claude_code_transcript.jsonl", function(dir)
    local now = loop.time()
    local other = fake_route({ budget = 3, used = 0, limited = 0 }, now + 600)
    local d = resume.decide(p, dir, other, { attempt = 1, exit_code = 1 })
    t:eq(d.action, "stop", "a failure that is not a rate limit is final")
    t:eq(d.why, nil)
  end)
  with_transcript(nil, function(dir)
    local now = loop.time()
    local nosession = fake_route({ budget = 3, used = 0, limited = 1, reset_at = now + 5, passed_at = now }, now + 600)
    t:eq(resume.decide(p, dir, nosession, { attempt = 1, exit_code = 1 }).why, "the CLI named no session to resume")
  end)
end

function tests.wrapper_quotes_the_cli_and_resumes_the_session(t)
  local p = { name = "echoer", argv = function(run)
    return { "printf", "%s|%s|%s\\n", "it's \"quoted\" $HOME", run.resume_session or "fresh", run.resume_prompt or "-" }
  end }
  local script = resume.wrapper(p, { model = "m" })
  t:ok(script:find([['printf' '%s|%s|%s\n' 'it'\''s "quoted" $HOME' 'fresh' '-']], 1, true), script)
  t:ok(script:find([['printf' '%s|%s|%s\n' 'it'\''s "quoted" $HOME' "$session" ']], 1, true), script)
  local _, resumable = resume.wrapper(p, { model = "m" })
  t:eq(resumable, true)
  local fresh_only = { name = "fresh_only", argv = function() return { "cli", "go" } end }
  local s2, r2 = resume.wrapper(fresh_only, {})
  t:eq(r2, false, "an argv that ignores resume_session cannot resume")
  t:ok(s2:find('exit "$code" # this provider does not resume sessions', 1, true), s2)
  with_transcript("claude_code_transcript_429.jsonl", function(dir)
    local now = loop.time()
    local route = fake_route({ budget = 3, used = 0, limited = 1, reset_at = now + 5, passed_at = now }, now + 600)
    local d = resume.decide(fresh_only, dir, route, { attempt = 1, exit_code = 1 }, false)
    t:eq(d.why, "provider fresh_only does not resume sessions")
    t:eq(route.rate.used, 0)
  end)
  local bad = { name = "bad", argv = function(run) return { "x", "--resume=" .. (run.resume_session or "") } end }
  local ok, err = pcall(resume.wrapper, bad, {})
  t:eq(ok, false)
  t:ok(tostring(err):find("an argument of its own", 1, true))
end

-- A route on loopback with no upstream call expected; returns route, base URL, closer.
local function bare_route(run_id, extra)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local cred = setmetatable({ present = true, kind = "api_key", value = function() return "real-secret" end }, {})
  local o = { run_id = run_id, run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p, token = "dmsn-good",
    credential = cred }
  for k, v in pairs(extra or {}) do o[k] = v end
  local route = assert(vendor.start(o))
  -- stand-in for the relay: a TCP listener of the route's own HTTP server
  local fport = assert(route.server:listen_tcp("127.0.0.1", 0, { tag = "test" }))
  return route, "http://127.0.0.1:" .. fport, function()
    route:stop()
    fs.remove_tree(dir)
    vendor.forget(run_id)
  end, dir, p
end

function tests.attempt_endpoint_checks_its_caller_and_body(t)
  local run_id = "va-" .. hex(loop.random(4))
  local _, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    local function post(body, auth)
      return assert(request({ url = base .. vendor.ATTEMPT_PATH, method = "POST", body = body,
        headers = { authorization = auth or "Bearer dmsn-good", ["content-type"] = "application/json" } }))
    end
    t:eq(post('{"attempt":1,"exit_code":1}', "Bearer wrong").status, 401)
    t:eq(post('{"attempt":"1","exit_code":"1"}').status, 400, "strings are not numbers")
    t:eq(post('{"attempt":1001,"exit_code":1}').status, 400, "attempt numbers are bounded")
    t:eq(post('{"attempt":1.5,"exit_code":1}').status, 400)
    local r = post('{"attempt":1,"exit_code":0}')
    t:eq(r.status, 200)
    t:eq(r.body, "stop\n", "no decider: stop")
  end)
  close()
  if not ok then error(err, 0) end
end

-- Sends raw bytes to the route in the given pieces (each written after the one before has
-- gone out and the loop has turned, so the route mostly reads them apart) and returns what
-- it answers up to EOF, or "" when it answers nothing within `wait_ms`.
local function raw_exchange(base, pieces, wait_ms)
  local port = tonumber(base:match(":(%d+)$"))
  local conn = async.await(function(cb) assert(stream.connect_tcp("127.0.0.1", port, cb)) end)
  assert(conn, "connect to the route")
  local got, done = {}, async.event()
  conn:read_start(function(data)
    if data then got[#got + 1] = data else done.set() end
  end)
  for _, p in ipairs(pieces) do
    async.await(function(cb) conn:write(p, cb) end)
    async.sleep(1)
  end
  async.timeout(wait_ms or 2000, done.wait)
  conn:close()
  return table.concat(got)
end

local ATTEMPT_JSON = '{"attempt":1,"exit_code":0}'
local ATTEMPT_HEX = ("%x"):format(#ATTEMPT_JSON)
local function attempt_head(extra)
  return "POST " .. vendor.ATTEMPT_PATH .. " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer dmsn-good\r\n" .. (extra or "")
end

-- The route read a request head by searching all it held after every read, and a chunked
-- body by copying what was left after every chunk: a sandbox that sent its head a byte per
-- read, or a body of tiny or huge chunks, held the host's loop for seconds to minutes
-- (a 64 KiB head a byte per read: 47 s; a 16 MiB chunk in 64 KiB reads: 1.7 s, growing with
-- the square). Both are now searched and taken in linear time; these check the answers.
function tests.request_head_and_chunked_body_read_in_any_pieces(t)
  local run_id = "vp-" .. hex(loop.random(4))
  local _, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    -- the head's blank line split over reads, then a body of one-byte chunks in odd reads
    local chunks = {}
    for i = 1, #ATTEMPT_JSON do chunks[#chunks + 1] = "1\r\n" .. ATTEMPT_JSON:sub(i, i) .. "\r\n" end
    local body = table.concat(chunks) .. "0\r\nX-Trailer: t\r\n\r\n"
    local head = attempt_head("Transfer-Encoding: chunked\r\n\r\n")
    local pieces = { head:sub(1, -4), head:sub(-3, -2), head:sub(-1) }
    for i = 1, #body, 7 do pieces[#pieces + 1] = body:sub(i, i + 6) end
    local answer = raw_exchange(base, pieces)
    t:match(answer, "^HTTP/1.1 200 ", "answered")
    t:match(answer, "\r\n\r\nstop\n$", "the body was read whole")
    -- a head trickled a byte per read
    local trickle = {}
    local whole = attempt_head(("Content-Length: %d\r\n\r\n"):format(#ATTEMPT_JSON)) .. ATTEMPT_JSON
    for i = 1, #whole do trickle[i] = whole:sub(i, i) end
    t:match(raw_exchange(base, trickle), "\r\n\r\nstop\n$", "a trickled request")
  end)
  close()
  if not ok then error(err, 0) end
end

-- What the route's HTTP server (llhttp) refuses never reaches the route; what it passes
-- on is the request as sent, an absolute-form target (a client that used the proxy
-- variables) included.
function tests.requests_the_server_refuses_and_absolute_form_targets(t)
  local run_id = "vf-" .. hex(loop.random(4))
  local _, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    local answer = raw_exchange(base, { "GARBAGE\r\n\r\n" })
    t:match(answer, "^HTTP/1%.1 400 ", "a malformed request")
    t:match(answer, '"message":"demesne vendor route: ', "in the vendors' error shape")
    answer = raw_exchange(base, { "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
      .. "Content-Length: 2\r\n\r\nab" })
    t:match(answer, "^HTTP/1%.1 400 ", "conflicting Content-Length")
    answer = raw_exchange(base, { "POST http://127.0.0.1:3129" .. vendor.ATTEMPT_PATH .. " HTTP/1.1\r\nHost: x\r\n"
      .. "Authorization: Bearer dmsn-good\r\nContent-Length: 27\r\nConnection: close\r\n\r\n"
      .. '{"attempt":1,"exit_code":0}' })
    t:match(answer, "^HTTP/1%.1 200 OK\r\n.*\r\n\r\nstop\n$", "the absolute-form target keeps its path")
  end)
  close()
  if not ok then error(err, 0) end
end

-- A route that stops while it holds an answer (here a session resume the wrapper waits
-- for) closes the connection unanswered, and leaves no task, timer or handle behind (the
-- test runner counts them).
function tests.a_route_stopped_during_a_wait_closes_the_connection_and_leaks_nothing(t)
  local run_id = "vs-" .. hex(loop.random(4))
  local route, base, close = bare_route(run_id, { decide = function()
    return { action = "resume", session = "s-1", at = loop.time() + 30 }
  end })
  local asked = async.spawn("wrapper", function()
    return request({ url = base .. vendor.ATTEMPT_PATH, method = "POST", body = '{"attempt":1,"exit_code":1}',
      headers = { authorization = "Bearer dmsn-good" }, timeout_ms = 10000 })
  end)
  async.sleep(200)
  t:eq(asked.done, false, "the answer waits for the reset")
  t:eq(next(route.tasks) ~= nil, true, "the connection's task is waiting")
  local started = loop.hrtime()
  close()
  local _, res, msg = asked:wait()
  t:eq(res, nil, "no answer")
  t:ok(msg, "the agent sees the connection end")
  t:ok((loop.hrtime() - started) / 1e6 < 2000, "at once, not after the reset")
  t:eq(next(route.tasks), nil, "no task left")
  t:eq(route.server, nil, "the server is closed, with its connections")
end

-- Deciding reads the transcript: each attempt is decided once and in order, and nothing
-- after a stop, however often a sandbox reports.
function tests.attempts_are_decided_once_in_order_and_not_after_a_stop(t)
  local run_id = "vo-" .. hex(loop.random(4))
  local decided = {}
  local route, base, close = bare_route(run_id, { decide = function(_, info)
    decided[#decided + 1] = info.attempt
    if info.attempt == 1 then return { action = "resume", session = "s1", at = loop.time() } end
    return { action = "stop" }
  end })
  local ok, err = pcall(function()
    local function post(n)
      return assert(request({ url = base .. vendor.ATTEMPT_PATH, method = "POST",
        body = ('{"attempt":%d,"exit_code":1}'):format(n),
        headers = { authorization = "Bearer dmsn-good", ["content-type"] = "application/json" } }))
    end
    t:eq(post(3).status, 409, "attempt 3 before attempt 1")
    t:eq(post(1).body, "resume s1\n")
    t:eq(post(1).body, "resume s1\n", "asked again: the same answer")
    t:eq(post(2).body, "stop\n")
    for n = 2, 6 do t:eq(post(n).body, "stop\n", "after a stop: " .. n) end
    t:eq(decided, { 1, 2 }, "two decisions for eight reports")
    t:eq(route:rate_state().last_attempt, 2)
    t:eq(route:rate_state().stopped, true)
  end)
  close()
  if not ok then error(err, 0) end
end

-- Request bodies a route holds at once are bounded (vendor_max_buffered_bytes); one over it
-- is answered 503 naming the setting, before its body is read.
function tests.route_refuses_bodies_over_its_buffer_ceiling(t)
  local config = require("demesne.config")
  loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES", "100000")
  config.load()
  local run_id = "vb-" .. hex(loop.random(4))
  local route, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    local res = assert(request({ url = base .. "/v1/messages", method = "POST", headers = { ["x-api-key"] = "dmsn-good" },
      body = ("x"):rep(200000), timeout_ms = 5000 }))
    t:eq(res.status, 503)
    t:match(res.body, "vendor_max_buffered_bytes")
    t:eq(route.buffered, 0, "nothing stays charged")
    t:eq(vendor.buffered(), 0)
    -- a request the route refuses for its token is refused before its body
    local bad = assert(request({ url = base .. "/v1/messages", method = "POST", headers = { ["x-api-key"] = "wrong" },
      body = ("x"):rep(200000), timeout_ms = 5000 }))
    t:eq(bad.status, 401)
  end)
  close()
  loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES", nil)
  config.load()
  if not ok then error(err, 0) end
end

-- A request is judged from its head before its body is read: a wrong token with 50 MiB
-- announced, or a body over vendor_max_buffered_bytes, is answered with only the head sent
-- (the route never waits for, or holds, the body); the refusals are in usage.jsonl.
function tests.refusals_come_before_the_body_is_sent(t)
  local config = require("demesne.config")
  loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES", "100000")
  config.load()
  local run_id = "vh-" .. hex(loop.random(4))
  local route, base, close, dir = bare_route(run_id)
  local ok, err = pcall(function()
    local head = "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    local answer = raw_exchange(base, { head .. "x-api-key: wrong\r\nContent-Length: 52428800\r\n\r\n" }, 5000)
    t:match(answer, "^HTTP/1.1 401 ", "a wrong token is refused at its head")
    t:match(answer, "Connection: close")
    t:eq(vendor.buffered(), 0, "nothing was charged for it")
    answer = raw_exchange(base, { head .. "x-api-key: dmsn-good\r\nContent-Length: 200000\r\n\r\n" }, 5000)
    t:match(answer, "^HTTP/1.1 503 ", "a body over the route's ceiling is refused at its head")
    t:match(answer, "vendor_max_buffered_bytes")
    answer = raw_exchange(base, { "POST " .. vendor.ATTEMPT_PATH .. " HTTP/1.1\r\nHost: x\r\n"
      .. "Authorization: Bearer wrong\r\nContent-Length: 52428800\r\n\r\n" }, 5000)
    t:match(answer, "^HTTP/1.1 401 ", "the attempt endpoint too")
    -- a chunked body past the route's ceiling: the server stops reading it (503 naming it)
    answer = raw_exchange(base, { head .. "x-api-key: dmsn-good\r\nTransfer-Encoding: chunked\r\n\r\n",
      ("%x\r\n"):format(150000) .. ("x"):rep(150000) .. "\r\n0\r\n\r\n" }, 5000)
    t:match(answer, "^HTTP/1.1 503 ", "a chunked body over the ceiling")
    t:match(answer, "vendor_max_buffered_bytes ")
    -- the bytes being read on every route together are bounded by the total
    loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES_TOTAL", "50000")
    config.load()
    local route2, base2, close2 = bare_route(run_id .. "-2")
    local _c2 <close> = setmetatable({}, { __close = close2 })
    answer = raw_exchange(base2, { head .. "x-api-key: dmsn-good\r\nTransfer-Encoding: chunked\r\n\r\n",
      ("%x\r\n"):format(80000) .. ("x"):rep(80000) .. "\r\n0\r\n\r\n" }, 5000)
    t:match(answer, "^HTTP/1.1 503 ", "a chunked body over the total")
    t:match(answer, "vendor_max_buffered_bytes_total")
    t:eq(route2.buffered, 0)
    t:eq(route.buffered, 0, "nothing stays charged")
    t:eq(vendor.buffered(), 0)
  end)
  local lines = fs.read_file(dir .. "/out/usage.jsonl") or ""
  close()
  loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES", nil)
  loop.setenv("DEMESNE_VENDOR_MAX_BUFFERED_BYTES_TOTAL", nil)
  config.load()
  if not ok then error(err, 0) end
  local recs = {}
  for line in lines:gmatch("[^\n]+") do recs[#recs + 1] = json.decode(line) end
  t:eq(#recs, 3, "one line per refusal the route made")
  t:eq(recs[1].status, 401)
  t:eq(recs[1].verdict, "deny")
  t:eq(recs[2].status, 503)
  t:match(recs[2].reason, "vendor_max_buffered_bytes")
  t:eq(recs[3].status, 401)
  t:eq(recs[3].path, vendor.ATTEMPT_PATH)
end

function tests.a_restarted_route_keeps_a_hold_in_progress(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  local run_id = "vh-" .. hex(loop.random(4))
  -- the previous server held a request until 1.5 s from now
  local state = require("demesne.config").get("state_dir") .. "/vendor"
  assert(fs.mkdir_p(state, 448))
  assert(fs.write_atomic(state .. "/" .. run_id .. ".json",
    json.encode({ used = 1, held = 1, limited = 1, holding_until = loop.time() + 1.5 })))
  local up = upstream(0)
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local route, base, close, dir = bare_route(run_id, { provider = p })
  local started = loop.hrtime()
  local ok, res = pcall(request, { url = base .. "/v1/messages", method = "POST",
    headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" }, body = '{"stream":true}' })
  local waited = (loop.hrtime() - started) / 1e6
  local used = route.rate.used
  local lines = {}
  for l in (fs.read_file(dir .. "/out/usage.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
  close()
  up.listener:close()
  p.vendor.upstream = saved
  if not ok then error(res, 0) end
  t:eq(res.status, 200)
  t:ok(waited >= 1200, ("the request waited for the reset (%.0f ms)"):format(waited))
  t:eq(#up.seen, 1)
  t:eq(used, 1, "the same hold: the budget is not drawn on again")
  t:ok(lines[1].held_ms >= 1000, json.encode(lines[1]))
end

-- The hand parser this route had (before core.httpd) read a chunk size of 17 hex digits
-- wrapping around in tonumber ("1000000000000001b" as a 27-byte chunk), held a trailer line
-- that never ended until the 60 s deadline, and skipped the two bytes after a chunk's data
-- whatever they were. llhttp refuses all three; these keep it so.
function tests.chunk_size_that_wraps_around_is_refused(t)
  local run_id = "vw-" .. hex(loop.random(4))
  local _, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    local answer = raw_exchange(base, { attempt_head("Transfer-Encoding: chunked\r\n\r\n"),
      "100000000000000" .. ATTEMPT_HEX .. "\r\n" .. ATTEMPT_JSON .. "\r\n0\r\n\r\n" })
    t:match(answer, "^HTTP/1.1 4%d%d ", "refused")
    t:eq(answer:find("\r\n\r\nstop\n$"), nil, "not read as a request")
  end)
  close()
  if not ok then error(err, 0) end
end

function tests.endless_trailer_and_bad_chunk_framing_are_refused(t)
  local run_id = "vt-" .. hex(loop.random(4))
  local _, base, close = bare_route(run_id)
  local ok, err = pcall(function()
    local started = loop.hrtime()
    local answer = raw_exchange(base, { attempt_head("Transfer-Encoding: chunked\r\n\r\n"), "0\r\nX-T: ",
      ("a"):rep(70000) })
    t:match(answer, "^HTTP/1.1 431 ", "a trailer over 64 KiB is refused")
    t:ok((loop.hrtime() - started) / 1e6 < 1500, "at once, not at the deadline")
    answer = raw_exchange(base, { attempt_head("Transfer-Encoding: chunked\r\n\r\n"),
      ATTEMPT_HEX .. "\r\n" .. ATTEMPT_JSON .. "XY0\r\n\r\n" })
    t:match(answer, "^HTTP/1.1 400 ", "chunk data not followed by CRLF")
    t:match(answer, "not followed by CRLF", "names the reason")
    answer = raw_exchange(base, { attempt_head("Transfer-Encoding: chunked\r\n\r\n"),
      ATTEMPT_HEX .. "\r\n" .. ATTEMPT_JSON, "\r", "Y0\r\n\r\n" })
    t:match(answer, "^HTTP/1.1 400 ", "the same, the CRLF split over reads")
  end)
  close()
  if not ok then error(err, 0) end
end

-- A route started again for a run (a background job re-attached after a restart) takes up
-- the totals the host saved, never usage.json in /out, which the sandbox can rewrite.
function tests.a_restarted_route_takes_up_the_hosts_totals_not_the_sandboxs(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vendor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run", 493))
  assert(fs.mkdir_p(dir .. "/out", 493))
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local cred = { present = true, kind = "api_key", value = function() return "x" end }
  local o = { run_id = "vh-" .. hex(loop.random(4)), run_dir = dir .. "/run", output_dir = dir .. "/out", provider = p,
    token = "dmsn-x", credential = cred }
  local first = assert(vendor.start(o))
  first:count({ model = "claude-sonnet-5", input = 100, output = 10 })
  first:stop()
  assert(fs.write_atomic(dir .. "/out/usage.json", json.encode({ cost_usd = 999, input = 7,
    models = { forged = { requests = 9, input = 7, cost_usd = 999 } } })))
  local again = assert(vendor.start(o))
  local tot = again:totals()
  again:stop()
  vendor.forget(o.run_id)
  fs.remove_tree(dir)
  t:eq(tot.models.forged, nil, "the sandbox's usage.json is not read")
  t:eq({ tot.input, tot.output, tot.models["claude-sonnet-5"].input }, { 100, 10, 100 }, "the host's totals")
  t:ok(tot.cost_usd < 999)
end

--------------------------------------------------------------------------------------------
-- The tree's budget as a reservation (lua/tree/store.lua through the layer hooks vendor_admit/vendor_charge)

-- claude-sonnet-5: input 3, cache_creation 3.75, output 15 USD per million tokens.
local function close_to(t, got, want, what)
  t:ok(type(got) == "number" and math.abs(got - want) < 1e-12, ("%s: expected %.10f, got %s"):format(what, want,
    tostring(got)))
end

function tests.a_reservation_covers_the_body_as_input_and_max_tokens_as_output(t)
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local body = json.encode({ model = "claude-sonnet-5", max_tokens = 16000, stream = true,
    messages = { { role = "user", content = "hello" } } })
  local e = providers.reservation(p, body)
  t:eq({ e.model, e.input, e.output }, { "claude-sonnet-5", #body, 16000 })
  close_to(t, e.usd, (#body * 3.75 + 16000 * 15) / 1e6, "the body's bytes at the dearest input rate (a cache write)")
  -- the largest of the fields that limit an answer counts; none: the provider's longest answer; more: capped
  e = providers.reservation(p, json.encode({ model = "claude-sonnet-5", max_tokens = 10, max_output_tokens = 900 }))
  t:eq(e.output, 900)
  e = providers.reservation(p, '{"model":"claude-sonnet-5","messages":[{"role":"user","content":[{"max_tokens":1}]}]}')
  t:eq(e.output, providers.MAX_OUTPUT_TOKENS, "only the body's own max_tokens counts, not one nested in a message")
  t:eq(providers.reservation(p, json.encode({ model = "claude-sonnet-5", max_tokens = 1e12 })).output,
    providers.MAX_OUTPUT_TOKENS)
  -- no model, or one without a price: the dearest model of the table, as the vendor charges it all the same
  close_to(t, providers.reservation(p, "not json").usd, (8 * 12.5 + providers.MAX_OUTPUT_TOKENS * 50) / 1e6,
    "no model: the dearest price")
  close_to(t, providers.reservation(p, json.encode({ model = "claude-unlisted-9", max_tokens = 100 })).usd,
    (#json.encode({ model = "claude-unlisted-9", max_tokens = 100 }) * 12.5 + 100 * 50) / 1e6, "an unpriced model too")
  -- a body too large to decode: the dearest model of the table (claude-fable-5: 12.50 a cache write, 50 output)
  local big = '{"model":"claude-haiku-4-5","max_tokens":10,"x":"' .. ("y"):rep(providers.RESERVATION_DECODE_MAX) .. '"}'
  e = providers.reservation(p, big)
  t:eq({ e.model, e.output }, { nil, providers.MAX_OUTPUT_TOKENS }, "not read")
  close_to(t, e.usd, (#big * 12.5 + providers.MAX_OUTPUT_TOKENS * 50) / 1e6, "the dearest price")
  local codex = providers.load({ user_dir = false, quiet = true }):get("codex")
  e = providers.reservation(codex, json.encode({ model = "gpt-5.6-sol", input = "x" }))
  t:eq(e.output, providers.MAX_OUTPUT_TOKENS, "the Responses API's max_output_tokens is optional")
  close_to(t, e.usd, (e.input * 5 + providers.MAX_OUTPUT_TOKENS * 30) / 1e6, "Codex")
  -- once message_start gives the input counts: those, and the output still to come
  local u, usd = providers.reserved_usage(p, { model = "claude-sonnet-5", input = 5000, output = 16000, usd = 1 },
    { model = "claude-sonnet-5-20260101", input = 500, cache_read = 2000, cache_creation = 0, output = 1 })
  t:eq({ u.model, u.input, u.cache_read, u.output }, { "claude-sonnet-5-20260101", 500, 2000, 16000 })
  close_to(t, usd, (500 * 3 + 2000 * 0.30 + 16000 * 15) / 1e6, "input known, output reserved")
  u, usd = providers.reserved_usage(p, { model = "claude-sonnet-5", input = 5000, output = 16000, usd = 0.5 }, nil)
  t:eq({ u.input, u.output, usd }, { 5000, 16000, 0.5 }, "nothing known: the whole reservation")
end

-- A scratch state folder with one tree root (budget in USD) in demesne.tree.store, and its
-- check/charge as the route's hooks (they are while the tree layer is installed:
-- compose.install). Closing restores.
local function budget_world(budget)
  local config = require("demesne.config")
  local store = require("demesne.tree.store")
  local d = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-vbudget-" .. hex(loop.random(6))
  assert(fs.mkdir_p(d .. "/state", 448))
  local saved = os.getenv("DEMESNE_STATE_DIR")
  loop.setenv("DEMESNE_STATE_DIR", d .. "/state")
  config.load()
  store.reset()
  local root_id = "20260101T000000Z-" .. hex(loop.random(4))
  local n = { run_id = root_id, root = root_id, depth = 0, kind = "agent", tool = "sandbox_agent", status = "running",
    active = true, children = json.array(), inputs = json.array(), cost_usd = 0, budget_usd = budget, spent_usd = 0,
    members = json.array({ root_id }), limits = { depth = 3, children = 32, running = 8 } }
  store.put(n)
  store.save(n)
  local added = not layer.get("tree")
    and layer.install({ name = "vendor_test tree budget", vendor_admit = store.check, vendor_charge = store.charge })
  local spent_hook = store.on_budget_spent
  store.on_budget_spent = nil -- no tree to stop here
  return setmetatable({ dir = d, root = root_id, store = store }, { __close = function()
    if added then layer.uninstall("vendor_test tree budget") end
    store.on_budget_spent = spent_hook
    store.reset()
    loop.setenv("DEMESNE_STATE_DIR", saved)
    config.load()
    fs.remove_tree(d)
  end })
end

function tests.the_budget_admits_while_spent_and_reserved_fit_and_one_request_alone_always(t)
  local w <close> = budget_world(1)
  local store = w.store
  t:eq({ store.check(w.root, { id = "a", usd = 0.4 }) }, { true })
  t:eq({ store.check(w.root, { id = "b", usd = 0.4 }) }, { true })
  close_to(t, store.reserved(w.root), 0.8, "held")
  local ok, why, spent = store.check(w.root, { id = "c", usd = 0.4 })
  t:eq({ ok, spent }, { nil, false }, "0.8 reserved + 0.4 is over the budget of 1")
  t:eq(why, "budget of $1.00: $0.00 spent and $0.80 reserved by the model requests in flight leave no room for "
    .. "this one's $0.40 (its max_tokens and its size); it can go once those end")
  t:eq(store.get(w.root).reservations.a.usd, 0.4, "reservations are in the root's record")
  -- the answer of `a` cost 0.1: spent 0.1, its reservation given back
  t:eq({ store.charge(w.root, 0.1, { model = "m", input = 1, output = 1 }, { id = "a" }) }, { true })
  close_to(t, store.reserved(w.root), 0.4, "held after a's charge")
  t:eq({ store.check(w.root, { id = "c", usd = 0.4 }) }, { true }, "0.1 + 0.4 + 0.4 fits")
  t:eq({ store.charge(w.root, 0, nil, { id = "b" }) }, { true }, "b never reached the vendor: given back")
  t:eq({ store.charge(w.root, 0, nil, { id = "c" }) }, { true })
  t:eq(store.reserved(w.root), 0)
  t:eq(next(store.get(w.root).reservations), nil)
  -- alone, a request goes whatever its reservation while the budget is not spent: the spend
  -- passes the budget by at most that one reservation
  t:eq({ store.check(w.root, { id = "d", usd = 5 }) }, { true })
  t:eq({ store.charge(w.root, 1.2, { model = "m", input = 1, output = 1 }, { id = "d" }) },
    { nil, "budget of $1.00 spent" })
  t:eq({ store.check(w.root, { id = "e", usd = 0.01 }) }, { nil, "budget of $1.00 spent" })
  close_to(t, (store.spent(w.root)), 1.3, "spent")
end

function tests.reservations_a_dead_server_left_are_charged_in_full_when_the_tree_is_read(t)
  local w <close> = budget_world(10)
  local store = w.store
  local sandbox = require("demesne.sandbox")
  t:eq({ store.check(w.root, { id = "live", usd = 0.5, model = "claude-sonnet-5" }) }, { true })
  local rec = store.get(w.root)
  -- a server that is gone (no such process) left one request in flight
  rec.reservations.dead = { run_id = w.root, usd = 2.25, model = "claude-sonnet-5",
    owner = loop.hostname() .. "/999999999/1" }
  store.save(rec)
  t:ok(not sandbox.owner_alive(rec.reservations.dead.owner))
  store.reset()
  rec = store.get(w.root)
  close_to(t, (store.spent(w.root)), 2.25, "charged in full")
  t:eq(rec.reservations.dead, nil)
  t:eq(rec.reservations.live.usd, 0.5, "this server's own reservation is kept")
  t:eq(rec.usage.models["claude-sonnet-5"].requests, 1)
  store.reset()
  close_to(t, (store.spent(w.root)), 2.25, "charged once")
end

-- An upstream that answers each POST with its head and message_start (input 500), then
-- holds the rest until released (output `out`); seen = requests, held = their sockets.
local function held_upstream()
  local srv = { seen = 0, held = {} }
  local function on_client(c)
    local buf = ""
    c:read_start(function(data)
      if not data then c:close() return end
      buf = buf .. data
      local s, e = buf:find("\r\n\r\n", 1, true)
      if not s then return end
      local len = tonumber(buf:sub(1, s - 1):lower():match("content%-length:%s*(%d+)") or "0")
      if #buf - e < len then return end
      c:read_stop()
      srv.seen = srv.seen + 1
      c:write("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
      local ev = 'event: message_start\ndata: {"type":"message_start","message":{"id":"m","model":"claude-sonnet-5",'
        .. '"usage":{"input_tokens":500,"output_tokens":1}}}\n\n'
      c:write(("%x\r\n%s\r\n"):format(#ev, ev))
      srv.held[#srv.held + 1] = c
    end)
  end
  function srv.release(i, out)
    local c = srv.held[i]
    local ev = ('event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
      .. '"usage":{"output_tokens":%d}}\n\n'):format(out)
    c:write(("%x\r\n%s\r\n0\r\n\r\n"):format(#ev, ev), function() c:close() end)
  end
  srv.listener, srv.port = assert(stream.listen_tcp("127.0.0.1", 0, on_client))
  return srv
end

function tests.concurrent_requests_reserve_and_what_was_forwarded_is_always_charged(t)
  if (os.getenv("DEMESNE_CLAUDE_CODE_UPSTREAM") or "") ~= "" then return end
  local w <close> = budget_world(1)
  local up = held_upstream()
  local p = providers.load({ user_dir = false, quiet = true }):get("claude_code")
  local saved = p.vendor.upstream
  p.vendor.upstream = "http://127.0.0.1:" .. up.port
  local route, base, close, dir = bare_route(w.root, { provider = p })
  -- each request: about 2 KB, max_tokens 16000: reserved (2 KB x 3.75 + 16000 x 15) / 1e6, about $0.2475
  local body = json.encode({ model = "claude-sonnet-5", max_tokens = 16000, stream = true,
    messages = { { role = "user", content = ("x"):rep(2000) } } })
  local resv = (#body * 3.75 + 16000 * 15) / 1e6
  local answers, tasks = {}, {}
  local function send(i)
    tasks[i] = async.spawn("client " .. i, function()
      local chunks = {}
      local res = request({ url = base .. "/v1/messages", method = "POST", body = body,
        headers = { ["x-api-key"] = "dmsn-good", ["content-type"] = "application/json" },
        on_headers = function(status) answers[i] = { status = status } end,
        on_data = function(c) chunks[#chunks + 1] = c end })
      answers[i] = answers[i] or {}
      answers[i].done, answers[i].status, answers[i].body = true, res and res.status, table.concat(chunks)
    end)
  end
  local ok, err = pcall(function()
    for i = 1, 6 do send(i) end
    local deadline = loop.now() + 10000
    local function settled(n)
      local c = 0
      for i = 1, 6 do if answers[i] and (answers[i].done or answers[i].status == 200) then c = c + 1 end end
      return c >= n
    end
    while not (settled(6) and up.seen >= 4) and loop.now() < deadline do async.sleep(10) end
    t:eq(up.seen, 4, "4 reservations of $0.2475 fit in $1; the other 2 never reach the vendor")
    local refused = {}
    for i = 1, 6 do if answers[i].done then refused[#refused + 1] = answers[i] end end
    t:eq(#refused, 2)
    t:eq(refused[1].status, 400)
    local e = json.decode(refused[1].body).error
    t:eq(e.code, "budget_exceeded")
    t:match(e.message, "^demesne vendor route: budget of %$1%.00: %$0%.00 spent and %$0%.%d%d reserved by the model "
      .. "requests in flight leave no room for this one's %$0%.25")
    -- message_start gave the input (500): each reservation is now its input and the output still to come
    close_to(t, w.store.reserved(w.root), 4 * (500 * 3 + 16000 * 15) / 1e6, "reserved once the input is known")
    -- three answers end (100 output tokens each): charged what they used, reservations given back
    local held = {}
    for i = 1, 6 do if not answers[i].done then held[#held + 1] = i end end
    for k = 1, 3 do up.release(k, 100) end
    while not (answers[held[1]].done and answers[held[2]].done and answers[held[3]].done) and loop.now() < deadline do
      async.sleep(10)
    end
    local each = (500 * 3 + 100 * 15) / 1e6
    close_to(t, (w.store.spent(w.root)), 3 * each, "spent")
    close_to(t, w.store.reserved(w.root), (500 * 3 + 16000 * 15) / 1e6, "one still in flight")
    -- the agent hangs up mid-answer: charged the input message_start gave and the whole output reserved
    async.cancel(tasks[held[4]])
    while w.store.reserved(w.root) > 0 and loop.now() < deadline do async.sleep(10) end
    close_to(t, (w.store.spent(w.root)), 3 * each + (500 * 3 + 16000 * 15) / 1e6, "the cut answer is charged")
    -- one more, and the route stops (the tree ended) while it is answered: charged too
    send(7)
    while up.seen < 5 and loop.now() < deadline do async.sleep(10) end
    t:eq(up.seen, 5)
    route:stop() -- waits up to 5 s for the answer, then cuts it
    close_to(t, (w.store.spent(w.root)), 3 * each + 2 * (500 * 3 + 16000 * 15) / 1e6, "charged when the route stops")
    t:eq(w.store.reserved(w.root), 0)
    t:eq(next(w.store.get(w.root).reservations), nil, "nothing left reserved in the record")
  end)
  local lines = {}
  for l in (fs.read_file(dir .. "/out/usage.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(l) end
  local usage = json.decode(fs.read_file(dir .. "/out/usage.json") or "{}")
  close()
  up.listener:close()
  for _, c in ipairs(up.held) do c:close() end
  p.vendor.upstream = saved
  if not ok then error(err, 0) end
  local cut, denied = 0, 0
  for _, l in ipairs(lines) do
    if l.charged == "cut" then
      cut = cut + 1
      t:eq({ l.input, l.output }, { 500, 16000 })
    end
    if l.verdict == "deny" then denied = denied + 1 end
  end
  t:eq({ cut, denied }, { 2, 2 }, "usage.jsonl: the cut answers and the refusals")
  t:eq(usage.requests, 5)
  close_to(t, usage.cost_usd, (w.store.spent(w.root)), "usage.json's cost is the tree's spend")
  t:ok(resv > 0.24)
end

return tests
