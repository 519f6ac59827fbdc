-- sandbox_pause: Pause a persistent sandbox.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_pause",
  title = "Pause a persistent sandbox",
  description = "Freezes every process of a sandbox made by sandbox_create (the engine's pause). Its TTL keeps "
    .. "running. While it is paused, sandbox_exec, sandbox_upload, sandbox_download, sandbox_snapshot and "
    .. "sandbox_fork are refused with an error that says so; sandbox_resume thaws it, sandbox_destroy removes it.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id" },
    properties = { sandbox_id = schemas.sandbox_id },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "status" }),
    properties = {
      sandbox_id = { type = "string" },
      status = { type = "string", enum = { "paused", "already paused" } },
      expires_at = { type = "string", description = "UTC, RFC 3339" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.pause(ctx, args)
    return r, ("%s: %s"):format(r.status, r.sandbox_id)
  end,
}
