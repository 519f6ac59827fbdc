-- The services runner (lua/services.lua) and the server's services (compose.SERVICES): the
-- order they start in, the reverse order they stop in, and what an error does.
local compose = require("demesne.compose")
local log = require("demesne.log")
local services = require("demesne.services")

local tests = {}

-- A service that notes its start and stop in `seen`.
local function noted(seen, name, opts)
  opts = opts or {}
  return {
    name = name,
    start = not opts.no_start and function(ctx)
      seen[#seen + 1] = "start " .. name
      ctx.n = (ctx.n or 0) + 1
      if opts.start_fails then error(name .. " cannot start", 0) end
    end or nil,
    stop = not opts.no_stop and function()
      seen[#seen + 1] = "stop " .. name
      if opts.stop_fails then error(name .. " cannot stop", 0) end
    end or nil,
  }
end

function tests.start_in_order_stop_in_reverse_once(t)
  local seen, ctx = {}, {}
  local running = services.start({ noted(seen, "a"), noted(seen, "b", { no_stop = true }),
    noted(seen, "c", { no_start = true }), noted(seen, "d") }, ctx)
  t:eq(seen, { "start a", "start b", "start d" })
  t:eq(ctx.n, 3, "the services shared ctx")
  services.stop(running, ctx)
  t:eq(seen, { "start a", "start b", "start d", "stop d", "stop c", "stop a" })
  services.stop(running, ctx)
  t:eq(#seen, 6, "a second stop stops nothing")
end

function tests.a_start_that_fails_stops_the_started_ones(t)
  local seen = {}
  local ok, err = pcall(services.start, { noted(seen, "a"), noted(seen, "b"), noted(seen, "c", { start_fails = true }),
    noted(seen, "d") }, {})
  t:eq(ok, false)
  t:eq(err, "c cannot start")
  t:eq(seen, { "start a", "start b", "start c", "stop b", "stop a" })
end

function tests.a_stop_that_fails_is_logged_and_the_others_stop(t)
  local seen, got = {}, {}
  local remove = log.add_sink(function(level, logger, msg)
    if logger == "demesne.services" then got[#got + 1] = level .. ": " .. msg end
  end)
  local running = services.start({ noted(seen, "a"), noted(seen, "b", { stop_fails = true }), noted(seen, "c") }, {})
  services.stop(running, {})
  remove()
  t:eq(seen, { "start a", "start b", "start c", "stop c", "stop b", "stop a" })
  t:eq(got, { "warning: service b: stop: b cannot stop" })
end

function tests.a_service_without_a_name_is_refused_before_anything_starts(t)
  local seen = {}
  local ok, err = pcall(services.start, { noted(seen, "a"), { start = function() end } }, {})
  t:eq(ok, false)
  t:match(err, "services%[2%] needs a name")
  t:eq(seen, {}, "nothing started")
end

-- `demesne serve` stops its parts in this order once its transport has returned; the
-- integration tests (shutdown.test.mjs) rely on it: the control socket first, the quota
-- watches last, the jobs' sweep before the host MCP servers.
function tests.the_servers_services_stop_in_the_order_serve_relies_on(t)
  local names, stops = {}, {}
  for _, s in ipairs(compose.SERVICES) do names[#names + 1] = s.name end
  for i = #compose.SERVICES, 1, -1 do
    if compose.SERVICES[i].stop then stops[#stops + 1] = compose.SERVICES[i].name end
  end
  t:eq(names, { "quota watches", "reaper", "exit reaper", "host MCP", "jobs", "pool", "tools", "endpoint", "layers",
    "control" })
  t:eq(stops, { "control", "layers", "jobs", "host MCP", "reaper", "quota watches" })
end

return tests
