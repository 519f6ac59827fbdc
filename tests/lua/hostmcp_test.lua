-- Host MCP servers (lua/hostmcp, lua/mcp/client.lua) against REAL MCP servers from the npm
-- registry, installed by tests/integration's package.json (npm ci):
-- @modelcontextprotocol/server-everything (stdio, and Streamable HTTP on loopback) and
-- @modelcontextprotocol/server-memory (stdio). They run offline. Each test writes its own
-- config.lua (XDG_CONFIG_HOME in a temporary folder), and stops every upstream at its end.
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local programs = require("demesne.proc")
local hostmcp = require("demesne.hostmcp")
local proxy = require("demesne.hostmcp.proxy")
local demesne_tools = require("demesne.tools")
local client = require("demesne.mcp.client")
local fs = require("core.fs")
local loop = require("core.loop")
local process = require("core.process")
local stream = require("core.stream")
local timer = require("core.timer")

local tests = {}

local SRC = os.getenv("DEMESNE_SOURCE_DIR") or "."
local MODULES = SRC .. "/tests/integration/node_modules/@modelcontextprotocol"
local EVERYTHING = MODULES .. "/server-everything/dist/index.js"
local MEMORY = MODULES .. "/server-memory/dist/index.js"

local function need_servers()
  for _, p in ipairs({ EVERYTHING, MEMORY }) do
    if not fs.stat(p) then
      error(p .. " is missing: run `npm ci` in tests/integration (the real MCP servers these tests use)", 0)
    end
  end
end

local function hex(n) return (loop.random(n):gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- Lua source for a value (config.lua is Lua).
local function lua_value(v, indent)
  indent = indent or ""
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) ~= "table" then return tostring(v) end
  local parts = {}
  if #v > 0 then
    for _, x in ipairs(v) do parts[#parts + 1] = lua_value(x, indent .. "  ") end
    return "{ " .. table.concat(parts, ", ") .. " }"
  end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    parts[#parts + 1] = indent .. "  [" .. ("%q"):format(k) .. "] = " .. lua_value(v[k], indent .. "  ")
  end
  return "{\n" .. table.concat(parts, ",\n") .. "\n" .. indent .. "}"
end

-- Runs fn(dir) with a fresh configuration: `cfg` becomes config.lua, `env` are set. Every
-- upstream is stopped and the environment restored afterwards, whatever happens.
local function with_config(cfg, env, fn)
  need_servers()
  local dir = "/tmp/demesne-hostmcp-test-" .. hex(6)
  assert(fs.mkdir_p(dir .. "/xdg/demesne"))
  local text = ("return " .. lua_value(cfg) .. "\n"):gsub("%$DIR", dir)
  assert(fs.write_atomic(dir .. "/xdg/demesne/config.lua", text))
  local vars = { XDG_CONFIG_HOME = dir .. "/xdg", DEMESNE_STATE_DIR = dir .. "/state" }
  for k, v in pairs(env or {}) do vars[k] = v end
  local saved = {}
  for k, v in pairs(vars) do
    saved[k] = os.getenv(k) or false
    loop.setenv(k, v ~= false and v:gsub("%$DIR", dir) or nil)
  end
  config.load()
  hostmcp.shutdown()
  local ok, err = xpcall(fn, debug.traceback, dir)
  hostmcp.shutdown()
  for k, v in pairs(saved) do loop.setenv(k, v or nil) end
  config.load()
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

local function everything(tools, extra)
  local e = { command = "node", args = { EVERYTHING, "stdio" }, tools = tools }
  for k, v in pairs(extra or {}) do e[k] = v end
  return e
end

local function names_of(list)
  local out = {}
  for _, t in ipairs(list) do out[#out + 1] = t.name end
  table.sort(out)
  return out
end

local function text_of(res)
  local parts = {}
  for _, c in ipairs(res.content or {}) do if c.type == "text" then parts[#parts + 1] = c.text end end
  return table.concat(parts, "\n")
end

-- Whether a process (by pid) still exists and is not a zombie.
local function alive(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return false end
  local s = f:read("a")
  f:close()
  local state = s:match("%) (%a)")
  return state ~= nil and state ~= "Z" and state ~= "X"
end

-- The pids of this process's children running `comm` (from /proc: a leftover is visible
-- even when demesne has lost track of it).
local function children_named(comm)
  local me, out = loop.getpid(), {}
  for _, d in ipairs(fs.readdir("/proc") or {}) do
    if d:match("^%d+$") then
      local f = io.open("/proc/" .. d .. "/stat")
      local st = f and f:read("a")
      if f then f:close() end
      local name, state, ppid = (st or ""):match("^%d+ %((.-)%) (%a) (%d+)")
      if name == comm and tonumber(ppid) == me and state ~= "Z" then out[#out + 1] = tonumber(d) end
    end
  end
  return out
end

-- The raw listing of a server, straight from a client session of our own (to compare the
-- filtered listing with).
local function raw_listing(file, args)
  local s = assert(client.spawn({ file = file, args = args, name = "raw" }))
  assert(s:initialize(20000))
  local tools = assert(s:list_tools(20000))
  s:close(2000)
  return tools
end

function tests.an_allowed_tool_is_listed_and_called_and_get_env_is_not(t)
  with_config({ host_mcp = { everything = everything({ "echo", "get-sum" }) } }, nil, function()
    local tools = assert(hostmcp.list_tools("everything"))
    t:eq(names_of(tools), { "echo", "get-sum" }, "allowed tools")
    for _, tool in ipairs(tools) do t:eq(type(tool.inputSchema), "table", tool.name .. " inputSchema") end
    local res, err = hostmcp.call("everything", "get-sum", { a = 2, b = 40 })
    t:ok(res, tostring(err))
    t:match(text_of(res), "42", "the real sum")
    res = assert(hostmcp.call("everything", "echo", { message = "hello from the host" }))
    t:match(text_of(res), "hello from the host")
    -- get-env is marked read-only, returns the host's environment, and is not allowed here
    local forged, ferr, fcode = hostmcp.call("everything", "get-env", {})
    t:eq(forged, nil, "a direct call of get-env")
    t:eq(fcode, "EPERM")
    t:match(ferr, "get%-env of host MCP server everything is not allowed")
  end)
end

-- Sleeps inside a task.
local function sleep(ms) async.sleep(ms) end

-- Runs a program to its end (inside a task); returns its exit status.
local function run(file, args)
  return async.await(function(cb)
    local proc = process.spawn({ file = file, args = args }, function(status) cb(status) end)
    if not proc then cb(127) end
  end)
end

-- Waits until pred() is true, at most `ms`; returns pred()'s last value.
local function eventually(ms, pred)
  local deadline = loop.now() + ms
  while not pred() and loop.now() < deadline do sleep(50) end
  return pred()
end

function tests.read_only_keeps_exactly_the_tools_marked_readOnlyHint(t)
  local raw_memory = raw_listing("node", { MEMORY })
  local raw_everything = raw_listing("node", { EVERYTHING, "stdio" })
  local function read_only(list)
    local out = {}
    for _, tool in ipairs(list) do
      if type(tool.annotations) == "table" and tool.annotations.readOnlyHint == true then out[#out + 1] = tool.name end
    end
    table.sort(out)
    return out
  end
  -- the raw listings hold both kinds, so the filter has something to drop
  t:eq(read_only(raw_memory), { "open_nodes", "read_graph", "search_nodes" }, "server-memory's read-only tools")
  t:ok(#raw_memory > 3, "server-memory lists write tools too")
  t:ok(#read_only(raw_everything) > 0 and #read_only(raw_everything) < #raw_everything, "server-everything has both")
  with_config({ host_mcp = {
    memory = { command = "node", args = { MEMORY }, env = { MEMORY_FILE_PATH = "$DIR/memory.jsonl" }, tools = "read-only" },
    everything = everything("read-only"),
  } }, nil, function(dir)
    local tools = assert(hostmcp.list_tools("memory"))
    t:eq(names_of(tools), read_only(raw_memory), "memory, read-only")
    t:eq(names_of(assert(hostmcp.list_tools("everything"))), read_only(raw_everything), "everything, read-only")
    t:ok(names_of(assert(hostmcp.list_tools("everything")))[1] ~= nil, "not empty")
    local res = assert(hostmcp.call("memory", "read_graph", {}))
    t:eq(res.isError, nil, "read_graph")
    local denied, _, code = hostmcp.call("memory", "create_entities",
      { entities = { { name = "x", entityType = "t", observations = {} } } })
    t:eq(denied, nil)
    t:eq(code, "EPERM", "create_entities is not read-only")
    t:eq(fs.stat(dir .. "/memory.jsonl"), nil, "nothing was written")
  end)
end

function tests.star_offers_the_whole_live_listing(t)
  local raw = raw_listing("node", { EVERYTHING, "stdio" })
  with_config({ host_mcp = { everything = everything("*") } }, nil, function()
    -- server-everything registers more tools once initialized and says so with
    -- notifications/tools/list_changed: the listing follows
    local changed = false
    local unsubscribe = hostmcp.on_tools_changed(function(name) if name == "everything" then changed = true end end)
    local first = assert(hostmcp.list_tools("everything"))
    t:ok(#first > 0)
    eventually(3000, function() return changed end)
    unsubscribe()
    t:ok(changed, "list_changed was seen")
    t:eq(names_of(assert(hostmcp.list_tools("everything"))), names_of(raw), "the whole listing")
  end)
end

function tests.servers_for_narrows_and_a_child_gets_at_most_its_parents(t)
  with_config({ host_mcp = {
    everything = everything({ "echo" }),
    memory = { command = "node", args = { MEMORY }, tools = "read-only" },
  } }, nil, function()
    t:eq(assert(hostmcp.servers_for(nil)), { "everything", "memory" }, "default: all")
    t:eq(assert(hostmcp.servers_for({ host_mcp = { "memory" } })), { "memory" })
    t:eq(assert(hostmcp.servers_for({ parent = { "memory" } })), { "memory" }, "a child inherits its parent's set")
    local none, err, code = hostmcp.servers_for({ host_mcp = { "everything" }, parent = { "memory" } })
    t:eq(none, nil)
    t:eq(code, "EINVAL")
    t:match(err, "host_mcp%[1%]: host MCP server everything is not offered to the parent run")
    none, err = hostmcp.servers_for({ host_mcp = { "nosuch" } })
    t:eq(none, nil)
    t:match(err, 'no host MCP server is named "nosuch" %(offered: everything, memory%)')
    t:eq(hostmcp.pid("everything"), nil, "nothing was started to answer")
  end)
end

function tests.an_upstream_that_crashes_mid_call_errors_and_is_restarted(t)
  with_config({ host_mcp = { everything = everything({ "trigger-long-running-operation", "get-sum" }) } }, nil, function()
    t:ok(hostmcp.call("everything", "get-sum", { a = 1, b = 1 }))
    local pid = hostmcp.pid("everything")
    t:ok(pid and alive(pid), "running")
    local call = async.spawn("long call", function()
      return hostmcp.call("everything", "trigger-long-running-operation", { duration = 20, steps = 20 })
    end)
    sleep(500)
    t:ok(not call.done, "the long call runs")
    t:eq(run("kill", { "-KILL", tostring(pid) }), 0, "kill -KILL")
    local _, res, err, code = call:wait()
    t:eq(res, nil, "the call that saw the crash")
    t:eq(code, "ECONNRESET")
    t:match(err, "killed by signal 9")
    local again = assert(hostmcp.call("everything", "get-sum", { a = 20, b = 22 }))
    t:match(text_of(again), "42", "the next call works")
    t:ok(hostmcp.pid("everything") ~= pid, "a new process")
  end)
end

function tests.an_upstream_that_never_answers_times_out_and_is_not_left_running(t)
  with_config({ host_mcp_startup_timeout_seconds = 1,
    host_mcp = { sleeper = { command = "sleep", args = { "600" }, tools = "*" } } }, nil, function()
    local t0 = loop.now()
    local tools, err, code = hostmcp.list_tools("sleeper")
    t:eq(tools, nil)
    t:eq(code, "ETIMEDOUT")
    t:match(err, "no answer to initialize within 1000 ms")
    t:ok(loop.now() - t0 < 10000, "not stuck")
    t:eq(hostmcp.pid("sleeper"), nil)
    t:ok(eventually(3000, function() return #children_named("sleep") == 0 end), "no sleep process is left")
    local res, _, ccode = hostmcp.call("sleeper", "x", {})
    t:eq(res, nil)
    t:eq(ccode, "ETIMEDOUT", "each use tries again and times out again")
    t:ok(eventually(3000, function() return #children_named("sleep") == 0 end), "still none")
  end)
end

function tests.a_stopped_upstream_times_out_is_killed_and_the_next_call_works(t)
  with_config({ host_mcp_timeout_seconds = 1, host_mcp = { everything = everything({ "get-sum" }) } }, nil, function()
    t:ok(hostmcp.call("everything", "get-sum", { a = 1, b = 2 }))
    local pid = hostmcp.pid("everything")
    t:eq(run("kill", { "-STOP", tostring(pid) }), 0, "kill -STOP")
    local t0 = loop.now()
    local res, err, code = hostmcp.call("everything", "get-sum", { a = 1, b = 2 })
    t:eq(res, nil)
    t:eq(code, "ETIMEDOUT")
    t:match(err, "no answer to tools/%a+ within 1000 ms")
    t:ok(loop.now() - t0 < 5000, "not stuck")
    -- it does not answer ping either: demesne kills it
    t:ok(eventually(5000, function() return not alive(pid) end), "the hung process is gone")
    local again = assert(hostmcp.call("everything", "get-sum", { a = 40, b = 2 }))
    t:match(text_of(again), "42")
  end)
end

function tests.an_idle_upstream_is_stopped_and_started_again_on_use(t)
  with_config({ host_mcp_idle_seconds = 1, host_mcp = { everything = everything({ "echo" }) } }, nil, function()
    assert(hostmcp.call("everything", "echo", { message = "a" }))
    local pid = hostmcp.pid("everything")
    t:ok(alive(pid))
    t:ok(eventually(5000, function() return not alive(pid) end), "stopped after 1 s idle")
    t:eq(hostmcp.pid("everything"), nil)
    t:match(text_of(assert(hostmcp.call("everything", "echo", { message = "b" }))), "b")
  end)
end

function tests.shutdown_leaves_no_upstream_process_nor_its_children(t)
  local pids = {}
  with_config({ host_mcp = {
    everything = everything({ "echo" }),
    -- a shell that keeps its node child: the whole process group must go
    wrapped = { command = "sh", args = { "-c", 'exec 3<&0; node "$0" <&3 3<&- & echo $! > "$1"; wait', MEMORY, "$DIR/child.pid" },
      tools = "read-only" },
  } }, nil, function(dir)
    assert(hostmcp.call("everything", "echo", { message = "x" }))
    assert(hostmcp.list_tools("wrapped"))
    pids = { hostmcp.pid("everything"), hostmcp.pid("wrapped"), tonumber(fs.read_file(dir .. "/child.pid"):match("%d+")) }
    for _, p in ipairs(pids) do t:ok(alive(p), "running: " .. p) end
    hostmcp.shutdown()
    for _, p in ipairs(pids) do t:ok(not alive(p), "gone after shutdown: " .. p) end
  end)
  t:eq(#pids, 3)
end

function tests.cancel_ends_a_call_and_the_upstream_goes_on(t)
  with_config({ host_mcp = { everything = everything({ "trigger-long-running-operation", "echo" }) } }, nil, function()
    local ev = async.event()
    local tm = timer.after(300, function() ev.set() end)
    local t0 = loop.now()
    local res, err, code = hostmcp.call("everything", "trigger-long-running-operation", { duration = 30, steps = 30 },
      { cancel = ev })
    tm:close()
    t:eq(res, nil)
    t:eq(code, "ECANCELED")
    t:eq(err, "cancelled")
    t:ok(loop.now() - t0 < 5000)
    t:match(text_of(assert(hostmcp.call("everything", "echo", { message = "still here" }))), "still here")
  end)
end

function tests.progress_of_the_upstream_reaches_the_caller(t)
  with_config({ host_mcp = { everything = everything({ "trigger-long-running-operation" }) } }, nil, function()
    local seen = {}
    local res = assert(hostmcp.call("everything", "trigger-long-running-operation", { duration = 1, steps = 3 },
      { on_progress = function(p) seen[#seen + 1] = p.progress end }))
    t:match(text_of(res), "Long running operation completed")
    t:eq(seen, { 1, 2, 3 })
  end)
end

-- Runs a program to its end (inside a task); returns its exit status and stdout.
local function capture(file, args, env)
  local r = programs.run({ file = file, args = args, env = env, timeout_ms = 300000, max_out = 16 * 1024 * 1024,
    err_max = 0 })
  if not r then return 127, "" end
  return r.status, r.out
end

-- The import fixtures: a ~/.claude.json and a Codex config.toml as the clients write them.
local function write_client_configs(dir)
  assert(fs.mkdir_p(dir .. "/home/.codex"))
  assert(fs.mkdir_p(dir .. "/proj"))
  local claude = {
    numStartups = 3,
    mcpServers = {
      everything = { type = "stdio", command = "node", args = { "${HOSTMCP_TEST_EVERYTHING}", "stdio" }, env = {} },
      demesne = { command = "/usr/bin/demesne", args = { "serve" } },
      itself = { command = loop.exepath(), args = { "serve" } },
      broken = { type = "stdio", command = 42 },
      ["needs-env"] = { command = "x", env = { TOKEN = "${HOSTMCP_TEST_UNSET_VAR}" } },
      ["old-sse"] = { type = "sse", url = "http://127.0.0.1:9/sse" },
    },
    projects = {
      [dir .. "/proj"] = {
        allowedTools = {},
        mcpServers = {
          memory = { command = "node", args = { MEMORY },
            env = { MEMORY_FILE_PATH = "${HOSTMCP_TEST_UNSET_VAR:-" .. dir .. "/memory.jsonl}" } },
        },
      },
    },
  }
  assert(fs.write_atomic(dir .. "/home/.claude.json", json.encode(claude)))
  local toml = ([[
model = "gpt-5"

[mcp_servers.memory2]
command = "node"
args = ["%s"]
env = { MEMORY_FILE_PATH = "%s/memory2.jsonl" }

[mcp_servers.remote]
url = "http://127.0.0.1:9/mcp"
bearer_token_env_var = "HOSTMCP_TEST_TOKEN"
http_headers = { "X-Team" = "docs" }
tool_timeout_sec = 60.0

[mcp_servers.off]
command = "node"
enabled = false

[mcp_servers.bad]
command = "node"
url = "http://127.0.0.1:9/mcp"

[mcp_servers.inline]
url = "http://127.0.0.1:9/mcp"
bearer_token = "not-in-a-file-please"

[mcp_servers.demesne-http]
url = "http://127.0.0.1:8080/mcp"
bearer_token_env_var = "DEMESNE_HTTP_TOKEN"
]]):format(MEMORY, dir)
  assert(fs.write_atomic(dir .. "/home/.codex/config.toml", toml))
end

local IMPORT_ENV = { HOME = "$DIR/home", CLAUDE_CONFIG_DIR = false, CODEX_HOME = false,
  HOSTMCP_TEST_EVERYTHING = EVERYTHING, HOSTMCP_TEST_UNSET_VAR = false, HOSTMCP_TEST_TOKEN = "t0ken" }

function tests.import_from_claude_code_and_codex_offers_nothing_until_named(t)
  local cfg = { host_mcp_import = { "claude_code", "codex" }, host_mcp = { memory2 = { tools = { "read_graph" } } } }
  local dir0 = "/tmp/demesne-hostmcp-test-" .. hex(6) -- written before the config is read
  with_config(cfg, IMPORT_ENV, function(dir)
    write_client_configs(dir)
    local rows, problems = hostmcp.describe()
    local by = {}
    for _, r in ipairs(rows) do by[r.name] = r end
    t:eq(names_of(rows), { "everything", "memory", "memory2", "remote" }, "imported servers")
    t:eq(by.everything.transport, "stdio")
    t:eq(by.everything.target, "node " .. EVERYTHING .. " stdio", "${VAR} expanded")
    t:eq(by.everything.tools, "none")
    t:match(by.memory.origin, "projects%[" .. dir:gsub("%p", "%%%0") .. "/proj%]%.mcpServers")
    t:eq(by.memory2.tools, "read_graph")
    t:eq(by.remote.transport, "http")
    t:eq(by.remote.target, "http://127.0.0.1:9/mcp")
    local text = {}
    for _, p in ipairs(problems) do text[#text + 1] = p.message end
    text = table.concat(text, "\n")
    local claude = dir .. "/home/.claude.json mcpServers"
    local codex = dir .. "/home/.codex/config.toml"
    local function has(s) t:ok(text:find(s, 1, true), "a problem: " .. s .. "\n--- got:\n" .. text) end
    has(claude .. ': server "broken": field command: must be a string')
    has(claude .. ': server "needs-env": field env.TOKEN: ${HOSTMCP_TEST_UNSET_VAR} is not set in demesne\'s environment')
    has(claude .. ': server "old-sse": field type: "sse" is not supported')
    has(claude .. ': server "demesne": skipped: the name demesne')
    has(claude .. ': server "itself": skipped: its command is the demesne binary')
    has(codex .. ': server "bad": field url: a server has either command (stdio) or url (HTTP), not both')
    has(codex .. ': server "inline": field bearer_token: an inline token is refused')
    has(codex .. ': server "off": field enabled: false: not imported')
    has(codex .. ' [mcp_servers.demesne-http]: server "demesne-http": skipped: it authenticates with demesne\'s own token')
    for _, p in ipairs(problems) do t:eq(p.level, "warning", "an imported file's problem is a warning: " .. p.message) end

    -- offered: only the imported server whose tools config.lua names
    t:eq(assert(hostmcp.servers_for(nil)), { "memory2" })
    t:eq(#assert(hostmcp.list_tools("everything")), 0, "no tool named: none listed")
    t:eq(hostmcp.pid("everything"), nil, "and nothing started for it")
    local res, err, code = hostmcp.call("everything", "echo", { message = "x" })
    t:eq(res, nil)
    t:eq(code, "EPERM")
    t:match(err, "offers no tools %(it is imported: name its tools in host_mcp")
    t:eq(names_of(assert(hostmcp.list_tools("memory2"))), { "read_graph" })
    local graph = assert(hostmcp.call("memory2", "read_graph", {}))
    t:match(text_of(graph), "entities", "the real server-memory answered")
  end)
  t:eq(fs.stat(dir0), nil)
end

function tests.check_config_shows_what_will_be_offered(t)
  local cfg = { host_mcp_import = { "claude_code", "codex" }, host_mcp = {
    memory2 = { tools = { "read_graph" } },
    local_everything = everything({ "echo", "get-sum" }),
  } }
  with_config(cfg, IMPORT_ENV, function(dir)
    write_client_configs(dir)
    local env = {}
    for _, kv in ipairs(loop.environ()) do env[#env + 1] = kv end
    local status, out = capture(loop.exepath(), { "check-config" }, env)
    t:eq(status, 0, "check-config exits 0: imported files' problems are notes\n" .. out)
    t:match(out, "host MCP servers %(offered to agent sandboxes; import: claude_code, codex%)")
    t:match(out, "\n  local_everything  stdio  node [^\n]*server%-everything/dist/index%.js stdio\n"
      .. "    from:  [^\n]*/config%.lua\n    tools: echo, get%-sum\n")
    t:match(out, "\n  everything  stdio  node [^\n]*\n    from:  [^\n]*%.claude%.json mcpServers\n"
      .. "    tools: none %(imported: name its tools in host_mcp in config%.lua%)\n")
    t:match(out, "\n  memory2  stdio  node [^\n]*\n    from:  [^\n]*config%.toml %[mcp_servers%.memory2%]\n"
      .. "    tools: read_graph\n")
    t:match(out, "\n  remote  http  http://127%.0%.0%.1:9/mcp\n")
    t:match(out, 'note: [^\n]*server "broken": field command: must be a string')
    t:ok(not out:find("t0ken", 1, true), "no secret printed")
    t:eq(hostmcp.pid("local_everything"), nil)
  end)
  -- an error in config.lua itself: refused, named, and check-config fails; the rest loads
  with_config({ host_mcp = { good = everything({ "echo" }), typo = { command = "node", tool = { "echo" } },
    notools = { command = "node" }, ["bad name"] = { command = "node", tools = "*" } } }, nil, function(dir)
    local env = {}
    for _, kv in ipairs(loop.environ()) do env[#env + 1] = kv end
    local status, out = capture(loop.exepath(), { "check-config" }, env)
    t:eq(status, 1, "check-config fails on a refused config.lua entry\n" .. out)
    local file = dir .. "/xdg/demesne/config.lua"
    t:ok(out:find("refused: " .. file .. ': server "typo": field tool: is not a host_mcp field', 1, true), out)
    t:ok(out:find("refused: " .. file .. ': server "notools": field tools: is required', 1, true), out)
    t:ok(out:find("refused: " .. file .. ': server "bad name": the name must be', 1, true), out)
    t:match(out, "\n  good  stdio  node ")
    t:eq(assert(hostmcp.servers_for(nil)), { "good" }, "the good entry still loads")
  end)
end

-- server-everything in its Streamable HTTP mode on a free loopback port; returns the URL
-- and a function that stops it (its whole process group).
local function start_http_everything(port)
  if not port then
    local probe
    probe, port = stream.listen_tcp("127.0.0.1", 0, function(c) c:close() end)
    assert(probe, port)
    probe:close()
  end
  local env = {}
  for _, kv in ipairs(loop.environ()) do env[#env + 1] = kv end
  env[#env + 1] = "PORT=" .. port
  local exited = async.event()
  local proc, pipes = process.spawn({ file = "node", args = { EVERYTHING, "streamableHttp" }, env = env, detached = true,
    stdout = true, stderr = true }, function() exited.set() end)
  assert(proc, pipes)
  local ready = false
  for _, k in ipairs({ "stdout", "stderr" }) do
    pipes[k]:read_start(function(data)
      if not data then pipes[k]:close() return end
      if data:find("listening on port", 1, true) then ready = true end
    end)
  end
  eventually(15000, function() return ready or exited.is_set() end)
  assert(ready, "server-everything streamableHttp did not start")
  return ("http://127.0.0.1:%d/mcp"):format(port), function()
    proc:kill("KILL", true)
    exited.wait()
    eventually(2000, function() return false end)
  end, proc, port
end

function tests.a_streamable_http_upstream_is_listed_called_and_filtered(t)
  local url, stop, proc, port = start_http_everything()
  local ok, err = pcall(function()
    -- the raw listing, from a client session of our own over HTTP
    local raw_s = client.http({ url = url, name = "raw" })
    assert(raw_s:initialize(10000))
    local raw = assert(raw_s:list_tools(10000))
    raw_s:close()
    t:ok(#raw > 5, "server-everything lists its tools over HTTP")
    local ro = {}
    for _, tool in ipairs(raw) do
      if type(tool.annotations) == "table" and tool.annotations.readOnlyHint == true then ro[#ro + 1] = tool.name end
    end
    table.sort(ro)
    with_config({ host_mcp_timeout_seconds = 1, host_mcp = {
      web = { url = url, env_http_headers = { ["X-Demesne-Test"] = "HOSTMCP_TEST_HEADER" }, tools = { "echo", "get-sum" } },
      webro = { url = url, tools = "read-only" },
      nohdr = { url = url, bearer_token_env_var = "HOSTMCP_TEST_UNSET_VAR", tools = "*" },
    } }, { HOSTMCP_TEST_HEADER = "yes", HOSTMCP_TEST_UNSET_VAR = false }, function()
      t:eq(names_of(assert(hostmcp.list_tools("web"))), { "echo", "get-sum" })
      local res = assert(hostmcp.call("web", "get-sum", { a = 40, b = 2 }))
      t:match(text_of(res), "42", "the real sum over HTTP")
      local denied, _, code = hostmcp.call("web", "get-env", {})
      t:eq(denied, nil)
      t:eq(code, "EPERM", "get-env refused over HTTP too")
      t:eq(names_of(assert(hostmcp.list_tools("webro"))), ro, "read-only over HTTP")
      local none, herr, hcode = hostmcp.list_tools("nohdr")
      t:eq(none, nil)
      t:eq(hcode, "EINVAL")
      t:match(herr, "bearer_token_env_var: environment variable HOSTMCP_TEST_UNSET_VAR is not set")
      -- a server that stops answering: the call times out, and once it answers again a
      -- later call works (in a new session if the old one was dropped)
      t:eq(run("kill", { "-STOP", "--", "-" .. proc:pid() }), 0, "kill -STOP the server's group")
      local t0 = loop.now()
      local r2, _, c2 = hostmcp.call("web", "get-sum", { a = 1, b = 1 })
      t:eq(r2, nil)
      t:eq(c2, "ETIMEDOUT")
      t:ok(loop.now() - t0 < 5000, "not stuck")
      sleep(1500)
      run("kill", { "-CONT", "--", "-" .. proc:pid() })
      local r3 = assert(hostmcp.call("web", "get-sum", { a = 2, b = 40 }))
      t:match(text_of(r3), "42", "works again")
      -- the server restarts and forgets every session: the next call gets a new one
      stop()
      url, stop, proc = start_http_everything(port)
      local r4, e4 = hostmcp.call("web", "get-sum", { a = 30, b = 12 })
      t:ok(r4, "a call after the server restarted: " .. tostring(e4))
      t:match(text_of(r4), "42")
    end)
  end)
  run("kill", { "-CONT", "--", "-" .. proc:pid() })
  stop()
  if not ok then error(err, 0) end
end

local function read_lines(path)
  local out = {}
  local f = io.open(path)
  if not f then return out end
  for line in f:lines() do out[#out + 1] = assert(json.decode(line)) end
  f:close()
  return out
end

function tests.each_proxied_call_is_one_line_of_mcp_jsonl(t)
  with_config({ host_mcp = { everything = everything({ "get-sum" }) } }, nil, function(dir)
    local out = dir .. "/out"
    assert(fs.mkdir_p(out))
    assert(hostmcp.call("everything", "get-sum", { a = 1, b = 2 }, { output_dir = out }))
    local refused = hostmcp.call("everything", "get-env", {}, { output_dir = out })
    t:eq(refused, nil)
    local lines = read_lines(out .. "/mcp.jsonl")
    t:eq(#lines, 2, "one line per call")
    local a, b = lines[1], lines[2]
    t:eq(a.server, "everything")
    t:eq(a.tool, "get-sum")
    t:eq(a.ok, true)
    t:eq(a.error, nil)
    t:eq(a.request_bytes, #json.encode({ a = 1, b = 2 }))
    t:ok(a.response_bytes > 10, "response size")
    t:ok(a.duration_ms >= 0 and a.duration_ms < 60000, "duration")
    t:match(a.time, "^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$")
    t:eq(a.arguments, nil, "arguments only when the operator turns that on")
    t:eq(b.tool, "get-env")
    t:eq(b.ok, false)
    t:match(b.error, "not allowed")
    t:eq(b.response_bytes, 0)
  end)
  with_config({ host_mcp_record_arguments = true, host_mcp = { everything = everything({ "get-sum" }) } }, nil,
    function(dir)
      local out = dir .. "/out"
      assert(fs.mkdir_p(out))
      assert(hostmcp.call("everything", "get-sum", { a = 5, b = 6 }, { output_dir = out }))
      t:eq(read_lines(out .. "/mcp.jsonl")[1].arguments, { a = 5, b = 6 })
    end)
end

function tests.proxy_registry_lists_the_allowed_tools_calls_them_and_refuses_the_rest(t)
  with_config({ host_mcp = { everything = everything({ "echo", "get-sum" }) } }, nil, function(dir)
    local out = dir .. "/out"
    assert(fs.mkdir_p(out))
    local reg = proxy.registry("everything", { output_dir = function(ctx) return ctx.out end })
    t:eq(reg.list_changed, true, "its sessions announce tools.listChanged")
    local listing = assert(reg:listing())
    t:eq(names_of(listing), { "echo", "get-sum" }, "only the allowed tools are listed")
    t:eq(listing[1].inputSchema.type, "object", "the upstream's schema is passed on")
    local ctx = { out = out, progress = function() return true end }
    local res = demesne_tools.call(reg:get("echo"), ctx, { message = "via the proxy" })
    t:eq(res.isError, false)
    t:match(text_of(res), "Echo: via the proxy")
    local refused = demesne_tools.call(reg:get("get-env"), ctx, {})
    t:eq(refused.isError, true, "a direct call of a tool that is not allowed is refused")
    t:match(text_of(refused), "get%-env of host MCP server everything is not allowed here %(allowed: echo, get%-sum%)")
    t:eq(text_of(refused):find("PATH=", 1, true), nil, "nothing of the host's environment")
    local lines = read_lines(out .. "/mcp.jsonl")
    t:eq({ lines[1].tool, lines[1].ok, lines[2].tool, lines[2].ok }, { "echo", true, "get-env", false },
      "both calls recorded in the caller's output folder")
    local gone = proxy.registry("nosuch")
    local l, err = gone:listing()
    t:eq(l, nil)
    t:match(err, "no host MCP server named \"nosuch\"")
  end)
end

function tests.mcp_jsonl_planted_by_the_sandbox_is_not_followed(t)
  with_config({ host_mcp = { everything = everything({ "get-sum" }) } }, nil, function(dir)
    -- the output folder is the sandbox's: it plants a link to a host file, a FIFO, and a
    -- link in place of a child's folder
    local victim = dir .. "/host-file"
    assert(fs.write_atomic(victim, "precious\n"))
    local out1, out2, out3 = dir .. "/out1", dir .. "/out2", dir .. "/out3"
    for _, d in ipairs({ out1, out2, out3 .. "/child" }) do assert(fs.mkdir_p(d)) end
    t:eq(run("ln", { "-s", victim, out1 .. "/mcp.jsonl" }), 0)
    t:eq(run("mkfifo", { out2 .. "/mcp.jsonl" }), 0)
    t:eq(run("ln", { "-s", dir, out3 .. "/child/x" }), 0)
    for _, o in ipairs({ out1, out2, out3 .. "/child/x" }) do
      local t0 = loop.now()
      local res = hostmcp.call("everything", "get-sum", { a = 1, b = 1 }, { output_dir = o })
      t:match(text_of(assert(res)), "2", "the call itself still answers")
      t:ok(loop.now() - t0 < 10000, "nothing blocked")
    end
    t:eq(fs.read_file(victim), "precious\n", "the host file is untouched")
    t:eq(fs.lstat(out2 .. "/mcp.jsonl").type, "other", "the FIFO is left as it was")
    t:eq(fs.stat(dir .. "/mcp.jsonl"), nil, "nothing written through the linked folder")
    local ok, err, code = hostmcp.record(out1, { server = "s", tool = "t" })
    t:eq(ok, nil)
    t:eq(code, "ELOOP", "a link at mcp.jsonl is refused, not followed")
    t:ok(err ~= nil, "with a message")
    ok, err, code = hostmcp.record(out2, { server = "s", tool = "t" })
    t:eq(ok, nil)
    t:eq(code, "EINVAL", "a FIFO at mcp.jsonl is refused without being opened")
    t:match(err, "fifo")
  end)
end

function tests.json_decode_arrays_keeps_empty_arrays_apart_from_empty_objects(t)
  local v = assert(json.decode_arrays('{"a":[],"b":{},"c":[ \n],"d":"[]","e":[[],{"f":[]}],"g":"x\\"[]"}'))
  t:eq(json.encode(v.a), "[]")
  t:eq(json.encode(v.b), "{}")
  t:eq(json.encode(v.c), "[]")
  t:eq(v.d, "[]", "inside a string it stays text")
  t:eq(json.encode(v.e), "[[],{\"f\":[]}]")
  t:eq(v.g, 'x"[]')
  t:eq(json.encode(assert(json.decode_arrays("[]"))), "[]")
  t:eq(json.decode_arrays('{"a":'), nil, "malformed JSON is still an error")
end

return tests
