-- Snapshots as the engine holds them: images labelled as demesne's, found, listed and
-- restored. What makes them (sandbox_snapshot, sandbox_fork) is lua/sandbox/snapshot.lua;
-- lua/sandbox/persistent.lua starts a sandbox from one through this file.
--
-- A snapshot is the image demesne/snapshot:<snapshot id> with the labels
--   io.demesne.snapshot_id, .snapshot_name, .snapshot_source (the sandbox it was taken of),
--   .snapshot_created (epoch seconds), .snapshot_by ("host" or the tree run that took it),
--   .snapshot_state (the state folder of the server that took it), .snapshot_isolation
--   (the source's isolation: a sandbox from it gets no weaker) and .snapshot_image (the
--   source's image name).
-- Its /workspace is the tar /.demesne-snapshot/workspace.tar inside the image (a sandbox's
-- /workspace is a tmpfs or a host folder, which no commit holds), unpacked into the new
-- sandbox's /workspace when it starts.
local config = require("demesne.config")
local errors = require("demesne.errors")
local json = require("demesne.json")
local util = require("demesne.util")
local spec = require("demesne.sandbox.spec")

local snapshots = {}

local fail = errors.raise
local LABEL = spec.LABEL

--- The image repository of every snapshot.
snapshots.REPO = "demesne/snapshot"
--- Where a snapshot's /workspace lies inside its image.
snapshots.WORKSPACE_TAR = "/.demesne-snapshot/workspace.tar"
--- The label every snapshot image carries (its id).
snapshots.ID_LABEL = LABEL .. "snapshot_id"

--- The image reference of snapshot `id`.
---@param id string
---@return string
function snapshots.ref(id) return snapshots.REPO .. ":" .. id end

--- Fails unless the engine adapter declares capability snapshots.
---@param eng table
---@param field string  the tool's field to name
function snapshots.require_capability(eng, field)
  if not (eng.capabilities or {}).snapshots then
    fail(("%s: this engine adapter cannot take snapshots (capability snapshots is false)"):format(field), "ENOTSUP")
  end
end

--- Whether the caller (ctx.caller from inside a tree, none on the host) may see a snapshot
--- with these labels: the host sees every snapshot of its state folder, a sandbox those its
--- own subtree took.
---@param ctx table|nil
---@param labels table<string, string>
---@return boolean
function snapshots.visible(ctx, labels)
  if labels[LABEL .. "snapshot_state"] ~= config.get("state_dir") then return false end
  local caller = type(ctx) == "table" and ctx.caller or nil
  if not caller then return true end
  local by = labels[LABEL .. "snapshot_by"]
  return by == caller.run_id or (by ~= nil and by ~= "host" and caller.sees_run(by) == true)
end

-- The neutral view of one snapshot image.
local function view(img)
  local l = img.labels or {}
  local created = tonumber(l[LABEL .. "snapshot_created"]) or img.created or 0
  local keep = config.get("snapshot_keep_seconds")
  return {
    snapshot_id = l[snapshots.ID_LABEL],
    name = l[LABEL .. "snapshot_name"] ~= "" and l[LABEL .. "snapshot_name"] or nil,
    source_sandbox_id = l[LABEL .. "snapshot_source"],
    isolation = l[LABEL .. "snapshot_isolation"] or "container",
    image = l[LABEL .. "snapshot_image"],
    created_at = util.iso(created),
    expires_at = util.iso(created + keep),
    created = created,
    size_bytes = img.size_bytes,
    ref = snapshots.ref(l[snapshots.ID_LABEL]),
    image_id = img.id,
    by = l[LABEL .. "snapshot_by"],
  }
end

--- The snapshots the caller sees, newest first: {snapshot_id, name, source_sandbox_id,
--- isolation, image, created_at, expires_at, created (epoch s), size_bytes, ref, image_id}.
---@param eng table
---@param ctx table|nil
---@return table[]
function snapshots.list(eng, ctx)
  -- (one filter: Podman 4.3 matches no image for a key-only label filter beside a key=value one)
  local imgs = errors.check(eng:image_list({ LABEL .. "snapshot_state=" .. config.get("state_dir") }))
  local out = {}
  for _, img in ipairs(imgs) do
    if snapshots.visible(ctx, img.labels or {}) and (img.labels or {})[snapshots.ID_LABEL] then out[#out + 1] = view(img) end
  end
  table.sort(out, function(a, b)
    if a.created ~= b.created then return a.created > b.created end
    return a.snapshot_id > b.snapshot_id
  end)
  return out
end

--- Checks a snapshot id's form (field names the parameter).
---@param field string
---@param id any
function snapshots.check_id(field, id)
  if type(id) ~= "string" or not id:match("^snap%-[%w%-]+$") or #id > 80 then
    fail(("%s: %q is not a snapshot id (snap-…, as sandbox_snapshot returns)"):format(field, tostring(id)))
  end
end

--- The snapshot `id` as the caller sees it (snapshots.list's shape), or a failure naming
--- `field`: unknown, removed, or not in the caller's scope (the same answer for both).
---@param eng table
---@param ctx table|nil
---@param id string
---@param field string
---@return table
function snapshots.find(eng, ctx, id, field)
  snapshots.check_id(field, id)
  snapshots.require_capability(eng, field)
  local imgs = errors.check(eng:image_list({ snapshots.ID_LABEL .. "=" .. id }))
  for _, img in ipairs(imgs) do
    if snapshots.visible(ctx, img.labels or {}) then return view(img) end
  end
  fail(("%s: no snapshot %s (it was deleted, expired, or was never taken here)"):format(field, id), "ENOENT")
end

--- Unpacks a snapshot's /workspace into the started container `id` (a sandbox made from
--- the snapshot's image), as the container's own user, with the image's tar. Returns true,
--- or nil and why.
---@param eng table
---@param id string  the container
---@return boolean|nil ok, string|nil err
function snapshots.restore(eng, id)
  local code, err = eng:exec(id, { "/bin/sh", "-c", '[ ! -f "$1" ] || exec tar -x --no-same-owner -f "$1" -C /workspace',
    "sh", snapshots.WORKSPACE_TAR }, { env = json.array(), timeout_ms = spec.deadline_ms(600) })
  if code == 0 then return true end
  return nil, code and ("unpacking its /workspace exited %d"):format(code) or tostring(err)
end

return snapshots
