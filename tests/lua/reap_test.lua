-- The reaper's sweep of what a killed server leaves in the state folder (sandbox.reap):
-- which run folders, expiry and claim files and temporary files go, and which stay. The
-- engine is a user adapter (engines/fake.lua in a scratch config folder) whose container
-- list the test writes; the folders are real.
local config = require("demesne.config")
local engines = require("demesne.engines")
local json = require("demesne.json")
local sandbox = require("demesne.sandbox")
local loop = require("core.loop")
local fs = require("core.fs")
local process = require("core.process")
local async = require("demesne.async")

local tests = {}

local FAKE = [[
local list = {}
return { new = function()
  local e = { socket = "/fake/engine.sock", list_value = list, removed = {},
    capabilities = { bind_mounts = true, unix_socket_mounts = true, tmpfs = true, read_only_rootfs = true,
      bounded_logs = true,
      networks = { none = true }, runtimes = {}, userns = false } }
  for _, m in ipairs({ "create", "start", "wait", "inspect", "exec", "image_inspect", "build", "import", "pull" }) do
    e[m] = function() return nil, "not in this test", "ENOTSUP" end
  end
  function e:list() return self.list_value end
  function e:remove(id)
    self.removed[#self.removed + 1] = id
    for i, c in ipairs(self.list_value) do
      if c.id == id then table.remove(self.list_value, i) break end
    end
    return true
  end
  return e
end }
]]

local function touch_old(path)
  assert(os.execute(("touch -h -d '10 days ago' '%s'"):format(path)))
end

-- Runs fn(d, state) with the fake engine as the configured one and a scratch state folder
-- under d; restores the configuration and removes d afterwards.
local function with_fake_engine(fn)
  local d = os.tmpname()
  os.remove(d)
  local state = d .. "/state"
  assert(fs.mkdir_p(d .. "/xdg/demesne/engines"))
  assert(fs.write_atomic(d .. "/xdg/demesne/engines/fake.lua", FAKE))
  loop.setenv("XDG_CONFIG_HOME", d .. "/xdg")
  loop.setenv("DEMESNE_ENGINE_ADAPTER", "fake")
  loop.setenv("DEMESNE_STATE_DIR", state)
  config.load()
  local ok, err = pcall(fn, d, state)
  loop.setenv("XDG_CONFIG_HOME", nil)
  loop.setenv("DEMESNE_ENGINE_ADAPTER", nil)
  loop.setenv("DEMESNE_STATE_DIR", nil)
  config.load()
  fs.remove_tree(d)
  if not ok then error(err, 0) end
end

function tests.leftovers_of_a_killed_server_go_and_live_folders_stay(t)
  with_fake_engine(function(d, state)
    local eng = assert(engines.get())
    local dead = loop.hostname() .. "/999999999/1"
    local function folder(id, claim, old)
      assert(fs.mkdir_p(state .. "/run/" .. id .. "/exec", 493))
      if claim then
        assert(fs.mkdir_p(state .. "/claims", 448))
        assert(fs.write_atomic(state .. "/claims/" .. id, json.encode(claim)))
      end
      if old then touch_old(state .. "/run/" .. id) end
    end
    folder("r-dead", { engine = eng.socket, owner = dead })
    folder("r-other-engine", { engine = "/elsewhere.sock", owner = dead })
    folder("r-live-owner", { engine = eng.socket, owner = sandbox.owner() })
    folder("r-container", { engine = eng.socket, owner = dead })
    folder("r-job", { engine = eng.socket, owner = dead })
    folder("r-legacy-old", nil, true)
    folder("r-legacy-young", nil, false)
    folder("r-legacy-old-unexpired", nil, true)
    assert(fs.mkdir_p(state .. "/expiry", 448))
    assert(fs.write_atomic(state .. "/expiry/r-legacy-old-unexpired", tostring(math.floor(loop.time()) + 3600)))
    assert(fs.write_atomic(state .. "/expiry/r-orphan", "1"))
    assert(fs.write_atomic(state .. "/claims/r-orphan-claim", "{}"))
    -- a link planted in a leftover folder is removed, never followed
    assert(fs.write_atomic(d .. "/outside.txt", "keep me"))
    assert(os.execute(("ln -s '%s' '%s'"):format(d .. "/outside.txt", state .. "/run/r-dead/exec/link")))
    assert(fs.mkdir_p(state .. "/jobs", 448))
    assert(fs.write_atomic(state .. "/jobs/job-20260101T000000Z-aa.json", json.encode({ job_id = "job-20260101T000000Z-aa",
      status = "running", run_dir = state .. "/run/r-job", started_ms = 1, owner = dead })))
    assert(fs.mkdir_p(state .. "/tmp", 448))
    assert(fs.write_atomic(state .. "/tmp/old.tar", "x"))
    touch_old(state .. "/tmp/old.tar")
    assert(fs.write_atomic(state .. "/tmp/new.tar", "x"))
    local list = eng.list_value
    list[1] = { id = "c1", state = "running", labels = { ["io.demesne.managed"] = "1", ["io.demesne.kind"] = "persistent",
      ["io.demesne.run_id"] = "r-container", ["io.demesne.run_dir"] = state .. "/run/r-container",
      ["io.demesne.expires_at"] = tostring(math.floor(loop.time()) + 3600) } }
    t:eq(sandbox.reap(), 0, "no container removed")
    local function has(p) return fs.lstat(state .. "/" .. p) ~= nil end
    t:eq(has("run/r-dead"), false, "a dead server's folder on this engine goes")
    t:eq(has("claims/r-dead"), false, "with its claim")
    t:eq(fs.read_file(d .. "/outside.txt"), "keep me", "a link inside it was not followed")
    t:eq(has("run/r-other-engine"), true, "another engine's folder stays")
    t:eq(has("run/r-live-owner"), true, "a live server's folder stays (it cleans up itself)")
    t:eq(has("run/r-container"), true, "a folder a container names stays")
    t:eq(has("run/r-job"), true, "a running job's folder stays")
    t:eq(has("run/r-legacy-old"), false, "an old folder without a claim goes")
    t:eq(has("run/r-legacy-young"), true, "a young folder without a claim stays")
    t:eq(has("run/r-legacy-old-unexpired"), true, "an old folder whose expiry is ahead stays")
    t:eq(has("expiry/r-orphan"), false, "an expiry file without a folder goes")
    t:eq(has("claims/r-orphan-claim"), false, "a claim without a folder goes")
    t:eq(has("tmp/old.tar"), false, "an old temporary file goes")
    t:eq(has("tmp/new.tar"), true, "a new one stays")
  end)
end

-- A server killed while it discarded a warm sandbox (container and run folder gone, the
-- output folder and marker not yet) leaves an empty output folder with its marker: the
-- sweep removes both, and leaves a marker whose run folder or container is still there.
function tests.a_warm_sandbox_discarded_half_way_leaves_no_output_folder(t)
  with_fake_engine(function(d, state)
    local out = d .. "/out"
    loop.setenv("DEMESNE_OUTPUT_ROOT", out)
    config.load()
    local ok, err = pcall(function()
      local eng = assert(engines.get())
      assert(fs.mkdir_p(state .. "/pool", 448))
      for _, id in ipairs({ "w-half", "w-filling", "w-container" }) do
        assert(fs.mkdir_p(out .. "/" .. id, 493))
        assert(fs.write_atomic(state .. "/pool/" .. id, "ready\n"))
      end
      -- a sandbox's link in its output folder is removed, never followed
      assert(fs.write_atomic(d .. "/outside.txt", "keep me"))
      assert(os.execute(("ln -s '%s' '%s'"):format(d .. "/outside.txt", out .. "/w-half/link")))
      assert(fs.mkdir_p(state .. "/run/w-filling", 493)) -- a live server is filling it
      eng.list_value[1] = { id = "c2", state = "running", labels = { ["io.demesne.managed"] = "1",
        ["io.demesne.kind"] = "oneshot", ["io.demesne.run_id"] = "w-container", ["io.demesne.owner"] = sandbox.owner(),
        ["io.demesne.expires_at"] = tostring(math.floor(loop.time()) + 3600) } }
      t:eq(sandbox.reap(), 0, "no container removed")
      local function has(p) return fs.lstat(p) ~= nil end
      t:eq(has(out .. "/w-half"), false, "the half-discarded sandbox's output folder goes")
      t:eq(has(state .. "/pool/w-half"), false, "with its marker")
      t:eq(fs.read_file(d .. "/outside.txt"), "keep me", "a link inside it was not followed")
      t:eq(has(out .. "/w-filling"), true, "a marker whose run folder is there: its folder stays")
      t:eq(has(state .. "/pool/w-filling"), true, "and its marker")
      t:eq(has(out .. "/w-container"), true, "a marker a container names: its folder stays")
    end)
    loop.setenv("DEMESNE_OUTPUT_ROOT", nil)
    if not ok then error(err, 0) end
  end)
end

-- The owner label of process `pid` (as sandbox.owner() makes it for this process).
local function owner_of(pid)
  local f = assert(io.open("/proc/" .. pid .. "/stat"))
  local s = f:read("a")
  f:close()
  local fields = {}
  for x in s:match("%) (.*)$"):gmatch("%S+") do fields[#fields + 1] = x end
  return ("%s/%d/%s"):format(loop.hostname(), pid, fields[20])
end

function tests.the_exit_reaper_waits_for_its_server_to_end_then_removes_what_it_left(t)
  with_fake_engine(function()
    local eng = assert(engines.get())
    -- the "server": a child whose stdout pipe stands for the exit reaper's stdin
    local server, pipes = assert(process.spawn({ file = "sleep", args = { "0.3" }, stdout = true }, function() end))
    local label = owner_of(server:pid())
    local function container(id, who)
      return { id = id, state = "running", labels = { ["io.demesne.managed"] = "1", ["io.demesne.kind"] = "oneshot",
        ["io.demesne.run_id"] = id, ["io.demesne.owner"] = who, ["io.demesne.expires_at"] = "9999999999" } }
    end
    eng.list_value[1] = container("c-of-the-server", label)
    eng.list_value[2] = container("c-of-a-live-server", sandbox.owner())
    local started = loop.now()
    local n, err
    local task = async.spawn("exit reaper", function() n, err = sandbox.after_exit(pipes.stdout, label, 5000, { 0, 300 }) end)
    -- a create the server sent just before it ended: the engine makes it after the first pass
    async.spawn("late create", function()
      while #eng.removed == 0 do async.sleep(10) end
      eng.list_value[#eng.list_value + 1] = container("c-made-after-the-end", label)
    end)
    task:wait()
    pipes.stdout:close()
    t:eq(err, nil, "no error")
    t:ok(server:exited(), "it ran once the server had ended")
    t:ok(loop.now() - started >= 300, "not before")
    t:eq(eng.removed, { "c-of-the-server", "c-made-after-the-end" }, "the server's containers, also the late one; "
      .. "a live server's stays")
    t:eq(n, 2, "the count of both passes")
  end)
end

return tests
