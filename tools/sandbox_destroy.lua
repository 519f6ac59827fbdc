-- sandbox_destroy: remove a persistent sandbox (its output folder stays).
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")

return schemas.sandbox_state_tool({
  name = "sandbox_destroy",
  title = "Destroy a persistent sandbox",
  destructive = true,
  description = "Removes a sandbox made by sandbox_create and every process in it. Its output folder is kept; a "
    .. "sandbox made with repository hands its branch back first. "
    .. "Idempotent: destroying a sandbox that is already gone succeeds and says so.",
  statuses = { "destroyed", "already gone" },
  properties = { output_dir = { type = "string" }, branch = repo.SCHEMA },
  call = sandbox.destroy,
  text = function(r) return r.branch and repo.text(r.branch) end,
})
