-- lua/engines/init.lua: what a user engine adapter's new() must return.
local engines = require("demesne.engines")

local tests = {}

function tests.a_user_adapter_must_build_a_whole_engine(t)
  local function try(new) return select(2, engines.new_user("mine", { new = new }, "unix:///x.sock")) end
  t:eq(try(function() return nil end), "engine_adapter mine: new() returned nothing")
  t:eq(try(function() return nil, "no such host" end), "engine_adapter mine: no such host")
  t:eq(try(function() return 5 end), "engine_adapter mine: new() returned a number, not an engine object")
  t:match(try(function() error("boom") end), "^engine_adapter mine: new%(%) failed: .*boom")
  local partial = {}
  for _, m in ipairs(engines.METHODS) do partial[m] = function() end end
  partial.pull = nil
  t:eq(try(function() return partial end), "engine_adapter mine: the engine new() returned has no method pull")
  local docker = require("demesne.engines.docker")
  local eng = engines.new_user("mine", { new = function(e) return docker.new(e:gsub("^unix://", ""), nil) end },
    "unix:///x.sock")
  t:eq(eng.socket, "/x.sock", "the built-in adapter is a whole engine")
end

-- Every value the adapter puts into an API path is one escaped segment: it cannot climb
-- with "..", add segments or start a query (issue 10). A loopback engine records the
-- request lines the adapter sends.
function tests.docker_adapter_escapes_every_path_segment(t)
  local stream = require("core.stream")
  local fs = require("core.fs")
  local loop = require("core.loop")
  local docker = require("demesne.engines.docker")
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-eng-" .. loop.getpid() .. "-" .. math.floor(loop.now())
  assert(fs.mkdir_p(dir))
  local sock = dir .. "/engine.sock"
  local lines = {}
  local srv = assert(stream.listen_unix(sock, function(c)
    local buf = ""
    c:read_start(function(d)
      if not d then c:close() return end
      buf = buf .. d
      if buf:find("\r\n\r\n", 1, true) then
        lines[#lines + 1] = buf:match("^([^\r]*)")
        c:read_stop()
        local body = '{"message":"no such thing"}'
        c:write(("HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
          .. "Connection: close\r\n\r\n%s"):format(#body, body), function() c:close() end)
      end
    end)
  end))
  local eng = docker.new(sock)
  local ok, err = pcall(function()
    t:eq(select(3, eng:image_inspect("../events?x=")), "ENOENT", "an answer, not a hang")
    eng:image_inspect("../images/x/get?x=")
    eng:inspect("a/../b?c#d")
    eng:remove("..")
    eng:start("x y")
    eng:exec("ctr/../../x", { "true" })
    eng:kill("../../info", "KILL")
  end)
  srv:close()
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
  t:eq(lines, {
    "GET /v1.41/images/..%2Fevents%3Fx%3D/json HTTP/1.1",
    "GET /v1.41/images/..%2Fimages%2Fx%2Fget%3Fx%3D/json HTTP/1.1",
    "GET /v1.41/containers/a%2F..%2Fb%3Fc%23d/json HTTP/1.1",
    "DELETE /v1.41/containers/%2E%2E?force=true&v=true HTTP/1.1",
    "POST /v1.41/containers/x%20y/start HTTP/1.1",
    "POST /v1.41/containers/ctr%2F..%2F..%2Fx/exec HTTP/1.1",
    "POST /v1.41/containers/..%2F..%2Finfo/kill?signal=KILL HTTP/1.1",
  }, "request lines")
  t:ok(not pcall(docker.segment, ""), "an empty segment is a programmer's mistake")
end

return tests
