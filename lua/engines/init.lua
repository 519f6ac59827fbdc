-- Container engine discovery: which Docker Engine API socket to use, and the adapter.
--
-- Order: DEMESNE_ENGINE (unix:///path), DOCKER_HOST when it is unix://, the rootful and
-- rootless Podman sockets, /var/run/docker.sock. The first socket that exists wins.
local fs = require("core.fs")
local config = require("demesne.config")
local plugins = require("demesne.plugins")

local engines = {}

local function candidates()
  local list = {}
  local function add(s, why)
    if s and s ~= "" then list[#list + 1] = { path = s:gsub("^unix://", ""), why = why } end
  end
  local e = config.get("engine")
  if e then add(e, "DEMESNE_ENGINE") end
  local dh = os.getenv("DOCKER_HOST")
  if dh and dh:match("^unix://") then add(dh, "DOCKER_HOST") end
  add("/run/podman/podman.sock", "rootful Podman")
  local xdg = os.getenv("XDG_RUNTIME_DIR")
  if xdg then add(xdg .. "/podman/podman.sock", "rootless Podman") end
  add("/var/run/docker.sock", "Docker")
  return list
end

--- Finds the engine socket. Returns path, the sockets tried and why the path was a
--- candidate ("DEMESNE_ENGINE", "DOCKER_HOST", "rootful Podman", "rootless Podman",
--- "Docker"), or nil and the sockets tried.
---@return string|nil path, string[] tried, string|nil why
function engines.discover()
  local tried = {}
  local explicit = config.get("engine")
  for _, c in ipairs(candidates()) do
    tried[#tried + 1] = c.path
    local st = fs.stat(c.path)
    if st and st.type == "socket" then return c.path, tried, c.why end
    if explicit and c.why == "DEMESNE_ENGINE" then return nil, tried end
  end
  return nil, tried
end

local current

-- Adapters are plugins (demesne.plugins): the built-in lua/engines/docker.lua, then
-- $XDG_CONFIG_HOME/demesne/engines/<name>.lua, which replaces a built-in one of the same
-- name. A file returns a module table with `new(endpoint) -> engine | nil, err` (the engine
-- object implements the adapter interface in docs/reference/engines.md; wrapping
-- require("demesne.engines.docker") is the usual way). Adapter files are the engine layer:
-- they are trusted like config.lua and run with the runtime's full environment. Only the
-- configured adapter's file is loaded.
local modules = {}

-- The engine kind of plugin, loading the files named `name` only.
local function kind(name)
  return {
    kind = "engine adapter", kinds = "engines", logger = "demesne.engines", quiet = true,
    builtin = "lua/engines/", skip = { ["init.lua"] = true, ["spec.lua"] = true },
    user_dir = config.dir() .. "/engines", only = name,
    env = function(origin)
      return plugins.environment(origin, { kind = "engine adapter", kinds = "engine adapters", trusted = true })
    end,
    check = function(mod, file)
      if type(mod) ~= "table" or type(mod.new) ~= "function" then
        return nil, "must return a table with a function new(endpoint)"
      end
      mod.origin = file.builtin and "built-in" or file.origin
      return mod
    end,
  }
end

--- The adapter's name: the `engine_adapter` setting, or "kubernetes" when the `engine`
--- setting is "kubernetes" or "kubernetes:<kubeconfig path>".
---@return string
function engines.adapter_name()
  local e = config.get("engine")
  if e == "kubernetes" or (e and e:match("^kubernetes:")) then return "kubernetes" end
  return config.get("engine_adapter") or "docker"
end

--- The module of an engine adapter (built in, or a file in the config folder's engines/),
--- or nil, err. `name`: letters, digits, '_' and '-'.
---@param name string
---@return table|nil module, string|nil err
function engines.load(name)
  if not tostring(name):match("^[%w_%-]+$") then
    return nil, ("engine_adapter: %q is not a valid adapter name (letters, digits, '_', '-')"):format(tostring(name))
  end
  local key = config.dir() .. "|" .. name -- another config folder has other files
  if modules[key] then return modules[key] end
  local set = plugins.load(kind(name))
  local mod = set:get(name)
  if not mod then
    local e = set.errors[#set.errors]
    if e then return nil, "engine_adapter: " .. e.message end
    return nil, ("engine_adapter: no adapter %q (built in: docker, kubernetes; no file %s)"):format(name,
      config.dir() .. "/engines/" .. name .. ".lua")
  end
  modules[key] = mod
  return mod
end

--- The methods the runtime calls on an engine (docs/reference/engines.md, "Methods"); an
--- engine also carries a `capabilities` table ("Capabilities").
engines.METHODS = { "create", "start", "wait", "remove", "inspect", "list", "exec", "image_inspect", "build",
  "import", "pull" }

--- The methods an engine has when it declares a capability (docs/reference/engines.md,
--- "Methods"): `snapshots` (sandbox_snapshot, sandbox_fork) and `pause` (sandbox_pause,
--- sandbox_resume). An engine without them says so with the capability false.
engines.CAPABILITY_METHODS = {
  snapshots = { "commit", "image_list", "image_remove", "size", "put_archive" },
  pause = { "pause", "unpause" },
}

--- Builds a user adapter's engine: mod.new(endpoint), checked. Returns the engine, or nil
--- and a message naming the adapter and what is wrong.
---@param name string
---@param mod table
---@param endpoint string|nil
---@return table|nil engine, string|nil err
function engines.new_user(name, mod, endpoint)
  local ok, eng, nerr = pcall(mod.new, endpoint)
  if not ok then return nil, ("engine_adapter %s: new() failed: %s"):format(name, tostring(eng)) end
  if eng == nil then
    return nil, ("engine_adapter %s: %s"):format(name, nerr ~= nil and tostring(nerr) or "new() returned nothing")
  end
  if type(eng) ~= "table" then
    return nil, ("engine_adapter %s: new() returned a %s, not an engine object"):format(name, type(eng))
  end
  local missing = {}
  for _, m in ipairs(engines.METHODS) do
    if type(eng[m]) ~= "function" then missing[#missing + 1] = m end
  end
  if #missing > 0 then
    return nil, ("engine_adapter %s: the engine new() returned has no method %s"):format(name, table.concat(missing, ", "))
  end
  if type(eng.capabilities) ~= "table" then
    return nil, ("engine_adapter %s: the engine new() returned has no capabilities table "
      .. "(docs/reference/engines.md, \"Capabilities\")"):format(name)
  end
  for cap, methods in pairs(engines.CAPABILITY_METHODS) do
    if eng.capabilities[cap] then
      for _, m in ipairs(methods) do
        if type(eng[m]) ~= "function" then missing[#missing + 1] = m end
      end
    end
  end
  if #missing > 0 then
    table.sort(missing)
    return nil, ("engine_adapter %s: the engine declares capabilities snapshots or pause but has no method %s "
      .. "(set the capability false, or add the methods)"):format(name, table.concat(missing, ", "))
  end
  return eng
end

--- Checks the configured engine adapter without contacting an engine (what
--- `demesne check-config` and `demesne doctor` report): "docker" is built in; a user
--- adapter's file must load and its new(endpoint) build a whole engine.
--- Returns {name = adapter name, origin = "built-in" | file path}, or nil and the reason.
---@return {name: string, origin: string}|nil adapter, string|nil err
function engines.check_adapter()
  local which = engines.adapter_name()
  local mod, err = engines.load(which)
  if not mod then return nil, err end
  if mod.origin == "built-in" and which == "docker" then return { name = which, origin = "built-in" } end
  local eng, nerr = engines.new_user(which, mod, config.get("engine")) -- new() must not contact the engine yet
  if not eng then return nil, nerr end
  return { name = which, origin = mod.origin }
end

--- The engine adapter: for engine_adapter "docker" (the default) the Docker Engine API at
--- the discovered socket; otherwise the user adapter's new(endpoint) with the `engine`
--- setting as is. Cached while the socket (or adapter) stays the same. Returns the adapter,
--- or nil, a message (which sockets were tried and how to start an engine; or why the
--- adapter cannot be loaded) and "ENOENGINE".
---@return table|nil engine, string|nil err, string|nil code
function engines.get()
  local which = engines.adapter_name()
  local mod, err = engines.load(which)
  if not mod then return nil, err, "ENOENGINE" end
  if mod.origin ~= "built-in" or which ~= "docker" then
    if current and current.adapter_module == mod and current.adapter_endpoint == config.get("engine") then
      return current
    end
    local eng, nerr = engines.new_user(which, mod, config.get("engine"))
    if not eng then return nil, nerr, "ENOENGINE" end
    eng.adapter_name, eng.adapter_module, eng.adapter_endpoint = which, mod, config.get("engine")
    eng.socket = eng.socket or ("adapter:" .. which) -- lua/images.lua keys its cache by it
    current = eng
    return current
  end
  local path, tried = engines.discover()
  if not path then
    current = nil
    return nil, ("no container engine found (tried %s). Start one: "
      .. "`podman system service --time=0 unix:///run/podman/podman.sock &` "
      .. "(Podman) or `dockerd &` (Docker), or set DEMESNE_ENGINE=unix:///path/to/socket"):format(table.concat(tried, ", ")),
      "ENOENGINE"
  end
  local gv_runtime = config.get("gvisor_runtime")
  local gv_socket = config.get("gvisor_engine")
  gv_socket = gv_socket and gv_socket ~= "" and (gv_socket:gsub("^unix://", "")) or nil
  if not current or current.socket ~= path or current.adapter_name or current.gvisor_runtime ~= gv_runtime
      or current.gvisor_socket ~= gv_socket then
    current = mod.new(path, { gvisor_runtime = gv_runtime, gvisor_socket = gv_socket })
  end
  return current
end

return engines
