-- `demesne doctor` (lua/doctor.lua): each check names the problem it finds and its fix,
-- and passes on what a working install has. The engine check's success against Podman and
-- Docker is tested in tests/integration/doctor.test.mjs and tests/package/run.
local doctor = require("demesne.doctor")
local config = require("demesne.config")
local stream = require("core.stream")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local function tmpdir()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-doctor-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

-- Runs fn with the environment variables set (false removes one), then restores them.
-- Unless a test names them, no engine is asked (a socket path that does not exist) and
-- the user's config folder is not read.
local function with_env(vars, fn)
  local saved = {}
  local defaults = { DEMESNE_ENGINE = "unix:///nonexistent/demesne-doctor-test.sock",
    XDG_CONFIG_HOME = "/nonexistent/demesne-doctor-test" }
  for k, v in pairs(defaults) do if vars[k] == nil then vars[k] = v end end
  for k, v in pairs(vars) do saved[k] = os.getenv(k) or false; loop.setenv(k, v or nil) end
  config.load()
  local ok, err = pcall(fn)
  for k, v in pairs(saved) do loop.setenv(k, v or nil) end
  config.load()
  if not ok then error(err, 0) end
end

local function by_name(results)
  local out, names = {}, {}
  for _, r in ipairs(results) do out[r.name] = r; names[#names + 1] = r.name end
  return out, names
end

function tests.every_check_runs_in_order(t)
  with_env({}, function()
    local _, names = by_name(doctor.run())
    t:eq(names, { "engine", "images", "agent-clis", "config", "folders", "demesne-init", "gvisor", "userns", "limits",
      "network" })
  end)
end

function tests.a_missing_engine_socket_is_named_with_its_fix(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_ENGINE = "unix://" .. d.path .. "/none.sock" }, function()
    local r = by_name(doctor.run())
    t:eq(r.engine.ok, false, "engine verdict")
    t:eq(r.engine.detail, ("the engine setting ($DEMESNE_ENGINE) names %s/none.sock, which is not a socket"):format(d.path))
    t:match(r.engine.fix, "correct the setting", "engine fix")
    t:eq(r.images.skip, "needs an engine", "images are not judged without an engine")
    t:eq(r.images.ok, false)
    t:eq(r["agent-clis"].skip, "needs an engine")
  end)
end

function tests.a_socket_nobody_serves_is_named_with_its_fix(t)
  local d <close> = tmpdir()
  local path = d.path .. "/stale.sock"
  -- a socket file nothing listens on: libuv unlinks a listener's path when it closes, so
  -- the file is moved away first and stays behind as a stale socket
  local srv = assert(stream.listen_unix(d.path .. "/live.sock", function(c) c:close() end))
  assert(fs.rename(d.path .. "/live.sock", path))
  srv:close()
  with_env({ DEMESNE_ENGINE = "unix://" .. path }, function()
    local r = by_name(doctor.run())
    t:eq(r.engine.ok, false, "engine verdict")
    t:match(r.engine.detail, "^container engine at " .. path:gsub("%p", "%%%0") .. " is not answering ", "engine detail")
    t:match(r.engine.fix, "podman system service", "engine fix")
    t:match(r.engine.fix, "remove the stale socket file", "engine fix")
  end)
end

function tests.config_errors_and_missing_allowed_paths_are_problems(t)
  local d <close> = tmpdir()
  with_env({ DEMESNE_TIMEOUT_MAX = "soon" }, function()
    local r = by_name(doctor.run())
    t:eq(r.config.ok, false)
    t:eq(r.config.detail, 'config error: timeout_max must be a number, got "soon"')
    t:match(r.config.fix, "demesne check%-config")
  end)
  with_env({ DEMESNE_ALLOWED_PATHS = d.path .. ":" .. d.path .. "/gone" }, function()
    local r = by_name(doctor.run())
    t:eq(r.config.ok, false)
    t:eq(r.config.detail, ("allowed_paths: %s/gone is not an existing folder"):format(d.path))
    t:match(r.config.fix, "DEMESNE_ALLOWED_PATHS")
  end)
  with_env({ DEMESNE_ALLOWED_PATHS = d.path, XDG_CONFIG_HOME = d.path .. "/xdg" }, function()
    local r = by_name(doctor.run())
    t:eq(r.config.ok, true, "config verdict: " .. r.config.detail)
    t:match(r.config.detail, "host inputs from " .. d.path:gsub("%p", "%%%0"))
  end)
end

function tests.folders_must_be_writable_or_creatable(t)
  local d <close> = tmpdir()
  assert(fs.chmod(d.path, tonumber("700", 8)))
  assert(fs.write_atomic(d.path .. "/afile", "x"))
  with_env({ DEMESNE_STATE_DIR = d.path .. "/afile/state", DEMESNE_OUTPUT_ROOT = d.path .. "/new/out" }, function()
    local r = by_name(doctor.run())
    t:eq(r.folders.ok, false)
    t:eq(r.folders.detail, ("state_dir %s/afile/state: %s/afile is not a folder"):format(d.path, d.path))
    t:match(r.folders.fix, "DEMESNE_STATE_DIR")
  end)
  with_env({ DEMESNE_STATE_DIR = d.path, DEMESNE_OUTPUT_ROOT = d.path .. "/new/out" }, function()
    local r = by_name(doctor.run())
    t:eq(r.folders.ok, true, "folders verdict: " .. r.folders.detail)
    t:eq(r.folders.detail, ("output_root %s/new/out (will be created under %s), state_dir %s: writable, private to "
      .. "this user"):format(d.path, d.path, d.path))
    t:eq(fs.readdir(d.path), { "afile" }, "the probe file is gone and nothing was created")
  end)
end

-- Root in a sandbox is root on the host (rootful engine): a setuid-root program it leaves in
-- its output folder must not be reachable by other users, so the roots above must be private.
function tests.folders_other_users_can_enter_fail(t)
  local d <close> = tmpdir()
  assert(fs.chmod(d.path, tonumber("755", 8)))
  with_env({ DEMESNE_STATE_DIR = d.path, DEMESNE_OUTPUT_ROOT = d.path .. "/new/out" }, function()
    local r = by_name(doctor.run())
    t:eq(r.folders.ok, false)
    t:match(r.folders.detail, "^state_dir " .. d.path:gsub("%p", "%%%0") .. " can be entered by other users %(mode 755%)")
    t:match(r.folders.detail, "setuid%-root")
    t:match(r.folders.fix, "chmod 700")
    t:eq(fs.readdir(d.path), {}, "doctor creates nothing")
  end)
end

function tests.demesne_init_must_be_a_static_executable(t)
  with_env({ DEMESNE_INIT = "/bin/sh" }, function()
    local r = by_name(doctor.run())
    t:eq(r["demesne-init"].ok, false)
    t:match(r["demesne-init"].detail, "^/bin/sh is dynamically linked")
    t:match(r["demesne-init"].fix, "static")
  end)
  local d <close> = tmpdir()
  assert(fs.write_atomic(d.path .. "/init", "#!/bin/sh\n"))
  assert(fs.chmod(d.path .. "/init", tonumber("755", 8)))
  with_env({ DEMESNE_INIT = d.path .. "/init" }, function()
    local r = by_name(doctor.run())
    t:eq(r["demesne-init"].detail, d.path .. "/init: not an ELF executable")
  end)
  with_env({ DEMESNE_INIT = d.path .. "/missing" }, function()
    local r = by_name(doctor.run())
    t:eq(r["demesne-init"].detail, ("demesne-init not found at %s/missing (set DEMESNE_INIT)"):format(d.path))
    t:match(r["demesne-init"].fix, "/usr/libexec/demesne")
  end)
end

function tests.demesne_init_beside_the_binary_passes(t)
  -- the build tree: build/demesne-init beside build/demesne
  local beside = config.init_candidates()[1]
  if not fs.stat(beside) then error("no demesne-init beside the binary under test: " .. beside, 0) end
  with_env({ DEMESNE_INIT = false }, function()
    local r = by_name(doctor.run())
    t:eq(r["demesne-init"].ok, true, "demesne-init verdict: " .. r["demesne-init"].detail)
    t:eq(r["demesne-init"].detail, beside .. " (static)")
  end)
end

function tests.demesne_init_is_looked_for_beside_the_binary_then_in_libexec(t)
  local exe = assert(loop.exepath())
  local dir = exe:gsub("/[^/]*$", "")
  local c = config.init_candidates()
  t:eq(#c, 2, "two places")
  t:eq(c[1], dir .. "/demesne-init")
  t:eq(loop.libexec_dir, "../libexec/demesne", "the default GNUInstallDirs layout")
  t:eq(c[2], dir:gsub("/[^/]*$", "") .. "/libexec/demesne/demesne-init")
end

-- images.readiness, the images check's answer, without an engine to build in: an engine
-- object that knows only which references exist (the check never builds or pulls).
function tests.images_are_ready_when_built_or_buildable_without_a_registry(t)
  local images = require("demesne.images")
  local present = {}
  local eng = { socket = "doctor-test-" .. hex(loop.random(4)),
    image_inspect = function(_, ref) return present[ref] and { Id = ref } or nil end }
  local d <close> = tmpdir()
  local path = os.getenv("PATH")
  local ok, err = pcall(function()
    loop.setenv("PATH", d.path) -- no mmdebstrap here
    local st, reason, fix = images.readiness(eng, "default")
    t:eq(st, nil, "nothing built, nothing to build with")
    t:match(reason, "^image default is not built, no Debian root filesystem image is in the engine, and mmdebstrap is "
      .. "not installed")
    t:match(fix, "^apt%-get install mmdebstrap, then `demesne images build`")
    assert(fs.write_atomic(d.path .. "/mmdebstrap", "#!/bin/sh\nexit 1\n"))
    assert(fs.chmod(d.path .. "/mmdebstrap", tonumber("755", 8)))
    st = images.readiness(eng, "default")
    t:eq(st and st.state, "buildable", "buildable with mmdebstrap")
    t:eq(st and st.mmdebstrap, d.path .. "/mmdebstrap")
    present["demesne/debian-rootfs:bookworm"] = true
    t:eq(images.readiness(eng, "default"), { state = "buildable", from = "demesne/debian-rootfs:bookworm" })
    st, reason, fix = images.readiness(eng, "example/own:1")
    t:eq(st, nil, "an image neither built-in nor present is not ready")
    t:eq(reason, 'image "example/own:1" is neither built-in nor present in the engine')
    t:match(fix, "set default_image to a built%-in image")
    present["example/own:1"] = true
    t:eq(images.readiness(eng, "example/own:1"), { state = "built", ref = "example/own:1" })
  end)
  loop.setenv("PATH", path)
  if not ok then error(err, 0) end
end

-- The gvisor and userns checks read what the engine offers (its adapter's probe, tested on
-- recorded engine answers in engines_test.lua); here an engine whose probe returns facts.
local function check(name)
  for _, c in ipairs(doctor.CHECKS) do
    if c.name == name then return c.run end
  end
end

local function engine_with(facts) return { probe = function() return facts end } end

local GVISOR = { ok = true, detail = "Docker runtime runsc: /usr/bin/runsc --network=none --host-uds=open" }
local NO_GVISOR = { ok = false, detail = "Docker has no runtime named runsc (it has runc)", fix = "register it" }

function tests.gvisor_is_reported_and_a_problem_only_when_it_is_the_default(t)
  with_env({}, function()
    local r = check("gvisor")({ engine = engine_with({ engine = "docker", gvisor = GVISOR }) })
    t:eq({ r.ok, r.detail }, { true, "available (isolation gvisor): " .. GVISOR.detail }, "available")
    r = check("gvisor")({ engine = engine_with({ engine = "docker", gvisor = NO_GVISOR }) })
    t:eq({ r.ok, r.detail }, { true, "not available, so calls that ask for isolation gvisor fail: Docker has no runtime "
      .. "named runsc (it has runc) (to offer it: register it)" }, "missing, and not the default: said, not a problem")
    t:eq(check("gvisor")({}).skip, "needs an engine", "no engine")
  end)
  with_env({ DEMESNE_ISOLATION = "gvisor" }, function()
    local r = check("gvisor")({ engine = engine_with({ engine = "docker", gvisor = NO_GVISOR }) })
    t:eq({ r.ok, r.detail, r.fix }, { false, "isolation_default is gvisor but gVisor is not available: " .. NO_GVISOR.detail,
      "register it; or set isolation_default back to container" }, "missing while it is the default: a problem")
    r = check("gvisor")({ engine = engine_with({ engine = "docker", gvisor = GVISOR }) })
    t:match(r.detail, "sandboxes use it unless a call says otherwise$", "the default")
  end)
end

function tests.userns_says_which_mode_is_in_effect(t)
  with_env({}, function()
    local r = check("userns")({ engine = engine_with({ engine = "docker", gvisor = NO_GVISOR,
      userns_detail = "Docker without userns-remap: uid 0 in a sandbox is uid 0 on the host" }) })
    t:eq({ r.ok, r.detail }, { true, "not available: Docker without userns-remap: uid 0 in a sandbox is uid 0 on the host" },
      "Docker without remap")
    r = check("userns")({ engine = engine_with({ engine = "docker", gvisor = GVISOR, userns = "remap",
      userns_detail = "Docker's userns-remap is on: uid 0 in a sandbox is uid 231072 on the host" }) })
    t:eq(r.detail, "on: Docker's userns-remap is on: uid 0 in a sandbox is uid 231072 on the host", "remap")
  end)
  with_env({ DEMESNE_USERNS = "0" }, function()
    local r = check("userns")({ engine = engine_with({ engine = "podman", gvisor = NO_GVISOR, userns = "auto" }) })
    t:match(r.detail, "^off %(userns = false in the configuration%): uid 0 in a sandbox is uid 0 on the host", "off")
  end)
end

return tests
