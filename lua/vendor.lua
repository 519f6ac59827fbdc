-- The vendor route: the credential-holding half of an agent sandbox's egress.
--
-- demesne-init relays 127.0.0.1:3129 inside an agent sandbox to <run_dir>/vendor.sock on
-- the host (--relay 3129=/.demesne/run/vendor.sock) and hands each accepted TCP socket
-- over (core.stream.listen_relay). Here a small HTTP/1.1 server reads one request per
-- connection (head, then a Content-Length or chunked body), asks
-- providers.vendor_decide for a verdict, and for `forward` sends the request upstream with
-- core.http, the run's token replaced by the real credential. The response streams back
-- to the agent chunk by chunk as it arrives (SSE flows unbuffered) with
-- `Connection: close`; its usage is counted on the way (providers.usage_counter).
--
-- Each request is one JSON line in <output_dir>/usage.jsonl; <output_dir>/usage.json holds
-- the totals by model and the indicative cost, rewritten atomically after each request.
-- The credential is read only when a request is forwarded and goes only into the upstream
-- request's headers: it is never logged, written or put into the sandbox.
local fs = require("core.fs")
local http = require("core.http")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local providers = require("demesne.providers")
local stream = require("core.stream")
local timer = require("core.timer")

local vendor = {}

local LOGGER = "demesne.vendor"

--- Hooks of the layer above (nested sandboxes, lua/tree), each called with the run id:
---   admit(run_id) -> true | nil, why   before a model request is forwarded: a refusal (the
---                                      tree's budget is spent) answers the agent with `why`
---   charge(run_id, usd, usage)         after a model request was counted (usage: ProviderUsage)
vendor.hooks = { admit = {}, charge = {} }

--- The vendor port inside an agent sandbox.
vendor.PORT = 3129
vendor.SANDBOX_SOCKET = "/.demesne/run/vendor.sock"
vendor.SOCKET_NAME = "vendor.sock"

local MAX_HEAD = 64 * 1024
local MAX_BODY = 64 * 1024 * 1024
local HEAD_TIMEOUT_MS = 60 * 1000
local UPSTREAM_TIMEOUT_MS = 30 * 60 * 1000

--- The in-sandbox base URL of the vendor route.
function vendor.base_url() return ("http://127.0.0.1:%d"):format(vendor.PORT) end

--- The demesne-init options that start the relay of the vendor port.
function vendor.relay_args() return { "--relay", ("%d=%s"):format(vendor.PORT, vendor.SANDBOX_SOCKET) } end

local function iso_now()
  local t = loop.time()
  return os.date("!%Y-%m-%dT%H:%M:%S", math.floor(t)) .. (".%03dZ"):format(math.floor((t % 1) * 1000))
end

local REASONS = { [200] = "OK", [400] = "Bad Request", [401] = "Unauthorized", [403] = "Forbidden",
  [404] = "Not Found", [413] = "Payload Too Large", [431] = "Request Header Fields Too Large",
  [500] = "Internal Server Error", [502] = "Bad Gateway", [503] = "Service Unavailable", [504] = "Gateway Timeout" }

-- Headers that describe the hop, not the message: never copied across the proxy.
local HOP = { connection = true, ["keep-alive"] = true, ["proxy-connection"] = true, ["transfer-encoding"] = true,
  ["content-length"] = true, te = true, trailer = true, upgrade = true, host = true, expect = true,
  ["proxy-authorization"] = true, ["proxy-authenticate"] = true }

--------------------------------------------------------------------------------------------
-- Request parsing (one request per connection)

--- Parses a request head (without the blank line). Returns {method, target, version,
--- headers = {name=value lowercased}} or nil, status, why.
function vendor.parse_head(text)
  local lines = {}
  for line in (text .. "\r\n"):gmatch("(.-)\r?\n") do lines[#lines + 1] = line end
  local method, target, version = (lines[1] or ""):match("^(%u+) (%S+) HTTP/(1%.[01])$")
  if not method then return nil, 400, "malformed request line" end
  local headers, repeated = {}, {}
  for i = 2, #lines do
    local l = lines[i]
    if l ~= "" then
      -- linear patterns only: the sandbox writes this text, and a lazy "(.-)" before a
      -- trailing "[ \t]*$" backtracks quadratically over a long run of blanks (a 32 KB header
      -- line held the loop for 18 s)
      local name, rest = l:match("^([!#$%%&'*+%-.^_`|~%w]+):(.*)$")
      if not name then return nil, 400, "malformed header line" end
      local value = rest:match("^[ \t]*(.*[^ \t])") or ""
      name = name:lower()
      if headers[name] and name ~= "content-length" then
        repeated[name] = repeated[name] or { headers[name] }
        repeated[name][#repeated[name] + 1] = value
      elseif headers[name] and headers[name] ~= value then return nil, 400, "conflicting Content-Length"
      else headers[name] = value end
    end
  end
  for name, values in pairs(repeated) do headers[name] = table.concat(values, ", ") end
  -- an absolute-form target (a client that used the egress proxy variables) keeps its path
  local path = target:match("^https?://[^/]+(/.*)$")
  if path then target = path elseif target:match("^https?://[^/]+$") then target = "/" end
  return { method = method, target = target, version = version, headers = headers }
end

--- Reads a request body as it arrives (Content-Length or chunked). `charge(n)` is asked
--- before n more body bytes are kept and returns false to refuse them (a ceiling); a
--- Content-Length body is charged whole when the head arrives. Each byte is copied once:
--- the work is linear in the body's size, and no more than the body plus one framing line
--- (at most 1 KiB) is held. Returns the reader, or nil, status, why for a head that cannot
--- be read. reader:feed(data) returns "more", "done" (reader.body is set) or "error"
--- (reader.status and reader.why say why: 400, 413, or 503 for a refused charge).
---@param headers table<string,string>
---@param charge fun(n: integer): boolean
---@return table|nil reader, integer|nil status, string|nil why
function vendor.body_reader(headers, charge)
  local te = headers["transfer-encoding"]
  local r = { parts = {}, size = 0, line = "", trailers = 0 }
  if te then
    if te:lower():match("^%s*chunked%s*$") == nil then return nil, 501, "unsupported transfer-encoding" end
    r.chunked, r.state, r.trailer = true, "size", 0
  else
    local cl = headers["content-length"]
    if cl and (not cl:match("^%d+$") or #cl > 12) then return nil, 400, "bad Content-Length" end
    r.want = tonumber(cl or "0")
    if r.want > MAX_BODY then return nil, 413, "request body too large" end
    if r.want > 0 and not charge(r.want) then return nil, 503, "refused" end
  end
  local function fail(self, status, why)
    self.status, self.why, self.parts = status, why, {}
    return "error"
  end
  function r.feed(self, data)
    if not self.chunked then
      local take = math.min(#data, self.want - self.size)
      if take > 0 then
        self.parts[#self.parts + 1] = take < #data and data:sub(1, take) or data
        self.size = self.size + take
      end
      if self.size < self.want then return "more" end
      self.body = table.concat(self.parts)
      self.parts = {}
      return "done"
    end
    -- one part per read, not per chunk: tiny chunks must not cost a table slot each
    local pos, n, got = 1, #data, {}
    local function keep()
      if #got > 0 then self.parts[#self.parts + 1] = table.concat(got) end
      got = {}
    end
    while true do
      if self.state == "data" then
        if pos > n then keep() return "more" end
        local take = math.min(self.left, n - pos + 1)
        if not charge(take) then return fail(self, 503, "refused") end
        got[#got + 1] = (pos == 1 and take == n) and data or data:sub(pos, pos + take - 1)
        self.size, self.left, pos = self.size + take, self.left - take, pos + take
        if self.left == 0 then self.state = "crlf" end
      else -- a framing line: a chunk's size, the CRLF after its data, or a trailer
        if pos > n then keep() return "more" end
        local nl = data:find("\n", pos, true)
        local piece = data:sub(pos, nl and nl - 1 or n)
        if #self.line + #piece > 1024 then return fail(self, 400, "chunk framing line too long") end
        self.line = self.line .. piece
        if not nl then keep() return "more" end
        pos = nl + 1
        local line = self.line:gsub("\r$", "")
        self.line = ""
        if self.state == "size" then
          local hex = line:match("^(%x+)")
          if not hex or #hex > 8 then return fail(self, 400, "bad chunk size") end
          self.left = tonumber(hex, 16)
          if self.size + self.left > MAX_BODY then return fail(self, 413, "request body too large") end
          self.state = self.left == 0 and "trailer" or "data"
        elseif self.state == "crlf" then
          if line ~= "" then return fail(self, 400, "no line break after a chunk") end
          self.state = "size"
        else -- trailer lines until an empty one
          if line == "" then
            keep()
            self.body = table.concat(self.parts)
            self.parts = {}
            return "done"
          end
          self.trailers = self.trailers + 1
          if self.trailers > 64 then return fail(self, 400, "too many trailer lines") end
        end
      end
    end
  end
  return r
end

--------------------------------------------------------------------------------------------
-- The per-run route

local Route = {}
Route.__index = Route

local active = {} -- run_id -> route

--------------------------------------------------------------------------------------------
-- Rate limits. An upstream 429 is read whole (its reset time may be in the headers, or only
-- in the JSON body as with a ChatGPT plan's usage limit). Within a per-run budget
-- (agent_rate_limit_retries) a reset at most agent_rate_limit_hold_seconds away is waited out
-- here and the same request sent again: the agent sees a slow answer. A later reset (up to
-- agent_rate_limit_max_wait_seconds, before the run's deadline) goes to the agent marked
-- `x-should-retry: false`, so its CLI ends the attempt at once; the agent's wrapper then
-- asks POST /.demesne/attempt, and the route answers `resume <session>` after the reset
-- (lua/agent.lua decides) or `stop`. Holds and resumes draw on the same budget. The state
-- is kept in <state_dir>/vendor/<run_id>.json (out of the sandbox's reach) so a restarted
-- server neither forgets the retries spent nor grants one twice.

function vendor.rate_budget(n)
  n = n or require("demesne.config").get("agent_rate_limit_retries")
  return math.max(0, math.floor(tonumber(n) or 0))
end

local function utc_epoch(y, mo, d, h, mi, sec)
  -- days from civil (proleptic Gregorian), independent of the local time zone
  y = mo <= 2 and y - 1 or y
  local era = (y >= 0 and y or y - 399) // 400
  local yoe = y - era * 400
  local doy = (153 * (mo + (mo > 2 and -3 or 9)) + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  return (era * 146097 + doe - 719468) * 86400 + h * 3600 + mi * 60 + sec
end

local MONTHS = { jan = 1, feb = 2, mar = 3, apr = 4, may = 5, jun = 6, jul = 7, aug = 8, sep = 9, oct = 10, nov = 11, dec = 12 }

-- The longest wait a reset can name: a later one (1e300 s, or 400 digits read as infinity)
-- is taken as this far away. Waits are printed as integers, which such numbers are not.
local RESET_MAX = 2 ^ 31 -- seconds, 68 years

-- A wait in seconds from 0 to RESET_MAX, or nil for NaN.
local function bounded_wait(w)
  if w == nil or w ~= w then return nil end
  return math.max(0, math.min(w, RESET_MAX))
end

--- Seconds until a reset from one header value: an RFC 3339 time, an HTTP date, delta
--- seconds, or an OpenAI-style duration ("1m30s", "250ms"). nil when unreadable; may be
--- huge (infinite for 400 digits): reset_wait and body_reset bound it.
function vendor.parse_reset(value, now)
  if type(value) ~= "string" then return nil end
  value = value:match("^%s*(.*%S)") or "" -- (linear: no lazy match before a trailing %s*$)
  if value:match("^%d+%.?%d*$") then return tonumber(value) end
  local y, mo, d, h, mi, sec, frac, zone = value:match("^(%d%d%d%d)%-(%d%d)%-(%d%d)[Tt ](%d%d):(%d%d):(%d%d)(%.?%d*)(.*)$")
  if y then
    local t = utc_epoch(tonumber(y), tonumber(mo), tonumber(d), tonumber(h), tonumber(mi), tonumber(sec))
      + (tonumber("0" .. frac) or 0)
    local sign, zh, zm = zone:match("^([+-])(%d%d):?(%d%d)$")
    if sign then t = t - (sign == "+" and 1 or -1) * (tonumber(zh) * 3600 + tonumber(zm) * 60)
    elseif zone ~= "" and zone ~= "Z" and zone ~= "z" then return nil end
    return t - now
  end
  local dd, mon, yy, hh, mm, ss = value:match("^%a+, (%d%d?) (%a%a%a) (%d%d%d%d) (%d%d):(%d%d):(%d%d) GMT$")
  if dd and MONTHS[mon:lower()] then
    return utc_epoch(tonumber(yy), MONTHS[mon:lower()], tonumber(dd), tonumber(hh), tonumber(mm), tonumber(ss)) - now
  end
  local total, any = 0, false
  local rest = value:gsub("(%d+%.?%d*)(%a+)", function(n, unit)
    local f = ({ h = 3600, m = 60, s = 1, ms = 0.001 })[unit]
    if not f then return nil end
    total, any = total + tonumber(n) * f, true
    return ""
  end)
  if any and rest == "" then return total end
  return nil
end

--- Seconds to wait before a rate-limited request may be sent again, from a 429's headers
--- (retry-after first, else the latest anthropic-ratelimit-*-reset / x-ratelimit-reset-*).
--- nil when no header names a reset; at most 2^31.
function vendor.reset_wait(headers, now)
  headers = headers or {}
  now = now or loop.time()
  local ra = vendor.parse_reset(headers["retry-after"], now)
  if ra then return bounded_wait(ra) end
  local best
  for k, v in pairs(headers) do
    if type(k) == "string" and (k:match("^anthropic%-ratelimit%-.+%-reset$") or k:match("^x%-ratelimit%-reset")) then
      local w = vendor.parse_reset(v, now)
      if w and (not best or w > best) then best = w end
    end
  end
  return bounded_wait(best)
end

--- Seconds until a reset named in a 429's JSON body, or nil. Reads `resets_at` (epoch
--- seconds, or an RFC 3339 time) and `resets_in_seconds`, under `error` or at the top level:
--- the shape of OpenAI's `usage_limit_reached` answer to a ChatGPT-plan login, which has no
--- reset header. At most 2^31.
---@param body string|nil
---@param now number  epoch seconds
---@return number|nil
function vendor.body_reset(body, now)
  if type(body) ~= "string" or body == "" or #body > 65536 then return nil end
  local ok, v = pcall(json.decode, body)
  if not ok or type(v) ~= "table" then return nil end
  for _, t in ipairs({ type(v.error) == "table" and v.error or {}, v }) do
    local at = t.resets_at
    if type(at) == "number" and at > 0 then return bounded_wait(at - now) end
    if type(at) == "string" then
      local w = vendor.parse_reset(at, now)
      if w and not at:match("^%s*%d+%.?%d*%s*$") then return bounded_wait(w) end
      local n = tonumber(at)
      if n and n > 0 then return bounded_wait(n - now) end
    end
    local inn = tonumber(t.resets_in_seconds)
    if inn and inn >= 0 then return bounded_wait(inn) end
  end
  return nil
end

local function setting(name, default) return tonumber(require("demesne.config").get(name)) or default end

--- Seconds before the run's deadline after which no wait for a reset is started (the
--- agent needs some time to finish after it).
vendor.DEADLINE_MARGIN = 10

--- How a 429 is handled, from its headers and body. Returns the wait in ms when the route
--- holds the request and sends it again; else nil, why, resumable (true when the run's
--- session is to be resumed after the reset: the agent is told not to retry by itself).
---@param headers table<string,string>|nil
---@param body string|nil
---@return integer|nil ms, string|nil why, boolean|nil resumable
function Route:rate_wait(headers, body)
  local now = loop.time()
  local w = vendor.reset_wait(headers, now) or vendor.body_reset(body, now)
  local rate = self.rate
  rate.limited = rate.limited + 1
  rate.passed_at = now -- provisional: cleared below when the request is held
  rate.reset_at = w and (now + w) or nil -- the latest answer's reset (none: unknown)
  local function no(why, resumable)
    self:save_rate()
    return nil, why, resumable
  end
  if rate.used >= rate.budget then return no(("retry budget of %d exhausted"):format(rate.budget)) end
  if not w then return no("no reset time in the answer") end
  local max = setting("agent_rate_limit_max_wait_seconds", 3600)
  if w > max then return no(("reset in %d s is beyond the longest wait (%d s)"):format(math.ceil(w), max)) end
  if self.deadline and now + w >= self.deadline - vendor.DEADLINE_MARGIN then
    return no("reset is after the run's timeout")
  end
  local hold = setting("agent_rate_limit_hold_seconds", 60)
  if hold <= 0 or w > hold or not self.holds then
    return no(("reset in %d s: the attempt ends and the session is resumed after it"):format(math.ceil(w)), true)
  end
  rate.used = rate.used + 1
  rate.held = (rate.held or 0) + 1
  rate.passed_at = nil
  local ms = math.max(1, math.ceil(w * 1000) + 250)
  rate.holding_until = now + ms / 1000 -- a restarted route waits for it too
  self:save_rate()
  return ms
end

--- The rate-limit state of the run (saved in <state_dir>/vendor/<run_id>.json): budget,
--- used (holds + resumes), held, resumed, limited (429 answers seen), reset_at (epoch s),
--- passed_at (when a 429 last went to the agent), why (the reason a rate-limited run
--- ended), decided (attempt number -> the resume given to the agent's wrapper),
--- last_attempt (the last attempt decided), stopped (a stop was answered: no later attempt
--- is decided).
function Route:rate_state() return self.rate end

local function rate_file(run_id)
  return require("demesne.config").get("state_dir") .. "/vendor/" .. run_id .. ".json"
end

function Route:save_rate()
  local f = rate_file(self.run_id)
  fs.mkdir_p(f:match("^(.*)/"), 448) -- 0700
  local ok, text = pcall(json.encode, self.rate)
  if ok then
    local w, err = fs.write_atomic(f, text .. "\n")
    if not w then log.warning(LOGGER, "%s: %s: %s", self.run_id, f, tostring(err)) end
  end
end

--- Forgets the saved rate-limit state of a finished run.
---@param run_id string
function vendor.forget(run_id)
  if type(run_id) == "string" and run_id ~= "" then os.remove(rate_file(run_id)) end
end

local function load_rate(run_id, budget)
  local rate = { budget = budget, used = 0, limited = 0, held = 0, resumed = 0 }
  local text = fs.read_file(rate_file(run_id), 0, 1 << 20)
  local prev = text and json.decode(text)
  if type(prev) ~= "table" then return rate end
  for _, k in ipairs({ "used", "limited", "held", "resumed" }) do
    if type(prev[k]) == "number" then rate[k] = math.tointeger(math.floor(prev[k])) end
  end
  for _, k in ipairs({ "reset_at", "passed_at", "attempt_started", "holding_until" }) do
    if type(prev[k]) == "number" then rate[k] = prev[k] end
  end
  if type(prev.why) == "string" then rate.why = prev.why end
  if math.type(prev.last_attempt) == "integer" or type(prev.last_attempt) == "number" then
    rate.last_attempt = math.tointeger(math.floor(prev.last_attempt))
  end
  if prev.stopped == true then rate.stopped = true end
  if type(prev.decided) == "table" then rate.decided = prev.decided end
  return rate
end

--- Starts the vendor route of one run. `o`: {run_id, run_dir, output_dir, provider, token,
--- credential, deadline (epoch s, optional), decide (optional: function(route, {attempt,
--- exit_code}) -> {action = "resume", session, at} | {action = "stop", why}; answers the
--- agent wrapper's POST /.demesne/attempt, see lua/agent.lua), holds (false: never hold a
--- rate-limited request; default true)}. A route started again for the same run (a
--- restarted server) takes up its usage totals and rate-limit state. Returns the route
--- (route:stop() ends it) or nil, err.
function vendor.start(o)
  local r = setmetatable({ run_id = o.run_id, provider = o.provider, token = o.token, credential = o.credential,
    output_dir = o.output_dir, conns = {}, nconns = 0, buffered = 0, lingering = 0, models = {}, requests = 0,
    closed = false,
    deadline = o.deadline, waits = {}, decide = o.decide, holds = o.holds ~= false,
    rate = load_rate(o.run_id, vendor.rate_budget(o.rate_limit_retries)),
    total = { input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 } }, Route)
  -- the output folder is the sandbox's to write: held by descriptor, every file in it
  -- opened confined (no link, no FIFO; core.fs.dir), so a restarted server never blocks here
  local out, oerr = fs.opendir(o.output_dir)
  if not out then return nil, "vendor: " .. tostring(oerr) end
  r.out = out
  -- a route started again (a background job re-attached after a restart) keeps the totals;
  -- they are the sandbox's word (it can write usage.json): only finite counts are taken
  local prev, perr, pcode = out:read("usage.json", 1 << 20)
  if not prev and pcode ~= "ENOENT" then log.warning(LOGGER, "%s: previous totals not read: %s", o.run_id, tostring(perr)) end
  local pok
  pok, prev = pcall(json.decode, prev or "")
  if not pok then prev = nil end
  if type(prev) == "table" and type(prev.models) == "table" then
    for name, m in pairs(prev.models) do
      if type(name) == "string" and type(m) == "table" then
        local rec = { requests = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 }
        for k in pairs(rec) do
          local v = m[k]
          if type(v) == "number" and v >= 0 and v < 2 ^ 53 then rec[k] = math.tointeger(v) or v end
        end
        r.models[name] = rec
        for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "cost_usd" }) do
          r.total[k] = r.total[k] + rec[k]
        end
        r.requests = r.requests + rec.requests
      end
    end
  end
  local file, ferr = out:open("usage.jsonl", "a")
  if not file then
    out:close()
    return nil, "vendor: " .. tostring(ferr)
  end
  r.file = file
  r:write_totals()
  local path = o.run_dir .. "/" .. vendor.SOCKET_NAME
  local server, err = stream.listen_relay(path, function(conn) r:accept(conn) end)
  if not server then
    file:close()
    out:close()
    return nil, ("vendor: cannot listen on %s: %s"):format(path, tostring(err))
  end
  -- 0666: whatever user the image runs as can connect; the run folder is the sandbox's to
  -- write, so the socket is changed through the held folder, never through a link
  local run = fs.opendir(o.run_dir)
  if run then
    run:chmod(vendor.SOCKET_NAME, 438)
    run:close()
  end
  r.server = server
  active[o.run_id] = r
  return r
end

--- The live route of a run, or nil.
function vendor.get(run_id) return active[run_id] end

function Route:log_line(rec)
  if not self.file then return end
  local ok, line = pcall(json.encode, rec)
  if ok then self.file:write(line .. "\n") end
end

--- Totals as written to usage.json: {models = {name = {requests, input, output,
--- cache_creation, cache_read, cost_usd}}, requests, input, output, cache_creation,
--- cache_read, cost_usd, indicative = true}.
function Route:totals()
  local models = {}
  for name, m in pairs(self.models) do models[name] = m end
  local t = self.total
  return {
    provider = self.provider.name, requests = self.requests, models = models,
    input = t.input, output = t.output, cache_creation = t.cache_creation, cache_read = t.cache_read,
    cost_usd = t.cost_usd, indicative = true,
    rate_limited = self.rate and self.rate.limited > 0 and { answers = self.rate.limited, retried = self.rate.used,
      held = self.rate.held or 0, resumed = self.rate.resumed or 0,
      budget = self.rate.budget, reset_at = self.rate.reset_at, why = self.rate.why } or nil,
  }
end

function Route:write_totals()
  local ok, text = pcall(json.encode, self:totals())
  if ok then
    local w, err = nil, "the route is stopped"
    if self.out then w, err = self.out:write_atomic("usage.json", text .. "\n") end
    if not w then log.warning(LOGGER, "%s: usage.json: %s", self.run_id, tostring(err)) end
  end
end

function Route:count(usage)
  local model = usage.model or "unknown"
  local usd, priced = self.provider.cost(usage)
  local m = self.models[model]
  if not m then
    m = { requests = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 }
    self.models[model] = m
  end
  m.requests = m.requests + 1
  for _, k in ipairs({ "input", "output", "cache_creation", "cache_read" }) do
    m[k] = m[k] + (usage[k] or 0)
    self.total[k] = self.total[k] + (usage[k] or 0)
  end
  m.cost_usd = m.cost_usd + usd
  if not priced then m.unpriced = true end
  self.total.cost_usd = self.total.cost_usd + usd
  return usd, priced
end

-- Tells the charge hooks of one counted request.
function Route:charge(usd, usage)
  for _, fn in ipairs(vendor.hooks.charge) do
    local ok, err = pcall(fn, self.run_id, usd, usage)
    if not ok then log.warning(LOGGER, "%s: charge hook: %s", self.run_id, tostring(err)) end
  end
end

local function reply(conn, status, body, ctype)
  body = body or ""
  local head = ("HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n")
    :format(status, REASONS[status] or "Error", ctype or "application/json", #body)
  conn:write(head .. body, function() conn:close() end)
end

-- A refusal of the layer above (a tree's budget is spent) in both vendors' error shape, with
-- status 400 as the vendors answer a spent balance: neither CLI retries a 400 (both retry
-- 402 and 403, and Claude Code reads 403 as a failed login), so the run ends at once with
-- the message shown.
local REFUSED_STATUS = 400
local function refusal_body(message)
  return json.encode({ type = "error", error = { type = "invalid_request_error", code = "budget_exceeded",
    message = "demesne vendor route: " .. message .. "; no further model requests are sent for this tree" } })
end

-- The first refusal of an admit hook, or nil.
local function refused(run_id)
  for _, fn in ipairs(vendor.hooks.admit) do
    local ok, yes, why = pcall(fn, run_id)
    if not ok then
      log.warning(LOGGER, "%s: admit hook: %s", run_id, tostring(yes))
    elseif not yes then
      return tostring(why or "refused")
    end
  end
  return nil
end

local function error_body(p, status, message)
  -- both vendor shapes: Anthropic {type: error, error: {type, message}}, OpenAI {error: {message, type, code}}
  return json.encode({ type = "error", error = { type = status == 401 and "authentication_error"
    or status == 403 and "permission_error" or "api_error", message = "demesne vendor route: " .. message,
    code = tostring(status) } })
end

-- Connections a route keeps open at once only to let its answer arrive (answer_and_drain).
local LINGER_MAX = 32

-- Answers `status` with an error body and then reads (and drops) what the client still
-- sends, for at most 2 s, before closing: closing with unread bytes would reset the
-- connection under the answer. At most LINGER_MAX connections of a route linger so at
-- once (each holds a descriptor); past that the answer goes out and the connection closes.
function Route:answer_and_drain(conn, status, message)
  local body = error_body(self.provider, status, message)
  local closed = false
  local lingering = self.lingering < LINGER_MAX
  if lingering then self.lingering = self.lingering + 1 end
  local linger
  local function close()
    if closed then return end
    closed = true
    if linger then linger:close() end
    if lingering then self.lingering = self.lingering - 1 end
    conn:close()
  end
  conn:read_stop()
  local head = ("HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n")
    :format(status, REASONS[status] or "Error", #body)
  if not lingering then
    conn:write(head .. body, close)
    return
  end
  linger = timer.after(2000, close)
  conn:read_start(function(data)
    if data == nil then close() end
  end)
  conn:write(head .. body, function() if not closed then conn:shutdown() end end)
end

-- Request bytes held by every route together (bodies being read, sent or held for a retry).
local buffered_total = 0

--- Bytes of request bodies all vendor routes hold now (tests, diagnostics).
---@return integer
function vendor.buffered() return buffered_total end

-- Holds `n` bytes of request body for connection `state` on this route, within
-- vendor_max_buffered_bytes (this route) and vendor_max_buffered_bytes_total (every route):
-- the bodies are held in the server's memory until their request ends. Returns true, or
-- false and the sentence for the 503.
function Route:hold(state, n)
  local route_max = math.floor(config.get("vendor_max_buffered_bytes"))
  local total_max = math.floor(config.get("vendor_max_buffered_bytes_total"))
  if self.buffered + n > route_max then
    return false, ("this sandbox's requests on its vendor route would hold %d bytes of bodies at once, over its "
      .. "ceiling of %d (vendor_max_buffered_bytes in the demesne configuration); send fewer or smaller requests at "
      .. "once"):format(self.buffered + n, route_max)
  end
  if buffered_total + n > total_max then
    return false, ("the vendor routes of all sandboxes would hold %d bytes of request bodies at once, over the "
      .. "server's ceiling of %d (vendor_max_buffered_bytes_total in the demesne configuration); retry "
      .. "later"):format(buffered_total + n, total_max)
  end
  self.buffered = self.buffered + n
  buffered_total = buffered_total + n
  state.charged = (state.charged or 0) + n
  return true
end

-- Gives back what connection `state` was charged.
function Route:release(state)
  local n = state.charged or 0
  state.charged = 0
  self.buffered = self.buffered - n
  buffered_total = buffered_total - n
end

-- A request the route refused: one line in usage.jsonl (the sandbox's own file, with the
-- path cut), and a log record for the first refusal and then at most one every 10 s with
-- the count since: a sandbox that floods its route must not flood the server's log or the
-- client's notifications.
function Route:note_refusal(rec, why)
  if rec.path then rec.path = log.printable(rec.path, 256) end
  self:log_line(rec)
  local r = self.refusals or { count = 0, last = -math.huge }
  self.refusals = r
  r.count = r.count + 1
  if loop.now() - r.last >= 10000 then
    log.info(LOGGER, "%s: refused %s %s: %s%s", self.run_id, log.printable(rec.method or "-", 32),
      log.printable(rec.path or "-", 256), log.printable(why or "refused", 512),
      r.count > 1 and (" (%d requests refused since the last report)"):format(r.count) or "")
    r.count, r.last = 0, loop.now()
  end
end

--- Takes one connection of the agent (from the relay). A route holds at most
--- vendor_max_connections at once: one more is answered 503 naming the ceiling (each
--- connection holds descriptors on the host; a sandbox must not starve the others). The
--- request is judged as soon as its head is read (route, token), before any of its body is;
--- the bodies a route holds at once are bounded (Route:charge), and a request over a
--- ceiling is answered 503 naming it.
---@param conn userdata  a core.stream
function Route:accept(conn)
  if self.closed then conn:close() return end
  local max = math.max(1, math.floor(config.get("vendor_max_connections")))
  if self.nconns >= max then
    local why = ("this sandbox has %d connections open on its vendor route, its ceiling "
      .. "(vendor_max_connections in the demesne configuration); close some and retry"):format(self.nconns)
    -- answered before the request is read
    self:answer_and_drain(conn, 503, why)
    self.refused = (self.refused or 0) + 1
    if self.refused == 1 or loop.now() - (self.refused_logged or 0) >= 1000 then
      self.refused_logged = loop.now()
      self:log_line({ time = iso_now(), verdict = "deny", status = 503, reason = why, refused = self.refused })
    end
    return
  end
  self.conns[conn] = true
  self.nconns = self.nconns + 1
  local state = { started = loop.hrtime() }
  local done = false
  -- the request (head and body) must arrive within HEAD_TIMEOUT_MS
  local deadline = timer.after(HEAD_TIMEOUT_MS, function()
    if not state.handed and not done then
      done = true
      conn:close()
      self:release(state)
      if self.conns[conn] then self.conns[conn] = nil; self.nconns = self.nconns - 1 end
    end
  end)
  local function finish()
    deadline:close()
    if done then return end
    done = true
    self:release(state)
    if self.conns[conn] then self.conns[conn] = nil; self.nconns = self.nconns - 1 end
  end
  state.finish = finish
  local function refuse(status, why, rec)
    self:note_refusal(rec or { time = iso_now(), verdict = "deny", status = status, reason = why }, why)
    self:answer_and_drain(conn, status, why)
    return finish()
  end
  local reader
  conn:read_start(function(data, err)
    if done or state.handed then return end
    if data == nil then
      conn:close()
      return finish()
    end
    if not state.req then
      -- the head's pieces are kept apart and only the new bytes, with the three before them,
      -- are searched for its end: a head trickled in one byte per read costs linear time
      local held = state.held or 0
      local tail = state.tail or ""
      local s, e = (tail .. data):find("\r?\n\r?\n")
      if not s then
        state.parts = state.parts or {}
        state.parts[#state.parts + 1] = data
        state.held = held + #data
        state.tail = (tail .. data):sub(-3)
        if state.held > MAX_HEAD then return refuse(431, "request head too large") end
        return
      end
      local whole = table.concat(state.parts or {}) .. data
      s, e = s + held - #tail, e + held - #tail
      state.parts, state.held, state.tail = nil, nil, nil
      local req, status, why = vendor.parse_head(whole:sub(1, s - 1))
      local rest = whole:sub(e + 1)
      if not req then return refuse(status, why) end
      state.req = req
      -- judged before the body is read: a request the route would refuse costs no body
      local path = req.target:match("^[^?#]*")
      if path == vendor.ATTEMPT_PATH then
        if not providers.token_equal(providers.bearer(req.headers), self.token) then
          return refuse(401, "the request does not carry this run's token",
            { time = iso_now(), method = req.method, path = path, verdict = "deny", status = 401,
              reason = "the request does not carry this run's token" })
        end
      else
        local v = providers.vendor_decide(self.provider, { method = req.method, target = req.target,
          headers = req.headers }, self.token, self.credential)
        if v.action == "deny" then
          return refuse(v.status or 403, v.reason or "refused", { time = iso_now(), method = req.method, path = path,
            verdict = "deny", status = v.status or 403, reason = v.reason })
        end
        state.verdict = v
      end
      local charge_why
      local br, bstatus, bwhy = vendor.body_reader(req.headers, function(n)
        local ok, why2 = self:hold(state, n)
        charge_why = why2
        return ok
      end)
      if not br then
        if bstatus == 503 then bwhy = charge_why end
        return refuse(bstatus, bwhy)
      end
      reader = br
      reader.charge_why = function() return charge_why end
      data = rest
    end
    local st = reader:feed(data)
    if st == "more" then return end
    deadline:close()
    if st == "error" then
      local why = reader.status == 503 and reader.charge_why() or reader.why
      return refuse(reader.status or 400, why)
    end
    conn:read_stop()
    state.handed = true
    self:handle(conn, state.req, reader.body, state)
  end)
end

--- The path on the vendor port where an agent's wrapper reports that an attempt of its CLI
--- ended: POST with `Authorization: Bearer <run token>` and a JSON body {attempt (1, 2, …),
--- exit_code}. The answer (text/plain) is `resume <session>`, sent once the rate limit has
--- reset, or `stop`.
vendor.ATTEMPT_PATH = "/.demesne/attempt"
vendor.ATTEMPTS_MAX = 1000

function Route:attempt_end(conn, req, body, state, rec)
  local function answer(status, text)
    rec.status = status
    self:log_line(rec)
    reply(conn, status, text, "text/plain; charset=utf-8")
    state.finish()
  end
  rec.verdict = "local"
  if not providers.token_equal(providers.bearer(req.headers), self.token) then
    rec.verdict, rec.reason = "deny", "the request does not carry this run's token"
    return answer(401, "the request does not carry this run's token\n")
  end
  if req.method ~= "POST" then return answer(405, "POST only\n") end
  local ok, info = pcall(json.decode, body or "")
  local n = ok and type(info) == "table" and type(info.attempt) == "number" and math.tointeger(info.attempt)
  local code = ok and type(info) == "table" and type(info.exit_code) == "number" and math.tointeger(info.exit_code)
  if not n or n < 1 or n > vendor.ATTEMPTS_MAX or not code then
    return answer(400, ("body: must be JSON {attempt: integer 1..%d, exit_code: integer}\n"):format(vendor.ATTEMPTS_MAX))
  end
  info = { attempt = n, exit_code = code }
  rec.attempt, rec.exit_code = info.attempt, info.exit_code
  -- Each attempt is decided once, in order (the wrapper reports 1, then 2 after a resume …),
  -- and nothing after a stop: deciding reads the whole transcript, and a sandbox that
  -- floods this path with reports must not make the server read it again and again. A
  -- report of an attempt already decided (a wrapper asking again after a server restart)
  -- gets the same answer.
  local rate = self.rate
  local last = math.tointeger(rate.last_attempt) or 0
  local d = { action = "stop" }
  if n <= last or rate.stopped then
    local kept = type(rate.decided) == "table" and rate.decided[tostring(n)]
    if n <= last and type(kept) == "table" and kept.action == "resume" then d = kept end
    rec.cached = true
  elseif n > last + 1 then
    return answer(409, ("attempt %d reported before attempt %d\n"):format(n, last + 1))
  else
    if self.decide then
      local dok, got = pcall(self.decide, self, { attempt = info.attempt, exit_code = info.exit_code })
      if dok and type(got) == "table" then d = got
      else log.warning(LOGGER, "%s: deciding on attempt %d: %s", self.run_id, info.attempt, tostring(got)) end
    end
    rate.last_attempt = n
    if d.action == "resume" then
      rate.decided = type(rate.decided) == "table" and rate.decided or {}
      rate.decided[tostring(n)] = d
    else
      rate.stopped = true
    end
    self:save_rate()
  end
  rec.decision = d.action
  if d.action ~= "resume" then return answer(200, "stop\n") end
  local wait_ms = math.max(0, math.ceil(((d.at or 0) - loop.time()) * 1000))
  rec.resume_in_ms = wait_ms
  if not rec.cached then
    log.info(LOGGER, "%s: attempt %d ended rate limited; resuming session %s in %d ms", self.run_id,
      info.attempt, log.printable(d.session, 200), wait_ms)
  end
  local t
  t = timer.after(wait_ms, function()
    self.waits[t] = nil
    if self.closed then return end
    answer(200, "resume " .. d.session .. "\n")
  end)
  self.waits[t] = true
end

function Route:handle(conn, req, body, state)
  local p = self.provider
  local path = req.target:match("^[^?#]*")
  local rec = { time = iso_now(), method = req.method, path = path }
  if path == vendor.ATTEMPT_PATH then return self:attempt_end(conn, req, body, state, rec) end
  local v = state.verdict or providers.vendor_decide(p, { method = req.method, target = req.target,
    headers = req.headers }, self.token, self.credential)
  if v.action == "local" then
    rec.verdict, rec.status = "local", v.status
    self:log_line(rec)
    conn:write(("HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"):format(v.status,
      REASONS[v.status] or "OK"), function() conn:close() end)
    return state.finish()
  end
  if v.action ~= "forward" then
    rec.verdict, rec.status, rec.reason = "deny", v.status, v.reason
    self:note_refusal(rec, v.reason)
    reply(conn, v.status or 403, error_body(p, v.status or 403, v.reason or "refused"))
    return state.finish()
  end
  local headers = {}
  for k, val in pairs(v.headers) do
    if not HOP[k] then headers[k] = val end
  end
  rec.verdict = "forward"
  local attempt
  local function issue()
    -- the tree's budget (checked again when a held request is sent after its reset)
    local refusal = refused(self.run_id)
    if refusal then
      rec.verdict, rec.status, rec.reason = "deny", REFUSED_STATUS, refusal
      self:log_line(rec)
      log.info(LOGGER, "%s: refused %s %s: %s", self.run_id, req.method, path, refusal)
      reply(conn, REFUSED_STATUS, refusal_body(refusal))
      return state.finish()
    end
    local counter
    local head_sent = false
    local retry_ms
    local limited -- a 429 being read whole before it is decided on: {headers, parts, size}
    local function write_head(status, h)
      head_sent = true
      rec.status = status
      local lines = { ("HTTP/1.1 %d %s"):format(status, REASONS[status] or "Status") }
      for k, val in pairs(h or {}) do
        if not HOP[k] and k ~= "content-encoding" then lines[#lines + 1] = k .. ": " .. val end
      end
      lines[#lines + 1] = "connection: close"
      conn:write(table.concat(lines, "\r\n") .. "\r\n\r\n")
    end
    local function send_head(status, h)
      if status == 429 and not state.client_gone then
        limited = { headers = h or {}, parts = {}, size = 0 }
        rec.rate_limited = true
        return
      end
      write_head(status, h)
      counter = providers.usage_counter(p, h and h["content-type"])
    end
    -- the 429 read whole: hold the request (true) or pass the answer to the agent
    local function decide_429()
      local body = table.concat(limited.parts)
      local why, resumable
      retry_ms, why, resumable = self:rate_wait(limited.headers, body)
      if retry_ms then
        rec.status, rec.retry_in_ms = 429, retry_ms
        return true
      end
      rec.rate_limit = why
      local h = limited.headers
      -- the host waits for the reset and resumes the session, or the run cannot wait for
      -- it: either way the CLI must not retry into the limit (without a reset time its own
      -- short backoff may still help)
      if resumable then rec.resume = true end
      if resumable or why ~= "no reset time in the answer" then
        local copy = {}
        for k, v in pairs(h) do
          if k ~= "retry-after" and k ~= "x-should-retry" then copy[k] = v end
        end
        copy["x-should-retry"] = "false"
        h = copy
      end
      if not resumable then
        self.rate.why = why
        self:save_rate()
      end
      write_head(429, h)
      conn:write(body)
      return false
    end
    local opts = {
      url = v.url, method = req.method, headers = headers, timeout_ms = UPSTREAM_TIMEOUT_MS,
      connect_timeout_ms = 30000,
      on_headers = send_head,
      on_data = function(chunk)
        if limited then
          if limited.size < 65536 then
            limited.parts[#limited.parts + 1] = chunk
            limited.size = limited.size + #chunk
          end
          return
        end
        if counter then counter:feed(chunk) end
        if state.client_gone then return end
        local ok = conn:write(chunk, function(wok)
          if not wok and not state.client_gone then
            state.client_gone = true -- the agent hung up: stop the upstream call too
            if state.upstream then state.upstream:cancel() end
          end
        end)
        if not ok then state.client_gone = true end
      end,
    }
    if req.method ~= "GET" and req.method ~= "HEAD" then opts.body = body or "" end
    local started = loop.hrtime()
    local upstream, serr = http.request(opts, function(res, msg, code)
      rec.duration_ms = math.floor((loop.hrtime() - started) / 1e6)
      if self.upstreams and state.upstream then self.upstreams[state.upstream] = nil end
      if limited and res and not self.closed and not state.client_gone and decide_429() then
        -- rate limited: log this answer, wait for the reset, send the request again
        self:log_line(rec)
        self:write_totals()
        log.info(LOGGER, "%s: rate limited (429); retrying %s in %d ms", self.run_id, path, retry_ms)
        rec = { time = iso_now(), method = req.method, path = path, verdict = "forward", retry = true }
        self.inflight = (self.inflight or 1) - 1
        local t
        t = timer.after(retry_ms, function()
          self.waits[t] = nil
          if self.closed or state.client_gone then
            state.finish()
            if self.closed and (self.inflight or 0) <= 0 and self.on_idle then self.on_idle() end
            return
          end
          self.rate.holding_until = nil
          rec.time = iso_now() -- when it is sent again
          attempt()
        end)
        self.waits[t] = true
        return
      end
      if not res then
        rec.error = tostring(msg)
        if not head_sent then
          rec.status = code == "ETIMEDOUT" and 504 or 502
          reply(conn, rec.status, error_body(p, rec.status, "upstream failed: " .. tostring(msg)))
        else
          conn:close()
        end
      else
        if not head_sent then -- a 429 to an agent that hung up, or a route closing meanwhile
          reply(conn, 429, error_body(p, 429, "rate limited by the vendor"))
        end
        conn:shutdown(function() conn:close() end)
      end
      if counter then
        local usage = counter:finish()
        if usage then
          rec.model = usage.model
          rec.id = usage.id
          for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "reasoning" }) do rec[k] = usage[k] end
          self.requests = self.requests + 1
          rec.cost_usd = self:count(usage)
          self:charge(rec.cost_usd, usage)
        end
      end
      self:log_line(rec)
      self:write_totals()
      state.finish()
      self.inflight = (self.inflight or 1) - 1
      if self.closed and self.inflight <= 0 and self.on_idle then self.on_idle() end
    end)
    state.upstream = upstream
    if not upstream then
      rec.status, rec.error = 502, tostring(serr)
      self:log_line(rec)
      reply(conn, 502, error_body(p, 502, "cannot start the upstream request"))
      return state.finish()
    end
    self.inflight = (self.inflight or 0) + 1
    self.upstreams = self.upstreams or {}
    self.upstreams[upstream] = true
  end
  attempt = issue
  -- a hold that a previous server started (the agent's held connection dropped with it and
  -- the CLI sent the request again): wait for the same reset before sending it
  local until_ = self.rate.holding_until
  local left = type(until_) == "number" and until_ - loop.time() or 0
  if left > 0 then
    rec.held_ms = math.ceil(left * 1000)
    local t
    t = timer.after(rec.held_ms, function()
      self.waits[t] = nil
      if self.closed then return state.finish() end
      self.rate.holding_until = nil
      rec.time = iso_now()
      issue()
    end)
    self.waits[t] = true
    return
  end
  return issue()
end

--- Stops the route: no new connections; inside a task waits up to 5 s for requests in
--- flight, then cancels them. usage.json is final afterwards. Idempotent.
function Route:stop()
  if self.closed then return end
  self.closed = true
  if active[self.run_id] == self then active[self.run_id] = nil end
  if self.server then self.server:close() self.server = nil end
  local async = require("demesne.async")
  if (self.inflight or 0) > 0 and async.current() then
    local ev = async.event()
    self.on_idle = function() ev.set() end
    local ok, err = pcall(async.timeout, 5000, ev.wait)
    if not ok and err == async.CANCELLED then error(err, 0) end
  end
  for t in pairs(self.waits or {}) do pcall(t.stop, t) end
  self.waits = {}
  for u in pairs(self.upstreams or {}) do pcall(u.cancel, u) end
  for c in pairs(self.conns) do pcall(c.close, c) end
  self:write_totals()
  if self.file then self.file:close() self.file = nil end
  if self.out then self.out:close() self.out = nil end
end
Route.__close = Route.stop

--- Stops the route of a run if one runs.
function vendor.stop(run_id)
  local r = active[run_id]
  if r then r:stop() end
end

return vendor
