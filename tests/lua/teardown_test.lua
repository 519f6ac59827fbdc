-- lua/teardown.lua: work after an answer runs on the loop's next turn, is tracked until it
-- ends (shutdown waits for it), never raises into its caller, and holds back while a call
-- waits for the engine.
local async = require("demesne.async")
local teardown = require("demesne.teardown")
local loop = require("core.loop")

local tests = {}

function tests.work_starts_after_the_caller_and_is_waited_for(t)
  local log = {}
  teardown.spawn("one", function()
    log[#log + 1] = "one starts"
    async.sleep(30)
    log[#log + 1] = "one ends"
  end)
  log[#log + 1] = "caller goes on" -- the answer would be written here
  t:eq(teardown.pending(), 1, "tracked")
  t:ok(teardown.wait(2000), "wait returns once it ended")
  t:eq(log, { "caller goes on", "one starts", "one ends" }, "order")
  t:eq(teardown.pending(), 0, "no longer tracked")
end

function tests.an_error_is_logged_not_raised_and_a_stuck_task_bounds_the_wait(t)
  teardown.spawn("fails", function() error("boom") end)
  local stuck = teardown.spawn("stuck", function() async.sleep(5000) end)
  t:eq(teardown.wait(100), false, "the wait gives up after its time")
  t:eq(teardown.pending(), 1, "the stuck one is still tracked; the failed one is gone")
  async.cancel(stuck, "test")
  t:ok(teardown.wait(1000), "and ends when it does")
end

function tests.background_work_holds_back_while_a_call_waits_for_the_engine(t)
  local log = {}
  local call = async.spawn("call", function()
    teardown.urgent(function()
      async.sleep(10) -- the removal below is spawned meanwhile
      log[#log + 1] = "call: create"
      async.sleep(50)
      log[#log + 1] = "call: started"
    end)
  end)
  async.sleep(0)
  teardown.spawn("removal", function() log[#log + 1] = "removal" end)
  call:wait()
  t:ok(teardown.wait(2000), "done")
  t:eq(log, { "call: create", "call: started", "removal" }, "the removal waited for the call's engine work")
  local ok, err = pcall(teardown.urgent, function() error("create failed", 0) end)
  t:eq({ ok, err }, { false, "create failed" }, "an error inside urgent is raised again")
  local t0 = loop.now()
  teardown.quiet(1000)
  t:ok(loop.now() - t0 < 100, "and does not leave anyone waiting")
end

return tests
