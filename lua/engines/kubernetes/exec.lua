-- The Kubernetes exec stream: `GET /api/v1/namespaces/{ns}/pods/{pod}/exec` upgraded to a
-- WebSocket (core.ws) that speaks the channel protocol of k8s.io/apimachinery's wsstream
-- package (kubernetes remotecommand/websocket.go):
--   * every binary message starts with a channel byte: 0 stdin, 1 stdout, 2 stderr, 3 status
--     (error), 4 resize;
--   * the status channel carries one metav1.Status JSON at the end: `Success`, or `Failure`
--     with reason NonZeroExitCode and details.causes[{reason = "ExitCode", message = "<n>"}];
--   * v5.channel.k8s.io adds a close signal, the message {255, stream id}: how stdin gets its
--     end of file. v4.channel.k8s.io has none, so a command reading stdin under v4 must know
--     how much to read (e.g. `head -c N`).
-- Both are offered ("v5.channel.k8s.io, v4.channel.k8s.io"); the server chooses. Kubernetes
-- before 1.30 (the 1.20 test bed) speaks v4 only. This module is part of the Kubernetes engine
-- adapter; it lives in lua/engines/kubernetes/, where the adapter loader (which loads
-- lua/engines/<name>.lua) does not take it for an adapter.
local ws = require("core.ws")
local timer = require("core.timer")
local async = require("demesne.async")
local json = require("demesne.json")

local exec = {}

--- Channel numbers (the first byte of each message).
exec.STDIN, exec.STDOUT, exec.STDERR, exec.STATUS, exec.RESIZE = 0, 1, 2, 3, 4
--- The close-signal channel of v5.channel.k8s.io.
exec.CLOSE = 255
--- The subprotocols offered, in order of preference.
exec.PROTOCOLS = { "v5.channel.k8s.io", "v4.channel.k8s.io" }

local function escape(s)
  return (tostring(s):gsub("[^%w%-%._~]", function(c) return ("%%%02X"):format(c:byte()) end))
end

--- The path and query of an exec request: one `command=` per argv element, in order.
---@param namespace string
---@param pod string
---@param container string|nil  nil: the Pod's only container
---@param argv string[]  the command and its arguments (no shell)
---@param stdin boolean  whether a stdin stream is opened
---@return string path  "/api/v1/namespaces/ns/pods/pod/exec?container=…&command=…&stdin=…"
function exec.path(namespace, pod, container, argv, stdin)
  local q = {}
  if container then q[#q + 1] = "container=" .. escape(container) end
  for _, a in ipairs(argv) do q[#q + 1] = "command=" .. escape(a) end
  q[#q + 1] = "stdin=" .. tostring(not not stdin)
  q[#q + 1] = "stdout=true&stderr=true&tty=false"
  return ("/api/v1/namespaces/%s/pods/%s/exec?%s"):format(escape(namespace), escape(pod), table.concat(q, "&"))
end

--- A message for a channel: the channel byte, then the data.
---@param channel integer  0..4, or 255 (v5's close signal)
---@param data string|nil
---@return string message
function exec.frame(channel, data) return string.char(channel) .. (data or "") end

--- Splits a message into its channel and data; nil for an empty message.
---@param message string
---@return integer|nil channel, string|nil data
function exec.unframe(message)
  if #message == 0 then return nil end
  return message:byte(1), message:sub(2)
end

--- The exit code a status message gives: 0 for Success; n for a Failure with reason
--- NonZeroExitCode and an ExitCode cause; else nil, the status's message, "EEXEC" (the
--- command did not run: not found, the container gone…), or nil, msg, "EPROTO" when the text
--- is not a metav1.Status.
---@param text string  the data of the status channel (JSON)
---@return integer|nil code, string|nil err, string|nil errcode
function exec.exit_code(text)
  local st = json.decode(text)
  if type(st) ~= "table" or type(st.status) ~= "string" then
    return nil, "kubernetes exec: the status channel holds no metav1.Status: " .. text:sub(1, 200), "EPROTO"
  end
  if st.status == "Success" then return 0 end
  if st.reason == "NonZeroExitCode" and type(st.details) == "table" then
    for _, c in ipairs(type(st.details.causes) == "table" and st.details.causes or {}) do
      local n = type(c) == "table" and c.reason == "ExitCode" and math.tointeger(tonumber(c.message))
      if n then return n end
    end
  end
  return nil, "kubernetes exec: " .. tostring(st.message or st.reason or "Failure"), "EEXEC"
end

---@class KubeExecOpts
---@field server string  the API server, "https://host:port" (or http:// for a test server)
---@field namespace string
---@field pod string
---@field container string|nil
---@field command string[]
---@field stdin string|nil  bytes for the command's stdin (nil: no stdin stream)
---@field token string|nil  a bearer token (Authorization: Bearer)
---@field ca_pem string|nil  PEM CA of the API server
---@field cert_pem string|nil  PEM client certificate
---@field key_pem string|nil  PEM client key
---@field timeout_ms integer|nil  the whole exec, default 60000
---@field protocols string[]|nil  the subprotocols offered (default exec.PROTOCOLS)
---@field max_output integer|nil  exec.run keeps at most this many bytes of stdout and of stderr each (nil: all)

---@class KubeExecSession
---@field conn userdata  the core.ws.conn
---@field protocol string|nil  the subprotocol chosen, once open
local Session = {}
Session.__index = Session

--- Sends stdin bytes. Returns true, or nil, err, code (the connection is not open).
---@param data string
---@return boolean|nil ok, string|nil err, string|nil code
function Session:write(data) return self.conn:send(exec.frame(exec.STDIN, data), "binary") end

--- Ends stdin (v5's close signal for stream 0). Returns true, or nil, err, "ENOTSUP" under
--- v4, which has no way to end stdin.
---@return boolean|nil ok, string|nil err, string|nil code
function Session:close_stdin()
  if self.protocol ~= "v5.channel.k8s.io" then
    return nil, ("kubernetes exec: %s has no stdin end of file (v5.channel.k8s.io has)"):format(
      tostring(self.protocol)), "ENOTSUP"
  end
  return self.conn:send(exec.frame(exec.CLOSE, string.char(exec.STDIN)), "binary")
end

--- Sends a terminal size (channel 4), for a command run with a TTY.
---@param width integer  columns
---@param height integer  rows
---@return boolean|nil ok, string|nil err, string|nil code
function Session:resize(width, height)
  return self.conn:send(exec.frame(exec.RESIZE, json.encode({ Width = width, Height = height })), "binary")
end

--- Closes the connection (a normal close handshake).
function Session:close() self.conn:close(1000, "") end

--- Handles one event of the connection (core.ws.connect's on_event).
---@param kind string  "open", "message", "close" or "error"
---@param a any  the protocol, the message, the close code or the error message
---@param b any  the message type, the close reason or the error code
---@param c any  the HTTP status of a refused handshake
function Session:event(kind, a, b, c)
  local h = self.handlers
  if kind == "open" then
    self.protocol = a
    if h.open then h.open(self, a) end
  elseif kind == "message" then
    local ch, data = exec.unframe(a)
    if ch == exec.STDOUT and h.stdout then h.stdout(data)
    elseif ch == exec.STDERR and h.stderr then h.stderr(data)
    elseif ch == exec.STATUS then self.status = (self.status or "") .. data end
  elseif kind == "close" or kind == "error" then
    if self.ended then return end
    self.ended = true
    if self.status then return h.done(exec.exit_code(self.status)) end
    if kind == "error" then return h.done(nil, "kubernetes exec: " .. tostring(a), b, c) end
    h.done(nil, ("kubernetes exec: the stream ended (%s %s) without a status"):format(tostring(a), tostring(b)), "EPROTO")
  end
end

--- Opens an exec stream. `handlers`: open(session, protocol), stdout(data), stderr(data),
--- and done(exit_code | nil, err, code[, http_status]) called once at the end (see
--- exec.exit_code). Callback-shaped; exec.run is the task-shaped whole run.
---@param opts KubeExecOpts
---@param handlers table
---@return KubeExecSession|nil session, string|nil err, string|nil code
function exec.open(opts, handlers)
  local headers = {}
  if opts.token then headers[1] = { "Authorization", "Bearer " .. opts.token } end
  local s = setmetatable({ handlers = handlers }, Session)
  local conn, err, code = ws.connect({
    url = opts.server:gsub("/+$", "") .. exec.path(opts.namespace, opts.pod, opts.container, opts.command,
      opts.stdin ~= nil),
    headers = headers, protocols = opts.protocols or exec.PROTOCOLS,
    ca_pem = opts.ca_pem, cert_pem = opts.cert_pem, key_pem = opts.key_pem,
    timeout_ms = math.min(opts.timeout_ms or 30000, 30000),
  }, function(...) s:event(...) end)
  if not conn then return nil, "kubernetes exec: " .. err, code end
  s.conn = conn
  return s
end

--- Runs a command in a Pod's container and waits for it (inside a task). With opts.stdin,
--- the bytes are sent and then stdin is ended under v5 (under v4 it stays open: the command
--- must stop reading by itself). opts.max_output bounds what is kept of each stream.
--- Returns {stdout, stderr, exit_code, protocol}, or nil, err, code: a connection or
--- handshake failure (core.ws codes; a refused upgrade has "EHANDSHAKE" and the HTTP
--- status as a 4th value), "EEXEC" when the command could not run, "ETIMEDOUT".
---@param opts KubeExecOpts
---@return table|nil result, string|nil err, string|nil code
function exec.run(opts)
  local out, errs, session = { n = 0 }, { n = 0 }, nil
  -- what the command writes is the sandbox's: with max_output, bounded
  local function keep(list, d)
    local room = opts.max_output and opts.max_output - list.n or #d
    if room <= 0 then return end
    if #d > room then d = d:sub(1, room) end
    list[#list + 1] = d
    list.n = list.n + #d
  end
  local result = table.pack(async.await(function(resume)
    local finished = false
    local function cb(...)
      if finished then return end
      finished = true
      resume(...)
    end
    local t = timer.after(opts.timeout_ms or 60000, function()
      cb(nil, ("kubernetes exec: no end after %d ms"):format(opts.timeout_ms or 60000), "ETIMEDOUT")
    end)
    local err, code
    session, err, code = exec.open(opts, {
      open = function(s)
        if opts.stdin == nil then return end
        if #opts.stdin > 0 then s:write(opts.stdin) end
        if s.protocol == "v5.channel.k8s.io" then s:close_stdin() end
      end,
      stdout = function(d) keep(out, d) end,
      stderr = function(d) keep(errs, d) end,
      done = function(...) t:close(); cb(...) end,
    })
    if not session then
      t:close()
      cb(nil, err, code)
      return nil
    end
    return function() t:close(); session.conn:close(1000, "") end
  end))
  if session and session.conn:is_open() then session.conn:close(1000, "") end
  if result[1] == nil then return nil, result[2], result[3], result[4] end
  return { stdout = table.concat(out), stderr = table.concat(errs), exit_code = result[1],
    protocol = session and session.protocol }
end

return exec
