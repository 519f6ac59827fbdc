-- The engine adapter contract (docs/reference/engines.md): the tests every adapter must
-- pass. Not a test file itself: a runner file calls it with a fixture function that
-- returns {engine = <adapter>, image = <an image with /bin/sh>}.
--   tests/lua/engine_contract_fake_test.lua   the fake engine (CTest, every build)
--   tests/lua/engine_contract_live.lua        the engine at DEMESNE_ENGINE (Podman and Docker,
--                                             through tests/integration/engine-contract.test.mjs)
-- Each test makes its own containers, labelled io.demesne.contract=<random>, and removes
-- them; it sees no other container on the engine.
local archive = require("core.archive")
local async = require("demesne.async")
local fs = require("core.fs")
local loop = require("core.loop")

local function hex(n) return (loop.random(n):gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local MiB = 1024 * 1024
local WAIT_MS = 60000 -- a bound against a hang, not a timing assertion

-- A test's world: the adapter, a scratch host folder, and the containers it made (removed,
-- with the folder, when the test ends).
local function world(fixture)
  local f = fixture()
  local dir = os.tmpname()
  os.remove(dir)
  assert(fs.mkdir_p(dir .. "/out", 493))
  assert(fs.chmod(dir .. "/out", 511)) -- 0777: a container user other than root writes there too
  local w = { eng = f.engine, image = f.image, dir = dir, tag = hex(6), made = {}, n = 0 }
  -- An engine that shares no host folder (Kubernetes) gets /out as a tmpfs, and the tests
  -- read what the container wrote there through exec instead of on the host.
  w.shared = f.engine.capabilities.bind_mounts
  --- A spec with every field set; `over` replaces fields.
  function w.spec(over)
    w.n = w.n + 1
    local s = {
      name = ("demesne-contract-%s-%d"):format(w.tag, w.n),
      image = w.image,
      entrypoint = { "/bin/sh", "-c" },
      command = { "sleep 60" },
      env = { "A=1", "B=2" },
      workdir = "/out",
      hostname = "contract",
      labels = { ["io.demesne.contract"] = w.tag, ["io.demesne.n"] = tostring(w.n) },
      mounts = w.shared and { { source = dir .. "/out", target = "/out", mode = "rw" } } or nil,
      tmpfs = { { target = "/tmp", mode = "1777", exec = true },
        not w.shared and { target = "/out", mode = "0777", exec = false } or nil },
      limits = { memory_bytes = 256 * MiB, cpus = 0.5, pids = 64 },
      network = "none",
      read_only_rootfs = true,
      security = { no_new_privileges = true, cap_drop = { "NET_RAW" } },
    }
    for k, v in pairs(over or {}) do s[k] = v end
    return s
  end
  --- Creates a container from spec(over), remembered for removal; returns its id and spec.
  function w.create(over)
    local s = w.spec(over)
    local id, err, code = w.eng:create(s)
    assert(id, ("create: %s (%s)"):format(tostring(err), tostring(code)))
    w.made[#w.made + 1] = id
    return id, s
  end
  --- Creates and starts one.
  function w.run(over)
    local id, s = w.create(over)
    assert(w.eng:start(id))
    return id, s
  end
  --- Runs a sh script in a running container; returns its exit code.
  function w.sh(id, script, opts)
    return w.eng:exec(id, { "/bin/sh", "-c", script }, opts)
  end
  --- A file of the scratch folder, or nil.
  function w.read(rel)
    return fs.read_file(dir .. "/" .. rel)
  end
  --- Whether the file /out/<name> of running container `id` holds `want`: read on the host
  --- where /out is shared, else compared inside by exec (trailing line breaks aside).
  function w.holds(id, name, want)
    if w.shared then return w.read("out/" .. name) == want end
    local quoted = "'" .. want:gsub("\n+$", ""):gsub("'", "'\\''") .. "'"
    return w.sh(id, ('test "$(cat /out/%s)" = %s'):format(name, quoted)) == 0
  end
  return setmetatable(w, { __close = function()
    for _, id in ipairs(w.made) do w.eng:remove(id) end
    -- an adapter that keeps something running between calls (the Kubernetes adapter's
    -- Lease renewal) stops it in its optional close(); the next create starts it again
    if w.eng.close then w.eng:close() end
    fs.remove_tree(dir)
  end })
end

-- Runs fn in a task of its own, bounded by WAIT_MS; returns what it returned.
local function bounded(fn)
  return async.timeout(WAIT_MS, fn)
end

return function(fixture)
  local tests = {}

  function tests.info_names_the_engine(t)
    local w <close> = world(fixture)
    local i = t:ok(w.eng:info(), "info")
    t:eq(type(i.name), "string", "info.name")
    t:eq(type(i.version), "string", "info.version")
  end

  function tests.capabilities_are_declared(t)
    local w <close> = world(fixture)
    local caps = w.eng.capabilities
    t:eq(type(caps), "table", "capabilities")
    for _, k in ipairs({ "bind_mounts", "unix_socket_mounts", "tmpfs", "read_only_rootfs", "bounded_logs", "userns",
      "snapshots", "pause" }) do
      t:eq(type(caps[k]), "boolean", "capabilities." .. k)
    end
    t:eq(caps.networks.none, true, "every adapter offers network none (the egress enforcement)")
    t:eq(type(caps.runtimes), "table", "capabilities.runtimes")
  end

  function tests.a_created_container_is_inspected_listed_and_removed(t)
    local w <close> = world(fixture)
    local id, s = w.create()
    t:eq(type(id), "string", "create returns an id")
    for _, ref in ipairs({ id, s.name }) do
      local i = t:ok(w.eng:inspect(ref), "inspect " .. ref)
      t:eq(i.id, id, "info.id")
      t:eq(i.name, s.name, "info.name (no leading /)")
      t:eq(i.state, "created", "info.state")
      t:eq(i.exit_code, nil, "no exit code before it ran")
      for k, v in pairs(s.labels) do t:eq(i.labels[k], v, "info.labels." .. k) end
      t:eq(i.limits, s.limits, "info.limits")
      t:ok(i.image == s.image or i.image:sub(-#s.image - 1) == "/" .. s.image, "info.image names " .. s.image)
    end
    local list = t:ok(w.eng:list({ "io.demesne.contract=" .. w.tag }), "list")
    t:eq(#list, 1, "one container with the label")
    t:eq({ list[1].id, list[1].name, list[1].state, list[1].labels["io.demesne.n"] }, { id, s.name, "created", "1" },
      "summary")
    t:eq(w.eng:remove(id), true, "remove")
    local none, msg, code = w.eng:inspect(id)
    t:eq({ none, code }, { nil, "ENOENT" }, "inspect after remove")
    t:eq(type(msg), "string", "a message")
    t:eq({ w.eng:remove(id) }, { true, "gone" }, "removing again")
    t:eq(#t:ok(w.eng:list({ "io.demesne.contract=" .. w.tag })), 0, "listed no more")
  end

  function tests.list_matches_every_label_filter(t)
    local w <close> = world(fixture)
    local a = w.create({ labels = { ["io.demesne.contract"] = w.tag, ["io.demesne.x"] = "1" } })
    local b = w.create({ labels = { ["io.demesne.contract"] = w.tag, ["io.demesne.x"] = "2" } })
    local function ids(filters)
      local out = {}
      for _, c in ipairs(t:ok(w.eng:list(filters))) do out[#out + 1] = c.id end
      table.sort(out)
      return out
    end
    local both = { a, b }
    table.sort(both)
    t:eq(ids({ "io.demesne.contract=" .. w.tag }), both, "by one label")
    t:eq(ids({ "io.demesne.contract=" .. w.tag, "io.demesne.x=2" }), { b }, "by two labels")
    t:eq(ids({ "io.demesne.contract=" .. w.tag, "io.demesne.x" }), both, "by a key alone")
    t:eq(ids({ "io.demesne.contract=" .. w.tag, "io.demesne.x=3" }), {}, "no match")
  end

  function tests.stats_report_the_memory_a_running_container_uses(t)
    local w <close> = world(fixture)
    if not w.eng.stats or not w.shared then return end -- optional (docs/reference/engines.md)
    local big = 8 * MiB
    assert(fs.write_atomic(w.dir .. "/out/big", ("x"):rep(big), 420))
    local id = w.run()
    local before = t:ok(w.eng:stats(id), "stats")
    t:eq(math.type(before.memory_bytes), "integer", "memory_bytes: an integer")
    t:ok(before.memory_bytes > 0, ("a running container uses some memory (%s bytes)"):format(before.memory_bytes))
    t:eq(w.sh(id, "cat /out/big > /tmp/big"), 0, "8 MiB into its tmpfs (memory)")
    local after = t:ok(w.eng:stats(id), "stats again")
    t:ok(after.memory_bytes >= before.memory_bytes + big // 2,
      ("its tmpfs counts: %d bytes before, %d after"):format(before.memory_bytes, after.memory_bytes))
    t:ok(after.memory_bytes <= 256 * MiB, "within its limit")
    local none, msg, code = w.eng:stats("demesne-contract-none-" .. w.tag)
    t:eq({ none, code }, { nil, "ENOENT" }, "stats of no container")
    t:eq(type(msg), "string", "a message")
  end

  function tests.a_taken_name_is_ECONFLICT(t)
    local w <close> = world(fixture)
    local _, s = w.create()
    local id, msg, code = w.eng:create(w.spec({ name = s.name }))
    if id then w.made[#w.made + 1] = id end
    t:eq({ id, code }, { nil, "ECONFLICT" }, "second create")
    t:eq(type(msg), "string", "a message")
  end

  function tests.a_missing_image_is_ENOENT(t)
    local w <close> = world(fixture)
    local id, _, code = w.eng:create(w.spec({ image = "demesne/no-such-image:contract-" .. w.tag }))
    if id then w.made[#w.made + 1] = id end
    t:eq({ id, code }, { nil, "ENOENT" }, "create")
    local img, _, icode = w.eng:image_inspect("demesne/no-such-image:contract-" .. w.tag)
    t:eq({ img, icode }, { nil, "ENOENT" }, "image_inspect")
    local found = t:ok(w.eng:image_inspect(w.image), "image_inspect of the fixture's image")
    t:eq(type(found.id), "string", "image.id")
    t:eq(type(found.labels), "table", "image.labels")
  end

  function tests.a_spec_it_cannot_honour_is_refused_not_weakened(t)
    local w <close> = world(fixture)
    local cases = {
      { { network = "host" }, "EINVAL", "spec%.network" },
      { { privileged = true }, "EINVAL", "spec%.privileged: unknown field" },
      { { mounts = { { source = w.dir .. "/out", target = "/out", mode = "rwx" } } }, "EINVAL", "spec%.mounts%[1%]%.mode" },
      { { limits = { memory_bytes = 0 } }, "EINVAL", "spec%.limits%.memory_bytes" },
    }
    for _, c in ipairs(cases) do
      local id, msg, code = w.eng:create(w.spec(c[1]))
      if id then w.made[#w.made + 1] = id end
      t:eq({ id, code }, { nil, c[2] }, "create with " .. next(c[1]))
      t:match(msg, c[3], "message")
    end
  end

  function tests.start_and_wait_give_the_exit_code(t)
    local w <close> = world(fixture)
    -- where /out is not shared it is gone with the container: the exit code tells the folder
    local id = w.run({ command = { w.shared and "pwd > /out/main; exit 7" or '[ "$(pwd)" = /out ] || exit 1; exit 7' } })
    t:eq(w.eng:start(id), true, "a second start is success")
    t:eq(bounded(function() return w.eng:wait(id) end), 7, "wait")
    local i = t:ok(w.eng:inspect(id))
    t:eq({ i.state, i.exit_code }, { "exited", 7 }, "inspect after the end")
    if w.shared then t:eq(w.read("out/main"), "/out\n", "the main process ran in the spec's workdir with /out mounted") end
  end

  function tests.exec_gets_the_container_env_plus_its_own(t)
    local w <close> = world(fixture)
    local id = w.run()
    t:eq(t:ok(w.eng:inspect(id)).state, "running", "running")
    t:eq(w.sh(id, 'printf "%s %s %s" "$A" "$B" "$C" > /out/env; pwd > /out/pwd', { env = { "B=exec", "C=3" } }), 0,
      "exec")
    t:eq(w.holds(id, "env", "1 exec 3"), true, "container env, the exec's env winning")
    t:eq(w.holds(id, "pwd", "/out\n"), true, "the container's workdir by default")
    t:eq(w.sh(id, "pwd > /out/pwd2", { workdir = "/tmp" }), 0, "exec in /tmp")
    t:eq(w.holds(id, "pwd2", "/tmp\n"), true, "opts.workdir")
    t:eq(w.sh(id, "exit 5"), 5, "the exit code")
  end

  function tests.user_runs_the_processes(t)
    local w <close> = world(fixture)
    local id = w.run({ user = "1000" })
    t:eq(w.sh(id, "id -u > /out/uid"), 0, "exec")
    t:eq(w.holds(id, "uid", "1000\n"), true, "the spec's user by default")
    if w.eng.capabilities.exec_user == false then
      local code, msg, ecode = w.eng:exec(id, { "id", "-u" }, { user = "0" })
      t:eq({ code, ecode }, { nil, "ENOTSUP" }, "exec as 0 where capability exec_user is false")
      t:match(msg, "opts%.user", "the message names opts.user")
      t:eq(w.sh(id, "id -u > /out/uid1", { user = "1000" }), 0, "exec as the container's own user")
      return
    end
    t:eq(w.sh(id, "id -u > /out/uid0", { user = "0" }), 0, "exec as 0")
    t:eq(w.holds(id, "uid0", "0\n"), true, "opts.user")
  end

  function tests.mounts_keep_their_modes(t)
    local w <close> = world(fixture)
    assert(fs.mkdir_p(w.dir .. "/in", 493))
    if not w.shared then
      local id, msg, code = w.eng:create(w.spec({ mounts = { { source = w.dir .. "/in", target = "/in", mode = "ro" } } }))
      if id then w.made[#w.made + 1] = id end
      t:eq({ id, code }, { nil, "ENOTSUP" }, "an engine without bind_mounts refuses a host folder")
      t:match(msg, "spec%.mounts%[1%]", "naming the mount")
      return
    end
    assert(fs.write_atomic(w.dir .. "/in/data.txt", "host data\n"))
    local spec = w.spec()
    spec.mounts[#spec.mounts + 1] = { source = w.dir .. "/in", target = "/in/data", mode = "ro" }
    local id = w.run({ mounts = spec.mounts })
    t:eq(w.sh(id, "cat /in/data/data.txt > /out/copy"), 0, "read a read-only mount")
    t:eq(w.read("out/copy"), "host data\n", "its content")
    t:ok(w.sh(id, "echo changed > /in/data/data.txt") ~= 0, "writing a read-only mount fails")
    t:eq(w.read("in/data.txt"), "host data\n", "the host file is unchanged")
    t:eq(w.sh(id, "echo new > /out/new"), 0, "write a read-write mount")
    t:eq(w.read("out/new"), "new\n", "the host sees it")
  end

  function tests.root_is_read_only_tmpfs_is_not(t)
    local w <close> = world(fixture)
    local id = w.run()
    t:ok(w.sh(id, "touch /etc/contract") ~= 0, "the read-only root refuses a write")
    t:eq(w.sh(id, "touch /tmp/contract && test -f /tmp/contract"), 0, "the tmpfs takes one")
    local rw = w.run({ read_only_rootfs = false })
    t:eq(w.sh(rw, "touch /etc/contract"), 0, "a writable root")
  end

  function tests.network_none_has_only_loopback(t)
    local w <close> = world(fixture)
    local id = w.run()
    if w.eng.capabilities.network_none == "policy" then
      -- every Pod has a network interface: "none" is a deny-all NetworkPolicy, and no default
      -- route (what demesne doctor checks the cluster for); a route to 0.0.0.0/0 is a way out
      t:eq(w.sh(id, "cat /proc/net/route > /out/route"), 0, "exec")
      t:eq(w.sh(id, [[! awk 'NR > 1 && $2 == "00000000" { found = 1 } END { exit !found }' /out/route]]), 0,
        "no default route")
      return
    end
    t:eq(w.sh(id, "cat /proc/net/dev > /out/net"), 0, "exec")
    local names = {}
    for name in (w.read("out/net") or ""):gmatch("\n%s*([%w%.%-_@]+):") do names[#names + 1] = name end
    t:eq(names, { "lo" }, "interfaces")
  end

  function tests.exec_in_a_stopped_container_is_ECONFLICT(t)
    local w <close> = world(fixture)
    local id = w.run({ command = { "exit 0" } })
    t:eq(bounded(function() return w.eng:wait(id) end), 0, "wait")
    local code, msg, ecode = w.sh(id, "true")
    t:eq({ code, ecode }, { nil, "ECONFLICT" }, "exec")
    t:eq(type(msg), "string", "a message")
    local none, _, ncode = w.sh(w.tag .. "-no-such-container", "true")
    t:eq({ none, ncode }, { nil, "ENOENT" }, "exec in a missing container")
  end

  function tests.remove_ends_a_running_container_its_wait_and_its_exec(t)
    local w <close> = world(fixture)
    local id = w.run()
    local waiting = async.spawn("wait", function() return w.eng:wait(id) end)
    local exec = async.spawn("exec", function() return w.sh(id, "sleep 60") end)
    async.sleep(500) -- let the exec start (a wait for a result that comes either way)
    t:eq(w.eng:remove(id), true, "remove")
    local r1 = { bounded(function() return waiting:wait() end) }
    local r2 = { bounded(function() return exec:wait() end) }
    t:ok(r1[1] == true, "the wait ended: " .. tostring(r1[2]))
    t:ok(r2[1] == true, "the exec ended: " .. tostring(r2[2]))
    t:ok(r2[2] ~= 0, "the exec did not succeed")
    local none, _, code = w.eng:inspect(id)
    t:eq({ none, code }, { nil, "ENOENT" }, "gone")
  end

  -- snapshots and pause: an adapter implements them or declares the capability false
  function tests.a_declared_capability_has_its_methods(t)
    local w <close> = world(fixture)
    local methods = {
      snapshots = { "commit", "image_list", "image_remove", "size", "put_archive" },
      pause = { "pause", "unpause" },
    }
    for cap, list in pairs(methods) do
      t:eq(type(w.eng.capabilities[cap]), "boolean", "capabilities." .. cap .. " is declared")
      if w.eng.capabilities[cap] then
        for _, m in ipairs(list) do t:eq(type(w.eng[m]), "function", cap .. ": method " .. m) end
      end
    end
  end

  function tests.a_commit_keeps_the_root_filesystem_and_labels(t)
    local w <close> = world(fixture)
    if not w.eng.capabilities.snapshots then return end
    local id = w.run({ read_only_rootfs = false })
    t:eq(w.sh(id, "echo kept > /etc/contract-snap"), 0, "write the root filesystem")
    local size = t:ok(w.eng:size(id), "size")
    t:ok(math.type(size.rw_bytes) == "integer" and size.rw_bytes > 0, "size.rw_bytes counts the write")
    local repo, tag = "demesne-contract/snap", w.tag
    local label = "io.demesne.contract_snap"
    local img = t:ok(w.eng:commit(id, { repo = repo, tag = tag, labels = { [label] = w.tag, ["io.demesne.n"] = "s" },
      clear_env = { "A" } }), "commit")
    t:eq(type(img), "string", "commit returns the image id")
    local _img <close> = setmetatable({}, { __close = function() w.eng:image_remove(repo .. ":" .. tag) end })
    local list = t:ok(w.eng:image_list({ label .. "=" .. w.tag }), "image_list")
    t:eq(#list, 1, "one image with the label")
    t:ok(list[1].refs[1] == repo .. ":" .. tag or list[1].refs[1]:sub(-#repo - #tag - 2) == "/" .. repo .. ":" .. tag,
      "refs names repo:tag: " .. tostring(list[1].refs[1]))
    t:eq(list[1].labels["io.demesne.n"], "s", "the commit's label wins over the container's")
    t:eq(math.type(list[1].created), "integer", "created")
    local from = w.run({ image = repo .. ":" .. tag, labels = { ["io.demesne.contract"] = w.tag }, env = { "C=3" } })
    t:eq(w.sh(from, "cat /etc/contract-snap > /out/snap"), 0, "read it in a container of the image")
    t:eq(w.read("out/snap"), "kept\n", "the committed file")
    t:eq(w.sh(from, 'printf "[%s][%s]" "$A" "$C" > /out/env'), 0, "exec")
    t:eq(w.read("out/env"), "[][3]", "clear_env: the container's A is empty in the image")
    local ok, _, code = w.eng:image_remove(repo .. ":" .. tag)
    t:eq({ ok, code }, { nil, "ECONFLICT" }, "an image a container uses is not removed")
    t:eq(w.eng:remove(from), true, "remove its container")
    t:eq(w.eng:image_remove(repo .. ":" .. tag), true, "image_remove")
    t:eq({ w.eng:image_remove(repo .. ":" .. tag) }, { true, "gone" }, "removing again")
    t:eq(#t:ok(w.eng:image_list({ label .. "=" .. w.tag })), 0, "listed no more")
  end

  function tests.put_archive_writes_a_created_containers_root(t)
    local w <close> = world(fixture)
    if not w.eng.capabilities.snapshots then return end
    local tar = w.dir .. "/in.tar"
    t:ok(archive.pack(tar, { { name = "contract-put", data = "put\n" } }), "pack")
    local id = w.create({ read_only_rootfs = false })
    t:eq(w.eng:put_archive(id, "/", tar), true, "put_archive before start")
    t:ok(w.eng:start(id), "start")
    t:eq(w.sh(id, "cat /contract-put > /out/put"), 0, "read it")
    t:eq(w.read("out/put"), "put\n", "the file")
  end

  function tests.a_paused_container_refuses_exec_until_unpaused(t)
    local w <close> = world(fixture)
    if not w.eng.capabilities.pause then return end
    local id = w.run()
    t:eq(w.eng:pause(id), true, "pause")
    t:eq(w.eng:pause(id), true, "pausing again")
    local i = t:ok(w.eng:inspect(id))
    t:eq({ i.state, i.paused }, { "running", true }, "inspect: running, paused")
    local l = t:ok(w.eng:list({ "io.demesne.contract=" .. w.tag }))
    t:eq(l[1].paused, true, "list: paused")
    local code, msg, ecode = w.sh(id, "true")
    t:eq({ code, ecode }, { nil, "ECONFLICT" }, "exec while paused")
    t:eq(type(msg), "string", "a message")
    t:eq(w.eng:unpause(id), true, "unpause")
    t:eq(w.eng:unpause(id), true, "unpausing again")
    t:eq(t:ok(w.eng:inspect(id)).paused, false, "not paused")
    t:eq(w.sh(id, "exit 3"), 3, "exec after unpause")
  end

  return tests
end
