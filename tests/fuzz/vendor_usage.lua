-- Fuzz harness: what comes back to the vendor route from upstream, as lua/vendor.lua reads
-- it: the response body's usage (providers.usage_counter: the SSE reader and each adapter's
-- usage_from_sse for an event stream, usage_from_json for JSON), its indicative cost, and
-- for a 429 the reset time in the headers and the body (vendor.reset_wait, body_reset) and
-- what the route makes of it (Route:rate_wait).
--
-- An input is a response without its status line: header lines ("name: value"), a blank
-- line, then the body, fed in socket-sized pieces. Without a blank line it is all body.
-- Each input goes through the claude_code and codex adapters.
--
-- The adapters' usage_from_sse and usage_from_json are also called directly: the counter
-- calls them under pcall (a user's adapter may be sloppy), so an error there would be
-- silent, usage lost; the built-in adapters must not raise on any event.
--
-- Findings: a Lua error; usage that is not a set of non-negative integers; a cost or a wait
-- that is negative, NaN or infinite.
local fs = require("core.fs")
local loop = require("core.loop")
local providers = require("demesne.providers")
local vendor = require("demesne.vendor")
local fuzz = require("fuzzlib")
local check = fuzz.check

local reg = providers.load({ user_dir = false, quiet = true })
local adapters, routes = {}, {}
for _, name in ipairs({ "claude_code", "codex" }) do
  local p = assert(reg:get(name))
  adapters[#adapters + 1] = p
  local dir = os.getenv("FUZZ_TMPDIR") .. "/usage-" .. name
  assert(fs.mkdir_p(dir .. "/run", 448))
  assert(fs.mkdir_p(dir .. "/out", 448))
  -- a retry budget of one that is never spent (no holds): every 429 reaches the wait checks
  local route = assert(vendor.start({ run_id = "fuzz-usage-" .. name, run_dir = dir .. "/run",
    output_dir = dir .. "/out", provider = p, token = "dmsn-fuzz", credential = { present = false },
    holds = false, rate_limit_retries = 1 }))
  route.file:close()
  route.file = nil
  routes[name] = route
end

local function finite(x) return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge end

local function check_usage(u, where)
  check(type(u) == "table", "%s: usage is a %s", where, type(u))
  for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "reasoning" }) do
    local v = u[k]
    if k ~= "reasoning" or v ~= nil then
      check(finite(v) and v >= 0 and v == math.floor(v), "%s: %s = %s", where, k, tostring(v))
    end
  end
  check(u.model == nil or type(u.model) == "string", "%s: model is a %s", where, type(u.model))
end

-- "name: value" lines up to a blank line, lowercased names as curl's callback gives them.
local function split_response(data)
  local s, e = data:find("\r?\n\r?\n")
  if not s then return {}, data end
  local headers = {}
  for line in (data:sub(1, s - 1) .. "\n"):gmatch("([^\n]*)\n") do
    local name, value = line:match("^([^:]+):[ \t]*(.-)\r?$")
    if name then headers[name:lower()] = value end
  end
  return headers, data:sub(e + 1)
end

return function(data)
  local headers, body = split_response(data)
  local now = loop.time()
  for _, p in ipairs(adapters) do
    -- the route's own reading: the counter, fed as the body arrives
    local counter = providers.usage_counter(p, headers["content-type"])
    for piece in fuzz.chunks(body) do counter:feed(piece) end
    local usage = counter:finish()
    if usage then
      check_usage(usage, p.name .. " counter")
      local usd, priced = p.cost(usage)
      check(finite(usd) and usd >= 0, "%s: cost %s", p.name, tostring(usd))
      check(type(priced) == "boolean", "%s: priced is a %s", p.name, type(priced))
    end
    -- the adapter's parsers, unprotected
    local reader = providers.sse_reader()
    local events = {}
    for piece in fuzz.chunks(body) do
      for _, ev in ipairs(reader:feed(piece)) do events[#events + 1] = ev end
    end
    for _, ev in ipairs(reader:finish()) do events[#events + 1] = ev end
    for _, ev in ipairs(events) do
      check(type(ev.data) == "string", "an SSE event without data")
      local part = p.usage_from_sse(ev.event, ev.data)
      if part ~= nil then check(type(part) == "table", "%s: usage_from_sse gave a %s", p.name, type(part)) end
    end
    local u = p.usage_from_json(body)
    if u ~= nil then check_usage(u, p.name .. " usage_from_json") end
    -- a 429: the reset time and what the route decides
    local w = vendor.reset_wait(headers, now)
    check(w == nil or (finite(w) and w >= 0), "reset_wait gave %s", tostring(w))
    local b = vendor.body_reset(body, now)
    check(b == nil or (finite(b) and b >= 0), "body_reset gave %s", tostring(b))
    local ms, why = routes[p.name]:rate_wait(headers, body)
    check(ms == nil and type(why) == "string", "rate_wait held a request with no holds allowed: %s", tostring(ms))
  end
end
