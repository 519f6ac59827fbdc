-- The agent runner's wiring of demesne's in-sandbox MCP server into the CLIs (lua/agent/init.lua
-- agent.wire, agent.mcp_servers) and the context file's section on child sandboxes, on
-- plans made by hand (the endpoint as lua/tree's plan hook leaves it on the plan). The real
-- CLIs run this wiring in tests/integration/agent-tree.test.mjs.
local agent = require("demesne.agent")
local context = require("demesne.agent.context")
local providers = require("demesne.providers")
local json = require("demesne.json")

local tests = {}

local ENDPOINT = { url = "http://127.0.0.1:3130/mcp", port = 3130, token = "feedc0de", socket = "/x/mcp.sock",
  sandbox_socket = "/.demesne/run/mcp.sock",
  tree = { run_id = "r1", root = "r0", name = "helper", depth = 1, limits = { depth = 3, children = 32, running = 8 },
    children_used = 0, budget_usd = 2.5, spent_usd = 0.75 } }

-- A plan as agent.prepare leaves it, for provider `name`.
local function plan(name, endpoint)
  local p = providers.load({ user_dir = false, quiet = true }):get(name)
  local run = { prompt_file = "/.demesne/agent/prompt.md", context_file = "/.demesne/agent/" .. p.context_file_name,
    model = providers.models_of(p)[1].name, vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok",
    workdir = "/workspace", home = "/root", agent_dir = "/.demesne/agent", credential_kind = "api_key" }
  return { provider = p, run = run, timeout = 600, endpoint = endpoint, egress = { name = "none" }, mounts = {},
    env = json.array({ "PATH=/usr/bin:/bin", "DEMESNE_MCP_URL=http://127.0.0.1:3130/mcp",
      "DEMESNE_MCP_TOKEN=feedc0de" }) }
end

local function env_of(list)
  local m = {}
  for _, kv in ipairs(list) do
    local k, v = kv:match("^([^=]+)=(.*)$")
    m[k] = v
  end
  return m
end

function tests.claude_code_is_wired_to_the_endpoint_of_its_run(t)
  local o = plan("claude_code", ENDPOINT)
  local files = agent.wire(o)
  t:eq(#o.run.mcp_servers, 1)
  t:eq(o.run.mcp_servers[1], { name = "demesne", url = "http://127.0.0.1:3130/mcp", token = "feedc0de",
    token_env = "DEMESNE_MCP_TOKEN", tool_timeout_ms = 660000, startup_timeout_ms = 60000 },
    "a call may last as long as the run, and a minute more")
  local conf = json.decode(files["mcp.json"])
  t:eq(conf.mcpServers.demesne.headers.Authorization, "Bearer feedc0de")
  t:match(o.wrapper, "'/%.demesne/agent/mcp%.json'", "the wrapper runs the CLI with the configuration")
  local env = env_of(o.env)
  t:eq(env.MCP_TOOL_TIMEOUT, "660000")
  t:eq(env.DEMESNE_MCP_TOKEN, "feedc0de", "what the tree put in the environment stays")
  t:eq(env.PATH, "/usr/bin:/bin")
  local n = 0
  for _, kv in ipairs(o.env) do if kv:match("^MCP_TOOL_TIMEOUT=") then n = n + 1 end end
  t:eq(n, 1, "wired twice, set once")
  agent.wire(o)
  n = 0
  for _, kv in ipairs(o.env) do if kv:match("^MCP_TOOL_TIMEOUT=") then n = n + 1 end end
  t:eq(n, 1)
end

function tests.codex_is_wired_through_its_config(t)
  local o = plan("codex", ENDPOINT)
  local files = agent.wire(o)
  t:eq(files, {}, "Codex needs no extra file: config.toml carries the server")
  t:match(o.wrapper, "%[mcp_servers%.demesne%]")
  t:match(o.wrapper, 'bearer_token_env_var = "DEMESNE_MCP_TOKEN"')
  t:match(o.wrapper, "tool_timeout_sec = 660")
end

function tests.no_endpoint_no_wiring(t)
  local o = plan("claude_code", nil)
  local files = agent.wire(o)
  t:eq(o.run.mcp_servers, nil)
  t:eq(files, {})
  t:ok(not o.wrapper:find("'/.demesne/agent/mcp.json'", 1, true))
  t:ok(not context.text(o, { prompt = "p" }):find("sandbox_", 1, true),
    "a run without an endpoint hears nothing of child sandboxes")
end

function tests.a_provider_that_takes_no_mcp_server_gets_none(t)
  local o = plan("claude_code", ENDPOINT)
  local p = {}
  for k, v in pairs(o.provider) do p[k] = v end
  p.mcp = nil
  o.provider = p
  agent.wire(o)
  t:eq(o.run.mcp_servers, nil)
  local text = context.text(o, { prompt = "p" })
  t:match(text, "your CLI is not connected to it")
  t:ok(not text:find("sandbox_wait", 1, true))
end

function tests.the_context_file_tells_the_tools_the_habits_and_the_limits(t)
  local o = plan("claude_code", ENDPOINT)
  o.mounts = { { host = "/h/data", target = "/in/data" }, { host = "/h/out/child/lint", target = "/in/previous-jobs/lint" } }
  agent.wire(o)
  local text = context.text(o, { prompt = "Build the thing." })
  t:ok(text:find("  - `/in/data`\n", 1, true), "a host input")
  t:ok(text:find("  - `/in/previous-jobs/lint` (the output of `lint`, a child your parent spawned before you)", 1, true),
    "an earlier sibling's output")
  for _, want in ipairs({ "## Child sandboxes (the `demesne` tools)", "`sandbox_script`", "`sandbox_agent`",
    "`sandbox_research`", "`sandbox_wait`", "`sandbox_usage_report`", "unique among your children",
    "`/out/child/<name>/`", "`/in/previous-jobs/<name>/`", "`background: true`", "call it again",
    "copy or summarise what must surface into your own `/out`",
    "You are at depth 1 (the host's run is 0); children may go down to depth 3.",
    "At most 32 children in your run.", "At most 8 sandboxes of the whole tree run at once",
    "The whole tree may spend $2.50 on model requests ($1.75 left when you started)" }) do
    t:ok(text:find(want, 1, true), "the context file says: " .. want)
  end
  t:ok(text:find("## Child sandboxes", 1, true) < text:find("## Task", 1, true), "before the task")
  t:ok(text:find("Claude Code lists them as `mcp__demesne__<tool>`", 1, true), "the provider's hint on tool names")
  -- at the deepest level: no children
  local deep = plan("codex", { url = ENDPOINT.url, token = "t", tree = { depth = 3, limits = { depth = 3 } } })
  agent.wire(deep)
  local deep_text = context.text(deep, { prompt = "p" })
  t:match(deep_text, "You are at depth 3, the deepest allowed %(3%): you cannot spawn")
  t:ok(deep_text:find("`await tools.mcp__demesne__sandbox_script({...})`", 1, true), "Codex's code mode explained")
  -- no budget
  local free = plan("codex", { url = ENDPOINT.url, token = "t", tree = { depth = 0, limits = { depth = 3 } } })
  agent.wire(free)
  t:match(context.text(free, { prompt = "p" }), "No budget is set")
end

-- Host MCP servers on the plan (o.host_mcp, as lua/tree's plan hook leaves it): one MCP
-- server each, on the run's endpoint and token, with the upstream's bound plus 15 s; the
-- context file lists each with its tools.
local HOST = {
  { name = "notes", url = "http://127.0.0.1:3130/mcp/host/notes", timeout_ms = 120000,
    tools = { { name = "search", description = "Searches the notes\nsecond line" }, { name = "read" } } },
  { name = "tracker", url = "http://127.0.0.1:3130/mcp/host/tracker", timeout_ms = 7000,
    error = "cannot start tracker-mcp: no such file" },
}

function tests.host_mcp_servers_are_wired_next_to_demesne_and_listed_in_the_context(t)
  local o = plan("claude_code", ENDPOINT)
  o.host_mcp = HOST
  local files = agent.wire(o)
  t:eq(#o.run.mcp_servers, 3)
  t:eq(o.run.mcp_servers[2], { name = "notes", url = "http://127.0.0.1:3130/mcp/host/notes", token = "feedc0de",
    token_env = "DEMESNE_MCP_TOKEN", tool_timeout_ms = 135000, startup_timeout_ms = 60000 })
  t:eq(o.run.mcp_servers[3].tool_timeout_ms, 22000, "the server's own bound plus 15 s")
  local conf = json.decode(files["mcp.json"])
  t:eq(conf.mcpServers.notes.url, "http://127.0.0.1:3130/mcp/host/notes")
  t:eq(conf.mcpServers.notes.headers.Authorization, "Bearer feedc0de", "the run's token")
  t:eq(conf.mcpServers.tracker.timeout, 22000)
  local text = context.text(o, { prompt = "do it" })
  t:match(text, "## Host tools")
  t:match(text, "%- `notes`: 2 tools\n  %- `search`: Searches the notes\n  %- `read`\n")
  t:match(text, "%- `tracker`: its tools could not be listed when you started %(cannot start tracker%-mcp")
  t:match(text, "do not appear in your container")
  local c = plan("codex", ENDPOINT)
  c.host_mcp = HOST
  agent.wire(c)
  t:match(c.wrapper, "%[mcp_servers%.notes%]\nurl = \"http://127%.0%.0%.1:3130/mcp/host/notes\"")
  t:match(c.wrapper, "%[mcp_servers%.tracker%][^%[]*tool_timeout_sec = 22")
  -- a host server may never take demesne's place
  local d = plan("claude_code", ENDPOINT)
  d.host_mcp = { { name = "demesne", url = "http://127.0.0.1:3130/mcp/host/demesne", timeout_ms = 1000 } }
  agent.wire(d)
  t:eq(#d.run.mcp_servers, 1)
  t:eq(d.run.mcp_servers[1].url, "http://127.0.0.1:3130/mcp")
  t:eq(context.text(d, { prompt = "x" }):find("## Host tools", 1, true), nil)
end

return tests
