-- sandbox_upload: copy a host file or folder into a persistent sandbox.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local paths = require("demesne.paths")
local json = require("demesne.json")

return {
  name = "sandbox_upload",
  title = "Upload into a sandbox",
  description = "Copies a host file or folder (inside the allowed paths) into a sandbox made by sandbox_create, "
    .. "at the absolute path dst. The parent folder of dst must exist (e.g. /out, /tmp, /workspace).",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id", "src", "dst" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      src = { type = "string", minLength = 1, description = "Host file or folder. " .. paths.describe_roots() },
      dst = { type = "string", minLength = 1, description = "Absolute destination path in the sandbox." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "src", "dst", "files", "bytes" }),
    properties = {
      sandbox_id = { type = "string" }, src = { type = "string" }, dst = { type = "string" },
      files = { type = "integer" }, bytes = { type = "integer" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = true, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.upload(ctx, args)
    return r, ("uploaded: %s -> %s (%d files, %d bytes)"):format(r.src, r.dst, r.files, r.bytes)
  end,
}
