-- The warm pool (DESIGN.md "Warm pool"): sandboxes that are created and started before a
-- call needs them, each waiting in `demesne-init wait` for the one command it will run.
--
-- A warm sandbox is made by the very code that makes a fresh one (sandbox.script_start);
-- under gVisor its PID 1 is `demesne-init serve`, as in a persistent sandbox:
-- its run id, output folder, run folder, egress proxy and relay socket exist from the
-- fill; only the command, its environment and its timeout come with the call, over the
-- control socket (lua/channel.lua), or under gVisor, which has no control socket, through
-- the engine's exec API (sandbox.script_send with an "exec" Delivery). So a claimed sandbox is what a fresh one
-- would be: a new filesystem, no earlier process (demesne-init and its relay only), its own
-- /out, the same isolation (gVisor, user namespace).
--
-- Kinds: sandboxes are pooled per kind = (image, egress policy, limits, read-only root,
-- demesne-init, engine, isolation): a call without host inputs claims one of exactly its kind, or
-- makes a fresh one. Calls with host inputs (files, directories), background jobs and
-- agent runs are never pooled. Each sandbox is used once and never reused.
--
-- Lifecycle: `demesne serve` starts the pool (pool.start), which fills the kinds of
-- `pool_images` (default egress and limits) when their images are built; a call of another
-- kind teaches the pool that kind. After a claim the kind refills in the background. Each
-- kind keeps `pool_size` warm sandboxes; a call that finds none ready raises its kind's
-- target by one (up to `pool_max` in all), and each minute without such a miss lowers it
-- again by one, so bursts of calls find more warm sandboxes than the base size. A
-- warm sandbox whose demesne-init goes away (killed, removed) is noticed at once through
-- its held control connection, discarded and replaced (a gVisor one, which has none, when
-- a call would take it: the engine is asked whether it runs). A kind unused for
-- `pool_idle_seconds` is emptied. pool.stop (at shutdown) removes every warm sandbox.
--
-- Crash safety: warm sandboxes carry the labels of a one-shot run (owner, expiry) plus
-- io.demesne.pool=<kind hash>, and <state_dir>/pool/<run id> marks one that no call has
-- claimed yet ("filling" while it starts, "ready" once a call can take it), so the reaper
-- removes them (with their empty output folders) once their server is gone.
local async = require("demesne.async")
local config = require("demesne.config")
local egress_policy = require("demesne.egress.policy")
local images = require("demesne.images")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local delivery = require("demesne.sandbox.delivery")
local plan = require("demesne.sandbox.plan")
local fs = require("core.fs")
local loop = require("core.loop")
local text = require("core.text")

local pool = {}

local LOGGER = "demesne.pool"
--- How long a warm sandbox waits before the pool replaces it (seconds).
local RECYCLE_AFTER = 23 * 3600
--- A warm sandbox's label lifetime (seconds): the reaper's safety net, long enough for a
--- command of the default timeout claimed just before the sandbox is recycled.
pool.TTL = RECYCLE_AFTER + 3600 + 600

local running = false
-- key -> kind {key, hash, image, image_ref, policy, limits, engine, ready = {entry}, filler,
-- last_used, target, misses}
local kinds = {}
local sweeper      -- the idle sweep task

local function now() return loop.time() end

--- The marker file of a warm sandbox (<state_dir>/pool/<run id>): the reaper removes the
--- output folder of a warm sandbox no call claimed only when it is there.
---@param run_id string
---@return string
local function marker(run_id) return config.get("state_dir") .. "/pool/" .. run_id end
pool.marker = marker

-- The kind of a plan whose image is resolved: everything that makes two sandboxes differ
-- before their command runs.
local function key_of(eng, image_ref, policy, lim, isolation)
  return table.concat({ tostring(eng.socket), image_ref, policy.name, sandbox.num(lim.memory_mb), sandbox.num(lim.cpus),
    sandbox.num(lim.pids), config.get("readonly_rootfs") and "ro" or "rw", tostring(config.init_path()), isolation },
    "|")
end

-- Whether a planned sandbox_script run may take a warm sandbox: a one-shot of the plain
-- shape (no host inputs, no agent extras, no job labels), under a policy that never asks (a
-- warm sandbox's proxy was started before anyone called: it would know no client to ask).
local function eligible(o)
  return o.kind == "oneshot" and o.tool == "sandbox_script" and o.delivery ~= nil
    and (o.delivery.mode == "control" or o.isolation == "gvisor")
    and not (o.egress and o.egress.asks)
    and #(o.mounts or {}) == 0
    and not o.argv and not o.extra_relay and not o.before_create and not o.labels and not o.tree
end

local function total()
  local n = 0
  for _, k in pairs(kinds) do n = n + #k.ready + (k.filler and 1 or 0) end
  return n
end

local function size() return math.floor(config.get("pool_size") or 0) end
local function max_total() return math.floor(config.get("pool_max") or 0) end
local function target(k) return math.max(k.target or 0, size()) end

-- Removes a warm sandbox that no call claimed: container, run folder, its (empty) output
-- folder and its marker; in a tracked task, so shutdown waits for it.
local function discard(entry, why)
  if entry.gone then return end
  entry.gone = true
  if entry.conn then entry.conn:watch(nil) end
  local o = entry.o
  log.debug(LOGGER, "discarding warm sandbox %s: %s", o.run_id, why or "")
  sandbox.script_teardown(o, function()
    sandbox.remove_tree(o.output_dir)
    os.remove(marker(o.run_id))
  end)
end

local refill

-- A warm sandbox whose demesne-init hung up (the container was killed or removed).
local function on_dead(k, entry, why)
  for i, e in ipairs(k.ready) do
    if e == entry then table.remove(k.ready, i) break end
  end
  if not entry.gone then
    log.info(LOGGER, "warm sandbox %s went away (%s); replacing it", entry.o.run_id, tostring(why))
  end
  discard(entry, why)
  refill(k)
end

-- Makes one warm sandbox of kind k, waiting on its control socket. Returns the entry.
local function fill_one(k)
  local run_id = sandbox.new_run_id()
  local output_dir, run_dir = sandbox.dirs(run_id)
  local o = plan.new({
    engine = k.engine, limits = k.limits, mounts = {}, egress = k.policy, run_id = run_id, output_dir = output_dir,
    run_dir = run_dir, kind = "oneshot", tool = "sandbox_script", ttl = pool.TTL, image_arg = k.image,
    name = "demesne-" .. run_id, exec_id = "main", background = true,
  })
  -- isolated as a fresh sandbox of the same call would be: the user namespace where the
  -- engine gives one (without it, Docker's userns-remap runs the sandbox as the host's root)
  local iso = sandbox.isolation(k.engine, k.isolation, k.policy.open == true)
  o.isolation, o.userns = iso.isolation, iso.userns
  -- under gVisor the host cannot connect to a socket made inside: the command comes through
  -- the engine's exec API instead of the control socket (lua/sandbox/delivery.lua)
  o.delivery = delivery.new(iso.isolation == "gvisor" and "exec" or "control")
  o.env = sandbox.env(nil, sandbox.default_env(run_id, k.policy))
  local entry = { o = o, policy = k.policy, born = now(), expires_at = math.floor(now()) + pool.TTL }
  -- the marker once the folders exist and before the container does: a crash from there on
  -- leaves a sandbox the reaper knows to be unused
  o.before_create = function()
    assert(fs.mkdir_p(config.get("state_dir") .. "/pool", 448)) -- 0700
    assert(fs.write_atomic(marker(run_id), "filling\n", 384))
  end
  local ok, err = pcall(sandbox.script_start, nil, o, { pool = k.hash })
  if not ok then
    discard(entry, "fill failed")
    error(err, 0)
  end
  entry.conn = o.delivery.conn -- nil under gVisor
  plan.launched(o) -- a call takes what it holds into its own plan (take): this one is only read
  -- demesne-init listens (or, under gVisor, the container runs): from now on a call can take it
  fs.write_atomic(marker(run_id), "ready\n", 384)
  return entry
end

local function err_text(e) return type(e) == "table" and tostring(e.message) or tostring(e) end

-- Starts kind k's filler unless it runs: it fills until the kind holds pool_size warm
-- sandboxes, one at a time, backing off after failures.
refill = function(k)
  if not running or k.filler or kinds[k.key] ~= k then return end
  if #k.ready >= target(k) then return end
  k.filler = async.spawn("pool fill " .. k.hash, function()
    local _ <close> = setmetatable({}, { __close = function() k.filler = nil end })
    -- not before the loop's next turn: the call that started it answers (or creates) first
    async.sleep(0)
    local backoff = 1000
    while running and kinds[k.key] == k and #k.ready < target(k) and total() <= max_total() do
      local ok, entry = pcall(fill_one, k)
      if not ok then
        if entry == async.CANCELLED then error(entry, 0) end
        log.warning(LOGGER, "cannot fill a warm %s sandbox (egress %s): %s; next try in %d s", k.image, k.policy.name,
          err_text(entry), backoff // 1000)
        async.sleep(backoff)
        backoff = math.min(backoff * 2, 60000)
      elseif not running or kinds[k.key] ~= k then
        discard(entry, "the pool stopped")
        return
      else
        backoff = 1000
        if entry.conn then entry.conn:watch(function(why) on_dead(k, entry, why) end) end
        k.ready[#k.ready + 1] = entry
        log.debug(LOGGER, "warm sandbox %s ready (%s, egress %s; %d of %d)", entry.o.run_id, k.image, k.policy.name,
          #k.ready, target(k))
      end
    end
  end)
end

-- Empties kind k and forgets it.
local function drain(k, why)
  if kinds[k.key] == k then kinds[k.key] = nil end
  if k.filler then async.cancel(k.filler, why) end
  local ready = k.ready
  k.ready = {}
  for _, e in ipairs(ready) do discard(e, why) end
end

-- The kind for (engine, image, policy, limits), made (and its filler started) when new.
-- Learning a kind beyond what pool_max allows drains the least recently used one.
local function kind_for(eng, image, image_ref, policy, lim, isolation)
  local key = key_of(eng, image_ref, policy, lim, isolation)
  local k = kinds[key]
  if k then return k end
  local cap = math.max(math.floor(max_total() / math.max(size(), 1)), 1)
  local n, oldest = 0, nil
  for _, x in pairs(kinds) do
    n = n + 1
    if not oldest or x.last_used < oldest.last_used then oldest = x end
  end
  if n >= cap and oldest then drain(oldest, "a more recently used kind of sandbox needs the room") end
  k = { key = key, hash = text.hash(key):sub(1, 12), engine = eng, image = image, image_ref = image_ref,
    policy = policy, limits = lim, isolation = isolation, ready = {}, last_used = now(), target = size(), misses = 0,
    learned = true }
  kinds[key] = k
  return k
end

-- Moves warm sandbox `entry` into plan o and hands it the command. Returns true, or false
-- (o as it was) when the sandbox no longer answers.
local function take(o, entry, img)
  local keep = {}
  local FIELDS = { "run_id", "name", "id", "output_dir", "run_dir", "egress_handle", "delivery", "image_ref",
    "image_name", "creating", "env" }
  for _, f in ipairs(FIELDS) do keep[f] = o[f] end
  local w = entry.o
  o.run_id, o.name, o.id, o.output_dir, o.run_dir = w.run_id, w.name, w.id, w.output_dir, w.run_dir
  -- the warm sandbox's Delivery ("control" with its connection, or "exec" under gVisor)
  o.egress_handle, o.delivery, o.image_ref, o.image_name, o.creating = w.egress_handle, w.delivery, img.ref, img.name, nil
  entry.gone = true -- the call owns it now: its teardown is the call's
  if entry.conn then entry.conn:watch(nil) end
  os.remove(marker(o.run_id))
  -- the label's expiry, set at the fill, must cover the command's whole timeout (as a fresh
  -- one-shot's does); a renewed expiry is written only when it would not (an fsync saved)
  local need = math.floor(now()) + o.timeout + 600
  if need > entry.expires_at then sandbox.write_expiry(o.run_dir, need) end
  local ok, err = pcall(sandbox.script_send, o)
  if ok then return true end
  if err == async.CANCELLED then error(err, 0) end -- o holds the sandbox: its teardown removes it
  log.info(LOGGER, "warm sandbox %s did not take its command (%s); trying another", o.run_id, err_text(err))
  local dead = { o = plan.new({ run_id = o.run_id, name = o.name, id = o.id, output_dir = o.output_dir,
    run_dir = o.run_dir, egress_handle = o.egress_handle, delivery = o.delivery, engine = o.engine }) }
  for _, f in ipairs(FIELDS) do o[f] = keep[f] end
  dead.gone = false
  discard(dead, "it did not take its command")
  return false
end

-- Whether a warm sandbox still waits for its command: its control connection is open, or
-- (under gVisor, without one) the engine says its container runs.
local function alive(entry)
  if entry.conn then return not entry.conn.closed end
  local info = sandbox.state_of(entry.o.engine, entry.o.run_id)
  return info ~= nil and info.state == "running"
end

--- Claims a warm sandbox for a planned sandbox_script run (sandbox.script_prepare with
--- o.control) and hands it the command: on true, `o` holds the sandbox (run id, folders,
--- container, proxy, connection) as script_start and script_send would have left it. False
--- when the plan may not be pooled or no warm sandbox of its kind is ready; the kind then
--- fills for the next call. Never fails for the pool's own reasons.
---@param ctx ToolContext|nil
---@param o table  the plan
---@return boolean claimed
function pool.claim(ctx, o)
  if not running or size() <= 0 or not eligible(o) then return false end
  local img = images.ensure(o.engine, o.image_arg, ctx)
  if not img then return false end -- script_start says why
  local k = kind_for(o.engine, o.image_arg or config.get("default_image"), img.ref, o.egress, o.limits, o.isolation)
  k.last_used = now()
  local claimed = false
  while #k.ready > 0 and not claimed do
    local entry = table.remove(k.ready, 1)
    if entry.policy == o.egress and alive(entry) and now() - entry.born < RECYCLE_AFTER then
      claimed = take(o, entry, img)
    else
      discard(entry, "stale")
    end
  end
  if k.learned then
    k.learned = nil -- its first call: no miss, the kind was unknown
  elseif not claimed then
    -- a miss: this kind is asked for faster than it holds warm sandboxes
    k.misses = k.misses + 1
    k.target = math.min(target(k) + 1, max_total())
  end
  if claimed and #k.ready > 0 then
    -- the kind refills once this call has answered, not while its command runs
    o.after_call = function() refill(k) end
  else
    refill(k) -- empty: the next call needs one as soon as possible
  end
  return claimed
end

-- Warms the kinds of pool_images (default egress and limits) whose images are built.
local function prewarm()
  local eng = sandbox.engine()
  local pol = assert(egress_policy.select(nil, false))
  local lim = sandbox.limits(nil)
  -- the isolation calls get by default (isolation_default), where the engine offers it
  local iok, iso = pcall(sandbox.isolation, eng, nil, pol.open == true)
  local isolation = iok and iso.isolation or "container"
  for _, name in ipairs(config.get("pool_images") or {}) do
    if name ~= "none" then
      local ref = images.BUILTIN[name] and images.status(eng, name) or (eng:image_inspect(name) and name)
      if ref then
        local k = kind_for(eng, name, ref, pol, lim, isolation)
        k.learned = nil
        refill(k)
      else
        log.info(LOGGER, "image %s is not built yet: its warm sandboxes fill after its first call", name)
      end
    end
  end
end

--- Starts the pool (`demesne serve`): sandbox.run_script claims from it from now on, the
--- kinds of pool_images fill, and kinds unused for pool_idle_seconds are emptied.
--- Nothing happens when pool_size is 0. Idempotent.
function pool.start()
  if running or size() <= 0 then return end
  running = true
  sandbox.use_pool(pool)
  sweeper = async.spawn("pool", function()
    local ok, err = pcall(prewarm)
    if not ok and err == async.CANCELLED then return end
    if not ok then log.warning(LOGGER, "warming the pool: %s", err_text(err)) end
    while running do
      local idle = config.get("pool_idle_seconds")
      async.sleep(math.floor(math.max(math.min(idle > 0 and idle / 4 or 60, 60), 1) * 1000))
      for _, k in pairs(kinds) do
        if idle > 0 and now() - k.last_used > idle then
          log.info(LOGGER, "no %s sandbox (egress %s) used for %d s: removing its warm sandboxes", k.image,
            k.policy.name, math.floor(now() - k.last_used))
          drain(k, "idle")
        else
          for i = #k.ready, 1, -1 do
            if now() - k.ready[i].born >= RECYCLE_AFTER then
              discard(table.remove(k.ready, i), "recycled")
              refill(k)
            end
          end
          -- a minute without a miss: one warm sandbox fewer, down to pool_size
          if k.misses == 0 and now() - (k.shrunk_at or 0) >= 60 and target(k) > size() then
            k.target, k.shrunk_at = target(k) - 1, now()
            if #k.ready > target(k) then discard(table.remove(k.ready), "fewer calls") end
          elseif k.misses > 0 then
            k.shrunk_at = now()
          end
          k.misses = 0
        end
      end
    end
  end)
end

--- Stops the pool: no more claims, fills are cancelled, every warm sandbox is removed (in
--- tracked teardown tasks: lua/teardown.lua). Inside a task it waits for the fills to end.
function pool.stop()
  if not running then return end
  running = false
  sandbox.use_pool(nil)
  if sweeper then async.cancel(sweeper, "shutdown") end
  local fillers = {}
  for _, k in pairs(kinds) do
    if k.filler then fillers[#fillers + 1] = k.filler end
    drain(k, "shutdown")
  end
  for _, t in ipairs(fillers) do
    if not t.done and async.current() then t:wait() end
  end
end

--- The pool as it is now: one row per kind {image, egress, memory_mb, cpus, pids, ready,
--- target (warm sandboxes it fills to), filling, idle_seconds}. For status views and tests.
---@return table[]
function pool.status()
  local out = {}
  for _, k in pairs(kinds) do
    out[#out + 1] = { image = k.image, egress = k.policy.name, memory_mb = k.limits.memory_mb, cpus = k.limits.cpus,
      pids = k.limits.pids, ready = #k.ready, target = target(k), filling = k.filler ~= nil,
      idle_seconds = math.floor(now() - k.last_used) }
  end
  table.sort(out, function(a, b) return a.image .. a.egress < b.image .. b.egress end)
  return out
end

--- The warm sandboxes an engine holds, whatever server made them (`demesne check-config`):
--- one row per container labelled io.demesne.pool {run_id, image, egress, owner, state,
--- created_at (Unix seconds), claimed (false while its server's marker says no call has
--- taken it), starting (its marker says the pool is still starting it)}, oldest first.
--- Inside a task. Returns the list, or nil, message, code.
---@param eng table  an engine adapter
---@return table[]|nil list, string|nil err, string|nil code
function pool.on_engine(eng)
  local list, err, code = eng:list({ "io.demesne.managed=1", "io.demesne.pool" })
  if not list then return nil, err, code end
  local out = {}
  for _, c in ipairs(list) do
    local l = c.labels or {}
    local state_dir, rid = tostring(l["io.demesne.run_dir"]):match("^(.*)/run/([%w%-]+)$")
    local mark = state_dir and fs.read_file(state_dir .. "/pool/" .. rid, 0, 64)
    out[#out + 1] = { run_id = l["io.demesne.run_id"], image = l["io.demesne.image"], egress = l["io.demesne.egress"],
      owner = l["io.demesne.owner"], state = c.state, created_at = tonumber(l["io.demesne.created_at"]) or 0,
      claimed = not mark, starting = mark == "filling\n" }
  end
  table.sort(out, function(a, b) return a.created_at < b.created_at end)
  return out
end

return pool
