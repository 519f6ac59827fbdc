-- sandbox_research: an AI agent CLI with open egress and no host inputs, for web research
-- (the run itself: lua/agent.lua).
local agent = require("demesne.agent")
local jobs = require("demesne.jobs")
local schemas = require("demesne.schemas")

local NAME = "sandbox_research"

return {
  name = NAME,
  title = "Research with an AI agent (open network)",
  description = "Runs an AI agent CLI (Claude Code, Codex, …) with full autonomy in a fresh sandbox with open network "
    .. "access and no host inputs, for web research. "
    .. "The real vendor credential stays on the host: the agent reaches the model only through a per-run "
    .. "token on a host-side vendor route that counts usage (usage.json). Returns the agent's final answer, "
    .. "exit code, cost and usage; transcript.jsonl and results.json are in output_dir.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "prompt" },
    properties = schemas.agent_task({ model = agent.model_schema() }),
  },
  outputSchema = schemas.or_job(schemas.agent_result()),
  execution = { taskSupport = "optional" }, -- MCP tasks: runs as a background job
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = true },
  run = jobs.dispatch("agent", function(ctx, args)
    local r = agent.run(ctx, args, NAME)
    return r, agent.text(r)
  end, NAME),
}
