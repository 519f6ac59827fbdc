-- Container engine discovery: which Docker Engine API socket to use, and the adapter.
--
-- Order: DEMESNE_ENGINE (unix:///path), DOCKER_HOST when it is unix://, the rootful and
-- rootless Podman sockets, /var/run/docker.sock. The first socket that exists wins.
local fs = require("core.fs")
local config = require("demesne.config")

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

--- Finds the engine socket. Returns path, or nil and the list of sockets tried.
---@return string|nil path, string[] tried
function engines.discover()
  local tried = {}
  local explicit = config.get("engine")
  for _, c in ipairs(candidates()) do
    tried[#tried + 1] = c.path
    local st = fs.stat(c.path)
    if st and st.type == "socket" then return c.path, tried end
    if explicit and c.why == "DEMESNE_ENGINE" then return nil, tried end
  end
  return nil, tried
end

local current

--- The engine adapter for the discovered socket (cached), or nil and a message that says
--- which sockets were tried and how to start an engine.
function engines.get()
  local path, tried = engines.discover()
  if not path then
    current = nil
    return nil, ("no container engine found (tried %s). Start one: `podman system service --time=0 unix:///run/podman/podman.sock &` "
      .. "(Podman) or `dockerd &` (Docker), or set DEMESNE_ENGINE=unix:///path/to/socket"):format(table.concat(tried, ", ")),
      "ENOENGINE"
  end
  if not current or current.socket ~= path then
    current = require("demesne.engines.docker").new(path)
  end
  return current
end

return engines
