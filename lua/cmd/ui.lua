-- `demesne ui [--port N] [--no-open]`: the cockpit page on 127.0.0.1 (lua/cockpit/web.lua),
-- until SIGINT or SIGTERM. Prints a one-time login URL (and opens it with $BROWSER or
-- xdg-open where one is set). docs/reference/cli.md#demesne-ui
local async = require("demesne.async")
local mcp_transport = require("demesne.mcp.transport")
local web = require("demesne.cockpit.web")
local loop = require("core.loop")
local process = require("core.process")

local USAGE = "usage: demesne ui [--port N] [--no-open]\n"

-- Opens `url` with $BROWSER (a command; %s is replaced by the URL, else it is the last
-- argument) or xdg-open when DISPLAY or WAYLAND_DISPLAY is set. Failures are ignored.
local function open_browser(url)
  local b = os.getenv("BROWSER")
  local argv
  if b and b ~= "" then
    argv = {}
    for w in b:gmatch("%S+") do argv[#argv + 1] = w end
    local put = false
    for i, w in ipairs(argv) do
      if w:find("%s", 1, true) then argv[i] = w:gsub("%%s", url) put = true end
    end
    if not put then argv[#argv + 1] = url end
  elseif (os.getenv("DISPLAY") or "") ~= "" or (os.getenv("WAYLAND_DISPLAY") or "") ~= "" then
    argv = { "xdg-open", url }
  end
  if not argv then return end
  local file = table.remove(argv, 1)
  pcall(process.spawn, { file = file, args = argv }, function() end)
end

---@param args string[]
---@return integer status
return function(args)
  local port, open = nil, true
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--no-open" then open = false
    elseif a == "--port" then
      port = math.tointeger(tonumber(args[i + 1] or ""))
      if not port or port < 0 or port > 65535 then io.stderr:write("demesne ui: --port needs 0..65535\n", USAGE) return 2 end
      i = i + 1
    else
      io.stderr:write("demesne ui: unexpected argument '", a, "'\n", USAGE)
      return 2
    end
    i = i + 1
  end
  local dir, derr = web.ui_dir()
  if not dir then io.stderr:write("demesne ui: ", derr, "\n") return 1 end
  local h, err = web.start({ ui_dir = dir, port = port })
  if not h then io.stderr:write("demesne ui: ", err, "\n") return 1 end
  io.stdout:write("demesne cockpit: open this one-time link (it signs this browser in):\n  ", h.url, "\n")
  io.stdout:flush()
  if open then open_browser(h.url) end
  local unwatch
  unwatch = mcp_transport.watch_signals(function()
    async.spawn("ui shutdown", function()
      h.stop()
      if unwatch then unwatch() end
      loop.stop()
    end)
  end)
  loop.run()
  return 0
end
