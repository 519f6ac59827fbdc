-- MCP over stdio: newline-delimited JSON-RPC on fd 0 / fd 1, logs on stderr.
--
-- Reads stdin through the line framer (lines over max_line_bytes are discarded with an
-- error), hands each line to the session (lua/mcp/server.lua), and writes its messages to
-- stdout — the one McpTransport of this session — with the stream's write queue as
-- back-pressure. Stops gracefully on stdin EOF, SIGINT, SIGTERM or SIGHUP, in any order
-- and any number: requests in progress are cancelled and their cleanup awaited (bounded
-- by shutdown_timeout_ms), queued output is flushed, then the loop stops. Later signals
-- do not cut the cleanup short (Claude Code sends SIGINT then SIGTERM 100 ms later; Codex
-- SIGTERM to the process group); only SIGKILL does, and the next start reaps what that leaves.
local async = require("demesne.async")
local log = require("demesne.log")
local tools = require("demesne.tools")
local framing = require("demesne.mcp.framing")
local server = require("demesne.mcp.server")
local mcp_transport = require("demesne.mcp.transport")
local loop = require("core.loop")
local stream = require("core.stream")
local timer = require("core.timer")

local stdio = {}

local LOGGER = "demesne.mcp"
local DRAIN_LOW = 256 * 1024           -- a waiting writer resumes when the queue is this small
local PAUSE_INPUT_BYTES = 16 * 1024 * 1024 -- stdin is not read while this much output is queued

-- The output side, an McpTransport: a libuv stream when fd 1 is a pipe, socket or
-- terminal, else blocking writes (a regular file). on_broken() is called once when the
-- peer went away.
local function open_output(fd, on_broken, on_drained)
  local out = {}
  function out.is_closing() return out.closed == true end
  function out.terminate() out.close() end
  local s = stream.open_fd(fd)
  local broken = false
  local waiters = {}
  local function wake()
    local ws = waiters
    waiters = {}
    for _, w in ipairs(ws) do w() end
  end
  if s then
    local function written(ok, err)
      if not ok and not broken then
        broken = true
        log.warning(LOGGER, "stdout: %s", tostring(err))
        on_broken()
      end
      if broken or not s or s:write_queue_size() <= DRAIN_LOW then
        wake()
        on_drained()
      end
    end
    function out.write(_, line)
      if broken or not s then return nil, "stdout is closed" end
      local ok, err = s:write(line .. "\n", written)
      if not ok then
        broken = true
        on_broken()
        return nil, err
      end
      return true
    end
    function out.backlog() return (s and not broken) and s:write_queue_size() or 0 end
    --- Waits (inside a task) until at most DRAIN_LOW bytes are queued.
    function out.drain()
      while out.backlog() > DRAIN_LOW do
        async.await(function(cb)
          waiters[#waiters + 1] = cb
          return function()
            for i, w in ipairs(waiters) do if w == cb then table.remove(waiters, i) break end end
          end
        end)
      end
    end
    function out.flush(ms)
      if out.backlog() == 0 then return end
      async.timeout(ms, function()
        while out.backlog() > 0 do
          async.await(function(cb)
            waiters[#waiters + 1] = cb
            return function()
              for i, w in ipairs(waiters) do if w == cb then table.remove(waiters, i) break end end
            end
          end)
        end
      end)
    end
    function out.close()
      out.closed = true
      if s then s:close(); s = nil end
      wake()
    end
  else
    local f = io.stdout
    function out.write(_, line)
      if broken then return nil, "stdout is closed" end
      local ok, err = f:write(line, "\n")
      if ok then ok, err = f:flush() end
      if not ok then
        broken = true
        on_broken()
        return nil, err
      end
      return true
    end
    function out.backlog() return 0 end
    function out.drain() end
    function out.flush() end
    function out.close() out.closed = true end
  end
  return out
end

-- The input side: a libuv stream when fd 0 is a pipe, socket or terminal; otherwise (a
-- regular file, /dev/null) chunks read from io.stdin, one per loop turn.
-- on_chunk(data) per chunk; on_end(err) once at EOF or error.
-- Returns {stop = fn, pause = fn, resume = fn} (pause/resume: stop and restart reading).
local function open_input(fd, on_chunk, on_end)
  local s = stream.open_fd(fd)
  if s then
    local paused = false
    local function on_read(data, rerr)
      if data then on_chunk(data) else on_end(rerr) end
    end
    local ok, err = s:read_start(on_read)
    if not ok then
      s:close()
      on_end(err)
      return { stop = function() end, pause = function() end, resume = function() end }
    end
    return {
      stop = function() if s then s:close(); s = nil end end,
      pause = function()
        if s and not paused then paused = true; s:read_stop() end
      end,
      resume = function()
        if s and paused then
          paused = false
          local rok, rerr = s:read_start(on_read)
          if not rok then on_end(rerr) end
        end
      end,
    }
  end
  local stopped = false
  local t
  local function pump()
    t = nil
    if stopped then return end
    local data = io.stdin:read(65536)
    if data then
      on_chunk(data)
      if not stopped then t = timer.after(0, pump) end
    else
      stopped = true
      on_end(nil)
    end
  end
  t = timer.after(0, pump)
  return {
    stop = function()
      stopped = true
      if t then t:close(); t = nil end
    end,
    pause = function() end,
    resume = function() end,
  }
end

--- Runs the MCP server on stdin/stdout until stdin closes or SIGINT, SIGTERM or SIGHUP
--- arrives. Returns the process exit status (0 after a graceful stop).
--- `opts.on_stop(timeout_ms)` (optional) runs in the shutdown task beside the session's
--- own stop (the in-sandbox endpoint's server stops with it).
--- `opts.on_shutdown` (optional) runs inside the shutdown task once the requests in progress
--- have been cancelled and cleaned up, before the loop stops.
---@param opts {fixtures: string|nil, registry: ToolRegistry|nil, input_fd: integer|nil, output_fd: integer|nil, on_stop: fun(timeout_ms: integer)|nil, on_shutdown: function|nil}|nil
---@return integer
function stdio.serve(opts)
  opts = opts or {}
  -- stdout carries only the protocol: a stray print() or io.write() goes to stderr
  io.output(io.stderr)
  _G.print = function(...)
    local parts = table.pack(...)
    for i = 1, parts.n do parts[i] = tostring(parts[i]) end
    io.stderr:write(table.concat(parts, "\t", 1, parts.n), "\n")
  end
  local limits = mcp_transport.limits()
  local registry = opts.registry or tools.load({ fixtures = opts.fixtures })
  local status = 0
  local shutting_down = false
  local input
  local signals
  local begin_shutdown

  local out = open_output(opts.output_fd or 1, function()
    if begin_shutdown then begin_shutdown("stdout closed") end
  end, function()
    if input then input.resume() end
  end)
  local srv = server.new({
    transport = out,
    registry = registry,
    max_message_bytes = limits.max_message_bytes,
    listener = "stdio",
  })

  local function close_all()
    if signals then signals(); signals = nil end
    if input then input.stop() end
    out.close()
  end

  begin_shutdown = function(reason)
    if shutting_down then return end
    shutting_down = true
    log.info(LOGGER, "shutting down (%s), %d request(s) in progress", reason, srv:pending())
    if input then input.stop() end
    async.spawn("mcp shutdown", function()
      mcp_transport.graceful_stop(LOGGER, function(ms) srv:shutdown(ms) end, opts, limits.shutdown_timeout_ms)
      pcall(out.flush, 2000)
      close_all()
      loop.stop()
    end)
  end

  local reader = framing.reader(limits.max_line_bytes, function(line)
    if shutting_down then return end
    local ok, err = xpcall(srv.receive, debug.traceback, srv, line)
    if not ok then log.error(LOGGER, "failed to handle a message: %s", tostring(err)) end
    -- the client is not reading what we write: stop reading what it sends until it does
    if input and out.backlog() > PAUSE_INPUT_BYTES then input.pause() end
  end, function(bytes)
    srv:overflow(bytes, limits.max_line_bytes)
  end)

  signals = mcp_transport.watch_signals(function(name) begin_shutdown("SIG" .. name) end)

  input = open_input(opts.input_fd or 0, function(data) reader.feed(data) end, function(err)
    if err then log.warning(LOGGER, "stdin: %s", tostring(err)) end
    if not shutting_down then reader.finish() end
    begin_shutdown(err and "stdin error" or "stdin closed")
  end)

  log.info(LOGGER, "demesne %s serving MCP on stdio (%d tools)", loop.version, #registry:list())
  loop.run()
  close_all()
  srv:close()
  return status
end

return stdio
