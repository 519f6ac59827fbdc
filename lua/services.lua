-- The services runner: a server's long-running parts, each `{name, start(ctx), stop(ctx)}`,
-- started in the order of a declared list and stopped in the reverse order, by one
-- function each. The list belongs to the composition root (compose.SERVICES, started and
-- stopped by `demesne serve`); this module only runs one.
--
--   local running = services.start(compose.SERVICES, ctx)
--   …                                  -- serve the transport
--   services.stop(running, ctx)         -- the last service started stops first
--
-- A service's start and stop run where the caller runs them (`demesne serve`: outside any
-- task, the stops once the transport has stopped the loop); a start may spawn a task (the
-- reaper) and its stop cancel it. Either may be left out: a service that only starts (its
-- stop is elsewhere, or there is nothing to stop) or only stops.
local errors = require("demesne.errors")
local log = require("demesne.log")

local services = {}

---@class Service
---@field name string
---@field start fun(ctx: table)|nil  starts it; an error stops the services started before it
---@field stop fun(ctx: table)|nil   stops it; an error is logged and the next service stops

---@class RunningServices
---@field started Service[]  in the order of their starts

local function check(list)
  if type(list) ~= "table" then error("services.start: a list of services, not " .. type(list), 3) end
  for i, s in ipairs(list) do
    if type(s) ~= "table" or type(s.name) ~= "string" or s.name == ""
      or (s.start ~= nil and type(s.start) ~= "function") or (s.stop ~= nil and type(s.stop) ~= "function") then
      error(("services.start: services[%d] needs a name and start and stop functions (or none)"):format(i), 3)
    end
  end
end

--- Starts the services of `list` in its order, each with `ctx` (a table the services share:
--- what the command parsed, what one service hands to the next). A start that raises stops
--- the services started so far, in reverse, and raises its error; a list that is no list of
--- services raises before anything starts.
---@param list Service[]
---@param ctx table
---@return RunningServices running  for services.stop
function services.start(list, ctx)
  check(list)
  local running = { started = {} }
  for _, s in ipairs(list) do
    if s.start then
      local ok, err = pcall(s.start, ctx)
      if not ok then
        services.stop(running, ctx)
        error(err, 0)
      end
    end
    running.started[#running.started + 1] = s
  end
  return running
end

--- Stops what services.start started, in the reverse order of the starts, each once (a
--- second call stops nothing). A stop that raises is logged under demesne.services and the
--- services before it still stop.
---@param running RunningServices
---@param ctx table
function services.stop(running, ctx)
  while #running.started > 0 do
    local s = table.remove(running.started)
    if s.stop then
      local ok, err = pcall(s.stop, ctx)
      if not ok then log.warning("demesne.services", "service %s: stop: %s", s.name, errors.message(err)) end
    end
  end
end

return services
