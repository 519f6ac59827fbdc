-- sandbox_agent: an AI coding agent CLI with full autonomy in a fresh sandbox, its real
-- credential kept on the host (the run itself: lua/agent/).
local agent = require("demesne.agent")
local jobs = require("demesne.jobs")
local repo = require("demesne.repo")
local json = require("demesne.json")
local schemas = require("demesne.schemas")

local NAME = "sandbox_agent"

return {
  name = NAME,
  title = "Run an AI coding agent in a sandbox",
  description = "Runs an AI coding agent CLI (Claude Code, Codex, …) with full autonomy in a fresh sandbox: host inputs "
    .. "read-only under /in, a writable /workspace, deliverables in /out (output_dir). "
    .. schemas.AGENT_RUN_NOTE,
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "prompt" },
    properties = schemas.agent_task({
      model = agent.model_schema(),
      files = schemas.files(),
      directories = schemas.directories(),
      egress = { type = "string", enum = json.array({ "none", "package-managers" }), default = "none",
        description = "'none' (default): only the model API; 'package-managers': also package registries." },
      host_mcp = schemas.host_mcp,
      image = { type = "string", enum = json.array({ "devcontainer" }), description = "\"devcontainer\": run in "
        .. "the environment the repository (or a directories entry) declares in .devcontainer/devcontainer.json, "
        .. "with the provider's CLI added; left out, the provider's own image." },
      repository = repo.params().repository,
      include_uncommitted = repo.params().include_uncommitted,
      branch = repo.params().branch,
      depth = repo.params().depth,
      continue = { type = "string", minLength = 1, maxLength = 64, description = "The run_id of an ended "
        .. "sandbox_agent run to continue: the same provider, model and inputs, the same /workspace, and the CLI's "
        .. "own session resumed with this prompt (kept for workspace_keep_seconds after a run, default a day). "
        .. "Leave model, files, directories, egress, isolation and host_mcp out (they are the first run's). "
        .. "The result names the run it continues (continues)." },
    }),
  },
  outputSchema = schemas.or_job(schemas.agent_result(), { branch = repo.SCHEMA }),
  execution = { taskSupport = "optional" }, -- MCP tasks: runs as a background job
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = true },
  run = jobs.dispatch("agent", function(ctx, args)
    local r = agent.run(ctx, args, NAME)
    return r, agent.text(r)
  end, NAME),
}
