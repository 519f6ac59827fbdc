-- JSON Schema pieces shared by the sandbox tools, so every tool spells a parameter the same way.
local json = require("demesne.json")
local paths = require("demesne.paths")
local repo = require("demesne.repo")

local schemas = {}

--- A list of strings, described.
---@param desc string
---@return table schema
function schemas.string_list(desc)
  return { type = "array", items = { type = "string" }, description = desc }
end

--- The `files` parameter: host files mounted read-only at /in/<basename>; the description
--- names the allowed roots (read when called).
---@return table schema
function schemas.files()
  return schemas.string_list("Host files mounted read-only at /in/<basename>. " .. paths.describe_roots())
end

--- The `directories` parameter: host folders mounted read-only at /in/<basename>.
---@return table schema
function schemas.directories()
  return schemas.string_list("Host folders mounted read-only at /in/<basename>. " .. paths.describe_roots())
end

schemas.image = { type = "string", description =
  "Image: a built-in one (default: base + python3 + nodejs + build-essential + git; base; python; node; go; "
  .. "browser: headless Chromium + Playwright + React, `render-png`; media: ffmpeg, ImageMagick, vips, sox; "
  .. "webgamedev: Phaser 4 + Vite template in /opt/game-template, `playtest-game`; twine: extwee, "
  .. "`twine-compile`, `playtest-story`), a user image from $XDG_CONFIG_HOME/demesne/images/, or the "
  .. "reference of an image (pulled with the host's registry credentials when the engine lacks it). Each works "
  .. "with no network once built. Default: default. "
  .. "\"devcontainer\": the environment the repository (or a directories entry) declares in "
  .. ".devcontainer/devcontainer.json, built on first use." }

schemas.env = { type = "object", additionalProperties = { type = "string" },
  description = "Environment variables for the command (string values). Names starting with DEMESNE_ are reserved." }

schemas.timeout_seconds = { type = "integer", minimum = 1, description =
  "Seconds before the command's whole process group is killed. Default 3600; the ceiling comes from the configuration." }

schemas.limits = { type = "object", additionalProperties = false, description =
  "Resource limits; defaults and ceilings come from the configuration.",
  properties = {
    memory_mb = { type = "integer", minimum = 16, description = "memory limit in MiB" },
    cpus = { type = "number", minimum = 0.01, description = "CPU limit (fractional CPUs)" },
    pids = { type = "integer", minimum = 8, description = "maximum number of processes" },
  } }

--- The `egress` parameter of sandbox_script and sandbox_create.
schemas.egress = { type = "string", minLength = 1, description =
  "Egress policy: 'package-managers' (default: package registries only), 'none' (no network), "
  .. "'open' (unrestricted; refused when files or directories are mounted), 'allowlist' "
  .. "(DEMESNE_EGRESS_ALLOW), or a policy from the user's policies folder. "
  .. "Everything goes through a proxy that judges each host name; see egress.jsonl in output_dir." }

--- The `isolation` parameter of every tool that makes a sandbox.
schemas.isolation = { type = "string", enum = json.array({ "container", "gvisor" }), description =
  "The wall between the sandbox and the host. 'container': the engine's namespaces, capabilities and seccomp "
  .. "(default unless the configuration says otherwise). 'gvisor': a second wall: the sandbox runs on gVisor's own "
  .. "kernel, so its system calls never reach the host kernel directly; slower to start, and a call that asks for "
  .. "it where the engine has no gVisor fails instead of running without it." }

--- The `host_mcp` parameter of sandbox_agent: the host MCP servers (lua/hostmcp) offered to
--- the run, by name (lua/tree checks the names and inherits a parent's set).
schemas.host_mcp = { type = "array", uniqueItems = true,
  items = { type = "string", minLength = 1, maxLength = 64, pattern = "^[A-Za-z0-9][A-Za-z0-9_-]*$" },
  description = "The host MCP servers (host_mcp in demesne's configuration) whose allowed tools the agent "
    .. "gets, each as an MCP server of its own; default: all configured ones ([] = none). From inside a "
    .. "sandbox: at most the calling agent's." }

schemas.sandbox_id = { type = "string", minLength = 1, description = "The id returned by sandbox_create." }

--- A port of a sandbox to preview (sandbox_create's ports, sandbox_expose's port).
schemas.port = { type = "integer", minimum = 1, maximum = 65535 }

--- The previews of a sandbox in a result: [{port, url}] (lua/sandbox/preview.lua).
schemas.previews = { type = "array", description = "port previews: each sandbox port (on its 127.0.0.1) at a URL on "
  .. "the host's loopback; the URL carries the preview's secret (open it as it is, in a browser on this host)",
  items = { type = "object", required = json.array({ "port", "url" }), properties = {
    port = { type = "integer" }, url = { type = "string" } } } }

--- The result of a command: shared by sandbox_script and sandbox_exec.
---@param extra table<string, table>|nil  more properties
---@return table schema
function schemas.run_result(extra)
  local props = {
    exit_code = { type = "integer", description = "the command's exit status (128+N when killed by signal N)" },
    stdout = { type = "string", description = "head and tail of stdout (full stream in stdout.log)" },
    stderr = { type = "string", description = "head and tail of stderr (full stream in stderr.log)" },
    output_dir = { type = "string", description = "host folder that was /out; kept after the sandbox goes" },
    duration_ms = { type = "integer" },
    timed_out = { type = "boolean" },
    truncated = { type = "boolean", description = "true when stdout or stderr was cut; the logs hold everything" },
    oom_killed = { type = "string", description = "present when the kernel killed a process in the sandbox for "
      .. "lack of memory while the command ran: says so, with the sandbox's memory limit" },
    reason = { type = "string", description = "present when demesne stopped the run: \"output quota exceeded\"" },
    output_quota = { type = "object", description = "with that reason: the bytes the output folder took once the "
      .. "sandbox stopped, output_max_bytes, and which limit it passed",
      properties = { written_bytes = { type = "integer" }, max_bytes = { type = "integer" },
        detail = { type = "string" } } },
    devcontainer = { type = "object", description = "with image \"devcontainer\": the folder and file it came from, "
      .. "the image built, its forwardPorts, the create steps run, the features installed (in order) and notes",
      properties = { source = { type = "string" }, file = { type = "string" }, image = { type = "string" },
        ports = { type = "array", items = { type = "integer" } }, steps = { type = "array", items = { type = "string" } },
        features = { type = "array", items = { type = "string" } }, notes = { type = "array", items = { type = "string" } } } },
  }
  for k, v in pairs(extra or {}) do props[k] = v end
  return { type = "object", properties = props,
    required = json.array({ "exit_code", "stdout", "stderr", "output_dir", "duration_ms", "timed_out", "truncated" }) }
end

--- Readable text for a command result (the structured result carries the same).
---@param r table  a result of sandbox.run_script or sandbox.exec
---@return string
function schemas.run_text(r)
  local lines = {
    ("exit_code: %d%s"):format(r.exit_code, r.timed_out and " (timed out)" or ""),
    "output_dir: " .. r.output_dir,
  }
  if r.run_id then lines[#lines + 1] = "run_id: " .. r.run_id end
  if r.oom_killed then lines[#lines + 1] = "oom_killed: " .. r.oom_killed end
  if r.output_quota then
    lines[#lines + 1] = ("reason: %s (%s; %s bytes written)"):format(tostring(r.reason), tostring(r.output_quota.detail),
      tostring(r.output_quota.written_bytes))
  end
  lines[#lines + 1] = ("duration_ms: %d"):format(r.duration_ms)
  lines[#lines + 1] = "--- stdout ---"
  lines[#lines + 1] = r.stdout
  lines[#lines + 1] = "--- stderr ---"
  lines[#lines + 1] = r.stderr
  return table.concat(lines, "\n")
end

schemas.background = { type = "boolean", default = false, description =
  "Return at once with a job_id instead of waiting; follow the job with sandbox_status (read stdout "
  .. "incrementally with `since`), sandbox_wait and sandbox_cancel. The job survives a server restart." }

--- An outputSchema that is either `result` (the call ran to the end) or a started
--- background job {job_id, status = "running", output_dir, …} (background = true).
---@param result table  the schema of the result (properties, required)
---@param extra table<string, table>|nil  more properties
---@return table schema
function schemas.or_job(result, extra)
  local props = {}
  for k, v in pairs(result.properties) do props[k] = v end
  props.job_id = { type = "string", description = "background: the job's id, for sandbox_status/wait/cancel" }
  props.status = { type = "string", description = "background: the job's status (running)" }
  for k, v in pairs(extra or {}) do props[k] = v end
  return { type = "object", properties = props,
    anyOf = json.array({ { required = result.required }, { required = json.array({ "job_id", "status", "output_dir" }) } }) }
end

--------------------------------------------------------------------------------------------
-- Background jobs (sandbox_status, sandbox_wait, sandbox_cancel, sandbox_jobs)

schemas.job_id = { type = "string", minLength = 1,
  description = "The job_id a call with background: true returned (job-…)." }

schemas.job_status = { type = "string", enum = json.array({ "running", "succeeded", "failed", "cancelled", "lost" }) }

--- The properties of a job's view (jobs.view), plus `extra`.
---@param extra table<string, table>|nil
---@return table<string, table> properties
function schemas.job_properties(extra)
  local props = {
    job_id = { type = "string" },
    status = schemas.job_status,
    tool = { type = "string", description = "the tool that started the job" },
    started_at = { type = "string", description = "ISO 8601, UTC" },
    finished_at = { type = "string", description = "ISO 8601, UTC; absent while running" },
    elapsed_seconds = { type = "number", description = "seconds since the start; frozen once the job ended" },
    exit_code = { type = "integer", description = "the command's exit status, once known" },
    timed_out = { type = "boolean" },
    reason = { type = "string", description = "why the job failed, was cancelled or was lost" },
    output_dir = { type = "string", description = "host folder that is the sandbox's /out" },
    log_dir = { type = "string", description = "folder of the job's stdout.log and stderr.log" },
    run_id = { type = "string" },
    sandbox_id = { type = "string" },
    parent = { type = "string", description = "the job that started this one" },
    children = { type = "array", items = { type = "string" }, description = "jobs this one started" },
    message = { type = "string" },
    agent = { type = "object", description = "an ended agent job's result (from results.json in output_dir): "
      .. "answer, reason, cost_usd, usage, rate_limited, model, session_id" },
    branch = repo.SCHEMA,
    previews = { type = "array", items = { type = "object" }, description = "while the job runs: the port previews "
      .. "of its sandbox, [{port, url}] (sandbox_expose from inside the sandbox)" },
    tree = { type = "object", description = "when the job runs a sandbox tree (or a node of one): its live cost "
      .. "(cost_usd of the subtree), nodes, running, and the tree's budget_usd and spent_usd" },
  }
  for k, v in pairs(extra or {}) do props[k] = v end
  return props
end

--- outputSchema of a job's status (sandbox_status, sandbox_wait, sandbox_cancel).
---@param extra table<string, table>|nil  more properties
---@return table schema
function schemas.status_result(extra)
  return { type = "object", properties = schemas.job_properties(extra),
    required = json.array({ "job_id", "status", "elapsed_seconds", "started_at" }) }
end

--- Readable text for a job's view.
---@param r table  jobs.view's result, with the tool's own fields
---@return string
function schemas.status_text(r)
  local lines = { "job_id: " .. r.job_id, "status: " .. r.status }
  if r.exit_code then lines[#lines + 1] = ("exit_code: %d%s"):format(r.exit_code, r.timed_out and " (timed out)" or "") end
  lines[#lines + 1] = ("elapsed_seconds: %.1f"):format(r.elapsed_seconds)
  if r.reason then lines[#lines + 1] = "reason: " .. r.reason end
  if r.message then lines[#lines + 1] = "message: " .. r.message end
  if r.output_dir then lines[#lines + 1] = "output_dir: " .. r.output_dir end
  if type(r.branch) == "table" then lines[#lines + 1] = repo.text(r.branch) end
  if type(r.tree) == "table" then
    lines[#lines + 1] = ("tree: %d sandbox(es), %d running, cost_usd %.4f%s"):format(r.tree.nodes or 0,
      r.tree.running or 0, r.tree.cost_usd or 0,
      r.tree.budget_usd and (" of a budget of %.2f"):format(r.tree.budget_usd) or "")
  end
  if type(r.agent) == "table" then
    if type(r.agent.cost_usd) == "number" then lines[#lines + 1] = ("cost_usd: %.4f (indicative)"):format(r.agent.cost_usd) end
    if type(r.agent.reason) == "string" and r.agent.reason ~= r.reason then
      lines[#lines + 1] = "agent reason: " .. r.agent.reason
    end
    if type(r.agent.answer) == "string" then lines[#lines + 1] = "--- answer ---\n" .. r.agent.answer end
  end
  return table.concat(lines, "\n")
end

--------------------------------------------------------------------------------------------
-- Nested sandboxes (lua/tree): what a host call sets for the tree its run roots

--- A host call's budget for the model requests of the tree its run roots (lua/tree).
schemas.budget_usd = { type = "number", minimum = 0, description =
  "USD this run and every sandbox it spawns may spend on model requests together; once spent, every run of the "
  .. "tree ends ('budget of $X spent'). Default and ceiling from the configuration." }

--- A host call's limits of the tree its run roots (lua/tree).
schemas.tree = { type = "object", additionalProperties = false, description =
  "Limits of the sandbox tree rooted here (defaults and ceilings from the configuration).",
  properties = {
    depth = { type = "integer", minimum = 1, description = "deepest level below this run (3)" },
    children = { type = "integer", minimum = 1, description = "children one run may spawn (32)" },
    running = { type = "integer", minimum = 1, description = "sandboxes running at once, this one included (8)" },
    memory_mb = { type = "number", exclusiveMinimum = 0, description = "MiB the tree's running sandboxes may hold "
      .. "together, this one included (default: this run's limits.memory_mb x running)" },
    cpus = { type = "number", exclusiveMinimum = 0, description = "CPUs the tree's running sandboxes may hold together "
      .. "(default: this run's limits.cpus x running)" },
    pids = { type = "integer", minimum = 1, description = "processes the tree's running sandboxes may hold together "
      .. "(default: this run's limits.pids x running)" },
    jobs = { type = "integer", minimum = 1, description = "background jobs running at once on the sandboxes below "
      .. "this run (32)" },
    job_records = { type = "integer", minimum = 1, description = "job records kept of those jobs; at it the oldest "
      .. "finished one's goes (256)" },
  } }

--- sandbox_script/sandbox_create: serve demesne's MCP endpoint inside the sandbox (lua/tree).
schemas.mcp = { type = "boolean", default = false, description =
  "Serve demesne's MCP endpoint inside ($DEMESNE_MCP_URL, token in $DEMESNE_MCP_TOKEN) so its commands can spawn "
  .. "child sandboxes; their outputs appear at /out/child/<name>." }

--------------------------------------------------------------------------------------------
-- Agent runs (sandbox_agent, sandbox_research)

--- The end of both agent tools' descriptions: where the credential stays, what comes back.
schemas.AGENT_RUN_NOTE = "The real vendor credential stays on the host: the agent reaches the model only through a "
  .. "per-run token on a host-side vendor route that counts usage (usage.json). Returns the agent's final answer, "
  .. "exit code, cost and usage; transcript.jsonl and results.json are in output_dir."

--- The parameters of an agent run that both agent tools take (prompt, preamble,
--- output_path, output_format, success_criteria, timeout_seconds, background, budget_usd, tree,
--- isolation), plus `extra`.
---@param extra table<string, table>|nil
---@return table<string, table> properties
function schemas.agent_task(extra)
  local props = {
    prompt = { type = "string", minLength = 1, description = "The task for the agent." },
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
  for k, v in pairs(extra or {}) do props[k] = v end
  return props
end

--- The result of an agent run: the outputSchema of both agent tools (without the job form).
---@return table
function schemas.agent_result()
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
    session_id = { type = "string", description = "the CLI's session (Claude Code) or thread (Codex)" },
    continues = { type = "string", description = "the run this one continues (sandbox_agent `continue`)" },
    previews = { type = "array", items = { type = "object" }, description = "the port previews the agent opened "
      .. "(sandbox_expose from inside): sandbox_id, port, url; each closed once its sandbox has gone" },
  }, required = json.array({ "exit_code", "answer", "stderr", "output_dir", "run_id", "cost_usd", "usage" }) }
end

--- The descriptor of a tool that changes the state of one persistent sandbox named by its
--- `sandbox_id` (sandbox_pause, sandbox_resume, sandbox_destroy). Its input is that one
--- parameter; its result is what `d.call(ctx, args)` returns, {sandbox_id, status, …}, its
--- outputSchema those two (status one of `d.statuses`) plus `d.properties`, and its text
--- "<status>: <sandbox_id>", followed by a line of `d.text(result)` when that gives one.
--- Its annotations: not read-only, idempotent, closed world, destructive when `d.destructive`.
---@param d { name: string, title: string, description: string, statuses: string[], properties?: table<string, table>, destructive?: boolean, call: fun(ctx: table, args: table): table, text?: fun(r: table): string|nil }
---@return table descriptor  a tool descriptor (lua/tools/init.lua)
function schemas.sandbox_state_tool(d)
  local properties = { sandbox_id = { type = "string" }, status = { type = "string", enum = d.statuses } }
  for k, v in pairs(d.properties or {}) do properties[k] = v end
  return {
    name = d.name,
    title = d.title,
    description = d.description,
    inputSchema = {
      type = "object",
      additionalProperties = false,
      required = { "sandbox_id" },
      properties = { sandbox_id = schemas.sandbox_id },
    },
    outputSchema = { type = "object", required = json.array({ "sandbox_id", "status" }), properties = properties },
    annotations = { readOnlyHint = false, destructiveHint = d.destructive == true, idempotentHint = true,
      openWorldHint = false },
    run = function(ctx, args)
      local r = d.call(ctx, args)
      local text = ("%s: %s"):format(r.status, r.sandbox_id)
      local more = d.text and d.text(r)
      if more then text = text .. "\n" .. more end
      return r, text
    end,
  }
end

return schemas
