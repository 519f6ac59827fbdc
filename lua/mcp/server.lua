-- The MCP session layer: JSON-RPC 2.0 dispatch, lifecycle and version negotiation,
-- tools/list, tools/call, ping, cancellation, progress, logging, resources (background
-- jobs) and subscriptions. Transport-agnostic: it is handed one message at a time
-- (server:receive) together with the transport its answer goes back on (lua/mcp/transport.lua),
-- and writes whole encoded messages through it. lua/mcp/stdio.lua and lua/mcp/http.lua are
-- the transports.
--
-- Two protocol eras are served side by side, chosen per message as the 2026-07-28 revision
-- says a dual-era server does:
--   * legacy (2025-11-25, 2025-06-18): `initialize` negotiates a version for the session;
--     logging/setLevel sets the session's level; job ends arrive as notifications/message;
--   * modern (2026-07-28, stateless): a request whose params._meta carries
--     io.modelcontextprotocol/protocolVersion is served on its own: no initialize, the
--     client's capabilities and log level come with the request, results carry resultType
--     and the server's identity, server/discover and subscriptions/listen exist, and
--     initialize, ping and logging/setLevel do not.
--
-- Every request runs in its own task (demesne.async), so responses may go out in any
-- order. notifications/cancelled (or, over HTTP in 2026-07-28, closing the request's
-- stream) cancels the request's task (its <close> handlers run) and no response is sent
-- for it. Every outgoing message is encoded once and bounded by max_message_bytes; a tool
-- result over the bound is replaced by an isError result. JSON-RPC ids go back exactly as
-- they came (core.text.json_raw): lua-cjson alone would turn 2^53+1 into a rounded float.
local async = require("demesne.async")
local json = require("demesne.json")
local log = require("demesne.log")
local tools = require("demesne.tools")
local schema = require("demesne.jsonschema")
local tasks = require("demesne.mcp.tasks")
local resources = require("demesne.mcp.resources")
local transport = require("demesne.mcp.transport")
local util = require("demesne.util")
local loop = require("core.loop")
local timer = require("core.timer")
local text = require("core.text")

local server = {}

local LOGGER = "demesne.mcp"
local null = json.null

--- Legacy protocol revisions (negotiated by initialize), newest first. A client asking for
--- one of these gets it; any other initialize gets the newest. Per-revision differences
--- live in this table.
server.VERSIONS = {
  { version = "2025-11-25", server_description = true, tasks = true },
  { version = "2025-06-18", server_description = false },
}

--- Modern (stateless, per-request) revisions.
server.MODERN_VERSIONS = { ["2026-07-28"] = true }

--- Every revision served, newest first (server/discover's supportedVersions).
server.SUPPORTED_VERSIONS = { "2026-07-28", "2025-11-25", "2025-06-18" }

--- The reserved _meta keys of 2026-07-28.
server.META = {
  PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion",
  CLIENT_INFO = "io.modelcontextprotocol/clientInfo",
  CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities",
  LOG_LEVEL = "io.modelcontextprotocol/logLevel",
  SERVER_INFO = "io.modelcontextprotocol/serverInfo",
  SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId",
}
local META = server.META

--- JSON-RPC error codes (and the MCP 2026-07-28 ones).
server.PARSE_ERROR = -32700
server.INVALID_REQUEST = -32600
server.METHOD_NOT_FOUND = -32601
server.INVALID_PARAMS = -32602
server.INTERNAL_ERROR = -32603
server.RESOURCE_NOT_FOUND = -32002 -- 2025 revisions; 2026-07-28 uses -32602
server.HEADER_MISMATCH = -32020
server.MISSING_CLIENT_CAPABILITY = -32021
server.UNSUPPORTED_PROTOCOL_VERSION = -32022

--- True for a revision served statelessly (2026-07-28).
---@param v any
---@return boolean
function server.is_modern(v) return type(v) == "string" and server.MODERN_VERSIONS[v] == true end

--- True for any revision this server speaks.
---@param v any
---@return boolean
function server.is_supported(v)
  if server.is_modern(v) then return true end
  for _, rev in ipairs(server.VERSIONS) do if rev.version == v then return true end end
  return false
end

--- The server's identity: {name, title, version}.
---@return table
function server.info() return { name = "demesne", title = "demesne", version = loop.version } end

server.DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
server.DEFAULT_LOG_LEVEL = "info"

local LOG_MESSAGE_MAX = 64 * 1024        -- longest log text sent in one notifications/message
local LOG_DROP_BACKLOG = 8 * 1024 * 1024  -- log notifications are dropped while this much output is queued
local BACKPRESSURE_BYTES = 1024 * 1024   -- a task that writes waits while this much output is queued
local CLIENT_REQUEST_TIMEOUT_MS = 5 * 60 * 1000
-- A tools/call response waits this long after the call's last progress notification. The
-- TypeScript SDK client handles notifications a microtask after it reads them but responses
-- at once, and drops the progress handler with the response: a progress notification read
-- in the same chunk as the response is lost ("unknown token"). A short gap avoids that.
local PROGRESS_SETTLE_MS = 25

server.INSTRUCTIONS = table.concat({
  "demesne runs shell commands, scripts and coding agents in disposable containers on this machine.",
  "Host files and folders you name are mounted read-only under /in; each sandbox gets a writable /out",
  "folder on the host that is kept after the sandbox goes (its path is in every result as output_dir).",
  "Every tool result carries structuredContent; long output is cut to a head and tail, and the full",
  "streams are in stdout.log and stderr.log in output_dir. Long calls report progress when you send a",
  "progressToken, and can be cancelled.",
}, " ")

--- A JSON-RPC error to raise from a method handler: error(server.rpc_error(code, msg)).
---@param code integer
---@param message string
---@param data any|nil
---@return table
function server.rpc_error(code, message, data)
  return { rpc_error = true, code = code, message = message, data = data }
end

local function invalid_params(message) error(server.rpc_error(server.INVALID_PARAMS, message), 0) end

local function id_key(id)
  if json.is_raw(id) then
    if type(id.value) == "string" then return "s:" .. id.value end
    return "r:" .. id.token
  end
  if type(id) == "string" then return "s:" .. id end
  if math.type(id) == "integer" or (id == math.floor(id) and math.abs(id) < 2 ^ 63) then
    return ("n:%d"):format(math.tointeger(id) or id)
  end
  return ("n:%.17g"):format(id)
end

local function valid_id(id)
  return type(id) == "string" or json.is_raw(id)
    or (type(id) == "number" and id == id and id ~= math.huge and id ~= -math.huge)
end

--- The id to answer with: exactly the token the client sent. `id` is the decoded value of
--- the member at the key path `...` of `line`. A number goes back verbatim unless it is a
--- plain integer of at most 14 digits (lua-cjson encodes numbers with 14 significant
--- digits, so those come out the same). A string is a string: it goes back as the same
--- string (escapes may be spelled differently, as JSON allows).
---@param id any
---@param line string|nil
---@param ... string|integer  the key path of the id in the message (core.text.json_raw)
---@return any
function server.exact_id(id, line, ...)
  if not line or type(id) ~= "number" then return id end
  local raw = text.json_raw(line, ...)
  if not raw then return id end
  if raw:match("^%-?%d%d?%d?%d?%d?%d?%d?%d?%d?%d?%d?%d?%d?%d?$") and raw ~= "-0" then return math.tointeger(id) or id end
  return json.raw(raw, id)
end
local exact_id = server.exact_id

local function is_object(v) return type(v) == "table" and schema.type_of(v) == "object" end

local function describe(v)
  local t = schema.type_of(v)
  return t == "integer" and "number" or t
end

---@class ServerOptions
---@field transport McpTransport|nil   the session's standing transport: answers to requests
---   received without a channel, and messages that relate to no request
---@field send (fun(line: string): boolean|nil, string|nil)|nil  shorthand for transport.of(send, backlog, drain)
---@field backlog (fun(): integer)|nil
---@field drain fun()|nil
---@field registry ToolRegistry
---@field max_message_bytes integer|nil  bound on one outgoing message (default 4 MiB)
---@field instructions string|nil
---@field forward_logs boolean|nil       send log records as notifications/message to a legacy session (default true)
---@field listener string|nil            the listener the session's requests arrive on (HTTP), given to tools
---@field tools_only boolean|nil     offer tools only: no resources capability, resources/* and
---   subscriptions/listen are not found, no log record is forwarded (a proxied host MCP server
---   on the in-sandbox endpoint)
---@field scope {job: fun(job_id: string): boolean}|nil  what the caller may see (the in-sandbox endpoint):
---   only job-end records of jobs in scope are forwarded (no other host log record), resources
---   list and read only jobs in scope, subscriptions hear only of them, and tasks are not offered

---@class McpServer
local Server = {}
Server.__index = Server

--- Creates a session. Call server:close() (or shutdown) when done with it (removes its log sink).
---@param opts ServerOptions
---@return McpServer
function server.new(opts)
  local t = opts.transport
  if not t then
    assert(opts.send, "opts.transport or opts.send is required")
    t = transport.of(opts.send, opts.backlog, opts.drain)
  end
  local self = setmetatable({
    transport = t,
    registry = opts.registry or tools.registry(),
    max_message = opts.max_message_bytes or server.DEFAULT_MAX_MESSAGE_BYTES,
    instructions = opts.instructions or server.INSTRUCTIONS,
    listener = opts.listener,
    scope = opts.scope,
    tools_only = opts.tools_only == true,
    inflight = {},   -- id key -> entry {id, method, task, cancelled, done, channel, modern, listen}
    outgoing = {},   -- our request id -> callback(result | nil, msg, error)
    next_out = 0,
    dropped_logs = 0,
    closing = false,
    session = {
      initialized = false,       -- initialize accepted
      announced = false,         -- initialize answered: log notifications may flow
      ready = false,             -- notifications/initialized received
      protocol_version = server.VERSIONS[1].version,
      client_info = nil,
      client_capabilities = {},
      log_level = server.DEFAULT_LOG_LEVEL,
    },
  }, Server)
  if opts.forward_logs ~= false then
    self.remove_sink = log.add_sink(function(level, logger, msg, data) self:forward_log(level, logger, msg, data) end)
  end
  return self
end

--------------------------------------------------------------------------------------------
-- Writing

-- Encodes a message once; invalid UTF-8 is replaced so the peer's decoder never chokes.
local function encode(msg)
  local ok, line = pcall(json.encode, msg)
  if not ok then return nil, tostring(line) end
  local clean = text.utf8_clean(line)
  return clean
end

local function kind_of(msg)
  if msg.method == nil then return "response" end
  if msg.id ~= nil then return "request" end
  return "notification"
end

--- Writes one message (a table) on `channel` (default: the session's transport). Returns
--- true, or nil and why it was not sent (too large, cannot be encoded, transport failed).
--- Inside a task it waits while the transport is backed up; outside a task it only queues.
---@param msg table
---@param channel McpTransport|nil
---@return boolean|nil ok, string|nil err
function Server:send(msg, channel)
  local line, err = encode(msg)
  if not line then return nil, "cannot encode: " .. err end
  if #line > self.max_message then
    return nil, ("message of %d bytes exceeds the limit of %d bytes"):format(#line, self.max_message)
  end
  return self:write_line(line, kind_of(msg), channel)
end

--- Writes one encoded message; waits for the transport to drain when called in a task
--- and the backlog is over 1 MiB.
---@param line string
---@param kind "response"|"notification"|"request"
---@param channel McpTransport|nil
---@return boolean|nil ok, string|nil err
function Server:write_line(line, kind, channel)
  local t = channel or self.transport
  local ok, err = t:write(line, kind or "notification")
  if not ok then return nil, err or "write failed" end
  if t.drain and async.current() and t.backlog and (t:backlog() or 0) > BACKPRESSURE_BYTES then t:drain() end
  return true
end

--- Sends a notification (no response expected) on `channel` (default: the session's
--- transport). Oversized or unencodable ones are dropped with a log record. Returns true when sent.
---@param method string
---@param params table|nil
---@param channel McpTransport|nil
---@return boolean
function Server:notify(method, params, channel)
  local ok, err = self:send({ jsonrpc = "2.0", method = method, params = params }, channel)
  if not ok then
    if method ~= "notifications/message" and method ~= "notifications/progress" then
      log.warning(LOGGER, "dropped %s: %s", method, err)
    end
    return false
  end
  return true
end

--- Sends a JSON-RPC error response. `id` nil or json.null answers with id null.
---@param id any
---@param code integer    a JSON-RPC error code (server.PARSE_ERROR …)
---@param message string
---@param data any|nil
---@param channel McpTransport|nil
function Server:respond_error(id, code, message, data, channel)
  local err = { code = code, message = message, data = data }
  local ok, why = self:send({ jsonrpc = "2.0", id = id == nil and null or id, error = err }, channel)
  if not ok then
    log.error(LOGGER, "cannot send error response: %s", why)
    if data ~= nil then
      self:send({ jsonrpc = "2.0", id = id == nil and null or id, error = { code = code, message = message } }, channel)
    end
  end
end

--- Sends a result, encoded once. `tool` names the tool when `result` is a CallToolResult:
--- an oversized one is then replaced by an isError result; any other oversized result
--- becomes a -32603 error.
---@param id any
---@param result table
---@param tool string|nil
---@param channel McpTransport|nil
function Server:respond(id, result, tool, channel)
  local line, err = encode({ jsonrpc = "2.0", id = id, result = result })
  if line and #line <= self.max_message then
    local ok, werr = self:write_line(line, "response", channel)
    if not ok then log.warning(LOGGER, "response to %s not sent: %s", tostring(id), tostring(werr)) end
    return
  end
  local why = line and ("the encoded result is %d bytes, over the %d-byte limit on one message"):format(#line, self.max_message)
    or ("the result cannot be encoded as JSON: %s"):format(err)
  line = nil -- luacheck: ignore 311 (let the oversized string go before building the replacement)
  if tool then
    log.warning(LOGGER, "tool %s: result replaced: %s", tool, why)
    local replacement = tools.error_result(("Tool %s produced a result too large to send: %s. "
      .. "Ask for less output (full output stays in the files the tool names)."):format(tool, why))
    if result.resultType then replacement.resultType = result.resultType; replacement._meta = result._meta end
    if not self:send({ jsonrpc = "2.0", id = id, result = replacement }, channel) then
      self:respond_error(id, server.INTERNAL_ERROR, "Internal error: result too large", nil, channel)
    end
  else
    log.error(LOGGER, "response to %s replaced: %s", tostring(id), why)
    self:respond_error(id, server.INTERNAL_ERROR, "Internal error: " .. why, nil, channel)
  end
end

--------------------------------------------------------------------------------------------
-- Logging to the client

local LEVELS = log.LEVELS
local EARLY_LOGS_MAX = 256 -- job-end records kept for a client that has not finished connecting

-- The params of a notifications/message for a record.
local function log_params(level, logger, msg, data)
  msg = tostring(msg)
  -- tracebacks stay in the stderr log; the client gets the first line
  local tb = msg:find("\nstack traceback:", 1, true)
  if tb then msg = msg:sub(1, tb - 1) end
  if #msg > LOG_MESSAGE_MAX then msg = msg:sub(1, text.utf8_floor(msg, LOG_MESSAGE_MAX)) .. "…" end
  local payload = msg
  if data ~= nil then payload = { message = msg, data = data } end
  return { level = level, logger = logger, data = payload }, msg
end

--- The log sink of a legacy session: forwards a record as notifications/message on the
--- session's transport when the session is initialised and the record is at or above the
--- level the client set.
---@param level string
---@param logger string
---@param msg string
---@param data any
function Server:forward_log(level, logger, msg, data)
  if self.in_forward or self.closing or self.tools_only then return end -- tools_only: no host record at all
  if self.scope and not (logger == "demesne.jobs" and type(data) == "table" and type(data.job_id) == "string"
    and self.scope.job(data.job_id)) then
    return -- a scoped session hears of its own jobs' ends, and nothing else of the host's
  end
  if not self.session.announced then
    -- a background job that ends before the client is connected: keep its one terminal
    -- notification (bounded) and send it once initialize is answered
    if logger == "demesne.jobs" and type(data) == "table" and data.job_id and data.status then
      self.early_logs = self.early_logs or {}
      if #self.early_logs < EARLY_LOGS_MAX then
        self.early_logs[#self.early_logs + 1] = { level, logger, msg, data }
      end
    end
    return
  end
  local n = LEVELS[level]
  if not n or n < (LEVELS[self.session.log_level] or 0) then return end
  local t = self.transport
  if t:is_closing() then return end
  if t.backlog and (t:backlog() or 0) > LOG_DROP_BACKLOG then
    self.dropped_logs = self.dropped_logs + 1
    return
  end
  self.in_forward = true
  local params, short = log_params(level, logger, msg, data)
  if not self:notify("notifications/message", params) and data ~= nil then
    self:notify("notifications/message", { level = level, logger = logger, data = short })
  end
  self.in_forward = false
end

--- A tool's own log record goes to its caller only: the request's stream, at the level the
--- session set (legacy) or the request's _meta logLevel (2026-07-28; none without it).
---@param entry table  the request in progress
---@param level string
---@param logger string
---@param msg string
---@param data any
function Server:log_to_caller(entry, level, logger, msg, data)
  if self.closing or entry.done or entry.cancelled then return end
  local threshold
  if entry.modern then
    threshold = entry.modern.log_level
  elseif self.session.announced then
    threshold = self.session.log_level
  end
  if not threshold or (LEVELS[level] or 0) < (LEVELS[threshold] or 0) then return end
  local params, short = log_params(level, logger, msg, data)
  if not self:notify("notifications/message", params, entry.channel) and data ~= nil then
    self:notify("notifications/message", { level = level, logger = logger, data = short }, entry.channel)
  end
end

--------------------------------------------------------------------------------------------
-- Requests to the client (sampling/createMessage, elicitation/create, roots/list)

--- Sends a request to the client and waits (inside a task) for its response, on the
--- stream of the request in progress `entry` (or the session's transport).
--- Returns the result table, or nil, a message and the JSON-RPC error object (or a code:
--- "ETIMEDOUT", "ECANCELED", "EIO", "ENOTSUP" in 2026-07-28, which has no server-to-client
--- requests). Cancelling the calling task sends notifications/cancelled for it.
---@param method string
---@param params table|nil
---@param opts {timeout_ms: integer|nil}|nil
---@param entry table|nil
---@return table|nil result, string|nil err, any detail
function Server:request(method, params, opts, entry)
  assert(async.current(), "server:request must be called inside a task")
  if self.closing then return nil, "server is shutting down", "ECANCELED" end
  if entry and entry.modern then
    return nil, ("%s: revision 2026-07-28 has no requests from server to client"):format(method), "ENOTSUP"
  end
  local channel = entry and entry.channel
  self.next_out = self.next_out + 1
  local id = "demesne-" .. self.next_out
  local ms = opts and opts.timeout_ms or CLIENT_REQUEST_TIMEOUT_MS
  return async.await(function(cb)
    local t
    local function finish(...)
      if t then t:close(); t = nil end
      self.outgoing[id] = nil
      cb(...)
    end
    self.outgoing[id] = finish
    t = timer.after(ms, function()
      t = nil
      self:notify("notifications/cancelled", { requestId = id, reason = "timed out" }, channel)
      finish(nil, ("%s: no response from the client after %d ms"):format(method, ms), "ETIMEDOUT")
    end)
    local ok, err = self:send({ jsonrpc = "2.0", id = id, method = method, params = params }, channel)
    if not ok then finish(nil, ("%s: %s"):format(method, err), "EIO") end
    return function()
      if t then t:close(); t = nil end
      self.outgoing[id] = nil
      self:notify("notifications/cancelled", { requestId = id, reason = "cancelled" }, channel)
    end
  end)
end

--- Delivers a response from the client to the request (server:request) waiting for it.
---@param msg table
function Server:handle_response(msg)
  local fn = type(msg.id) == "string" and self.outgoing[msg.id]
  if not fn then
    log.debug(LOGGER, "response to unknown request %s ignored", tostring(msg.id))
    return
  end
  if msg.error ~= nil and msg.error ~= null then
    local e = msg.error
    local m = type(e) == "table" and e.message or tostring(e)
    fn(nil, tostring(m), e)
  else
    fn(msg.result)
  end
end

--------------------------------------------------------------------------------------------
-- Method handlers: function(self, params, entry) -> result, [tool name]
-- `legacy` holds the methods of a session opened by initialize, `modern` those of a
-- 2026-07-28 request. A handler serving both reads entry.modern.

local legacy, modern = {}, {}

-- `registry.list_changed`: its listing follows something that changes (a proxied host MCP
-- server): the session may be sent notifications/tools/list_changed.
-- A `tools_only` session (a proxied host MCP server) offers tools and nothing else of demesne's.
local function capabilities(era, registry, tools_only)
  local caps = { tools = { listChanged = registry ~= nil and registry.list_changed == true } }
  if tools_only then
    if era ~= "modern" then caps.logging = {} end
    return caps
  end
  if era == "modern" then
    caps.resources = { subscribe = true, listChanged = false }
  else
    caps.resources = { subscribe = false, listChanged = false }
    caps.logging = {}
  end
  return caps
end

function legacy.initialize(self, params)
  local v = params.protocolVersion
  if type(v) ~= "string" then invalid_params("params.protocolVersion: expected a string, got " .. describe(v)) end
  if params.capabilities ~= nil and not is_object(params.capabilities) then
    invalid_params("params.capabilities: expected an object, got " .. describe(params.capabilities))
  end
  if params.clientInfo ~= nil and not is_object(params.clientInfo) then
    invalid_params("params.clientInfo: expected an object, got " .. describe(params.clientInfo))
  end
  if self.session.initialized then
    error(server.rpc_error(server.INVALID_REQUEST, "initialize may be sent only once per session"), 0)
  end
  local chosen = server.VERSIONS[1]
  for _, rev in ipairs(server.VERSIONS) do
    if rev.version == v then chosen = rev break end
  end
  local s = self.session
  s.protocol_version = chosen.version
  s.client_info = params.clientInfo
  s.client_capabilities = params.capabilities or {}
  s.initialized = true
  log.info(LOGGER, "session: client %s %s asked for %s, speaking %s",
    tostring(type(s.client_info) == "table" and s.client_info.name or "?"),
    tostring(type(s.client_info) == "table" and s.client_info.version or "?"), v, chosen.version)
  local info = server.info()
  if chosen.server_description then
    info.description = "Runs commands, scripts and coding agents in disposable containers"
  end
  local caps = capabilities("legacy", self.registry, self.tools_only)
  caps.tasks = chosen.tasks and not self.scope and tasks.capability() or nil
  return {
    protocolVersion = chosen.version,
    capabilities = caps,
    serverInfo = info,
    instructions = self.instructions,
  }
end

function legacy.ping() return {} end

-- 2026-07-28 CacheableResult fields: job status changes at any moment, the template never
local function cacheable(entry, r, ttl_ms)
  if entry.modern then
    r.ttlMs = ttl_ms
    r.cacheScope = "private"
  end
  return r
end

local function tools_list(self, params, entry)
  if params.cursor ~= nil and params.cursor ~= null and type(params.cursor) ~= "string" then
    invalid_params("params.cursor: expected a string, got " .. describe(params.cursor))
  end
  -- one page: nextCursor is never set. demesne's own list is the same for every caller and
  -- changes only with a restart; a registry with list_changed (a proxied host MCP server)
  -- follows its upstream, and may fail to reach it (listing() -> nil, why)
  local list, why = self.registry:listing()
  if list == nil then
    error(server.rpc_error(server.INTERNAL_ERROR, "Internal error: the tool list is not available: " .. tostring(why)), 0)
  end
  return cacheable(entry, { tools = list }, self.registry.list_changed and 0 or 300000)
end
legacy["tools/list"], modern["tools/list"] = tools_list, tools_list

legacy["logging/setLevel"] = function(self, params)
  local level = params.level
  if type(level) ~= "string" or not LEVELS[level] then
    invalid_params("params.level: expected one of debug, info, notice, warning, error, critical, alert, emergency, got "
      .. (type(level) == "string" and ("%q"):format(level) or describe(level)))
  end
  self.session.log_level = level
  return {}
end

local function resources_list(self, params, entry)
  if params.cursor ~= nil and params.cursor ~= null and type(params.cursor) ~= "string" then
    invalid_params("params.cursor: expected a string, got " .. describe(params.cursor))
  end
  return cacheable(entry, resources.list(self.scope and self.scope.job), 0)
end
legacy["resources/list"], modern["resources/list"] = resources_list, resources_list
legacy["resources/templates/list"] = function(_, _, entry) return cacheable(entry, resources.templates(), 300000) end
modern["resources/templates/list"] = legacy["resources/templates/list"]

local function resources_read(self, params, entry)
  if type(params.uri) ~= "string" then invalid_params("params.uri: expected a string, got " .. describe(params.uri)) end
  local r, err = resources.read(params.uri, self.scope and self.scope.job)
  if not r then
    error(server.rpc_error(entry.modern and server.INVALID_PARAMS or server.RESOURCE_NOT_FOUND, err,
      { uri = params.uri }), 0)
  end
  return cacheable(entry, r, 0)
end
legacy["resources/read"], modern["resources/read"] = resources_read, resources_read

modern["server/discover"] = function(self)
  return {
    supportedVersions = json.array({ table.unpack(server.SUPPORTED_VERSIONS) }),
    capabilities = capabilities("modern", self.registry, self.tools_only),
    instructions = self.instructions,
    ttlMs = 300000,
    cacheScope = "public",
  }
end

--- Builds the ToolContext handed to a tool's run(ctx, args) (see lua/tools/init.lua).
---@param tool ToolDescriptor
---@param entry table  the request in progress ({id, cancelled, done, channel, modern})
---@param meta table|nil  the request's params._meta
---@return ToolContext
function Server:tool_context(tool, entry, meta)
  local token = type(meta) == "table" and meta.progressToken or nil
  if token == null then token = nil end
  local last
  local s = self.session
  local m = entry.modern
  local ctx = {
    request_id = entry.id,
    tool = tool.name,
    client_info = m and m.client_info or s.client_info,
    client_capabilities = m and m.capabilities or s.client_capabilities,
    protocol_version = m and m.version or s.protocol_version,
    meta = meta,
    listener = self.listener,
  }
  local logger = "demesne.tools." .. tool.name
  function ctx.progress(progress, total, message)
    if token == nil or entry.done or entry.cancelled or self.closing then return false end
    if type(progress) ~= "number" then error("ctx.progress: progress must be a number", 2) end
    if total ~= nil and type(total) ~= "number" then error("ctx.progress: total must be a number or nil", 2) end
    if last ~= nil and progress <= last then
      log.debug(LOGGER, "tool %s: progress %s not above %s, not sent", tool.name, tostring(progress), tostring(last))
      return false
    end
    last = progress
    entry.progress_at = loop.now()
    local p = { progressToken = token, progress = progress, total = total }
    if message ~= nil then
      message = tostring(message)
      if #message > 4096 then message = message:sub(1, text.utf8_floor(message, 4096)) .. "…" end
      p.message = message
    end
    return self:notify("notifications/progress", p, entry.channel)
  end
  function ctx.log(level, message, data)
    if not LEVELS[level] then level = "info" end
    log.log(level, logger, tostring(message), data, true)
    self:log_to_caller(entry, level, logger, message, data)
  end
  function ctx.is_cancelled() return entry.cancelled or self.closing end
  function ctx.request(method, params, opts) return self:request(method, params, opts, entry) end
  -- The host client behind this call, for the layers below that ask it something after the
  -- call itself may have ended (the egress `ask` verdict, lua/egress/ask.lua): a request goes
  -- on this call's stream while the call lasts, else on that of another tools/call of the
  -- session in progress, else on the session's own (stdio; the HTTP session's GET stream
  -- when it is open). 2026-07-28 has no server-to-client request.
  local function live(e)
    local ch = e.channel
    return not e.done and not e.cancelled and not e.modern and not (ch and ch:is_closing())
  end
  ctx.client = {
    capabilities = ctx.client_capabilities, protocol_version = ctx.protocol_version, modern = m ~= nil,
    info = ctx.client_info,
    request = function(method, params, opts)
      local via = live(entry) and entry or nil
      if not via then
        for _, e in pairs(self.inflight) do
          if e.method == "tools/call" and live(e) then via = e break end
        end
      end
      return self:request(method, params, opts, via)
    end,
  }
  return ctx
end

local function tools_call(self, params, entry)
  local name = params.name
  if type(name) ~= "string" then invalid_params("params.name: expected a string, got " .. describe(name)) end
  local args = params.arguments
  if args == null then args = nil end
  if args ~= nil and not is_object(args) then
    invalid_params("params.arguments: expected an object, got " .. describe(args))
  end
  local meta = params._meta
  if meta ~= nil and meta ~= null and not is_object(meta) then
    invalid_params("params._meta: expected an object, got " .. describe(meta))
  end
  if meta == null then meta = nil end
  local token = meta and meta.progressToken
  if token ~= nil and token ~= null and type(token) ~= "string" and type(token) ~= "number" then
    invalid_params("params._meta.progressToken: expected a string or a number, got " .. describe(token))
  end
  local tool = self.registry:get(name)
  if not tool then
    error(server.rpc_error(server.INVALID_PARAMS, ("Unknown tool: %s"):format(name)), 0)
  end
  if entry.modern and tool.clientCapabilities then
    local missing
    for _, cap in ipairs(tool.clientCapabilities) do
      if entry.modern.capabilities[cap] == nil then
        missing = missing or {}
        missing[cap] = {}
      end
    end
    if missing then
      local names = {}
      for k in pairs(missing) do names[#names + 1] = k end
      table.sort(names)
      error(server.rpc_error(server.MISSING_CLIENT_CAPABILITY, ("Missing required client capability: tool %s needs %s, "
        .. "which the request's clientCapabilities do not declare"):format(name, table.concat(names, ", ")),
        { requiredCapabilities = missing }), 0)
    end
  end
  local ctx = self:tool_context(tool, entry, meta)
  -- task-augmented call (2025-11-25 experimental tasks): lua/mcp/tasks.lua
  local task = params.task
  if task == null then task = nil end
  if task ~= nil and self.scope then
    invalid_params("params.task: tasks are not offered here; use background: true and sandbox_wait")
  end
  if not entry.modern and (task ~= nil or (type(tool.execution) == "table" and tool.execution.taskSupport == "required")) then
    return tasks.call(tool, ctx, args or {}, task), name
  end
  local started = loop.hrtime()
  local result = tools.call(tool, ctx, args or {})
  if entry.progress_at then
    local wait = entry.progress_at + PROGRESS_SETTLE_MS - loop.now()
    if wait > 0 then async.sleep(wait) end
  end
  log.debug(LOGGER, "tools/call %s done in %.0f ms%s", name, (loop.hrtime() - started) / 1e6,
    result.isError and " (isError)" or "")
  return result, name
end
legacy["tools/call"], modern["tools/call"] = tools_call, tools_call

-- tasks/get, tasks/result, tasks/list, tasks/cancel (2025-11-25): lua/mcp/tasks.lua
for m, fn in pairs(tasks.methods) do legacy[m] = fn end

--------------------------------------------------------------------------------------------
-- Subscriptions (2026-07-28 subscriptions/listen): job ends as resource updates

-- every open subscription: entry -> {server, filter = {uri…}}
local subscriptions = {}
local remove_job_sink

local function on_job_record(_, logger, _, data)
  if logger ~= "demesne.jobs" or type(data) ~= "table" or type(data.job_id) ~= "string" then return end
  if data.status == "running" then return end
  for entry, sub in pairs(subscriptions) do
    local scope = sub.server.scope
    for _, uri in ipairs(scope and not scope.job(data.job_id) and {} or sub.uris) do
      if resources.covers(uri, data.job_id) then
        sub.server:notify("notifications/resources/updated", { uri = resources.job_uri(data.job_id),
          _meta = { [META.SUBSCRIPTION_ID] = entry.id } }, entry.channel)
        break
      end
    end
  end
end

modern["subscriptions/listen"] = function(self, params, entry)
  local filter = params.notifications
  if filter ~= nil and not is_object(filter) then
    invalid_params("params.notifications: expected an object, got " .. describe(filter))
  end
  filter = filter or {}
  local uris = {}
  local asked = filter.resourceSubscriptions
  if asked ~= nil and asked ~= null then
    if type(asked) ~= "table" or schema.type_of(asked) == "object" and next(asked) ~= nil then
      invalid_params("params.notifications.resourceSubscriptions: expected a list of URIs")
    end
    for i, uri in ipairs(asked) do
      if type(uri) ~= "string" then
        invalid_params(("params.notifications.resourceSubscriptions[%d]: expected a string"):format(i - 1))
      end
      if resources.subscribable(uri) then uris[#uris + 1] = uri end
    end
  end
  -- the acknowledgment names what is honoured: job resources only (the tool list never changes)
  local honoured = {}
  if #uris > 0 then honoured.resourceSubscriptions = json.array({ table.unpack(uris) }) end
  local sid = { [META.SUBSCRIPTION_ID] = entry.id }
  self:notify("notifications/subscriptions/acknowledged", { _meta = sid, notifications = honoured }, entry.channel)
  if not remove_job_sink then remove_job_sink = log.add_sink(on_job_record) end
  local stop = async.event()
  entry.listen = { stop = stop }
  subscriptions[entry] = { server = self, uris = uris }
  local _ <close> = util.closer(function() subscriptions[entry] = nil end)
  -- a job named by URI that has already ended gets its update at once
  for _, uri in ipairs(uris) do
    local id = resources.job_of(uri)
    if id and (not self.scope or self.scope.job(id)) and resources.ended(id) then
      self:notify("notifications/resources/updated", { uri = uri, _meta = sid }, entry.channel)
    end
  end
  stop.wait() -- until the client cancels (stream closed / notifications/cancelled) or the server stops
  return { _meta = sid }
end

--------------------------------------------------------------------------------------------
-- Dispatch

local function handler_error(e)
  if type(e) == "table" then return e end
  return { internal = true, message = tostring(e), traceback = debug.traceback(tostring(e), 2) }
end

-- The request's 2026-07-28 envelope: {version, client_info, capabilities, log_level}, or
-- raises the error a malformed one gets.
local function modern_envelope(params)
  local meta = params._meta
  local function missing(what)
    error(server.rpc_error(server.INVALID_PARAMS, ("Invalid params: params._meta must carry %s (revision 2026-07-28 "
      .. "sends the protocol version and client capabilities with every request)"):format(what)), 0)
  end
  if not is_object(meta) then missing(META.PROTOCOL_VERSION .. " and " .. META.CLIENT_CAPABILITIES) end
  local v = meta[META.PROTOCOL_VERSION]
  if type(v) ~= "string" then missing(META.PROTOCOL_VERSION) end
  local caps = meta[META.CLIENT_CAPABILITIES]
  if not is_object(caps) then missing(META.CLIENT_CAPABILITIES) end
  if not server.is_modern(v) then
    error(server.rpc_error(server.UNSUPPORTED_PROTOCOL_VERSION, ("Unsupported protocol version: %s"):format(v),
      { supported = json.array({ table.unpack(server.SUPPORTED_VERSIONS) }), requested = v }), 0)
  end
  local info = meta[META.CLIENT_INFO]
  local level = meta[META.LOG_LEVEL]
  return {
    version = v,
    capabilities = caps,
    client_info = is_object(info) and info or nil,
    log_level = type(level) == "string" and LEVELS[level] and level or nil,
  }
end

--- True when `msg` (a decoded request) is in the 2026-07-28 shape: its params._meta names
--- a protocol version.
---@param msg table
---@return boolean
function server.is_modern_request(msg)
  local p = msg.params
  return type(p) == "table" and type(p._meta) == "table" and p._meta[META.PROTOCOL_VERSION] ~= nil
end

--- Starts a request in its own task; the response is sent on `channel` when it finishes.
---@param msg table  a checked request: {jsonrpc, id, method, params?}
---@param channel McpTransport|nil
function Server:handle_request(msg, channel)
  local id = msg.id
  local key = id_key(id)
  if self.inflight[key] then
    -- answered with a null id: an error under the same id would read as the answer to the
    -- request that is still running (JSON-RPC 2.0 §5: null when the id cannot be used)
    local v = json.is_raw(id) and id.token or id
    local whole = type(v) == "number" and math.tointeger(v)
    local shown = whole and ("%d"):format(whole) or type(v) == "number" and ("%.17g"):format(v) or tostring(v)
    return self:respond_error(json.null, server.INVALID_REQUEST,
      "Invalid Request: id " .. shown .. " is already in use by a request in progress", nil, channel)
  end
  local params = msg.params
  if params == nil or params == null then params = {} end
  local era = (channel and channel.modern or server.is_modern_request(msg)) and modern or legacy
  local env
  if era == modern then
    local ok, e = pcall(modern_envelope, params)
    if not ok then
      if type(e) == "table" and e.rpc_error then return self:respond_error(id, e.code, e.message, e.data, channel) end
      error(e, 0)
    end
    env = e
  end
  local handler = era[msg.method]
  if self.scope and msg.method:match("^tasks/") then handler = nil end -- no tasks where a scope applies
  if self.tools_only and (msg.method:match("^resources/") or msg.method == "subscriptions/listen") then handler = nil end
  if not handler then
    return self:respond_error(id, server.METHOD_NOT_FOUND, "Method not found: " .. msg.method
      .. (era == modern and legacy[msg.method] and " (not part of revision 2026-07-28)" or ""), nil, channel)
  end
  if self.closing then
    return self:respond_error(id, server.INTERNAL_ERROR, "server is shutting down", nil, channel)
  end
  local entry = { id = id, key = key, method = msg.method, cancelled = false, done = false, channel = channel,
    modern = env }
  self.inflight[key] = entry
  local task = async.spawn(msg.method .. " " .. key, function()
    local ok, res, tool = xpcall(handler, handler_error, self, params, entry)
    entry.done = true
    if self.inflight[key] == entry then self.inflight[key] = nil end
    if entry.cancelled and not (entry.listen and ok) then
      log.debug(LOGGER, "%s %s cancelled: no response", msg.method, tostring(id))
      return
    end
    if ok then
      if env then
        res.resultType = res.resultType or "complete"
        res._meta = type(res._meta) == "table" and res._meta or {}
        res._meta[META.SERVER_INFO] = server.info()
      end
      self:respond(id, res, tool, channel)
      if msg.method == "initialize" and not env then
        self.session.announced = true
        local early = self.early_logs or {}
        self.early_logs = nil
        for _, r in ipairs(early) do self:forward_log(r[1], r[2], r[3], r[4]) end
      end
    elseif res == async.CANCELLED then
      log.debug(LOGGER, "%s %s cancelled", msg.method, tostring(id))
    elseif type(res) == "table" and res.rpc_error then
      self:respond_error(id, res.code, res.message, res.data, channel)
    else
      log.error(LOGGER, "%s failed: %s", msg.method, tostring(res.traceback or res.message or res))
      self:respond_error(id, server.INTERNAL_ERROR, "Internal error: " .. tostring(res.message or res):match("^[^\n]*"),
        nil, channel)
    end
  end)
  if not entry.done then entry.task = task end
end

--- Cancels a request in progress (notifications/cancelled, or its stream closed): its task
--- is cancelled and no response is sent; a subscription ends. Unknown, finished and
--- initialize requests are left alone. Returns true when something was cancelled.
---@param id any
---@param reason string|nil
---@return boolean
function Server:cancel(id, reason)
  if not valid_id(id) then return false end
  local entry = self.inflight[id_key(id)]
  if not entry or entry.done or entry.method == "initialize" then
    log.debug(LOGGER, "cancel of %s: not in progress", tostring(id))
    return false
  end
  entry.cancelled = true
  log.info(LOGGER, "request %s (%s) cancelled%s", tostring(id), entry.method, reason and (": " .. reason) or "")
  if entry.task then async.cancel(entry.task, reason or "cancelled by client") end
  return true
end

--- Handles a notification (never answered).
---@param msg table
---@param line string|nil  the raw message (for an exact requestId)
function Server:handle_notification(msg, line)
  local params = msg.params
  if not is_object(params) then params = {} end
  local m = msg.method
  if m == "notifications/initialized" then
    self.session.ready = true
  elseif m == "notifications/cancelled" then
    local rid = exact_id(params.requestId, line, "params", "requestId")
    if not valid_id(rid) then
      log.debug(LOGGER, "notifications/cancelled without a valid requestId ignored")
      return
    end
    self:cancel(rid, type(params.reason) == "string" and ("by the client: " .. params.reason) or "by the client")
  else
    log.debug(LOGGER, "notification %s ignored", m)
  end
end

--- Handles one incoming message (the text of one JSON-RPC message). Its answer goes on
--- `channel` (default: the session's transport).
---@param line string
---@param channel McpTransport|nil
function Server:receive(line, channel)
  local msg, err = json.decode(line)
  if msg == nil and err ~= nil then
    return self:respond_error(null, server.PARSE_ERROR, "Parse error: " .. err, nil, channel)
  end
  return self:receive_message(msg, line, channel)
end

--- Handles one decoded message; `line` is its text (for exact ids), `channel` where its
--- answer goes (default: the session's transport).
---@param msg any
---@param line string|nil
---@param channel McpTransport|nil
function Server:receive_message(msg, line, channel)
  if line and line:match("^%s*%[") then
    return self:respond_error(null, server.INVALID_REQUEST,
      "Invalid Request: batches (JSON arrays) are not supported; JSON-RPC batching was removed in MCP 2025-06-18",
      nil, channel)
  end
  if type(msg) ~= "table" then
    return self:respond_error(null, server.INVALID_REQUEST, "Invalid Request: a message must be a JSON object, got "
      .. describe(msg), nil, channel)
  end
  local id = exact_id(msg.id, line, "id")
  msg.id = id
  local reply_id = valid_id(id) and id or null
  if msg.jsonrpc ~= "2.0" then
    return self:respond_error(reply_id, server.INVALID_REQUEST, 'Invalid Request: jsonrpc must be "2.0"', nil, channel)
  end
  if msg.method ~= nil then
    if type(msg.method) ~= "string" then
      return self:respond_error(reply_id, server.INVALID_REQUEST, "Invalid Request: method must be a string", nil, channel)
    end
    if id == nil then
      local ok, e = pcall(self.handle_notification, self, msg, line)
      if not ok then log.error(LOGGER, "notification %s: %s", msg.method, tostring(e)) end
      return
    end
    if not valid_id(id) then
      return self:respond_error(null, server.INVALID_REQUEST, "Invalid Request: id must be a string or a number", nil,
        channel)
    end
    local p = msg.params
    if p ~= nil and p ~= null and not is_object(p) then
      return self:respond_error(id, server.INVALID_PARAMS, "Invalid params: params must be an object, got "
        .. describe(p), nil, channel)
    end
    return self:handle_request(msg, channel)
  end
  if id ~= nil and (msg.result ~= nil or msg.error ~= nil) then
    return self:handle_response(msg)
  end
  return self:respond_error(reply_id, server.INVALID_REQUEST,
    "Invalid Request: neither a request, a notification nor a response", nil, channel)
end

--- Reports a line that exceeded the transport's cap (it is being discarded).
---@param bytes integer  bytes seen so far
---@param max integer    the cap
function Server:overflow(bytes, max)
  log.warning(LOGGER, "incoming message over %d bytes discarded (%d bytes seen)", max or 0, bytes or 0)
  self:respond_error(null, server.INVALID_REQUEST,
    ("Invalid Request: message exceeds the maximum of %d bytes; it was discarded"):format(max or 0))
end

--- Number of requests in progress.
---@return integer
function Server:pending()
  local n = 0
  for _ in pairs(self.inflight) do n = n + 1 end
  return n
end

--- Graceful stop, inside a task: refuses new requests, ends open subscriptions with their
--- completion result, cancels every other request in progress and waits up to
--- `timeout_ms` for their cleanup (<close> handlers) to finish. Returns true when all
--- finished in time.
---@param timeout_ms integer
---@return boolean
function Server:shutdown(timeout_ms)
  self.closing = true
  local waiting = {}
  for _, entry in pairs(self.inflight) do
    if entry.task and not entry.task.done then waiting[#waiting + 1] = entry.task end
    if entry.listen then
      entry.listen.stop.set()
    else
      entry.cancelled = true
    end
  end
  for _, entry in pairs(self.inflight) do
    if not entry.listen and entry.task and not entry.task.done then async.cancel(entry.task, "server shutting down") end
  end
  for _, fn in pairs(self.outgoing) do fn(nil, "server is shutting down", "ECANCELED") end
  local all = true
  local pending = {}
  for _, task in ipairs(waiting) do if not task.done then pending[#pending + 1] = task end end
  if #pending > 0 then
    log.info(LOGGER, "waiting up to %d ms for %d cancelled request(s) to clean up", timeout_ms, #pending)
    local ok, _, code = async.timeout(timeout_ms, function()
      for _, task in ipairs(pending) do task:wait() end
      return true
    end)
    if not ok and code == "ETIMEDOUT" then
      all = false
      log.warning(LOGGER, "cleanup of cancelled requests did not finish within %d ms", timeout_ms)
    end
  end
  self:close()
  return all
end

--- Stops forwarding log records to the client. Idempotent.
function Server:close()
  self.closing = true
  if self.remove_sink then self.remove_sink(); self.remove_sink = nil end
end

return server
