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
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local providers = require("demesne.providers")
local stream = require("core.stream")
local timer = require("core.timer")

local vendor = {}

local LOGGER = "demesne.vendor"

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
  local headers = {}
  for i = 2, #lines do
    local l = lines[i]
    if l ~= "" then
      local name, value = l:match("^([!#$%%&'*+%-.^_`|~%w]+):[ \t]*(.-)[ \t]*$")
      if not name then return nil, 400, "malformed header line" end
      name = name:lower()
      if headers[name] and name ~= "content-length" then headers[name] = headers[name] .. ", " .. value
      elseif headers[name] and headers[name] ~= value then return nil, 400, "conflicting Content-Length"
      else headers[name] = value end
    end
  end
  -- an absolute-form target (a client that used the egress proxy variables) keeps its path
  local path = target:match("^https?://[^/]+(/.*)$")
  if path then target = path elseif target:match("^https?://[^/]+$") then target = "/" end
  return { method = method, target = target, version = version, headers = headers }
end

-- A body reader fed with bytes: returns "more", "done" or "error" and sets r.body / r.why.
local function body_reader(headers)
  local te = headers["transfer-encoding"]
  local r = { buf = "", parts = {}, size = 0 }
  if te then
    if te:lower():match("^%s*chunked%s*$") == nil then return nil, 501, "unsupported transfer-encoding" end
    r.chunked, r.state = true, "size"
  else
    local cl = headers["content-length"]
    if cl and not cl:match("^%d+$") then return nil, 400, "bad Content-Length" end
    r.want = tonumber(cl or "0")
    if r.want > MAX_BODY then return nil, 413, "request body too large" end
  end
  function r.feed(self, data)
    if not self.chunked then
      self.parts[#self.parts + 1] = data
      self.size = self.size + #data
      if self.size >= self.want then
        self.body = table.concat(self.parts):sub(1, self.want)
        return "done"
      end
      return "more"
    end
    self.buf = self.buf .. data
    while true do
      if self.state == "size" then
        local s, e, hex = self.buf:find("^([0-9a-fA-F]+)[^\r\n]*\r\n")
        if not s then
          if #self.buf > 1024 then self.why = "bad chunk size" return "error" end
          return "more"
        end
        self.chunk = tonumber(hex, 16)
        self.buf = self.buf:sub(e + 1)
        if self.chunk == 0 then self.state = "trailer" else self.state = "data" end
      elseif self.state == "data" then
        if #self.buf < self.chunk + 2 then return "more" end
        self.parts[#self.parts + 1] = self.buf:sub(1, self.chunk)
        self.size = self.size + self.chunk
        if self.size > MAX_BODY then self.why = "request body too large" return "error" end
        self.buf = self.buf:sub(self.chunk + 3)
        self.state = "size"
      else -- trailer: lines until an empty one
        local s, e = self.buf:find("\r\n", 1, true)
        if not s then return "more" end
        local line = self.buf:sub(1, s - 1)
        self.buf = self.buf:sub(e + 1)
        if line == "" then
          self.body = table.concat(self.parts)
          return "done"
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
-- Rate limits: an upstream 429 with a reset time is waited out here (up to a per-run budget
-- of retries, each wait at most agent_rate_limit_max_wait_seconds and before the run's
-- deadline) and the same request is sent again; the agent sees a slow answer. Otherwise
-- the 429 goes to the agent as is.

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

--- Seconds until a reset from one header value: an RFC 3339 time, an HTTP date, delta
--- seconds, or an OpenAI-style duration ("1m30s", "250ms"). nil when unreadable.
function vendor.parse_reset(value, now)
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
--- nil when no header names a reset.
function vendor.reset_wait(headers, now)
  headers = headers or {}
  now = now or loop.time()
  local ra = vendor.parse_reset(headers["retry-after"], now)
  if ra then return math.max(0, ra) end
  local best
  for k, v in pairs(headers) do
    if type(k) == "string" and (k:match("^anthropic%-ratelimit%-.+%-reset$") or k:match("^x%-ratelimit%-reset")) then
      local w = vendor.parse_reset(v, now)
      if w and (not best or w > best) then best = w end
    end
  end
  return best and math.max(0, best) or nil
end

--- Whether a 429 with these headers is waited out: the wait in ms, or nil and why not.
function Route:rate_wait(headers)
  local now = loop.time()
  local w = vendor.reset_wait(headers, now)
  local rate = self.rate
  rate.limited = rate.limited + 1
  if w then rate.reset_at = now + w end
  if rate.used >= rate.budget then return nil, ("retry budget of %d exhausted"):format(rate.budget) end
  if not w then return nil, "no reset time in the answer" end
  local max = tonumber(require("demesne.config").get("agent_rate_limit_max_wait_seconds")) or 3600
  if w > max then return nil, ("reset in %d s is beyond the longest wait (%d s)"):format(math.ceil(w), max) end
  if self.deadline and now + w >= self.deadline then return nil, "reset is after the run's timeout" end
  rate.used = rate.used + 1
  return math.max(1, math.ceil(w * 1000) + 250)
end

--- The rate-limit state of the run: {budget, used, limited, reset_at, why} (why: the
--- reason the last 429 was passed to the agent).
function Route:rate_state() return self.rate end

--- Starts the vendor route of one run. `o`: {run_id, run_dir, output_dir, provider, token,
--- credential}. Returns the route (route:stop() ends it) or nil, err.
function vendor.start(o)
  local r = setmetatable({ run_id = o.run_id, provider = o.provider, token = o.token, credential = o.credential,
    output_dir = o.output_dir, conns = {}, nconns = 0, models = {}, requests = 0, closed = false,
    deadline = o.deadline, waits = {},
    rate = { budget = vendor.rate_budget(o.rate_limit_retries), used = 0, limited = 0 },
    total = { input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 } }, Route)
  -- a route started again (a background job re-attached after a restart) keeps the totals
  local prev = fs.read_file(o.output_dir .. "/usage.json", 0, 1 << 20)
  prev = prev and json.decode(prev)
  if type(prev) == "table" and type(prev.models) == "table" then
    for name, m in pairs(prev.models) do
      if type(name) == "string" and type(m) == "table" then
        local rec = { requests = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 }
        for k in pairs(rec) do
          if type(m[k]) == "number" then rec[k] = m[k] end
        end
        r.models[name] = rec
        for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "cost_usd" }) do
          r.total[k] = r.total[k] + rec[k]
        end
        r.requests = r.requests + rec.requests
      end
    end
  end
  local file, ferr = fs.open(o.output_dir .. "/usage.jsonl", "a")
  if not file then return nil, "vendor: " .. tostring(ferr) end
  r.file = file
  r:write_totals()
  local path = o.run_dir .. "/" .. vendor.SOCKET_NAME
  local server, err = stream.listen_relay(path, function(conn) r:accept(conn) end)
  if not server then
    file:close()
    return nil, ("vendor: cannot listen on %s: %s"):format(path, tostring(err))
  end
  fs.chmod(path, 438) -- 0666: whatever user the image runs as can connect
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
      budget = self.rate.budget, reset_at = self.rate.reset_at, why = self.rate.why } or nil,
  }
end

function Route:write_totals()
  local ok, text = pcall(json.encode, self:totals())
  if ok then
    local w, err = fs.write_atomic(self.output_dir .. "/usage.json", text .. "\n")
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

local function reply(conn, status, body, ctype)
  body = body or ""
  local head = ("HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n")
    :format(status, REASONS[status] or "Error", ctype or "application/json", #body)
  conn:write(head .. body, function() conn:close() end)
end

local function error_body(p, status, message)
  -- both vendor shapes: Anthropic {type: error, error: {type, message}}, OpenAI {error: {message, type, code}}
  return json.encode({ type = "error", error = { type = status == 401 and "authentication_error"
    or status == 403 and "permission_error" or "api_error", message = "demesne vendor route: " .. message,
    code = tostring(status) } })
end

function Route:accept(conn)
  if self.closed then conn:close() return end
  self.conns[conn] = true
  self.nconns = self.nconns + 1
  local state = { buf = "", started = loop.hrtime() }
  local done = false
  -- the request (head and body) must arrive within HEAD_TIMEOUT_MS
  local deadline = timer.after(HEAD_TIMEOUT_MS, function()
    if not state.handed and not done then
      done = true
      conn:close()
      if self.conns[conn] then self.conns[conn] = nil; self.nconns = self.nconns - 1 end
    end
  end)
  local function finish()
    deadline:close()
    if done then return end
    done = true
    if self.conns[conn] then self.conns[conn] = nil; self.nconns = self.nconns - 1 end
  end
  state.finish = finish
  local reader
  conn:read_start(function(data, err)
    if done or state.handed then return end
    if data == nil then
      conn:close()
      return finish()
    end
    if not state.req then
      state.buf = state.buf .. data
      local s, e = state.buf:find("\r?\n\r?\n")
      if not s then
        if #state.buf > MAX_HEAD then
          conn:read_stop()
          reply(conn, 431, error_body(self.provider, 431, "request head too large"))
          return finish()
        end
        return
      end
      local req, status, why = vendor.parse_head(state.buf:sub(1, s - 1))
      local rest = state.buf:sub(e + 1)
      state.buf = ""
      if not req then
        conn:read_stop()
        reply(conn, status, error_body(self.provider, status, why))
        self:log_line({ time = iso_now(), verdict = "deny", status = status, reason = why })
        return finish()
      end
      state.req = req
      local br, bstatus, bwhy = body_reader(req.headers)
      if not br then
        conn:read_stop()
        reply(conn, bstatus, error_body(self.provider, bstatus, bwhy))
        return finish()
      end
      reader = br
      data = rest
    end
    local st = reader:feed(data)
    if st == "more" then return end
    conn:read_stop()
    deadline:close()
    if st == "error" then
      reply(conn, 400, error_body(self.provider, 400, reader.why))
      return finish()
    end
    state.handed = true
    self:handle(conn, state.req, reader.body, state)
  end)
end

function Route:handle(conn, req, body, state)
  local p = self.provider
  local path = req.target:match("^[^?#]*")
  local rec = { time = iso_now(), method = req.method, path = path }
  local v = providers.vendor_decide(p, { method = req.method, target = req.target, headers = req.headers },
    self.token, self.credential)
  if v.action == "local" then
    rec.verdict, rec.status = "local", v.status
    self:log_line(rec)
    conn:write(("HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"):format(v.status,
      REASONS[v.status] or "OK"), function() conn:close() end)
    return state.finish()
  end
  if v.action ~= "forward" then
    rec.verdict, rec.status, rec.reason = "deny", v.status, v.reason
    self:log_line(rec)
    log.info(LOGGER, "%s: refused %s %s: %s", self.run_id, req.method, path, tostring(v.reason))
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
    local counter
    local head_sent = false
    local retry_ms
    local function send_head(status, h)
      if status == 429 and not state.client_gone then
        local why
        retry_ms, why = self:rate_wait(h)
        rec.rate_limited = true
        if retry_ms then
          rec.status, rec.retry_in_ms = status, retry_ms
          return -- the answer is dropped; the same request goes again after the reset
        end
        rec.rate_limit = why
        self.rate.why = why
      end
      head_sent = true
      rec.status = status
      local lines = { ("HTTP/1.1 %d %s"):format(status, REASONS[status] or "Status") }
      for k, val in pairs(h or {}) do
        if not HOP[k] and k ~= "content-encoding" then lines[#lines + 1] = k .. ": " .. val end
      end
      lines[#lines + 1] = "connection: close"
      conn:write(table.concat(lines, "\r\n") .. "\r\n\r\n")
      counter = providers.usage_counter(p, h and h["content-type"])
    end
    local opts = {
      url = v.url, method = req.method, headers = headers, timeout_ms = UPSTREAM_TIMEOUT_MS,
      connect_timeout_ms = 30000,
      on_headers = send_head,
      on_data = function(chunk)
        if retry_ms then return end
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
      if retry_ms and res and not self.closed and not state.client_gone then
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
        if not head_sent then -- a dropped 429 whose retry cannot happen: the agent gets a 429
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
end
Route.__close = Route.stop

--- Stops the route of a run if one runs.
function vendor.stop(run_id)
  local r = active[run_id]
  if r then r:stop() end
end

return vendor
