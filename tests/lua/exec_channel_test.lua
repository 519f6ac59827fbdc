-- sandbox_exec through demesne-init's control socket, on the fake engine (which models the
-- socket with a real unix socket at the host end of the run folder): execs and their
-- cancels go over the socket, not the engine's exec API; back-to-back execs ask the engine
-- once; a sandbox without the socket still works through the exec API; one destroyed
-- meanwhile is reported as before.
local async = require("demesne.async")
local sandbox = require("demesne.sandbox")
local fs = require("core.fs")

local scratch = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/world.lua")
local IMAGE = scratch.IMAGE

local tests = {}

-- A scratch world on the fake engine that counts the engine calls made (w.calls[method]).
local function world()
  local w = scratch.new()
  w.calls = {}
  for _, m in ipairs({ "exec", "list", "inspect" }) do
    w:wrap(m, function(inner, eng, ...)
      w.calls[m] = (w.calls[m] or 0) + 1
      return inner(eng, ...)
    end)
  end
  return w
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
