-- Provider claude_code: the Claude Code CLI (@anthropic-ai/claude-code, images/agent-claude_code)
-- run headless with stream-JSON output. Behaviour behind a loopback vendor port, as relied
-- on here, is recorded in shared/reference/agent-clis.md §2 and §4.
--
-- The container is the boundary, so permissions are bypassed (--dangerously-skip-permissions);
-- the CLI refuses that as root unless IS_SANDBOX=1, which is always set. All model traffic
-- goes to ANTHROPIC_BASE_URL, the in-sandbox vendor port; CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC
-- removes every other connection (bootstrap, telemetry, event logging, the title request).
-- Credentials: ANTHROPIC_API_KEY (sent as x-api-key), or CLAUDE_CODE_OAUTH_TOKEN /
-- ANTHROPIC_AUTH_TOKEN (sent as Authorization: Bearer) on the host; the sandbox gets a fake
-- of the same kind, so the CLI sends the same headers and betas it would with the real one.
local P = require("demesne.providers")
local json = require("demesne.json")

local claude = {}

-- The kinds of credential, in the order the host is searched: name = {host variable,
-- variable the sandbox gets the fake in, header it travels in}.
local KINDS = {
  { kind = "api_key", var = "ANTHROPIC_API_KEY", header = "x-api-key" },
  { kind = "oauth_token", var = "CLAUDE_CODE_OAUTH_TOKEN", header = "authorization" },
  { kind = "auth_token", var = "ANTHROPIC_AUTH_TOKEN", header = "authorization" },
}
local BY_KIND = {}
for _, k in ipairs(KINDS) do BY_KIND[k.kind] = k end

--- Finds the credential on the host: the first of ANTHROPIC_API_KEY, CLAUDE_CODE_OAUTH_TOKEN,
--- ANTHROPIC_AUTH_TOKEN that is set (the CLI itself prefers the API key too).
---@return ProviderCredential
function claude.credentials()
  for _, k in ipairs(KINDS) do
    local v = os.getenv(k.var)
    if v and v ~= "" then
      return { present = true, kind = k.kind, source = "$" .. k.var, value = function() return os.getenv(k.var) end }
    end
  end
  return { present = false,
    hint = "set ANTHROPIC_API_KEY or CLAUDE_CODE_OAUTH_TOKEN (from `claude setup-token`) on the host" }
end

-- The command: a small sh script so the prompt can come from a file, the context file is
-- linked into the working folder and stdin is /dev/null (an open stdin stalls the CLI).
-- $1 prompt file, $2 context file, $3 workdir, $4 model, $5 session to resume (or empty),
-- $6 the prompt that resumes it, $7 the MCP configuration file (or empty: no MCP server).
-- --strict-mcp-config always: the CLI takes MCP servers from that file only, never from a
-- .mcp.json in the (possibly shared) working folder or a settings file.
local SCRIPT = [[
set -eu
model=$4 session=${5:-} again=${6:-continue} mcp=${7:-}
mkdir -p "$3"
cd "$3"
if [ -n "$2" ] && [ "$2" != "$3/CLAUDE.md" ]; then ln -sf "$2" CLAUDE.md; fi
if [ -n "$session" ]; then
  prompt=$again
  set -- --resume "$session" -p
else
  prompt=$(cat "$1")
  set -- -p
fi
if [ -n "$mcp" ]; then set -- "$@" --mcp-config "$mcp"; fi
exec claude "$@" --strict-mcp-config --output-format stream-json --verbose --dangerously-skip-permissions \
  --model "$model" -- "$prompt" </dev/null
]]

local MODELS = {
  { name = "sonnet", arg = "sonnet", description = "the default: general coding work" },
  { name = "opus", arg = "opus", description = "complex synthesis and design" },
  { name = "haiku", arg = "haiku", description = "cheap lookups and small edits" },
  { name = "fable", arg = "claude-fable-5", description = "the hardest problems (above opus)" },
}
local MODEL_ARG = {}
for _, m in ipairs(MODELS) do MODEL_ARG[m.name] = m.arg end

-- The MCP configuration file, in run.agent_dir.
claude.MCP_CONFIG = "mcp.json"

local function mcp_servers(run)
  return type(run.mcp_servers) == "table" and run.mcp_servers or {}
end

--- The command line for a run (see SCRIPT).
---@param run ProviderRun
---@return string[]
function claude.argv(run)
  local mcp = ""
  if #mcp_servers(run) > 0 then mcp = (run.agent_dir or "/.demesne/agent") .. "/" .. claude.MCP_CONFIG end
  return { "/bin/sh", "-c", SCRIPT, "claude-run", run.prompt_file, run.context_file or "", run.workdir or "/workspace",
    MODEL_ARG[run.model] or run.model, run.resume_session or "", run.resume_prompt or "continue", mcp }
end

--- The run's files: with MCP servers, mcp.json for --mcp-config in the shape of a project's
--- .mcp.json: each server {type = "http", url, headers = {Authorization = "Bearer <token>"},
--- timeout = the longest tool call in ms (a hard wall clock per call in Claude Code; it also
--- raises the 60 s per-request timer and the idle watchdog)}. Claude Code then names the
--- tools mcp__<server>__<tool>; --dangerously-skip-permissions lets it call them unasked.
---@param run ProviderRun
---@return table<string,string>
function claude.files(run)
  local servers = mcp_servers(run)
  if #servers == 0 then return {} end
  local conf = {}
  for _, m in ipairs(servers) do
    conf[m.name] = { type = "http", url = m.url, headers = { Authorization = "Bearer " .. m.token },
      timeout = math.floor(m.tool_timeout_ms) }
  end
  return { [claude.MCP_CONFIG] = json.encode({ mcpServers = conf }) .. "\n" }
end

--- The environment for a run: the vendor port, the per-run token under the variable of the
--- credential's kind, and the switches that keep the CLI quiet and local.
---@param run ProviderRun
---@return table<string,string>
function claude.env(run)
  local kind = run.credential_kind
  if not BY_KIND[kind] then kind = claude.credentials().kind end
  local k = BY_KIND[kind] or BY_KIND.api_key
  local env = {
    IS_SANDBOX = "1",
    HOME = run.home or "/root",
    ANTHROPIC_BASE_URL = run.vendor_base_url,
    [k.var] = run.token,
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC = "1",
    DISABLE_TELEMETRY = "1",
    DISABLE_AUTOUPDATER = "1",
    DISABLE_ERROR_REPORTING = "1",
    -- with *_PROXY set for tools, the CLI would send its API calls into the egress proxy
    NO_PROXY = "127.0.0.1,localhost",
    no_proxy = "127.0.0.1,localhost",
  }
  if run.max_retries then env.CLAUDE_CODE_MAX_RETRIES = tostring(math.floor(run.max_retries)) end
  if run.request_timeout_ms then env.API_TIMEOUT_MS = tostring(math.floor(run.request_timeout_ms)) end
  local servers = mcp_servers(run)
  if #servers > 0 then
    -- the longest any call may take; the per-server timeout in mcp.json says the same
    -- (versions before 2.1.206 ignore it there), and no call is aborted for a quiet spell
    -- (a blocking child call sends progress only when the CLI asked for it)
    local tool, startup = 0, 0
    for _, m in ipairs(servers) do
      tool = math.max(tool, math.floor(m.tool_timeout_ms))
      startup = math.max(startup, math.floor(m.startup_timeout_ms))
    end
    env.MCP_TOOL_TIMEOUT = tostring(tool)
    env.CLAUDE_CODE_MCP_TOOL_IDLE_TIMEOUT = tostring(tool)
    env.MCP_TIMEOUT = tostring(startup)
  end
  return env
end

--- Reads the final answer from a stream-json transcript: the `result` of the last
--- {type: result} line; without one, the text blocks of the last assistant message.
--- details: session_id, is_error, api_error_status, num_turns, cli_cost_usd, rate_limited,
--- resets_at (epoch seconds, from a rejected rate_limit_event).
---@param lines string[]
---@return string|nil answer, table details
function claude.parse_answer(lines)
  local details = { is_error = false }
  local result
  local last_id, texts = nil, {}
  P.each_event(lines, function(ev)
    if ev.session_id and type(ev.session_id) == "string" then details.session_id = ev.session_id end
    if ev.type == "result" then
      result = ev
    elseif ev.type == "system" and ev.subtype == "init" then -- a new attempt (a resumed session)
      details.rate_limited, details.resets_at = nil, nil
    elseif ev.type == "assistant" and type(ev.message) == "table" then
      local id = ev.message.id or last_id
      for _, block in ipairs(type(ev.message.content) == "table" and ev.message.content or {}) do
        if type(block) == "table" and block.type == "text" and type(block.text) == "string" then
          if id ~= last_id then last_id, texts = id, {} end
          texts[#texts + 1] = block.text
        end
      end
    elseif ev.type == "rate_limit_event" then
      local info = type(ev.rate_limit_info) == "table" and ev.rate_limit_info or ev
      if info.status == "rejected" then
        details.rate_limited = true
        if type(info.resetsAt) == "number" then details.resets_at = info.resetsAt end
      end
    end
  end)
  if result then
    details.is_error = result.is_error == true
    if type(result.api_error_status) == "number" then details.api_error_status = result.api_error_status end
    if details.api_error_status == 429 then details.rate_limited = true end
    details.num_turns = result.num_turns
    details.cli_cost_usd = result.total_cost_usd
    if type(result.result) == "string" and result.result ~= "" then return result.result, details end
  end
  -- trimmed with a linear pattern: "%s+$" backtracks quadratically over a long run of
  -- blanks, and the transcript is the sandbox's to write
  if #texts > 0 then return table.concat(texts, "\n"):match("^%s*(.*%S)") or "", details end
  return nil, details
end

local function usage_fields(u, out)
  out = out or {}
  if type(u) ~= "table" then return out end
  out.input = P.num(u.input_tokens)
  out.output = P.num(u.output_tokens)
  out.cache_creation = P.num(u.cache_creation_input_tokens)
  out.cache_read = P.num(u.cache_read_input_tokens)
  return out
end

--- Usage of a non-streaming Messages response: top-level model and usage.
---@param body string|table
---@return ProviderUsage|nil usage, string|nil err
function claude.usage_from_json(body)
  local b, err = P.decode(body)
  if not b then return nil, err end
  if type(b.usage) ~= "table" then return nil, "no usage in the response" end
  local u = usage_fields(b.usage, { model = type(b.model) == "string" and b.model or nil, id = b.id })
  return P.merge_usage(P.empty_usage(), u)
end

--- Usage from one Messages SSE event: message_start sets model and all counts;
--- message_delta carries the running output total (and input counts when non-zero).
--- Other events give nil without being decoded.
---@param event string|nil
---@param data string
---@return table|nil partial
function claude.usage_from_sse(event, data)
  if event ~= nil and event ~= "message_start" and event ~= "message_delta" and event ~= "message" then return nil end
  if event == nil or event == "message" then
    if not (data:find('"message_start"', 1, true) or data:find('"message_delta"', 1, true)) then return nil end
  end
  local d = json.decode(data)
  if type(d) ~= "table" then return nil end
  if d.type == "message_start" and type(d.message) == "table" then
    local m = d.message
    return usage_fields(m.usage, { model = type(m.model) == "string" and m.model or nil, id = m.id })
  elseif d.type == "message_delta" and type(d.usage) == "table" then
    local part = usage_fields(d.usage)
    -- a delta restates input counts as 0 when it has nothing new: keep the start's
    for _, k in ipairs({ "input", "cache_creation", "cache_read" }) do
      if part[k] == 0 then part[k] = nil end
    end
    return part
  end
  return nil
end

claude.adapter = {
  name = "claude_code",
  title = "Claude Code",
  models = MODELS,
  image = "agent-claude_code",
  context_file_name = "CLAUDE.md",
  credentials = claude.credentials,
  argv = claude.argv,
  env = claude.env,
  mcp = "http",
  files = claude.files,
  mcp_hint = function(server)
    return ("Claude Code lists them as `mcp__%s__<tool>` (`mcp__%s__sandbox_script`, …)."):format(server, server)
  end,
  parse_answer = claude.parse_answer,
  usage_from_json = claude.usage_from_json,
  usage_from_sse = claude.usage_from_sse,
  vendor = {
    label = "the Anthropic API",
    upstream = "https://api.anthropic.com",
    allowed = {
      { method = "POST", path = "^/v1/messages$" },
    },
    -- the Bun runtime's warm-up HEAD on the base URL carries no credential
    local_answers = {
      { method = "HEAD", path = "^/?$", status = 200 },
    },
    presented_token = function(headers) return headers["x-api-key"] or P.bearer(headers) end,
    swap_auth = function(headers, cred)
      local out = {}
      for k, v in pairs(headers) do out[k] = v end
      out["x-api-key"], out["authorization"] = nil, nil
      if cred.kind == "api_key" then
        out["x-api-key"] = cred.value()
      else
        out["authorization"] = "Bearer " .. cred.value()
      end
      return out
    end,
  },
  -- USD per million tokens, indicative only: subscription logins are not billed per request,
  -- and the 1-hour cache tier is not modelled. Keys are prefixes of the model id on the wire.
  prices = {
    ["claude-sonnet-5"] = { input = 3, output = 15, cache_creation = 3.75, cache_read = 0.30 },
    ["claude-opus-4-8"] = { input = 5, output = 25, cache_creation = 6.25, cache_read = 0.50 },
    ["claude-fable-5"] = { input = 10, output = 50, cache_creation = 12.50, cache_read = 1.00 },
    ["claude-haiku-4-5"] = { input = 1, output = 5, cache_creation = 1.25, cache_read = 0.10 },
  },
}

return claude.adapter
