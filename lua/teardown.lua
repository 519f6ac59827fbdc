-- Work that runs after a call has answered: removing a one-shot's container, discarding a
-- warm sandbox. Each piece is a task of its own, tracked here, so that the answer does not
-- wait for the engine while a graceful shutdown still does (`demesne serve` calls
-- teardown.wait before it exits). A crash leaves what was pending to the reaper, which
-- works from the engine's labels (lua/sandbox.lua, sandbox.reap).
local async = require("demesne.async")
local log = require("demesne.log")

local teardown = {}

local pending = {} -- task -> true while it runs

--- Starts fn(...) in a tracked task of its own; an error is logged, never raised.
---@param name string  shown in logs
---@param fn function
---@return Task
function teardown.spawn(name, fn, ...)
  local task
  task = async.spawn(name, function(...)
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
