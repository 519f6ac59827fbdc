-- What every core.* handle shares (core/bind/registry.c dm_metatable): a name in
-- tostring, and a __close that releases it at the end of a `<close>` scope, process and
-- signal handles included; and the error sink of loop callbacks (core.loop.on_callback_error).
local async = require("demesne.async")
local loop = require("core.loop")
local process = require("core.process")
local signal = require("core.signal")
local timer = require("core.timer")

local tests = {}

function tests.a_process_in_a_close_scope_is_killed_at_its_end(t)
  local exited = async.event()
  local code, sig
  do
    local proc <close> = assert(process.spawn({ file = "sleep", args = { "30" } }, function(c, s)
      code, sig = c, s
      exited.set()
    end))
    t:eq(proc:exited(), false, "running inside the scope")
    t:ok(tostring(proc):match("^core%.process: 0x%x+$"), "tostring names the handle: " .. tostring(proc))
  end
  exited.wait()
  t:eq(sig, 9, "killed with SIGKILL at the end of the scope (exit code " .. tostring(code) .. ")")
end

function tests.a_process_that_exited_is_left_alone_by_its_close(t)
  local exited = async.event()
  local code
  local proc = assert(process.spawn({ file = "true" }, function(c) code = c exited.set() end))
  exited.wait()
  do
    local p <close> = proc
    t:eq(p:exited(), true, "exited")
  end
  t:eq(code, 0, "its exit code stands")
end

-- Runs `true` and returns once it has exited: libuv delivers its SIGCHLD to every watcher
-- of CHLD in the same turn of the loop as the exit.
local function run_a_child()
  local exited = async.event()
  assert(process.spawn({ file = "true" }, function() exited.set() end))
  exited.wait()
  async.sleep(0)
end

function tests.a_signal_watcher_in_a_close_scope_stops_at_its_end(t)
  local calls = 0
  do
    local w <close> = assert(signal.watch("CHLD", function() calls = calls + 1 end))
    t:ok(tostring(w):match("^core%.signal: 0x%x+$"), "tostring names the watcher: " .. tostring(w))
    run_a_child()
    t:ok(calls >= 1, "it watches inside the scope: " .. calls .. " calls")
  end
  local seen = calls
  run_a_child()
  t:eq(calls, seen, "no call after the end of the scope")
end

function tests.every_handle_kind_names_itself(t)
  local tm <close> = timer.new()
  t:ok(tostring(tm):match("^core%.timer: 0x%x+$"), "timer: " .. tostring(tm))
end

function tests.a_callback_error_goes_to_the_sink_and_the_default_comes_back(t)
  local got = {}
  local previous = loop.on_callback_error(function(tb) got[#got + 1] = tb end)
  local fired = async.event()
  timer.after(0, function()
    fired.set()
    error("boom from a timer")
  end)
  fired.wait()
  async.sleep(0)
  local mine = loop.on_callback_error(previous)
  t:ok(type(mine) == "function", "on_callback_error returns the sink it replaces")
  t:eq(#got, 1, "one error reported")
  t:ok((got[1] or ""):find("boom from a timer", 1, true), "the message: " .. tostring(got[1]))
  t:ok((got[1] or ""):find("stack traceback", 1, true), "with its traceback")
  t:eq(loop.on_callback_error(previous), previous, "the previous sink is back")
end

return tests
