-- A sandbox's plan before it exists: the call's settings checked against the configuration
-- (limits, env, timeout, command), its folders and their claim, and the engine-neutral
-- spec (lua/engines/spec.lua) built from them.
local config = require("demesne.config")
local egress = require("demesne.egress")
local egress_policy = require("demesne.egress.policy")
local engine_spec = require("demesne.engines.spec")
local engines = require("demesne.engines")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local loop = require("core.loop")
local log = require("demesne.log")
local paths = require("demesne.paths")
local repo = require("demesne.repo")
local util = require("demesne.util")
local owner = require("demesne.sandbox.owner")
local plan = require("demesne.sandbox.plan")
local quota = require("demesne.sandbox.quota")

local spec = {}

local fail, check = errors.raise, errors.check

-- Linux refuses a single argv or environment string of 128 KiB or more (MAX_ARG_STRLEN),
-- and the exec would fail with no output at all: refuse such values up front.
local MAX_ARG_BYTES = 128 * 1024 - 1024

local LABEL = "io.demesne."

local INIT = "/.demesne/init"

local RUN = "/.demesne/run"

--- A new run id: sortable by time, unique ("20261129T101500Z-3fa9c2d1").
function spec.new_run_id()
  return util.new_id("", 4)
end

--- The engine adapter, or a failure that says how to start one.
function spec.engine()
  return check(engines.get())
end

--- A number for a message: integral values without a fraction (also beyond the 64-bit
--- range, where "%d" cannot print them), others as Lua writes them.
---@param x number
---@return string
function spec.num(x)
  if math.tointeger(x) then return ("%d"):format(x) end
  if x == math.floor(x) and x > -math.huge and x < math.huge then return ("%.0f"):format(x) end
  return tostring(x)
end

--- Resolves limits against defaults and ceilings. Returns {memory_mb, cpus, pids}.
---@param l table|nil  the call's limits
---@return table
function spec.limits(l)
  l = l or {}
  local out = {}
  for _, k in ipairs({ "memory_mb", "cpus", "pids" }) do
    local v = l[k] or config.get(k .. "_default")
    local max = config.get(k .. "_max")
    if v > max then
      fail(("limits.%s: %s is above the ceiling of %s set in the configuration"):format(k, spec.num(v), spec.num(max)))
    end
    if v <= 0 then fail(("limits.%s: must be positive"):format(k)) end
    out[k] = v
  end
  return out
end

--- Validates a caller's env map. Variables demesne sets itself cannot be overridden.
--- Returns a list of "K=V".
---@param env table<string, string>|nil    the caller's
---@param extra table<string, string>|nil  demesne's defaults (default_env)
---@return string[]
function spec.env(env, extra)
  local list = {}
  local keys = {}
  for k in pairs(env or {}) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = env[k]
    if not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then fail(("env: %q is not a valid variable name"):format(k)) end
    if k:match("^DEMESNE_") then
      fail(("env.%s: variables starting with DEMESNE_ are set by demesne and cannot be overridden"):format(k))
    end
    if type(v) ~= "string" then fail(("env.%s: value must be a string"):format(k)) end
    if v:find("\0", 1, true) then fail(("env.%s: value contains a NUL byte"):format(k)) end
    if #k + #v + 1 > MAX_ARG_BYTES then
      fail(("env.%s: %d bytes is more than the %d one variable can hold; pass large data as a file"):format(k, #v, MAX_ARG_BYTES))
    end
    list[#list + 1] = k .. "=" .. v
  end
  -- demesne's defaults (PATH, HOME, proxy settings) yield to the caller's own value
  for k, v in pairs(extra or {}) do
    if env == nil or env[k] == nil or k:match("^DEMESNE_") then list[#list + 1] = k .. "=" .. v end
  end
  return json.array(list)
end

--- Checks a shell command: a string without NUL bytes that fits in one argument.
---@param field string
---@param cmd string
function spec.check_command(field, cmd)
  if type(cmd) ~= "string" or cmd == "" then fail(field .. ": must be a non-empty string") end
  if cmd:find("\0", 1, true) then fail(field .. ": contains a NUL byte, which a shell command cannot hold") end
  if #cmd > MAX_ARG_BYTES then
    fail(("%s: %d bytes is more than the %d a single argument can hold; put the script in a file "
      .. "(mount it with files or upload it) and run that file"):format(field, #cmd, MAX_ARG_BYTES))
  end
  return cmd
end

--- Resolves timeout_seconds against the default and ceiling.
---@param t number|nil
---@return integer
function spec.timeout(t)
  t = t or config.get("timeout_default")
  local max = config.get("timeout_max")
  if t > max then fail(("timeout_seconds: %s is above the ceiling of %s"):format(spec.num(t), spec.num(max))) end
  if t < 1 then fail("timeout_seconds: must be at least 1") end
  return math.floor(t)
end

--- A run's output folder and run folder.
---@param run_id string
---@return string output_dir, string run_dir
local function dirs(run_id)
  return config.get("output_root") .. "/" .. run_id, config.get("state_dir") .. "/run/" .. run_id
end

--- Builds the engine-neutral sandbox spec (lua/engines/spec.lua) of a sandbox, checked
--- against the engine's capabilities: an engine that cannot honour all of it is refused.
---@param o table  the plan (prepare) with name, image_ref, cmd, env, labels set
---@return table spec
local function container_spec(o)
  local init = check(config.init_path())
  local lim = o.limits
  local mounts = {
    { source = init, target = INIT, mode = "ro" },
    { source = o.run_dir, target = RUN, mode = "rw", relay = true }, -- exec records and relay sockets
    { source = o.output_dir, target = "/out", mode = "rw" },
  }
  for _, m in ipairs(o.mounts or {}) do mounts[#mounts + 1] = { source = m.host, target = m.target, mode = "ro" } end
  local rm = repo.mount_of(o) -- a repository run's folder (lua/repo), never inherited by a tree's children
  if rm then mounts[#mounts + 1] = { source = rm.host, target = rm.target, mode = "ro" } end
  local tmpfs = { { target = "/tmp", mode = "1777", exec = true } }
  if o.workspace then -- a run that can have children shares its /workspace with them: a host folder
    mounts[#mounts + 1] = { source = o.workspace, target = "/workspace", mode = "rw" }
  else
    tmpfs[#tmpfs + 1] = { target = "/workspace", mode = "0777", exec = true }
  end
  if o.home then -- an agent run's HOME kept for a `continue` (lua/sandbox/keep.lua): a host folder
    mounts[#mounts + 1] = { source = o.home, target = "/root", mode = "rw" }
  end
  if config.get("readonly_rootfs") then
    tmpfs[#tmpfs + 1] = { target = "/var/tmp", mode = "1777", exec = true }
    if not o.home then tmpfs[#tmpfs + 1] = { target = "/root", mode = "0700", exec = true } end
    tmpfs[#tmpfs + 1] = { target = "/run", mode = "0755" }
  end
  local now = math.floor(loop.time())
  local labels = {
    [LABEL .. "managed"] = "1",
    [LABEL .. "run_id"] = o.run_id,
    [LABEL .. "tool"] = o.tool or "",
    [LABEL .. "kind"] = o.kind,
    [LABEL .. "owner"] = owner.owner(),
    [LABEL .. "expires_at"] = tostring(now + o.ttl),
    [LABEL .. "created_at"] = tostring(now),
    [LABEL .. "output_dir"] = o.output_dir,
    [LABEL .. "run_dir"] = o.run_dir,
    [LABEL .. "image"] = o.image_name,
    [LABEL .. "egress"] = o.egress and o.egress.name or "none",
    [LABEL .. "memory_mb"] = tostring(math.floor(lim.memory_mb)),
    [LABEL .. "cpus"] = tostring(lim.cpus), -- (with memory_mb: what the cockpit shows of its limits)
    [LABEL .. "pids"] = tostring(math.floor(lim.pids)),
    -- open egress is a property of the policy, kept here as it was at create
    [LABEL .. "egress_unrestricted"] = o.egress and o.egress.unrestricted and "1" or "0",
    [LABEL .. "isolation"] = o.isolation or "container",
    [LABEL .. "rootfs"] = config.get("readonly_rootfs") and "ro" or "rw",
  }
  for k, v in pairs(o.labels or {}) do labels[LABEL .. k] = v end
  local cspec = {
    name = o.name,
    image = o.image_ref,
    entrypoint = { INIT },
    command = o.cmd,
    env = o.env,
    workdir = "/out",
    labels = labels,
    hostname = "sandbox",
    mounts = mounts,
    tmpfs = tmpfs,
    network = o.egress and o.egress.open and "bridge" or "none", -- egress goes through the proxy
    read_only_rootfs = config.get("readonly_rootfs") and true or false,
    -- MKNOD: a device node the sandbox made in /out or its run folder is a node on the host,
    -- usable there by whoever reaches it (Docker grants MKNOD by default; Podman does not)
    security = { no_new_privileges = true, cap_drop = { "NET_RAW", "MKNOD" } },
    -- the sandbox can write to PID 1's stdout (/proc/1/fd/1): the engine's log of it lives
    -- on the host's disk, outside the output folder, and demesne never reads it
    log_max_bytes = 1024 * 1024,
    -- an engine that would ignore them gets none with enforce_limits = false (see spec.isolation);
    -- otherwise engine_spec.check below refuses it
    limits = ((o.engine.capabilities or {}).limits ~= false or config.get("enforce_limits"))
      and { memory_bytes = math.floor(lim.memory_mb * 1024 * 1024), cpus = lim.cpus, pids = math.floor(lim.pids) }
      or nil,
    runtime = o.isolation == "gvisor" and "gvisor" or nil,
    userns = o.userns or nil,
  }
  check(engine_spec.check(cspec, o.engine.capabilities))
  return cspec
end

--- The variables demesne sets in every sandbox: the proxy settings of its egress policy,
--- DEMESNE_RUN_ID, DEMESNE_OUT, HOME, PATH.
---@param run_id string
---@param pol table  the egress policy
---@return table<string, string>
local function default_env(run_id, pol)
  local env = egress.env(pol) -- proxy variables, telemetry off
  env.DEMESNE_RUN_ID = run_id
  env.DEMESNE_OUT = "/out"
  env.HOME = "/root"
  env.PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  return env
end

--- The engine's summary of the demesne sandbox `run_id` ({id, name, image, state, labels},
--- see docs/reference/engines.md), found by its run_id label through `list`, not
--- `inspect`: on Podman 4.3 an inspect of a container takes its lock and then the storage
--- lock, which deadlocks against the `container cleanup` process of an exec that just ended
--- in that container (it takes them the other way round; fixed in Podman 4.4). Sandboxes
--- are looked up before and after every exec and transfer, so they stay off that path.
--- Returns the summary, or nil, message, code ("ENOENT" when there is none).
---@param eng table
---@param run_id string
---@return table|nil info, string|nil err, string|nil code
function spec.state_of(eng, run_id)
  local list, err, code = eng:list({ LABEL .. "managed=1", LABEL .. "run_id=" .. tostring(run_id) })
  if not list then return nil, err, code end
  for _, c in ipairs(list) do
    if (c.labels or {})[LABEL .. "run_id"] == run_id then return c end
  end
  return nil, ("no sandbox %s"):format(tostring(run_id)), "ENOENT"
end

--- The isolation levels a sandbox call may ask for (the `isolation` parameter).
spec.ISOLATIONS = { container = true, gvisor = true }

local unlimited_warned = setmetatable({}, { __mode = "k" }) -- engine -> true: said it runs sandboxes without limits

--- Decides how a new sandbox is isolated: `isolation` ("container" or "gvisor"; nil = the
--- isolation_default setting) and whether it gets a user namespace (the userns setting,
--- where the engine offers one). Asks the engine what it offers (eng:probe, when the
--- adapter has it). Fails, naming the field, when gVisor is asked for and the engine cannot
--- give it, and when the engine would not enforce the sandbox's limits (capability limits)
--- unless enforce_limits is false (then a warning, once per engine): never a silent
--- downgrade. Returns {isolation = string, userns = boolean}.
---@param eng table  the engine adapter
---@param isolation string|nil
---@param open_egress boolean  the sandbox gets the engine's bridge network (open egress)
---@return {isolation: string, userns: boolean}
function spec.isolation(eng, isolation, open_egress)
  local field = isolation ~= nil and "isolation" or "isolation_default (configuration)"
  isolation = isolation or config.get("isolation_default")
  if not spec.ISOLATIONS[isolation] then
    fail(("%s: %q is not container or gvisor"):format(field, tostring(isolation)))
  end
  local facts
  if type(eng.probe) == "function" then facts = check(eng:probe({ gvisor = isolation == "gvisor" })) end
  local caps = eng.capabilities or {}
  if isolation == "gvisor" then
    if not (caps.runtimes or {}).gvisor then
      local g = facts and facts.gvisor or {}
      fail(("%s: gvisor is not available on this engine%s%s"):format(field, g.detail and (": " .. g.detail) or "",
        g.fix and ("; to offer it: " .. g.fix) or ""), "ENOTSUP")
    end
    if open_egress then
      fail(("%s: gvisor sandboxes have no network but loopback (gVisor runs with --network=none), so the open "
        .. "egress policy cannot be given; use a proxied policy (package-managers, an allowlist) or isolation "
        .. "container"):format(field), "ENOTSUP")
    end
  end
  if caps.limits == false then
    local l = facts and facts.limits or {}
    if config.get("enforce_limits") then
      fail(("limits: this engine does not enforce memory, process and CPU limits%s, so demesne starts no sandbox "
        .. "on it; %s"):format(l.detail and (": " .. l.detail) or "", l.fix or "use an engine that does, or set "
        .. "enforce_limits = false"), "ENOTSUP")
    end
    if not unlimited_warned[eng] then
      unlimited_warned[eng] = true
      log.warning("demesne.sandbox", "sandboxes on this engine run WITHOUT memory, process and CPU limits "
        .. "(enforce_limits = false): %s", tostring(l.detail))
    end
  end
  return { isolation = isolation, userns = config.get("userns") == true and caps.userns == true }
end

-- The components of a path ("/a/b" -> {"a", "b"}).
local function components(p)
  local out = {}
  for c in tostring(p):gmatch("[^/]+") do out[#out + 1] = c end
  return out
end

-- `path` resolved as far as it exists (its existing ancestor's realpath, then the rest as
-- written): a folder made later (a control folder, a credential file) is still matched.
local function resolved(path)
  local rest = {}
  local p = path
  while p and p ~= "" and p ~= "/" do
    local real = fs.realpath(p)
    if real then
      for i = #rest, 1, -1 do real = (real == "/" and "" or real) .. "/" .. rest[i] end
      return real
    end
    rest[#rest + 1] = p:match("([^/]+)/*$")
    p = p:match("^(.*)/[^/]+/*$")
  end
  return path
end

--- Refuses an input that is, contains or lies inside what no sandbox may see: demesne's own
--- folders (a state folder holds job records and relay sockets, the control folder every
--- server's control socket — a sandbox with it could answer its own egress questions —, the
--- output root every other sandbox's /out, the configuration folder its settings) and the
--- credential files of config protected_paths. Fails naming `field`.
---@param field string
---@param host string  the input's resolved host path
local function check_not_holding(field, host)
  local own = { { "state_dir", "demesne's state folder" }, { "control_dir", "demesne's control folder" },
    { "output_root", "demesne's output root" } }
  local list = {}
  for _, x in ipairs(own) do list[#list + 1] = { path = config.get(x[1]), what = x[2], key = x[1] } end
  list[#list + 1] = { path = config.dir(), what = "demesne's configuration folder" }
  for _, p in ipairs(config.get("protected_paths") or {}) do
    list[#list + 1] = { path = p, what = "a protected path (config protected_paths)", key = "protected_paths" }
  end
  for _, x in ipairs(list) do
    local p = type(x.path) == "string" and x.path ~= "" and resolved(x.path) or nil
    if p and paths.within(p, host) then
      fail(("%s: %s holds %s (%s), which no sandbox may see; mount a folder that does not contain it"):format(
        field, host, x.what, p))
    end
    -- inside the state folder and the output root: spec.check_inputs_reach's own rules
    if p and x.key ~= "state_dir" and x.key ~= "output_root" and paths.within(host, p) then
      fail(("%s: %s is inside %s (%s), which no sandbox may see"):format(field, host, x.what, p))
    end
  end
end

--- Refuses host inputs that a live sandbox could change before the engine mounts them.
--- paths.inputs resolves every link once; the engine resolves the path again when it starts
--- the container, and follows any link it then finds. Below a folder a sandbox can write
--- (its output folder, `<output_root>/<run id>/…`, while it runs; any run folder under the
--- state folder) every component can be swapped for a link to any host path in between, and
--- the new sandbox would get that host folder or file mounted. So an input strictly inside
--- the output folder of a sandbox that still exists (its run folder, or a container with its
--- run id on the engine) is refused, and so is anything in the state folder. The output
--- folder itself is fine (the sandbox cannot replace it: its parent is the host's), and so
--- is the output of a sandbox that is gone (nothing can change it any more).
---@param eng table  the engine adapter
---@param mounts table  paths.inputs' list ({host, field, …})
function spec.check_inputs_reach(eng, mounts)
  local state = fs.realpath(config.get("state_dir"))
  local out_root = fs.realpath(config.get("output_root"))
  for _, m in ipairs(mounts or {}) do
    local field = m.field or "input"
    check_not_holding(field, m.host)
    if state and paths.within(m.host, state) then
      fail(("%s: %s is inside demesne's state folder (%s), which sandboxes write (their run folders and relay "
        .. "sockets); it cannot be mounted"):format(field, m.host, state))
    end
    if out_root and paths.within(m.host, out_root) then
      local c, r = components(m.host), components(out_root)
      local id = c[#r + 1]
      if #c > #r + 1 and id:match("^[%w%-]+$") then
        local alive = fs.lstat(config.get("state_dir") .. "/run/" .. id) ~= nil
        if not alive then
          local info, err, code = spec.state_of(eng, id)
          if info then alive = true
          elseif code ~= "ENOENT" then
            fail(("%s: %s is inside the output folder of sandbox %s, and whether that sandbox still runs cannot be "
              .. "told (%s)"):format(field, m.host, id, tostring(err)), code)
          end
        end
        if alive then
          fail(("%s: %s is inside the output folder of sandbox %s, which is still running and can replace any part "
            .. "of it with a link to another host path before the engine mounts it; mount the whole output folder, "
            .. "destroy that sandbox first, or send the files with sandbox_upload"):format(field, m.host, id))
        end
      end
    end
  end
end

-- An absolute path (as the engine spec takes it: a leading "/", no NUL byte), or nil; with
-- `strict` (a mount target) also without a "." or ".." component.
local function absolute(p, strict)
  if type(p) ~= "string" or p:sub(1, 1) ~= "/" or p:find("\0", 1, true) then return nil end
  for c in p:gmatch("[^/]+") do
    if strict and (c == "." or c == "..") then return nil end
  end
  return p
end

--- The checks of a plan's placement, run once on the final plan: after its contributors
--- (the repository, the devcontainer, the plan hooks of the layer above, which may replace
--- its output folder and mounts and add a workspace) and before anything is made. The
--- output and run folders are absolute; every mount, the call's own or a contributor's,
--- has an absolute host path and an absolute target without "." or "..", no target is
--- mounted twice, and no mount, nor the workspace or HOME folder, holds demesne's own
--- folders or a protected path. (The call's own inputs were checked for what a live
--- sandbox could change under them when the call was resolved, spec.prepare: a refused
--- call leaves no tree node behind.) Fails (errors.raise) naming the field.
---@param o SandboxPlan
function spec.check_plan(o)
  for _, k in ipairs({ "output_dir", "run_dir" }) do
    if not absolute(o[k]) then fail(("plan: %s %s is not an absolute path"):format(k, tostring(o[k]))) end
  end
  local targets = {}
  for _, m in ipairs(o.mounts or {}) do
    local field = m.field or ("mount at " .. tostring(m.target))
    if not absolute(m.host) then fail(("%s: %s is not an absolute host path"):format(field, tostring(m.host))) end
    if not absolute(m.target, true) then fail(("%s: %s is not an absolute target"):format(field, tostring(m.target))) end
    if targets[m.target] then
      fail(("%s: %s is mounted twice (%s and %s)"):format(field, m.target, targets[m.target], m.host))
    end
    targets[m.target] = m.host
    check_not_holding(field, m.host)
  end
  for _, k in ipairs({ "workspace", "home" }) do
    if o[k] ~= nil then
      if not absolute(o[k]) then fail(("plan: %s %s is not an absolute path"):format(k, tostring(o[k]))) end
      check_not_holding(k, o[k])
    end
  end
end

--- The plan of a new sandbox from a call's arguments, checked: engine, limits, mounts,
--- egress policy, isolation, a fresh run id and its folders. Nothing is created yet.
---@param args table         limits, files, directories, egress, isolation
---@param kind string        the container's kind label ("oneshot", "job", "persistent")
---@param tool string|nil    the tool that asked
---@param ttl number         seconds the container may live (its expires_at label)
---@return SandboxPlan plan
local function prepare(args, kind, tool, ttl)
  local eng = spec.engine()
  local lim = spec.limits(args.limits)
  local mounts = check(paths.inputs(args.files, args.directories))
  spec.check_inputs_reach(eng, mounts)
  local pol = check(egress_policy.select(args.egress, #mounts > 0))
  local iso = spec.isolation(eng, args.isolation, pol.open == true)
  local run_id = spec.new_run_id()
  local output_dir, run_dir = dirs(run_id)
  return plan.new({
    egress = pol, engine = eng, limits = lim, mounts = mounts, run_id = run_id, output_dir = output_dir,
    run_dir = run_dir, kind = kind, tool = tool, ttl = ttl, isolation = iso.isolation, userns = iso.userns,
  })
end

--- <state>/claims/<run id>: which engine and which server a run folder belongs to, kept out
--- of the sandbox's reach, so that the reaper can tell a folder a killed server left behind
--- from one another live server (or another engine) still uses.
---@param run_id string
---@return string
local function claim_path(run_id) return config.get("state_dir") .. "/claims/" .. run_id end

--- With `create`, makes the output root and the state folder, when missing, readable by this
--- user only (0700). Returns a warning for each that other users can enter. Root in a sandbox is
--- root on the host under a rootful engine: a setuid-root program the sandbox leaves in its
--- output or run folder is one on the host, which only the folders above keep from other
--- users (the sandbox can change the mode of its own /out, not of its parent).
---@param create boolean|nil
---@return string[] warnings
function spec.private_roots(create)
  local warnings = {}
  for _, name in ipairs({ "output_root", "state_dir" }) do
    local dir = config.get(name)
    if create and not fs.lstat(dir) then fs.mkdir_p(dir, 448) end -- 0700 (Lua has no octal literals)
    local st = fs.stat(dir)
    if st and st.mode & 63 ~= 0 then -- 0077: group or others
      warnings[#warnings + 1] = ("%s %s can be entered by other users (mode %03o): a sandbox can leave setuid-root "
        .. "programs in the folders below it (root in a sandbox is root on the host under a rootful engine); "
        .. "chmod 700 %s"):format(name, dir, st.mode & 511, dir)
    end
  end
  return warnings
end

--- Creates a plan's output and run folders, then its claim. The folders a sandbox writes to
--- are made before it exists: with a user namespace the engine hands them (and what is in
--- them) to the sandbox's root when it starts, so the transfer folder is made here too.
---@param o table  the plan (prepare)
local function make_dirs(o)
  spec.private_roots(true)
  quota.check_reserve() -- no sandbox starts on a filesystem below its free-space reserve
  check(fs.mkdir_p(o.output_dir, 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/exec", 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/xfer", 448)) -- 0700
  -- after the folder: a claim without its folder is always stale (a young folder without a
  -- claim is left alone by the reaper)
  check(fs.mkdir_p(config.get("state_dir") .. "/claims", 448)) -- 0700
  check(fs.write_atomic(claim_path(o.run_id), json.encode({ engine = o.engine.socket, owner = owner.owner() }) .. "\n"))
end

--- The host-side deadline of a command that may run `timeout_s` seconds in a sandbox: its
--- timeout plus exec_grace_seconds, in ms. demesne-init enforces the timeout inside; this
--- bounds the host's wait when demesne-init itself does not answer (stopped with SIGSTOP
--- by the sandbox, or hung).
---@param timeout_s number
---@return integer ms
function spec.deadline_ms(timeout_s)
  return math.floor((timeout_s + config.get("exec_grace_seconds")) * 1000)
end

--- demesne-init's relay options of a plan: its egress policy's, the plan's extra ones
--- (the vendor route, a tree's endpoint); under gVisor it copies from the start (a socket
--- cannot be passed there).
---@param o table  the plan
---@return string[]
local function relay_args(o)
  local relay = egress.relay_args(o.egress)
  for _, a in ipairs(o.extra_relay or {}) do relay[#relay + 1] = a end
  if o.isolation == "gvisor" and #relay > 0 then relay[#relay + 1] = "--relay-copy" end
  return relay
end

spec.LABEL = LABEL
spec.relay_args = relay_args
spec.INIT = INIT
spec.RUN = RUN
spec.container_spec = container_spec
spec.default_env = default_env
spec.prepare = prepare
spec.claim_path = claim_path
spec.make_dirs = make_dirs
spec.dirs = dirs

return spec
