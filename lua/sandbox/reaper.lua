-- The reaper: removes expired sandboxes and what a server that is gone left behind
-- (containers, run folders, claims, temporary files), from the engine's state and the
-- state folder.
local async = require("demesne.async")
local config = require("demesne.config")
local egress = require("demesne.egress")
local engines = require("demesne.engines")
local fs = require("core.fs")
local json = require("demesne.json")
local layer = require("demesne.layer")
local log = require("demesne.log")
local loop = require("core.loop")
local paths = require("demesne.paths")
local process = require("core.process")
local files = require("demesne.sandbox.files")
local kept = require("demesne.sandbox.keep")
local owner = require("demesne.sandbox.owner")
local persistent = require("demesne.sandbox.persistent")
local preview = require("demesne.sandbox.preview")
local snapshot = require("demesne.sandbox.snapshot")
local spec = require("demesne.sandbox.spec")

local reaper = {}

local owner_alive = owner.owner_alive
local expiry_file, expiry_of = persistent.expiry_file, persistent.expiry_of
local LABEL, claim_path = spec.LABEL, spec.claim_path

-- A background job's container is left to lua/jobs/ while its record says running
-- (the record's path is in the job_record label; labels cannot be changed from inside).
local function job_running(labels)
  local p = labels[LABEL .. "job_record"]
  if type(p) ~= "string" or not p:match("/jobs/job%-[%w%-]+%.json$") then return false end
  local text, _, code = fs.read_file(p, 0, 1024 * 1024)
  if not text then return code ~= "ENOENT" end -- cannot tell (EMFILE…): keep the container
  local rec = json.decode(text)
  return type(rec) == "table" and rec.status == "running"
end

-- Removes a tree a sandbox could once write (a run folder), never following a link in it.
-- The one place such a removal happens in the reaper: switch it to core.fs's fd-relative
-- tree removal when that lands.
local function remove_leftover(path)
  return files.remove_tree(path)
end

-- A run folder older than this with no claim file (made before claims existed) and no
-- container is taken for a leftover: longer than a one-shot may run.
local function unclaimed_age() return config.get("timeout_max") + 3600 end

local TMP_AGE = 24 * 3600 -- seconds: state_dir/tmp files (build contexts, transfers) older than this are leftovers

-- What a server killed at the wrong moment (SIGKILL) leaves in the state folder: run
-- folders (exec records, proxy sockets, transfer staging) whose sandbox has no container,
-- their expiry and claim files, and old temporary files. A run folder is kept while a
-- container on this engine names it, a running job record names it, this process runs
-- its proxy, or the server that made it is alive (it cleans up itself); a folder claimed
-- for another engine is never touched. `containers` is the engine's list of demesne
-- containers (all states). Returns the number of run folders removed.
local function reap_leftovers(eng, containers)
  local state = config.get("state_dir")
  local keep = {}
  for _, c in ipairs(containers) do
    local l = c.labels or {}
    if l[LABEL .. "run_id"] then keep[l[LABEL .. "run_id"]] = true end
    local rd = tostring(l[LABEL .. "run_dir"] or "")
    if rd:match("/run/([^/]+)$") then keep[rd:match("/run/([^/]+)$")] = true end
  end
  -- whatever cannot be read (EMFILE…) stops the pass: a folder is removed only on what is known
  local job_names, _, jcode = fs.readdir(state .. "/jobs")
  if not job_names and jcode ~= "ENOENT" then return 0 end
  for _, name in ipairs(job_names or {}) do
    if name:match("^job%-[%w%-]+%.json$") then
      local text, _, rcode = fs.read_file(state .. "/jobs/" .. name, 0, 1024 * 1024)
      if not text and rcode ~= "ENOENT" then return 0 end
      local rec = json.decode(text or "")
      if type(rec) == "table" and rec.status == "running" and type(rec.run_dir) == "string" then
        local id = rec.run_dir:match("/run/([^/]+)$")
        if id then keep[id] = true end
      end
    end
  end
  local now = loop.time()
  local n = 0
  for _, id in ipairs(fs.readdir(state .. "/run") or {}) do
    local path = state .. "/run/" .. id
    local st = fs.lstat(path)
    if st and id:match("^[%w%-]+$") and not keep[id] and not egress.get(id) then
      local text, _, ccode = fs.read_file(claim_path(id), 0, 4096)
      local claim = json.decode(text or "")
      local leftover
      if type(claim) == "table" then
        leftover = claim.engine == eng.socket and not owner_alive(claim.owner)
      elseif not text and ccode == "ENOENT" then
        local etext, _, ecode = fs.read_file(expiry_file(path), 0, 64)
        local expires = tonumber(etext or "") or 0
        leftover = (etext or ecode == "ENOENT") and now - (st.mtime or now) > unclaimed_age() and expires < now
      end
      if leftover then
        local ok, err = remove_leftover(path)
        if ok then
          n = n + 1
          os.remove(expiry_file(path))
          os.remove(claim_path(id))
          log.info("demesne.reaper", "removed the leftover run folder %s (no container, job or live server claims it)", id)
        else
          log.warning("demesne.reaper", "cannot remove the run folder %s: %s", id, tostring(err))
        end
      end
    end
  end
  -- expiry and claim files whose run folder is gone (a claim is written after its folder)
  for _, sub in ipairs({ "expiry", "claims" }) do
    for _, id in ipairs(fs.readdir(state .. "/" .. sub) or {}) do
      if id:match("^[%w%-]+$") and not keep[id] and not fs.lstat(state .. "/run/" .. id) then
        fs.unlink(state .. "/" .. sub .. "/" .. id)
      end
    end
  end
  -- [pool] a warm sandbox's marker whose run folder and container are gone (the run folder
  -- removed just above, or by a server killed while it discarded that sandbox: lua/pool.lua
  -- removes container, run folder, then the output folder and the marker): its output
  -- folder is empty and no one's; the marker is made after the run folder and removed
  -- before a call takes the sandbox, so it names no one's work
  for _, id in ipairs(fs.readdir(state .. "/pool") or {}) do
    local st = fs.lstat(state .. "/pool/" .. id)
    if id:match("^[%w%-]+$") and st and st.type == "file" and not keep[id] and not fs.lstat(state .. "/run/" .. id) then
      remove_leftover(config.get("output_root") .. "/" .. id)
      os.remove(state .. "/pool/" .. id)
      log.info("demesne.reaper", "removed the unused output folder of warm sandbox %s", id)
    end
  end
  -- a repository run's folder (lua/repo) whose run folder is gone, an hour on (it is made
  -- before its run folder): a run that ended without its own cleanup (a crash) left it
  for _, id in ipairs(fs.readdir(state .. "/repo") or {}) do
    local st = fs.lstat(state .. "/repo/" .. id)
    if id:match("^[%w%-]+$") and not keep[id] and not fs.lstat(state .. "/run/" .. id) and st
      and now - (st.mtime or now) > 3600 then
      remove_leftover(state .. "/repo/" .. id)
    end
  end
  for _, name in ipairs(fs.readdir(state .. "/tmp") or {}) do
    local st = fs.lstat(state .. "/tmp/" .. name)
    if st and now - (st.mtime or now) > TMP_AGE then remove_leftover(state .. "/tmp/" .. name) end
  end
  return n
end

--- One reaper pass: removes containers past their expiry and one-shot containers whose
--- owner process is gone, but never a background job's container while its job record
--- says running; then what a killed server left in the state folder (run folders without
--- a container, their expiry and claim files, old temporary files). Works from the
--- engine's state. Kept workspaces past their expiry go too (keep.sweep). With opts.watch
--- (`demesne serve`), the running persistent sandboxes of this configuration that no quota
--- watch follows get one (persistent.watch). Returns the number of containers removed.
---@param opts {watch: boolean|nil}|nil
---@return integer
function reaper.reap(opts)
  -- kept workspaces past workspace_keep_seconds (lua/sandbox/keep.lua): no engine needed
  local kok, kerr = pcall(kept.sweep)
  if not kok then log.warning("demesne.reaper", "kept workspaces: %s", tostring(kerr)) end
  local eng = engines.get()
  if not eng then return 0 end
  local list = eng:list({ LABEL .. "managed=1" })
  if not list then return 0 end
  local now = loop.time()
  local n = 0
  for _, c in ipairs(list) do
    local l = c.labels or {}
    local kind = l[LABEL .. "kind"]
    local expired = expiry_of(l) < now
    local orphan = (kind == "oneshot" or kind == "job") and not owner_alive(l[LABEL .. "owner"])
    local sid, srd = l[LABEL .. "run_id"], l[LABEL .. "run_dir"]
    if opts and opts.watch and kind == "persistent" and not expired and c.state == "running" and type(sid) == "string"
      and not persistent.watched(sid) and srd and paths.within(srd, config.get("state_dir") .. "/run")
      and l[LABEL .. "output_dir"] then
      -- a running sandbox of this configuration that no server watches (this one restarted)
      persistent.watch(eng, c.id, sid, l[LABEL .. "output_dir"], srd)
    end
    if (expired or orphan) and not (kind == "job" and job_running(l)) then
      if eng:remove(c.id) then
        n = n + 1
        if l[LABEL .. "run_id"] then
          egress.stop(l[LABEL .. "run_id"])
          if kind == "persistent" then persistent.unwatch(l[LABEL .. "run_id"], l[LABEL .. "run_dir"]) end
          preview.close(l[LABEL .. "run_id"])
          layer.run("sandbox_removed", { run_id = l[LABEL .. "run_id"] }, expired and "expired" or "its server is gone")
        end
        local rd = l[LABEL .. "run_dir"]
        if rd and paths.within(rd, config.get("state_dir") .. "/run") then
          files.remove_tree(rd)
          os.remove(expiry_file(rd))
          os.remove(claim_path(rd:match("([^/]+)$")))
          -- [pool] a warm sandbox no call claimed: its output folder holds nothing of anyone's
          local rid, od = l[LABEL .. "run_id"], l[LABEL .. "output_dir"]
          local mark = l[LABEL .. "pool"] and type(rid) == "string" and rid:match("^[%w%-]+$")
            and (config.get("state_dir") .. "/pool/" .. rid)
          if mark and fs.lstat(mark) then
            if od and paths.within(od, config.get("output_root")) then files.remove_tree(od) end
            os.remove(mark)
          end
        end
        log.info("demesne.reaper", "removed %s (%s)", l[LABEL .. "run_id"] or c.id, expired and "expired" or "owner gone")
      end
    end
  end
  snapshot.prune(eng) -- retention: snapshot_keep_seconds, snapshot_max_count
  -- the list again: what was just removed no longer claims its folder
  local now_list = eng:list({ LABEL .. "managed=1" })
  if now_list then reap_leftovers(eng, now_list) end
  return n
end

-- [exit reaper] the pipe whose other end is the exit reaper's stdin: held open as long as
-- this process lives (the kernel closes it however the process ends, SIGKILL included)
local exit = {} -- {proc = core.process, pipe = core.stream} once started

-- [exit reaper] the wait before each of its passes, in ms: they run 0, 3 and 15 s after the end
reaper.EXIT_PASSES = { 0, 3000, 12000 }

--- Starts this server's exit reaper (`demesne serve` calls it once): this binary again, as
--- `demesne reap --after-exit OWNER`, in a session of its own, so that a client that ends
--- the server by signalling its process group (Codex: SIGTERM to the group, and SIGKILL to
--- the server at once) does not reach it. Its stdin is a pipe only this process holds; once
--- that closes (the server has ended, however) it waits for the owner process to be gone and
--- runs one reaper pass (reaper.reap): the warm sandboxes and the one-shots of a server killed
--- before its own clean-up go at once (and what its last requests to the engine still make,
--- seconds later), not when the next server starts. Its stdout and
--- stderr are /dev/null (it must not hold the client's pipes open); it logs to
--- `<state_dir>/exit-reaper.log`. Idempotent. Returns true, or nil and why it could not start
--- (the server then runs without it; the next server's reaper still cleans up).
---@return boolean|nil ok, string|nil err
function reaper.start_exit_reaper()
  if exit.proc then return true end
  local exe, xerr = loop.exepath()
  if not exe then return nil, xerr end
  local proc, pipes = process.spawn({ file = exe, args = { "reap", "--after-exit", owner.owner() }, detached = true,
    stdin = true }, function() exit.proc = nil end)
  if not proc then return nil, pipes end
  exit.proc, exit.pipe = proc, pipes.stdin
  return true
end

--- Inside a task: waits until the stream `input` (the exit reaper's stdin; nil: no stream
--- to wait for) ends, then until the server process `owner_label` names is gone
--- (owner.owner_alive; polled from every 50 ms up to every second, for as long as it takes),
--- then runs reaper passes, each bounded by `ms`, after the waits `passes` lists (default
--- reaper.EXIT_PASSES: at once, and 3 s and 15 s after the end; what a request sent just
--- before the end makes appears in the engine later). Returns the number of containers
--- removed, or nil, message, code when the first pass failed ("ETIMEDOUT" when it ran out
--- of time).
---@param input table|nil  a core.stream (stdin)
---@param owner_label string  host/pid/start time, as owner.owner() gives it
---@param ms integer  each pass's deadline in milliseconds
---@param passes integer[]|nil  milliseconds to wait before each pass
---@return integer|nil removed, string|nil err, string|nil code
function reaper.after_exit(input, owner_label, ms, passes)
  if input then
    async.await(function(cb)
      local ok = input:read_start(function(data) if not data then cb() end end)
      if not ok then cb() end -- not readable: the owner check below decides alone
      return function() input:read_stop() end
    end)
  end
  local poll = 50
  while owner_alive(owner_label) do
    async.sleep(poll)
    poll = math.min(poll * 2, 1000)
  end
  -- a request the server had sent just before it ended (a create, a start) still completes
  -- in the engine: later passes find what it made
  local total = 0
  for i, delay in ipairs(passes or reaper.EXIT_PASSES) do
    if delay > 0 then async.sleep(delay) end
    local n, err, code = async.timeout(ms, reaper.reap)
    if not n then
      if i == 1 then return nil, err, code end
      log.warning("demesne.reaper", "a later pass: %s", tostring(err))
    else
      total = total + n
    end
  end
  return total
end

return reaper
