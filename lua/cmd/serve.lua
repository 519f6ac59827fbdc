-- `demesne serve` (the default command): the MCP server over stdio, or over Streamable
-- HTTP with `--http ADDR` (repeatable: 127.0.0.1:PORT, [::1]:PORT, localhost:PORT,
-- unix:/path; `--http-allow-remote` permits a non-loopback address).
-- Over stdio, stdout carries only the protocol; logs go to stderr (level from
-- DEMESNE_LOG_LEVEL). `--fixtures DIR` also loads the tool files in DIR (test fixtures).
local config = require("demesne.config")
local compose = require("demesne.compose")
local control = require("demesne.cockpit.control")
local endpoint = require("demesne.tree.endpoint")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local services = require("demesne.services")
local http = require("demesne.mcp.http")
local stdio = require("demesne.mcp.stdio")
local pool = require("demesne.pool")
local teardown = require("demesne.teardown")

-- The two parts that stop inside the transport's graceful stop (transport.graceful_stop), in
-- a task while the loop still runs, and so are no service stops of compose.SERVICES (those
-- run after the transport has returned):
--   on_stop(timeout_ms): the in-sandbox endpoint closes beside the server's own stop, so the
--     requests it cancels finish their cleanup within the same timeout;
--   on_shutdown(): once both have ended, the warm pool goes and the one-shot containers
--     removed after their answers are awaited, so no container waits for a next server.
local function on_stop(timeout_ms) endpoint.stop(timeout_ms) end

local function on_shutdown()
  pool.stop()
  -- one-shot containers removed after their answers, warm sandboxes discarded just now
  if not teardown.wait(30000) then
    log.warning("demesne.teardown", "%d container removal(s) still running at exit; the reaper of the next "
      .. "server removes what is left", teardown.pending())
  end
end

---@param args string[]
---@param opts {fixtures: string|nil}
---@return integer status
return function(args, opts)
  local addrs, allow_remote = {}, false
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--http" then
      if not args[i + 1] then
        io.stderr:write("demesne serve: --http needs an address (127.0.0.1:PORT, [::1]:PORT or unix:/path)\n")
        return 2
      end
      addrs[#addrs + 1] = args[i + 1]
      i = i + 1
    elseif a:match("^%-%-http=") then
      addrs[#addrs + 1] = a:sub(8)
    elseif a == "--http-allow-remote" then
      allow_remote = true
    else
      io.stderr:write("demesne serve: unexpected argument '", a, "'\n")
      return 2
    end
    i = i + 1
  end
  if allow_remote and #addrs == 0 then
    io.stderr:write("demesne serve: --http-allow-remote goes with --http ADDR\n")
    return 2
  end
  -- the layers above sandboxes, jobs and agent runs (the tree, the cockpit) and the job kinds
  compose.install()
  local _, cerr = config.describe()
  if cerr then log.error("demesne.config", "%s (the default is used instead; see demesne check-config)", cerr) end
  if not log.set_level(config.get("log_level")) then -- the config file may set it too
    log.error("demesne.config", "log_level %q is not one of debug, info, notice, warning, error, critical, alert, "
      .. "emergency", tostring(config.get("log_level")))
  end
  -- the folders above every output and run folder: private, or a warning that says why
  for _, w in ipairs(sandbox.private_roots(true)) do log.warning("demesne.sandbox", "%s", w) end
  -- the server's long-running parts, in the order compose.SERVICES declares (the reaper
  -- first, the control socket last); the tools service leaves the registry in ctx
  local ctx = { fixtures = opts.fixtures, transport = #addrs > 0 and "http" or "stdio", urls = addrs }
  local running = services.start(compose.SERVICES, ctx)
  local status
  if #addrs > 0 then
    status = http.serve({ addrs = addrs, allow_remote = allow_remote, registry = ctx.registry,
      on_stop = on_stop, on_shutdown = on_shutdown, on_listening = control.set_urls })
  else
    status = stdio.serve({ registry = ctx.registry, on_stop = on_stop, on_shutdown = on_shutdown })
  end
  -- in the reverse order of the starts: the control socket, the layers' services, the jobs'
  -- sweep, the host MCP servers, the reaper, the quota watches
  services.stop(running, ctx)
  return status
end
