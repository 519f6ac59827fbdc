-- A running sandbox's live state (a SandboxRun): what is written while it runs, apart from
-- its plan (lua/sandbox/plan.lua), which is built once and only read once the run started.
-- Every field a SandboxRun may hold is declared below with what it means; a write of any
-- other field is a mistake, treated as a plan's (DEMESNE_STRICT=1: it raises, naming the
-- field; otherwise it is logged once per field and kept).
--
-- A plan's SandboxRun is made when its run starts (run.start: oneshot.script_start,
-- oneshot.run_script, persistent.create, the warm pool's fill) or at the first write of a
-- live field (a warm sandbox handed to a call's plan, a job's plan rebuilt from its record).
-- The plan reads and writes its live fields through it (p.id is p:live().id), so a hook
-- given the plan (layer "sandbox_removed") sees both; the run names its plan (r.plan).
local log = require("demesne.log")

local run = {}

--- field name -> meaning: every field a SandboxRun may hold (the plan's "run" part).
run.FIELDS = {
  id = "the container id, once created",
  creating = "the task that creates the container",
  egress_handle = "its egress proxy",
  started_ms = "when the run started (Unix ms)",
  planned = "the plan hooks have run (its contributors and checks: the plan is complete)",
  quota_watch = "the watch of its output quota",
  removed = "its container was removed",
  tree_removed = "its removed hooks ran",
  exit_code = "the command's exit code, once read",
  timed_out = "whether the command timed out",
  vendor = "an agent run's vendor route (made by its before_create)",
  handed_back = "a repository run's branch came back",
}

local warned = {} -- message -> true: logged once

--- A mistake in a plan's or a run's use (an undeclared field, a write to a frozen plan):
--- raises `msg` under DEMESNE_STRICT=1 (at the writer, `level` frames up), else logs it once.
---@param msg string
---@param level integer  error level, from the caller of mistake
function run.mistake(msg, level)
  if os.getenv("DEMESNE_STRICT") == "1" then error(msg, level + 1) end
  if not warned[msg] then
    warned[msg] = true
    log.warning("demesne.sandbox", "%s", msg)
  end
end

---@class SandboxRun
---@field plan SandboxPlan  the plan it runs
local SandboxRun = {}

local meta = {
  __index = SandboxRun,
  __newindex = function(self, k, v)
    if not run.FIELDS[k] then
      run.mistake(("sandbox run: %s is not a declared field (lua/sandbox/run.lua FIELDS)"):format(tostring(k)), 2)
    end
    rawset(self, k, v)
  end,
}

--- A new SandboxRun of plan `p`, holding `fields` (each declared in run.FIELDS). The plan
--- makes its own (plan:live, run.start): this is for it.
---@param p SandboxPlan
---@param fields table|nil  field name -> value
---@return SandboxRun
function run.new(p, fields)
  local r = setmetatable({}, meta)
  rawset(r, "plan", p)
  for k, v in pairs(fields or {}) do r[k] = v end
  return r
end

--- Whether `v` is a SandboxRun.
---@param v any
---@return boolean
function run.is(v) return getmetatable(v) == meta end

--- Starts the run of plan `p`: its SandboxRun (made now, or the one its live writes made)
--- gets started_ms (`now_ms`, unless it has one). Returns the SandboxRun. The plan is
--- frozen later, once the run is launched (plan.launched: after script_send, for one).
---@param p SandboxPlan  (a plain table, a test's, gets started_ms itself)
---@param now_ms integer  Unix ms
---@return SandboxRun
function run.start(p, now_ms)
  if type(p.live) ~= "function" then -- a plain table (a test's): as before
    if p.started_ms == nil then p.started_ms = now_ms end
    return p
  end
  local r = p:live()
  if r.started_ms == nil then r.started_ms = now_ms end
  return r
end

return run
