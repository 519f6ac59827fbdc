-- Logging: RFC 5424 levels (as MCP logging uses them). Records go to stderr (stdout
-- carries only protocol) and to any sinks, such as the MCP server's notifications/message.
local loop = require("core.loop")

local log = {}

log.LEVELS = { debug = 0, info = 1, notice = 2, warning = 3, error = 4, critical = 5, alert = 6, emergency = 7 }
local threshold = log.LEVELS[(os.getenv("DEMESNE_LOG_LEVEL") or "info"):lower()] or log.LEVELS.info
local sinks = {}

--- Sets the stderr threshold ("debug" … "emergency"). Returns false for an unknown level.
---@param level string
---@return boolean
function log.set_level(level)
  local n = log.LEVELS[level]
  if not n then return false end
  threshold = n
  return true
end

--- Adds a sink: fn(level, logger, message, data) for every record, whatever the stderr
--- threshold (each sink filters for itself). Returns a function that removes it.
function log.add_sink(fn)
  sinks[fn] = true
  return function() sinks[fn] = nil end
end

--- Writes a record. `data` (optional table) rides along to sinks. `stderr_only` keeps the
--- record from the sinks (the MCP session sends a tool's own log records to its caller only).
---@param level string
---@param logger string  e.g. "demesne.sandbox"
---@param msg string
---@param data table|nil
---@param stderr_only boolean|nil
function log.log(level, logger, msg, data, stderr_only)
  local n = log.LEVELS[level] or 1
  if n >= threshold then
    local t = loop.time()
    io.stderr:write(os.date("!%Y-%m-%dT%H:%M:%S", math.floor(t)), (".%03dZ "):format(math.floor((t % 1) * 1000)),
      level, " ", logger, ": ", msg, "\n")
  end
  if stderr_only then return end
  for fn in pairs(sinks) do pcall(fn, level, logger, msg, data) end
end

for name in pairs(log.LEVELS) do
  log[name] = function(logger, fmt, ...)
    log.log(name, logger, select("#", ...) > 0 and fmt:format(...) or fmt)
  end
end

return log
