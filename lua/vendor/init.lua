-- The vendor route: the credential-holding half of an agent sandbox's egress.
--
-- demesne-init relays 127.0.0.1:3129 inside an agent sandbox to <run_dir>/vendor.sock on
-- the host (--relay 3129=/.demesne/run/vendor.sock) and hands each accepted TCP socket
-- over; the route's HTTP server (core.httpd: llhttp, in C) listens there and hands each
-- complete request to Lua. Each request is a task (demesne.async) that reads straight
-- down: a verdict from providers.vendor_decide, and for `forward` the request sent
-- upstream with core.http, the run's token replaced by the real credential. The response
-- streams back to the agent chunk by chunk as it arrives (SSE flows unbuffered); its usage
-- is counted on the way (providers.usage_counter). A wait (a rate-limit hold, a session
-- resume) is an async.sleep in that task; the agent hanging up, or the route stopping,
-- cancels it.
--
-- Each request is one JSON line in <output_dir>/usage.jsonl; <output_dir>/usage.json holds
-- the totals by model and the indicative cost, rewritten atomically after each request.
-- The credential is read only when a request is forwarded and goes only into the upstream
-- request's headers: it is never logged, written or put into the sandbox.
local async = require("demesne.async")
local config = require("demesne.config")
local fs = require("core.fs")
local http = require("core.http")
local httpd = require("core.httpd")
local json = require("demesne.json")
local layer = require("demesne.layer")
local log = require("demesne.log")
local loop = require("core.loop")
local providers = require("demesne.providers")
local rate = require("demesne.vendor.rate")
local util = require("demesne.util")

local vendor = {}

local LOGGER = "demesne.vendor"

-- The layers above (nested sandboxes, lua/tree) meet each model request through the layer
-- hooks (lua/layer.lua, which states their error policies), each called with the run id:
--   vendor_admit(run_id, resv) -> true | nil, why, spent
--       before a model request is forwarded, with its reservation `resv` = {id (unique),
--       usd (the most it can cost: providers.reservation; lowered once the answer's
--       message_start gives the input counts), model, input, output}. A refusal answers the
--       agent with `why`; `spent` true when the budget is spent (no later request can pass),
--       false when only the requests in flight leave no room for this one. A refused
--       reservation is given back to every charge hook (Route:reserve).
--   vendor_charge(run_id, usd, usage, resv)
--       once the request ended, whatever ended it (answered, cut, cancelled, the route
--       stopping): usage (ProviderUsage) and its cost, which gives `resv` back; usage nil
--       (and usd 0) when nothing is to be counted (refused, a 429, an error answer, never sent).

--- The vendor port inside an agent sandbox.
vendor.PORT = 3129
vendor.SANDBOX_SOCKET = "/.demesne/run/vendor.sock"
vendor.SOCKET_NAME = "vendor.sock"

local MAX_HEAD = 64 * 1024
local MAX_BODY = 64 * 1024 * 1024
local REQUEST_TIMEOUT_MS = 60 * 1000 -- a request must arrive whole within this of its first byte
local IDLE_MARGIN = 16 -- connections past vendor_max_connections the server holds before it cuts new ones
local UPSTREAM_TIMEOUT_MS = 30 * 60 * 1000

--- The in-sandbox base URL of the vendor route.
---@return string
function vendor.base_url() return ("http://127.0.0.1:%d"):format(vendor.PORT) end

--- The demesne-init options that start the relay of the vendor port.
---@return string[]
function vendor.relay_args() return { "--relay", ("%d=%s"):format(vendor.PORT, vendor.SANDBOX_SOCKET) } end

local iso_now = util.iso_now

-- The body of core.httpd's own refusals (malformed, too large, too slow), in the vendors'
-- JSON error shape.
local REFUSAL_BODY = '{"type":"error","error":{"type":"api_error","message":"demesne vendor route: %s"}}'

-- Headers that describe the hop, not the message: never copied across the proxy.
local HOP = { connection = true, ["keep-alive"] = true, ["proxy-connection"] = true, ["transfer-encoding"] = true,
  ["content-length"] = true, te = true, trailer = true, upgrade = true, host = true, expect = true,
  ["proxy-authorization"] = true, ["proxy-authenticate"] = true }

--------------------------------------------------------------------------------------------
-- The per-run route

local Route = {}
Route.__index = Route

local active = {} -- run_id -> route
-- Body bytes the servers of every route hold while reading them (core.httpd), within
-- vendor_max_buffered_bytes_total too: a chunked body is charged (Route:hold) only once read.
local reading = httpd.pool(0, "the vendor routes of all sandboxes are reading more request body bytes at once than "
  .. "the server's ceiling (vendor_max_buffered_bytes_total in the demesne configuration); retry later")

-- Rate limits (lua/vendor/rate.lua): the route's methods, and the readers of reset times
-- callers and tests use through demesne.vendor.
Route.rate_wait, Route.save_rate = rate.wait, rate.save
vendor.rate_budget, vendor.parse_reset, vendor.reset_wait, vendor.body_reset = rate.budget, rate.parse_reset,
  rate.reset_wait, rate.body_reset
vendor.DEADLINE_MARGIN = rate.DEADLINE_MARGIN

-- The host's copy of a run's totals (Route:write_totals), out of the sandbox's reach.
local function totals_file(run_id) return config.get("state_dir") .. "/vendor/" .. run_id .. ".usage.json" end

--- Forgets what the host saved of a finished run's route: its rate-limit state and totals.
---@param run_id string
function vendor.forget(run_id)
  rate.forget(run_id)
  if type(run_id) == "string" and run_id:match("^[%w][%w%-]*$") then os.remove(totals_file(run_id)) end
end

--- The rate-limit state of the run (saved in <state_dir>/vendor/<run_id>.json): budget,
--- used (holds + resumes), held, resumed, limited (429 answers seen), reset_at (epoch s),
--- passed_at (when a 429 last went to the agent), why (the reason a rate-limited run
--- ended), decided (attempt number -> the answer given to the agent's wrapper).
---@return table
function Route:rate_state() return self.rate end

--- Starts the vendor route of one run. `o`: {run_id, run_dir, output_dir, provider, token,
--- credential, deadline (epoch s, optional), decide (optional: function(route, {attempt,
--- exit_code}) -> {action = "resume", session, at} | {action = "stop", why}; answers the
--- agent wrapper's POST /.demesne/attempt, see lua/agent/resume.lua), holds (false: never hold a
--- rate-limited request; default true)}. A route started again for the same run (a
--- restarted server) takes up its usage totals and rate-limit state. Returns the route
--- (route:stop() ends it) or nil, err.
---@param o {run_id: string, run_dir: string, output_dir: string, provider: ProviderAdapter, token: string, credential: ProviderCredential, deadline: number|nil, decide: function|nil, holds: boolean|nil, rate_limit_retries: integer|nil}
---@return table|nil route, string|nil err
function vendor.start(o)
  local r = setmetatable({ run_id = o.run_id, provider = o.provider, token = o.token, credential = o.credential,
    output_dir = o.output_dir, tasks = {}, forwarding = 0, buffered = 0, admitted = {}, models = {}, requests = 0,
    closed = false, resv_tag = util.random_hex(4),
    deadline = o.deadline, decide = o.decide, holds = o.holds ~= false,
    rate = rate.load(o.run_id, rate.budget(o.rate_limit_retries)),
    total = { input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 } }, Route)
  -- the output folder is the sandbox's to write: held by descriptor, every file in it
  -- opened confined (no link, no FIFO; core.fs.dir), so a restarted server never blocks here
  local out, oerr = fs.opendir(o.output_dir)
  if not out then return nil, "vendor: " .. tostring(oerr) end
  r.out = out
  -- a route started again (a background job re-attached after a restart) keeps the totals
  -- it saved on the host (never usage.json in /out: the sandbox can write that); only
  -- finite counts are taken
  local prev = fs.read_file(totals_file(o.run_id), 0, 1 << 20)
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
  -- vendor_max_connections is enforced when a request head arrives (Route:on_head: a 503
  -- naming the ceiling, and a line in usage.jsonl); connections that send nothing are cut
  -- by the server itself past IDLE_MARGIN more (each holds descriptors on the host)
  r.max_conns = math.max(1, math.floor(config.get("vendor_max_connections")))
  -- every head is judged before its body is read (Route:on_head); the body bytes the server
  -- holds while reading them are bounded by the route's ceiling, and with every other
  -- route's by the total (a chunked body's size is not known at its head)
  local route_max = math.max(1, math.floor(config.get("vendor_max_buffered_bytes")))
  reading:set_max(math.max(1, math.floor(config.get("vendor_max_buffered_bytes_total"))))
  local server = httpd.new({ max_body = MAX_BODY, max_head = MAX_HEAD, request_timeout_ms = REQUEST_TIMEOUT_MS,
      max_conns = r.max_conns + IDLE_MARGIN, error_body = REFUSAL_BODY, error_type = "application/json",
      max_buffered = route_max, max_buffered_why = ("this sandbox's request bodies being read on its vendor route are "
        .. "over its ceiling of %d bytes (vendor_max_buffered_bytes in the demesne configuration); send fewer or "
        .. "smaller requests at once"):format(route_max), pool = reading },
    function(conn, req) r:on_request(conn, req) end,
    function(conn) r:on_close(conn) end,
    function(conn, head) r:on_head(conn, head) end)
  local ok, err = server:listen_relay(path, { tag = o.run_id })
  if not ok then
    server:close()
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
---@param run_id string
---@return table|nil route
function vendor.get(run_id) return active[run_id] end

--- Appends one request's line to usage.jsonl.
---@param rec table  time, method, path, verdict, status, tokens, cost_usd, …
function Route:log_line(rec)
  if not self.file then return end
  local ok, line = pcall(json.encode, rec)
  if ok then self.file:write(line .. "\n") end
end

--- Totals as written to usage.json: {models = {name = {requests, input, output,
--- cache_creation, cache_read, cost_usd}}, requests, input, output, cache_creation,
--- cache_read, cost_usd, indicative = true}.
---@return table
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

--- Rewrites usage.json atomically with the totals (logged when it cannot), and the host's
--- own copy of them, <state_dir>/vendor/<run id>.usage.json (0600), which a route started
--- again for the run takes up.
function Route:write_totals()
  local ok, text = pcall(json.encode, self:totals())
  if ok then
    local w, err = nil, "the route is stopped"
    if self.out then w, err = self.out:write_atomic("usage.json", text .. "\n") end
    if not w then log.warning(LOGGER, "%s: usage.json: %s", self.run_id, tostring(err)) end
    local f = totals_file(self.run_id)
    fs.mkdir_p(f:match("^(.*)/"), 448) -- 0700
    local hw, herr = fs.write_atomic(f, text .. "\n", 384)
    if not hw then log.warning(LOGGER, "%s: %s: %s", self.run_id, f, tostring(herr)) end
  end
end

--- Adds one response's usage to the totals of its model. Returns its indicative cost in
--- USD and whether the model has a price.
---@param usage ProviderUsage
---@param usd number|nil  the cost when already known (a reservation charged whole), else priced here
---@return number usd, boolean priced
function Route:count(usage, usd)
  local model = usage.model or "unknown"
  local priced
  if usd then priced = providers.price_for(self.provider.prices, model) ~= nil
  else usd, priced = self.provider.cost(usage) end
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

--- Tells the charge hooks (the layer hook vendor_charge) of one ended request.
---@param usd number          its indicative cost (0 with no usage)
---@param usage ProviderUsage|nil  nil: nothing counted, the reservation is only given back
---@param resv table|nil      its reservation (the layer hook vendor_admit)
function Route:charge(usd, usage, resv)
  layer.run("vendor_charge", self.run_id, usd, usage, resv)
end

--------------------------------------------------------------------------------------------
-- Serving. core.httpd (llhttp, in C) reads each request: its head, judged by Route:on_head
-- before any body byte is read (a refusal closes the connection), then a Content-Length or
-- chunked body, within the limits below; what is malformed or too large never reaches
-- Lua (it is answered 400, 413, 431, 503 or 408 by the server). Each request is then a task
-- that reads straight down: decide, answer or forward. A connection may carry several
-- requests (keep-alive); their answers go out in order.

local function error_body(status, message)
  -- both vendor shapes: Anthropic {type: error, error: {type, message}}, OpenAI {error: {message, type, code}}
  return json.encode({ type = "error", error = { type = status == 401 and "authentication_error"
    or status == 403 and "permission_error" or "api_error", message = "demesne vendor route: " .. message,
    code = tostring(status) } })
end

-- An error answer in the vendor's JSON shape.
local function refuse(conn, status, message)
  return conn:respond(status, { ["content-type"] = "application/json" }, error_body(status, message))
end

-- Request bytes held by every route together (bodies being sent or held for a retry).
local buffered_total = 0

--- Bytes of request bodies all vendor routes hold now (tests, diagnostics).
---@return integer
function vendor.buffered() return buffered_total end

--- Holds `n` bytes of request body for one request of this route, within
--- vendor_max_buffered_bytes (this route) and vendor_max_buffered_bytes_total (every route):
--- a Content-Length body is charged at its head, before core.httpd reads it (Route:on_head),
--- a chunked one once read; it stays in the server's memory until its request ends, a
--- rate-limit hold included. Returns the bytes held (give them back with Route:release), or
--- nil and the sentence for the 503.
---@param n integer
---@return integer|nil held, string|nil why
function Route:hold(n)
  local route_max = math.floor(config.get("vendor_max_buffered_bytes"))
  local total_max = math.floor(config.get("vendor_max_buffered_bytes_total"))
  if self.buffered + n > route_max then
    return nil, ("this sandbox's requests on its vendor route would hold %d bytes of bodies at once, over its "
      .. "ceiling of %d (vendor_max_buffered_bytes in the demesne configuration); send fewer or smaller requests at "
      .. "once"):format(self.buffered + n, route_max)
  end
  if buffered_total + n > total_max then
    return nil, ("the vendor routes of all sandboxes would hold %d bytes of request bodies at once, over the "
      .. "server's ceiling of %d (vendor_max_buffered_bytes_total in the demesne configuration); retry "
      .. "later"):format(buffered_total + n, total_max)
  end
  self.buffered = self.buffered + n
  buffered_total = buffered_total + n
  return n
end

--- Gives back `n` bytes Route:hold held.
---@param n integer
function Route:release(n)
  self.buffered = self.buffered - n
  buffered_total = buffered_total - n
end

--- A request the route refused: one line in usage.jsonl (the sandbox's own file, with the
--- path cut), and a log record for the first refusal and then at most one every 10 s with
--- the count since: a sandbox that floods its route must not flood the server's log or the
--- client's notifications.
---@param rec table   the usage.jsonl line (method, path, verdict, status, reason)
---@param why string  the reason
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

-- A refusal of the layer above (a tree's budget) in both vendors' error shape, with status
-- 400 as the vendors answer a spent balance: neither CLI retries a 400 (both retry 402 and
-- 403, and Claude Code reads 403 as a failed login), so the run ends at once with the
-- message shown.
local REFUSED_STATUS = 400
local function refusal_body(message, spent)
  return json.encode({ type = "error", error = { type = "invalid_request_error", code = "budget_exceeded",
    message = "demesne vendor route: " .. message
      .. (spent and "; no further model requests are sent for this tree" or "") } })
end

--- Reserves one model request against the layers above (the layer hook vendor_admit)
--- before it is forwarded. Returns the reservation {id, usd, model, input, output, est}, or
--- nil, the refusal's sentence and whether the budget is spent (a refused reservation is
--- given back to the charge hooks).
---@param est ProviderReservation  providers.reservation of the request
---@return table|nil resv, string|nil why, boolean|nil spent
function Route:reserve(est)
  self.reservations = (self.reservations or 0) + 1
  local resv = { id = ("%s-%s-%d"):format(self.run_id, self.resv_tag, self.reservations), usd = est.usd,
    model = est.model, input = est.input, output = est.output, est = est }
  local ok, why, spent = layer.run("vendor_admit", self.run_id, resv)
  if not ok then
    self:charge(0, nil, resv)
    return nil, why, spent
  end
  return resv
end

-- The target as a path-first target (an absolute-form one, from a client that used the
-- egress proxy variables, keeps its path) and its path.
local function target_path(raw)
  local target = raw:match("^https?://[^/]+(/.*)$") or (raw:match("^https?://[^/]+$") and "/") or raw
  return target, target:match("^[^?#]*")
end

--- core.httpd's on_head: judges a request from its head, before any byte of its body is
--- read: a stopping route, the connection ceiling, a wrong token or a path the provider does
--- not allow are refused here (the connection then closes), with the same answers and
--- usage.jsonl lines as before. A Content-Length body is charged whole here against
--- vendor_max_buffered_bytes and vendor_max_buffered_bytes_total (Route:hold), and refused
--- 503 when it does not fit; a chunked body is charged once it has arrived (Route:serve),
--- the servers keeping the bytes they read within vendor_max_buffered_bytes (this route's)
--- and vendor_max_buffered_bytes_total (every route's, one core.httpd.pool) meanwhile.
---@param conn userdata  a core.httpd.conn
---@param head table     {method, target, headers, content_length, chunked, …} (core.httpd)
function Route:on_head(conn, head)
  if self.closed then return refuse(conn, 503, "the run's vendor route has stopped") end
  local open = self.server and self.server:connections() or 0
  if open > self.max_conns then
    local why = ("this sandbox has %d connections open on its vendor route, over its ceiling of %d "
      .. "(vendor_max_connections in the demesne configuration); close some and retry"):format(open, self.max_conns)
    self.refused = (self.refused or 0) + 1
    if self.refused == 1 or loop.now() - (self.refused_logged or 0) >= 1000 then
      self.refused_logged = loop.now()
      self:log_line({ time = iso_now(), verdict = "deny", status = 503, reason = why, refused = self.refused })
    end
    return refuse(conn, 503, why)
  end
  local target, path = target_path(head.target)
  local rec = { time = iso_now(), method = head.method, path = path }
  if path == vendor.ATTEMPT_PATH then
    -- a wrong token is answered (and logged) by attempt_end before it reads the body
    if not providers.token_equal(providers.bearer(head.headers), self.token) then
      return self:attempt_end(conn, head, rec)
    end
  else
    local v = providers.vendor_decide(self.provider, { method = head.method, target = target, headers = head.headers },
      self.token, self.credential)
    if v.action ~= "forward" and v.action ~= "local" then
      rec.verdict, rec.status, rec.reason = "deny", v.status, v.reason
      self:note_refusal(rec, tostring(v.reason))
      return refuse(conn, v.status or 403, v.reason or "refused")
    end
  end
  if head.content_length > 0 then
    local held, hwhy = self:hold(head.content_length)
    if not held then
      rec.verdict, rec.status, rec.reason = "deny", 503, hwhy
      self:note_refusal(rec, hwhy)
      return refuse(conn, 503, hwhy)
    end
    self.admitted[conn] = held
  end
end

--- core.httpd's on_request: serves one request in a task of its own, with the body bytes
--- Route:on_head charged for it (given back when the request ends). A route that is
--- stopping answers 503.
---@param conn userdata  a core.httpd.conn
---@param req table      {method, target, headers, body, …} (core.httpd)
function Route:on_request(conn, req)
  local pre = self.admitted[conn]
  self.admitted[conn] = nil
  if self.closed then
    if pre then self:release(pre) end
    return refuse(conn, 503, "the run's vendor route has stopped")
  end
  local task
  task = async.spawn("vendor " .. self.run_id, function()
    -- a request left unanswered (cancelled, or an error) cuts its connection
    local _ <close> = util.closer(function(err)
      if task then self.tasks[task] = nil end
      if pre then self:release(pre) end
      if err ~= nil then conn:close() end
    end)
    self:serve(conn, req, pre ~= nil)
  end)
  if not task.done then self.tasks[task] = conn end
end

--- core.httpd's on_close: the agent's connection is gone, so are the requests it carried
--- (a request being forwarded is cancelled upstream too), and the bytes charged for a body
--- it did not finish sending.
---@param conn userdata
function Route:on_close(conn)
  local pre = self.admitted[conn]
  if pre then
    self.admitted[conn] = nil
    self:release(pre)
  end
  for task, c in pairs(self.tasks) do
    if c == conn then async.cancel(task, "the agent closed the connection") end
  end
end

--- The path on the vendor port where an agent's wrapper reports that an attempt of its CLI
--- ended: POST with `Authorization: Bearer <run token>` and a JSON body {attempt (1, 2, …),
--- exit_code}. The answer (text/plain) is `resume <session>`, sent once the rate limit has
--- reset, or `stop`.
vendor.ATTEMPT_PATH = "/.demesne/attempt"
vendor.ATTEMPTS_MAX = 1000

--- Answers the agent's wrapper on ATTEMPT_PATH (see there). A resume is answered once the
--- reset has passed: the task sleeps until then (a route that stops meanwhile closes the
--- connection unanswered).
---@param conn userdata  the core.httpd.conn to answer on
---@param req table        {method, target, headers, body}
---@param rec table        the usage.jsonl line of this request
function Route:attempt_end(conn, req, rec)
  local function answer(status, text)
    rec.status = status
    self:log_line(rec)
    conn:respond(status, { ["content-type"] = "text/plain; charset=utf-8" }, text)
  end
  rec.verdict = "local"
  if not providers.token_equal(providers.bearer(req.headers), self.token) then
    rec.verdict, rec.reason = "deny", "the request does not carry this run's token"
    answer(401, "the request does not carry this run's token\n")
    return
  end
  if req.method ~= "POST" then
    answer(405, "POST only\n")
    return
  end
  local ok, info = pcall(json.decode, req.body or "")
  local n = ok and type(info) == "table" and type(info.attempt) == "number" and math.tointeger(info.attempt)
  local code = ok and type(info) == "table" and type(info.exit_code) == "number" and math.tointeger(info.exit_code)
  if not n or n < 1 or n > vendor.ATTEMPTS_MAX or not code then
    answer(400, ("body: must be JSON {attempt: integer 1..%d, exit_code: integer}\n"):format(vendor.ATTEMPTS_MAX))
    return
  end
  rec.attempt, rec.exit_code = n, code
  -- Each attempt is decided once, in order (the wrapper reports 1, then 2 after a resume …),
  -- and nothing after a stop: deciding reads the whole transcript, and a sandbox that
  -- floods this path with reports must not make the server read it again and again. A
  -- report of an attempt already decided (a wrapper asking again after a server restart)
  -- gets the same answer.
  local rs = self.rate
  local last = math.tointeger(rs.last_attempt) or 0
  local d = { action = "stop" }
  if n <= last or rs.stopped then
    local kept = type(rs.decided) == "table" and rs.decided[tostring(n)]
    if n <= last and type(kept) == "table" and kept.action == "resume" then d = kept end
    rec.cached = true
  elseif n > last + 1 then
    answer(409, ("attempt %d reported before attempt %d\n"):format(n, last + 1))
    return
  else
    if self.decide then
      local dok, got = pcall(self.decide, self, { attempt = n, exit_code = code })
      if dok and type(got) == "table" then d = got
      else log.warning(LOGGER, "%s: deciding on attempt %d: %s", self.run_id, n, tostring(got)) end
    end
    rs.last_attempt = n
    if d.action == "resume" then
      rs.decided = type(rs.decided) == "table" and rs.decided or {}
      rs.decided[tostring(n)] = d
    else
      rs.stopped = true
    end
    self:save_rate()
  end
  rec.decision = d.action
  if d.action ~= "resume" then
    answer(200, "stop\n")
    return
  end
  local wait_ms = math.max(0, math.ceil(((d.at or 0) - loop.time()) * 1000))
  rec.resume_in_ms = wait_ms
  if not rec.cached then
    log.info(LOGGER, "%s: attempt %d ended rate limited; resuming session %s in %d ms", self.run_id, n,
      log.printable(d.session, 200), wait_ms)
  end
  async.sleep(wait_ms)
  answer(200, "resume " .. d.session .. "\n")
end

--- Serves one request read whole: the attempt endpoint, the provider's local answers and
--- refusals (providers.vendor_decide), or the forward upstream with the real credential.
--- A request a previous server was holding for a rate-limit reset waits for that reset
--- first; a 429 the route holds is waited out and the request sent again.
---@param conn userdata  the core.httpd.conn to answer on
---@param req table        {method, target, headers, body}
---@param charged boolean|nil  the body was charged at its head (Route:on_head; the caller gives it back)
function Route:serve(conn, req, charged)
  local target, path = target_path(req.target)
  local rec = { time = iso_now(), method = req.method, path = path }
  if path == vendor.ATTEMPT_PATH then
    self:attempt_end(conn, req, rec)
    return
  end
  local v = providers.vendor_decide(self.provider, { method = req.method, target = target, headers = req.headers },
    self.token, self.credential)
  if v.action == "local" then
    rec.verdict, rec.status = "local", v.status
    self:log_line(rec)
    conn:respond(v.status, {}, "")
    return
  end
  if v.action ~= "forward" then
    rec.verdict, rec.status, rec.reason = "deny", v.status, v.reason
    self:note_refusal(rec, tostring(v.reason))
    refuse(conn, v.status or 403, v.reason or "refused")
    return
  end
  -- the body stays in memory until the request ends (a rate-limit hold included): bounded,
  -- charged at its head already when it came with a Content-Length
  local held, hwhy = 0, nil
  if not charged then held, hwhy = self:hold(#(req.body or "")) end
  if not held then
    rec.verdict, rec.status, rec.reason = "deny", 503, hwhy
    self:note_refusal(rec, hwhy)
    refuse(conn, 503, hwhy)
    return
  end
  local _held <close> = util.closer(function() self:release(held) end)
  rec.verdict = "forward"
  -- a hold that a previous server started (the agent's held connection dropped with it and
  -- the CLI sent the request again): wait for the same reset before sending it
  local until_ = self.rate.holding_until
  local left = type(until_) == "number" and until_ - loop.time() or 0
  if left > 0 then
    rec.held_ms = math.ceil(left * 1000)
    async.sleep(rec.held_ms)
    self.rate.holding_until = nil
    rec.time = iso_now()
  end
  -- what the request may cost at most (its body's size as input, its max_tokens as output)
  local est = providers.reservation(self.provider, req.body)
  while true do
    -- the tree's budget: reserved before each send (again when a held request is sent
    -- after its reset), given back or charged once the request ended
    local resv, refusal, spent = self:reserve(est)
    if not resv then
      rec.verdict, rec.status, rec.reason = "deny", REFUSED_STATUS, refusal
      self:note_refusal(rec, refusal)
      conn:respond(REFUSED_STATUS, { ["content-type"] = "application/json" }, refusal_body(refusal, spent))
      return
    end
    local retry_ms = self:forward(conn, req, v, rec, resv)
    if not retry_ms then return end
    -- rate limited: this answer is logged, the reset waited for, the request sent again
    log.info(LOGGER, "%s: rate limited (429); retrying %s in %d ms", self.run_id, path, retry_ms)
    rec = { time = iso_now(), method = req.method, path = path, verdict = "forward", retry = true }
    async.sleep(retry_ms) -- the agent hanging up meanwhile cancels this task (Route:on_close)
    self.rate.holding_until = nil
    rec.time = iso_now() -- when it is sent again
  end
end

-- The headers of an upstream answer that go to the agent: not the hop's, and no
-- content-encoding (identity was asked for; the body goes as it came).
local function answer_headers(h)
  local out = {}
  for k, val in pairs(h or {}) do
    if not HOP[k] and k ~= "content-encoding" then out[k] = val end
  end
  return out
end

-- A 429 read whole, and the route's decision on it: the wait in ms when the request is
-- held and sent again, else nil after the answer went to the agent (`x-should-retry:
-- false` when its CLI must not retry into the limit by itself).
local function decide_429(self, conn, limited, rec)
  local body = table.concat(limited.parts)
  local retry_ms, why, resumable = self:rate_wait(limited.headers, body)
  if retry_ms then
    rec.status, rec.retry_in_ms = 429, retry_ms
    return retry_ms
  end
  rec.rate_limit = why
  local h = answer_headers(limited.headers)
  -- the host waits for the reset and resumes the session, or the run cannot wait for it:
  -- either way the CLI must not retry into the limit (without a reset time its own short
  -- backoff may still help)
  if resumable then rec.resume = true end
  if resumable or why ~= "no reset time in the answer" then
    h["retry-after"] = nil
    h["x-should-retry"] = "false"
  end
  if not resumable then
    self.rate.why = why
    self:save_rate()
  end
  rec.status = 429
  conn:respond(429, h, body)
  return nil
end

-- Failures before an answer's head that prove nothing reached the vendor: nothing is charged.
local NOT_SENT = { ESTART = true, ECONNREFUSED = true, ENETUNREACH = true, EHOSTUNREACH = true, EAI_NONAME = true,
  EAI_AGAIN = true, EAI_FAIL = true, EINVAL = true, ENOMEM = true }

--- What one forwarded request is charged once it ended, from how it ended (`st`: status,
--- head_sent, complete, code, counter) and its reservation: the usage the answer gave; for
--- an answer that did not end (cut mid-stream, the agent gone, the route stopping) or a
--- success without usage, the input it gave (message_start) and the reserved output, or the
--- whole reservation (providers.reserved_usage); nothing for a request that never reached
--- the vendor, a 429 or an error answer without usage. Returns usage (nil: nothing), its
--- cost when it is a reservation's, and how it was found ("answer", "cut", "reserved").
---@param st table
---@param resv table
---@return ProviderUsage|nil usage, number|nil usd, string|nil how
function Route:charge_of(st, resv)
  local p = self.provider
  if st.limited then return nil end
  if not st.head_sent then
    if st.code and NOT_SENT[st.code] then return nil end
    -- sent and no answer yet (a timeout, a reset, cancelled): the vendor may be writing it
    local u, usd = providers.reserved_usage(p, resv.est, nil)
    return u, usd, "reserved"
  end
  local usage = st.counter and (st.complete and st.counter:finish() or st.counter:partial())
  if st.status and st.status >= 400 then return usage, nil, usage and "answer" or nil end
  if st.complete and usage then return usage, nil, "answer" end
  local u, usd = providers.reserved_usage(p, resv.est, usage)
  return u, (not usage) and usd or nil, usage and "cut" or "reserved"
end

--- Settles one forwarded request however it ended (Route:forward's closer): counts and
--- charges it once (Route:charge_of), gives its reservation back, and logs its line unless
--- it is to be sent again (`retry`: its line went out before the wait).
---@param st table        how the request ended (Route:forward)
---@param rec table       its usage.jsonl line
---@param resv table      its reservation
---@param started integer loop.hrtime() when it was sent
---@param err any         the error that ended Route:forward, if any (a cancel included)
---@param retry boolean|nil
function Route:settle(st, rec, resv, started, err, retry)
  if err ~= nil then
    rec.error = rec.error or tostring(err == async.CANCELLED and "cancelled" or err)
    rec.duration_ms = rec.duration_ms or math.floor((loop.hrtime() - started) / 1e6)
  end
  local usage, usd, how = self:charge_of(st, resv)
  if usage then
    rec.model = usage.model
    rec.id = usage.id
    for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "reasoning" }) do rec[k] = usage[k] end
    if how ~= "answer" then rec.charged = how end
    self.requests = self.requests + 1
    rec.cost_usd = self:count(usage, usd)
    self:charge(rec.cost_usd, usage, resv)
  else
    self:charge(0, nil, resv)
  end
  if not retry then
    -- the totals first: whoever sees the request's line (a test, a server killed right
    -- after) finds it counted in them
    self:write_totals()
    self:log_line(rec)
  end
end

--- The core.http request options of one forward: the verdict's URL and headers (without
--- hop-by-hop ones) and the callbacks that stream the answer to the agent as it arrives,
--- count its usage (st.counter; the reservation shrinks once the input counts are known)
--- and read a 429 aside (st.limited_answer) instead of passing it on.
---@param conn userdata    the core.httpd.conn to answer on
---@param req table        {method, target, headers, body}
---@param v VendorVerdict  a "forward" verdict
---@param rec table        the usage.jsonl line of this attempt
---@param resv table       its reservation
---@param st table         how the request ended (Route:forward), filled in here
---@return table opts
function Route:upstream_options(conn, req, v, rec, resv, st)
  local p = self.provider
  local headers = {}
  for k, val in pairs(v.headers) do
    if not HOP[k] then headers[k] = val end
  end
  local opts = {
    url = v.url, method = req.method, headers = headers, timeout_ms = UPSTREAM_TIMEOUT_MS,
    connect_timeout_ms = 30000,
    on_headers = function(status, h)
      if status == 429 then
        st.limited_answer = { headers = h or {}, parts = {}, size = 0 }
        st.limited = true
        rec.rate_limited = true
        return
      end
      st.head_sent, st.status = true, status
      rec.status = status
      conn:start(status, answer_headers(h))
      st.counter = providers.usage_counter(p, h and h["content-type"])
    end,
    on_data = function(chunk)
      local limited = st.limited_answer
      if limited then
        if limited.size < 65536 then
          limited.parts[#limited.parts + 1] = chunk
          limited.size = limited.size + #chunk
        end
        return
      end
      local counter = st.counter
      if counter then
        counter:feed(chunk)
        -- the input counts are known (message_start): the reservation shrinks to them and
        -- the output it still may write
        if not st.refined then
          local part = counter:partial()
          if part then
            st.refined = true
            local _, usd = providers.reserved_usage(p, resv.est, part)
            resv.usd = usd
          end
        end
      end
      -- the agent hung up (or reads too slowly and was cut): stop the upstream call too
      if not conn:write(chunk) and st.upstream then st.upstream:cancel() end
    end,
  }
  if req.method ~= "GET" and req.method ~= "HEAD" then opts.body = req.body or "" end
  return opts
end

--- Sends the upstream request of `opts` and waits for its end, counted among the requests
--- being forwarded (Route:stop waits for them); a cancel of the task cancels it. Returns
--- what core.http's callback gives (res or nil, msg, code), code "ESTART" when the request
--- could not start; st.upstream holds the request meanwhile.
---@param opts table  Route:upstream_options
---@param st table    how the request ended (Route:forward)
---@return table|nil res, string|nil msg, string|nil code
function Route:send_upstream(opts, st)
  self.forwarding = self.forwarding + 1
  local _ <close> = util.closer(function()
    self.forwarding = self.forwarding - 1
    if self.forwarding == 0 and self.idle then self.idle.set() end
  end)
  local start_err
  return async.await(function(cb)
    st.upstream, start_err = http.request(opts, cb)
    if not st.upstream then return cb(nil, start_err, "ESTART") end
    return function() st.upstream:cancel() end
  end)
end

--- Ends the agent's side of a forwarded request once the upstream one ended: the streamed
--- answer finished or cut, a 502/504 when none had started, a held 429 decided on
--- (decide_429). Returns the wait in ms when the request is to be sent again (its line is
--- logged now, before the wait), else nil.
---@param conn userdata  the core.httpd.conn to answer on
---@param st table       how the request ended (Route:forward)
---@param rec table      the usage.jsonl line of this attempt
---@param res table|nil  core.http's result
---@param msg string|nil
---@param code string|nil
---@return integer|nil retry_ms
function Route:answer_forwarded(conn, st, rec, res, msg, code)
  if code == "ESTART" then
    rec.status, rec.error = 502, tostring(msg)
    refuse(conn, 502, "cannot start the upstream request")
    return nil
  end
  if st.limited_answer and res and not self.closed and conn:is_open() then
    local retry_ms = decide_429(self, conn, st.limited_answer, rec)
    if retry_ms then
      -- logged here, before the wait: the closer gives the reservation back
      self:write_totals()
      self:log_line(rec)
      return retry_ms
    end
  elseif not res then
    rec.error = tostring(msg)
    if st.head_sent then
      conn:close() -- cut mid-answer: the agent sees a stream that did not end
    else
      rec.status = code == "ETIMEDOUT" and 504 or 502
      refuse(conn, rec.status, "upstream failed: " .. tostring(msg))
    end
  elseif st.head_sent then
    conn:finish()
  else
    -- a 429 read while the route was closing or the agent had gone
    refuse(conn, 429, "rate limited by the vendor")
  end
  return nil
end

--- Sends one request upstream with the real credential and streams the answer to the
--- agent as it arrives (SSE unbuffered), counting its usage on the way. A 429 is read
--- whole and decided on (Route:rate_wait). Returns the wait in ms when the route holds the
--- request and sends it again, else nil once the answer went out (or could not). However
--- it ends (a cancel included: the agent hung up, the route stopped), the request is
--- counted and charged once (Route:settle), its reservation given back, its line logged.
---@param conn userdata  the core.httpd.conn to answer on
---@param req table        {method, target, headers, body}
---@param v VendorVerdict  a "forward" verdict
---@param rec table        the usage.jsonl line of this attempt (logged here)
---@param resv table       its reservation (Route:reserve)
---@return integer|nil retry_ms
function Route:forward(conn, req, v, rec, resv)
  -- how the request ended: status, head_sent, complete, code, counter, limited (and the
  -- 429's answer, limited_answer), upstream (the core.http request)
  local st = {}
  local started = loop.hrtime()
  local retry
  local _settle <close> = util.closer(function(err) self:settle(st, rec, resv, started, err, retry) end)
  local opts = self:upstream_options(conn, req, v, rec, resv, st)
  local res, msg, code = self:send_upstream(opts, st)
  st.complete, st.code = res ~= nil, code
  rec.duration_ms = math.floor((loop.hrtime() - started) / 1e6)
  local retry_ms = self:answer_forwarded(conn, st, rec, res, msg, code)
  retry = retry_ms ~= nil
  return retry_ms
end

--- Stops the route: new requests are answered 503; inside a task it waits up to 5 s for
--- requests being forwarded, then cancels what is left (held requests, pending answers)
--- and closes the server (its relay socket and every connection). usage.json is final
--- afterwards. Idempotent.
function Route:stop()
  if self.closed then return end
  self.closed = true
  if active[self.run_id] == self then active[self.run_id] = nil end
  if self.forwarding > 0 and async.current() then
    self.idle = async.event()
    local ok, err = pcall(async.timeout, 5000, self.idle.wait)
    if not ok and err == async.CANCELLED then error(err, 0) end
  end
  for task in pairs(self.tasks) do async.cancel(task, "the vendor route stopped") end
  self.tasks = {}
  if self.server then self.server:close() self.server = nil end
  self:write_totals()
  if self.file then self.file:close() self.file = nil end
  if self.out then self.out:close() self.out = nil end
end
Route.__close = Route.stop

--- Stops the route of a run if one runs.
---@param run_id string
function vendor.stop(run_id)
  local r = active[run_id]
  if r then r:stop() end
end

return vendor
