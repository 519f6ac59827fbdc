-- What a sandbox command's exit record (demesne-init's status.json) means for a job, and
-- waiting out an engine that is not answering: shared by the kinds of job that run
-- sandbox commands (lua/jobs/script.lua, lua/jobs/exec.lua).
local async = require("demesne.async")
local sandbox = require("demesne.sandbox")

local outcome = {}

--- What a job's exit status (demesne-init's status.json) means for the job.
---@param st table       the decoded status.json (untrusted: written in the sandbox)
---@param timeout integer the command's timeout in seconds
---@return JobOutcome
function outcome.of(st, timeout)
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
    local oom = sandbox.oom_note(st)
    if oom then out.reason = out.reason .. "; " .. oom end
  else
    out.status, out.reason = "failed", "demesne-init recorded no exit code"
  end
  return out
end

--- Sleeps 5 s and returns true while the engine is not answering (ENOENGINE): a restarted
--- engine must not make jobs lost. False for any other code.
---@param ecode string|nil
---@return boolean retry
function outcome.engine_retry(ecode)
  if ecode == "ENOENGINE" then
    async.sleep(5000)
    return true
  end
  return false
end

return outcome
