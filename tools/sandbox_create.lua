-- sandbox_create: a persistent sandbox for several sandbox_exec calls.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_create",
  title = "Create a persistent sandbox",
  description = "Creates a container that stays up for sandbox_exec, sandbox_upload and sandbox_download "
    .. "until sandbox_destroy or its TTL (renewed by each exec). Inputs are mounted read-only at /in; "
    .. "/out is a host folder kept after the sandbox goes. Network access is decided by its egress policy.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    properties = {
      image = schemas.image,
      snapshot = { type = "string", minLength = 1, description = "Start from this snapshot (sandbox_snapshot's "
        .. "snapshot_id) instead of an image: its /workspace and files, isolated no weaker than its source." },
      files = schemas.files(),
      directories = schemas.directories(),
      env = schemas.env,
      egress = schemas.egress,
      limits = schemas.limits,
      isolation = schemas.isolation,
      ttl_seconds = { type = "integer", minimum = 60, description = "Seconds the sandbox lives without use. Default 48 h." },
      mcp = schemas.mcp,
      budget_usd = schemas.budget_usd,
      tree = schemas.tree,
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "output_dir", "expires_at" }),
    properties = {
      sandbox_id = { type = "string" },
      output_dir = { type = "string" },
      expires_at = { type = "string", description = "UTC, RFC 3339" },
      image = { type = "string" },
      snapshot = { type = "string", description = "the snapshot it started from" },
      isolation = { type = "string" },
      mcp = { type = "object", description = "with mcp: true, the in-sandbox endpoint: url (inside the sandbox) and "
        .. "the bearer token its commands find in $DEMESNE_MCP_TOKEN" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.create(ctx, args)
    return r, ("sandbox_id: %s\noutput_dir: %s\nexpires_at: %s"):format(r.sandbox_id, r.output_dir, r.expires_at)
  end,
}
