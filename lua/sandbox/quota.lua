-- The output quota: how much disk a run's output folder (/out) may take (output_max_bytes,
-- output_max_entries) and how much free space its filesystem keeps (output_min_free_bytes,
-- output_min_free_percent). A host-side watcher, the one mechanism that works on every
-- engine (rootful and rootless Podman, Docker with or without userns-remap, gVisor): a
-- bounded walk of the output folder off the loop (core.fs.dir:usage: allocated blocks,
-- hard links once, no link followed, no FIFO opened), plus fstatvfs of it, repeated while
-- the sandbox runs; past either limit the sandbox is stopped and its result says
-- "output quota exceeded". A tree node's children write into <its out>/child/<name>, so
-- the root's walk counts the whole tree: no node gets more than the root's quota. A
-- research child's folder of its own (outside the root's until it is handed over) is
-- included in the root's walk while it runs (quota.include).
--
-- The overshoot is bounded by what the sandbox writes between two measurements plus the
-- engine's kill: the interval shrinks as the folder nears its limit (from
-- output_quota_interval_ms down to MIN_INTERVAL_MS), from the growth rate the watcher saw;
-- it starts at MIN_INTERVAL_MS and doubles while the folder does not grow. Between walks the
-- free space of the folder's filesystem is read every MIN_INTERVAL_MS (fstatvfs, on the
-- loop): a drop of half the room left starts the next walk at once. A walk is not repeated
-- sooner than ten times its own duration (a huge folder costs a tenth of a worker).
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local log = require("demesne.log")
local loop = require("core.loop")

local quota = {}

local LOGGER = "demesne.sandbox"

--- The reason a run stopped by its quota ends with (result.reason, a job's reason).
quota.REASON = "output quota exceeded"

--- The shortest time between two measurements (ms), as a folder nears its limit.
quota.MIN_INTERVAL_MS = 10

local function num(x) return ("%.0f"):format(x) end

-- watched output folder -> {[folder] = true}: folders elsewhere that count against its quota
local included = {}

--- Counts the folder `path` (outside `output_dir`) against the quota of `output_dir`'s
--- watch, as if it were inside it: a tree's research child writes a folder of its own
--- under the output root while it runs (lua/tree), which is its root's until it is handed
--- over. Idempotent; quota.exclude undoes it.
---@param output_dir string  a watched output folder (a tree's root)
---@param path string        another folder, measured confined like the watched one
function quota.include(output_dir, path)
  included[output_dir] = included[output_dir] or {}
  included[output_dir][path] = true
end

--- Undoes quota.include (the folder was handed over into output_dir, or is gone).
---@param output_dir string
---@param path string
function quota.exclude(output_dir, path)
  local set = included[output_dir]
  if not set then return end
  set[path] = nil
  if next(set) == nil then included[output_dir] = nil end
end

-- Adds the folders included in `output_dir`'s quota to its measurement `u` (in place),
-- each walk bounded by what is left of `max_bytes` (nil: not bounded) and of `max_entries`.
local function measure_included(output_dir, u, max_bytes, max_entries)
  for path in pairs(included[output_dir] or {}) do
    if u.limit or (max_bytes and u.bytes >= max_bytes) then return end
    local d = fs.opendir(path)
    if d then
      local x = quota.measure(d, { stop_bytes = max_bytes and math.floor(max_bytes - u.bytes) or nil,
        max_entries = math.max(max_entries - u.entries, 1) })
      d:close()
      if x then
        u.bytes, u.entries, u.unreadable = u.bytes + x.bytes, u.entries + x.entries, u.unreadable + x.unreadable
        if x.limit then u.limit, u.where = x.limit, x.where end
      end
    end
  end
end

--- The free-space reserve (bytes) on a filesystem of `total_bytes`: the larger of
--- output_min_free_bytes and output_min_free_percent of it.
---@param total_bytes integer
---@return integer
function quota.reserve(total_bytes)
  local pct = config.get("output_min_free_percent")
  return math.max(math.floor(config.get("output_min_free_bytes")), math.floor(total_bytes * pct / 100))
end

--- Measures the folder `dir` (a core.fs.dir) off the loop, awaiting the walk in the
--- current task. opts as core.fs.dir:usage (stop_bytes, max_entries, max_depth). Returns
--- {bytes, entries, unreadable, limit?, where?}, or nil, message, code.
---@param dir userdata
---@param opts table|nil
---@return table|nil usage, string|nil err, string|nil code
function quota.measure(dir, opts)
  return async.await(function(cb)
    local w, err, code = dir:usage(opts or {}, cb)
    if not w then
      cb(nil, err, code)
      return nil
    end
    return function() w:cancel() end
  end)
end

-- Why a measurement is over a limit (a sentence), or nil. `u` from measure, `v` from statvfs.
local function over(u, v, lim)
  if u.limit == "bytes" or u.bytes > lim.max_bytes then
    return ("the output folder takes more than output_max_bytes (%s bytes)"):format(num(lim.max_bytes))
  end
  if u.limit == "entries" then
    return ("the output folder holds more than output_max_entries (%s) files and folders"):format(num(lim.max_entries))
  end
  if u.limit == "depth" then
    return ("the output folder is more than 256 folders deep (%s), too deep to measure"):format(tostring(u.where))
  end
  if u.unreadable > 0 then
    return ("the output folder holds a folder the host cannot open (%s), so it cannot be measured")
      :format(tostring(u.where))
  end
  if v and v.avail_bytes < lim.reserve then
    return ("the filesystem of output_root has %s bytes free, below the reserve of %s bytes "
      .. "(output_min_free_bytes / output_min_free_percent)"):format(num(v.avail_bytes), num(lim.reserve))
  end
  return nil
end

--- Refuses to start a sandbox when the filesystem of output_root has less free space than
--- the reserve (raises a demesne error naming output_min_free_bytes, code "ENOSPC").
---@param root string|nil  default: output_root (made when missing)
function quota.check_reserve(root)
  root = root or config.get("output_root")
  errors.check(fs.mkdir_p(root, 493)) -- 0755
  local d <close> = errors.check(fs.opendir(root))
  local v = errors.check(d:statvfs())
  local reserve = quota.reserve(v.total_bytes)
  if v.avail_bytes < reserve then
    errors.raise(("output quota exceeded: the filesystem of output_root (%s) has %s bytes free, below the reserve "
      .. "of %s bytes kept free (output_min_free_bytes = %s, output_min_free_percent = %s); free some space or "
      .. "lower them"):format(root, num(v.avail_bytes), num(reserve), num(config.get("output_min_free_bytes")),
      tostring(config.get("output_min_free_percent"))), "ENOSPC")
  end
end

---@class QuotaWatch
---@field task Task
---@field exceeded table|nil  {reason, detail, output_bytes, output_max_bytes} once over
---@field stop fun()
---@field settle fun(): table|nil

--- Watches the output folder of a running sandbox. `on_exceeded(info)` is called once, in
--- the watcher's task, when the folder goes over a limit (it must stop the sandbox); then
--- the folder is measured in full and info.output_bytes updated. info: {reason =
--- quota.REASON, detail = sentence, output_bytes, output_max_bytes}. Returns a
--- QuotaWatch: stop() ends the watch; settle() waits for a watch that found the folder
--- over its limit to finish (then returns info), or ends it and returns nil.
---@param output_dir string
---@param name string              for logs (a run id)
---@param on_exceeded fun(info: table)
---@return QuotaWatch
function quota.watch(output_dir, name, on_exceeded)
  local w = {}
  local lim = { max_bytes = config.get("output_max_bytes"), max_entries = math.floor(config.get("output_max_entries")) }
  local interval = math.max(math.floor(config.get("output_quota_interval_ms")), quota.MIN_INTERVAL_MS)
  w.task = async.spawn("quota " .. tostring(name), function()
    local dir, derr = fs.opendir(output_dir)
    if not dir then
      log.warning(LOGGER, "%s: output quota not watched: %s", tostring(name), tostring(derr))
      return
    end
    local _d <close> = dir
    local rate = 0 -- bytes per ms, the fastest growth seen lately
    local last_bytes, last_t
    local delay = quota.MIN_INTERVAL_MS -- doubles up to `interval` while nothing grows
    while true do
      local v = dir:statvfs()
      lim.reserve = v and quota.reserve(v.total_bytes) or 0
      local t0 = loop.hrtime()
      local u, err = quota.measure(dir, { stop_bytes = math.floor(lim.max_bytes), max_entries = lim.max_entries })
      if u then measure_included(output_dir, u, lim.max_bytes, lim.max_entries) end
      local walk_ms = (loop.hrtime() - t0) / 1e6
      if not u then
        log.warning(LOGGER, "%s: output quota: %s", tostring(name), tostring(err))
      else
        local why = over(u, v, lim)
        if why then
          w.exceeded = { reason = quota.REASON, detail = why, output_bytes = u.bytes, output_max_bytes = lim.max_bytes }
          log.warning(LOGGER, "%s: %s: %s; stopping the sandbox", tostring(name), quota.REASON, why)
          local tk = loop.hrtime()
          local ok, e = pcall(on_exceeded, w.exceeded)
          log.info(LOGGER, "%s: the engine stopped the sandbox in %d ms (%d bytes seen, %d ms after the last look)",
            tostring(name), (loop.hrtime() - tk) // 1000000, u.bytes, delay)
          if not ok then log.warning(LOGGER, "%s: stopping the sandbox: %s", tostring(name), tostring(e)) end
          local full = quota.measure(dir, { max_entries = lim.max_entries })
          if full then
            measure_included(output_dir, full, nil, lim.max_entries)
            w.exceeded.output_bytes = full.bytes
          end
          return
        end
        local t = loop.now()
        if last_t and t > last_t then
          local r = (u.bytes - last_bytes) / (t - last_t)
          rate = math.max(r, rate * 0.5) -- a burst is remembered for a few rounds
        end
        last_bytes, last_t = u.bytes, t
        local room = lim.max_bytes - u.bytes
        if v then room = math.min(room, v.avail_bytes - lim.reserve) end
        -- next look once a quarter of the room may have been written at the rate seen; a
        -- folder that does not grow is looked at less and less often, up to `interval`
        if rate > 0 then delay = math.min(interval, math.max(quota.MIN_INTERVAL_MS, math.floor(room / rate / 4)))
        else delay = math.min(interval, delay * 2) end
        -- the next walk after `delay`, or sooner once the filesystem's free space has dropped
        -- by half the room (one fstatvfs per MIN_INTERVAL_MS on the loop: a burst is seen
        -- within that, however long the delay); a big folder's walk is not repeated more
        -- than one part in ten of the time
        local now = loop.now()
        local not_before, until_t = now + math.floor(walk_ms * 10), now + math.max(delay, math.floor(walk_ms * 10))
        local avail0 = v and v.avail_bytes
        repeat
          async.sleep(quota.MIN_INTERVAL_MS)
          local v2 = avail0 and dir:statvfs()
          if v2 and loop.now() >= not_before
            and (avail0 - v2.avail_bytes >= room / 2 or v2.avail_bytes < lim.reserve) then break end
        until loop.now() >= until_t
      end
      if not u then async.sleep(interval) end
    end
  end)
  function w.stop()
    if not w.task.done then async.cancel(w.task, "the sandbox has ended") end
  end
  function w.settle()
    if w.exceeded and not w.task.done then w.task:wait() end
    w.stop()
    return w.exceeded
  end
  return w
end

return quota
