-- sandbox_download: copy a file or folder out of a sandbox into its output folder.
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_download",
  title = "Download from a sandbox",
  description = "Copies a file or folder from a sandbox made by sandbox_create into <output_dir>/downloads/<basename> "
    .. "on the host. Archive entries with absolute paths, '..' or links leading outside are refused.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    required = { "sandbox_id", "src" },
    properties = {
      sandbox_id = schemas.sandbox_id,
      src = { type = "string", minLength = 1, description = "Absolute path of a file or folder in the sandbox." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "src", "path", "files", "bytes" }),
    properties = {
      sandbox_id = { type = "string" }, src = { type = "string" },
      path = { type = "string", description = "host path written" },
      files = { type = "integer" }, bytes = { type = "integer" },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.download(ctx, args)
    return r, ("downloaded: %s -> %s (%d files, %d bytes)"):format(r.src, r.path, r.files, r.bytes)
  end,
}
