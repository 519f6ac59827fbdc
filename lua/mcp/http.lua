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
--     (job ends); DELETE ends the session. A disconnect is not a cancellation, and a
--     request's stream is resumable: its events carry ids (<stream>-<n>; a 2025-11-25
--     client first gets a priming event), and when its connection drops it is kept
--     (http_sse_replay_events, http_sse_replay_seconds) for a GET with Last-Event-ID. An
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

local MAX_TAGGED_ID = 64 -- bytes of a string request id that an event id still carries

--- The suffix of a request stream's event ids that names its JSON-RPC request id ("-i<n>"
--- for an integer, "-s<hex>" for a string of up to MAX_TAGGED_ID bytes, "" otherwise), so
--- that a server which no longer keeps the stream (it was restarted, or the stream expired)
--- can still answer a resume of it with an error for that request instead of a 404 that a
--- client retries for ever (rmcp's SseAutoReconnectStream backs off with no limit).
---@param id any  the request's id
---@return string
local function id_tag(id)
  local int = math.type(id) and math.tointeger(id) -- the JSON decoder may give 2.0
  if int then return "-i" .. int end
  if type(id) == "string" and #id <= MAX_TAGGED_ID then
    return "-s" .. id:gsub(".", function(c) return ("%02x"):format(c:byte()) end)
  end
  return ""
end

--- The parts of an event id "<stream>-<seq>[-i<n>|-s<hex>]" (RequestChannel:event_id): the
--- stream number, the sequence number and the request id it names (nil when it names none);
--- nil for an id not of that form.
---@param last string  a Last-Event-ID header
---@return integer|nil stream, integer|nil seq, any id
local function parse_event_id(last)
  local n, seq, rest = last:match("^(%d+)%-(%d+)(.*)$")
  if not n or #n > 15 or #seq > 15 then return nil end
  n, seq = math.tointeger(tonumber(n)), math.tointeger(tonumber(seq))
  local int, hex = rest:match("^%-i(%-?%d+)$"), rest:match("^%-s(%x*)$")
  if int and #int <= 19 then return n, seq, math.tointeger(tonumber(int)) end
  if hex and #hex % 2 == 0 and #hex <= 2 * MAX_TAGGED_ID then
    return n, seq, (hex:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end))
  end
  if rest == "" then return n, seq, nil end
  return nil
end

local function accepts(req)
  local a = (req.headers["accept"] or ""):lower()
  if a == "" or a:find("*/*", 1, true) then return true, true end
  return a:find("application/json", 1, true) ~= nil or a:find("application/*", 1, true) ~= nil,
    a:find("text/event-stream", 1, true) ~= nil
end

-- The HTTP server: three small classes, in the style of Neovim's vim.lsp.rpc.Client.
--
--   HttpServer      the listeners, the routes, keep-alive comments, graceful stop; it owns the
--                   tables of sessions, of connections with a request in progress and of open streams
--   Session         one 2025-revision session: its id, its GET stream (the standing transport
--                   for messages that relate to no request), whether it owns work, eviction
--   RequestChannel  the McpTransport of one POSTed request: a JSON answer, or an SSE stream
--                   (messages buffered until it opens), back-pressure and drain

---@class HttpServeOptions
---@field addrs string[]             listen addresses (http.parse_addr); may be empty (relay listeners only)
---@field allow_remote boolean|nil   allow non-loopback TCP addresses
---@field registry ToolRegistry
---@field max_message_bytes integer|nil  default: config mcp_max_message_bytes
---@field shutdown_timeout_ms integer|nil  default: config mcp_shutdown_timeout_ms
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

--------------------------------------------------------------------------------------------
-- Session

---@class HttpSession
---@field id string          Mcp-Session-Id (32 hex digits)
---@field listener string    the listener that opened it ("host" or a relay's tag)
---@field path string        the route that opened it
---@field seen integer       loop.now() (ms) of its last request
---@field owns_work boolean|nil  it started a job or made a sandbox: never evicted
---@field get_conn userdata|nil  its GET stream's connection
---@field srv table          its McpServer
---@field streams table<integer, RequestChannel>  its resumable request streams by number
---@field nstreams integer   the last stream number given
---@field ended boolean|nil  it is out of the server's table
local Session = {}
Session.__index = Session

--- A new session of `listener` on `route`; `opts` are its ServerOptions but the transport
--- (the session's own GET stream).
---@param listener string
---@param route table
---@param opts table
---@return HttpSession
function Session.new(listener, route, opts)
  local self = setmetatable({ id = util.random_hex(16), listener = listener, path = route.path, seen = loop.now(),
    streams = {}, nstreams = 0 }, Session)
  opts.transport = self:standing_transport()
  self.srv = server.new(opts)
  return self
end

--- True while its GET stream is open.
---@return boolean
function Session:stream_open() return self.get_conn ~= nil and self.get_conn:is_open() end

--- The McpTransport of messages that relate to no request: its GET stream, when open.
---@return McpTransport
function Session:standing_transport()
  return {
    write = function(_, line)
      local c = self.get_conn
      if not c or not c:is_open() then return nil, "no GET stream is open" end
      if c:queued() > NOTIFY_HIGH then return nil, "the client is not reading its GET stream" end
      return c:write(sse_event(line))
    end,
    is_closing = function() return not self:stream_open() end,
    terminate = function() if self.get_conn then self.get_conn:finish() end end,
    backlog = function() return self.get_conn and self.get_conn:queued() or 0 end,
  }
end

--- Registers a resumable request stream; returns its number (the first part of its event ids).
---@param ch RequestChannel
---@return integer n
function Session:add_stream(ch)
  self.nstreams = self.nstreams + 1
  self.streams[self.nstreams] = ch
  return self.nstreams
end

--- The resumable stream a Last-Event-ID names ("<stream>-<seq>[-i<n>|-s<hex>]", see
--- RequestChannel:event_id), and the sequence number of that event; nil when the session
--- keeps no such stream.
---@param last_event_id string
---@return RequestChannel|nil ch, integer|nil seq
function Session:stream_of(last_event_id)
  local n, seq = parse_event_id(last_event_id)
  local ch = n and self.streams[n]
  if not ch or not ch.replay then return nil end
  return ch, seq
end

--- Whether its client takes a priming event (an SSE event with an id and empty data):
--- 2025-11-25 and later (older clients parse the empty data as a message and fail).
---@return boolean
function Session:primes() return (self.srv.session.protocol_version or "") >= "2025-11-25" end

--- True until it ends.
---@return boolean
function Session:live() return not self.ended end

--- Ends its part: no stream is kept for a resume any more.
function Session:close_streams()
  self.ended = true
  for _, ch in pairs(self.streams) do ch:expire() end
  self.streams = {}
end

--- Ends the streams kept for a resume longer than `keep_ms` with no client back.
---@param now integer  loop.now()
---@param keep_ms integer
function Session:expire_streams(now, keep_ms)
  for _, ch in pairs(self.streams) do
    if ch.replay and ch.replay.since and now - ch.replay.since >= keep_ms then ch:expire() end
  end
end

--- Notes a request of it (it is not idle).
function Session:touch() self.seen = loop.now() end

--- Notes an answer sent to it: a session that started a job or made a sandbox is never
--- evicted (its client may come back for them; clients do not re-initialize after a 404).
---@param line string  the encoded response
function Session:note_answer(line)
  if line:find('"job_id":"', 1, true) or line:find('"sandbox_id":"', 1, true) then self.owns_work = true end
end

--- Whether it may end to make room for a new session of `listener`: nothing in progress
--- and no open stream; of a relay listener's own sessions any such one (what a sandbox
--- started belongs to its run, and short-lived clients often never DELETE theirs), of the
--- host's one that owns no work and was idle IDLE_EVICT_MS.
---@param listener string
---@param now integer  loop.now()
---@return boolean
function Session:evictable(listener, now)
  if self.srv:pending() ~= 0 or self:stream_open() then return false end
  if listener ~= "host" then return self.listener == listener end
  return self.listener == "host" and not self.owns_work and now - self.seen >= IDLE_EVICT_MS
end

--------------------------------------------------------------------------------------------
-- RequestChannel

---@class RequestChannel: McpTransport
---@field conn userdata|nil    the connection its messages go on: the POST's, a resuming GET's, or
---   nil while a resumable stream waits for its client to come back
---@field session HttpSession|nil  its session (nil for a 2026-07-28 request)
---@field headers table|nil    extra headers of the answer (Mcp-Session-Id of an initialize)
---@field sse_ok boolean|nil   the client accepts an event stream
---@field sse boolean|nil      the event stream is open
---@field done boolean|nil     the answer was sent (or kept for a resume)
---@field gone boolean|nil     the connection closed first and the stream is not kept
---@field replay {n: integer, seq: integer, events: {seq: integer, text: string}[], since: integer|nil}|nil
---   a resumable stream (a session's, http_sse_replay_events > 0): its number in the session,
---   the last event's sequence number, the events kept for a resume, and since when (loop.now())
---   it waits for one (nil while a connection is attached)
local RequestChannel = {}
RequestChannel.__index = RequestChannel

--- The channel that answers one POSTed request on `conn`, registered in `owner`'s tables
--- (owner.channels[conn], owner.streams[conn] while its stream is open). `opts.on_done()` is
--- called once it ends (answered or gone), `opts.on_gone()` when the connection closes first
--- and the stream is not kept for a resume.
---@param owner table  the HttpServer
---@param conn userdata
---@param opts {modern: boolean|nil, session: HttpSession|nil, request_id: any, headers: table|nil, sse_ok: boolean|nil, on_done: function|nil, on_gone: function|nil}
---@return RequestChannel
function RequestChannel.new(owner, conn, opts)
  local self = setmetatable({ owner = owner, conn = conn, modern = opts.modern, listener = conn:listener(),
    session = opts.session, request_id = opts.request_id, headers = opts.headers, sse_ok = opts.sse_ok, buffer = {},
    on_done = opts.on_done, on_gone = opts.on_gone }, RequestChannel)
  owner.channels[conn] = self
  return self
end

--- True while a connection is attached and open.
---@return boolean
function RequestChannel:attached() return self.conn ~= nil and self.conn:is_open() end

--- Takes the channel off its connection's entries in the owner's tables.
function RequestChannel:unhook()
  local owner, conn = self.owner, self.conn
  if not conn then return end
  if owner.channels[conn] == self then owner.channels[conn] = nil end
  owner.streams[conn] = nil
end

--- It ended (answered or gone): out of the owner's tables, then opts.on_done().
function RequestChannel:finish()
  self.done = true
  self:unhook()
  if self.on_done then self.on_done() end
end

--- The id of event `seq` of its resumable stream: "<stream>-<seq>" and the tag of its
--- request's id (id_tag), which a server that lost the stream answers a resume with.
---@param seq integer
---@return string
function RequestChannel:event_id(seq) return ("%d-%d%s"):format(self.replay.n, seq, id_tag(self.request_id)) end

--- One SSE event of `line`: with an id (RequestChannel:event_id) and kept for a resume on a
--- resumable stream (the oldest dropped past http_sse_replay_events).
---@param line string
---@return string text
function RequestChannel:event(line)
  local r = self.replay
  if not r then return sse_event(line) end
  r.seq = r.seq + 1
  local text = ("id: %s\n"):format(self:event_id(r.seq)) .. sse_event(line)
  r.events[#r.events + 1] = { seq = r.seq, text = text }
  if #r.events > self.owner.replay_events then table.remove(r.events, 1) end
  return text
end

--- Opens the event stream (once), with what was buffered for it. A session's stream is
--- resumable: its events carry ids, and a client that negotiated 2025-11-25 or later first
--- gets a priming event (an id, empty data) so it can resume even before the first message.
function RequestChannel:start_sse()
  if self.sse or self.done or self.gone then return end
  local h = {}
  for k, v in pairs(SSE_HEADERS) do h[k] = v end
  for k, v in pairs(self.headers or {}) do h[k] = v end
  if not self.conn:start(200, h) then self.gone = true return end
  self.sse = true
  self.owner.streams[self.conn] = true
  if self.session and self.owner.replay_events > 0 then
    self.replay = { n = self.session:add_stream(self), seq = 0, events = {} }
    if self.session:primes() then self.conn:write(("id: %s\ndata: \n\n"):format(self:event_id(0))) end
  end
  for _, l in ipairs(self.buffer) do self.conn:write(self:event(l)) end
  self.buffer = {}
end

--- The answer: on the stream when one is open (or messages wait for one), else as JSON.
--- On a resumable stream with no connection it is kept for the client's resume.
---@param line string  the encoded response
---@return boolean ok
function RequestChannel:answer(line)
  local conn = self.conn
  if self.session then self.session:note_answer(line) end
  if self.sse or (#self.buffer > 0 and self.sse_ok) then
    self:start_sse()
    local text = self:event(line)
    if self:attached() then
      conn:write(text)
      conn:finish()
      self:forget()
    elseif self.replay then
      self.replay.since = loop.now() -- kept http_sse_replay_seconds for a resume
    end
  else
    local h = { ["Content-Type"] = JSON_TYPE }
    if self.headers and line:find('"result":', 1, true) then for k, v in pairs(self.headers) do h[k] = v end end
    conn:respond(self.modern and modern_status(line) or 200, h, line)
  end
  self:finish()
  return true
end

--- McpTransport write: the response ends the channel; progress, logs and requests to the
--- client go on its stream (buffered, up to 64, until it opens; kept for a resume while
--- a resumable stream has no connection), or on the session's GET stream when the client
--- takes JSON only.
---@param line string
---@param kind "response"|"notification"|"request"
---@return boolean|nil ok, string|nil err
function RequestChannel:write(line, kind)
  if self:closed() then return nil, "the request's stream is closed" end
  if kind == "response" then return self:answer(line) end
  if self.sse then
    if not self:attached() then
      self:event(line)
      return true
    end
    if kind ~= "request" and self.conn:queued() > NOTIFY_HIGH then return nil, "the client is not reading its stream" end
    return self.conn:write(self:event(line))
  end
  if self.sse_ok then
    if #self.buffer >= 64 then return nil, "too many messages before the stream opened" end
    self.buffer[#self.buffer + 1] = line
    return true
  end
  -- a JSON answer carries nothing else: related messages go on the session's stream
  if self.session then return self.session.srv.transport:write(line, kind) end
  return nil, "the client accepts no event stream"
end

--- Whether nothing more can be written: answered, or its connection closed and the stream
--- is not kept for a resume.
---@return boolean
function RequestChannel:closed()
  return self.done or self.gone or not (self:attached() or self.replay ~= nil)
end

--- McpTransport is_closing: nothing reaches its client now (closed, or a resumable stream
--- waiting for its client to come back, which still keeps what is written), so the session
--- sends its requests to the client on another stream.
---@return boolean
function RequestChannel:is_closing() return self:closed() or not self:attached() end

--- McpTransport terminate: cuts the connection unless answered; the stream is not kept.
function RequestChannel:terminate()
  if self.done then return end
  if self.conn then self.conn:close() end
  self:expire()
end

--- McpTransport backlog: bytes queued on the connection.
---@return integer
function RequestChannel:backlog() return self:attached() and self.conn:queued() or 0 end

--- McpTransport drain: waits (inside a task) until the connection holds NOTIFY_HIGH or less.
function RequestChannel:drain()
  local conn = self.conn
  while conn and conn:is_open() and conn:queued() > NOTIFY_HIGH do
    local ok = async.await(function(cb)
      if not conn:drain(cb) then cb(true) end
    end)
    if not ok then return end
  end
end

--- The connection closed before the answer was sent. A resumable stream of a live session
--- is kept (http_sse_replay_seconds) for its client's GET with Last-Event-ID; any other ends.
function RequestChannel:lost()
  if self.replay and not self.done and not self.owner.stopping and self.session:live() then
    self:unhook()
    self.conn = nil
    self.replay.since = loop.now()
    return
  end
  self.gone = true
  self:forget()
  self:finish()
  if self.on_gone then self.on_gone() end
end

--- Resumes the stream on `conn` (a GET with Last-Event-ID naming event `after` of it): the
--- events after it that are kept, then what comes next; the answer, once sent, ends it. A
--- connection still attached is cut (the client has given up on it).
---@param conn userdata
---@param after integer  the sequence number of the last event the client got
---@return boolean ok  false when the connection could not start
function RequestChannel:resume(conn, after)
  if self.conn and self.conn ~= conn then
    local old = self.conn
    self:unhook()
    if old:is_open() then old:close() end
  end
  self.conn = nil
  self.replay.since = self.replay.since or loop.now()
  if not conn:start(200, SSE_HEADERS) then return false end
  for _, e in ipairs(self.replay.events) do
    if e.seq > after then conn:write(e.text) end
  end
  if self.done then
    conn:finish()
    self:forget()
    return true
  end
  self.conn = conn
  self.replay.since = nil
  self.owner.channels[conn] = self
  self.owner.streams[conn] = true
  return true
end

--- No resume of it any more: out of its session's streams, its events let go.
function RequestChannel:forget()
  if not self.replay then return end
  if self.session then self.session.streams[self.replay.n] = nil end
  self.replay = nil
end

--- Ends a stream kept for a resume that did not come (or whose session ended): its events
--- are let go, and a request still in progress on it writes into nothing.
function RequestChannel:expire()
  self:forget()
  if not self.done then
    self.gone = true
    self:finish()
  end
end

--------------------------------------------------------------------------------------------
-- HttpServer

---@class HttpServer
local HttpServer = {}
HttpServer.__index = HttpServer

-- The listen addresses of `o`, checked, or nil and why.
local function checked_addrs(o)
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
  return addrs
end

--- A server for options `o` (not listening yet), or nil and why.
---@param o HttpServeOptions
---@return HttpServer|nil, string|nil err
function HttpServer.new(o)
  local addrs, err = checked_addrs(o)
  if not addrs then return nil, err end
  local token, origin
  if #addrs > 0 then
    token, origin = http.token(true)
    if not token then return nil, origin end
  end
  local self = setmetatable({
    o = o,
    addrs = addrs,
    token = token,
    token_origin = origin,
    root = { path = ENDPOINT, registry = o.registry },
    max_sessions = math.floor(config.get("http_max_sessions")),
    per_listener = math.max(1, math.floor(o.max_sessions_per_listener or config.get("endpoint_max_sessions"))),
    max_message_bytes = o.max_message_bytes or math.floor(config.get("mcp_max_message_bytes")),
    shutdown_timeout_ms = o.shutdown_timeout_ms or math.floor(config.get("mcp_shutdown_timeout_ms")),
    replay_events = math.floor(config.get("http_sse_replay_events")),
    replay_ms = math.floor(config.get("http_sse_replay_seconds") * 1000),
    sessions = {},         -- id -> HttpSession
    nsessions = 0,
    nshared = 0,           -- of them, those of "host" listeners (http_max_sessions; a relay listener has its own)
    channels = {},         -- conn -> the RequestChannel answering its current request, or its GET stream
    streams = {},          -- conn -> true: open SSE streams (keep-alive comments)
    modern = {},           -- per-request 2026-07-28 sessions in progress -> true
    stopping = false,
    urls = {},
  }, HttpServer)
  return self
end

--- Opens core.httpd with the configured connection caps; its callbacks are on_request and on_close.
function HttpServer:open_httpd()
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
    local ok, err = xpcall(self.on_request, debug.traceback, self, conn, req)
    if not ok then
      log.error(LOGGER, "request failed: %s", tostring(err))
      if conn:is_open() then pcall(reply, conn, 500, server.INTERNAL_ERROR, "Internal error") end
    end
  end, function(conn, why) self:on_close(conn, why) end)
end

--- Listens on one address; its URL goes in self.urls. Returns true, or nil and why.
---@param addr table  http.parse_addr's
---@return boolean|nil ok, string|nil err
function HttpServer:listen_addr(addr)
  local lopts = { tag = "host", token = self.token, hosts = LOOPBACK_HOSTS }
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
  if ok then return true end
  return nil, ("--http %s: %s%s"):format(addr.text, tostring(err), code == "EADDRINUSE" and " (the port is taken)" or "")
end

--- Opens core.httpd, listens on every address and starts the keep-alive timer. Returns
--- true, or nil and why (every listener closed again).
---@return boolean|nil ok, string|nil err
function HttpServer:listen()
  self:open_httpd()
  for _, addr in ipairs(self.addrs) do
    local ok, err = self:listen_addr(addr)
    if not ok then
      self.http:close()
      return nil, err
    end
  end
  -- keep-alive comments on open streams (proxies and NATs drop silent connections)
  self.keepalive = timer.new()
  self.keepalive:start(KEEPALIVE_MS, KEEPALIVE_MS, function()
    for c in pairs(self.streams) do
      if c:is_open() and c:queued() < NOTIFY_HIGH then c:write(": keepalive\n\n") end
    end
    -- and streams kept for a resume go once they waited http_sse_replay_seconds
    local now = loop.now()
    for _, sess in pairs(self.sessions) do sess:expire_streams(now, self.replay_ms) end
  end)
  return true
end

--- ServerOptions for a session or request of `listener` on `route`: `base`, with the
--- listener's (session_options) and the route's added.
---@param listener string
---@param route table
---@param base table
---@return table base
function HttpServer:server_options(listener, route, base)
  local extra = self.o.session_options and self.o.session_options(listener)
  for k, v in pairs(extra or {}) do base[k] = v end
  for k, v in pairs(route.options or {}) do base[k] = v end
  return base
end

--- Counts a session in or out of the tables (its listener's share: host ones in nshared).
---@param sess HttpSession
---@param d integer  1 or -1
function HttpServer:count(sess, d)
  self.nsessions = self.nsessions + d
  if sess.listener == "host" then self.nshared = self.nshared + d end
end

--- Whether a new session of `listener` fits: the host's sessions share http_max_sessions; a
--- relay listener (one sandbox) holds at most per_listener of its own, so no sandbox and no
--- host client crowds out another. When full, the longest-idle evictable session goes.
---@param listener string
---@return boolean
function HttpServer:make_room(listener)
  local full
  if listener == "host" then
    full = self.nshared >= self.max_sessions
  else
    local mine = 0
    for _, s in pairs(self.sessions) do if s.listener == listener then mine = mine + 1 end end
    full = mine >= self.per_listener
  end
  if not full then return true end
  local now, victim = loop.now(), nil
  for _, s in pairs(self.sessions) do
    if s:evictable(listener, now) and (not victim or s.seen < victim.seen) then victim = s end
  end
  if not victim then return false end
  log.notice(LOGGER, "session %s idle for %d s: ended to make room", victim.id, (now - victim.seen) // 1000)
  self:remove_session(victim)
  victim.srv:close()
  return true
end

--- A new session of `listener` on `route`, or nil when there is no room.
---@param listener string
---@param route table
---@return HttpSession|nil
function HttpServer:new_session(listener, route)
  if not self:make_room(listener) then return nil end
  local sess = Session.new(listener, route, self:server_options(listener, route, { registry = route.registry,
    max_message_bytes = self.max_message_bytes, listener = listener }))
  self.sessions[sess.id] = sess
  self:count(sess, 1)
  return sess
end

--- Takes a session out of the table; no stream of it is kept for a resume any more.
---@param sess HttpSession
function HttpServer:remove_session(sess)
  self.sessions[sess.id] = nil
  self:count(sess, -1)
  sess:close_streams()
end

--- Forgets a session that never initialized (its initialize failed).
---@param sess HttpSession
function HttpServer:drop_session(sess)
  self:remove_session(sess)
  sess.srv:close()
end

--- Ends a session: out of the table, its GET stream finished, its requests in progress
--- cancelled (in a task, bounded by shutdown_timeout_ms).
---@param sess HttpSession
---@param why string  for the log
function HttpServer:end_session(sess, why)
  if self.sessions[sess.id] ~= sess then return end
  self:remove_session(sess)
  log.info(LOGGER, "session %s ended (%s)", sess.id, why)
  local c = sess.get_conn
  sess.get_conn = nil
  if c then
    self.streams[c] = nil
    self.channels[c] = nil
    if c:is_open() then c:finish() end
  end
  async.spawn("end session", function() sess.srv:shutdown(self.shutdown_timeout_ms) end)
end

--- The route of a request's path (/mcp, or one of o.routes), or nil.
---@param conn userdata
---@param req table
---@return table|nil route
function HttpServer:route_of(conn, req)
  local path = req.target:match("^[^?#]*")
  if path == ENDPOINT then return self.root end
  local r = self.o.routes and self.o.routes(path, conn:listener())
  if r then return { path = path, registry = r.registry, options = r.options } end
  return nil
end

--- core.httpd's request callback: one request that passed the checks in C.
---@param conn userdata
---@param req {method: string, target: string, headers: table<string, string>, body: string}
function HttpServer:on_request(conn, req)
  local route = self:route_of(conn, req)
  if not route then
    return reply(conn, 404, server.INVALID_REQUEST, ("Not Found: the MCP endpoint is %s"):format(ENDPOINT))
  end
  if self.stopping then
    return reply(conn, 503, server.INTERNAL_ERROR, "the server is shutting down")
  end
  if req.method == "POST" then return self:post(conn, req, route) end
  if req.method == "GET" then return self:get(conn, req, route) end
  if req.method == "DELETE" then return self:delete(conn, req, route) end
  reply(conn, 405, server.INVALID_REQUEST, "Method Not Allowed: use POST, GET or DELETE", { Allow = "GET, POST, DELETE" })
end

--- core.httpd's close callback: a request in progress on `conn` lost its connection.
---@param conn userdata
---@param why string|nil
function HttpServer:on_close(conn, why)
  local ch = self.channels[conn]
  self.channels[conn] = nil
  self.streams[conn] = nil
  if ch then
    if why then log.debug(LOGGER, "a connection closed with its answer pending (%s)", why) end
    ch:lost()
  end
end

local function header_mismatch(conn, id, message)
  conn:respond(400, { ["Content-Type"] = JSON_TYPE }, error_body(id, server.HEADER_MISMATCH, "Header mismatch: " .. message))
end

-- Decodes "=?base64?…?=" (Mcp-Name, Mcp-Param-*); other values are returned as they are.
local function header_value(v)
  local b64 = v and v:match("^=%?base64%?(.*)%?=$")
  if not b64 then return v end
  return util.base64_decode(b64)
end

-- 2026-07-28: Mcp-Name must mirror the body's name or uri. Returns true, or false (answered).
local function check_name_header(conn, req, msg)
  local name_field = (msg.method == "tools/call" or msg.method == "prompts/get") and "name"
    or (msg.method == "resources/read") and "uri" or nil
  if not name_field or msg.id == nil then return true end
  local want = type(msg.params) == "table" and msg.params[name_field]
  local got = header_value(req.headers["mcp-name"])
  if got == nil then header_mismatch(conn, msg.id, "the Mcp-Name header is required for " .. msg.method) return false end
  if type(want) == "string" and got ~= want then
    header_mismatch(conn, msg.id, ("Mcp-Name header %q does not match params.%s %q"):format(got, name_field, want))
    return false
  end
  return true
end

-- 2026-07-28: the headers must mirror the body. Returns true, or false (answered).
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
  return check_name_header(conn, req, msg)
end

-- The one JSON-RPC message of a POST body, or nil (answered with 400).
local function post_message(conn, body)
  local msg, err = json.decode(body)
  if msg == nil and err ~= nil then return reply(conn, 400, server.PARSE_ERROR, "Parse error: " .. err) end
  if type(msg) ~= "table" or body:match("^%s*%[") then
    return reply(conn, 400, server.INVALID_REQUEST, "Invalid Request: the body must be one JSON-RPC message (an object)")
  end
  return msg
end

--- POST: one JSON-RPC message, of a session (2025 revisions) or on its own (2026-07-28).
---@param conn userdata
---@param req table
---@param route table
function HttpServer:post(conn, req, route)
  local ctype = (req.headers["content-type"] or ""):lower()
  if not ctype:find("application/json", 1, true) then
    return reply(conn, 415, server.INVALID_REQUEST, "Content-Type must be application/json")
  end
  local json_ok, sse_ok = accepts(req)
  if not json_ok and not sse_ok then
    return reply(conn, 406, server.INVALID_REQUEST, "Accept must list application/json and text/event-stream")
  end
  local msg = post_message(conn, req.body)
  if not msg then return end
  local pv = req.headers["mcp-protocol-version"]
  -- 2026-07-28: a modern envelope, or the modern version in the header
  if server.is_modern_request(msg) or server.is_modern(pv) then return self:post_modern(conn, req, route, msg, sse_ok) end
  -- 2025-11-25 and 2025-06-18 (2025-03-26, the first Streamable HTTP revision, is served as
  -- the session negotiated: its header is accepted, as the SDKs do)
  if pv and not server.is_supported(pv) and pv ~= "2025-03-26" then
    return reply(conn, 400, server.INVALID_REQUEST, ("Unsupported MCP-Protocol-Version: %s (supported: %s)"):format(
      pv, table.concat(server.SUPPORTED_VERSIONS, ", ")))
  end
  return self:post_session(conn, req, route, msg, sse_ok)
end

local function is_request(msg) return msg.method ~= nil and msg.id ~= nil and msg.id ~= json.null end

--- A 2026-07-28 POST: served on its own, with no session; closing its stream cancels it.
---@param conn userdata
---@param req table
---@param route table
---@param msg table  the decoded message
---@param sse_ok boolean  the client accepts an event stream
function HttpServer:post_modern(conn, req, route, msg, sse_ok)
  local pv = req.headers["mcp-protocol-version"]
  msg.id = server.exact_id(msg.id, req.body, "id")
  if not check_modern_headers(conn, req, msg, pv) then return end
  if not is_request(msg) then return conn:respond(202, {}, "") end
  local srv = server.new(self:server_options(conn:listener(), route, { transport = mcp_transport.null(),
    registry = route.registry, forward_logs = false, max_message_bytes = self.max_message_bytes,
    listener = conn:listener() }))
  self.modern[srv] = true
  local ch = RequestChannel.new(self, conn, {
    modern = true,
    sse_ok = sse_ok,
    on_done = function() self.modern[srv] = nil end,
    -- closing the stream is cancellation in 2026-07-28
    on_gone = function() srv:cancel(msg.id, "the client closed the stream") end,
  })
  srv:receive_message(msg, req.body, ch)
  if not ch.done and sse_ok then ch:start_sse() end
end

--- The session a 2025-revision POST names, a new one for an initialize, or nil (answered).
---@param conn userdata
---@param req table
---@param route table
---@param msg table
---@return HttpSession|nil sess, boolean|nil new  true for a new session
function HttpServer:session_for_post(conn, req, route, msg)
  local sid = req.headers["mcp-session-id"]
  local sess = sid and self.sessions[sid]
  if sess and (sess.listener ~= conn:listener() or sess.path ~= route.path) then sess = nil end
  if sess then return sess, false end
  if msg.method == "initialize" and is_request(msg) and not sid then
    sess = self:new_session(conn:listener(), route)
    if sess then return sess, true end
    return reply(conn, 503, server.INVALID_REQUEST, conn:listener() == "host"
      and "too many sessions: end one (DELETE) or raise http_max_sessions"
      or ("too many sessions on this endpoint (its ceiling of %d, endpoint_max_sessions in the demesne "
        .. "configuration): end one (DELETE)"):format(self.per_listener))
  elseif sid then
    return reply(conn, 404, -32001, "Session not found: it ended or never existed; send initialize again")
  end
  return reply(conn, 400, server.INVALID_REQUEST, "Bad Request: the Mcp-Session-Id header is required "
    .. "(initialize first)")
end

--- A 2025-revision POST: a message of a session (initialize opens one).
---@param conn userdata
---@param req table
---@param route table
---@param msg table  the decoded message
---@param sse_ok boolean  the client accepts an event stream
function HttpServer:post_session(conn, req, route, msg, sse_ok)
  local sess, new = self:session_for_post(conn, req, route, msg)
  if not sess then return end
  sess:touch()
  if not is_request(msg) then
    sess.srv:receive_message(msg, req.body, nil)
    return conn:respond(202, {}, "")
  end
  local ch = RequestChannel.new(self, conn, { session = sess, request_id = msg.id, sse_ok = sse_ok,
    headers = new and { ["Mcp-Session-Id"] = sess.id } or nil })
  sess.srv:receive_message(msg, req.body, ch)
  -- an initialize that failed leaves no session behind
  if new and ch.done and not sess.srv.session.initialized then return self:drop_session(sess) end
  if not ch.done and sse_ok then ch:start_sse() end
end

--- The session a GET or DELETE names, or nil (answered with 400 or 404).
---@param conn userdata
---@param req table
---@param route table
---@return HttpSession|nil
function HttpServer:session_of(conn, req, route)
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
  sess:touch()
  return sess
end

--- GET: opens a session's stream for messages that relate to no request.
---@param conn userdata
---@param req table
---@param route table
function HttpServer:get(conn, req, route)
  local pv = req.headers["mcp-protocol-version"]
  if server.is_modern(pv) then
    return reply(conn, 405, server.INVALID_REQUEST, "revision 2026-07-28 has no GET stream: use subscriptions/listen",
      { Allow = "POST" })
  end
  local _, sse_ok = accepts(req)
  if not sse_ok then return reply(conn, 406, server.INVALID_REQUEST, "Accept must list text/event-stream") end
  local last = req.headers["last-event-id"]
  local sid = req.headers["mcp-session-id"]
  local known = sid and self.sessions[sid]
  if last and sid and not (known and known.listener == conn:listener() and known.path == route.path)
    and self:answer_lost(conn, last, "its session is not one this server has (the server was restarted, "
      .. "or the session ended)") then
    return
  end
  local sess = self:session_of(conn, req, route)
  if not sess then return end
  if last then return self:resume(conn, sess, last) end
  if sess:stream_open() then
    return reply(conn, 409, server.INVALID_REQUEST, "this session's GET stream is already open")
  end
  if not conn:start(200, SSE_HEADERS) then return end
  sess.get_conn = conn
  self.streams[conn] = true
  self.channels[conn] = { lost = function()
    if sess.get_conn == conn then sess.get_conn = nil end
    self.streams[conn] = nil
  end }
end

--- GET with Last-Event-ID: resumes the request stream that event belongs to (its events
--- after it, then the rest of the stream up to the answer), or 400 when the session keeps
--- no such stream (its answer was delivered, it waited longer than http_sse_replay_seconds,
--- or the id is not one of this session's).
---@param conn userdata
---@param sess HttpSession
---@param last string  the Last-Event-ID header
function HttpServer:resume(conn, sess, last)
  local ch, seq = sess:stream_of(last)
  if not ch then
    if self:answer_lost(conn, last, "this session keeps no such stream: it waited for a resume longer than "
      .. "http_sse_replay_seconds, or its answer was delivered") then
      return
    end
    return reply(conn, 400, server.INVALID_REQUEST, ("Last-Event-ID %q names no stream this session keeps: its "
      .. "answer was delivered, or it waited for a resume longer than http_sse_replay_seconds"):format(last:sub(1, 64)))
  end
  log.debug(LOGGER, "session %s resumes stream %s after event %d", sess.id, ch.replay.n, seq)
  ch:resume(conn, seq)
end

--- Answers a resume of a stream this server does not keep, when its Last-Event-ID names the
--- request (RequestChannel:event_id): a 200 event stream with one JSON-RPC error (-32603)
--- for that request, then the end, so the client's call fails at once and it can call
--- again. Returns false (nothing sent) when the id names no request.
---@param conn userdata
---@param last string  the Last-Event-ID header
---@param why string   why the stream is not kept
---@return boolean sent
function HttpServer:answer_lost(conn, last, why)
  local _, _, id = parse_event_id(last)
  if id == nil then return false end
  log.info(LOGGER, "a resume of event %s is answered with an error: %s", last:sub(1, 96), why)
  if not conn:start(200, SSE_HEADERS) then return true end
  conn:write(sse_event(error_body(id, server.INTERNAL_ERROR,
    "the answer to this request is lost: " .. why .. "; call again")))
  conn:finish()
  return true
end

--- DELETE: ends a session.
---@param conn userdata
---@param req table
---@param route table
function HttpServer:delete(conn, req, route)
  local pv = req.headers["mcp-protocol-version"]
  if server.is_modern(pv) then
    return reply(conn, 405, server.INVALID_REQUEST, "revision 2026-07-28 has no sessions", { Allow = "POST" })
  end
  local sess = self:session_of(conn, req, route)
  if not sess then return end
  self:end_session(sess, "DELETE")
  conn:respond(200, {}, "")
end

--- Listens on a unix socket for demesne-init's relay (core.httpd listen_relay): the
--- listener's `tag` names the caller of every request that arrives on it (never "host"),
--- `token` is required on each, Host must be loopback, at most `max_conns` (default
--- endpoint_max_connections) connections that presented the token are open on it at once
--- and at most `max_preauth` (default endpoint_max_preauth_connections) that have not yet
--- (the oldest closed past it); both its own, apart from every other listener's.
---@param path string
---@param lopts {tag: string, token: string|nil, max_conns: integer|nil, max_preauth: integer|nil}
---@return boolean|nil ok, string|nil err, string|nil code
function HttpServer:listen_relay(path, lopts)
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
---@param tag string
---@return integer
function HttpServer:unlisten(tag)
  local n = self.http:unlisten(tag)
  for _, sess in pairs(self.sessions) do
    if sess.listener == tag then self:end_session(sess, "its listener closed") end
  end
  return n
end

--- Sends a notification (method, params) on the standing stream of every initialized
--- session with its GET stream open for which `which(listener, path)` is true
--- (notifications/tools/list_changed to the sessions of one route); the others miss it.
--- Returns how many sessions it was sent to.
---@param which fun(listener: string, path: string): boolean
---@param method string
---@param params table|nil
---@return integer
function HttpServer:notify(which, method, params)
  local n = 0
  for _, sess in pairs(self.sessions) do
    if sess.srv.session.initialized and sess:stream_open() and which(sess.listener, sess.path) then
      if sess.srv:notify(method, params) then n = n + 1 end
    end
  end
  return n
end

--- Stops (inside a task): new requests get 503, every session and request in progress is
--- stopped (subscriptions get their completion result, other requests are cancelled and
--- their cleanup awaited, up to timeout_ms), then every connection is closed.
---@param timeout_ms integer|nil  default: shutdown_timeout_ms
function HttpServer:stop(timeout_ms)
  if self.stopping then return end
  self.stopping = true
  timeout_ms = timeout_ms or self.shutdown_timeout_ms
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

--- Creates the MCP HTTP server and starts listening. Returns a handle
--- {urls, token_origin, stop = fn(timeout_ms) (inside a task), sessions = fn() -> integer,
--- connections = fn() -> integer, notify = fn(which, method, params) -> integer,
--- listen_relay = fn(path, lopts) -> true | nil, err, unlisten = fn(tag) -> integer}
--- (HttpServer's methods), or nil and why (a bad address, a non-loopback address without
--- allow_remote, a port in use).
---@param o HttpServeOptions
---@return table|nil handle, string|nil err
function http.start(o)
  local self, err = HttpServer.new(o)
  if not self then return nil, err end
  local ok, lerr = self:listen()
  if not ok then return nil, lerr end
  return {
    urls = self.urls,
    token_origin = self.token_origin,
    sessions = function() return self.nsessions end,
    connections = function() return self.http:connections() end,
    listen_relay = function(path, lopts) return self:listen_relay(path, lopts) end,
    unlisten = function(tag) return self:unlisten(tag) end,
    notify = function(which, method, params) return self:notify(which, method, params) end,
    stop = function(timeout_ms) return self:stop(timeout_ms) end,
  }
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
  local limits = mcp_transport.limits()
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
      mcp_transport.graceful_stop(LOGGER, handle.stop, opts, limits.shutdown_timeout_ms)
      if unwatch then unwatch() end
      loop.stop()
    end)
  end)
  loop.run()
  return 0
end

return http
