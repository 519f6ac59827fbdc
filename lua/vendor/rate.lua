-- Rate limits of a vendor route. An upstream 429 is read whole (its reset time may be in
-- the headers, or only in the JSON body as with a ChatGPT plan's usage limit). Within a
-- per-run budget (agent_rate_limit_retries) a reset at most agent_rate_limit_hold_seconds
-- away is waited out and the same request sent again: the agent sees a slow answer. A
-- later reset (up to agent_rate_limit_max_wait_seconds, before the run's deadline) goes to
-- the agent marked `x-should-retry: false`, so its CLI ends the attempt at once; the
-- agent's wrapper then asks POST /.demesne/attempt, and the route answers `resume
-- <session>` after the reset (lua/agent/resume.lua decides) or `stop`. Holds and resumes
-- draw on the same budget. The state is kept in <state_dir>/vendor/<run_id>.json (out of
-- the sandbox's reach) so a restarted server neither forgets the retries spent nor grants
-- one twice.
local config = require("demesne.config")
local fs = require("core.fs")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")

local ratelimit = {}

local LOGGER = "demesne.vendor"

--- The retry budget of a run: `n`, else agent_rate_limit_retries; a whole number >= 0.
---@param n number|nil
---@return integer
function ratelimit.budget(n)
  n = n or config.get("agent_rate_limit_retries")
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
---@param value string|nil  the header's value
---@param now number        epoch seconds
---@return number|nil seconds
function ratelimit.parse_reset(value, now)
  if type(value) ~= "string" then return nil end
  value = value:match("^%s*(.-)%s*$")
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
---@param headers table<string,string>|nil  lowercased names
---@param now number|nil  epoch seconds (default: now)
---@return number|nil seconds
function ratelimit.reset_wait(headers, now)
  headers = headers or {}
  now = now or loop.time()
  local ra = ratelimit.parse_reset(headers["retry-after"], now)
  if ra then return bounded_wait(ra) end
  local best
  for k, v in pairs(headers) do
    if type(k) == "string" and (k:match("^anthropic%-ratelimit%-.+%-reset$") or k:match("^x%-ratelimit%-reset")) then
      local w = ratelimit.parse_reset(v, now)
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
function ratelimit.body_reset(body, now)
  if type(body) ~= "string" or body == "" or #body > 65536 then return nil end
  local ok, v = pcall(json.decode, body)
  if not ok or type(v) ~= "table" then return nil end
  for _, t in ipairs({ type(v.error) == "table" and v.error or {}, v }) do
    local at = t.resets_at
    if type(at) == "number" and at > 0 then return bounded_wait(at - now) end
    if type(at) == "string" then
      local w = ratelimit.parse_reset(at, now)
      if w and not at:match("^%s*%d+%.?%d*%s*$") then return bounded_wait(w) end
      local n = tonumber(at)
      if n and n > 0 then return bounded_wait(n - now) end
    end
    local inn = tonumber(t.resets_in_seconds)
    if inn and inn >= 0 then return bounded_wait(inn) end
  end
  return nil
end

local function setting(name, default) return tonumber(config.get(name)) or default end

--- Seconds before the run's deadline after which no wait for a reset is started (the
--- agent needs some time to finish after it).
ratelimit.DEADLINE_MARGIN = 10

--- How a 429 is handled, from its headers and body. Returns the wait in ms when the route
--- holds the request and sends it again; else nil, why, resumable (true when the run's
--- session is to be resumed after the reset: the agent is told not to retry by itself).
---@param self table  the route (Route:rate_wait): its rate state, deadline, holds
---@param headers table<string,string>|nil
---@param body string|nil
---@return integer|nil ms, string|nil why, boolean|nil resumable
function ratelimit.wait(self, headers, body)
  local now = loop.time()
  local w = ratelimit.reset_wait(headers, now) or ratelimit.body_reset(body, now)
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
  if self.deadline and now + w >= self.deadline - ratelimit.DEADLINE_MARGIN then
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

local function rate_file(run_id)
  return config.get("state_dir") .. "/vendor/" .. run_id .. ".json"
end

--- Saves the rate-limit state to <state_dir>/vendor/<run_id>.json (logged when it cannot).
---@param self table  the route (Route:save_rate)
function ratelimit.save(self)
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
function ratelimit.forget(run_id)
  if type(run_id) == "string" and run_id ~= "" then os.remove(rate_file(run_id)) end
end

--- The rate-limit state of a run: a fresh one with `budget`, carrying on what a previous
--- server saved for the same run (a background job re-attached after a restart).
---@param run_id string
---@param budget integer
---@return table rate
function ratelimit.load(run_id, budget)
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

return ratelimit
