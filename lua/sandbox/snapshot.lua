-- Snapshots, forks and pause of persistent sandboxes (sandbox_snapshot, sandbox_snapshots,
-- sandbox_snapshot_delete, sandbox_fork, sandbox_pause, sandbox_resume). The images and
-- their labels are lua/sandbox/snapshots.lua's.
--
-- What a snapshot holds (docs/reference/tools/sandbox_snapshot.md): /workspace (a tar made
-- inside the sandbox by its own tar, bounded by snapshot_max_bytes, kept in the image at
-- snapshots.WORKSPACE_TAR), and, when the sandbox's root filesystem is writable
-- (readonly_rootfs = false), the root filesystem's changes (the engine's commit). Not /out
-- (the host's), /in, /tmp, /var/tmp, /root, /run (tmpfs), nor any process.
--
-- A read-only root cannot take the tar, so the image is made from a helper container: one
-- created (never started) from the sandbox's own image, given the tar through the engine's
-- archive API and committed. The tar the sandbox wrote in its run folder is moved out of
-- its reach (renameat2 on held folders) and checked to be a regular file before the host
-- hands it to the engine, wrapped in a tar of the host's own making; the host never
-- unpacks it: the new sandbox does, with its own tar, as its own user.
local archive = require("core.archive")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local util = require("demesne.util")
local persistent = require("demesne.sandbox.persistent")
local snapshots = require("demesne.sandbox.snapshots")
local spec = require("demesne.sandbox.spec")
local transfer = require("demesne.sandbox.transfer")

local snapshot = {}

local fail, check = errors.raise, errors.check
local LABEL = spec.LABEL
local closer = util.closer

-- The labels every sandbox's spec sets (lua/sandbox/spec.lua): a commit of a sandbox keeps
-- the others it had (a pool's, a job's), which are blanked so that no sandbox from the
-- snapshot inherits them.
local BASE = {}
for k in ("managed run_id tool kind owner expires_at created_at output_dir run_dir image egress memory_mb "
  .. "egress_unrestricted isolation rootfs from_snapshot"):gmatch("%S+") do BASE[LABEL .. k] = true end

--- Checks a snapshot name: a valid tag component of an image reference (letters, digits,
--- '_', '.', '-', starting with a letter, digit or '_', at most 128 characters).
---@param name any
function snapshot.check_name(name)
  if name == nil then return end
  if type(name) ~= "string" or #name > 128 or not name:match("^[%w_][%w_%.%-]*$") then
    fail(("name: %q is not a valid image reference component (letters, digits, '_', '.' and '-', starting with a "
      .. "letter, digit or '_', at most 128 characters)"):format(tostring(name)))
  end
end

-- The persistent sandbox to snapshot, running, not paused, in scope (the tools check the
-- scope of a call from inside a tree before this).
local function source(eng, sandbox_id)
  local sb = persistent.lookup(eng, sandbox_id)
  if not sb.running then fail(("sandbox_id: sandbox %s is not running"):format(sandbox_id)) end
  persistent.check_not_paused(sb, sandbox_id)
  return sb
end

-- The labels of the snapshot image.
local function labels_of(ctx, id, name, sb)
  local caller = type(ctx) == "table" and ctx.caller or nil
  return {
    [snapshots.ID_LABEL] = id,
    [LABEL .. "snapshot_name"] = name or "",
    [LABEL .. "snapshot_source"] = sb.labels[LABEL .. "run_id"],
    [LABEL .. "snapshot_created"] = tostring(math.floor(loop.time())),
    [LABEL .. "snapshot_by"] = caller and caller.run_id or "host",
    [LABEL .. "snapshot_state"] = config.get("state_dir"),
    [LABEL .. "snapshot_isolation"] = sb.labels[LABEL .. "isolation"] or "container",
    [LABEL .. "snapshot_image"] = sb.labels[LABEL .. "image"] or "",
  }
end

-- Runs sh `script` with args in the sandbox through demesne-init (as the container's user);
-- returns exit code, stderr text, status.
local function sh(eng, sb, script, ...)
  return transfer.run_quiet(eng, sb, { "/bin/sh", "-c", script, "sh", ... })
end

local TAR = 'ulimit -f "$1" && cd /workspace && exec tar -c -f "$2" .'

-- The failure of the tar of /workspace: too large, or the transfer failure's message.
local function tar_failed(eng, sb, code, msg, st, cap)
  if code == 128 + 25 or tostring(msg):find("File too large", 1, true) then
    fail(("sandbox_id: the snapshot of sandbox %s would hold more than snapshot_max_bytes (%s bytes: /workspace as a "
      .. "tar%s); remove files from /workspace or raise DEMESNE_SNAPSHOT_MAX_BYTES"):format(
      sb.labels[LABEL .. "run_id"], spec.num(config.get("snapshot_max_bytes")),
      cap < config.get("snapshot_max_bytes") and " plus the root filesystem's changes" or ""), "E2BIG")
  end
  transfer.transfer_failure(eng, sb, "packing /workspace for the snapshot", code, msg, st)
end

-- A writable root: the sandbox's own tar puts /workspace into its root filesystem, the
-- engine commits the sandbox, and the tar goes again.
local function take_writable(eng, sb, id, labels, cap)
  local dir = snapshots.WORKSPACE_TAR:match("^(.*)/")
  local _rm <close> = closer(function() sh(eng, sb, 'rm -rf "$1"', dir) end)
  local code, msg, st = sh(eng, sb, 'mkdir -p "$3" && ' .. TAR, tostring(cap // 512 + 1), snapshots.WORKSPACE_TAR, dir)
  if code ~= 0 then tar_failed(eng, sb, code, msg, st, cap) end
  -- (no second size check: the tar is bounded by cap = snapshot_max_bytes less the root's
  -- changes measured before it, and an inspect right after an exec ends is the path that
  -- deadlocks Podman 4.3, lua/sandbox/spec.lua state_of)
  for k in pairs(sb.labels) do
    if k:sub(1, #LABEL) == LABEL and not BASE[k] and labels[k] == nil then labels[k] = "" end
  end
  labels[LABEL .. "snapshot_created"] = tostring(math.floor(loop.time())) -- retention counts from the commit
  -- a commit keeps the container's environment: its endpoint's token is no image's
  return check(eng:commit(sb.id, { repo = snapshots.REPO, tag = id, labels = labels,
    clear_env = { "DEMESNE_MCP_TOKEN", "DEMESNE_MCP_URL" } }))
end

-- <state_dir>/snapshots, held: where the host keeps a snapshot's tar while it makes the image.
local function private_dir()
  local dir = config.get("state_dir") .. "/snapshots"
  check(fs.mkdir_p(dir, 448)) -- 0700
  return check(fs.opendir(dir)), dir
end

-- A read-only root: the tar is written in the run folder, moved out of the sandbox's reach
-- and put into a helper container of the sandbox's image, which is committed.
local function take_read_only(eng, sb, id, labels, cap)
  local xfer, name, sandbox_tar, guard = transfer.xfer_dir(sb)
  local _x <close> = guard
  local code, msg, st = sh(eng, sb, TAR, tostring(cap // 512 + 1), sandbox_tar)
  if code ~= 0 then tar_failed(eng, sb, code, msg, st, cap) end
  local priv, privpath = private_dir()
  local _p <close> = priv
  -- (only the host writes there: the moved tar, a regular file, and the host's own tar)
  local _w <close> = closer(function()
    fs.remove_tree(privpath .. "/" .. id)
    os.remove(privpath .. "/" .. id .. ".tar")
  end)
  check(priv:mkdir(id, 448))
  local d = check(priv:opendir(id))
  local _d <close> = d
  check(d:mkdir(".demesne-snapshot", 493))
  local inner = check(d:opendir(".demesne-snapshot"))
  local _i <close> = inner
  check(xfer:rename(name, inner, "workspace.tar", true))
  local tst = inner:stat("workspace.tar")
  if not tst or tst.type ~= "file" then
    fail("sandbox_id: the snapshot's tar of /workspace, written in the sandbox, is not a regular file; refused")
  end
  if (tst.size or 0) > cap + 512 * 1024 then tar_failed(eng, sb, 128 + 25, "File too large", nil, cap) end
  local out <close>, oerr, ocode = priv:open(id .. ".tar", "wx", 384) -- 0600
  if not out then fail("sandbox_snapshot: " .. tostring(oerr), ocode) end
  check(transfer.await_work(function(cb)
    return archive.pack_to(out, { { src = privpath .. "/" .. id .. "/.demesne-snapshot", name = ".demesne-snapshot" } },
      { max_bytes = cap + 512 * 1024, max_entries = 4 }, cb)
  end))
  out:close()
  -- the helper: the sandbox's image, labelled so that the reaper removes it if this server dies now
  local now = math.floor(loop.time())
  local hid = check(eng:create({ name = "demesne-" .. id, image = sb.image, entrypoint = { "/bin/true" },
    network = "none", read_only_rootfs = false,
    labels = { [LABEL .. "managed"] = "1", [LABEL .. "run_id"] = id, [LABEL .. "kind"] = "snapshot",
      [LABEL .. "created_at"] = tostring(now), [LABEL .. "expires_at"] = tostring(now + 3600) } }))
  local _h <close> = closer(function() eng:remove(hid) end)
  check(eng:put_archive(hid, "/", privpath .. "/" .. id .. ".tar"))
  labels[LABEL .. "snapshot_created"] = tostring(math.floor(loop.time())) -- retention counts from the commit
  return check(eng:commit(hid, { repo = snapshots.REPO, tag = id, labels = labels }))
end

--- Takes a snapshot of a persistent sandbox (sandbox_snapshot). Fails, naming the field,
--- for a sandbox that is gone, stopped or paused, a name that is no reference component,
--- an engine without snapshots, and a snapshot over snapshot_max_bytes (checked on the root
--- filesystem's changes before anything is made, and on /workspace while it is packed).
--- Nothing is left behind by a failure (no image, no helper container, no tar). The
--- oldest snapshots past snapshot_max_count go afterwards.
--- Returns {snapshot_id, name, source_sandbox_id, isolation, image, created_at, expires_at, size_bytes}.
---@param ctx table|nil
---@param args {sandbox_id: string, name: string|nil}
---@return table
function snapshot.take(ctx, args)
  local eng = spec.engine()
  snapshots.require_capability(eng, "sandbox_id")
  snapshot.check_name(args.name)
  local sb = source(eng, args.sandbox_id)
  local max = config.get("snapshot_max_bytes")
  local writable = sb.labels[LABEL .. "rootfs"] == "rw"
    or (sb.labels[LABEL .. "rootfs"] == nil and not config.get("readonly_rootfs"))
  local rw = writable and check(eng:size(sb.id)).rw_bytes or 0
  if rw >= max then
    fail(("sandbox_id: sandbox %s has %s bytes of root filesystem changes, over snapshot_max_bytes (%s)"):format(
      args.sandbox_id, spec.num(rw), spec.num(max)), "E2BIG")
  end
  local id = util.new_id("snap-", 4)
  local labels = labels_of(ctx, id, args.name, sb)
  local done = false
  local _undo <close> = closer(function()
    if not done then eng:image_remove(snapshots.ref(id)) end
  end)
  if writable then take_writable(eng, sb, id, labels, max - rw) else take_read_only(eng, sb, id, labels, max) end
  local found = snapshots.find(eng, ctx, id, "sandbox_id")
  done = true
  persistent.renew(sb)
  snapshot.prune(eng, id)
  log.info("demesne.sandbox", "snapshot %s of sandbox %s", id, args.sandbox_id)
  return {
    snapshot_id = id, name = found.name, source_sandbox_id = args.sandbox_id, isolation = found.isolation,
    image = found.image, created_at = found.created_at, expires_at = found.expires_at, size_bytes = found.size_bytes,
  }
end

--- The snapshots the caller sees (sandbox_snapshots), newest first.
---@param ctx table|nil
---@return {snapshots: table[]}
function snapshot.list(ctx)
  local eng = spec.engine()
  snapshots.require_capability(eng, "sandbox_snapshots")
  local out = json.array()
  for _, s in ipairs(snapshots.list(eng, ctx)) do
    out[#out + 1] = { snapshot_id = s.snapshot_id, name = s.name, source_sandbox_id = s.source_sandbox_id,
      isolation = s.isolation, image = s.image, created_at = s.created_at, expires_at = s.expires_at,
      size_bytes = s.size_bytes }
  end
  return { snapshots = out }
end

--- Deletes a snapshot (sandbox_snapshot_delete). Idempotent for one that is gone ("already
--- gone"); refused while a sandbox runs from it. Returns {snapshot_id, status}.
---@param ctx table|nil
---@param args {snapshot_id: string}
---@return table
function snapshot.delete(ctx, args)
  local eng = spec.engine()
  snapshots.check_id("snapshot_id", args.snapshot_id)
  local ok, s = pcall(snapshots.find, eng, ctx, args.snapshot_id, "snapshot_id")
  if not ok then
    if errors.is(s) and s.code == "ENOENT" then return { snapshot_id = args.snapshot_id, status = "already gone" } end
    error(s, 0)
  end
  local removed, how, code = eng:image_remove(s.ref)
  if not removed then
    if code == "ECONFLICT" then
      fail(("snapshot_id: sandboxes still run from snapshot %s; destroy them first (%s)"):format(args.snapshot_id,
        tostring(how)), "ECONFLICT")
    end
    fail(how, code)
  end
  return { snapshot_id = args.snapshot_id, status = how == "gone" and "already gone" or "deleted" }
end

--- Retention (the reaper and each new snapshot): removes this state folder's snapshots
--- older than snapshot_keep_seconds, and the oldest past snapshot_max_count; one a sandbox
--- still runs from stays until a later pass. Returns the number removed.
---@param eng table|nil
---@param spare string|nil  a snapshot id to keep (the one just taken)
---@return integer
function snapshot.prune(eng, spare)
  eng = eng or spec.engine()
  if not (eng.capabilities or {}).snapshots then return 0 end
  local ok, list = pcall(snapshots.list, eng, nil)
  if not ok then return 0 end
  local now, keep, cap = loop.time(), config.get("snapshot_keep_seconds"), config.get("snapshot_max_count")
  -- the spared one counts first, as the newest, wherever the list (ordered by the commit's
  -- second) puts it: two snapshots of one second are in either order
  local kept, n = 0, 0
  for _, s in ipairs(list) do
    if s.snapshot_id == spare then kept = kept + 1 end
  end
  for _, s in ipairs(list) do
    if s.snapshot_id ~= spare then
      local expired = s.created + keep < now
      if expired or kept >= cap then
        local removed = eng:image_remove(s.ref)
        if removed then
          n = n + 1
          log.info("demesne.reaper", "removed snapshot %s (%s)", s.snapshot_id,
            expired and "past snapshot_keep_seconds" or "past snapshot_max_count")
        else
          kept = kept + 1 -- a sandbox still runs from it: it stays, and counts
        end
      else
        kept = kept + 1
      end
    end
  end
  return n
end

--- Checks a fork count against fork_max_count.
---@param count any
function snapshot.check_count(count)
  local max = config.get("fork_max_count")
  count = math.tointeger(count)
  if not count or count < 1 then fail("count: must be a positive integer") end
  if count > max then
    fail(("count: %d is above the ceiling of %s set in the configuration (fork_max_count)"):format(count,
      spec.num(max)))
  end
end

--- Forks a persistent sandbox (sandbox_fork): one snapshot, then `count` sandboxes from it
--- (sandbox_create {snapshot}), each with its own /out. `create(i, call)` makes the i-th
--- (default persistent.create; from inside a tree the tree's spawn). On any failure the
--- sandboxes already made are destroyed and the snapshot deleted.
--- Returns {snapshot_id, source_sandbox_id, sandboxes = {{sandbox_id, output_dir, expires_at, image, isolation}}}.
---@param ctx table|nil
---@param args table  sandbox_id, count, name, ttl_seconds, egress, limits, env, isolation
---@param create fun(i: integer, call: table): table|nil
---@return table
function snapshot.fork(ctx, args, create)
  snapshot.check_count(args.count)
  local count = math.tointeger(args.count)
  local snap = snapshot.take(ctx, { sandbox_id = args.sandbox_id, name = args.name })
  local made = {}
  local done = false
  local _undo <close> = closer(function()
    if done then return end
    for _, r in ipairs(made) do pcall(persistent.destroy, ctx, { sandbox_id = r.sandbox_id }) end
    spec.engine():image_remove(snapshots.ref(snap.snapshot_id))
  end)
  local src = persistent.lookup(spec.engine(), args.sandbox_id)
  for i = 1, count do
    local call = { snapshot = snap.snapshot_id, ttl_seconds = args.ttl_seconds, limits = args.limits, env = args.env,
      egress = args.egress or src.labels[LABEL .. "egress"],
      -- the snapshot's floor, named: from inside a tree a child that names none gets its parent's
      isolation = args.isolation or (snap.isolation == "gvisor" and "gvisor" or nil) }
    local r = create and create(i, call) or persistent.create(ctx, call)
    made[#made + 1] = r
  end
  done = true
  local out = json.array()
  for _, r in ipairs(made) do
    out[#out + 1] = { sandbox_id = r.sandbox_id, output_dir = r.output_dir, expires_at = r.expires_at, image = r.image,
      isolation = r.isolation }
  end
  return { snapshot_id = snap.snapshot_id, source_sandbox_id = args.sandbox_id, sandboxes = out }
end

--- Pauses a persistent sandbox (sandbox_pause): every process in it is frozen by the
--- engine. Its TTL keeps running (a paused sandbox still holds its memory); commands,
--- transfers and snapshots are refused until sandbox_resume. Returns {sandbox_id, status}.
---@param ctx table|nil
---@param args {sandbox_id: string}
---@return table
function snapshot.pause(ctx, args)
  local eng = spec.engine()
  if not (eng.capabilities or {}).pause then
    fail("sandbox_id: this engine adapter cannot pause sandboxes (capability pause is false)", "ENOTSUP")
  end
  local sb = persistent.lookup(eng, args.sandbox_id)
  if not sb.running then fail(("sandbox_id: sandbox %s is not running"):format(args.sandbox_id)) end
  persistent.forget(args.sandbox_id)
  if sb.paused then return { sandbox_id = args.sandbox_id, status = "already paused",
    expires_at = util.iso(sb.expires_at) } end
  check(eng:pause(sb.id))
  persistent.forget(args.sandbox_id)
  return { sandbox_id = args.sandbox_id, status = "paused", expires_at = util.iso(sb.expires_at) }
end

--- Resumes a paused sandbox (sandbox_resume). Returns {sandbox_id, status}.
---@param ctx table|nil
---@param args {sandbox_id: string}
---@return table
function snapshot.resume(ctx, args)
  local eng = spec.engine()
  if not (eng.capabilities or {}).pause then
    fail("sandbox_id: this engine adapter cannot pause sandboxes (capability pause is false)", "ENOTSUP")
  end
  local sb = persistent.lookup(eng, args.sandbox_id)
  persistent.forget(args.sandbox_id)
  if not sb.paused then
    if not sb.running then fail(("sandbox_id: sandbox %s is not running"):format(args.sandbox_id)) end
    return { sandbox_id = args.sandbox_id, status = "not paused", expires_at = util.iso(sb.expires_at) }
  end
  check(eng:unpause(sb.id))
  persistent.renew(sb)
  return { sandbox_id = args.sandbox_id, status = "resumed", expires_at = util.iso(sb.expires_at) }
end

return snapshot
