-- The transport interface the MCP session layer (lua/mcp/server.lua) writes through, in the
-- shape of Neovim's vim.lsp.rpc Transport. A transport only moves whole, encoded JSON-RPC
-- messages; the protocol (lifecycle, versions, dispatch, cancellation, progress, logging,
-- notifications) is the session layer's.
--
-- Each request the session handles carries the transport its answer goes back on (its
-- "channel"): on stdio that is stdout for everything; over HTTP it is the request's own
-- response (JSON or an SSE stream), while messages that relate to no request (job ends,
-- list changes) go on the session's standing transport (the GET stream).
--
---@class McpTransport
---@field write fun(self: McpTransport, line: string, kind: "response"|"notification"|"request"): boolean|nil, string|nil
---   writes one encoded message (no trailing newline). `kind` lets a per-request transport
---   end its stream after the response. Returns true, or nil and why it was not written.
---@field is_closing fun(self: McpTransport): boolean  true once nothing more can be written
---@field terminate fun(self: McpTransport)            closes it (idempotent)
---@field backlog (fun(self: McpTransport): integer)|nil bytes written but not yet taken by the peer
---@field drain (fun(self: McpTransport))|nil           waits (inside a task) until the backlog is small
---@field modern boolean|nil   set by the HTTP transport when the request named revision 2026-07-28 in its headers
---@field listener string|nil  the listener the request arrived on (HTTP), for the session's tools
local async = require("demesne.async")
local config = require("demesne.config")
local log = require("demesne.log")
local signal = require("core.signal")

local transport = {}

--- A transport around plain functions: `send(line)` (required), `backlog()` and `drain()`
--- (optional). Used by tests and by callers that write to one sink.
---@param send fun(line: string): boolean|nil, string|nil
---@param backlog (fun(): integer)|nil
---@param drain fun()|nil
---@return McpTransport
function transport.of(send, backlog, drain)
  local closed = false
  return {
    write = function(_, line) if closed then return nil, "transport closed" end return send(line) end,
    is_closing = function() return closed end,
    terminate = function() closed = true end,
    backlog = backlog and function() return backlog() end or nil,
    drain = drain and function() return drain() end or nil,
  }
end

--- A transport that drops everything (a session whose standing stream is not open).
---@return McpTransport
function transport.null()
  return {
    write = function() return nil, "no stream is open for messages that relate to no request" end,
    is_closing = function() return false end,
    terminate = function() end,
  }
end

--- The limits every transport serves under, from the configuration: max_line_bytes
--- (mcp_max_line_bytes, stdio's longest line), max_message_bytes (mcp_max_message_bytes, the
--- largest outgoing message) and shutdown_timeout_ms (mcp_shutdown_timeout_ms).
---@return {max_line_bytes: integer, max_message_bytes: integer, shutdown_timeout_ms: integer}
function transport.limits()
  return {
    max_line_bytes = math.floor(config.get("mcp_max_line_bytes")),
    max_message_bytes = math.floor(config.get("mcp_max_message_bytes")),
    shutdown_timeout_ms = math.floor(config.get("mcp_shutdown_timeout_ms")),
  }
end

--- The one graceful-stop sequence of a server (stdio and HTTP), inside a task: the caller's
--- `on_stop(timeout_ms)` runs in its own task beside `stop(timeout_ms)`, the server's own
--- (requests in progress cancelled and their cleanup awaited); once both ended,
--- `on_shutdown()` (the caller's cleanup: warm sandboxes, removals after answers). An error
--- in one step is logged under `logger` and the next steps still run.
---@param logger string
---@param stop fun(timeout_ms: integer)
---@param opts {on_stop: fun(timeout_ms: integer)|nil, on_shutdown: function|nil}
---@param timeout_ms integer
function transport.graceful_stop(logger, stop, opts, timeout_ms)
  local other = opts.on_stop and async.spawn("stop", opts.on_stop, timeout_ms)
  local ok, err = pcall(stop, timeout_ms)
  if not ok then log.error(logger, "shutdown: %s", tostring(err)) end
  if other then
    local sok, serr = other:wait()
    if not sok then log.error(logger, "shutdown: %s", tostring(serr)) end
  end
  if opts.on_shutdown then
    ok, err = pcall(opts.on_shutdown)
    if not ok then log.error(logger, "shutdown: %s", tostring(err)) end
  end
end

--- Watches SIGINT, SIGTERM and SIGHUP for a server: the first one calls
--- `on_first(name)` ("INT", "TERM" or "HUP"), which starts the graceful stop; every later
--- one is logged and ignored, so the cleanup always completes (only SIGKILL can cut it
--- short). Returns a function that stops watching.
---@param on_first fun(name: string)
---@return fun()
function transport.watch_signals(on_first)
  local watchers, fired = {}, false
  for _, name in ipairs({ "INT", "TERM", "HUP" }) do
    local w = signal.watch(name, function()
      if fired then
        log.notice("demesne.mcp", "SIG%s: already stopping; the cleanup of requests in progress goes on", name)
        return
      end
      fired = true
      on_first(name)
    end)
    if w then watchers[#watchers + 1] = w end
  end
  return function()
    for _, w in ipairs(watchers) do w:close() end
    watchers = {}
  end
end

return transport
