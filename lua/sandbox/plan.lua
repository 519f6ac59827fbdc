-- A sandbox's plan as one declared value (a SandboxPlan): every field it may hold is named
-- below, with the part of the plan it belongs to and what it means. The parts:
--
--   identity   which run this is: run id, container name, kind label, the tool that asked
--   placement  where it sits on the host and in a tree: its folders, mounts, workspace, the
--              relays and environment the layer above adds (lua/tree's plan hook)
--   policy     what it may do: engine, limits, egress policy, isolation, lifetimes
--   launch     how it starts: image, command, demesne-init's command line and Delivery
--              (lua/sandbox/delivery.lua), the agent run's and repository's extras
--   run        what the run holds once it is under way: container id, proxy, times, exit
--              status (the live state; not the plan's own: it lives in the plan's SandboxRun,
--              lua/sandbox/run.lua, and the plan reads and writes it through, p.id being
--              p:live().id)
--
-- A plan is built once (plan.new, by spec.prepare, the warm pool, a job's record) and its
-- contributors (the plan hooks of the layer above, the repository, the devcontainer) fill
-- it before it is checked and launched. A write of a field that is not declared here is a
-- mistake: with DEMESNE_STRICT=1 (the tests) it raises, naming the field; otherwise it is
-- logged once per field and kept. A job's record keeps what it needs of the plan
-- (plan:record) and a restarted server rebuilds it from there (plan.from_record).
local run = require("demesne.sandbox.run")

local plan = {}

--- The parts of a plan, in the order a plan is built.
plan.PARTS = { "identity", "placement", "policy", "launch", "run" }

--- field name -> {part, meaning, why}: every field a SandboxPlan may hold; `why`, for the
--- few a frozen plan may still have written, says why (SandboxPlan:freeze).
plan.FIELDS = {
  -- identity
  run_id = { "identity", "the run id (sortable, unique); names its folders and labels" },
  name = { "identity", "the container's name (demesne-<run id>)" },
  kind = { "identity", "the container's kind label: oneshot, job or persistent" },
  tool = { "identity", "the tool that asked (sandbox_script, sandbox_agent, …)" },
  exec_id = { "identity", "the id of the command's exec record (main for a one-shot)" },
  args = { "identity", "the call's arguments, for the plan hooks (mcp, tree, budget_usd)" },
  -- placement
  output_dir = { "placement", "the host folder mounted at /out" },
  run_dir = { "placement", "the host folder mounted at /.demesne/run (exec records, relay sockets)" },
  mounts = { "placement", "host inputs mounted read-only: {host, target, field}" },
  workspace = { "placement", "a host folder mounted at /workspace (a tree node's, shared with its children)" },
  home = { "placement", "a host folder mounted at /root (an agent run's kept HOME)" },
  keep_workspace = { "placement", "a kept /workspace a tree root takes (lua/agent/continue.lua)" },
  tree = { "placement", "the run id of its tree node (lua/tree), when it is one" },
  endpoint = { "placement", "its in-sandbox MCP endpoint {url, port, token, socket, sandbox_socket, tree}" },
  host_mcp = { "placement", "the host MCP servers offered on its endpoint" },
  ask = { "placement", "whom its egress `ask` verdicts go to {root, lineage, has_inputs, tool, client}" },
  extra_relay = { "placement", "demesne-init relay options beyond the egress policy's (vendor route, endpoint)" },
  labels = { "placement", "extra container labels, names without io.demesne." },
  -- policy
  engine = { "policy", "the engine adapter" },
  limits = { "policy", "resolved limits {memory_mb, cpus, pids}" },
  egress = { "policy", "the egress policy" },
  isolation = { "policy", "container or gvisor" },
  userns = { "policy", "whether it gets a user namespace" },
  ttl = { "policy", "seconds the container may live (its expires_at label)" },
  timeout = { "policy", "the command's timeout in seconds" },
  -- launch
  image_arg = { "launch", "the image the call named (nil: the default)" },
  image_ref = { "launch", "the resolved image reference" },
  image_name = { "launch", "the image's name for labels and answers" },
  command = { "launch", "the shell command (sh -c) of a one-shot" },
  argv = { "launch", "the command's argv, instead of sh -c command" },
  cwd = { "launch", "the command's working folder (default /out)" },
  stdout_path = { "launch", "where the command's stdout goes (default /out/stdout.log)" },
  env = { "launch", "the command's environment, a list of K=V" },
  caller_env = { "launch", "the caller's env map, kept for a warm sandbox (script_env)" },
  cmd = { "launch", "demesne-init's command line (the container's command)" },
  delivery = { "launch", "how the command reaches demesne-init (lua/sandbox/delivery.lua)" },
  control = { "launch", "a persistent sandbox's demesne-init serves a control socket" },
  background = { "launch", "made outside a call (the warm pool): no urgent create" },
  before_create = { "launch", "a function(plan) run just before the container is created" },
  after_call = { "launch", "a function run when the call's teardown starts (the pool refills)" },
  devcontainer = { "launch", "the repository's devcontainer plan (lua/images/devcontainer.lua)" },
  repo = { "launch", "the host repository's plan (lua/repo)",
    "written after the start: a script job's hand-back reloads the saved plan (lua/jobs/script.lua)" },
  provider = { "launch", "an agent run's provider" },
  model = { "launch", "an agent run's model" },
  credential = { "launch", "an agent run's credential (never recorded)" },
  token = { "launch", "an agent run's per-run vendor route token" },
  run = { "launch", "an agent run's ProviderRun (what its CLI is wired from)" },
  wrapper = { "launch", "an agent run's run.sh" },
  resumable = { "launch", "whether an agent run's CLI can resume its session" },
  continues = { "launch", "the run id an agent run continues" },
  chain = { "launch", "the keep of the chain of continues it belongs to" },
  keep_id = { "launch", "the keep an agent run holds (its HOME and /workspace)" },
  -- run: the live state, in the plan's SandboxRun (lua/sandbox/run.lua FIELDS)
}

---@class SandboxPlan
local SandboxPlan = {}

-- A plan's storage is apart from the plan table (which stays empty), so that every write
-- passes __newindex: a plan's fields, and its SandboxRun; both weak-keyed on the plan.
local store = setmetatable({}, { __mode = "k" }) -- plan -> field -> value
local live = setmetatable({}, { __mode = "k" }) -- plan -> its SandboxRun
local frozen = setmetatable({}, { __mode = "k" }) -- plan -> true once launched

local function live_of(self)
  local r = live[self]
  if not r then
    r = run.new(self)
    live[self] = r
  end
  return r
end

local meta = {
  __index = function(self, k)
    if run.FIELDS[k] then
      local r = live[self]
      return r and r[k]
    end
    local v = store[self][k]
    if v ~= nil then return v end
    return SandboxPlan[k]
  end,
  __newindex = function(self, k, v)
    if run.FIELDS[k] then
      live_of(self)[k] = v
      return
    end
    local f = plan.FIELDS[k]
    if not f then
      run.mistake(("sandbox plan: %s is not a declared field (lua/sandbox/plan.lua FIELDS)"):format(tostring(k)), 2)
    elseif frozen[self] and not f[3] then
      run.mistake(("sandbox plan: %s written after its run started (the plan is frozen; live state goes in "
        .. "its SandboxRun, lua/sandbox/run.lua)"):format(tostring(k)), 2)
    end
    store[self][k] = v
  end,
  -- pairs(plan): its fields, then its live ones
  __pairs = function(self)
    local all = {}
    for k, v in pairs(store[self]) do all[k] = v end
    for k, v in pairs(live[self] or {}) do
      if k ~= "plan" then all[k] = v end
    end
    return next, all, nil
  end,
}

--- A new plan holding `fields` (each must be declared in plan.FIELDS: see undeclared writes
--- in the header).
---@param fields table|nil  field name -> value
---@return SandboxPlan
function plan.new(fields)
  local p = setmetatable({}, meta)
  store[p] = {}
  for k, v in pairs(fields or {}) do p[k] = v end
  return p
end

--- Whether `v` is a SandboxPlan.
---@param v any
---@return boolean
function plan.is(v) return getmetatable(v) == meta end

--- The part a field belongs to ("identity", "placement", "policy", "launch", "run"), or nil
--- when it is not declared.
---@param field string
---@return string|nil
function plan.part(field)
  if run.FIELDS[field] then return "run" end
  local f = plan.FIELDS[field]
  return f and f[1]
end

--- The plan's SandboxRun (lua/sandbox/run.lua): its live state, made now if it has none.
---@return SandboxRun
function SandboxPlan:live() return live_of(self) end

--- Freezes the plan once its run is launched: from then on a write of a plan field (not its
--- live ones, which go to its SandboxRun; nor the few FIELDS that say why they may change)
--- is a mistake, as an undeclared one is (DEMESNE_STRICT=1: it raises, naming the field).
function SandboxPlan:freeze() frozen[self] = true end

--- Whether the plan is frozen (SandboxPlan:freeze).
---@return boolean
function SandboxPlan:is_frozen() return frozen[self] == true end

--- Freezes `p` (SandboxPlan:freeze) once its run is launched, when it is a SandboxPlan (a
--- test's plain table is left as it is). The launchers call it: run_script once the command
--- is handed over (a fresh sandbox or a warm one), a background job once it is launched, an
--- agent run once started, the warm pool once a sandbox is filled, persistent.create once
--- its container runs.
---@param p table
function plan.launched(p)
  if plan.is(p) then p:freeze() end
end

--- The fields a job's record keeps of its plan, under the record's own names: record name
--- -> plan field.
plan.RECORD = { run_id = "run_id", container = "name", output_dir = "output_dir", run_dir = "run_dir",
  exec_id = "exec_id", timeout_seconds = "timeout" }

--- What a job's record keeps of this plan (plan.RECORD): {run_id, container, output_dir,
--- run_dir, exec_id, timeout_seconds}; the live state and what cannot be saved (the engine,
--- functions, the credential) are left out.
---@return table
function SandboxPlan:record()
  local out = {}
  for rk, f in pairs(plan.RECORD) do out[rk] = self[f] end
  return out
end

--- The plan of a job a server that is gone left running, rebuilt from its record (the
--- fields of plan:record): identity and placement, the container `rec.container` as its id,
--- and `extra` (e.g. engine, tree) over them.
---@param rec table  a job record (run_id, container, output_dir, run_dir, exec_id, timeout_seconds)
---@param extra table|nil  more fields (declared ones)
---@return SandboxPlan
function plan.from_record(rec, extra)
  local p = plan.new()
  for rk, f in pairs(plan.RECORD) do p[f] = rec[rk] end
  p.id = rec.container
  for k, v in pairs(extra or {}) do p[k] = v end
  return p
end

return plan
