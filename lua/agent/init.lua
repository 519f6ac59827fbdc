-- Agent runs (sandbox_agent, sandbox_research): an AI coding agent CLI from a provider
-- adapter (lua/providers) in a fresh sandbox of the provider's image, with the vendor route
-- (lua/vendor/) as its only way to the model and the real credential kept on the host.
--
-- Layout inside the sandbox: /workspace (writable scratch, the agent's working folder),
-- /out (deliverables; the host's output folder), /in (read-only host inputs, sandbox_agent
-- only), /.demesne/agent (read-only: the prompt and the generated context file). The CLI's
-- event stream goes to /out/transcript.jsonl while it runs; stderr to /out/stderr.log.
-- After the run, results.json in the output folder holds the result the tool returns.
local config = require("demesne.config")
local context = require("demesne.agent.context")
local continue = require("demesne.agent.continue")
local devcontainer = require("demesne.images.devcontainer")
local errors = require("demesne.errors")
local egress_policy = require("demesne.egress.policy")
local fs = require("core.fs")
local json = require("demesne.json")
local layer = require("demesne.layer")
local log = require("demesne.log")
local loop = require("core.loop")
local core_text = require("core.text")
local output = require("demesne.output")
local progress = require("demesne.progress")
local providers = require("demesne.providers")
local repo = require("demesne.repo")
local resume = require("demesne.agent.resume")
local sandbox = require("demesne.sandbox")
local sandbox_plan = require("demesne.sandbox.plan")
local util = require("demesne.util")
local vendor = require("demesne.vendor")

local agent = {}

-- The layers above (nested sandboxes, lua/tree) see each run's result through the layer
-- hook agent_result(o, r) (lua/layer.lua), run once it is built, before results.json is
-- written (it may add fields: children, reason); an error of one is logged.

local AGENT_DIR = "/.demesne/agent"
local ANSWER_MAX = 16 * 1024
local STDERR_MAX = 4 * 1024
-- The tail of transcript.jsonl that is read for the answer and the rate-limit signals (its
-- last providers.LINES_MAX lines): the sandbox writes it, and decoding it is work on the loop.
local TRANSCRIPT_MAX = 1024 * 1024

local fail = errors.raise

--- The `model` parameter's schema: an enum of the models that can be used now (when any).
function agent.model_schema()
  local models = providers.available_models()
  local s = { type = "string", minLength = 1, description =
    "The model (it picks the provider); default: the first available provider's default model."
    .. (#models > 0 and (" Available: " .. table.concat(models, ", ") .. ".") or " No provider has credentials now.") }
  if #models > 0 then s.enum = json.array(models) end
  return s
end

--- The name the agent CLIs know demesne's in-sandbox MCP server by (Claude Code's tools are
--- then mcp__demesne__<tool>; Codex's sit in a namespace mcp__demesne).
agent.MCP_SERVER = context.MCP_SERVER
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
--- before the sandbox is made. Fails (errors.raise) naming the provider when its argv or
--- files cannot be used. Returns the files to write into the agent folder (name -> text).
---@param o table  the plan (agent.prepare)
---@return table<string,string>
function agent.wire(o)
  local p, run = o.provider, o.run
  local servers = agent.mcp_servers(o)
  run.mcp_servers = #servers > 0 and servers or nil
  local wok, script, resumable = pcall(resume.wrapper, p, run)
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
---@param args table     the tool's arguments (prompt, model, image, …)
---@param tool string
---@param kind string|nil
---@return table plan
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
    if egress_policy.is_unrestricted(args.egress) then
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
  continue.plan(o, args) -- a continue resumes the session of the run it continues
  o.argv = { "/bin/sh", AGENT_DIR .. "/run.sh" }
  agent.wire(o) -- refuses a provider whose argv cannot be run now, before anything is made
  local env = sandbox.default_env(o.run_id, o.egress)
  for k, v in pairs(p.env(run)) do env[k] = v end
  env.DEMESNE_VENDOR_URL, env.DEMESNE_VENDOR_TOKEN = vendor.base_url(), o.token
  o.env = sandbox.env(nil, env)
  o.args = args
  local host_agent_dir = o.run_dir .. "/agent"
  if args.repository ~= nil then
    -- the agent works in a clone of the host repository; its branch comes back (lua/repo)
    -- a continue works on in the clone its kept /workspace holds (run.sh's setup keeps it)
    -- and fast-forwards the branch from the head the run it continues handed back
    local c = continue.repo_opts(o)
    local rok, rerr = pcall(repo.prepare, o, args.repository, { include_uncommitted = args.include_uncommitted,
      depth = args.depth, name = args.branch or c.name, expect = c.expect, base = c.base, host_head = c.host_head,
      context = p.context_file_name })
    if not rok then
      repo.cleanup(o)
      error(rerr, 0)
    end
    run.workdir = o.repo.path
    repo.add_env(o)
  else
    repo.only_with(args)
  end
  if args.image ~= nil then
    -- the repository's own environment with the provider's CLI added (lua/images/devcontainer.lua)
    local dok, derr = pcall(function()
      if args.image ~= devcontainer.IMAGE then
        fail(("image: %q: an agent runs in its provider's image, or in the repository's devcontainer "
          .. "(\"devcontainer\")"):format(tostring(args.image)))
      end
      devcontainer.plan(o, args, { agent = p.image })
    end)
    if not dok then
      repo.cleanup(o)
      error(derr, 0)
    end
  end
  o.before_create = function(plan)
    continue.started(plan) -- its place in a tree is known now: recorded for a later continue
    -- the run's MCP endpoint is known now (the plan hooks ran): wire it into the CLI
    local files = agent.wire(plan)
    -- the run folder is the sandbox's to write once it runs: written through held folders
    local run_folder <close> = assert(fs.opendir(plan.run_dir))
    assert(run_folder:mkdir("agent", 493))
    local dir <close> = assert(run_folder:opendir("agent"))
    assert(dir:write_atomic("prompt.md", args.prompt .. "\n"))
    assert(dir:write_atomic(p.context_file_name, context.text(plan, args)))
    assert(dir:write_atomic("run.sh", plan.wrapper))
    for name, text in pairs(files) do assert(dir:write_atomic(name, text)) end
    plan.mounts[#plan.mounts + 1] = { host = host_agent_dir, target = AGENT_DIR }
    local route, verr = vendor.start({ run_id = plan.run_id, run_dir = plan.run_dir, output_dir = plan.output_dir,
      provider = p, token = plan.token, credential = cred, deadline = loop.time() + plan.timeout,
      decide = resume.decider(p, plan.output_dir, plan.resumable) })
    if not route then fail(verr) end
    plan.vendor = route
  end
  continue.claim(o) -- last: nothing after it fails (the run's keep: its HOME and /workspace)
  return o
end

--- The final reason of a run that ended rate limited. `rate`: {budget, reset_at, why}.
---@param rate table
---@return string
function agent.rate_reason(rate)
  local why = rate.why
  if not why and rate.retried and rate.budget and rate.retried >= rate.budget then
    why = ("retry budget of %d exhausted"):format(rate.budget)
  end
  why = why or "the CLI gave up"
  local at = ""
  local reset_at = resume.reset_time(rate.reset_at)
  if reset_at then at = "(reset at " .. util.iso(reset_at) .. ")" end
  return ("rate limited by the vendor; %s%s"):format(why, at ~= "" and (" " .. at) or "")
end

--- After the container stopped: stops the vendor route and builds the result (also written
--- to results.json). `code, err` as script_wait returned them; `reason` (optional) says why
--- the run ended early (a cancel), replacing the message built from `err`. Returns the
--- result and, when demesne could not read the run's exit status, transcript or stderr
--- (a FIFO, a link, a malformed status.json …), a message naming what failed: the result
--- then says so in `reason` and `is_error`, and must not be taken for a success.
---@return table result, string|nil read_error
---@param o table            the plan (agent.prepare)
---@param code integer|nil
---@param err string|nil
---@param duration_ms integer
---@param reason string|nil
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
    answer = answer:sub(1, core_text.utf8_floor(answer, ANSWER_MAX)) .. "\n[answer truncated]"
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
  local q = sandbox.quota_outcome(o) -- the output quota stopped it (lua/sandbox/quota.lua)
  if q then
    r.reason, r.output_quota, r.is_error = q.reason, q.output_quota, true
    if r.exit_code == nil then r.exit_code = 137 end
  elseif reason then r.reason = reason
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
    r.reason = agent.rate_reason({ budget = vendor.rate_budget(),
      reset_at = details.resets_at })
  end
  if read_error then
    r.reason = "demesne could not read the run's results: " .. read_error
    r.is_error = true
  end
  -- a repository run: the container has stopped; its branch comes back (never raises)
  if o.repo then r.branch = repo.hand_back(o, r) end
  -- recorded for a later continue (with the branch, which a continue fast-forwards)
  local cok, cerr = pcall(continue.finished, o, r)
  if not cok then log.warning("demesne.agent", "%s: keep: %s", tostring(o.run_id), tostring(cerr)) end
  layer.run("agent_result", o, r)
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

--- A call's `continue` (sandbox_agent): checked against the run it continues and the call
--- filled from it (lua/agent/continue.lua: continue.resolve, scoped to ctx.caller's subtree
--- from inside a tree). Fails (errors.raise) naming the field and the reason.
---@param ctx table|nil  the tool call's context
---@param args table
---@param tool string
function agent.resolve_continue(ctx, args, tool)
  if args.continue == nil then return end
  if tool ~= "sandbox_agent" then fail("continue: only sandbox_agent continues a run") end
  continue.resolve(type(ctx) == "table" and ctx.caller or nil, args)
end

--- The runs of a run's chain of continues, first to latest ({run_id, status, exit_code,
--- cost_usd, continues, started, finished} each), or nil when the run kept nothing.
---@param run_id string
---@return table[]|nil
function agent.chain(run_id) return continue.chain(run_id) end

--- Runs an agent to the end (foreground). Returns the result.
---@param ctx table   the tool call's context (progress, cancel)
---@param args table
---@param tool string  "sandbox_agent" or "sandbox_research"
---@return table result
function agent.run(ctx, args, tool)
  agent.resolve_continue(ctx, args, tool)
  local o = agent.prepare(args, tool)
  local started = loop.hrtime()
  local finished = false
  local _ <close> = util.closer(function()
    -- cancelled: a repository run is stopped gently first, so that its branch comes back
    if not finished and o.repo then sandbox.script_stop_gently(o) end
    if not o.removed then sandbox.script_remove(o) end
    if not finished and o.vendor then -- cancelled or failed on the way: still say so in results.json
      pcall(agent.finish, o, nil, nil, math.floor((loop.hrtime() - started) / 1e6),
        "the call ended before the agent did (cancelled by the client, or the server stopped)")
    end
    if o.vendor then o.vendor:stop() end
    if not finished and not o.vendor then continue.abandon(o) end -- it never started
    vendor.forget(o.run_id)
    sandbox.remove_tree(o.run_dir)
    repo.cleanup(o)
  end)
  sandbox.script_start(ctx, o)
  sandbox_plan.launched(o) -- from here on the plan is only read (its live state: its SandboxRun)
  local _hb <close> = progress.heartbeat(ctx)
  local code, err = sandbox.script_wait(o, (o.timeout + 30) * 1000)
  sandbox.script_remove(o)
  o.removed = true
  finished = true
  local r, read_error = agent.finish(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
  if read_error then errors.raise(r.reason) end
  return r
end

--- Readable text of a result.
---@param r table  a result of agent.finish
---@return string
function agent.text(r)
  local lines = {
    ("exit_code: %d%s"):format(r.exit_code, r.timed_out and " (timed out)" or ""),
    "output_dir: " .. r.output_dir, "run_id: " .. r.run_id,
    ("model: %s (%s)"):format(tostring(r.model), tostring(r.provider)),
    ("cost_usd: %.4f (indicative)"):format(r.cost_usd or 0),
  }
  if r.continues then table.insert(lines, 4, "continues: " .. r.continues) end
  if r.reason then lines[#lines + 1] = "reason: " .. r.reason end
  if r.branch then lines[#lines + 1] = repo.text(r.branch) end
  lines[#lines + 1] = "--- answer ---"
  lines[#lines + 1] = r.answer
  if r.exit_code ~= 0 and r.stderr ~= "" then
    lines[#lines + 1] = "--- stderr (tail) ---"
    lines[#lines + 1] = r.stderr
  end
  return table.concat(lines, "\n")
end

return agent
