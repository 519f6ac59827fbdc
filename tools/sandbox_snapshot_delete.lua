-- sandbox_snapshot_delete: remove a snapshot.
local sandbox = require("demesne.sandbox")
local json = require("demesne.json")

return {
  name = "sandbox_snapshot_delete",
  title = "Delete a snapshot",
  description = "Removes a snapshot taken by sandbox_snapshot or sandbox_fork. Refused while a sandbox runs from it. "
    .. "Idempotent: deleting one that is already gone succeeds and says so.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "snapshot_id" },
    properties = { snapshot_id = { type = "string", minLength = 1, description = "The id sandbox_snapshot returned." } },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "snapshot_id", "status" }),
    properties = { snapshot_id = { type = "string" }, status = { type = "string", enum = { "deleted", "already gone" } } },
  },
  annotations = { readOnlyHint = false, destructiveHint = true, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.snapshot_delete(ctx, args)
    return r, ("%s: %s"):format(r.status, r.snapshot_id)
  end,
}
