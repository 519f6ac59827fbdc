local async = require("demesne.async")
local fs = require("core.fs")
local log = require("demesne.log")
local loop = require("core.loop")
local proc = require("demesne.proc")

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

-- async.every: the resume-then-sweep loop of the reaper, the jobs and the trees
function tests.every_runs_at_once_then_repeats(t)
  local passes, firsts = 0, 0
  local task = async.every("every", 10, function() passes = passes + 1 end,
    { first = function() firsts = firsts + 1 end })
  t:eq({ firsts, passes }, { 1, 0 }, "the first pass ran at once, before any sleep")
  async.sleep(65)
  async.cancel(task, "test")
  t:eq(firsts, 1, "the first pass ran once")
  t:ok(passes >= 2, "the sweep repeated every 10 ms (" .. passes .. " passes in 65 ms)")
end

function tests.every_reads_the_interval_before_each_sleep(t)
  local passes, asked = 0, 0
  local task = async.every("every", function() asked = asked + 1; return 5.7 end,
    function() passes = passes + 1 end)
  async.sleep(40)
  async.cancel(task, "test")
  t:ok(asked >= 2 and asked == passes, "the interval was read after each pass")
end

function tests.every_logs_an_error_and_goes_on(t)
  local got, passes = {}, 0
  local remove = log.add_sink(function(level, logger, msg)
    if logger == "demesne.test.every" then got[#got + 1] = level .. ": " .. msg end
  end)
  local task = async.every("every", 5, function()
    passes = passes + 1
    if passes == 1 then error("first pass fails", 0) end
  end, { logger = "demesne.test.every" })
  async.sleep(30)
  async.cancel(task, "test")
  remove()
  t:eq(got, { "warning: first pass fails" }, "the error was logged once, under the given logger")
  t:ok(passes >= 2, "the loop went on after the error")
  t:ok(not task.done or task.result[2] ~= "first pass fails", "the error did not end the task")
end

function tests.every_stops_on_cancel(t)
  local passes = 0
  local task = async.every("every", 5, function() passes = passes + 1 end)
  async.sleep(12)
  async.cancel(task, "shutdown")
  local ok, err = task:wait()
  t:eq({ ok, err }, { false, async.CANCELLED }, "the sleep was cancelled")
  local n = passes
  async.sleep(20)
  t:eq(passes, n, "no pass after the cancel")
  -- a pass cancelled while it awaits ends the loop too, without a warning
  local warned = false
  local remove = log.add_sink(function(_, logger) if logger == "demesne.async" then warned = true end end)
  local inner = async.every("every", 5, function() async.sleep(60000) end)
  async.cancel(inner, "shutdown")
  t:ok(inner.done, "a cancel inside a pass ended the loop")
  remove()
  t:ok(not warned, "a cancel is not logged as an error")
end

function tests.errors_carry_traceback(t)
  local task = async.spawn("boom", function() error("boom") end)
  local ok, err = task:wait()
  t:eq(ok, false)
  t:match(err, "boom")
  t:match(err, "traceback")
end

-- async.main runs the loop itself, so it is called where a command calls it: outside any
-- task. The check is a test file run by a child `demesne test` whose top level (which the
-- runner loads outside a task) calls it, with a 20 s timer open that would keep a plain
-- loop.run going until it fired: the loop stops when the task ends (the timer has not
-- fired), and the results come back pcall-style.
local MAIN_FIXTURE = [[
local async = require("demesne.async")
local timer = require("core.timer")
local fired = false
local held = timer.after(20000, function() fired = true end)
local r1 = table.pack(async.main("fixture", function(x) async.sleep(1) return x, "two" end, "one"))
local r2 = table.pack(async.main("fixture error", function() error({ code = "EX" }) end))
local fired_before_return = fired
held:close()
return {
  results = function(t)
    t:eq({ r1.n, r1[1], r1[2], r1[3] }, { 3, true, "one", "two" }, "true and fn's results")
    t:eq({ r2[1], type(r2[2]) == "table" and r2[2].code }, { false, "EX" }, "false and the error raised")
    t:eq(fired_before_return, false, "the loop stopped when the task ended, not when the timer fired")
  end,
}
]]

function tests.main_drives_the_loop_until_its_task_ends(t)
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d, 448))
  assert(fs.write_atomic(d .. "/main_test.lua", MAIN_FIXTURE))
  local r = assert(proc.run({ file = loop.exepath(), args = { "test", d }, timeout_ms = 120000, max_out = 1024 * 1024,
    err_max = 4000 }))
  fs.remove_tree(d)
  t:eq(r.status, 0, r.out .. r.err)
  t:match(r.out, "1 passed, 0 failed")
end

return tests
