-- Work that runs after a call has answered: removing a one-shot's container, discarding a
-- warm sandbox. Each piece is a task of its own, tracked here, so that the answer does not
-- wait for the engine while a graceful shutdown still does (`demesne serve` calls
-- teardown.wait before it exits). A crash leaves what was pending to the reaper, which
-- works from the engine's labels (lua/sandbox/reaper.lua, sandbox.reap).
--
-- Removals give way to calls: while a call waits for the engine to create and start its
-- sandbox (teardown.urgent), they hold back (teardown.quiet, at most 10 s), so that on a
-- busy engine the waiting call goes first. (The warm pool's fills do not wait: they make
-- the sandboxes the next calls need.)
local async = require("demesne.async")
local log = require("demesne.log")

local teardown = {}

local pending = {} -- task -> true while it runs
local urgent = 0   -- calls waiting for the engine (teardown.urgent)
local calm         -- event set when urgent drops to 0

--- Runs fn(...) as engine work a call is waiting for: background work holds back until it
--- is done. Returns fn's results; an error is raised again.
---@param fn function
---@param ... any  fn's arguments
function teardown.urgent(fn, ...)
  urgent = urgent + 1
  local r = table.pack(pcall(fn, ...))
  urgent = urgent - 1
  if urgent == 0 and calm then
    local ev = calm
    calm = nil
    ev.set()
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- Inside a task: waits until no call waits for the engine, at most `ms`.
---@param ms integer
function teardown.quiet(ms)
  if urgent == 0 then return end
  calm = calm or async.event()
  async.timeout(ms, calm.wait)
end

--- Starts fn(...) in a tracked task of its own; an error is logged, never raised.
---@param name string  shown in logs
---@param fn function
---@param ... any  fn's arguments
---@return Task
function teardown.spawn(name, fn, ...)
  local task
  task = async.spawn(name, function(...)
    async.sleep(0) -- the answer goes out first: nothing here runs before the loop's next turn
    teardown.quiet(10000)
    local ok, err = pcall(fn, ...)
    if not ok and err ~= async.CANCELLED then log.warning("demesne.teardown", "%s: %s", name, tostring(err)) end
    pending[task] = nil
  end, ...)
  if not task.done then pending[task] = true end
  return task
end

--- How many tracked tasks are still running.
---@return integer
function teardown.pending()
  local n = 0
  for _ in pairs(pending) do n = n + 1 end
  return n
end

--- Inside a task: waits up to `ms` for every tracked task (also those started meanwhile).
--- Returns true when none is left.
---@param ms integer
---@return boolean
function teardown.wait(ms)
  local ok = async.timeout(ms, function()
    while next(pending) do
      local task = next(pending)
      task:wait()
      pending[task] = nil
    end
    return true
  end)
  return ok == true
end

return teardown
