-- Host MCP servers proxied into sandboxes: the host side.
--
-- The operator lists MCP servers (`host_mcp` in config.lua, and imports from Claude Code
-- and Codex: lua/hostmcp/config.lua). demesne runs them on the host as upstreams — started
-- on first use, shared by every sandbox, restarted after a crash, stopped when idle and at
-- shutdown — and offers each sandbox an allowlisted subset of their tools. Credentials and
-- processes stay on the host; files a tool writes on the host are not handed to the
-- sandbox unless the result itself carries them.
--
-- The API the in-sandbox endpoint calls (all inside a task; failures are nil, msg, code):
--
--   hostmcp.servers_for(run_opts) -> {name...}
--       the servers a run may use, sorted: those that offer at least one tool, narrowed by
--       run_opts.host_mcp (a list of names; nil = all) and by run_opts.parent (the parent
--       run's set: a child gets at most that). An unknown name, or one outside the parent's
--       set, is refused (EINVAL) naming it.
--   hostmcp.list_tools(server) -> {tool...}
--       the server's allowed tools as its live listing gives them (name, title,
--       description, inputSchema, outputSchema, annotations, …), filtered every time:
--       a list of names, "*", or "read-only" = exactly the tools whose listing sets
--       annotations.readOnlyHint = true. The listing is cached until the upstream sends
--       notifications/tools/list_changed (or, for an HTTP upstream without a GET stream,
--       fetched on every use).
--   hostmcp.call(server, tool, arguments, opts) -> CallToolResult
--       calls an allowed tool; anything else is refused (EPERM) before the upstream sees
--       it. opts: timeout_ms (at most host_mcp_timeout_seconds, the default), output_dir
--       (append a line to <output_dir>/mcp.jsonl), cancel (an async.event(): setting it
--       cancels the call, which then returns nil, "cancelled", "ECANCELED"; cancelling the
--       calling task does the same and raises), on_progress(params) (the upstream's
--       notifications/progress for this call). The result is the upstream's
--       {content, structuredContent?, isError?}, untouched.
--   hostmcp.on_tools_changed(fn) -> unsubscribe
--       fn(server) after an upstream announced a new listing (for list_changed to clients).
--   hostmcp.record(output_dir, entry)   one line of mcp.jsonl (hostmcp.call does it).
--   hostmcp.describe() -> rows, problems  (for `demesne check-config`; starts nothing)
--   hostmcp.call_timeout_ms(server) -> ms    the longest one call may take
--   hostmcp.shutdown()                   stops every upstream and forgets the configuration.
--
-- Codes: ENOENT (no such server / tool), EPERM (tool not allowed), EINVAL (bad run
-- options), ETIMEDOUT, ECANCELED, ECONNRESET (the upstream died during the call: it is
-- started again on the next call), EAGAIN (it keeps failing to start), E2BIG, EPROTO,
-- ERPC (the upstream's JSON-RPC error), ECONNREFUSED and the like (an HTTP upstream that
-- cannot be reached). An HTTP upstream that forgot its session (it restarted) gets a new
-- one and the request is sent once more, since it was not processed.
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local client = require("demesne.mcp.client")
local hconfig = require("demesne.hostmcp.config")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")
local timer = require("core.timer")

local hostmcp = {}

local LOGGER = "demesne.hostmcp"
hostmcp.RECORD_FILE = "mcp.jsonl"
local PING_TIMEOUT_MS = 5000
local STOP_GRACE_MS = 2000
local BACKOFF_AFTER = 3        -- failed starts in a row before waiting
local BACKOFF_MS = 30000

-- The environment a stdio upstream gets besides its own `env` and `env_vars`: what a
-- program needs to run, nothing of demesne's credentials (Codex passes the same set).
local BASE_ENV = { "HOME", "LOGNAME", "PATH", "SHELL", "USER", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM",
  "TMPDIR", "TZ", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR" }

local loaded        -- hconfig.load() result
local loading       -- the task loading it
local upstreams = {} -- name -> Upstream
local listeners = {}

local function ms_setting(name) return math.floor((config.get(name) or 1) * 1000) end

local iso_now = util.iso_now

--- The declared servers (lua/hostmcp/config.lua's load() result), read once and kept until
--- hostmcp.shutdown(). Inside a task (Codex import runs a helper process).
---@return table
function hostmcp.load()
  if loaded then return loaded end
  if not loading then
    local t = async.spawn("host MCP configuration", function()
      local l = hconfig.load()
      for _, p in ipairs(l.problems) do
        log.log(p.level == "error" and "error" or "warning", LOGGER, p.message)
      end
      return l
    end)
    if t.done then
      local ok, l = table.unpack(t.result, 1, 2)
      if not ok then error(l, 0) end
      loaded = l
      return l
    end
    loading = t
  end
  local t = loading
  local ok, l = t:wait()
  if loading == t then loading = nil end
  if not ok then error(l, 0) end
  loaded = loaded or l
  return loaded
end

---------------------------------------------------------------------------------------------
-- Upstreams

---@class Upstream
local Upstream = {}
Upstream.__index = Upstream

local function upstream(decl)
  local up = upstreams[decl.name]
  if up and up.decl == decl then return up end
  up = setmetatable({ name = decl.name, decl = decl, failures = 0, inflight = 0, generation = 0 }, Upstream)
  upstreams[decl.name] = up
  return up
end

local function notify_changed(name)
  for fn in pairs(listeners) do
    local ok, err = pcall(fn, name)
    if not ok then log.warning(LOGGER, "tools-changed listener: %s", tostring(err)) end
  end
end

--- The environment of a stdio server's process: its declared env first, then the host
--- variables it forwards, then the base ones (PATH, HOME, …), each name once.
---@return string[] env  "K=V"
function Upstream:stdio_env()
  local env, seen = {}, {}
  local function add(k, v)
    if v ~= nil and not seen[k] then seen[k] = true; env[#env + 1] = k .. "=" .. v end
  end
  -- the server's own settings win over the forwarded host variables
  for k, v in pairs(self.decl.env) do add(k, v) end
  for _, k in ipairs(self.decl.env_vars) do add(k, os.getenv(k)) end
  for _, k in ipairs(BASE_ENV) do add(k, os.getenv(k)) end
  return env
end

--- The headers an HTTP server is sent: its declared ones, and those read from host
--- variables (env_http_headers).
---@return table<string, string>
function Upstream:http_headers()
  local d = self.decl
  local h = {}
  for k, v in pairs(d.http_headers) do h[k] = v end
  for k, var in pairs(d.env_http_headers) do
    local v = os.getenv(var)
    if v == nil then
      return nil, ("%s: header %s: environment variable %s is not set"):format(d.origin, k, var)
    end
    h[k] = v
  end
  if d.bearer_token_env_var then
    local v = os.getenv(d.bearer_token_env_var)
    if v == nil or v == "" then
      return nil, ("%s: bearer_token_env_var: environment variable %s is not set"):format(d.origin, d.bearer_token_env_var)
    end
    h["Authorization"] = "Bearer " .. v
  end
  return h
end

--- The session's notification handler: a tools/list_changed makes the cached listing stale.
---@param session McpClientSession
---@param method string
function Upstream:on_notification(session, method)
  if method == "notifications/tools/list_changed" and self.session == session then
    self.tools_stale = true
    log.debug(LOGGER, "%s: its tool listing changed", self.name)
    notify_changed(self.name)
  end
end

--- The session's exit handler: the server process ended; it starts again on its next use.
---@param session McpClientSession
---@param status integer|nil  exit status
---@param sig integer|nil     the signal that ended it
function Upstream:on_exit(session, status, sig)
  if self.session ~= session then return end
  self.session = nil
  self.tools = nil
  if self.idle_timer then self.idle_timer:close(); self.idle_timer = nil end
  if self.stopping == session then return end
  log.warning(LOGGER, "%s: the server process %s; it is started again on its next use", self.name,
    sig ~= 0 and ("was killed by signal " .. tostring(sig)) or ("exited with status " .. tostring(status)))
end

--- Starts the upstream and initializes it (in its own task, so the callers that wait for it
--- can be cancelled without stopping it). Returns the session, or nil, msg, code.
---@return McpClientSession|nil session, string|nil err, string|nil code
function Upstream:start()
  local d = self.decl
  local label = "host MCP server " .. self.name
  local max = math.floor(config.get("host_mcp_max_message_bytes"))
  local session, err, code
  local this -- the session, for the callbacks
  if d.transport == "stdio" then
    session, err, code = client.spawn({
      file = d.command, args = d.args, env = self:stdio_env(), cwd = d.cwd, name = label, max_message_bytes = max,
      on_notification = function(method) self:on_notification(this, method) end,
      on_stderr = function(line) log.info(LOGGER, "%s: stderr: %s", self.name, line) end,
      on_exit = function(status, sig) self:on_exit(this, status, sig) end,
    })
    if not session then err = ("%s: cannot start %s: %s"):format(label, d.command, tostring(err)) end
  else
    local headers, herr = self:http_headers()
    if not headers then
      session, err, code = nil, herr, "EINVAL"
    else
      session = client.http({ url = d.url, headers = headers, name = label, max_message_bytes = max,
        on_notification = function(method) self:on_notification(this, method) end })
    end
  end
  if not session then return nil, err, code end
  this = session
  local ok, res, ierr, icode = pcall(session.initialize, session, ms_setting("host_mcp_startup_timeout_seconds"))
  if not ok then
    -- cancelled (shutdown) or a bug: the process must not outlive this
    self.stopping = session
    session:close(500)
    error(res, 0)
  end
  if res and type(session.capabilities.tools) ~= "table" then
    res, ierr, icode = nil, label .. ": the server offers no tools (no tools capability)", "EPROTO"
  end
  if not res then
    self.stopping = session
    session:close(500)
    return nil, ierr, icode
  end
  self.session = session
  self.tools, self.tools_stale = nil, false
  self.generation = self.generation + 1
  log.info(LOGGER, "%s: started (%s %s, protocol %s)", self.name, tostring(session.server_info.name),
    tostring(session.server_info.version), session.protocol_version)
  return session
end

--- The running session, started if needed. Inside a task.
function Upstream:ensure()
  local s = self.session
  if s and not s.closed then return s end
  if s then
    -- the transport failed (an HTTP server ended the session): drop what is left of it
    self.session, self.tools = nil, nil
    self.stopping = s
    s:close(500)
  end
  if self.shut then return nil, self.name .. ": demesne is shutting down", "ECANCELED" end
  local t = self.starting
  if not t then
    if self.failures >= BACKOFF_AFTER and loop.now() < (self.retry_at or 0) then
      return nil, ("%s: failed to start %d times in a row (last: %s); the next try is in %d s"):format(self.name,
        self.failures, tostring(self.last_error), math.ceil((self.retry_at - loop.now()) / 1000)), "EAGAIN"
    end
    t = async.spawn("host MCP start: " .. self.name, function()
      local session, err, code = self:start()
      if session then
        self.failures = 0
      else
        self.failures = self.failures + 1
        self.last_error = err
        if self.failures >= BACKOFF_AFTER then self.retry_at = loop.now() + BACKOFF_MS end
        log.warning(LOGGER, "%s", tostring(err))
      end
      return session, err, code
    end)
    if not t.done then
      self.starting = t
      t:on_done(function() if self.starting == t then self.starting = nil end end)
    end
  end
  local r = table.pack(t:wait())
  if not r[1] then
    if r[2] == async.CANCELLED then return nil, self.name .. ": its start was cancelled", "ECANCELED" end
    error(r[2], 0)
  end
  return table.unpack(r, 2, r.n)
end

--- The live listing (cached until list_changed; refetched every time without a stream).
--- Returns tools, session or nil, msg, code. `timeout_ms` bounds the listing request.
---@param fresh boolean|nil     refetch even when a cached listing is good
---@param timeout_ms integer|nil
---@return table[]|nil tools, McpClientSession|string|nil session_or_err, string|nil code
function Upstream:listing(fresh, timeout_ms)
  local s, err, code = self:ensure()
  if not s then return nil, err, code end
  if self.tools and not fresh and not self.tools_stale and not s.no_stream then return self.tools, s end
  self.tools_stale = false
  local tools, lerr, lcode = s:list_tools(timeout_ms)
  if not tools then
    if self.session == s then self.tools_stale = true end
    if lcode == "ETIMEDOUT" then self:check_alive(s, timeout_ms) end
    return nil, lerr, lcode
  end
  if self.session == s then self.tools = tools end
  return tools, s
end

--- Arms the idle timer: with no call in flight for host_mcp_idle_seconds, the server stops.
function Upstream:arm_idle()
  if self.idle_timer then self.idle_timer:close(); self.idle_timer = nil end
  if self.inflight > 0 or not self.session or self.shut then return end
  local s = self.session
  self.idle_timer = timer.after(ms_setting("host_mcp_idle_seconds"), function()
    self.idle_timer = nil
    if self.inflight > 0 or self.session ~= s then return end
    async.spawn("host MCP idle stop: " .. self.name, function()
      log.info(LOGGER, "%s: idle for %d s: stopped", self.name, math.floor(config.get("host_mcp_idle_seconds")))
      self:stop()
    end)
  end)
end

--- Stops the running server (inside a task: waits for its process to end).
function Upstream:stop()
  if self.idle_timer then self.idle_timer:close(); self.idle_timer = nil end
  local s = self.session
  if not s then return end
  self.session = nil
  self.tools = nil
  self.stopping = s
  s:close(STOP_GRACE_MS)
end

--- After a call timed out: a server that does not answer ping either hangs; kill it, so the
--- next call starts a fresh one instead of waiting out the timeout again.
---@param s McpClientSession
---@param timeout_ms integer  the call's timeout (the ping waits at most this)
function Upstream:check_alive(s, timeout_ms)
  async.spawn("host MCP ping: " .. self.name, function()
    local res, _, code = s:request("ping", nil, { timeout_ms = math.min(PING_TIMEOUT_MS, timeout_ms) })
    if res or code ~= "ETIMEDOUT" or self.session ~= s then return end
    log.warning(LOGGER, "%s: does not answer ping after a call timed out: stopped (it is started again on its next use)",
      self.name)
    self.session, self.tools = nil, nil
    self.stopping = s
    if s.kill then s.kill() end
    s:close(500)
  end)
end

---------------------------------------------------------------------------------------------
-- Filtering

local function allowed(spec, tool)
  if spec.mode == "all" then return true end
  if spec.mode == "read-only" then
    return type(tool.annotations) == "table" and tool.annotations.readOnlyHint == true
  end
  if spec.mode == "names" then return spec.set[tool.name] == true end
  return false
end

--- Whether a tool of a listing passes a tools spec (lua/hostmcp/config.lua parse_tools).
---@param spec table
---@param tool table  one entry of a tools/list answer
---@return boolean
function hostmcp.allowed(spec, tool) return allowed(spec, tool) end

local function find(name)
  local l = hostmcp.load()
  local d = l.servers[name]
  if not d then
    return nil, ("no host MCP server named %s (configured: %s)"):format(("%q"):format(tostring(name)),
      #l.names > 0 and table.concat(l.names, ", ") or "none"), "ENOENT"
  end
  return upstream(d)
end

--- The allowed tools of a server, from its live listing (see the module header).
---@param server string
---@return table[]|nil tools, string|nil err, string|nil code
function hostmcp.list_tools(server)
  local up, err, code = find(server)
  if not up then return nil, err, code end
  local out = json.array()
  if up.decl.tools.mode == "none" then return out end
  up.inflight = up.inflight + 1
  if up.idle_timer then up.idle_timer:close(); up.idle_timer = nil end
  local tools, lerr, lcode
  do
    local _ <close> = util.closer(function()
      up.inflight = up.inflight - 1
      up:arm_idle()
    end)
    tools, lerr, lcode = up:listing(false, up.decl.timeout_ms or ms_setting("host_mcp_timeout_seconds"))
  end
  if not tools then return nil, lerr, lcode end
  for _, t in ipairs(tools) do
    if allowed(up.decl.tools, t) then out[#out + 1] = t end
  end
  return out
end

--- Subscribes to listing changes: fn(server) after an upstream sent
--- notifications/tools/list_changed. Returns a function that unsubscribes.
---@param fn fun(server: string)
---@return fun()
function hostmcp.on_tools_changed(fn)
  listeners[fn] = true
  return function() listeners[fn] = nil end
end

---------------------------------------------------------------------------------------------
-- Record

-- Opens <output_dir>/mcp.jsonl for appending.
--
-- SWITCH TO core.fs.dir WHEN IT LANDS (branch h1-fs): the output folder is writable by the
-- sandbox, so this must be `fs.opendir(output_dir):open("mcp.jsonl", "a")` (openat2
-- RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, O_NONBLOCK | O_NOFOLLOW, type checked before the
-- data open). Until then, the narrowest primitives there are: the folder must be a real
-- folder with no symlink on its path (realpath), the file is created with O_EXCL when
-- missing, and an existing one must be a regular file (lstat) and is opened O_NOFOLLOW. A
-- sandbox that swaps the file for a FIFO between the lstat and the open could still make
-- the open wait for a reader; core.fs.dir closes that.
local function open_record_file(output_dir)
  -- the output folder is the sandbox's /out: held by descriptor, no link followed, a FIFO
  -- or anything but a regular file at mcp.jsonl refused without being opened
  local dir, err, code = fs.opendir(output_dir)
  if not dir then return nil, err, code end
  local f, ferr, fcode = dir:open(hostmcp.RECORD_FILE, "a", 420) -- 0644
  dir:close()
  return f, ferr, fcode
end

--- Appends one JSON line to <output_dir>/mcp.jsonl. `entry`: {server, tool, duration_ms,
--- ok, error?, request_bytes, response_bytes, arguments?}; `time` (ISO 8601 UTC) is added.
--- Returns true or nil, msg, code (the call it records is not failed for it).
---@param output_dir string
---@param entry table
---@return boolean|nil ok, string|nil err, string|nil code
function hostmcp.record(output_dir, entry)
  local rec = { time = iso_now() }
  for k, v in pairs(entry) do rec[k] = v end
  local ok, line = pcall(json.encode, rec)
  if not ok then return nil, "cannot encode the record: " .. tostring(line), "EINVAL" end
  local f, err, code = open_record_file(output_dir)
  if not f then return nil, err, code end
  local wok, werr, wcode = f:write(line .. "\n")
  f:close()
  if not wok then return nil, werr, wcode end
  return true
end

---------------------------------------------------------------------------------------------
-- Calls

local function encoded_size(v)
  local ok, s = pcall(json.encode, v)
  return ok and #s or 0
end

-- Writes the mcp.jsonl line of one call (hostmcp.record) when the call has an output
-- folder: c = {server, tool, arguments, output_dir, t0 (loop.hrtime), request_bytes}.
local function record_call(c, res, err)
  if not c.output_dir then return end
  local rec = {
    server = c.server, tool = c.tool, duration_ms = math.floor((loop.hrtime() - c.t0) / 1e6),
    ok = res ~= nil and res.isError ~= true, request_bytes = c.request_bytes,
    response_bytes = res and encoded_size(res) or 0,
  }
  if not res then rec.error = err elseif res.isError == true then rec.error = "the tool reported an error (isError)" end
  if config.get("host_mcp_record_arguments") then rec.arguments = c.arguments end
  local rok, rerr = hostmcp.record(c.output_dir, rec)
  if not rok then log.warning(LOGGER, "cannot record the call of %s/%s: %s", c.server, c.tool, tostring(rerr)) end
end

-- The upstream of `server` and its tools' declaration when its declaration lets `tool` be
-- called (before the live listing is asked), or nil, err, code.
local function declared_upstream(server, tool)
  local up, err, code = find(server)
  if not up then return nil, nil, err, code end
  local spec = up.decl.tools
  if spec.mode == "none" then
    return nil, nil, ("host MCP server %s offers no tools%s"):format(server,
      up.decl.source ~= "config" and " (it is imported: name its tools in host_mcp in config.lua)" or ""), "EPERM"
  end
  if spec.mode == "names" and not spec.set[tool] then
    return nil, nil, ("tool %s of host MCP server %s is not allowed here (allowed: %s)"):format(tostring(tool), server,
      hconfig.tools_text(spec)), "EPERM"
  end
  return up, spec
end

-- The session of a started upstream whose live listing has `tool`, allowed by `spec`, or
-- nil, err, code. A session the server forgot is made again once; a listing that lacks the
-- tool is asked once more (the cached one may be behind the server).
local function listed_session(up, spec, server, tool, timeout, remaining)
  local tools, s, lcode = up:listing(false, timeout)
  if not tools and lcode == "ESESSION" then
    -- an HTTP server that forgot the session (it restarted) processed nothing: once more
    tools, s, lcode = up:listing(true, remaining())
  end
  if not tools then return nil, s, lcode end
  local entry
  for _, t in ipairs(tools) do if t.name == tool then entry = t break end end
  if not entry then
    tools, s, lcode = up:listing(true, remaining())
    if not tools then return nil, s, lcode end
    for _, t in ipairs(tools) do if t.name == tool then entry = t break end end
  end
  if not entry then return nil, ("host MCP server %s has no tool %s"):format(server, tostring(tool)), "ENOENT" end
  if not allowed(spec, entry) then
    return nil, ("tool %s of host MCP server %s is not allowed here (allowed: %s)"):format(tool, server,
      hconfig.tools_text(spec)), "EPERM"
  end
  return s
end

-- Calls `tool` on the session `s` in a task of its own, which opts.cancel (an event)
-- cancels. Returns res, err, code; with a fourth value, the error that cancels the caller,
-- to be raised once the call is recorded. Another error of the call's task is raised.
local function call_in_task(up, s, server, tool, arguments, opts, timeout, remaining)
  local child = async.spawn("host MCP call: " .. server .. "/" .. tool, function()
    local r, e, c, x = s:call_tool(tool, arguments, { timeout_ms = remaining(), on_progress = opts.on_progress })
    if r or c ~= "ESESSION" then return r, e, c, x end
    -- the server forgot the session before processing the call: a new session, once
    local s2, e2, c2 = up:ensure()
    if not s2 then return nil, e2, c2 end
    s = s2
    return s2:call_tool(tool, arguments, { timeout_ms = remaining(), on_progress = opts.on_progress })
  end)
  local watcher = opts.cancel and async.spawn("host MCP cancel: " .. server .. "/" .. tool, function()
    opts.cancel.wait()
    async.cancel(child, "cancelled")
  end)
  local ok, r = pcall(function() return table.pack(child:wait()) end)
  if watcher then async.cancel(watcher, "done") end
  if not ok then
    async.cancel(child, "the caller was cancelled")
    return nil, "cancelled", "ECANCELED", r
  end
  if not r[1] then
    if r[2] ~= async.CANCELLED then error(r[2], 0) end
    return nil, "cancelled", "ECANCELED"
  end
  local res, err, code = r[2], r[3], r[4]
  if res and type(res.content) ~= "table" then
    res, err, code = nil, ("host MCP server %s answered tools/call without content"):format(server), "EPROTO"
  end
  if not res and code == "ETIMEDOUT" then up:check_alive(s, timeout) end
  return res, err, code
end

--- Calls an allowed tool of a host MCP server (see the module header).
---@param server string
---@param tool string
---@param arguments table|nil
---@param opts {timeout_ms: integer|nil, output_dir: string|nil, cancel: table|nil, on_progress: function|nil}|nil
---@return table|nil result, string|nil err, string|nil code
function hostmcp.call(server, tool, arguments, opts)
  opts = opts or {}
  arguments = arguments or {}
  local c = { server = server, tool = tool, arguments = arguments, output_dir = opts.output_dir, t0 = loop.hrtime(),
    request_bytes = encoded_size(arguments) }
  local function finish(res, err, code)
    record_call(c, res, err)
    return res, err, code
  end
  if type(arguments) ~= "table" then return finish(nil, "arguments must be an object", "EINVAL") end
  local up, spec, err, code = declared_upstream(server, tool)
  if not up then return finish(nil, err, code) end

  up.inflight = up.inflight + 1
  if up.idle_timer then up.idle_timer:close(); up.idle_timer = nil end
  local _ <close> = util.closer(function()
    up.inflight = up.inflight - 1
    up:arm_idle()
  end)

  -- starting the server has its own bound (host_mcp_startup_timeout_seconds); the call's
  -- bound covers the listing and the call
  local started, serr, scode = up:ensure()
  if not started then return finish(nil, serr, scode) end
  local limit = up.decl.timeout_ms or ms_setting("host_mcp_timeout_seconds")
  local timeout = math.min(opts.timeout_ms or limit, limit)
  local deadline = loop.now() + timeout
  local function remaining() return math.max(1, deadline - loop.now()) end
  local s, lerr, lcode = listed_session(up, spec, server, tool, timeout, remaining)
  if not s then return finish(nil, lerr, lcode) end
  local res, cerr, ccode, raise = call_in_task(up, s, server, tool, arguments, opts, timeout, remaining)
  finish(res, cerr, ccode)
  if raise then error(raise, 0) end
  return res, cerr, ccode
end

---------------------------------------------------------------------------------------------
-- Runs

local function is_name_list(v)
  if type(v) ~= "table" then return false end
  for k, x in pairs(v) do
    if math.type(k) ~= "integer" or type(x) ~= "string" then return false end
  end
  return true
end

--- The servers a run may use (see the module header).
---@param run_opts {host_mcp: string[]|nil, parent: string[]|nil}|nil
---@return string[]|nil names, string|nil err, string|nil code
function hostmcp.servers_for(run_opts)
  run_opts = run_opts or {}
  local l = hostmcp.load()
  local base, in_base = {}, {}
  local parent
  if run_opts.parent ~= nil then
    if not is_name_list(run_opts.parent) then return nil, "parent: must be a list of server names", "EINVAL" end
    parent = {}
    for _, n in ipairs(run_opts.parent) do parent[n] = true end
  end
  for _, n in ipairs(l.names) do
    if l.servers[n].tools.mode ~= "none" and (not parent or parent[n]) then
      base[#base + 1] = n
      in_base[n] = true
    end
  end
  local want = run_opts.host_mcp
  if want == nil then return base end
  if not is_name_list(want) then return nil, "host_mcp: must be a list of host MCP server names", "EINVAL" end
  local out, seen = {}, {}
  for i, n in ipairs(want) do
    if not in_base[n] then
      local d = l.servers[n]
      local why
      if not d then
        why = ("no host MCP server is named %q (offered: %s)"):format(n, #base > 0 and table.concat(base, ", ") or "none")
      elseif d.tools.mode == "none" then
        why = ("host MCP server %s offers no tools (name its tools in host_mcp in config.lua)"):format(n)
      else
        why = ("host MCP server %s is not offered to the parent run, so not to its children"):format(n)
      end
      return nil, ("host_mcp[%d]: %s"):format(i, why), "EINVAL"
    end
    if not seen[n] then seen[n] = true; out[#out + 1] = n end
  end
  table.sort(out)
  return out
end

--- What will be offered, for `demesne check-config`: one row per server {name, origin,
--- source, transport, target (command line or URL), tools (text), tools_origin} and the
--- problems found. Starts no server. Inside a task.
---@return table[] rows, table[] problems, table loaded
function hostmcp.describe()
  local l = hostmcp.load()
  local rows = {}
  for _, n in ipairs(l.names) do
    local d = l.servers[n]
    local target
    if d.transport == "stdio" then
      target = table.concat({ d.command, table.unpack(d.args) }, " ")
    else
      target = d.url:gsub("%?.*$", "?…")
    end
    rows[#rows + 1] = { name = n, origin = d.origin, source = d.source, transport = d.transport, target = target,
      tools = hconfig.tools_text(d.tools), tools_origin = d.tools_origin }
  end
  return rows, l.problems, l
end

--- The longest one call of `server` may take, in ms: its own timeout_seconds, else
--- host_mcp_timeout_seconds (also for a name that is not configured).
---@param server string
---@return integer
function hostmcp.call_timeout_ms(server)
  local d = loaded and loaded.servers[server]
  return d and d.timeout_ms or ms_setting("host_mcp_timeout_seconds")
end

--- The pid of a stdio server's running process, or nil (tests and diagnostics).
---@param server string
---@return integer|nil
function hostmcp.pid(server)
  local up = upstreams[server]
  return up and up.session and up.session.pid or nil
end

--- Stops every upstream (each gets its stdin closed, then TERM, then KILL to its process
--- group) and forgets the configuration, so the next use reads it again. Inside a task.
function hostmcp.shutdown()
  local ups = upstreams
  upstreams = {}
  for _, up in pairs(ups) do up.shut = true end
  -- in parallel: each may take its grace periods
  local stoppers = {}
  for _, up in pairs(ups) do
    stoppers[#stoppers + 1] = async.spawn("host MCP stop: " .. up.name, function()
      local starting = up.starting
      if starting then
        async.cancel(starting, "shutdown")
        if not starting.done then pcall(starting.wait, starting) end
      end
      up:stop()
    end)
  end
  for _, st in ipairs(stoppers) do
    local ok, err = st:wait()
    if not ok then log.error(LOGGER, "stopping a host MCP server: %s", tostring(err)) end
  end
  if loading then async.cancel(loading, "shutdown") end
  loaded, loading = nil, nil
end

--- hostmcp.shutdown() for a caller outside any task, after the loop stopped (`demesne
--- serve` once its transport has closed): runs the loop until every upstream is gone.
function hostmcp.shutdown_outside_task()
  if next(upstreams) == nil and not loading then
    loaded = nil
    return
  end
  local t = async.spawn("host MCP shutdown", hostmcp.shutdown)
  if not t.done then
    t:on_done(function() loop.stop() end)
    loop.run()
  end
  if not t.result[1] then log.error(LOGGER, "shutdown: %s", tostring(t.result[2])) end
end

return hostmcp
