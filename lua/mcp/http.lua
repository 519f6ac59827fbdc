-- MCP over Streamable HTTP (`demesne serve --http ADDR`): the endpoint /mcp on loopback
-- TCP ports or unix sockets, served by core.httpd (llhttp in C). The protocol is the session
-- layer's (lua/mcp/server.lua); this file only moves messages and speaks HTTP:
--
--   * security (checked in C before a body is read): a bearer token on every request
--     (DEMESNE_HTTP_TOKEN, else one generated at first start and kept 0600 in the state
--     folder), 401 + WWW-Authenticate otherwise; Host must name this machine's loopback
--     (421 otherwise) and a present Origin too (403); bodies over http_max_body_bytes 413.
--     Binding to a non-loopback address needs allow_remote.
--   * connections (in C): a new one must send its first head whole within
--     http_head_timeout_seconds, else it is closed; until a head passes the checks it is in
--     its listener's own queue of http_max_preauth_connections (a new one past it closes the
--     oldest), and only then counts against http_max_connections (503 past it), so
--     connections without the token never keep out a client that has it. A relay listener
--     (one sandbox's endpoint) has its own caps instead, and its own session cap
--     (max_sessions_per_listener), apart from the host's http_max_sessions.
--   * 2025-11-25 / 2025-06-18: POST initialize opens a session (Mcp-Session-Id); every later
--     request names it (400 without, 404 for an unknown or ended one); notifications and
--     responses get 202; a request is answered as JSON when its answer is ready at once,
--     else as an SSE stream that carries its progress and log notifications and ends with
--     the answer. GET opens the session's stream for messages that relate to no request
--     (job ends); DELETE ends the session. A disconnect is not a cancellation. An
--     MCP-Protocol-Version we do not speak is 400 with a plain JSON-RPC error, so a client
--     probing for 2026-07-28 with a legacy request falls back correctly.
--   * 2026-07-28: a POST whose request carries _meta io.modelcontextprotocol/protocolVersion
--     (or whose MCP-Protocol-Version header names 2026-07-28) is served on its own, with no
--     session: MCP-Protocol-Version, Mcp-Method and Mcp-Name must match the body (400,
--     -32020 HeaderMismatch); errors map to 400 (-32602, -32020, -32021, -32022) and 404
--     (-32601); closing the response stream cancels the request; GET and DELETE are 405.
--     subscriptions/listen holds its stream open for job-end resource updates.
--
-- Sessions never expire on a timer (clients that lose one do not re-initialize); past
-- http_max_sessions the longest-idle session with no request in progress, no open stream,
-- and no job or sandbox it started, goes. A slow client cannot make the server hold much for it: progress and log
-- notifications are dropped while over NOTIFY_HIGH bytes wait on its socket, and C cuts a
-- connection whose queue passes max_output.
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local server = require("demesne.mcp.server")
local mcp_transport = require("demesne.mcp.transport")
local stdio = require("demesne.mcp.stdio")
local util = require("demesne.util")
local tools = require("demesne.tools")
local fs = require("core.fs")
local httpd = require("core.httpd")
local loop = require("core.loop")
local timer = require("core.timer")

local http = {}

local LOGGER = "demesne.mcp.http"
local ENDPOINT = "/mcp"
local NOTIFY_HIGH = 256 * 1024      -- notifications wait no longer on a socket holding this much
local MAX_OUTPUT = 16 * 1024 * 1024 -- C cuts a connection holding more (a slow reader)
local KEEPALIVE_MS = 15000          -- SSE comment on every open stream
local IDLE_EVICT_MS = 3600 * 1000   -- a session idle this long may go when the table is full
local TOKEN_FILE = "http-token"
local LOOPBACK_HOSTS = { "localhost", "127.0.0.1", "[::1]" }
local SSE_HEADERS = { ["Content-Type"] = "text/event-stream", ["Cache-Control"] = "no-cache, no-transform",
  ["X-Accel-Buffering"] = "no" }
local JSON_TYPE = "application/json"


--------------------------------------------------------------------------------------------
-- Addresses and the token

--- Parses a listen address: "127.0.0.1:PORT", "[::1]:PORT", "localhost:PORT" (= 127.0.0.1)
--- or "unix:/absolute/path". Port 0 picks a free port.
--- Returns {kind = "tcp", ip, port, loopback} or {kind = "unix", path}, or nil and why.
---@param s string
---@return table|nil addr, string|nil err
function http.parse_addr(s)
  if type(s) ~= "string" or s == "" then return nil, "--http needs an address: 127.0.0.1:PORT, [::1]:PORT or unix:/path" end
  local path = s:match("^unix:(.+)$")
  if path then
    if path:sub(1, 1) ~= "/" then return nil, ("--http %s: the unix socket path must be absolute"):format(s) end
    if #path > 107 then return nil, ("--http %s: a unix socket path is at most 107 bytes"):format(s) end
    return { kind = "unix", path = path, text = s }
  end
  local ip, port = s:match("^%[([%x:%.]+)%]:(%d+)$")
  if not ip then ip, port = s:match("^([^:%[%]]+):(%d+)$") end
  port = tonumber(port)
  if not ip or not port or port > 65535 then
    return nil, ("--http %s: expected 127.0.0.1:PORT, [::1]:PORT, localhost:PORT or unix:/path"):format(s)
  end
  if ip == "localhost" then ip = "127.0.0.1" end
  local v4 = ip:match("^%d+%.%d+%.%d+%.%d+$")
  local v6 = ip:find(":", 1, true)
  if not v4 and not v6 then
    return nil, ("--http %s: give a numeric address (names other than localhost are not looked up)"):format(s)
  end
  local loopback = (v4 and ip:match("^127%.") ~= nil) or ip == "::1"
  return { kind = "tcp", ip = ip, port = math.tointeger(port), loopback = loopback, v6 = v6 ~= nil, text = s }
end

--- Where the generated token is kept: <state_dir>/http-token.
---@return string
function http.token_path() return config.get("state_dir") .. "/" .. TOKEN_FILE end

--- The bearer token every request must carry: $DEMESNE_HTTP_TOKEN when set, else the
--- token file (created at first use, 0600, 32 random bytes as hex). Returns the token and
--- where it comes from ("$DEMESNE_HTTP_TOKEN" or the file path), or nil and why.
---@param create boolean|nil  create the file when missing (serve); check-config only reads
---@return string|nil token, string origin_or_err
function http.token(create)
  local env = os.getenv("DEMESNE_HTTP_TOKEN")
  if env and env ~= "" then
    if #env < 16 then return nil, "DEMESNE_HTTP_TOKEN is shorter than 16 characters: use a long random value" end
    if env:find("[%s%c]") then return nil, "DEMESNE_HTTP_TOKEN holds whitespace or control characters" end
    return env, "$DEMESNE_HTTP_TOKEN"
  end
  local path = http.token_path()
  local st = fs.lstat(path)
  if st then
    if st.type ~= "file" then return nil, ("%s is not a regular file"):format(path) end
    if st.mode & 63 ~= 0 then fs.chmod(path, 384) end -- others must not read it: 0600
    local s, err = fs.read_file(path, 0, 4096)
    if not s then return nil, ("cannot read %s: %s"):format(path, tostring(err)) end
    local tok = s:match("^%s*(%S+)%s*$")
    if tok and #tok >= 16 then return tok, path end
    if not create then return nil, ("%s holds no usable token (16 characters or more)"):format(path) end
  elseif not create then
    return nil, path
  end
  local ok, err = fs.mkdir_p(config.get("state_dir"), 448)
  if ok then ok, err = fs.write_atomic(path, util.random_hex(32) .. "\n", 384) end
  if not ok then return nil, ("cannot write %s: %s"):format(path, tostring(err)) end
  log.notice(LOGGER, "generated a bearer token in %s", path)
  return http.token(false)
end

--------------------------------------------------------------------------------------------
-- Answers

local function error_body(id, code, message, data)
  return json.encode({ jsonrpc = "2.0", id = id == nil and json.null or id,
    error = { code = code, message = message, data = data } })
end

local function reply(conn, status, code, message, headers)
  local h = { ["Content-Type"] = JSON_TYPE }
  for k, v in pairs(headers or {}) do h[k] = v end
  conn:respond(status, h, error_body(nil, code, message))
end

-- HTTP status of a JSON-RPC error in a 2026-07-28 answer (spec: transports/streamable-http).
local MODERN_STATUS = { [-32700] = 400, [-32600] = 400, [-32602] = 400, [-32020] = 400, [-32021] = 400,
  [-32022] = 400, [-32601] = 404 }

local function modern_status(line)
  if #line > 65536 or not line:find('"error":', 1, true) then return 200 end
  local msg = json.decode(line)
  local code = type(msg) == "table" and type(msg.error) == "table" and msg.error.code
  return code and MODERN_STATUS[code] or 200
end

local function sse_event(line) return "event: message\ndata: " .. line .. "\n\n" end

local function accepts(req)
  local a = (req.headers["accept"] or ""):lower()
  if a == "" or a:find("*/*", 1, true) then return true, true end
  return a:find("application/json", 1, true) ~= nil or a:find("application/*", 1, true) ~= nil,
    a:find("text/event-stream", 1, true) ~= nil
end

--------------------------------------------------------------------------------------------
-- The HTTP server

---@class HttpServeOptions
---@field addrs string[]             listen addresses (http.parse_addr); may be empty (relay listeners only)
---@field allow_remote boolean|nil   allow non-loopback TCP addresses
---@field registry ToolRegistry
---@field max_message_bytes integer|nil
---@field shutdown_timeout_ms integer|nil
---@field session_options (fun(listener: string): table|nil)|nil  extra ServerOptions for the sessions
---   and 2026-07-28 requests of a listener (the in-sandbox endpoint: no host log records, a scope)
---@field max_sessions_per_listener integer|nil  sessions one relay listener may hold, apart from the
---   host's http_max_sessions (default endpoint_max_sessions)
---@field routes (fun(path: string, listener: string): HttpRoute|nil)|nil  MCP servers at paths other
---   than /mcp (the in-sandbox endpoint's /mcp/host/<server>): nil = 404. A session belongs to the
---   path that opened it and is not found on another.

---@class HttpRoute
---@field registry ToolRegistry   the tools served at the path (may carry list_changed)
---@field options table|nil       extra ServerOptions for its sessions (instructions, …)

--- Creates the MCP HTTP server and starts listening. Returns a handle
--- {urls, token_origin, stop = fn(timeout_ms) (inside a task), sessions = fn() -> integer,
--- listen_relay = fn(path, lopts) -> true | nil, err, unlisten = fn(tag) -> integer},
--- or nil and why (a bad address, a non-loopback address without allow_remote, a port in use).
---@param o HttpServeOptions
---@return table|nil handle, string|nil err
function http.start(o)
  local addrs = {}
  for _, a in ipairs(o.addrs) do
    local addr, err = http.parse_addr(a)
    if not addr then return nil, err end
    if addr.kind == "tcp" and not addr.loopback and not o.allow_remote then
      return nil, ("--http %s: %s is not a loopback address; demesne serves this machine only unless "
        .. "--http-allow-remote is given (then anyone who can reach the port and holds the token drives it)"):format(
        a, addr.ip)
    end
    addrs[#addrs + 1] = addr
  end
  local token, origin
  if #addrs > 0 then
    token, origin = http.token(true)
    if not token then return nil, origin end
  end
  local max_sessions = math.floor(config.get("http_max_sessions"))
  local per_listener = math.max(1, math.floor(o.max_sessions_per_listener or config.get("endpoint_max_sessions")))
  local function server_opts(listener, base)
    local extra = o.session_options and o.session_options(listener)
    for k, v in pairs(extra or {}) do base[k] = v end
    return base
  end
  local self = {
    sessions = {},         -- id -> session
    nsessions = 0,
    nshared = 0,           -- of them, those of "host" listeners (http_max_sessions; a relay listener has its own)
    channels = {},         -- conn -> the channel answering its current request
    streams = {},          -- conn -> true: open SSE streams (keep-alive comments)
    modern = {},           -- per-request 2026-07-28 sessions in progress -> true
    stopping = false,
    urls = {},
    token_origin = origin,
  }

  local function session_transport(sess)
    -- messages that relate to no request: the session's GET stream, when open
    return {
      write = function(_, line)
        local c = sess.get_conn
        if not c or not c:is_open() then return nil, "no GET stream is open" end
        if c:queued() > NOTIFY_HIGH then return nil, "the client is not reading its GET stream" end
        return c:write(sse_event(line))
      end,
      is_closing = function() return not (sess.get_conn and sess.get_conn:is_open()) end,
      terminate = function() if sess.get_conn then sess.get_conn:finish() end end,
      backlog = function() return sess.get_conn and sess.get_conn:queued() or 0 end,
    }
  end

  local root = { path = ENDPOINT, registry = o.registry }

  local function route_opts(listener, route, base)
    server_opts(listener, base)
    for k, v in pairs(route.options or {}) do base[k] = v end
    return base
  end

  -- Counts a session in or out of the tables (its listener's share: host ones in nshared).
  local function count(sess, d)
    self.nsessions = self.nsessions + d
    if sess.listener == "host" then self.nshared = self.nshared + d end
  end

  local function new_session(listener, route)
    -- the host's sessions share http_max_sessions; a relay listener (one sandbox) holds at
    -- most per_listener sessions of its own, so no sandbox and no host client crowds out another
    local mine = 0
    if listener ~= "host" then
      for _, s in pairs(self.sessions) do if s.listener == listener then mine = mine + 1 end end
    end
    local full
    if listener == "host" then full = self.nshared >= max_sessions else full = mine >= per_listener end
    if full then
      -- room: the longest-idle session with nothing in progress and no open stream goes.
      -- Of a relay listener's own sessions any such one may go: what a sandbox started
      -- belongs to its run, not to a session, and short-lived clients (a script per call)
      -- often never DELETE theirs
      local own = listener ~= "host"
      local victim
      for _, s in pairs(self.sessions) do
        if s.srv:pending() == 0 and not (s.get_conn and s.get_conn:is_open())
          and (own and s.listener == listener
            or not own and s.listener == "host" and not s.owns_work and loop.now() - s.seen >= IDLE_EVICT_MS)
          and (not victim or s.seen < victim.seen) then
          victim = s
        end
      end
      if not victim then return nil end
      log.notice(LOGGER, "session %s idle for %d s: ended to make room", victim.id, (loop.now() - victim.seen) // 1000)
      self.sessions[victim.id] = nil
      count(victim, -1)
      victim.srv:close()
    end
    local sess = { id = util.random_hex(16), listener = listener, path = route.path, seen = loop.now() }
    sess.srv = server.new(route_opts(listener, route, { transport = session_transport(sess), registry = route.registry,
      max_message_bytes = o.max_message_bytes, listener = listener }))
    self.sessions[sess.id] = sess
    count(sess, 1)
    return sess
  end

  local function end_session(sess, why)
    if self.sessions[sess.id] ~= sess then return end
    self.sessions[sess.id] = nil
    count(sess, -1)
    log.info(LOGGER, "session %s ended (%s)", sess.id, why)
    local c = sess.get_conn
    sess.get_conn = nil
    if c then
      self.streams[c] = nil
      self.channels[c] = nil
      if c:is_open() then c:finish() end
    end
    async.spawn("end session", function() sess.srv:shutdown(o.shutdown_timeout_ms or 20000) end)
  end

  -- The channel (McpTransport) that answers one POSTed request on its connection.
  local function channel(conn, opts)
    local ch = { modern = opts.modern, listener = conn:listener(), buffer = {} }
    self.channels[conn] = ch
    local function done()
      ch.done = true
      if self.channels[conn] == ch then self.channels[conn] = nil end
      self.streams[conn] = nil
      if opts.on_done then opts.on_done() end
    end
    function ch.start_sse()
      if ch.sse or ch.done or ch.gone then return end
      local h = {}
      for k, v in pairs(SSE_HEADERS) do h[k] = v end
      if ch.headers then for k, v in pairs(ch.headers) do h[k] = v end end
      if not conn:start(200, h) then ch.gone = true return end
      ch.sse = true
      self.streams[conn] = true
      for _, l in ipairs(ch.buffer) do conn:write(sse_event(l)) end
      ch.buffer = {}
    end
    function ch.write(_, line, kind)
      if ch.done or ch.gone or not conn:is_open() then return nil, "the request's stream is closed" end
      if kind == "response" and opts.session and (line:find('"job_id":"', 1, true) or line:find('"sandbox_id":"', 1, true)) then
        -- a session that started a job or made a sandbox is never evicted (its client may come
        -- back for them; clients do not re-initialize after a 404)
        opts.session.owns_work = true
      end
      if kind == "response" then
        if ch.sse then
          conn:write(sse_event(line))
          conn:finish()
        elseif #ch.buffer > 0 and ch.sse_ok then
          ch.start_sse()
          conn:write(sse_event(line))
          conn:finish()
        else
          local h = { ["Content-Type"] = JSON_TYPE }
          if ch.headers and line:find('"result":', 1, true) then for k, v in pairs(ch.headers) do h[k] = v end end
          conn:respond(ch.modern and modern_status(line) or 200, h, line)
        end
        done()
        return true
      end
      if ch.sse then
        if kind ~= "request" and conn:queued() > NOTIFY_HIGH then return nil, "the client is not reading its stream" end
        return conn:write(sse_event(line))
      end
      if ch.sse_ok then
        if #ch.buffer >= 64 then return nil, "too many messages before the stream opened" end
        ch.buffer[#ch.buffer + 1] = line
        return true
      end
      -- a JSON answer carries nothing else: related messages go on the session's stream
      if opts.session then return opts.session.srv.transport:write(line, kind) end
      return nil, "the client accepts no event stream"
    end
    function ch.is_closing() return ch.done or ch.gone or not conn:is_open() end
    function ch.terminate() if not ch.done then conn:close() end end
    function ch.backlog() return conn:queued() end
    function ch.drain()
      while conn:is_open() and conn:queued() > NOTIFY_HIGH do
        local ok = async.await(function(cb)
          if not conn:drain(cb) then cb(true) end
        end)
        if not ok then return end
      end
    end
    ch.on_gone = function()
      ch.gone = true
      done()
      if opts.on_gone then opts.on_gone() end
    end
    return ch
  end

  local function header_mismatch(conn, id, message)
    conn:respond(400, { ["Content-Type"] = JSON_TYPE }, error_body(id, server.HEADER_MISMATCH, "Header mismatch: " .. message))
  end

  -- Decodes "=?base64?…?=" (Mcp-Name, Mcp-Param-*); other values are returned as they are.
  local function header_value(v)
    local b64 = v and v:match("^=%?base64%?(.*)%?=$")
    if not b64 then return v end
    local map = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    local bits, out = "", {}
    for c in b64:gsub("=", ""):gmatch(".") do
      local i = map:find(c, 1, true)
      if not i then return nil end
      local n = i - 1
      for k = 5, 0, -1 do bits = bits .. ((n >> k) & 1) end
      while #bits >= 8 do
        out[#out + 1] = string.char(tonumber(bits:sub(1, 8), 2))
        bits = bits:sub(9)
      end
    end
    return table.concat(out)
  end

  -- 2026-07-28: the headers must mirror the body.
  local function check_modern_headers(conn, req, msg, pv)
    local id = msg.id
    local meta = type(msg.params) == "table" and type(msg.params._meta) == "table" and msg.params._meta or {}
    local body_v = meta[server.META.PROTOCOL_VERSION]
    if not pv then header_mismatch(conn, id, "the MCP-Protocol-Version header is required") return false end
    if body_v ~= nil and body_v ~= pv then
      header_mismatch(conn, id, ("MCP-Protocol-Version header %q does not match params._meta %s %q"):format(pv,
        server.META.PROTOCOL_VERSION, tostring(body_v)))
      return false
    end
    if msg.method == nil then return true end
    local m = req.headers["mcp-method"]
    if m == nil then header_mismatch(conn, id, "the Mcp-Method header is required") return false end
    if m ~= msg.method then
      header_mismatch(conn, id, ("Mcp-Method header %q does not match the body's method %q"):format(m, msg.method))
      return false
    end
    local name_field = (msg.method == "tools/call" or msg.method == "prompts/get") and "name"
      or (msg.method == "resources/read") and "uri" or nil
    if name_field and msg.id ~= nil then
      local want = type(msg.params) == "table" and msg.params[name_field]
      local got = header_value(req.headers["mcp-name"])
      if got == nil then header_mismatch(conn, id, "the Mcp-Name header is required for " .. msg.method) return false end
      if type(want) == "string" and got ~= want then
        header_mismatch(conn, id, ("Mcp-Name header %q does not match params.%s %q"):format(got, name_field, want))
        return false
      end
    end
    return true
  end

  local function post(conn, req, route)
    local ctype = (req.headers["content-type"] or ""):lower()
    if not ctype:find("application/json", 1, true) then
      return reply(conn, 415, server.INVALID_REQUEST, "Content-Type must be application/json")
    end
    local json_ok, sse_ok = accepts(req)
    if not json_ok and not sse_ok then
      return reply(conn, 406, server.INVALID_REQUEST, "Accept must list application/json and text/event-stream")
    end
    local body = req.body
    local msg, err = json.decode(body)
    if msg == nil and err ~= nil then return reply(conn, 400, server.PARSE_ERROR, "Parse error: " .. err) end
    if type(msg) ~= "table" or body:match("^%s*%[") then
      return reply(conn, 400, server.INVALID_REQUEST, "Invalid Request: the body must be one JSON-RPC message (an object)")
    end
    local pv = req.headers["mcp-protocol-version"]
    local is_request = msg.method ~= nil and msg.id ~= nil and msg.id ~= json.null
    -- 2026-07-28: a modern envelope, or the modern version in the header
    if server.is_modern_request(msg) or server.is_modern(pv) then
      msg.id = server.exact_id(msg.id, body, "id")
      if not check_modern_headers(conn, req, msg, pv) then return end
      if not is_request then
        conn:respond(202, {}, "")
        return
      end
      local srv = server.new(route_opts(conn:listener(), route, { transport = mcp_transport.null(),
        registry = route.registry, forward_logs = false, max_message_bytes = o.max_message_bytes,
        listener = conn:listener() }))
      self.modern[srv] = true
      local ch
      ch = channel(conn, {
        modern = true,
        on_done = function() self.modern[srv] = nil end,
        -- closing the stream is cancellation in 2026-07-28
        on_gone = function() srv:cancel(msg.id, "the client closed the stream") end,
      })
      ch.sse_ok = sse_ok
      srv:receive_message(msg, body, ch)
      if not ch.done and sse_ok then ch.start_sse() end
      return
    end
    -- 2025-11-25 and 2025-06-18 (2025-03-26, the first Streamable HTTP revision, is served as
    -- the session negotiated: its header is accepted, as the SDKs do)
    if pv and not server.is_supported(pv) and pv ~= "2025-03-26" then
      return reply(conn, 400, server.INVALID_REQUEST, ("Unsupported MCP-Protocol-Version: %s (supported: %s)"):format(
        pv, table.concat(server.SUPPORTED_VERSIONS, ", ")))
    end
    local sid = req.headers["mcp-session-id"]
    local sess = sid and self.sessions[sid]
    if sess and (sess.listener ~= conn:listener() or sess.path ~= route.path) then sess = nil end
    local headers
    if not sess then
      if msg.method == "initialize" and is_request and not sid then
        sess = new_session(conn:listener(), route)
        if not sess then
          return reply(conn, 503, server.INVALID_REQUEST, conn:listener() == "host"
            and "too many sessions: end one (DELETE) or raise http_max_sessions"
            or ("too many sessions on this endpoint (its ceiling of %d, endpoint_max_sessions in the demesne "
              .. "configuration): end one (DELETE)"):format(per_listener))
        end
        headers = { ["Mcp-Session-Id"] = sess.id }
      elseif sid then
        return reply(conn, 404, -32001, "Session not found: it ended or never existed; send initialize again")
      else
        return reply(conn, 400, server.INVALID_REQUEST, "Bad Request: the Mcp-Session-Id header is required "
          .. "(initialize first)")
      end
    end
    sess.seen = loop.now()
    if not is_request then
      sess.srv:receive_message(msg, body, nil)
      conn:respond(202, {}, "")
      return
    end
    local ch = channel(conn, { session = sess })
    ch.headers = headers
    ch.sse_ok = sse_ok
    sess.srv:receive_message(msg, body, ch)
    if headers and (not ch.done or not sess.srv.session.initialized) then
      -- an initialize that failed leaves no session behind
      if ch.done then
        self.sessions[sess.id] = nil
        count(sess, -1)
        sess.srv:close()
        return
      end
    end
    if not ch.done and sse_ok then ch.start_sse() end
  end

  local function session_of(conn, req, route)
    local sid = req.headers["mcp-session-id"]
    if not sid then
      reply(conn, 400, server.INVALID_REQUEST, "Bad Request: the Mcp-Session-Id header is required")
      return nil
    end
    local sess = self.sessions[sid]
    if not sess or sess.listener ~= conn:listener() or sess.path ~= route.path then
      reply(conn, 404, -32001, "Session not found: it ended or never existed")
      return nil
    end
    sess.seen = loop.now()
    return sess
  end

  local function get(conn, req, route)
    local pv = req.headers["mcp-protocol-version"]
    if server.is_modern(pv) then
      return reply(conn, 405, server.INVALID_REQUEST, "revision 2026-07-28 has no GET stream: use subscriptions/listen",
        { Allow = "POST" })
    end
    local _, sse_ok = accepts(req)
    if not sse_ok then return reply(conn, 406, server.INVALID_REQUEST, "Accept must list text/event-stream") end
    local sess = session_of(conn, req, route)
    if not sess then return end
    if sess.get_conn and sess.get_conn:is_open() then
      return reply(conn, 409, server.INVALID_REQUEST, "this session's GET stream is already open")
    end
    if not conn:start(200, SSE_HEADERS) then return end
    sess.get_conn = conn
    self.streams[conn] = true
    self.channels[conn] = { get_of = sess, on_gone = function()
      if sess.get_conn == conn then sess.get_conn = nil end
      self.streams[conn] = nil
    end }
  end

  local function delete(conn, req, route)
    local pv = req.headers["mcp-protocol-version"]
    if server.is_modern(pv) then
      return reply(conn, 405, server.INVALID_REQUEST, "revision 2026-07-28 has no sessions", { Allow = "POST" })
    end
    local sess = session_of(conn, req, route)
    if not sess then return end
    end_session(sess, "DELETE")
    conn:respond(200, {}, "")
  end

  local function on_request(conn, req)
    local path = req.target:match("^[^?#]*")
    local route = path == ENDPOINT and root or nil
    if not route and o.routes then
      local r = o.routes(path, conn:listener())
      if r then route = { path = path, registry = r.registry, options = r.options } end
    end
    if not route then
      return reply(conn, 404, server.INVALID_REQUEST, ("Not Found: the MCP endpoint is %s"):format(ENDPOINT))
    end
    if self.stopping then
      return reply(conn, 503, server.INTERNAL_ERROR, "the server is shutting down")
    end
    if req.method == "POST" then return post(conn, req, route) end
    if req.method == "GET" then return get(conn, req, route) end
    if req.method == "DELETE" then return delete(conn, req, route) end
    reply(conn, 405, server.INVALID_REQUEST, "Method Not Allowed: use POST, GET or DELETE", { Allow = "GET, POST, DELETE" })
  end

  local function on_close(conn, why)
    local ch = self.channels[conn]
    self.channels[conn] = nil
    self.streams[conn] = nil
    if ch and ch.on_gone then
      if why then log.debug(LOGGER, "a connection closed with its answer pending (%s)", why) end
      ch.on_gone()
    end
  end

  self.http = httpd.new({
    max_body = math.floor(config.get("http_max_body_bytes")),
    max_output = MAX_OUTPUT,
    -- connections that have not presented the token: a short head timeout and a queue of their
    -- own per listener (its oldest closed when full), so they never crowd out one that has it
    max_conns = math.max(1, math.floor(config.get("http_max_connections"))),
    max_preauth = math.max(1, math.floor(config.get("http_max_preauth_connections"))),
    head_timeout_ms = math.max(1, math.floor(config.get("http_head_timeout_seconds") * 1000)),
    error_body = '{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"%s"}}',
    error_type = JSON_TYPE,
  }, function(conn, req)
    local ok, err = xpcall(on_request, debug.traceback, conn, req)
    if not ok then
      log.error(LOGGER, "request failed: %s", tostring(err))
      if conn:is_open() then pcall(reply, conn, 500, server.INTERNAL_ERROR, "Internal error") end
    end
  end, on_close)

  for _, addr in ipairs(addrs) do
    local lopts = { tag = "host", token = token, hosts = LOOPBACK_HOSTS }
    if addr.kind == "tcp" and not addr.loopback then
      lopts.hosts = { "localhost", "127.0.0.1", "[::1]", addr.v6 and ("[" .. addr.ip .. "]") or addr.ip }
    end
    local ok, err, code
    if addr.kind == "unix" then
      ok, err, code = self.http:listen_unix(addr.path, lopts)
      if ok then self.urls[#self.urls + 1] = "unix:" .. addr.path .. " (endpoint " .. ENDPOINT .. ")" end
    else
      lopts.ipv6_only = addr.v6
      ok, err, code = self.http:listen_tcp(addr.ip, addr.port, lopts)
      if ok then
        self.urls[#self.urls + 1] = ("http://%s:%d%s"):format(addr.v6 and ("[" .. addr.ip .. "]") or addr.ip, ok, ENDPOINT)
      end
    end
    if not ok then
      self.http:close()
      return nil, ("--http %s: %s%s"):format(addr.text, tostring(err), code == "EADDRINUSE" and " (the port is taken)" or "")
    end
  end

  -- keep-alive comments on open streams (proxies and NATs drop silent connections)
  self.keepalive = timer.new()
  self.keepalive:start(KEEPALIVE_MS, KEEPALIVE_MS, function()
    for c in pairs(self.streams) do
      if c:is_open() and c:queued() < NOTIFY_HIGH then c:write(": keepalive\n\n") end
    end
  end)

  local handle = { urls = self.urls, token_origin = origin }
  function handle.sessions() return self.nsessions end
  --- Listens on a unix socket for demesne-init's relay (core.httpd listen_relay): the
  --- listener's `tag` names the caller of every request that arrives on it (never "host"),
  --- `token` is required on each, Host must be loopback, at most `max_conns` (default
  --- endpoint_max_connections) connections that presented the token are open on it at once
  --- and at most `max_preauth` (default endpoint_max_preauth_connections) that have not yet
  --- (the oldest closed past it); both its own, apart from every other listener's.
  ---@param path string
  ---@param lopts {tag: string, token: string|nil, max_conns: integer|nil, max_preauth: integer|nil}
  ---@return boolean|nil ok, string|nil err, string|nil code
  function handle.listen_relay(path, lopts)
    assert(type(lopts.tag) == "string" and lopts.tag ~= "host", "listen_relay: a tag other than host")
    if self.stopping then return nil, "the server is shutting down" end
    local ok, err, code = self.http:listen_relay(path, { tag = lopts.tag, token = lopts.token, hosts = LOOPBACK_HOSTS,
      max_conns = math.max(1, math.floor(lopts.max_conns or config.get("endpoint_max_connections"))),
      max_preauth = math.max(1, math.floor(lopts.max_preauth or config.get("endpoint_max_preauth_connections"))) })
    if not ok then return nil, ("listen on %s: %s"):format(path, tostring(err)), code end
    return true
  end
  --- Stops the listeners tagged `tag`: their connections are cut (a 2026-07-28 request in
  --- progress on one is cancelled) and their sessions end (their requests in progress are
  --- cancelled). Returns how many listeners stopped.
  function handle.unlisten(tag)
    local n = self.http:unlisten(tag)
    for _, sess in pairs(self.sessions) do
      if sess.listener == tag then end_session(sess, "its listener closed") end
    end
    return n
  end
  function handle.connections() return self.http:connections() end
  --- Sends a notification (method, params) on the standing stream of every initialized
  --- session with its GET stream open for which `which(listener, path)` is true
  --- (notifications/tools/list_changed to the sessions of one route); the others miss it. Returns
  --- how many sessions it was sent to.
  function handle.notify(which, method, params)
    local n = 0
    for _, sess in pairs(self.sessions) do
      if sess.srv.session.initialized and sess.get_conn and sess.get_conn:is_open()
        and which(sess.listener, sess.path) then
        if sess.srv:notify(method, params) then n = n + 1 end
      end
    end
    return n
  end
  --- Stops (inside a task): new requests get 503, every session and request in progress is
  --- stopped (subscriptions get their completion result, other requests are cancelled and
  --- their cleanup awaited, up to timeout_ms), then every connection is closed.
  function handle.stop(timeout_ms)
    if self.stopping then return end
    self.stopping = true
    self.keepalive:close()
    local tasks = {}
    local function stop(srv)
      tasks[#tasks + 1] = async.spawn("stop session", function() return srv:shutdown(timeout_ms) end)
    end
    for _, sess in pairs(self.sessions) do stop(sess.srv) end
    for srv in pairs(self.modern) do stop(srv) end
    for _, t in ipairs(tasks) do t:wait() end
    local closed = async.event()
    self.http:close(function() closed.set() end)
    closed.wait()
  end
  return handle
end

--- Runs `demesne serve --http`: the MCP server on the given addresses until SIGINT,
--- SIGTERM or SIGHUP (stdin is not read: it may be /dev/null). Returns the exit status.
--- `opts.on_stop(timeout_ms)` (optional) runs in the shutdown task beside the server's own stop.
--- `opts.on_shutdown` (optional) runs inside the shutdown task once the sessions have
--- stopped, before the loop stops. `opts.on_listening(urls)` (optional) is called once the
--- listeners are bound, with their URLs (the ports port 0 picked).
---@param opts {addrs: string[], allow_remote: boolean|nil, fixtures: string|nil, registry: ToolRegistry|nil, on_stop: fun(timeout_ms: integer)|nil, on_shutdown: function|nil, on_listening: fun(urls: string[])|nil}
---@return integer
function http.serve(opts)
  local limits = stdio.limits()
  local registry = opts.registry or tools.load({ fixtures = opts.fixtures })
  local handle, err = http.start({ addrs = opts.addrs, allow_remote = opts.allow_remote, registry = registry,
    max_message_bytes = limits.max_message_bytes, shutdown_timeout_ms = limits.shutdown_timeout_ms })
  if not handle then
    io.stderr:write("demesne serve: ", err, "\n")
    return 2
  end
  for _, u in ipairs(handle.urls) do
    log.notice(LOGGER, "demesne %s serving MCP over HTTP on %s", loop.version, u)
  end
  if opts.on_listening then opts.on_listening(handle.urls) end
  log.notice(LOGGER, "bearer token: %s (send Authorization: Bearer <token>)",
    handle.token_origin == "$DEMESNE_HTTP_TOKEN" and "from $DEMESNE_HTTP_TOKEN" or ("in " .. handle.token_origin))
  local unwatch
  unwatch = mcp_transport.watch_signals(function(name)
    log.info(LOGGER, "shutting down (SIG%s), %d session(s)", name, handle.sessions())
    async.spawn("http shutdown", function()
      local other = opts.on_stop and async.spawn("stop", opts.on_stop, limits.shutdown_timeout_ms)
      local ok, e = pcall(handle.stop, limits.shutdown_timeout_ms)
      if not ok then log.error(LOGGER, "shutdown: %s", tostring(e)) end
      if other then
        local sok, serr = other:wait()
        if not sok then log.error(LOGGER, "shutdown: %s", tostring(serr)) end
      end
      if opts.on_shutdown then -- the caller's own cleanup (warm sandboxes, removals after answers)
        ok, e = pcall(opts.on_shutdown)
        if not ok then log.error(LOGGER, "shutdown: %s", tostring(e)) end
      end
      if unwatch then unwatch() end
      loop.stop()
    end)
  end)
  loop.run()
  return 0
end

return http
