-- The engine-neutral sandbox spec: what lua/sandbox/spec.lua asks an engine adapter to create,
-- and the container states adapters report back. Adapters translate it to their engine's
-- wire format (lua/engines/docker.lua: a Docker ContainerCreate body); nothing above an
-- adapter sees that format. docs/reference/engines.md describes every field.
local spec = {}

--- The container states an adapter reports (inspect, list). `gone`: the engine still
--- lists the container but it can never run again (Docker's "dead").
spec.STATES = { created = true, running = true, exited = true, removing = true, gone = true }

--- The network modes a spec may ask for: `none` (loopback only) and `bridge` (the engine's
--- default outbound network, for open egress).
spec.NETWORKS = { none = true, bridge = true }

--- The runtimes a spec may ask for beyond the engine's default (`runtime` absent): `gvisor`
--- runs the sandbox on gVisor's own kernel (the application's system calls never reach the
--- host kernel directly).
spec.RUNTIMES = { gvisor = true }

local FIELDS = {
  name = true, image = true, entrypoint = true, command = true, env = true, workdir = true, hostname = true,
  user = true, labels = true, mounts = true, tmpfs = true, limits = true, network = true, read_only_rootfs = true,
  security = true, runtime = true, userns = true, log_max_bytes = true,
}

--- The smallest log_max_bytes a spec may ask for (conmon, Podman's monitor, reads the
--- container's output in 8 KiB blocks and needs at least that).
spec.LOG_MIN_BYTES = 8192

local function bad(field, why) return nil, ("spec.%s: %s"):format(field, why), "EINVAL" end
local function unsupported(field, why) return nil, ("spec.%s: %s"):format(field, why), "ENOTSUP" end

local function string_list(field, v)
  if v == nil then return true end
  if type(v) ~= "table" then return bad(field, "must be a list of strings") end
  for i, s in ipairs(v) do
    if type(s) ~= "string" or s:find("\0", 1, true) then
      return bad(("%s[%d]"):format(field, i), "must be a string without NUL bytes")
    end
  end
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v then return bad(field, "must be a list, not a map") end
  end
  return true
end

local function absolute(field, p)
  if type(p) ~= "string" or p:sub(1, 1) ~= "/" or p:find("\0", 1, true) then
    return bad(field, "must be an absolute path")
  end
  return true
end

local function positive(field, v, integer)
  if type(v) ~= "number" or v ~= v or v <= 0 or v == math.huge or (integer and math.tointeger(v) == nil) then
    return bad(field, integer and "must be a positive integer" or "must be a positive number")
  end
  return true
end

-- Runs checks {fn, args...} in order; returns the first failure (nil, message, code) or true.
local function all(...)
  for i = 1, select("#", ...) do
    local c = select(i, ...)
    local ok, err, code = c[1](table.unpack(c, 2))
    if not ok then return nil, err, code end
  end
  return true
end

local function optional(check, field, v, ...)
  if v == nil then return true end
  return check(field, v, ...)
end

-- The spec's own fields: image, name, command lines, environment, hostname, user, labels.
local function check_basics(s)
  for k in pairs(s) do
    if not FIELDS[k] then return bad(tostring(k), "unknown field") end
  end
  if type(s.image) ~= "string" or s.image == "" then return bad("image", "must be a non-empty string") end
  if s.name ~= nil and (type(s.name) ~= "string" or not s.name:match("^[%w][%w_.%-]*$")) then
    return bad("name", "must be letters, digits, '_', '.' and '-', starting with a letter or digit")
  end
  local ok, err, code = all({ string_list, "entrypoint", s.entrypoint }, { string_list, "command", s.command },
    { string_list, "env", s.env }, { optional, absolute, "workdir", s.workdir })
  if not ok then return nil, err, code end
  for i, e in ipairs(s.env or {}) do
    if not e:match("^[^=]+=") then return bad(("env[%d]"):format(i), 'must be "NAME=value"') end
  end
  for _, f in ipairs({ "hostname", "user" }) do
    if s[f] ~= nil and (type(s[f]) ~= "string" or s[f] == "") then return bad(f, "must be a non-empty string") end
  end
  if s.labels ~= nil then
    if type(s.labels) ~= "table" then return bad("labels", "must be a map of strings") end
    for k, v in pairs(s.labels) do
      if type(k) ~= "string" or type(v) ~= "string" then return bad("labels", "must map strings to strings") end
    end
  end
  return true
end

-- The bind mounts and tmpfs mounts, whose targets are absolute and each mounted once.
local function check_mounts(s, caps)
  local targets = {}
  local function target(field, p)
    local aok, aerr, acode = absolute(field, p)
    if not aok then return nil, aerr, acode end
    if targets[p] then return bad(field, ("%s is mounted twice"):format(p)) end
    targets[p] = true
    return true
  end
  if s.mounts ~= nil and type(s.mounts) ~= "table" then return bad("mounts", "must be a list") end
  for i, m in ipairs(s.mounts or {}) do
    local f = ("mounts[%d]"):format(i)
    if type(m) ~= "table" then return bad(f, "must be a table {source, target, mode}") end
    local ok, err, code = all({ absolute, f .. ".source", m.source }, { target, f .. ".target", m.target })
    if not ok then return nil, err, code end
    if m.mode ~= "ro" and m.mode ~= "rw" then return bad(f .. ".mode", 'must be "ro" or "rw"') end
    if m.relay ~= nil and type(m.relay) ~= "boolean" then return bad(f .. ".relay", "must be a boolean") end
    if not caps.bind_mounts then
      return unsupported(f, "this engine adapter cannot share host folders with a sandbox (capability bind_mounts)")
    end
    if m.relay and not caps.unix_socket_mounts then
      return unsupported(f .. ".relay",
        "this engine adapter cannot pass host unix sockets into a sandbox (capability unix_socket_mounts)")
    end
  end
  if s.tmpfs ~= nil and type(s.tmpfs) ~= "table" then return bad("tmpfs", "must be a list") end
  for i, t in ipairs(s.tmpfs or {}) do
    local f = ("tmpfs[%d]"):format(i)
    if type(t) ~= "table" then return bad(f, "must be a table {target, mode, exec}") end
    local ok, err, code = target(f .. ".target", t.target)
    if not ok then return nil, err, code end
    if type(t.mode) ~= "string" or not t.mode:match("^[0-7][0-7][0-7][0-7]?$") then
      return bad(f .. ".mode", 'must be an octal mode string such as "1777"')
    end
    if t.exec ~= nil and type(t.exec) ~= "boolean" then return bad(f .. ".exec", "must be a boolean") end
    if not caps.tmpfs then return unsupported(f, "this engine adapter has no tmpfs mounts (capability tmpfs)") end
  end
  return true
end

-- The resource limits.
local function check_limits(s, caps)
  if s.limits == nil then return true end
  if type(s.limits) ~= "table" then return bad("limits", "must be a table {memory_bytes, cpus, pids}") end
  for k in pairs(s.limits) do
    if k ~= "memory_bytes" and k ~= "cpus" and k ~= "pids" then return bad("limits." .. tostring(k), "unknown field") end
  end
  local ok, err, code = all({ optional, positive, "limits.memory_bytes", s.limits.memory_bytes, true },
    { optional, positive, "limits.cpus", s.limits.cpus }, { optional, positive, "limits.pids", s.limits.pids, true })
  if not ok then return nil, err, code end
  if next(s.limits) and caps.limits == false then
    return unsupported("limits", "this engine does not enforce memory, process and CPU limits (capability limits)")
  end
  return true
end

-- How the sandbox is isolated: network, read-only root, runtime, user namespace, engine log.
local function check_isolation(s, caps)
  local net = s.network or "none"
  if not spec.NETWORKS[net] then return bad("network", ('"%s" is not "none" or "bridge"'):format(tostring(net))) end
  if not (caps.networks or {})[net] then
    return unsupported("network", ('this engine adapter has no "%s" network'):format(net))
  end
  if s.read_only_rootfs ~= nil and type(s.read_only_rootfs) ~= "boolean" then
    return bad("read_only_rootfs", "must be a boolean")
  end
  if s.read_only_rootfs and not caps.read_only_rootfs then
    return unsupported("read_only_rootfs", "this engine adapter cannot make the root filesystem read-only")
  end
  if s.runtime ~= nil then
    if not spec.RUNTIMES[s.runtime] then
      return bad("runtime", ('"%s" is not a known runtime (gvisor)'):format(tostring(s.runtime)))
    end
    if not (caps.runtimes or {})[s.runtime] then
      return unsupported("runtime", ("this engine offers no %s runtime (capability runtimes)"):format(s.runtime))
    end
  end
  if s.userns ~= nil and type(s.userns) ~= "boolean" then return bad("userns", "must be a boolean") end
  if s.userns and not caps.userns then
    return unsupported("userns", "this engine cannot run a sandbox in a user namespace (capability userns)")
  end
  if s.log_max_bytes ~= nil then
    if math.type(s.log_max_bytes) ~= "integer" or s.log_max_bytes < spec.LOG_MIN_BYTES then
      return bad("log_max_bytes", ("must be an integer of at least %d"):format(spec.LOG_MIN_BYTES))
    end
    if not caps.bounded_logs then
      return unsupported("log_max_bytes", "this engine adapter cannot bound the log the engine keeps of a sandbox "
        .. "(capability bounded_logs)")
    end
  end
  return true
end

-- The security settings: no_new_privileges, the capabilities dropped.
local function check_security(s)
  local sec = s.security
  if sec == nil then return true end
  if type(sec) ~= "table" then return bad("security", "must be a table {no_new_privileges, cap_drop}") end
  for k in pairs(sec) do
    if k ~= "no_new_privileges" and k ~= "cap_drop" then return bad("security." .. tostring(k), "unknown field") end
  end
  if sec.no_new_privileges ~= nil and type(sec.no_new_privileges) ~= "boolean" then
    return bad("security.no_new_privileges", "must be a boolean")
  end
  local ok, err, code = string_list("security.cap_drop", sec.cap_drop)
  if not ok then return nil, err, code end
  for i, c in ipairs(sec.cap_drop or {}) do
    if not c:match("^[A-Z][A-Z_]*$") then
      return bad(("security.cap_drop[%d]"):format(i), "must be a capability name without CAP_ (NET_RAW)")
    end
  end
  return true
end

--- Checks a sandbox spec, and that an adapter with capabilities `caps` can honour all of it:
--- an adapter refuses what it cannot do rather than weaken the sandbox.
--- Returns true, or nil, a message naming the field ("spec.mounts[2].mode: …") and
--- "EINVAL" (malformed) or "ENOTSUP" (beyond the adapter's capabilities).
---@param s table   the spec (docs/reference/engines.md, "The sandbox spec")
---@param caps table the adapter's capabilities table
---@return boolean|nil ok, string|nil err, string|nil code
function spec.check(s, caps)
  if type(s) ~= "table" then return bad("", "must be a table") end
  caps = caps or {}
  return all({ check_basics, s }, { check_mounts, s, caps }, { check_limits, s, caps }, { check_isolation, s, caps },
    { check_security, s })
end

return spec
