-- The sandbox lifecycle over an engine adapter: limits, mounts, output folders, labels,
-- TTL, one-shot runs, execs through demesne-init, and the reaper.
--
-- Host layout (DESIGN.md "State on the host"):
--   <output_root>/<run id>/              = /out of that sandbox (stdout.log, stderr.log, exec/<n>/…)
--   <state_dir>/run/<run id>/            = /.demesne/run (exec records written by demesne-init)
--   <state_dir>/expiry/<run id>          = renewed expiry (labels are immutable; kept outside
--                                          the run folder, which the sandbox can write)
--   <state_dir>/claims/<run id>          = {engine, owner} of the run folder, for the reaper
--                                          (also outside the sandbox's reach)
local async = require("demesne.async")
local channel = require("demesne.channel")
local config = require("demesne.config")
local egress = require("demesne.egress")
local engines = require("demesne.engines")
local engine_spec = require("demesne.engines.spec")
local images = require("demesne.images")
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")
local paths = require("demesne.paths")
local teardown = require("demesne.teardown")
local fs = require("core.fs")
local archive = require("core.archive")
local loop = require("core.loop")

local sandbox = {}

local warm_pool -- [pool] set by sandbox.use_pool
local seen = {}   -- [h10] sandbox_id -> {sb, engine, at (loop.now() ms)}: lookup_running
local SEEN_MS = 30000

-- Linux refuses a single argv or environment string of 128 KiB or more (MAX_ARG_STRLEN),
-- and the exec would fail with no output at all: refuse such values up front.
local MAX_ARG_BYTES = 128 * 1024 - 1024

local LABEL = "io.demesne."
local INIT = "/.demesne/init"
local RUN = "/.demesne/run"

--- A user-facing failure: raised with error(); the MCP layer turns it into isError.
local function fail(msg, code) error({ demesne_error = true, message = msg, code = code }, 0) end
sandbox.fail = fail

--- Hooks of the layer above (nested sandboxes, lua/tree), run in order:
---   plan(ctx, o, args)  before a sandbox is made (script_start, create): may change the plan
---                       (output_dir, mounts, workspace, extra_relay, env; sets o.tree, o.endpoint)
---   removing(run_id)    a persistent sandbox is about to be destroyed
---   removed(o, why)     a sandbox's container is gone (script_remove of a plan with o.tree,
---                       destroy, the reaper: o = {run_id})
sandbox.hooks = { plan = {}, removing = {}, removed = {} }
local function run_hooks(name, ...)
  for _, fn in ipairs(sandbox.hooks[name]) do fn(...) end
end
-- removal hooks never stop the cleanup of the caller: a failure is logged
local function run_removal_hooks(name, ...)
  for _, fn in ipairs(sandbox.hooks[name]) do
    local ok, err = pcall(fn, ...)
    if not ok then
      if err == async.CANCELLED then error(err, 0) end
      log.warning("demesne.sandbox", "%s hook: %s", name, tostring(type(err) == "table" and err.message or err))
    end
  end
end

local function check(v, err, code)
  if v == nil then fail(err, code) end
  return v
end

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

--- A new run id: sortable by time, unique ("20261129T101500Z-3fa9c2d1").
function sandbox.new_run_id()
  return os.date("!%Y%m%dT%H%M%SZ") .. "-" .. hex(loop.random(4))
end

local function proc_start(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  local after = s:match("%) (.*)$")
  if not after then return nil end
  local fields = {}
  for x in after:gmatch("%S+") do fields[#fields + 1] = x end
  if fields[1] == "Z" or fields[1] == "X" then return nil end -- exited, not yet reaped: gone
  return fields[20] -- field 22 overall: starttime
end

local owner_id
--- This server instance's owner label: host/pid/starttime (stable for the process).
function sandbox.owner()
  if not owner_id then
    local pid = loop.getpid()
    owner_id = ("%s/%d/%s"):format(loop.hostname(), pid, proc_start(pid) or "0")
  end
  return owner_id
end

local function owner_alive(owner)
  local host, pid, start = tostring(owner):match("^(.*)/(%d+)/(%d+)$")
  if not host then return false end
  if host ~= loop.hostname() then return true end -- another host's: not ours to judge
  -- only a process that is not there is gone: a server out of descriptors (EMFILE) that
  -- cannot open /proc must not take live servers for dead and reap their sandboxes
  local f, _, errno = io.open("/proc/" .. pid .. "/stat")
  if not f then return errno ~= 2 and errno ~= 3 end -- ENOENT, ESRCH: gone
  f:close()
  return proc_start(pid) == start
end

--- The engine adapter, or a failure that says how to start one.
function sandbox.engine()
  return check(engines.get())
end

--- A number for a message: integral values without a fraction (also beyond the 64-bit
--- range, where "%d" cannot print them), others as Lua writes them.
---@param x number
---@return string
function sandbox.num(x)
  if math.tointeger(x) then return ("%d"):format(x) end
  if x == math.floor(x) and x > -math.huge and x < math.huge then return ("%.0f"):format(x) end
  return tostring(x)
end

--- Resolves limits against defaults and ceilings. Returns {memory_mb, cpus, pids}.
function sandbox.limits(l)
  l = l or {}
  local out = {}
  for _, k in ipairs({ "memory_mb", "cpus", "pids" }) do
    local v = l[k] or config.get(k .. "_default")
    local max = config.get(k .. "_max")
    if v > max then
      fail(("limits.%s: %s is above the ceiling of %s set in the configuration"):format(k, sandbox.num(v), sandbox.num(max)))
    end
    if v <= 0 then fail(("limits.%s: must be positive"):format(k)) end
    out[k] = v
  end
  return out
end

--- Validates a caller's env map. Variables demesne sets itself cannot be overridden.
--- Returns a list of "K=V".
function sandbox.env(env, extra)
  local list = {}
  local keys = {}
  for k in pairs(env or {}) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = env[k]
    if not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then fail(("env: %q is not a valid variable name"):format(k)) end
    if k:match("^DEMESNE_") then fail(("env.%s: variables starting with DEMESNE_ are set by demesne and cannot be overridden"):format(k)) end
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
function sandbox.check_command(field, cmd)
  if type(cmd) ~= "string" or cmd == "" then fail(field .. ": must be a non-empty string") end
  if cmd:find("\0", 1, true) then fail(field .. ": contains a NUL byte, which a shell command cannot hold") end
  if #cmd > MAX_ARG_BYTES then
    fail(("%s: %d bytes is more than the %d a single argument can hold; put the script in a file "
      .. "(mount it with files or upload it) and run that file"):format(field, #cmd, MAX_ARG_BYTES))
  end
  return cmd
end

--- Resolves timeout_seconds against the default and ceiling.
function sandbox.timeout(t)
  t = t or config.get("timeout_default")
  local max = config.get("timeout_max")
  if t > max then fail(("timeout_seconds: %s is above the ceiling of %s"):format(sandbox.num(t), sandbox.num(max))) end
  if t < 1 then fail("timeout_seconds: must be at least 1") end
  return math.floor(t)
end

local function dirs(run_id)
  return config.get("output_root") .. "/" .. run_id, config.get("state_dir") .. "/run/" .. run_id
end
sandbox.dirs = dirs

-- Builds the engine-neutral sandbox spec (lua/engines/spec.lua) of a sandbox, checked
-- against the engine's capabilities: an engine that cannot honour all of it is refused.
local function container_spec(o)
  local init = check(config.init_path())
  local lim = o.limits
  local mounts = {
    { source = init, target = INIT, mode = "ro" },
    { source = o.run_dir, target = RUN, mode = "rw", relay = true }, -- exec records and relay sockets
    { source = o.output_dir, target = "/out", mode = "rw" },
  }
  for _, m in ipairs(o.mounts or {}) do mounts[#mounts + 1] = { source = m.host, target = m.target, mode = "ro" } end
  local tmpfs = { { target = "/tmp", mode = "1777", exec = true } }
  if o.workspace then -- a run that can have children shares its /workspace with them: a host folder
    mounts[#mounts + 1] = { source = o.workspace, target = "/workspace", mode = "rw" }
  else
    tmpfs[#tmpfs + 1] = { target = "/workspace", mode = "0777", exec = true }
  end
  if config.get("readonly_rootfs") then
    tmpfs[#tmpfs + 1] = { target = "/var/tmp", mode = "1777", exec = true }
    tmpfs[#tmpfs + 1] = { target = "/root", mode = "0700", exec = true }
    tmpfs[#tmpfs + 1] = { target = "/run", mode = "0755" }
  end
  local now = math.floor(loop.time())
  local labels = {
    [LABEL .. "managed"] = "1",
    [LABEL .. "run_id"] = o.run_id,
    [LABEL .. "tool"] = o.tool or "",
    [LABEL .. "kind"] = o.kind,
    [LABEL .. "owner"] = sandbox.owner(),
    [LABEL .. "expires_at"] = tostring(now + o.ttl),
    [LABEL .. "created_at"] = tostring(now),
    [LABEL .. "output_dir"] = o.output_dir,
    [LABEL .. "run_dir"] = o.run_dir,
    [LABEL .. "image"] = o.image_name,
    [LABEL .. "egress"] = o.egress and o.egress.name or "none",
    [LABEL .. "memory_mb"] = tostring(math.floor(lim.memory_mb)),
    -- open egress is a property of the policy, kept here as it was at create
    [LABEL .. "egress_unrestricted"] = o.egress and o.egress.unrestricted and "1" or "0",
    [LABEL .. "isolation"] = o.isolation or "container",
  }
  for k, v in pairs(o.labels or {}) do labels[LABEL .. k] = v end
  local spec = {
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
    limits = { memory_bytes = math.floor(lim.memory_mb * 1024 * 1024), cpus = lim.cpus, pids = math.floor(lim.pids) },
    runtime = o.isolation == "gvisor" and "gvisor" or nil,
    userns = o.userns or nil,
  }
  check(engine_spec.check(spec, o.engine.capabilities))
  return spec
end

local function default_env(run_id, pol)
  local env = egress.env(pol) -- proxy variables, telemetry off
  env.DEMESNE_RUN_ID = run_id
  env.DEMESNE_OUT = "/out"
  env.HOME = "/root"
  env.PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  return env
end

--- What a status.json says about the OOM killer: a sentence for the result when it killed a
--- process in the sandbox while the command ran (demesne-init's "oom_kills"), else nil.
--- `memory_mb`: the sandbox's limit when known.
---@param st table|nil
---@param memory_mb number|nil
---@return string|nil
function sandbox.oom_note(st, memory_mb)
  local n = st and math.tointeger(st.oom_kills)
  if not n or n <= 0 then return nil end
  return ("the kernel killed %d process%s in the sandbox for lack of memory%s; files in /tmp and /workspace "
    .. "count against the limit"):format(n, n == 1 and "" or "es",
    memory_mb and (" (its limit is %d MiB)"):format(math.floor(memory_mb)) or "")
end

--- Under gVisor a sandbox that passes its memory limit is ended as a whole by the host's
--- OOM killer (gVisor's kernel is one host process), so no status.json says so: a sentence
--- for the result when a gVisor one-shot's container ended with 137 and no status, else nil.
---@param o table  the plan (isolation, limits)
---@param st table|nil  status.json
---@param code integer|nil  the container's exit code
---@return string|nil
function sandbox.gvisor_kill_note(o, st, code)
  if o.isolation ~= "gvisor" or st ~= nil or code ~= 137 then return nil end
  local mb = o.limits and o.limits.memory_mb
  return ("the sandbox was killed (exit 137) before its command finished, most likely for passing its memory "
    .. "limit%s: under gVisor the whole sandbox ends when it does; files in /tmp and /workspace count against it")
    :format(mb and (" of %d MiB"):format(math.floor(mb)) or "")
end

-- The largest status.json read; demesne-init writes well under 8 KiB.
local STATUS_MAX = 65536

-- An integer JSON number within [lo, hi] (JSON numbers decode as floats), or nil.
local function int_in(v, lo, hi)
  if type(v) ~= "number" or v ~= v or v < lo or v > hi or v ~= math.floor(v) then return nil end
  return math.tointeger(v)
end

--- Checks a decoded status.json (demesne-init's record of one command, written inside the
--- sandbox and therefore untrusted: core/init/run.c writes id, exit_code (0-255), signal
--- (null or 1-64), timed_out, cancelled, started_at, finished_at, duration_ms (ms),
--- oom_kills (optional), error (optional)). Returns a new table holding only well-typed
--- fields, or nil and the first field that is wrong.
---@param t any
---@return table|nil status, string|nil why
function sandbox.check_status(t)
  if type(t) ~= "table" then return nil, "it is not a JSON object" end
  local out = { exit_code = int_in(t.exit_code, 0, 255) }
  if not out.exit_code then return nil, "exit_code is not an integer from 0 to 255" end
  for _, k in ipairs({ "timed_out", "cancelled" }) do
    if t[k] ~= nil and type(t[k]) ~= "boolean" then return nil, k .. " is not a boolean" end
    out[k] = t[k] == true
  end
  if t.signal ~= nil and t.signal ~= json.null then
    out.signal = int_in(t.signal, 1, 64)
    if not out.signal then return nil, "signal is not null or an integer from 1 to 64" end
  end
  for _, k in ipairs({ "started_at", "finished_at", "duration_ms", "oom_kills" }) do
    if t[k] ~= nil then
      out[k] = int_in(t[k], 0, 2 ^ 53)
      if not out[k] then return nil, k .. " is not a non-negative integer" end
    end
  end
  if t.error ~= nil then
    if type(t.error) ~= "string" or #t.error > 4096 then return nil, "error is not a string of at most 4096 bytes" end
    out.error = t.error
  end
  return out
end

--- The exit status demesne-init recorded for one command (run_dir/exec/<exec_id>/status.json),
--- read confined (no symlink, no FIFO, a regular file of at most 64 KiB) and checked field
--- by field. Returns the status table, or nil when there is none (the command has not ended,
--- or nothing was recorded). Any other failure (a FIFO, a link, a folder, a huge or
--- malformed file, EMFILE) fails with a message naming the file: it never reads as
--- "no status" or as success.
---@param run_dir string
---@param exec_id string
---@return table|nil
local function read_status(run_dir, exec_id)
  local rel = "exec/" .. exec_id .. "/status.json"
  local d, derr, dcode = fs.opendir(run_dir)
  if not d then
    if dcode == "ENOENT" then return nil end
    fail(("cannot read the command's exit status: %s"):format(tostring(derr)), dcode)
  end
  local s, err, code = d:read(rel, STATUS_MAX)
  d:close()
  if not s then
    if code == "ENOENT" then return nil end
    fail(("cannot read the command's exit status: %s"):format(tostring(err)), code)
  end
  local t, jerr = json.decode(s)
  local st, why = sandbox.check_status(t)
  if not st then
    if t == nil then why = "it is not JSON: " .. tostring(jerr) end
    fail(("the command's exit status %s/%s is not valid (%s); it was written inside the sandbox"):format(run_dir, rel,
      why), "EINVAL")
  end
  return st
end

-- Bounded stdout/stderr of one command, from its log files under the output folder. A log
-- that cannot be read (anything but missing) fails: a result never shows it as empty.
local function collect(output_dir, rel_dir)
  local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
  local prefix = rel_dir and (rel_dir .. "/") or ""
  local so, cut1, c1 = output.view(output_dir, prefix .. "stdout.log", head, tail)
  if not so then fail("cannot read the command's output: " .. tostring(cut1), c1) end
  local se, cut2, c2 = output.view(output_dir, prefix .. "stderr.log", head, tail)
  if not se then fail("cannot read the command's output: " .. tostring(cut2), c2) end
  return so, se, cut1 or cut2
end

--- The isolation levels a sandbox call may ask for (the `isolation` parameter).
sandbox.ISOLATIONS = { container = true, gvisor = true }

--- Decides how a new sandbox is isolated: `isolation` ("container" or "gvisor"; nil = the
--- isolation_default setting) and whether it gets a user namespace (the userns setting,
--- where the engine offers one). Asks the engine what it offers (eng:probe, when the
--- adapter has it). Fails, naming
--- the field, when gVisor is asked for and the engine cannot give it: never a silent
--- downgrade to the plain container. Returns {isolation = string, userns = boolean}.
---@param eng table  the engine adapter
---@param isolation string|nil
---@param open_egress boolean  the sandbox gets the engine's bridge network (open egress)
---@return {isolation: string, userns: boolean}
function sandbox.isolation(eng, isolation, open_egress)
  local field = isolation ~= nil and "isolation" or "isolation_default (configuration)"
  isolation = isolation or config.get("isolation_default")
  if not sandbox.ISOLATIONS[isolation] then
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
  return { isolation = isolation, userns = config.get("userns") == true and caps.userns == true }
end

local function closer(fn) return setmetatable({}, { __close = fn }) end

--- Removes `name` (a file, a link or a folder with everything in it) from the held folder
--- `dir` off the loop (dir:remove_tree: unlinkat on held descriptors, never through a
--- link). Inside a task it waits for the removal; outside one it starts it and returns.
--- Failures are logged and returned.
---@param dir userdata  a core.fs.dir
---@param name string
---@return boolean|nil ok, string|nil err
function sandbox.remove_in(dir, name)
  local function start(cb)
    local w, e, c = dir:remove_tree(name, cb)
    if not w then cb(nil, e, c) end
  end
  local function report(ok, e)
    if not ok then log.warning("demesne.sandbox", "remove %s: %s", name, tostring(e)) end
    return ok, e
  end
  if not async.current() then
    start(report)
    return true
  end
  return report(async.await(start))
end

--- Removes a folder the host made but a sandbox could write (a run folder) with everything
--- in it, as sandbox.remove_in does, from its parent folder. A missing folder is fine.
---@param path string
---@return boolean|nil ok, string|nil err
function sandbox.remove_tree(path)
  local parent, name = tostring(path):match("^(.*)/([^/]+)$")
  if not parent then return nil, "not an absolute path: " .. tostring(path) end
  local d, err, code = fs.opendir(parent ~= "" and parent or "/")
  if not d then
    if code == "ENOENT" then return true end
    log.warning("demesne.sandbox", "remove %s: %s", path, tostring(err))
    return nil, err
  end
  local _ <close> = d
  return sandbox.remove_in(d, name)
end

local function components(p)
  local out = {}
  for c in tostring(p):gmatch("[^/]+") do out[#out + 1] = c end
  return out
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
function sandbox.check_inputs_reach(eng, mounts)
  local state = fs.realpath(config.get("state_dir"))
  local out_root = fs.realpath(config.get("output_root"))
  for _, m in ipairs(mounts or {}) do
    local field = m.field or "input"
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
          local info, err, code = sandbox.state_of(eng, id)
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

local function prepare(args, kind, tool, ttl)
  local eng = sandbox.engine()
  local lim = sandbox.limits(args.limits)
  local mounts = check(paths.inputs(args.files, args.directories))
  sandbox.check_inputs_reach(eng, mounts)
  local pol = check(egress.select(args.egress, #mounts > 0))
  local iso = sandbox.isolation(eng, args.isolation, pol.open == true)
  local run_id = sandbox.new_run_id()
  local output_dir, run_dir = dirs(run_id)
  return {
    egress = pol, engine = eng, limits = lim, mounts = mounts, run_id = run_id, output_dir = output_dir,
    run_dir = run_dir, kind = kind, tool = tool, ttl = ttl, isolation = iso.isolation, userns = iso.userns,
  }
end

-- <state>/claims/<run id>: which engine and which server a run folder belongs to, kept out
-- of the sandbox's reach, so that the reaper can tell a folder a killed server left behind
-- from one another live server (or another engine) still uses.
local function claim_path(run_id) return config.get("state_dir") .. "/claims/" .. run_id end

--- With `create`, makes the output root and the state folder, when missing, readable by this
--- user only (0700). Returns a warning for each that other users can enter. Root in a sandbox is
--- root on the host under a rootful engine: a setuid-root program the sandbox leaves in its
--- output or run folder is one on the host, which only the folders above keep from other
--- users (the sandbox can change the mode of its own /out, not of its parent).
---@param create boolean|nil
---@return string[] warnings
function sandbox.private_roots(create)
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

-- The folders a sandbox writes to are made before it exists: with a user namespace the
-- engine hands them (and what is in them) to the sandbox's root when it starts, so the
-- transfer folder is made here too.
local function make_dirs(o)
  sandbox.private_roots(true)
  check(fs.mkdir_p(o.output_dir, 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/exec", 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/xfer", 448)) -- 0700
  -- after the folder: a claim without its folder is always stale (a young folder without a
  -- claim is left alone by the reaper)
  check(fs.mkdir_p(config.get("state_dir") .. "/claims", 448)) -- 0700
  check(fs.write_atomic(claim_path(o.run_id), json.encode({ engine = o.engine.socket, owner = sandbox.owner() }) .. "\n"))
end

-- demesne-init's relay options: under gVisor it copies from the start (a socket cannot be passed).
local function relay_args(o)
  local relay = egress.relay_args(o.egress)
  for _, a in ipairs(o.extra_relay or {}) do relay[#relay + 1] = a end
  if o.isolation == "gvisor" and #relay > 0 then relay[#relay + 1] = "--relay-copy" end
  return relay
end

sandbox.read_status = read_status
sandbox.prepare = prepare
sandbox.default_env = default_env
sandbox.make_dirs = make_dirs
sandbox.collect = collect
sandbox.owner_alive = owner_alive

--- Checks a sandbox_script call and plans its run; nothing is created yet. `kind` is the
--- container's kind label: "oneshot" (removed when the call ends, or by the reaper once its
--- server is gone) or "job" (a background job's: left to lua/jobs.lua). Returns the plan
--- {engine, run_id, name, output_dir, run_dir, exec_id, timeout, …} that script_start,
--- script_wait and script_result take.
---@param args table  command, image, files, directories, env, timeout_seconds, limits
---@param kind string|nil
---@return table plan
function sandbox.script_prepare(args, kind)
  local timeout = sandbox.timeout(args.timeout_seconds)
  local o = prepare(args, kind or "oneshot", "sandbox_script", timeout + 600)
  o.env = sandbox.env(args.env, default_env(o.run_id, o.egress))
  o.timeout, o.exec_id, o.name = timeout, "main", "demesne-" .. o.run_id
  o.image_arg, o.command = args.image, sandbox.check_command("command", args.command)
  o.args = args -- for the plan hooks (mcp, tree, budget_usd)
  o.caller_env = args.env -- [channel] sandbox.script_env: a warm sandbox gets it with its own run id
  return o
end

--- The environment of a planned one-shot's command: the caller's variables over demesne's
--- own for the plan's run id and egress. A list of "K=V".
---@param o table  the plan
---@return string[]
function sandbox.script_env(o)
  return sandbox.env(o.caller_env, default_env(o.run_id, o.egress))
end

-- The words of `demesne-init run` (after "run") that run a planned one-shot's command.
local function run_args(o)
  local args = { "--id", o.exec_id, "--dir", RUN .. "/exec/" .. o.exec_id,
    "--stdout", o.stdout_path or "/out/stdout.log", "--stderr", "/out/stderr.log",
    "--cwd", o.cwd or "/out", "--timeout", tostring(o.timeout), "--" }
  for _, a in ipairs(o.argv or { "/bin/sh", "-c", o.command }) do args[#args + 1] = a end
  return args
end

-- Runs the plan hooks of a one-shot plan once (run_script runs them before the pool is
-- asked: a tree node's plan changes its folders and relay, and is never pooled).
local function plan_once(ctx, o)
  if o.planned then return end
  o.planned = true
  run_hooks("plan", ctx, o, o.args)
end

--- Starts a planned one-shot run: image, folders, container (with `labels`, names without
--- the io.demesne. prefix, added), start. Sets plan.id. ctx (may be nil) gets image progress.
---@param ctx ToolContext|nil
---@param o table  from script_prepare
---@param labels table<string,string>|nil
function sandbox.script_start(ctx, o, labels)
  plan_once(ctx, o)
  local img = check(images.ensure(o.engine, o.image_arg, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  local relay = relay_args(o)
  if o.control then
    -- [channel] demesne-init waits for the command on its control socket (script_send)
    o.cmd = { "wait", "--control", channel.PATH, table.unpack(relay) }
  else
    o.cmd = { "run", table.unpack(relay) }
    for _, a in ipairs(run_args(o)) do o.cmd[#o.cmd + 1] = a end
  end
  if o.before_create then o.before_create(o) end -- e.g. the vendor route of an agent run
  o.egress_handle = check(egress.start(o)) -- stopped by script_remove
  o.labels = labels
  local spec = container_spec(o)
  -- the create runs in a task of its own: a cancel must not abort it half-way (the engine
  -- may create the container anyway); script_remove waits for it and removes the result
  o.creating = async.spawn("create " .. o.name, function() return o.engine:create(spec) end)
  local function create_and_start()
    local _, id, err, code = o.creating:wait()
    o.id = check(id, err, code)
    check(o.engine:start(o.id))
  end
  -- a call waits for this: removals and warm fills hold back meanwhile (lua/teardown.lua)
  if o.background then create_and_start() else teardown.urgent(create_and_start) end
  if o.control then
    -- [channel] the connection demesne-init answers on; script_send hands it the command
    local eng, rid = o.engine, o.run_id
    o.conn = check(channel.connect_wait(o.run_dir, 30000, function()
      local info = sandbox.state_of(eng, rid) -- by list, not inspect: see state_of
      if info and info.state ~= "running" and info.state ~= "created" then
        return false, ("the sandbox stopped (%s) before demesne-init opened its control socket"):format(info.state)
      end
      return true
    end))
  end
end

--- [channel] Hands a started one-shot's command to demesne-init over the control socket
--- (o.conn, from script_start or a warm sandbox): the command, its environment
--- (script_env) and its timeout. Returns once demesne-init has accepted it; fails otherwise.
---@param o table  the plan
function sandbox.script_send(o)
  o.env = sandbox.script_env(o)
  local ok, err, code = o.conn:send("run", run_args(o), o.env)
  if ok then
    local r
    r, err, code = o.conn:next(10000)
    if r and r.kind == "ok" then return end
    if r then err, code = "demesne-init refused the command: " .. tostring(r.text or r.kind), "EPROTO" end
  end
  fail("sandbox run failed: " .. tostring(err), code)
end

--- Removes a one-shot run's container, if it was created (waiting for a create still in
--- flight). Returns true, or nil and the engine's message.
---@param o table  the plan
---@return boolean|nil ok, string|nil err
function sandbox.script_remove(o)
  -- the proxy stops after the container, and waits for its connections: egress.jsonl is complete
  local _eg <close> = o.egress_handle
  -- a tree node's children end once it has (lua/tree), whatever the way out
  local _tree <close> = setmetatable({}, { __close = function()
    if o.tree and not o.tree_removed then
      o.tree_removed = true
      run_removal_hooks("removed", o)
    end
  end })
  -- demesne-init's control connection closes after the removal: a `wait` that sees the
  -- host hang up exits, and Podman refuses to remove a container caught stopping
  local _conn <close> = o.conn
  if not o.id and o.creating then
    local ok, id = o.creating:wait()
    if ok then o.id = id end
  end
  if not o.id or o.removed then return true end
  local ok, err = o.engine:remove(o.id)
  if not ok then log.warning("demesne.sandbox", "remove %s: %s", o.name or o.id, tostring(err)) end
  o.removed = ok or nil -- a second call (the teardown after an early removal) does nothing
  return ok, err
end

--- Waits up to `ms` for a one-shot container to stop. Returns its exit code, or nil, message,
--- code ("ETIMEDOUT", "ENOENT" when the container is gone, "ENOENGINE" …).
---@param o table  a plan with id (a container id or name)
---@param ms integer
function sandbox.script_wait(o, ms)
  if o.conn then
    -- [channel] demesne-init says "exit CODE" once status.json is written; no engine wait
    -- (Podman's polls). A connection that ends without it: the container's state decides.
    local deadline = loop.now() + ms
    while true do
      local r, err, code = o.conn:next(math.max(math.floor(deadline - loop.now()), 1))
      if r and r.kind == "exit" then return r.code end
      if not r then
        if code == "ETIMEDOUT" then return nil, err, code end
        return async.timeout(math.max(math.min(10000, math.floor(deadline - loop.now())), 1),
          function() return o.engine:wait(o.id) end)
      end
    end
  end
  return async.timeout(ms, function() return o.engine:wait(o.id) end)
end

--- The result table of a finished one-shot run, from demesne-init's status.json and the
--- logs (bounded head and tail); `code, err` are what script_wait returned.
---@param o table  the plan
---@param code integer|nil
---@param err string|nil
---@param duration_ms integer
---@return table result  exit_code, stdout, stderr, output_dir, run_id, duration_ms, timed_out, truncated
function sandbox.script_result(o, code, err, duration_ms)
  local st = read_status(o.run_dir, o.exec_id)
  local timed_out = (st and st.timed_out) or (code == nil and err and err:find("timed out") ~= nil) or false
  local stdout, stderr, truncated = collect(o.output_dir)
  local exit_code = st and st.exit_code or code
  if exit_code == nil then fail("sandbox run failed: " .. tostring(err)) end
  return {
    exit_code = exit_code,
    stdout = stdout,
    stderr = stderr,
    output_dir = o.output_dir,
    run_id = o.run_id,
    duration_ms = duration_ms,
    timed_out = timed_out and true or false,
    truncated = truncated,
    oom_killed = sandbox.oom_note(st, o.limits and o.limits.memory_mb) or sandbox.gvisor_kill_note(o, st, code),
  }
end

--- Runs one command in a fresh container that is removed afterwards (sandbox_script).
--- args: command, image, files, directories, env, timeout_seconds, limits.
--- ctx: the MCP tool context (progress/log). Returns the result table.
function sandbox.run_script(ctx, args)
  local o = sandbox.script_prepare(args)
  -- [channel] the command goes to demesne-init over its control socket; not under gVisor,
  -- where the host cannot connect to a socket made in the sandbox (runsc's --host-uds=open)
  o.control = o.isolation ~= "gvisor"
  local started = loop.hrtime()
  -- the container goes on success, failure, timeout and cancel alike, after the answer
  -- (a tree node's container goes before the answer: its results.json, written once its
  -- children have ended, must be there when the caller reads the answer; see lua/tree)
  local _ <close> = setmetatable({}, { __close = function()
    if o.tree then sandbox.script_remove(o) end
    sandbox.script_teardown(o)
  end })
  plan_once(ctx, o)
  -- [pool] a warm sandbox of the same kind when there is one (lua/pool.lua), else a new one
  if not (warm_pool and warm_pool.claim(ctx, o)) then
    sandbox.script_start(ctx, o)
    if o.control then sandbox.script_send(o) end
  end
  local _hb <close> = require("demesne.progress").heartbeat(ctx)
  -- demesne-init enforces the timeout inside; this host-side deadline covers a stuck engine
  -- or sandbox (the container is removed on the way out either way)
  local code, err = sandbox.script_wait(o, sandbox.deadline_ms(o.timeout))
  -- every process in the sandbox is gone: the proxy's last lines reach egress.jsonl now
  if o.egress_handle then o.egress_handle:stop() end
  return sandbox.script_result(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
end

--- Removes a one-shot's container and run folder in a tracked task of its own
--- (lua/teardown.lua), so the call's answer does not wait for the engine; a server that
--- stops gracefully waits for it, and after a crash the reaper removes the container.
--- `after` (optional) runs in the same task once the container is gone; the plan's own
--- `o.after_call` (optional, set by the pool) runs at once.
---@param o table  the plan
---@param after function|nil
function sandbox.script_teardown(o, after)
  if o.after_call then o.after_call() end -- [pool] e.g. the kind refills
  teardown.spawn("remove " .. tostring(o.name), function()
    sandbox.script_remove(o)
    if o.run_dir then
      sandbox.remove_tree(o.run_dir)
      local ef = sandbox.expiry_file(o.run_dir)
      if ef then os.remove(ef) end
    end
    if after then after() end
  end)
end

--- [pool] The warm pool sandbox.run_script claims from: an object with claim(ctx, plan) ->
--- boolean (lua/pool.lua registers itself when `demesne serve` starts it), or nil.
---@param p table|nil
function sandbox.use_pool(p) warm_pool = p end

--- Creates a persistent sandbox (sandbox_create). Returns {sandbox_id, output_dir, expires_at, image}.
function sandbox.create(ctx, args)
  local ttl = args.ttl_seconds or config.get("ttl_default")
  if ttl > config.get("ttl_max") then
    fail(("ttl_seconds: %s is above the ceiling of %s"):format(sandbox.num(ttl), sandbox.num(config.get("ttl_max"))))
  end
  local o = prepare(args, "persistent", "sandbox_create", ttl)
  o.env = sandbox.env(args.env, default_env(o.run_id, o.egress))
  local started = false
  -- a sandbox that never came up is no tree node either (lua/tree)
  local _tree <close> = setmetatable({}, { __close = function()
    if o.tree and not started then run_removal_hooks("removed", o, "the sandbox could not be started") end
  end })
  run_hooks("plan", ctx, o, args)
  local img = check(images.ensure(o.engine, args.image, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  -- [channel] a control socket, except under gVisor: the host cannot connect to a socket made
  -- in its sandbox (runsc's --host-uds=open); execs there go through the engine's exec API
  o.control = o.isolation ~= "gvisor"
  o.cmd = { "serve", table.unpack(relay_args(o)) }
  if o.control then
    table.insert(o.cmd, 2, "--control")
    table.insert(o.cmd, 3, channel.PATH)
  end
  o.name = "demesne-" .. o.run_id
  local spec = container_spec(o)
  local eg = check(egress.start(o)) -- lives as long as the sandbox (egress.stop in destroy/reap)
  local id, cerr, ccode = o.engine:create(spec)
  if not id then eg:stop() fail(cerr, ccode) end
  local ok, err = o.engine:start(id)
  if not ok then
    o.engine:remove(id)
    eg:stop()
    sandbox.remove_tree(o.run_dir)
    fail(err)
  end
  started = true
  -- [channel] answer once demesne-init listens on its control socket, so that the first
  -- exec does not find it missing (and fall back to the exec API); a few ms at most
  if o.control then
    local conn, cerr2 = channel.connect_wait(o.run_dir, 5000, function()
      local info = sandbox.state_of(o.engine, o.run_id)
      return not info or info.state == "running" or info.state == "created"
    end)
    if conn then conn:close() else log.warning("demesne.sandbox", "sandbox %s: %s", o.run_id, tostring(cerr2)) end
  end
  local expires = math.floor(loop.time()) + ttl
  sandbox.write_expiry(o.run_dir, expires)
  return {
    sandbox_id = o.run_id,
    output_dir = o.output_dir,
    expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", expires),
    image = img.name,
    mcp = o.endpoint and { url = o.endpoint.url, token = o.endpoint.token } or nil,
  }
end

-- <state>/run/<id> -> <state>/expiry/<id>: out of the sandbox's reach.
local function expiry_file(run_dir)
  local state, id = tostring(run_dir):match("^(.*)/run/([^/]+)$")
  return state and (state .. "/expiry/" .. id)
end

--- The file that holds a renewed expiry for the sandbox whose run folder is run_dir
--- (<state>/expiry/<run id>), or nil for a run folder elsewhere.
---@param run_dir string
---@return string|nil
sandbox.expiry_file = expiry_file

--- Records a renewed expiry (unix seconds) for the sandbox whose run folder is run_dir.
function sandbox.write_expiry(run_dir, expires)
  local f = expiry_file(run_dir)
  if not f then return end
  fs.mkdir_p(f:match("^(.*)/"), 448) -- 0700
  fs.write_atomic(f, tostring(expires))
end

local function expiry_of(labels)
  local e = tonumber(labels[LABEL .. "expires_at"]) or 0
  local f = expiry_file(labels[LABEL .. "run_dir"])
  local s = f and fs.read_file(f)
  if s and tonumber(s) and tonumber(s) > e then e = tonumber(s) end
  return e
end

--- Looks up a persistent sandbox by id. Returns {id, name, labels, output_dir, run_dir,
--- running} or fails with a message that says it is unknown or gone.
function sandbox.lookup(eng, sandbox_id)
  if type(sandbox_id) ~= "string" or not sandbox_id:match("^[%w%-]+$") then
    fail(("sandbox_id: %q is not a sandbox id"):format(tostring(sandbox_id)))
  end
  local info, err, code = sandbox.state_of(eng, sandbox_id)
  if not info then
    if code == "ENOENT" then fail(("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(sandbox_id), "ENOENT") end
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
    expires_at = expiry_of(labels),
    memory_mb = tonumber(labels[LABEL .. "memory_mb"]),
  }
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
function sandbox.state_of(eng, run_id)
  local list, err, code = eng:list({ LABEL .. "managed=1", LABEL .. "run_id=" .. tostring(run_id) })
  if not list then return nil, err, code end
  for _, c in ipairs(list) do
    if (c.labels or {})[LABEL .. "run_id"] == run_id then return c end
  end
  return nil, ("no sandbox %s"):format(tostring(run_id)), "ENOENT"
end

--- Fails with a plain message when a persistent sandbox is no longer running (destroyed,
--- expired or stopped while a command or transfer used it). Returns nothing otherwise.
--- A removal can still be under way when the command's stream ends, so this watches the
--- container for up to 2 s before concluding it is alive.
function sandbox.check_alive(eng, sandbox_id)
  seen[sandbox_id] = nil -- asked because something went wrong: look it up afresh next time
  for _ = 1, 10 do
    local info, _, code = sandbox.state_of(eng, tostring(sandbox_id))
    if not info and code == "ENOENT" then
      fail(("sandbox_id: sandbox %s was destroyed (or expired) while the call was running"):format(sandbox_id), "ENOENT")
    end
    -- (a container being removed is not running either: ask about removal first)
    if info and info.state == "removing" then
      fail(("sandbox_id: sandbox %s was destroyed while the call was running"):format(sandbox_id), "ENOENT")
    end
    if info and info.state ~= "running" then
      fail(("sandbox_id: sandbox %s stopped while the call was running"):format(sandbox_id))
    end
    async.sleep(200)
  end
end

-- Renews the TTL by the sandbox's own ttl_seconds from now; never shortens it. `busy`
-- (seconds) keeps it alive at least that long: an exec that may run for its whole timeout
-- must not see its sandbox expire under it.
local function renew(sb, busy)
  local created = tonumber(sb.labels[LABEL .. "created_at"]) or 0
  local ttl = (tonumber(sb.labels[LABEL .. "expires_at"]) or 0) - created
  if ttl <= 0 then ttl = config.get("ttl_default") end
  if busy and busy + 60 > ttl then ttl = busy + 60 end
  local new = math.floor(loop.time()) + ttl
  -- [h10] written (with an fsync) when it moves by a tenth of the TTL or a minute, not on
  -- every exec: back-to-back execs would each pay for it
  if new >= sb.expires_at + math.min(60, ttl // 10) and new > sb.expires_at then
    sandbox.write_expiry(sb.run_dir, new)
    sb.expires_at = new
  end
end

local exec_seq = 0

-- [h10] sandbox_exec's lookups: a persistent sandbox found running is remembered for a
-- while (its labels never change), so back-to-back execs do not each ask the engine. One
-- that has gone or stopped meanwhile is found out as before: its control socket no longer
-- answers, the exec API fails, and check_alive (which forgets it) says what happened.
local function lookup_running(eng, id)
  local s = seen[id]
  if s and s.engine == eng and loop.now() - s.at < SEEN_MS then
    s.sb.expires_at = expiry_of(s.sb.labels) -- the renewed expiry lives in a file
    return s.sb
  end
  local sb = sandbox.lookup(eng, id)
  for k, v in pairs(seen) do -- the stale ones go (the table holds the sandboxes of the last 30 s)
    if loop.now() - v.at >= SEEN_MS then seen[k] = nil end
  end
  seen[id] = sb.running and { sb = sb, engine = eng, at = loop.now() } or nil
  return sb
end

--- Checks a sandbox_exec call and plans it; nothing runs yet. Renews the sandbox's TTL.
--- Returns the plan {engine, sb, container, exec_id, rel, dir, argv, env, timeout,
--- output_dir, run_dir, log_dir} that exec_run, exec_kill and exec_result take.
---@param args table  sandbox_id, command, timeout_seconds, cwd, env
---@return table plan
function sandbox.exec_prepare(args)
  local eng = sandbox.engine()
  local timeout = sandbox.timeout(args.timeout_seconds)
  local sb = lookup_running(eng, args.sandbox_id)
  if not sb.running then fail(("sandbox_id: sandbox %s is not running"):format(args.sandbox_id)) end
  local pol = sb.labels[LABEL .. "egress"]
  if pol then -- after a server restart the sandbox's proxy has to be started again
    local _, eerr = egress.ensure(args.sandbox_id, sb.run_dir, sb.output_dir, pol)
    if eerr then log.warning("demesne.sandbox", "sandbox %s: %s", args.sandbox_id, eerr) end
  end
  local cwd = args.cwd or "/out"
  if cwd:sub(1, 1) ~= "/" then fail("cwd: must be an absolute path inside the sandbox") end
  local env = sandbox.env(args.env)
  sandbox.check_command("command", args.command)
  renew(sb, timeout)
  exec_seq = exec_seq + 1
  local exec_id = os.date("!%Y%m%dT%H%M%SZ") .. "-" .. exec_seq .. "-" .. hex(loop.random(2))
  local rel = "exec/" .. exec_id
  local dir = RUN .. "/exec/" .. exec_id
  local run = { "--id", exec_id, "--dir", dir,
    "--stdout", "/out/" .. rel .. "/stdout.log", "--stderr", "/out/" .. rel .. "/stderr.log",
    "--cwd", cwd, "--timeout", tostring(timeout), "--", "/bin/sh", "-c", args.command }
  return {
    engine = eng, sb = sb, container = sb.id, exec_id = exec_id, rel = rel, dir = dir, env = env,
    timeout = timeout, output_dir = sb.output_dir, run_dir = sb.run_dir, log_dir = sb.output_dir .. "/" .. rel,
    run_args = run, argv = { INIT, "run", table.unpack(run) },
    started = async.event(), -- set(true) once the command runs, set(false) when that is not known
  }
end

--- The host-side deadline of a command that may run `timeout_s` seconds in a sandbox: its
--- timeout plus exec_grace_seconds, in ms. demesne-init enforces the timeout inside; this
--- bounds the host's wait when demesne-init itself does not answer (stopped with SIGSTOP
--- by the sandbox, or hung).
---@param timeout_s number
---@return integer ms
function sandbox.deadline_ms(timeout_s)
  return math.floor((timeout_s + config.get("exec_grace_seconds")) * 1000)
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
function sandbox.stop_unresponsive(eng, container, sandbox_id, what)
  log.warning("demesne.sandbox", "sandbox %s: %s; stopping it as unresponsive", tostring(sandbox_id or container), what)
  local ok, err = (eng.kill and eng.kill or eng.remove)(eng, container, "KILL")
  if sandbox_id then
    seen[sandbox_id] = nil -- the next call looks it up afresh and finds it stopped
    egress.stop(sandbox_id)
  end
  return ("%s: the sandbox's demesne-init is not responding (stopped or hung), so sandbox %s %s; its output "
    .. "folder is kept. sandbox_destroy removes it; create a new sandbox to go on"):format(what,
    tostring(sandbox_id or container), ok and "was stopped" or ("could not be stopped (" .. tostring(err) .. ")"))
end

--- Runs a planned exec and waits for it, at most its timeout plus exec_grace_seconds:
--- through demesne-init's control socket when the sandbox has one (a few milliseconds to
--- start), else through the engine's exec API. Returns the exit code `demesne-init run`
--- reported, or nil, message, code ("ETIMEDOUT": the deadline passed and the sandbox did
--- not answer). Sets e.started once the command runs. Cancelling the task stops the wait
--- only: call exec_kill.
---@param e table  the plan from exec_prepare
---@return integer|nil code, string|nil err, string|nil ecode
function sandbox.exec_run(e)
  -- [channel] a sandbox made before the control socket existed (or one that removed it)
  -- has none: the exec API then runs the same `demesne-init run`
  local conn = channel.connect(e.run_dir)
  if not conn then
    e.started.set(false)
    return e.engine:exec(e.container, e.argv, { env = e.env, timeout_ms = sandbox.deadline_ms(e.timeout) })
  end
  local _ <close> = conn
  local ok, err, code = conn:send("run", e.run_args, e.env)
  if not ok then
    e.started.set(false)
    return nil, "sandbox_exec: the control socket: " .. tostring(err), code
  end
  -- the command records its own end (status.json); the host waits at most as long as it may run
  local deadline = loop.now() + sandbox.deadline_ms(e.timeout)
  while true do
    local r
    r, err, code = conn:next(math.max(math.floor(deadline - loop.now()), 1))
    if not r then
      e.started.set(false)
      return nil, "sandbox_exec: " .. tostring(err), code
    end
    if r.kind == "started" then e.started.set(true) end
    if r.kind == "exit" then
      e.started.set(true)
      return r.code
    end
    if r.kind == "error" then
      e.started.set(false)
      return nil, "sandbox_exec: demesne-init refused the command: " .. r.text, "EPROTO"
    end
  end
end

--- Kills a planned exec's whole process group inside the sandbox (demesne-init kill:
--- SIGTERM, SIGKILL after 2 s), through the sandbox's control socket when it has one, else
--- through the engine's exec API. Works after a restart: needs only the container, the
--- exec's folder and the sandbox's id. The kill itself has a host-side deadline (its own
--- 5 s plus exec_grace_seconds): a sandbox that does not answer it is stopped
--- (stop_unresponsive). Returns the kill's exit code, or nil, message, "ETIMEDOUT".
---@param eng table       the engine adapter
---@param container string
---@param dir string      the exec's folder inside the sandbox (/.demesne/run/exec/<id>)
---@param sandbox_id string|nil
function sandbox.exec_kill(eng, container, dir, sandbox_id)
  local args = { "--dir", dir, "--signal", "TERM", "--grace", "2" }
  local function unresponsive()
    return nil, sandbox.stop_unresponsive(eng, container, sandbox_id,
      ("cancelling the command: demesne-init kill did not end within %d s"):format(sandbox.deadline_ms(5) // 1000)),
      "ETIMEDOUT"
  end
  -- [channel] the run folder of a persistent sandbox is <state_dir>/run/<sandbox id>
  local conn = type(sandbox_id) == "string" and sandbox_id:match("^[%w%-]+$") and
    channel.connect(select(2, dirs(sandbox_id)))
  if conn then
    local _ <close> = conn
    if conn:send("kill", args) then
      local deadline = loop.now() + sandbox.deadline_ms(5)
      while true do
        local r, _, code = conn:next(math.max(math.floor(deadline - loop.now()), 1))
        if r and r.kind == "exit" then return r.code end
        if not r and code == "ETIMEDOUT" then return unresponsive() end
        if not r or r.kind == "error" then break end -- not a demesne-init that answers: the exec API
      end
    end
  end
  local code, err, ecode = eng:exec(container, { INIT, "kill", table.unpack(args) },
    { timeout_ms = sandbox.deadline_ms(5) })
  if code == nil and ecode == "ETIMEDOUT" then return unresponsive() end
  return code, err, ecode
end

--- The result table of a finished exec, from status.json and its logs; `code` is what
--- exec_run returned.
---@param e table  the plan from exec_prepare
---@param code integer
---@param duration_ms integer
---@return table result  exit_code, stdout, stderr, output_dir, log_dir, duration_ms, timed_out, truncated, expires_at
function sandbox.exec_result(e, code, duration_ms)
  local st = read_status(e.run_dir, e.exec_id)
  local stdout, stderr, truncated = collect(e.output_dir, e.rel)
  return {
    exit_code = st and st.exit_code or code,
    stdout = stdout,
    stderr = stderr,
    output_dir = e.output_dir,
    log_dir = e.log_dir,
    duration_ms = duration_ms,
    timed_out = st and st.timed_out or false,
    truncated = truncated,
    expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", e.sb.expires_at),
    oom_killed = sandbox.oom_note(st, e.sb.memory_mb),
  }
end

--- Runs a command in a persistent sandbox (sandbox_exec).
--- args: sandbox_id, command, timeout_seconds, cwd, env. Returns the result table.
function sandbox.exec(ctx, args)
  local e = sandbox.exec_prepare(args)
  local started = loop.hrtime()
  local finished = false
  -- cancelling the call kills the command's whole process group inside the sandbox
  local _ <close> = setmetatable({}, { __close = function()
    if not finished then sandbox.exec_kill(e.engine, e.container, e.dir, args.sandbox_id) end
  end })
  local _hb <close> = require("demesne.progress").heartbeat(ctx)
  local code, err, ecode = sandbox.exec_run(e)
  finished = true
  if code == nil and ecode == "ETIMEDOUT" and not read_status(e.run_dir, e.exec_id) then
    fail("sandbox_exec: " .. sandbox.stop_unresponsive(e.engine, e.container, args.sandbox_id,
      ("the command did not end within its timeout (%d s) plus a grace of %s s"):format(e.timeout,
        sandbox.num(config.get("exec_grace_seconds")))), "ETIMEDOUT")
  end
  -- a sandbox destroyed (or expired) under a running command: say so, not the engine's text
  if not read_status(e.run_dir, e.exec_id) then sandbox.check_alive(e.engine, args.sandbox_id) end
  if code == nil then fail("sandbox_exec failed: " .. tostring(err)) end
  return sandbox.exec_result(e, code, math.floor((loop.hrtime() - started) / 1e6))
end

-- Runs argv (no shell) in a persistent sandbox through demesne-init and waits for it.
-- Returns exit_code, stderr text (bounded). Used for file transfers.
local function run_quiet(eng, sb, argv)
  exec_seq = exec_seq + 1
  local id = ("xfer-%d-%s"):format(exec_seq, hex(loop.random(4)))
  local dir = RUN .. "/exec/" .. id
  local cmd = { INIT, "run", "--id", id, "--dir", dir, "--timeout", "3600", "--" }
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local code, err, ecode = eng:exec(sb.id, cmd, { env = json.array(), timeout_ms = sandbox.deadline_ms(3600) })
  if code == nil and ecode == "ETIMEDOUT" then
    fail("file transfer failed: " .. sandbox.stop_unresponsive(eng, sb.id, sb.labels[LABEL .. "run_id"],
      "the transfer did not end within its hour plus the grace"), "ETIMEDOUT")
  end
  if code == nil then
    sandbox.check_alive(eng, sb.labels[LABEL .. "run_id"])
    fail("file transfer failed: " .. tostring(err))
  end
  local run = check(fs.opendir(sb.run_dir))
  local _ <close> = run
  local _rm <close> = closer(function() sandbox.remove_in(run, "exec/" .. id) end)
  local st = read_status(sb.run_dir, id)
  local msg, merr = output.view(sb.run_dir, "exec/" .. id .. "/stderr.log", 2048, 2048)
  if not msg then fail("file transfer: " .. tostring(merr)) end
  return st and st.exit_code or code, msg:match("^(.*%S)") or "", st -- (linear: not "%s+$")
end

-- A transfer step that failed in an unexpected way: says when the sandbox is gone or ran
-- out of memory (its tmpfs folders count against the limit), else the exit code and stderr.
local function transfer_failure(eng, sb, what, code, msg, st)
  sandbox.check_alive(eng, sb.labels[LABEL .. "run_id"])
  local oom = sandbox.oom_note(st, sb.memory_mb)
  if not oom and code == 137 then
    oom = "it was killed (exit 137): out of memory or out of processes, most likely"
  end
  fail(("%s failed (exit %s)%s%s"):format(what, tostring(code), msg ~= "" and (": " .. msg) or "",
    oom and ("; " .. oom) or ""))
end

-- Transfers go through a tar in the sandbox's run folder (bind-mounted at /.demesne/run)
-- and the image's own tar, not the engine's archive API: Docker's archive API neither
-- sees nor writes tmpfs mounts (/tmp, /workspace), where an upload would vanish.
-- The sandbox can write that folder while the host works in it, so the host holds the
-- xfer folder by descriptor (core.fs.dir) and touches the tar only through it. Returns
-- the held folder (closed, with the tar removed, when the returned guard closes), the
-- tar's name in it and its path inside the sandbox.
local function xfer_dir(sb)
  local run = check(fs.opendir(sb.run_dir))
  local ok, err, code = run:mkdir("xfer", 448) -- 0700
  if not ok and code ~= "EEXIST" then
    run:close()
    fail("file transfer: " .. tostring(err), code)
  end
  local x, xerr = run:opendir("xfer")
  run:close()
  if not x then
    fail(("file transfer refused: the sandbox's run folder has an xfer entry that is not a plain folder; "
      .. "refusing to work through it (%s)"):format(tostring(xerr)))
  end
  local name = hex(loop.random(8)) .. ".tar"
  local guard = closer(function()
    x:unlink(name)
    x:close()
  end)
  return x, name, RUN .. "/xfer/" .. name, guard
end

-- Waits inside the current task for a core.* work started by `start(cb)` (which returns
-- a core.fs.work, or nil, msg, code). Cancelling the task cancels the work.
local function await_work(start)
  return async.await(function(cb)
    local w, err, code = start(cb)
    if not w then
      cb(nil, err, code)
      return nil
    end
    return function() w:cancel() end
  end)
end

-- Bytes of the tar the sandbox may write for a download of at most `max` bytes of files:
-- room for headers (512 B per entry, pax records for long names) on top of the data.
local function download_tar_cap(max)
  return max + math.max(64 * 1024 * 1024, max // 8)
end

--- Copies a host file or folder into a sandbox (sandbox_upload).
--- args: sandbox_id, src (host path inside an allowed root), dst (absolute path in the sandbox).
--- The tar is packed off the loop into a file created O_EXCL in the held xfer folder;
--- src is walked by descriptors (never through a link) and its files' sizes (sparse files
--- count in full) are summed against upload_max_bytes before anything is written.
function sandbox.upload(ctx, args)
  local eng = sandbox.engine()
  local src = check(paths.check("src", args.src, "any"))
  local dst = args.dst
  if type(dst) ~= "string" or dst:sub(1, 1) ~= "/" then fail("dst: must be an absolute path inside the sandbox") end
  dst = dst:gsub("/+$", "")
  local parent, base = dst:match("^(.*)/([^/]+)$")
  if not base or base == "." or base == ".." then fail("dst: must name a file or folder, e.g. /out/data.csv") end
  if parent == "" then parent = "/" end
  local sb = sandbox.lookup(eng, args.sandbox_id)
  -- host inputs plus open egress is the exfiltration shape sandbox_create refuses: open as
  -- the policy was at create (label), or as the policy of that name is now (the proxy of a
  -- re-attached sandbox follows the current file)
  local pol_name = sb.labels[LABEL .. "egress"] or "none"
  if sb.labels[LABEL .. "egress_unrestricted"] == "1" or egress.is_unrestricted(pol_name) then
    fail(("sandbox_id: %s has open egress (policy %q); host files cannot be uploaded into it"):format(args.sandbox_id,
      pol_name))
  end
  -- tar would silently replace an existing file with a folder, or an empty folder with a file
  -- (the checks exit 1 for a clash; anything else is a failure of the check itself)
  if fs.stat(src).type == "directory" then
    local code, msg, st = run_quiet(eng, sb, { "/bin/sh", "-c", '[ ! -e "$1" ] || [ -d "$1" ]', "sh", dst })
    if code == 1 then fail(("dst: %s exists in the sandbox and is not a folder; a folder cannot replace it"):format(dst)) end
    if code ~= 0 then transfer_failure(eng, sb, "checking dst in the sandbox", code, msg, st) end
  else
    local code, msg, st = run_quiet(eng, sb, { "/bin/sh", "-c", '[ ! -d "$1" ]', "sh", dst })
    if code == 1 then
      fail(("dst: %s is a folder in the sandbox; name the file's own path inside it (e.g. %s/%s)"):format(dst, dst, src:match("[^/]+$")))
    end
    if code ~= 0 then transfer_failure(eng, sb, "checking dst in the sandbox", code, msg, st) end
  end
  local max = config.get("upload_max_bytes")
  local xfer, name, sandbox_tar, guard = xfer_dir(sb)
  local _ <close> = guard
  local f <close>, ferr, fcode = xfer:open(name, "wx", 420) -- 0644
  if not f then fail("file transfer: " .. tostring(ferr), fcode) end
  local stats, perr, pcode = await_work(function(cb)
    return archive.pack_to(f, { { src = src, name = base } }, { max_bytes = max, max_entries = 1000000, strict = true },
      cb)
  end)
  f:close()
  if not stats then
    if pcode == "E2BIG" and tostring(perr):find("max_bytes", 1, true) then
      fail(("src: %s holds more than %s bytes of files, over upload_max_bytes (%s); raise it with "
        .. "DEMESNE_UPLOAD_MAX_BYTES or upload less"):format(src, sandbox.num(max), sandbox.num(max)))
    end
    fail(("src: %s cannot be packed: %s"):format(src, tostring(perr)), pcode)
  end
  -- --no-overwrite-dir: uploading into an existing folder (/tmp) keeps its mode and owner
  local code, msg, st = run_quiet(eng, sb, { "tar", "-x", "--no-same-owner", "--no-overwrite-dir", "-f", sandbox_tar, "-C", parent })
  if code ~= 0 then
    if msg:find("Cannot open: No such file", 1, true) or msg:find("Cannot chdir", 1, true) then
      fail(("dst: the folder %s does not exist in the sandbox"):format(parent))
    end
    if msg:find("File exists", 1, true) or msg:find("Is a directory", 1, true) then
      fail(("dst: %s is a folder in the sandbox; name the file's own path inside it (e.g. %s/%s)"):format(dst, dst, src:match("[^/]+$")))
    end
    transfer_failure(eng, sb, "upload to " .. dst, code, msg, st)
  end
  renew(sb)
  return { sandbox_id = args.sandbox_id, src = src, dst = dst, files = stats.files, bytes = stats.bytes }
end

--- Copies a file or folder out of a sandbox into <output_dir>/downloads/<basename>
--- (sandbox_download). The sandbox's own tar writes the archive into its run folder (at
--- most download_max_bytes plus room for headers: RLIMIT_FSIZE through `ulimit -f`); the
--- host opens it through the held xfer folder (a regular file only) and extracts it off the
--- loop into a fresh staging folder under the held downloads folder, writing every entry
--- itself on held descriptors. Entries with absolute paths, "..", links leading outside,
--- devices, or more than 256 levels are refused; the unpacked size is capped by
--- download_max_bytes while writing (holes of sparse files count). The result is then
--- renamed into place within the held downloads folder.
function sandbox.download(ctx, args)
  local eng = sandbox.engine()
  local src = args.src
  if type(src) ~= "string" or src:sub(1, 1) ~= "/" then fail("src: must be an absolute path inside the sandbox") end
  for c in src:gmatch("[^/]+") do
    if c == ".." then fail("src: must not contain '..'") end
  end
  src = src:gsub("/+$", "")
  local top = src:match("^/+([^/]+)")
  if top == "proc" or top == "sys" then
    -- kernel files claim a size of 0 (or 4096) whatever they hold: a copy would be empty or cut
    fail(("src: %s is under /%s, whose files are generated by the kernel; copy one first "
      .. "(e.g. sandbox_exec 'cat %s > /out/x') and download that"):format(src, top, src))
  end
  local parent, base = src:match("^(.*)/([^/]+)$")
  if not base or base == "." then fail("src: must name a file or folder (not / and not ending in /.)") end
  if parent == "" then parent = "/" end
  local sb = sandbox.lookup(eng, args.sandbox_id)
  local max = config.get("download_max_bytes")
  local cap = download_tar_cap(max)
  -- the sandbox can write its own /out: the downloads folder is held by descriptor and
  -- never followed through a link it planted there
  local out = check(fs.opendir(sb.output_dir))
  local _o <close> = out
  local mk, merr, mcode = out:mkdir("downloads", 493) -- 0755 (Lua has no octal literals)
  if not mk and mcode ~= "EEXIST" then fail("download: " .. tostring(merr), mcode) end
  local dl, derr = out:opendir("downloads")
  if not dl then
    fail(("the sandbox's output folder has a downloads entry that is not a plain folder; refusing to write "
      .. "through it (%s)"):format(tostring(derr)))
  end
  local _d <close> = dl
  local xfer, name, sandbox_tar, guard = xfer_dir(sb)
  local _x <close> = guard
  -- ulimit -f counts 512-byte blocks (POSIX sh): tar is stopped (SIGXFSZ) at the cap
  local code, msg, xst = run_quiet(eng, sb, { "/bin/sh", "-c", 'ulimit -f "$1" && shift && exec tar "$@"', "sh",
    tostring(cap // 512 + 1), "-c", "-f", sandbox_tar, "-C", parent, "--", base })
  if code ~= 0 then
    if msg:find("No such file", 1, true) then fail(("src: %s does not exist in the sandbox"):format(src)) end
    if code == 128 + 25 or msg:find("File too large", 1, true) then
      fail(("src: %s holds more than download_max_bytes (%s bytes) of files and archive headers; raise it with "
        .. "DEMESNE_DOWNLOAD_MAX_BYTES or download less"):format(src, sandbox.num(max)), "E2BIG")
    end
    transfer_failure(eng, sb, "download of " .. src, code, msg, xst)
  end
  local tar, terr = xfer:open(name, "r")
  if not tar then fail("download refused: the archive written in the sandbox cannot be read: " .. tostring(terr)) end
  local _t <close> = tar
  local staging = ".incoming-" .. hex(loop.random(6))
  local stats, xerr, xcode = await_work(function(cb)
    return archive.extract_at(tar, dl, staging, { max_bytes = max, max_entries = 100000, max_archive_bytes = cap }, cb)
  end)
  if not stats then fail("download refused: " .. tostring(xerr), xcode) end
  -- the extraction removed its folder on failure; after success it goes here
  local _s <close> = closer(function() sandbox.remove_in(dl, staging) end)
  local moved, rerr, rcode
  for _ = 1, 3 do -- the sandbox may put something at the target again meanwhile
    sandbox.remove_in(dl, base)
    moved, rerr, rcode = dl:rename(staging .. "/" .. base, dl, base, true)
    if moved or (rcode ~= "EEXIST" and rcode ~= "ENOTEMPTY") then break end
  end
  if not moved then
    if rcode == "ENOENT" then fail(("download refused: the archive from the sandbox does not hold %s"):format(base)) end
    fail("download: cannot move the result into place: " .. tostring(rerr), rcode)
  end
  return { sandbox_id = args.sandbox_id, src = src, path = sb.output_dir .. "/downloads/" .. base, files = stats.files,
    bytes = stats.bytes }
end

--- Destroys a persistent sandbox. Idempotent: a gone sandbox is success, with status
--- "already gone". Returns {sandbox_id, status}.
function sandbox.destroy(ctx, args)
  local eng = sandbox.engine()
  local ok, sb = pcall(sandbox.lookup, eng, args.sandbox_id)
  if not ok then
    if type(sb) == "table" and sb.code == "ENOENT" then
      return { sandbox_id = args.sandbox_id, status = "already gone" }
    end
    error(sb, 0)
  end
  run_removal_hooks("removing", args.sandbox_id) -- its children go first (lua/tree)
  local removed, how = eng:remove(sb.id)
  if not removed then fail(how) end
  run_removal_hooks("removed", { run_id = args.sandbox_id })
  seen[args.sandbox_id] = nil
  egress.stop(args.sandbox_id)
  if sb.run_dir then
    sandbox.remove_tree(sb.run_dir)
    local ef = expiry_file(sb.run_dir)
    if ef then os.remove(ef) end
  end
  return { sandbox_id = args.sandbox_id, status = how == "gone" and "already gone" or "destroyed",
    output_dir = sb.output_dir }
end

--- Lists the live persistent sandboxes of this configuration (those whose run folder is
--- under this state_dir): {sandboxes = {{sandbox_id, image, created_at, expires_at, output_dir, state}}}.
function sandbox.list()
  local eng = sandbox.engine()
  local list = check(eng:list({ LABEL .. "managed=1", LABEL .. "kind=persistent" }))
  local out = json.array()
  local mine = config.get("state_dir") .. "/run"
  for _, c in ipairs(list) do
    local l = c.labels or {}
    if paths.within(tostring(l[LABEL .. "run_dir"]), mine) then out[#out + 1] = {
      sandbox_id = l[LABEL .. "run_id"],
      image = l[LABEL .. "image"],
      created_at = os.date("!%Y-%m-%dT%H:%M:%SZ", tonumber(l[LABEL .. "created_at"]) or 0),
      expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", expiry_of(l)),
      output_dir = l[LABEL .. "output_dir"],
      state = c.state,
    } end
  end
  table.sort(out, function(a, b) return tostring(a.sandbox_id) < tostring(b.sandbox_id) end)
  return { sandboxes = out }
end

-- A background job's container is left to lua/jobs.lua while its record says running
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
  return sandbox.remove_tree(path)
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
          -- [pool] a warm sandbox no call claimed, whose container is already gone
          if fs.lstat(state .. "/pool/" .. id) then
            sandbox.remove_tree(config.get("output_root") .. "/" .. id)
            os.remove(state .. "/pool/" .. id)
          end
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
--- engine's state. Returns the number of containers removed.
function sandbox.reap()
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
    if (expired or orphan) and not (kind == "job" and job_running(l)) then
      if eng:remove(c.id) then
        n = n + 1
        if l[LABEL .. "run_id"] then
          egress.stop(l[LABEL .. "run_id"])
          run_removal_hooks("removed", { run_id = l[LABEL .. "run_id"] }, expired and "expired" or "its server is gone")
        end
        local rd = l[LABEL .. "run_dir"]
        if rd and paths.within(rd, config.get("state_dir") .. "/run") then
          sandbox.remove_tree(rd)
          os.remove(expiry_file(rd))
          os.remove(claim_path(rd:match("([^/]+)$")))
          -- [pool] a warm sandbox no call claimed: its output folder holds nothing of anyone's
          local rid, od = l[LABEL .. "run_id"], l[LABEL .. "output_dir"]
          local mark = l[LABEL .. "pool"] and type(rid) == "string" and rid:match("^[%w%-]+$")
            and (config.get("state_dir") .. "/pool/" .. rid)
          if mark and fs.lstat(mark) then
            if od and paths.within(od, config.get("output_root")) then sandbox.remove_tree(od) end
            os.remove(mark)
          end
        end
        log.info("demesne.reaper", "removed %s (%s)", l[LABEL .. "run_id"] or c.id, expired and "expired" or "owner gone")
      end
    end
  end
  -- the list again: what was just removed no longer claims its folder
  local now_list = eng:list({ LABEL .. "managed=1" })
  if now_list then reap_leftovers(eng, now_list) end
  return n
end

return sandbox
