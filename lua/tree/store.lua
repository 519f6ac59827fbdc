-- The records of nested sandboxes (lua/tree): one JSON file per tree node in
-- <state_dir>/tree/<run id>.json (0600, out of every sandbox's reach), this process's copies,
-- scope (what a run may see: itself and what is below it), the tree's limits and money, and
-- the views built from the records (subtree totals, children, the usage report).
local async = require("demesne.async")
local errors = require("demesne.errors")
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local util = require("demesne.util")
local fs = require("core.fs")

local store = {}

local LOGGER = "demesne.tree"
local RECORD_MAX = 4 * 1024 * 1024

local now_ms = util.now_ms
local fail = errors.raise

---@class TreeNode
---@field run_id string
---@field root string           the root's run id (itself for a root)
---@field parent string|nil     the parent's run id
---@field depth integer         0 for a root
---@field name string|nil       the name its parent gave it (nil for a root)
---@field kind string           script, create, agent or research
---@field tool string
---@field status string         running, succeeded, failed, cancelled, lost, destroyed
---@field active boolean        its container is there (it holds a slot)
---@field reason string|nil
---@field exit_code integer|nil
---@field owner string          the server process that runs it (host/pid/starttime)
---@field started_ms integer
---@field finished_ms integer|nil
---@field job_id string|nil     the background job running it
---@field output_dir string
---@field run_dir string
---@field egress string         its egress policy
---@field inputs table[]        the host inputs its children inherit ({host, target})
---@field workspace string|nil  the host folder that is its /workspace
---@field owns_workspace boolean|nil  it made that folder (removed when it ends)
---@field endpoint table|nil    {token, socket}
---@field host_mcp string[]|nil  the host MCP servers of its subtree (lua/hostmcp): an agent node is
---   offered them; a child gets at most these. nil or empty: none
---@field children table[]      {name, run_id|nil} in spawn order; a name is never reused
---@field cost_usd number       its own model spend
---@field usage table|nil       its own tokens: {models = {model = {requests, input, output, cache_creation,
---   cache_read, cost_usd}}}
---@field cancel_reason string|nil
---@field walls table|nil       {isolation, userns, limits = {memory_mb, cpus, pids}}: what it runs with, the floor
---   and ceiling of its children's (lua/tree/walls.lua); a root's also tree = {memory_mb, cpus, pids} (totals)
---@field limits table|nil      root: {depth, children, running, jobs, job_records}
---@field jobs string[]|nil     root: the background jobs started on its members below it, oldest first
---   (the kept records that count against tree.jobs and tree.job_records)
---@field budget_usd number|nil root: the tree's budget
---@field spent_usd number|nil  root: the tree's spend
---@field reservations table|nil  root: the model requests in flight, id -> {run_id, usd, model, owner}
---   (what each may cost at most; a server that died with some is charged them in full when
---   the record is next read)
---@field members string[]|nil  root: every node's run id

local cache = {}     -- run_id -> TreeNode (this process's copy)
local mem = {}       -- run_id -> {ended = event, reserved = n (roots), held = {memory_mb, cpus, pids} (roots:
                     -- the reserved spawns'), slot = event (roots), resv = {id -> the vendor route's
                     -- reservation, its usd kept current} (roots)}
local settle_stale   -- (root) charges the reservations a dead server left (below)

--- The in-memory state of a run (events, slot reservations), made on first use.
---@param id string
---@return table
function store.mem(id)
  local x = mem[id]
  if not x then
    x = { ended = async.event(), reserved = 0 }
    mem[id] = x
  end
  return x
end

--- The folder of the node records: <state_dir>/tree.
---@return string
function store.dir() return config.get("state_dir") .. "/tree" end

local function record_path(id) return store.dir() .. "/" .. id .. ".json" end

local function valid_id(id) return type(id) == "string" and #id <= 64 and id:match("^[%w][%w%-]*$") ~= nil end

--- Writes a node's record atomically (0600). A failure is logged; returns true when saved.
---@param n TreeNode
---@return boolean|nil
function store.save(n)
  n.updated_ms = now_ms()
  local ok, err = fs.mkdir_p(store.dir(), 448) -- 0700
  if ok then ok, err = fs.write_atomic(record_path(n.run_id), json.encode(n) .. "\n", 384) end
  if not ok then log.error(LOGGER, "cannot save the node %s: %s", n.run_id, tostring(err)) end
  return ok
end

local INTS = { "depth", "exit_code", "started_ms", "finished_ms", "updated_ms" }

--- The node of a run (nil when the run is no tree node).
---@param run_id string
---@return TreeNode|nil
function store.get(run_id)
  if not valid_id(run_id) then return nil end
  local n = cache[run_id]
  if n then return n end
  local s = fs.read_file(record_path(run_id), 0, RECORD_MAX)
  n = s and json.decode(s)
  if type(n) ~= "table" or n.run_id ~= run_id or type(n.root) ~= "string" then return nil end
  for _, k in ipairs(INTS) do
    if type(n[k]) == "number" then n[k] = math.tointeger(math.floor(n[k])) end
  end
  n.children = type(n.children) == "table" and n.children or {}
  json.array(n.children)
  n.inputs = type(n.inputs) == "table" and n.inputs or {}
  json.array(n.inputs)
  if n.members then json.array(n.members) end
  local hm = json.array()
  for _, x in ipairs(type(n.host_mcp) == "table" and n.host_mcp or {}) do
    if type(x) == "string" then hm[#hm + 1] = x end
  end
  n.host_mcp = hm
  n.cost_usd = tonumber(n.cost_usd) or 0
  cache[run_id] = n
  if type(n.reservations) == "table" and next(n.reservations) ~= nil then settle_stale(n) end
  return n
end

--- The node of a run, or an error (a programmer mistake: the caller knows it exists).
---@param run_id string
---@return TreeNode
function store.must(run_id)
  local n = store.get(run_id)
  if not n then error(("tree: no node %s"):format(tostring(run_id)), 2) end
  return n
end

--- True when `id` is `of` itself or below it.
---@param of string
---@param id string
---@return boolean
function store.within(of, id)
  local n = store.get(id)
  for _ = 1, 64 do
    if not n then return false end
    if n.run_id == of then return true end
    n = n.parent and store.get(n.parent)
  end
  return false
end

local function below(of, id) return id ~= of and store.within(of, id) end

--- Whether the run `caller` may see the job `job_id`: a job whose run (or, for an exec,
--- whose sandbox) is strictly below the caller in its tree. Everything else is "unknown".
---@param caller string
---@param job_id string
---@return boolean
function store.sees_job(caller, job_id)
  if not jobs.valid_id(job_id) then return false end
  local rec = jobs.get(job_id)
  if not rec then return false end
  local node = rec.run_id or rec.sandbox_id
  return type(node) == "string" and below(caller, node)
end

--- Whether the run `caller` may act on the persistent sandbox `sandbox_id` (one made in its
--- subtree).
---@param caller string
---@param sandbox_id string
---@return boolean
function store.sees_sandbox(caller, sandbox_id)
  local n = store.get(sandbox_id)
  return n ~= nil and n.kind == "create" and below(caller, sandbox_id)
end

--- Whether the run `caller` may see the run `run_id` (itself or one below it).
---@param caller string  the calling run's id
---@param run_id string
---@return boolean
function store.sees_run(caller, run_id) return store.within(caller, run_id) end

--------------------------------------------------------------------------------------------
-- Limits and money

--- A dollar amount for a message: 2 decimals, 4 below a cent.
---@param x number
---@return string
function store.money(x)
  if x >= 0.01 or x == 0 then return ("%.2f"):format(x) end
  return ("%.4f"):format(x)
end

--- The reason a run of a tree whose budget is spent ends with.
---@param budget number
---@return string
function store.budget_reason(budget) return ("budget of $%s spent"):format(store.money(budget)) end

local function ceiling(field, v, max)
  if v > max then
    fail(("%s: %s is above the ceiling of %s set in the configuration"):format(field, sandbox.num(v), sandbox.num(max)))
  end
  if v < 1 then fail(field .. ": must be at least 1") end
  return math.floor(v)
end

--- Resolves a host call's `tree` limits and `budget_usd` against the configuration:
--- {depth, children, running, jobs, job_records}, budget (nil: none). Fails naming the field.
---@param t table|nil
---@param budget number|nil
---@return table limits, number|nil budget
function store.limits(t, budget)
  t = type(t) == "table" and t or {}
  local l = {
    depth = ceiling("tree.depth", t.depth or config.get("tree_depth_default"), config.get("tree_depth_max")),
    children = ceiling("tree.children", t.children or config.get("tree_children_default"),
      config.get("tree_children_max")),
    running = ceiling("tree.running", t.running or config.get("tree_running_default"), config.get("tree_running_max")),
    jobs = ceiling("tree.jobs", t.jobs or config.get("tree_jobs_default"), config.get("tree_jobs_max")),
    job_records = ceiling("tree.job_records", t.job_records or config.get("tree_job_records_default"),
      config.get("tree_job_records_max")),
  }
  if l.job_records < l.jobs then
    fail(("tree.job_records: %d is below tree.jobs (%d): every running job keeps a record"):format(l.job_records, l.jobs))
  end
  local max = config.get("tree_budget_usd_max")
  local b = budget or config.get("tree_budget_usd_default")
  if type(b) ~= "number" or b ~= b or b < 0 then fail("budget_usd: must be a non-negative number") end
  if max > 0 and (b == 0 or b > max) then
    if budget and b > max then
      fail(("budget_usd: %s is above the ceiling of %s set in the configuration"):format(sandbox.num(b), sandbox.num(max)))
    end
    b = max
  end
  return l, b > 0 and b or nil
end

--- What the tree of `root` has spent and its budget (nil when it has none).
---@param root string
---@return number spent, number|nil budget
function store.spent(root)
  local r = store.get(root)
  if not r then return 0, nil end
  r = store.get(r.root) or r
  return tonumber(r.spent_usd) or 0, r.budget_usd
end

-- A dollar amount from a reservation or a record: finite and >= 0, else 0.
local function usd_of(v)
  v = tonumber(v) or 0
  if v ~= v or v < 0 or v == math.huge then return 0 end
  return v
end

--- What the model requests of the tree of `root` in flight in this process hold reserved,
--- in USD (each the most it can still cost).
---@param root string
---@return number usd
function store.reserved(root)
  local x = mem[root]
  local sum = 0
  for _, resv in pairs(x and x.resv or {}) do sum = sum + usd_of(resv.usd) end
  return sum
end

--- Checks before a model request of the run `run_id` is forwarded and reserves it against
--- its tree's budget. `resv` = {id, usd, model} (the vendor route's reservation: its usd the
--- most the request can cost, lowered by the route while the answer comes). Admitted when
--- the budget is not spent and the spend, what the requests in flight hold and this
--- reservation stay within the budget; a request with none in flight is admitted whenever
--- the budget is not spent (so the spend passes the budget by at most one reservation).
--- Returns true (the reservation is held until store.charge gives it back), or nil and
--- "budget of $X spent", or nil, a sentence naming the budget, the spend and the reserved
--- amount, and false (the budget is not spent: the requests in flight leave no room). Without
--- `resv` it only says whether the budget is spent. A run that is no tree node, or of a
--- tree without a budget, passes.
---@param run_id string
---@param resv {id: string, usd: number, model: string|nil}|nil
---@return boolean|nil ok, string|nil why, boolean|nil spent
function store.check(run_id, resv)
  local n = store.get(run_id)
  if not n then return true end
  local r = store.get(n.root)
  if not r or not r.budget_usd then return true end
  local spent = usd_of(r.spent_usd)
  if r.budget_spent or spent >= r.budget_usd then return nil, store.budget_reason(r.budget_usd) end
  if type(resv) ~= "table" or type(resv.id) ~= "string" then return true end
  local usd, held = usd_of(resv.usd), store.reserved(r.run_id)
  if held > 0 and spent + held + usd > r.budget_usd then
    return nil, ("budget of $%s: $%s spent and $%s reserved by the model requests in flight leave no room for "
      .. "this one's $%s (its max_tokens and its size); it can go once those end"):format(store.money(r.budget_usd),
      store.money(spent), store.money(held), store.money(usd)), false
  end
  local x = store.mem(r.run_id)
  x.resv = x.resv or {}
  x.resv[resv.id] = resv
  r.reservations = type(r.reservations) == "table" and r.reservations or {}
  r.reservations[resv.id] = { run_id = n.run_id, usd = usd, model = resv.model, owner = sandbox.owner() }
  store.save(r)
  return true
end

-- Gives back the reservation `resv` of the tree `r`. True when the record changed.
local function release(r, resv)
  if type(resv) ~= "table" or type(resv.id) ~= "string" then return false end
  local x = mem[r.run_id]
  if x and x.resv then x.resv[resv.id] = nil end
  if type(r.reservations) == "table" and r.reservations[resv.id] then
    r.reservations[resv.id] = nil
    return true
  end
  return false
end

--- Adds one model request (`usd`, `u` = {model, input, output, cache_creation, cache_read})
--- to a node's own usage.
---@param n TreeNode
---@param usd number
---@param u table|nil
function store.add_usage(n, usd, u)
  n.usage = type(n.usage) == "table" and n.usage or { models = {} }
  n.usage.models = type(n.usage.models) == "table" and n.usage.models or {}
  local model = type(u) == "table" and type(u.model) == "string" and u.model or "unknown"
  local row = n.usage.models[model]
  if not row then
    row = { requests = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 }
    n.usage.models[model] = row
  end
  row.requests = row.requests + 1
  for _, k in ipairs({ "input", "output", "cache_creation", "cache_read" }) do
    local v = type(u) == "table" and tonumber(u[k]) or 0
    if v and v > 0 then row[k] = row[k] + v end
  end
  row.cost_usd = row.cost_usd + usd
end

--------------------------------------------------------------------------------------------
-- Results and usage

local TOKENS = { "input", "output", "cache_creation", "cache_read" }

--- A node's own usage: {cost_usd, input, output, cache_creation, cache_read, models}.
---@param n TreeNode
---@return table
function store.own_usage(n)
  local t = { input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = tonumber(n.cost_usd) or 0,
    models = {} }
  local models = type(n.usage) == "table" and type(n.usage.models) == "table" and n.usage.models or {}
  for model, row in pairs(models) do
    if type(row) == "table" then
      local r = { requests = math.tointeger(tonumber(row.requests) or 0) or 0, cost_usd = tonumber(row.cost_usd) or 0 }
      for _, k in ipairs(TOKENS) do
        r[k] = math.tointeger(tonumber(row[k]) or 0) or 0
        t[k] = t[k] + r[k]
      end
      t.models[model] = r
    end
  end
  return t
end

local function add_into(acc, u)
  acc.cost_usd = acc.cost_usd + u.cost_usd
  for _, k in ipairs(TOKENS) do acc[k] = acc[k] + u[k] end
  for model, r in pairs(u.models) do
    local a = acc.models[model]
    if not a then
      a = { requests = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, cost_usd = 0 }
      acc.models[model] = a
    end
    for k, v in pairs(r) do a[k] = (a[k] or 0) + v end
  end
end

--- Every node of the subtree of `n`, depth first in spawn order: {node, depth (relative), path}.
---@param n TreeNode
---@param out table[]|nil    the list to add to (a new one when nil)
---@param depth integer|nil  the depth of `n` relative to the first call's node (0)
---@param path string|nil    the path of names from that node down to `n` ("")
---@return table[]
function store.walk(n, out, depth, path)
  out = out or {}
  out[#out + 1] = { node = n, depth = depth or 0, path = path or "" }
  for _, c in ipairs(n.children) do
    local x = c.run_id and store.get(c.run_id)
    if x then store.walk(x, out, (depth or 0) + 1, (path and path ~= "" and (path .. "/") or "") .. c.name) end
  end
  return out
end

--- The subtree totals of a run (itself and everything below it): {cost_usd, input, output,
--- cache_creation, cache_read, models = {model = {...}}, nodes, running}.
---@param run_id string
---@return table|nil
function store.totals(run_id)
  local n = store.get(run_id)
  if not n then return nil end
  local acc = { cost_usd = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, models = {}, nodes = 0,
    running = 0 }
  for _, w in ipairs(store.walk(n)) do
    add_into(acc, store.own_usage(w.node))
    acc.nodes = acc.nodes + 1
    if w.node.active then acc.running = acc.running + 1 end
  end
  return acc
end

--- A run's children as results.json lists them: {name, kind, status, exit_code, reason,
--- cost_usd (own), total_cost_usd (its subtree), output_dir, run_id, job_id}.
---@param run_id string
---@return table[]
function store.children(run_id)
  local n = store.get(run_id)
  local out = json.array()
  if not n then return out end
  for _, c in ipairs(n.children) do
    local x = c.run_id and store.get(c.run_id)
    if x then
      local t = store.totals(x.run_id)
      out[#out + 1] = { name = c.name, kind = x.kind, status = x.status, exit_code = x.exit_code, reason = x.reason,
        cost_usd = tonumber(x.cost_usd) or 0, total_cost_usd = t.cost_usd, output_dir = x.output_dir,
        run_id = x.run_id, job_id = x.job_id }
    else
      out[#out + 1] = { name = c.name, status = "failed", reason = "the spawn failed before the sandbox existed" }
    end
  end
  return out
end

--- The usage report of a run's subtree (sandbox_usage_report): total cost, tokens by type
--- and by model, the cache-read share, and one row per node.
---@param run_id string
---@return table|nil report, string|nil err
function store.report(run_id)
  local n = store.get(run_id)
  if not n then return nil, ("run %s is no part of a sandbox tree"):format(tostring(run_id)) end
  local acc = { cost_usd = 0, input = 0, output = 0, cache_creation = 0, cache_read = 0, models = {} }
  local rows = json.array()
  for _, w in ipairs(store.walk(n)) do
    local own = store.own_usage(w.node)
    add_into(acc, own)
    local tokens = own.input + own.output + own.cache_creation + own.cache_read
    rows[#rows + 1] = { run_id = w.node.run_id, name = w.node.name or "", path = w.path, depth = w.depth,
      kind = w.node.kind, status = w.node.status, cost_usd = own.cost_usd, tokens = tokens,
      exit_code = w.node.exit_code, job_id = w.node.job_id, output_dir = w.node.output_dir }
  end
  local by_model = json.array()
  local names = {}
  for model in pairs(acc.models) do names[#names + 1] = model end
  table.sort(names)
  for _, model in ipairs(names) do
    local r = acc.models[model]
    by_model[#by_model + 1] = { model = model, requests = r.requests, input = r.input, output = r.output,
      cache_creation = r.cache_creation, cache_read = r.cache_read, cost_usd = r.cost_usd }
  end
  local prompt = acc.input + acc.cache_creation + acc.cache_read
  local root = store.get(n.root)
  local spent, budget = store.spent(n.root)
  return {
    run_id = n.run_id, root = n.root, total_cost_usd = acc.cost_usd,
    tokens = { input = acc.input, output = acc.output, cache_creation = acc.cache_creation, cache_read = acc.cache_read },
    cache_read_share = prompt > 0 and acc.cache_read / prompt or 0,
    by_model = by_model, nodes = rows,
    budget_usd = budget, tree_spent_usd = spent, budget_spent = root and root.budget_spent or nil,
    tree_reserved_usd = budget and store.reserved(n.root) or nil,
  }
end


--- Takes a new node into this process's copies (it is saved by the caller).
---@param n TreeNode
function store.put(n) cache[n.run_id] = n end

--- Counts `usd` (one model request, with its `usage` when known) against the run's own
--- spend and its tree's budget, and gives back its reservation `resv` (store.check); with
--- `resv`, no usage and no cost it only gives the reservation back (the request was not
--- counted: refused, rate limited, never sent). Returns true, or nil and "budget of $X
--- spent" when the tree's budget is now spent: the reaction (store.on_budget_spent, which
--- the composition root points at tree.budget_spent: every run of the tree ends with that
--- reason) has then started. A run
--- that is no tree node is not counted (true). For the vendor route, which sits below
--- lua/tree/init.lua.
---@param run_id string
---@param usd number
---@param usage table|nil  {model, input, output, cache_creation, cache_read}
---@param resv table|nil   the reservation store.check held
---@return boolean|nil ok, string|nil why
function store.charge(run_id, usd, usage, resv)
  local n = store.get(run_id)
  if not n then return true end
  usd = usd_of(usd)
  local r = store.get(n.root) or n
  local released = release(r, resv)
  if resv ~= nil and usage == nil and usd == 0 then
    if released then store.save(r) end
    return true
  end
  n.cost_usd = (n.cost_usd or 0) + usd
  store.add_usage(n, usd, usage)
  if r ~= n then r.spent_usd = (tonumber(r.spent_usd) or 0) + usd else n.spent_usd = (tonumber(n.spent_usd) or 0) + usd end
  store.save(n)
  if r ~= n then store.save(r) end
  if r.budget_usd and r.spent_usd >= r.budget_usd then
    local why = store.budget_reason(r.budget_usd)
    if not r.budget_spent then
      r.budget_spent = true
      store.save(r)
      log.notice(LOGGER, "tree %s: %s ($%s); ending every run in it", r.run_id, why, store.money(r.spent_usd))
      if store.on_budget_spent then store.on_budget_spent(r.run_id, why) end
    end
    return nil, why
  end
  return true
end

-- A root read from its record with reservations a server that is gone left (it died with
-- those requests in flight): each is charged in full to the run that made it, since the
-- vendor may have answered it. Reservations of a live server (this one, or another that
-- still runs) are kept.
settle_stale = function(r)
  local me = sandbox.owner()
  local gone = {}
  for id, x in pairs(r.reservations) do
    if type(x) ~= "table" then
      r.reservations[id] = nil
    elseif x.owner ~= me and not sandbox.owner_alive(x.owner) then
      gone[#gone + 1] = { id = id, x = x }
    end
  end
  if #gone == 0 then return end
  table.sort(gone, function(a, b) return tostring(a.id) < tostring(b.id) end)
  for _, g in ipairs(gone) do
    r.reservations[g.id] = nil
    local run = valid_id(g.x.run_id) and store.within(r.run_id, g.x.run_id) and g.x.run_id or r.run_id
    local usd = usd_of(g.x.usd)
    log.notice(LOGGER, "tree %s: a model request of %s was in flight when its server stopped; charged its "
      .. "reservation of $%s", r.run_id, run, store.money(usd))
    store.charge(run, usd, { model = type(g.x.model) == "string" and g.x.model or nil })
  end
  store.save(r)
end

--- What a run of a tree may do, for its context file: {run_id, root, name, depth, limits =
--- {depth, children, running}, children_used (names taken), budget_usd (nil: none),
--- spent_usd}. nil when the run is no tree node.
---@param run_id string
---@return table|nil
function store.info(run_id)
  local n = store.get(run_id)
  local r = n and store.get(n.root)
  if not n or not r then return nil end
  local spent, budget = store.spent(n.root)
  return { run_id = n.run_id, root = n.root, name = n.name, depth = n.depth,
    limits = { depth = r.limits.depth, children = r.limits.children, running = r.limits.running,
      jobs = r.limits.jobs, job_records = r.limits.job_records },
    children_used = #n.children, budget_usd = budget, spent_usd = spent }
end

--- The budget's reaction, called once with (root run id, reason) when a charge reaches the
--- tree's budget: tree.budget_spent, set by the composition root (lua/compose.lua); nil
--- (no reaction) until then.
store.on_budget_spent = nil

--- Forgets this process's copy of a run (its record is gone).
---@param id string
function store.forget(id) cache[id], mem[id] = nil, nil end

--- Forgets every copy (tests).
function store.reset() cache, mem = {}, {} end

--- The path of a run's record.
---@param id string
---@return string
function store.record_path(id) return record_path(id) end

return store
