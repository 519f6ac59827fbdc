-- lua/sandbox/ on the fake engine (tests/fixtures/engines/fake.lua), loaded the way a
-- user adapter is (DEMESNE_ENGINE_ADAPTER=fake, engines/fake.lua in the config folder):
-- the spec a sandbox gets (limits, env, mounts, labels, network), one-shot runs, persistent
-- sandboxes and their execs, TTL renewal and the reaper's decisions. The fake passes the
-- same contract as the real adapter (engine_contract_fake_test.lua); sandbox.lua, egress,
-- paths and config here are the real modules.
local async = require("demesne.async")
local config = require("demesne.config")
local sandbox = require("demesne.sandbox")
local json = require("demesne.json")
local teardown = require("demesne.teardown")
local fs = require("core.fs")
local loop = require("core.loop")

local scratch = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/world.lua")
local IMAGE = scratch.IMAGE
local by_target = scratch.by_target
local MiB = 1024 * 1024

local tests = {}

-- A scratch world (tests/lua/world.lua): config, state and output folders, an allowed host
-- folder, the fake engine as the runtime's adapter, and every create() it receives.
local function world(extra_env)
  return scratch.new({
    vars = { "DEMESNE_MEMORY_MB_MAX", "DEMESNE_ISOLATION", "DEMESNE_USERNS", "DEMESNE_FORK_MAX_COUNT" },
    env = extra_env,
    on_open = function(w) w:record_creates() end,
  })
end

local function failure(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected a failure")
  return type(e) == "table" and e.message or tostring(e), type(e) == "table" and e.code or nil
end

function tests.a_one_shot_run_gives_exit_code_and_output_and_leaves_no_container(t)
  local w <close> = world()
  local r = sandbox.run_script(nil, { command = "echo hello; echo oops >&2; exit 3", image = IMAGE })
  t:eq(r.exit_code, 3, "exit_code")
  t:eq(r.stdout, "hello\n", "stdout")
  t:eq(r.stderr, "oops\n", "stderr")
  t:eq(r.timed_out, false, "timed_out")
  t:eq(r.output_dir, w.dir .. "/out/" .. r.run_id, "output_dir")
  t:eq(fs.read_file(r.output_dir .. "/stdout.log"), "hello\n", "the log stays")
  t:ok(teardown.wait(5000), "the container is removed after the answer")
  t:eq(#w.eng:list({ "io.demesne.managed=1" }), 0, "no container is left")
  t:eq(fs.stat(w.dir .. "/state/run/" .. r.run_id), nil, "the run folder is gone")
end

function tests.a_one_shot_sandbox_gets_the_whole_spec(t)
  local w <close> = world()
  local before = math.floor(loop.time())
  local r = sandbox.run_script(nil, { command = "true", image = IMAGE, timeout_seconds = 60 })
  t:eq(#w.specs, 1, "one create")
  local s = w.specs[1]
  local run_dir, out = w.dir .. "/state/run/" .. r.run_id, w.dir .. "/out/" .. r.run_id
  t:eq(s.name, "demesne-" .. r.run_id, "name")
  t:eq(s.image, IMAGE, "image")
  t:eq(s.entrypoint, { "/.demesne/init" }, "demesne-init is the entrypoint")
  t:eq(s.command, { "wait", "--control", "/.demesne/run/init.sock", "--relay", "3128=/.demesne/run/egress.sock" },
    "demesne-init waits for the command on its control socket, with the egress relay")
  t:eq(fs.read_file(out .. "/stdout.log"), "", "the command came over the control socket and ran")
  t:ok(teardown.wait(5000), "removed after the answer")
  t:eq(fs.stat(run_dir), nil, "its run folder is gone")
  t:eq({ s.workdir, s.hostname, s.network, s.read_only_rootfs }, { "/out", "sandbox", "none", true },
    "workdir, hostname, network, read-only root")
  t:eq(s.security, { no_new_privileges = true, cap_drop = { "NET_RAW", "MKNOD" } }, "security")
  t:eq(s.limits, { memory_bytes = 2048 * MiB, cpus = 2, pids = 1024 }, "the default limits")
  t:eq(s.mounts, {
    { source = w.dir .. "/demesne-init", target = "/.demesne/init", mode = "ro" },
    { source = run_dir, target = "/.demesne/run", mode = "rw", relay = true },
    { source = out, target = "/out", mode = "rw" },
  }, "mounts")
  local tmpfs = {}
  for _, m in ipairs(s.tmpfs) do tmpfs[m.target] = m.mode .. (m.exec and ",exec" or "") end
  t:eq(tmpfs, { ["/tmp"] = "1777,exec", ["/workspace"] = "0777,exec", ["/var/tmp"] = "1777,exec",
    ["/root"] = "0700,exec", ["/run"] = "0755" }, "tmpfs")
  local l = s.labels
  local created = tonumber(l["io.demesne.created_at"])
  t:ok(created >= before and created <= math.floor(loop.time()), "created_at is now")
  t:eq(tonumber(l["io.demesne.expires_at"]), created + 60 + 600, "a one-shot expires 10 min after its timeout")
  t:eq({ l["io.demesne.managed"], l["io.demesne.run_id"], l["io.demesne.tool"], l["io.demesne.kind"],
    l["io.demesne.owner"], l["io.demesne.output_dir"], l["io.demesne.run_dir"], l["io.demesne.image"],
    l["io.demesne.egress"] }, { "1", r.run_id, "sandbox_script", "oneshot", sandbox.owner(), out, run_dir, IMAGE,
    "package-managers" }, "labels")
end

function tests.without_a_read_only_root_there_are_fewer_tmpfs_mounts(t)
  local w <close> = world()
  loop.setenv("DEMESNE_READONLY_ROOTFS", "0")
  config.load()
  local _ <close> = setmetatable({}, { __close = function() loop.setenv("DEMESNE_READONLY_ROOTFS", nil) end })
  local r = sandbox.run_script(nil, { command = "touch /etc/x", image = IMAGE })
  t:eq(r.exit_code, 0, "the root is writable")
  t:eq(w.specs[1].read_only_rootfs, false, "read_only_rootfs")
  t:eq(#w.specs[1].tmpfs, 2, "/tmp and /workspace only")
end

function tests.limits_come_from_the_call_within_the_ceilings(t)
  local w <close> = world({ DEMESNE_MEMORY_MB_MAX = "4096" })
  local r = sandbox.run_script(nil, { command = "true", image = IMAGE, limits = { memory_mb = 256, cpus = 1.5, pids = 100 } })
  t:eq(r.exit_code, 0, "ran")
  t:eq(w.specs[1].limits, { memory_bytes = 256 * MiB, cpus = 1.5, pids = 100 }, "limits")
  local msg = failure(sandbox.run_script, nil, { command = "true", image = IMAGE, limits = { memory_mb = 8192 } })
  t:eq(msg, "limits.memory_mb: 8192 is above the ceiling of 4096 set in the configuration", "above the ceiling")
  msg = failure(sandbox.run_script, nil, { command = "true", image = IMAGE, limits = { pids = -1 } })
  t:eq(msg, "limits.pids: must be positive", "negative")
  t:eq(#w.specs, 1, "nothing was created for a refused call")
end

function tests.env_is_the_callers_over_demesnes_defaults(t)
  local w <close> = world()
  local r = sandbox.run_script(nil, { image = IMAGE, env = { FOO = "bar baz", HOME = "/work" },
    command = 'printf "%s|%s|%s|%s" "$FOO" "$HOME" "$DEMESNE_RUN_ID" "$DEMESNE_OUT"' })
  t:eq(r.stdout, "bar baz|/work|" .. r.run_id .. "|/out", "the variables inside")
  local env = {}
  for _, e in ipairs(w.specs[1].env) do
    local k, v = e:match("^([^=]*)=(.*)$")
    t:eq(env[k], nil, "one value per name: " .. k)
    env[k] = v
  end
  t:eq(env.HOME, "/work", "the caller's HOME wins")
  t:eq(env.PATH, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "demesne's PATH")
  t:eq(env.HTTPS_PROXY, "http://127.0.0.1:3128", "the proxy")
  local msg = failure(sandbox.run_script, nil, { command = "true", image = IMAGE, env = { DEMESNE_RUN_ID = "x" } })
  t:match(msg, "^env%.DEMESNE_RUN_ID: variables starting with DEMESNE_ are set by demesne", "a DEMESNE_ variable")
  msg = failure(sandbox.run_script, nil, { command = "true", image = IMAGE, env = { ["1X"] = "x" } })
  t:eq(msg, 'env: "1X" is not a valid variable name', "a bad name")
end

function tests.host_inputs_are_mounted_read_only_under_in(t)
  local w <close> = world()
  assert(fs.write_atomic(w.dir .. "/host/data.txt", "host data\n"))
  assert(fs.mkdir_p(w.dir .. "/host/src", 493))
  assert(fs.write_atomic(w.dir .. "/host/src/a.c", "int a;\n"))
  local r = sandbox.run_script(nil, { image = IMAGE, files = { w.dir .. "/host/data.txt" },
    directories = { w.dir .. "/host/src" }, command = "cat /in/data.txt /in/src/a.c; echo changed > /in/data.txt" })
  t:eq(r.stdout, "host data\nint a;\n", "both inputs are readable")
  t:eq(r.exit_code, 2, "the write fails")
  t:match(r.stderr, "Read%-only file system", "stderr")
  t:eq(fs.read_file(w.dir .. "/host/data.txt"), "host data\n", "the host file is unchanged")
  local m = by_target(w.specs[1].mounts)
  t:eq(m["/in/data.txt"], { source = w.dir .. "/host/data.txt", target = "/in/data.txt", mode = "ro" }, "the file")
  t:eq(m["/in/src"], { source = w.dir .. "/host/src", target = "/in/src", mode = "ro" }, "the folder")
  local msg = failure(sandbox.run_script, nil, { image = IMAGE, files = { "/etc/passwd" }, command = "true" })
  t:match(msg, "^files%[0%]: ", "a path outside the allowed roots")
  t:eq(#w.specs, 1, "nothing was created for it")
end

function tests.an_input_holding_demesnes_folders_or_credentials_is_refused(t)
  -- the allowed root is the whole scratch folder, which holds the state folder, the output
  -- root, the configuration folder and (below) a control folder and a credential file
  local w <close> = scratch.new({ vars = { "DEMESNE_CONTROL_DIR", "DEMESNE_PROTECTED_PATHS" },
    env = { DEMESNE_ALLOWED_PATHS = "/" }, on_open = function(x) x:record_creates() end })
  local d = w.dir
  assert(fs.mkdir_p(d .. "/home/me/.codex", 448))
  assert(fs.write_atomic(d .. "/home/me/.codex/auth.json", "{}"))
  assert(fs.mkdir_p(d .. "/home/me/work", 493))
  assert(fs.mkdir_p(d .. "/run/u", 448))
  loop.setenv("DEMESNE_CONTROL_DIR", d .. "/run/u/demesne") -- not made yet: still matched
  loop.setenv("DEMESNE_PROTECTED_PATHS", d .. "/home/me/.codex")
  config.load()
  local cases = {
    { d, "holds demesne's state folder" },
    { d .. "/run", "holds demesne's control folder %(" .. d:gsub("%p", "%%%0") .. "/run/u/demesne%)" },
    { d .. "/home", "holds a protected path %(config protected_paths%)" },
    { d .. "/home/me/.codex", "holds a protected path" },
    { d .. "/config", "holds demesne's configuration folder" },
  }
  for i, c in ipairs(cases) do
    local msg = failure(sandbox.run_script, nil, { image = IMAGE, directories = { c[1] }, command = "true" })
    t:match(msg, "^directories%[0%]: " .. c[1]:gsub("%p", "%%%0") .. " " .. c[2], "case " .. i)
  end
  local msg = failure(sandbox.run_script, nil, { image = IMAGE, files = { d .. "/home/me/.codex/auth.json" },
    command = "true" })
  t:match(msg, "^files%[0%]: .* is inside a protected path", "a credential file itself")
  assert(fs.mkdir_p(d .. "/out", 493))
  msg = failure(sandbox.run_script, nil, { image = IMAGE, directories = { d .. "/out" }, command = "true" })
  t:match(msg, "holds demesne's output root", "the output root itself")
  t:eq(#w.specs, 0, "nothing was created")
  local r = sandbox.run_script(nil, { image = IMAGE, directories = { d .. "/home/me/work" }, command = "true" })
  t:eq(r.exit_code, 0, "a folder beside them is mounted")
end

function tests.open_egress_gets_a_bridge_network_and_no_host_inputs(t)
  local w <close> = world()
  local r = sandbox.run_script(nil, { image = IMAGE, egress = "open", command = "cat /proc/net/dev" })
  t:eq(w.specs[1].network, "bridge", "network")
  t:match(r.stdout, "eth0:", "an interface besides lo")
  t:eq(w.specs[1].labels["io.demesne.egress"], "open", "label")
  assert(fs.write_atomic(w.dir .. "/host/data.txt", "x"))
  local msg = failure(sandbox.run_script, nil, { image = IMAGE, egress = "open", files = { w.dir .. "/host/data.txt" },
    command = "true" })
  t:match(msg, "^egress: \"open\" is not permitted for a call that mounts files", "open egress with inputs")
  r = sandbox.run_script(nil, { image = IMAGE, command = "cat /proc/net/dev" })
  t:eq(w.specs[#w.specs].network, "none", "the default policy")
  t:ok(not r.stdout:find("eth0", 1, true), "loopback only")
end

-- An engine that offers gVisor and a user namespace (capabilities); the fake runs the
-- command the same way, so this checks what sandbox.lua asks for.
local function offering(w, runtimes, userns)
  local caps = {}
  for k, v in pairs(w.caps) do caps[k] = v end
  caps.runtimes, caps.userns = runtimes, userns
  w.eng.capabilities = caps
end

function tests.isolation_gvisor_is_asked_for_and_never_dropped(t)
  local w <close> = world()
  local msg, code = failure(sandbox.run_script, nil, { image = IMAGE, command = "true", isolation = "gvisor" })
  t:eq({ msg, code }, { "isolation: gvisor is not available on this engine", "ENOTSUP" },
    "an engine without gVisor: refused, not run in a plain container")
  t:eq(#w.specs, 0, "nothing reached the engine")
  offering(w, { gvisor = true }, true)
  local r = sandbox.run_script(nil, { image = IMAGE, command = "echo hi", isolation = "gvisor" })
  t:eq(r.stdout, "hi\n", "it runs")
  local s = w.specs[1]
  t:eq({ s.runtime, s.userns, s.labels["io.demesne.isolation"] }, { "gvisor", true, "gvisor" },
    "runtime gvisor, in a user namespace where the engine has one")
  t:eq({ s.command[2], s.command[3], s.command[4] }, { "--relay", "3128=/.demesne/run/egress.sock", "--relay-copy" },
    "the relay copies from the start: gVisor cannot pass a socket to the host")
  msg = failure(sandbox.run_script, nil, { image = IMAGE, command = "true", isolation = "gvisor", egress = "open" })
  t:match(msg, "^isolation: gvisor sandboxes have no network but loopback", "open egress cannot be given")
  msg = failure(sandbox.create, nil, { image = IMAGE, isolation = "kvm" })
  t:eq(msg, 'isolation: "kvm" is not container or gvisor', "an unknown level")
  local c = sandbox.create(nil, { image = IMAGE, isolation = "gvisor" })
  t:eq({ w.specs[2].runtime, w.specs[2].command[1], w.specs[2].command[#w.specs[2].command] },
    { "gvisor", "serve", "--relay-copy" }, "a persistent sandbox too")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
  sandbox.run_script(nil, { image = IMAGE, command = "true" })
  t:eq({ w.specs[3].runtime, w.specs[3].userns, w.specs[3].labels["io.demesne.isolation"] }, { nil, true, "container" },
    "the default: a container, in a user namespace where the engine has one")
end

function tests.the_configuration_picks_the_default_isolation_and_the_user_namespace(t)
  local w <close> = world({ DEMESNE_ISOLATION = "gvisor" })
  local _ <close> = setmetatable({}, { __close = function()
    loop.setenv("DEMESNE_ISOLATION", nil)
    loop.setenv("DEMESNE_USERNS", nil)
  end })
  loop.setenv("DEMESNE_ISOLATION", "gvisor")
  config.load()
  local msg = failure(sandbox.run_script, nil, { image = IMAGE, command = "true" })
  t:eq(msg, "isolation_default (configuration): gvisor is not available on this engine", "the setting is named")
  offering(w, { gvisor = true }, true)
  sandbox.run_script(nil, { image = IMAGE, command = "true" })
  t:eq(w.specs[1].runtime, "gvisor", "gVisor by default")
  sandbox.run_script(nil, { image = IMAGE, command = "true", isolation = "container" })
  t:eq({ w.specs[2].runtime, w.specs[2].userns }, { nil, true }, "a call may still ask for a plain container")
  loop.setenv("DEMESNE_USERNS", "false")
  config.load()
  sandbox.run_script(nil, { image = IMAGE, command = "true", isolation = "container" })
  t:eq(w.specs[3].userns, nil, "userns = false: no user namespace")
  loop.setenv("DEMESNE_ISOLATION", "vm")
  config.load()
  local _, err = config.describe()
  t:eq(err, 'isolation_default must be one of container, gvisor, got "vm"', "a bad setting is named")
end

function tests.a_gvisor_sandbox_killed_for_memory_says_so(t)
  t:match(sandbox.gvisor_kill_note({ isolation = "gvisor", limits = { memory_mb = 64 } }, nil, 137),
    "^the sandbox was killed %(exit 137%) before its command finished, most likely for passing its memory limit of 64 MiB",
    "no status.json and 137 under gVisor")
  t:eq(sandbox.gvisor_kill_note({ isolation = "gvisor" }, { exit_code = 137 }, 137), nil, "the command's own 137")
  t:eq(sandbox.gvisor_kill_note({ isolation = "container" }, nil, 137), nil, "not under gVisor")
end

function tests.a_timeout_stops_the_command_and_says_so(t)
  local w <close> = world()
  local r = sandbox.run_script(nil, { image = IMAGE, command = "echo before; sleep 30; echo after", timeout_seconds = 1 })
  t:eq(r.timed_out, true, "timed_out")
  t:eq(r.stdout, "before\n", "stdout up to the timeout")
  t:eq(r.exit_code, 143, "killed by SIGTERM")
  t:ok(teardown.wait(5000), "removed after the answer")
  t:eq(#w.eng:list({ "io.demesne.managed=1" }), 0, "no container is left")
end

function tests.cancelling_a_one_shot_run_removes_its_container(t)
  local w <close> = world()
  local task = async.spawn("run", sandbox.run_script, nil, { image = IMAGE, command = "sleep 30" })
  for _ = 1, 200 do
    local list = w.eng:list({ "io.demesne.managed=1" })
    if #list == 1 and list[1].state == "running" then break end
    async.sleep(10)
  end
  t:eq(#w.eng:list({ "io.demesne.managed=1" }), 1, "the container ran")
  async.cancel(task, "test")
  task:wait()
  t:eq(task.result[1], false, "the call ended with an error")
  t:eq(tostring(task.result[2]), "cancelled", "cancelled")
  t:ok(teardown.wait(5000), "the removal after the cancel finished")
  t:eq(#w.eng:list({ "io.demesne.managed=1" }), 0, "the container is gone")
  t:eq(fs.readdir(w.dir .. "/state/run") or {}, {}, "its run folder too")
end

function tests.a_persistent_sandbox_runs_execs_until_destroyed(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE, ttl_seconds = 600 })
  t:match(c.sandbox_id, "^%d+T%d+Z%-%x+$", "sandbox_id")
  t:eq(c.image, IMAGE, "image")
  local s = w.specs[1]
  t:eq({ s.labels["io.demesne.kind"], s.labels["io.demesne.tool"], s.command[1] }, { "persistent", "sandbox_create", "serve" },
    "a persistent sandbox runs demesne-init serve")
  local listed = sandbox.list().sandboxes
  t:eq(#listed, 1, "listed")
  t:eq({ listed[1].sandbox_id, listed[1].state, listed[1].expires_at }, { c.sandbox_id, "running", c.expires_at }, "entry")
  local r = sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = 'echo hi > /out/f; pwd; printf "%s" "$X" >&2; exit 4',
    cwd = "/tmp", env = { X = "from the call" } })
  t:eq({ r.exit_code, r.stdout, r.stderr, r.timed_out }, { 4, "/tmp\n", "from the call", false }, "the exec")
  t:eq(fs.read_file(c.output_dir .. "/f"), "hi\n", "a file written to /out")
  t:eq(fs.read_file(r.log_dir .. "/stdout.log"), "/tmp\n", "the exec's log")
  r = sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = 'printf "%s" "$DEMESNE_RUN_ID"' })
  t:eq(r.stdout, c.sandbox_id, "an exec sees the sandbox's own env")
  t:eq(sandbox.destroy(nil, { sandbox_id = c.sandbox_id }).status, "destroyed", "destroy")
  t:eq(sandbox.destroy(nil, { sandbox_id = c.sandbox_id }).status, "already gone", "destroy again")
  local msg, code = failure(sandbox.exec, nil, { sandbox_id = c.sandbox_id, command = "true" })
  t:eq({ msg, code }, { ("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(c.sandbox_id), "ENOENT" },
    "an exec after destroy")
  t:eq(#sandbox.list().sandboxes, 0, "listed no more")
end

function tests.an_exec_renews_the_ttl_to_cover_its_timeout(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE, ttl_seconds = 600 })
  local before = math.floor(loop.time())
  local r = sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = "true", timeout_seconds = 3600 })
  local function epoch(iso)
    local y, mo, d, h, mi, s = iso:match("^(%d+)-(%d+)-(%d+)T(%d+):(%d+):(%d+)Z$")
    local t0 = os.time({ year = y, month = mo, day = d, hour = h, min = mi, sec = s })
    return t0 + (os.time() - os.time(os.date("!*t"))) -- os.time read the fields as local time
  end
  t:ok(epoch(r.expires_at) >= before + 3660, "expires no earlier than the exec's timeout + 60 s: " .. r.expires_at)
  t:eq(sandbox.list().sandboxes[1].expires_at, r.expires_at, "sandbox_list agrees")
  local msg = failure(sandbox.create, nil, { image = IMAGE, ttl_seconds = 10 * 24 * 3600 })
  t:match(msg, "^ttl_seconds: 864000 is above the ceiling of 604800", "a TTL above the ceiling")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
  t:eq(w.specs[2], nil, "nothing was created for the refused call")
end

function tests.an_exec_whose_sandbox_is_destroyed_under_it_says_so(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE })
  local task = async.spawn("exec", sandbox.exec, nil, { sandbox_id = c.sandbox_id, command = "sleep 30" })
  for _ = 1, 200 do
    if fs.stat(("%s/state/run/%s/exec"):format(w.dir, c.sandbox_id)) and #(fs.readdir(
      ("%s/state/run/%s/exec"):format(w.dir, c.sandbox_id)) or {}) > 0 then break end
    async.sleep(10)
  end
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
  task:wait()
  t:eq(task.result[1], false, "the exec failed")
  -- the exec learns it from its control connection, as the container is being removed or
  -- once it is gone: "was destroyed" or "was destroyed (or expired)"
  local want = ("sandbox_id: sandbox %s was destroyed"):format(c.sandbox_id)
  t:eq(task.result[2].message:sub(1, #want), want, "message")
  t:eq(task.result[2].code, "ENOENT", "code")
end

function tests.an_engine_that_cannot_share_host_folders_is_refused(t)
  local w <close> = world()
  local caps = {}
  for k, v in pairs(w.caps) do caps[k] = v end
  caps.bind_mounts = false
  w.eng.capabilities = caps
  local msg, code = failure(sandbox.run_script, nil, { image = IMAGE, command = "true" })
  t:eq({ msg, code }, { "spec.mounts[1]: this engine adapter cannot share host folders with a sandbox (capability bind_mounts)",
    "ENOTSUP" }, "run_script")
  msg = failure(sandbox.create, nil, { image = IMAGE })
  t:match(msg, "capability bind_mounts", "create")
  caps.bind_mounts, caps.unix_socket_mounts = true, false
  msg = failure(sandbox.create, nil, { image = IMAGE })
  t:eq(msg, "spec.mounts[2].relay: this engine adapter cannot pass host unix sockets into a sandbox (capability "
    .. "unix_socket_mounts)", "no unix sockets")
  -- a sandbox can write its main process's stdout: an engine that keeps that log unbounded
  -- on the host's disk is refused
  caps.unix_socket_mounts, caps.bounded_logs = true, false
  msg = failure(sandbox.create, nil, { image = IMAGE })
  t:eq(msg, "spec.log_max_bytes: this engine adapter cannot bound the log the engine keeps of a sandbox (capability "
    .. "bounded_logs)", "unbounded logs")
  t:eq(#w.specs, 0, "nothing reached the engine")
  t:eq(#w.eng:list({ "io.demesne.managed=1" }), 0, "no container")
end

-- The reaper's decisions, on containers made with the labels sandbox.lua gives them.
function tests.the_reaper_removes_expired_and_orphaned_sandboxes_only(t)
  local w <close> = world()
  local now = math.floor(loop.time())
  local dead = ("%s/999999999/1"):format(loop.hostname())
  assert(fs.mkdir_p(w.dir .. "/state/jobs", 448))
  local function record(id, status)
    local p = ("%s/state/jobs/job-%s.json"):format(w.dir, id)
    assert(fs.write_atomic(p, json.encode({ job_id = "job-" .. id, status = status })))
    return p
  end
  local cases = {
    live = { kind = "persistent", expires = now + 600, keep = true },
    expired = { kind = "persistent", expires = now - 10, keep = false },
    renewed = { kind = "persistent", expires = now - 10, renewed = now + 600, keep = true },
    oneshot_live_owner = { kind = "oneshot", expires = now + 600, owner = sandbox.owner(), keep = true },
    oneshot_dead_owner = { kind = "oneshot", expires = now + 600, owner = dead, keep = false },
    oneshot_other_host = { kind = "oneshot", expires = now + 600, owner = "elsewhere.example/1/1", keep = true },
    job_running = { kind = "job", expires = now - 10, owner = dead, record = record("a1", "running"), keep = true },
    job_done = { kind = "job", expires = now + 600, owner = dead, record = record("b2", "succeeded"), keep = false },
  }
  local ids = {}
  for name, c in pairs(cases) do
    local run_dir = w.dir .. "/state/run/" .. name
    assert(fs.mkdir_p(run_dir, 493))
    if c.renewed then sandbox.write_expiry(run_dir, c.renewed) end
    local labels = { ["io.demesne.managed"] = "1", ["io.demesne.kind"] = c.kind, ["io.demesne.run_id"] = name,
      ["io.demesne.owner"] = c.owner or sandbox.owner(), ["io.demesne.expires_at"] = tostring(c.expires),
      ["io.demesne.created_at"] = tostring(now - 20), ["io.demesne.run_dir"] = run_dir,
      ["io.demesne.job_record"] = c.record }
    ids[name] = assert(w.eng:create({ name = "demesne-" .. name:gsub("_", "-"), image = IMAGE,
      entrypoint = { "/bin/sh", "-c", "sleep 60" }, labels = labels }))
    assert(w.eng:start(ids[name]))
  end
  local unmanaged = assert(w.eng:create({ name = "not-demesne", image = IMAGE,
    labels = { ["io.demesne.kind"] = "oneshot", ["io.demesne.expires_at"] = "1" } }))
  t:eq(sandbox.reap(), 3, "removed")
  for name, c in pairs(cases) do
    t:eq(w.eng:inspect(ids[name]) ~= nil, c.keep, name .. (c.keep and " is kept" or " is removed"))
    t:eq(fs.stat(w.dir .. "/state/run/" .. name) ~= nil, c.keep, name .. "'s run folder")
  end
  t:ok(w.eng:inspect(unmanaged), "a container without io.demesne.managed is never touched")
  t:eq(sandbox.reap(), 0, "a second pass finds nothing")
end

function tests.sandbox_list_shows_only_this_state_folders_sandboxes(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE })
  assert(w.eng:create({ name = "demesne-elsewhere", image = IMAGE, labels = { ["io.demesne.managed"] = "1",
    ["io.demesne.kind"] = "persistent", ["io.demesne.run_id"] = "elsewhere",
    ["io.demesne.run_dir"] = "/var/lib/other/run/elsewhere" } }))
  local ids = {}
  for _, s in ipairs(sandbox.list().sandboxes) do ids[#ids + 1] = s.sandbox_id end
  t:eq(ids, { c.sandbox_id }, "only this configuration's")
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
end

function tests.a_paused_sandbox_refuses_exec_until_resumed(t)
  local _w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE, ttl_seconds = 600 })
  t:eq(sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = "exit 0" }).exit_code, 0, "exec")
  t:eq(sandbox.pause(nil, { sandbox_id = c.sandbox_id }).status, "paused", "pause")
  t:eq(sandbox.pause(nil, { sandbox_id = c.sandbox_id }).status, "already paused", "pause again")
  local listed = sandbox.list().sandboxes[1]
  t:eq({ listed.state, listed.paused }, { "running", true }, "listed: running, paused")
  local msg, code = failure(sandbox.exec, nil, { sandbox_id = c.sandbox_id, command = "exit 0" })
  t:match(msg, "^sandbox_id: sandbox .* is paused %(sandbox_pause%); sandbox_resume it first", "exec refused")
  t:eq(code, "EPAUSED", "its code")
  t:match(failure(sandbox.snapshot, nil, { sandbox_id = c.sandbox_id }), "is paused", "snapshot refused")
  t:eq(sandbox.resume(nil, { sandbox_id = c.sandbox_id }).status, "resumed", "resume")
  t:eq(sandbox.resume(nil, { sandbox_id = c.sandbox_id }).status, "not paused", "resume again")
  t:eq(sandbox.exec(nil, { sandbox_id = c.sandbox_id, command = "exit 3" }).exit_code, 3, "exec after resume")
  t:eq(sandbox.destroy(nil, { sandbox_id = c.sandbox_id }).status, "destroyed", "destroy")
end

function tests.an_engine_without_snapshots_or_pause_refuses_them_by_capability(t)
  local w <close> = world()
  local c = sandbox.create(nil, { image = IMAGE, ttl_seconds = 600 })
  w.eng.capabilities = setmetatable({ snapshots = false, pause = false }, { __index = w.caps })
  local msg, code = failure(sandbox.snapshot, nil, { sandbox_id = c.sandbox_id })
  t:eq({ msg, code }, { "sandbox_id: this engine adapter cannot take snapshots (capability snapshots is false)",
    "ENOTSUP" }, "snapshot")
  t:match(failure(sandbox.fork, nil, { sandbox_id = c.sandbox_id, count = 2 }), "capability snapshots is false", "fork")
  t:match(failure(sandbox.create, nil, { snapshot = "snap-20260101T000000Z-00000000" }),
    "^snapshot: this engine adapter cannot take snapshots", "create from a snapshot")
  t:match(failure(sandbox.pause, nil, { sandbox_id = c.sandbox_id }), "capability pause is false", "pause")
  t:eq(#w.specs, 1, "nothing more was created")
end

function tests.snapshot_names_counts_and_ids_are_checked_before_anything_is_made(t)
  local w <close> = world({ DEMESNE_FORK_MAX_COUNT = "2" })
  local c = sandbox.create(nil, { image = IMAGE, ttl_seconds = 600 })
  for _, bad in ipairs({ "a b", "-x", ".x", ("n"):rep(129), "x/y", "x:y" }) do
    t:match(failure(sandbox.snapshot, nil, { sandbox_id = c.sandbox_id, name = bad }),
      "^name: .* is not a valid image reference component", ("name %q"):format(bad))
  end
  t:match(failure(sandbox.fork, nil, { sandbox_id = c.sandbox_id, count = 3 }),
    "^count: 3 is above the ceiling of 2 set in the configuration %(fork_max_count%)", "count over the cap")
  t:match(failure(sandbox.fork, nil, { sandbox_id = c.sandbox_id, count = 0 }), "^count: must be a positive integer",
    "count 0")
  t:match(failure(sandbox.create, nil, { snapshot = "../x" }), '^snapshot: "%.%./x" is not a snapshot id', "a bad id")
  t:match(failure(sandbox.snapshot_delete, nil, { snapshot_id = "x" }), '^snapshot_id: "x" is not a snapshot id',
    "delete: a bad id")
  t:eq(sandbox.snapshot_delete(nil, { snapshot_id = "snap-20260101T000000Z-00000000" }).status, "already gone",
    "delete: an unknown one")
  t:eq(#t:ok(w.eng:image_list({ "io.demesne.snapshot_id" })), 0, "no image was made")
end

return tests
