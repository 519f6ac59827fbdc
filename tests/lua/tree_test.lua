-- lua/tree on the fake engine (tests/fixtures/engines/fake.lua): roots and children, names,
-- depth, children and running limits, egress never wider than the parent's, inheritance in
-- the sandbox spec (/in, /workspace, previous jobs, /out/child read-only), scope, a parent
-- that ends taking its children, the budget counter and its "spent" reaction, results and
-- the usage report. The real endpoint is replaced by a stub that records what it is asked
-- (tests/integration/tree.test.mjs drives the real one over MCP on real engines).
local async = require("demesne.async")
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local sandbox = require("demesne.sandbox")
local tree = require("demesne.tree")
local hostmcp = require("demesne.hostmcp")
local child = require("demesne.tree.child")
local store = require("demesne.tree.store")
local egress = require("demesne.egress")
local tools = require("demesne.tools")
local fs = require("core.fs")
local loop = require("core.loop")

local scratch = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/world.lua")
local IMAGE = scratch.IMAGE
local by_target = scratch.by_target

local tests = {}

-- A scratch world on the fake engine (tests/lua/world.lua), with a stub endpoint (opened
-- and closed runs) and the create() specs by container name.
local function world(extra_env)
  local env = { DEMESNE_CHILD_IMAGES = IMAGE } -- the fake's image, named from inside
  for k, v in pairs(extra_env or {}) do env[k] = v end
  return scratch.new({
    vars = { "DEMESNE_TREE_BUDGET_USD_MAX", "DEMESNE_TREE_WAIT_SECONDS", "DEMESNE_CHILD_IMAGES" },
    env = env,
    files = { ["host/data/in.txt"] = "input\n" },
    on_open = function(w)
      tree.reset()
      w.opened, w.closed = {}, {}
      w:record_creates(true)
      tree.set_endpoint({
        open = function(n) w.opened[n.run_id] = n.endpoint.token return true end,
        close = function(id) w.closed[id] = true end,
      })
    end,
    on_close = function()
      tree.set_endpoint(nil)
      tree.reset()
    end,
  })
end

local function failure(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected a failure")
  return type(e) == "table" and e.message or tostring(e)
end

-- A root: a persistent sandbox with the endpoint (sandbox_create, mcp = true).
local function root(w, extra)
  local args = { image = IMAGE, mcp = true, directories = { w.dir .. "/host/data" } }
  for k, v in pairs(extra or {}) do args[k] = v end
  return sandbox.create(nil, args)
end

-- What a call from inside the sandbox `caller` runs: tree.spawn with the host tool's run.
local function spawn(caller, kind, args, run)
  local ctx = { listener = tree.tag(caller) }
  return tree.spawn(ctx, caller, kind, args, run or function(c, a)
    if kind == "script" then return sandbox.run_script(c, a) end
    if kind == "create" then return sandbox.create(c, a) end
    error("no run for " .. kind)
  end)
end

function tests.background_jobs_of_a_tree_are_bounded_running_and_kept(t)
  local w <close> = world()
  local r = root(w, { egress = "none", tree = { jobs = 2, job_records = 3 } })
  local id = r.sandbox_id
  local box = spawn(id, "create", { name = "box", image = IMAGE })
  local gate = async.event()
  jobs.register("tree_test", {
    start = function() error("not used") end,
    run = function(_, hold)
      if hold then gate.wait() end
      return { status = "succeeded", exit_code = 0 }
    end,
    attach = function() return { status = "lost" } end,
  })
  -- what child.lua does for a background call from inside the root: admit, then launch
  local function launch(hold)
    local _admitted <close> = tree.job_admit(id)
    return jobs.launch({ tool = "sandbox_exec", kind = "tree_test", command = "x", timeout_seconds = 60,
      output_dir = w.dir, sandbox_id = box.sandbox_id }, hold)
  end
  local a, b = launch(true), launch(true)
  t:match(failure(tree.job_admit, id), "already runs 2 background jobs, its limit %(tree%.jobs%)")
  gate.set()
  t:eq({ jobs.wait(a.job_id, 5000).status, jobs.wait(b.job_id, 5000).status }, { "succeeded", "succeeded" })
  local c = launch(false)
  t:eq(jobs.wait(c.job_id, 5000).status, "succeeded")
  -- three kept, the limit: the next one removes the tree's oldest finished record
  local d = launch(false)
  t:eq(jobs.wait(d.job_id, 5000).status, "succeeded")
  t:eq(jobs.get(a.job_id), nil, "the oldest finished record went")
  t:eq(fs.lstat(jobs.record_path(a.job_id)), nil, "its file too")
  t:eq(tree.get(id).jobs, { b.job_id, c.job_id, d.job_id })
  launch(false)
  t:eq(#tree.get(id).jobs, 3, "the kept records stay at the limit")
  t:eq(jobs.get(b.job_id), nil)
  t:match(failure(tree.limits, { jobs = 4, job_records = 2 }), "tree%.job_records: 2 is below tree%.jobs %(4%)")
  sandbox.destroy(nil, { sandbox_id = id })
end

function tests.a_root_gets_its_endpoint_workspace_and_read_only_child_folder(t)
  local w <close> = world()
  local r = root(w)
  local n = tree.get(r.sandbox_id)
  t:eq({ n.depth, n.kind, n.root, n.active }, { 0, "create", r.sandbox_id, true })
  t:ok(w.opened[r.sandbox_id], "endpoint opened")
  t:eq(r.mcp.url, "http://127.0.0.1:3130/mcp")
  t:eq(#r.mcp.token, 64)
  local spec = w.specs["demesne-" .. r.sandbox_id]
  local m = by_target(spec.mounts)
  t:eq({ m["/out/child"].source, m["/out/child"].mode }, { r.output_dir .. "/child", "ro" })
  t:eq({ m["/workspace"].source, m["/workspace"].mode }, { n.workspace, "rw" })
  for _, x in ipairs(spec.tmpfs) do t:ok(x.target ~= "/workspace", "no tmpfs at /workspace") end
  t:ok(table.concat(spec.command, " "):find("--relay 3130=/.demesne/run/mcp.sock", 1, true), "relay of the port")
  local env = table.concat(spec.env, "\n")
  t:ok(env:find("DEMESNE_MCP_URL=http://127.0.0.1:3130/mcp", 1, true), "url in env")
  t:ok(env:find("DEMESNE_MCP_TOKEN=" .. r.mcp.token, 1, true), "token in env")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
  t:eq({ n.active, n.status }, { false, "destroyed" })
  t:ok(w.closed[r.sandbox_id], "endpoint closed")
  t:eq(fs.lstat(n.workspace), nil, "workspace removed")
end

function tests.a_live_servers_sandbox_missing_from_this_engine_is_left_to_it(t)
  local w <close> = world()
  local r = root(w)
  local n = tree.get(r.sandbox_id)
  -- another server of the same state folder (another host: alive, as far as this one can
  -- tell) runs it on an engine this one does not see
  n.owner = "elsewhere.example/4242/1"
  store.save(n)
  assert(w.eng:remove("demesne-" .. r.sandbox_id))
  tree.reset()
  tree.resume()
  n = tree.get(r.sandbox_id)
  t:eq({ n.active, n.status }, { true, "running" }, "left to its live server")
  -- a server of this host that is gone: the node ends
  n.owner = loop.hostname() .. "/999999999/1"
  store.save(n)
  tree.reset()
  tree.resume()
  n = tree.get(r.sandbox_id)
  t:eq(n.active, false, "ended once its server is gone")
  t:match(n.reason or "", "removed while no server watched it")
  egress.stop(r.sandbox_id) -- its proxy, which the world's close finds by its container (gone here)
end

function tests.a_sandbox_without_mcp_is_no_tree_node(t)
  local _w <close> = world()
  local r = sandbox.create(nil, { image = IMAGE })
  t:eq(tree.get(r.sandbox_id), nil)
  t:eq(r.mcp, nil)
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

function tests.a_child_inherits_inputs_workspace_and_earlier_siblings(t)
  local w <close> = world()
  local r = root(w, { egress = "none" })
  local rn = tree.get(r.sandbox_id)
  local a = spawn(r.sandbox_id, "script", { name = "first", command = "echo one > /out/one.txt", image = IMAGE })
  t:eq(a.exit_code, 0)
  t:eq(a.output_dir, r.output_dir .. "/child/first")
  t:eq(fs.read_file(a.output_dir .. "/one.txt"), "one\n")
  local b = spawn(r.sandbox_id, "create", { name = "second", image = IMAGE })
  local spec = w.specs["demesne-" .. b.sandbox_id]
  local m = by_target(spec.mounts)
  t:eq({ m["/out"].source, m["/out"].mode }, { r.output_dir .. "/child/second", "rw" })
  t:eq({ m["/in/data"].source, m["/in/data"].mode }, { w.dir .. "/host/data", "ro" }, "the parent's input")
  t:eq({ m["/in/previous-jobs/first"].source, m["/in/previous-jobs/first"].mode },
    { r.output_dir .. "/child/first", "ro" }, "the earlier sibling's output")
  t:eq({ m["/workspace"].source, m["/workspace"].mode }, { rn.workspace, "rw" }, "the shared workspace")
  t:eq(m["/out/child"], nil, "no endpoint: no child folder")
  t:eq(spec.network, "none")
  local bn = tree.get(b.sandbox_id)
  t:eq({ bn.parent, bn.depth, bn.name, bn.egress }, { r.sandbox_id, 1, "second", "none" })
  t:eq({ tree.get(a.run_id).name, tree.get(a.run_id).status }, { "first", "succeeded" })
  local kids = tree.children(r.sandbox_id)
  t:eq({ kids[1].name, kids[1].kind, kids[1].status, kids[1].exit_code }, { "first", "script", "succeeded", 0 })
  t:eq({ kids[2].name, kids[2].kind, kids[2].status }, { "second", "create", "running" })
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
  t:eq(tree.get(b.sandbox_id).status, "cancelled", "the child sandbox went with its parent")
  t:eq(tree.get(b.sandbox_id).reason, "parent ended")
  t:eq(w.eng:list({ "io.demesne.managed=1" }), {}, "no container left")
end

function tests.names_depth_children_and_egress_are_checked(t)
  local w <close> = world()
  local r = root(w, { egress = "none", tree = { depth = 1, children = 3 } })
  local id = r.sandbox_id
  t:match(failure(spawn, id, "script", { name = "Bad_Name", command = "true", image = IMAGE }), "lowercase letters")
  t:match(failure(spawn, id, "script", { name = ("x"):rep(41), command = "true", image = IMAGE }), "longer than 40")
  t:match(failure(spawn, id, "script", { name = "trailing-", command = "true", image = IMAGE }), "inner hyphens")
  spawn(id, "script", { name = "once", command = "true", image = IMAGE })
  t:match(failure(spawn, id, "script", { name = "once", command = "true", image = IMAGE }),
    'name: "once" is already used by a child of this sandbox')
  t:match(failure(spawn, id, "script", { name = "wide", command = "true", image = IMAGE, egress = "open" }),
    "not permitted for a child sandbox_script.*sandbox_research")
  t:match(failure(spawn, id, "script", { name = "wider", command = "true", image = IMAGE,
    egress = "package-managers" }), "wider than this sandbox's own egress %(none%)")
  -- a name is taken even when its spawn failed, and counts: the third is the last
  t:match(failure(spawn, id, "script", { name = "broken", command = "true", image = IMAGE }, function()
    error({ demesne_error = true, message = "image: no such image" }, 0)
  end), "no such image")
  t:match(failure(spawn, id, "script", { name = "broken", command = "true", image = IMAGE }), "already used")
  spawn(id, "script", { name = "third", command = "true", image = IMAGE })
  t:match(failure(spawn, id, "script", { name = "more", command = "true", image = IMAGE }), "spawned 3 children")
  t:eq(tree.info(id), { run_id = id, root = id, depth = 0, limits = { depth = 1, children = 3, running = 8,
    jobs = 32, job_records = 256 }, children_used = 3, spent_usd = 0 })
  sandbox.destroy(nil, { sandbox_id = id })
  local kids = tree.children(id)
  t:eq({ kids[2].name, kids[2].status }, { "broken", "failed" })
end

function tests.depth_limit_refuses_a_grandchild(t)
  local w <close> = world()
  local r = root(w, { egress = "none", tree = { depth = 1 } })
  local c = spawn(r.sandbox_id, "create", { name = "mid", image = IMAGE, mcp = true })
  t:ok(tree.get(c.sandbox_id).endpoint, "a child with mcp gets its endpoint")
  t:ok(w.opened[c.sandbox_id], "opened")
  t:match(failure(spawn, c.sandbox_id, "script", { name = "low", command = "true", image = IMAGE }),
    "depth 2, below the tree's limit of 1")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
  t:ok(w.closed[c.sandbox_id], "the child's endpoint closed with it")
end

function tests.scope_is_the_callers_subtree(t)
  local w <close> = world()
  local r1 = root(w)
  local r2 = root(w)
  local c = spawn(r1.sandbox_id, "create", { name = "kid", image = IMAGE, mcp = true })
  local g = spawn(c.sandbox_id, "create", { name = "grandkid", image = IMAGE })
  t:ok(tree.sees_sandbox(r1.sandbox_id, c.sandbox_id), "its child")
  t:ok(tree.sees_sandbox(r1.sandbox_id, g.sandbox_id), "its grandchild")
  t:ok(not tree.sees_sandbox(c.sandbox_id, r1.sandbox_id), "not its parent")
  t:ok(not tree.sees_sandbox(c.sandbox_id, c.sandbox_id), "not itself")
  t:ok(not tree.sees_sandbox(r2.sandbox_id, c.sandbox_id), "not another tree's")
  t:ok(not tree.sees_sandbox(r1.sandbox_id, "nosuch"), "not an unknown one")
  -- the child tools refuse what is out of scope exactly as an unknown id
  local host = tools.registry()
  host:add({ name = "sandbox_destroy", description = "d", inputSchema = { type = "object", properties = {
    sandbox_id = { type = "string" } } }, run = function(_, a) return sandbox.destroy(nil, a) end })
  local reg = child.registry(host)
  local d = reg:get("sandbox_destroy")
  local res = tools.call(d, { listener = tree.tag(c.sandbox_id) }, { sandbox_id = r2.sandbox_id })
  t:eq(res.isError, true)
  t:eq(res.content[1].text, ("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(r2.sandbox_id))
  res = tools.call(d, { listener = "run:nosuch" }, { sandbox_id = g.sandbox_id })
  t:eq(res.content[1].text, "the calling sandbox is not a running sandbox of a tree")
  res = tools.call(d, { listener = tree.tag(c.sandbox_id) }, { sandbox_id = g.sandbox_id })
  t:eq(res.isError, false, res.content[1].text)
  t:eq(res.structuredContent.output_dir, "/out/child/grandkid", "host paths as the caller sees them")
  sandbox.destroy(nil, { sandbox_id = r1.sandbox_id })
  sandbox.destroy(nil, { sandbox_id = r2.sandbox_id })
end

function tests.child_schemas_have_no_host_paths_and_a_required_name(t)
  local _w <close> = world()
  local host = tools.load({ user_dir = false, quiet = true })
  local reg = child.registry(host)
  local names = {}
  for _, d in ipairs(reg:list()) do names[#names + 1] = d.name end
  t:eq(names, child.TOOLS)
  for _, d in ipairs(reg:list()) do
    local p = d.inputSchema.properties
    t:eq({ p.files, p.directories, p.budget_usd, p.tree }, {}, d.name .. ": no host-only parameter")
  end
  for _, n in ipairs({ "sandbox_script", "sandbox_create", "sandbox_agent", "sandbox_research" }) do
    local s = reg:get(n).inputSchema
    t:eq(s.required[1], "name", n)
    t:eq(s.properties.name.maxLength, 40)
  end
  t:eq(reg:get("sandbox_research").inputSchema.properties.egress, nil)
  t:eq(reg:get("sandbox_wait").inputSchema.properties.timeout_seconds.maximum, 240)
  t:ok(host:get("sandbox_agent").inputSchema.properties.budget_usd, "the host keeps budget_usd")
  t:ok(host:get("sandbox_create").inputSchema.properties.mcp, "the host's sandbox_create has mcp")
end

function tests.limits_come_from_the_call_within_the_ceilings(t)
  local _w <close> = world({ DEMESNE_TREE_BUDGET_USD_MAX = "5" })
  local l, b = tree.limits(nil, nil)
  t:eq({ l.depth, l.children, l.running, b }, { 3, 32, 8, 5 }, "defaults; the ceiling is the budget of a tree without one")
  l, b = tree.limits({ depth = 2, running = 4 }, 1.5)
  t:eq({ l.depth, l.running, b }, { 2, 4, 1.5 })
  t:match(failure(tree.limits, { depth = 99 }), "tree.depth: 99 is above the ceiling of 5")
  t:match(failure(tree.limits, nil, 6), "budget_usd: 6 is above the ceiling of 5")
end

function tests.running_limit_makes_a_spawn_wait_then_refuses(t)
  local w <close> = world({ DEMESNE_TREE_WAIT_SECONDS = "1" })
  local r = root(w, { tree = { running = 2 } })
  local a = spawn(r.sandbox_id, "create", { name = "holds-a-slot", image = IMAGE })
  local started = loop.now()
  t:match(failure(spawn, r.sandbox_id, "create", { name = "waits", image = IMAGE }),
    "already runs 2 sandboxes at once, its limit")
  t:ok(loop.now() - started >= 900, "it waited for a slot first")
  -- a slot that frees while a spawn waits lets it go on
  local waiter = async.spawn("spawn", function()
    return spawn(r.sandbox_id, "create", { name = "gets-in", image = IMAGE })
  end)
  async.sleep(100)
  sandbox.destroy(nil, { sandbox_id = a.sandbox_id })
  local ok, got = waiter:wait()
  t:ok(ok, tostring(got and got.message or got))
  t:eq(tree.get(got.sandbox_id).name, "gets-in")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

function tests.budget_counter_and_the_spent_reaction(t)
  local w <close> = world()
  local r = root(w, { budget_usd = 1 })
  local c = spawn(r.sandbox_id, "create", { name = "spender", image = IMAGE, mcp = true })
  local g = spawn(c.sandbox_id, "create", { name = "below", image = IMAGE })
  t:eq({ tree.check(c.sandbox_id) }, { true })
  t:eq({ tree.charge(c.sandbox_id, 0.4, { model = "m1", input = 100, output = 10, cache_read = 300 }) }, { true })
  t:eq({ tree.charge(r.sandbox_id, 0.3, { model = "m2", input = 50, output = 5 }) }, { true })
  t:eq({ tree.spent(r.sandbox_id) }, { 0.7, 1 })
  t:eq({ tree.spent(g.sandbox_id) }, { 0.7, 1 }, "the tree's counter, from any node")
  -- persisted: a fresh load sees the same
  tree.reset()
  t:eq({ tree.spent(r.sandbox_id) }, { 0.7, 1 })
  local ok, why = tree.charge(c.sandbox_id, 0.35, { model = "m1", input = 10, output = 1 })
  t:eq({ ok, why }, { nil, "budget of $1.00 spent" })
  t:eq({ tree.check(g.sandbox_id) }, { nil, "budget of $1.00 spent" })
  -- the reaction: every run of the tree ends with the reason, no container left
  local deadline = loop.now() + 10000
  while tree.get(r.sandbox_id).active and loop.now() < deadline do async.sleep(20) end
  for _, id in ipairs({ r.sandbox_id, c.sandbox_id, g.sandbox_id }) do
    local n = tree.get(id)
    t:eq({ n.active, n.status, n.reason }, { false, "cancelled", "budget of $1.00 spent" }, id)
  end
  t:eq(w.eng:list({ "io.demesne.managed=1" }), {}, "no container left")
  local rep = tree.report(r.sandbox_id)
  t:ok(math.abs(rep.total_cost_usd - 1.05) < 1e-9, "total " .. rep.total_cost_usd)
  t:eq(rep.tokens, { input = 160, output = 16, cache_creation = 0, cache_read = 300 })
  t:ok(math.abs(rep.cache_read_share - 300 / 460) < 1e-9, "cache-read share")
  t:eq({ rep.by_model[1].model, rep.by_model[1].requests, rep.by_model[2].model }, { "m1", 2, "m2" })
  t:eq(#rep.nodes, 3)
  t:eq({ rep.nodes[2].path, rep.nodes[2].depth, rep.nodes[3].path, rep.nodes[3].depth },
    { "spender", 1, "spender/below", 2 })
  t:match(failure(spawn, r.sandbox_id, "script", { name = "late", command = "true", image = IMAGE }),
    "calling sandbox is no longer running")
end

function tests.a_run_outside_a_tree_is_never_charged(t)
  local _w <close> = world()
  t:eq({ tree.charge("20260101T000000Z-00000000", 5) }, { true })
  t:eq({ tree.check("20260101T000000Z-00000000") }, { true })
end

function tests.a_planted_child_folder_is_refused(t)
  local w <close> = world()
  local r = root(w)
  -- what a parent could try if /out/child were writable to it: a link where the child's
  -- folder goes (here made on the host side, as the worst case)
  assert(fs.mkdir_p(w.dir .. "/elsewhere", 493))
  os.execute(("ln -s %q %q"):format(w.dir .. "/elsewhere", r.output_dir .. "/child/evil"))
  t:match(failure(spawn, r.sandbox_id, "script", { name = "evil", command = "true", image = IMAGE }),
    "cannot make the child's output folder .*something is already there")
  t:eq(fs.readdir(w.dir .. "/elsewhere"), {}, "nothing was written through the link")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

-- The spec the engine was given for a sandbox.
local function spec_of(w, id) return w.specs["demesne-" .. id] end

function tests.isolation_is_a_floor_kept_in_the_record(t)
  local w <close> = world()
  w.eng.capabilities.runtimes = { gvisor = true }
  local r = root(w, { egress = "none", isolation = "gvisor", mcp = true })
  t:eq(tree.get(r.sandbox_id).walls.isolation, "gvisor")
  local a = spawn(r.sandbox_id, "create", { name = "names-none", image = IMAGE })
  t:eq(spec_of(w, a.sandbox_id).runtime, "gvisor", "a child that names no isolation runs on the parent's")
  t:eq(tree.get(a.sandbox_id).walls.isolation, "gvisor")
  t:eq(failure(spawn, r.sandbox_id, "create", { name = "weaker", image = IMAGE, isolation = "container" }),
    'isolation: "container" is weaker than this sandbox\'s own isolation (gvisor); a child runs on gvisor')
  local again = spawn(r.sandbox_id, "create", { name = "weaker", image = IMAGE, isolation = "gvisor" })
  t:ok(again.sandbox_id, "a refused isolation does not take the name")
  -- a container parent's child may ask for more
  local c = root(w, { egress = "none" })
  local g = spawn(c.sandbox_id, "create", { name = "stronger", image = IMAGE, isolation = "gvisor" })
  t:eq(spec_of(w, g.sandbox_id).runtime, "gvisor")
  -- the record survives a restart (a new process reads it from the state folder)
  tree.reset()
  t:eq(tree.get(r.sandbox_id).walls, { isolation = "gvisor", userns = false,
    limits = { memory_mb = 2048, cpus = 2, pids = 1024 }, tree = { memory_mb = 2048 * 8, cpus = 16, pids = 1024 * 8 } })
  t:match(failure(spawn, r.sandbox_id, "create", { name = "after-restart", image = IMAGE, isolation = "container" }),
    "weaker than this sandbox's own isolation %(gvisor%)")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
  sandbox.destroy(nil, { sandbox_id = c.sandbox_id })
end

function tests.limits_default_to_the_parents_and_never_exceed_them(t)
  local w <close> = world()
  local r = root(w, { egress = "none", limits = { memory_mb = 256, pids = 64, cpus = 1 } })
  local a = spawn(r.sandbox_id, "create", { name = "inherits", image = IMAGE })
  t:eq(spec_of(w, a.sandbox_id).limits, { memory_bytes = 256 * 1024 * 1024, cpus = 1, pids = 64 })
  local b = spawn(r.sandbox_id, "create", { name = "smaller", image = IMAGE, limits = { memory_mb = 128 } })
  t:eq(spec_of(w, b.sandbox_id).limits, { memory_bytes = 128 * 1024 * 1024, cpus = 1, pids = 64 })
  t:eq(failure(spawn, r.sandbox_id, "create", { name = "greedy", image = IMAGE, limits = { memory_mb = 512 } }),
    "limits.memory_mb: 512 is more than this sandbox's own limit of 256 (the parent's); a child may have at most 256")
  t:match(failure(spawn, r.sandbox_id, "script", { name = "forks", command = "true", image = IMAGE,
    limits = { pids = 30000 } }), "^limits.pids: 30000 is more than this sandbox's own limit of 64 %(the parent's%)")
  t:match(failure(spawn, r.sandbox_id, "create", { name = "cpus", image = IMAGE, limits = { cpus = 1.5 } }),
    "^limits.cpus: 1.5 is more than")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

function tests.tree_totals_are_checked_where_a_slot_is_reserved(t)
  local w <close> = world({ DEMESNE_TREE_WAIT_SECONDS = "1" })
  t:match(failure(root, w, { egress = "none", limits = { memory_mb = 256 }, tree = { memory_mb = 128 } }),
    "^tree.memory_mb: 128 is less than this run's own limits.memory_mb %(256%)")
  local r = root(w, { egress = "none", limits = { memory_mb = 256 }, tree = { memory_mb = 640 } })
  t:eq(tree.get(r.sandbox_id).walls.tree.memory_mb, 640)
  local mid = spawn(r.sandbox_id, "create", { name = "mid", image = IMAGE, mcp = true })
  -- mid's child would need 256 beside mid and the root (512): more than 640, at once
  t:eq(failure(spawn, mid.sandbox_id, "create", { name = "deep", image = IMAGE }),
    "limits.memory_mb: this sandbox and those above it, which run as long as this call, hold 512 of its 640 MB "
      .. "(tree.memory_mb: the root's limits x tree.running unless the host's call set it), so a child of 256 does "
      .. "not fit while they run; ask for less")
  local small = spawn(mid.sandbox_id, "create", { name = "small", image = IMAGE, limits = { memory_mb = 128 } })
  -- with tree.running 2, a grandchild never gets a slot while its parent and the root run: refused at once
  local r2 = root(w, { egress = "none", tree = { running = 2 } })
  local mid2 = spawn(r2.sandbox_id, "create", { name = "mid", image = IMAGE, mcp = true })
  local started = loop.now()
  t:match(failure(spawn, mid2.sandbox_id, "create", { name = "deep", image = IMAGE }),
    "^this tree runs at most 2 sandboxes at once %(tree.running%), and this sandbox and those above it, which run as "
      .. "long as this call, are 2 of them: a child here never gets a slot")
  t:ok(loop.now() - started < 900, "without waiting")
  sandbox.destroy(nil, { sandbox_id = r2.sandbox_id })
  -- 640 held: a further child waits for room, then is refused
  t:match(failure(spawn, r.sandbox_id, "create", { name = "late", image = IMAGE, limits = { memory_mb = 64 } }),
    "^limits.memory_mb: this tree's running sandboxes already hold 640 of its 640 MB %(tree.memory_mb: the root's "
      .. "limits x tree.running.*so a child of 64 does not fit; waited 1 s")
  -- room that frees while a spawn waits lets it go on
  local waiter = async.spawn("spawn", function()
    return spawn(r.sandbox_id, "create", { name = "gets-in", image = IMAGE, limits = { memory_mb = 64 } })
  end)
  async.sleep(100)
  sandbox.destroy(nil, { sandbox_id = small.sandbox_id })
  local ok, got = waiter:wait()
  t:ok(ok, tostring(got and got.message or got))
  t:eq(tree.get(got.sandbox_id).walls.limits.memory_mb, 64)
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

function tests.images_from_inside_are_demesnes_the_users_or_the_configurations(t)
  local w <close> = world()
  w.eng.images["local/secret:1"] = { id = "feed", labels = {} }
  local r = root(w, { egress = "none" })
  t:match(failure(spawn, r.sandbox_id, "script", { name = "secret", command = "true", image = "local/secret:1" }),
    '^image: "local/secret:1" is not an image a sandbox may start: from inside a sandbox only demesne\'s images %(.*base.*%) '
      .. "and those the configuration lists in child_images may be named")
  t:eq(sandbox.run_script(nil, { command = "true", image = "local/secret:1" }).exit_code, 0, "the host may use it")
  t:match(failure(spawn, r.sandbox_id, "create", { name = "builds", image = "browser" }),
    '^image: "browser" is not built yet, and a sandbox may not start its build .*`demesne images build browser`')
  t:eq(#tree.get(r.sandbox_id).children, 0, "refused before the name is taken")
  t:eq(spawn(r.sandbox_id, "script", { name = "listed", command = "true", image = IMAGE }).exit_code, 0,
    "an image child_images lists")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

-- An agent run's plan as agent.prepare makes it (only what tree.plan reads).
local function agent_plan(w, tool, id, args)
  local out = w.dir .. "/out/" .. id
  return { tool = tool, run_id = id, output_dir = out, run_dir = w.dir .. "/state/runs/" .. id, mounts = {},
    egress = { name = tool == "sandbox_research" and "open" or "none" }, args = args, engine = w.eng, image_arg = IMAGE,
    isolation = args.isolation or "container", limits = sandbox.limits(args.limits) }
end

function tests.a_research_childs_out_is_handed_over_when_it_ends(t)
  local w <close> = world()
  local r = root(w, { egress = "none" })
  local final = r.output_dir .. "/child/web"
  local seen = {}
  local res = spawn(r.sandbox_id, "research", { name = "web", prompt = "x" }, function(ctx, a)
    local o = agent_plan(w, "sandbox_research", "20260101T000000Z-eeeeeeee", a)
    tree.plan(ctx, o, a)
    seen.out = o.output_dir
    assert(fs.write_atomic(o.output_dir .. "/note.txt", "from the child\n")) -- the child runs
    seen.while_running = fs.readdir(final)
    tree.removed(o) -- its container is gone
    return { exit_code = 0, output_dir = o.output_dir, run_id = o.run_id }
  end)
  t:eq(seen.out, w.dir .. "/out/20260101T000000Z-eeeeeeee", "it ran in a folder of its own under the output root")
  t:eq(seen.while_running, {}, "its parent's child/web stays empty while it runs")
  t:eq(res.output_dir, final, "the result names the folder where the parent reads it")
  t:eq(fs.read_file(final .. "/note.txt"), "from the child\n", "handed over when it ended")
  t:eq(fs.lstat(seen.out), nil, "nothing is left where it ran")
  t:eq(tree.get("20260101T000000Z-eeeeeeee").output_dir, final)
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

-- Writes config.lua with host MCP servers that cannot start (/bin/false): tree.plan's sets
-- and their refusals need no upstream; the context lists them as not listed.
local function with_host_servers(w)
  assert(fs.write_atomic(w.dir .. "/config/demesne/config.lua", [[
return { host_mcp = {
  alpha = { command = "/bin/false", tools = { "a" } },
  beta = { command = "/bin/false", tools = "*", timeout_seconds = 7 },
} }
]]))
  config.load()
  hostmcp.shutdown()
  tree.set_host_mcp(hostmcp) -- as the in-sandbox endpoint installs it
end

function tests.host_mcp_sets_default_narrow_inherit_and_are_refused_beyond_the_parent(t)
  local w <close> = world()
  with_host_servers(w)
  local _ <close> = setmetatable({}, { __close = function() tree.set_host_mcp(nil) hostmcp.shutdown() end })
  -- a host call of sandbox_agent: every configured server by default
  local o = agent_plan(w, "sandbox_agent", "20260101T000000Z-aaaaaaaa", {})
  tree.plan(nil, o, o.args)
  local n = tree.get(o.run_id)
  t:eq(n.host_mcp, { "alpha", "beta" }, "default: all configured")
  t:eq({ #o.host_mcp, o.host_mcp[1].name, o.host_mcp[1].url }, { 2, "alpha", "http://127.0.0.1:3130/mcp/host/alpha" })
  t:eq(o.host_mcp[2].timeout_ms, 7000, "the server's own call bound")
  t:ok(o.host_mcp[1].error, "a server that cannot start is still wired; the context says why")
  t:eq({ tree.offers_host_mcp(o.run_id, "alpha"), tree.offers_host_mcp(o.run_id, "gamma") }, { true, false })
  -- narrowed, and an unknown name refused naming the field
  local o2 = agent_plan(w, "sandbox_agent", "20260101T000000Z-bbbbbbbb", { host_mcp = { "beta" } })
  tree.plan(nil, o2, o2.args)
  t:eq(tree.get(o2.run_id).host_mcp, { "beta" })
  local o3 = agent_plan(w, "sandbox_agent", "20260101T000000Z-cccccccc", { host_mcp = { "beta", "nosuch" } })
  t:match(failure(tree.plan, nil, o3, o3.args), 'host_mcp%[2%]: no host MCP server is named "nosuch"')
  t:eq(tree.get(o3.run_id), nil, "a refused plan leaves no node")
  -- research gets none; a script root passes all on without being offered any
  local o4 = agent_plan(w, "sandbox_research", "20260101T000000Z-dddddddd", {})
  tree.plan(nil, o4, o4.args)
  t:eq(tree.get(o4.run_id).host_mcp, {}, "research: none (open egress must not meet host data)")
  t:eq(o4.host_mcp, {})
  local r = root(w)
  t:eq(tree.get(r.sandbox_id).host_mcp, { "alpha", "beta" })
  t:eq(tree.offers_host_mcp(r.sandbox_id, "alpha"), false, "only agent runs are offered host servers")
  -- children of the narrowed agent: the parent's set by default, never more
  local function agent_child(name, args)
    return spawn(o2.run_id, "agent", args, function(c, a)
      local co = agent_plan(w, "sandbox_agent", "20260101T000000Z-" .. name, a)
      tree.plan(c, co, a)
      return { exit_code = 0, run_id = co.run_id }
    end)
  end
  local inherited = agent_child("e0000001", { name = "kid", prompt = "x" })
  t:eq(tree.get(inherited.run_id).host_mcp, { "beta" }, "a child inherits its parent's set")
  local e = failure(agent_child, "e0000002", { name = "greedy", prompt = "x", host_mcp = { "alpha" } })
  t:match(e, "host_mcp%[1%]: host MCP server alpha is not offered to the parent run, so not to its children")
  local none = agent_child("e0000003", { name = "none", prompt = "x", host_mcp = {} })
  t:eq(tree.get(none.run_id).host_mcp, {}, "[] = none")
  sandbox.destroy(nil, { sandbox_id = r.sandbox_id })
end

return tests
