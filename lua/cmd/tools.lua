-- `demesne tools [--json]`: the loaded tools, each with its title and the file it came
-- from, then any tool files that were refused and why. Exit status 1 when a file was refused.
local json = require("demesne.json")
local tools = require("demesne.tools")

---@param args string[]
---@param opts {fixtures: string|nil}
---@return integer status
return function(args, opts)
  local as_json = false
  for _, a in ipairs(args) do
    if a == "--json" then
      as_json = true
    else
      io.stderr:write("demesne tools: unexpected argument '", a, "'\n")
      return 2
    end
  end
  local reg = tools.load({ fixtures = opts.fixtures, quiet = true })
  local list = reg:list()
  if as_json then
    local out = { tools = json.array(), refused = json.array() }
    for _, d in ipairs(list) do
      out.tools[#out.tools + 1] = { name = d.name, title = d.title, origin = d.origin }
    end
    for _, e in ipairs(reg.errors) do out.refused[#out.refused + 1] = { origin = e.origin, error = e.message } end
    io.stdout:write(json.encode(out), "\n")
  else
    local w = 4
    for _, d in ipairs(list) do w = math.max(w, #d.name) end
    for _, d in ipairs(list) do
      io.stdout:write(("%-" .. w .. "s  %s\n%" .. w .. "s  from %s\n"):format(d.name, d.title or "", "", d.origin))
    end
    if #list == 0 then io.stdout:write("no tools loaded\n") end
    if #reg.errors > 0 then
      io.stdout:write("\nrefused:\n")
      for _, e in ipairs(reg.errors) do io.stdout:write("  ", e.message, "\n") end
    end
  end
  return #reg.errors > 0 and 1 or 0
end
