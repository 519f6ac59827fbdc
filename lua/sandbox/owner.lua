-- Which server process owns a sandbox or a job: the owner label (host/pid/start time) and
-- whether that process still runs.
local loop = require("core.loop")

local owner = {}

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
function owner.owner()
  if not owner_id then
    local pid = loop.getpid()
    owner_id = ("%s/%d/%s"):format(loop.hostname(), pid, proc_start(pid) or "0")
  end
  return owner_id
end

--- Whether the server process an owner label names still runs (another host's: assumed so).
---@param label string
---@return boolean
local function owner_alive(label)
  local host, pid, start = tostring(label):match("^(.*)/(%d+)/(%d+)$")
  if not host then return false end
  if host ~= loop.hostname() then return true end -- another host's: not ours to judge
  -- only a process that is not there is gone: a server out of descriptors (EMFILE) that
  -- cannot open /proc must not take live servers for dead and reap their sandboxes
  local f, _, errno = io.open("/proc/" .. pid .. "/stat")
  if not f then return errno ~= 2 and errno ~= 3 end -- ENOENT, ESRCH: gone
  f:close()
  return proc_start(pid) == start
end

owner.owner_alive = owner_alive

return owner
