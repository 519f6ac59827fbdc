-- sandbox_cancel: cancels a background job and every job it started.
local jobs = require("demesne.jobs")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_cancel",
  title = "Cancel a background job",
  description = "Cancels a background job and every job it started (children first): the command's whole "
    .. "process group is killed, a one-shot sandbox is removed, and the job's status becomes cancelled. "
    .. "Cancelling a job that has already ended changes nothing and returns its status.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "job_id" },
    properties = { job_id = schemas.job_id },
  },
  outputSchema = schemas.status_result({
    cancelled = { type = "array", items = { type = "string" },
      description = "the jobs this call cancelled (children first); empty when the job had already ended" },
  }),
  annotations = { readOnlyHint = false, destructiveHint = true, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local rec, cancelled = jobs.cancel(args.job_id, "cancelled by sandbox_cancel")
    local r = jobs.view(rec)
    r.cancelled = cancelled or json.array()
    if #r.cancelled == 0 then
      r.message = ("job %s had already ended (%s); nothing was cancelled"):format(rec.job_id, rec.status)
    end
    return r, schemas.status_text(r)
  end,
}
