-- Background jobs: a registry persisted under the state folder, status, wait, cancel of a
-- whole job tree, and one terminal notification per job.
--
-- A job is a tool call (sandbox_script, sandbox_exec) that was started with
-- `background: true`. It runs in its own task, not in the request's, so it outlives the
-- call. Its record is a JSON file, $DEMESNE_STATE_DIR/jobs/<job id>.json, rewritten
-- atomically at every change; the record holds what is needed to re-attach to the job
-- from the engine and the files alone (container, run folder, exec id), so a server that
-- starts after another one died (even by SIGKILL) adopts the running jobs it left:
--
--   * a one-shot job (sandbox_script): wait for its container to stop, read the exit
--     status demesne-init recorded, remove the container;
--   * an exec job (sandbox_exec): poll the exec's status.json in the sandbox's run folder
--     while the sandbox runs;
--   * a job whose container is gone is `lost` (with the reason), unless its status.json
--     shows it finished, which then gives the result.
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
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")
local sandbox = require("demesne.sandbox")
local fs = require("core.fs")
local loop = require("core.loop")

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

-- job_id -> {rec = JobRecord, task = Task, done = event, cancel_reason = string|nil}
-- for the jobs this process watches
local live = {}
local service -- the sweep task of jobs.start

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end
local function now_ms() return math.floor(loop.time() * 1000) end
local function fail(msg) sandbox.fail(msg) end

-- Is there anything at `rel` below the run folder `run_dir`? Looked up confined (no
-- symlink, no ".."): the run folder is the sandbox's to write.
local function exists_in(run_dir, rel)
  local d = fs.opendir(run_dir)
  if not d then return false end
  local st = d:stat(rel)
  d:close()
  return st ~= nil
end

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

local function new_id() return "job-" .. os.date("!%Y%m%dT%H%M%SZ") .. "-" .. hex(loop.random(5)) end

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
  local fin = math.tointeger(fields.finished_ms)
  if not fin or fin < rec.started_ms or fin > now_ms() + 60000 then fin = now_ms() end
  rec.finished_ms = math.max(fin, rec.started_ms)
  save(rec)
  local msg = ("background job %s %s"):format(rec.job_id, status)
  if rec.exit_code then msg = msg .. (" (exit code %d)"):format(rec.exit_code) end
  if rec.reason and status ~= "succeeded" then msg = msg .. ": " .. rec.reason end
  log.log("info", LOGGER, msg .. "; sandbox_status or sandbox_wait give the result",
    { job_id = rec.job_id, status = status, exit_code = rec.exit_code })
  job.done.set(rec) -- last: waiters resume at once, and the notification goes out before their answers
  return true
end

-- What a job's exit status (demesne-init's status.json) means for the job.
local function outcome_of(st, timeout)
  local code = math.tointeger(st.exit_code)
  local out = { exit_code = code, timed_out = st.timed_out == true,
    finished_ms = math.tointeger(st.finished_at) }
  if type(st.error) == "string" then
    out.status, out.reason = "failed", "the command could not start: " .. st.error:sub(1, 600)
  elseif out.timed_out then
    out.status, out.reason = "failed", ("timed out after %d s; the command's process group was killed"):format(timeout)
  elseif st.cancelled == true then
    out.status, out.reason = "cancelled", "the command was stopped by a signal to its sandbox"
  elseif code == 0 then
    out.status = "succeeded"
  elseif code then
    out.status, out.reason = "failed", ("the command exited with code %d"):format(code)
    local oom = require("demesne.sandbox").oom_note(st)
    if oom then out.reason = out.reason .. "; " .. oom end
  else
    out.status, out.reason = "failed", "demesne-init recorded no exit code"
  end
  return out
end

local function closer(fn) return setmetatable({}, { __close = fn }) end

-- Retries while the engine is not answering (a restarted engine must not make jobs lost).
local function engine_retry(ecode)
  if ecode == "ENOENGINE" then
    async.sleep(5000)
    return true
  end
  return false
end

--------------------------------------------------------------------------------------------
-- Kinds: how a job of each kind runs the first time (run) and after a restart (attach).
-- Both return an outcome {status, exit_code?, timed_out?, reason?, finished_ms?}; they are
-- cancelled through their task, and their <close> handlers kill the job's processes.
-- `after` runs once the terminal record is saved.

local kinds = {}
jobs.kinds = kinds

-- One-shot jobs: the container runs `demesne-init run` as PID 1.
local function script_outcome(rec, o, code, err, ecode)
  local st = sandbox.read_status(o.run_dir, o.exec_id)
  if st then return outcome_of(st, rec.timeout_seconds) end
  if code ~= nil then
    return { status = code == 0 and "succeeded" or "failed", exit_code = math.tointeger(code),
      reason = ("the sandbox stopped with code %s and no exit status was recorded"):format(tostring(code)) }
  end
  if ecode == "ENOENT" then
    return { status = "lost", reason = ("container %s no longer exists and no exit status was recorded "
      .. "(it was removed while no server was watching it)"):format(rec.container) }
  end
  if ecode == "ETIMEDOUT" then
    return { status = "failed", timed_out = true,
      reason = "the sandbox did not stop within its timeout; it was removed" }
  end
  return { status = "failed", reason = tostring(err) }
end

-- Watches a one-shot job's container until it stops.
local function script_watch(job, o)
  local rec = job.rec
  -- the container goes on success, failure and cancel; the run folder (status.json) only
  -- once the terminal record is saved, so a crash in between still finds the exit status
  local _ <close> = closer(function() sandbox.script_remove(o) end)
  if not o.id then return script_outcome(rec, o, nil, "gone", "ENOENT") end
  while true do
    local left = rec.started_ms + (rec.timeout_seconds + 60) * 1000 - now_ms()
    local code, err, ecode = sandbox.script_wait(o, math.max(left, 30000))
    if code ~= nil or not engine_retry(ecode) then return script_outcome(rec, o, code, err, ecode) end
  end
end

kinds.script = {
  -- o: a plan whose container sandbox.script_start has started
  run = function(job, o)
    job.after = function() sandbox.remove_tree(o.run_dir) end
    return script_watch(job, o)
  end,
  attach = function(job)
    local rec = job.rec
    local o = { engine = sandbox.engine(), id = rec.container, run_dir = rec.run_dir, exec_id = rec.exec_id,
      output_dir = rec.output_dir }
    job.after = function() sandbox.remove_tree(o.run_dir) end
    local info, err, ecode
    repeat info, err, ecode = o.engine:inspect(rec.container) until info or not engine_retry(ecode)
    if not info and ecode ~= "ENOENT" then return { status = "failed", reason = tostring(err) } end
    if not info then o.id = nil end
    if info and info.state == "created" then
      local out = { status = "lost", reason = "the server stopped before the sandbox was started" }
      o.engine:remove(o.id)
      return out
    end
    return script_watch(job, o)
  end,
}

-- Agent jobs (sandbox_agent, sandbox_research in the background): a one-shot container
-- plus the run's vendor route, stopped once the container has; results.json is written
-- before the terminal record. After a restart the vendor route is gone, so the agent's
-- model calls fail and it ends; the job is then watched like a script job.
kinds.agent = {
  run = function(job, o)
    job.after = function()
      sandbox.remove_tree(o.run_dir)
      require("demesne.vendor").forget(o.run_id)
    end
    local started = now_ms()
    local finished = false
    -- a cancel: the container goes first (script_watch), then the vendor route stops (its
    -- held requests and timers with it) and results.json says the run was cancelled
    local _ <close> = closer(function()
      if finished then return end
      local ok, err = pcall(require("demesne.agent").finish, o, nil, nil, now_ms() - started,
        "cancelled: " .. tostring(job.cancel_reason or "cancelled"))
      if not ok then log.warning(LOGGER, "%s: results.json: %s", job.rec.job_id, tostring(err)) end
      if o.vendor then o.vendor:stop() end
    end)
    local out = script_watch(job, o)
    finished = true
    local ok, err, read_error = pcall(require("demesne.agent").finish, o, out.exit_code, out.reason, now_ms() - started)
    if not ok then log.warning(LOGGER, "%s: results.json: %s", job.rec.job_id, tostring(err)) end
    if ok and read_error and out.status == "succeeded" then
      out = { status = "failed", exit_code = out.exit_code, reason = err.reason }
    end
    return out
  end,
  -- after a restart: the vendor route is started again with the token kept in the record
  -- (a per-run token, not the credential), the container watched like a script job
  attach = function(job)
    local rec = job.rec
    local providers = require("demesne.providers")
    local p = rec.provider and providers.get(rec.provider)
    local route
    if p and rec.vendor_token then
      local cred, why = providers.ready(p)
      if cred then
        local err
        route, err = require("demesne.vendor").start({ run_id = rec.run_id, run_dir = rec.run_dir,
          output_dir = rec.output_dir, provider = p, token = rec.vendor_token, credential = cred,
          deadline = rec.started_ms / 1000 + rec.timeout_seconds,
          decide = require("demesne.agent").decider(p, rec.output_dir, rec.resumable) })
        if not route then log.warning(LOGGER, "%s: vendor route: %s", rec.job_id, tostring(err)) end
      else
        log.warning(LOGGER, "%s: vendor route not restarted: %s", rec.job_id, tostring(why))
      end
    end
    local finished = false
    local _ <close> = closer(function()
      if finished or not route then return end
      local o = { provider = p, vendor = route, run_dir = rec.run_dir, exec_id = rec.exec_id,
        output_dir = rec.output_dir, run_id = rec.run_id, model = rec.model }
      local ok, err = pcall(require("demesne.agent").finish, o, nil, nil, now_ms() - rec.started_ms,
        "cancelled: " .. tostring(job.cancel_reason or "cancelled"))
      if not ok then log.warning(LOGGER, "%s: results.json: %s", rec.job_id, tostring(err)) end
      route:stop()
      require("demesne.vendor").forget(rec.run_id)
    end)
    local out = kinds.script.attach(job)
    finished = true
    local after = job.after
    job.after = function()
      if after then after() end
      require("demesne.vendor").forget(rec.run_id)
    end
    if route then
      local o = { provider = p, vendor = route, run_dir = rec.run_dir, exec_id = rec.exec_id,
        output_dir = rec.output_dir, run_id = rec.run_id, model = rec.model }
      local ok, err, read_error = pcall(require("demesne.agent").finish, o, out.exit_code, out.reason,
        now_ms() - rec.started_ms)
      if not ok then log.warning(LOGGER, "%s: results.json: %s", rec.job_id, tostring(err)) end
      if ok and read_error and out.status == "succeeded" then
        out = { status = "failed", exit_code = out.exit_code, reason = err.reason }
      end
    end
    return out
  end,
}

-- Exec jobs: `demesne-init run` through the engine's exec API in a persistent sandbox.
local function exec_outcome(rec, gone_reason)
  local st = sandbox.read_status(rec.run_dir, rec.exec_id)
  if st then return outcome_of(st, rec.timeout_seconds) end
  return { status = "lost", reason = gone_reason }
end

-- Polls the exec's status.json while its sandbox runs (after a restart there is no exec
-- stream to wait on). demesne-init writes it atomically, last, so its presence means done.
local function exec_poll(job, eng)
  local rec = job.rec
  local poll_ms = math.max(math.floor(config.get("jobs_poll_interval") * 1000), 50)
  while true do
    local st = sandbox.read_status(rec.run_dir, rec.exec_id)
    if st then return outcome_of(st, rec.timeout_seconds) end
    -- (by list, not inspect: see sandbox.state_of)
    local info, err, ecode = sandbox.state_of(eng, rec.sandbox_id)
    if not info and ecode == "ENOENT" then
      return exec_outcome(rec, ("sandbox %s no longer exists and the command recorded no exit status"):format(rec.sandbox_id))
    elseif not info and not engine_retry(ecode) then
      return { status = "failed", reason = tostring(err) }
    elseif info and info.state ~= "running" then
      return exec_outcome(rec, ("sandbox %s stopped before the command recorded an exit status"):format(rec.sandbox_id))
    end
    local age = now_ms() - rec.started_ms
    if age > sandbox.deadline_ms(rec.timeout_seconds) then
      -- demesne-init enforces the timeout inside: a record still missing now means it does
      -- not answer (stopped or hung), and the sandbox is stopped
      st = sandbox.read_status(rec.run_dir, rec.exec_id)
      if st then return outcome_of(st, rec.timeout_seconds) end
      return { status = "failed", reason = sandbox.stop_unresponsive(eng, rec.container, rec.sandbox_id,
        ("the command recorded no exit status within its timeout (%d s) plus the grace"):format(rec.timeout_seconds)) }
    end
    if age > 60000 and not exists_in(rec.run_dir, "exec/" .. rec.exec_id .. "/pid") then
      return exec_outcome(rec, "the command never started (the server stopped before it ran)")
    end
    async.sleep(poll_ms)
  end
end

local function exec_watch(job, eng, first_run, e)
  local rec = job.rec
  local finished = false
  -- a cancel kills the command's whole process group inside the sandbox
  local _ <close> = closer(function()
    if finished then return end
    local _, kerr, kcode = sandbox.exec_kill(eng, rec.container, "/.demesne/run/exec/" .. rec.exec_id, rec.sandbox_id)
    if kcode == "ETIMEDOUT" then job.cancel_reason = (job.cancel_reason or "cancelled") .. "; " .. tostring(kerr) end
  end)
  local out
  if first_run then
    local code, err, ecode = sandbox.exec_run(e)
    if code ~= nil then
      out = exec_outcome(rec, "the command recorded no exit status")
      if out.status == "lost" then
        -- no status.json: most likely the sandbox went away under the command (as a
        -- synchronous sandbox_exec says through check_alive)
        local ok, gone = pcall(sandbox.check_alive, eng, rec.sandbox_id)
        if not ok then
          out = { status = "lost", reason = type(gone) == "table" and tostring(gone.message) or tostring(gone) }
        else
          out = { status = code == 0 and "succeeded" or "failed", exit_code = math.tointeger(code),
            reason = "demesne-init recorded no exit status" }
        end
      end
    elseif ecode == "ETIMEDOUT" and not sandbox.read_status(rec.run_dir, rec.exec_id) then
      out = { status = "failed", reason = sandbox.stop_unresponsive(eng, rec.container, rec.sandbox_id,
        ("the command did not end within its timeout (%d s) plus the grace"):format(rec.timeout_seconds)) }
    elseif ecode == "ENOENGINE" then
      out = exec_poll(job, eng) -- the engine went away: the command may well still run
    else
      local info, _, icode = sandbox.state_of(eng, rec.sandbox_id)
      if not info and icode == "ENOENT" then
        out = exec_outcome(rec, ("sandbox %s was removed before the command finished"):format(rec.sandbox_id))
      else
        out = exec_poll(job, eng) -- the exec stream broke; the command records its status itself
        if out.status == "lost" and err then out.reason = out.reason .. " (" .. tostring(err) .. ")" end
      end
    end
  else
    out = exec_poll(job, eng)
  end
  finished = true
  return out
end

kinds.exec = {
  run = function(job, e) return exec_watch(job, e.engine, true, e) end,
  attach = function(job) return exec_watch(job, sandbox.engine(), false) end,
}

--------------------------------------------------------------------------------------------
-- Running

local function error_text(e)
  if type(e) == "table" and e.message then return tostring(e.message) end
  return (tostring(e):match("^[^\n]*"))
end

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
      if not ok and type(out) == "string" and out:find("traceback", 1, true) then log.error(LOGGER, "%s: %s", job.rec.job_id, out) end
      jobs.finish(job, "failed", { reason = ok and "the job returned no outcome" or error_text(out) })
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
  local path = ("%s/%s.adopt-%s"):format(jobs.dir(), rec.job_id, require("core.text").hash(tostring(rec.owner)))
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
function jobs.cancel(id, reason, cancelled)
  cancelled = cancelled or json.array()
  local rec = jobs.must_get(id)
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
---@param status string|nil
---@param limit integer|nil
---@return JobRecord[] list, integer matched
function jobs.list(status, limit)
  local list = {}
  for _, rec in ipairs(all_records()) do
    if not status or rec.status == status then list[#list + 1] = rec end
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
  service = async.spawn("jobs", function()
    while true do
      local ok, err = pcall(jobs.resume)
      if err == async.CANCELLED then return end
      if not ok then log.warning(LOGGER, "%s", tostring(err)) end
      async.sleep(math.floor(config.get("reap_interval") * 1000))
    end
  end)
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

--- Formats Unix time in ms as ISO 8601 UTC with milliseconds (nil for nil).
function jobs.iso(ms)
  if not ms then return nil end
  return os.date("!%Y-%m-%dT%H:%M:%S", ms // 1000) .. (".%03dZ"):format(ms % 1000)
end

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
  return {
    job_id = rec.job_id,
    status = rec.status,
    tool = rec.tool,
    started_at = jobs.iso(rec.started_ms),
    finished_at = jobs.iso(rec.finished_ms),
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
    agent = rec.kind == "agent" and TERMINAL[rec.status] and jobs.agent_result(rec) or nil,
  }
end

local AGENT_FIELDS = { "answer", "reason", "cost_usd", "usage", "rate_limited", "model", "provider", "session_id", "is_error" }

--- An ended agent job's result, from results.json in its output folder (written by
--- lua/agent.lua; read confined: no link followed, a regular file of at most 256 KiB),
--- reduced to AGENT_FIELDS. nil when there is none; {is_error = true, reason} when it
--- cannot be read or is not a JSON object (the sandbox can write its output folder).
---@param rec JobRecord
---@return table|nil
function jobs.agent_result(rec)
  if type(rec.output_dir) ~= "string" then return nil end
  local d, derr, dcode = fs.opendir(rec.output_dir)
  if not d and dcode == "ENOENT" then return nil end
  local text, err, code
  if d then
    text, err, code = d:read("results.json", 256 * 1024)
    d:close()
  else
    err, code = derr, dcode
  end
  if not text then
    if code == "ENOENT" then return nil end
    return { is_error = true, reason = "cannot read results.json: " .. tostring(err) }
  end
  local ok, r = pcall(json.decode, text)
  if not ok or type(r) ~= "table" then
    return { is_error = true, reason = "results.json in the output folder is not a JSON object" }
  end
  local out = {}
  for _, k in ipairs(AGENT_FIELDS) do
    if r[k] ~= nil and r[k] ~= json.null then out[k] = r[k] end
  end
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
  if not text then sandbox.fail("cannot read the job's output: " .. tostring(nxt), size) end
  return text, nxt, size, final and nxt >= size
end

--- The last `max` bytes of a job's stdout.log (whole lines) and the log's size. A log that
--- cannot be read (anything but missing) fails naming it.
function jobs.stdout_tail(rec, max)
  local text, size, code = output.tail(rec.output_dir, log_rel(rec, "stdout"), max)
  if not text then sandbox.fail("cannot read the job's output: " .. tostring(size), code) end
  return text, size
end

--- The bounded head and tail of a job's stdout and stderr: stdout, stderr, truncated.
function jobs.collect(rec)
  if rec.stdout_file then
    local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
    local so, cut1, c1 = output.view(rec.output_dir, rec.stdout_file, head, tail)
    if not so then sandbox.fail("cannot read the job's output: " .. tostring(cut1), c1) end
    local se, cut2, c2 = output.view(rec.output_dir, "stderr.log", head, tail)
    if not se then sandbox.fail("cannot read the job's output: " .. tostring(cut2), c2) end
    return so, se, cut1 or cut2
  end
  local rel = (rec.log_dir or rec.output_dir):sub(#rec.output_dir + 2)
  return sandbox.collect(rec.output_dir, rel ~= "" and rel or nil)
end

--------------------------------------------------------------------------------------------
-- Starting the sandbox tools in the background

local function short(s)
  s = tostring(s or "")
  if #s > 1000 then s = s:sub(1, require("core.text").utf8_floor(s, 1000)) .. "…" end
  return s
end

local function parent_of(ctx) return type(ctx) == "table" and ctx.job_id or nil end

--- sandbox_script with background = true: checks the call and starts the sandbox (the
--- image is built first if needed, with progress), then hands the running container to a
--- job and returns {job_id, status = "running", output_dir, run_id}. Once it returns, the
--- command runs on its own: a server stop does not stop it.
---@param ctx ToolContext
---@param args table
function jobs.start_script(ctx, args)
  local o = sandbox.script_prepare(args, "job")
  local id = new_id()
  local handed = false
  -- a call that fails or is cancelled before the job exists leaves nothing behind
  local _ <close> = closer(function()
    if not handed then
      sandbox.script_remove(o)
      sandbox.remove_tree(o.run_dir)
    end
  end)
  sandbox.script_start(ctx, o, { job_id = id, job_record = record_path(id) })
  local rec = jobs.launch({
    job_id = id, tool = "sandbox_script", kind = "script", command = short(args.command), timeout_seconds = o.timeout,
    output_dir = o.output_dir, log_dir = o.output_dir, run_dir = o.run_dir, exec_id = o.exec_id,
    container = o.name, run_id = o.run_id,
  }, o, parent_of(ctx))
  handed = true
  return { job_id = rec.job_id, status = rec.status, output_dir = rec.output_dir, run_id = rec.run_id }
end

--- sandbox_agent / sandbox_research with background = true: as start_script, for an agent
--- run (lua/agent.lua). Returns {job_id, status = "running", output_dir, run_id}.
---@param ctx ToolContext
---@param args table
---@param tool string
function jobs.start_agent(ctx, args, tool)
  local agent = require("demesne.agent")
  local o = agent.prepare(args, tool, "job")
  local id = new_id()
  local handed = false
  local _ <close> = closer(function()
    if not handed then
      sandbox.script_remove(o)
      if o.vendor then o.vendor:stop() end
      sandbox.remove_tree(o.run_dir)
    end
  end)
  sandbox.script_start(ctx, o, { job_id = id, job_record = record_path(id) })
  local rec = jobs.launch({
    job_id = id, tool = tool, kind = "agent", command = short(args.prompt), timeout_seconds = o.timeout,
    output_dir = o.output_dir, log_dir = o.output_dir, run_dir = o.run_dir, exec_id = o.exec_id,
    container = o.name, run_id = o.run_id, provider = o.provider.name, model = o.model, vendor_token = o.token,
    resumable = o.resumable,
    stdout_file = "transcript.jsonl",
  }, o, parent_of(ctx))
  handed = true
  return { job_id = rec.job_id, status = rec.status, output_dir = rec.output_dir, run_id = rec.run_id }
end

--- sandbox_exec with background = true: checks the call, starts the job and returns once
--- demesne-init has started the command (its pid file exists, at most 10 s):
--- {job_id, status = "running", output_dir, log_dir}. From then on the command runs on its
--- own in the sandbox: a server stop does not stop it.
---@param ctx ToolContext
---@param args table
function jobs.start_exec(ctx, args)
  local e = sandbox.exec_prepare(args)
  local rec = jobs.launch({
    tool = "sandbox_exec", kind = "exec", command = short(args.command), timeout_seconds = e.timeout,
    output_dir = e.output_dir, log_dir = e.log_dir, run_dir = e.run_dir, exec_id = e.exec_id,
    container = e.container, sandbox_id = args.sandbox_id,
  }, e, parent_of(ctx))
  local returned = false
  local _ <close> = closer(function()
    if not returned then pcall(jobs.cancel, rec.job_id, "the call that started it was cancelled") end
  end)
  local dir = "exec/" .. e.exec_id
  local deadline = loop.now() + 10000
  while rec.status == "running" and loop.now() < deadline
    and not exists_in(e.run_dir, dir .. "/pid") and not exists_in(e.run_dir, dir .. "/status.json") do
    async.sleep(20)
  end
  returned = true
  return { job_id = rec.job_id, status = rec.status, output_dir = rec.output_dir, log_dir = rec.log_dir }
end

--- Readable text for a "job started" result.
function jobs.started_text(r)
  return ("job_id: %s\nstatus: running\noutput_dir: %s\nUse sandbox_status (with `since` to read stdout "
    .. "incrementally), sandbox_wait or sandbox_cancel with this job_id."):format(r.job_id, r.output_dir)
end

return jobs
