-- A program on the host run to its end inside a task: its standard output kept up to a
-- bound (past it the program is killed), the tail of its standard error, and a deadline
-- (then it is killed). For the short helper processes demesne runs itself (git in
-- lua/repo/git.lua, the TOML reader in lua/hostmcp/config.lua); what they are given
-- (program, arguments, environment) is the caller's to make safe.
local async = require("demesne.async")
local process = require("core.process")
local timer = require("core.timer")

local proc = {}

--- Runs `opts.file` with `opts.args` and waits (inside a task) until it has exited and both
--- its output pipes have closed. opts: file (string, looked up in PATH), args (string[]),
--- env ("K=V" strings; nil inherits demesne's), cwd (string), detached (boolean: its own
--- process group, and every kill reaches the whole group), timeout_ms (integer: then it is
--- killed with SIGKILL), max_out (bytes of stdout kept: past it it is killed with SIGKILL),
--- err_max (bytes of the end of stderr kept). Standard input is /dev/null.
--- Returns {status = exit status, signal = the signal that ended it (0: none), out = stdout
--- (at most max_out bytes), err = the tail of stderr, timed_out = true when the deadline
--- killed it, over = true when it wrote more than max_out}, or nil, message, code when it
--- could not be started (the spawn's own message: the caller says what was being run).
--- Cancelling the task kills it.
---@param opts { file: string, args?: string[], env?: string[], cwd?: string, detached?: boolean, timeout_ms: integer, max_out: integer, err_max: integer }
---@return table|nil r, string|nil err, string|nil code
function proc.run(opts)
  local group = opts.detached and true or nil
  local parts, len, over, timed_out = {}, 0, false, false
  local err_tail = ""
  local status, sig
  local ok, e, code = async.await(function(cb)
    local waiting, outs = 2, 0
    local p, pipes, perr = process.spawn({ file = opts.file, args = opts.args, env = opts.env, cwd = opts.cwd,
      stdout = true, stderr = true, detached = opts.detached }, function(st, sg)
      status, sig = st, sg
      waiting = waiting - 1
      if waiting == 0 then cb(true) end
    end)
    if not p then
      cb(nil, tostring(pipes), perr)
      return
    end
    local t = timer.after(opts.timeout_ms, function()
      timed_out = true
      p:kill("KILL", group)
    end)
    local function closed()
      outs = outs + 1
      if outs == 2 then
        t:close()
        waiting = waiting - 1
        if waiting == 0 then cb(true) end
      end
    end
    pipes.stdout:read_start(function(data)
      if data then
        len = len + #data
        if len > opts.max_out then
          if not over then over = true; p:kill("KILL", group) end
        else
          parts[#parts + 1] = data
        end
      else
        pipes.stdout:close()
        closed()
      end
    end)
    pipes.stderr:read_start(function(data)
      if data then err_tail = (err_tail .. data):sub(-opts.err_max) else pipes.stderr:close(); closed() end
    end)
    return function() t:close(); p:kill("KILL", group) end
  end)
  if not ok then return nil, e, code end
  return { status = status, signal = sig, out = table.concat(parts), err = err_tail, timed_out = timed_out, over = over }
end

return proc
