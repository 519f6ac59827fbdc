-- sandbox_wait: waits for a background job to end and returns its result.
local jobs = require("demesne.jobs")
local progress = require("demesne.progress")
local schemas = require("demesne.schemas")

local MAX = 48 * 3600

return {
  name = "sandbox_wait",
  title = "Wait for a background job",
  description = "Waits until a background job ends, then returns its result: status, exit code, the head and "
    .. "tail of stdout and stderr (full logs in log_dir), and the reason when it failed or was lost. When "
    .. "timeout_seconds pass first it returns status running with a message (not an error): call it again. "
    .. "Sends progress while waiting when the request carries a progressToken. Cancelling the wait leaves the job running.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "job_id" },
    properties = {
      job_id = schemas.job_id,
      timeout_seconds = { type = "number", minimum = 0, maximum = MAX, default = 1800,
        description = "Seconds to wait at most (default 1800, at most 172800 = 48 h; 0 = just look)." },
    },
  },
  outputSchema = schemas.status_result({
    stdout = { type = "string", description = "head and tail of stdout (full stream in log_dir/stdout.log)" },
    stderr = { type = "string", description = "head and tail of stderr (full stream in log_dir/stderr.log)" },
    truncated = { type = "boolean", description = "true when stdout or stderr was cut; the logs hold everything" },
  }),
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local rec = jobs.must_get(args.job_id)
    local timeout = math.min(args.timeout_seconds or 1800, MAX)
    local _hb <close> = progress.heartbeat(ctx, { total = timeout, message = function(waited)
      local r = jobs.get(args.job_id) or rec
      return ("job %s %s; waited %d s of %d s"):format(r.job_id, r.status, math.floor(waited), math.floor(timeout))
    end })
    rec = jobs.wait(args.job_id, math.floor(timeout * 1000))
    local r = jobs.view(rec)
    if not jobs.is_terminal(rec.status) then
      r.message = ("still running after waiting %g s; call sandbox_wait again (or sandbox_status with since "
        .. "to read stdout so far)"):format(timeout)
      return r, schemas.status_text(r)
    end
    r.stdout, r.stderr, r.truncated = jobs.collect(rec)
    local text = schemas.status_text(r) .. "\n--- stdout ---\n" .. r.stdout .. "\n--- stderr ---\n" .. r.stderr
    return r, text
  end,
}
