-- Egress: the per-sandbox proxy listeners, and the proxy settings a sandbox gets.
--
-- A sandbox has no network (network mode none). demesne-init relays 127.0.0.1:3128 inside
-- it to <run_dir>/egress.sock on the host; core.proxy listens there, parses each request
-- head and asks the sandbox's policy (lua/egress/policy.lua) for a verdict on the *name*
-- (before any DNS lookup). After an allow, C resolves the name itself and dials only an
-- address that passes the address checks (loopback, private, link-local, metadata, IPv6…
-- are refused unless a CIDR rule allows them). Every connection ends as one JSON line in
-- <output_dir>/egress.jsonl. Where the host has a proxy of its own (HTTPS_PROXY and its
-- kin, lua/egress/upstream.lua), an allowed request goes on through it instead, and the name
-- is resolved there.
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local policy = require("demesne.egress.policy")
local ask = require("demesne.egress.ask")
local upstream = require("demesne.egress.upstream")
local proxy = require("core.proxy")
local fs = require("core.fs")
local loop = require("core.loop")
local util = require("demesne.util")

local egress = {}

local LOGGER = "demesne.egress"

egress.ALLOW, egress.DENY, egress.ASK = policy.ALLOW, policy.DENY, policy.ASK
--- The proxy's port inside every sandbox.
egress.PORT = proxy.PORT
--- The socket inside the sandbox (the run folder is bind-mounted at /.demesne/run).
egress.SANDBOX_SOCKET = "/.demesne/run/egress.sock"
--- The socket's name in the host's run folder.
egress.SOCKET_NAME = "egress.sock"

--------------------------------------------------------------------------------------------
-- Inside the sandbox

local TELEMETRY_OFF = {
  DO_NOT_TRACK = "1", WRANGLER_SEND_METRICS = "false", WRANGLER_SEND_ERROR_REPORTS = "false",
  NEXT_TELEMETRY_DISABLED = "1", NUXT_TELEMETRY_DISABLED = "1", NG_CLI_ANALYTICS = "false",
  STORYBOOK_DISABLE_TELEMETRY = "1", VERCEL_TELEMETRY_DISABLED = "1", YARN_ENABLE_TELEMETRY = "0",
  NO_UPDATE_NOTIFIER = "1", npm_config_fund = "false", npm_config_update_notifier = "false",
  DISABLE_OPENCOLLECTIVE = "true", PIP_DISABLE_PIP_VERSION_CHECK = "1", PIP_NO_INPUT = "1",
  CHECKPOINT_DISABLE = "1", NX_NO_CLOUD = "true", DOTNET_CLI_TELEMETRY_OPTOUT = "1",
  HOMEBREW_NO_ANALYTICS = "1", GATSBY_TELEMETRY_DISABLED = "1", ASTRO_TELEMETRY_DISABLED = "1",
}

--- Environment variables for a sandbox under `pol`: the proxy for every common client
--- (curl, pip, npm, apt, Go, Python, Node…) and build-tool telemetry turned off. The
--- variables only help tools find the proxy; enforcement is the missing network.
---@param pol table|nil  a compiled policy (nil or open: telemetry only)
---@return table<string, string>
function egress.env(pol)
  local env = {}
  for k, v in pairs(TELEMETRY_OFF) do env[k] = v end
  if pol and pol.open then return env end
  local url = ("http://127.0.0.1:%d"):format(egress.PORT)
  for _, k in ipairs({ "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
      "npm_config_proxy", "npm_config_https_proxy", "PIP_PROXY", "YARN_HTTP_PROXY", "YARN_HTTPS_PROXY" }) do
    env[k] = url
  end
  env.NO_PROXY, env.no_proxy = "localhost,127.0.0.1,::1", "localhost,127.0.0.1,::1"
  env.GOPROXY = "https://proxy.golang.org"
  -- apt reads http_proxy/https_proxy itself; APT_CONFIG adds Acquire::*::Proxy for tools
  -- that clear the environment (the file is written by egress.start)
  env.APT_CONFIG = "/.demesne/run/apt.conf"
  return env
end

--- The demesne-init options that start the relay of the proxy port ({} for open egress).
---@param pol table
---@return string[]
function egress.relay_args(pol)
  if pol.open then return {} end
  return { "--relay", ("%d=%s"):format(egress.PORT, egress.SANDBOX_SOCKET) }
end

--------------------------------------------------------------------------------------------
-- The per-sandbox listener

local active = {} -- run_id -> handle

local iso_now = util.iso_now

local Handle = {}
Handle.__index = Handle

--- Starts the proxy of one sandbox: listens on <run_dir>/egress.sock and appends to
--- <output_dir>/egress.jsonl. Where the host has a proxy of its own (HTTPS_PROXY and its
-- kin, lua/egress/upstream.lua), an allowed request goes on through it instead, and the name
-- is resolved there. `o`: {run_id, run_dir, output_dir, policy (or egress) = compiled policy}.
--- The listener admits at most egress_max_connections connections whose descriptors stay
--- within sandbox_max_descriptors (see core/proxy.h); a connection over either ceiling is
--- answered 503 naming it, and egress.jsonl gets a "ceiling" line (at most one a second,
--- with the count of refusals since the last one).
--- A request the policy asks about (ASK) is held while a person decides (lua/egress/ask.lua):
--- `o.ask` = {root, lineage = {run_id, parent, …, root}, has_inputs, tool, client} says whose
--- tree it is and, for a root, its host client (set by the plan hook of lua/tree; without it
--- the run is its own root, counts as holding host inputs, and only the cockpit is asked). A "run" answer of this run or one above it lets it through at once.
--- Returns a handle (closing it — or egress.stop — stops the listener and waits for its
--- connections to end), or a handle that does nothing for open egress; nil, err on failure.
---@param o table  the sandbox's plan: run_id, run_dir, its policy (o.policy or o.egress), ask
---@return table|nil handle, string|nil err
function egress.start(o)
  local pol = o.policy or o.egress
  local h = setmetatable({ run_id = o.run_id, policy = pol, pending = {}, closed = false, held = 0 }, Handle)
  if pol.open then h.closed = true return h end
  local a = type(o.ask) == "table" and o.ask or {}
  h.lineage = type(a.lineage) == "table" and #a.lineage > 0 and a.lineage or { o.run_id }
  h.root_id = a.root or h.lineage[#h.lineage]
  h.has_inputs = a.has_inputs ~= false
  h.tool = a.tool or o.tool
  -- the output and run folders are the sandbox's to write (and it runs already after a
  -- server restart): every file in them is reached through a held folder, confined (no
  -- link, no FIFO, never blocking; core.fs.dir)
  local out, oerr, ocode = fs.opendir(o.output_dir)
  if not out then return nil, "egress: " .. tostring(oerr), ocode end
  local file, ferr, fcode = out:open("egress.jsonl", "a")
  out:close()
  if not file then return nil, "egress: " .. tostring(ferr), fcode end
  h.file = file
  local up, uerr = upstream.settings()
  if not up then
    file:close()
    return nil, "egress: " .. uerr, "EINVAL"
  end
  h.upstream = up
  local run, rerr, rcode = fs.opendir(o.run_dir)
  if not run then
    file:close()
    return nil, "egress: " .. tostring(rerr), rcode
  end
  local _ <close> = run
  run:write_atomic("apt.conf", ("Acquire::http::Proxy \"http://127.0.0.1:%d\";\n"
    .. "Acquire::https::Proxy \"http://127.0.0.1:%d\";\n"):format(egress.PORT, egress.PORT))
  local path = o.run_dir .. "/" .. egress.SOCKET_NAME
  local resolver = config.get("egress_resolver")
  local listener, err, code = proxy.listen(path, { rules = pol.addr_rules, resolver = resolver ~= "" and resolver or nil,
      max_conns = math.max(1, math.floor(config.get("egress_max_connections"))),
      max_fds = math.max(1, math.floor(config.get("sandbox_max_descriptors"))),
      ceiling_hint = "(egress_max_connections / sandbox_max_descriptors in the demesne configuration)",
      on_refused = function(info) h:on_refused(info) end },
    function(conn, req) h:on_request(conn, req) end,
    function(conn, res) h:on_done(conn, res) end)
  if not listener then
    file:close()
    return nil, ("egress: cannot listen on %s: %s"):format(path, tostring(err)), code
  end
  run:chmod(egress.SOCKET_NAME, 438) -- 0666: whatever user the image runs as can connect
  h.listener = listener
  active[o.run_id] = h
  ask.register(o.run_id, a.client)
  return h
end

--- core.proxy's on_request: judges the name and answers allow or deny, or holds the
--- connection while the person is asked (ASK; lua/egress/ask.lua).
---@param conn userdata  a core.proxy.conn
---@param req table      {method, host, port, ip, form, path, host_header}
function Handle:on_request(conn, req)
  local verdict, label = policy.decide(self.policy, req)
  local p = { req = req, verdict = verdict, rule = label, time = iso_now() }
  self.pending[conn] = p
  if verdict == egress.ASK then
    local g = ask.granted(self.lineage, req.host, req.port)
    if not g then return self:hold(conn, p) end
    -- an earlier "allow for this run" of this run or one above it
    p.verdict, p.question, p.decision, p.decided_by, p.granted = egress.ALLOW, g.question, "run", g.by, true
  end
  self:answer(conn, p)
end

--- Gives a connection its verdict (p.verdict): allow (through the host's proxy where there is
--- one) or deny (with p.reason, else the policy's rule).
---@param conn userdata  a core.proxy.conn
---@param p table  the connection's pending record {req, verdict, rule, reason}
function Handle:answer(conn, p)
  local via = p.verdict == egress.ALLOW and upstream.for_request(self.upstream, p.req)
  if via then
    p.via = via.url
    conn:allow_via(via.host, via.port, via.authorization)
  elseif p.verdict == egress.ALLOW then conn:allow()
  else conn:deny(p.reason or ("denied by egress policy %s (%s)"):format(self.policy.name, p.rule)) end
end

--- Holds a connection the policy asks about until its question is answered (ask.hold): at
--- most ask_max_held of the sandbox's at once (more are denied at once), each at most
--- ask_timeout_seconds (then denied; the proxy's own hold ends a little later still).
---@param conn userdata
---@param p table  the connection's pending record
function Handle:hold(conn, p)
  local req = p.req
  p.holding = true
  local id, err, waiter = ask.hold({ run_id = self.run_id, root_id = self.root_id, lineage = self.lineage,
    has_inputs = self.has_inputs, policy = self.policy.name, rule = p.rule, tool = self.tool, host = req.host,
    port = req.port, held = self.held,
    decided = function(decision, who, qid)
      if not p.holding then return end
      p.holding, p.waiter = false, nil
      self.held = self.held - 1
      p.question, p.decision, p.decided_by = qid, decision, who
      if decision == "deny" then
        p.verdict = egress.DENY
        p.reason = who == "timeout"
          and ("denied: egress policy %s (%s) asks about %s:%d and nobody answered within ask_timeout_seconds")
            :format(self.policy.name, p.rule, req.host, req.port)
          or ("denied: egress policy %s (%s) asks about %s:%d and the answer (%s) was deny")
            :format(self.policy.name, p.rule, req.host, req.port, who)
      else
        p.verdict = egress.ALLOW
      end
      self:answer(conn, p)
    end })
  if not id then
    p.holding = false
    p.verdict, p.decision, p.decided_by = egress.DENY, "deny", "ask_max_held"
    p.reason = ("denied: egress policy %s (%s) asks about %s:%d, but %s"):format(self.policy.name, p.rule, req.host,
      req.port, err)
    return self:answer(conn, p)
  end
  if not p.holding then return end -- answered already
  p.question, p.waiter = id, waiter
  self.held = self.held + 1
  conn:hold((math.max(1, math.floor(config.get("ask_timeout_seconds"))) + 10) * 1000)
end

--- core.proxy's on_done: appends the connection's line to egress.jsonl.
---@param conn userdata
---@param res table  {bytes_up, bytes_down, status, denied, rule, address, error, code, via}
function Handle:on_done(conn, res)
  local p = self.pending[conn]
  self.pending[conn] = nil
  if not p then return end
  if p.holding then -- it ended while held (its sandbox stopped): it leaves its question
    p.holding = false
    self.held = self.held - 1
    ask.release(p.question, p.waiter)
    p.verdict = egress.DENY
  end
  local allowed = p.verdict == egress.ALLOW and not res.denied
  local rule = p.rule
  if res.code == "ELIMIT" then
    allowed, rule = false, "ceiling" -- a descriptor ceiling stopped it while it dialled
  elseif p.verdict == egress.ALLOW and res.denied then
    local r = res.rule and self.policy.rules[res.rule]
    rule = r and r.label or ("address:" .. tostring((res.error or ""):match("is (.*)$") or "refused"))
  end
  local rec = {
    time = p.time, sandbox = self.run_id, method = p.req.method, host = p.req.host, port = p.req.port,
    verdict = allowed and "allow" or "deny", rule = rule, status = res.status,
    bytes_up = res.bytes_up, bytes_down = res.bytes_down, address = res.address, error = res.error,
    via = res.via and p.via or nil,
    -- an asked connection: its question, the decision (once, run, deny) and who took it
    -- (elicitation, cockpit, timeout, ask_max_held…); granted: by an earlier "run" answer
    question = p.question, decision = p.decision, decided_by = p.decided_by, granted = p.granted,
  }
  if p.req.form ~= "connect" then rec.path = p.req.path end
  if self.file then
    local ok, line = pcall(json.encode, rec)
    if ok then self.file:write(line .. "\n") end
  end
end

--- Writes the pending "ceiling" line: the refusals since the last one, and why.
function Handle:flush_refusals()
  local r = self.refusals
  if not r or r.count == 0 or not self.file then return end
  local ok, line = pcall(json.encode, { time = iso_now(), sandbox = self.run_id, verdict = "deny", rule = "ceiling",
    status = 503, refused = r.count, limit = r.limit, error = r.message })
  if ok then self.file:write(line .. "\n") end
  r.count, r.last = 0, loop.now()
end

--- core.proxy's on_refused: a connection over a ceiling. Counted, and written to
--- egress.jsonl at most once a second (a flood must not become a flood of lines).
---@param info table  {limit, active, ceiling, answered, message}
function Handle:on_refused(info)
  local r = self.refusals or { count = 0, last = -math.huge }
  self.refusals = r
  r.count, r.limit, r.message = r.count + 1, info.limit, info.message
  if r.count == 1 and r.total == nil then
    log.warning(LOGGER, "sandbox %s: egress connection refused: %s", self.run_id, tostring(info.message))
  end
  r.total = (r.total or 0) + 1
  if loop.now() - r.last >= 1000 then self:flush_refusals() end
end

--- Stops the listener; inside a task, waits until every connection has ended (so
--- egress.jsonl is complete). Idempotent.
function Handle:stop()
  if self.closed then return end
  self.closed = true
  if active[self.run_id] == self then active[self.run_id] = nil end
  local listener = self.listener
  self.listener = nil
  if listener then
    local ev = async.event()
    listener:close(function() ev.set() end)
    if async.current() then
      local ok, err = pcall(async.timeout, 5000, ev.wait)
      if not ok and err == async.CANCELLED then error(err, 0) end
    end
  end
  self:flush_refusals()
  if self.file then self.file:close() self.file = nil end
  if self.run_id then ask.forget(self.run_id) end
end
Handle.__close = Handle.stop

--- The live handle of a sandbox, or nil.
---@param run_id string
---@return table|nil handle
function egress.get(run_id) return active[run_id] end

--- Stops the proxy of a sandbox if one runs. Idempotent.
---@param run_id string
function egress.stop(run_id)
  local h = active[run_id]
  if h then h:stop() end
end

--- Makes sure a persistent sandbox has its proxy (after a server restart the listener is
--- gone while the container lives on). Returns the handle, or nil, err.
---@param run_id string
---@param run_dir string
---@param output_dir string
---@param policy_name string
function egress.ensure(run_id, run_dir, output_dir, policy_name)
  if active[run_id] then return active[run_id] end
  local pol, err = policy.policy(policy_name)
  if not pol then return nil, err end
  if pol.open then return setmetatable({ closed = true }, Handle) end
  log.info(LOGGER, "re-attaching the proxy of sandbox %s (policy %s)", run_id, policy_name)
  return egress.start({ run_id = run_id, run_dir = run_dir, output_dir = output_dir, policy = pol })
end

return egress
