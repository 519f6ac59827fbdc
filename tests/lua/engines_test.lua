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
  partial.pull = function() end
  t:eq(try(function() return partial end), "engine_adapter mine: the engine new() returned has no capabilities table "
    .. '(docs/reference/engines.md, "Capabilities")')
  local docker = require("demesne.engines.docker")
  local eng = engines.new_user("mine", { new = function(e) return docker.new(e:gsub("^unix://", ""), nil) end },
    "unix:///x.sock")
  t:eq(eng.socket, "/x.sock", "the built-in adapter is a whole engine")
end

-- lua/engines/docker.lua: the sandbox spec in, Docker's JSON out, and back.
local docker = require("demesne.engines.docker")
local json = require("demesne.json")

local SPEC = {
  name = "demesne-r1",
  image = "demesne/default:3f9c0a1b2c4d",
  entrypoint = { "/.demesne/init" },
  command = { "serve", "--relay", "3128=/.demesne/run/egress.sock" },
  env = json.array({ "DEMESNE_RUN_ID=r1", "HOME=/root" }),
  workdir = "/out",
  hostname = "sandbox",
  labels = { ["io.demesne.managed"] = "1", ["io.demesne.run_id"] = "r1" },
  mounts = {
    { source = "/usr/lib/demesne/demesne-init", target = "/.demesne/init", mode = "ro" },
    { source = "/state/run/r1", target = "/.demesne/run", mode = "rw", relay = true },
    { source = "/output/r1", target = "/out", mode = "rw" },
    { source = "/home/me/data.csv", target = "/in/data.csv", mode = "ro" },
  },
  tmpfs = { { target = "/tmp", mode = "1777", exec = true }, { target = "/run", mode = "0755" } },
  network = "none",
  read_only_rootfs = true,
  security = { no_new_privileges = true, cap_drop = { "NET_RAW" } },
  limits = { memory_bytes = 2147483648, cpus = 1.5, pids = 1024 },
  log_max_bytes = 1048576,
}

function tests.docker_translates_the_spec_into_the_create_body_it_always_sent(t)
  -- the body lua/sandbox.lua built itself before the neutral spec (docs/reference/engines.md)
  t:eq(json.decode(json.encode(docker.create_body(SPEC))), {
    Image = "demesne/default:3f9c0a1b2c4d",
    Entrypoint = { "/.demesne/init" },
    Cmd = { "serve", "--relay", "3128=/.demesne/run/egress.sock" },
    Env = { "DEMESNE_RUN_ID=r1", "HOME=/root" },
    WorkingDir = "/out",
    Hostname = "sandbox",
    Labels = { ["io.demesne.managed"] = "1", ["io.demesne.run_id"] = "r1" },
    HostConfig = {
      Binds = { "/usr/lib/demesne/demesne-init:/.demesne/init:ro", "/state/run/r1:/.demesne/run:rw", "/output/r1:/out:rw",
        "/home/me/data.csv:/in/data.csv:ro" },
      Tmpfs = { ["/tmp"] = "rw,exec,mode=1777", ["/run"] = "rw,mode=0755" },
      NetworkMode = "none",
      ReadonlyRootfs = true,
      SecurityOpt = { "no-new-privileges" },
      CapDrop = { "NET_RAW" },
      Memory = 2147483648, MemorySwap = 2147483648, NanoCpus = 1500000000, PidsLimit = 1024,
      Init = false,
      LogConfig = { Type = "json-file", Config = { ["max-size"] = "1048576", ["max-file"] = "1" } },
    },
  }, "body")
  local open = {}
  for k, v in pairs(SPEC) do open[k] = v end
  open.network, open.env, open.user = "bridge", json.array(), "1000:1000"
  local body = json.encode(docker.create_body(open))
  t:match(body, '"NetworkMode":"bridge"', "open egress")
  t:match(body, '"Env":%[%]', "an empty env is a JSON array")
  t:match(body, '"User":"1000:1000"', "user")
end

function tests.docker_reads_inspect_and_list_into_neutral_info(t)
  -- trimmed from GET /containers/{id}/json of Podman 4.3 and Docker 20.10
  local inspect = {
    Id = "3f9c", Name = "/demesne-r1",
    State = { Status = "running", Running = true, ExitCode = 0 },
    Config = { Image = "docker.io/demesne/default:3f9c0a1b2c4d", Labels = { ["io.demesne.run_id"] = "r1" } },
    HostConfig = { Memory = 268435456, NanoCpus = 500000000, PidsLimit = 64, NetworkMode = "none" },
  }
  t:eq(docker.container_info(inspect), { id = "3f9c", name = "demesne-r1", image = "docker.io/demesne/default:3f9c0a1b2c4d",
    state = "running", labels = { ["io.demesne.run_id"] = "r1" },
    limits = { memory_bytes = 268435456, cpus = 0.5, pids = 64 } }, "a running container")
  local function state(st) return docker.container_info({ Id = "x", State = st }) end
  t:eq(state({ Status = "exited", Running = false, ExitCode = 7 }).exit_code, 7, "exit code once exited")
  t:eq(state({ Status = "created", Running = false, ExitCode = 0 }).state, "created", "created")
  t:eq(state({ Status = "configured", Running = false }).state, "created", "Podman's configured")
  t:eq(state({ Status = "paused", Running = true }).state, "running", "paused counts as running (State.Running)")
  t:eq(state({ Status = "removing", Running = false }).state, "removing", "removing")
  t:eq(state({ Status = "dead", Running = false }).state, "gone", "dead")
  t:eq(state({ Status = "stopped", Running = false }).state, "exited", "Podman's stopped")
  t:eq(state({ Status = "running", Running = false }).state, "exited", "State.Running decides")
  t:eq(docker.container_info({ Id = "x", HostConfig = { Memory = 0, NanoCpus = 0, PidsLimit = -1 } }).limits, {},
    "no limits: nothing reported")
  t:eq(docker.container_info({ Id = "x" }).labels, {}, "no labels: an empty map")
  t:eq(docker.container_summary({ Id = "3f9c", Names = { "/demesne-r1" }, Image = "demesne/default:3f9c0a1b2c4d",
    State = "exited", Labels = { a = "1" } }), { id = "3f9c", name = "demesne-r1", image = "demesne/default:3f9c0a1b2c4d",
    state = "exited", labels = { a = "1" } }, "a list entry")
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
