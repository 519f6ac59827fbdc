local async = require("demesne.async")
local loop = require("core.loop")

local tests = {}

function tests.sleep_waits(t)
  local t0 = loop.hrtime()
  async.sleep(20)
  t:ok((loop.hrtime() - t0) / 1e6 >= 19, "slept at least 20 ms")
end

function tests.timeout_returns_etimedout(t)
  local v, msg, code = async.timeout(30, function() async.sleep(5000) return 1 end)
  t:eq(v, nil)
  t:eq(code, "ETIMEDOUT")
  t:match(msg, "timed out")
end

function tests.timeout_passes_results(t)
  local a, b = async.timeout(1000, function() async.sleep(1) return 1, 2 end)
  t:eq({ a, b }, { 1, 2 })
end

function tests.cancel_runs_close_handlers_that_await(t)
  local cleaned = false
  local task = async.spawn("victim", function()
    local _ <close> = setmetatable({}, { __close = function()
      async.sleep(5) -- cleanup may wait (e.g. remove a container)
      cleaned = true
    end })
    async.sleep(60000)
  end)
  async.sleep(5)
  async.cancel(task, "test")
  local ok, err = task:wait()
  t:eq(ok, false)
  t:eq(err, async.CANCELLED)
  t:ok(cleaned, "close handler ran to completion")
end

function tests.event_wakes_waiters(t)
  local ev = async.event()
  local got = {}
  for i = 1, 3 do
    async.spawn("w" .. i, function() local v = ev.wait(); got[#got + 1] = v end)
  end
  async.sleep(1)
  ev.set("x")
  t:eq(got, { "x", "x", "x" })
end

function tests.errors_carry_traceback(t)
  local task = async.spawn("boom", function() error("boom") end)
  local ok, err = task:wait()
  t:eq(ok, false)
  t:match(err, "boom")
  t:match(err, "traceback")
end

return tests
