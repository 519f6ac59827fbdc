-- The loopback servers of tests/fixtures/ws/server.mjs for the core.ws and Kubernetes exec
-- tests: start() runs the fixture under node and returns {ws = port, raw = port}, a <close>
-- value that stops it.
local process = require("core.process")
local fs = require("core.fs")
local json = require("core.json")
local async = require("demesne.async")

local SRC = os.getenv("DEMESNE_SOURCE_DIR") or "."
local FIXTURE = SRC .. "/tests/fixtures/ws/server.mjs"
local WS_MODULE = SRC .. "/tests/integration/node_modules/ws/package.json"

local M = {}

--- Starts the fixture servers; returns {ws = port, raw = port} with __close stopping them.
function M.start()
  if not fs.stat(WS_MODULE) then
    error(WS_MODULE .. " is missing: run `npm ci` in tests/integration (the `ws` server these tests use)", 0)
  end
  local exited, line = async.event(), async.event()
  local proc, pipes = process.spawn({ file = "node", args = { FIXTURE }, stdin = true, stdout = true },
    function(status) exited.set(status) end)
  assert(proc, pipes)
  local buf = ""
  pipes.stdout:read_start(function(d)
    if not d then return line.set(nil) end
    buf = buf .. d
    if buf:find("\n") then line.set(buf) end
  end)
  local got = async.timeout(10000, function() return line.wait() end)
  assert(got, "the fixture server did not start")
  local s = json.decode(got)
  return setmetatable(s, { __close = function()
    pipes.stdout:close()
    pipes.stdin:close() -- the server exits when its stdin ends
    async.timeout(5000, function() return exited.wait() end)
    if not proc:exited() then proc:kill("KILL") end
  end })
end

return M
