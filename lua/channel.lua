-- The host side of demesne-init's control socket (core/init/control.c): how a command is
-- handed to a sandbox without the engine's exec API. demesne-init listens on
-- /.demesne/run/init.sock, which is <run_dir>/init.sock on the host.
--
-- The socket lies in a folder the sandbox can write, so whatever answers there is treated
-- as the sandbox itself: the socket is opened without following links (it can only be this
-- sandbox's own), every reply is bounded (MAX_REPLY bytes per connection, one short line
-- at a time) and parsed strictly, and every wait has a deadline. Nothing that arrives on a
-- connection is trusted beyond "this sandbox says so"; the durable records (status.json,
-- the logs) are read from the run and output folders as before.
--
-- Protocol (docs/reference/demesne-init.md, "Control socket"): one request per connection,
--   "DMI1", u32 big-endian payload length, then NUL-terminated strings
--   OP, N, ARG1 … ARGN, M, ENV1 … ENVM
-- answered by lines "ok", "started PID", "exit CODE" or "error TEXT"; while a `run` runs,
-- the host may send the line "kill" on the same connection (Conn:kill).
local async = require("demesne.async")
local loop = require("core.loop")
local stream = require("core.stream")
local timer = require("core.timer")

local channel = {}

--- The socket's name in a run folder, and its path inside the sandbox.
channel.NAME = "init.sock"
channel.PATH = "/.demesne/run/init.sock"
--- Bytes a connection may receive in all; more is a protocol error (the sandbox is talking).
channel.MAX_REPLY = 4096
--- The longest request payload demesne-init takes (CONTROL_MAX in core/init/init.h).
channel.MAX_REQUEST = 4 * 1024 * 1024

--- Encodes a request: op ("run" or "kill"), its arguments (the words of `demesne-init op`
--- after the mode) and environment ("K=V" strings, applied over the sandbox's own).
---@param op string
---@param args string[]
---@param env string[]|nil
---@return string|nil frame, string|nil err
function channel.encode(op, args, env)
  env = env or {}
  local parts = { op, tostring(#args) }
  for _, a in ipairs(args) do parts[#parts + 1] = a end
  parts[#parts + 1] = tostring(#env)
  for _, e in ipairs(env) do parts[#parts + 1] = e end
  for _, p in ipairs(parts) do
    if p:find("\0", 1, true) then return nil, "a request string contains a NUL byte" end
  end
  local payload = table.concat(parts, "\0") .. "\0"
  if #payload > channel.MAX_REQUEST then
    return nil, ("the command and its environment take %d bytes, over the %d a request may hold"):format(#payload,
      channel.MAX_REQUEST)
  end
  return "DMI1" .. string.pack(">I4", #payload) .. payload
end

-- What a reply line may be: {kind, value}. Anything else is a protocol error.
local function parse_line(line)
  if line == "ok" then return { kind = "ok" } end
  local pid = line:match("^started (%d+)$")
  if pid and #pid <= 10 then return { kind = "started", pid = math.tointeger(tonumber(pid)) } end
  local code = line:match("^exit (%-?%d+)$")
  if code and #code <= 11 then return { kind = "exit", code = math.tointeger(tonumber(code)) } end
  local text = line:match("^error (.*)$")
  if text then return { kind = "error", text = (text:gsub("[%c\128-\255]", "?")) } end
end

---@class ChannelConn
---@field stream userdata|nil
local Conn = {}
Conn.__index = Conn

local function new_conn(s)
  local c = setmetatable({ stream = s, buf = "", seen = 0, replies = {} }, Conn)
  s:read_start(function(data, err, code)
    if data then
      c.seen = c.seen + #data
      if c.seen > channel.MAX_REPLY then
        return c:hangup("the sandbox sent more than its control replies can hold", "EPROTO")
      end
      c.buf = c.buf .. data
      while true do
        local nl = c.buf:find("\n", 1, true)
        if not nl then break end
        local r = parse_line(c.buf:sub(1, nl - 1))
        c.buf = c.buf:sub(nl + 1)
        if not r then return c:hangup("the sandbox sent a reply that is not part of the protocol", "EPROTO") end
        c.replies[#c.replies + 1] = r
      end
      if #c.buf > 256 then return c:hangup("the sandbox sent an overlong reply line", "EPROTO") end
      c:wake()
    else
      c:hangup(err or "the sandbox closed the control connection", code or "EOF")
    end
  end)
  return c
end

--- Wakes the task waiting in Conn:next (a line arrived or the connection ended), if any.
function Conn:wake()
  local w = self.waiter
  self.waiter = nil
  if w then w() end
end

--- The connection is over: why (kept for readers), stream closed, waiters and watchers told.
--- Idempotent: the first reason stays.
---@param why string   the reason Conn:next returns from now on
---@param code string  its error code ("EOF", "ECONNRESET", …)
function Conn:hangup(why, code)
  if self.closed then return end
  self.closed, self.closed_code = why, code
  if self.stream then self.stream:close() self.stream = nil end
  self:wake()
  local fn = self.on_hangup
  self.on_hangup = nil
  if fn then fn(why, code) end
end

--- Calls fn(why, code) once when the connection ends (the sandbox hung up or broke the
--- protocol); at once if it already has. Replaces an earlier watcher.
---@param fn fun(why: string, code: string)|nil
function Conn:watch(fn)
  if self.closed and fn then return fn(self.closed, self.closed_code) end
  self.on_hangup = fn
end

--- Sends a request (channel.encode) and waits until it is written, at most `ms` (default
--- 10 s: a peer that does not read a large request must not hold the caller; the
--- connection is then closed). Returns true, or nil, message, code.
---@param op string
---@param args string[]
---@param env string[]|nil
---@param ms integer|nil
function Conn:send(op, args, env, ms)
  local frame, err = channel.encode(op, args, env)
  if not frame then return nil, err, "EINVAL" end
  if not self.stream then return nil, self.closed or "not connected", self.closed_code or "EOF" end
  local s = self.stream
  local t
  local ok, werr, wcode = async.await(function(cb)
    local queued, qerr, qcode = s:write(frame, cb)
    if not queued then return cb(nil, qerr, qcode) end
    t = timer.after(ms or 10000, function()
      self:hangup("the sandbox did not take the request on its control socket in time", "ETIMEDOUT")
      cb(nil, self.closed, self.closed_code)
    end)
    return function() if t then t:close() t = nil end end
  end)
  if t then t:close() end
  if not ok then return nil, werr, wcode end
  return true
end

--- Asks demesne-init to SIGKILL the command this connection runs, now (the line "kill"
--- after the request; docs/reference/demesne-init.md, "Control socket"): faster than the
--- engine's kill, which the caller sends as well (a sandbox's demesne-init may not listen).
--- Does not wait. Returns true once queued, or nil, message, code.
---@return boolean|nil ok, string|nil err, string|nil code
function Conn:kill()
  if not self.stream then return nil, self.closed or "not connected", self.closed_code or "EOF" end
  return self.stream:write("kill\n", function() end)
end

--- The next reply {kind = "ok"|"started"|"exit"|"error", pid, code, text}, waiting at most
--- `ms` (nil: no limit). Returns nil, message, code when the connection ended ("EOF",
--- "EPROTO" when the sandbox broke the protocol) or the time ran out ("ETIMEDOUT").
---@param ms integer|nil
---@return table|nil reply, string|nil err, string|nil code
function Conn:next(ms)
  while true do
    if #self.replies > 0 then return table.remove(self.replies, 1) end
    if self.closed then return nil, self.closed, self.closed_code end
    local timed_out = false
    local t
    async.await(function(cb)
      self.waiter = cb
      if ms then t = timer.after(ms, function() timed_out = true cb() end) end
      return function()
        self.waiter = nil
        if t then t:close() t = nil end
      end
    end)
    if t then t:close() end
    if timed_out and #self.replies == 0 and not self.closed then
      self.waiter = nil
      return nil, ("the sandbox did not answer on its control socket within %d ms"):format(ms), "ETIMEDOUT"
    end
  end
end

--- Closes the connection (demesne-init sees the host hang up). Idempotent.
function Conn:close() self:hangup("closed by the host", "ECANCELED") end
Conn.__close = Conn.close

--- Connects to the control socket in run_dir, once. Returns the connection, or nil,
--- message, code (ENOENT: no socket yet or none at all; ECONNREFUSED: nobody listens;
--- ENOTSOCK: something else is there, never followed).
---@param run_dir string
---@return ChannelConn|nil conn, string|nil err, string|nil code
function channel.connect(run_dir)
  local s, err, code = async.await(function(cb)
    local ok, e, c = stream.connect_unix_at(run_dir, channel.NAME, cb)
    if not ok then cb(nil, e, c) end
  end)
  if not s then return nil, err, code end
  return new_conn(s)
end

--- Connects to the control socket of a sandbox that is starting: retries while the socket
--- is missing or refuses, for at most `ms`. `alive()` (optional) is asked between tries
--- after the first second and may end the wait by returning false, why.
---@param run_dir string
---@param ms integer
---@param alive fun(): boolean, string|nil
---@return ChannelConn|nil conn, string|nil err, string|nil code
function channel.connect_wait(run_dir, ms, alive)
  local t0 = loop.now()
  local delay = 1
  while true do
    local c, err, code = channel.connect(run_dir)
    if c then return c end
    if code ~= "ENOENT" and code ~= "ECONNREFUSED" and code ~= "EAGAIN" then return nil, err, code end
    local waited = loop.now() - t0
    if waited >= ms then
      return nil, ("demesne-init did not open its control socket within %d ms (%s)"):format(ms, err), "ETIMEDOUT"
    end
    if alive and waited > 1000 then
      local ok, why = alive()
      if not ok then return nil, why or "the sandbox stopped before it was ready", "ENOENT" end
    end
    async.sleep(delay)
    delay = math.min(delay * 2, 10)
  end
end

return channel
