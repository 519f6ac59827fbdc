-- `demesne skills list | show NAME | check [DIR...] | install [--claude] [--codex] [--dir DIR]`:
-- the orchestration skills demesne ships (and the user's own), the check that keeps each
-- one true to the live tools, and linking them into the agents' skill folders.
local skills = require("demesne.skills")

local USAGE = [[
usage: demesne skills list
       demesne skills show NAME
       demesne skills check [DIR...]
       demesne skills install [--claude] [--codex] [--dir DIR]...
]]

local function origin_text(s)
  if s.origin == "embedded" then return "built-in" end
  if s.builtin then return "built-in " .. s.origin end
  return (s.replaces and "user (replaces the built-in) " or "user ") .. s.origin
end

-- The first sentence of a description, at most 100 characters, for a one-line listing.
local function first_sentence(d)
  d = d:gsub("%s+", " "):gsub("^ ", "")
  d = d:match("^(.-[%.!?])%s") or d
  if utf8.len(d) and utf8.len(d) > 100 then
    d = d:sub(1, utf8.offset(d, 100) - 1):gsub("%s+%S*$", "") .. " …"
  end
  return d
end

local function list(args)
  if #args > 0 then io.stderr:write("demesne: skills list: unexpected argument ", args[1], "\n", USAGE) return 2 end
  local all = skills.all()
  local w = 4
  for _, s in ipairs(all) do w = math.max(w, #s.name) end
  for _, s in ipairs(all) do
    local sum, err = skills.summary(s)
    io.stdout:write(("%-" .. w .. "s  %s\n%" .. w .. "s  from %s\n"):format(s.name,
      sum and first_sentence(sum.description) or ("(unreadable: " .. tostring(err) .. ")"), "", origin_text(s)))
  end
  if #all == 0 then io.stdout:write("no skills\n") end
  return 0
end

local function show(args)
  if #args ~= 1 then io.stderr:write("demesne: skills show: give one NAME\n", USAGE) return 2 end
  local s = skills.find(args[1])
  if not s then
    local names = {}
    for _, x in ipairs(skills.all()) do names[#names + 1] = x.name end
    io.stderr:write(("demesne: skills show: no skill %q (there are: %s)\n"):format(args[1], table.concat(names, ", ")))
    return 1
  end
  local text, err = skills.read(s, "SKILL.md")
  if not text then io.stderr:write("demesne: skills show: ", err, "\n") return 1 end
  io.stdout:write(text)
  if text:sub(-1) ~= "\n" then io.stdout:write("\n") end
  local extra = {}
  for rel in pairs(s.files) do if rel ~= "SKILL.md" then extra[#extra + 1] = rel end end
  table.sort(extra)
  if #extra > 0 then
    io.stdout:write("\n-- resources (", origin_text(s), "): ", table.concat(extra, ", "), "\n")
  end
  return 0
end

local function report(s, problems)
  local errors, warnings = 0, 0
  for _, p in ipairs(problems) do
    if p.level == "error" then errors = errors + 1 else warnings = warnings + 1 end
  end
  local where = s.dir or ("skills/" .. s.name)
  if #problems == 0 then
    io.stdout:write("ok       ", s.name, "\n")
  else
    io.stdout:write(errors > 0 and "FAILED   " or "warning  ", s.name, "\n")
    for _, p in ipairs(problems) do
      local at = p.line and (":" .. p.line) or ""
      io.stdout:write(("  %s/%s%s: %s: %s\n"):format(where, p.file, at, p.level, p.message))
    end
  end
  return errors, warnings
end

local function check(args)
  local list_of = {}
  if #args == 0 then
    list_of = skills.all()
  else
    for _, dir in ipairs(args) do
      if dir:sub(1, 1) == "-" then
        io.stderr:write("demesne: skills check: unknown option ", dir, "\n", USAGE)
        return 2
      end
      local found = skills.in_dir(dir)
      if #found == 0 then
        io.stderr:write(("demesne: skills check: %s holds no skill (a folder with SKILL.md, or folders of them)\n")
          :format(dir))
        return 1
      end
      for _, s in ipairs(found) do list_of[#list_of + 1] = s end
    end
  end
  local surf = skills.surfaces()
  local errors, warnings = 0, 0
  for _, s in ipairs(list_of) do
    local e, w = report(s, (skills.check(s, surf)))
    errors, warnings = errors + e, warnings + w
  end
  io.stdout:write(("%d skill(s) checked against %d host tools and %s: %d error(s), %d warning(s)\n"):format(#list_of,
    #surf.host:list(), surf.child and (#surf.child:list() .. " in-sandbox tools") or "no in-sandbox tools",
    errors, warnings))
  return errors > 0 and 1 or 0
end

--------------------------------------------------------------------------------------------
-- install

local function install(args)
  local targets = {}
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--claude" then targets[#targets + 1] = skills.claude_dir()
    elseif a == "--codex" then targets[#targets + 1] = skills.codex_dir()
    elseif a == "--dir" then
      local d = args[i + 1]
      if not d or d == "" then io.stderr:write("demesne: skills install: --dir needs a folder\n", USAGE) return 2 end
      targets[#targets + 1] = d
      i = i + 1
    else
      io.stderr:write("demesne: skills install: unexpected argument ", a, "\n", USAGE)
      return 2
    end
    i = i + 1
  end
  if #targets == 0 then targets = { skills.claude_dir(), skills.codex_dir() } end
  local ok = skills.install(skills.all(), skills.surfaces(), targets, function(line)
    io.stdout:write(line, "\n")
  end)
  return ok and 0 or 1
end

---@param args string[]
---@return integer status
return function(args)
  local sub = table.remove(args, 1) or "list"
  if sub == "list" then return list(args)
  elseif sub == "show" then return show(args)
  elseif sub == "check" then return check(args)
  elseif sub == "install" then return install(args)
  end
  io.stderr:write("demesne: skills: unknown subcommand ", sub, "\n", USAGE)
  return 2
end
