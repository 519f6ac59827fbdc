-- The cockpit page (`demesne ui`): a web server on 127.0.0.1 (a free port; core.httpd, llhttp
-- in C) that shows every tree of every running server of this user, live, and carries the
-- person's actions to the servers' control sockets (lua/cockpit/client.lua). It renders
-- what sandboxes wrote, so it treats all of it as hostile:
--
--   * who: a one-time login link (/login?t=<launch token>, printed by `demesne ui`) sets a
--     session cookie (HttpOnly, SameSite=Strict); every other request must carry it (401).
--   * where from: Host must be exactly localhost:<port> (421; DNS rebinding), a present
--     Origin exactly http://localhost:<port> (403), and Sec-Fetch-Site, when sent, same-origin
--     (or none for a navigation to the page itself). The page is named localhost, a host no
--     port preview has (lua/sandbox/preview.lua serves each on a 127.A.B.C of its own),
--     because browsers keep cookies per host name, not per port: a cookie of a preview's
--     host would be sent to that preview's sandbox.
--   * actions: POST /api/action only, with Content-Type application/json, an Origin, and the
--     session's CSRF token in X-Demesne-CSRF (403 otherwise).
--   * what runs: a strict Content-Security-Policy (scripts from this origin only, no inline
--     script, no eval, no frames); the page inserts sandbox text as text only.
--   * files from /out: downloads are application/octet-stream with Content-Disposition:
--     attachment and X-Content-Type-Options: nosniff under a sandboxing CSP; only PNG, JPEG,
--     GIF and WebP (checked by their first bytes) are shown as images; SVG and HTML never
--     render in this origin; text comes as JSON for textContent.
--   * it is on no relay: no sandbox reaches 127.0.0.1 of the host (their egress goes through
--     the policy proxy; a loopback name is refused there).
local async = require("demesne.async")
local client = require("demesne.cockpit.client")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local terminal = require("demesne.terminal")
local util = require("demesne.util")
local fs = require("core.fs")
local httpd = require("core.httpd")
local loop = require("core.loop")
local timer = require("core.timer")

local web = {}

local LOGGER = "demesne.cockpit"
local SCAN_MS = 2000          -- the control folder is read again this often (new servers)
local LOG_TICK_MS = 500       -- a followed log is read again this often, on the server side
local KEEPALIVE_MS = 15000
local TEXT_MAX = 256 * 1024   -- a /out file shown as text, at most
local COOKIE = "demesne_ui"
local ASSETS = { ["/"] = { "index.html", "text/html; charset=utf-8" },
  ["/app.js"] = { "app.js", "text/javascript; charset=utf-8" },
  ["/app.css"] = { "app.css", "text/css; charset=utf-8" } }
local CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
  .. "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
local FILE_CSP = "default-src 'none'; sandbox; frame-ancestors 'none'"
local IMAGES = { { "^\137PNG\r\n\26\n", "image/png" }, { "^\255\216\255", "image/jpeg" }, { "^GIF8[79]a", "image/gif" },
  { "^RIFF....WEBP", "image/webp" } }

--- The folder of the built page: ui_dir, else <bindir>/ui (the build tree), else
--- <bindir>/../share/demesne/ui (installed). nil and the paths tried when none holds index.html.
---@return string|nil dir, string|nil err
function web.ui_dir()
  local tried = {}
  local set = config.get("ui_dir")
  local cands = {}
  if set and set ~= "" then cands = { set } else
    local exe = loop.exepath()
    local dir = exe and exe:gsub("/[^/]*$", "")
    if dir then cands = { dir .. "/ui", (dir:gsub("/[^/]*$", "")) .. "/share/demesne/ui" } end
  end
  for _, c in ipairs(cands) do
    tried[#tried + 1] = c
    local st = fs.stat(c .. "/index.html")
    if st and st.type == "file" then return c end
  end
  return nil, ("the cockpit page is not built (no index.html in %s): build with npm available, or set "
    .. "DEMESNE_UI_DIR"):format(#tried > 0 and table.concat(tried, " or ") or "(the binary's folder is unknown)")
end

local function headers(extra)
  local h = { ["Content-Security-Policy"] = CSP, ["X-Content-Type-Options"] = "nosniff",
    ["Referrer-Policy"] = "no-referrer", ["X-Frame-Options"] = "DENY", ["Cache-Control"] = "no-store",
    ["Cross-Origin-Resource-Policy"] = "same-origin", ["Cross-Origin-Opener-Policy"] = "same-origin" }
  for k, v in pairs(extra or {}) do h[k] = v end
  return h
end

local function send(conn, status, body, ctype, extra)
  local h = headers(extra)
  h["Content-Type"] = ctype or "text/plain; charset=utf-8"
  conn:respond(status, h, body)
end

local function send_json(conn, status, v) send(conn, status, json.encode(v), "application/json") end

local function fail(conn, status, message) send_json(conn, status, { error = { message = message } }) end

local function query(target)
  local q = {}
  for k, v in (target:match("%?(.*)$") or ""):gmatch("([^&=]+)=([^&]*)") do
    q[k] = v:gsub("+", " "):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end)
  end
  return q
end

local pct = util.percent_encode

-- A file name for Content-Disposition: the last component, printable ASCII in the plain
-- form (others as _), UTF-8 in filename*.
local function disposition(rel)
  local base = rel:match("([^/]+)$") or "file"
  local plain = base:gsub("[^%w%-%._ ]", "_")
  return ('attachment; filename="%s"; filename*=UTF-8\'\'%s'):format(plain, pct(base))
end

-- One page server (web.start): the servers it watches, its streams, its one-time link and
-- session, and the methods that answer the page's requests.
local Page = {}
Page.__index = Page

--- The page's state: every watched server's trees as it last answered, oldest server first.
---@return {servers: table[], now_ms: integer}
function Page:state()
  local out = json.array()
  for _, s in pairs(self.servers) do
    if s.data then
      -- the server's answer passed on as it came (decoding loses the empty arrays)
      out[#out + 1] = { pid = s.entry.pid, transport = s.entry.transport, urls = json.array(s.entry.urls or {}),
        state_dir = s.entry.state_dir, started_ms = s.entry.started_ms, data = json.raw(s.raw, s.data) }
    end
  end
  table.sort(out, function(a, b) return (tonumber(a.started_ms) or 0) < (tonumber(b.started_ms) or 0) end)
  return { servers = out, now_ms = util.now_ms() }
end

--- Sends the state to every open /api/events stream (a stream 4 MiB behind is skipped).
function Page:broadcast()
  local ev = "event: state\ndata: " .. json.encode(self:state()) .. "\n\n"
  for c in pairs(self.streams) do
    if c:is_open() then
      if c:queued() < 4 * 1024 * 1024 then c:write(ev) end
    else self.streams[c] = nil end
  end
end

--- Asks a watched server for its trees again (once more if a change came meanwhile), then
--- broadcasts.
---@param s table  the watched server
function Page:refresh(s)
  if s.refreshing then s.again = true return end
  s.refreshing = true
  repeat
    s.again = false
    local status, body, _, text = client.call(s.entry, "GET", "/v1/trees", nil, 30000)
    if status == 200 and type(body) == "table" then s.data, s.raw = body, text end
  until not s.again
  s.refreshing = false
  self:broadcast()
end

--- Watches one server: its control socket's event stream, a refresh on each change.
---@param entry table  lua/cockpit/client.lua's server entry
function Page:watch(entry)
  local s = { entry = entry }
  self.servers[entry.pid] = s
  local req, err = client.events(entry, function(name)
    if name == "changed" then async.spawn("cockpit refresh", self.refresh, self, s) end
  end, function()
    if self.servers[entry.pid] == s then self.servers[entry.pid] = nil end
    self:broadcast()
  end)
  if not req then
    log.debug(LOGGER, "server %d: no event stream (%s)", entry.pid, tostring(err))
    self.servers[entry.pid] = nil
    return
  end
  s.req = req
end

--- Lists the user's servers (their control sockets): watches new ones, forgets gone ones.
function Page:scan_servers()
  local seen = {}
  for _, e in ipairs(client.servers()) do
    seen[e.pid] = true
    local s = self.servers[e.pid]
    if not s or s.entry.owner ~= e.owner then
      if s and s.req then s.req:cancel() end
      self:watch(e)
    elseif table.concat(s.entry.urls or {}, " ") ~= table.concat(e.urls or {}, " ") then
      s.entry = e -- rewritten (an HTTP server's URLs, once bound)
      self:broadcast()
    end
  end
  for pid, s in pairs(self.servers) do
    if not seen[pid] then
      if s.req then s.req:cancel() end
      self.servers[pid] = nil
      self:broadcast()
    end
  end
end

--- Checks every request: Host, Origin, Sec-Fetch-Site. Returns true or answers it.
---@param conn table  the httpd connection
---@param req table  the request
---@param navigation boolean  a navigation to the page itself (Sec-Fetch-Site none allowed)
---@return boolean
function Page:where_from(conn, req, navigation)
  local h = req.headers
  if h["host"] ~= ("localhost:%d"):format(self.port) then
    fail(conn, 421, "the Host header names another server (DNS rebinding protection)")
    return false
  end
  if h["origin"] and h["origin"] ~= self.origin then
    fail(conn, 403, "requests from this Origin are not allowed")
    return false
  end
  local site = h["sec-fetch-site"]
  if site and site ~= "same-origin" and not (navigation and site == "none") then
    fail(conn, 403, "cross-site requests are not allowed")
    return false
  end
  return true
end

--- The session cookie's value in a request, or nil.
---@param req table
---@return string|nil
function Page:cookie_of(req)
  for k, v in (req.headers["cookie"] or ""):gmatch("([^=;%s]+)=([^;]*)") do
    if k == COOKIE then return v end
  end
  return nil
end

--- Whether a request carries this page's session cookie.
---@param req table
---@return boolean
function Page:signed_in(req)
  local c = self:cookie_of(req)
  return c ~= nil and httpd.token_equal(c, self.session)
end

--- The entry of the watched server a request names (its `server` pid), or nil.
---@param q table  the query or body
---@return table|nil
function Page:server_of(q)
  local s = self.servers[math.tointeger(tonumber(q.server))]
  return s and s.entry
end

--- Passes a request to a server's control API and its JSON answer back to the page.
---@param conn table
---@param entry table|nil  the server (nil: 404)
---@param method string
---@param path string
---@param body table|nil
function Page:proxy_json(conn, entry, method, path, body)
  if not entry then return fail(conn, 404, "server: no such running demesne server") end
  local status, v, _, text = client.call(entry, method, path, body)
  if not status then return fail(conn, 502, tostring(v)) end
  if type(v) ~= "table" then return fail(conn, 502, "the server's answer is not JSON") end
  send(conn, status, text, "application/json")
end

--- Whether `id` has a run id's form.
---@param id any
---@return boolean
function Page:valid_id(id) return type(id) == "string" and #id <= 64 and id:match("^[%w][%w%-]*$") ~= nil end

--- GET /api/file: a file of a run's /out as text (neutralised), an image, or a download.
---@param conn table
---@param q table  {server, id, path, mode}
function Page:file(conn, q)
  local entry = self:server_of(q)
  if not entry or not self:valid_id(q.id) or type(q.path) ~= "string" then
    return fail(conn, 400, "server, id and path are required")
  end
  local status, data = client.call(entry, "GET", ("/v1/nodes/%s/file?path=%s"):format(q.id, pct(q.path)))
  if status ~= 200 or type(data) ~= "string" then return fail(conn, status or 502, client.message(status, data)) end
  if q.mode == "text" then
    local text = data
    local cut = #text > TEXT_MAX
    if cut then text = text:sub(1, TEXT_MAX) end
    return send_json(conn, 200, { text = terminal.neutralise(text), truncated = cut, size = #data })
  end
  if q.mode == "image" then
    for _, im in ipairs(IMAGES) do
      if data:find(im[1]) then
        return send(conn, 200, data, im[2], { ["Content-Security-Policy"] = FILE_CSP,
          ["Content-Disposition"] = "inline" })
      end
    end
    return fail(conn, 415, "not a PNG, JPEG, GIF or WebP image (SVG is never shown: download it)")
  end
  send(conn, 200, data, "application/octet-stream", { ["Content-Security-Policy"] = FILE_CSP,
    ["Content-Disposition"] = disposition(q.path) })
end

--- GET /api/stream: a log followed for one page, read on the server side every
--- LOG_TICK_MS and sent as events.
---@param conn table
---@param q table  {server, id, stream}
function Page:tail(conn, q)
  local entry = self:server_of(q)
  if not entry or not self:valid_id(q.id) then return fail(conn, 400, "server and id are required") end
  local stream = q.stream or "transcript"
  if stream ~= "transcript" and stream ~= "stdout" and stream ~= "stderr" then
    return fail(conn, 400, "stream: one of transcript, stdout, stderr")
  end
  if not conn:start(200, headers({ ["Content-Type"] = "text/event-stream" })) then return end
  self.tails[conn] = true
  local from = 0
  while conn:is_open() and not self.stopping do
    local status, part = client.call(entry, "GET", ("/v1/nodes/%s/log?stream=%s&from=%d"):format(q.id, stream, from))
    if status ~= 200 or type(part) ~= "table" then
      conn:write("event: end\ndata: " .. json.encode({ error = client.message(status, part) }) .. "\n\n")
      break
    end
    if #(part.lines or {}) > 0 then
      conn:write("event: lines\ndata: " .. json.encode({ lines = part.lines }) .. "\n\n")
    end
    from = math.tointeger(part.next) or from
    if part.eof then
      conn:write("event: end\ndata: {}\n\n")
      break
    end
    if #(part.lines or {}) == 0 then async.sleep(LOG_TICK_MS) end
  end
  self.tails[conn] = nil
  if conn:is_open() then conn:finish() end
end

--- POST /api/action: cancel, ttl, budget or an ask's answer, from the page only (Origin,
--- CSRF token), passed to the server named.
---@param conn table
---@param req table
function Page:action(conn, req)
  if (req.headers["content-type"] or ""):match("^[^;]*") ~= "application/json" then
    return fail(conn, 415, "Content-Type must be application/json")
  end
  if req.headers["origin"] ~= self.origin then return fail(conn, 403, "an action must come from the page (Origin)") end
  local tok = req.headers["x-demesne-csrf"]
  if not tok or not httpd.token_equal(tok, self.csrf) then
    return fail(conn, 403, "the CSRF token is missing or wrong: reload the page")
  end
  local b = json.decode(req.body)
  if type(b) ~= "table" then return fail(conn, 400, "the body must be a JSON object") end
  local entry = self:server_of(b)
  if not entry then return fail(conn, 404, "server: no such running demesne server") end
  local a = b.action
  if a == "ask" then
    if type(b.ask_id) ~= "string" or not b.ask_id:match("^[%w%-_%.]+$") then return fail(conn, 400, "ask_id") end
    return self:proxy_json(conn, entry, "POST", "/v1/asks/" .. b.ask_id, { decision = b.decision })
  end
  if not self:valid_id(b.id) then return fail(conn, 400, "id: a run id") end
  if a == "cancel" then
    return self:proxy_json(conn, entry, "POST", ("/v1/nodes/%s/cancel"):format(b.id), { subtree = b.subtree == true })
  elseif a == "ttl" then
    return self:proxy_json(conn, entry, "POST", ("/v1/nodes/%s/ttl"):format(b.id), { seconds = b.seconds })
  elseif a == "budget" then
    return self:proxy_json(conn, entry, "POST", ("/v1/trees/%s/budget"):format(b.id), { budget_usd = b.budget_usd })
  end
  fail(conn, 400, "action: one of cancel, ttl, budget, ask")
end

--- Answers one request of the page.
---@param conn table
---@param req table
function Page:route(conn, req)
  local path = req.target:match("^[^?#]*")
  local q = query(req.target)
  if req.method == "GET" and path == "/login" then
    if not self:where_from(conn, req, true) then return end
    if self.used or type(q.t) ~= "string" or not httpd.token_equal(q.t, self.launch) then
      return send(conn, 403, "This one-time link is not valid (it was used already, or is wrong). Run `demesne ui` "
        .. "again for a new one.\n")
    end
    self.used = true
    return send(conn, 303, "", nil, { Location = "/",
      ["Set-Cookie"] = ("%s=%s; HttpOnly; SameSite=Strict; Path=/"):format(COOKIE, self.session) })
  end
  local asset = req.method == "GET" and ASSETS[path]
  if not self:where_from(conn, req, path == "/") then return end
  if not self:signed_in(req) then
    return send(conn, 401, "Not signed in: open the one-time link that `demesne ui` printed.\n")
  end
  if asset then
    local d = fs.opendir(self.ui_dir)
    local body = d and d:read(asset[1], 8 * 1024 * 1024)
    if d then d:close() end
    if not body then return fail(conn, 404, "the page's file " .. asset[1] .. " is missing") end
    return send(conn, 200, body, asset[2])
  end
  if req.method == "GET" and path == "/api/session" then return send_json(conn, 200, { csrf = self.csrf }) end
  if req.method == "GET" and path == "/api/state" then return send_json(conn, 200, self:state()) end
  if req.method == "GET" and path == "/api/events" then
    if not conn:start(200, headers({ ["Content-Type"] = "text/event-stream" })) then return end
    self.streams[conn] = true
    conn:write("event: state\ndata: " .. json.encode(self:state()) .. "\n\n")
    return
  end
  if req.method == "GET" and path == "/api/node" then
    if not self:valid_id(q.id) then return fail(conn, 400, "id: a run id") end
    return self:proxy_json(conn, self:server_of(q), "GET", "/v1/nodes/" .. q.id)
  end
  if req.method == "GET" and path == "/api/stream" then return self:tail(conn, q) end
  if req.method == "GET" and path == "/api/file" then return self:file(conn, q) end
  if req.method == "POST" and path == "/api/action" then return self:action(conn, req) end
  fail(conn, 404, "not found")
end

--- Starts the page's server. o.open (optional) is called with the login URL.
--- Returns {url, port, stop = fn()}, or nil and why.
---@param o {ui_dir: string, port: integer|nil}
---@return table|nil handle, string|nil err
function web.start(o)
  local self = setmetatable({ servers = {}, streams = {}, tails = {}, launch = util.random_hex(32),
    session = util.random_hex(32), csrf = util.random_hex(32), used = false, stopping = false, ui_dir = o.ui_dir }, Page)
  self.http = httpd.new({ max_body = 64 * 1024, max_conns = 64, max_output = 64 * 1024 * 1024 }, function(conn, req)
    async.spawn("cockpit page", function()
      local ok, err = pcall(self.route, self, conn, req)
      if not ok then
        log.error(LOGGER, "%s %s: %s", req.method, req.target, tostring(err))
        if conn:is_open() then pcall(fail, conn, 500, "internal error") end
      end
    end)
  end, function(conn)
    self.streams[conn] = nil
    self.tails[conn] = nil
  end)
  local bound, err = self.http:listen_tcp("127.0.0.1", o.port or 0, { tag = "ui", hosts = { "localhost" } })
  if not bound then
    self.http:close()
    return nil, ("cannot listen on 127.0.0.1:%d: %s"):format(o.port or 0, tostring(err))
  end
  self.port = bound
  self.origin = ("http://localhost:%d"):format(bound)
  self:scan_servers()
  self.scan = timer.new()
  self.scan:start(SCAN_MS, SCAN_MS, function() async.spawn("cockpit scan", self.scan_servers, self) end)
  self.keepalive = timer.new()
  self.keepalive:start(KEEPALIVE_MS, KEEPALIVE_MS, function()
    for c in pairs(self.streams) do if c:is_open() then c:write(": keepalive\n\n") end end
  end)
  local handle = { port = self.port, url = ("%s/login?t=%s"):format(self.origin, self.launch) }
  --- Stops the page's server and its streams.
  function handle.stop()
    self.stopping = true
    self.scan:close()
    self.keepalive:close()
    for _, s in pairs(self.servers) do if s.req then s.req:cancel() end end
    self.http:close()
  end
  return handle
end

return web
