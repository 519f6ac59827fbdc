-- The tool loader: descriptor checks, override order, the restricted environment, and the
-- result conventions of tools.call.
local async = require("demesne.async")
local fs = require("core.fs")
local json = require("demesne.json")
local loop = require("core.loop")
local tools = require("demesne.tools")

local tests = {}

local function tmpdir()
  local dir = ("/tmp/demesne-tools-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  assert(fs.mkdir_p(dir))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

local function write(dir, name, src)
  local f = assert(io.open(dir .. "/" .. name, "w"))
  f:write(src)
  f:close()
end

local GOOD = [[
return {
  name = %q,
  title = "T",
  description = "d",
  inputSchema = { type = "object", properties = {} },
  run = function(ctx, args) return { from = %q } end,
}
]]

local function load(dir, user)
  return tools.load({ builtin = false, user_dir = user or false, fixtures = dir, quiet = true })
end

function tests.loads_tools_and_records_their_origin(t)
  local d <close> = tmpdir()
  write(d.path, "a.lua", GOOD:format("alpha", "a"))
  write(d.path, "b.lua", GOOD:format("beta", "b"))
  write(d.path, "notes.txt", "not a tool")
  local reg = load(d.path)
  local names = {}
  for _, x in ipairs(reg:list()) do names[#names + 1] = x.name end
  t:eq(names, { "alpha", "beta" })
  t:eq(reg:get("alpha").origin, d.path .. "/a.lua")
  t:eq(#reg.errors, 0)
end

function tests.later_folder_overrides_same_name(t)
  local user <close> = tmpdir()
  local fix <close> = tmpdir()
  write(user.path, "x.lua", GOOD:format("same", "user"))
  write(fix.path, "y.lua", GOOD:format("same", "fixtures"))
  local reg = load(fix.path, user.path)
  t:eq(#reg:list(), 1)
  t:eq(reg:get("same").origin, fix.path .. "/y.lua")
end

function tests.bad_descriptors_are_refused_naming_file_and_field(t)
  local d <close> = tmpdir()
  write(d.path, "ok.lua", GOOD:format("fine", "x"))
  write(d.path, "badname.lua", GOOD:format("has space", "x"))
  write(d.path, "longname.lua", GOOD:format(("n"):rep(129), "x"))
  write(d.path, "noschema.lua", [[return { name = "a", description = "d", run = function() end }]])
  write(d.path, "arrayschema.lua",
    [[return { name = "a", description = "d", inputSchema = { type = "array" }, run = function() end }]])
  write(d.path, "badprop.lua", [[return { name = "a", description = "d",
    inputSchema = { type = "object", properties = { x = { type = "strng" } } }, run = function() end }]])
  write(d.path, "norun.lua", [[return { name = "a", description = "d", inputSchema = { type = "object" } }]])
  write(d.path, "hint.lua", [[return { name = "a", description = "d", inputSchema = { type = "object" },
    annotations = { readOnlyHint = "yes" }, run = function() end }]])
  write(d.path, "syntax.lua", [[return {]])
  write(d.path, "raises.lua", [[error("boom at load")]])
  write(d.path, "nothing.lua", [[local x = 1]])
  local reg = load(d.path)
  t:eq(#reg:list(), 1, "the good one still loads")
  local by = {}
  for _, e in ipairs(reg.errors) do by[e.origin:match("[^/]+$")] = e.message end
  t:match(by["badname.lua"], "badname%.lua: name:")
  t:match(by["longname.lua"], "name: .*1%-128")
  t:match(by["noschema.lua"], "noschema%.lua: inputSchema: must be a table")
  t:match(by["arrayschema.lua"], 'inputSchema%.type: must be "object"')
  t:match(by["badprop.lua"], 'inputSchema%.properties%.x%.type: unknown type "strng"')
  t:match(by["norun.lua"], "run: must be a function")
  t:match(by["hint.lua"], "annotations%.readOnlyHint: must be a boolean")
  t:match(by["syntax.lua"], "syntax%.lua")
  t:match(by["raises.lua"], "boom at load")
  t:match(by["nothing.lua"], "must return a descriptor table")
end

function tests.tool_environment_refuses_core_bindings(t)
  local env = tools.environment("test")
  local ok, err = pcall(env.require, "core.stream")
  t:eq(ok, false)
  t:match(err, "core%.%* bindings are not available to tools")
  ok, err = pcall(env.require, "socket")
  t:eq(ok, false)
  t:match(err, "not available to tools")
  t:eq(env.require("demesne.json").encode, json.encode, "the runtime API's functions are the runtime's")
  t:eq(env.require("string").format, string.format)
  t:eq(env.os.execute, nil)
  t:eq(env.os.exit, nil)
  t:eq(env.os.remove, nil)
  t:eq(env.os.rename, nil)
  t:eq(env.require("os").execute, nil)
  t:ok(env.os.time and env.os.getenv, "os.time and os.getenv stay")
  t:eq(env.io.popen, nil)
  t:eq(env.io.write, nil, "stdout carries only the protocol")
  t:eq(env.debug, nil)
  t:eq(env.package, nil)
  t:eq(env.dofile, nil)
  t:eq(env.coroutine, nil)
  -- load() defaults to the tool's environment, never the real globals
  local f = env.load("return require")
  t:eq(f(), env.require)
  ok = pcall(env.load, "return 1", "x", "b")
  t:eq(ok, false, "binary chunks are refused")
end

-- The runtime API is all a tool reaches: not the engine adapter, not the raw bindings, not
-- the internals of the modules it may use (docs/reference/runtime-api.md).
function tests.tool_environment_reaches_only_the_runtime_api(t)
  local env = tools.environment("test")
  for _, name in ipairs({ "demesne.engines", "demesne.engines.docker", "demesne.egress", "demesne.vendor",
    "demesne.providers", "demesne.plugins", "demesne.runtime", "demesne.mcp.server", "demesne.images", "demesne" }) do
    local ok, err = pcall(env.require, name)
    t:eq(ok, false, name .. " is refused")
    t:match(err, "not available to tools", name)
  end
  local sandbox = env.require("demesne.sandbox")
  t:eq(type(sandbox.run_script), "function", "sandbox.run_script is in the API")
  for _, internal in ipairs({ "engine", "script_prepare", "script_start", "prepare", "reap", "lookup", "fail" }) do
    t:eq(sandbox[internal], nil, "sandbox." .. internal .. " is not")
  end
  local ok, err = pcall(function() sandbox.engine = function() end end)
  t:eq(ok, false, "a runtime module is read-only")
  t:match(err, "read%-only")
  t:eq(getmetatable(sandbox), "read-only", "and its metatable is out of reach")
  t:eq(env.require("demesne.jobs").launch, nil, "jobs.launch is not in the API")
  t:eq(env.require("demesne.tools").fail, require("demesne.errors").new, "tools.fail is errors.new")
end

function tests.tool_file_cannot_reach_the_engine(t)
  local d <close> = tmpdir()
  write(d.path, "engine.lua", [[
local engines = require("demesne.engines")
return { name = "engine", description = "d", inputSchema = { type = "object" }, run = function() end }]])
  local reg = load(d.path)
  t:eq(#reg:list(), 0)
  t:match(reg.errors[1].message, "engine%.lua:.*require%(\"demesne%.engines\"%): module not available to tools")
end

function tests.tool_file_cannot_reach_core_through_require(t)
  local d <close> = tmpdir()
  write(d.path, "sneaky.lua", [[
local stream = require("core.stream")
return { name = "sneaky", description = "d", inputSchema = { type = "object" }, run = function() end }]])
  local reg = load(d.path)
  t:eq(#reg:list(), 0)
  t:match(reg.errors[1].message, "sneaky%.lua:.*not allowed in a tool")
end

function tests.builtin_tools_load_cleanly(t)
  local reg = tools.load({ user_dir = false, quiet = true })
  for _, e in ipairs(reg.errors) do error("built-in tool refused: " .. e.message) end
  local names = {}
  for _, d in ipairs(reg:list()) do
    t:match(d.name, "^[A-Za-z0-9_.-]+$")
    t:match(d.origin, "tools/" .. d.name .. "%.lua$", "each descriptor lives in tools/, in a file of its name")
    names[#names + 1] = d.name
  end
  t:eq(names, { "sandbox_agent", "sandbox_cancel", "sandbox_create", "sandbox_destroy", "sandbox_download",
    "sandbox_exec", "sandbox_expose", "sandbox_fork", "sandbox_jobs", "sandbox_list", "sandbox_pause", "sandbox_research",
    "sandbox_resume", "sandbox_script", "sandbox_snapshot", "sandbox_snapshot_delete", "sandbox_snapshots",
    "sandbox_status", "sandbox_upload", "sandbox_usage_report", "sandbox_wait" })
end

function tests.fixture_tools_load_cleanly(t)
  local src = require("demesne.runtime").source_dir or os.getenv("DEMESNE_SOURCE_DIR") or "."
  local reg = tools.load({ builtin = false, user_dir = false, fixtures = src .. "/tests/fixtures/tools", quiet = true })
  for _, e in ipairs(reg.errors) do error("fixture refused: " .. e.message) end
  for _, name in ipairs({ "test_simple_text", "test_image_content", "test_audio_content", "test_embedded_resource",
    "test_multiple_content_types", "test_tool_with_logging", "test_error_handling", "test_tool_with_progress",
    "test_sampling", "test_elicitation", "fixture_sleep", "fixture_echo", "fixture_progress" }) do
    t:ok(reg:get(name), name .. " loaded")
  end
end

local function ctx()
  return { request_id = 1, progress = function() return false end, log = function() end,
    is_cancelled = function() return false end }
end

function tests.return_conventions(t)
  local function run_with(fn)
    return tools.call({ name = "x", description = "d", inputSchema = { type = "object" }, run = fn }, ctx(), {})
  end
  local r = run_with(function() return { a = 1 } end)
  t:eq(r.structuredContent, { a = 1 })
  t:eq(r.content, { { type = "text", text = '{"a":1}' } })
  r = run_with(function() return { a = 1 }, "A is one" end)
  t:eq(r.content[1].text, "A is one")
  t:eq(r.structuredContent, { a = 1 })
  r = run_with(function() return "plain" end)
  t:eq(r.content[1].text, "plain")
  t:eq(r.structuredContent, nil)
  r = run_with(function() return { content = { { type = "text", text = "raw" } }, isError = true } end)
  t:eq(r.isError, true)
  t:eq(r.content[1].text, "raw")
  r = run_with(function() return { f = function() end } end)
  t:eq(r.isError, true)
  t:match(r.content[1].text, "cannot be encoded as JSON")
end

function tests.defaults_reach_run_and_args_are_a_copy(t)
  local seen
  local args = { a = "x" }
  tools.call({ name = "x", description = "d", run = function(_, a) seen = a; a.mutated = true; return {} end,
    inputSchema = { type = "object", properties = { a = { type = "string" }, n = { type = "integer", default = 3 } } } },
    ctx(), args)
  t:eq(seen.n, 3)
  t:eq(args.n, nil)
  t:eq(args.mutated, nil)
end

function tests.cancellation_propagates_out_of_call(t)
  local task = async.spawn("call", function()
    return tools.call({ name = "x", description = "d", inputSchema = { type = "object" },
      run = function() async.sleep(60000) end }, ctx(), {})
  end)
  async.cancel(task, "test")
  local ok, err = task:wait()
  t:eq(ok, false)
  t:eq(err, async.CANCELLED)
end

return tests
