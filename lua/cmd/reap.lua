-- `demesne reap`: one reaper pass now (lua/sandbox/reaper.lua): expired sandboxes, the
-- one-shot and warm sandboxes of servers that are gone, and what such servers left in the
-- state folder. Background jobs whose record says running and live servers' sandboxes are
-- kept. Prints how many containers it removed.
--
-- `demesne reap --after-exit OWNER` is the exit reaper `demesne serve` starts beside
-- itself (reaper.start_exit_reaper): it waits for its stdin to close and for the server
-- OWNER names to be gone, then runs the same pass, logging to <state_dir>/exit-reaper.log.
local async = require("demesne.async")
local config = require("demesne.config")
local fs = require("core.fs")
local log = require("demesne.log")
local sandbox = require("demesne.sandbox")
local stream = require("core.stream")
local util = require("demesne.util")

local PASS_MS = 120000        -- one pass, at most: an engine that hangs must not keep us
local LOG_MAX = 1024 * 1024   -- bytes: a longer exit-reaper.log starts again from empty

-- Sends this process's log records (info and above) to <state_dir>/exit-reaper.log (its
-- stderr is /dev/null). The state folder is the host's own; the file is never a link.
local function log_to_file()
  local dir = config.get("state_dir")
  if not fs.mkdir_p(dir, 448) then return end -- 0700
  local path = dir .. "/exit-reaper.log"
  local st = fs.lstat(path)
  local f = fs.open(path, (st and st.size and st.size > LOG_MAX) and "w" or "a", 384) -- 0600
  if not f then return end
  log.add_sink(function(level, logger, msg)
    if log.LEVELS[level] >= log.LEVELS.info then
      f:write(("%s %s %s: %s\n"):format(util.iso_now(), level, logger, log.printable(msg, 4096)))
    end
  end)
end

---@param args string[]
---@return integer status  0 done, 1 the pass failed, 2 usage
return function(args)
  local owner_label
  if args[1] == "--after-exit" and args[2] and #args == 2 then
    owner_label = args[2]
    if not owner_label:match("^.+/%d+/%d+$") then
      io.stderr:write("demesne reap: --after-exit needs an owner label HOST/PID/START\n")
      return 2
    end
  elseif args[1] then
    io.stderr:write("demesne reap: unexpected argument '", args[1], "'\n")
    return 2
  end
  local n, err
  local ok, terr = async.main("reap", function()
    if owner_label then
      log_to_file()
      -- stdin that is no pipe: nothing but the owner's process tells us the server ended
      local input = stream.open_fd(0)
      n, err = sandbox.after_exit(input, owner_label, PASS_MS)
      if input then input:close() end
      if n then log.info("demesne.reaper", "the server %s has ended: %d container(s) removed", owner_label, n) end
    else
      n, err = async.timeout(PASS_MS, sandbox.reap)
    end
  end)
  if not ok then err = tostring(terr) end
  if not n then
    log.error("demesne.reaper", "%s", tostring(err))
    return 1
  end
  if not owner_label then io.stdout:write(("removed %d container(s)\n"):format(n)) end
  return 0
end
