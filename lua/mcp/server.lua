-- The MCP server: JSON-RPC 2.0 dispatch, lifecycle and version negotiation, tools/list,
-- tools/call, ping, cancellation, progress and logging. Transport-agnostic: it is handed
-- one line (one JSON-RPC message) at a time (server:receive) and writes whole encoded
-- messages through `send`; lua/mcp/stdio.lua wires it to stdin/stdout.
--
-- Every request runs in its own task (demesne.async), so responses may go out in any
-- order. notifications/cancelled cancels the request's task (its <close> handlers run)
-- and no response is sent for it. Every outgoing message is encoded once and bounded by
-- max_message_bytes; a tool result over the bound is replaced by an isError result.
local async = require("demesne.async")
local json = require("demesne.json")
local log = require("demesne.log")
local tools = require("demesne.tools")
local schema = require("demesne.jsonschema")
local tasks = require("demesne.mcp.tasks")
local loop = require("core.loop")
local timer = require("core.timer")
local text = require("core.text")

local server = {}

local LOGGER = "demesne.mcp"
local null = json.null

--- Protocol revisions we speak, newest first. A client asking for one of these gets it;
--- any other request gets the newest. Per-revision differences live in this table.
server.VERSIONS = {
  { version = "2025-11-25", server_description = true, tasks = true },
  { version = "2025-06-18", server_description = false },
}

--- JSON-RPC error codes.
server.PARSE_ERROR = -32700
server.INVALID_REQUEST = -32600
server.METHOD_NOT_FOUND = -32601
server.INVALID_PARAMS = -32602
server.INTERNAL_ERROR = -32603

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
  if type(id) == "string" then return "s:" .. id end
  if math.type(id) == "integer" or (id == math.floor(id) and math.abs(id) < 2 ^ 63) then
    return ("n:%d"):format(math.tointeger(id) or id)
  end
  return ("n:%.17g"):format(id)
end

local function valid_id(id)
  return type(id) == "string" or (type(id) == "number" and id == id and id ~= math.huge and id ~= -math.huge)
end

local function is_object(v) return type(v) == "table" and schema.type_of(v) == "object" end

local function describe(v)
  local t = schema.type_of(v)
  return t == "integer" and "number" or t
end

---@class ServerOptions
---@field send fun(line: string): boolean|nil, string|nil  writes one encoded message (without the newline)
---@field backlog fun(): integer|nil    bytes written but not yet taken by the peer (optional)
---@field drain fun()|nil               waits (inside a task) until the backlog is small (optional)
---@field registry ToolRegistry
---@field max_message_bytes integer|nil  bound on one outgoing message (default 4 MiB)
---@field instructions string|nil
---@field forward_logs boolean|nil       send log records as notifications/message (default true)

---@class McpServer
local Server = {}
Server.__index = Server

--- Creates a server. Call server:close() when done with it (removes its log sink).
---@param opts ServerOptions
---@return McpServer
function server.new(opts)
  local self = setmetatable({
    send_line = assert(opts.send, "opts.send is required"),
    backlog = opts.backlog or function() return 0 end,
    drain = opts.drain,
    registry = opts.registry or tools.registry(),
    max_message = opts.max_message_bytes or server.DEFAULT_MAX_MESSAGE_BYTES,
    instructions = opts.instructions or server.INSTRUCTIONS,
    inflight = {},   -- id key -> {id, method, task, cancelled, done}
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

--- Writes one message (a table). Returns true, or nil and why it was not sent (too large,
--- cannot be encoded, transport failed). Inside a task it waits while the transport is
--- backed up; outside a task it only queues.
---@param msg table
---@return boolean|nil ok, string|nil err
function Server:send(msg)
  local line, err = encode(msg)
  if not line then return nil, "cannot encode: " .. err end
  if #line > self.max_message then
    return nil, ("message of %d bytes exceeds the limit of %d bytes"):format(#line, self.max_message)
  end
  return self:write_line(line)
end

--- Writes one encoded message; waits for the transport to drain when called in a task
--- and the backlog is over 1 MiB.
---@param line string
---@return boolean|nil ok, string|nil err
function Server:write_line(line)
  local ok, err = self.send_line(line)
  if not ok then return nil, err or "write failed" end
  if self.drain and async.current() and (self.backlog() or 0) > BACKPRESSURE_BYTES then self.drain() end
  return true
end

--- Sends a notification (no response expected). Oversized or unencodable ones are
--- dropped with a log record. Returns true when sent.
---@param method string
---@param params table|nil
---@return boolean
function Server:notify(method, params)
  local ok, err = self:send({ jsonrpc = "2.0", method = method, params = params })
  if not ok then
    if method ~= "notifications/message" then log.warning(LOGGER, "dropped %s: %s", method, err) end
    return false
  end
  return true
end

--- Sends a JSON-RPC error response. `id` nil or json.null answers with id null.
---@param id string|number|nil
---@param code integer    a JSON-RPC error code (server.PARSE_ERROR …)
---@param message string
---@param data any|nil
function Server:respond_error(id, code, message, data)
  local err = { code = code, message = message, data = data }
  local ok, why = self:send({ jsonrpc = "2.0", id = id == nil and null or id, error = err })
  if not ok then
    log.error(LOGGER, "cannot send error response: %s", why)
    if data ~= nil then self:send({ jsonrpc = "2.0", id = id == nil and null or id, error = { code = code, message = message } }) end
  end
end

--- Sends a result, encoded once. `tool` names the tool when `result` is a CallToolResult:
--- an oversized one is then replaced by an isError result; any other oversized result
--- becomes a -32603 error.
---@param id string|number
---@param result table
---@param tool string|nil
function Server:respond(id, result, tool)
  local line, err = encode({ jsonrpc = "2.0", id = id, result = result })
  if line and #line <= self.max_message then
    local ok, werr = self:write_line(line)
    if not ok then log.warning(LOGGER, "response to %s not sent: %s", tostring(id), tostring(werr)) end
    return
  end
  local why = line and ("the encoded result is %d bytes, over the %d-byte limit on one message"):format(#line, self.max_message)
    or ("the result cannot be encoded as JSON: %s"):format(err)
  line = nil -- let the oversized string go before building the replacement
  if tool then
    log.warning(LOGGER, "tool %s: result replaced: %s", tool, why)
    local replacement = tools.error_result(("Tool %s produced a result too large to send: %s. "
      .. "Ask for less output (full output stays in the files the tool names)."):format(tool, why))
    if not self:send({ jsonrpc = "2.0", id = id, result = replacement }) then
      self:respond_error(id, server.INTERNAL_ERROR, "Internal error: result too large")
    end
  else
    log.error(LOGGER, "response to %s replaced: %s", tostring(id), why)
    self:respond_error(id, server.INTERNAL_ERROR, "Internal error: " .. why)
  end
end

--------------------------------------------------------------------------------------------
-- Logging to the client

local LEVELS = log.LEVELS
local EARLY_LOGS_MAX = 256 -- job-end records kept for a client that has not finished connecting

--- The log sink: forwards a record as notifications/message when the session is
--- initialised and the record is at or above the level the client set.
function Server:forward_log(level, logger, msg, data)
  if self.in_forward or self.closing then return end
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
  if (self.backlog() or 0) > LOG_DROP_BACKLOG then
    self.dropped_logs = self.dropped_logs + 1
    return
  end
  self.in_forward = true
  msg = tostring(msg)
  -- tracebacks stay in the stderr log; the client gets the first line
  local tb = msg:find("\nstack traceback:", 1, true)
  if tb then msg = msg:sub(1, tb - 1) end
  if #msg > LOG_MESSAGE_MAX then msg = msg:sub(1, text.utf8_floor(msg, LOG_MESSAGE_MAX)) .. "…" end
  local payload = msg
  if data ~= nil then payload = { message = msg, data = data } end
  if not self:notify("notifications/message", { level = level, logger = logger, data = payload }) and data ~= nil then
    self:notify("notifications/message", { level = level, logger = logger, data = msg })
  end
  self.in_forward = false
end

--------------------------------------------------------------------------------------------
-- Requests to the client (sampling/createMessage, elicitation/create, roots/list)

--- Sends a request to the client and waits (inside a task) for its response.
--- Returns the result table, or nil, a message and the JSON-RPC error object (or a code:
--- "ETIMEDOUT", "ECANCELED", "EIO"). Cancelling the calling task sends
--- notifications/cancelled for it.
---@param method string
---@param params table|nil
---@param opts {timeout_ms: integer|nil}|nil
---@return table|nil result, string|nil err, any detail
function Server:request(method, params, opts)
  assert(async.current(), "server:request must be called inside a task")
  if self.closing then return nil, "server is shutting down", "ECANCELED" end
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
      self:notify("notifications/cancelled", { requestId = id, reason = "timed out" })
      finish(nil, ("%s: no response from the client after %d ms"):format(method, ms), "ETIMEDOUT")
    end)
    local ok, err = self:send({ jsonrpc = "2.0", id = id, method = method, params = params })
    if not ok then finish(nil, ("%s: %s"):format(method, err), "EIO") end
    return function()
      if t then t:close(); t = nil end
      self.outgoing[id] = nil
      self:notify("notifications/cancelled", { requestId = id, reason = "cancelled" })
    end
  end)
end

--- Delivers a response from the client to the request (server:request) waiting for it.
---@param msg table
function Server:handle_response(msg)
  local fn = valid_id(msg.id) and self.outgoing[msg.id]
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

local methods = {}

function methods.initialize(self, params)
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
  local info = { name = "demesne", title = "demesne", version = loop.version }
  if chosen.server_description then
    info.description = "Runs commands, scripts and coding agents in disposable containers"
  end
  return {
    protocolVersion = chosen.version,
    capabilities = { tools = { listChanged = false }, logging = {},
      tasks = chosen.tasks and tasks.capability() or nil },
    serverInfo = info,
    instructions = self.instructions,
  }
end

function methods.ping() return {} end

methods["tools/list"] = function(self, params)
  if params.cursor ~= nil and params.cursor ~= null and type(params.cursor) ~= "string" then
    invalid_params("params.cursor: expected a string, got " .. describe(params.cursor))
  end
  -- one page: nextCursor is never set
  return { tools = self.registry:listing() }
end

methods["logging/setLevel"] = function(self, params)
  local level = params.level
  if type(level) ~= "string" or not LEVELS[level] then
    invalid_params("params.level: expected one of debug, info, notice, warning, error, critical, alert, emergency, got "
      .. (type(level) == "string" and ("%q"):format(level) or describe(level)))
  end
  self.session.log_level = level
  return {}
end

--- Builds the ToolContext handed to a tool's run(ctx, args) (see lua/tools.lua).
---@param tool ToolDescriptor
---@param entry table  the request in progress ({id, cancelled, done})
---@param meta table|nil  the request's params._meta
---@return ToolContext
function Server:tool_context(tool, entry, meta)
  local token = type(meta) == "table" and meta.progressToken or nil
  if token == null then token = nil end
  local last
  local s = self.session
  local ctx = {
    request_id = entry.id,
    tool = tool.name,
    client_info = s.client_info,
    client_capabilities = s.client_capabilities,
    protocol_version = s.protocol_version,
    meta = meta,
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
    return self:notify("notifications/progress", p)
  end
  function ctx.log(level, message, data)
    if not LEVELS[level] then level = "info" end
    log.log(level, logger, tostring(message), data)
  end
  function ctx.is_cancelled() return entry.cancelled or self.closing end
  function ctx.request(method, params, opts) return self:request(method, params, opts) end
  return ctx
end

methods["tools/call"] = function(self, params, entry)
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
  local ctx = self:tool_context(tool, entry, meta)
  -- task-augmented call (2025-11-25 experimental tasks): lua/mcp/tasks.lua
  local task = params.task
  if task == null then task = nil end
  if task ~= nil or (type(tool.execution) == "table" and tool.execution.taskSupport == "required") then
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

-- tasks/get, tasks/result, tasks/list, tasks/cancel: lua/mcp/tasks.lua
for m, fn in pairs(tasks.methods) do methods[m] = fn end

--------------------------------------------------------------------------------------------
-- Dispatch

local function handler_error(e)
  if type(e) == "table" then return e end
  return { internal = true, message = tostring(e), traceback = debug.traceback(tostring(e), 2) }
end

--- Starts a request in its own task; the response is sent when it finishes.
---@param msg table  a checked request: {jsonrpc, id, method, params?}
function Server:handle_request(msg)
  local id = msg.id
  local key = id_key(id)
  if self.inflight[key] then
    -- answered with a null id: an error under the same id would read as the answer to the
    -- request that is still running (JSON-RPC 2.0 §5: null when the id cannot be used)
    local shown = (math.type(id) == "float" and id == math.floor(id)) and ("%d"):format(id) or tostring(id)
    return self:respond_error(json.null, server.INVALID_REQUEST, "Invalid Request: id " .. shown .. " is already in use by a request in progress")
  end
  local handler = methods[msg.method]
  if not handler then
    return self:respond_error(id, server.METHOD_NOT_FOUND, "Method not found: " .. msg.method)
  end
  if self.closing then
    return self:respond_error(id, server.INTERNAL_ERROR, "server is shutting down")
  end
  local params = msg.params
  if params == nil or params == null then params = {} end
  local entry = { id = id, method = msg.method, cancelled = false, done = false }
  self.inflight[key] = entry
  local task = async.spawn(msg.method .. " " .. key, function()
    local ok, res, tool = xpcall(handler, handler_error, self, params, entry)
    entry.done = true
    if self.inflight[key] == entry then self.inflight[key] = nil end
    if entry.cancelled then
      log.debug(LOGGER, "%s %s cancelled: no response", msg.method, tostring(id))
      return
    end
    if ok then
      self:respond(id, res, tool)
      if msg.method == "initialize" then
        self.session.announced = true
        local early = self.early_logs or {}
        self.early_logs = nil
        for _, r in ipairs(early) do self:forward_log(r[1], r[2], r[3], r[4]) end
      end
    elseif res == async.CANCELLED then
      log.debug(LOGGER, "%s %s cancelled", msg.method, tostring(id))
    elseif type(res) == "table" and res.rpc_error then
      self:respond_error(id, res.code, res.message, res.data)
    else
      log.error(LOGGER, "%s failed: %s", msg.method, tostring(res.traceback or res.message or res))
      self:respond_error(id, server.INTERNAL_ERROR, "Internal error: " .. tostring(res.message or res):match("^[^\n]*"))
    end
  end)
  if not entry.done then entry.task = task end
end

--- Handles a notification (never answered).
---@param msg table
function Server:handle_notification(msg)
  local params = msg.params
  if not is_object(params) then params = {} end
  local m = msg.method
  if m == "notifications/initialized" then
    self.session.ready = true
  elseif m == "notifications/cancelled" then
    local rid = params.requestId
    if not valid_id(rid) then
      log.debug(LOGGER, "notifications/cancelled without a valid requestId ignored")
      return
    end
    local entry = self.inflight[id_key(rid)]
    if not entry or entry.done or entry.method == "initialize" then
      log.debug(LOGGER, "notifications/cancelled for %s: not in progress", tostring(rid))
      return
    end
    entry.cancelled = true
    log.info(LOGGER, "request %s (%s) cancelled by the client%s", tostring(rid), entry.method,
      type(params.reason) == "string" and (": " .. params.reason) or "")
    if entry.task then async.cancel(entry.task, type(params.reason) == "string" and params.reason or "cancelled by client") end
  else
    log.debug(LOGGER, "notification %s ignored", m)
  end
end

--- Handles one incoming line (one JSON-RPC message).
---@param line string
function Server:receive(line)
  local msg, err = json.decode(line)
  if msg == nil and err ~= nil then
    return self:respond_error(null, server.PARSE_ERROR, "Parse error: " .. err)
  end
  if line:match("^%s*%[") then
    return self:respond_error(null, server.INVALID_REQUEST,
      "Invalid Request: batches (JSON arrays) are not supported; JSON-RPC batching was removed in MCP 2025-06-18")
  end
  if type(msg) ~= "table" then
    return self:respond_error(null, server.INVALID_REQUEST, "Invalid Request: a message must be a JSON object, got "
      .. describe(msg))
  end
  local id = msg.id
  local reply_id = valid_id(id) and id or null
  if msg.jsonrpc ~= "2.0" then
    return self:respond_error(reply_id, server.INVALID_REQUEST, 'Invalid Request: jsonrpc must be "2.0"')
  end
  if msg.method ~= nil then
    if type(msg.method) ~= "string" then
      return self:respond_error(reply_id, server.INVALID_REQUEST, "Invalid Request: method must be a string")
    end
    if id == nil then
      local ok, e = pcall(self.handle_notification, self, msg)
      if not ok then log.error(LOGGER, "notification %s: %s", msg.method, tostring(e)) end
      return
    end
    if not valid_id(id) then
      return self:respond_error(null, server.INVALID_REQUEST, "Invalid Request: id must be a string or a number")
    end
    local p = msg.params
    if p ~= nil and p ~= null and not is_object(p) then
      return self:respond_error(id, server.INVALID_PARAMS, "Invalid params: params must be an object, got " .. describe(p))
    end
    return self:handle_request(msg)
  end
  if id ~= nil and (msg.result ~= nil or msg.error ~= nil) then
    return self:handle_response(msg)
  end
  return self:respond_error(reply_id, server.INVALID_REQUEST, "Invalid Request: neither a request, a notification nor a response")
end

--- Reports a line that exceeded the transport's cap (it is being discarded).
---@param bytes integer  bytes seen so far
---@param max integer    the cap
function Server:overflow(bytes, max)
  log.warning(LOGGER, "incoming message over %d bytes discarded", max or 0)
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

--- Graceful stop, inside a task: refuses new requests, cancels every request in
--- progress and waits up to `timeout_ms` for their cleanup (<close> handlers) to finish.
--- Returns true when all finished in time.
---@param timeout_ms integer
---@return boolean
function Server:shutdown(timeout_ms)
  self.closing = true
  local waiting = {}
  for _, entry in pairs(self.inflight) do
    entry.cancelled = true
    if entry.task and not entry.task.done then waiting[#waiting + 1] = entry.task end
  end
  for _, task in ipairs(waiting) do async.cancel(task, "server shutting down") end
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
