-- What the cockpit shows beside the trees: this server's sandboxes that are no tree node (a
-- plain sandbox_script run, in the foreground or as a background job, and a persistent
-- sandbox_create sandbox), and the memory every running sandbox uses.
--
-- Where it comes from, never from a record a sandbox could write:
--   * running: the engine's list of demesne containers (their labels, which this server set
--     when it made them: run id, tool, kind, image, isolation, egress, limits, folders,
--     owner, expiry), kept LIST_MS so that the page's stream asks the engine little;
--   * background jobs: their records (lua/jobs, <state_dir>/jobs), for status and exit code;
--   * ended foreground runs: a record this server writes when a run's container goes
--     (runs.layer's sandbox_removed hook): <state_dir>/cockpit/runs/<run id>.json (0600), kept as long
--     as the cockpit shows ended trees (KEEP_MS);
--   * memory used: eng:stats of each running container (lua/engines), at most
--     STATS_PARALLEL at once, each sample kept STATS_MS.
local async = require("demesne.async")
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local log = require("demesne.log")
local paths = require("demesne.paths")
local sandbox = require("demesne.sandbox")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")

local runs = {}

local LABEL = "io.demesne."
local LOGGER = "demesne.cockpit"
local RECORD_MAX = 64 * 1024
local LIST_MS = 2000           -- the engine's container list is asked at most this often
local STATS_MS = 3000          -- a container's memory sample is kept this long
local STATS_PARALLEL = 4       -- stats asked of the engine at once, at most
local DAY_MS = 86400 * 1000
runs.KEEP_MS = 7 * DAY_MS      -- ended runs are shown this long (as ended trees: lua/cockpit/view.lua)
local KINDS = { oneshot = true, job = true, persistent = true }

local listed -- {at, list = {container summary}, engine}
local samples = {} -- container id -> {at, bytes}

local function num(x) return tonumber(x) or 0 end

--- The folder of the ended foreground runs' records: <state_dir>/cockpit/runs.
---@return string
function runs.dir() return config.get("state_dir") .. "/cockpit/runs" end

local function valid_id(id) return type(id) == "string" and #id <= 64 and id:match("^[%w][%w%-]*$") ~= nil end

--- The demesne containers of the engine (its neutral summaries), from the cache when it is
--- younger than LIST_MS. An engine that does not answer gives none (logged at debug).
---@return table[]
function runs.containers()
  local got, eng = pcall(sandbox.engine)
  if not got then
    log.debug(LOGGER, "no engine: %s", tostring(type(eng) == "table" and eng.message or eng))
    return {}
  end
  if listed and listed.engine == eng and loop.now() - listed.at < LIST_MS then return listed.list end
  local list, err = eng:list({ LABEL .. "managed=1" })
  if not list then
    log.debug(LOGGER, "the engine's containers: %s", tostring(err))
    list = {}
  end
  listed = { at = loop.now(), list = list, engine = eng }
  return list
end

--- Forgets the cached container list (an action changed it).
function runs.changed() listed = nil end

-- True for a container this server shows: its own, or a persistent sandbox of this state
-- folder whose server is gone (the next server looks after it).
local function shown(l)
  if not KINDS[l[LABEL .. "kind"]] then return false end
  if l[LABEL .. "owner"] == sandbox.owner() then return true end
  return l[LABEL .. "kind"] == "persistent" and paths.within(tostring(l[LABEL .. "run_dir"]),
    config.get("state_dir") .. "/run") and not sandbox.owner_alive(tostring(l[LABEL .. "owner"]))
end

-- A warm sandbox of the pool (lua/pool.lua) that no call has claimed yet: no run.
local function warm(l)
  if not l[LABEL .. "pool"] then return false end
  return fs.lstat(config.get("state_dir") .. "/pool/" .. tostring(l[LABEL .. "run_id"])) ~= nil
end

--- This server's running sandboxes by run id: {[run_id] = container summary} (warm pool
--- sandboxes left out).
---@return table<string, table>
function runs.running()
  local out = {}
  for _, c in ipairs(runs.containers()) do
    local l = c.labels or {}
    local id = l[LABEL .. "run_id"]
    if valid_id(id) and shown(l) and not warm(l) then out[id] = c end
  end
  return out
end

local function limits_of(l)
  return { memory_mb = tonumber(l[LABEL .. "memory_mb"]), cpus = tonumber(l[LABEL .. "cpus"]),
    pids = tonumber(l[LABEL .. "pids"]) }
end

-- A job record of a one-shot background run (kind "script"), or nil.
local function job_record(id)
  if not jobs.valid_id(id) then return nil end
  local s = fs.read_file(jobs.record_path(id), 0, 1024 * 1024)
  local rec = s and json.decode(s)
  if type(rec) ~= "table" or rec.job_id ~= id or rec.kind ~= "script" or not valid_id(rec.run_id) then return nil end
  return rec
end

-- The job records of one-shot background runs, by run id.
local function job_records()
  local out = {}
  for _, name in ipairs(fs.readdir(jobs.dir()) or {}) do
    local id = type(name) == "string" and name:match("^(job%-[%w%-]+)%.json$")
    local rec = id and job_record(id)
    if rec then out[rec.run_id] = rec end
  end
  return out
end

local function read_record(path)
  local st = fs.lstat(path)
  local s = st and st.type == "file" and fs.read_file(path, 0, RECORD_MAX)
  local r = s and json.decode(s)
  return type(r) == "table" and r or nil
end

-- A run as the cockpit lists it (the shape of a tree node's summary, lua/cockpit/view.lua).
local function run_of(id, c, rec, job)
  local l = c and c.labels or {}
  local kind = (l[LABEL .. "kind"] or (rec and rec.sandbox_kind)) == "persistent" and "create" or "script"
  local now = util.now_ms()
  local started = c and num(l[LABEL .. "created_at"]) * 1000 or num(rec and rec.started_ms or job and job.started_ms)
  if job and num(job.started_ms) > 0 then started = num(job.started_ms) end
  local r = {
    run_id = id, root = id, depth = 0, standalone = true, kind = kind,
    tool = l[LABEL .. "tool"] or (rec and rec.tool) or (job and job.tool) or "sandbox_script",
    image = l[LABEL .. "image"] or (rec and rec.image), isolation = l[LABEL .. "isolation"] or (rec and rec.isolation),
    egress = l[LABEL .. "egress"] or (rec and rec.egress),
    limits = c and limits_of(l) or (rec and type(rec.limits) == "table" and rec.limits) or {},
    output_dir = l[LABEL .. "output_dir"] or (rec and rec.output_dir) or (job and job.output_dir),
    job_id = job and job.job_id or l[LABEL .. "job_id"], started_ms = math.tointeger(math.floor(started)),
    cost_usd = 0, total_cost_usd = 0, spent_usd = 0, children = json.array(),
  }
  if c and c.state == "running" then
    r.status, r.active = c.paused and "paused" or "running", true
    r.container = c.id
  elseif c then
    r.status, r.active = c.state == "created" and "starting" or "stopped", kind == "create" or c.state == "created"
    r.container = c.id
  end
  if job and jobs.is_terminal(job.status) then
    r.status, r.active, r.container = job.status, false, nil
    r.exit_code, r.reason, r.finished_ms = job.exit_code, job.reason, job.finished_ms
  elseif not c and rec then
    r.status, r.active = rec.status, false
    r.exit_code, r.reason, r.finished_ms = rec.exit_code, rec.reason, rec.finished_ms
  elseif not c and job then
    r.status, r.active = job.status, false -- its container is gone: its record says how it ended soon
  end
  if kind == "create" then
    r.expires_at = c and math.tointeger(math.floor(sandbox.expiry_of(l))) or nil
  end
  r.elapsed_seconds = math.max(num(r.finished_ms or now) - num(r.started_ms), 0) / 1000
  r.finished_ms = math.tointeger(r.finished_ms)
  return r
end

--- This server's sandboxes that are no tree node: running ones, and one-shot runs that
--- ended within KEEP_MS, newest first. `trees` (set of run ids) are left out.
--- Each: the fields of a tree node's summary (run_id, kind "script" or "create", tool, image,
--- isolation, egress, status, active, started_ms, finished_ms, elapsed_seconds, limits,
--- job_id, exit_code, reason) plus standalone = true, container (running), expires_at
--- (a persistent sandbox, epoch seconds), output_dir.
---@param trees table<string, boolean>
---@return table[]
function runs.list(trees)
  local running = runs.running()
  local js = job_records()
  local out, seen = {}, {}
  local now = util.now_ms()
  local function add(id, c, rec, job)
    if seen[id] or trees[id] then return end
    seen[id] = true
    out[#out + 1] = run_of(id, c, rec, job)
  end
  for id, c in pairs(running) do
    add(id, c, nil, js[id] and js[id].owner == sandbox.owner() and js[id] or nil)
  end
  for id, job in pairs(js) do
    if job.owner == sandbox.owner() and (job.status == "running" or now - num(job.finished_ms) < runs.KEEP_MS) then
      add(id, nil, read_record(runs.dir() .. "/" .. id .. ".json"), job)
    end
  end
  for _, name in ipairs(fs.readdir(runs.dir()) or {}) do
    local id = type(name) == "string" and name:match("^([%w][%w%-]*)%.json$")
    local rec = id and not seen[id] and read_record(runs.dir() .. "/" .. name)
    -- (a job's run whose job record was pruned already, jobs_keep_seconds, too)
    if rec and rec.run_id == id and rec.owner == sandbox.owner() and now - num(rec.finished_ms) < runs.KEEP_MS then
      add(id, nil, rec, nil)
    end
  end
  table.sort(out, function(a, b) return num(a.started_ms) > num(b.started_ms) end)
  return out
end

--- One of runs.list by run id or job id, or nil.
---@param id string
---@param trees table<string, boolean>|nil  tree node ids (left out)
---@return table|nil
function runs.find(id, trees)
  if not valid_id(id) then return nil end
  for _, r in ipairs(runs.list(trees or {})) do
    if r.run_id == id or r.job_id == id then return r end
  end
  return nil
end

--- The memory the running containers `ids` use now (eng:stats), by container id, in bytes;
--- a container the engine says nothing of is left out. Samples are kept STATS_MS; at most
--- STATS_PARALLEL are asked at once.
---@param ids string[]
---@return table<string, integer>
function runs.memory(ids)
  local got, eng = pcall(sandbox.engine)
  if not got then return {} end
  local out, todo = {}, {}
  local now = loop.now()
  for _, id in ipairs(ids) do
    local s = samples[id]
    if s and now - s.at < STATS_MS then out[id] = s.bytes else todo[#todo + 1] = id end
  end
  if #todo > 0 and eng.stats then
    local next_i = 0
    local function worker()
      while next_i < #todo do
        next_i = next_i + 1
        local id = todo[next_i]
        local st = eng:stats(id)
        local bytes = st and math.tointeger(st.memory_bytes) or nil
        samples[id] = { at = loop.now(), bytes = bytes }
        out[id] = bytes
      end
    end
    local tasks = {}
    for i = 1, math.min(STATS_PARALLEL, #todo) do tasks[i] = async.spawn("cockpit stats", worker) end
    for _, t in ipairs(tasks) do t:wait() end
  end
  for id, s in pairs(samples) do -- the samples of containers asked about no more go
    if loop.now() - s.at > 10 * STATS_MS then samples[id] = nil end
  end
  return out
end

--- The removed hook (runs.layer.sandbox_removed): a one-shot run of a tool call (no tree node,
--- no warm sandbox) has gone: what it was is kept for the cockpit (runs.dir()).
---@param o table  the plan (SandboxPlan, read only: exit_code, timed_out, started_ms are its SandboxRun's, read through it)
---@param why string|nil
function runs.removed(o, why)
  if type(o) ~= "table" or o.tree or not o.command or not valid_id(o.run_id) then return end
  if o.kind ~= "oneshot" and o.kind ~= "job" then return end
  local lim = type(o.limits) == "table" and o.limits or {}
  local code = math.tointeger(o.exit_code)
  local r = {
    run_id = o.run_id, tool = o.tool, sandbox_kind = o.kind, owner = sandbox.owner(), image = o.image_name,
    isolation = o.isolation or "container", egress = type(o.egress) == "table" and o.egress.name or "none",
    limits = { memory_mb = lim.memory_mb, cpus = lim.cpus, pids = lim.pids }, output_dir = o.output_dir,
    job_id = o.labels and o.labels.job_id or nil, started_ms = math.tointeger(o.started_ms) or util.now_ms(),
    finished_ms = util.now_ms(), exit_code = code, command = jobs.short(o.command),
    status = code == 0 and "succeeded" or code and "failed" or "ended",
    reason = why or (o.timed_out and "timed out") or (not code and "it ended before its result was read") or nil,
  }
  local ok, err = fs.mkdir_p(runs.dir(), 448)
  if ok then ok, err = fs.write_atomic(runs.dir() .. "/" .. o.run_id .. ".json", json.encode(r) .. "\n", 384) end
  if not ok then log.warning(LOGGER, "cannot keep the record of run %s: %s", o.run_id, tostring(err)) end
  runs.changed()
end

--- Removes ended runs' records older than KEEP_MS. Returns how many went.
---@return integer
function runs.prune()
  local n = 0
  for _, name in ipairs(fs.readdir(runs.dir()) or {}) do
    local path = type(name) == "string" and name:match("%.json$") and (runs.dir() .. "/" .. name)
    local r = path and read_record(path)
    if path and (not r or util.now_ms() - num(r.finished_ms) >= runs.KEEP_MS) then
      os.remove(path)
      n = n + 1
    end
  end
  return n
end

--- The cockpit's layer (lua/layer.lua), installed by the composition root (lua/compose.lua):
--- the runs it keeps a record of when their container goes.
runs.layer = { name = "cockpit", sandbox_removed = runs.removed }

return runs
