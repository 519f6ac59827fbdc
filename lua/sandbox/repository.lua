-- A host repository in a persistent sandbox (sandbox_create with `repository`): the clone is
-- made by an exec once the sandbox runs; its branch comes back when the sandbox is destroyed
-- and on demand (sandbox_exec with `hand_back`), each time through an exec of run.sh
-- --handback and lua/repo's hand_back. The run's repository plan lives under the state
-- folder (repo.save / repo.load), out of the sandbox's reach.
local devcontainer = require("demesne.images.devcontainer")
local errors = require("demesne.errors")
local log = require("demesne.log")
local repo = require("demesne.repo")
local exec = require("demesne.sandbox.exec")
local persistent = require("demesne.sandbox.persistent")

local repository = {}

local SETUP = "/bin/sh " .. repo.MOUNT .. "/run.sh --setup"
local HANDBACK = "/bin/sh " .. repo.MOUNT .. "/run.sh --handback"

--- sandbox_create: creates the sandbox (persistent.create, which plans the repository when
--- args.repository is set), then clones the repository in it, then runs the create
--- commands of its devcontainer (image "devcontainer", lua/images/devcontainer.lua). A
--- clone or a create command that fails removes the sandbox and fails the call. Returns
--- persistent.create's result, with `repository` = {branch, path, base, host_head, notes}
--- when there is one.
---@param ctx table
---@param args table  sandbox_create's arguments
---@return table
function repository.create(ctx, args)
  local r = persistent.create(ctx, args)
  local g = repo.load(r.sandbox_id)
  local steps = devcontainer.pending(r.sandbox_id)
  if g then
    local ok, res = pcall(exec.exec, ctx, { sandbox_id = r.sandbox_id, command = SETUP, timeout_seconds = 600 })
    if not ok or res.exit_code ~= 0 then
      pcall(persistent.destroy, ctx, { sandbox_id = r.sandbox_id })
      repo.forget(r.sandbox_id)
      errors.raise(("repository: the clone could not be made in the sandbox: %s"):format(ok and (res.stderr or "")
        or errors.message(res)))
    end
    r.repository = { branch = g.branch, path = g.path, base = g.base, host_head = g.host_head, notes = g.notes }
  end
  if steps then
    local ok, res = pcall(exec.exec, ctx, { sandbox_id = r.sandbox_id, command = steps, timeout_seconds = 600 })
    if not ok or res.exit_code ~= 0 then
      pcall(persistent.destroy, ctx, { sandbox_id = r.sandbox_id })
      if g then repo.forget(r.sandbox_id) end
      errors.raise(("image: devcontainer: the create commands failed in the sandbox, which was removed: %s"):format(
        ok and (res.stderr or "") or errors.message(res)))
    end
  end
  return r
end

--- Hands a running persistent sandbox's branch back to the host (run.sh --handback, then
--- repo.hand_back). Returns the branch result, or nil when the sandbox has no repository.
---@param ctx table
---@param sandbox_id string
---@return table|nil branch
function repository.hand_back(ctx, sandbox_id)
  local g = repo.load(sandbox_id)
  if not g then return nil end
  local ok, res = pcall(exec.exec, ctx, { sandbox_id = sandbox_id, command = HANDBACK, timeout_seconds = 600 })
  if not ok or res.exit_code ~= 0 then
    return { branch = g.branch, base = g.base, host_head = g.host_head, repository = g.host,
      notes = g.notes or {}, error = "the sandbox could not make the bundle: "
        .. (ok and tostring(res.stderr) or errors.message(res)) }
  end
  local o = { repo = g, output_dir = res.output_dir, run_id = sandbox_id }
  local b = repo.hand_back(o)
  if b.head and not b.error then repo.save(o) end -- g.expect is the new head: the next one fast-forwards
  return b
end

--- sandbox_exec: runs the command, then (hand_back = true) hands the branch back; the
--- result gets `branch`.
---@param ctx table
---@param args table  sandbox_exec's arguments
---@return table
function repository.exec(ctx, args)
  local r = exec.exec(ctx, args)
  if args.hand_back then
    local b = repository.hand_back(ctx, args.sandbox_id)
    if not b then errors.raise("hand_back: sandbox " .. tostring(args.sandbox_id) .. " was not created with a repository") end
    r.branch = b
  end
  return r
end

--- sandbox_destroy: a sandbox with a repository hands its branch back first (when it still
--- runs), then goes; its repository folder goes with it. The result gets `branch`.
---@param ctx table
---@param args table  sandbox_id
---@return table
function repository.destroy(ctx, args)
  local b
  if repo.load(args.sandbox_id) then
    local hok, res = pcall(repository.hand_back, ctx, args.sandbox_id)
    if hok then b = res else log.warning("demesne.sandbox", "hand back %s: %s", args.sandbox_id, errors.message(res)) end
  end
  local r = persistent.destroy(ctx, args)
  repo.forget(args.sandbox_id)
  r.branch = b
  return r
end

return repository
