-- sandbox_snapshots: the snapshots there are.
local sandbox = require("demesne.sandbox")
local json = require("demesne.json")

return {
  name = "sandbox_snapshots",
  title = "List snapshots",
  description = "Lists the snapshots taken by sandbox_snapshot and sandbox_fork that are still kept, newest first.",
  inputSchema = { type = "object", additionalProperties = false, properties = {} },
  outputSchema = {
    type = "object",
    required = json.array({ "snapshots" }),
    properties = {
      snapshots = { type = "array", items = { type = "object", required = json.array({ "snapshot_id" }), properties = {
        snapshot_id = { type = "string" }, name = { type = "string" }, source_sandbox_id = { type = "string" },
        isolation = { type = "string" }, image = { type = "string" }, created_at = { type = "string" },
        expires_at = { type = "string" }, size_bytes = { type = "integer" },
      } } },
    },
  },
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, _args)
    local r = sandbox.snapshots(ctx)
    local lines = {}
    for _, s in ipairs(r.snapshots) do
      lines[#lines + 1] = ("%s  %s  from %s%s"):format(s.snapshot_id, s.created_at, tostring(s.source_sandbox_id),
        s.name and ("  " .. s.name) or "")
    end
    return r, #lines > 0 and table.concat(lines, "\n") or "no snapshots"
  end,
}
