-- The "agent" kind of background job (sandbox_agent and sandbox_research with background =
-- true): how an agent run starts as a job, is watched, and is re-attached after a restart.
--
-- An agent job is a one-shot sandbox (watched as the "script" kind watches its container)
-- plus the run's vendor route, stopped once the container has; results.json is written
-- before the terminal record. After a restart the route is started again with the per-run
-- token kept in the record (never the credential), so the agent's model calls go on.
local agent = require("demesne.agent")
local continue = require("demesne.agent.continue")
local fs = require("core.fs")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local log = require("demesne.log")
local providers = require("demesne.providers")
local repo = require("demesne.repo")
local resume = require("demesne.agent.resume")
local sandbox = require("demesne.sandbox")
local plan = require("demesne.sandbox.plan")
local util = require("demesne.util")
local vendor = require("demesne.vendor")

local LOGGER = "demesne.jobs"
local closer, now_ms = util.closer, util.now_ms
local script = require("demesne.jobs.script") -- the one-shot container this kind runs its agent in

local kind = {}

--- sandbox_agent / sandbox_research with background = true: plans the run (agent.prepare),
--- starts its sandbox and vendor route and hands them to a job. Returns {job_id, status =
--- "running", output_dir, run_id}.
---@param ctx ToolContext
---@param args table
---@param tool string|nil  "sandbox_agent" (the default) or "sandbox_research"
---@return table started
function kind.start(ctx, args, tool)
  tool = tool or "sandbox_agent"
  agent.resolve_continue(ctx, args, tool)
  local o = agent.prepare(args, tool, "job")
  local res = table.pack(pcall(script.launch, ctx, o, {
    tool = tool, kind = "agent", command = jobs.short(args.prompt), provider = o.provider.name, model = o.model,
    vendor_token = o.token, resumable = o.resumable, stdout_file = "transcript.jsonl",
  }, function()
    if o.vendor then o.vendor:stop() end
    repo.cleanup(o)
  end))
  if not res[1] then
    continue.abandon(o) -- it never started: its keep is freed (a new one goes)
    error(res[2], 0)
  end
  return table.unpack(res, 2, res.n)
end

-- Writes results.json (agent.finish), logging instead of raising: the job's outcome
-- stands, except that a run whose results demesne could not read (a FIFO, a link, a
-- malformed status.json: the sandbox writes them) did not succeed.
local function finish(rec, o, out, duration_ms, reason)
  local ok, r, read_error = pcall(agent.finish, o, out and out.exit_code, out and out.reason, duration_ms, reason)
  if not ok then log.warning(LOGGER, "%s: results.json: %s", rec.job_id, tostring(r)) end
  if ok and type(r) == "table" and r.branch then
    rec.branch = r.branch -- also for a cancel (no outcome here): jobs.finish saves the record
    if type(out) == "table" then out.branch = r.branch end
  end
  if ok and read_error and out and out.status == "succeeded" then
    return { status = "failed", exit_code = out.exit_code, reason = r.reason }
  end
  return out
end

--- Watches a job this server started (in the job's task).
---@param job table
---@param o table  the plan of agent.prepare, its sandbox started
---@return JobOutcome
function kind.run(job, o)
  job.after = function()
    sandbox.remove_tree(o.run_dir)
    vendor.forget(o.run_id)
    repo.cleanup(o)
  end
  local started = now_ms()
  local finished = false
  -- a cancel: the container goes first (script.watch), then the vendor route stops (its
  -- held requests and timers with it) and results.json says the run was cancelled
  local _ <close> = closer(function()
    if finished then return end
    finish(job.rec, o, nil, now_ms() - started, "cancelled: " .. tostring(job.cancel_reason or "cancelled"))
    if o.vendor then o.vendor:stop() end
  end)
  local out = script.watch(job, o)
  finished = true
  return finish(job.rec, o, out, now_ms() - started)
end

--- Re-attaches to a job a server that is gone left running: the vendor route is started
--- again with the token kept in the record, the container watched like a script job.
---@param job table
---@return JobOutcome
function kind.attach(job)
  local rec = job.rec
  local p = rec.provider and providers.get(rec.provider)
  local route
  if p and rec.vendor_token then
    local cred, why = providers.ready(p)
    if cred then
      local err
      route, err = vendor.start({ run_id = rec.run_id, run_dir = rec.run_dir,
        output_dir = rec.output_dir, provider = p, token = rec.vendor_token, credential = cred,
        deadline = rec.started_ms / 1000 + rec.timeout_seconds,
        decide = resume.decider(p, rec.output_dir, rec.resumable) })
      if not route then log.warning(LOGGER, "%s: vendor route: %s", rec.job_id, tostring(err)) end
    else
      log.warning(LOGGER, "%s: vendor route not restarted: %s", rec.job_id, tostring(why))
    end
  end
  -- the result names the run as a tree node (o.tree) so that results.json lists its children
  -- (plan.from_record: the plan as the record kept it) a repository run's saved plan: its
  -- branch still comes back
  local o = plan.from_record(rec, { provider = p, vendor = route, model = rec.model, tree = rec.run_id,
    repo = repo.load(rec.run_id) })
  local finished = false
  local _ <close> = closer(function()
    if finished or not route then return end
    finish(rec, o, nil, now_ms() - rec.started_ms, "cancelled: " .. tostring(job.cancel_reason or "cancelled"))
    route:stop()
    vendor.forget(rec.run_id)
  end)
  local out = script.attach(job)
  finished = true
  local after = job.after
  job.after = function()
    if after then after() end
    vendor.forget(rec.run_id)
    repo.forget(rec.run_id)
  end
  if route then out = finish(rec, o, out, now_ms() - rec.started_ms) end
  return out
end

local RESULT_FIELDS = { "answer", "reason", "cost_usd", "usage", "rate_limited", "model", "provider", "session_id",
  "is_error", "continues" }

-- results.json of an ended agent job (written by agent.finish; read confined: no link
-- followed, a regular file of at most 256 KiB): the decoded object, nil when there is
-- none, or nil and why it cannot be used (the sandbox can write its output folder).
local function read_results(rec)
  if type(rec.output_dir) ~= "string" then return nil end
  local d, derr, dcode = fs.opendir(rec.output_dir)
  if not d and dcode == "ENOENT" then return nil end
  local text, err, code
  if d then
    text, err, code = d:read("results.json", 256 * 1024)
    d:close()
  else
    err, code = derr, dcode
  end
  if not text then
    if code == "ENOENT" then return nil end
    return nil, "cannot read results.json: " .. tostring(err)
  end
  local ok, r = pcall(json.decode_arrays, text) -- [] stays an array (children)
  if not ok or type(r) ~= "table" or json.is_array(r) then
    return nil, "results.json in the output folder is not a JSON object"
  end
  return r
end

-- An ended agent job's result reduced to the fields a job's view carries; nil when there is
-- none; {is_error = true, reason} when results.json cannot be used.
local function summary(rec)
  local r, why = read_results(rec)
  if not r then return why and { is_error = true, reason = why } or nil end
  local out = {}
  for _, k in ipairs(RESULT_FIELDS) do
    if r[k] ~= nil and r[k] ~= json.null then out[k] = r[k] end
  end
  return out
end

local function of_type(v, t, default)
  if type(v) == t then return v end
  return default
end

--- An ended agent job's result as the sandbox_agent call would have returned it in the
--- foreground (jobs.result, for MCP tasks/result): results.json (written by agent.finish
--- once the container was gone) with the run's identity, exit code and duration from the
--- host's job record, and its text (agent.text). The caller checks it against the tool's
--- outputSchema.
---@param rec JobRecord  an ended agent job that ran to an exit status
---@return table structured, string text
function kind.result(rec)
  local doc, why = read_results(rec)
  local r = {}
  for k, v in pairs(doc or {}) do r[k] = v end
  r.exit_code, r.output_dir, r.run_id = rec.exit_code, rec.output_dir, rec.run_id
  r.duration_ms = math.max((rec.finished_ms or rec.started_ms) - rec.started_ms, 0)
  r.timed_out = rec.timed_out == true or r.timed_out == true
  r.provider, r.model = of_type(r.provider, "string", rec.provider), of_type(r.model, "string", rec.model)
  r.answer, r.stderr = of_type(r.answer, "string", ""), of_type(r.stderr, "string", "")
  r.cost_usd, r.usage = of_type(r.cost_usd, "number", 0), of_type(r.usage, "table", {})
  r.reason = of_type(r.reason, "string", nil)
  if not doc then r.reason = why or "the run left no results.json" end
  return r, agent.text(r)
end

--- The view of an agent job adds `agent`: its result once it has ended (jobs.view).
---@param rec JobRecord
---@return table|nil
function kind.view(rec)
  if jobs.is_terminal(rec.status) then return { agent = summary(rec) } end
  return nil
end

return kind
