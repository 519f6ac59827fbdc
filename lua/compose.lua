-- The composition root: the one place that plugs the layers together. Loading a module
-- wires nothing; `demesne serve` (lua/cmd/serve.lua) and the test runner (lua/testing.lua)
-- call compose.install() once before they use the runtime, and it
--   * installs the layers above the sandbox, job, agent and vendor layers (lua/layer.lua),
--     in the order their hooks run: the tree (nested sandboxes: plans, limits, budget, the
--     tree's service), then the cockpit (the record of a plain run once its container goes);
--   * registers the kinds of background job with the job registry (lua/jobs): script and
--     exec (sandboxes), agent (agent runs with their vendor route);
--   * points the tree's budget at its reaction (store.on_budget_spent = tree.budget_spent).
--   * declares the server's services (compose.SERVICES): its long-running parts, in the
--     order `demesne serve` starts them; it stops them in the reverse order (lua/services.lua).
--
-- Only this module installs a layer or registers a job kind (tests/lua/structure_test.lua).
local agent_job = require("demesne.agent.job")
local async = require("demesne.async")
local config = require("demesne.config")
local control = require("demesne.cockpit.control")
local endpoint = require("demesne.tree.endpoint")
local exec_job = require("demesne.jobs.exec")
local hostmcp = require("demesne.hostmcp")
local jobs = require("demesne.jobs")
local layer = require("demesne.layer")
local log = require("demesne.log")
local pool = require("demesne.pool")
local runs = require("demesne.cockpit.runs")
local sandbox = require("demesne.sandbox")
local script_job = require("demesne.jobs.script")
local store = require("demesne.tree.store")
local tools = require("demesne.tools")
local tree = require("demesne.tree")

local compose = {}

--- The kinds of background job, by the name their records carry (the `kind` field).
compose.JOB_KINDS = { script = script_job, exec = exec_job, agent = agent_job }

--- The layers, in the order they are installed (their hooks run in this order).
compose.LAYERS = { tree.layer, runs.layer }

local reaper -- the reaper's task (async.every), while the service runs

--- The server's services (lua/services.lua), in the order `demesne serve` starts them; it
--- stops them in the reverse order once its transport has returned. ctx: {fixtures (a
--- folder of test tools or nil), transport ("stdio" or "http"), urls (the --http
--- addresses)}; the tools service sets ctx.registry for the endpoint.
--- Two parts stop inside the transport, not here, so they have no stop below: the warm pool
--- (pool.stop, then teardown.wait) in its on_shutdown, before the answers in flight are
--- flushed and the transport returns, and the in-sandbox endpoint (endpoint.stop) in its
--- on_stop(timeout_ms), while the loop still runs the requests it cancels (lua/cmd/serve.lua).
---@type Service[]
compose.SERVICES = {
  -- the persistent sandboxes' output quota watches (the reaper takes them up): dropped last,
  -- the next server takes them up again
  { name = "quota watches", stop = function() sandbox.unwatch_all() end },
  -- the reaper: at start and every reap_interval seconds, remove expired sandboxes and
  -- one-shot containers whose server is gone (from the engine's labels); watch: the
  -- persistent sandboxes still running get their output quota watched again
  { name = "reaper",
    start = function()
      reaper = async.every("reaper", function() return config.get("reap_interval") * 1000 end,
        function() sandbox.reap({ watch = true }) end, { logger = "demesne.reaper" })
    end,
    stop = function() async.cancel(reaper, "shutdown"); reaper = nil end },
  -- what this server leaves if it is killed before its own clean-up (a client may SIGKILL it
  -- at once) goes as soon as it has ended: the exit reaper, a process of its own that
  -- outlives the server on purpose (no stop)
  { name = "exit reaper",
    start = function()
      local ok, err = sandbox.start_exit_reaper()
      if not ok then log.warning("demesne.reaper", "no exit reaper (%s): what a killed server leaves waits for "
        .. "the next server", tostring(err)) end
    end },
  -- host MCP servers: their declaration problems are logged now; they start on first use,
  -- and none outlives the server
  { name = "host MCP",
    start = function()
      async.spawn("host MCP configuration", function()
        local ok, err = pcall(hostmcp.load)
        if not ok and err ~= async.CANCELLED then log.error("demesne.hostmcp", "%s", tostring(err)) end
      end)
    end,
    stop = function() hostmcp.shutdown_outside_task() end },
  -- background jobs: re-attach the ones a previous server left running, sweep every
  -- reap_interval; they outlive the server (the next one re-attaches them)
  { name = "jobs", start = function() jobs.start() end, stop = function() jobs.stop() end },
  -- warm sandboxes for sandbox_script (lua/pool.lua); stopped in the transport's on_shutdown
  { name = "pool", start = function() pool.start() end },
  -- the tools (the built-in and the user's, and --fixtures): the registry the endpoint serves
  { name = "tools", start = function(ctx) ctx.registry = tools.load({ fixtures = ctx.fixtures }) end },
  -- nested sandboxes' in-sandbox MCP endpoint; stopped in the transport's on_stop
  { name = "endpoint",
    start = function(ctx)
      local ok, err = endpoint.start(ctx.registry)
      if not ok then log.error("demesne.tree", "the in-sandbox MCP endpoint cannot start: %s", tostring(err)) end
    end },
  -- the installed layers' services (the tree's: resume the trees a previous server left,
  -- sweep every reap_interval), in the order of installation; stopped in reverse
  { name = "layers", start = function() layer.start_services() end, stop = function() layer.stop_services() end },
  -- the control socket: demesne ps, logs, cancel and ui find this server there
  { name = "control",
    start = function(ctx) control.start({ transport = ctx.transport, urls = ctx.urls }) end,
    stop = function() control.stop() end },
}

--- Installs the layers, registers the job kinds and the budget's reaction. Idempotent: a
--- second call changes nothing.
function compose.install()
  for _, l in ipairs(compose.LAYERS) do layer.install(l) end
  for _, name in ipairs({ "script", "exec", "agent" }) do jobs.register(name, compose.JOB_KINDS[name]) end
  store.on_budget_spent = tree.budget_spent
end

return compose
