-- sandbox_list: the live persistent sandboxes this host's demesne created.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return {
  name = "sandbox_list",
  title = "List persistent sandboxes",
  description = "Lists the live sandboxes made by sandbox_create: id, image, created and expiry times, output folder, "
    .. "port previews.",
  inputSchema = { type = "object", additionalProperties = false, properties = {} },
  outputSchema = {
    type = "object",
    required = { "sandboxes" },
    properties = {
      sandboxes = { type = "array", items = { type = "object", properties = {
        sandbox_id = { type = "string" }, image = { type = "string" }, created_at = { type = "string" },
        expires_at = { type = "string" }, output_dir = { type = "string" }, state = { type = "string" },
        previews = schemas.previews,
        paused = { type = "boolean", description = "frozen by sandbox_pause (state stays running)" },
      } } },
    },
  },
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.list()
    local lines = {}
    for _, s in ipairs(r.sandboxes) do
      lines[#lines + 1] = ("%s  %s  expires %s  %s"):format(s.sandbox_id, s.image, s.expires_at, s.output_dir)
      for _, p in ipairs(s.previews or {}) do lines[#lines + 1] = ("  port %d: %s"):format(p.port, p.url) end
    end
    return r, #lines > 0 and table.concat(lines, "\n") or "no sandboxes"
  end,
}
