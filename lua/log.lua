-- Logging: RFC 5424 levels (as MCP logging uses them). Records go to stderr (stdout
-- carries only protocol) and to any sinks, such as the MCP server's notifications/message.
local util = require("demesne.util")

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
---@param fn fun(level: string, logger: string, message: string, data: any)
---@return fun() remove
function log.add_sink(fn)
  sinks[fn] = true
  return function() sinks[fn] = nil end
end

-- A control byte as a visible escape: "\x1b".
local function escape_control(c) return ("\\x%02x"):format(c:byte()) end

--- Text from elsewhere (a sandbox's request path, a file name) made safe to log: control
--- bytes (C0, DEL) written as \xNN, so that nothing reaches a terminal or splits a record
--- line, and cut to `max` bytes (on a UTF-8 boundary, marked with "…").
---@param s any
---@param max integer|nil  bytes (default 512)
---@return string
function log.printable(s, max)
  s = tostring(s):gsub("[%c\127]", escape_control)
  max = max or 512
  if #s > max then
    local cut = max
    while cut > 0 and (s:byte(cut + 1) or 0) & 0xC0 == 0x80 do cut = cut - 1 end
    s = s:sub(1, cut) .. "…"
  end
  return s
end

--- Writes a record. `data` (optional table) rides along to sinks. `stderr_only` keeps the
--- record from the sinks (the MCP session sends a tool's own log records to its caller only).
---@param level string
---@param logger string  e.g. "demesne.sandbox"
---@param msg string
---@param data table|nil
---@param stderr_only boolean|nil
function log.log(level, logger, msg, data, stderr_only)
  -- control bytes other than tab and line feed never reach the terminal (a message may
  -- carry a sandbox's text): ESC sequences and carriage returns are written as \xNN
  msg = tostring(msg):gsub("[\0-\8\11-\31\127]", escape_control)
  local n = log.LEVELS[level] or 1
  if n >= threshold then
    io.stderr:write(util.iso_now(), " ", level, " ", logger, ": ", msg, "\n")
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
