-- sandbox_snapshot: a persistent sandbox's files as an image, to start more sandboxes from.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_snapshot",
  title = "Snapshot a persistent sandbox",
  description = "Keeps a sandbox made by sandbox_create as a snapshot (an image of the engine): its /workspace, and "
    .. "its root filesystem's changes where the root is writable. Not /out (the host's), /in, /tmp, /root, nor any "
    .. "running process. sandbox_create {snapshot} and sandbox_fork start sandboxes from it; sandbox_snapshots lists "
    .. "them; they are removed by sandbox_snapshot_delete or after snapshot_keep_seconds.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      name = { type = "string", minLength = 1, maxLength = 128,
        description = "A name to know it by: letters, digits, '_', '.' and '-' (an image reference component)." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "snapshot_id", "source_sandbox_id", "created_at", "expires_at" }),
    properties = {
      snapshot_id = { type = "string" }, name = { type = "string" }, source_sandbox_id = { type = "string" },
      isolation = { type = "string" }, image = { type = "string" }, created_at = { type = "string" },
      expires_at = { type = "string", description = "UTC, RFC 3339: when retention removes it" },
      size_bytes = { type = "integer" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.snapshot(ctx, args)
    return r, ("snapshot_id: %s\nsource: %s\nexpires_at: %s"):format(r.snapshot_id, r.source_sandbox_id, r.expires_at)
  end,
}
