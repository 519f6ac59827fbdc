-- The layer contract (lua/layer.lua) and the composition root (lua/compose.lua): what
-- layer.install refuses, each hook's error policy as the lower layers meet it, the order of
-- hooks and services, uninstall; and that compose.install installs what `demesne serve`
-- runs with.
local async = require("demesne.async")
local compose = require("demesne.compose")
local jobs = require("demesne.jobs")
local layer = require("demesne.layer")
local log = require("demesne.log")
local plan = require("demesne.sandbox.plan")
local run = require("demesne.sandbox.run")
local util = require("demesne.util")

local tests = {}

-- Installs the test layers `ls` for the scope of a <close> variable, alone: the layers
-- compose.install put in are taken out meanwhile (their services must not start in a test)
-- and put back, in their order, when it closes.
local function only(...)
  local saved = {}
  for _, name in ipairs(layer.installed()) do saved[#saved + 1] = layer.get(name) end
  for _, l in ipairs(saved) do layer.uninstall(l.name) end
  local mine = { ... }
  for _, l in ipairs(mine) do layer.install(l) end
  return util.closer(function()
    layer.stop_services()
    for _, l in ipairs(mine) do layer.uninstall(l.name) end
    for _, l in ipairs(saved) do layer.install(l) end
  end)
end

-- The warnings logged while fn runs: {"logger: message"}.
local function warnings(fn, ...)
  local got = {}
  local remove = log.add_sink(function(level, logger, msg)
    if level == "warning" then got[#got + 1] = logger .. ": " .. msg end
  end)
  local ok, err = pcall(fn, ...)
  remove()
  if not ok then error(err, 0) end
  return got
end

local function install_error(l)
  local ok, err = pcall(function() layer.install(l) end)
  if ok then return nil end
  return tostring(err)
end

function tests.install_refuses_an_unknown_hook_naming_the_field(t)
  local _ <close> = only()
  local err = install_error({ name = "typo", sandbox_plans = function() end })
  t:match(err, "layer%.install: layer typo: unknown field sandbox_plans", "the field is named")
  t:match(err, "sandbox_plan,", "and the hooks there are")
  t:match(install_error({ name = "bad", job_finish = true }), "layer bad: hook job_finish is a boolean, not a function")
  t:match(install_error({ job_finish = function() end }), "a layer needs a name")
  t:match(install_error("tree"), "a layer is a table, not string")
  t:match(install_error({ name = "svc", services = { { name = "x", start = function() end } } }),
    "layer svc: services%[1%] needs a name, a start and a stop function")
  t:eq(layer.installed(), {}, "nothing refused was installed")
  -- the error points at the caller, not at lua/layer.lua
  t:match(err, "layer_test%.lua:%d+:", "where the layer was installed")
end

function tests.a_layer_is_installed_once(t)
  local l = { name = "once", job_finish = function() end }
  local _ <close> = only(l)
  t:eq(layer.install(l), false, "the same layer again: already there")
  t:eq(layer.installed(), { "once" })
  t:match(install_error({ name = "once" }), "another layer named once is installed")
end

function tests.a_plan_hook_error_refuses_the_plan(t)
  local after = false
  local _ <close> = only(
    { name = "refuses", sandbox_plan = function(_, o) error("no plan for " .. o.run_id, 0) end },
    { name = "later", sandbox_plan = function() after = true end })
  local ok, err = pcall(layer.run, "sandbox_plan", nil, { run_id = "r1" }, {})
  t:eq(ok, false, "the caller sees the error")
  t:eq(err, "no plan for r1")
  t:eq(after, false, "the hooks after it did not run")
end

function tests.a_removal_hook_error_is_logged_and_the_cleanup_goes_on(t)
  local seen = {}
  local _ <close> = only(
    { name = "broken", sandbox_removed = function() error("disk on fire", 0) end },
    { name = "records", sandbox_removed = function(o, why) seen[#seen + 1] = o.run_id .. ": " .. why end })
  local ok
  local got = warnings(function() ok = layer.run("sandbox_removed", { run_id = "r2" }, "expired") end)
  t:eq(ok, true, "layer.run returns to the cleanup")
  t:eq(seen, { "r2: expired" }, "the next layer's hook still ran")
  t:eq(got, { "demesne.sandbox: sandbox_removed hook of layer broken: disk on fire" })
end

-- A one-shot's removal hooks are given its plan, frozen: they read its live state (its
-- SandboxRun's exit code, timeout, start) through it, and may not write the plan.
function tests.a_removal_hook_reads_the_live_state_through_the_frozen_plan(t)
  local seen
  local _ <close> = only({ name = "records", sandbox_removed = function(o)
    seen = { o.run_id, o.exit_code, o.timed_out, o.started_ms, o:live().plan == o }
    o.cwd = "/elsewhere" -- a mistake: raises under DEMESNE_STRICT=1 (the tests'), logged by the hook's policy
  end })
  local o = plan.new({ run_id = "r5", kind = "oneshot" })
  run.start(o, 1000)
  plan.launched(o)
  o.exit_code, o.timed_out = 7, false
  local got = warnings(function() layer.run("sandbox_removed", o) end)
  t:eq(seen, { "r5", 7, false, 1000, true })
  t:eq(#got, 1, "the write to the frozen plan was refused")
  t:match(got[1] or "", "cwd written after its run started")
  t:eq(o.cwd, nil)
end

function tests.a_cancel_inside_a_removal_or_job_hook_propagates(t)
  local _ <close> = only({ name = "cancelled",
    sandbox_removing = function() error(async.CANCELLED, 0) end,
    job_finish = function() error(async.CANCELLED, 0) end })
  for _, hook in ipairs({ "sandbox_removing", "job_finish" }) do
    local ok, err = pcall(layer.run, hook, "r3")
    t:eq(ok, false, hook .. " raises")
    t:ok(err == async.CANCELLED, hook .. ": the cancel itself goes on up")
  end
end

function tests.a_contained_hook_never_raises_not_even_a_cancel(t)
  -- agent_result and vendor_charge keep the policy their old lists had
  local _ <close> = only({ name = "contained",
    agent_result = function() error(async.CANCELLED, 0) end,
    vendor_charge = function() error("no ledger", 0) end })
  local got = warnings(function()
    t:eq(layer.run("agent_result", {}, {}), true)
    t:eq(layer.run("vendor_charge", "r4", 0, nil, nil), true)
  end)
  t:eq(#got, 2, "both were logged")
  t:match(got[2], "^demesne%.vendor: r4: vendor_charge hook of layer contained: no ledger$", "naming the run")
end

function tests.an_admit_hook_refuses_and_the_ones_after_it_do_not_run(t)
  local asked = {}
  local _ <close> = only(
    { name = "broken", vendor_admit = function() asked[#asked + 1] = "broken" error("oops", 0) end },
    { name = "room", vendor_admit = function(run_id)
      asked[#asked + 1] = "room"
      if run_id == "full" then return nil, "no room now", false end
      return true
    end },
    { name = "budget", vendor_admit = function(run_id)
      asked[#asked + 1] = "budget"
      if run_id == "spent" then return nil end
      return true
    end })
  local r
  local got = warnings(function() r = table.pack(layer.run("vendor_admit", "ok", {})) end)
  t:eq({ r[1], r[2], r[3] }, { true, nil, nil }, "admitted: a hook that raised counts as admitting")
  t:eq(#got, 1, "its error was logged")
  t:eq(asked, { "broken", "room", "budget" })
  asked = {}
  warnings(function() r = table.pack(layer.run("vendor_admit", "full", {})) end)
  t:eq({ r[1], r[2], r[3] }, { nil, "no room now", false }, "refused; spent as the hook said")
  t:eq(asked, { "broken", "room" }, "the budget was not asked")
  warnings(function() r = table.pack(layer.run("vendor_admit", "spent", {})) end)
  t:eq({ r[1], r[2], r[3] }, { nil, "refused", true }, "a bare nil: refused, and spent")
end

function tests.hooks_run_in_the_order_the_layers_were_installed(t)
  local order = {}
  local a = { name = "a", job_launch = function() order[#order + 1] = "a" end }
  local b = { name = "b", job_launch = function() order[#order + 1] = "b" end }
  local _ <close> = only(a, b)
  layer.run("job_launch", {})
  t:eq(order, { "a", "b" })
  t:ok(not pcall(layer.run, "job_launched", {}), "an unknown hook name is a mistake")
end

function tests.uninstall_takes_a_layers_hooks_out(t)
  local n = 0
  local _ <close> = only({ name = "counts", job_cancel = function() n = n + 1 end })
  layer.run("job_cancel", {}, "why")
  t:eq(layer.uninstall("counts"), true)
  layer.run("job_cancel", {}, "why")
  t:eq(n, 1, "it ran while installed only")
  t:eq(layer.uninstall("counts"), false, "a second uninstall: nothing to remove")
  t:eq(layer.installed(), {})
end

function tests.services_start_in_order_and_stop_in_reverse_once(t)
  local events = {}
  local function svc(name)
    return { name = name, start = function() events[#events + 1] = "start " .. name end,
      stop = function() events[#events + 1] = "stop " .. name end }
  end
  local _ <close> = only({ name = "first", services = { svc("a"), svc("b") } }, { name = "second", services = { svc("c") } })
  layer.start_services()
  layer.start_services() -- already started: nothing more
  layer.stop_services()
  layer.stop_services() -- already stopped: nothing more
  t:eq(events, { "start a", "start b", "start c", "stop c", "stop b", "stop a" })
end

function tests.a_failing_start_stops_what_had_started(t)
  local events = {}
  local _ <close> = only({ name = "svc", services = {
    { name = "a", start = function() events[#events + 1] = "start a" end, stop = function() events[#events + 1] = "stop a" end },
    { name = "b", start = function() error("port taken", 0) end, stop = function() events[#events + 1] = "stop b" end },
  } })
  local ok, err = pcall(layer.start_services)
  t:eq({ ok, err }, { false, "port taken" })
  t:eq(events, { "start a", "stop a" }, "a was stopped again, b never started")
end

function tests.a_lower_layer_runs_the_hooks_jobs_view_goes_on_past_a_broken_one(t)
  local _ <close> = only(
    { name = "broken", job_view = function() error("no view", 0) end },
    { name = "adds", job_view = function(rec, out) out.seen_by = rec.job_id end })
  local v
  local got = warnings(function()
    v = jobs.view({ job_id = "job-x", status = "succeeded", tool = "sandbox_script", kind = "none", started_ms = 1000,
      finished_ms = 2000, children = {} })
  end)
  t:eq(v.seen_by, "job-x", "the later layer added its field")
  t:eq(got, { "demesne.jobs: job_view hook of layer broken: no view" })
end

function tests.compose_installs_the_tree_then_the_cockpit_and_the_job_kinds(t)
  compose.install()
  compose.install() -- idempotent
  t:eq(layer.installed(), { "tree", "cockpit" }, "the layers, once each, in the order their hooks run")
  for _, kind in ipairs({ "script", "exec", "agent" }) do
    t:ok(jobs.kinds[kind] == compose.JOB_KINDS[kind], kind .. " is registered")
  end
  t:eq(#layer.get("tree").services, 1, "the tree has its service")
end

return tests
