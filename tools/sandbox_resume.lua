-- sandbox_resume: Resume a paused sandbox.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return schemas.sandbox_state_tool({
  name = "sandbox_resume",
  title = "Resume a paused sandbox",
  description = "Thaws a sandbox paused by sandbox_pause: its processes go on where they stopped, and its TTL is renewed.",
  statuses = { "resumed", "not paused" },
  properties = { expires_at = { type = "string", description = "UTC, RFC 3339" } },
  call = sandbox.resume,
})
