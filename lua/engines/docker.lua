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
local async = require("demesne.async")
local json = require("demesne.json")
local engine_spec = require("demesne.engines.spec")

local docker = {}
local Engine = {}
Engine.__index = Engine

local request = async.wrap(http.request)

local function urlencode(s)
  return (tostring(s):gsub("[^%w%-%._~]", function(c) return ("%%%02X"):format(c:byte()) end))
end

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

local function query(q)
  if not q then return "" end
  local keys = {}
  for k in pairs(q) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = q[k]
    if type(v) == "table" then v = json.encode(v) end
    if type(v) == "boolean" then v = v and "true" or "false" end
    parts[#parts + 1] = urlencode(k) .. "=" .. urlencode(v)
  end
  return #parts > 0 and ("?" .. table.concat(parts, "&")) or ""
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
--- the unix sockets in them are shared live through bind mounts.
docker.CAPABILITIES = {
  bind_mounts = true,
  unix_socket_mounts = true,
  tmpfs = true,
  read_only_rootfs = true,
  bounded_logs = true,
  networks = { none = true, bridge = true },
  runtimes = {}, -- spec.runtime is not offered yet
  userns = false,
}

--- Creates an adapter for the Docker Engine API at a unix socket path.
---@param socket string
function docker.new(socket)
  return setmetatable({ socket = socket, name = "docker", capabilities = docker.CAPABILITIES }, Engine)
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
--- (Init = false: demesne-init is the container's init).
---@param s table  the sandbox spec
---@return table body  https://docs.docker.com/reference/api/engine/version/v1.41/#operation/ContainerCreate
function docker.create_body(s)
  local binds = json.array()
  for _, m in ipairs(s.mounts or {}) do binds[#binds + 1] = m.source .. ":" .. m.target .. ":" .. m.mode end
  local tmpfs = {}
  for _, t in ipairs(s.tmpfs or {}) do tmpfs[t.target] = "rw," .. (t.exec and "exec," or "") .. "mode=" .. t.mode end
  local lim = s.limits or {}
  local sec = s.security or {}
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
      PidsLimit = lim.pids,
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
  return {
    id = t.Id,
    name = type(t.Name) == "string" and (t.Name:gsub("^/", "")) or nil,
    image = cfg.Image,
    state = state,
    exit_code = (state == "exited" or state == "gone") and math.tointeger(st.ExitCode) or nil,
    labels = type(cfg.Labels) == "table" and cfg.Labels or {},
    limits = { memory_bytes = positive(hc.Memory), cpus = nano and nano / 1e9, pids = positive(hc.PidsLimit) },
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
    labels = type(c.Labels) == "table" and c.Labels or {},
  }
end

--- The deadline of an engine call that sets none (ms): a hung engine must not hold a
--- caller (or a cancel's cleanup) for ever. Streams that may run long pass their own
--- (timeout_ms = 0: none).
docker.DEFAULT_TIMEOUT_MS = 300000

--- Low-level call: method, path (with query table), optional JSON body or opts
--- ({body_file=, output_file=, on_data=, timeout_ms= (default DEFAULT_TIMEOUT_MS, 0: none),
--- headers=}). `path` must be built with docker.segment for every value it holds.
--- Returns res or nil, msg, code.
function Engine:call(method, path, q, body, opts)
  opts = opts or {}
  local headers = opts.headers or {}
  local req = {
    method = method,
    url = "http://d/v1.41" .. path .. query(q), -- 1.41: spoken by Docker 20.10+ and Podman 4
    unix_socket = self.socket,
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
      return nil, ("container engine at %s is not answering (%s)"):format(self.socket, err), "ENOENGINE"
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

--- POST /containers/create?name=<spec.name> with the sandbox spec translated
--- (docker.create_body). Returns the container's id. A spec this adapter cannot honour is
--- refused (spec.check: EINVAL, ENOTSUP), a taken name is ECONFLICT, a missing image ENOENT.
---@param s table  the sandbox spec
---@return string|nil id, string|nil err, string|nil code
function Engine:create(s)
  local ok, cerr, ccode = engine_spec.check(s, self.capabilities)
  if not ok then return nil, "create container: " .. cerr, ccode end
  local t, err, code = ok_json(self, "POST", "/containers/create", s.name and { name = s.name } or nil,
    docker.create_body(s), "create container")
  if not t then
    -- Podman 4 answers a taken name with HTTP 500 ("… is already in use"), Docker with 409
    if code == "EENGINE" and tostring(err):find("already in use", 1, true) then code = "ECONFLICT" end
    return nil, err, code
  end
  return t.Id
end

--- POST /containers/{id}/start.
function Engine:start(id)
  local res, err, code = self:call("POST", "/containers/" .. seg(id) .. "/start")
  if not res then return nil, err, code end
  if res.status >= 300 and res.status ~= 304 then return engine_error(res, "start container") end
  return true
end

--- POST /containers/{id}/wait: blocks until the container stops. Returns its exit code.
function Engine:wait(id)
  local t, err, code = ok_json(self, "POST", "/containers/" .. seg(id) .. "/wait", { condition = "not-running" }, nil,
    "wait for container", { timeout_ms = 0 })
  if not t then return nil, err, code end
  return t.StatusCode
end

--- POST /containers/{id}/kill with a signal name ("KILL", "TERM").
function Engine:kill(id, signal)
  local res, err, code = self:call("POST", "/containers/" .. seg(id) .. "/kill", { signal = signal or "KILL" })
  if not res then return nil, err, code end
  if res.status >= 300 then return engine_error(res, "kill container") end
  return true
end

--- DELETE /containers/{id}?force=true&v=true. A container that is already gone is success
--- with the second value "gone".
function Engine:remove(id)
  local res, err, code = self:call("DELETE", "/containers/" .. seg(id), { force = true, v = true })
  if not res then return nil, err, code end
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

--- Runs argv in a running container through the exec API and waits for it to end.
--- opts: env (list "K=V"), workdir, user, timeout_ms (the host-side deadline for the whole
--- run, from the exec's start; 0 or nil: none). Output is discarded (demesne-init writes it
--- to files). Returns exit code, or nil, msg, code: "ETIMEDOUT" when the deadline passed
--- (the process may still run: the exec API cannot stop it). Cancelling the task aborts the
--- wait, not the process: use demesne-init kill for that.
function Engine:exec(id, argv, opts)
  opts = opts or {}
  local t, err, code = ok_json(self, "POST", "/containers/" .. seg(id) .. "/exec", nil, {
    Cmd = argv, Env = opts.env, WorkingDir = opts.workdir, User = opts.user,
    AttachStdout = true, AttachStderr = true, AttachStdin = false, Tty = false,
  }, "create exec")
  if not t then
    -- a stopped container: Docker answers 409, Podman 4 500 ("container state improper")
    if code == "EENGINE" then
      local info = self:inspect(id)
      if info and info.state ~= "running" then
        return nil, ("create exec: container %s is not running"):format(id), "ECONFLICT"
      end
    end
    return nil, err, code
  end
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

--- PUT /containers/{id}/archive?path=DIR with a tar file as the body (streamed from disk).
function Engine:put_archive(id, dir, tar_path)
  local res, err, code = self:call("PUT", "/containers/" .. seg(id) .. "/archive", { path = dir }, nil, {
    body_file = tar_path, headers = { ["Content-Type"] = "application/x-tar" }, timeout_ms = 0 })
  if not res then return nil, err, code end
  if res.status >= 300 then return engine_error(res, "upload") end
  return true
end

--- GET /containers/{id}/archive?path=PATH, the tar written to out_path (streamed).
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

--- GET /images/{ref}/json. Returns {id, labels}, or nil, msg, "ENOENT".
---@param ref string
---@return table|nil image, string|nil err, string|nil code
function Engine:image_inspect(ref)
  local t, err, code = ok_json(self, "GET", "/images/" .. seg(ref) .. "/json", nil, nil, "inspect image")
  if not t then return nil, err, code end
  if type(t) ~= "table" then return nil, "inspect image: the engine answered no JSON object", "EENGINE" end
  local cfg = type(t.Config) == "table" and t.Config or {}
  return { id = t.Id, labels = type(cfg.Labels) == "table" and cfg.Labels or {} }
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
        local text = t.stream or t.status
        if on_line and type(text) == "string" then on_line(text) end
      end
    end
    if #buf > 1024 * 1024 then buf = "" end
  end
end

--- POST /build with a tar build context from disk. opts: tag, buildargs (table), network
--- (the build's network mode: "host"), dockerfile (default "Containerfile"), labels.
--- on_line(text) receives the text of each progress line ("STEP 1/3: FROM …").
function Engine:build(context_tar, opts, on_line)
  local state = {}
  local q = { t = opts.tag, rm = true, forcerm = true, networkmode = opts.network,
    dockerfile = opts.dockerfile or "Containerfile", buildargs = opts.buildargs, labels = opts.labels }
  local res, err, code = self:call("POST", "/build", q, nil, { body_file = context_tar, timeout_ms = 0,
    headers = { ["Content-Type"] = "application/x-tar" }, on_data = progress_stream(on_line, state) })
  if not res then return nil, err, code end
  if res.status >= 300 then return nil, "image build failed: HTTP " .. res.status, "EBUILD" end
  if state.error then return nil, "image build failed: " .. state.error, "EBUILD" end
  local img = self:image_inspect(opts.tag)
  if not img then return nil, "image build finished without producing " .. opts.tag, "EBUILD" end
  return true
end

--- POST /images/create?fromSrc=-: imports a root filesystem tar (from disk) as repo:tag.
function Engine:import(tar_path, repo, tag, on_line)
  local state = {}
  -- repo:tag in one parameter: Podman 4.3 ignores a separate tag=
  local res, err, code = self:call("POST", "/images/create", { fromSrc = "-", repo = repo .. ":" .. tag }, nil, {
    body_file = tar_path, timeout_ms = 0, headers = { ["Content-Type"] = "application/x-tar" },
    on_data = progress_stream(on_line, state) })
  if not res then return nil, err, code end
  if res.status >= 300 or state.error then return nil, "image import failed: " .. tostring(state.error or res.status), "EBUILD" end
  return true
end

--- POST /images/create?fromImage=: pulls from a registry. Returns true or nil, msg, code.
function Engine:pull(ref, timeout_ms, on_line)
  local state = {}
  local name, tag = ref:match("^(.-):([^:/]+)$")
  local res, err, code = self:call("POST", "/images/create", { fromImage = name or ref, tag = tag or "latest" }, nil,
    { timeout_ms = timeout_ms or 60000, on_data = progress_stream(on_line, state) })
  if not res then return nil, err, code end
  if res.status >= 300 or state.error then return nil, "pull failed: " .. tostring(state.error or res.status), "EPULL" end
  return true
end

return docker
