-- sandbox_research: an AI agent CLI with open egress and no host inputs, for web research
-- (the run itself: lua/agent/).
local agent = require("demesne.agent")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local schemas = require("demesne.schemas")

local NAME = "sandbox_research"

return {
  name = NAME,
  title = "Research with an AI agent (open network)",
  description = "Runs an AI agent CLI (Claude Code, Codex, …) with full autonomy in a fresh sandbox with open network "
    .. "access and no host inputs, for web research. "
    .. schemas.AGENT_RUN_NOTE,
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "prompt" },
    properties = schemas.agent_task({ model = agent.model_schema(),
      isolation = { type = "string", enum = json.array({ "container", "gvisor" }), description =
        schemas.isolation.description .. " Under gvisor the research run's network is the proxy's web policy (any "
          .. "host name on ports 80 and 443, public addresses only, each request in egress.jsonl) instead of an "
          .. "open network." } }),
  },
  outputSchema = schemas.or_job(schemas.agent_result()),
  execution = { taskSupport = "optional" }, -- MCP tasks: runs as a background job
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = true },
  run = jobs.dispatch("agent", function(ctx, args)
    local r = agent.run(ctx, args, NAME)
    return r, agent.text(r)
  end, NAME),
}
