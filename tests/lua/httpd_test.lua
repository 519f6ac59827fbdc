-- core.httpd against real loopback clients: libcurl (core.http) for ordinary exchanges and
-- raw core.stream sockets for what a normal client never sends (pipelining, cut-off bodies,
-- bad hosts, a client that never reads). Every server a test opens is closed by the test.
local httpd = require("core.httpd")
local http = require("core.http")
local stream = require("core.stream")
local fs = require("core.fs")
local loop = require("core.loop")
local async = require("demesne.async")

local request = async.wrap(http.request)
local HOSTS = { "localhost", "127.0.0.1", "[::1]" }

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- A server whose handler(conn, req) runs in its own task; closes (and waits) at scope end.
local function server(handler, opts, lopts)
  local s = { closes = {}, requests = 0 }
  s.srv = httpd.new(opts or {}, function(conn, req)
    s.requests = s.requests + 1
    async.spawn("handler", handler, conn, req, s)
  end, function(conn, why)
    s.closes[#s.closes + 1] = why or "ok"
    if s.on_close then s.on_close(conn, why) end
  end)
  lopts = lopts or {}
  s.port = assert(s.srv:listen_tcp("127.0.0.1", 0, { tag = lopts.tag or "test", token = lopts.token,
    hosts = lopts.hosts }))
  s.url = "http://127.0.0.1:" .. s.port
  return setmetatable(s, { __close = function(x)
    local done = async.event()
    x.srv:close(function() done.set() end)
    done.wait()
  end })
end

-- A raw client: sends `data`, collects everything until the server closes (or `ms`).
local function raw(port, data, ms)
  local got, ev = {}, async.event()
  local conn
  assert(stream.connect_tcp("127.0.0.1", port, function(c, msg)
    if not c then ev.set(msg) return end
    conn = c
    c:read_start(function(d) if d then got[#got + 1] = d else ev.set() end end)
    c:write(data)
  end))
  async.timeout(ms or 3000, ev.wait)
  if conn then conn:close() end
  return table.concat(got)
end

local tests = {}

function tests.answers_get_and_post_with_keep_alive(t)
  local s <close> = server(function(conn, req)
    assert(conn:respond(200, { ["X-Listener"] = req.listener, ["X-Method"] = req.method,
      ["X-Target"] = req.target, ["X-Echo"] = req.headers["x-echo"] or "" }, req.body))
  end)
  local res = assert(request({ url = s.url .. "/mcp?a=1", method = "POST", body = "hello",
    headers = { ["X-Echo"] = "e1" } }))
  t:eq({ res.status, res.body, res.headers["x-listener"], res.headers["x-method"], res.headers["x-target"],
    res.headers["x-echo"] }, { 200, "hello", "test", "POST", "/mcp?a=1", "e1" })
  t:eq(res.headers["connection"], "keep-alive")
  res = assert(request({ url = s.url .. "/x" }))
  t:eq({ res.status, res.body, res.headers["x-method"] }, { 200, "", "GET" })
  -- a body of 1 MiB arrives whole (curl sends Expect: 100-continue for it)
  local big = ("0123456789abcdef"):rep(65536)
  res = assert(request({ url = s.url .. "/big", method = "POST", body = big }))
  t:eq(#res.body, #big, "echoed size")
  t:ok(res.body == big, "echoed bytes")
end

function tests.pipelined_requests_are_answered_in_order(t)
  local s <close> = server(function(conn, req)
    if req.target == "/slow" then async.sleep(50) end
    assert(conn:respond(200, {}, req.target))
  end)
  local out = raw(s.port, "GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\nGET /two HTTP/1.1\r\nHost: localhost\r\n\r\n"
    .. "GET /three HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
  local bodies = {}
  for body in out:gmatch("\r\n\r\n(/%l+)") do bodies[#bodies + 1] = body end
  t:eq(bodies, { "/slow", "/two", "/three" }, "answers in request order: " .. out)
  t:match(out, "Connection: close\r\n\r\n/three$", "the last one closes")
end

function tests.streams_a_chunked_answer(t)
  local s <close> = server(function(conn)
    assert(conn:start(200, { ["Content-Type"] = "text/event-stream" }))
    for i = 1, 3 do
      async.sleep(10)
      assert(conn:write(("data: %d\n\n"):format(i)))
    end
    assert(conn:finish())
    t:eq(select(3, conn:finish()), "EALREADY", "finish twice")
  end)
  local chunks = {}
  local res = assert(request({ url = s.url .. "/sse", on_data = function(c) chunks[#chunks + 1] = c end }))
  t:eq(res.status, 200)
  t:eq(res.headers["transfer-encoding"], "chunked")
  t:eq(table.concat(chunks), "data: 1\n\ndata: 2\n\ndata: 3\n\n")
end

function tests.token_required_and_never_shown(t)
  local seen = {}
  local s <close> = server(function(conn, req)
    seen[#seen + 1] = req.headers
    assert(conn:respond(200, {}, "ok"))
  end, {}, { token = "s3cret-token", hosts = HOSTS })
  local res = assert(request({ url = s.url .. "/mcp" }))
  t:eq(res.status, 401, "no token")
  t:eq(res.headers["www-authenticate"], 'Bearer realm="demesne"')
  res = assert(request({ url = s.url .. "/mcp", headers = { Authorization = "Bearer wrong" } }))
  t:eq(res.status, 401, "wrong token")
  t:match(res.headers["www-authenticate"], 'error="invalid_token"')
  t:ok(not res.body:find("s3cret", 1, true), "the token is not in the answer")
  res = assert(request({ url = s.url .. "/mcp", headers = { Authorization = "Bearer s3cret-token-longer" } }))
  t:eq(res.status, 401, "a longer token")
  res = assert(request({ url = s.url .. "/mcp", headers = { Authorization = "bearer s3cret-token" } }))
  t:eq(res.status, 200, "scheme is case-insensitive")
  t:eq(#seen, 1, "only the authorised request reached the owner")
  t:eq(seen[1].authorization, nil, "Authorization removed")
  t:ok(httpd.token_equal("abc", "abc") and not httpd.token_equal("abd", "abc") and not httpd.token_equal("ab", "abc"),
    "token_equal")
end

function tests.host_and_origin_checked(t)
  local s <close> = server(function(conn) assert(conn:respond(200, {}, "ok")) end, {}, { hosts = HOSTS })
  local function get(headers) return assert(request({ url = s.url .. "/mcp", headers = headers })).status end
  t:eq(get({ Host = "evil.example.com" }), 421, "rebinding Host")
  t:eq(get({ Host = "evil.example.com:" .. s.port, Origin = "http://evil.example.com" }), 421)
  t:eq(get({ Origin = "http://evil.example.com" }), 403, "bad Origin")
  t:eq(get({ Origin = "null" }), 403, "null Origin")
  t:eq(get({ Origin = "http://localhost.evil.com:" .. s.port }), 403, "lookalike Origin")
  t:eq(get({ Host = "localhost:" .. s.port, Origin = "http://localhost:" .. s.port }), 200, "localhost")
  t:eq(get({ Host = "[::1]:" .. s.port, Origin = "https://127.0.0.1" }), 200, "v6 Host, https Origin")
  t:eq(get({}), 200, "no Origin (CLI clients)")
  local out = raw(s.port, "GET / HTTP/1.1\r\n\r\n")
  t:match(out, "^HTTP/1.1 400 ", "no Host")
end

function tests.body_limits_refused_before_reading(t)
  local s <close> = server(function(conn, req) assert(conn:respond(200, {}, tostring(#req.body))) end,
    { max_body = 1000 })
  local res = assert(request({ url = s.url .. "/", method = "POST", body = ("x"):rep(1000) }))
  t:eq({ res.status, res.body }, { 200, "1000" }, "at the limit")
  res = assert(request({ url = s.url .. "/", method = "POST", body = ("x"):rep(1001) }))
  t:eq(res.status, 413, "over the limit")
  -- Content-Length over the limit: refused from the head, the body never sent
  local out = raw(s.port, "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10485760\r\n\r\nxx")
  t:match(out, "^HTTP/1.1 413 ")
  -- chunked over the limit
  out = raw(s.port, "POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    .. "3e8\r\n" .. ("y"):rep(1000) .. "\r\n2\r\nzz\r\n0\r\n\r\n")
  t:match(out, "^HTTP/1.1 413 ")
  t:eq(s.requests, 1, "refused bodies never reached the owner")
end

-- on_head: a request judged from its head, before its body is read; max_buffered: the body
-- bytes being read on all connections are bounded.
function tests.on_head_refuses_before_the_body_and_max_buffered_bounds_bodies(t)
  local heads, requests, closes = {}, 0, 0
  local srv = httpd.new({ max_body = 64 << 20, max_buffered = 1000, max_buffered_why = "too much at once" },
    function(conn, req)
      requests = requests + 1
      assert(conn:respond(200, {}, req.body))
    end,
    function() closes = closes + 1 end,
    function(conn, head)
      heads[#heads + 1] = head
      if head.target == "/deny" then
        local ok, _, code = conn:start(200, {})
        t:eq({ ok, code }, { nil, "EALREADY" }, "no stream from on_head")
        assert(conn:respond(401, { ["content-type"] = "text/plain" }, "no\n"))
      elseif head.target == "/raise" then
        error("on_head failed")
      end
    end)
  local port = assert(srv:listen_tcp("127.0.0.1", 0, { tag = "head" }))
  local ok, err = pcall(function()
    -- only the head of a 50 MiB body is sent: the answer comes without it
    local out = raw(port, "POST /deny HTTP/1.1\r\nHost: localhost\r\nContent-Length: 52428800\r\n\r\n")
    t:match(out, "^HTTP/1.1 401 ")
    t:match(out, "Connection: close\r\n\r\nno\n$")
    t:eq({ heads[1].content_length, heads[1].chunked, heads[1].body, heads[1].method },
      { 52428800, false, nil, "POST" })
    out = raw(port, "POST /raise HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\n")
    t:match(out, "^HTTP/1.1 500 ", "an error in on_head")
    local res = assert(request({ url = "http://127.0.0.1:" .. port .. "/ok", method = "POST", body = "hello" }))
    t:eq({ res.status, res.body }, { 200, "hello" }, "a head let through")
    out = raw(port, "POST /c HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
      .. "5\r\nhello\r\n0\r\n\r\n", 500)
    t:match(out, "^HTTP/1.1 200 ")
    t:eq(heads[#heads].chunked, true)
    out = raw(port, "POST /big HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2000\r\n\r\n" .. ("x"):rep(2000))
    t:match(out, "^HTTP/1.1 503 ")
    t:match(out, "too much at once")
    t:eq(requests, 2, "refused requests never reached on_request")
    -- a pool shared with another server bounds the bytes both read
    local pool = httpd.pool(500, "the pool is full")
    local other = httpd.new({ pool = pool }, function(conn) conn:respond(200, {}, "") end, function() end)
    local oport = assert(other:listen_tcp("127.0.0.1", 0, { tag = "other" }))
    out = raw(oport, "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 800\r\n\r\n" .. ("x"):rep(800))
    local od = async.event()
    other:close(function() od.set() end)
    od.wait()
    t:match(out, "^HTTP/1.1 503 ")
    t:match(out, "the pool is full")
    t:eq(pool:used(), 0, "nothing counted once the connection is gone")
    pool:set_max(0)
    t:eq(#heads, 5)
  end)
  local done = async.event()
  srv:close(function() done.set() end)
  done.wait()
  if not ok then error(err, 0) end
  t:ok(closes >= 4, "on_close for connections that had only a head: " .. closes)
end

function tests.cut_off_and_malformed_requests(t)
  local s <close> = server(function(conn) assert(conn:respond(200, {}, "ok")) end, { request_timeout_ms = 200 })
  -- half a body, then the client shuts its side: 400
  local got, ev = {}, async.event()
  assert(stream.connect_tcp("127.0.0.1", s.port, function(c)
    c:read_start(function(d) if d then got[#got + 1] = d else ev.set() c:close() end end)
    c:write("POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\nhalf")
    c:shutdown()
  end))
  async.timeout(3000, ev.wait)
  t:match(table.concat(got), "^HTTP/1.1 400 ", "cut off")
  -- half a body and silence: 408 after the request timeout
  t:match(raw(s.port, "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\nhalf"), "^HTTP/1.1 408 ")
  t:match(raw(s.port, "GARBAGE\r\n\r\n"), "^HTTP/1.1 400 ", "malformed")
  t:match(raw(s.port, "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
    "^HTTP/1.1 501 ", "upgrade")
  t:match(raw(s.port, "GET /" .. ("a"):rep(9000) .. " HTTP/1.1\r\nHost: localhost\r\n\r\n"), "^HTTP/1.1 414 ")
  t:match(raw(s.port, "GET / HTTP/1.1\r\nHost: localhost\r\nX: " .. ("b"):rep(70000) .. "\r\n\r\n"), "^HTTP/1.1 431 ")
  t:eq(s.requests, 0)
  -- the server still serves
  t:eq(assert(request({ url = s.url .. "/" })).status, 200)
end

function tests.slow_reader_is_cut_and_memory_bounded(t)
  local result = async.event()
  local s <close> = server(function(conn)
    assert(conn:start(200, { ["Content-Type"] = "text/event-stream" }))
    local chunk = ("z"):rep(64 * 1024)
    local written = 0
    for _ = 1, 10000 do
      local ok, _, code = conn:write(chunk)
      if not ok then result.set(written, code) return end
      written = written + #chunk
      if conn:queued() > 256 * 1024 then
        -- the drain callback comes only if the client reads; it never does
        local ev = async.event()
        if conn:drain(function(v) ev.set(v) end) then
          -- a drain that does not come within 100 ms is not waited for: writing goes on past
          -- the point a polite writer would stop, and C must cut it
          async.timeout(100, ev.wait)
        end
      end
    end
    result.set(written, "none")
  end, { max_output = 1024 * 1024 })
  local cut = async.event()
  s.on_close = function(_, why) cut.set(why) end
  -- a client that sends a request and never reads
  local client
  assert(stream.connect_tcp("127.0.0.1", s.port, function(c)
    client = c
    c:write("GET /sse HTTP/1.1\r\nHost: localhost\r\n\r\n")
  end))
  local written, code = async.timeout(20000, result.wait)
  t:eq(code, "ENOBUFS", "the write past the bound fails")
  t:ok(written < 64 * 1024 * 1024, "bounded: " .. tostring(written))
  t:eq(async.timeout(5000, cut.wait), "slow reader")
  if client then client:close() end
end

function tests.client_gone_mid_stream_is_reported(t)
  local cut = async.event()
  local s <close> = server(function(conn)
    assert(conn:start(200, {}))
    assert(conn:write("first"))
  end)
  s.on_close = function(conn, why) cut.set(why, conn:is_open()) end
  local res = request({ url = s.url .. "/", on_data = function() return false end, timeout_ms = 1000 })
  local why, open = async.timeout(3000, cut.wait)
  t:eq({ why, open }, { "client closed", false }, tostring(res))
end

function tests.unix_listener_is_private_and_removed(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-httpd-" .. hex(loop.random(4))
  assert(fs.mkdir_p(dir))
  local path = dir .. "/mcp.sock"
  local srv = httpd.new({}, function(conn, req) conn:respond(200, {}, req.listener) end, function() end)
  t:ok(srv:listen_unix(path, { tag = "sandbox-1", hosts = HOSTS }))
  local port = assert(srv:listen_tcp("127.0.0.1", 0, { tag = "host" }))
  t:eq(fs.stat(path).mode & 511, 384, "mode 0600")
  local res = assert(request({ url = "http://localhost/mcp", unix_socket = path }))
  t:eq({ res.status, res.body }, { 200, "sandbox-1" }, "tagged with its listener")
  res = assert(request({ url = "http://127.0.0.1:" .. port .. "/" }))
  t:eq(res.body, "host")
  -- a regular file is never replaced
  local f = dir .. "/file"
  assert(fs.write_atomic(f, "keep"))
  local ok, _, code = srv:listen_unix(f, { tag = "x" })
  t:eq({ ok, code }, { nil, "EEXIST" })
  local done = async.event()
  srv:close(function() done.set() end)
  done.wait()
  t:eq(fs.lstat(path), nil, "socket removed")
  fs.remove_tree(dir)
end

function tests.unlisten_stops_one_listener_only(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-httpd-" .. hex(loop.random(4))
  assert(fs.mkdir_p(dir))
  local path = dir .. "/mcp.sock"
  local why_closed = async.event()
  local srv = httpd.new({}, function(conn, req)
    if req.target == "/hold" then
      assert(conn:start(200, {}))
      assert(conn:write("held"))
      return
    end
    conn:respond(200, {}, req.listener)
  end, function(_, why) if why == "listener closed" then why_closed.set(why) end end)
  t:ok(srv:listen_unix(path, { tag = "sandbox-1", hosts = HOSTS, max_conns = 1 }))
  local port = assert(srv:listen_tcp("127.0.0.1", 0, { tag = "host" }))
  local held = async.spawn("held", function()
    return request({ url = "http://localhost/hold", unix_socket = path, timeout_ms = 5000 })
  end)
  async.sleep(100)
  -- the listener's own cap: a second connection on it is refused, the other listener is not
  local res = assert(request({ url = "http://localhost/x", unix_socket = path }))
  t:eq(res.status, 503, "over the listener's max_conns")
  res = assert(request({ url = "http://127.0.0.1:" .. port .. "/" }))
  t:eq(res.body, "host")
  t:eq(srv:unlisten("sandbox-1"), 1, "one listener stopped")
  t:eq(async.timeout(3000, why_closed.wait), "listener closed", "its held stream was cut")
  held:wait()
  t:eq(fs.lstat(path), nil, "socket removed")
  t:eq(srv:unlisten("sandbox-1"), 0, "none left with that tag")
  res = assert(request({ url = "http://127.0.0.1:" .. port .. "/" }))
  t:eq(res.body, "host", "the other listener goes on")
  local done = async.event()
  srv:close(function() done.set() end)
  done.wait()
  t:eq(srv:unlisten("host"), 0, "closed: nothing to stop")
  fs.remove_tree(dir)
end

function tests.many_connections_at_once(t)
  local s <close> = server(function(conn, req)
    async.sleep(20)
    assert(conn:respond(200, {}, req.target))
  end)
  local tasks = {}
  for i = 1, 200 do
    tasks[i] = async.spawn("c" .. i, function()
      local r = assert(request({ url = s.url .. "/" .. i }))
      return r.body
    end)
  end
  local bad = 0
  for i, task in ipairs(tasks) do
    local ok, body = task:wait()
    if not ok or body ~= "/" .. i then bad = bad + 1 end
  end
  t:eq(bad, 0, "every request answered with its own body")
end

function tests.options_that_are_not_counts_are_refused_by_name(t)
  local ok, err = pcall(httpd.new, { max_body = -1 }, function() end, function() end)
  t:eq(ok, false, "a negative size is refused")
  t:match(tostring(err), "max_body must be a non%-negative integer", "naming the option")
  local proxy = require("core.proxy")
  local d = os.tmpname()
  os.remove(d)
  ok, err = pcall(proxy.listen, d .. ".sock", { rules = { { cidr = "10.0.0.0/8", allow = false, port = -1 } } },
    function() end, function() end)
  t:eq(ok, false, "a negative port in a rule is refused")
  t:match(tostring(err), "opts%.rules%[1%]: port and index must be non%-negative integers", "naming the rule")
  ok, err = pcall(proxy.listen, d .. ".sock", { max_conns = -2 }, function() end, function() end)
  t:eq(ok, false, "a negative ceiling is refused")
  t:match(tostring(err), "max_conns must be a non%-negative integer", "naming the option")
end

-- Connections that have not passed the listener's checks: a queue of their own (its oldest
-- silent one closed when full), not counted against max_conns, and the head timeout.
function tests.preauth_queue_and_head_timeout(t)
  local tok = "preauth-token-0123456789"
  local s <close> = server(function(conn) assert(conn:respond(200, {}, "ok")) end,
    { max_conns = 1, max_preauth = 2, head_timeout_ms = 200 }, { token = tok, hosts = HOSTS })
  local closed, all, held = 0, async.event(), {}
  for _ = 1, 6 do
    assert(stream.connect_tcp("127.0.0.1", s.port, function(c)
      held[#held + 1] = c
      c:read_start(function(d)
        if d then return end
        closed = closed + 1
        if closed == 6 then all.set() end
      end)
    end))
  end
  async.sleep(50)
  -- a client with the token is served beside them (max_conns 1 counts only it)
  local res = assert(request({ url = s.url .. "/", headers = { Authorization = "Bearer " .. tok,
    Connection = "close" } }))
  t:eq(res.status, 200)
  pcall(async.timeout, 5000, all.wait)
  t:eq(closed, 6, "the server closed every silent connection (the oldest past the queue, the rest at the head timeout)")
  for _, c in ipairs(held) do c:close() end
  t:match(raw(s.port, "GET / HTTP/1.1\r\nHost: loc"), "^HTTP/1.1 408 ", "half a head at the head timeout")
  t:match(raw(s.port, "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"), "^HTTP/1.1 401 ", "no token")
  local ok, err = pcall(s.srv.listen_tcp, s.srv, "127.0.0.1", 0, { tag = "x", max_preauth = -1 })
  t:eq(ok, false)
  t:match(tostring(err), "max_preauth must be >= 0")
end

return tests
