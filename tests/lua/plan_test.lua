-- lua/sandbox/plan.lua (SandboxPlan: declared fields, strict writes, records) and
-- lua/sandbox/delivery.lua (the three ways a one-shot's command reaches demesne-init), at
-- unit level: no engine, no container.
local delivery = require("demesne.sandbox.delivery")
local config = require("demesne.config")
local json = require("demesne.json")
local loop = require("core.loop")
local plan = require("demesne.sandbox.plan")
local run = require("demesne.sandbox.run")
local spec = require("demesne.sandbox.spec")

local tests = {}

-- Runs fn with DEMESNE_STRICT set to `value` (nil: unset), restoring it after.
local function with_strict(value, fn)
  local was = os.getenv("DEMESNE_STRICT")
  loop.setenv("DEMESNE_STRICT", value)
  local ok, err = pcall(fn)
  loop.setenv("DEMESNE_STRICT", was)
  if not ok then error(err, 0) end
end

function tests.every_declared_field_has_a_known_part_and_a_meaning(t)
  local parts = {}
  for _, p in ipairs(plan.PARTS) do parts[p] = true end
  local n = 0
  for name, f in pairs(plan.FIELDS) do
    n = n + 1
    t:ok(parts[f[1]], name .. ": its part " .. tostring(f[1]) .. " is one of plan.PARTS")
    t:ok(type(f[2]) == "string" and #f[2] > 0, name .. " says what it means")
  end
  t:ok(n > 40, "the plan's fields are declared")
  t:eq(plan.part("run_id"), "identity")
  t:eq(plan.part("output_dir"), "placement")
  t:eq(plan.part("limits"), "policy")
  t:eq(plan.part("delivery"), "launch")
  t:eq(plan.part("id"), "run")
  t:eq(plan.part("no_such_field"), nil)
end

function tests.a_declared_field_is_written_and_read(t)
  with_strict("1", function()
    local p = plan.new({ run_id = "r1", output_dir = "/o" })
    p.mounts = {}
    p.id = "c1"
    t:ok(plan.is(p), "plan.new gives a SandboxPlan")
    t:eq({ p.run_id, p.output_dir, p.id }, { "r1", "/o", "c1" })
    t:eq(#p.mounts, 0)
    t:ok(not plan.is({}), "a plain table is no plan")
  end)
end

function tests.the_live_state_is_in_the_plans_sandbox_run(t)
  with_strict("1", function()
    local p = plan.new({ run_id = "r1" })
    t:eq(p.id, nil, "no live state before the run")
    p.id, p.exit_code = "c1", 3
    local r = p:live()
    t:ok(run.is(r), "p:live() is a SandboxRun")
    t:eq(r.plan, p, "the run names its plan")
    t:eq({ r.id, r.exit_code }, { "c1", 3 }, "the live writes went to the run")
    r.timed_out = true
    t:eq(p.timed_out, true, "the plan reads its live fields through")
    t:eq(p:live(), r, "one run per plan")
    local seen = {}
    for k, v in pairs(p) do seen[k] = v end
    t:eq(seen, { run_id = "r1", id = "c1", exit_code = 3, timed_out = true }, "pairs: its fields and its live ones")
    t:eq(run.start(p, 42), r, "run.start gives the same run")
    t:eq(p.started_ms, 42)
    run.start(p, 99)
    t:eq(p.started_ms, 42, "a started run keeps its start")
    local ok, err = pcall(function() r.exti_code = 1 end)
    t:ok(not ok, "an undeclared live field raises")
    t:match(tostring(err), "exti_code is not a declared field %(lua/sandbox/run.lua")
    for name, meaning in pairs(run.FIELDS) do
      t:eq(plan.part(name), "run", name .. " is of the run part")
      t:eq(plan.FIELDS[name], nil, name .. " is no plan field")
      t:ok(type(meaning) == "string" and #meaning > 0, name .. " says what it means")
    end
  end)
end

function tests.a_launched_plan_is_frozen_its_live_state_is_not(t)
  with_strict("1", function()
    local p = plan.new({ run_id = "r1", env = {} })
    p.cwd = "/w" -- being built: written freely
    plan.launched(p)
    t:ok(p:is_frozen(), "launched: frozen")
    local ok, err = pcall(function() p.env = { "A=1" } end)
    t:ok(not ok, "a plan field written after the start raises")
    t:match(tostring(err), "env written after its run started")
    ok, err = pcall(function() p.cwd = "/x" end)
    t:ok(not ok, "an existing field too (every write passes the plan's __newindex)")
    t:match(tostring(err), "cwd written after")
    t:eq(p.cwd, "/w", "nothing was written")
    p.id, p.exit_code, p.removed = "c1", 0, true -- its live state: its SandboxRun's
    t:eq({ p.id, p.exit_code, p.removed }, { "c1", 0, true })
    p.repo = { branch = "b" } -- the declared exception (FIELDS says why)
    t:eq(p.repo.branch, "b")
    local q = { run_id = "plain" }
    plan.launched(q) -- a test's plain table: left as it is
    q.env = {}
    t:eq(type(q.env), "table")
  end)
  with_strict(nil, function()
    local p = plan.new({ run_id = "r2" })
    plan.launched(p)
    p.cwd = "/late" -- logged once, kept
    t:eq(p.cwd, "/late")
  end)
end

function tests.fields_a_frozen_plan_may_take_say_why(t)
  for name, f in pairs(plan.FIELDS) do
    if f[3] ~= nil then t:ok(type(f[3]) == "string" and #f[3] > 0, name .. ": why it may change after the start") end
  end
end

function tests.an_undeclared_write_raises_under_strict_naming_the_field(t)
  with_strict("1", function()
    local p = plan.new()
    local ok, err = pcall(function() p.contianer_id = "x" end)
    t:ok(not ok, "the write raised")
    t:match(tostring(err), "contianer_id is not a declared field")
    t:eq(rawget(p, "contianer_id"), nil, "nothing was written")
    local ok2, err2 = pcall(plan.new, { run_id = "r", bogus_field = 1 })
    t:ok(not ok2, "plan.new refuses an undeclared field too")
    t:match(tostring(err2), "bogus_field")
  end)
end

function tests.an_undeclared_write_without_strict_is_kept(t)
  with_strict(nil, function()
    local p = plan.new()
    p.lenient_field = 7 -- logged once (log.warning), kept
    p.lenient_field = 8
    t:eq(p.lenient_field, 8)
  end)
end

function tests.a_record_round_trips_to_a_plan(t)
  with_strict("1", function()
    local p = plan.new({ run_id = "20260101T000000Z-aaaaaaaa", name = "demesne-20260101T000000Z-aaaaaaaa",
      output_dir = "/out/x", run_dir = "/state/run/x", exec_id = "main", timeout = 60, kind = "job",
      credential = { secret = "never recorded" } })
    p.id = "c0ffee"
    local rec = p:record()
    t:eq(rec, { run_id = "20260101T000000Z-aaaaaaaa", container = "demesne-20260101T000000Z-aaaaaaaa",
      output_dir = "/out/x", run_dir = "/state/run/x", exec_id = "main", timeout_seconds = 60 })
    local q = plan.from_record(rec, { tree = rec.run_id })
    t:ok(plan.is(q), "from_record gives a SandboxPlan")
    t:eq(q:record(), rec, "the rebuilt plan records the same")
    t:eq(q.id, rec.container, "the container of the record is the plan's container")
    t:eq(q.tree, rec.run_id)
    t:eq(q.credential, nil, "what is not recorded does not come back")
    local ok = pcall(plan.from_record, rec, { nonsense = 1 })
    t:ok(not ok, "extra fields are checked as any write is")
  end)
end

-- What a contributor (the tree's plan hook) put in the plan is checked with the rest.
function tests.the_final_plan_is_checked_with_what_contributors_added(t)
  local function refused(fields)
    local ok, err = pcall(spec.check_plan, plan.new(fields))
    t:ok(not ok, "refused: " .. json.encode(fields.mounts or {}))
    return type(err) == "table" and tostring(err.message) or tostring(err)
  end
  local base = { output_dir = "/o/r", run_dir = "/s/run/r" }
  spec.check_plan(plan.new({ output_dir = "/o/r", run_dir = "/s/run/r",
    mounts = { { host = "/srv/a", target = "/in/a" }, { host = "/srv/b", target = "/in/previous-jobs/b" } } }))
  local f = {}
  for k, v in pairs(base) do f[k] = v end
  f.mounts = { { host = config.get("state_dir"), target = "/in/state" } }
  t:match(refused(f), "^mount at /in/state: .* holds demesne's state folder")
  f.mounts = { { host = "/srv/a", target = "/in/a" }, { host = "/srv/b", target = "/in/a" } }
  t:match(refused(f), "/in/a is mounted twice")
  f.mounts = { { host = "srv/a", target = "/in/a", field = "directories[0]" } }
  t:match(refused(f), "^directories%[0%]: srv/a is not an absolute host path")
  f.mounts = { { host = "/srv/a", target = "/in/../etc" } }
  t:match(refused(f), "/in/%.%./etc is not an absolute target")
  f.mounts, f.workspace = nil, "srv/w"
  t:match(refused(f), "workspace srv/w is not an absolute path")
  t:match(refused({ output_dir = "out", run_dir = "/s" }), "output_dir")
end

function tests.delivery_modes_are_checked(t)
  for _, m in ipairs({ "control", "exec", "argv" }) do t:eq(delivery.new(m).mode, m) end
  local ok, err = pcall(delivery.new, "socket")
  t:ok(not ok, "an unknown mode raises")
  t:match(tostring(err), "socket")
  t:ok(delivery.is(delivery.new("argv")) and not delivery.is({ mode = "argv" }), "delivery.is")
end

function tests.each_mode_has_its_own_container_command(t)
  local relay = { "--relay", "3128=/.demesne/run/egress.sock" }
  local words = { "--id", "main", "--", "/bin/sh", "-c", "true" }
  t:eq(delivery.new("control"):init_cmd(relay, words),
    { "wait", "--control", "/.demesne/run/init.sock", "--relay", "3128=/.demesne/run/egress.sock" })
  t:eq(delivery.new("exec"):init_cmd(relay, words), { "serve", "--relay", "3128=/.demesne/run/egress.sock" })
  t:eq(delivery.new("argv"):init_cmd(relay, words),
    { "run", "--relay", "3128=/.demesne/run/egress.sock", "--id", "main", "--", "/bin/sh", "-c", "true" })
end

-- An engine that records its waits and execs.
local function fake_engine(wait_code)
  local e = { waits = 0, execs = {} }
  function e.wait(self) self.waits = self.waits + 1 return wait_code end
  function e.exec(self, id, argv, opts)
    self.execs[#self.execs + 1] = { id = id, argv = argv, env = opts.env }
    return 5
  end
  return e
end

function tests.argv_waits_for_the_container(t)
  local eng = fake_engine(3)
  local d = delivery.new("argv")
  d:send({ engine = eng, id = "c", timeout = 10 }, { "--" }, {}) -- nothing to send
  t:eq(d:wait(eng, "c", 1000), 3, "the container's exit code")
  t:eq(eng.waits, 1)
  t:eq(#eng.execs, 0, "no exec")
end

function tests.exec_sends_through_the_engine_and_its_code_wins(t)
  local eng = fake_engine(99)
  local d = delivery.new("exec")
  d:send({ engine = eng, id = "c", name = "n", timeout = 10 }, { "--id", "main", "--", "true" }, { "A=1" })
  t:eq(d:wait(eng, "c", 1000), 5, "the exec's exit code, not the container's")
  t:eq(eng.waits, 0, "no engine wait")
  t:eq(eng.execs[1].argv, { "/.demesne/init", "run", "--id", "main", "--", "true" })
  t:eq(eng.execs[1].env, { "A=1" })
end

-- A control connection that answers from a script of messages, then hangs up.
local function fake_conn(script)
  local c = { sent = {}, killed = false, closed = false }
  function c.send(self, op, args, env) self.sent[#self.sent + 1] = { op = op, args = args, env = env } return true end
  function c.next() return table.remove(script, 1), "hung up", "ECONNRESET" end
  function c.kill(self) self.killed = true end
  function c.close(self) self.closed = true end
  return c
end

function tests.control_sends_a_run_request_and_reads_exit(t)
  local eng = fake_engine(99)
  local d = delivery.new("control")
  d.conn = fake_conn({ { kind = "ok" }, { kind = "started" }, { kind = "exit", code = 7 } })
  d:send({}, { "--id", "main" }, { "B=2" })
  t:eq(d.conn.sent[1].op, "run")
  t:eq(d.conn.sent[1].env, { "B=2" })
  t:eq(d:wait(eng, "c", 1000), 7, "demesne-init's exit code")
  t:eq(eng.waits, 0)
  d:kill()
  t:ok(d.conn.killed, "kill goes over the connection")
  do local _ <close> = d end
  t:ok(d.conn.closed, "closing the Delivery closes its connection")
end

function tests.control_refused_raises_and_a_hang_up_falls_back_to_the_container(t)
  local d = delivery.new("control")
  d.conn = fake_conn({ { kind = "error", text = "busy" } })
  local ok, err = pcall(d.send, d, {}, {}, {})
  t:ok(not ok, "a refusal raises")
  t:match(tostring(type(err) == "table" and err.message or err), "refused the command: busy")
  local eng = fake_engine(137)
  d.conn = fake_conn({}) -- hangs up at once, no exit line
  t:eq(d:wait(eng, "c", 1000), 137, "the container's end decides")
  t:eq(eng.waits, 1)
end

return tests
