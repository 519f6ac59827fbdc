-- Skills: ready-made orchestration procedures an agent loads (skills/<name>/SKILL.md plus
-- the resources it links to), and the check that keeps them true to the live tools.
--
-- A skill follows the Agent Skills format (https://agentskills.io/specification), read by
-- Claude Code and Codex alike: YAML front matter (`name`, `description`, optional
-- `license`, `compatibility`, `metadata`, `allowed-tools`), then Markdown. demesne's skills
-- add two sections, `## Procedure` and `## Output contract`, and name every tool call in a
-- form this module can find and check:
--
--   ```call host                 a call the user's agent makes (demesne's host tools)
--   sandbox_agent {"prompt": "…", "background": true}
--   ```
--   ```call child                a call an agent inside a sandbox makes through the
--   sandbox_wait                 in-sandbox `demesne` MCP server
--   {"job_id": "<job_id of impl>", "timeout_seconds": 240}
--   ```
--
-- The first word is the tool, the rest one JSON object: its arguments, checked against the
-- tool's live inputSchema (every parameter must exist, the required ones must be there and
-- each value must validate). A string holding `<…>` is a template for a value known only
-- at run time: each `<…>` is read as `x1` for the check, and an enum is not enforced on it.
-- In prose, `sandbox_x(param, other=…)` names a tool and its parameters (checked by name),
-- and any other word `sandbox_x` or `mcp__demesne__x` must name a tool.
--
-- Built-in skills are embedded in the binary (skills/ in the source tree); users add their
-- own in $XDG_CONFIG_HOME/demesne/skills/<name>/, which replace a built-in of that name.
local config = require("demesne.config")
local json = require("demesne.json")
local schema = require("demesne.jsonschema")
local runtime = require("demesne.runtime")
local tools = require("demesne.tools")
local fs = require("core.fs")
local loop = require("core.loop")

-- LibYAML through lyaml (the Debian package lua-yaml); loaded by the standard searchers
local has_yaml, lyaml = pcall(require, "lyaml")
-- the tools a sandbox sees (nested sandboxes); absent from a build without them
local has_child, child_tools = pcall(require, "demesne.tree.child")

local skills = {}

--- The most a SKILL.md or a resource may hold (bytes): a skill is loaded into a model's context.
skills.MAX_FILE = 256 * 1024
--- The most files a skill folder may hold (a skill is instructions and a few resources).
skills.MAX_FILES = 200

local NAME_MAX, DESCRIPTION_MAX, COMPATIBILITY_MAX = 64, 1024, 500
local FIELDS = { name = true, description = true, license = true, compatibility = true, metadata = true,
  ["allowed-tools"] = true }
local SURFACES = { host = true, child = true }

--------------------------------------------------------------------------------------------
-- Where skills come from

--- The folder users put their own skills in: $XDG_CONFIG_HOME/demesne/skills.
---@return string
function skills.user_dir() return config.dir() .. "/skills" end

--- The folder `install` writes the built-in skills to, so that agents can read them from
--- disk: $XDG_DATA_HOME/demesne/skills.
---@return string
function skills.data_dir()
  local base = os.getenv("XDG_DATA_HOME")
  if not base or base == "" then base = (os.getenv("HOME") or "/root") .. "/.local/share" end
  return base .. "/demesne/skills"
end

---@class Skill
---@field name string          the folder's name
---@field origin string        "embedded" or the folder on disk
---@field dir string|nil       the folder on disk (nil for an embedded skill)
---@field files table<string, fun(): string|nil, string|nil>  relative path -> reader

local function disk_reader(path)
  return function()
    local st = fs.stat(path)
    if st and st.size > skills.MAX_FILE then
      return nil, ("%s: %d bytes, more than the %d a skill file may hold"):format(path, st.size, skills.MAX_FILE)
    end
    local s, err = fs.read_file(path)
    return s, err
  end
end

-- The files of a skill folder on disk: relative path -> reader; hidden names and links
-- skipped. At most skills.MAX_FILES files, MAX_DEPTH folders deep; the second result is true
-- when there was more.
local MAX_DEPTH = 8
local function disk_files(dir)
  local out, count, more = {}, 0, false
  local function walk(rel, depth)
    for _, n in ipairs(fs.readdir(dir .. (rel == "" and "" or "/" .. rel)) or {}) do
      if n:sub(1, 1) ~= "." then
        local r = rel == "" and n or rel .. "/" .. n
        local st = fs.lstat(dir .. "/" .. r)
        if st and st.type == "directory" then
          if depth < MAX_DEPTH then walk(r, depth + 1) else more = true end
        elseif st and st.type == "file" then
          count = count + 1
          if count > skills.MAX_FILES then more = true return end
          out[r] = disk_reader(dir .. "/" .. r)
        end
      end
    end
  end
  walk("", 1)
  return out, more
end

--- The skill in folder `dir` (which holds a SKILL.md), or nil and why.
---@param dir string
---@return Skill|nil, string|nil err
function skills.from_dir(dir)
  dir = dir:gsub("/+$", "")
  local st = fs.stat(dir .. "/SKILL.md")
  if not st or st.type ~= "file" then return nil, ("%s: no SKILL.md"):format(dir) end
  local files, more = disk_files(dir)
  return { name = dir:match("([^/]+)$"), origin = dir, dir = dir, files = files, too_many = more }
end

--- The skills in `dir`: the skill itself when `dir` holds a SKILL.md, else each folder in it
--- that holds one (sorted by name). A missing folder gives none.
---@param dir string
---@return Skill[]
function skills.in_dir(dir)
  local one = skills.from_dir(dir)
  if one then return { one } end
  local out = {}
  for _, n in ipairs(fs.readdir(dir) or {}) do
    if n:sub(1, 1) ~= "." then
      local s = skills.from_dir(dir .. "/" .. n)
      if s then out[#out + 1] = s end
    end
  end
  return out
end

--- The built-in skills: those embedded in the binary (or, with --source-dir, the source
--- tree's skills/ folder), sorted by name.
---@return Skill[]
function skills.builtin()
  if runtime.source_dir then return skills.in_dir(runtime.source_dir .. "/skills") end
  local by_name, names = {}, {}
  for _, rel in ipairs(runtime.files("skills/")) do
    local name, path = rel:match("^skills/([^/]+)/(.+)$")
    if name then
      if not by_name[name] then
        by_name[name] = { name = name, origin = "embedded", files = {} }
        names[#names + 1] = name
      end
      by_name[name].files[path] = function() return (runtime.source(rel)) end
    end
  end
  table.sort(names)
  local out = {}
  for _, n in ipairs(names) do
    if by_name[n].files["SKILL.md"] then out[#out + 1] = by_name[n] end
  end
  return out
end

--- Every skill demesne offers: the built-in ones, then the user's
--- ($XDG_CONFIG_HOME/demesne/skills), a user skill replacing a built-in of the same name.
--- Each gets `builtin = true` or `replaces = true` where that applies.
---@param opts {user_dir: string|false|nil}|nil  user_dir overrides the user folder (false: none)
---@return Skill[]
function skills.all(opts)
  opts = opts or {}
  local by_name, order = {}, {}
  for _, s in ipairs(skills.builtin()) do
    s.builtin = true
    by_name[s.name] = s
    order[#order + 1] = s.name
  end
  local user = opts.user_dir
  if user == nil then user = skills.user_dir() end
  if user then
    for _, s in ipairs(skills.in_dir(user)) do
      if by_name[s.name] then s.replaces = true else order[#order + 1] = s.name end
      by_name[s.name] = s
    end
  end
  table.sort(order)
  local out = {}
  for _, n in ipairs(order) do out[#out + 1] = by_name[n] end
  return out
end

--- The skill named `name` among skills.all(opts), or nil.
---@param name string
---@param opts table|nil
---@return Skill|nil
function skills.find(name, opts)
  for _, s in ipairs(skills.all(opts)) do
    if s.name == name then return s end
  end
  return nil
end

--- The text of a skill's file (relative path), or nil and why.
---@param s Skill
---@param rel string
---@return string|nil, string|nil err
function skills.read(s, rel)
  local r = s.files[rel]
  if not r then return nil, ("%s: no file %s"):format(s.origin, rel) end
  local text, err = r()
  if not text then return nil, err or ("%s: cannot read %s"):format(s.origin, rel) end
  if #text > skills.MAX_FILE then
    return nil, ("%s/%s: %d bytes, more than the %d a skill file may hold"):format(s.origin, rel, #text,
      skills.MAX_FILE)
  end
  return text
end

--------------------------------------------------------------------------------------------
-- Reading SKILL.md

---@class SkillDoc
---@field front table      the front matter, as YAML gave it
---@field body string      the Markdown after it
---@field body_line integer  the line number (1-based) in SKILL.md where the body starts

--- Splits SKILL.md into its front matter (parsed as YAML) and body.
---@param text string
---@return SkillDoc|nil, string|nil err  err names the line when it can
function skills.parse(text)
  if not has_yaml then
    return nil, "reading YAML front matter needs lyaml (the Debian package lua-yaml): " .. tostring(lyaml)
  end
  text = text:gsub("\r\n", "\n")
  if text:sub(1, 4) ~= "---\n" then
    return nil, "line 1: SKILL.md must start with YAML front matter: a line '---', the fields, and a line '---'"
  end
  local close = text:find("\n%-%-%-[ \t]*\n", 4) or text:find("\n%-%-%-[ \t]*$", 4)
  if not close then return nil, "the front matter has no closing '---' line" end
  local yaml_text = text:sub(5, close)
  local ok, front = pcall(lyaml.load, yaml_text)
  if not ok then
    local msg = tostring(front):gsub("^.-:%d+: ", "")
    -- LibYAML counts lines of the front matter from 1: SKILL.md's line is one more
    msg = msg:gsub("line (%d+)", function(n) return "line " .. (tonumber(n) + 1) end)
    return nil, "front matter: " .. msg
  end
  if type(front) ~= "table" then return nil, "front matter: must be a mapping of fields (name: …, description: …)" end
  local after = text:find("\n", close + 1) or #text
  local _, front_lines = text:sub(1, after):gsub("\n", "")
  return { front = front, body = text:sub(after + 1), body_line = front_lines + 1 }
end

--------------------------------------------------------------------------------------------
-- Finding what a skill names

---@class SkillCall
---@field surface string   "host" or "child"
---@field tool string
---@field args table|nil   the decoded arguments (nil when they did not decode)
---@field line integer     the line of the opening fence in SKILL.md
---@field error string|nil why the block could not be read

---@class SkillMention
---@field tool string
---@field params string[]|nil  the parameters named in `tool(a, b=…)`, nil for a bare name
---@field line integer

-- The fenced code blocks of a Markdown text: {info, lines = {…}, line = opening line (0-based
-- offset from the text's first line)}. Fences may be indented (inside list items); the
-- content loses the opening fence's indentation.
local function fences(body)
  local out, cur = {}, nil
  local n = 0
  local outside = {}
  for line in (body .. "\n"):gmatch("([^\n]*)\n") do
    if cur then
      local mark = line:match("^%s*([`~]+)%s*$")
      if mark and mark:sub(1, 1) == cur.char and #mark >= cur.len then
        out[#out + 1] = cur
        cur = nil
      else
        local strip = #cur.indent
        local lead = line:match("^%s*")
        cur.lines[#cur.lines + 1] = line:sub(math.min(strip, #lead) + 1)
      end
    else
      local ind, mark, info = line:match("^(%s*)(```+)%s*([^`]*)$")
      if not mark then ind, mark, info = line:match("^(%s*)(~~~+)%s*(.*)$") end
      if mark then
        cur = { indent = ind, char = mark:sub(1, 1), len = #mark, info = info:gsub("%s+$", ""), lines = {}, line = n }
      else
        outside[#outside + 1] = { text = line, line = n }
      end
    end
    n = n + 1
  end
  if cur then out[#out + 1] = cur end -- an unclosed fence runs to the end, as in CommonMark
  return out, outside
end

--- The tool calls (```call host / ```call child blocks) of a SKILL.md body.
---@param doc SkillDoc
---@return SkillCall[]
function skills.calls(doc)
  local blocks = fences(doc.body)
  local out = {}
  for _, b in ipairs(blocks) do
    local word, rest = b.info:match("^(%S+)%s*(.*)$")
    if word == "call" then
      local c = { line = doc.body_line + b.line, surface = rest }
      out[#out + 1] = c
      local text = table.concat(b.lines, "\n")
      local tool, args_text = text:match("^%s*([%w_%.%-]+)(.*)$")
      if not SURFACES[rest] then
        c.error = ("a call block says where the call is made: ```call host or ```call child (got ```%s)"):format(b.info)
      elseif not tool then
        c.error = "a call block starts with the tool's name"
      else
        c.tool = tool
        args_text = args_text:match("^%s*(.-)%s*$")
        if args_text == "" then
          c.args = {}
        else
          local v, err = json.decode(args_text)
          if type(v) ~= "table" or json.is_array(v) or (v[1] ~= nil) then
            c.error = ("%s: the arguments must be one JSON object%s"):format(tool, err and (" (" .. err .. ")") or "")
          else
            c.args = v
          end
        end
      end
    end
  end
  return out
end

--- The tools named outside call blocks: `sandbox_x(a, b=…)` (with its parameters) and bare
--- words `sandbox_x` and `mcp__demesne__x` (Claude Code's name for a tool of the in-sandbox
--- server), in the prose and in other code blocks.
---@param doc SkillDoc
---@return SkillMention[]
function skills.mentions(doc)
  local blocks, outside = fences(doc.body)
  local lines = {}
  for _, o in ipairs(outside) do lines[#lines + 1] = o end
  for _, b in ipairs(blocks) do
    if b.info:match("^(%S+)") ~= "call" then
      for i, l in ipairs(b.lines) do lines[#lines + 1] = { text = l, line = b.line + i } end
    end
  end
  local out = {}
  for _, l in ipairs(lines) do
    local text = l.text
    local taken = {}
    for s, tool, inner in text:gmatch("()(sandbox_[%w_]+)%(([^()]*)%)") do
      local params = {}
      for part in (inner .. ","):gmatch("([^,]*),") do
        local p = part:match("^%s*([%a_][%w_]*)")
        if p then params[#params + 1] = p end
      end
      out[#out + 1] = { tool = tool, params = params, line = doc.body_line + l.line }
      taken[s] = true
    end
    for s, tool in text:gmatch("()%f[%w_](sandbox_[%w_]+)") do
      if not taken[s] then out[#out + 1] = { tool = tool, line = doc.body_line + l.line } end
    end
    for tool in text:gmatch("mcp__demesne__([%w_]+)") do
      out[#out + 1] = { tool = tool, line = doc.body_line + l.line, child = true }
    end
  end
  return out
end

--------------------------------------------------------------------------------------------
-- The live tools

---@class SkillSurfaces
---@field host ToolRegistry         the tools demesne serves to its MCP client
---@field child ToolRegistry|nil    the tools a sandbox sees through its endpoint (nil without nested sandboxes)

--- The live tool surfaces: the registry `demesne serve` loads (built-in and user tools) and,
--- derived from it, the tools an agent in a sandbox sees.
---@param opts {fixtures: string|nil, user_dir: string|false|nil}|nil  passed to tools.load
---@return SkillSurfaces
function skills.surfaces(opts)
  opts = opts or {}
  local host = tools.load({ fixtures = opts.fixtures, user_dir = opts.user_dir, quiet = true })
  local out = { host = host }
  if has_child then out.child = child_tools.registry(host) end
  return out
end

-- Replaces each <…> in the strings of `v` by "x1"; records the paths (schema.validate's
-- spelling: a.b[0]) of the strings that held one.
local function detemplate(v, path, marks)
  if type(v) == "string" then
    if v:find("<[^<>]*>") then
      marks[path] = true
      return (v:gsub("<[^<>]*>", "x1"))
    end
    return v
  end
  if type(v) ~= "table" then return v end
  local out = json.is_array(v) and json.array() or {}
  for k, x in pairs(v) do
    local p
    if type(k) == "number" then p = path .. "[" .. (k - 1) .. "]"
    else p = path == "" and k or path .. "." .. k end
    out[k] = detemplate(x, p, marks)
  end
  return out
end

local function sorted_keys(t)
  local out = {}
  for k in pairs(t or {}) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- Problems of one call against a tool registry: the tool's existence, each parameter's,
--- the required ones, and the values (templates excepted from enums).
---@param c SkillCall
---@param reg ToolRegistry
---@param where string  how to name the surface in messages ("the host tools")
---@return string[] messages
function skills.check_call(c, reg, where)
  local d = reg:get(c.tool)
  if not d then
    return { ("%s: no such tool among %s (%s)"):format(c.tool, where, table.concat(sorted_keys(reg.by_name), ", ")) }
  end
  local props = d.inputSchema.properties or {}
  local out = {}
  for _, k in ipairs(sorted_keys(c.args)) do
    if type(k) ~= "string" or not props[k] then
      out[#out + 1] = ("%s: no parameter %q among %s (it takes %s)"):format(c.tool, tostring(k), where,
        table.concat(sorted_keys(props), ", "))
    end
  end
  local marks = {}
  local ok, errs = schema.validate(d.inputSchema, detemplate(c.args, "", marks))
  if not ok then
    for _, e in ipairs(errs) do
      local skip = (marks[e.path] and e.message:match("^must be one of")) or e.message == "is not an allowed property"
      if not skip then
        out[#out + 1] = ("%s: %s: %s"):format(c.tool, e.path ~= "" and e.path or "arguments", e.message)
      end
    end
  end
  return out
end

--------------------------------------------------------------------------------------------
-- The check

---@class SkillProblem
---@field level string   "error" or "warning"
---@field file string    the skill's file ("SKILL.md")
---@field line integer|nil
---@field message string

local NAME_PATTERN = "^[a-z0-9]+$"

local function valid_name(n)
  if n:find("%-%-") or n:sub(1, 1) == "-" or n:sub(-1) == "-" then return false end
  return n:gsub("%-", ""):match(NAME_PATTERN) ~= nil
end

local function check_front(front, s, add)
  for _, k in ipairs(sorted_keys(front)) do
    if not FIELDS[k] then
      add("warning", 1, ("front matter: %q is not a field of the Agent Skills format (name, description, license, "
        .. "compatibility, metadata, allowed-tools); agents may ignore it"):format(tostring(k)))
    end
  end
  local name = front.name
  if type(name) ~= "string" or name == "" then
    add("error", 1, "name: required, a string")
  else
    if #name > NAME_MAX or not valid_name(name) then
      add("error", 1, ("name: %q must be 1-%d lowercase letters, digits and single inner hyphens"):format(name,
        NAME_MAX))
    end
    if name ~= s.name then
      add("error", 1, ("name: %q must be the skill's folder name, %q"):format(name, s.name))
    end
  end
  local d = front.description
  if type(d) ~= "string" or d:match("^%s*$") then
    add("error", 1, "description: required, a non-empty string saying what the skill does, when to use it and when not")
  else
    if utf8.len(d) and utf8.len(d) > DESCRIPTION_MAX then
      add("error", 1, ("description: %d characters, more than %d"):format(utf8.len(d), DESCRIPTION_MAX))
    end
    local low = d:lower()
    if not (low:find("not for") or low:find("do not use") or low:find("don't use") or low:find("not when")) then
      add("warning", 1, "description: say when not to use the skill too (\"Not for …\"), so an agent does not "
        .. "pick it for the wrong task")
    end
  end
  if front.license ~= nil and type(front.license) ~= "string" then add("error", 1, "license: must be a string") end
  if front.compatibility ~= nil and (type(front.compatibility) ~= "string" or #front.compatibility < 1
      or utf8.len(front.compatibility) > COMPATIBILITY_MAX) then
    add("error", 1, ("compatibility: must be a string of 1-%d characters"):format(COMPATIBILITY_MAX))
  end
  if front.metadata ~= nil then
    if type(front.metadata) ~= "table" then
      add("error", 1, "metadata: must be a mapping of strings to strings")
    else
      for k, v in pairs(front.metadata) do
        if type(k) ~= "string" or type(v) ~= "string" then
          add("error", 1, ("metadata.%s: must map a string to a string (quote numbers and booleans)"):format(
            tostring(k)))
        end
      end
    end
  end
  if front["allowed-tools"] ~= nil and type(front["allowed-tools"]) ~= "string" then
    add("error", 1, "allowed-tools: must be a string (tool names separated by spaces)")
  end
end

-- The sections of the body: lower-cased "## " heading -> {line, text}
local function sections(doc)
  local out = {}
  local cur
  local n = 0
  local in_fence = false
  for line in (doc.body .. "\n"):gmatch("([^\n]*)\n") do
    if line:match("^%s*```") or line:match("^%s*~~~") then in_fence = not in_fence end
    local h = not in_fence and line:match("^##%s+(.-)%s*$")
    if h then
      cur = { line = doc.body_line + n, lines = {} }
      out[h:lower()] = cur
    elseif cur then
      cur.lines[#cur.lines + 1] = line
    end
    n = n + 1
  end
  for _, sec in pairs(out) do sec.text = table.concat(sec.lines, "\n") end
  return out
end

local function check_links(doc, s, add)
  local n = 0
  for line in (doc.body .. "\n"):gmatch("([^\n]*)\n") do
    for target in line:gmatch("%]%(([^)%s]+)[^)]*%)") do
      local rel = target:gsub("#.*$", "")
      if rel ~= "" and not rel:match("^%a[%w+.-]*:") and not rel:match("^/") then
        rel = rel:gsub("^%./", "")
        if not s.files[rel] then
          add("error", doc.body_line + n, ("link to %s: no such file in the skill's folder"):format(target))
        end
      end
    end
    n = n + 1
  end
end

local SPAWNING = { sandbox_script = true, sandbox_create = true, sandbox_agent = true, sandbox_research = true }

--- Checks one skill against the live tools. Returns its problems (errors and warnings),
--- sorted by line, and the parsed document (nil when SKILL.md could not be read).
---@param s Skill
---@param surf SkillSurfaces
---@return SkillProblem[] problems, SkillDoc|nil doc
function skills.check(s, surf)
  local problems = {}
  local function add(level, line, msg, file)
    problems[#problems + 1] = { level = level, file = file or "SKILL.md", line = line, message = msg }
  end
  local text, rerr = skills.read(s, "SKILL.md")
  if not text then
    add("error", nil, rerr)
    return problems
  end
  local doc, perr = skills.parse(text)
  if not doc then
    add("error", tonumber(perr:match("^line (%d+)")) or tonumber(perr:match("line (%d+)")), perr)
    return problems
  end
  check_front(doc.front, s, add)

  local secs = sections(doc)
  if not secs["procedure"] then
    add("error", nil, "no '## Procedure' section: the steps the skill has an agent take")
  end
  local contract = secs["output contract"]
  if not contract then
    add("error", nil, "no '## Output contract' section: the files the run leaves under /out")
  elseif not contract.text:find("/out/", 1, true) then
    add("error", contract.line, "the output contract names no file under /out/")
  end
  check_links(doc, s, add)

  local where = { host = "the host tools", child = "the tools a sandbox sees" }
  local names = {}
  for _, c in ipairs(skills.calls(doc)) do
    if c.error then
      add("error", c.line, c.error)
    else
      local reg = surf[c.surface]
      if not reg then
        add("error", c.line, ("%s: this demesne offers no tools inside sandboxes (nested sandboxes), so a "
          .. "```call child block cannot be checked"):format(c.tool))
      else
        for _, m in ipairs(skills.check_call(c, reg, where[c.surface])) do add("error", c.line, m) end
      end
      local nm = c.args and c.args.name
      if c.surface == "child" and SPAWNING[c.tool] and type(nm) == "string" and not nm:find("<", 1, true) then
        if names[nm] then
          add("error", c.line, ("%s: the child name %q is already used on line %d; a child's name is unique in "
            .. "its parent for the parent's life (a retry takes a new name)"):format(c.tool, nm, names[nm]))
        else
          names[nm] = c.line
        end
      end
    end
  end

  for _, m in ipairs(skills.mentions(doc)) do
    local regs = {}
    if m.child then
      regs[1] = surf.child
    else
      regs[1], regs[2] = surf.child, surf.host
    end
    local d
    for _, r in ipairs(regs) do d = d or (r and r:get(m.tool)) end
    if not d then
      if m.child and not surf.child then
        add("error", m.line, ("mcp__demesne__%s: this demesne offers no tools inside sandboxes"):format(m.tool))
      else
        add("error", m.line, ("%s%s: no such tool"):format(m.child and "mcp__demesne__" or "", m.tool))
      end
    elseif m.params then
      for _, p in ipairs(m.params) do
        local found = false
        for _, r in ipairs(regs) do
          local t = r and r:get(m.tool)
          if t and (t.inputSchema.properties or {})[p] then found = true end
        end
        if not found then
          add("error", m.line, ("%s(%s): no parameter %q (it takes %s)"):format(m.tool, p, p,
            table.concat(sorted_keys(d.inputSchema.properties), ", ")))
        end
      end
    end
  end

  if s.too_many then
    add("error", nil, ("the skill's folder holds more than %d files or folders deeper than %d: a skill is "
      .. "instructions and a few resources"):format(skills.MAX_FILES, MAX_DEPTH))
  end
  for rel in pairs(s.files) do
    if rel ~= "SKILL.md" then
      local _, err = skills.read(s, rel)
      if err then add("error", nil, err, rel) end
    end
  end

  table.sort(problems, function(a, b)
    if (a.line or 0) ~= (b.line or 0) then return (a.line or 0) < (b.line or 0) end
    return a.message < b.message
  end)
  return problems, doc
end

--- The front matter of a skill for listing: {name, description} (description "" when it
--- cannot be read), or nil and why.
---@param s Skill
---@return table|nil, string|nil err
function skills.summary(s)
  local text, err = skills.read(s, "SKILL.md")
  if not text then return nil, err end
  local doc, perr = skills.parse(text)
  if not doc then return nil, perr end
  local d = doc.front.description
  return { name = doc.front.name, description = type(d) == "string" and d or "" }
end

--------------------------------------------------------------------------------------------
-- Installing into the agents' skill folders

local function hex(n)
  local b = loop.random(n) or tostring(loop.hrtime())
  return (b:gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

local function home() return os.getenv("HOME") or "/root" end

--- Claude Code's user skill folder: $CLAUDE_CONFIG_DIR/skills, else ~/.claude/skills.
---@return string
function skills.claude_dir()
  local d = os.getenv("CLAUDE_CONFIG_DIR")
  if d and d ~= "" then return d .. "/skills" end
  return home() .. "/.claude/skills"
end

--- Codex's user skill folder: ~/.agents/skills (Codex reads it and follows links there; its
--- older $CODEX_HOME/skills is deprecated).
---@return string
function skills.codex_dir() return home() .. "/.agents/skills" end

--- Writes a skill's files to `root`/<name>, replacing what is there only when it differs
--- (written to a new folder beside it, then swapped in by rename). For the embedded skills,
--- which agents must read from disk.
---@param s Skill
---@param root string
---@return string|nil folder, string how_or_err  "written" | "unchanged", or why it failed
function skills.materialize(s, root)
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
    ok, err = fs.mkdir_p((tmp .. "/" .. rel):match("^(.*)/[^/]+$"))
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

--- Links `target`/`name` to the folder `src`. A link that already points there is left
--- as it is; a link demesne made (one pointing under a folder of `ours`) is replaced;
--- anything else (a folder, a file, someone else's link) is left alone and refused.
---@param target string  the agent's skill folder (must exist)
---@param name string
---@param src string     the skill's folder
---@param ours string[]  folders whose links demesne may replace
---@return string|nil how, string|nil err  "linked" | "relinked" | "unchanged"
function skills.link(target, name, src, ours)
  local path = target .. "/" .. name
  local st = fs.lstat(path)
  if st and st.type == "link" then
    local cur = fs.readlink(path)
    if cur == src then return "unchanged" end
    local mine = false
    for _, d in ipairs(ours) do if cur and under(cur, d) then mine = true end end
    if not mine then
      return nil, ("%s is a link to %s, not demesne's: left alone (remove it to install this skill)"):format(path,
        tostring(cur))
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

--- Installs skills into agents' skill folders: each skill that passes the check is linked as
--- `<target>/<name>`; an embedded skill is first written to skills.data_dir(). Links to
--- the data folder for skills demesne no longer has are removed. Safe to run again: what
--- is already in place is left as it is.
---@param list Skill[]
---@param surf SkillSurfaces
---@param targets string[]  the agents' skill folders
---@param say fun(line: string)  one line per thing done or refused
---@return boolean ok  false when a skill was skipped or a link refused
function skills.install(list, surf, targets, say)
  local data = skills.data_dir()
  local user = skills.user_dir()
  local ours = { data, user, fs.realpath(user) or user }
  local good = true
  local sources = {}
  for _, s in ipairs(list) do
    local bad = 0
    for _, p in ipairs(skills.check(s, surf)) do if p.level == "error" then bad = bad + 1 end end
    if bad > 0 then
      say(("skipped  %s: it fails `demesne skills check` (%d error(s)); fix it first"):format(s.name, bad))
      good = false
    elseif s.dir then
      sources[#sources + 1] = { name = s.name, src = fs.realpath(s.dir) or s.dir }
    else
      local dest, how = skills.materialize(s, data)
      if not dest then
        say(("failed   %s: cannot write it to %s: %s"):format(s.name, data, tostring(how)))
        good = false
      else
        if how == "written" then say(("wrote    %s to %s"):format(s.name, dest)) end
        sources[#sources + 1] = { name = s.name, src = dest }
      end
    end
  end
  local wanted = {}
  for _, x in ipairs(sources) do wanted[x.name] = true end
  for _, dir in ipairs(targets) do
    dir = dir:gsub("/+$", "")
    local ok, err = fs.mkdir_p(dir)
    if not ok then
      say(("failed   %s: %s"):format(dir, err))
      good = false
    else
      local counts = { linked = 0, relinked = 0, unchanged = 0 }
      for _, x in ipairs(sources) do
        local how, lerr = skills.link(dir, x.name, x.src, ours)
        if how then
          counts[how] = counts[how] + 1
          if how ~= "unchanged" then say(("%-8s %s/%s -> %s"):format(how, dir, x.name, x.src)) end
        else
          say("refused  " .. lerr)
          good = false
        end
      end
      for _, n in ipairs(fs.readdir(dir) or {}) do
        local p = dir .. "/" .. n
        local st = fs.lstat(p)
        local cur = st and st.type == "link" and fs.readlink(p)
        if cur and under(cur, data) and not wanted[n] and fs.unlink(p) then
          say(("removed  %s (demesne no longer has this skill)"):format(p))
        end
      end
      say(("%s: %d skill(s) linked, %d relinked, %d already in place"):format(dir, counts.linked, counts.relinked,
        counts.unchanged))
    end
  end
  return good
end

return skills
