-- sandbox_exec through demesne-init's control socket, on the fake engine (which models the
-- socket with a real unix socket at the host end of the run folder): execs and their
-- cancels go over the socket, not the engine's exec API; back-to-back execs ask the engine
-- once; a sandbox without the socket still works through the exec API; one destroyed
-- meanwhile is reported as before.
local async = require("demesne.async")
local config = require("demesne.config")
local engines = require("demesne.engines")
local sandbox = require("demesne.sandbox")
local teardown = require("demesne.teardown")
local fs = require("core.fs")
local loop = require("core.loop")

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local FAKE = here .. "/../fixtures/engines/fake.lua"
local IMAGE = "fake/base:1"

local tests = {}

local VARS = { "XDG_CONFIG_HOME", "DEMESNE_ENGINE_ADAPTER", "DEMESNE_ENGINE", "DEMESNE_STATE_DIR",
  "DEMESNE_OUTPUT_ROOT", "DEMESNE_ALLOWED_PATHS", "DEMESNE_INIT" }

-- A scratch world on the fake engine that counts the engine calls made (w.calls[method]).
local function world()
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d .. "/config/demesne/engines", 493))
  assert(fs.write_atomic(d .. "/config/demesne/engines/fake.lua", assert(fs.read_file(FAKE))))
  assert(fs.write_atomic(d .. "/demesne-init", "not run: the fake engine models it"))
  local env = { XDG_CONFIG_HOME = d .. "/config", DEMESNE_ENGINE_ADAPTER = "fake", DEMESNE_ENGINE = "",
    DEMESNE_STATE_DIR = d .. "/state", DEMESNE_OUTPUT_ROOT = d .. "/out", DEMESNE_ALLOWED_PATHS = d,
    DEMESNE_INIT = d .. "/demesne-init" }
  local saved = {}
  for _, k in ipairs(VARS) do
    saved[k] = os.getenv(k)
    loop.setenv(k, env[k])
  end
  config.load()
  local eng = assert(engines.get())
  local w = { dir = d, eng = eng, calls = {} }
  for _, m in ipairs({ "exec", "list", "inspect" }) do
    local inner = eng[m]
    eng[m] = function(self, ...)
      w.calls[m] = (w.calls[m] or 0) + 1
      return inner(self, ...)
    end
  end
  return setmetatable(w, { __close = function()
    assert(teardown.wait(5000), "the removals finished")
    for _, m in ipairs({ "exec", "list", "inspect" }) do eng[m] = nil end
    for _, c in ipairs(eng:list({ "io.demesne.managed=1" })) do
      local rid = c.labels["io.demesne.run_id"]
      if rid then require("demesne.egress").stop(rid) end
    end
    eng:reset()
    for _, k in ipairs(VARS) do loop.setenv(k, saved[k]) end
    config.load()
    fs.remove_tree(d)
  end })
end

function tests.execs_go_over_the_control_socket_and_back_to_back_ones_ask_the_engine_once(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE })
  w.calls = {}
  for i = 1, 3 do
    local r = sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = 'printf "%s" "$N"', env = { N = tostring(i) } })
    t:eq({ r.exit_code, r.stdout }, { 0, tostring(i) }, "exec " .. i .. " ran with its env")
  end
  t:eq(w.calls.exec, nil, "no engine exec: the commands went over the control socket")
  t:eq(w.calls.list, 1, "one lookup for three back-to-back execs")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
  local ok, e = pcall(sandbox.exec, nil, { sandbox_id = c.sandbox_id, command = "true" })
  t:eq({ ok, e.code }, { false, "ENOENT" }, "after destroy the sandbox is looked up afresh and reported gone")
end

function tests.a_cancel_goes_over_the_control_socket(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE })
  local run_dir = w.dir .. "/state/run/" .. c.sandbox_id
  local task = async.spawn("exec", sandbox.exec, nil, { sandbox_id = c.sandbox_id, command = "sleep 30" })
  for _ = 1, 200 do
    local names = fs.readdir(run_dir .. "/exec") or {}
    if names[1] and fs.stat(run_dir .. "/exec/" .. names[1] .. "/pid") then break end
    async.sleep(10)
  end
  w.calls = {}
  async.cancel(task, "test")
  task:wait()
  t:eq(w.calls.exec, nil, "the kill went over the control socket")
  local names = fs.readdir(run_dir .. "/exec") or {}
  local st = sandbox.read_status(run_dir, names[1])
  t:eq(st and st.cancelled, true, "the command was cancelled")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
end

function tests.a_sandbox_without_the_control_socket_runs_execs_through_the_exec_api(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE })
  assert(os.remove(w.dir .. "/state/run/" .. c.sandbox_id .. "/init.sock"))
  w.calls = {}
  local r = sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = "echo via-exec" })
  t:eq(r.stdout, "via-exec\n", "the command ran")
  t:eq(w.calls.exec, 1, "through the engine's exec API")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
end

return tests
