-- The Docker Engine API adapter (serves Docker and Podman's Docker-compatible API alike)
-- over a unix socket through core.http. Every method runs inside an async task and
-- returns its value, or nil, message, code. Messages are the engine's own reason, parsed
-- from its JSON error body, never the raw body. The interface is documented in
-- docs/reference/engines.md. API reference: https://docs.docker.com/reference/api/engine/
--
-- The only place that knows Docker's JSON: it takes the engine-neutral sandbox spec
-- (lua/engines/spec.lua) and returns neutral container info; nothing above it sees
-- HostConfig, Binds, State or Config.Labels.
local http = require("core.http")
local fs = require("core.fs")
local stream = require("core.stream")
local loop = require("core.loop")
local async = require("demesne.async")
local json = require("demesne.json")
local engine_spec = require("demesne.engines.spec")
local util = require("demesne.util")

local docker = {}
local Engine = {}
Engine.__index = Engine

local request = async.wrap(http.request)

local urlencode = util.percent_encode

--- One segment of an API path built from a caller's or a sandbox's data (a container name
--- or id, an exec id, an image reference): every byte but RFC 3986's unreserved ones is
--- percent-escaped, '/' included, so that no value can add a segment, climb with "..",
--- or start a query ("../events?x=" becomes "..%2Fevents%3Fx%3D"). Docker and Podman
--- both decode escaped segments (an image reference's '/' and ':' included).
--- Raises on an empty value (it would name another endpoint: "/containers//json" is the list).
---@param s string|number
---@return string
function docker.segment(s)
  local v = urlencode(s)
  if v == "" then error("engine API path: an empty segment", 2) end
  if v == "." or v == ".." then v = v:gsub("%.", "%%2E") end -- never a dot segment
  return v
end
local seg = docker.segment

-- The query of a Docker Engine API call: tables (filters) as JSON, the rest as util.query_string
local function query(q)
  if not q then return "" end
  local flat = {}
  for k, v in pairs(q) do flat[k] = type(v) == "table" and json.encode(v) or v end
  return util.query_string(flat)
end

local CODES = { [400] = "EINVAL", [401] = "EACCES", [403] = "EACCES", [404] = "ENOENT", [409] = "ECONFLICT",
  [500] = "EENGINE", [304] = "ENOTMODIFIED" }

local function engine_error(res, what)
  local body = res.body or ""
  local msg
  local t = json.decode(body)
  if type(t) == "table" and type(t.message) == "string" then
    msg = t.message
  else
    msg = body:gsub("%s+$", ""):sub(1, 300)
    if msg == "" then msg = "HTTP " .. res.status end
  end
  return nil, ("%s: %s"):format(what, msg), CODES[res.status] or "EENGINE"
end

--- What this adapter can do (docs/reference/engines.md, "Capabilities"). Host folders and
--- the unix sockets in them are shared live through bind mounts. `runtimes` and `userns`
--- depend on the engine's set-up: each adapter starts with these and Engine:probe() fills
--- them in from what the engine says.
docker.CAPABILITIES = {
  bind_mounts = true,
  unix_socket_mounts = true,
  tmpfs = true,
  read_only_rootfs = true,
  bounded_logs = true,
  networks = { none = true, bridge = true },
  runtimes = {},
  userns = false,
  limits = true,
  snapshots = true,
  pause = true,
  exec_user = true,
}

--- Under gVisor the host's pids cgroup counts the gVisor kernel's own threads (about five
--- per sandbox process on its ptrace platform, measured with runsc 20221219), and running
--- out of them ends the whole sandbox. So the process limit is enforced inside, by gVisor's
--- RLIMIT_NPROC, and the host limit is this many times larger, as a backstop.
docker.GVISOR_PIDS_FACTOR = 8

--- Rootful Podman's automatic user namespace, with its size given. Without a size, Podman
--- 4.3 (containers/storage 1.43) measures the image by mounting a temporary layer while it
--- holds the layer store's lock, and so takes storage.lock in the wrong order: creates that
--- run while containers are cleaned up deadlock the whole engine (podman#16062, measured here
--- with 20 sandboxes at once). 65536 ids cover every uid and gid of a Debian image (nobody
--- is 65534).
docker.USERNS_AUTO = "auto:size=65536"

--- The first Podman whose userns=auto demesne uses. Podman 4.3.1 (Debian bookworm), measured
--- here with 20 sandboxes at once: without a size its engine deadlocks (podman#16062, fixed
--- in 4.4); with a size, starts fail now and then with "mounting storage … permission denied".
docker.PODMAN_USERNS_AUTO_MIN = "4.4"

-- "4.3.1" < "4.4"? Dotted versions compared part by part as numbers.
local function version_before(v, min)
  local a, b = {}, {}
  for n in tostring(v):gmatch("%d+") do a[#a + 1] = tonumber(n) end
  for n in min:gmatch("%d+") do b[#b + 1] = tonumber(n) end
  for i = 1, #b do
    if (a[i] or 0) ~= b[i] then return (a[i] or 0) < b[i] end
  end
  return false
end

--- Creates an adapter for the Docker Engine API at a unix socket path. opts (optional):
--- gvisor_runtime = the runtime name gVisor is registered under in Docker's daemon.json
--- (default "runsc"); gvisor_socket = the socket path of a Podman API service whose default
--- runtime is gVisor (Podman's API cannot choose a runtime per container).
---@param socket string
---@param opts {gvisor_runtime: string|nil, gvisor_socket: string|nil}|nil
---@return table engine
function docker.new(socket, opts)
  -- not a table: e.g. the count of docker.new(endpoint:gsub("^unix://", "")), ignored
  if type(opts) ~= "table" then opts = {} end
  local caps = {}
  for k, v in pairs(docker.CAPABILITIES) do caps[k] = v end
  caps.networks = { none = true, bridge = true }
  caps.runtimes = {}
  return setmetatable({ socket = socket, name = "docker", capabilities = caps,
    gvisor_runtime = opts.gvisor_runtime or "runsc", gvisor_socket = opts.gvisor_socket }, Engine)
end

-- Copies a list into a JSON array (an empty list must encode as [], not {}).
local function array(list)
  if list == nil then return nil end
  local out = json.array()
  for i, v in ipairs(list) do out[i] = v end
  return out
end

--- Translates a sandbox spec (checked with spec.check) into a Docker ContainerCreate body.
--- The memory limit includes swap (MemorySwap = Memory); the entrypoint runs as PID 1
--- (Init = false: demesne-init is the container's init). `how` says how this engine does
--- what the spec asks beyond the defaults (Engine:probe() finds it out):
---   gvisor_runtime = the runtime name for spec.runtime "gvisor" on Docker (HostConfig.Runtime;
---     nil on Podman, whose gVisor is a separate service);
---   userns = "auto" (rootful Podman: UsernsMode docker.USERNS_AUTO, and the rw mounts' folders handed to the
---     sandbox's root with the U option), "remap" (Docker maps every container; a spec
---     without userns opts out with UsernsMode host), "rootless" (the engine maps every
---     container: nothing to ask), nil (no user namespace).
--- Under gVisor the process limit is RLIMIT_NPROC inside (Ulimits nproc) and PidsLimit is
--- docker.GVISOR_PIDS_FACTOR times it.
---@param s table  the sandbox spec
---@param how {gvisor_runtime: string|nil, userns: string|nil}|nil
---@return table body  https://docs.docker.com/reference/api/engine/version/v1.41/#operation/ContainerCreate
function docker.create_body(s, how)
  how = how or {}
  local auto = s.userns and how.userns == "auto"
  local binds = json.array()
  for _, m in ipairs(s.mounts or {}) do
    binds[#binds + 1] = m.source .. ":" .. m.target .. ":" .. m.mode .. (auto and m.mode == "rw" and ",U" or "")
  end
  local tmpfs = {}
  for _, t in ipairs(s.tmpfs or {}) do tmpfs[t.target] = "rw," .. (t.exec and "exec," or "") .. "mode=" .. t.mode end
  local lim = s.limits or {}
  local sec = s.security or {}
  local gvisor = s.runtime == "gvisor"
  local pids, ulimits = lim.pids, nil
  if gvisor and pids then
    ulimits = { { Name = "nproc", Soft = pids, Hard = pids } }
    pids = pids * docker.GVISOR_PIDS_FACTOR
  end
  return {
    Image = s.image,
    Entrypoint = array(s.entrypoint),
    Cmd = array(s.command),
    Env = array(s.env),
    WorkingDir = s.workdir,
    User = s.user,
    Labels = s.labels,
    Hostname = s.hostname,
    HostConfig = {
      Binds = binds,
      Tmpfs = tmpfs,
      NetworkMode = s.network or "none",
      ReadonlyRootfs = s.read_only_rootfs and true or false,
      SecurityOpt = sec.no_new_privileges and { "no-new-privileges" } or nil,
      CapDrop = array(sec.cap_drop),
      Memory = lim.memory_bytes,
      MemorySwap = lim.memory_bytes,
      NanoCpus = lim.cpus and math.floor(lim.cpus * 1e9),
      PidsLimit = pids,
      Ulimits = ulimits,
      Runtime = gvisor and how.gvisor_runtime or nil,
      -- userns-remap maps every container unless it opts out: a spec without userns does
      UsernsMode = auto and docker.USERNS_AUTO or (not s.userns and how.userns == "remap" and "host") or nil,
      Init = false,
      -- one file of at most log_max_bytes (Docker: json-file rotated at max-size, keeping one
      -- old file; Podman maps json-file to k8s-file and truncates at max-size)
      LogConfig = s.log_max_bytes and { Type = "json-file",
        Config = { ["max-size"] = tostring(s.log_max_bytes), ["max-file"] = "1" } } or nil,
    },
  }
end

-- Docker's container states (State.Status in inspect, State in list; Podman's compatible
-- API uses the same words) -> the neutral states of spec.STATES.
local STATES = {
  created = "created", configured = "created", running = "running", paused = "running", restarting = "running",
  stopping = "running", removing = "removing", exited = "exited", stopped = "exited", dead = "gone",
}

local function positive(n) return type(n) == "number" and n > 0 and n or nil end

--- Neutral container info from a Docker inspect body (GET /containers/{id}/json):
--- {id, name, image, state, exit_code, labels, limits = {memory_bytes, cpus, pids}}.
---@param t table
---@return table info
function docker.container_info(t)
  local st = type(t.State) == "table" and t.State or {}
  local hc = type(t.HostConfig) == "table" and t.HostConfig or {}
  local cfg = type(t.Config) == "table" and t.Config or {}
  -- Running decides first, as Docker's own State.Status does (paused and restarting are running)
  local state = st.Running == true and "running" or STATES[st.Status] or "exited"
  if state == "running" and st.Running ~= true then state = "exited" end
  local nano = positive(hc.NanoCpus)
  -- under gVisor the process limit is RLIMIT_NPROC (docker.create_body), PidsLimit a backstop
  local pids = positive(hc.PidsLimit)
  for _, u in ipairs(type(hc.Ulimits) == "table" and hc.Ulimits or {}) do
    if type(u) == "table" and tostring(u.Name):lower() == "nproc" then pids = positive(u.Soft) or pids end
  end
  return {
    id = t.Id,
    name = type(t.Name) == "string" and (t.Name:gsub("^/", "")) or nil,
    image = cfg.Image,
    state = state,
    exit_code = (state == "exited" or state == "gone") and math.tointeger(st.ExitCode) or nil,
    labels = type(cfg.Labels) == "table" and cfg.Labels or {},
    paused = st.Paused == true or st.Status == "paused",
    limits = { memory_bytes = positive(hc.Memory), cpus = nano and nano / 1e9, pids = pids },
  }
end

--- Neutral container info from one entry of a Docker list (GET /containers/json):
--- {id, name, image, state, labels}.
---@param c table
---@return table info
function docker.container_summary(c)
  local name = type(c.Names) == "table" and c.Names[1] or nil
  return {
    id = c.Id,
    name = type(name) == "string" and (name:gsub("^/", "")) or nil,
    image = c.Image,
    state = STATES[c.State] or "exited",
    paused = c.State == "paused",
    labels = type(c.Labels) == "table" and c.Labels or {},
  }
end

--- The deadline of an engine call that sets none (ms): a hung engine must not hold a
--- caller (or a cancel's cleanup) for ever. Streams that may run long pass their own
--- (timeout_ms = 0: none).
docker.DEFAULT_TIMEOUT_MS = 300000

--- Low-level call: method, path (with query table), optional JSON body or opts
--- ({body_file=, output_file=, on_data=, timeout_ms= (default DEFAULT_TIMEOUT_MS, 0: none),
--- headers=, socket=, prefix=}; socket: another socket than the adapter's; prefix: the API
--- path prefix, default "/v1.41"). `path` must be built with docker.segment for every value
--- it holds.
--- Returns res or nil, msg, code.
---@param method string  HTTP method
---@param path string    API path after the version ("/containers/json")
---@param q table|nil    query parameters
---@param body any       a JSON-encodable body (a string is sent as is), or nil
---@param opts table|nil
---@return table|nil res, string|nil err, string|nil code  res: core.http's {status, headers, body}
function Engine:call(method, path, q, body, opts)
  opts = opts or {}
  local headers = opts.headers or {}
  local socket = opts.socket or self.socket
  local req = {
    method = method,
    url = "http://d" .. (opts.prefix or "/v1.41") .. path .. query(q), -- 1.41: spoken by Docker 20.10+ and Podman 4
    unix_socket = socket,
    headers = headers,
    timeout_ms = opts.timeout_ms == nil and docker.DEFAULT_TIMEOUT_MS or opts.timeout_ms,
    connect_timeout_ms = 5000,
    body_file = opts.body_file,
    output_file = opts.output_file,
    on_data = opts.on_data,
    max_body_bytes = opts.max_body_bytes or 64 * 1024 * 1024,
  }
  if body ~= nil then
    req.body = type(body) == "string" and body or json.encode(body)
    headers["Content-Type"] = headers["Content-Type"] or "application/json"
  elseif method == "POST" and not opts.body_file then
    req.body = ""
  end
  local res, err, code = request(req)
  if not res then
    if code == "ENOENT" or code == "ECONNREFUSED" then
      return nil, ("container engine at %s is not answering (%s)"):format(socket, err), "ENOENGINE"
    end
    return nil, err, code
  end
  return res
end

local function ok_json(self, method, path, q, body, what, opts)
  local res, err, code = self:call(method, path, q, body, opts)
  if not res then return nil, err, code end
  if res.status >= 300 then return engine_error(res, what) end
  if res.body and res.body ~= "" then
    local t = json.decode(res.body)
    return t ~= nil and t or res.body
  end
  return true
end

--- GET /_ping and /version: {name = "podman"|"docker", version = string, api = string}.
---@return {name: string, version: string, api: string}|nil info, string|nil err, string|nil code
function Engine:info()
  local v, err, code = ok_json(self, "GET", "/version", nil, nil, "engine version")
  if not v then return nil, err, code end
  local name = "docker"
  for _, c in ipairs(v.Components or {}) do
    if tostring(c.Name):lower():find("podman") then name = "podman" end
  end
  self.kind = name
  return { name = name, version = v.Version, api = v.ApiVersion }
end

-- How long a probe's answers are kept: daemon.json or a service can change under a server.
-- The engine's own (a Podman's /libpod/info takes half a second) for longer.
local PROBE_SECONDS = 30
local ENGINE_FACTS_SECONDS = 300

local DOCKER_GVISOR_FIX = 'install gVisor (`apt-get install runsc`), register it in /etc/docker/daemon.json as '
  .. '{"runtimes": {"%s": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=open"]}}} '
  .. "and reload Docker (`kill -HUP $(pidof dockerd)`)"
local PODMAN_GVISOR_FIX = "install gVisor (`apt-get install runsc`) and start a second Podman service whose runtime is "
  .. "gVisor with the flags demesne needs, e.g. a script /usr/local/libexec/demesne/runsc containing "
  .. '`exec /usr/bin/runsc --network=none --host-uds=open "$@"` and `podman --runtime '
  .. "/usr/local/libexec/demesne/runsc system service --time=0 unix:///run/podman/podman-gvisor.sock &`; then set "
  .. "DEMESNE_GVISOR_ENGINE=unix:///run/podman/podman-gvisor.sock"

local function list_has(list, pred)
  for _, x in ipairs(type(list) == "table" and list or {}) do
    if pred(x) then return true end
  end
  return false
end

-- gVisor on Docker: a runtime registered under `name`, with --host-uds=open (or all) for the
-- relay sockets. Returns {ok, detail, fix}.
local function docker_gvisor(info, name)
  local rts = type(info.Runtimes) == "table" and info.Runtimes or {}
  local rt = rts[name]
  if type(rt) ~= "table" then
    local names = {}
    for k in pairs(rts) do names[#names + 1] = k end
    table.sort(names)
    return { ok = false, detail = ("Docker has no runtime named %s (it has %s)"):format(name, table.concat(names, ", ")),
      fix = DOCKER_GVISOR_FIX:format(name) }
  end
  local args = type(rt.runtimeArgs) == "table" and rt.runtimeArgs or {}
  local how = ("%s %s"):format(tostring(rt.path), table.concat(args, " "))
  if not list_has(args, function(a) return tostring(a):match("^%-%-?host%-uds=") and not tostring(a):match("=none$") end) then
    return { ok = false, detail = ("Docker's runtime %s (%s) lacks --host-uds=open: the sandbox's relays could not "
      .. "reach the host"):format(name, how), fix = DOCKER_GVISOR_FIX:format(name) }
  end
  return { ok = true, detail = ("Docker runtime %s: %s"):format(name, how) }
end

local LIMITS_FIX = "run the engine rootful, or give rootless Podman cgroup v2 with the memory, pids and cpu "
  .. "controllers delegated to its user (systemd: a user session, Delegate=yes); or set enforce_limits = false to run "
  .. "sandboxes without limits"

-- Whether the engine enforces memory, process and CPU limits: {ok, detail, fix}. Podman
-- names the cgroup controllers it can use (host.cgroupControllers: none for rootless Podman on
-- cgroup v1, which ignores limits with only a warning); Docker says MemoryLimit, PidsLimit and
-- CpuCfsQuota in /info.
local function limits_of(engine, info, rootless)
  local missing = {}
  if engine == "podman" then
    local host = type(info.host) == "table" and info.host or {}
    local have = {}
    for _, c in ipairs(type(host.cgroupControllers) == "table" and host.cgroupControllers or {}) do have[c] = true end
    for _, c in ipairs({ "memory", "pids", "cpu" }) do
      if not have[c] then missing[#missing + 1] = c end
    end
    if #missing == 0 then return { ok = true, detail = "enforced (cgroup " .. tostring(host.cgroupVersion) .. ")" } end
    local why = (rootless and host.cgroupVersion == "v1")
      and "rootless Podman on cgroup v1 ignores them"
      or ("Podman cannot use the cgroup controller(s) %s"):format(table.concat(missing, ", "))
    return { ok = false, detail = why, fix = LIMITS_FIX }
  end
  for _, k in ipairs({ "MemoryLimit", "PidsLimit", "CpuCfsQuota" }) do
    if info[k] == false then missing[#missing + 1] = k end
  end
  if #missing == 0 then return { ok = true, detail = "enforced" } end
  return { ok = false, detail = ("Docker says it cannot enforce %s"):format(table.concat(missing, ", ")),
    fix = LIMITS_FIX }
end

--- What an engine offers beyond the defaults, from its own answers (pure: tested on
--- recorded bodies). raw = {version = GET /version, info = GET /info (Docker) or
--- GET /libpod/info (Podman), gvisor_info = the gVisor service's GET /libpod/info (Podman;
--- nil when none is configured), gvisor_err = why that service did not answer}.
--- opts = {gvisor_runtime, gvisor_socket}. Returns the facts:
--- {engine = "podman"|"docker", rootless = boolean, userns = "auto"|"remap"|"rootless"|nil,
---  userns_detail = string, remap_uid, remap_gid (remap), gvisor_path (Podman),
---  gvisor = {ok = boolean, detail = string, fix = string|nil},
---  limits = {ok = boolean, detail = string, fix = string|nil} (memory, process and CPU limits)}.
---@param raw table
---@param opts {gvisor_runtime: string, gvisor_socket: string|nil}
---@return table facts
function docker.read_facts(raw, opts)
  local v = type(raw.version) == "table" and raw.version or {}
  local engine = list_has(v.Components, function(c)
    return type(c) == "table" and tostring(c.Name):lower():find("podman", 1, true) ~= nil
  end) and "podman" or "docker"
  local f = { engine = engine, rootless = false }
  local i = type(raw.info) == "table" and raw.info or {}
  if engine == "podman" then
    local host = type(i.host) == "table" and i.host or {}
    f.rootless = type(host.security) == "table" and host.security.rootless == true
    f.limits = limits_of("podman", i, f.rootless)
    if f.rootless then
      f.userns, f.userns_detail = "rootless", "rootless Podman: uid 0 in a sandbox is your own uid on the host"
    elseif version_before(v.Version, docker.PODMAN_USERNS_AUTO_MIN) then
      f.userns_detail = ("rootful Podman %s: uid 0 in a sandbox is uid 0 on the host, held back by namespaces, "
        .. "capabilities and seccomp; its automatic user namespaces (userns=auto) wedge the engine or fail to mount "
        .. "when sandboxes start and end at once (podman#16062), so demesne asks for them from Podman %s on; "
        .. "rootless Podman gives one now"):format(tostring(v.Version), docker.PODMAN_USERNS_AUTO_MIN)
    else
      f.userns, f.userns_detail = "auto", "rootful Podman: each sandbox gets its own user namespace (userns=auto), "
        .. "so uid 0 in a sandbox is an unprivileged uid from the containers range of /etc/subuid"
    end
    local gi = raw.gvisor_info
    local rt = type(gi) == "table" and type(gi.host) == "table" and gi.host.ociRuntime or nil
    if not opts.gvisor_socket then
      f.gvisor = { ok = false, detail = "Podman's API cannot choose a runtime per container, and no Podman service "
        .. "running gVisor is configured (gvisor_engine)", fix = PODMAN_GVISOR_FIX }
    elseif type(gi) ~= "table" then
      f.gvisor = { ok = false, detail = ("the gVisor service at %s (gvisor_engine) does not answer: %s"):format(
        opts.gvisor_socket, tostring(raw.gvisor_err)), fix = PODMAN_GVISOR_FIX }
    elseif type(rt) ~= "table" or not tostring(rt.version):find("runsc", 1, true) then
      f.gvisor = { ok = false, detail = ("the Podman service at %s runs %s, not gVisor"):format(opts.gvisor_socket,
        tostring(type(rt) == "table" and rt.path or "an unknown runtime")), fix = PODMAN_GVISOR_FIX }
    else
      f.gvisor_path = rt.path
      f.gvisor = { ok = true, detail = ("the Podman service at %s runs %s (%s)"):format(opts.gvisor_socket,
        tostring(rt.path), (tostring(rt.version):gsub("\n.*", ""))) }
    end
    return f
  end
  local function secopt(name)
    return list_has(i.SecurityOptions, function(o) return tostring(o):match("name=([^,]+)") == name end)
  end
  f.rootless = secopt("rootless")
  f.limits = limits_of("docker", i, f.rootless)
  if f.rootless then
    f.userns, f.userns_detail = "rootless", "rootless Docker: uid 0 in a sandbox is your own uid on the host"
  elseif secopt("userns") then
    -- the remapped root's ids name Docker's data folder: /var/lib/docker/231072.231072
    local uid, gid = tostring(i.DockerRootDir):match("/(%d+)%.(%d+)$")
    f.remap_uid, f.remap_gid = tonumber(uid), tonumber(gid)
    f.userns, f.userns_detail = "remap", ("Docker's userns-remap is on: uid 0 in a sandbox is uid %s on the host")
      :format(uid or "(unknown)")
  else
    f.userns_detail = "Docker without userns-remap: uid 0 in a sandbox is uid 0 on the host, held back by "
      .. "namespaces, capabilities and seccomp (turn on userns-remap in /etc/docker/daemon.json for a user namespace)"
  end
  f.gvisor = docker_gvisor(i, opts.gvisor_runtime)
  return f
end

--- Asks the engine what it offers beyond the defaults (docker.read_facts), fills in
--- capabilities.runtimes (gvisor), capabilities.userns and capabilities.limits, and returns
--- the facts. The
--- engine's own answers are kept for 5 minutes (30 seconds when asked about gVisor: a
--- runtime registered meanwhile is seen soon). Podman's gVisor lives in another service,
--- asked only when `opts.gvisor` is true (a gVisor sandbox, `demesne doctor`) and kept for
--- 30 seconds; until then its facts say it was not asked. Returns nil, message, code when
--- the engine does not answer.
---@param opts {gvisor: boolean|nil}|nil
---@return table|nil facts, string|nil err, string|nil code
function Engine:probe(opts)
  local want_gvisor = type(opts) == "table" and opts.gvisor == true
  local now = loop.time()
  local raw = self.raw
  -- asked about gVisor, Docker's answer (its Runtimes) is not older than PROBE_SECONDS either
  if not raw or now - self.raw_at >= (want_gvisor and PROBE_SECONDS or ENGINE_FACTS_SECONDS) then
    local v, err, code = ok_json(self, "GET", "/version", nil, nil, "engine version")
    if not v then return nil, err, code end
    raw = { version = v }
    local podman = docker.read_facts(raw, {}).engine == "podman"
    raw.info, err, code = ok_json(self, "GET", "/info", nil, nil, "engine info", podman and { prefix = "/v4.0.0/libpod" } or nil)
    if not raw.info then return nil, err, code end
    raw.podman = podman
    self.raw, self.raw_at = raw, now
  end
  local asked = self.gvisor_raw
  if raw.podman and self.gvisor_socket and want_gvisor and (not asked or now - asked.at >= PROBE_SECONDS) then
    local gi, gerr = ok_json(self, "GET", "/info", nil, nil, "gVisor service info",
      { socket = self.gvisor_socket, prefix = "/v4.0.0/libpod" })
    asked = { info = gi, err = gerr, at = now }
    self.gvisor_raw = asked
  end
  local f = docker.read_facts({ version = raw.version, info = raw.info, gvisor_info = asked and asked.info,
    gvisor_err = asked and asked.err or "not asked yet" }, { gvisor_runtime = self.gvisor_runtime,
    gvisor_socket = self.gvisor_socket })
  self.kind = f.engine
  self.capabilities.runtimes = { gvisor = f.gvisor.ok or nil }
  self.capabilities.userns = f.userns ~= nil
  self.capabilities.limits = f.limits.ok
  self.facts = f
  return f
end

-- lchown of `path` and, in a folder, of what lies beneath it down to `depth` more levels
-- (symlinks themselves, never followed).
local function lchown_tree(path, uid, gid, depth)
  local ok, err = fs.lchown(path, uid, gid)
  if not ok then return nil, err end
  local st = fs.lstat(path)
  if depth > 0 and st and st.type == "directory" then
    for _, n in ipairs(fs.readdir(path) or {}) do
      ok, err = lchown_tree(path .. "/" .. n, uid, gid, depth - 1)
      if not ok then return nil, err end
    end
  end
  return true
end

-- The folders of the spec's rw mounts, handed to Docker's remapped root (userns-remap has no
-- per-mount option like Podman's U). Only folders demesne made for this sandbox, before the
-- sandbox exists, are rw: nothing in them was written by a sandbox.
local function give_to_remapped_root(s, f)
  if not (f.remap_uid and f.remap_gid) then
    return nil, "Docker's userns-remap is on but its remapped root could not be found (DockerRootDir)", "ENOTSUP"
  end
  for _, m in ipairs(s.mounts or {}) do
    if m.mode == "rw" then
      local ok, err = lchown_tree(m.source, f.remap_uid, f.remap_gid, 2)
      if not ok then return nil, ("mount %s: %s"):format(m.target, tostring(err)), "EENGINE" end
    end
  end
  return true
end

-- After a gVisor create: the engine really runs it on gVisor (a silent downgrade to the
-- default runtime would be worse than a refusal). Returns true or nil, message.
local function check_gvisor(self, id, f)
  if f.engine == "podman" then
    local t = ok_json(self, "GET", "/containers/" .. seg(id) .. "/json", nil, nil, "inspect container",
      { prefix = "/v4.0.0/libpod" })
    local rt = type(t) == "table" and t.OCIRuntime or nil
    if rt ~= f.gvisor_path then return nil, ("the engine created it with runtime %s"):format(tostring(rt)) end
  else
    local t = ok_json(self, "GET", "/containers/" .. seg(id) .. "/json", nil, nil, "inspect container")
    local rt = type(t) == "table" and type(t.HostConfig) == "table" and t.HostConfig.Runtime or nil
    if rt ~= self.gvisor_runtime then return nil, ("the engine created it with runtime %s"):format(tostring(rt)) end
  end
  return true
end

--- POST /containers/create?name=<spec.name> with the sandbox spec translated
--- (docker.create_body). Returns the container's id. A spec this adapter cannot honour is
--- refused (spec.check: EINVAL, ENOTSUP), a taken name is ECONFLICT, a missing image ENOENT.
--- spec.runtime "gvisor": on Docker the registered runtime (gvisor_runtime), on Podman a
--- create through the gVisor service (gvisor_socket); either way the created container's
--- runtime is checked, and one that is not gVisor is removed and refused (ENOTSUP).
--- spec.userns: rootful Podman's userns=auto with the U option on rw mounts; Docker's
--- userns-remap with the rw mounts' folders chowned to the remapped root first.
---@param s table  the sandbox spec
---@return string|nil id, string|nil err, string|nil code
function Engine:create(s)
  local f, perr, pcode = self:probe({ gvisor = s.runtime == "gvisor" })
  if not f then return nil, "create container: " .. tostring(perr), pcode end
  local ok, cerr, ccode = engine_spec.check(s, self.capabilities)
  if not ok then return nil, "create container: " .. cerr, ccode end
  if s.userns and f.userns == "remap" then
    ok, cerr, ccode = give_to_remapped_root(s, f)
    if not ok then return nil, "create container: " .. cerr, ccode end
  end
  local gvisor = s.runtime == "gvisor"
  local t, err, code = ok_json(self, "POST", "/containers/create", s.name and { name = s.name } or nil,
    docker.create_body(s, { gvisor_runtime = f.engine == "docker" and self.gvisor_runtime or nil, userns = f.userns }),
    "create container", { socket = gvisor and f.engine == "podman" and self.gvisor_socket or nil })
  if not t then
    -- Podman 4 answers a taken name with HTTP 500 ("… is already in use"), Docker with 409
    if code == "EENGINE" and tostring(err):find("already in use", 1, true) then code = "ECONFLICT" end
    if s.userns and f.userns == "auto" and tostring(err):find("subuid", 1, true) then
      err = err .. " (Podman's userns=auto needs a range for the user containers in /etc/subuid and /etc/subgid, "
        .. "e.g. the line containers:2147483647:2147483648 in both; or set userns = false)"
    end
    return nil, err, code
  end
  if gvisor then
    local gok, gerr = check_gvisor(self, t.Id, f)
    if not gok then
      self:remove(t.Id)
      return nil, ("create container: refused to run it without gVisor: %s"):format(gerr), "ENOTSUP"
    end
  end
  return t.Id
end

--- POST /containers/{id}/start.
---@param id string  container id or name
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:start(id)
  local res, err, code = self:call("POST", "/containers/" .. seg(id) .. "/start")
  if not res then return nil, err, code end
  if res.status >= 300 and res.status ~= 304 then return engine_error(res, "start container") end
  return true
end

--- POST /containers/{id}/wait: blocks until the container stops. Returns its exit code.
---@param id string
---@return integer|nil code, string|nil err, string|nil ecode
function Engine:wait(id)
  local t, err, code = ok_json(self, "POST", "/containers/" .. seg(id) .. "/wait", { condition = "not-running" }, nil,
    "wait for container", { timeout_ms = 0 })
  if not t then return nil, err, code end
  return t.StatusCode
end

--- POST /containers/{id}/kill with a signal name ("KILL", "TERM").
---@param id string
---@param signal string|nil  default "KILL"
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:kill(id, signal)
  local res, err, code = self:call("POST", "/containers/" .. seg(id) .. "/kill", { signal = signal or "KILL" })
  if not res then return nil, err, code end
  if res.status >= 300 then return engine_error(res, "kill container") end
  return true
end

--- Neutral resource use from a Docker stats body (GET /containers/{id}/stats): memory in
--- use as `docker stats` counts it (usage less the page cache the kernel can drop:
--- inactive_file on cgroup v2, total_inactive_file on v1), the memory limit, processes and
--- CPU time. Fields the engine does not report are nil.
---@param t table
---@return {memory_bytes: integer|nil, memory_limit_bytes: integer|nil, pids: integer|nil, cpu_ns: integer|nil}
function docker.stats_info(t)
  local function int(x) return type(x) == "number" and x >= 0 and math.tointeger(math.floor(x)) or nil end
  local m = type(t.memory_stats) == "table" and t.memory_stats or {}
  local st = type(m.stats) == "table" and m.stats or {}
  local used = int(m.usage)
  local cache = int(st.inactive_file) or int(st.total_inactive_file)
  if used and cache and cache <= used then used = used - cache end
  local cpu = type(t.cpu_stats) == "table" and type(t.cpu_stats.cpu_usage) == "table" and t.cpu_stats.cpu_usage or {}
  local limit = int(m.limit)
  return { memory_bytes = used, memory_limit_bytes = limit and limit > 0 and limit or nil,
    pids = int(type(t.pids_stats) == "table" and t.pids_stats.current or nil), cpu_ns = int(cpu.total_usage) }
end

--- GET /containers/{id}/stats?stream=false&one-shot=true: one sample of a container's
--- resource use (docker.stats_info), at once (one-shot: no wait for a second CPU sample;
--- Docker 20.10+ and Podman 3.2+ honour it). A container that is not running reports no
--- memory (memory_bytes 0 or nil, as the engine says). ENOENT when there is no such container.
---@param id string
---@return {memory_bytes: integer|nil, memory_limit_bytes: integer|nil, pids: integer|nil, cpu_ns: integer|nil}|nil stats, string|nil err, string|nil code
function Engine:stats(id)
  local t, err, code = ok_json(self, "GET", "/containers/" .. seg(id) .. "/stats",
    { stream = false, ["one-shot"] = true }, nil, "container stats", { timeout_ms = 10000 })
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "container stats: the engine answered no JSON object", "EENGINE" end
  return docker.stats_info(t)
end

--- DELETE /containers/{id}?force=true&v=true. A container that is already gone is success
--- with the second value "gone".
---@param id string
---@return boolean|nil ok, string|nil how_or_err, string|nil code
function Engine:remove(id)
  local res, err, code
  for attempt = 1, 5 do
    res, err, code = self:call("DELETE", "/containers/" .. seg(id), { force = true, v = true })
    if not res then return nil, err, code end
    -- Podman 4 answers 500 "… could not be stopped … container state improper" for a
    -- container caught while its main process exits: it is stopping, so ask again
    if not (res.status == 500 and tostring(res.body):find("state improper", 1, true)) then break end
    async.sleep(50 * attempt)
  end
  if res.status == 404 then return true, "gone" end
  if res.status == 409 then
    -- removal already in progress (e.g. two destroys at once): wait for it to finish
    for _ = 1, 50 do
      async.sleep(100)
      local r2 = self:call("GET", "/containers/" .. seg(id) .. "/json")
      if r2 and r2.status == 404 then return true, "gone" end
    end
    return engine_error(res, "remove container")
  end
  if res.status >= 300 then return engine_error(res, "remove container") end
  return true
end

--- GET /containers/{id}/json. Returns neutral container info (docker.container_info), or
--- nil, msg, "ENOENT" when there is no such container. `id` may be a name.
---@param id string
---@return table|nil info, string|nil err, string|nil code
function Engine:inspect(id)
  local t, err, code = ok_json(self, "GET", "/containers/" .. seg(id) .. "/json", nil, nil, "inspect container")
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "inspect container: the engine answered no JSON object", "EENGINE" end
  return docker.container_info(t)
end

--- GET /containers/json?all=true&filters={label:[...]}. labels: list of "k=v" or "k", all
--- of which must match. Returns a list of neutral summaries (docker.container_summary),
--- stopped containers included.
---@param labels string[]
---@return table[]|nil list, string|nil err, string|nil code
function Engine:list(labels)
  local t, err, code = ok_json(self, "GET", "/containers/json", { all = true, filters = { label = labels } }, nil,
    "list containers")
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "list containers: the engine answered no JSON list", "EENGINE" end
  local out = {}
  for i, c in ipairs(t) do out[i] = docker.container_summary(c) end
  return out
end

-- POST /containers/{id}/exec with `body` (an ExecConfig). Returns the answer ({Id}), or nil,
-- msg, code: ECONFLICT when the container does not run (Docker answers 409, Podman 4 a 500
-- "container state improper").
local function create_exec(self, id, body)
  local t, err, code = ok_json(self, "POST", "/containers/" .. seg(id) .. "/exec", nil, body, "create exec")
  if not t and code == "EENGINE" then
    local info = self:inspect(id)
    if info and info.state ~= "running" then
      return nil, ("create exec: container %s is not running"):format(id), "ECONFLICT"
    end
  end
  return t, err, code
end

--- Runs argv in a running container through the exec API and waits for it to end.
--- opts: env (list "K=V"), workdir, user, timeout_ms (the host-side deadline for the whole
--- run, from the exec's start; 0 or nil: none). Output is discarded (demesne-init writes it
--- to files). Returns exit code, or nil, msg, code: "ETIMEDOUT" when the deadline passed
--- (the process may still run: the exec API cannot stop it). Cancelling the task aborts the
--- wait, not the process: use demesne-init kill for that.
---@param id string
---@param argv string[]
---@param opts {env: string[]|nil, workdir: string|nil, user: string|nil, timeout_ms: integer|nil}|nil
---@return integer|nil code, string|nil err, string|nil ecode
function Engine:exec(id, argv, opts)
  opts = opts or {}
  local t, err, code = create_exec(self, id, {
    Cmd = argv, Env = opts.env, WorkingDir = opts.workdir, User = opts.user,
    AttachStdout = true, AttachStderr = true, AttachStdin = false, Tty = false,
  })
  if not t then return nil, err, code end
  local exec_id = t.Id
  local res
  local deadline = opts.timeout_ms and opts.timeout_ms > 0 and math.floor(opts.timeout_ms) or 0
  res, err, code = self:call("POST", "/exec/" .. seg(exec_id) .. "/start", nil, { Detach = false, Tty = false },
    { timeout_ms = deadline, on_data = function() end })
  if not res then
    if code == "ETIMEDOUT" and deadline > 0 then
      return nil, ("the command in container %s did not end within %d s"):format(id, deadline // 1000), "ETIMEDOUT"
    end
    return nil, err, code
  end
  if res.status >= 300 then return engine_error(res, "start exec") end
  local info
  for _ = 1, 100 do
    info, err, code = ok_json(self, "GET", "/exec/" .. seg(exec_id) .. "/json", nil, nil, "inspect exec")
    if not info then return nil, err, code end
    if not info.Running then break end
    async.sleep(20)
  end
  local exit = type(info.ExitCode) == "number" and math.tointeger(info.ExitCode) or nil
  if info.Running or not exit then
    return nil, ("exec in container %s: its output ended but the engine reports no exit code"):format(id), "EENGINE"
  end
  return exit
end

--- A process started by Engine:exec_stream: its stdin and stdout as a byte stream.
---@class ExecStream
---@field write fun(self: ExecStream, data: string, cb: fun(ok: boolean|nil)|nil)  to its stdin
---@field shutdown fun(self: ExecStream)  ends its stdin (the process reads end of file)
---@field pause fun(self: ExecStream)     stops delivering its stdout (back-pressure)
---@field resume fun(self: ExecStream)
---@field queued fun(self: ExecStream): integer  bytes written and not yet sent
---@field close fun(self: ExecStream)     hangs up (idempotent)
local ExecStream = {}
ExecStream.__index = ExecStream

local EXEC_HEAD_MAX = 16384 -- bytes of the engine's answer head
local EXEC_STDERR_MAX = 4096 -- bytes of stderr kept for the end callback

--- Queues `data` for the process's stdin; cb(true) or cb(nil, msg, code) once written.
---@param data string
---@param cb fun(ok: boolean|nil)|nil
---@return boolean|nil ok, string|nil err, string|nil code
function ExecStream:write(data, cb)
  if self.closed then return nil, "the exec stream is closed", "ECANCELED" end
  return self.s:write(data, cb)
end
--- Ends the process's stdin after what is queued (it reads end of file).
function ExecStream:shutdown() if not self.closed then self.s:shutdown() end end
--- Bytes written and not yet sent.
---@return integer
function ExecStream:queued() return self.closed and 0 or self.s:write_queue_size() end
--- Stops delivering the process's stdout until resume (back-pressure).
function ExecStream:pause()
  if not self.closed and not self.paused then self.paused = true self.s:read_stop() end
end
--- Delivers the process's stdout again after pause.
function ExecStream:resume()
  if not self.closed and self.paused then self.paused = false self.s:read_start(self.reader) end
end
--- Hangs up (the process's stdin ends; on_out(nil, stderr) follows if it has not). Idempotent.
function ExecStream:close()
  if self.closed then return end
  self.closed = true
  self.s:close()
  if not self.ended then
    self.ended = true
    self.on_out(nil, self.stderr)
  end
end

--- POST /containers/{id}/exec with stdin attached, then /exec/{id}/start on a hijacked
--- connection: `argv` runs in the running container with its stdin fed by handle:write and
--- its stdout given to on_out(data) as it comes (the engine's frames undone); on_out(nil,
--- stderr) once at the end (the process ended or the connection broke; stderr: its first
--- 4 KiB). Returns the handle once the engine has started the process, or nil, msg, code
--- (ENOENT: no such container; ECONFLICT: not running). The exit code is not asked for.
---@param id string
---@param argv string[]
---@param on_out fun(data: string|nil, stderr: string|nil)
---@return ExecStream|nil handle, string|nil err, string|nil code
function Engine:exec_stream(id, argv, on_out)
  local t, err, code = create_exec(self, id, {
    Cmd = argv, AttachStdin = true, AttachStdout = true, AttachStderr = true, Tty = false,
  })
  if not t then return nil, err, code end
  local s, cerr, ccode = async.await(function(cb)
    local ok, e, c = stream.connect_unix(self.socket, cb)
    if not ok then cb(nil, e, c) end
  end)
  if not s then return nil, ("container engine at %s: %s"):format(self.socket, tostring(cerr)), ccode end
  local h = setmetatable({ s = s, on_out = on_out, stderr = "" }, ExecStream)
  local body = '{"Detach":false,"Tty":false}'
  s:write(("POST /v1.41/exec/%s/start HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
    .. "Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: %d\r\n\r\n%s"):format(seg(t.Id), #body, body))
  local buf, started = "", async.event()
  local status
  local function finish()
    if h.ended then return end
    h.ended = true
    h.on_out(nil, h.stderr)
  end
  local function frames()
    -- [8-byte header: stream (0 stdin, 1 stdout, 2 stderr), 0, 0, 0, size (big-endian u32)] payload
    while #buf >= 8 do
      local kind, size = buf:byte(1), string.unpack(">I4", buf, 5)
      if #buf < 8 + size then return end
      local payload = buf:sub(9, 8 + size)
      buf = buf:sub(9 + size)
      if kind == 2 then
        if #h.stderr < EXEC_STDERR_MAX then h.stderr = (h.stderr .. payload):sub(1, EXEC_STDERR_MAX) end
      elseif kind == 1 and #payload > 0 then
        h.on_out(payload)
      end
    end
  end
  h.reader = function(data)
    if not data then
      if not status then status = false started.set() end
      h.closed = true
      s:close()
      return finish()
    end
    buf = buf .. data
    if not status then
      local e = buf:find("\r\n\r\n", 1, true)
      if not e then
        if #buf > EXEC_HEAD_MAX then status = false started.set() h:close() end
        return
      end
      status = tonumber(buf:match("^HTTP/1%.%d (%d%d%d)")) or 0
      h.head = buf:sub(1, e + 3)
      buf = buf:sub(e + 4)
      started.set()
      if status ~= 101 and status ~= 200 then return end
    end
    frames()
  end
  s:read_start(h.reader)
  started.wait()
  if status ~= 101 and status ~= 200 then
    local msg = h.head and h.head:match("^[^\r\n]*") or "no answer"
    h.ended = true
    h:close()
    return nil, ("start exec: the engine answered %s"):format(msg), "EENGINE"
  end
  return h
end

-- POST /containers/{id}/pause or /unpause (`pause` true or false). A container already
-- in the state asked for is success: the engine says "already paused" / "not paused", or
-- (Podman, 500 "container state improper") an unpause finds it not paused on inspect.
local function set_paused(self, id, pause)
  local verb = pause and "pause" or "unpause"
  local res, err, code = self:call("POST", "/containers/" .. seg(id) .. "/" .. verb)
  if not res then return nil, err, code end
  if res.status < 300 then return true end
  local _, msg, ecode = engine_error(res, verb .. " container")
  local m = tostring(msg)
  if m:find(pause and "already paused" or "not paused", 1, true) then return true end
  -- Docker 409 "is not running", Podman 500 "container state improper"
  if ecode == "EENGINE" and m:find("state improper", 1, true) then
    if not pause then
      local info = self:inspect(id)
      if info and not info.paused then return true end
    end
    ecode = "ECONFLICT"
  end
  return nil, msg, ecode
end

--- POST /containers/{id}/pause: freezes every process of a running container (the cgroup
--- freezer; under gVisor, runsc pause). A paused container lists as state "running" with
--- paused = true. Pausing a paused one is success.
---@param id string
---@return boolean|nil ok, string|nil err, string|nil code  ECONFLICT: not running
function Engine:pause(id) return set_paused(self, id, true) end

--- POST /containers/{id}/unpause: thaws a paused container. Unpausing one that is not
--- paused is success.
---@param id string
---@return boolean|nil ok, string|nil err, string|nil code  ECONFLICT: not running
function Engine:unpause(id) return set_paused(self, id, false) end

--- GET /containers/{id}/json?size=true: the bytes the container has written to its own
--- root filesystem layer (SizeRw; tmpfs and bind mounts are not in it).
---@param id string
---@return {rw_bytes: integer}|nil size, string|nil err, string|nil code
function Engine:size(id)
  local t, err, code = ok_json(self, "GET", "/containers/" .. seg(id) .. "/json", { size = true }, nil,
    "inspect container size")
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "inspect container size: the engine answered no JSON object", "EENGINE" end
  return { rw_bytes = math.tointeger(t.SizeRw) or 0 }
end

-- One LABEL instruction of a commit's `changes` (Dockerfile syntax): the value in double
-- quotes. Podman 4.3 keeps a backslash escape as written, so a value with '"', '\\' or a
-- line break cannot be given the same on both engines: nil.
local function label_change(k, v)
  v = tostring(v)
  if not tostring(k):match("^[%w_.%-/]+$") or v:find('[\r\n"\\]') then return nil end
  return ('LABEL %s="%s"'):format(k, v)
end

--- POST /commit?container=<id>&repo=&tag=: the container's root filesystem layer (not its
--- tmpfs or bind mounts, nor its processes) becomes the image repo:tag, with `labels` added
--- to the image's (as LABEL changes: Podman ignores a config body; a value with '"', '\\'
--- or a line break is EINVAL). `clear_env` names variables of the container's environment
--- that the image keeps empty (its secrets: a commit keeps the container's Env). The
--- container is paused while it is copied. Returns the image id.
---@param id string
---@param opts {repo: string, tag: string, labels: table<string, string>|nil, clear_env: string[]|nil}
---@return string|nil image_id, string|nil err, string|nil code
function Engine:commit(id, opts)
  local changes = {}
  local keys = {}
  for k in pairs(opts.labels or {}) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local c = label_change(k, opts.labels[k])
    if not c then
      return nil, ("commit container: label %s: a key of letters, digits and . _ - /, and a value without '\"', '\\' "
        .. "or a line break"):format(k), "EINVAL"
    end
    changes[#changes + 1] = c
  end
  for _, name in ipairs(opts.clear_env or {}) do
    if not tostring(name):match("^[A-Za-z_][A-Za-z0-9_]*$") then
      return nil, ("commit container: clear_env: %q is not a variable name"):format(tostring(name)), "EINVAL"
    end
    changes[#changes + 1] = ('ENV %s=""'):format(name)
  end
  local q = { container = id, repo = opts.repo, tag = opts.tag, pause = true }
  if #changes > 0 then q.changes = table.concat(changes, "\n") end
  local t, err, code = ok_json(self, "POST", "/commit", q, {}, "commit container", { timeout_ms = 0 })
  if not t then return nil, err, code end
  if type(t) ~= "table" or type(t.Id) ~= "string" then return nil, "commit container: the engine answered no id", "EENGINE" end
  return t.Id
end

--- GET /images/json?filters={label:[...]}: the images with all of the labels ("k=v" or
--- "k"). Returns a list of {id, refs = {"repo:tag", ...}, labels, created (epoch seconds),
--- size_bytes}.
---@param labels string[]
---@return table[]|nil images, string|nil err, string|nil code
function Engine:image_list(labels)
  local t, err, code
  -- Podman 4.3 fails the whole list ("reading image …: image not known") when an image goes
  -- while it lists (another server's snapshot retention, say): asked again, it lists the rest
  for _ = 1, 4 do
    t, err, code = ok_json(self, "GET", "/images/json", { filters = { label = labels } }, nil, "list images")
    if t or not tostring(err):find("image not known", 1, true) then break end
  end
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "list images: the engine answered no JSON list", "EENGINE" end
  local out = {}
  for _, i in ipairs(t) do
    local refs = {}
    for _, r in ipairs(type(i.RepoTags) == "table" and i.RepoTags or {}) do
      if r ~= "<none>:<none>" then refs[#refs + 1] = r end
    end
    out[#out + 1] = { id = i.Id, refs = refs, labels = type(i.Labels) == "table" and i.Labels or {},
      created = math.tointeger(i.Created) or 0, size_bytes = math.tointeger(i.Size) or 0 }
  end
  return out
end

--- DELETE /images/{ref} (never forced: an image a container still uses is not removed).
--- Returns true, or true, "gone" when there is no such image; ECONFLICT while a container
--- uses it.
---@param ref string  an image id or repo:tag
---@return boolean|nil ok, string|nil how_or_err, string|nil code
function Engine:image_remove(ref)
  local res, err, code = self:call("DELETE", "/images/" .. seg(ref))
  if not res then return nil, err, code end
  if res.status == 404 then return true, "gone" end
  if res.status >= 300 then
    local _, msg, ecode = engine_error(res, "remove image")
    if ecode == "EENGINE" and tostring(msg):find("in use", 1, true) then ecode = "ECONFLICT" end
    return nil, msg, ecode
  end
  return true
end

--- PUT /containers/{id}/archive?path=DIR with a tar file as the body (streamed from disk).
---@param id string
---@param dir string       the folder in the container
---@param tar_path string  the tar on the host
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:put_archive(id, dir, tar_path)
  local res, err, code = self:call("PUT", "/containers/" .. seg(id) .. "/archive", { path = dir }, nil, {
    body_file = tar_path, headers = { ["Content-Type"] = "application/x-tar" }, timeout_ms = 0 })
  if not res then return nil, err, code end
  if res.status >= 300 then return engine_error(res, "upload") end
  return true
end

--- GET /containers/{id}/archive?path=PATH, the tar written to out_path (streamed).
---@param id string
---@param path string      the path in the container
---@param out_path string  where the tar goes on the host
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:get_archive(id, path, out_path)
  local res, err, code = self:call("GET", "/containers/" .. seg(id) .. "/archive", { path = path }, nil, {
    output_file = out_path, timeout_ms = 0 })
  if not res then return nil, err, code end
  if res.status >= 300 then
    local f = io.open(out_path, "rb")
    res.body = f and f:read(4096) or ""
    if f then f:close() end
    os.remove(out_path)
    return engine_error(res, "download " .. path)
  end
  return true
end

--- Seconds since the epoch of an RFC 3339 time ("2026-12-01T21:43:33.123456789Z",
--- "…+01:00"), or nil when it is not one.
---@param s any
---@return integer|nil
function docker.rfc3339(s)
  if type(s) ~= "string" then return nil end
  local y, mo, d, h, mi, sec, rest = s:match("^(%d%d%d%d)%-(%d%d)%-(%d%d)[Tt ](%d%d):(%d%d):(%d%d)%.?%d*(.*)$")
  if not y then return nil end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  -- days from 1970-01-01 to y-mo-d (the proleptic Gregorian calendar, H. Hinnant's days_from_civil)
  local yy = mo <= 2 and y - 1 or y
  local era = (yy >= 0 and yy or yy - 399) // 400
  local yoe = yy - era * 400
  local doy = (153 * (mo + (mo > 2 and -3 or 9)) + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  local days = era * 146097 + doe - 719468
  local off = 0
  local sign, oh, om = rest:match("^([+-])(%d%d):?(%d%d)$")
  if sign then off = (tonumber(oh) * 3600 + tonumber(om) * 60) * (sign == "+" and 1 or -1)
  elseif rest ~= "Z" and rest ~= "z" and rest ~= "" then return nil end
  return days * 86400 + tonumber(h) * 3600 + tonumber(mi) * 60 + tonumber(sec) - off
end

--- GET /images/{ref}/json. Returns {id, labels, env = {"K=V"…} (the image's ENV), created
--- (epoch seconds, or nil when the engine gives no time), onbuild = {string} (its ONBUILD
--- triggers, which a build FROM it runs; empty when none)}, or nil, msg, "ENOENT". Podman leaves the triggers out of its inspect answer (even of an image
--- in the Docker format, which keeps them and runs them): with opts.onbuild, on an engine
--- other than Docker, `onbuild` is also read from the image's history (GET
--- /images/{ref}/history, its "#(nop) ONBUILD …" steps), which may name triggers a child
--- image already consumed — it errs towards reporting them.
---@param ref string
---@param opts {onbuild: boolean|nil}|nil
---@return table|nil image, string|nil err, string|nil code
function Engine:image_inspect(ref, opts)
  local t, err, code = ok_json(self, "GET", "/images/" .. seg(ref) .. "/json", nil, nil, "inspect image")
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "inspect image: the engine answered no JSON object", "EENGINE" end
  local cfg = type(t.Config) == "table" and t.Config or {}
  local onbuild = {}
  for _, v in ipairs(type(cfg.OnBuild) == "table" and cfg.OnBuild or {}) do onbuild[#onbuild + 1] = tostring(v) end
  if opts and opts.onbuild and #onbuild == 0 and self.kind ~= "docker" then
    local h, herr, hcode = ok_json(self, "GET", "/images/" .. seg(ref) .. "/history", nil, nil, "image history")
    if not h then return nil, herr, hcode end
    for _, step in ipairs(type(h) == "table" and h or {}) do
      local by = type(step) == "table" and tostring(step.CreatedBy or "") or ""
      local trigger = by:match("#%(nop%)%s+ONBUILD%s+(.*)$")
      if trigger then onbuild[#onbuild + 1] = trigger end
    end
  end
  return { id = t.Id, labels = type(cfg.Labels) == "table" and cfg.Labels or {},
    env = type(cfg.Env) == "table" and cfg.Env or {}, created = docker.rfc3339(t.Created), onbuild = onbuild }
end

-- Streams the engine's JSON progress lines (build, import, pull) to on_line(text): the
-- text of each line ({stream=…} of a build, {status=…} of a pull or import).
local function progress_stream(on_line, state)
  local buf = ""
  return function(chunk)
    buf = buf .. chunk
    while true do
      local nl = buf:find("\n", 1, true)
      if not nl then break end
      local line = buf:sub(1, nl - 1)
      buf = buf:sub(nl + 1)
      local t = json.decode(line)
      if type(t) == "table" then
        if t.error or t.errorDetail then state.error = t.error or (t.errorDetail and t.errorDetail.message) end
        -- an error status's body ({"message": …}) arrives here too when it is streamed
        if type(t.message) == "string" and not t.stream and not t.status then state.message = t.message end
        local text = t.stream or t.status
        if on_line and type(text) == "string" then on_line(text) end
      end
    end
    if #buf > 1024 * 1024 then buf = "" end
  end
end

-- base64url with padding (RFC 4648 §5), the encoding of X-Registry-Auth and X-Registry-Config.
local B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
local function base64url(bytes)
  local out = {}
  for i = 1, #bytes, 3 do
    local a, b, c = bytes:byte(i, i + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    for k = 0, 3 do
      local v = (n >> (18 - 6 * k)) & 63
      out[#out + 1] = ((k == 2 and not b) or (k == 3 and not c)) and "=" or B64URL:sub(v + 1, v + 1)
    end
  end
  return table.concat(out)
end

-- One registry credential (the neutral {username, password} or {identity_token}, with
-- server) as Docker's AuthConfig.
local function auth_config(cred)
  if cred.identity_token then return { identitytoken = cred.identity_token, serveraddress = cred.server } end
  return { username = cred.username or "", password = cred.password or "", serveraddress = cred.server }
end

--- The X-Registry-Auth header value of one credential: base64url of a JSON AuthConfig.
---@param cred {username: string|nil, password: string|nil, identity_token: string|nil, server: string}
---@return string
function docker.registry_auth(cred) return base64url(json.encode(auth_config(cred))) end

--- The X-Registry-Config header value of a build: base64url of a JSON map server -> AuthConfig.
---@param creds table<string, table>  server -> credential (as docker.registry_auth takes)
---@return string
function docker.registry_config(creds)
  local m = {}
  for server, cred in pairs(creds) do m[server] = auth_config(cred) end
  return base64url(json.encode(m))
end

--- POST /build with a tar build context from disk. opts: tag, buildargs (table), network
--- (the build's network mode: "host", "none"), dockerfile (default "Containerfile"), labels,
--- target (the stage to build, of a multi-stage Containerfile), registry_auth (server ->
--- credential {username, password} or {identity_token}: the registries its FROM lines pull
--- from; sent as X-Registry-Config, for this build only), no_cache (true: no step is taken
--- from the engine's cache).
--- on_line(text) receives the text of each progress line ("STEP 1/3: FROM …").
---@param context_tar string  the build context, a tar on the host
---@param opts {tag: string, buildargs: table|nil, network: string|nil, dockerfile: string|nil, labels: table|nil, target: string|nil, registry_auth: table|nil, no_cache: boolean|nil}
---@param on_line fun(text: string)|nil
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:build(context_tar, opts, on_line)
  local state = {}
  local q = { t = opts.tag, rm = true, forcerm = true, networkmode = opts.network,
    dockerfile = opts.dockerfile or "Containerfile", buildargs = opts.buildargs, labels = opts.labels,
    target = opts.target, nocache = opts.no_cache or nil }
  local headers = { ["Content-Type"] = "application/x-tar" }
  if opts.registry_auth and next(opts.registry_auth) then
    headers["X-Registry-Config"] = docker.registry_config(opts.registry_auth)
  end
  local res, err, code = self:call("POST", "/build", q, nil, { body_file = context_tar, timeout_ms = 0,
    headers = headers, on_data = progress_stream(on_line, state) })
  if not res then return nil, err, code end
  if res.status >= 300 then return nil, "image build failed: HTTP " .. res.status, "EBUILD" end
  if state.error then return nil, "image build failed: " .. state.error, "EBUILD" end
  local img = self:image_inspect(opts.tag)
  if not img then return nil, "image build finished without producing " .. opts.tag, "EBUILD" end
  return true
end

--- POST /images/create?fromSrc=-: imports a root filesystem tar (from disk) as repo:tag.
---@param tar_path string
---@param repo string
---@param tag string
---@param on_line fun(text: string)|nil
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:import(tar_path, repo, tag, on_line)
  local state = {}
  -- repo:tag in one parameter: Podman 4.3 ignores a separate tag=
  local res, err, code = self:call("POST", "/images/create", { fromSrc = "-", repo = repo .. ":" .. tag }, nil, {
    body_file = tar_path, timeout_ms = 0, headers = { ["Content-Type"] = "application/x-tar" },
    on_data = progress_stream(on_line, state) })
  if not res then return nil, err, code end
  if res.status >= 300 or state.error then
    return nil, "image import failed: " .. tostring(state.error or res.status), "EBUILD"
  end
  return true
end

--- POST /images/create?fromImage=: pulls from a registry. opts.auth: a credential
--- ({username, password} or {identity_token}, with server) sent as X-Registry-Auth for this
--- pull only. Returns true or nil, msg, code ("EPULL"; "EACCES" when the registry refused
--- or wanted credentials).
---@param ref string  name[:tag] or name@digest
---@param timeout_ms integer|nil
---@param on_line fun(text: string)|nil
---@param opts {auth: table|nil}|nil
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:pull(ref, timeout_ms, on_line, opts)
  local state = {}
  local name, tag = ref:match("^(.-)@(.+)$")
  if not name then name, tag = ref:match("^(.-):([^:/]+)$") end
  local headers = {}
  if opts and opts.auth then headers["X-Registry-Auth"] = docker.registry_auth(opts.auth) end
  local res, err, code = self:call("POST", "/images/create", { fromImage = name or ref, tag = tag or "latest" }, nil,
    { timeout_ms = timeout_ms or 60000, on_data = progress_stream(on_line, state), headers = headers })
  if not res then return nil, err, code end
  if res.status >= 300 and not state.error then
    if state.message then
      state.error = state.message
    else
      local _, emsg = engine_error(res, "pull")
      state.error = (emsg:gsub("^pull: ", ""))
    end
  end
  if res.status >= 300 or state.error then
    local msg = tostring(state.error or res.status)
    local l = msg:lower()
    local denied = res.status == 401 or res.status == 403 or l:find("unauthorized", 1, true)
      or l:find("authentication required", 1, true) or l:find("no basic auth credentials", 1, true)
      or l:find("denied", 1, true) or l:find("invalid username/password", 1, true)
    return nil, "pull failed: " .. msg, denied and "EACCES" or "EPULL"
  end
  return true
end

--- POST /images/{src}/tag?repo=&tag=: gives an image another name (what a mirror served,
--- the name of the reference asked for). Returns true or nil, msg, code.
---@param src string  an image reference or id
---@param ref string  the new name, repo[:tag]
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:tag(src, ref)
  local repo, tag = ref:match("^(.-):([^:/]+)$")
  local ok, err, code = ok_json(self, "POST", "/images/" .. seg(src) .. "/tag", { repo = repo or ref,
    tag = tag or "latest" }, nil, "tag image")
  if not ok then return nil, err, code end
  return true
end

return docker
