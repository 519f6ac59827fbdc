-- sandbox_expose: a port preview of a running persistent sandbox (lua/sandbox/preview.lua).
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_expose",
  title = "Preview a port of a sandbox",
  description = "Opens a URL on the host's loopback (http://127.0.0.1:<host port>/, one port, so one browser origin, "
    .. "per preview) that carries HTTP and WebSocket connections to a port the sandbox's service listens on (on its "
    .. "127.0.0.1), without any network interface: it works at egress none. The URL carries a secret: open it as it "
    .. "is (it sets a cookie and redirects); requests without it get 403. Closed when the sandbox goes.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id", "port" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      port = { type = "integer", minimum = 1, maximum = 65535, description = "The port in the sandbox (1-65535)." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "port", "url", "previews" }),
    properties = {
      sandbox_id = { type = "string" },
      port = { type = "integer" },
      url = { type = "string", description = "the preview's URL with its secret" },
      previews = schemas.previews,
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.expose(ctx, args)
    return r, ("preview of port %d of %s: %s"):format(r.port, r.sandbox_id, r.url)
  end,
}
