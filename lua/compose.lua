-- The composition root: the one place that plugs the layers together. Loading a module
-- wires nothing; `demesne serve` (lua/cmd/serve.lua) and the test runner (lua/testing.lua)
-- call compose.install() once before they use the runtime, and it
--   * installs the layers above the sandbox, job, agent and vendor layers (lua/layer.lua),
--     in the order their hooks run: the tree (nested sandboxes: plans, limits, budget, the
--     tree's service), then the cockpit (the record of a plain run once its container goes);
--   * registers the kinds of background job with the job registry (lua/jobs): script and
--     exec (sandboxes), agent (agent runs with their vendor route);
--   * points the tree's budget at its reaction (store.on_budget_spent = tree.budget_spent).
-- The services of the installed layers are started and stopped by layer.start_services and
-- layer.stop_services (`demesne serve`).
--
-- Only this module installs a layer or registers a job kind (tests/lua/structure_test.lua).
local agent_job = require("demesne.agent.job")
local exec_job = require("demesne.jobs.exec")
local jobs = require("demesne.jobs")
local layer = require("demesne.layer")
local runs = require("demesne.cockpit.runs")
local script_job = require("demesne.jobs.script")
local store = require("demesne.tree.store")
local tree = require("demesne.tree")

local compose = {}

--- The kinds of background job, by the name their records carry (the `kind` field).
compose.JOB_KINDS = { script = script_job, exec = exec_job, agent = agent_job }

--- The layers, in the order they are installed (their hooks run in this order).
compose.LAYERS = { tree.layer, runs.layer }

--- Installs the layers, registers the job kinds and the budget's reaction. Idempotent: a
--- second call changes nothing.
function compose.install()
  for _, l in ipairs(compose.LAYERS) do layer.install(l) end
  for _, name in ipairs({ "script", "exec", "agent" }) do jobs.register(name, compose.JOB_KINDS[name]) end
  store.on_budget_spent = tree.budget_spent
end

return compose
