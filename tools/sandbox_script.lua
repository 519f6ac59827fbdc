-- sandbox_script: one command in a fresh, disposable container.
local jobs = require("demesne.jobs")
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return {
  name = "sandbox_script",
  title = "Run a script in a fresh sandbox",
  description = "Runs a shell command with /bin/sh -c in a new container whose network access is decided by an egress policy, "
    .. "working directory /out (a host folder kept after the run). Host inputs are mounted read-only at /in. "
    .. "The container is removed afterwards. Returns the exit code and the head and tail of stdout and stderr; "
    .. "the full streams are in stdout.log and stderr.log in output_dir.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "command" },
    properties = {
      command = { type = "string", minLength = 1, description = "Shell command, run with /bin/sh -c in /out." },
      image = schemas.image,
      files = schemas.files(),
      directories = schemas.directories(),
      env = schemas.env,
      egress = schemas.egress,
      background = schemas.background,
      timeout_seconds = schemas.timeout_seconds,
      limits = schemas.limits,
      mcp = schemas.mcp,
      budget_usd = schemas.budget_usd,
      tree = schemas.tree,
      isolation = schemas.isolation,
      repository = repo.params().repository,
      include_uncommitted = repo.params().include_uncommitted,
      branch = repo.params().branch,
      depth = repo.params().depth,
    },
  },
  outputSchema = schemas.or_job(schemas.run_result({ run_id = { type = "string" }, branch = repo.SCHEMA })),
  execution = { taskSupport = "optional" }, -- MCP tasks: runs as a background job
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = jobs.dispatch("script", function(ctx, args)
    local r = sandbox.run_script(ctx, args)
    local text = schemas.run_text(r)
    if r.branch then text = repo.text(r.branch) .. "\n" .. text end
    return r, text
  end),
}
