-- The sandbox lifecycle over an engine adapter: limits, mounts, output folders, labels,
-- TTL, one-shot runs, execs through demesne-init, and the reaper.
--
-- Host layout (DESIGN.md "State on the host"):
--   <output_root>/<run id>/              = /out of that sandbox (stdout.log, stderr.log, exec/<n>/…)
--   <state_dir>/run/<run id>/            = /.demesne/run (exec records written by demesne-init)
--   <state_dir>/expiry/<run id>          = renewed expiry (labels are immutable; kept outside
--                                          the run folder, which the sandbox can write)
local async = require("demesne.async")
local config = require("demesne.config")
local egress = require("demesne.egress")
local engines = require("demesne.engines")
local engine_spec = require("demesne.engines.spec")
local images = require("demesne.images")
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")
local paths = require("demesne.paths")
local fs = require("core.fs")
local archive = require("core.archive")
local loop = require("core.loop")

local sandbox = {}

-- Linux refuses a single argv or environment string of 128 KiB or more (MAX_ARG_STRLEN),
-- and the exec would fail with no output at all: refuse such values up front.
local MAX_ARG_BYTES = 128 * 1024 - 1024

local LABEL = "io.demesne."
local INIT = "/.demesne/init"
local RUN = "/.demesne/run"

--- A user-facing failure: raised with error(); the MCP layer turns it into isError.
local function fail(msg, code) error({ demesne_error = true, message = msg, code = code }, 0) end
sandbox.fail = fail

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
  local tmpfs = { { target = "/tmp", mode = "1777", exec = true }, { target = "/workspace", mode = "0777", exec = true } }
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
    security = { no_new_privileges = true, cap_drop = { "NET_RAW" } },
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

local function read_status(run_dir, exec_id)
  local f = fs.open_beneath(run_dir, "exec/" .. exec_id .. "/status.json")
  if not f then return nil end
  local s = f:read(65536)
  f:close()
  local st = json.decode(s or "")
  return type(st) == "table" and st or nil -- written inside the sandbox: untrusted
end

-- Bounded stdout/stderr of one command, from its log files under the output folder.
local function collect(output_dir, rel_dir)
  local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
  local prefix = rel_dir and (rel_dir .. "/") or ""
  local so, cut1 = output.view(output_dir, prefix .. "stdout.log", head, tail)
  local se, cut2 = output.view(output_dir, prefix .. "stderr.log", head, tail)
  return so, se, cut1 or cut2
end

--- The isolation levels a sandbox call may ask for (the `isolation` parameter).
sandbox.ISOLATIONS = { container = true, gvisor = true }

--- Decides how a new sandbox is isolated: `isolation` ("container" or "gvisor"; nil = the
--- isolation_default setting) and whether it gets a user namespace (the userns setting,
--- where the engine offers one; not under gVisor, whose Debian build cannot stat files in
--- one). Asks the engine what it offers (eng:probe, when the adapter has it). Fails, naming
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
  if type(eng.probe) == "function" then facts = check(eng:probe()) end
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
  return { isolation = isolation, userns = isolation ~= "gvisor" and config.get("userns") == true and caps.userns == true }
end

local function prepare(args, kind, tool, ttl)
  local eng = sandbox.engine()
  local lim = sandbox.limits(args.limits)
  local mounts = check(paths.inputs(args.files, args.directories))
  local pol = check(egress.select(args.egress, #mounts > 0))
  local iso = sandbox.isolation(eng, args.isolation, pol.open == true)
  local run_id = sandbox.new_run_id()
  local output_dir, run_dir = dirs(run_id)
  return {
    egress = pol, engine = eng, limits = lim, mounts = mounts, run_id = run_id, output_dir = output_dir,
    run_dir = run_dir, kind = kind, tool = tool, ttl = ttl, isolation = iso.isolation, userns = iso.userns,
  }
end

-- The folders a sandbox writes to, made before it exists: with a user namespace the engine
-- hands them (and what is in them) to the sandbox's root when it starts, so the transfer
-- folder is made here too.
local function make_dirs(o)
  check(fs.mkdir_p(o.output_dir, 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/exec", 493)) -- 0755 (Lua has no octal literals)
  check(fs.mkdir_p(o.run_dir .. "/xfer", 448)) -- 0700
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
  return o
end

--- Starts a planned one-shot run: image, folders, container (with `labels`, names without
--- the io.demesne. prefix, added), start. Sets plan.id. ctx (may be nil) gets image progress.
---@param ctx ToolContext|nil
---@param o table  from script_prepare
---@param labels table<string,string>|nil
function sandbox.script_start(ctx, o, labels)
  local img = check(images.ensure(o.engine, o.image_arg, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  o.cmd = { "run", "--id", o.exec_id, "--dir", RUN .. "/exec/" .. o.exec_id,
    "--stdout", o.stdout_path or "/out/stdout.log", "--stderr", "/out/stderr.log",
    "--cwd", o.cwd or "/out", "--timeout", tostring(o.timeout), "--" }
  if o.argv then
    for _, a in ipairs(o.argv) do o.cmd[#o.cmd + 1] = a end
  else
    for _, a in ipairs({ "/bin/sh", "-c", o.command }) do o.cmd[#o.cmd + 1] = a end
  end
  for i, a in ipairs(relay_args(o)) do table.insert(o.cmd, 1 + i, a) end
  if o.before_create then o.before_create(o) end -- e.g. the vendor route of an agent run
  o.egress_handle = check(egress.start(o)) -- stopped by script_remove
  o.labels = labels
  local spec = container_spec(o)
  -- the create runs in a task of its own: a cancel must not abort it half-way (the engine
  -- may create the container anyway); script_remove waits for it and removes the result
  o.creating = async.spawn("create " .. o.name, function() return o.engine:create(spec) end)
  local _, id, err, code = o.creating:wait()
  o.id = check(id, err, code)
  check(o.engine:start(o.id))
end

--- Removes a one-shot run's container, if it was created (waiting for a create still in
--- flight). Returns true, or nil and the engine's message.
---@param o table  the plan
---@return boolean|nil ok, string|nil err
function sandbox.script_remove(o)
  -- the proxy stops after the container, and waits for its connections: egress.jsonl is complete
  local _eg <close> = o.egress_handle
  if not o.id and o.creating then
    local ok, id = o.creating:wait()
    if ok then o.id = id end
  end
  if not o.id then return true end
  local ok, err = o.engine:remove(o.id)
  if not ok then log.warning("demesne.sandbox", "remove %s: %s", o.name or o.id, tostring(err)) end
  return ok, err
end

--- Waits up to `ms` for a one-shot container to stop. Returns its exit code, or nil, message,
--- code ("ETIMEDOUT", "ENOENT" when the container is gone, "ENOENGINE" …).
---@param o table  a plan with id (a container id or name)
---@param ms integer
function sandbox.script_wait(o, ms)
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
  local started = loop.hrtime()
  -- the container goes on success, failure, timeout and cancel alike
  local _ <close> = setmetatable({}, { __close = function()
    sandbox.script_remove(o)
    fs.remove_tree(o.run_dir)
  end })
  sandbox.script_start(ctx, o)
  local _hb <close> = require("demesne.progress").heartbeat(ctx)
  -- demesne-init enforces the timeout inside; this host-side guard covers a stuck engine
  local code, err = sandbox.script_wait(o, (o.timeout + 30) * 1000)
  return sandbox.script_result(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
end

--- Creates a persistent sandbox (sandbox_create). Returns {sandbox_id, output_dir, expires_at, image}.
function sandbox.create(ctx, args)
  local ttl = args.ttl_seconds or config.get("ttl_default")
  if ttl > config.get("ttl_max") then
    fail(("ttl_seconds: %s is above the ceiling of %s"):format(sandbox.num(ttl), sandbox.num(config.get("ttl_max"))))
  end
  local o = prepare(args, "persistent", "sandbox_create", ttl)
  local img = check(images.ensure(o.engine, args.image, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  o.env = sandbox.env(args.env, default_env(o.run_id, o.egress))
  o.cmd = { "serve", table.unpack(relay_args(o)) }
  o.name = "demesne-" .. o.run_id
  local spec = container_spec(o)
  local eg = check(egress.start(o)) -- lives as long as the sandbox (egress.stop in destroy/reap)
  local id, cerr, ccode = o.engine:create(spec)
  if not id then eg:stop() fail(cerr, ccode) end
  local ok, err = o.engine:start(id)
  if not ok then
    o.engine:remove(id)
    eg:stop()
    fs.remove_tree(o.run_dir)
    fail(err)
  end
  local expires = math.floor(loop.time()) + ttl
  sandbox.write_expiry(o.run_dir, expires)
  return {
    sandbox_id = o.run_id,
    output_dir = o.output_dir,
    expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", expires),
    image = img.name,
  }
end

-- <state>/run/<id> -> <state>/expiry/<id>: out of the sandbox's reach.
local function expiry_file(run_dir)
  local state, id = tostring(run_dir):match("^(.*)/run/([^/]+)$")
  return state and (state .. "/expiry/" .. id)
end

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
  local info, err, code = eng:inspect("demesne-" .. sandbox_id)
  if not info then
    if code == "ENOENT" then fail(("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(sandbox_id), "ENOENT") end
    fail(err, code)
  end
  local labels = info.labels or {}
  if labels[LABEL .. "managed"] ~= "1" or labels[LABEL .. "kind"] ~= "persistent" then
    fail(("sandbox_id: %s is not a persistent demesne sandbox"):format(sandbox_id))
  end
  local memory = info.limits and info.limits.memory_bytes
  return {
    id = info.id, name = "demesne-" .. sandbox_id, labels = labels,
    output_dir = labels[LABEL .. "output_dir"], run_dir = labels[LABEL .. "run_dir"],
    running = info.state == "running",
    expires_at = expiry_of(labels),
    memory_mb = memory and memory / (1024 * 1024) or nil,
  }
end

--- Fails with a plain message when a persistent sandbox is no longer running (destroyed,
--- expired or stopped while a command or transfer used it). Returns nothing otherwise.
--- A removal can still be under way when the command's stream ends, so this watches the
--- container for up to 2 s before concluding it is alive.
function sandbox.check_alive(eng, sandbox_id)
  for _ = 1, 10 do
    local info, _, code = eng:inspect("demesne-" .. tostring(sandbox_id))
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
  if new > sb.expires_at then
    sandbox.write_expiry(sb.run_dir, new)
    sb.expires_at = new
  end
end

local exec_seq = 0

--- Checks a sandbox_exec call and plans it; nothing runs yet. Renews the sandbox's TTL.
--- Returns the plan {engine, sb, container, exec_id, rel, dir, argv, env, timeout,
--- output_dir, run_dir, log_dir} that exec_run, exec_kill and exec_result take.
---@param args table  sandbox_id, command, timeout_seconds, cwd, env
---@return table plan
function sandbox.exec_prepare(args)
  local eng = sandbox.engine()
  local timeout = sandbox.timeout(args.timeout_seconds)
  local sb = sandbox.lookup(eng, args.sandbox_id)
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
  return {
    engine = eng, sb = sb, container = sb.id, exec_id = exec_id, rel = rel, dir = dir, env = env,
    timeout = timeout, output_dir = sb.output_dir, run_dir = sb.run_dir, log_dir = sb.output_dir .. "/" .. rel,
    argv = { INIT, "run", "--id", exec_id, "--dir", dir,
      "--stdout", "/out/" .. rel .. "/stdout.log", "--stderr", "/out/" .. rel .. "/stderr.log",
      "--cwd", cwd, "--timeout", tostring(timeout), "--", "/bin/sh", "-c", args.command },
  }
end

--- Runs a planned exec through the engine and waits for it. Returns the exec's exit code,
--- or nil, message, code. Cancelling the task stops the wait only: call exec_kill.
---@param e table  the plan from exec_prepare
---@return integer|nil code, string|nil err, string|nil ecode
function sandbox.exec_run(e)
  return e.engine:exec(e.container, e.argv, { env = e.env })
end

--- Kills a planned exec's whole process group inside the sandbox (demesne-init kill:
--- SIGTERM, SIGKILL after 2 s). Works after a restart: needs only the container and dir.
---@param eng table       the engine adapter
---@param container string
---@param dir string      the exec's folder inside the sandbox (/.demesne/run/exec/<id>)
function sandbox.exec_kill(eng, container, dir)
  return eng:exec(container, { INIT, "kill", "--dir", dir, "--signal", "TERM", "--grace", "2" })
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
    if not finished then sandbox.exec_kill(e.engine, e.container, e.dir) end
  end })
  local _hb <close> = require("demesne.progress").heartbeat(ctx)
  local code, err = sandbox.exec_run(e)
  finished = true
  -- a sandbox destroyed (or expired) under a running command: say so, not the engine's text
  if not read_status(e.run_dir, e.exec_id) then sandbox.check_alive(e.engine, args.sandbox_id) end
  if code == nil then fail("sandbox_exec failed: " .. tostring(err)) end
  return sandbox.exec_result(e, code, math.floor((loop.hrtime() - started) / 1e6))
end

local function tmp_file(suffix)
  local dir = config.get("state_dir") .. "/tmp"
  check(fs.mkdir_p(dir))
  return ("%s/%s%s"):format(dir, hex(loop.random(8)), suffix)
end

local function temp_guard(path)
  return setmetatable({}, { __close = function() fs.remove_tree(path) end })
end

-- Runs argv (no shell) in a persistent sandbox through demesne-init and waits for it.
-- Returns exit_code, stderr text (bounded). Used for file transfers.
local function run_quiet(eng, sb, argv)
  exec_seq = exec_seq + 1
  local id = ("xfer-%d-%s"):format(exec_seq, hex(loop.random(4)))
  local dir = RUN .. "/exec/" .. id
  local cmd = { INIT, "run", "--id", id, "--dir", dir, "--timeout", "3600", "--" }
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local code, err = eng:exec(sb.id, cmd, { env = json.array() })
  if code == nil then
    sandbox.check_alive(eng, sb.labels[LABEL .. "run_id"])
    fail("file transfer failed: " .. tostring(err))
  end
  local st = read_status(sb.run_dir, id)
  local msg = output.view(sb.run_dir, "exec/" .. id .. "/stderr.log", 2048, 2048)
  fs.remove_tree(sb.run_dir .. "/exec/" .. id)
  return st and st.exit_code or code, (msg:gsub("%s+$", "")), st
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
local function xfer_paths(sb)
  local name = hex(loop.random(8)) .. ".tar"
  check(fs.mkdir_p(sb.run_dir .. "/xfer", 448)) -- 0700
  return sb.run_dir .. "/xfer/" .. name, RUN .. "/xfer/" .. name
end

--- Copies a host file or folder into a sandbox (sandbox_upload).
--- args: sandbox_id, src (host path inside an allowed root), dst (absolute path in the sandbox).
-- The bytes of the regular files under `path` (symlinks not followed), counting stops once
-- over `limit`: what archive.pack would copy. Sparse files count their full size, as the
-- archive holds them in full.
local function tree_bytes(path, limit)
  local total = 0
  local function walk(p)
    local st = fs.lstat(p)
    if not st then return end
    if st.type == "file" then
      total = total + (st.size or 0)
    elseif st.type == "directory" then
      for _, n in ipairs(fs.readdir(p) or {}) do
        if total > limit then return end
        walk(p .. "/" .. n)
      end
    end
  end
  walk(path)
  return total
end

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
  if sb.labels[LABEL .. "egress"] == "open" then
    -- host inputs plus open egress is the exfiltration shape sandbox_create refuses
    fail(("sandbox_id: %s has open egress; host files cannot be uploaded into it"):format(args.sandbox_id))
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
  local size = tree_bytes(src, max)
  if size > max then
    fail(("src: %s holds more than %s bytes of files, over upload_max_bytes (%s); raise it with "
      .. "DEMESNE_UPLOAD_MAX_BYTES or upload less"):format(src, sandbox.num(max), sandbox.num(max)))
  end
  local host_tar, sandbox_tar = xfer_paths(sb)
  local _ <close> = temp_guard(host_tar)
  local stats = check(archive.pack(host_tar, { { src = src, name = base } }))
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
--- (sandbox_download). Entries with absolute paths, "..", or links leading outside are
--- refused; the unpacked size is capped by download_max_bytes.
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
  -- the sandbox can write its own /out: never follow a link it planted there
  local dl = sb.output_dir .. "/downloads"
  local st = fs.lstat(dl)
  if st and st.type ~= "directory" then
    fail(("the sandbox's output folder has a downloads entry that is not a plain folder (%s); refusing to write through it"):format(st.type))
  end
  local host_tar, sandbox_tar = xfer_paths(sb)
  local _ <close> = temp_guard(host_tar)
  local code, msg, xst = run_quiet(eng, sb, { "tar", "-c", "-f", sandbox_tar, "-C", parent, "--", base })
  if code ~= 0 then
    if msg:find("No such file", 1, true) then fail(("src: %s does not exist in the sandbox"):format(src)) end
    transfer_failure(eng, sb, "download of " .. src, code, msg, xst)
  end
  local tst = fs.lstat(host_tar)
  if not tst or tst.type ~= "file" then fail("download refused: the archive written in the sandbox is not a regular file") end
  check(fs.mkdir_p(dl, 493)) -- 0755 (Lua has no octal literals)
  local staging = dl .. "/.incoming-" .. hex(loop.random(6))
  local _s <close> = temp_guard(staging)
  local stats, xerr = archive.extract(host_tar, staging, { max_bytes = config.get("download_max_bytes"), max_entries = 100000 })
  if not stats then fail("download refused: " .. tostring(xerr)) end
  local target = dl .. "/" .. base
  if fs.lstat(target) then fs.remove_tree(target) end
  check(fs.rename(staging .. "/" .. base, target))
  return { sandbox_id = args.sandbox_id, src = src, path = target, files = stats.files, bytes = stats.bytes }
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
  local removed, how = eng:remove(sb.id)
  if not removed then fail(how) end
  egress.stop(args.sandbox_id)
  if sb.run_dir then
    fs.remove_tree(sb.run_dir)
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
  local rec = json.decode(fs.read_file(p, 0, 1024 * 1024) or "")
  return type(rec) == "table" and rec.status == "running"
end

--- One reaper pass: removes containers past their expiry and one-shot containers whose
--- owner process is gone, but never a background job's container while its job record
--- says running. Works from the engine's state. Returns the number removed.
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
        if l[LABEL .. "run_id"] then egress.stop(l[LABEL .. "run_id"]) end
        local rd = l[LABEL .. "run_dir"]
        if rd and paths.within(rd, config.get("state_dir") .. "/run") then
          fs.remove_tree(rd)
          os.remove(expiry_file(rd))
        end
        log.info("demesne.reaper", "removed %s (%s)", l[LABEL .. "run_id"] or c.id, expired and "expired" or "owner gone")
      end
    end
  end
  return n
end

return sandbox
