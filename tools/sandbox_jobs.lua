-- sandbox_jobs: lists background jobs.
local jobs = require("demesne.jobs")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_jobs",
  title = "List background jobs",
  description = "Lists background jobs, running ones first, then the newest first: id, status, tool, times, "
    .. "exit code, output folder. Finished jobs are kept for 7 days by default (jobs_keep_seconds).",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    properties = {
      status = { type = "string", enum = schemas.job_status.enum, description = "Only jobs with this status." },
      limit = { type = "integer", minimum = 1, maximum = 1000, default = 100, description = "Most jobs to list." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "jobs", "matched" }),
    properties = {
      jobs = { type = "array", items = { type = "object", properties = schemas.job_properties({
        command = { type = "string" } }) } },
      matched = { type = "integer", description = "jobs that matched the filter (the list stops at limit)" },
    },
  },
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    -- from inside a sandbox (ctx.caller, lua/tree/child.lua): only the jobs of its subtree
    local list, matched = jobs.list(args.status, args.limit, ctx.caller and ctx.caller.sees_job)
    local out, lines = json.array(), {}
    for _, rec in ipairs(list) do
      local v = jobs.view(rec)
      v.command = rec.command
      out[#out + 1] = v
      lines[#lines + 1] = ("%s  %-9s  %s  %s%s  %s"):format(v.job_id, v.status, v.tool or "?", v.started_at,
        v.exit_code and ("  exit " .. v.exit_code) or "", v.command or "")
    end
    local text = #lines > 0 and table.concat(lines, "\n") or "no jobs"
    if matched > #list then text = text .. ("\n(%d more not listed)"):format(matched - #list) end
    return { jobs = out, matched = matched }, text
  end,
}
