-- `demesne providers`: the agent providers loaded (built-in lua/providers/*.lua, then
-- $XDG_CONFIG_HOME/demesne/providers/*.lua), each with its models, where it came from and
-- whether it can run now; then the files that were refused and why. Exit status 1 when a
-- file was refused.
local providers = require("demesne.providers")

---@param args string[]
---@return integer status
return function(args)
  if args[1] then
    io.stderr:write("demesne providers: unexpected argument '", args[1], "'\n")
    return 2
  end
  local reg = providers.load({ quiet = true })
  for _, p in ipairs(reg:list()) do
    local names = {}
    for _, m in ipairs(providers.models_of(p)) do names[#names + 1] = m.name end
    local _, why = providers.ready(p)
    io.stdout:write(("%-18s %s\n%-18s from %s\n%-18s models: %s\n%-18s %s\n"):format(p.name, p.title or "", "",
      p.origin, "", table.concat(names, ", "), "", why and ("not ready: " .. why) or "ready"))
  end
  if #reg:list() == 0 then io.stdout:write("no providers loaded\n") end
  if #reg.errors > 0 then
    io.stdout:write("\nrefused:\n")
    for _, e in ipairs(reg.errors) do io.stdout:write("  ", e.message, "\n") end
  end
  return #reg.errors > 0 and 1 or 0
end
