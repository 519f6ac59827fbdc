-- Kept workspaces: what an agent run leaves for a later `continue` (lua/agent/continue.lua)
-- to pick up, kept on the host for workspace_keep_seconds after the run, bounded in size
-- (workspace_keep_max_mb) and count (workspace_keep_max_count), removed by the reaper
-- (keep.sweep, from reaper.reap) once expired.
--
-- Layout, all under <state_dir>/kept (0700, never mounted into a sandbox itself):
--   <id>/workspace   mounted rw at /workspace of a root run (and of the runs continuing it)
--   <id>/home        mounted rw at /root (HOME) of the run: the CLI's session state
--                    (~/.claude/projects/…, ~/.codex/sessions/…)
--   <id>.json        the keep's record (host-only): {id, created_at, latest, runs, busy,
--                    busy_owner, busy_since, expires_at, size_bytes, gone, gone_at}
--   runs/<run>.json  one record per run that used a keep: {run_id, keep, …} (the fields
--                    the agent layer stores; opaque here)
--   claims/<id>      made with mkdir while a run uses the keep: the lock that lets only one
--                    run at a time continue it (holds owner: the server's owner label)
-- A keep's id is the id of the first run that made it; the runs continuing it use the same
-- folders. Everything in workspace/ and home/ was written by a sandbox: the host never reads
-- a file there, never follows a link there (the size walk lstats, the removal is
-- fd-relative: files.remove_in), and only mounts the two folders back.
local config = require("demesne.config")
local files = require("demesne.sandbox.files")
local fs = require("core.fs")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local owner = require("demesne.sandbox.owner")
local async = require("demesne.async")

local keep = {}

local LOGGER = "demesne.keep"
local RECORD_MAX = 256 * 1024
--- The most entries the size walk visits in one keep; a keep with more is too large to keep.
keep.WALK_MAX = 200000

--- Whether `id` can name a run or a keep: letters, digits and inner hyphens, at most 64 bytes.
---@param id any
---@return boolean
function keep.valid_id(id) return type(id) == "string" and #id <= 64 and id:match("^[%w][%w%-]*$") ~= nil end
local valid_id = keep.valid_id

--- The folder of all keeps: <state_dir>/kept.
---@return string
function keep.dir() return config.get("state_dir") .. "/kept" end

local function base()
  local b = keep.dir()
  assert(fs.mkdir_p(b, 448))
  assert(fs.mkdir_p(b .. "/runs", 448))
  assert(fs.mkdir_p(b .. "/claims", 448))
  return b
end

local function read_json(path)
  local text = fs.read_file(path, 0, RECORD_MAX)
  if not text then return nil end
  local ok, v = pcall(json.decode, text)
  if ok and type(v) == "table" then return v end
  return nil
end

local function write_json(path, v)
  local ok, err = fs.write_atomic(path, json.encode(v) .. "\n", 384)
  if not ok then error(("cannot write %s: %s"):format(path, tostring(err)), 0) end
end

--- The record of keep `id`, or nil when there is none.
---@param id string
---@return table|nil
function keep.get(id)
  if not valid_id(id) then return nil end
  local r = read_json(keep.dir() .. "/" .. id .. ".json")
  if r and r.id == id then return r end
  return nil
end

--- Writes a keep's record.
---@param rec table  {id, …}
function keep.save(rec)
  assert(valid_id(rec.id), "keep id")
  base()
  write_json(keep.dir() .. "/" .. rec.id .. ".json", rec)
end

--- The record of run `run_id` (keep.save_run), or nil.
---@param run_id string
---@return table|nil
function keep.run(run_id)
  if not valid_id(run_id) then return nil end
  local r = read_json(keep.dir() .. "/runs/" .. run_id .. ".json")
  if r and r.run_id == run_id and valid_id(r.keep) then return r end
  return nil
end

--- Writes a run's record: {run_id, keep, …}.
---@param r table
function keep.save_run(r)
  assert(valid_id(r.run_id) and valid_id(r.keep), "run record ids")
  base()
  write_json(keep.dir() .. "/runs/" .. r.run_id .. ".json", r)
end

--- The host folders of keep `id`: {dir, workspace, home}.
---@param id string
---@return {dir: string, workspace: string, home: string}
function keep.paths(id)
  local d = keep.dir() .. "/" .. id
  return { dir = d, workspace = d .. "/workspace", home = d .. "/home" }
end

-- Takes the claim of keep `id` for run `run_id`: nil, the run holding it when it is held.
local function claim(id, run_id)
  local b = base()
  local d <close> = assert(fs.opendir(b .. "/claims"))
  local ok, err, code = d:mkdir(id, 448)
  if not ok then
    if code == "EEXIST" then
      local held = read_json(b .. "/claims/" .. id .. "/owner")
      return nil, type(held) == "table" and held.run_id or "another run"
    end
    error(("cannot claim the kept workspace %s: %s"):format(id, tostring(err)), 0)
  end
  write_json(b .. "/claims/" .. id .. "/owner", { run_id = run_id, owner = owner.owner(), since = loop.time() })
  return true
end

local function unclaim(id)
  -- a folder the host made with one small file: synchronous removal is fine
  if valid_id(id) then fs.remove_tree(keep.dir() .. "/claims/" .. id) end
end

--- Makes a new keep for run `run_id` (its id is the run's): the folder with workspace/ and
--- home/ (0777 as the tmpfs they replace: whatever user the image runs as writes them) and
--- the record, claimed by the run. Errors (a string) when the folders cannot be made.
---@param run_id string
---@return table rec  the keep's record
function keep.new(run_id)
  assert(valid_id(run_id), "run id")
  local b = base()
  local d <close> = assert(fs.opendir(b))
  local ok, err = d:mkdir(run_id, 448)
  if not ok then error(("cannot make the kept workspace of %s: %s"):format(run_id, tostring(err)), 0) end
  local k <close> = assert(d:opendir(run_id))
  for _, sub in ipairs({ "workspace", "home" }) do
    assert(k:mkdir(sub, 511))
    assert(k:chmod(sub, 511))
  end
  assert(claim(run_id, run_id))
  local rec = { id = run_id, created_at = loop.time(), runs = json.array({ run_id }), busy = run_id,
    busy_owner = owner.owner(), busy_since = loop.time() }
  keep.save(rec)
  return rec
end

--- Claims keep `id` for run `run_id` (a continue): nil and why when it is gone or another
--- run holds it. The claim is the lock: two continues of one keep never run at once.
---@param id string
---@param run_id string
---@return table|nil rec, string|nil why
function keep.claim(id, run_id)
  local rec = keep.get(id)
  if not rec then return nil, "unknown" end
  if rec.gone then return nil, "gone" end
  local ok, held = claim(id, run_id)
  if not ok then return nil, "busy", held end
  rec = keep.get(id) -- again, under the claim
  if not rec or rec.gone then
    unclaim(id)
    return nil, "gone"
  end
  rec.busy, rec.busy_owner, rec.busy_since = run_id, owner.owner(), loop.time()
  rec.runs = rec.runs or json.array()
  rec.runs[#rec.runs + 1] = run_id
  keep.save(rec)
  return rec
end

--- The bytes under the host folder `path` (regular files' sizes), walked without following
--- a link (lstat; a folder is entered only when lstat says it is one). Meant for a tree no
--- container writes any more. nil and why past `max_entries` entries (default
--- keep.WALK_MAX). Inside a task it yields now and then.
---@param path string
---@param max_entries integer|nil
---@return integer|nil bytes, string|nil err
function keep.size(path, max_entries)
  max_entries = max_entries or keep.WALK_MAX
  local total, seen = 0, 0
  local stack = { path }
  local in_task = async.current() ~= nil
  while #stack > 0 do
    local p = table.remove(stack)
    for _, name in ipairs(fs.readdir(p) or {}) do
      seen = seen + 1
      if seen > max_entries then return nil, ("more than %d files"):format(max_entries) end
      if in_task and seen % 2000 == 0 then async.sleep(0) end
      local st = fs.lstat(p .. "/" .. name)
      if st then
        if st.type == "directory" then stack[#stack + 1] = p .. "/" .. name
        elseif st.type == "file" then total = total + (st.size or 0) end
      end
    end
  end
  return total
end

-- Removes a keep's folders (off the loop inside a task) and marks its record gone.
local function remove(rec, why)
  local d = fs.opendir(keep.dir())
  if d then
    files.remove_in(d, rec.id)
    d:close()
  end
  rec.gone, rec.gone_at, rec.busy = why, loop.time(), nil
  keep.save(rec)
  log.info(LOGGER, "%s: kept workspace removed (%s)", rec.id, why)
end

--- Removes keep `id` now, marking its record gone with `why` (its runs can no longer be
--- continued; a continue says why).
---@param id string
---@param why string
function keep.remove(id, why)
  local rec = keep.get(id)
  if rec and not rec.gone then remove(rec, why) end
  unclaim(id)
end

--- Ends run `run_id`'s use of keep `id`. With `finished` (the run ended and its session can
--- be continued) the keep's latest run becomes `run_id` and it expires workspace_keep_seconds
--- from now; the keep is then measured and removed when larger than workspace_keep_max_mb,
--- and the oldest keeps go past workspace_keep_max_count. Without it (the run failed before
--- it started) a keep the run made goes at once and a continued keep stays as it was.
--- Returns the record, or nil when there is none.
---@param id string
---@param run_id string
---@param finished boolean
---@return table|nil
function keep.release(id, run_id, finished)
  local rec = keep.get(id)
  if not rec then
    unclaim(id)
    return nil
  end
  if rec.busy == run_id then rec.busy, rec.busy_owner, rec.busy_since = nil, nil, nil end
  local keep_s = tonumber(config.get("workspace_keep_seconds")) or 0
  if rec.gone then
    keep.save(rec)
  elseif not finished then
    if rec.latest == nil then
      remove(rec, "its first run did not start")
    else
      local runs = json.array()
      for _, r in ipairs(rec.runs or {}) do if r ~= run_id then runs[#runs + 1] = r end end
      rec.runs = runs
      keep.save(rec)
    end
  elseif keep_s <= 0 then
    rec.latest = run_id
    remove(rec, "workspace_keep_seconds is 0: nothing is kept")
  else
    rec.latest, rec.expires_at = run_id, loop.time() + keep_s
    local max_mb = tonumber(config.get("workspace_keep_max_mb")) or 0
    local size, serr = keep.size(keep.paths(id).dir)
    rec.size_bytes = size
    if not size then
      remove(rec, ("too large to keep (%s)"):format(serr))
    elseif size > max_mb * 1024 * 1024 then
      remove(rec, ("too large to keep: %d MB, more than workspace_keep_max_mb (%g)"):format(
        math.ceil(size / 1048576), max_mb))
    else
      keep.save(rec)
    end
  end
  unclaim(id)
  if not rec.gone then keep.enforce_count() end
  return rec
end

-- The records of every keep.
local function all()
  local out = {}
  for _, name in ipairs(fs.readdir(keep.dir()) or {}) do
    local id = name:match("^(.+)%.json$")
    local rec = id and keep.get(id)
    if rec then out[#out + 1] = rec end
  end
  return out
end

-- Whether a claim is held by a run that still goes: its server alive, and not older than
-- the longest a run may last (a job re-attached by another server keeps its claim that long).
local function claim_live(id)
  local held = read_json(keep.dir() .. "/claims/" .. id .. "/owner")
  if type(held) ~= "table" then return fs.lstat(keep.dir() .. "/claims/" .. id) ~= nil end
  if owner.owner_alive(held.owner) then return true end
  local since = tonumber(held.since) or 0
  return loop.time() - since < (tonumber(config.get("timeout_max")) or 3600) + 3600
end

--- Removes the kept workspaces of ended runs (not in use) past workspace_keep_max_count,
--- those expiring soonest first. Returns how many went.
---@return integer
function keep.enforce_count()
  local max = math.floor(tonumber(config.get("workspace_keep_max_count")) or 0)
  local live = {}
  for _, rec in ipairs(all()) do
    if not rec.gone and rec.expires_at and not rec.busy then live[#live + 1] = rec end
  end
  if #live <= max then return 0 end
  table.sort(live, function(a, b) return a.expires_at < b.expires_at end)
  local n = 0
  for _, rec in ipairs(live) do
    if #live - n <= max then break end
    remove(rec, ("removed to keep at most %d kept workspaces (workspace_keep_max_count)"):format(max))
    n = n + 1
  end
  return n
end

--- The reaper's pass: removes kept workspaces past their expiry (not while a run uses
--- them), frees claims whose run is gone (its server dead and past the longest run), and
--- prunes the records of keeps gone more than jobs_keep_seconds ago with their run records.
--- Returns the number of kept workspaces removed.
---@return integer
function keep.sweep()
  local now = loop.time()
  local n = 0
  local gone = {}
  for _, rec in ipairs(all()) do
    if rec.busy and not claim_live(rec.id) then
      log.warning(LOGGER, "%s: the run %s that used it is gone; freeing it", rec.id, tostring(rec.busy))
      local runs = json.array()
      for _, r in ipairs(rec.runs or {}) do if r ~= rec.busy then runs[#runs + 1] = r end end
      rec.runs, rec.busy = runs, nil
      unclaim(rec.id)
      if rec.latest == nil and not rec.gone then
        remove(rec, "its first run did not finish")
        n = n + 1
      else
        keep.save(rec)
      end
    end
    if not rec.gone and not rec.busy and rec.expires_at and rec.expires_at < now then
      remove(rec, "expired")
      n = n + 1
    end
    if rec.gone and (rec.gone_at or 0) + (tonumber(config.get("jobs_keep_seconds")) or 0) < now then
      gone[rec.id] = true
      fs.unlink(keep.dir() .. "/" .. rec.id .. ".json")
    end
  end
  if next(gone) then
    for _, name in ipairs(fs.readdir(keep.dir() .. "/runs") or {}) do
      local id = name:match("^(.+)%.json$")
      local r = id and keep.run(id)
      if r and gone[r.keep] then fs.unlink(keep.dir() .. "/runs/" .. name) end
    end
  end
  n = n + keep.enforce_count()
  return n
end

return keep
