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
local json = require("demesne.json")
local loop = require("core.loop")
local output = require("demesne.output")
local providers = require("demesne.providers")
local sandbox = require("demesne.sandbox")
local vendor = require("demesne.vendor")

local agent = {}

local AGENT_DIR = "/.demesne/agent"
local ANSWER_MAX = 16 * 1024
local STDERR_MAX = 4 * 1024
-- The tail of transcript.jsonl that is read for the answer and the rate-limit signals (its
-- last providers.LINES_MAX lines): the sandbox writes it, and decoding it is work on the loop.
local TRANSCRIPT_MAX = 1024 * 1024

local function fail(msg) sandbox.fail(msg) end

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
  add("- `/workspace`: your writable working folder (scratch; discarded after the run).")
  add("- `/out`: the deliverables folder. Everything written here is kept on the host.")
  add(("- `%s`: this file and the task (read-only)."):format(AGENT_DIR))
  if #(o.mounts or {}) > 0 then
    add("- `/in`: read-only inputs from the host:")
    for _, m in ipairs(o.mounts) do
      if m.target:sub(1, 4) == "/in/" or m.target == "/in" then add("  - `" .. m.target .. "`") end
    end
  end
  add("")
  add("## Network")
  add("")
  add(EGRESS_TEXT[o.egress.name] or ("Egress policy `" .. o.egress.name .. "`: other hosts are refused."))
  add("")
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
    local reset_at = rate.reset_at
    if type(details.resets_at) == "number" and (not reset_at or details.resets_at > reset_at) then
      reset_at = details.resets_at
    end
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

--- Checks a call and plans the run (nothing started). `tool`: "sandbox_agent" or
--- "sandbox_research". `kind`: the container kind ("oneshot" or "job").
function agent.prepare(args, tool, kind)
  local p, model, cred = providers.resolve(args.model)
  if not p then fail(model) end
  if tool == "sandbox_research" then
    args.files, args.directories = nil, nil
    args.egress = "open"
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
  local wok, script, resumable = pcall(agent.wrapper, p, run)
  if not wok then fail(("provider %s: %s"):format(p.name, tostring(script))) end
  o.wrapper, o.resumable = script, resumable
  o.argv = { "/bin/sh", AGENT_DIR .. "/run.sh" }
  local env = sandbox.default_env(o.run_id, o.egress)
  for k, v in pairs(p.env(run)) do env[k] = v end
  env.DEMESNE_VENDOR_URL, env.DEMESNE_VENDOR_TOKEN = vendor.base_url(), o.token
  o.env = sandbox.env(nil, env)
  o.args = args
  local host_agent_dir = o.run_dir .. "/agent"
  o.before_create = function(plan)
    -- the run folder is the sandbox's to write once it runs: written through held folders
    local run <close> = assert(fs.opendir(plan.run_dir))
    assert(run:mkdir("agent", 493))
    local dir <close> = assert(run:opendir("agent"))
    assert(dir:write_atomic("prompt.md", args.prompt .. "\n"))
    assert(dir:write_atomic(p.context_file_name, agent.context_text(plan, args)))
    assert(dir:write_atomic("run.sh", plan.wrapper))
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
  if type(rate.reset_at) == "number" then at = os.date("!(reset at %Y-%m-%dT%H:%M:%SZ)", math.floor(rate.reset_at)) end
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
  local jok, text_out = pcall(json.encode, r)
  if jok then -- the output folder is the sandbox's: written through the held folder
    local out, oerr = fs.opendir(o.output_dir)
    local w, werr = nil, oerr
    if out then
      w, werr = out:write_atomic("results.json", text_out .. "\n")
      out:close()
    end
    if not w then require("demesne.log").warning("demesne.agent", "results.json: %s", tostring(werr)) end
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
  }
  if not research then
    props.files = schemas.files()
    props.directories = schemas.directories()
    props.egress = { type = "string", enum = json.array({ "none", "package-managers" }), default = "none",
      description = "'none' (default): only the model API; 'package-managers': also package registries." }
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
