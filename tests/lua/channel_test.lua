-- lua/channel.lua, the host side of demesne-init's control socket, against sockets this
-- test serves itself: the request frames, links and non-sockets never followed, and a
-- hostile peer (garbage, floods, silence) that can neither grow the host's memory nor
-- block it.
local async = require("demesne.async")
local channel = require("demesne.channel")
local fs = require("core.fs")
local stream = require("core.stream")
local loop = require("core.loop")

local tests = {}

local function scratch()
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d, 448))
  return setmetatable({ dir = d }, { __close = function() fs.remove_tree(d) end })
end

-- Serves `path` with on_conn(conn, request_bytes) after the first bytes arrive. Returns
-- the server and the list of accepted connections (closed by the caller).
local function serve(path, on_data)
  local conns = {}
  local server = assert(stream.listen_unix(path, function(c)
    conns[#conns + 1] = c
    c:read_start(function(data) if data then on_data(c, data) end end)
  end))
  return setmetatable({ server = server, conns = conns }, { __close = function(self)
    self.server:close()
    for _, c in ipairs(self.conns) do c:close() end
  end })
end

function tests.a_request_is_framed_as_demesne_init_reads_it(t)
  local frame = assert(channel.encode("run", { "--id", "x", "--", "sh", "-c", "echo hi" }, { "A=1", "B=two words" }))
  local len = string.unpack(">I4", frame, 5)
  t:eq(frame:sub(1, 4), "DMI1", "magic")
  t:eq(len, #frame - 8, "length")
  t:eq(frame:sub(9), "run\0" .. "6\0--id\0x\0--\0sh\0-c\0echo hi\0" .. "2\0A=1\0B=two words\0", "payload")
  local none, err = channel.encode("run", { "a\0b" })
  t:eq(none, nil, "a NUL inside a string is refused")
  t:match(err, "NUL", "why")
  none, err = channel.encode("run", { string.rep("x", channel.MAX_REQUEST) })
  t:eq(none, nil, "an oversized request is refused")
  t:match(err, "over the", "why")
end

function tests.replies_are_read_in_order(t)
  local s <close> = scratch()
  local got = ""
  local _srv <close> = serve(s.dir .. "/init.sock", function(c, data)
    got = got .. data
    c:write("ok\nstarted 42\n")
    c:write("exit 3\n")
  end)
  local conn <close> = assert(channel.connect(s.dir))
  assert(conn:send("run", { "--", "true" }, { "X=1" }))
  t:eq(conn:next(2000), { kind = "ok" }, "ok")
  t:eq(conn:next(2000), { kind = "started", pid = 42 }, "started")
  t:eq(conn:next(2000), { kind = "exit", code = 3 }, "exit")
  t:eq(got:sub(1, 4), "DMI1", "the peer got the frame")
end

function tests.a_link_a_fifo_or_a_file_in_the_run_folder_is_never_followed(t)
  local s <close> = scratch()
  local other <close> = scratch()
  local _srv <close> = serve(other.dir .. "/init.sock", function(c) c:write("ok\n") end)
  assert(os.execute(("ln -s %q %q"):format(other.dir .. "/init.sock", s.dir .. "/init.sock")))
  local conn, err, code = channel.connect(s.dir)
  t:eq(conn, nil, "a link to another sandbox's socket is refused")
  t:eq(code, "ENOTSOCK", "code")
  t:match(err, "never followed", "message")
  os.remove(s.dir .. "/init.sock")
  assert(os.execute(("mkfifo %q"):format(s.dir .. "/init.sock")))
  conn, err, code = channel.connect(s.dir)
  t:eq({ conn, code }, { nil, "ENOTSOCK" }, "a FIFO is never opened for reading or writing")
  t:match(err, "never followed", "message")
  os.remove(s.dir .. "/init.sock")
  conn, err, code = channel.connect(s.dir)
  t:eq({ conn, code }, { nil, "ENOENT" }, "no socket yet")
  t:match(err, "no such file", "message")
end

function tests.a_hostile_peer_is_cut_off(t)
  local s <close> = scratch()
  local mode = "flood"
  local _srv <close> = serve(s.dir .. "/init.sock", function(c)
    if mode == "flood" then
      for _ = 1, 64 do c:write(string.rep("ok\n", 1000)) end
    elseif mode == "garbage" then
      c:write("ok\nrm -rf /\n")
    elseif mode == "long" then
      c:write(string.rep("e", 1000))
    end -- "silent": never answers
  end)
  local function try()
    local conn <close> = assert(channel.connect(s.dir))
    assert(conn:send("run", { "--", "true" }))
    local replies, r, err, code = 0
    repeat
      r, err, code = conn:next(300)
      if r then replies = replies + 1 end
    until not r
    return replies, err, code
  end
  local n, err, code = try()
  t:eq(code, "EPROTO", "a flood is a protocol error")
  t:ok(n <= channel.MAX_REPLY // 3, "at most MAX_REPLY bytes were taken: " .. n .. " replies")
  t:match(err, "more than", "why")
  mode = "garbage"
  local _
  n, _, code = try()
  t:eq({ n, code }, { 1, "EPROTO" }, "a line outside the protocol ends the connection after the good one")
  mode = "long"
  n, _, code = try()
  t:eq({ n, code }, { 0, "EPROTO" }, "an endless line")
  mode = "silent"
  local t0 = loop.now()
  n, _, code = try()
  t:eq({ n, code }, { 0, "ETIMEDOUT" }, "silence ends with the deadline")
  t:ok(loop.now() - t0 < 2000, "and not later")
end

function tests.a_peer_that_never_reads_cannot_hold_a_send(t)
  local s <close> = scratch()
  local conns = {}
  local server = assert(stream.listen_unix(s.dir .. "/init.sock", function(c) conns[#conns + 1] = c end)) -- never reads
  local _ <close> = setmetatable({}, { __close = function()
    server:close()
    for _, c in ipairs(conns) do c:close() end
  end })
  local conn <close> = assert(channel.connect(s.dir))
  local t0 = loop.now()
  local ok, err, code = conn:send("run", { "--", "true" }, { "BIG=" .. string.rep("x", 3 * 1024 * 1024) }, 300)
  t:eq({ ok, code }, { nil, "ETIMEDOUT" }, "the send gives up")
  t:match(err, "in time", "why")
  t:ok(loop.now() - t0 < 2000, "at its deadline")
  t:eq(conn:next(100), nil, "and the connection is over")
end

function tests.connect_wait_retries_until_the_socket_appears(t)
  local s <close> = scratch()
  local later = async.spawn("late server", function()
    async.sleep(100)
    return serve(s.dir .. "/init.sock", function(c) c:write("ok\n") end)
  end)
  local conn <close> = assert(channel.connect_wait(s.dir, 5000))
  assert(conn:send("kill", { "--dir", "/x" }))
  t:eq(conn:next(2000), { kind = "ok" }, "the late socket answered")
  local _, srv = later:wait()
  local _srv <close> = srv
  local none, _, code = channel.connect_wait(s.dir .. "/nothing", 50)
  t:eq({ none, code }, { nil, "ETIMEDOUT" }, "a socket that never appears")
end

return tests
