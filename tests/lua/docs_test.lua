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

return tests
