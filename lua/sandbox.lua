-- The sandbox lifecycle over an engine adapter: limits, mounts, output folders, labels,
-- TTL, one-shot runs, execs through demesne-init, and the reaper.
--
-- Host layout (DESIGN.md "State on the host"):
--   <output_root>/<run id>/              = /out of that sandbox (stdout.log, stderr.log, exec/<n>/…)
--   <state_dir>/run/<run id>/            = /.demesne/run (exec records written by demesne-init)
--   <state_dir>/run/<run id>/expires_at  = renewed expiry (labels are immutable)
local async = require("demesne.async")
local config = require("demesne.config")
local engines = require("demesne.engines")
local images = require("demesne.images")
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")
local paths = require("demesne.paths")
local fs = require("core.fs")
local archive = require("core.archive")
local loop = require("core.loop")

local sandbox = {}

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

--- Resolves limits against defaults and ceilings. Returns {memory_mb, cpus, pids}.
function sandbox.limits(l)
  l = l or {}
  local out = {}
  for _, k in ipairs({ "memory_mb", "cpus", "pids" }) do
    local v = l[k] or config.get(k .. "_default")
    local max = config.get(k .. "_max")
    if v > max then fail(("limits.%s: %s is above the ceiling of %s set in the configuration"):format(k, v, max)) end
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
    list[#list + 1] = k .. "=" .. v
  end
  for k, v in pairs(extra or {}) do list[#list + 1] = k .. "=" .. v end
  return json.array(list)
end

--- Resolves timeout_seconds against the default and ceiling.
function sandbox.timeout(t)
  t = t or config.get("timeout_default")
  local max = config.get("timeout_max")
  if t > max then fail(("timeout_seconds: %d is above the ceiling of %d"):format(t, max)) end
  if t < 1 then fail("timeout_seconds: must be at least 1") end
  return math.floor(t)
end

local function dirs(run_id)
  return config.get("output_root") .. "/" .. run_id, config.get("state_dir") .. "/run/" .. run_id
end
sandbox.dirs = dirs

-- Builds the ContainerCreate body for a sandbox.
local function container_spec(o)
  local init = check(config.init_path())
  local lim = o.limits
  local binds = {
    init .. ":" .. INIT .. ":ro",
    o.run_dir .. ":" .. RUN .. ":rw",
    o.output_dir .. ":/out:rw",
  }
  for _, m in ipairs(o.mounts or {}) do binds[#binds + 1] = m.host .. ":" .. m.target .. ":ro" end
  local tmpfs = { ["/tmp"] = "rw,exec,mode=1777", ["/workspace"] = "rw,exec,mode=0777" }
  if config.get("readonly_rootfs") then
    tmpfs["/var/tmp"] = "rw,exec,mode=1777"
    tmpfs["/root"] = "rw,exec,mode=0700"
    tmpfs["/run"] = "rw,mode=0755"
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
  }
  return {
    Image = o.image_ref,
    Entrypoint = { INIT },
    Cmd = o.cmd,
    Env = o.env,
    WorkingDir = "/out",
    Labels = labels,
    Hostname = "sandbox",
    HostConfig = {
      Binds = binds,
      Tmpfs = tmpfs,
      NetworkMode = "none",
      ReadonlyRootfs = config.get("readonly_rootfs") and true or false,
      SecurityOpt = { "no-new-privileges" },
      CapDrop = { "NET_RAW" },
      Memory = math.floor(lim.memory_mb * 1024 * 1024),
      MemorySwap = math.floor(lim.memory_mb * 1024 * 1024),
      NanoCpus = math.floor(lim.cpus * 1e9),
      PidsLimit = math.floor(lim.pids),
      Init = false,
    },
  }
end

local function default_env(run_id)
  return {
    DEMESNE_RUN_ID = run_id,
    DEMESNE_OUT = "/out",
    HOME = "/root",
    PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
  }
end

local function read_status(run_dir, exec_id)
  local f = fs.open_beneath(run_dir, "exec/" .. exec_id .. "/status.json")
  if not f then return nil end
  local s = f:read(65536)
  f:close()
  return json.decode(s or "")
end

-- Bounded stdout/stderr of one command, from its log files under the output folder.
local function collect(output_dir, rel_dir)
  local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
  local prefix = rel_dir and (rel_dir .. "/") or ""
  local so, cut1 = output.view(output_dir, prefix .. "stdout.log", head, tail)
  local se, cut2 = output.view(output_dir, prefix .. "stderr.log", head, tail)
  return so, se, cut1 or cut2
end

local function prepare(args, kind, tool, ttl)
  local eng = sandbox.engine()
  local lim = sandbox.limits(args.limits)
  local mounts = check(paths.inputs(args.files, args.directories))
  local run_id = sandbox.new_run_id()
  local output_dir, run_dir = dirs(run_id)
  return {
    engine = eng, limits = lim, mounts = mounts, run_id = run_id, output_dir = output_dir,
    run_dir = run_dir, kind = kind, tool = tool, ttl = ttl,
  }
end

local function make_dirs(o)
  check(fs.mkdir_p(o.output_dir, 0755))
  check(fs.mkdir_p(o.run_dir .. "/exec", 0755))
end

--- Runs one command in a fresh container that is removed afterwards (sandbox_script).
--- args: command, image, files, directories, env, timeout_seconds, limits.
--- ctx: the MCP tool context (progress/log). Returns the result table.
function sandbox.run_script(ctx, args)
  local timeout = sandbox.timeout(args.timeout_seconds)
  local o = prepare(args, "oneshot", "sandbox_script", timeout + 600)
  local env = sandbox.env(args.env, default_env(o.run_id))
  local img = check(images.ensure(o.engine, args.image, ctx))
  make_dirs(o)
  local exec_id = "main"
  o.image_ref, o.image_name = img.ref, img.name
  o.env = env
  o.cmd = { "run", "--id", exec_id, "--dir", RUN .. "/exec/" .. exec_id,
    "--stdout", "/out/stdout.log", "--stderr", "/out/stderr.log",
    "--cwd", "/out", "--timeout", tostring(timeout), "--", "/bin/sh", "-c", args.command }
  local started = loop.hrtime()
  local name = "demesne-" .. o.run_id
  local id = check(o.engine:create(container_spec(o), name))
  -- the container goes on success, failure, timeout and cancel alike
  local _ <close> = setmetatable({}, { __close = function()
    local ok, err = o.engine:remove(id)
    if not ok then log.warning("demesne.sandbox", "remove %s: %s", name, tostring(err)) end
    fs.remove_tree(o.run_dir)
  end })
  check(o.engine:start(id))
  -- demesne-init enforces the timeout inside; this host-side guard covers a stuck engine
  local code, err = async.timeout((timeout + 30) * 1000, function() return o.engine:wait(id) end)
  local duration_ms = math.floor((loop.hrtime() - started) / 1e6)
  local st = read_status(o.run_dir, exec_id)
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
  }
end

--- Creates a persistent sandbox (sandbox_create). Returns {sandbox_id, output_dir, expires_at, image}.
function sandbox.create(ctx, args)
  local ttl = args.ttl_seconds or config.get("ttl_default")
  if ttl > config.get("ttl_max") then
    fail(("ttl_seconds: %d is above the ceiling of %d"):format(ttl, config.get("ttl_max")))
  end
  local o = prepare(args, "persistent", "sandbox_create", ttl)
  local img = check(images.ensure(o.engine, args.image, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  o.env = sandbox.env(args.env, default_env(o.run_id))
  o.cmd = { "serve" }
  local name = "demesne-" .. o.run_id
  local id = check(o.engine:create(container_spec(o), name))
  local ok, err = o.engine:start(id)
  if not ok then
    o.engine:remove(id)
    fs.remove_tree(o.run_dir)
    fail(err)
  end
  local expires = math.floor(loop.time()) + ttl
  fs.write_atomic(o.run_dir .. "/expires_at", tostring(expires))
  return {
    sandbox_id = o.run_id,
    output_dir = o.output_dir,
    expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", expires),
    image = img.name,
  }
end

local function expiry_of(labels)
  local e = tonumber(labels[LABEL .. "expires_at"]) or 0
  local rd = labels[LABEL .. "run_dir"]
  if rd then
    local s = fs.read_file(rd .. "/expires_at")
    if s and tonumber(s) and tonumber(s) > e then e = tonumber(s) end
  end
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
  local labels = (info.Config or {}).Labels or {}
  if labels[LABEL .. "managed"] ~= "1" or labels[LABEL .. "kind"] ~= "persistent" then
    fail(("sandbox_id: %s is not a persistent demesne sandbox"):format(sandbox_id))
  end
  return {
    id = info.Id, name = "demesne-" .. sandbox_id, labels = labels,
    output_dir = labels[LABEL .. "output_dir"], run_dir = labels[LABEL .. "run_dir"],
    running = info.State and info.State.Running,
    expires_at = expiry_of(labels),
  }
end

-- Renews the TTL: never shortens it.
local function renew(sb)
  local ttl = config.get("ttl_default")
  local created = tonumber(sb.labels[LABEL .. "created_at"]) or 0
  local orig = (tonumber(sb.labels[LABEL .. "expires_at"]) or 0) - created
  if orig > ttl then ttl = orig end
  local new = math.floor(loop.time()) + ttl
  if new > sb.expires_at then
    fs.write_atomic(sb.run_dir .. "/expires_at", tostring(new))
    sb.expires_at = new
  end
end

local exec_seq = 0

--- Runs a command in a persistent sandbox (sandbox_exec).
--- args: sandbox_id, command, timeout_seconds, cwd, env. Returns the result table.
function sandbox.exec(ctx, args)
  local eng = sandbox.engine()
  local timeout = sandbox.timeout(args.timeout_seconds)
  local sb = sandbox.lookup(eng, args.sandbox_id)
  if not sb.running then fail(("sandbox_id: sandbox %s is not running"):format(args.sandbox_id)) end
  local cwd = args.cwd or "/out"
  if cwd:sub(1, 1) ~= "/" then fail("cwd: must be an absolute path inside the sandbox") end
  local env = sandbox.env(args.env)
  renew(sb)
  exec_seq = exec_seq + 1
  local exec_id = os.date("!%Y%m%dT%H%M%SZ") .. "-" .. exec_seq .. "-" .. hex(loop.random(2))
  local rel = "exec/" .. exec_id
  local started = loop.hrtime()
  local dir = RUN .. "/exec/" .. exec_id
  local finished = false
  -- cancelling the call kills the command's whole process group inside the sandbox
  local _ <close> = setmetatable({}, { __close = function()
    if not finished then
      eng:exec(sb.id, { INIT, "kill", "--dir", dir, "--signal", "TERM", "--grace", "2" })
    end
  end })
  local code, err = eng:exec(sb.id, { INIT, "run", "--id", exec_id, "--dir", dir,
    "--stdout", "/out/" .. rel .. "/stdout.log", "--stderr", "/out/" .. rel .. "/stderr.log",
    "--cwd", cwd, "--timeout", tostring(timeout), "--", "/bin/sh", "-c", args.command }, { env = env })
  finished = true
  if code == nil then fail("sandbox_exec failed: " .. tostring(err)) end
  local st = read_status(sb.run_dir, exec_id)
  local stdout, stderr, truncated = collect(sb.output_dir, rel)
  return {
    exit_code = st and st.exit_code or code,
    stdout = stdout,
    stderr = stderr,
    output_dir = sb.output_dir,
    log_dir = sb.output_dir .. "/" .. rel,
    duration_ms = math.floor((loop.hrtime() - started) / 1e6),
    timed_out = st and st.timed_out or false,
    truncated = truncated,
    expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", sb.expires_at),
  }
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
  if code == nil then fail("file transfer failed: " .. tostring(err)) end
  local st = read_status(sb.run_dir, id)
  local msg = output.view(sb.run_dir, "exec/" .. id .. "/stderr.log", 2048, 2048)
  fs.remove_tree(sb.run_dir .. "/exec/" .. id)
  return st and st.exit_code or code, (msg:gsub("%s+$", ""))
end

-- Transfers go through a tar in the sandbox's run folder (bind-mounted at /.demesne/run)
-- and the image's own tar, not the engine's archive API: Docker's archive API neither
-- sees nor writes tmpfs mounts (/tmp, /workspace), where an upload would vanish.
local function xfer_paths(sb)
  local name = hex(loop.random(8)) .. ".tar"
  check(fs.mkdir_p(sb.run_dir .. "/xfer", 0700))
  return sb.run_dir .. "/xfer/" .. name, RUN .. "/xfer/" .. name
end

--- Copies a host file or folder into a sandbox (sandbox_upload).
--- args: sandbox_id, src (host path inside an allowed root), dst (absolute path in the sandbox).
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
  local host_tar, sandbox_tar = xfer_paths(sb)
  local _ <close> = temp_guard(host_tar)
  local stats = check(archive.pack(host_tar, { { src = src, name = base } }))
  local code, msg = run_quiet(eng, sb, { "tar", "-x", "--no-same-owner", "-f", sandbox_tar, "-C", parent })
  if code ~= 0 then
    if msg:find("Cannot open: No such file", 1, true) or msg:find("Cannot chdir", 1, true) then
      fail(("dst: the folder %s does not exist in the sandbox"):format(parent))
    end
    fail(("upload to %s failed (tar exit %d): %s"):format(dst, code, msg))
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
  local parent, base = src:match("^(.*)/([^/]+)$")
  if not base then fail("src: must name a file or folder, not /") end
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
  local code, msg = run_quiet(eng, sb, { "tar", "-c", "-f", sandbox_tar, "-C", parent, "--", base })
  if code ~= 0 then
    if msg:find("No such file", 1, true) then fail(("src: %s does not exist in the sandbox"):format(src)) end
    fail(("download of %s failed (tar exit %d): %s"):format(src, code, msg))
  end
  local tst = fs.lstat(host_tar)
  if not tst or tst.type ~= "file" then fail("download refused: the archive written in the sandbox is not a regular file") end
  check(fs.mkdir_p(dl, 0755))
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
  if sb.run_dir then fs.remove_tree(sb.run_dir) end
  return { sandbox_id = args.sandbox_id, status = how == "gone" and "already gone" or "destroyed",
    output_dir = sb.output_dir }
end

--- Lists live persistent sandboxes: {sandboxes = {{sandbox_id, image, created_at, expires_at, output_dir, state}}}.
function sandbox.list()
  local eng = sandbox.engine()
  local list = check(eng:list({ LABEL .. "managed=1", LABEL .. "kind=persistent" }))
  local out = json.array()
  for _, c in ipairs(list) do
    local l = c.Labels or {}
    out[#out + 1] = {
      sandbox_id = l[LABEL .. "run_id"],
      image = l[LABEL .. "image"],
      created_at = os.date("!%Y-%m-%dT%H:%M:%SZ", tonumber(l[LABEL .. "created_at"]) or 0),
      expires_at = os.date("!%Y-%m-%dT%H:%M:%SZ", expiry_of(l)),
      output_dir = l[LABEL .. "output_dir"],
      state = c.State,
    }
  end
  table.sort(out, function(a, b) return tostring(a.sandbox_id) < tostring(b.sandbox_id) end)
  return { sandboxes = out }
end

--- One reaper pass: removes containers past their expiry and one-shot containers whose
--- owner process is gone. Works from the engine's state. Returns the number removed.
function sandbox.reap()
  local eng = engines.get()
  if not eng then return 0 end
  local list = eng:list({ LABEL .. "managed=1" })
  if not list then return 0 end
  local now = loop.time()
  local n = 0
  for _, c in ipairs(list) do
    local l = c.Labels or {}
    local expired = expiry_of(l) < now
    local orphan = l[LABEL .. "kind"] == "oneshot" and not owner_alive(l[LABEL .. "owner"])
    if expired or orphan then
      if eng:remove(c.Id) then
        n = n + 1
        local rd = l[LABEL .. "run_dir"]
        if rd and paths.within(rd, config.get("state_dir") .. "/run") then fs.remove_tree(rd) end
        log.info("demesne.reaper", "removed %s (%s)", l[LABEL .. "run_id"] or c.Id, expired and "expired" or "owner gone")
      end
    end
  end
  return n
end

return sandbox
