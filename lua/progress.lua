-- Heartbeat progress for long waits: while a tool call waits (a command, a background job),
-- send notifications/progress every `progress_interval` seconds when the caller sent a
-- progressToken, so clients that reset their timeout on progress keep waiting (case C22).
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local loop = require("core.loop")
local util = require("demesne.util")

local progress = {}

local NOOP = util.NOOP

--- Starts a heartbeat for the call `ctx`: every interval it sends `progress` = seconds
--- since the heartbeat started (strictly increasing), `total` = opts.total (seconds, may be
--- nil) and the message `opts.message(elapsed_seconds)` returns (or "running for N s").
--- Returns a to-be-closed value that stops it: `local _ <close> = progress.heartbeat(ctx)`.
--- Without a progressToken (or without ctx) nothing is started.
---@param ctx ToolContext|nil
---@param opts {total: number|nil, message: (fun(elapsed: number): string|nil)|nil, interval: number|nil}|nil
---@return table closable
function progress.heartbeat(ctx, opts)
  local token = ctx and type(ctx.meta) == "table" and ctx.meta.progressToken
  if not ctx or not ctx.progress or token == nil or token == json.null then return NOOP end
  opts = opts or {}
  local interval_ms = math.max(math.floor((opts.interval or config.get("progress_interval")) * 1000), 50)
  local start = loop.now()
  local task = async.spawn("heartbeat", function()
    while true do
      async.sleep(interval_ms)
      local elapsed = math.floor(loop.now() - start) / 1000
      local msg = opts.message and opts.message(elapsed) or ("running for %d s"):format(math.floor(elapsed))
      ctx.progress(elapsed, opts.total, msg)
    end
  end)
  return util.closer(function() async.cancel(task, "done") end)
end

return progress
