-- The in-sandbox MCP endpoint: demesne's own Streamable HTTP server (lua/mcp/http.lua, the
-- same session layer and revisions as `serve --http`) with one relay listener per tree node,
-- serving the child tools (lua/tree/child.lua).
--
-- Inside a sandbox, demesne-init relays 127.0.0.1:3130 (tree.PORT) to
-- /.demesne/run/mcp.sock, which is <run_dir>/mcp.sock on the host; each connection's TCP
-- socket is handed over and served here (core.httpd listen_relay). No network interface is
-- added. Identity is structural: the listener a connection arrived on is tagged with the
-- calling run ("run:<run id>", tree.tag); the run's bearer token is required on every request
-- as a second check (compared in C, in constant time); Host must be loopback. Nothing the
-- sandbox sends can name another run. Everything on the socket is hostile input: bodies,
-- heads (a new connection's within http_head_timeout_seconds), connections (per run:
-- endpoint_max_connections that presented the token, endpoint_max_preauth_connections that have
-- not yet), sessions (endpoint_max_sessions per run, apart from the host's) and output are bounded in C and in
-- lua/mcp/http.lua, and a session there is scoped (server option `scope`): it hears only of
-- the ends of its own subtree's jobs, and no host log record.
--
-- Host MCP servers (lua/hostmcp): on the same port and listener, /mcp/host/<server> is that
-- server's allowed tools (lua/hostmcp/proxy.lua) for an agent run it is offered to
-- (tree.offers_host_mcp), and 404 for any other caller or name. Each call is appended to
-- mcp.jsonl in the calling run's output folder; notifications/tools/list_changed from the
-- upstream goes to every session on its path that has its GET stream open.
local child = require("demesne.tree.child")
local hostmcp = require("demesne.hostmcp")
local proxy = require("demesne.hostmcp.proxy")
local fs = require("core.fs")
local http = require("demesne.mcp.http")
local log = require("demesne.log")
local tree = require("demesne.tree")

local endpoint = {}

local LOGGER = "demesne.tree"
local handle
local unsubscribe -- from hostmcp.on_tools_changed
local proxies = {} -- server name -> its registry (shared by every run it is offered to)
local HOST_NAME = "^[A-Za-z0-9][A-Za-z0-9_-]*$"

-- The output folder of the run a tool call came from (its listener), for mcp.jsonl.
local function caller_output_dir(ctx)
  local id = tree.run_of_tag(ctx.listener)
  local n = id and tree.get(id)
  return n and n.output_dir or nil
end

-- The route of /mcp/host/<server> for the run on `listener`, or nil (404).
local function host_route(path, listener)
  local rest = path:sub(1, #tree.HOST_MCP_PATH) == tree.HOST_MCP_PATH and path:sub(#tree.HOST_MCP_PATH + 1) or nil
  if not rest or not rest:match(HOST_NAME) or #rest > 64 then return nil end
  if not tree.offers_host_mcp(tree.run_of_tag(listener), rest) then return nil end
  local reg = proxies[rest]
  if not reg then
    reg = proxy.registry(rest, { output_dir = caller_output_dir })
    proxies[rest] = reg
  end
  return { registry = reg, options = { tools_only = true, instructions = ("The tools of the host MCP server %s, run "
    .. "on the host by demesne and offered here as its operator allowed. Each call is recorded in /out/mcp.jsonl.")
    :format(rest) } }
end

local function scope_of(listener)
  local run_id = tree.run_of_tag(listener)
  return { job = function(job_id) return run_id ~= nil and tree.sees_job(run_id, job_id) end }
end

--- Starts the endpoint's server for the tools of `registry` (the host's: the child tools
--- are derived from it) and installs it in the tree (tree.set_endpoint). Returns the
--- server's handle, or nil and why.
---@param registry ToolRegistry
---@param opts {max_message_bytes: integer|nil, shutdown_timeout_ms: integer|nil}|nil
---@return table|nil handle, string|nil err
function endpoint.start(registry, opts)
  if handle then return handle end
  opts = opts or {}
  local h, err = http.start({ addrs = {}, registry = child.registry(registry),
    max_message_bytes = opts.max_message_bytes, shutdown_timeout_ms = opts.shutdown_timeout_ms,
    session_options = function(listener) return { scope = scope_of(listener) } end,
    routes = host_route })
  if not h then return nil, err end
  handle = h
  tree.set_host_mcp(hostmcp)
  unsubscribe = hostmcp.on_tools_changed(function(server)
    local path = tree.HOST_MCP_PATH .. server
    h.notify(function(_, p) return p == path end, "notifications/tools/list_changed")
  end)
  tree.set_endpoint({
    open = function(n)
      -- its own connection and session caps (endpoint_max_*): no sandbox can take another's
      local ok, lerr = h.listen_relay(n.endpoint.socket, { tag = tree.tag(n.run_id), token = n.endpoint.token })
      if not ok then return nil, lerr end
      -- whatever user the image runs as may connect; the token and the socket folder are the checks
      local d = fs.opendir(n.run_dir)
      if d then
        d:chmod(tree.SOCKET_NAME, 438) -- through the held folder: a swap cannot redirect it
        d:close()
      end
      return true
    end,
    close = function(run_id) h.unlisten(tree.tag(run_id)) end,
  })
  log.debug(LOGGER, "in-sandbox MCP endpoint ready (%s inside each sandbox)", tree.URL)
  return h
end

--- Stops the endpoint (inside a task): every listener closes, the requests in progress on
--- them are cancelled and their cleanup awaited (up to timeout_ms).
---@param timeout_ms integer
function endpoint.stop(timeout_ms)
  local h = handle
  handle = nil
  tree.set_endpoint(nil)
  tree.set_host_mcp(nil)
  if unsubscribe then unsubscribe() end
  unsubscribe, proxies = nil, {}
  if h then h.stop(timeout_ms) end
end

--- The running endpoint's handle (tests), or nil.
function endpoint.handle() return handle end

return endpoint
