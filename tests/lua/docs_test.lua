-- Every Lua-visible C binding has a heading in docs/reference/lua-api.md (luv's docscov).
--
-- Module functions are `### core.<module>.<function>`; methods of a userdata are
-- `### <metatable name>:<method>` (`### core.stream:read_start`, `### core.fs.file:read`).
-- The modules are every `core.*` entry of package.preload, and the methods those of every
-- `core.*` metatable in the registry that has an __index table, so a new binding or method
-- fails this test until it is documented. Non-function fields (core.json.null,
-- core.loop.version) need no heading.

local DOC = "docs/reference/lua-api.md"

-- The source root: $DEMESNE_SOURCE_DIR (ctest sets it), else two folders above this file.
local function source_root()
  local dir = os.getenv("DEMESNE_SOURCE_DIR")
  if dir and dir ~= "" then return dir end
  local here = debug.getinfo(1, "S").source:match("^@(.*)$") or ""
  local root = here:match("^(.*)/tests/lua/[^/]+$")
  if root then return root == "" and "/" or root end
  return "."
end

-- The set of `### name` headings in the doc (backticks stripped).
local function headings()
  local path = source_root() .. "/" .. DOC
  local f, err = io.open(path, "r")
  if not f then error(("cannot read %s: %s"):format(path, tostring(err)), 0) end
  local set = {}
  for line in f:lines() do
    local name = line:match("^###%s+`?([%w_%.:]+)`?%s*$")
    if name then set[name] = true end
  end
  f:close()
  return set
end

-- Every binding: {name = "core.x.f" | "core.x:m", ...}, sorted.
local function bindings()
  local names = {}
  local modules = {}
  for name in pairs(package.preload) do
    if type(name) == "string" and name:match("^core%.") then modules[#modules + 1] = name end
  end
  table.sort(modules)
  for _, mod in ipairs(modules) do
    local m = require(mod)
    if type(m) == "table" then
      for k, v in pairs(m) do
        if type(v) == "function" then names[#names + 1] = mod .. "." .. k end
      end
    end
  end
  -- metatables are registered by the luaopen_* functions run by require above
  for key, mt in pairs(debug.getregistry()) do
    if type(key) == "string" and key:match("^core%.") and type(mt) == "table" and type(mt.__index) == "table" then
      for k, v in pairs(mt.__index) do
        if type(v) == "function" then names[#names + 1] = key .. ":" .. k end
      end
    end
  end
  table.sort(names)
  return names, modules
end

local tests = {}

function tests.every_binding_has_a_heading(t)
  local doc = headings()
  local names, modules = bindings()
  t:ok(#modules >= 10, "found the core.* modules in package.preload")
  t:ok(#names > 50, "found the bindings")
  local missing = {}
  for _, n in ipairs(names) do
    if not doc[n] then missing[#missing + 1] = n end
  end
  if #missing > 0 then
    error(("%d binding(s) have no `### <name>` heading in %s:\n  %s"):format(#missing, DOC,
      table.concat(missing, "\n  ")), 0)
  end
end

function tests.methods_of_live_handles_are_covered(t)
  -- the metatable a handle really carries is the one the registry walk documents
  local timer = require("core.timer").new()
  local mt = getmetatable(timer)
  timer:close()
  t:eq(mt, debug.getregistry()["core.timer"], "a timer's metatable is core.timer")
  local doc = headings()
  for _, m in ipairs({ "start", "stop", "close" }) do
    t:ok(doc["core.timer:" .. m], "core.timer:" .. m .. " documented")
  end
end

function tests.every_core_heading_names_a_binding(t)
  local names = bindings()
  local live = {}
  for _, n in ipairs(names) do live[n] = true end
  local stale = {}
  for h in pairs(headings()) do
    if h:match("^core%.") and not live[h] then stale[#stale + 1] = h end
  end
  table.sort(stale)
  if #stale > 0 then
    error(("%d heading(s) in %s name no binding (renamed or removed?):\n  %s"):format(#stale, DOC,
      table.concat(stale, "\n  ")), 0)
  end
  t:ok(true)
end

-- Worked examples marked `<!-- tested copy: tests/fixtures/<path> -->` in the reference are
-- the fixture files the tests run, byte for byte (the providers' are checked in
-- providers_test).
function tests.engine_adapter_example_is_the_tested_fixture(t)
  local root = source_root()
  local function read(p)
    local f = assert(io.open(root .. "/" .. p, "r"))
    local s = f:read("a")
    f:close()
    return s
  end
  local doc = read("docs/reference/engines.md")
  local marker = "<!-- tested copy: tests/fixtures/engines/recording.lua -->"
  local at = doc:find(marker, 1, true)
  t:ok(at, "engines.md marks the example")
  t:eq(doc:match("```lua\n(.-)```", at), read("tests/fixtures/engines/recording.lua"))
end

-- The man page (docs/man/demesne.1, installed as demesne(1)) is written by hand: it must
-- name every command and option of docs/reference/cli.md's usage block, every setting
-- that has an environment variable, and the binary's version.
local function man_page_text(root)
  local f = assert(io.open(root .. "/docs/man/demesne.1", "r"))
  local s = f:read("a")
  f:close()
  -- roff to plain words: \- is a hyphen, \fX font changes and quotes go
  return (s:gsub("\\%-", "-"):gsub("\\f[BIRP]", ""):gsub('"', ""))
end

function tests.man_page_follows_the_cli_reference(t)
  local root = source_root()
  local man = man_page_text(root)
  local items = {} -- the first line after each .TP, without its macro
  for item in man:gmatch("\n%.TP\n%.?%a*%s*([^\n]*)") do items[#items + 1] = " " .. item .. " " end
  local f = assert(io.open(root .. "/docs/reference/cli.md", "r"))
  local cli = f:read("a")
  f:close()
  local usage = assert(cli:match("```\n(.-)```"), "cli.md starts with a usage block")
  local names, missing = {}, {}
  for line in usage:gmatch("[^\n]+") do
    -- "  images build [NAME] build …" -> "images build"; "  --help, -h  show …" -> "--help"
    local synopsis = line:match("^  (%S.-)%s%s") or line:match("^  (%S.*)$")
    local words
    for w in (synopsis or ""):gmatch("%S+") do
      w = w:gsub(",$", "")
      if not w:match("^%-?%-?%l[%l%-]*$") then break end
      words = words and (words .. " " .. w) or w
      if w:sub(1, 1) == "-" then break end -- "--help, -h": the long name is enough
    end
    if words then
      names[#names + 1] = words
      local found = false
      for _, it in ipairs(items) do
        if it:find(" " .. words .. " ", 1, true) then found = true break end
      end
      if not found then missing[#missing + 1] = words end
    end
  end
  -- the options table: | `--source-dir DIR` | where | meaning |
  for opt in cli:match("\n## Options\n(.-)\n## "):gmatch("\n| `(%-%-[%l%-]+)") do
    names[#names + 1] = opt
    local found = false
    for _, it in ipairs(items) do
      if it:find(" " .. opt .. " ", 1, true) then found = true break end
    end
    if not found then missing[#missing + 1] = opt end
  end
  t:ok(#names >= 14, "read the commands and options of cli.md (" .. table.concat(names, ", ") .. ")")
  t:eq(missing, {}, "commands and options of cli.md with no .TP item in demesne.1")
  local config = require("demesne.config")
  local vars = {}
  for _, d in pairs(config.describe()) do
    if d.env and not man:find(d.env, 1, true) then vars[#vars + 1] = d.env end
  end
  table.sort(vars)
  t:eq(vars, {}, "setting variables demesne.1 does not name")
  local version = man:match("\n%.TH DEMESNE 1 %S+ demesne (%S+)")
  t:eq(version, require("core.loop").version, "the version in demesne.1's .TH line")
end

return tests
