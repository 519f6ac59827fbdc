-- core.ws against real WebSocket servers on 127.0.0.1: the npm package `ws` (installed by
-- tests/integration's package.json) and a raw node `net` server that breaks RFC 6455, both
-- run by tests/fixtures/ws/server.mjs. Every server and connection a test opens is closed
-- by the test.
local ws = require("core.ws")
local json = require("core.json")
local async = require("demesne.async")

local fixture = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]+$") or ".") .. "/ws_servers.lua")
local servers = fixture.start

--- Connects; returns the connection (a <close> value that closes it) and next(), which waits
--- for the next event (kind, ...) for at most 10 s.
local function client(opts)
  local queue, waiting = {}, nil
  local conn, err, code = ws.connect(opts, function(...)
    queue[#queue + 1] = table.pack(...)
    if waiting then waiting.set() end
  end)
  assert(conn, ("connect: %s (%s)"):format(tostring(err), tostring(code)))
  local function next_event()
    local r = async.timeout(10000, function()
      while #queue == 0 do
        waiting = async.event()
        waiting.wait()
        waiting = nil
      end
      return table.remove(queue, 1)
    end)
    assert(r, "no event within 10 s")
    return table.unpack(r, 1, r.n)
  end
  return conn, next_event
end

local tests = {}

function tests.handshake_chooses_a_protocol_and_sends_headers(t)
  local s <close> = servers()
  local conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/headers"):format(s.ws),
    protocols = { "chat.v3", "chat.v2", "chat.v1" }, headers = { { "X-Test", "yes" }, { "Authorization", "Bearer abc" } } })
  local kind, protocol = next_event()
  t:eq({ kind, protocol }, { "open", "chat.v2" }, "the server's choice among the offers")
  local k, data, typ = next_event()
  t:eq({ k, typ }, { "message", "text" })
  local h = json.decode(data)
  t:eq(h["x-test"], "yes", "extra header")
  t:eq(h.authorization, "Bearer abc")
  t:eq(h["sec-websocket-version"], "13")
  t:eq(h.host, ("127.0.0.1:%d"):format(s.ws), "Host with the port")
  t:eq(h["sec-websocket-protocol"], "chat.v3, chat.v2, chat.v1")
  conn:close()
  t:eq({ next_event() }, { "close", 1000, "" }, "the server echoes our close code")
  t:eq(conn:is_open(), false)
end

function tests.messages_of_every_length_form_round_trip(t)
  local s <close> = servers()
  local conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/echo"):format(s.ws), protocols = { "chat.v1" } })
  t:eq(next_event(), "open")
  for _, n in ipairs({ 0, 1, 125, 126, 127, 65535, 65536, 65537, 1 << 20 }) do
    for _, typ in ipairs({ "binary", "text" }) do
      local payload = typ == "binary" and string.rep("\0\255\1", n // 3 + 1):sub(1, n) or ("é"):rep(n // 2) .. ("a"):rep(n % 2)
      t:eq(conn:send(payload, typ), true)
      local k, data, got_typ = next_event()
      t:eq({ k, got_typ, #data }, { "message", typ, #payload }, ("%s of %d bytes"):format(typ, #payload))
      t:ok(data == payload, ("%s of %d bytes comes back unchanged"):format(typ, #payload))
    end
  end
  t:eq(conn:queued(), 0, "everything was written")
  -- a message the server sends in three fragments is reassembled
  conn:send("fragments:300000", "text")
  local k, data, typ = next_event()
  t:eq({ k, typ, #data }, { "message", "binary", 300000 }, "fragments reassembled")
  conn:close(4000, "done")
  t:eq({ next_event() }, { "close", 4000, "done" }, "the server echoes code and reason")
  t:eq({ conn:send("late") }, { nil, "ws: closed", "ECLOSED" }, "send after the close")
end

function tests.a_message_above_max_message_ends_with_1009(t)
  local s <close> = servers()
  local conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/echo"):format(s.ws),
    protocols = { "chat.v1" }, max_message = 1000 })
  t:eq(next_event(), "open")
  local _, _, code = conn:send(("x"):rep(1001))
  t:eq(code, "E2BIG", "sending above max_message")
  conn:send("fragments:3000", "text")
  local kind, msg, ecode = next_event()
  t:eq({ kind, ecode }, { "error", "E2BIG" }, msg)
end

function tests.server_ping_is_answered_with_a_pong(t)
  local s <close> = servers()
  local _conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/ping"):format(s.ws), protocols = { "chat.v1" } })
  t:eq(next_event(), "open")
  t:eq({ next_event() }, { "message", "pong:are you there?", "text" }, "the pong carried the ping's payload")
end

function tests.server_initiated_close_gives_code_and_reason(t)
  local s <close> = servers()
  local conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/close"):format(s.ws), protocols = { "chat.v1" } })
  t:eq(next_event(), "open")
  t:eq({ next_event() }, { "close", 4001, "bye now" })
  t:eq(conn:is_open(), false)
  conn:close() -- no effect once closed
end

function tests.refused_handshake_names_the_status(t)
  local s <close> = servers()
  local _conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/forbidden"):format(s.ws), protocols = { "chat.v1" } })
  local kind, msg, code, status = next_event()
  t:eq({ kind, code, status }, { "error", "EHANDSHAKE", 403 })
  t:ok(msg:find("HTTP 403", 1, true), msg)
end

function tests.protocol_errors_from_a_broken_server(t)
  local s <close> = servers()
  local cases = {
    { "masked", "EPROTO", "masked frame" },
    { "badop", "EPROTO", "unknown data opcode" },
    { "noaccept", "EHANDSHAKE", "wrong Sec-WebSocket-Accept" },
  }
  for _, c in ipairs(cases) do
    local route, want_code, want_msg = c[1], c[2], c[3]
    local _conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/%s"):format(s.raw, route) })
    local ev = table.pack(next_event())
    if ev[1] == "open" then ev = table.pack(next_event()) end
    t:eq({ ev[1], ev[3] }, { "error", want_code }, route)
    t:ok(tostring(ev[2]):find(want_msg, 1, true), ("%s: %s"):format(route, tostring(ev[2])))
  end
end

function tests.a_server_that_hangs_up_mid_frame_ends_with_1006(t)
  local s <close> = servers()
  local _conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/midframe"):format(s.raw) })
  t:eq(next_event(), "open")
  local kind, code = next_event()
  t:eq({ kind, code }, { "close", 1006 }, "no close frame: 1006 (RFC 6455 7.1.5)")
end

function tests.close_waits_a_bounded_time_for_a_deaf_server(t)
  local s <close> = servers()
  local conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/deaf"):format(s.raw), close_timeout_ms = 300 })
  t:eq(next_event(), "open")
  conn:close(1001, "going away")
  t:eq({ next_event() }, { "close", 1006, "no close frame from the server in time" })
end

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

function tests.wss_with_a_ca_and_a_client_certificate_given_as_pem(t)
  local certs <close> = fixture.certificates()
  local s <close> = servers(certs.path)
  local pem = function(n) return slurp(certs.path .. "/" .. n) end
  local url = ("wss://127.0.0.1:%d/whoami"):format(s.wss)
  local conn <close>, next_event = client({ url = url, protocols = { "chat.v1" }, ca_pem = pem("ca.crt"),
    cert_pem = pem("client.crt"), key_pem = pem("client.key") })
  t:eq({ next_event() }, { "open", "chat.v1" })
  t:eq({ next_event() }, { "message", "ws-client", "text" }, "the server saw our client certificate")
  conn:close()
  t:eq(next_event(), "close")
  -- the echo route over TLS: a big message in both directions
  local echo <close>, next_echo = client({ url = ("wss://127.0.0.1:%d/echo"):format(s.wss), protocols = { "chat.v1" },
    ca_pem = pem("ca.crt"), cert_pem = pem("client.crt"), key_pem = pem("client.key") })
  t:eq(next_echo(), "open")
  local big = ("0123456789abcdef"):rep(65536)
  echo:send(big)
  local kind, data = next_echo()
  t:eq({ kind, #data }, { "message", #big })
  t:ok(data == big, "1 MiB comes back over TLS")
  -- without our CA the server is not trusted
  local _untrusted <close>, next_untrusted = client({ url = url, protocols = { "chat.v1" } })
  local k, msg, code = next_untrusted()
  t:eq({ k, code }, { "error", "ETLS" }, msg)
end

function tests.nothing_listening_is_refused(t)
  -- a port that was just free: the fixture's raw port after a listener on it... use port 1
  local _conn <close>, next_event = client({ url = "ws://127.0.0.1:1/", timeout_ms = 5000 })
  local kind, msg, code = next_event()
  t:eq({ kind, code }, { "error", "ECONNREFUSED" }, msg)
end

function tests.a_silent_server_times_out(t)
  local s <close> = servers()
  local _conn <close>, next_event = client({ url = ("ws://127.0.0.1:%d/silent"):format(s.raw), timeout_ms = 300 })
  local kind, msg, code = next_event()
  t:eq({ kind, code }, { "error", "ETIMEDOUT" }, msg)
end

function tests.close_before_open_and_from_inside_a_callback(t)
  local s <close> = servers()
  local a <close>, next_a = client({ url = ("ws://127.0.0.1:%d/echo"):format(s.ws), protocols = { "chat.v1" } })
  a:close()
  t:eq({ next_a() }, { "close", 1006, "closed before the handshake" })
  -- close from inside the message callback, then drop every reference while it closes
  local done = async.event()
  local b
  b = assert(ws.connect({ url = ("ws://127.0.0.1:%d/echo"):format(s.ws), protocols = { "chat.v1" } }, function(kind, x)
    if kind == "open" then b:send("hello", "text")
    elseif kind == "message" then b:close(1000, "seen " .. x)
    else done.set(kind, x) end
  end))
  t:eq({ async.timeout(10000, done.wait) }, { "close", 1000 })
  b = nil
  -- an open connection that is collected closes its socket without a callback
  local c = assert(ws.connect({ url = ("ws://127.0.0.1:%d/echo"):format(s.ws), protocols = { "chat.v1" } }, function() end))
  async.sleep(100)
  t:eq(c:is_open(), true)
  c = nil -- luacheck: ignore 311 (dropping the last reference is the point)
  collectgarbage()
  collectgarbage()
end

function tests.bad_arguments_raise_and_bad_urls_fail(t)
  t:eq(pcall(ws.connect, {}, function() end), false, "url is required")
  t:eq(pcall(ws.connect, { url = "ws://x/", headers = { "X: y" } }, function() end), false, "headers are pairs")
  local c, msg, code = ws.connect({ url = "ftp://127.0.0.1/" }, function() end)
  t:eq({ c, code }, { nil, "EINVAL" }, msg)
  c, msg, code = ws.connect({ url = "ws://127.0.0.1/", headers = { { "X", "a\r\nb" } } }, function() end)
  t:eq({ c, code }, { nil, "EINVAL" }, msg)
end

return tests
