-- sandbox_status: where a background job stands, and its stdout read incrementally.
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local schemas = require("demesne.schemas")

return {
  name = "sandbox_status",
  title = "Status of a background job",
  description = "Returns a background job's status (running, succeeded, failed, cancelled, lost), exit code, "
    .. "elapsed time, start and finish times, the reason when it failed or was lost, and its output folder. "
    .. "To read its stdout as it grows, pass `since` (0 the first time, then the next_cursor of the previous "
    .. "answer): each answer gives the bytes from there on, so no line is missed or repeated; `eof` says the "
    .. "job has ended and everything was read. include_stdout_tail adds the last lines of stdout.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "job_id" },
    properties = {
      job_id = schemas.job_id,
      include_stdout_tail = { type = "boolean", default = false,
        description = "Add stdout_tail: the last lines of stdout (about 16 KiB)." },
      since = { type = "integer", minimum = 0,
        description = "Byte offset into stdout.log: return stdout from here (and next_cursor to continue from)." },
      max_bytes = { type = "integer", minimum = 1024, maximum = 1048576,
        description = "Most bytes of stdout one `since` read returns. Default 65536." },
    },
  },
  outputSchema = schemas.status_result({
    stdout = { type = "string", description = "stdout from `since` to next_cursor (cut on UTF-8 code points)" },
    next_cursor = { type = "integer", description = "pass as `since` to read on" },
    eof = { type = "boolean", description = "the job has ended and stdout was read to its end" },
    stdout_bytes = { type = "integer", description = "size of stdout.log so far" },
    stdout_tail = { type = "string", description = "the last lines of stdout" },
  }),
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local rec = jobs.must_get(args.job_id)
    local r = jobs.view(rec)
    local tail
    if args.since then
      local max = args.max_bytes or config.get("jobs_read_bytes")
      r.stdout, r.next_cursor, r.stdout_bytes, r.eof = jobs.read_stdout(rec, args.since, max)
    end
    if args.include_stdout_tail then
      tail, r.stdout_bytes = jobs.stdout_tail(rec, config.get("jobs_tail_bytes"))
      r.stdout_tail = tail
    end
    local text = schemas.status_text(r)
    if r.stdout then
      text = text .. ("\nnext_cursor: %d%s\n--- stdout from byte %d ---\n%s"):format(r.next_cursor,
        r.eof and " (eof)" or "", args.since, r.stdout)
    end
    if tail then text = text .. "\n--- stdout tail ---\n" .. tail end
    return r, text
  end,
}
