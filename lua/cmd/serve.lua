-- `demesne serve` (the default command): the MCP server over stdio, or over Streamable
-- HTTP with `--http ADDR` (repeatable: 127.0.0.1:PORT, [::1]:PORT, localhost:PORT,
-- unix:/path; `--http-allow-remote` permits a non-loopback address).
-- Over stdio, stdout carries only the protocol; logs go to stderr (level from
-- DEMESNE_LOG_LEVEL). `--fixtures DIR` also loads the tool files in DIR (test fixtures).
local async = require("demesne.async")
local config = require("demesne.config")
local compose = require("demesne.compose")
local control = require("demesne.cockpit.control")
local jobs = require("demesne.jobs")
local hostmcp = require("demesne.hostmcp")
local layer = require("demesne.layer")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local http = require("demesne.mcp.http")
local stdio = require("demesne.mcp.stdio")
local pool = require("demesne.pool")
local teardown = require("demesne.teardown")
local tools = require("demesne.tools")
local endpoint = require("demesne.tree.endpoint")

-- The reaper: at start and every reap_interval seconds, remove expired sandboxes and
-- one-shot containers whose server is gone. It works from the engine's labels.
local function start_reaper()
  -- watch: the persistent sandboxes still running get their output quota watched again
  return async.every("reaper", function() return config.get("reap_interval") * 1000 end,
    function() sandbox.reap({ watch = true }) end, { logger = "demesne.reaper" })
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
  local reaper = start_reaper()
  -- what this server leaves if it is killed before its own clean-up (a client may SIGKILL
  -- it at once) goes as soon as it has ended: the exit reaper, a process of its own
  local rok, rerr = sandbox.start_exit_reaper()
  if not rok then log.warning("demesne.reaper", "no exit reaper (%s): what a killed server leaves waits for the "
    .. "next server", tostring(rerr)) end
  -- background jobs: re-attach the ones a previous server left running; they outlive us too
  jobs.start()
  -- warm sandboxes for sandbox_script (lua/pool.lua); removed again at shutdown
  pool.start()
  local function on_shutdown()
    pool.stop()
    -- one-shot containers removed after their answers, warm sandboxes discarded just now
    if not teardown.wait(30000) then
      log.warning("demesne.teardown", "%d container removal(s) still running at exit; the reaper of the next "
        .. "server removes what is left", teardown.pending())
    end
  end
  -- host MCP servers: their declaration problems are logged now; they start on first use
  async.spawn("host MCP configuration", function()
    local ok, err = pcall(hostmcp.load)
    if not ok and err ~= async.CANCELLED then log.error("demesne.hostmcp", "%s", tostring(err)) end
  end)
  local registry = tools.load({ fixtures = opts.fixtures })
  -- nested sandboxes: the in-sandbox MCP endpoint, and the trees a previous server left
  local ok, eerr = endpoint.start(registry)
  if not ok then log.error("demesne.tree", "the in-sandbox MCP endpoint cannot start: %s", tostring(eerr)) end
  layer.start_services() -- the installed layers' (the tree's: the trees a previous server left)
  local function on_stop(timeout_ms) endpoint.stop(timeout_ms) end
  -- the control socket: demesne ps, logs, cancel and ui find this server there
  control.start({ transport = #addrs > 0 and "http" or "stdio", urls = addrs })
  local status
  if #addrs > 0 then
    status = http.serve({ addrs = addrs, allow_remote = allow_remote, registry = registry,
      on_stop = on_stop, on_shutdown = on_shutdown, on_listening = control.set_urls })
  else
    status = stdio.serve({ registry = registry, on_stop = on_stop, on_shutdown = on_shutdown })
  end
  control.stop()
  layer.stop_services() -- in the reverse order of their starts
  jobs.stop()
  -- no host MCP server outlives the server
  hostmcp.shutdown_outside_task()
  async.cancel(reaper, "shutdown")
  sandbox.unwatch_all() -- the persistent sandboxes' quota watches (the next server takes them up)
  return status
end
