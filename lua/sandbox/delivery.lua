-- How a one-shot's command reaches demesne-init, as one object (a Delivery) of one of three
-- modes, chosen once when the run is planned:
--
--   "control"  the container's PID 1 is `demesne-init wait --control`; once it runs, the host
--              connects to its control socket (lua/channel.lua) and sends the command there;
--              demesne-init answers "exit CODE" on the same connection
--   "exec"     the container's PID 1 is `demesne-init serve` (a warm gVisor sandbox, whose
--              host cannot connect to a socket made inside); the command goes through the
--              engine's exec API as `demesne-init run`, in a task of its own
--   "argv"     the command is in the container's own command line (`demesne-init run … --`);
--              nothing is sent, the container's end is the command's
--
-- Whatever the mode, Delivery:wait is the one place that turns what the delivery saw (an
-- "exit CODE", an exec's exit code, a connection or exec that ended without one) and the
-- engine's wait into the run's exit status.
local async = require("demesne.async")
local channel = require("demesne.channel")
local errors = require("demesne.errors")
local loop = require("core.loop")
local spec = require("demesne.sandbox.spec")

local delivery = {}

local fail, check = errors.raise, errors.check

--- The modes a Delivery can have (see the header).
delivery.MODES = { control = true, exec = true, argv = true }

---@class Delivery
---@field mode string      "control", "exec" or "argv"
---@field conn table|nil   [control] the control connection (lua/channel.lua), once started
---@field task table|nil   [exec] the task of the engine exec, once sent
local Delivery = {}
Delivery.__index = Delivery

--- A new Delivery of `mode` ("control", "exec" or "argv"); raises on any other mode.
---@param mode string
---@return Delivery
function delivery.new(mode)
  if not delivery.MODES[mode] then error(("delivery: %q is not control, exec or argv"):format(tostring(mode)), 2) end
  return setmetatable({ mode = mode }, Delivery)
end

--- Whether `v` is a Delivery.
---@param v any
---@return boolean
function delivery.is(v) return getmetatable(v) == Delivery end

--- The container's command (the words after demesne-init's path) for this mode: `relay` is
--- demesne-init's relay options (spec.relay_args), `run_words` the words of `demesne-init run`
--- after "run" that run the command (used by "argv" only).
---@param relay string[]
---@param run_words string[]
---@return string[]
function Delivery:init_cmd(relay, run_words)
  if self.mode == "control" then return { "wait", "--control", channel.PATH, table.unpack(relay) } end
  if self.mode == "exec" then return { "serve", table.unpack(relay) } end
  local cmd = { "run", table.unpack(relay) }
  for _, a in ipairs(run_words) do cmd[#cmd + 1] = a end
  return cmd
end

--- Called once the container has started: "control" connects to demesne-init's control
--- socket (at most 30 s; fails when the container stops first). Nothing for the others.
---@param o table  the plan (engine, run_id, run_dir)
function Delivery:started(o)
  if self.mode ~= "control" then return end
  local eng, rid = o.engine, o.run_id
  self.conn = check(channel.connect_wait(o.run_dir, 30000, function()
    local info = spec.state_of(eng, rid) -- by list, not inspect: see spec.state_of
    if info and info.state ~= "running" and info.state ~= "created" then
      return false, ("the sandbox stopped (%s) before demesne-init opened its control socket"):format(info.state)
    end
    return true
  end))
end

--- Hands the command to demesne-init: "control" sends a `run` request (`run_words`, `env`)
--- and returns once demesne-init accepted it (fails otherwise); "exec" starts the engine
--- exec of `demesne-init run` in a task of its own (self.task) and returns at once; "argv"
--- does nothing (the command is in the container's command line).
---@param o table  the plan (engine, id, name, timeout)
---@param run_words string[]  the words after `demesne-init run`
---@param env string[]  "K=V" list
function Delivery:send(o, run_words, env)
  if self.mode == "control" then
    local ok, err, code = self.conn:send("run", run_words, env)
    if ok then
      local r
      r, err, code = self.conn:next(10000)
      if r and r.kind == "ok" then return end
      if r then err, code = "demesne-init refused the command: " .. tostring(r.text or r.kind), "EPROTO" end
    end
    fail("sandbox run failed: " .. tostring(err), code)
  elseif self.mode == "exec" then
    local argv = { spec.INIT, "run" }
    for _, a in ipairs(run_words) do argv[#argv + 1] = a end
    local eng, id, ms = o.engine, o.id, spec.deadline_ms(o.timeout)
    self.task = async.spawn("exec " .. tostring(o.name), function()
      return eng:exec(id, argv, { env = env, timeout_ms = ms })
    end)
  end
end

-- The container's own end, when the delivery ended without an exit code: at most 10 s and
-- never past the deadline.
local function container_end(eng, id, deadline)
  return async.timeout(math.max(math.min(10000, math.floor(deadline - loop.now())), 1),
    function() return eng:wait(id) end)
end

--- Waits up to `ms` for the command's end and reconciles its exit status, the one place that
--- does: the exec's exit code ("exec"), demesne-init's "exit CODE" ("control"), else the
--- container's end (engine wait); an exec or connection that ended without a code falls
--- back to the container's end. Returns the exit code, or nil, message, code ("ETIMEDOUT",
--- "ENOENT" when the container is gone, …).
---@param eng table  the engine adapter
---@param id string  the container id or name
---@param ms integer
---@return integer|nil code, string|nil err, string|nil ecode
function Delivery:wait(eng, id, ms)
  local deadline = loop.now() + ms
  if self.task then
    local task = self.task
    local code, err, ecode = async.timeout(ms, function()
      local ok, c, e, ec = task:wait()
      if not ok then error(c, 0) end
      return c, e, ec
    end)
    if code ~= nil or ecode == "ETIMEDOUT" then return code, err, ecode end
    -- the exec ended without an exit code (the sandbox was killed: over its memory, say)
    return container_end(eng, id, deadline)
  end
  if self.conn then
    -- demesne-init says "exit CODE" once status.json is written; no engine wait (Podman's polls)
    while true do
      local r, err, code = self.conn:next(math.max(math.floor(deadline - loop.now()), 1))
      if r and r.kind == "exit" then return r.code end
      if not r then
        if code == "ETIMEDOUT" then return nil, err, code end
        return container_end(eng, id, deadline)
      end
    end
  end
  return async.timeout(ms, function() return eng:wait(id) end)
end

--- Asks demesne-init to kill the command at once ("control": a kill on the connection);
--- the caller kills the container too. Nothing for the other modes.
function Delivery:kill()
  if self.conn then self.conn:kill() end
end

--- Cancels an exec still in flight ("exec"; it ends with the container anyway).
---@param why string
function Delivery:cancel(why)
  if self.task and not self.task.done then async.cancel(self.task, why) end
end

--- Closes the control connection, if any (a `wait` that sees the host hang up exits); a
--- Delivery is also a `<close>` value that does this.
function Delivery:close()
  local c = self.conn
  if c then c:close() end
end

Delivery.__close = Delivery.close

return delivery
