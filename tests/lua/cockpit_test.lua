-- The cockpit's control plane without an engine: the control folder (entries, stale ones
-- removed), the control API on a real unix socket (core.httpd) asked by its real client,
-- over node records planted in a fresh state folder, and the readers of what a sandbox
-- wrote (paths in /out, logs cut at whole lines, transcripts rendered).
local async = require("demesne.async")
local client = require("demesne.cockpit.client")
local config = require("demesne.config")
local control = require("demesne.cockpit.control")
local json = require("demesne.json")
local registry = require("demesne.cockpit.registry")
local runs = require("demesne.cockpit.runs")
local sandbox = require("demesne.sandbox")
local store = require("demesne.tree.store")
local teardown_ = require("demesne.teardown")
local view = require("demesne.cockpit.view")
local fs = require("core.fs")
local loop = require("core.loop")

local scratch = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/world.lua")

local tests = {}

local function setup()
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d .. "/out/root", 448))
  loop.setenv("DEMESNE_STATE_DIR", d .. "/state")
  loop.setenv("DEMESNE_CONTROL_DIR", d .. "/ctl")
  config.load()
  store.reset()
  return d
end

local function teardown(d)
  control.stop()
  store.reset()
  loop.setenv("DEMESNE_STATE_DIR", nil)
  loop.setenv("DEMESNE_CONTROL_DIR", nil)
  config.load()
  fs.remove_tree(d)
end

-- A root node record of this server (a one-node tree), as lua/tree writes them.
local function plant(d, id, fields)
  local n = { run_id = id, root = id, depth = 0, kind = "script", tool = "sandbox_script", status = "running",
    active = false, owner = sandbox.owner(), started_ms = 1, output_dir = d .. "/out/root", run_dir = d .. "/run",
    egress = "none", children = json.array(), inputs = json.array(), cost_usd = 0.25, spent_usd = 0.25,
    budget_usd = 1, limits = { depth = 3, children = 32, running = 8, jobs = 32, job_records = 256 },
    members = json.array({ id }), image = "base" }
  for k, v in pairs(fields or {}) do n[k] = v end
  assert(fs.mkdir_p(store.dir(), 448))
  assert(fs.write_atomic(store.record_path(id), json.encode(n) .. "\n", 384))
  return n
end

function tests.the_control_folder_is_private_and_forgets_servers_that_are_gone(t)
  local d = setup()
  local ok, err = pcall(function()
    t:ok(registry.register({ transport = "stdio" }), "registered")
    local st = assert(fs.lstat(registry.dir()))
    t:eq(st.mode & 511, 448, "the control folder is 0700")
    -- a server that is gone: an owner label no live process has
    local stale = registry.dir() .. "/999999.json"
    assert(fs.write_atomic(stale, json.encode({ pid = 999999, owner = loop.hostname() .. "/999999/1" }), 384))
    assert(fs.write_atomic(registry.dir() .. "/999999.sock", "", 384))
    local list = registry.list()
    t:eq(#list, 1, "only the live server is listed")
    t:eq(list[1].pid, loop.getpid())
    t:eq(list[1].socket, registry.socket_path(loop.getpid()))
    t:eq(fs.lstat(stale), nil, "the stale entry is removed")
    t:eq(fs.lstat(registry.dir() .. "/999999.sock"), nil, "with its socket file")
  end)
  teardown(d)
  if not ok then error(err, 0) end
end

function tests.the_control_api_lists_trees_raises_a_budget_and_refuses_bad_input(t)
  local d = setup()
  local ok, err = pcall(function()
    plant(d, "20260101T000000Z-aaaa0001")
    plant(d, "20260101T000000Z-bbbb0002", { owner = "elsewhere/1/1" }) -- another server's
    t:ok(control.start({ transport = "stdio" }), "the control socket")
    local e = registry.list()[1]
    local status, body = client.call(e, "GET", "/v1/trees")
    t:eq(status, 200)
    t:eq(#body.trees, 1, "this server's trees only")
    local n = body.trees[1].nodes[1]
    t:eq({ n.run_id, n.kind, n.image, n.isolation, n.egress, n.status }, { "20260101T000000Z-aaaa0001", "script", "base",
      "container", "none", "running" })
    t:eq(n.budget_left_usd, 0.75)
    t:eq(n.total_cost_usd, 0.25)
    status, body = client.call(e, "GET", "/v1/nodes/20260101T000000Z-bbbb0002")
    t:eq(status, 404)
    t:eq(body.error.message, "node 20260101T000000Z-bbbb0002 belongs to another server")
    status, body = client.call(e, "POST", "/v1/trees/20260101T000000Z-aaaa0001/budget", { budget_usd = 0.5 })
    t:eq({ status, body.error.message }, { 400, "budget_usd: $0.50 does not raise the tree's budget of $1.00" })
    status, body = client.call(e, "POST", "/v1/trees/20260101T000000Z-aaaa0001/budget", { budget_usd = "lots" })
    t:eq({ status, body.error.message }, { 400, "budget_usd: a number of USD above 0" })
    status, body = client.call(e, "POST", "/v1/trees/20260101T000000Z-aaaa0001/budget", { budget_usd = 3 })
    t:eq(status, 200)
    t:eq(body.budget_usd, 3)
    local rec = json.decode(assert(fs.read_file(store.record_path("20260101T000000Z-aaaa0001"))))
    t:eq(rec.budget_usd, 3, "the record holds the new budget")
    status, body = client.call(e, "POST", "/v1/nodes/20260101T000000Z-aaaa0001/ttl", { seconds = 60 })
    t:eq(status, 409)
    t:ok(body.error.message:find("only a persistent sandbox (sandbox_create) has a TTL", 1, true), body.error.message)
    status, body = client.call(e, "POST", "/v1/nodes/20260101T000000Z-aaaa0001/cancel", { subtree = "yes" })
    t:eq({ status, body.error.message }, { 400, "subtree: true or false" })
    status, body = client.call(e, "POST", "/v1/nodes/20260101T000000Z-aaaa0001/cancel", {})
    t:eq({ status, body.error.code }, { 409, "EALREADY" }, "a node whose container is gone is not cancelled again")
    status = client.call(e, "GET", "/v1/nodes/..%2Fx/file?path=a")
    t:eq(status, 404)
    -- the event stream says `changed` at once, and again after a change
    local events = {}
    local got = async.event()
    local req = client.events(e, function(name, data)
      events[#events + 1] = { name, data.seq }
      if #events == 2 then got.set() end
    end, function() got.set() end)
    async.sleep(700)
    plant(d, "20260101T000000Z-cccc0003")
    async.timeout(5000, got.wait)
    req:cancel()
    t:eq(#events, 2, "two events")
    t:eq(events[1][1], "changed")
    t:ok(events[2][2] > events[1][2], "a later seq after the change")
  end)
  teardown(d)
  if not ok then error(err, 0) end
end

function tests.paths_in_out_are_checked_and_logs_come_in_whole_lines(t)
  local d = setup()
  local ok, err = pcall(function()
    for _, bad in ipairs({ "", "/etc/passwd", "../x", "a/../b", "a/./b", "a\0b" }) do
      t:eq(view.check_rel(bad), nil, ("%q is refused"):format(bad))
    end
    t:eq(view.check_rel("child/a.txt"), "child/a.txt")
    local n = plant(d, "20260101T000000Z-dddd0004", { kind = "agent" })
    local line = json.encode({ type = "assistant", message = { content = { { type = "text", text = "hello <b>" } } } })
    assert(fs.write_atomic(n.output_dir .. "/transcript.jsonl", line .. "\n" .. '{"type":"assis', 420))
    local part = assert(view.log(n, "transcript", 0))
    t:eq(#part.lines, 1, "the partial last line waits")
    t:ok(part.lines[1]:find("hello <b>", 1, true), part.lines[1])
    t:eq(part.next, #line + 1)
    t:eq(part.eof, false)
    -- a link planted in /out is never followed
    assert(fs.symlink("/etc/passwd", n.output_dir .. "/link"))
    local data, ferr, code = view.file(n, "link")
    t:eq(data, nil)
    t:eq(code, "ELOOP", tostring(ferr))
    local files = view.files(n)
    local types = {}
    for _, f in ipairs(files) do types[f.path] = f.type end
    t:eq(types.link, "link")
    t:eq(types["transcript.jsonl"], "file")
  end)
  teardown(d)
  if not ok then error(err, 0) end
end

-- Sandboxes that are no tree node, on the fake engine (tests/lua/world.lua): a foreground
-- run that ended, a persistent sandbox that runs; their limits, the memory used (eng:stats),
-- detail, and destroy through the control API.
function tests.sandboxes_that_are_no_tree_node_are_listed_with_the_memory_they_use(t)
  local w <close> = scratch.new({ vars = { "DEMESNE_CONTROL_DIR" } })
  loop.setenv("DEMESNE_CONTROL_DIR", w.dir .. "/ctl")
  config.load()
  local ok, err = pcall(function()
    local r = sandbox.run_script(nil, { command = "echo hi; exit 3", image = scratch.IMAGE, limits = { memory_mb = 300 } })
    t:ok(teardown_.wait(5000), "the container went")
    local c = sandbox.create(nil, { image = scratch.IMAGE, limits = { memory_mb = 256, cpus = 1, pids = 64 } })
    runs.changed()
    local trees = view.trees()
    local by = {}
    for _, tr in ipairs(trees) do
      t:eq(tr.standalone, true, "no tree here: each run is listed as a tree of one node")
      by[tr.run_id] = tr.nodes[1]
    end
    local fg, sb = by[r.run_id], by[c.sandbox_id]
    t:ok(fg, "the ended foreground run is listed")
    t:eq({ fg.kind, fg.tool, fg.status, fg.exit_code, fg.active, fg.limits.memory_mb, fg.image },
      { "script", "sandbox_script", "failed", 3, false, 300, scratch.IMAGE }, "the foreground run, as it ended")
    t:ok(sb, "the persistent sandbox is listed")
    t:eq({ sb.kind, sb.status, sb.active, sb.limits.memory_mb, sb.limits.cpus, sb.limits.pids, sb.egress },
      { "create", "running", true, 256, 1, 64, "package-managers" }, "the persistent sandbox, running, with its limits")
    t:ok(math.type(sb.expires_at) == "integer" and sb.expires_at > loop.time(), "its expiry")
    t:eq(sb.memory_used_bytes, 1024 * 1024, "the memory it uses (the fake's eng:stats)")
    t:eq(fg.memory_used_bytes, nil, "an ended run uses none")
    local tot = view.totals(trees)
    t:eq({ tot.running, tot.memory_mb, tot.memory_used_bytes }, { 1, 256, 1024 * 1024 }, "totals: reserved and used")
    local d = assert(view.detail(r.run_id))
    t:eq({ d.prompt, d.stdout }, { "echo hi; exit 3", "hi\n" }, "the foreground run's command and output")
    -- a sandbox cannot make itself a run of this server: only what the server recorded counts
    assert(fs.write_atomic(r.output_dir .. "/20260101T000000Z-ffff0009.json", json.encode({ run_id = "x" }), 420))
    t:eq(view.node("20260101T000000Z-ffff0009"), nil, "no such run")
    -- destroyed through the control API
    t:ok(control.start({ transport = "stdio" }), "the control socket")
    local e = registry.list()[1]
    local status, body = client.call(e, "POST", "/v1/nodes/" .. c.sandbox_id .. "/cancel", {})
    t:eq({ status, body.status }, { 200, "destroyed" }, "destroyed")
    t:eq(#w.eng:list({ "io.demesne.managed=1", "io.demesne.run_id=" .. c.sandbox_id }), 0, "its container is gone")
    status = client.call(e, "POST", "/v1/nodes/" .. r.run_id .. "/cancel", {})
    t:eq(status, 409, "an ended run cannot be cancelled")
  end)
  control.stop()
  if not ok then error(err, 0) end
end

return tests
