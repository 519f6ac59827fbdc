-- The "exec" kind of background job (sandbox_exec with background = true): a command run
-- by `demesne-init run` in a persistent sandbox (through its control socket, else the
-- engine's exec API), watched through that and, after a server restart, through its
-- status.json.
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local jobs = require("demesne.jobs")
local loop = require("core.loop")
local outcome = require("demesne.jobs.outcome")
local sandbox = require("demesne.sandbox")
local util = require("demesne.util")

local closer, now_ms = util.closer, util.now_ms
local outcome_of, engine_retry = outcome.of, outcome.engine_retry

-- Is there anything at `rel` below the run folder `run_dir`? Looked up confined (no
-- symlink, no ".."): the run folder is the sandbox's to write.
local function exists_in(run_dir, rel)
  local d = fs.opendir(run_dir)
  if not d then return false end
  local st = d:stat(rel)
  d:close()
  return st ~= nil
end

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
    if e and e.started then e.started.set(false) end -- start_exec waits no longer
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
          out = { status = "lost", reason = errors.message(gone) }
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

-- The kind (registered as "exec" by lua/compose.lua).
return {
  -- sandbox_exec with background = true: checks the call, starts the job and returns once
  -- demesne-init has started the command (its pid file exists, at most 10 s):
  -- {job_id, status = "running", output_dir, log_dir}. From then on the command runs on
  -- its own in the sandbox: a server stop does not stop it.
  start = function(ctx, args)
    local e = sandbox.exec_prepare(args)
    local rec = jobs.launch({
      tool = "sandbox_exec", kind = "exec", command = jobs.short(args.command), timeout_seconds = e.timeout,
      output_dir = e.output_dir, log_dir = e.log_dir, run_dir = e.run_dir, exec_id = e.exec_id,
      container = e.container, sandbox_id = args.sandbox_id,
    }, e, jobs.parent_of(ctx))
    local returned = false
    local _ <close> = closer(function()
      if not returned then pcall(jobs.cancel, rec.job_id, "the call that started it was cancelled") end
    end)
    -- through the control socket demesne-init says when the command runs; through the exec
    -- API only its pid file does
    local started = async.timeout(10000, e.started.wait)
    if started == false then
      local dir = "exec/" .. e.exec_id
      local deadline = loop.now() + 10000
      while rec.status == "running" and loop.now() < deadline
        and not exists_in(e.run_dir, dir .. "/pid") and not exists_in(e.run_dir, dir .. "/status.json") do
        async.sleep(20)
      end
    end
    returned = true
    return { job_id = rec.job_id, status = rec.status, output_dir = rec.output_dir, log_dir = rec.log_dir }
  end,
  run = function(job, e) return exec_watch(job, e.engine, true, e) end,
  attach = function(job) return exec_watch(job, sandbox.engine(), false) end,
}
