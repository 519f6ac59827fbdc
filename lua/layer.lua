-- The layer contract (Knot Resolver's kr_layer_api): how a layer above plugs into the
-- layers below it. A layer is one table of optional hooks and services, declared by the
-- module that owns them and installed by the composition root (lua/compose.lua), never by
-- the side effect of a require:
--
--   tree.layer = {
--     name = "tree",
--     sandbox_plan = function(ctx, o, args) … end,
--     job_finish = function(rec) … end,
--     services = { { name = "tree", start = tree.start, stop = tree.stop_service } },
--   }
--
-- The layers below (sandbox, jobs, agent, vendor) know no layer above: they call
-- layer.run(hook, …), and every installed layer's hook runs, in the order the layers were
-- installed, under the hook's error policy (HOOKS below). The policy belongs to the hook,
-- not to the caller, so it is the same at every call site:
--
--   raise    an error stops the caller (a plan hook refuses the plan)
--   cleanup  an error is logged and the next hook runs; the caller's cleanup goes on;
--            async.CANCELLED still propagates (the task is being cancelled)
--   contain  an error is logged and the next hook runs, async.CANCELLED included;
--            layer.run never raises
--   admit    as contain, and a hook that answers nil (or false) refuses: layer.run returns
--            nil, why, spent at once (the hooks after it do not run)
local async = require("demesne.async")
local errors = require("demesne.errors")
local log = require("demesne.log")
local services = require("demesne.services")

local layer = {}

--- The hooks a layer may declare: name -> {policy, logger (of the layer that runs it),
--- args (what the hook is called with), by_run (a logged error names the run id, the first
--- argument)}. An installed layer's field that is neither a hook,
--- `name` nor `services` is refused (layer.install).
layer.HOOKS = {
  -- before a sandbox is made (sandbox.script_start, sandbox.create): may change the plan `o`
  -- (output_dir, mounts, workspace, extra_relay, env; sets o.tree, o.endpoint, o.ask);
  -- an error refuses the plan
  sandbox_plan = { policy = "raise", logger = "demesne.sandbox", args = "ctx, o, args" },
  -- a persistent sandbox is about to be destroyed (its children go first)
  sandbox_removing = { policy = "cleanup", logger = "demesne.sandbox", args = "run_id" },
  -- a sandbox's container is gone (o: the plan of a one-shot, frozen: only read; its live
  -- state, o.exit_code once its result was read, o.timed_out, o.started_ms, o.vendor, is read
  -- through it from its SandboxRun, o:live(), lua/sandbox/run.lua; {run_id} from destroy and
  -- the reaper, a plain table); why: what ended it, when known
  sandbox_removed = { policy = "cleanup", logger = "demesne.sandbox", args = "o, why" },
  -- a background job was started (its record saved)
  job_launch = { policy = "cleanup", logger = "demesne.jobs", args = "rec" },
  -- a job is about to be cancelled (what it started goes first)
  job_cancel = { policy = "cleanup", logger = "demesne.jobs", args = "rec, reason" },
  -- a job reached its terminal status (record saved, before its waiters wake)
  job_finish = { policy = "cleanup", logger = "demesne.jobs", args = "rec" },
  -- jobs.view is building `out` for the record: may add fields
  job_view = { policy = "cleanup", logger = "demesne.jobs", args = "rec, out" },
  -- an agent run's result `r` is built, before results.json is written: may add fields
  -- (children, reason)
  agent_result = { policy = "contain", logger = "demesne.agent", args = "o, r" },
  -- before a model request is forwarded: true, or nil, why, spent to refuse it (spent true
  -- when no later request can pass, false when only the requests in flight leave no room);
  -- resv = {id, usd (the most it may cost), model, input, output, est}
  vendor_admit = { policy = "admit", logger = "demesne.vendor", args = "run_id, resv", by_run = true },
  -- once a model request ended, whatever ended it: counts `usage` and its cost `usd` and
  -- gives `resv` back; usage nil and usd 0 when nothing is to be counted
  vendor_charge = { policy = "contain", logger = "demesne.vendor", args = "run_id, usd, usage, resv", by_run = true },
}

local FIELDS = { name = true, services = true }

---@class LayerService
---@field name string
---@field start fun()  starts the service (layer.start_services)
---@field stop fun()   stops it (layer.stop_services, in the reverse order of the starts)

---@class Layer
---@field name string
---@field services LayerService[]|nil
---@field sandbox_plan fun(ctx: ToolContext|nil, o: table, args: table)|nil
---@field sandbox_removing fun(run_id: string)|nil
---@field sandbox_removed fun(o: table, why: string|nil)|nil
---@field job_launch fun(rec: JobRecord)|nil
---@field job_cancel fun(rec: JobRecord, reason: string)|nil
---@field job_finish fun(rec: JobRecord)|nil
---@field job_view fun(rec: JobRecord, out: table)|nil
---@field agent_result fun(o: table, r: table)|nil
---@field vendor_admit (fun(run_id: string, resv: table): boolean|nil, string|nil, boolean|nil)|nil
---@field vendor_charge fun(run_id: string, usd: number, usage: table|nil, resv: table|nil)|nil

local installed = {} -- Layer[], in the order of installation
local running = { started = {} } -- RunningServices: what layer.start_services started, in order

local function bad(fmt, ...) error("layer.install: " .. fmt:format(...), 4) end

local function validate(l)
  if type(l) ~= "table" then bad("a layer is a table, not %s", type(l)) end
  if type(l.name) ~= "string" or l.name == "" then bad("a layer needs a name (a non-empty string)") end
  for k, v in pairs(l) do
    if type(k) ~= "string" or not (FIELDS[k] or layer.HOOKS[k]) then
      bad("layer %s: unknown field %s (hooks: %s)", l.name, tostring(k), table.concat(layer.hook_names(), ", "))
    end
    if layer.HOOKS[k] and type(v) ~= "function" then
      bad("layer %s: hook %s is a %s, not a function", l.name, k, type(v))
    end
  end
  if l.services ~= nil and type(l.services) ~= "table" then bad("layer %s: services is a list", l.name) end
  for i, s in ipairs(l.services or {}) do
    if type(s) ~= "table" or type(s.name) ~= "string" or type(s.start) ~= "function" or type(s.stop) ~= "function" then
      bad("layer %s: services[%d] needs a name, a start and a stop function", l.name, i)
    end
  end
end

--- The names of the hooks a layer may declare, sorted.
---@return string[]
function layer.hook_names()
  local out = {}
  for k in pairs(layer.HOOKS) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- Installs the layer `l` after those already installed: its hooks run after theirs. A
--- layer of a name already installed is not installed again (the same table: false; another
--- table of that name: an error). Raises, naming the field, on a field that is no hook, a
--- hook that is no function, a service without name, start and stop.
---@param l Layer
---@return boolean installed  false when it already was
function layer.install(l)
  validate(l)
  for _, x in ipairs(installed) do
    if x.name == l.name then
      if x == l then return false end
      error(("layer.install: another layer named %s is installed"):format(l.name), 2)
    end
  end
  installed[#installed + 1] = l
  return true
end

--- Removes the installed layer `name` (its services are not stopped). Returns whether it
--- was installed.
---@param name string
---@return boolean
function layer.uninstall(name)
  for i, x in ipairs(installed) do
    if x.name == name then
      table.remove(installed, i)
      return true
    end
  end
  return false
end

--- The names of the installed layers, in the order their hooks run.
---@return string[]
function layer.installed()
  local out = {}
  for i, x in ipairs(installed) do out[i] = x.name end
  return out
end

--- The installed layer `name`, or nil.
---@param name string
---@return Layer|nil
function layer.get(name)
  for _, x in ipairs(installed) do if x.name == name then return x end end
  return nil
end

local function warn(h, l, name, err, first)
  local who = h.by_run and (tostring(first) .. ": ") or ""
  log.warning(h.logger, "%s%s hook of layer %s: %s", who, name, l.name, errors.message(err))
end

--- Runs the hook `name` of every installed layer, in order, under the hook's error policy
--- (layer.HOOKS): raise, cleanup, contain or admit. For `admit`, returns true, or nil, why,
--- spent at the first refusal (why defaults to "refused", spent to true unless the hook said
--- false). An unknown hook name is a programmer mistake and raises.
---@param name string  a key of layer.HOOKS
---@param ... any      the hook's arguments
---@return boolean|nil ok, string|nil why, boolean|nil spent
function layer.run(name, ...)
  local h = layer.HOOKS[name]
  if not h then error("layer.run: no hook " .. tostring(name), 2) end
  local list = { table.unpack(installed) } -- a hook that installs or uninstalls does not skip one
  for _, l in ipairs(list) do
    local fn = l[name]
    if fn then
      if h.policy == "raise" then
        fn(...)
      else
        local ok, yes, why, spent = pcall(fn, ...)
        if not ok then
          if yes == async.CANCELLED and h.policy == "cleanup" then error(yes, 0) end
          warn(h, l, name, yes, (...))
        elseif h.policy == "admit" and not yes then
          return nil, tostring(why or "refused"), spent ~= false
        end
      end
    end
  end
  return true
end

--- Starts the services of the installed layers, in the order of installation (each
--- layer's in its list's order), with the services runner (lua/services.lua). A service
--- already started is not started again. A start that raises stops the services started
--- so far (in reverse) and raises.
function layer.start_services()
  local list = {}
  for _, l in ipairs(installed) do
    for _, s in ipairs(l.services or {}) do
      local up = false
      for _, x in ipairs(running.started) do up = up or x == s end
      if not up then list[#list + 1] = s end
    end
  end
  local ok, r = pcall(services.start, list, {})
  if not ok then
    layer.stop_services()
    error(r, 0)
  end
  for _, s in ipairs(r.started) do running.started[#running.started + 1] = s end
end

--- Stops the services layer.start_services started, in the reverse order of their starts,
--- once each (services.stop). A stop that raises is logged and the others still stop.
function layer.stop_services() services.stop(running, {}) end

return layer
