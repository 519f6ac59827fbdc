-- An MCP client: demesne talking to another MCP server (the host MCP servers of
-- lua/hostmcp, which it proxies into agent sandboxes).
--
-- Two transports under one session:
--   client.spawn(opts)   stdio: a child process, newline-delimited JSON-RPC on its
--                        stdin/stdout (spec basic/transports "stdio"); its stderr is handed
--                        to opts.on_stderr line by line, each line cut at 1 KiB and at most
--                        1 MiB per process.
--   client.http(opts)    Streamable HTTP (spec basic/transports "Streamable HTTP",
--                        2025-03-26 … 2025-11-25): each message is a POST; a request is
--                        answered with application/json or a text/event-stream; the
--                        Mcp-Session-Id of the initialize answer and MCP-Protocol-Version go
--                        on every later request; a GET stream (when the server offers one)
--                        carries messages that relate to no request (tools/list_changed).
--
-- The session (both transports): session:initialize() (initialize + notifications/initialized),
-- session:request(method, params, opts) with a per-request timeout, cancellation of the
-- calling task (notifications/cancelled is sent) and progress routing;
-- session:list_tools() (every page, bounded) and session:call_tool(). The server's own
-- requests get an answer (ping: {}, anything else: -32601, since this client declares no
-- capabilities); its notifications go to opts.on_notification(method, params).
--
-- Every message is bounded by opts.max_message_bytes in both directions. Failures return
-- nil, message, code: ETIMEDOUT (no answer in time), ECANCELED, ECONNRESET (the process
-- exited or the stream ended), E2BIG (a message over the bound), EPROTO (not MCP),
-- ERPC (the server answered with a JSON-RPC error; the error object is the 4th value),
-- ESESSION (an HTTP server no longer knows the session: the request was not processed,
-- and a new session is needed).
local async = require("demesne.async")
local json = require("demesne.json")
local framing = require("demesne.mcp.framing")
local http = require("core.http")
local loop = require("core.loop")
local process = require("core.process")
local timer = require("core.timer")

local client = {}

--- The protocol revision this client asks for; the server may answer with another from
--- client.VERSIONS.
client.PROTOCOL_VERSION = "2025-11-25"
--- Revisions accepted in the server's initialize answer.
client.VERSIONS = { ["2025-11-25"] = true, ["2025-06-18"] = true, ["2025-03-26"] = true, ["2024-11-05"] = true }
client.DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
client.MAX_TOOLS = 1000     -- tools kept from one listing
client.MAX_PAGES = 100      -- tools/list pages followed
local STDERR_LINE_BYTES = 1024
local STDERR_TOTAL_BYTES = 1024 * 1024
local WRITE_QUEUE_MAX = 16 * 1024 * 1024

---------------------------------------------------------------------------------------------
-- The session: JSON-RPC over whatever transport

---@class McpClientSession
---@field name string
---@field closed boolean
---@field close_reason string|nil
---@field server_info table|nil       the initialize answer's serverInfo
---@field capabilities table|nil      the initialize answer's capabilities
---@field protocol_version string|nil the negotiated revision
local Session = {}
Session.__index = Session

local function new_session(o, transport)
  return setmetatable({
    name = o.name or "upstream",
    transport = transport,
    pending = {},
    next_id = 1,
    closed = false,
    max_message_bytes = o.max_message_bytes or client.DEFAULT_MAX_MESSAGE_BYTES,
    on_notification = o.on_notification,
  }, Session)
end

local function finish(entry, ...)
  if entry.done then return end
  entry.done = true
  if entry.timer then entry.timer:close(); entry.timer = nil end
  if entry.cb then entry.cb(...) end
end

--- Ends one pending request with a failure (the transport lost it).
---@param id integer  the request's id
---@param msg string
---@param code string|nil
function Session:fail(id, msg, code)
  local entry = self.pending[id]
  if not entry then return end
  self.pending[id] = nil
  finish(entry, nil, msg, code)
end

--- Ends every pending request with a failure and refuses new ones.
---@param msg string
---@param code string|nil
function Session:fail_all(msg, code)
  self.closed = true
  self.close_reason = self.close_reason or msg
  local ps = self.pending
  self.pending = {}
  for _, entry in pairs(ps) do finish(entry, nil, msg, code) end
end

--- Encodes and sends one message, within max_message_bytes. Returns true or nil, msg, code.
---@param msg table
---@return boolean|nil ok, string|nil err, string|nil code
function Session:send_message(msg)
  local ok, line = pcall(json.encode, msg)
  if not ok then return nil, "cannot encode the message: " .. tostring(line), "EINVAL" end
  if #line > self.max_message_bytes then
    return nil, ("the message is %d bytes, over the limit of %d"):format(#line, self.max_message_bytes), "E2BIG"
  end
  return self.transport.send(line, msg.id ~= nil and msg.method ~= nil and msg.id or nil)
end

--- Sends a notification (no answer). Returns true or nil, msg, code.
---@param method string
---@param params table|nil
function Session:notify(method, params)
  if self.closed then return nil, self.close_reason or "closed", "ECONNRESET" end
  return self:send_message({ jsonrpc = "2.0", method = method, params = params })
end

--- Sends a request and waits (inside a task) for its answer.
--- opts: timeout_ms (0 or nil: none), on_progress(params) for notifications/progress
--- about it (a progressToken is added to params._meta when on_progress is given).
--- Cancelling the calling task sends notifications/cancelled and raises async.CANCELLED.
---@param method string
---@param params table|nil
---@param opts {timeout_ms: integer|nil, on_progress: fun(p: table)|nil}|nil
---@return table|nil result, string|nil err, string|nil code, table|nil rpc_error
function Session:request(method, params, opts)
  opts = opts or {}
  if self.closed then return nil, self.close_reason or "the connection is closed", "ECONNRESET" end
  local id = self.next_id
  self.next_id = id + 1
  params = params or {}
  if opts.on_progress then
    local meta = {}
    for k, v in pairs(params._meta or {}) do meta[k] = v end
    meta.progressToken = id
    local p = {}
    for k, v in pairs(params) do p[k] = v end
    p._meta = meta
    params = p
  end
  local entry = { method = method, on_progress = opts.on_progress }
  self.pending[id] = entry
  local function abandon(reason)
    if self.pending[id] ~= entry then return end
    self.pending[id] = nil
    entry.done = true
    if entry.timer then entry.timer:close(); entry.timer = nil end
    if self.transport.abort then self.transport.abort(id) end
    if not self.closed then
      pcall(self.notify, self, "notifications/cancelled", { requestId = id, reason = reason })
    end
  end
  local res = table.pack(async.await(function(cb)
    entry.cb = cb
    if opts.timeout_ms and opts.timeout_ms > 0 then
      entry.timer = timer.after(math.floor(opts.timeout_ms), function()
        entry.timer = nil
        abandon("timed out")
        cb(nil, ("%s: no answer to %s within %d ms"):format(self.name, method, opts.timeout_ms), "ETIMEDOUT")
      end)
    end
    local ok, err, code = self:send_message({ jsonrpc = "2.0", id = id, method = method, params = params })
    if not ok then
      self.pending[id] = nil
      finish(entry, nil, self.name .. ": " .. tostring(err), code)
    end
    return function() abandon("cancelled by the caller") end
  end))
  return table.unpack(res, 1, res.n)
end

--- A message from the server (or a batch of them): a response, a request or a notification.
---@param msg any  the decoded message
function Session:receive(msg)
  if type(msg) ~= "table" then return end
  if msg[1] ~= nil then -- a batch (2025-03-26 allowed them)
    for _, m in ipairs(msg) do self:receive(m) end
    return
  end
  local id = msg.id
  if type(id) == "number" then id = math.tointeger(id) or id end
  if msg.method == nil then
    local entry = id ~= nil and self.pending[id]
    if not entry then return end
    self.pending[id] = nil
    if type(msg.error) == "table" then
      finish(entry, nil, ("%s: %s"):format(self.name, tostring(msg.error.message or "error")), "ERPC", msg.error)
    elseif type(msg.result) == "table" then
      finish(entry, msg.result)
    else
      finish(entry, nil, self.name .. ": the answer has neither result nor error", "EPROTO")
    end
    return
  end
  if type(msg.method) ~= "string" then return end
  if msg.id ~= nil and msg.id ~= json.null then
    -- a request from the server: this client declares no capabilities (no roots,
    -- sampling or elicitation), so only ping is answered with a result
    if msg.method == "ping" then
      self:send_message({ jsonrpc = "2.0", id = msg.id, result = {} })
    else
      self:send_message({ jsonrpc = "2.0", id = msg.id,
        error = { code = -32601, message = "method not found: this client offers " .. msg.method .. " nothing" } })
    end
    return
  end
  local params = type(msg.params) == "table" and msg.params or {}
  if msg.method == "notifications/progress" then
    local tok = params.progressToken
    if type(tok) == "number" then tok = math.tointeger(tok) or tok end
    local entry = tok ~= nil and self.pending[tok]
    if entry and entry.on_progress then pcall(entry.on_progress, params) end
    return
  end
  if self.on_notification then
    local ok, err = pcall(self.on_notification, msg.method, params)
    if not ok then io.stderr:write("demesne: ", self.name, ": notification handler: ", tostring(err), "\n") end
  end
end

--- The lifecycle's first step: initialize, check the answer, send notifications/initialized.
--- Returns the initialize result or nil, msg, code.
---@param timeout_ms integer
---@return table|nil result, string|nil err, string|nil code
function Session:initialize(timeout_ms)
  local res, err, code = self:request("initialize", {
    protocolVersion = client.PROTOCOL_VERSION,
    capabilities = {},
    clientInfo = { name = "demesne", version = loop.version },
  }, { timeout_ms = timeout_ms })
  if not res then return nil, err, code end
  if type(res.protocolVersion) ~= "string" or not client.VERSIONS[res.protocolVersion] then
    return nil, ("%s: the server answered initialize with protocol version %s, which this client does not speak")
      :format(self.name, tostring(res.protocolVersion)), "EPROTO"
  end
  self.protocol_version = res.protocolVersion
  self.server_info = type(res.serverInfo) == "table" and res.serverInfo or {}
  self.capabilities = type(res.capabilities) == "table" and res.capabilities or {}
  if self.transport.negotiated then self.transport.negotiated(res.protocolVersion) end
  local ok, nerr, ncode = self:notify("notifications/initialized")
  if not ok then return nil, nerr, ncode end
  if self.transport.after_initialized then self.transport.after_initialized() end
  return res
end

--- Lists the server's tools, following nextCursor (at most client.MAX_PAGES pages and
--- client.MAX_TOOLS tools; more is an E2BIG failure rather than a silently cut list).
--- Returns a list of tool objects as the server gave them.
---@param timeout_ms integer  for each page
---@return table[]|nil tools, string|nil err, string|nil code
function Session:list_tools(timeout_ms)
  local out, cursor = {}, nil
  for _ = 1, client.MAX_PAGES do
    local res, err, code = self:request("tools/list", cursor and { cursor = cursor } or {}, { timeout_ms = timeout_ms })
    if not res then return nil, err, code end
    if type(res.tools) ~= "table" then return nil, self.name .. ": tools/list answered without a tools list", "EPROTO" end
    for _, t in ipairs(res.tools) do
      if type(t) == "table" and type(t.name) == "string" then
        if #out >= client.MAX_TOOLS then
          return nil, ("%s: the server lists more than %d tools"):format(self.name, client.MAX_TOOLS), "E2BIG"
        end
        out[#out + 1] = t
      end
    end
    if type(res.nextCursor) ~= "string" or res.nextCursor == "" then return out end
    cursor = res.nextCursor
  end
  return nil, ("%s: tools/list went on for more than %d pages"):format(self.name, client.MAX_PAGES), "E2BIG"
end

--- Calls a tool. Returns the CallToolResult ({content, structuredContent?, isError?}) or
--- nil, msg, code. opts as for Session:request.
---@param name string
---@param arguments table
---@param opts {timeout_ms: integer|nil, on_progress: fun(p: table)|nil}|nil
function Session:call_tool(name, arguments, opts)
  return self:request("tools/call", { name = name, arguments = arguments or {} }, opts)
end

--- Number of requests waiting for an answer.
function Session:inflight()
  local n = 0
  for _ in pairs(self.pending) do n = n + 1 end
  return n
end

--- Closes the session: pending requests fail with ECONNRESET, the transport shuts down
--- (stdio: stdin is closed, then TERM and KILL to the process group after `grace_ms` each;
--- HTTP: in-flight requests are aborted and the session is ended with DELETE). Inside a
--- task it waits until that is done. Idempotent.
---@param grace_ms integer|nil  default 2000
function Session:close(grace_ms)
  self:fail_all(self.close_reason or "the connection was closed", "ECONNRESET")
  if self.transport.close then self.transport.close(grace_ms or 2000) end
end

--- True once the transport is gone (the process exited, or close was called).
function Session:is_closed() return self.closed end

---------------------------------------------------------------------------------------------
-- stdio

-- Splits stderr into lines, each cut at STDERR_LINE_BYTES, at most STDERR_TOTAL_BYTES in all.
local function stderr_lines(on_line)
  local buf, total, muted = "", 0, false
  local function emit(line)
    if muted then return end
    if #line > STDERR_LINE_BYTES then line = line:sub(1, STDERR_LINE_BYTES) .. " [line cut]" end
    total = total + #line
    if total > STDERR_TOTAL_BYTES then
      muted = true
      on_line(("[more than %d bytes of stderr: the rest is not logged]"):format(STDERR_TOTAL_BYTES))
      return
    end
    if line:find("%S") then on_line(line) end
  end
  return function(chunk)
    if not chunk then
      if buf ~= "" then emit(buf) end
      buf = ""
      return
    end
    buf = buf .. chunk
    while true do
      local nl = buf:find("\n", 1, true)
      if not nl then break end
      emit((buf:sub(1, nl - 1):gsub("\r$", "")))
      buf = buf:sub(nl + 1)
    end
    if #buf > STDERR_LINE_BYTES then
      emit(buf)
      buf = ""
    end
  end
end

--- Starts a stdio MCP server as a child process, in its own process group.
--- opts: file (program, looked up in PATH), args (list), env (list of "K=V": the child's
--- whole environment), cwd, name (for messages), max_message_bytes,
--- on_notification(method, params), on_stderr(line), on_exit(status, signal).
--- Returns the session (not yet initialized) or nil, msg, code when the program cannot start.
---@param opts table
---@return McpClientSession|nil, string|nil, string|nil
function client.spawn(opts)
  local self
  local pipes
  local exited, stdout_done, finalized = false, false, false
  local exit_status, exit_signal
  local exit_waiters = {}
  local settle_timer

  local function finalize()
    if finalized then return end
    finalized = true
    if settle_timer then settle_timer:close(); settle_timer = nil end
    local what = exit_signal ~= 0 and ("was killed by signal " .. tostring(exit_signal))
      or ("exited with status " .. tostring(exit_status))
    self:fail_all(("%s: the server process %s"):format(self.name, what), "ECONNRESET")
    for _, k in ipairs({ "stdin", "stdout", "stderr" }) do
      if pipes[k] then pipes[k]:close(); pipes[k] = nil end
    end
    if opts.on_exit then pcall(opts.on_exit, exit_status, exit_signal) end
    local ws = exit_waiters
    exit_waiters = {}
    for _, w in ipairs(ws) do w() end
  end

  local transport = {}
  local proc, p_or_err, code = process.spawn({
    file = opts.file, args = opts.args, env = opts.env, cwd = opts.cwd, detached = true,
    stdin = true, stdout = true, stderr = true,
  }, function(status, sig)
    exited, exit_status, exit_signal = true, status, sig
    -- the last answer may still be in the pipe: wait for end of stdout, briefly
    if stdout_done then finalize() else settle_timer = timer.after(500, finalize) end
  end)
  if not proc then return nil, p_or_err, code end
  pipes = p_or_err
  self = new_session(opts, transport)
  self.pid = proc:pid()

  local reader = framing.reader(self.max_message_bytes, function(line)
    local msg = json.decode_arrays(line)
    if msg == nil then return end -- not JSON: servers sometimes print banners on stdout
    self:receive(msg)
  end, function(bytes)
    -- the message is dropped, so whichever request it answered would wait forever
    local ps = self.pending
    self.pending = {}
    for _, entry in pairs(ps) do
      finish(entry, nil, ("%s: the server sent a message of more than %d bytes (the limit)"):format(self.name,
        self.max_message_bytes), "E2BIG")
    end
    self.oversize = (self.oversize or 0) + 1
    self.oversize_bytes = bytes
  end)
  pipes.stdout:read_start(function(data)
    if data then reader.feed(data) return end
    reader.finish()
    stdout_done = true
    if exited then finalize() end
  end)
  local on_err = stderr_lines(function(line) if opts.on_stderr then pcall(opts.on_stderr, line) end end)
  pipes.stderr:read_start(function(data) on_err(data) end)

  function transport.send(line)
    local stdin = pipes.stdin
    if not stdin or finalized then return nil, "the server process is gone", "ECONNRESET" end
    if stdin:write_queue_size() > WRITE_QUEUE_MAX then
      return nil, "the server process does not read its input", "EAGAIN"
    end
    return stdin:write(line .. "\n")
  end

  local function wait_exit(ms)
    if finalized then return true end
    local ok = false
    async.await(function(cb)
      local t = timer.after(ms, function() cb() end)
      exit_waiters[#exit_waiters + 1] = function() ok = true; t:close(); cb() end
      return function() t:close() end
    end)
    return ok or finalized
  end

  function transport.close(grace_ms)
    if finalized then return end
    -- the spec's order (basic/transports, stdio shutdown): close its input, wait, SIGTERM,
    -- wait, SIGKILL; the signals go to the process group (npx and its node, a shell's children)
    if pipes.stdin then pipes.stdin:close(); pipes.stdin = nil end
    if not async.current() then
      proc:kill("KILL", true)
      return
    end
    if wait_exit(grace_ms) then return end
    proc:kill("TERM", true)
    if wait_exit(grace_ms) then return end
    proc:kill("KILL", true)
    wait_exit(5000)
  end

  --- Kills the process group at once (a server that hangs).
  function self.kill()
    if not finalized then proc:kill("KILL", true) end
  end
  --- The process handle (tests signal it).
  self.process = proc
  return self
end

---------------------------------------------------------------------------------------------
-- Streamable HTTP

-- An incremental text/event-stream parser (HTML "server-sent events"): calls on_event(data)
-- for each event's joined data lines. A line or event over `max` bytes returns false.
local function sse_parser(max, on_event)
  local buf, data, dlen = "", {}, 0
  return function(chunk)
    buf = buf .. chunk
    while true do
      local nl = buf:find("\n", 1, true)
      if not nl then break end
      local line = buf:sub(1, nl - 1):gsub("\r$", "")
      buf = buf:sub(nl + 1)
      if line == "" then
        if #data > 0 then
          local ev = table.concat(data, "\n")
          data, dlen = {}, 0
          on_event(ev)
        end
      elseif line:sub(1, 5) == "data:" then
        local v = line:sub(6):gsub("^ ", "")
        dlen = dlen + #v
        if dlen > max then return false end
        data[#data + 1] = v
      end -- event:, id:, retry: and comments are not needed by this client
    end
    return #buf <= max
  end
end

local function header_token(v) return tostring(v):lower():match("^%s*([^;%s]+)") end

-- The Streamable HTTP transport of one client session (client.http): the session id and
-- protocol version the server gave, the requests in flight, the GET stream.
local HttpTransport = {}
HttpTransport.__index = HttpTransport

--- The headers of one request: the caller's, Accept, and the session's id and version.
---@param accept string
---@return table
function HttpTransport:headers(accept)
  local h = {}
  for k, v in pairs(self.opts.headers or {}) do h[k] = v end
  h["Accept"] = accept
  if accept ~= "text/event-stream" then h["Content-Type"] = "application/json" end
  if self.session_id then h["Mcp-Session-Id"] = self.session_id end
  if self.version then h["MCP-Protocol-Version"] = self.version end
  return h
end

--- One JSON-RPC message from the server, to the session.
---@param text string
function HttpTransport:deliver(text)
  local msg = json.decode_arrays(text)
  if msg ~= nil then self.session:receive(msg) end
end

--- Starts one HTTP request whose answer may be JSON or SSE; the messages it carries go to
--- the session. done(ok, err, code, status, body_snippet) once. Returns the request, or
--- nil, message, code.
---@param method string
---@param body string|nil
---@param accept string
---@param on_head fun(status: integer, headers: table)|nil
---@param done fun(ok: boolean, err: string|nil, code: string|nil, status: integer|nil, snippet: string|nil)
---@return userdata|nil req, string|nil err, string|nil code
function HttpTransport:exchange(method, body, accept, on_head, done)
  local req
  local status, kind
  local parse, json_parts, json_len = nil, {}, 0
  local failed
  local max = self.max
  local function fail(msg, code)
    failed = failed or { msg, code }
    if req then req:cancel() end
  end
  local r, err, code = http.request({
    url = self.opts.url, method = method, body = body, headers = self:headers(accept),
    connect_timeout_ms = self.opts.connect_timeout_ms or 10000,
    on_headers = function(st, hdrs)
      status = st
      kind = header_token(hdrs["content-type"] or "")
      if on_head then on_head(st, hdrs) end
      if kind == "text/event-stream" and st >= 200 and st < 300 then
        parse = sse_parser(max, function(text) self:deliver(text) end)
      end
    end,
    on_data = function(chunk)
      if parse then
        if not parse(chunk) then fail(("a server-sent event over %d bytes"):format(max), "E2BIG") end
      else
        json_len = json_len + #chunk
        if json_len > max then fail(("an answer over %d bytes"):format(max), "E2BIG") return end
        json_parts[#json_parts + 1] = chunk
      end
    end,
  }, function(res, rerr, rcode)
    self.inflight[req] = nil
    if failed then return done(false, failed[1], failed[2], status) end
    if not res then return done(false, rerr, rcode, status) end
    local text = table.concat(json_parts)
    if res.status >= 200 and res.status < 300 and kind == "application/json" and text ~= "" then
      self:deliver(text)
    end
    done(res.status >= 200 and res.status < 300, nil, nil, res.status, text:sub(1, 300))
  end)
  if not r then return nil, err, code end
  req = r
  self.inflight[r] = true
  return r
end

--- How a POST's answer ended, for the request `id` waiting on it (nil: a notification or
--- a response, nothing waits): an answer already delivered, a stream ended without one, a
--- session the server no longer knows, an HTTP error or a transport failure.
---@param id any
---@param ok boolean
---@param ferr string|nil
---@param fcode string|nil
---@param status integer|nil
---@param snippet string|nil
function HttpTransport:post_done(id, ok, ferr, fcode, status, snippet)
  local sess = self.session
  if id then self.by_id[id] = nil end
  if id == nil then return end -- a notification or a response: 202 expected, nothing waits
  if sess.pending[id] == nil then return end -- answered on this stream (or abandoned)
  if ok then
    sess:fail(id, ("%s: the server ended its answer stream without answering"):format(sess.name), "ECONNRESET")
  elseif (status == 404 or status == 400) and self.session_id then
    -- the spec: a 404 to a request carrying a session id means the session is gone and
    -- the client starts a new one; the SDK's servers answer an unknown session with
    -- 400 ("No valid session ID provided"), after a restart for instance
    sess:fail_all(("%s: the server no longer knows the session (HTTP %d)"):format(sess.name, status), "ESESSION")
  elseif status then
    sess:fail(id, ("%s: HTTP %d from the server%s"):format(sess.name, status,
      (snippet and snippet ~= "") and (": " .. snippet:gsub("%s+", " ")) or ""), status == 401 and "EACCES" or "EPROTO")
  else
    sess:fail(id, ("%s: %s"):format(sess.name, tostring(ferr)), fcode)
  end
end

--- Sends one message (a POST); `id` when it is a request that waits for its answer.
---@param line string
---@param id any
---@return boolean|nil ok, string|nil err, string|nil code
function HttpTransport:send(line, id)
  if self.closing then return nil, "the connection is closed", "ECONNRESET" end
  local is_init = id ~= nil and line:find('"method":"initialize"', 1, true) ~= nil
  local r, err, code = self:exchange("POST", line, "application/json, text/event-stream", function(_, hdrs)
    if is_init and hdrs["mcp-session-id"] then self.session_id = hdrs["mcp-session-id"] end
  end, function(...) self:post_done(id, ...) end)
  if not r then return nil, err, code end
  if id then self.by_id[id] = r end
  return true
end

--- Gives up on the request `id`: its POST is cancelled.
---@param id any
function HttpTransport:abort(id)
  local r = self.by_id[id]
  self.by_id[id] = nil
  if r then r:cancel() end
end

--- The GET stream for messages that relate to no request (tools/list_changed). A server
--- may answer 405; then there is no stream and session.no_stream tells the caller to list
--- again rather than trust a cached listing.
function HttpTransport:after_initialized()
  if self.closing then return end
  local sess = self.session
  sess.no_stream = false
  local r = self:exchange("GET", nil, "text/event-stream", function(st)
    if st < 200 or st >= 300 then sess.no_stream = true end
  end, function()
    self.listen_req = nil
    sess.no_stream = true
  end)
  if not r then sess.no_stream = true end
  self.listen_req = r
end

--- Ends every request and the GET stream; in a task, DELETEs the session (the spec: a
--- client that no longer needs it SHOULD). Idempotent.
function HttpTransport:close()
  if self.closing then return end
  self.closing = true
  for r in pairs(self.inflight) do r:cancel() end
  if self.listen_req then self.listen_req:cancel(); self.listen_req = nil end
  if self.session_id and async.current() then
    local del = async.wrap(http.request)
    del({ url = self.opts.url, method = "DELETE", headers = self:headers("application/json, text/event-stream"),
      timeout_ms = 2000, connect_timeout_ms = 2000 })
  end
end

--- Connects to a Streamable HTTP MCP server (nothing is sent until initialize).
--- opts: url (http:// or https://), headers ({name = value}: sent on every request, e.g.
--- Authorization), name, max_message_bytes, on_notification(method, params),
--- connect_timeout_ms (default 10000).
---@param opts table
---@return McpClientSession
function client.http(opts)
  local t = setmetatable({ opts = opts, inflight = {}, by_id = {}, closing = false }, HttpTransport)
  -- the session calls its transport's functions with a dot
  local transport = {
    send = function(line, id) return t:send(line, id) end,
    abort = function(id) return t:abort(id) end,
    negotiated = function(v) t.version = v end,
    after_initialized = function() return t:after_initialized() end,
    close = function() return t:close() end,
  }
  local self = new_session(opts, transport)
  t.session, t.max = self, self.max_message_bytes
  self.no_stream = true
  return self
end

return client
