-- docs/reference/runtime-api.md documents exactly the runtime API plugin files reach
-- (lua/tools/api.lua, providers.API, policy.API): every name has a `### demesne.<module>.<name>`
-- heading, every such heading names a name of the API, each kind's row in the table lists
-- its modules, and every name exists on its module.
local policy = require("demesne.egress.policy")
local providers = require("demesne.providers")
local tools = require("demesne.tools")
local tool_api = require("demesne.tools.api")

local DOC = "docs/reference/runtime-api.md"

local function source_root()
  local dir = os.getenv("DEMESNE_SOURCE_DIR")
  if dir and dir ~= "" then return dir end
  local here = debug.getinfo(1, "S").source:match("^@(.*)$") or ""
  return here:match("^(.*)/tests/lua/[^/]+$") or "."
end

local function read_doc()
  local f = assert(io.open(source_root() .. "/" .. DOC, "r"))
  local s = f:read("a")
  f:close()
  return s
end

local APIS = { tool = tool_api, provider = providers.API, policy = policy.API }

local tests = {}

function tests.every_name_of_the_api_has_a_heading_and_every_heading_a_name(t)
  local doc = read_doc()
  local headings = {}
  for name in doc:gmatch("\n###%s+`?(demesne%.[%w_%.]+)`?%s*\n") do headings[name] = true end
  local names = {}
  for _, api in pairs(APIS) do
    for mod, list in pairs(api) do
      for _, n in ipairs(list) do names[mod .. "." .. n] = true end
    end
  end
  local missing, stale = {}, {}
  for n in pairs(names) do if not headings[n] then missing[#missing + 1] = n end end
  for h in pairs(headings) do if not names[h] then stale[#stale + 1] = h end end
  table.sort(missing)
  table.sort(stale)
  t:ok(next(names) ~= nil and next(headings) ~= nil, "found the API and the headings")
  t:eq(missing, {}, "API names without a heading in " .. DOC)
  t:eq(stale, {}, "headings in " .. DOC .. " that name nothing of the API")
end

function tests.each_kind_lists_its_modules(t)
  local doc = read_doc()
  for kind, api in pairs(APIS) do
    local row = doc:match("\n| " .. kind .. " | [^\n]*")
    t:ok(row, "a table row for " .. kind)
    local listed = {}
    for m in row:gmatch("`(demesne%.[%w_%.]+)`") do listed[#listed + 1] = m end
    local want = {}
    for m in pairs(api) do want[#want + 1] = m end
    table.sort(listed)
    table.sort(want)
    t:eq(listed, want, kind .. "'s modules")
  end
end

function tests.every_name_resolves_in_its_kind_environment(t)
  local envs = { tool = tools.environment("t.lua"), provider = providers.environment("p.lua"),
    policy = policy.environment("q.lua") }
  for kind, api in pairs(APIS) do
    for mod, list in pairs(api) do
      local m = envs[kind].require(mod) -- raises when a listed name is missing on the module
      for _, n in ipairs(list) do t:ok(m[n] ~= nil, ("%s: %s.%s"):format(kind, mod, n)) end
    end
  end
end

function tests.policy_and_provider_files_reach_no_sandbox(t)
  for _, env in ipairs({ providers.environment("p.lua"), policy.environment("q.lua") }) do
    for _, mod in ipairs({ "demesne.sandbox", "demesne.jobs", "demesne.engines", "core.http" }) do
      local ok = pcall(env.require, mod)
      t:eq(ok, false, mod)
    end
  end
end

return tests
