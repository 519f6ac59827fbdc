-- Agent runs (sandbox_agent, sandbox_research): an AI coding agent CLI from a provider
-- adapter (lua/providers) in a fresh sandbox of the provider's image, with the vendor route
-- (lua/vendor.lua) as its only way to the model and the real credential kept on the host.
--
-- Layout inside the sandbox: /workspace (writable scratch, the agent's working folder),
-- /out (deliverables; the host's output folder), /in (read-only host inputs, sandbox_agent
-- only), /.demesne/agent (read-only: the prompt and the generated context file). The CLI's
-- event stream goes to /out/transcript.jsonl while it runs; stderr to /out/stderr.log.
-- After the run, results.json in the output folder holds the result the tool returns.
local config = require("demesne.config")
local egress = require("demesne.egress")
local fs = require("core.fs")
local text = require("core.text")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local output = require("demesne.output")
local providers = require("demesne.providers")
local sandbox = require("demesne.sandbox")
local vendor = require("demesne.vendor")

local agent = {}

--- Hooks of the layer above (nested sandboxes, lua/tree): result(o, r) runs when a run's
--- result is built, before results.json is written (it may add fields: children, reason).
agent.hooks = { result = {} }

local AGENT_DIR = "/.demesne/agent"
local ANSWER_MAX = 16 * 1024
local STDERR_MAX = 4 * 1024
-- The tail of transcript.jsonl that is read for the answer and the rate-limit signals (its
-- last providers.LINES_MAX lines): the sandbox writes it, and decoding it is work on the loop.
local TRANSCRIPT_MAX = 1024 * 1024

local function fail(msg) sandbox.fail(msg) end

-- A reset time (epoch seconds) read from a transcript the agent wrote, or nil unless it is a
-- number from 0 to 2^33 (the year 2242): os.date and "%d" take nothing larger, and a
-- transcript is written inside the sandbox.
local function epoch_seconds(v)
  if type(v) == "number" and v >= 0 and v < 2 ^ 33 then return v end
  return nil
end

--- The `model` parameter's schema: an enum of the models that can be used now (when any).
function agent.model_schema()
  local models = providers.available_models()
  local s = { type = "string", minLength = 1, description =
    "The model (it picks the provider); default: the first available provider's default model."
    .. (#models > 0 and (" Available: " .. table.concat(models, ", ") .. ".") or " No provider has credentials now.") }
  if #models > 0 then s.enum = json.array(models) end
  return s
end

local EGRESS_TEXT = {
  none = "There is no network access except the model API (used by your CLI itself). Package installs and "
    .. "downloads will fail; work with what is in the image and the inputs.",
  ["package-managers"] = "Outbound access is limited to package registries (npm, PyPI, Debian archives, …) "
    .. "through an HTTP proxy already configured in the environment. Other hosts are refused.",
  open = "Outbound network access is open (no host inputs are mounted).",
}

local function usd(x)
  if x >= 0.01 or x == 0 then return ("$%.2f"):format(x) end
  return ("$%.4f"):format(x)
end

local HOST_DESCRIPTION_MAX = 160

--- Adds the context file's section on the host MCP servers offered to the run (o.host_mcp,
--- set by lua/tree's plan hook: {name, tools = {{name, description}} | nil, error}), when
--- the run's CLI is wired to them: each server with its allowed tools (a description's first
--- line, bounded).
---@param o table  the plan
---@param add fun(line: string)
function agent.context_host_mcp(o, add)
  local wired = {}
  for _, m in ipairs(o.run and o.run.mcp_servers or {}) do wired[m.name] = true end
  local list = {}
  for _, h in ipairs(type(o.host_mcp) == "table" and o.host_mcp or {}) do
    if wired[h.name] and h.name ~= agent.MCP_SERVER then list[#list + 1] = h end
  end
  if #list == 0 then return end
  add("## Host tools (MCP servers of your operator)")
  add("")
  add("These MCP servers run on the host, not in your container, and are already connected (no approval "
    .. "needed). Only the tools listed here are offered. Files a tool writes on the host do not appear in "
    .. "your container: use what its result returns. Every call is recorded in `/out/mcp.jsonl`.")
  add(("Your CLI names their tools as it names any MCP server's: `mcp__<server>__<tool>` (e.g. `mcp__%s__%s`).")
    :format(list[1].name, list[1].tools and list[1].tools[1] and tostring(list[1].tools[1].name) or "<tool>"))
  add("")
  for _, h in ipairs(list) do
    if h.tools then
      add(("- `%s`: %s"):format(h.name, #h.tools == 0 and "no tools at the moment" or (#h.tools .. " tools")))
      for _, t in ipairs(h.tools) do
        local d = type(t.description) == "string" and t.description:match("^%s*([^\n]*)") or ""
        if #d > HOST_DESCRIPTION_MAX then d = d:sub(1, text.utf8_floor(d, HOST_DESCRIPTION_MAX)) .. "…" end
        add(("  - `%s`%s"):format(tostring(t.name), d ~= "" and (": " .. d) or ""))
      end
    else
      add(("- `%s`: its tools could not be listed when you started (%s); list them through your MCP client.")
        :format(h.name, tostring(h.error or "unknown error")))
    end
  end
  add("")
end

--- Adds the context file's section on child sandboxes (through the `demesne` MCP server) to
--- `add`, when the run's CLI is wired to its endpoint (o.run.mcp_servers). The limits come
--- from o.endpoint.tree (lua/tree's tree.info: {depth, limits = {depth, children, running},
--- children_used, budget_usd, spent_usd}); missing ones are left out.
---@param o table  the plan
---@param add fun(line: string)
function agent.context_children(o, add)
  local servers = o.run and o.run.mcp_servers
  if type(o.endpoint) ~= "table" then return end
  if not servers or #servers == 0 then
    add("## demesne")
    add("")
    add("demesne's MCP server (Streamable HTTP) is at `$DEMESNE_MCP_URL` with `Authorization: Bearer "
      .. "$DEMESNE_MCP_TOKEN`; your CLI is not connected to it.")
    add("")
    return
  end
  local t = type(o.endpoint.tree) == "table" and o.endpoint.tree or {}
  local limits = type(t.limits) == "table" and t.limits or {}
  local depth, max = tonumber(t.depth), tonumber(limits.depth)
  add("## Child sandboxes (the `demesne` tools)")
  add("")
  add("You can hand work to child sandboxes with the tools of the MCP server `demesne` (already connected, no "
    .. "approval needed). Each child is a fresh disposable container started by the host, not inside yours.")
  if o.provider.mcp_hint then
    local ok, hint = pcall(o.provider.mcp_hint, servers[1].name)
    if ok and type(hint) == "string" and hint ~= "" then add(hint) end
  end
  add("")
  add("- `sandbox_script`: run a shell command in a fresh sandbox (pick an `image`); returns its exit code and output.")
  add("- `sandbox_agent`: another AI agent with a prompt of its own (and a `model`); `sandbox_research`: an agent "
    .. "with open network access and no inputs, for web research.")
  add("- `sandbox_create`, `sandbox_exec`, `sandbox_destroy`: a sandbox that stays up for several commands.")
  add("- `sandbox_status`, `sandbox_wait`, `sandbox_cancel`, `sandbox_jobs`: children running in the background.")
  add("- `sandbox_usage_report`: the cost and tokens of everything below you.")
  add("")
  add("How children relate to you:")
  add("")
  add("- Every spawning call takes a `name`: lowercase letters, digits and inner hyphens, at most 40 characters, "
    .. "unique among your children for your whole run (a name is used up even when the spawn fails). Use "
    .. "distinct, descriptive names (`fetch-data`, `review-2`).")
  add("- A child's `/out` is your `/out/child/<name>/` (read-only for you): read its results there.")
  add("- Script, create and agent children see your `/in` read-only and share your `/workspace` read-write: hand "
    .. "them files through `/workspace` and give each child its own paths to write.")
  add("- A child sees the output of each child you spawned before it at `/in/previous-jobs/<name>/`.")
  add("- `sandbox_research` children get none of that (no `/in`, no `/workspace`, no previous jobs).")
  add("- A child's egress is never wider than yours; `open` is only for `sandbox_research`.")
  add("- Children you leave running are cancelled when you finish.")
  add("")
  add("Habits that work:")
  add("")
  add("- Fan out with `background: true`: each spawn answers at once with a `job_id`. Then call `sandbox_wait` "
    .. "on every job as a barrier. From here `sandbox_wait` waits at most a few minutes and then answers "
    .. "`status: running`: call it again until the status is final. Block (no `background`) only for short calls.")
  add("- Check each child's `status` and `exit_code`; for a failed one read `/out/child/<name>/stderr.log` (a "
    .. "script) or its `results.json` and `transcript.jsonl` (an agent).")
  add("- Verify claims with a script child (build, run the tests) instead of trusting an answer.")
  add("- Your caller reads your `/out` and your final message, not your children's answers: copy or summarise "
    .. "what must surface into your own `/out` files yourself (a child cannot write there).")
  add("")
  add("Limits of this tree:")
  add("")
  if depth and max then
    if depth >= max then
      add(("- You are at depth %d, the deepest allowed (%d): you cannot spawn children; do the work yourself."):format(
        depth, max))
    else
      add(("- You are at depth %d (the host's run is 0); children may go down to depth %d."):format(depth, max))
    end
  end
  if tonumber(limits.children) then
    add(("- At most %d children in your run."):format(math.floor(limits.children)))
  end
  if tonumber(limits.running) then
    add(("- At most %d sandboxes of the whole tree run at once (you included); a spawn past that waits its turn.")
      :format(math.floor(limits.running)))
  end
  local budget = tonumber(t.budget_usd)
  if budget then
    local spent = tonumber(t.spent_usd) or 0
    add(("- The whole tree may spend %s on model requests (%s left when you started). Past it every model request "
      .. "is refused and every run of the tree ends: prefer scripts to agents where a script will do, and a "
      .. "cheaper model for simple work."):format(usd(budget), usd(math.max(budget - spent, 0))))
  else
    add("- No budget is set for the tree's model requests; spend with care all the same.")
  end
  add("")
end

--- The context file's text.
function agent.context_text(o, args)
  local out = {}
  local function add(s) out[#out + 1] = s end
  if args.preamble and args.preamble ~= "" then add(args.preamble) add("") end
  add("# Your environment")
  add("")
  add("You run with full autonomy inside a disposable Linux container that is removed when you finish. "
    .. "Nobody answers questions: decide and proceed.")
  add("")
  if o.workspace and o.endpoint then
    add("- `/workspace`: your writable working folder, shared with the child sandboxes of your tree (removed "
      .. "when the run that made it ends).")
  else
    add("- `/workspace`: your writable working folder (scratch; discarded after the run).")
  end
  add("- `/out`: the deliverables folder. Everything written here is kept on the host.")
  add(("- `%s`: this file and the task (read-only)."):format(AGENT_DIR))
  if #(o.mounts or {}) > 0 then
    add("- `/in`: read-only inputs from the host:")
    for _, m in ipairs(o.mounts) do
      local sibling = m.target:match("^/in/previous%-jobs/(.+)$")
      if sibling then
        add(("  - `%s` (the output of `%s`, a child your parent spawned before you)"):format(m.target, sibling))
      elseif m.target:sub(1, 4) == "/in/" or m.target == "/in" then
        add("  - `" .. m.target .. "`")
      end
    end
  end
  add("")
  add("## Network")
  add("")
  add(EGRESS_TEXT[o.egress.name] or ("Egress policy `" .. o.egress.name .. "`: other hosts are refused."))
  add("")
  agent.context_children(o, add)
  agent.context_host_mcp(o, add)
  add("## Definition of done")
  add("")
  local any = false
  if args.success_criteria and #args.success_criteria > 0 then
    for _, c in ipairs(args.success_criteria) do add("- [ ] " .. c) any = true end
  end
  if args.output_path then
    add(("- [ ] The deliverable is written to `/out/%s`%s."):format(args.output_path,
      args.output_format and (" as " .. args.output_format) or "")) any = true
  elseif args.output_format then
    add("- [ ] Deliverables in `/out` are in this format: " .. args.output_format) any = true
  end
  add("- [ ] Your final message summarises what you did and where the results are.")
  if not any then add("- [ ] The task below is complete.") end
  add("")
  add("## Task")
  add("")
  add(args.prompt)
  add("")
  return table.concat(out, "\n")
end

--------------------------------------------------------------------------------------------
-- Attempts and session resumes. The sandbox runs a generated wrapper (/.demesne/agent/run.sh)
-- instead of the CLI itself: it runs the CLI, then reports the attempt's end to the vendor
-- route (POST /.demesne/attempt, see lua/vendor.lua) and, told `resume <session>` once a
-- vendor rate limit has reset, runs the CLI again resuming that session (the provider's
-- argv with run.resume_session). Both attempts write to the same stdout, so
-- transcript.jsonl holds the whole run. The decision is the host's (agent.decide).

local RESUME_MARK = "\1demesne-session\1"
local RESUME_PROMPT = "Your previous turn was interrupted by a vendor rate limit that has now reset. "
  .. "Continue the task from where you left off."
agent.RESUME_PROMPT = RESUME_PROMPT

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- One argv as a sh command line; the argument equal to RESUME_MARK becomes "$session".
local function command_line(argv)
  local parts = {}
  for i, a in ipairs(argv) do
    a = tostring(a)
    if a == RESUME_MARK then parts[i] = '"$session"'
    elseif a:find("\1demesne-session\1", 1, true) then
      error("provider argv: the session to resume must be an argument of its own", 0)
    elseif a:find("\0", 1, true) then error("provider argv: an argument holds a NUL byte", 0)
    else parts[i] = sh_quote(a) end
  end
  return table.concat(parts, " ")
end

--- The wrapper script that runs a provider's CLI and resumes its session when the host says
--- so. `p`: the provider; `run`: its ProviderRun (without resume_session). Errors (a string)
--- when the provider's argv cannot be written as a command line. `resumable` is false when
--- the provider's argv ignores run.resume_session (then a rate-limited run ends).
---@param p table
---@param run table
---@return string script  sh source
---@return boolean resumable
function agent.wrapper(p, run)
  local fresh = command_line(p.argv(run))
  local again = {}
  for k, v in pairs(run) do again[k] = v end
  again.resume_session, again.resume_prompt = RESUME_MARK, RESUME_PROMPT
  local resume = command_line(p.argv(again))
  local resumable = resume:find('"$session"', 1, true) ~= nil
  if not resumable then resume = 'exit "$code" # this provider does not resume sessions' end
  return table.concat({
    "# Generated by demesne (lua/agent.lua) for one agent run: runs the CLI; after each attempt",
    "# asks the host (the vendor route) whether to resume the session once a rate limit reset.",
    "attempt=1",
    "session=",
    "while :; do",
    '  if [ -z "$session" ]; then',
    "    " .. fresh,
    "  else",
    "    " .. resume,
    "  fi",
    "  code=$?",
    "  tries=0",
    "  while :; do",
    "    next=$(curl -sS --fail --noproxy '*' -X POST -H \"authorization: Bearer $DEMESNE_VENDOR_TOKEN\" \\",
    "      -H 'content-type: application/json' --data \"{\\\"attempt\\\":$attempt,\\\"exit_code\\\":$code}\" \\",
    "      \"$DEMESNE_VENDOR_URL" .. vendor.ATTEMPT_PATH .. "\" </dev/null)",
    "    rc=$?",
    "    [ \"$rc\" -eq 0 ] && break",
    "    # no route (a server restart in progress): try again for up to 10 minutes",
    "    case $rc in 7|52|56) ;; *) exit \"$code\" ;; esac",
    "    tries=$((tries + 1))",
    "    [ \"$tries\" -ge 120 ] && exit \"$code\"",
    "    sleep 5",
    "  done",
    '  case "$next" in',
    '    "resume "*)',
    '      session=${next#resume }',
    "      attempt=$((attempt + 1))",
    '      echo "demesne: the rate limit has reset; resuming session $session (attempt $attempt)" >&2',
    "      ;;",
    '    *) exit "$code" ;;',
    "  esac",
    "done",
    "",
  }, "\n"), resumable
end

--- Decides what an agent's wrapper does after an attempt of its CLI ended (the vendor
--- route's `decide`). Resumes when the attempt ended non-zero and rate limited (a 429 went
--- to the agent during it, or the transcript says so), the CLI named its session, a reset
--- time is known, and the budget, the longest wait and the run's deadline allow it. The
--- answer for an attempt is kept in the route's saved state, so a wrapper asking again after
--- a server restart gets the same one and the budget is drawn on once.
---@param provider table  the provider adapter (parse_answer)
---@param output_dir string
---@param route table     the vendor route (rate state, deadline)
---@param info table      {attempt, exit_code}
---@return table decision  {action = "resume", session, at (epoch s)} or {action = "stop", why?}
function agent.decide(provider, output_dir, route, info, resumable)
  local rate = route.rate
  rate.decided = type(rate.decided) == "table" and rate.decided or {}
  local key = tostring(info.attempt)
  if rate.decided[key] then return rate.decided[key] end
  local now = loop.time()
  local function stop(why)
    if why then rate.why = why end
    return { action = "stop", why = why }
  end
  local d = (function()
    if info.exit_code == 0 then return stop() end
    local text, terr = output.tail(output_dir, "transcript.jsonl", TRANSCRIPT_MAX)
    if not text then return stop("demesne cannot read the transcript: " .. tostring(terr)) end
    local ok, _, details = pcall(provider.parse_answer, providers.lines(text))
    if not ok or type(details) ~= "table" then details = {} end
    local passed = type(rate.passed_at) == "number" and rate.passed_at >= (rate.attempt_started or 0)
    if not (details.rate_limited or passed) then return stop() end
    if rate.why and not passed then return stop(rate.why) end
    if resumable == false then return stop(("provider %s does not resume sessions"):format(provider.name)) end
    local session = details.session_id
    if type(session) ~= "string" or #session > 200 or not session:match("^[%w][%w%-_.:]*$") then
      return stop("the CLI named no session to resume")
    end
    if rate.used >= rate.budget then return stop(("retry budget of %d exhausted"):format(rate.budget)) end
    local reset_at = epoch_seconds(rate.reset_at)
    local said = epoch_seconds(details.resets_at)
    if said and (not reset_at or said > reset_at) then reset_at = said end
    if type(reset_at) ~= "number" then return stop("no reset time in the answer") end
    local wait = math.max(1, reset_at - now + 1)
    local max = tonumber(config.get("agent_rate_limit_max_wait_seconds")) or 3600
    if wait > max + 1 then
      return stop(("reset in %d s is beyond the longest wait (%d s)"):format(math.ceil(wait), max))
    end
    if route.deadline and now + wait >= route.deadline - vendor.DEADLINE_MARGIN then
      return stop("reset is after the run's timeout")
    end
    rate.used = rate.used + 1
    rate.resumed = (rate.resumed or 0) + 1
    rate.why = nil
    return { action = "resume", session = session, at = now + wait }
  end)()
  -- only a granted resume is kept (the budget is drawn on once): at most `budget` entries
  if d.action == "resume" then rate.decided[key] = d end
  rate.attempt_started = d.at or now
  route:save_rate()
  return d
end

--- The vendor route options that make a route answer an agent's wrapper (see agent.decide).
---@param provider table
---@param output_dir string
---@param resumable boolean|nil  false: the provider's argv cannot resume (agent.wrapper)
---@return fun(route: table, info: table): table
function agent.decider(provider, output_dir, resumable)
  return function(route, info) return agent.decide(provider, output_dir, route, info, resumable) end
end

--- The name the agent CLIs know demesne's in-sandbox MCP server by (Claude Code's tools are
--- then mcp__demesne__<tool>; Codex's sit in a namespace mcp__demesne).
agent.MCP_SERVER = "demesne"
--- The variable that holds the in-sandbox endpoint's token (set by lua/tree with the URL in
--- DEMESNE_MCP_URL).
agent.MCP_TOKEN_ENV = "DEMESNE_MCP_TOKEN"
local MCP_STARTUP_MS = 60 * 1000
local MCP_CALL_MARGIN_S = 60
local HOST_MCP_MARGIN_MS = 15 * 1000

-- Sets (or replaces) variables in an environment list of "NAME=value" strings.
local function set_env(list, vars)
  local at = {}
  for i, kv in ipairs(list) do
    local k = kv:match("^([^=]+)=")
    if k then at[k] = i end
  end
  local names = {}
  for k in pairs(vars) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local kv = k .. "=" .. tostring(vars[k])
    if at[k] then list[at[k]] = kv else list[#list + 1] = kv; at[k] = #list end
  end
end

--- The MCP servers an agent run's CLI is given: demesne's in-sandbox endpoint when the run
--- has one (o.endpoint, set by lua/tree's plan hook) and the provider takes MCP servers
--- (mcp = "http"); else none. A call may take as long as the run may last (plus a margin):
--- no CLI is to give up on a child call before its own run ends. Then one server per host
--- MCP server offered to the run (o.host_mcp, set by the plan hook: {name, url, timeout_ms}),
--- on the same endpoint and token, its tool timeout the upstream's call bound plus a margin
--- (the host answers a call that ran out of time before the CLI gives up on it). A host
--- server named like demesne's own is never wired (the configuration refuses that name).
---@param o table  the plan
---@return ProviderMcpServer[]
function agent.mcp_servers(o)
  local e = o.endpoint
  if type(e) ~= "table" or o.provider.mcp ~= "http" then return {} end
  local out = { { name = agent.MCP_SERVER, url = e.url, token = e.token, token_env = agent.MCP_TOKEN_ENV,
    tool_timeout_ms = (o.timeout + MCP_CALL_MARGIN_S) * 1000, startup_timeout_ms = MCP_STARTUP_MS } }
  for _, h in ipairs(type(o.host_mcp) == "table" and o.host_mcp or {}) do
    if h.name ~= agent.MCP_SERVER then
      out[#out + 1] = { name = h.name, url = h.url, token = e.token, token_env = agent.MCP_TOKEN_ENV,
        tool_timeout_ms = math.floor(h.timeout_ms) + HOST_MCP_MARGIN_MS, startup_timeout_ms = MCP_STARTUP_MS }
    end
  end
  return out
end

--- Wires the run's CLI from what the plan knows now: run.mcp_servers (agent.mcp_servers),
--- the wrapper (o.wrapper, o.resumable), the provider's environment over o.env, and the
--- provider's extra files. Called when the run is planned (no endpoint yet) and again just
--- before the sandbox is made. Fails (sandbox.fail) naming the provider when its argv or
--- files cannot be used. Returns the files to write into the agent folder (name -> text).
---@param o table  the plan (agent.prepare)
---@return table<string,string>
function agent.wire(o)
  local p, run = o.provider, o.run
  local servers = agent.mcp_servers(o)
  run.mcp_servers = #servers > 0 and servers or nil
  local wok, script, resumable = pcall(agent.wrapper, p, run)
  if not wok then fail(("provider %s: %s"):format(p.name, tostring(script))) end
  o.wrapper, o.resumable = script, resumable
  if o.env then
    local eok, env = pcall(p.env, run)
    if not eok or type(env) ~= "table" then fail(("provider %s: env: %s"):format(p.name, tostring(env))) end
    set_env(o.env, env)
  end
  local files, ferr = providers.run_files(p, run, { ["prompt.md"] = true, ["run.sh"] = true,
    [p.context_file_name] = true })
  if not files then fail(("provider %s: %s"):format(p.name, ferr)) end
  return files
end

--- Checks a call and plans the run (nothing started). `tool`: "sandbox_agent" or
--- "sandbox_research". `kind`: the container kind ("oneshot" or "job").
function agent.prepare(args, tool, kind)
  local p, model, cred = providers.resolve(args.model)
  if not p then fail(model) end
  if tool == "sandbox_research" then
    args.files, args.directories = nil, nil
    -- gVisor gives no network but loopback: the open network becomes the proxy's web policy
    args.egress = (args.isolation or config.get("isolation_default")) == "gvisor" and "web" or "open"
  else
    args.egress = args.egress or "none"
    if args.egress ~= "none" and args.egress ~= "package-managers" then
      fail(("egress: %q is not permitted for sandbox_agent (none or package-managers)"):format(args.egress))
    end
    -- by property, not by name: a user file may replace package-managers with an open policy
    if egress.is_unrestricted(args.egress) then
      fail(("egress: the policy %q gives open egress (a bridge network, or a rule for any host), which "
        .. "sandbox_agent does not run with; sandbox_research is the open-network agent"):format(args.egress))
    end
  end
  if args.output_path and (args.output_path:find("^/") or args.output_path:find("%.%.")) then
    fail("output_path: must be a relative path inside /out without '..'")
  end
  local timeout = sandbox.timeout(args.timeout_seconds)
  if p.refresh then -- a login kept on the host (Codex's ChatGPT login) is renewed before the run
    local rok, ok, rerr = pcall(p.refresh, cred, timeout + 600)
    if not rok then ok, rerr = nil, tostring(ok) end
    if not ok then fail(("model: provider %s: %s"):format(p.name, tostring(rerr))) end
  end
  local o = sandbox.prepare(args, kind or "oneshot", tool, timeout + 600)
  o.provider, o.model, o.credential = p, model, cred
  o.token = providers.new_token()
  o.timeout, o.exec_id, o.name = timeout, "main", "demesne-" .. o.run_id
  o.image_arg = p.image
  o.stdout_path = "/out/transcript.jsonl"
  o.cwd = "/workspace"
  o.extra_relay = vendor.relay_args()
  local run = {
    prompt_file = AGENT_DIR .. "/prompt.md",
    context_file = AGENT_DIR .. "/" .. p.context_file_name,
    model = model, vendor_base_url = vendor.base_url(), token = o.token, workdir = "/workspace",
    home = "/root", credential_kind = cred.kind, max_retries = 2,
    -- the vendor route may hold a rate-limited request until the reset: the CLI must not give up first
    request_timeout_ms = (math.min(tonumber(config.get("agent_rate_limit_hold_seconds")) or 60, timeout) + 600) * 1000,
  }
  o.run = run
  run.agent_dir = AGENT_DIR
  o.argv = { "/bin/sh", AGENT_DIR .. "/run.sh" }
  agent.wire(o) -- refuses a provider whose argv cannot be run now, before anything is made
  local env = sandbox.default_env(o.run_id, o.egress)
  for k, v in pairs(p.env(run)) do env[k] = v end
  env.DEMESNE_VENDOR_URL, env.DEMESNE_VENDOR_TOKEN = vendor.base_url(), o.token
  o.env = sandbox.env(nil, env)
  o.args = args
  local host_agent_dir = o.run_dir .. "/agent"
  o.before_create = function(plan)
    -- the run's MCP endpoint is known now (the plan hooks ran): wire it into the CLI
    local files = agent.wire(plan)
    -- the run folder is the sandbox's to write once it runs: written through held folders
    local run <close> = assert(fs.opendir(plan.run_dir))
    assert(run:mkdir("agent", 493))
    local dir <close> = assert(run:opendir("agent"))
    assert(dir:write_atomic("prompt.md", args.prompt .. "\n"))
    assert(dir:write_atomic(p.context_file_name, agent.context_text(plan, args)))
    assert(dir:write_atomic("run.sh", plan.wrapper))
    for name, text in pairs(files) do assert(dir:write_atomic(name, text)) end
    plan.mounts[#plan.mounts + 1] = { host = host_agent_dir, target = AGENT_DIR }
    local route, verr = vendor.start({ run_id = plan.run_id, run_dir = plan.run_dir, output_dir = plan.output_dir,
      provider = p, token = plan.token, credential = cred, deadline = loop.time() + plan.timeout,
      decide = agent.decider(p, plan.output_dir, plan.resumable) })
    if not route then fail(verr) end
    plan.vendor = route
  end
  return o
end

--- The final reason of a run that ended rate limited. `rate`: {budget, reset_at, why}.
function agent.rate_reason(rate)
  local why = rate.why
  if not why and rate.retried and rate.budget and rate.retried >= rate.budget then
    why = ("retry budget of %d exhausted"):format(rate.budget)
  end
  why = why or "the CLI gave up"
  local at = ""
  local reset_at = epoch_seconds(rate.reset_at)
  if reset_at then at = os.date("!(reset at %Y-%m-%dT%H:%M:%SZ)", math.floor(reset_at)) end
  return ("rate limited by the vendor; %s%s"):format(why, at ~= "" and (" " .. at) or "")
end

--- After the container stopped: stops the vendor route and builds the result (also written
--- to results.json). `code, err` as script_wait returned them; `reason` (optional) says why
--- the run ended early (a cancel), replacing the message built from `err`. Returns the
--- result and, when demesne could not read the run's exit status, transcript or stderr
--- (a FIFO, a link, a malformed status.json …), a message naming what failed: the result
--- then says so in `reason` and `is_error`, and must not be taken for a success.
---@return table result, string|nil read_error
function agent.finish(o, code, err, duration_ms, reason)
  if o.vendor then o.vendor:stop() end
  local read_error
  local sok, st = pcall(sandbox.read_status, o.run_dir, o.exec_id)
  if not sok then
    read_error = type(st) == "table" and tostring(st.message) or tostring(st)
    st = nil
  end
  local exit_code = st and st.exit_code or code
  local timed_out = (st and st.timed_out) or (code == nil and err and tostring(err):find("timed out") ~= nil) or false
  local text, terr = output.tail(o.output_dir, "transcript.jsonl", TRANSCRIPT_MAX)
  if not text then read_error, text = read_error or tostring(terr), "" end
  local ok, answer, details = pcall(o.provider.parse_answer, providers.lines(text))
  if not ok then answer, details = nil, {} end
  if type(answer) == "string" and #answer > ANSWER_MAX then
    answer = answer:sub(1, require("core.text").utf8_floor(answer, ANSWER_MAX)) .. "\n[answer truncated]"
  end
  local stderr, serr = output.tail(o.output_dir, "stderr.log", STDERR_MAX)
  if not stderr then read_error, stderr = read_error or tostring(serr), "" end
  local totals = o.vendor and o.vendor:totals() or { models = {}, cost_usd = 0 }
  local r = {
    exit_code = exit_code, answer = answer or "", stderr = stderr, output_dir = o.output_dir, run_id = o.run_id,
    provider = o.provider.name, model = o.model, cost_usd = totals.cost_usd, usage = totals.models,
    duration_ms = duration_ms, timed_out = timed_out and true or false,
    is_error = type(details) == "table" and details.is_error or nil,
    session_id = type(details) == "table" and details.session_id or nil,
  }
  if reason then r.reason = reason
  elseif exit_code == nil then r.reason = "the agent run failed: " .. tostring(err) end
  local rate = totals.rate_limited
  if type(rate) == "table" then
    r.rate_limited = { answers = rate.answers, retried = rate.retried, held = rate.held, resumed = rate.resumed,
      budget = rate.budget }
    local limited_end = type(details) == "table" and details.rate_limited
    if r.reason == nil and exit_code ~= 0 and (limited_end or rate.why) then
      r.reason = agent.rate_reason(rate)
    end
  elseif r.reason == nil and exit_code ~= 0 and type(details) == "table" and details.rate_limited then
    r.reason = agent.rate_reason({ budget = require("demesne.vendor").rate_budget(),
      reset_at = details.resets_at })
  end
  if read_error then
    r.reason = "demesne could not read the run's results: " .. read_error
    r.is_error = true
  end
  for _, fn in ipairs(agent.hooks.result) do
    local hok, herr = pcall(fn, o, r)
    if not hok then log.warning("demesne.agent", "result hook: %s", tostring(herr)) end
  end
  local jok, text_out = pcall(json.encode, r)
  if jok then -- the output folder is the sandbox's: written through the held folder
    local out, oerr = fs.opendir(o.output_dir)
    local w, werr = nil, oerr
    if out then
      w, werr = out:write_atomic("results.json", text_out .. "\n")
      out:close()
    end
    if not w then log.warning("demesne.agent", "results.json: %s", tostring(werr)) end
  end
  vendor.forget(o.run_id)
  if r.exit_code == nil then r.exit_code = -1 end
  return r, read_error
end

--- Runs an agent to the end (foreground). Returns the result.
function agent.run(ctx, args, tool)
  local o = agent.prepare(args, tool)
  local started = loop.hrtime()
  local finished = false
  local _ <close> = setmetatable({}, { __close = function()
    if not o.removed then sandbox.script_remove(o) end
    if not finished and o.vendor then -- cancelled or failed on the way: still say so in results.json
      pcall(agent.finish, o, nil, nil, math.floor((loop.hrtime() - started) / 1e6),
        "the call ended before the agent did (cancelled by the client, or the server stopped)")
    end
    if o.vendor then o.vendor:stop() end
    vendor.forget(o.run_id)
    sandbox.remove_tree(o.run_dir)
  end })
  sandbox.script_start(ctx, o)
  local _hb <close> = require("demesne.progress").heartbeat(ctx)
  local code, err = sandbox.script_wait(o, (o.timeout + 30) * 1000)
  sandbox.script_remove(o)
  o.removed = true
  finished = true
  local r, read_error = agent.finish(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
  if read_error then sandbox.fail(r.reason) end
  return r
end

--- Readable text of a result.
function agent.text(r)
  local lines = {
    ("exit_code: %d%s"):format(r.exit_code, r.timed_out and " (timed out)" or ""),
    "output_dir: " .. r.output_dir, "run_id: " .. r.run_id,
    ("model: %s (%s)"):format(tostring(r.model), tostring(r.provider)),
    ("cost_usd: %.4f (indicative)"):format(r.cost_usd or 0),
  }
  if r.reason then lines[#lines + 1] = "reason: " .. r.reason end
  lines[#lines + 1] = "--- answer ---"
  lines[#lines + 1] = r.answer
  if r.exit_code ~= 0 and r.stderr ~= "" then
    lines[#lines + 1] = "--- stderr (tail) ---"
    lines[#lines + 1] = r.stderr
  end
  return table.concat(lines, "\n")
end

--- The outputSchema of both tools.
function agent.result_schema()
  return { type = "object", properties = {
    exit_code = { type = "integer" }, answer = { type = "string", description = "the agent's final message (bounded)" },
    stderr = { type = "string", description = "tail of the CLI's stderr" },
    output_dir = { type = "string" }, run_id = { type = "string" }, provider = { type = "string" },
    model = { type = "string" }, cost_usd = { type = "number", description = "indicative cost in USD" },
    usage = { type = "object", description = "tokens by model (see usage.json)" },
    duration_ms = { type = "integer" }, timed_out = { type = "boolean" },
    reason = { type = "string", description = "why the run ended abnormally (e.g. rate limited by the vendor)" },
    rate_limited = { type = "object", description = "vendor 429 answers; how many were waited out (retried = held "
      .. "requests + resumed sessions) and the budget" },
    children = { type = "array", items = { type = "object" }, description = "the child sandboxes it spawned: name, "
      .. "kind, status, exit_code, reason, cost_usd (own), total_cost_usd (its subtree), output_dir, run_id, job_id" },
    total_cost_usd = { type = "number", description = "this run's cost and that of every sandbox below it" },
  }, required = json.array({ "exit_code", "answer", "stderr", "output_dir", "run_id", "cost_usd", "usage" }) }
end

--- The descriptor of sandbox_agent (research = false) or sandbox_research (true).
function agent.descriptor(research)
  local schemas = require("demesne.schemas")
  local name = research and "sandbox_research" or "sandbox_agent"
  local props = {
    prompt = { type = "string", minLength = 1, description = "The task for the agent." },
    model = agent.model_schema(),
    preamble = { type = "string", description = "Text placed before everything else in the agent's context file." },
    output_path = { type = "string", minLength = 1, description = "Where the deliverable goes, relative to /out." },
    output_format = { type = "string", description = "The deliverable's format (e.g. 'markdown report', 'JSON')." },
    success_criteria = { type = "array", items = { type = "string", minLength = 1 },
      description = "Checks rendered as the definition of done in the context file." },
    timeout_seconds = schemas.timeout_seconds,
    background = schemas.background,
    budget_usd = schemas.budget_usd,
    tree = schemas.tree,
    isolation = schemas.isolation,
  }
  if research then
    props.isolation = { type = "string", enum = json.array({ "container", "gvisor" }), description =
      schemas.isolation.description .. " Under gvisor the research run's network is the proxy's web policy (any "
        .. "host name on ports 80 and 443, public addresses only, each request in egress.jsonl) instead of an "
        .. "open network." }
  end
  if not research then
    props.files = schemas.files()
    props.directories = schemas.directories()
    props.egress = { type = "string", enum = json.array({ "none", "package-managers" }), default = "none",
      description = "'none' (default): only the model API; 'package-managers': also package registries." }
    props.host_mcp = { type = "array", uniqueItems = true,
      items = { type = "string", minLength = 1, maxLength = 64, pattern = "^[A-Za-z0-9][A-Za-z0-9_-]*$" },
      description = "The host MCP servers (host_mcp in demesne's configuration) whose allowed tools the agent "
        .. "gets, each as an MCP server of its own; default: all configured ones ([] = none). From inside a "
        .. "sandbox: at most the calling agent's." }
  end
  return {
    name = name,
    title = research and "Research with an AI agent (open network)" or "Run an AI coding agent in a sandbox",
    description = (research
      and "Runs an AI agent CLI (Claude Code, Codex, …) with full autonomy in a fresh sandbox with open network "
        .. "access and no host inputs, for web research. "
      or "Runs an AI coding agent CLI (Claude Code, Codex, …) with full autonomy in a fresh sandbox: host inputs "
        .. "read-only under /in, a writable /workspace, deliverables in /out (output_dir). ")
      .. "The real vendor credential stays on the host: the agent reaches the model only through a per-run "
      .. "token on a host-side vendor route that counts usage (usage.json). Returns the agent's final answer, "
      .. "exit code, cost and usage; transcript.jsonl and results.json are in output_dir.",
    inputSchema = { type = "object", additionalProperties = false, required = { "prompt" }, properties = props },
    outputSchema = schemas.or_job(agent.result_schema()),
    execution = { taskSupport = "optional" },
    annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = true },
    run = function(ctx, args)
      if args.background then
        local jobs = require("demesne.jobs")
        local j = jobs.start_agent(ctx, args, name)
        return j, jobs.started_text(j)
      end
      local r = agent.run(ctx, args, name)
      return r, agent.text(r)
    end,
  }
end

return agent
