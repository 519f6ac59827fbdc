-- sandbox_pause: Pause a persistent sandbox.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return schemas.sandbox_state_tool({
  name = "sandbox_pause",
  title = "Pause a persistent sandbox",
  description = "Freezes every process of a sandbox made by sandbox_create (the engine's pause). Its TTL keeps "
    .. "running. While it is paused, sandbox_exec, sandbox_upload, sandbox_download, sandbox_snapshot and "
    .. "sandbox_fork are refused with an error that says so; sandbox_resume thaws it, sandbox_destroy removes it.",
  statuses = { "paused", "already paused" },
  properties = { expires_at = { type = "string", description = "UTC, RFC 3339" } },
  call = sandbox.pause,
})
