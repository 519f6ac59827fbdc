-- sandbox_resume: Resume a paused sandbox.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_resume",
  title = "Resume a paused sandbox",
  description = "Thaws a sandbox paused by sandbox_pause: its processes go on where they stopped, and its TTL is renewed.",
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
      status = { type = "string", enum = { "resumed", "not paused" } },
      expires_at = { type = "string", description = "UTC, RFC 3339" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.resume(ctx, args)
    return r, ("%s: %s"):format(r.status, r.sandbox_id)
  end,
}
