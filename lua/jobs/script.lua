-- The "script" kind of background job (sandbox_script with background = true): a
-- one-shot sandbox whose container runs `demesne-init run` as PID 1, watched until it
-- stops, and found again from its record after a server restart. Agent runs use its
-- launch and watch (lua/agent/job.lua).
local jobs = require("demesne.jobs")
local outcome = require("demesne.jobs.outcome")
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local plan = require("demesne.sandbox.plan")
local util = require("demesne.util")

local closer, now_ms = util.closer, util.now_ms
local outcome_of, engine_retry = outcome.of, outcome.engine_retry

-- One-shot jobs: the container runs `demesne-init run` as PID 1.
local function script_outcome(rec, o, code, err, ecode)
  local q = sandbox.quota_outcome(o) -- the output quota stopped it (lua/sandbox/quota.lua)
  if q then
    return { status = "failed", exit_code = math.tointeger(code) or 137,
      reason = ("%s: %s; %s bytes were written"):format(q.reason, q.output_quota.detail,
        sandbox.num(q.output_quota.written_bytes)) }
  end
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
  local ended = false
  local _ <close> = closer(function()
    if o.repo and o.id and not ended then
      -- a cancelled repository run: demesne-init stops the command gently (SIGTERM, SIGKILL
      -- 2 s on), so that its run.sh hands the branch back before the container goes
      pcall(sandbox.exec_kill, o.engine, o.id, "/.demesne/run/exec/" .. tostring(o.exec_id), nil)
      pcall(sandbox.script_wait, o, 10000)
    end
    sandbox.script_remove(o)
  end)
  if not o.id then return script_outcome(rec, o, nil, "gone", "ENOENT") end
  while true do
    local left = rec.started_ms + (rec.timeout_seconds + 60) * 1000 - now_ms()
    local code, err, ecode = sandbox.script_wait(o, math.max(left, 30000))
    if code ~= nil or not engine_retry(ecode) then
      ended = true
      return script_outcome(rec, o, code, err, ecode)
    end
  end
end

-- Hands a planned one-shot run to a new job: starts its sandbox (the image is built first
-- if needed, with progress), then launches the job (fields: the record's kind-specific
-- fields; the sandbox's are filled in) and returns {job_id, status = "running",
-- output_dir, run_id}. A call that fails or is cancelled before the job exists leaves
-- nothing behind: the container goes, `abandon` (optional) runs, the run folder goes.
local function launch_oneshot(ctx, o, fields, abandon)
  local id = jobs.new_id()
  local handed = false
  local _ <close> = closer(function()
    if not handed then
      sandbox.script_remove(o)
      if abandon then abandon() end
      sandbox.remove_tree(o.run_dir)
    end
  end)
  sandbox.script_start(ctx, o, { job_id = id, job_record = jobs.record_path(id) })
  -- what the record keeps of the plan (plan:record), from which attach rebuilds it
  for k, v in pairs(o:record()) do fields[k] = v end
  fields.job_id, fields.log_dir = id, o.output_dir
  local rec = jobs.launch(fields, o, jobs.parent_of(ctx))
  handed = true
  plan.launched(o) -- from here on the plan is only read (a failed launch above may still abandon it)
  return { job_id = rec.job_id, status = rec.status, output_dir = rec.output_dir, run_id = rec.run_id }
end

-- The kind (registered as "script" by lua/compose.lua).
return {
  -- sandbox_script with background = true: checks the call and starts the sandbox, then
  -- hands the running container to a job. Once it returns, the command runs on its own: a
  -- server stop does not stop it.
  start = function(ctx, args)
    local o = sandbox.script_prepare(args, "job")
    return launch_oneshot(ctx, o, { tool = "sandbox_script", kind = "script", command = jobs.short(args.command) })
  end,
  -- o: a plan whose container sandbox.script_start has started
  run = function(job, o)
    job.after = function()
      sandbox.remove_tree(o.run_dir)
      repo.cleanup(o)
    end
    -- a cancelled run's branch comes back too: script_watch stopped it gently, and the
    -- record (saved by jobs.finish) gets the branch
    local _hb <close> = closer(function()
      if o.repo and not o.handed_back then
        o.handed_back = true
        job.rec.branch = repo.hand_back(o)
      end
    end)
    local out = script_watch(job, o)
    -- a repository run's work comes back as its branch (lua/repo) once the container is gone
    if o.repo and type(out) == "table" then
      o.handed_back = true
      out.branch = repo.hand_back(o, out)
    end
    return out
  end,
  attach = function(job)
    local rec = job.rec
    -- the plan as the record kept it (plan.from_record); its result names it as a tree node
    local o = plan.from_record(rec, { engine = sandbox.engine(), tree = rec.run_id })
    job.after = function()
      sandbox.remove_tree(o.run_dir)
      repo.forget(rec.run_id)
    end
    local info, err, ecode
    repeat info, err, ecode = o.engine:inspect(rec.container) until info or not engine_retry(ecode)
    if not info and ecode ~= "ENOENT" then return { status = "failed", reason = tostring(err) } end
    if not info then o.id = nil end
    if info and info.state == "created" then
      local out = { status = "lost", reason = "the server stopped before the sandbox was started" }
      o.engine:remove(o.id)
      return out
    end
    local out = script_watch(job, o)
    -- a repository run's saved plan (lua/repo): its branch comes back after a restart too
    -- (an agent job's comes back through its results: lua/agent/job.lua)
    local g = rec.kind == "script" and repo.load(rec.run_id)
    if g and type(out) == "table" then
      o.repo = g
      out.branch = repo.hand_back(o, out)
    end
    return out
  end,
  -- for kinds that run a one-shot sandbox too (agent runs)
  launch = launch_oneshot,
  watch = script_watch,
}
