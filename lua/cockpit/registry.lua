-- Where the running servers of this user find each other: the control folder (config
-- control_dir, made 0700), one entry per `demesne serve` (stdio or HTTP), <pid>.json with
-- its owner label, transport and state folder, beside its control socket <pid>.sock (0600,
-- lua/cockpit/control.lua). `demesne ps`, `logs`, `cancel` and `ui` read it; an entry whose
-- server is gone (its owner label names no live process) is removed by the reader that
-- sees it. No sandbox mounts this folder: the control sockets are on no relay.
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")

local registry = {}

local ENTRY_MAX = 64 * 1024

--- The control folder (config control_dir).
---@return string
function registry.dir() return config.get("control_dir") end

--- Makes the control folder (0700; an existing one is made 0700 too). Returns the path, or
--- nil and why (a path that is not a folder, a folder we cannot make).
---@return string|nil dir, string|nil err
function registry.ensure()
  local dir = registry.dir()
  local ok, err = fs.mkdir_p(dir, 448)
  if not ok then return nil, ("cannot make the control folder %s: %s"):format(dir, tostring(err)) end
  local st = fs.lstat(dir)
  if not st or st.type ~= "directory" then return nil, ("the control folder %s is not a folder"):format(dir) end
  if st.mode & 63 ~= 0 then fs.chmod(dir, 448) end
  return dir
end

--- The socket path of server `pid` in the control folder.
---@param pid integer
---@return string
function registry.socket_path(pid) return ("%s/%d.sock"):format(registry.dir(), pid) end

--- Registers this process: writes <pid>.json (0600) with `info` plus pid, owner, state_dir,
--- started_ms and version. Returns the entry, or nil and why.
---@param info {transport: string, urls: string[]|nil, started_ms: integer|nil}
---@return table|nil entry, string|nil err
function registry.register(info)
  local dir, err = registry.ensure()
  if not dir then return nil, err end
  local pid = loop.getpid()
  local e = { pid = pid, owner = sandbox.owner(), transport = info.transport, urls = json.array(info.urls or {}),
    state_dir = config.get("state_dir"), socket = registry.socket_path(pid), started_ms = info.started_ms or util.now_ms(),
    version = loop.version }
  local ok, werr = fs.write_atomic(("%s/%d.json"):format(dir, pid), json.encode(e) .. "\n", 384)
  if not ok then return nil, ("cannot write the control entry: %s"):format(tostring(werr)) end
  return e
end

--- Removes this process's entry (its socket file goes with the listener).
function registry.unregister()
  os.remove(("%s/%d.json"):format(registry.dir(), loop.getpid()))
end

--- The live servers' entries, oldest first: {pid, owner, transport, urls, state_dir, socket,
--- started_ms, version}. Entries of servers that are gone are removed (with their socket
--- files); unreadable ones are skipped.
---@return table[]
function registry.list()
  local dir = registry.dir()
  local out = {}
  for _, name in ipairs(fs.readdir(dir) or {}) do
    local pid = type(name) == "string" and tonumber(name:match("^(%d+)%.json$"))
    if pid then
      local path = dir .. "/" .. name
      local st = fs.lstat(path)
      local s = st and st.type == "file" and fs.read_file(path, 0, ENTRY_MAX)
      local e = s and json.decode(s)
      if type(e) == "table" and math.tointeger(e.pid) == pid and type(e.owner) == "string" then
        if sandbox.owner_alive(e.owner) or e.owner == sandbox.owner() then
          e.pid = math.tointeger(pid)
          e.socket = registry.socket_path(pid) -- never a path an entry names
          out[#out + 1] = e
        else
          log.debug("demesne.cockpit", "server %d is gone: its control entry is removed", pid)
          os.remove(path)
          os.remove(registry.socket_path(pid))
        end
      end
    end
  end
  table.sort(out, function(a, b) return (tonumber(a.started_ms) or 0) < (tonumber(b.started_ms) or 0) end)
  return out
end

return registry
