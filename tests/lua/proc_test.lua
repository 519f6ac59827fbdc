-- lua/proc.lua: a helper program run to its end with bounded output and a deadline, on
-- real processes (/bin/sh): its status and output, the tail of stderr, a program killed for
-- writing too much or for its deadline (with its whole group when detached), and one that
-- cannot start.
local proc = require("demesne.proc")
local loop = require("core.loop")

local tests = {}

local function sh(script, opts)
  opts = opts or {}
  return proc.run({ file = "/bin/sh", args = { "-c", script }, detached = opts.detached,
    timeout_ms = opts.timeout_ms or 60000, max_out = opts.max_out or 1024, err_max = opts.err_max or 8 })
end

function tests.status_stdout_and_the_tail_of_stderr(t)
  local r = assert(sh("printf out; printf 0123456789abcdef >&2; exit 3"))
  t:eq({ r.status, r.signal, r.out, r.err, r.timed_out, r.over }, { 3, 0, "out", "89abcdef", false, false })
end

function tests.output_past_the_bound_kills_it_and_keeps_the_bound(t)
  local r = assert(sh("head -c 100000 /dev/zero; echo never-exits-alone; sleep 60", { max_out = 1000 }))
  t:eq({ r.over, r.signal, r.timed_out }, { true, 9, false }, "killed with SIGKILL for its output")
  t:ok(#r.out <= 1000, ("at most the bound is kept (%d bytes)"):format(#r.out))
end

function tests.the_deadline_kills_a_detached_program_with_its_group(t)
  -- the background sleep keeps the pipes open: the call ends only when the group is killed
  local r = assert(sh("sleep 60 & echo started; sleep 60", { detached = true, timeout_ms = 100 }))
  t:eq({ r.timed_out, r.signal, r.over, r.out }, { true, 9, false, "started\n" })
end

function tests.a_program_that_cannot_start_is_said_with_its_code(t)
  local r, err, code = proc.run({ file = "/nonexistent/program", args = {}, timeout_ms = 1000, max_out = 10,
    err_max = 10 })
  t:eq(r, nil)
  t:match(err, "no such file")
  t:eq(code, "ENOENT")
end

-- A spawn that failed left its handle in the loop's list, freed: the loop's walk at exit
-- then crashed. `demesne branches` in a folder that does not exist runs git there.
function tests.a_spawn_that_failed_leaves_nothing_behind_in_the_loop(t)
  local r = assert(proc.run({ file = loop.exepath(), args = { "branches", "/nonexistent/demesne-proc-test" },
    timeout_ms = 60000, max_out = 4096, err_max = 4096 }))
  t:eq({ r.status, r.signal }, { 1, 0 }, "it failed as a command fails, not by a signal: " .. r.err)
  t:match(r.err, "git cannot be run on the host")
end

return tests
