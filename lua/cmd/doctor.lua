-- `demesne doctor`: whether this machine is ready to run sandboxes (engine, images, config,
-- folders, demesne-init), one verdict per check and the fix for each problem. The checks
-- are lua/doctor.lua's. Exit status 0 only when every check passed.
local async = require("demesne.async")
local doctor = require("demesne.doctor")
local loop = require("core.loop")

---@param args string[]
---@return integer status  0 all well, 1 a problem, 2 usage
return function(args)
  if args[1] then
    io.stderr:write("demesne doctor: unexpected argument '", args[1], "'\n")
    return 2
  end
  local results
  local task = async.spawn("doctor", function() results = doctor.run() end)
  if not task.done then loop.run() end
  if not results then
    io.stderr:write("demesne doctor: ", tostring(task.result and task.result[2]), "\n")
    return 1
  end
  local w, problems = 0, {}
  for _, r in ipairs(results) do w = math.max(w, #r.name) end
  for _, r in ipairs(results) do
    local verdict = r.ok and "ok" or (r.skip and "skip" or "FAIL")
    io.stdout:write(("%-4s  %-" .. w .. "s  %s\n"):format(verdict, r.name, r.detail))
    if not r.ok and not r.skip then
      problems[#problems + 1] = r.name
      if r.fix then io.stdout:write(("%-4s  %-" .. w .. "s  fix: %s\n"):format("", "", r.fix)) end
    end
  end
  if #problems == 0 then
    io.stdout:write(("demesne doctor: all %d checks passed\n"):format(#results))
    return 0
  end
  io.stdout:write(("demesne doctor: %d problem%s (%s)\n"):format(#problems, #problems == 1 and "" or "s",
    table.concat(problems, ", ")))
  return 1
end
