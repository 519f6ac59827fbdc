-- Background jobs: the registry. Records persisted under the state folder, status,
-- wait, cancel of a whole job tree, adoption after a restart, and one terminal
-- notification per job. It knows no kind of job: each kind is registered (jobs.register,
-- by the composition root, lua/compose.lua) with how it starts, runs and re-attaches:
-- lua/jobs/script.lua (one-shot sandboxes), lua/jobs/exec.lua (commands in a persistent
-- sandbox), lua/agent/job.lua (agent runs).
--
-- A job is a tool call that was started with `background: true`. It runs in its own task,
-- not in the request's, so it outlives the call. Its record is a JSON file,
-- $DEMESNE_STATE_DIR/jobs/<job id>.json, rewritten atomically at every change; the record
-- holds what its kind needs to re-attach to the job from the engine and the files alone,
-- so a server that starts after another one died (even by SIGKILL) adopts the running jobs
-- it left.
--
-- Statuses: running → succeeded | failed | cancelled | lost. Exactly one terminal
-- transition per job (jobs.finish), and with it exactly one log record from logger
-- `demesne.jobs`, which the MCP server forwards as notifications/message (honouring
-- logging/setLevel). A graceful server stop leaves the jobs running: the next server
-- re-attaches them. Finished records are pruned after `jobs_keep_seconds`.
--
-- Ownership: a record names the server process that watches it (`owner`, as in sandbox
-- labels). A server adopts a running record only when that process is gone, so two
-- servers that share a state folder never watch the same job twice.
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local json = require("demesne.json")
local layer = require("demesne.layer")
local log = require("demesne.log")
local output = require("demesne.output")
local sandbox = require("demesne.sandbox")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")
local core_text = require("core.text")

local jobs = {}

local LOGGER = "demesne.jobs"
local RECORD_MAX = 1024 * 1024

--- Every status, in the order sandbox_jobs lists them.
jobs.STATUSES = { "running", "succeeded", "failed", "cancelled", "lost" }
local TERMINAL = { succeeded = true, failed = true, cancelled = true, lost = true }
local KNOWN = { running = true, succeeded = true, failed = true, cancelled = true, lost = true }

---@class JobRecord
---@field job_id string
---@field tool string           the tool that started it (sandbox_script, sandbox_exec)
---@field kind string           how it is watched: "script" or "exec"
---@field status string         running, succeeded, failed, cancelled or lost
---@field owner string          the server process watching it (host/pid/starttime)
---@field started_ms integer    Unix time in ms
---@field finished_ms integer|nil
---@field exit_code integer|nil
---@field timed_out boolean|nil
---@field reason string|nil     why it failed, was cancelled or lost
---@field branch table|nil      a repository run's branch (lua/repo: repo.hand_back's result)
---@field command string        the command (first 1000 bytes)
---@field timeout_seconds integer
---@field output_dir string     the sandbox's /out on the host
---@field log_dir string        folder of stdout.log and stderr.log
---@field run_dir string        the sandbox's run folder (status.json of each command)
---@field exec_id string        the command's id in run_dir/exec/
---@field container string      container name or id
---@field run_id string|nil     one-shot jobs: the run id
---@field sandbox_id string|nil exec jobs: the persistent sandbox
---@field parent string|nil     the job that started this one
---@field children string[]     jobs this one started

-- The layers above (nested sandboxes, lua/tree) hear of each job through the layer hooks
-- (lua/layer.lua): job_launch(rec) once its record is saved, job_cancel(rec, reason) before
-- it is cancelled, job_finish(rec) at its terminal status (record saved, before its waiters
-- wake), job_view(rec, out) while jobs.view builds `out`. An error of one is logged; a
-- cancel propagates.

-- job_id -> {rec = JobRecord, task = Task, done = event, cancel_reason = string|nil}
-- for the jobs this process watches
local live = {}
local service -- the sweep task of jobs.start

local hex, now_ms = util.hex, util.now_ms
local fail = errors.raise

--- The folder of the job records: $DEMESNE_STATE_DIR/jobs.
---@return string
function jobs.dir() return config.get("state_dir") .. "/jobs" end

local function record_path(id) return jobs.dir() .. "/" .. id .. ".json" end

--- True for a well-formed job id ("job-" then letters, digits and dashes).
---@param id any
---@return boolean
function jobs.valid_id(id)
  return type(id) == "string" and #id <= 128 and id:match("^job%-[%w%-]+$") ~= nil
end

local function new_id() return util.new_id("job-", 5) end

-- Writes a record atomically. A failure is logged (the job goes on; the record on disk is
-- then stale, which a restart would see).
local function save(rec)
  rec.updated_ms = now_ms()
  local ok, err = fs.mkdir_p(jobs.dir(), 448) -- 0700 (Lua has no octal literals)
  if ok then ok, err = fs.write_atomic(record_path(rec.job_id), json.encode(rec) .. "\n", 384) end
  if not ok then log.error(LOGGER, "cannot save the record of %s: %s", rec.job_id, tostring(err)) end
  return ok
end

-- Reads and checks a record file. Returns the record or nil, why.
local function read_record(id)
  local s, err = fs.read_file(record_path(id), 0, RECORD_MAX)
  if not s then return nil, err end
  local rec = json.decode(s)
  if type(rec) ~= "table" or rec.job_id ~= id or not KNOWN[rec.status] or type(rec.started_ms) ~= "number" then
    return nil, "malformed job record " .. record_path(id)
  end
  -- JSON numbers decode as floats: integers stay integers
  for _, k in ipairs({ "started_ms", "finished_ms", "exit_code", "timeout_seconds", "updated_ms", "adopted_ms" }) do
    local v = rec[k]
    if v ~= nil then rec[k] = type(v) == "number" and math.tointeger(math.floor(v)) or nil end
  end
  if not rec.started_ms then return nil, "malformed job record " .. record_path(id) end
  rec.timeout_seconds = rec.timeout_seconds or config.get("timeout_default")
  if type(rec.children) ~= "table" then rec.children = {} end
  json.array(rec.children)
  return rec
end

--------------------------------------------------------------------------------------------
-- Terminal transition

--- Moves a job this process watches to a terminal status, once: later calls do nothing and
--- return false. Saves the record, wakes waiters, and logs one record from `demesne.jobs`
--- (→ one notifications/message) with {job_id, status, exit_code}.
---@param job table   a live job
---@param status string  succeeded, failed, cancelled or lost
---@param fields table|nil  exit_code, timed_out, reason, finished_ms
---@return boolean changed
function jobs.finish(job, status, fields)
  local rec = job.rec
  assert(TERMINAL[status], "jobs.finish: not a terminal status: " .. tostring(status))
  if TERMINAL[rec.status] then return false end
  fields = fields or {}
  rec.status = status
  if math.type(fields.exit_code) == "integer" then rec.exit_code = fields.exit_code end
  if fields.timed_out ~= nil then rec.timed_out = fields.timed_out and true or false end
  if fields.reason ~= nil then rec.reason = tostring(fields.reason) end
  if type(fields.branch) == "table" then rec.branch = fields.branch end -- a repository run's (lua/repo)
  local fin = math.tointeger(fields.finished_ms)
  if not fin or fin < rec.started_ms or fin > now_ms() + 60000 then fin = now_ms() end
  rec.finished_ms = math.max(fin, rec.started_ms)
  save(rec)
  local msg = ("background job %s %s"):format(rec.job_id, status)
  if rec.exit_code then msg = msg .. (" (exit code %d)"):format(rec.exit_code) end
  if rec.reason and status ~= "succeeded" then msg = msg .. ": " .. rec.reason end
  layer.run("job_finish", rec)
  log.log("info", LOGGER, msg .. "; sandbox_status or sandbox_wait give the result",
    { job_id = rec.job_id, status = status, exit_code = rec.exit_code })
  job.done.set(rec) -- last: waiters resume at once, and the notification goes out before their answers
  return true
end

--------------------------------------------------------------------------------------------
-- Kinds. The registry knows no kind: each kind is registered (jobs.register, by the
-- composition root, lua/compose.lua) with how a job of it starts from a tool call (start),
-- runs the first time (run) and after a restart (attach). run and attach return an outcome {status, exit_code?, timed_out?, reason?,
-- finished_ms?}; they are cancelled through their task, and their <close> handlers kill
-- the job's processes. `job.after` runs once the terminal record is saved.

---@class JobOutcome
---@field status string          succeeded, failed, cancelled or lost
---@field exit_code integer|nil
---@field timed_out boolean|nil
---@field reason string|nil
---@field branch table|nil      a repository run's branch (lua/repo)
---@field finished_ms integer|nil

---@class JobKind
---@field start fun(ctx: ToolContext, args: table, tool: string|nil): table  starts a job for a call of `tool`; returns {job_id, status = "running", output_dir, …}
---@field run fun(job: table, plan: any): JobOutcome        watches the job it started (in the job's task)
---@field attach fun(job: table): JobOutcome                re-attaches to a job a server that is gone left running
---@field view (fun(rec: JobRecord): table|nil)|nil         extra fields of jobs.view for a job of this kind
---@field result (fun(rec: JobRecord): table, string)|nil  an ended job's result as the call would have returned it in the foreground (structuredContent, text); without it, the exit code and the head and tail of the output

---@type table<string, JobKind>
local kinds = {}
jobs.kinds = kinds

--- Registers a kind of job under `name` (the `kind` field of its records). A later
--- registration of the same name replaces the earlier one.
---@param name string
---@param kind JobKind
---@return JobKind kind
function jobs.register(name, kind)
  assert(type(name) == "string" and name:match("^[%w_]+$"), "jobs.register: a kind name of letters, digits and _")
  for _, f in ipairs({ "start", "run", "attach" }) do
    assert(type(kind[f]) == "function", ("jobs.register: kind %s has no %s function"):format(name, f))
  end
  kinds[name] = kind
  return kind
end

--- The id a new job gets: "job-<UTC time>-<10 hex digits>".
---@return string
function jobs.new_id() return new_id() end

--- The path of a job's record file (the sandbox's job_record label: the reaper leaves a
--- container alone while the record it names says running).
---@param id string
---@return string
function jobs.record_path(id) return record_path(id) end

--- The job a tool call runs in, when a background job's agent made it (ctx.job_id): the
--- parent of a job that call starts.
---@param ctx ToolContext|nil
---@return string|nil
function jobs.parent_of(ctx) return type(ctx) == "table" and ctx.job_id or nil end

--- The first 1000 bytes of a command or prompt for a record, cut on a code point.
---@param s any
---@return string
function jobs.short(s)
  s = tostring(s or "")
  if #s > 1000 then s = s:sub(1, core_text.utf8_floor(s, 1000)) .. "…" end
  return s
end

--- Starts a background job of kind `kind` for a call of the tool `tool` (the kind's
--- start). Returns what the kind's start returns.
---@param kind string
---@param ctx ToolContext
---@param args table
---@param tool string|nil  the tool's name (default: the kind's own tool)
---@return table started  {job_id, status = "running", output_dir, …}
function jobs.background(kind, ctx, args, tool)
  local k = kinds[kind]
  if not k then error(("jobs.background: no job kind %q is registered"):format(tostring(kind)), 2) end
  return k.start(ctx, args, tool)
end

--- The `run` of a tool that can run in the background: with args.background a job of
--- `kind` starts and the result says how to follow it; otherwise `foreground(ctx, args)`
--- runs the call to its end.
---@param kind string  a registered job kind ("script", "exec", "agent")
---@param foreground fun(ctx: ToolContext, args: table): any, string|nil
---@param tool string|nil  the tool's name, handed to the kind's start
---@return fun(ctx: ToolContext, args: table): any, string|nil
function jobs.dispatch(kind, foreground, tool)
  return function(ctx, args)
    if args.background then
      local j = jobs.background(kind, ctx, args, tool)
      return j, jobs.started_text(j)
    end
    return foreground(ctx, args)
  end
end

--------------------------------------------------------------------------------------------
-- Running

-- Runs fn(job, ...) in the job's own task and makes the terminal transition from what it
-- returns, raises or whether it was cancelled.
local function spawn(job, fn, ...)
  local args = table.pack(...)
  job.task = async.spawn("job " .. job.rec.job_id, function()
    local ok, out = xpcall(fn, function(e)
      if e == async.CANCELLED or type(e) == "table" then return e end
      return debug.traceback(tostring(e), 2)
    end, job, table.unpack(args, 1, args.n))
    if ok and type(out) == "table" and TERMINAL[out.status] then
      jobs.finish(job, out.status, out)
    elseif not ok and out == async.CANCELLED then
      jobs.finish(job, "cancelled", { reason = job.cancel_reason or "cancelled" })
    else
      if not ok and type(out) == "string" and out:find("traceback", 1, true) then
        log.error(LOGGER, "%s: %s", job.rec.job_id, out)
      end
      jobs.finish(job, "failed", { reason = ok and "the job returned no outcome" or errors.message(out) })
    end
    if job.after then
      local aok, aerr = pcall(job.after)
      if not aok then log.warning(LOGGER, "%s: cleanup: %s", job.rec.job_id, tostring(aerr)) end
    end
  end)
  return job
end

local function new_job(rec) return { rec = rec, done = async.event() } end

--- Starts a background job: writes its record (status running), then runs
--- `kinds[rec.kind].run(job, plan)` in a task of its own. `rec` holds the kind's fields
--- (see JobRecord); job_id, status, owner, started_ms and children are filled in.
--- `parent` (a job id) links it into a job tree. Returns the record.
---@param rec table
---@param plan any   handed to the kind's run
---@param parent string|nil
---@return JobRecord
function jobs.launch(rec, plan, parent)
  assert(kinds[rec.kind], "jobs.launch: unknown kind " .. tostring(rec.kind))
  rec.job_id = rec.job_id or new_id()
  rec.status = "running"
  rec.owner = sandbox.owner()
  rec.started_ms = now_ms()
  rec.children = json.array()
  if parent and live[parent] then
    rec.parent = parent
    local p = live[parent].rec
    p.children[#p.children + 1] = rec.job_id
    save(p)
  end
  if not save(rec) then fail("cannot write the job record in " .. jobs.dir()) end
  layer.run("job_launch", rec)
  local job = new_job(rec)
  live[rec.job_id] = job
  spawn(job, kinds[rec.kind].run, plan)
  return rec
end

-- The claim on adopting a job from one (gone) owner: <jobs>/<id>.adopt-<hash of owner>,
-- created exclusively. Of several servers that find the same orphan at once, only the one
-- that creates it adopts; a later orphaning (the adopter gone too) has another owner and
-- so another claim file. Removed with the record by jobs.prune.
-- A claim whose holder died before it took the record over (it still names the gone owner)
-- is stale: it is moved aside (rename: of two servers doing this at once, one wins) and the
-- claim is tried once more.
local function claim(rec, retried)
  local path = ("%s/%s.adopt-%s"):format(jobs.dir(), rec.job_id, core_text.hash(tostring(rec.owner)))
  local f = fs.open(path, "wx", 384) -- 0600
  if not f then
    if retried then return false end
    local holder = (fs.read_file(path, 0, 4096) or ""):match("^%s*(.-)%s*$")
    if holder == "" or sandbox.owner_alive(holder) then return false end
    local now = read_record(rec.job_id)
    if not (now and now.status == "running" and now.owner == rec.owner) then return false end
    local aside = ("%s.stale-%s"):format(path, hex(loop.random(4)))
    if not fs.rename(path, aside) then return false end
    -- what was moved aside may be a fresh claim made meanwhile: then put it back
    local moved = (fs.read_file(aside, 0, 4096) or ""):match("^%s*(.-)%s*$")
    if moved ~= holder then
      fs.rename(aside, path)
      return false
    end
    fs.unlink(aside)
    log.info(LOGGER, "%s: the server that claimed it (%s) is gone; claiming it again", rec.job_id, holder)
    return claim(rec, true)
  end
  f:write(sandbox.owner() .. "\n")
  f:close()
  -- the record may have moved on between our read and the claim (finished, or adopted
  -- from this same owner by a server that has since written it)
  local now = read_record(rec.job_id)
  return now ~= nil and now.status == "running" and now.owner == rec.owner
end

-- Takes over a running record whose server is gone and re-attaches to it.
local function adopt(rec)
  local kind = kinds[rec.kind]
  if not kind then
    log.warning(LOGGER, "%s: no way to re-attach a job of kind %q; left as it is", rec.job_id, tostring(rec.kind))
    return nil
  end
  if not claim(rec) then
    log.debug(LOGGER, "%s: another server re-attached it first", rec.job_id)
    return nil
  end
  log.info(LOGGER, "%s: re-attaching (%s, started by %s)", rec.job_id, rec.tool or rec.kind, tostring(rec.owner))
  rec.owner = sandbox.owner()
  rec.adopted_ms = now_ms()
  save(rec)
  local job = new_job(rec)
  live[rec.job_id] = job
  return spawn(job, kind.attach)
end

--- The record of a job: this process's copy for the jobs it watches, else the file (a
--- running record whose server is gone is adopted on the way). nil when there is none.
---@param id string
---@return JobRecord|nil
function jobs.get(id)
  if not jobs.valid_id(id) then return nil end
  if live[id] then return live[id].rec end
  local rec = read_record(id)
  if not rec then return nil end
  if rec.status == "running" and not sandbox.owner_alive(rec.owner) then
    local job = adopt(rec)
    if job then return job.rec end
    return read_record(id) or rec -- another server took it over: its view
  end
  return rec
end

--- The record of a job, or a failure naming the job_id field.
---@param id string
---@return JobRecord
function jobs.must_get(id)
  local rec = jobs.get(id)
  if not rec then
    fail(("job_id: no job %s (unknown, or its record was pruned after jobs_keep_seconds)"):format(tostring(id)))
  end
  return rec
end

--- True for a terminal status.
---@param status string
function jobs.is_terminal(status) return TERMINAL[status] == true end

--- Waits up to `ms` for a job to end. Returns its record (terminal, or still running when
--- the time ran out). Cancelling the waiting task ends the wait, never the job. A job
--- another live server watches is followed through its record file.
---@param id string
---@param ms integer
---@return JobRecord
function jobs.wait(id, ms)
  local rec = jobs.must_get(id)
  if TERMINAL[rec.status] or ms <= 0 then return rec end
  local job = live[id]
  if job then
    async.timeout(ms, job.done.wait)
    return job.rec
  end
  local deadline = loop.now() + ms
  while loop.now() < deadline do
    async.sleep(math.min(1000, math.max(deadline - loop.now(), 1)))
    rec = jobs.get(id) or rec
    if TERMINAL[rec.status] then return rec end
    if live[id] then return jobs.wait(id, math.floor(deadline - loop.now())) end
  end
  return rec
end

--- Cancels a job and every job it started, children first. The job's processes die (the
--- one-shot container is removed; an exec's process group is killed by demesne-init) and
--- its record says cancelled. A finished job is left as it is. Returns the record and the
--- ids of the jobs this call cancelled.
---@param id string
---@param reason string|nil
---@return JobRecord rec, string[] cancelled
---@param cancelled string[]|nil  the list this call adds to (over a job tree)
function jobs.cancel(id, reason, cancelled)
  cancelled = cancelled or json.array()
  local rec = jobs.must_get(id)
  if not TERMINAL[rec.status] then layer.run("job_cancel", rec, reason or "cancelled by sandbox_cancel") end
  for _, child in ipairs(rec.children or {}) do
    if jobs.valid_id(child) and jobs.get(child) then
      jobs.cancel(child, "its parent job " .. id .. " was cancelled", cancelled)
    end
  end
  if TERMINAL[rec.status] then return rec, cancelled end
  local job = live[id]
  if not job then
    if sandbox.owner_alive(rec.owner) then
      fail(("job %s is watched by another demesne server (%s) that is still running; cancel it there")
        :format(id, tostring(rec.owner)))
    end
    fail(("job %s is left by a server that is gone (%s) and could not be taken over yet; try again")
      :format(id, tostring(rec.owner)))
  end
  job.cancel_reason = reason or "cancelled by sandbox_cancel"
  async.cancel(job.task, job.cancel_reason)
  -- the job's cleanup (container removal, group kill) is bounded by the engine's own timeouts
  local ok = async.timeout(60000, function() job.task:wait() return true end)
  if not ok then log.warning(LOGGER, "%s: cleanup after cancel still running", id) end
  jobs.finish(job, "cancelled", { reason = job.cancel_reason })
  cancelled[#cancelled + 1] = id
  return job.rec, cancelled
end

-- Every record: the files, with this process's copies for the jobs it watches.
local function all_records()
  local out, seen = {}, {}
  for _, name in ipairs(fs.readdir(jobs.dir()) or {}) do
    local id = name:match("^(job%-[%w%-]+)%.json$")
    if id then
      local rec = jobs.get(id)
      if rec then out[#out + 1] = rec; seen[id] = true end
    end
  end
  for id, job in pairs(live) do
    if not seen[id] then out[#out + 1] = job.rec end
  end
  return out
end

--- Lists jobs, running first, then newest first. `status` (optional) keeps one status.
--- Returns at most `limit` records and the number that matched.
--- `visible` (optional) keeps only the jobs a scoped caller may see (a sandbox's subtree).
---@param status string|nil
---@param limit integer|nil
---@param visible (fun(job_id: string): boolean)|nil
---@return JobRecord[] list, integer matched
function jobs.list(status, limit, visible)
  local list = {}
  for _, rec in ipairs(all_records()) do
    if (not status or rec.status == status) and (not visible or visible(rec.job_id)) then list[#list + 1] = rec end
  end
  table.sort(list, function(a, b)
    local ra, rb = a.status == "running", b.status == "running"
    if ra ~= rb then return ra end
    if a.started_ms ~= b.started_ms then return a.started_ms > b.started_ms end
    return a.job_id > b.job_id
  end)
  local matched = #list
  if limit and #list > limit then
    for i = #list, limit + 1, -1 do list[i] = nil end
  end
  return list, matched
end

--- Removes finished records older than `jobs_keep_seconds` (by finished time). Returns
--- how many went. Output folders are kept.
---@return integer
function jobs.prune()
  local keep_ms = config.get("jobs_keep_seconds") * 1000
  local n = 0
  for _, name in ipairs(fs.readdir(jobs.dir()) or {}) do
    local id = name:match("^(job%-[%w%-]+)%.json$")
    local rec = id and (live[id] and live[id].rec or read_record(id))
    if rec and TERMINAL[rec.status] and (rec.finished_ms or rec.started_ms) + keep_ms < now_ms() then
      if fs.unlink(record_path(id)) then
        live[id] = nil
        n = n + 1
      end
    end
  end
  -- adoption claims whose record is gone
  local names = fs.readdir(jobs.dir()) or {}
  local have = {}
  for _, name in ipairs(names) do
    local id = name:match("^(job%-[%w%-]+)%.json$")
    if id then have[id] = true end
  end
  for _, name in ipairs(names) do
    local id = name:match("^(job%-[%w%-]+)%.adopt%-%x+$") or name:match("^(job%-[%w%-]+)%.adopt%-%x+%.stale%-%x+$")
    if id and not have[id] then fs.unlink(jobs.dir() .. "/" .. name) end
  end
  return n
end

--- Removes the record of a finished job now, before jobs_keep_seconds (a tree at its
--- tree.job_records, lua/tree): its file and this process's copy go; its output folder is
--- kept, and an adoption claim left with it goes at the next prune. A running job, or one
--- with no record, is left alone.
---@param id string
---@return boolean removed
function jobs.forget(id)
  if not jobs.valid_id(id) then return false end
  local rec = live[id] and live[id].rec or read_record(id)
  if not rec or not TERMINAL[rec.status] then return false end
  if not fs.unlink(record_path(id)) then return false end
  live[id] = nil
  return true
end

--- A job's output folder moved from `from` to `to` (a research child's, handed to its
--- parent when it ended: lua/tree): the record's output_dir and log_dir follow (saved).
--- Returns true when the record named the folder.
---@param id string
---@param from string  the old host path
---@param to string    the new host path
---@return boolean moved
function jobs.moved(id, from, to)
  local rec = jobs.valid_id(id) and (live[id] and live[id].rec or read_record(id))
  if not rec then return false end
  local changed = false
  for _, k in ipairs({ "output_dir", "log_dir" }) do
    local v = rec[k]
    if type(v) == "string" and (v == from or v:sub(1, #from + 1) == from .. "/") then
      rec[k] = to .. v:sub(#from + 1)
      changed = true
    end
  end
  if changed then save(rec) end
  return changed
end

--- Loads the records: adopts every running job whose server is gone (re-attaching to its
--- container) and prunes old finished ones. Returns the number adopted.
---@return integer
function jobs.resume()
  local n = 0
  for _, name in ipairs(fs.readdir(jobs.dir()) or {}) do
    local id = name:match("^(job%-[%w%-]+)%.json$")
    if id and not live[id] then
      local rec, err = read_record(id)
      if not rec then
        log.warning(LOGGER, "%s", tostring(err))
      elseif rec.status == "running" and not sandbox.owner_alive(rec.owner) then
        if adopt(rec) then n = n + 1 end
      end
    end
  end
  jobs.prune()
  return n
end

--- Starts the service of `demesne serve`: resume at once, then a sweep (adopt orphans,
--- prune) every reap_interval seconds. Idempotent.
function jobs.start()
  if service and not service.done then return service end
  service = async.every("jobs", function() return config.get("reap_interval") * 1000 end, function() jobs.resume() end,
    { logger = LOGGER })
  return service
end

--- Stops the sweep. Running jobs are left running (not cancelled): the next server
--- re-attaches them from their records.
function jobs.stop()
  if service then async.cancel(service, "shutdown") end
  service = nil
end

--- Forgets every job this process watches (tests only): their tasks are cancelled first.
function jobs.reset()
  for _, job in pairs(live) do
    if job.task and not job.task.done then async.cancel(job.task, "reset"); job.task:wait() end
  end
  live = {}
end

--------------------------------------------------------------------------------------------
-- Views for the tools

local function log_rel(rec, stream)
  -- agent jobs: the CLI's stdout is transcript.jsonl in the output folder
  if stream == "stdout" and rec.stdout_file then return rec.stdout_file end
  local dir = rec.log_dir or rec.output_dir
  local rel = dir:sub(#rec.output_dir + 2)
  return (rel ~= "" and (rel .. "/") or "") .. stream .. ".log"
end

--- The public view of a record: job_id, status, tool, started_at, finished_at (ISO 8601),
--- elapsed_seconds (frozen once finished), exit_code, timed_out, reason, output_dir,
--- log_dir, run_id or sandbox_id, parent, children.
---@param rec JobRecord
---@return table
function jobs.view(rec)
  local stop = rec.finished_ms or now_ms()
  local out = {
    job_id = rec.job_id,
    status = rec.status,
    tool = rec.tool,
    started_at = util.iso_ms(rec.started_ms),
    finished_at = util.iso_ms(rec.finished_ms),
    elapsed_seconds = math.max(stop - rec.started_ms, 0) / 1000,
    exit_code = rec.exit_code,
    timed_out = rec.timed_out,
    reason = rec.reason,
    output_dir = rec.output_dir,
    log_dir = rec.log_dir,
    run_id = rec.run_id,
    sandbox_id = rec.sandbox_id,
    parent = rec.parent,
    children = json.array({ table.unpack(rec.children or {}) }),
    branch = rec.branch,
  }
  if rec.status == "running" and rec.run_id then
    local p = sandbox.previews(rec.run_id)
    if #p > 0 then out.previews = p end
  end
  local k = kinds[rec.kind]
  if k and k.view then
    for key, v in pairs(k.view(rec) or {}) do out[key] = v end
  end
  layer.run("job_view", rec, out)
  return out
end

--- Reads a job's stdout.log from byte `since`, at most `max` bytes, ending on a code-point
--- boundary. Returns text, next_cursor, size, eof (the job has ended and nothing is left).
---@param rec JobRecord
---@param since integer
---@param max integer
---@return string text, integer next, integer size, boolean eof
function jobs.read_stdout(rec, since, max)
  local final = TERMINAL[rec.status] == true -- decided before reading: a later byte is never missed
  local text, nxt, size = output.read_from(rec.output_dir, log_rel(rec, "stdout"), since, max, final)
  if not text then fail("cannot read the job's output: " .. tostring(nxt), size) end
  return text, nxt, size, final and nxt >= size
end

--- The last `max` bytes of a job's stdout.log (whole lines) and the log's size. A log that
--- cannot be read (anything but missing) fails naming it.
---@param rec JobRecord
---@param max integer
---@return string text, integer size
function jobs.stdout_tail(rec, max)
  local text, size, code = output.tail(rec.output_dir, log_rel(rec, "stdout"), max)
  if not text then fail("cannot read the job's output: " .. tostring(size), code) end
  return text, size
end

--- The bounded head and tail of a job's stdout and stderr: stdout, stderr, truncated.
---@param rec JobRecord
---@return string stdout, string stderr, boolean truncated
function jobs.collect(rec)
  if rec.stdout_file then
    local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
    local so, cut1, c1 = output.view(rec.output_dir, rec.stdout_file, head, tail)
    if not so then fail("cannot read the job's output: " .. tostring(cut1), c1) end
    local se, cut2, c2 = output.view(rec.output_dir, "stderr.log", head, tail)
    if not se then fail("cannot read the job's output: " .. tostring(cut2), c2) end
    return so, se, cut1 or cut2
  end
  local rel = (rec.log_dir or rec.output_dir):sub(#rec.output_dir + 2)
  return sandbox.collect(rec.output_dir, rel ~= "" and rel or nil)
end

--- An ended job's result as its call would have returned it without `background`, where
--- its kind says (JobKind.result: an agent's answer, cost and children): structured result
--- and text. nil for kinds without one (a script's or exec's result is its exit code and
--- output, which the caller builds from the record).
---@param rec JobRecord  a record whose status is terminal and which ran to an exit status
---@return table|nil structured, string|nil text
function jobs.result(rec)
  local k = kinds[rec.kind]
  if k and k.result then return k.result(rec) end
  return nil
end

--- Readable text for a "job started" result.
---@param r table  {job_id, output_dir}
---@return string
function jobs.started_text(r)
  return ("job_id: %s\nstatus: running\noutput_dir: %s\nUse sandbox_status (with `since` to read stdout "
    .. "incrementally), sandbox_wait or sandbox_cancel with this job_id."):format(r.job_id, r.output_dir)
end

return jobs
