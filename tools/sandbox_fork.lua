-- sandbox_fork: a snapshot of a persistent sandbox and `count` new sandboxes from it (best-of-N).
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_fork",
  title = "Fork a persistent sandbox",
  description = "Takes a snapshot of a sandbox made by sandbox_create (as sandbox_snapshot) and starts count new "
    .. "sandboxes from it in one call, each with the snapshot's /workspace and files and its own /out, isolated no "
    .. "weaker than the source: for trying several approaches from one prepared state. Processes are not copied. "
    .. "If any of them cannot be made, none is kept.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id", "count" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      count = { type = "integer", minimum = 1, description = "How many sandboxes to start (at most fork_max_count)." },
      name = { type = "string", minLength = 1, maxLength = 128, description = "The snapshot's name (as sandbox_snapshot)." },
      env = schemas.env,
      egress = schemas.egress,
      limits = schemas.limits,
      isolation = schemas.isolation,
      ttl_seconds = { type = "integer", minimum = 60, description = "Seconds each new sandbox lives without use." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "snapshot_id", "source_sandbox_id", "sandboxes" }),
    properties = {
      snapshot_id = { type = "string" },
      source_sandbox_id = { type = "string" },
      sandboxes = { type = "array", items = { type = "object", required = json.array({ "sandbox_id", "output_dir" }),
        properties = { sandbox_id = { type = "string" }, output_dir = { type = "string" }, expires_at = { type = "string" },
          image = { type = "string" }, isolation = { type = "string" } } } },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.fork(ctx, args, ctx.fork_create)
    local lines = { "snapshot_id: " .. r.snapshot_id }
    for _, s in ipairs(r.sandboxes) do
      lines[#lines + 1] = ("sandbox_id: %s  output_dir: %s"):format(s.sandbox_id, s.output_dir)
    end
    return r, table.concat(lines, "\n")
  end,
}
