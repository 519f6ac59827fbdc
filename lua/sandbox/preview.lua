-- Port previews (sandbox_create's `ports`, sandbox_expose): a listener on the host's
-- loopback per previewed port, http://127.A.B.C:<host port>/, each on a loopback address of
-- its own (preview.address: each its own origin and its own cookie jar). A
-- request is let through when its head (parsed by core.httphead, llhttp) names that address
-- and port as its Host, comes from no other origin, and carries the preview's secret:
-- ?demesne_preview=<token> (answered with a cookie for that port and a redirect to the
-- clean URL) or that cookie; each request of a kept-alive connection is judged. Its bytes
-- are carried both ways, as they are (HTTP, keep-alive, WebSocket upgrades), to `demesne-init connect 127.0.0.1:<port>`
-- run in the sandbox through the engine's exec API (Engine:exec_stream): one exec per
-- connection, so the sandbox needs no network interface, and it works at egress none and
-- under gVisor, where the host cannot connect to a socket made in the sandbox.
--
-- The listeners live in this server process: sandbox destroy, expiry, the reaper and
-- stop_unresponsive close them (preview.close); a server that exits takes them along.
-- Reference: docs/reference/tools/sandbox_expose.md, docs/explanation/trust-boundary.md.
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local httphead = require("core.httphead")
local httpd = require("core.httpd")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local stream = require("core.stream")
local timer = require("core.timer")

local preview = {}

local LOGGER = "demesne.preview"
local HEAD_MAX = 16384 -- bytes of a request head
local HEAD_MS = 10000 -- the first request head must arrive within this
local HIGH, LOW = 1024 * 1024, 256 * 1024 -- back-pressure marks (bytes queued)
local PARAM = "demesne_preview"
local INIT = "/.demesne/init"

local by_sandbox = {} -- sandbox_id -> {[port] = entry}; entry = {port, host_port, url, token, listener, conns}

local fail = errors.raise

local function spec_num(x) return math.tointeger(x) and ("%d"):format(x) or tostring(x) end

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

--- An answer of the proxy itself (refusals, the cookie's redirect), then the connection ends.
local function answer(c, status, reason, body, extra)
  local head = ("HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
    .. "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n"):format(status, reason, #body, extra or "")
  -- (a connection the proxy closed meanwhile raises: nothing to answer then)
  if not pcall(c.write, c, head .. body, function() c:close() end) then c:close() end
end

local function header(head, name)
  for _, h in ipairs(head.headers) do
    if h[1] == name then return h[2] end
  end
end

-- "name=value; name2=value2" -> the value of `name`
local function cookie(head, name)
  for _, h in ipairs(head.headers) do
    if h[1] == "cookie" then
      for k, v in h[2]:gmatch("([^=;%s]+)=([^;]*)") do
        if k == name then return (v:gsub("%s+$", "")) end
      end
    end
  end
end

-- The target without the demesne_preview parameter, and that parameter's value.
local function split_token(target)
  local path, q = target:match("^([^?]*)%?(.*)$")
  if not path then return target, nil end
  local keep, token = {}, nil
  for part in q:gmatch("[^&]+") do
    local k, v = part:match("^([^=]*)=?(.*)$")
    if k == PARAM then token = v else keep[#keep + 1] = part end
  end
  if #keep > 0 then path = path .. "?" .. table.concat(keep, "&") end
  return path, token
end

--- A loopback address for a new preview: 127.A.B.C with A in 2-254 and B, C in 1-254,
--- at random and none a listening preview has (127.0.0.0/16, where 127.0.0.1, a resolver's
--- 127.0.0.53 and Debian's 127.0.1.1 live, is left alone). Linux routes all of 127.0.0.0/8
--- to lo, and browsers treat it as loopback.
---@return string
function preview.address()
  local used = {}
  for _, mine in pairs(by_sandbox) do
    for _, e in pairs(mine) do used[e.addr or ""] = true end
  end
  while true do
    local r = loop.random(3)
    local a = ("127.%d.%d.%d"):format(2 + r:byte(1) % 253, 1 + r:byte(2) % 254, 1 + r:byte(3) % 254)
    if not used[a] then return a end
  end
end

--- Why a request head is refused, or nil when it may pass; `redirect` when it carried
--- the right token in its URL (the answer sets the cookie).
---@param e table  the preview's entry
---@param head table  core.httphead.parse's result
---@return integer|nil status, string|nil why, string|nil redirect
function preview.judge(e, head)
  local want = ("%s:%s"):format(e.addr or "127.0.0.1", tostring(e.host_port))
  local host = (header(head, "host") or ""):lower()
  if host ~= want then
    return 421, ("this preview answers only to Host %s, not %q"):format(want, host)
  end
  local origin = header(head, "origin")
  if origin and origin:lower() ~= "http://" .. host then
    return 403, ("requests from another origin (%s) are refused"):format(origin)
  end
  local site, mode = header(head, "sec-fetch-site"), header(head, "sec-fetch-mode")
  if (site == "cross-site" or site == "same-site") and mode ~= "navigate" then
    return 403, "requests made by another site's page are refused"
  end
  local clean, token = split_token(head.target)
  if token then
    if not httpd.token_equal(token, e.token) then return 403, "this preview's secret is not that" end
    return nil, nil, clean
  end
  local c = cookie(head, e.cookie)
  if c and httpd.token_equal(c, e.token) then return nil end
  return 403, "this preview needs its secret: open the URL that sandbox_create or sandbox_expose gave"
end

-- The proxy's own answer to a head that preview.judge refused or sent to the cookie's
-- redirect, as answer()'s arguments after the connection ({status, reason, body, extra});
-- nil when the head may pass.
local function refusal(e, head)
  local status, why, redirect = preview.judge(e, head)
  if status then
    log.info(LOGGER, "preview %s:%d refused a request (%d): %s", e.sandbox_id, e.port, status, why)
    return { status, status == 421 and "Misdirected Request" or "Forbidden", why .. "\n" }
  end
  if redirect then
    return { 303, "See Other", "", ("Location: %s\r\nSet-Cookie: %s=%s; HttpOnly; SameSite=Strict; Path=/\r\n")
      :format(redirect, e.cookie, e.token) }
  end
end

-- Carries an accepted connection whose first head passed: `first` (the bytes read so far)
-- and the rest, with back-pressure both ways (a side whose peer has more than HIGH bytes
-- queued stops being read until the queue is below LOW). Every later request of a
-- kept-alive connection is judged too before its bytes go on (core.httphead.stream finds
-- where each request ends): a browser that reuses a connection for the secret's URL gets
-- the redirect, so the secret never reaches the sandbox in a URL. After an upgrade
-- (WebSocket) the bytes are carried as they are.
local function relay(e, c, first)
  local ex, out_started, ex_paused, c_paused, over
  local function on_out(data, stderr)
    if over then return end
    if data then
      out_started = true
      c:write(data, function(ok)
        if not ok then
          if ex then ex:close() end
          return
        end
        if ex_paused and c:write_queue_size() < LOW then
          ex_paused = false
          ex:resume()
        end
      end)
      if ex and not ex_paused and c:write_queue_size() > HIGH then
        ex_paused = true
        ex:pause()
      end
      return
    end
    -- the sandbox's side ended
    e.conns[c] = nil
    if not out_started then
      local why = (stderr or ""):gsub("^demesne%-init: ", ""):gsub("%s+$", "")
      if why == "" then why = "the connection to the sandbox ended" end
      return answer(c, 502, "Bad Gateway", ("port %d in the sandbox: %s\n"):format(e.port, why))
    end
    if not pcall(c.shutdown, c, function() c:close() end) then c:close() end
  end
  local h, err = e.open_exec(on_out)
  if not h then
    e.conns[c] = nil
    return answer(c, 502, "Bad Gateway", ("the sandbox cannot be reached: %s\n"):format(tostring(err)))
  end
  ex = h
  if e.closed then return ex:close() end
  e.conns[c] = ex
  -- the connection's end, with an answer of the proxy's own instead of the sandbox's
  local function cut(status, reason, body, extra)
    over = true
    c:read_stop()
    e.conns[c] = nil
    ex:close()
    answer(c, status, reason, body, extra)
  end
  local reader
  local function carry(bytes)
    ex:write(bytes, function()
      if c_paused and ex:queued() < LOW then
        c_paused = false
        c:read_start(reader)
      end
    end)
    if not c_paused and ex:queued() > HIGH then
      c_paused = true
      c:read_stop()
    end
  end
  local requests, buf, at = httphead.stream(), first, "body" -- at: "head", "body" or "raw"
  local function pump()
    while #buf > 0 and not over do
      if at == "raw" then
        carry(buf)
        buf = ""
        return
      end
      if at == "head" then
        local head, _, code = httphead.parse(buf)
        if not head then
          if code == "EAGAIN" and #buf <= HEAD_MAX then return end
          if code == "EAGAIN" then return cut(431, "Request Header Fields Too Large", "the request head is too large\n") end
          return cut(400, "Bad Request", "not an HTTP/1 request\n")
        end
        local r = refusal(e, head)
        if r then return cut(table.unpack(r)) end
        at = "body"
      end
      local n, state = requests:execute(buf)
      if not n then return cut(400, "Bad Request", "not an HTTP/1 request\n") end
      carry(buf:sub(1, n))
      buf = buf:sub(n + 1)
      if state == "ended" then at = "head" elseif state == "upgraded" then at = "raw" end
    end
  end
  reader = function(data)
    if not data then return ex:shutdown() end
    buf = buf .. data
    pump()
  end
  pump()
  if not over then c:read_start(reader) end
end

-- Reads the first request head of an accepted connection and judges it.
local function accept(e, c)
  if e.closed then return c:close() end
  local n = 0
  for _ in pairs(e.conns) do n = n + 1 end
  if n >= config.get("preview_connections_max") then
    return answer(c, 503, "Service Unavailable", ("this preview has %d connections open already (preview_connections_max)\n")
      :format(n))
  end
  e.conns[c] = true
  local buf = ""
  -- a connection that sends no whole head in time goes: it holds one of the preview's slots
  local slow = timer.after(HEAD_MS, function()
    if e.conns[c] == true then
      e.conns[c] = nil
      c:close()
    end
  end)
  c:read_start(function(data)
    if not data then
      slow:close()
      e.conns[c] = nil
      return c:close()
    end
    buf = buf .. data
    local head, _, code = httphead.parse(buf)
    if not head then
      if code == "EAGAIN" and #buf <= HEAD_MAX then return end
      c:read_stop()
      slow:close()
      e.conns[c] = nil
      if code == "EAGAIN" then return answer(c, 431, "Request Header Fields Too Large", "the request head is too large\n") end
      return answer(c, 400, "Bad Request", "not an HTTP/1 request\n")
    end
    c:read_stop()
    slow:close()
    local r = refusal(e, head)
    if r then
      e.conns[c] = nil
      return answer(c, table.unpack(r))
    end
    async.spawn("preview " .. e.sandbox_id .. ":" .. e.port, relay, e, c, buf)
  end)
end

-- The port as an integer (JSON numbers arrive as floats), or a failure naming `field`.
local function check_port(port, field)
  local p = type(port) == "number" and math.tointeger(port)
  if not p or p < 1 or p > 65535 then
    fail(("%s: %s is not a port (1-65535)"):format(field, type(port) == "number" and spec_num(port) or tostring(port)))
  end
  return p
end

--- Checks sandbox_create's `ports` before anything is made: each 1–65535, none twice, at
--- most previews_max of them. Raises naming the element.
---@param ports any
function preview.check_ports(ports)
  if ports == nil then return end
  local seen = {}
  for i, p in ipairs(ports) do
    local field = ("ports[%d]"):format(i)
    p = check_port(p, field)
    if seen[p] then fail(("%s: port %d is listed twice"):format(field, p)) end
    seen[p] = true
  end
  local max = config.get("previews_max")
  if #ports > max then
    fail(("ports: %d ports asked for, above the %d previews per sandbox that previews_max allows"):format(#ports, max))
  end
end

--- Opens a preview of `port` of a running sandbox. Fails (naming `field`) on a port out
--- of 1–65535, one already exposed, or past previews_max; nothing stays behind a failure.
---@param eng table        the engine adapter (needs exec_stream)
---@param sandbox_id string
---@param container string  the container's id
---@param port any          the sandbox's port
---@param field string      the parameter's name for messages ("port", "ports[2]")
---@return {port: integer, url: string}
function preview.open(eng, sandbox_id, container, port, field)
  port = check_port(port, field)
  if not eng.exec_stream then
    fail(("%s: the engine adapter %s cannot carry a preview (it has no exec_stream)"):format(field, tostring(eng.name)))
  end
  local mine = by_sandbox[sandbox_id] or {}
  if mine[port] then
    fail(("%s: port %d of sandbox %s is exposed already, at %s"):format(field, port, sandbox_id, mine[port].url))
  end
  local n = 0
  for _ in pairs(mine) do n = n + 1 end
  local max = config.get("previews_max")
  if n >= max then
    fail(("%s: sandbox %s has %d previews, the most previews_max allows"):format(field, sandbox_id, n))
  end
  local e = { sandbox_id = sandbox_id, port = port, token = hex(loop.random(24)), conns = {} }
  e.open_exec = function(on_out)
    return eng:exec_stream(container, { INIT, "connect", "127.0.0.1:" .. port }, on_out)
  end
  -- an address of its own in 127.0.0.0/8: a browser keeps cookies by host, not by port, so
  -- on a shared 127.0.0.1 every preview's cookie (its secret) would go to every other
  -- preview's sandbox along with its requests
  local l, hp, addr
  for _ = 1, 8 do
    addr = preview.address()
    l, hp = stream.listen_tcp(addr, 0, function(c) accept(e, c) end)
    if l then break end
  end
  if not l then fail(("%s: cannot listen on the host's loopback: %s"):format(field, tostring(hp))) end
  e.listener, e.host_port, e.addr = l, hp, addr
  e.cookie = "demesne_preview_" .. hp
  e.url = ("http://%s:%d/?%s=%s"):format(addr, hp, PARAM, e.token)
  mine[port] = e
  by_sandbox[sandbox_id] = mine
  log.info(LOGGER, "sandbox %s: port %d previewed at http://%s:%d/", sandbox_id, port, addr, hp)
  return { port = port, url = e.url }
end

--- Opens the previews of `ports` (sandbox_create's parameter), all or none.
---@param eng table
---@param sandbox_id string
---@param container string
---@param ports integer[]|nil
---@return table previews  json array of {port, url}
function preview.open_all(eng, sandbox_id, container, ports)
  local out = json.array()
  local ok, err = pcall(function()
    for i, p in ipairs(ports or {}) do
      out[#out + 1] = preview.open(eng, sandbox_id, container, p, ("ports[%d]"):format(i))
    end
  end)
  if not ok then
    preview.close(sandbox_id)
    error(err, 0)
  end
  return out
end

--- The sandbox's previews, by port: a json array of {port, url}.
---@param sandbox_id string
---@return table
function preview.list(sandbox_id)
  local out = json.array()
  for _, e in pairs(by_sandbox[sandbox_id] or {}) do out[#out + 1] = { port = e.port, url = e.url } end
  table.sort(out, function(a, b) return a.port < b.port end)
  return out
end

--- Closes the sandbox's previews: listeners and the connections they carry. Idempotent.
---@param sandbox_id string|nil
function preview.close(sandbox_id)
  local mine = sandbox_id and by_sandbox[sandbox_id]
  if not mine then return end
  by_sandbox[sandbox_id] = nil
  for _, e in pairs(mine) do
    e.closed = true
    e.listener:close()
    for c, ex in pairs(e.conns) do
      if type(ex) == "table" then ex:close() end
      c:close()
    end
    e.conns = {}
    log.info(LOGGER, "sandbox %s: preview of port %d closed", sandbox_id, e.port)
  end
end

return preview
