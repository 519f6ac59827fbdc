-- `demesne skills list | show NAME | check [DIR...] | install [--claude] [--codex] [--dir DIR]`:
-- the orchestration skills demesne ships (and the user's own), the check that keeps each
-- one true to the live tools, and linking them into the agents' skill folders.
local skills = require("demesne.skills")
local loop = require("core.loop")
local fs = require("core.fs")

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

-- The first sentence of a description, for a one-line listing.
local function first_sentence(d)
  d = d:gsub("%s+", " "):gsub("^ ", "")
  return d:match("^(.-[%.!?])%s") or d
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
      io.stdout:write(("  %s/%s%s: %s: %s\n"):format(where, p.file, p.line and (":" .. p.line) or "", p.level, p.message))
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
      if dir:sub(1, 1) == "-" then io.stderr:write("demesne: skills check: unknown option ", dir, "\n", USAGE) return 2 end
      local found = skills.in_dir(dir)
      if #found == 0 then
        io.stderr:write(("demesne: skills check: %s holds no skill (a folder with SKILL.md, or folders of them)\n"):format(dir))
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

local function hex(n)
  return ((loop.random(n) or tostring(loop.hrtime())):gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

local function home() return os.getenv("HOME") or "/root" end

--- The skill folders of the agents: Claude Code reads ~/.claude/skills (or
--- $CLAUDE_CONFIG_DIR/skills), Codex ~/.agents/skills (its current user folder; the older
--- $CODEX_HOME/skills is deprecated there).
local function claude_dir()
  local d = os.getenv("CLAUDE_CONFIG_DIR")
  if d and d ~= "" then return d .. "/skills" end
  return home() .. "/.claude/skills"
end
local function codex_dir() return home() .. "/.agents/skills" end

-- Writes an embedded skill's files to root/<name>, replacing what is there only when it
-- differs. Returns the folder and "written" | "unchanged", or nil and why.
local function materialize(s, root)
  local dest = root .. "/" .. s.name
  local ok, err = fs.mkdir_p(root)
  if not ok then return nil, err end
  local want = {}
  for rel in pairs(s.files) do
    local text, rerr = skills.read(s, rel)
    if not text then return nil, rerr end
    want[rel] = text
  end
  local st = fs.lstat(dest)
  if st and st.type == "directory" then
    local have = skills.from_dir(dest)
    local same = have ~= nil
    if same then
      for rel in pairs(have.files) do if want[rel] == nil then same = false end end
      for rel, text in pairs(want) do
        if not have.files[rel] or have.files[rel]() ~= text then same = false end
      end
    end
    if same then return dest, "unchanged" end
  end
  local tmp = ("%s/.%s.new-%s"):format(root, s.name, hex(6))
  for rel, text in pairs(want) do
    local dir = (tmp .. "/" .. rel):match("^(.*)/[^/]+$")
    ok, err = fs.mkdir_p(dir)
    if ok then ok, err = fs.write_atomic(tmp .. "/" .. rel, text) end
    if not ok then fs.remove_tree(tmp) return nil, err end
  end
  if st then
    local old = ("%s/.%s.old-%s"):format(root, s.name, hex(6))
    ok, err = fs.rename(dest, old)
    if not ok then fs.remove_tree(tmp) return nil, err end
    ok, err = fs.rename(tmp, dest)
    if not ok then fs.rename(old, dest) fs.remove_tree(tmp) return nil, err end
    fs.remove_tree(old)
  else
    ok, err = fs.rename(tmp, dest)
    if not ok then fs.remove_tree(tmp) return nil, err end
  end
  return dest, "written"
end

local function under(path, dir) return path == dir or path:sub(1, #dir + 1) == dir .. "/" end

-- Links target/<name> to `src`. A link demesne made before (to its data folder or the
-- user's skills folder) is replaced; anything else is left alone and reported.
local function link(target, name, src, ours)
  local path = target .. "/" .. name
  local st = fs.lstat(path)
  if st and st.type == "link" then
    local cur = fs.readlink(path)
    if cur == src then return "unchanged" end
    local mine = false
    for _, d in ipairs(ours) do if cur and under(cur, d) then mine = true end end
    if not mine then
      return nil, ("%s is a link to %s, not demesne's: left alone (remove it to install this skill)"):format(path, tostring(cur))
    end
    local ok, err = fs.unlink(path)
    if not ok then return nil, err end
  elseif st then
    return nil, ("%s already exists and is not a link: left alone (remove it to install this skill)"):format(path)
  end
  local ok, err = fs.symlink(src, path)
  if not ok then return nil, err end
  return st and "relinked" or "linked"
end

local function install(args)
  local targets = {}
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--claude" then targets[#targets + 1] = { label = "Claude Code", dir = claude_dir() }
    elseif a == "--codex" then targets[#targets + 1] = { label = "Codex", dir = codex_dir() }
    elseif a == "--dir" then
      local d = args[i + 1]
      if not d or d == "" then io.stderr:write("demesne: skills install: --dir needs a folder\n", USAGE) return 2 end
      targets[#targets + 1] = { label = "folder", dir = d }
      i = i + 1
    else
      io.stderr:write("demesne: skills install: unexpected argument ", a, "\n", USAGE)
      return 2
    end
    i = i + 1
  end
  if #targets == 0 then
    targets = { { label = "Claude Code", dir = claude_dir() }, { label = "Codex", dir = codex_dir() } }
  end
  for _, t in ipairs(targets) do t.dir = t.dir:gsub("/+$", "") end

  local surf = skills.surfaces()
  local data = skills.data_dir()
  local user = skills.user_dir()
  local ours = { data, fs.realpath(user) or user }
  local status = 0
  local sources = {} -- {name, src}
  for _, s in ipairs(skills.all()) do
    local problems = skills.check(s, surf)
    local bad = 0
    for _, p in ipairs(problems) do if p.level == "error" then bad = bad + 1 end end
    if bad > 0 then
      io.stdout:write(("skipped  %s: it fails `demesne skills check` (%d error(s)); fix it first\n"):format(s.name, bad))
      status = 1
    elseif s.dir then
      sources[#sources + 1] = { name = s.name, src = fs.realpath(s.dir) or s.dir }
    else
      local dest, how = materialize(s, data)
      if not dest then
        io.stdout:write(("failed   %s: cannot write it to %s: %s\n"):format(s.name, data, tostring(how)))
        status = 1
      else
        if how == "written" then io.stdout:write(("wrote    %s to %s\n"):format(s.name, dest)) end
        sources[#sources + 1] = { name = s.name, src = dest }
      end
    end
  end
  local wanted = {}
  for _, x in ipairs(sources) do wanted[x.name] = true end
  for _, t in ipairs(targets) do
    local ok, err = fs.mkdir_p(t.dir)
    if not ok then
      io.stdout:write(("failed   %s: %s\n"):format(t.dir, err))
      status = 1
    else
      local counts = { linked = 0, relinked = 0, unchanged = 0 }
      for _, x in ipairs(sources) do
        local how, lerr = link(t.dir, x.name, x.src, ours)
        if how then
          counts[how] = counts[how] + 1
          if how ~= "unchanged" then io.stdout:write(("%-8s %s/%s -> %s\n"):format(how, t.dir, x.name, x.src)) end
        else
          io.stdout:write("refused  ", lerr, "\n")
          status = 1
        end
      end
      -- links to demesne's data folder for skills it no longer has
      for _, n in ipairs(fs.readdir(t.dir) or {}) do
        local p = t.dir .. "/" .. n
        local st = fs.lstat(p)
        local cur = st and st.type == "link" and fs.readlink(p)
        if cur and under(cur, data) and not wanted[n] then
          if fs.unlink(p) then io.stdout:write(("removed  %s (demesne no longer has this skill)\n"):format(p)) end
        end
      end
      io.stdout:write(("%s (%s): %d skill(s) linked, %d relinked, %d already there\n"):format(t.label, t.dir,
        counts.linked, counts.relinked, counts.unchanged))
    end
  end
  return status
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
