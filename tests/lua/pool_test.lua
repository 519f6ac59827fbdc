-- lua/pool.lua on the fake engine (tests/fixtures/engines/fake.lua, which models
-- demesne-init's control socket with a real unix socket): warm sandboxes are made by the
-- same code as fresh ones, claimed once and never again, replaced when they die, and a
-- call that finds none ready makes a fresh one. The same properties are checked on the
-- real engines by tests/integration/pool.test.mjs.
local async = require("demesne.async")
local pool = require("demesne.pool")
local sandbox = require("demesne.sandbox")
local teardown = require("demesne.teardown")
local fs = require("core.fs")
local loop = require("core.loop")

local scratch = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/world.lua")
local IMAGE = scratch.IMAGE
local MiB = 1024 * 1024

local tests = {}

-- A scratch world on the fake engine with the pool started (pool_images = the fake image);
-- closing it stops the pool, waits for the removals and restores everything.
local function world(extra_env)
  local env = { DEMESNE_POOL_SIZE = "2", DEMESNE_POOL_IMAGES = IMAGE }
  for k, v in pairs(extra_env or {}) do env[k] = v end
  return scratch.new({
    vars = { "DEMESNE_POOL_SIZE", "DEMESNE_POOL_IMAGES", "DEMESNE_POOL_MAX", "DEMESNE_POOL_IDLE_SECONDS",
      "DEMESNE_MEMORY_MB_MAX" },
    env = env,
    on_open = function(w)
      w:record_creates()
      pool.start()
    end,
    on_close = function() pool.stop() end,
  })
end

-- Waits (at most 5 s) until the kind of `image` holds `n` warm sandboxes; returns their run ids.
local function warm(w, n, image)
  for _ = 1, 500 do
    local ids = {}
    for _, c in ipairs(w.eng:list({ "io.demesne.pool" })) do
      local rid = c.labels["io.demesne.run_id"]
      if c.state == "running" and fs.stat(w.dir .. "/state/pool/" .. rid)
        and (not image or c.labels["io.demesne.image"] == image) then ids[#ids + 1] = rid end
    end
    local ready = 0
    for _, k in ipairs(pool.status()) do
      if not image or k.image == image then ready = ready + k.ready end
    end
    if #ids >= n and ready >= n then
      table.sort(ids)
      return ids
    end
    async.sleep(10)
  end
  error(("the pool never held %d warm sandboxes: %s"):format(n, require("demesne.json").encode(pool.status())))
end

local function set(list)
  local s = {}
  for _, x in ipairs(list) do s[x] = true end
  return s
end

function tests.a_call_takes_a_warm_sandbox_made_exactly_like_a_fresh_one(t)
  local w <close> = world()
  local ids = set(warm(w, 2))
  local creates = #w.specs
  local r = sandbox.run_script(nil, { image = IMAGE, env = { GREETING = "hi" },
    command = 'printf "%s|%s|" "$GREETING" "$DEMESNE_RUN_ID"; pwd; echo x > /out/f' })
  t:ok(ids[r.run_id], "the call ran in a warm sandbox")
  t:eq(r.stdout, "hi|" .. r.run_id .. "|/out\n", "the caller's env and its own run id reached the command, in /out")
  t:eq(fs.read_file(r.output_dir .. "/f"), "x\n", "its own /out")
  t:eq(r.output_dir, w.dir .. "/out/" .. r.run_id, "output_dir")
  t:eq(fs.stat(w.dir .. "/state/pool/" .. r.run_id), nil, "no longer marked unclaimed")
  local s
  for i = 1, creates do
    if w.specs[i].labels["io.demesne.run_id"] == r.run_id then s = w.specs[i] end
  end
  t:eq({ s.labels["io.demesne.kind"], s.labels["io.demesne.tool"], s.labels["io.demesne.egress"] },
    { "oneshot", "sandbox_script", "package-managers" }, "the labels of a one-shot run")
  t:eq(s.limits, { memory_bytes = 2048 * MiB, cpus = 2, pids = 1024 }, "the default limits")
  t:eq(s.command, { "wait", "--control", "/.demesne/run/init.sock", "--relay", "3128=/.demesne/run/egress.sock" },
    "the same demesne-init wait as a fresh run")
  for _, e in ipairs(s.env) do t:ok(not e:match("^GREETING="), "the fill knew nothing of the call's env") end
  t:ok(teardown.wait(5000), "removed after the answer")
  t:eq(w.eng:inspect("demesne-" .. r.run_id), nil, "the claimed container is gone")
  t:eq(fs.stat(w.dir .. "/state/run/" .. r.run_id), nil, "and its run folder")
  t:eq(fs.read_file(r.output_dir .. "/stdout.log") ~= nil, true, "its output folder stays")
  warm(w, 2) -- refilled
end

function tests.no_warm_sandbox_is_handed_out_twice(t)
  local w <close> = world()
  local seen, runs = {}, {}
  for i = 1, 6 do
    if i % 2 == 1 then warm(w, 2) end
    local r = sandbox.run_script(nil, { image = IMAGE, command = "test -e /tmp/used && echo REUSED; touch /tmp/used" })
    t:eq(r.stdout, "", "a fresh filesystem in call " .. i)
    t:ok(not seen[r.run_id], "a new sandbox in call " .. i)
    seen[r.run_id] = true
    runs[#runs + 1] = r.run_id
  end
  local created = {}
  for _, s in ipairs(w.specs) do
    local rid = s.labels["io.demesne.run_id"]
    t:ok(not created[rid], "each sandbox was created once")
    created[rid] = true
  end
  for _, rid in ipairs(runs) do t:ok(created[rid], "ran in a sandbox the pool or the call created") end
end

function tests.a_warm_sandbox_that_dies_is_replaced(t)
  local w <close> = world()
  local ids = warm(w, 2)
  local victim = ids[1]
  assert(w.eng:remove("demesne-" .. victim))
  local after
  for _ = 1, 500 do
    after = set(warm(w, 2))
    if not after[victim] then break end
    async.sleep(10)
  end
  t:ok(not after[victim], "the dead one is no longer offered")
  t:eq(#w.specs, 3, "one more was made in its place")
  t:ok(teardown.wait(5000), "its cleanup finished")
  t:eq({ fs.stat(w.dir .. "/out/" .. victim) == nil, fs.stat(w.dir .. "/state/run/" .. victim) == nil,
    fs.stat(w.dir .. "/state/pool/" .. victim) == nil }, { true, true, true },
    "its output folder, run folder and marker are gone")
  local r = sandbox.run_script(nil, { image = IMAGE, command = "echo ok" })
  t:eq(r.stdout, "ok\n", "a call works")
  t:ok(r.run_id ~= victim, "and did not get the dead one")
end

function tests.a_call_that_finds_the_pool_empty_makes_a_fresh_sandbox(t)
  local w <close> = world({ DEMESNE_POOL_SIZE = "1" })
  local ids = set(warm(w, 1))
  local a = async.spawn("a", sandbox.run_script, nil, { image = IMAGE, command = "sleep 0.2; echo a" })
  local b = async.spawn("b", sandbox.run_script, nil, { image = IMAGE, command = "sleep 0.2; echo b" })
  local _, ra = a:wait()
  local _, rb = b:wait()
  t:eq({ ra.stdout, rb.stdout }, { "a\n", "b\n" }, "both answered")
  t:ok(ids[ra.run_id] ~= ids[rb.run_id], "one warm, one fresh: " .. ra.run_id .. " " .. rb.run_id)
end

function tests.a_kind_whose_calls_find_it_empty_grows_up_to_pool_max(t)
  local w <close> = world({ DEMESNE_POOL_SIZE = "1", DEMESNE_POOL_MAX = "3" })
  warm(w, 1)
  local tasks = {}
  for i = 1, 4 do tasks[i] = async.spawn("c" .. i, sandbox.run_script, nil, { image = IMAGE, command = "sleep 0.1" }) end
  for i = 1, 4 do tasks[i]:wait() end
  t:eq(pool.status()[1].target, 3, "three misses raised the target from 1 to pool_max (3), not beyond")
  t:eq(#warm(w, 3), 3, "and the kind fills to it: three warm sandboxes wait")
end

function tests.limits_and_egress_of_a_warm_sandbox_are_the_calls(t)
  local w <close> = world({ DEMESNE_MEMORY_MB_MAX = "4096" })
  local args = { image = IMAGE, egress = "none", limits = { memory_mb = 256, cpus = 1.5, pids = 100 },
    command = 'printf "%s" "$HTTPS_PROXY"' }
  local first = sandbox.run_script(nil, args) -- teaches the pool this kind
  warm(w, 2)
  local warm_ids = {}
  for _, c in ipairs(w.eng:list({ "io.demesne.pool" })) do
    if c.labels["io.demesne.egress"] == "none" then warm_ids[c.labels["io.demesne.run_id"]] = true end
  end
  local r = sandbox.run_script(nil, args)
  t:ok(warm_ids[r.run_id], "the second call of that kind took a warm sandbox")
  t:ok(first.run_id ~= r.run_id, "not the first call's")
  local s
  for _, x in ipairs(w.specs) do
    if x.labels["io.demesne.run_id"] == r.run_id then s = x end
  end
  t:eq(s.limits, { memory_bytes = 256 * MiB, cpus = 1.5, pids = 100 }, "its limits are the call's")
  t:eq({ s.network, s.labels["io.demesne.egress"] }, { "none", "none" }, "its egress is the call's")
  t:eq(r.stdout, "http://127.0.0.1:3128", "the proxy settings of its policy")
  local other = sandbox.run_script(nil, { image = IMAGE, command = "true", limits = { memory_mb = 512 } })
  local o
  for _, x in ipairs(w.specs) do
    if x.labels["io.demesne.run_id"] == other.run_id then o = x end
  end
  t:eq(o.limits.memory_bytes, 512 * MiB, "a call of another kind never gets a sandbox of this one")
  assert(fs.write_atomic(w.dir .. "/host/data.txt", "x"))
  local inputs = sandbox.run_script(nil, { image = IMAGE, egress = "none", command = "true",
    limits = { memory_mb = 256, cpus = 1.5, pids = 100 }, files = { w.dir .. "/host/data.txt" } })
  t:eq(#w.specs[#w.specs].mounts > 3 and w.specs[#w.specs].labels["io.demesne.run_id"], inputs.run_id,
    "a call with host inputs is never pooled: its own create, with its mounts")
end

function tests.stopping_the_pool_removes_every_warm_sandbox(t)
  local w <close> = world()
  local ids = warm(w, 2)
  pool.stop()
  t:ok(teardown.wait(5000), "removals finished")
  t:eq(#w.eng:list({ "io.demesne.pool" }), 0, "no warm sandbox is left")
  for _, id in ipairs(ids) do
    t:eq({ fs.stat(w.dir .. "/out/" .. id) == nil, fs.stat(w.dir .. "/state/run/" .. id) == nil,
      fs.stat(w.dir .. "/state/pool/" .. id) == nil }, { true, true, true }, "nothing of " .. id .. " is left")
  end
  local r = sandbox.run_script(nil, { image = IMAGE, command = "echo fresh" })
  t:eq(r.stdout, "fresh\n", "calls still work without the pool")
end

function tests.the_reaper_removes_a_dead_servers_warm_sandboxes_and_their_folders(t)
  local w <close> = world({ DEMESNE_POOL_SIZE = "0" })
  local dead = ("%s/999999999/1"):format(loop.hostname())
  local function make(name, claimed)
    local run_dir, out = w.dir .. "/state/run/" .. name, w.dir .. "/out/" .. name
    assert(fs.mkdir_p(run_dir, 493))
    assert(fs.mkdir_p(out, 493))
    assert(fs.write_atomic(out .. "/result.txt", "kept\n"))
    assert(fs.mkdir_p(w.dir .. "/state/pool", 448))
    if not claimed then assert(fs.write_atomic(w.dir .. "/state/pool/" .. name, "warm\n")) end
    local id = assert(w.eng:create({ name = "demesne-" .. name, image = IMAGE, entrypoint = { "/bin/sh", "-c", "sleep 60" },
      labels = { ["io.demesne.managed"] = "1", ["io.demesne.kind"] = "oneshot", ["io.demesne.pool"] = "abc",
        ["io.demesne.run_id"] = name, ["io.demesne.owner"] = dead, ["io.demesne.run_dir"] = run_dir,
        ["io.demesne.output_dir"] = out, ["io.demesne.expires_at"] = tostring(math.floor(loop.time()) + 600) } }))
    assert(w.eng:start(id))
  end
  make("warm-one", false)
  make("claimed-one", true)
  t:eq(sandbox.reap(), 2, "both containers of the dead server are removed")
  t:eq({ fs.stat(w.dir .. "/out/warm-one") == nil, fs.stat(w.dir .. "/state/pool/warm-one") == nil }, { true, true },
    "an unclaimed warm sandbox leaves no output folder and no marker")
  t:eq(fs.read_file(w.dir .. "/out/claimed-one/result.txt"), "kept\n", "a claimed one's output is a call's: kept")
  -- a warm sandbox whose container is already gone: its folders, claimed by the dead server
  assert(fs.mkdir_p(w.dir .. "/state/run/gone-one", 493))
  assert(fs.mkdir_p(w.dir .. "/out/gone-one", 493))
  assert(fs.write_atomic(w.dir .. "/state/pool/gone-one", "warm\n"))
  assert(fs.mkdir_p(w.dir .. "/state/claims", 448))
  assert(fs.write_atomic(w.dir .. "/state/claims/gone-one", require("demesne.json").encode({ engine = w.eng.socket,
    owner = dead })))
  sandbox.reap()
  t:eq({ fs.stat(w.dir .. "/state/run/gone-one") == nil, fs.stat(w.dir .. "/out/gone-one") == nil,
    fs.stat(w.dir .. "/state/pool/gone-one") == nil }, { true, true, true },
    "its run folder, its empty output folder and its marker go with the leftovers")
end

return tests
