-- sandbox_destroy: remove a persistent sandbox (its output folder stays).
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_destroy",
  title = "Destroy a persistent sandbox",
  description = "Removes a sandbox made by sandbox_create and every process in it. Its output folder is kept; a "
    .. "sandbox made with repository hands its branch back first. "
    .. "Idempotent: destroying a sandbox that is already gone succeeds and says so.",
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
      status = { type = "string", enum = { "destroyed", "already gone" } },
      output_dir = { type = "string" },
      branch = repo.SCHEMA,
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = true, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.destroy(ctx, args)
    local text = ("%s: %s"):format(r.status, r.sandbox_id)
    if r.branch then text = text .. "\n" .. repo.text(r.branch) end
    return r, text
  end,
}
