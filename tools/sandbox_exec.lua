-- sandbox_exec: a command in a persistent sandbox.
local errors = require("demesne.errors")
local jobs = require("demesne.jobs")
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return {
  name = "sandbox_exec",
  title = "Run a command in a persistent sandbox",
  description = "Runs a shell command with /bin/sh -c in a sandbox made by sandbox_create and renews its TTL. "
    .. "A timeout or cancel kills the command's whole process group. Full output is kept in "
    .. "output_dir/exec/<id>/stdout.log and stderr.log; the result carries a bounded head and tail.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id", "command" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      command = { type = "string", minLength = 1, description = "Shell command, run with /bin/sh -c." },
      timeout_seconds = schemas.timeout_seconds,
      cwd = { type = "string", description = "Absolute working directory in the sandbox. Default /out." },
      env = schemas.env,
      background = schemas.background,
      hand_back = { type = "boolean", default = false, description = "A sandbox made with repository: after the "
        .. "command, hand its branch back to the host repository now (commits, and what is uncommitted as a commit by "
        .. "demesne); the result gets `branch`. sandbox_destroy always does. Not with background." },
    },
  },
  outputSchema = schemas.or_job(schemas.run_result({ log_dir = { type = "string" }, expires_at = { type = "string" },
    branch = repo.SCHEMA })),
  execution = { taskSupport = "optional" }, -- MCP tasks: runs as a background job
  annotations = { readOnlyHint = false, destructiveHint = true, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    if args.hand_back and args.background then errors.raise("hand_back: not with background") end
    return jobs.dispatch("exec", function(c, a)
      local r = sandbox.exec(c, a)
      local text = schemas.run_text(r)
      if r.branch then text = repo.text(r.branch) .. "\n" .. text end
      return r, text
    end)(ctx, args)
  end,
}
