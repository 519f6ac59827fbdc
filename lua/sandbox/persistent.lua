-- Persistent sandboxes (sandbox_create): create, look up, renew and expire, stop when
-- unresponsive, destroy, list.
local async = require("demesne.async")
local channel = require("demesne.channel")
local devcontainer = require("demesne.images.devcontainer")
local config = require("demesne.config")
local egress = require("demesne.egress")
local errors = require("demesne.errors")
local fs = require("core.fs")
local images = require("demesne.images")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local paths = require("demesne.paths")
local util = require("demesne.util")
local files = require("demesne.sandbox.files")
local layer = require("demesne.layer")
local quota = require("demesne.sandbox.quota")
local repo = require("demesne.repo")
local plan = require("demesne.sandbox.plan")
local run = require("demesne.sandbox.run")
local preview = require("demesne.sandbox.preview")
local snapshots = require("demesne.sandbox.snapshots")
local spec = require("demesne.sandbox.spec")

local persistent = {}

local watching = {} -- sandbox_id -> QuotaWatch (lua/sandbox/quota.lua) of the live ones this server watches

local seen = {} -- [h10] sandbox_id -> {sb, engine, at (loop.now() ms)}: lookup_running
local SEEN_MS = 30000

local fail, check = errors.raise, errors.check
local LABEL, container_spec, default_env = spec.LABEL, spec.container_spec, spec.default_env
local prepare, make_dirs = spec.prepare, spec.make_dirs

-- The ttl of a sandbox_create call, checked, and the snapshot it starts from (nil: none),
-- with `args` as the rest of create reads them (a gVisor snapshot's sandbox runs on gVisor).
local function create_args(ctx, args)
  local ttl = args.ttl_seconds or config.get("ttl_default")
  if ttl > config.get("ttl_max") then
    fail(("ttl_seconds: %s is above the ceiling of %s"):format(spec.num(ttl), spec.num(config.get("ttl_max"))))
  end
  preview.check_ports(args.ports)
  if args.snapshot == nil then return ttl, nil, args end
  if args.image ~= nil then fail("snapshot: give image or snapshot, not both (a snapshot is its own image)") end
  local snap = snapshots.find(spec.engine(), ctx, args.snapshot, "snapshot")
  if snap.isolation == "gvisor" then
    if args.isolation == "container" then
      fail(("isolation: snapshot %s was taken of a gvisor sandbox, and a sandbox from it runs on gvisor too (give "
        .. "isolation gvisor, or leave it out)"):format(snap.snapshot_id))
    end
    local a = {}
    for k, v in pairs(args) do a[k] = v end
    a.isolation = "gvisor"
    args = a
  end
  return ttl, snap, args
end

-- The plan of a persistent sandbox before its contributors: checked settings, its
-- environment, and a host repository's plan (cloned once the sandbox runs).
local function plan_create(args, ttl, snap)
  local o = prepare(args, "persistent", "sandbox_create", ttl)
  if snap then o.labels = { from_snapshot = snap.snapshot_id } end
  o.env = spec.env(args.env, default_env(o.run_id, o.egress))
  if args.repository ~= nil then
    -- the clone is made once the sandbox runs (lua/sandbox/repository.lua); the plan is saved
    local rok, rerr = pcall(repo.prepare, o, args.repository, { include_uncommitted = args.include_uncommitted,
      depth = args.depth, name = args.branch })
    if not rok then
      repo.cleanup(o)
      error(rerr, 0)
    end
  else
    repo.only_with(args)
  end
  return o
end

-- The repository's own environment (lua/images/devcontainer.lua) for a devcontainer call;
-- its forwardPorts join the call's previews. Returns the ports to preview.
local function plan_devcontainer(o, args)
  if args.image ~= devcontainer.IMAGE then return args.ports end
  local dc = devcontainer.plan(o, args, { persistent = true })
  if #dc.cfg.ports == 0 then return args.ports end
  local have, merged = {}, {}
  for _, p in ipairs(args.ports or {}) do have[p] = true; merged[#merged + 1] = p end
  for _, p in ipairs(dc.cfg.ports) do
    if not have[p] then have[p] = true; merged[#merged + 1] = p end
  end
  preview.check_ports(merged)
  return merged
end

-- Makes and starts the container of a checked plan (from `snap`, a snapshot, when given):
-- image, folders, demesne-init serving (with a control socket, except under gVisor),
-- egress proxy. Returns the container id, the proxy and the image {ref, name}; on failure
-- what was made goes.
local function launch(ctx, o, args, snap)
  local img = snap and { ref = snap.ref, name = snap.image or "snapshot" }
    or o.devcontainer and devcontainer.ensure(o.engine, o, ctx) or check(images.ensure(o.engine, args.image, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  -- [channel] a control socket, except under gVisor: the host cannot connect to a socket made
  -- in its sandbox (runsc's --host-uds=open); execs there go through the engine's exec API
  o.control = o.isolation ~= "gvisor"
  o.cmd = { "serve", table.unpack(spec.relay_args(o)) }
  if o.control then
    table.insert(o.cmd, 2, "--control")
    table.insert(o.cmd, 3, channel.PATH)
  end
  o.name = "demesne-" .. o.run_id
  local cspec = container_spec(o)
  local eg = check(egress.start(o)) -- lives as long as the sandbox (egress.stop in destroy/reap)
  local id, cerr, ccode = o.engine:create(cspec)
  if not id then eg:stop() fail(cerr, ccode) end
  local ok, err = o.engine:start(id)
  if not ok then
    o.engine:remove(id)
    eg:stop()
    files.remove_tree(o.run_dir)
    fail(err)
  end
  if snap then
    local rok, rerr = snapshots.restore(o.engine, id)
    if not rok then
      o.engine:remove(id)
      eg:stop()
      files.remove_tree(o.run_dir)
      fail(("snapshot: the sandbox from snapshot %s could not be prepared (%s); nothing was kept"):format(
        snap.snapshot_id, tostring(rerr)))
    end
  end
  return id, eg, img
end

--- Creates a persistent sandbox (sandbox_create). Returns {sandbox_id, output_dir,
--- expires_at, image, mcp, previews}: mcp = {url, token} of its in-sandbox endpoint when the plan
--- hooks (lua/tree) gave it one; previews = {{port, url}} for `ports` (lua/sandbox/preview.lua).
---@param ctx table
--- With `snapshot` (a snapshot id) the sandbox starts from that snapshot's image, its
--- /workspace unpacked from it, isolated no weaker than the snapshot's source (gvisor when
--- `isolation` is left out; "container" for a gVisor snapshot is refused).
---@param args table  ttl_seconds, image, snapshot, files, directories, env, limits, egress, mcp, tree, budget_usd, ports
---@return table
function persistent.create(ctx, args)
  local ttl, snap
  ttl, snap, args = create_args(ctx, args)
  local o = plan_create(args, ttl, snap)
  local started = false
  -- a sandbox that never came up is no tree node either (lua/tree)
  local _tree <close> = util.closer(function()
    if o.tree and not started then layer.run("sandbox_removed", o, "the sandbox could not be started") end
    if not started then repo.cleanup(o) end
  end)
  local ports = plan_devcontainer(o, args)
  -- the contributors have filled the plan (the repository, the devcontainer, the plan
  -- hooks of the layer above): its checks run once, on the final plan
  layer.run("sandbox_plan", ctx, o, args)
  spec.check_plan(o)
  local id, eg, img = launch(ctx, o, args, snap)
  started = true
  run.start(o, util.now_ms()) -- its SandboxRun (lua/sandbox/run.lua); the container's id stays the engine's
  plan.launched(o) -- from here on the plan is only read
  -- [channel] answer once demesne-init listens on its control socket, so that the first
  -- exec does not find it missing (and fall back to the exec API); a few ms at most
  if o.control then
    local conn, cerr2 = channel.connect_wait(o.run_dir, 5000, function()
      local info = persistent.state_of(o.engine, o.run_id)
      return not info or info.state == "running" or info.state == "created"
    end)
    if conn then conn:close() else log.warning("demesne.sandbox", "sandbox %s: %s", o.run_id, tostring(cerr2)) end
  end
  -- the previews last: a listener that cannot be opened takes the sandbox down with it
  local pok, previews = pcall(preview.open_all, o.engine, o.run_id, id, ports)
  if not pok then
    layer.run("sandbox_removing", o.run_id)
    o.engine:remove(id)
    layer.run("sandbox_removed", { run_id = o.run_id })
    eg:stop()
    files.remove_tree(o.run_dir)
    error(previews, 0)
  end
  local expires = math.floor(loop.time()) + ttl
  persistent.write_expiry(o.run_dir, expires)
  persistent.watch(o.engine, id, o.run_id, o.output_dir, o.run_dir)
  if o.devcontainer and o.devcontainer.script then devcontainer.pending(o.run_id, o.devcontainer.script) end
  return {
    previews = previews,
    sandbox_id = o.run_id,
    output_dir = o.output_dir,
    expires_at = util.iso(expires),
    image = img.name,
    snapshot = snap and snap.snapshot_id or nil,
    isolation = o.isolation,
    mcp = o.endpoint and { url = o.endpoint.url, token = o.endpoint.token } or nil,
  }
end

--- <state>/run/<id> -> <state>/expiry/<id>: out of the sandbox's reach.
---@param run_dir string|nil
---@return string|nil
local function expiry_file(run_dir)
  local state, id = tostring(run_dir):match("^(.*)/run/([^/]+)$")
  return state and (state .. "/expiry/" .. id)
end

--- <state>/run/<id> -> <state>/stopped/<id>: why the sandbox was stopped (its output
--- quota), out of the sandbox's reach.
---@param run_dir string|nil
---@return string|nil
local function stopped_file(run_dir)
  local state, id = tostring(run_dir):match("^(.*)/run/([^/]+)$")
  return state and (state .. "/stopped/" .. id)
end

--- Watches a running persistent sandbox's output folder (lua/sandbox/quota.lua), once per
--- sandbox: past its quota the container is killed (its output folder stays until
--- sandbox_destroy or expiry), its egress proxy stops and <state>/stopped/<id> records why,
--- which sandbox_exec and the sandbox's lookup then say. sandbox_create calls it; the
--- reaper again for the running ones after a server restart.
---@param eng table        the engine adapter
---@param container string container id or name
---@param sandbox_id string
---@param output_dir string
---@param run_dir string
function persistent.watch(eng, container, sandbox_id, output_dir, run_dir)
  if watching[sandbox_id] then return end
  watching[sandbox_id] = quota.watch(output_dir, sandbox_id, function(info)
    seen[sandbox_id] = nil
    local f = stopped_file(run_dir)
    if f then
      fs.mkdir_p(f:match("^(.*)/"), 448) -- 0700
      fs.write_atomic(f, json.encode(info) .. "\n")
    end
    local ok, err = (eng.kill and eng.kill or eng.remove)(eng, container, "KILL")
    if not ok then log.warning("demesne.sandbox", "sandbox %s: kill: %s", sandbox_id, tostring(err)) end
    egress.stop(sandbox_id)
  end)
end

--- Ends the quota watch of a persistent sandbox (destroyed or expired) and forgets why it
--- was stopped.
---@param sandbox_id string
---@param run_dir string|nil
function persistent.unwatch(sandbox_id, run_dir)
  local w = watching[sandbox_id]
  watching[sandbox_id] = nil
  if w then w.stop() end
  local f = stopped_file(run_dir)
  if f then os.remove(f) end
end

--- Ends every quota watch of persistent sandboxes (the server stops; the sandboxes go on,
--- and the next server's reaper watches them again).
function persistent.unwatch_all()
  for id, w in pairs(watching) do
    watching[id] = nil
    w.stop()
  end
end

--- True while this server watches the persistent sandbox's output quota.
---@param sandbox_id string
---@return boolean
function persistent.watched(sandbox_id) return watching[sandbox_id] ~= nil end

--- Why a persistent sandbox was stopped by demesne (its output quota: "output quota
--- exceeded: <detail>; N bytes were written"), or nil.
---@param run_dir string|nil
---@return string|nil
function persistent.stopped_reason(run_dir)
  local f = stopped_file(run_dir)
  local text = f and fs.read_file(f, 0, 64 * 1024)
  local ok, info = pcall(json.decode, text or "")
  if not ok or type(info) ~= "table" then return nil end
  return ("%s: %s; %s bytes were written"):format(tostring(info.reason), tostring(info.detail),
    spec.num(tonumber(info.output_bytes) or 0))
end

--- Records a renewed expiry (unix seconds) for the sandbox whose run folder is run_dir.
---@param run_dir string
---@param expires number  epoch seconds
function persistent.write_expiry(run_dir, expires)
  local f = expiry_file(run_dir)
  if not f then return end
  fs.mkdir_p(f:match("^(.*)/"), 448) -- 0700
  fs.write_atomic(f, tostring(expires))
end

--- A sandbox's expiry (epoch seconds): its label, or the later renewal recorded under
--- <state>/expiry.
---@param labels table<string, string>  the container's labels
---@return number
local function expiry_of(labels)
  local e = tonumber(labels[LABEL .. "expires_at"]) or 0
  local f = expiry_file(labels[LABEL .. "run_dir"])
  local s = f and fs.read_file(f)
  if s and tonumber(s) and tonumber(s) > e then e = tonumber(s) end
  return e
end

--- Looks up a persistent sandbox by id. Returns {id, name, labels, output_dir, run_dir,
--- running} or fails with a message that says it is unknown or gone.
---@param eng table  the engine adapter
---@param sandbox_id string
---@return table
function persistent.lookup(eng, sandbox_id)
  if type(sandbox_id) ~= "string" or not sandbox_id:match("^[%w%-]+$") then
    fail(("sandbox_id: %q is not a sandbox id"):format(tostring(sandbox_id)))
  end
  local info, err, code = persistent.state_of(eng, sandbox_id)
  if not info then
    if code == "ENOENT" then
      fail(("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(sandbox_id), "ENOENT")
    end
    fail(err, code)
  end
  local labels = info.labels or {}
  if labels[LABEL .. "managed"] ~= "1" or labels[LABEL .. "kind"] ~= "persistent" then
    fail(("sandbox_id: %s is not a persistent demesne sandbox"):format(sandbox_id))
  end
  return {
    id = info.id, name = "demesne-" .. sandbox_id, labels = labels,
    output_dir = labels[LABEL .. "output_dir"], run_dir = labels[LABEL .. "run_dir"],
    running = info.state == "running",
    stopped_reason = info.state ~= "running" and persistent.stopped_reason(labels[LABEL .. "run_dir"]) or nil,
    paused = info.paused == true,
    image = info.image,
    expires_at = expiry_of(labels),
    memory_mb = tonumber(labels[LABEL .. "memory_mb"]),
  }
end

--- Fails, naming sandbox_id, when the sandbox (persistent.lookup) is paused: its
--- processes are frozen, so a command, a transfer or a snapshot would hang until its
--- deadline and then find demesne-init unresponsive. sandbox_resume thaws it.
---@param sb table
---@param sandbox_id string
function persistent.check_not_paused(sb, sandbox_id)
  if sb.paused then
    fail(("sandbox_id: sandbox %s is paused (sandbox_pause); sandbox_resume it first"):format(sandbox_id), "EPAUSED")
  end
end

--- Forgets what lookup_running remembers of a sandbox (its state changed: paused, resumed).
---@param sandbox_id string
function persistent.forget(sandbox_id) seen[sandbox_id] = nil end

--- The engine's summary of the demesne sandbox `run_id`, found by list, never by inspect
--- (spec.state_of says why).
persistent.state_of = spec.state_of

--- Fails with a plain message when a persistent sandbox is no longer running (destroyed,
--- expired or stopped while a command or transfer used it). Returns nothing otherwise.
--- A removal can still be under way when the command's stream ends, so this watches the
--- container for up to 2 s before concluding it is alive.
---@param eng table  the engine adapter
---@param sandbox_id string
function persistent.check_alive(eng, sandbox_id)
  seen[sandbox_id] = nil -- asked because something went wrong: look it up afresh next time
  for _ = 1, 10 do
    local info, _, code = persistent.state_of(eng, tostring(sandbox_id))
    if not info and code == "ENOENT" then
      fail(("sandbox_id: sandbox %s was destroyed (or expired) while the call was running"):format(sandbox_id), "ENOENT")
    end
    -- (a container being removed is not running either: ask about removal first)
    if info and info.state == "removing" then
      fail(("sandbox_id: sandbox %s was destroyed while the call was running"):format(sandbox_id), "ENOENT")
    end
    if info and info.state ~= "running" then
      local why = persistent.stopped_reason((info.labels or {})[LABEL .. "run_dir"])
      fail(("sandbox_id: sandbox %s stopped while the call was running%s"):format(sandbox_id,
        why and (" (" .. why .. ")") or ""))
    end
    async.sleep(200)
  end
end

--- Renews the TTL by the sandbox's own ttl_seconds from now; never shortens it. `busy`
--- (seconds) keeps it alive at least that long: an exec that may run for its whole timeout
--- must not see its sandbox expire under it.
---@param sb table         the sandbox (persistent.lookup)
---@param busy number|nil
local function renew(sb, busy)
  local created = tonumber(sb.labels[LABEL .. "created_at"]) or 0
  local ttl = (tonumber(sb.labels[LABEL .. "expires_at"]) or 0) - created
  if ttl <= 0 then ttl = config.get("ttl_default") end
  if busy and busy + 60 > ttl then ttl = busy + 60 end
  local new = math.floor(loop.time()) + ttl
  -- [h10] written (with an fsync) when it moves by a tenth of the TTL or a minute, not on
  -- every exec: back-to-back execs would each pay for it
  if new >= sb.expires_at + math.min(60, ttl // 10) and new > sb.expires_at then
    persistent.write_expiry(sb.run_dir, new)
    sb.expires_at = new
  end
end

--- Stops a persistent sandbox that did not answer within a host-side deadline: the engine
--- kills its container (every process in it; the container and its output folder stay
--- until sandbox_destroy or expiry) and its egress proxy stops. Returns the sentence that
--- says so, for the caller's error.
---@param eng table
---@param container string     container id or name
---@param sandbox_id string|nil
---@param what string          what overran, e.g. "the command did not end within its timeout (5 s) plus a grace of 30 s"
---@return string message
function persistent.stop_unresponsive(eng, container, sandbox_id, what)
  log.warning("demesne.sandbox", "sandbox %s: %s; stopping it as unresponsive", tostring(sandbox_id or container), what)
  local ok, err = (eng.kill and eng.kill or eng.remove)(eng, container, "KILL")
  if sandbox_id then
    seen[sandbox_id] = nil -- [h10] no longer running: the next exec looks it up afresh
    egress.stop(sandbox_id)
    preview.close(sandbox_id)
  end
  return ("%s: the sandbox's demesne-init is not responding (stopped or hung), so sandbox %s %s; its output "
    .. "folder is kept. sandbox_destroy removes it; create a new sandbox to go on"):format(what,
    tostring(sandbox_id or container), ok and "was stopped" or ("could not be stopped (" .. tostring(err) .. ")"))
end

--- Opens a preview of `args.port` of the running persistent sandbox `args.sandbox_id`
--- (sandbox_expose). Returns {sandbox_id, port, url, previews = {{port, url}}}.
---@param ctx table
---@param args table  sandbox_id, port
---@return table
function persistent.expose(ctx, args)
  local eng = spec.engine()
  local sb = persistent.lookup(eng, args.sandbox_id)
  if not sb.running then
    fail(("sandbox_id: sandbox %s is not running"):format(args.sandbox_id))
  end
  local p = preview.open(eng, args.sandbox_id, sb.id, args.port, "port")
  return { sandbox_id = args.sandbox_id, port = p.port, url = p.url, previews = preview.list(args.sandbox_id) }
end

--- Opens a preview of `port` of the running demesne sandbox `run_id`, whatever its kind
--- (an agent run's own sandbox, from inside its tree: lua/tree/child.lua checks the scope).
--- Returns {sandbox_id, port, url, previews}.
---@param run_id string
---@param port integer
---@return table
function persistent.expose_run(run_id, port)
  local eng = spec.engine()
  local info = spec.state_of(eng, run_id)
  if not info or info.state ~= "running" or (info.labels or {})[LABEL .. "managed"] ~= "1" then
    fail(("sandbox_id: sandbox %s is not running"):format(run_id))
  end
  local p = preview.open(eng, run_id, info.id, port, "port")
  return { sandbox_id = run_id, port = p.port, url = p.url, previews = preview.list(run_id) }
end

--- Destroys a persistent sandbox. Idempotent: a gone sandbox is success, with status
--- "already gone". Returns {sandbox_id, status}.
---@param ctx table
---@param args table  sandbox_id
---@return table
function persistent.destroy(ctx, args)
  local eng = spec.engine()
  local ok, sb = pcall(persistent.lookup, eng, args.sandbox_id)
  if not ok then
    if errors.is(sb) and sb.code == "ENOENT" then
      return { sandbox_id = args.sandbox_id, status = "already gone" }
    end
    error(sb, 0)
  end
  layer.run("sandbox_removing", args.sandbox_id) -- its children go first (lua/tree)
  local removed, how = eng:remove(sb.id)
  if not removed then fail(how) end
  layer.run("sandbox_removed", { run_id = args.sandbox_id })
  seen[args.sandbox_id] = nil
  persistent.unwatch(args.sandbox_id, sb.run_dir)
  egress.stop(args.sandbox_id)
  preview.close(args.sandbox_id)
  if sb.run_dir then
    files.remove_tree(sb.run_dir)
    local ef = expiry_file(sb.run_dir)
    if ef then os.remove(ef) end
  end
  return { sandbox_id = args.sandbox_id, status = how == "gone" and "already gone" or "destroyed",
    output_dir = sb.output_dir }
end

--- Lists the live persistent sandboxes of this configuration (those whose run folder is
--- under this state_dir): {sandboxes = {{sandbox_id, image, created_at, expires_at, output_dir, state, paused,
--- previews = {{port, url}}}}} (previews: those this server process holds).
function persistent.list()
  local eng = spec.engine()
  local list = check(eng:list({ LABEL .. "managed=1", LABEL .. "kind=persistent" }))
  local out = json.array()
  local mine = config.get("state_dir") .. "/run"
  for _, c in ipairs(list) do
    local l = c.labels or {}
    if paths.within(tostring(l[LABEL .. "run_dir"]), mine) then out[#out + 1] = {
      sandbox_id = l[LABEL .. "run_id"],
      image = l[LABEL .. "image"],
      created_at = util.iso(tonumber(l[LABEL .. "created_at"]) or 0),
      expires_at = util.iso(expiry_of(l)),
      output_dir = l[LABEL .. "output_dir"],
      state = c.state,
      previews = preview.list(l[LABEL .. "run_id"]),
      paused = c.paused == true,
    } end
  end
  table.sort(out, function(a, b) return tostring(a.sandbox_id) < tostring(b.sandbox_id) end)
  return { sandboxes = out }
end

--- [h10] sandbox_exec's lookups: a persistent sandbox found running is remembered for a
--- while (its labels never change), so back-to-back execs do not each ask the engine. One
--- that has gone or stopped meanwhile is found out as before: its control socket no longer
--- answers, the exec API fails, and check_alive (which forgets it) says what happened.
--- Returns what persistent.lookup returns.
---@param eng table  the engine adapter
---@param id string  the sandbox id
---@return table
function persistent.lookup_running(eng, id)
  local s = seen[id]
  if s and s.engine == eng and loop.now() - s.at < SEEN_MS then
    s.sb.expires_at = expiry_of(s.sb.labels) -- the renewed expiry lives in a file
    return s.sb
  end
  local sb = persistent.lookup(eng, id)
  for k, v in pairs(seen) do -- the stale ones go (the table holds the sandboxes of the last 30 s)
    if loop.now() - v.at >= SEEN_MS then seen[k] = nil end
  end
  seen[id] = sb.running and { sb = sb, engine = eng, at = loop.now() } or nil
  return sb
end

persistent.expiry_file = expiry_file
persistent.expiry_of = expiry_of
persistent.renew = renew

return persistent
