-- MCP tasks (2025-11-25, experimental, SEP-1686) for tools/call, mapped onto background
-- jobs (lua/jobs/): a task is a job and its taskId is the job id.
--
--   tools/call {…, task: {ttl?}}  → the tool runs with background = true (tools that declare
--                                   execution.taskSupport "optional" or "required") and the
--                                   answer is CreateTaskResult {task}
--   tasks/get {taskId}            → the task
--   tasks/result {taskId}         → waits for the end; the CallToolResult the call would have
--                                   given without a task, with _meta related-task
--   tasks/list                    → every job as a task (one page)
--   tasks/cancel {taskId}         → sandbox_cancel; a task that has ended is refused (-32602)
--
-- Status mapping: running → working; a job whose command ran to an exit status (whatever
-- its code) → completed, as the call without a task would have returned a normal result;
-- failed without an exit status, and lost → failed; cancelled → cancelled.
local config = require("demesne.config")
local errors = require("demesne.errors")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local schemas = require("demesne.schemas")
local tools = require("demesne.tools")
local util = require("demesne.util")

local tasks = {}

local INVALID_PARAMS, METHOD_NOT_FOUND = -32602, -32601
local RELATED = "io.modelcontextprotocol/related-task"
local POLL_MS = 1000

local function rpc_error(code, message) error({ rpc_error = true, code = code, message = message }, 0) end

--- The server capability, sent in the initialize result for 2025-11-25.
---@return table
function tasks.capability()
  return { list = {}, cancel = {}, requests = { tools = { call = {} } } }
end

-- A job record, or a -32602 error naming the taskId.
local function must_get(id)
  if type(id) ~= "string" then rpc_error(INVALID_PARAMS, "params.taskId: expected a string") end
  local rec = jobs.get(id)
  if not rec then rpc_error(INVALID_PARAMS, ("params.taskId: no task %s"):format(id)) end
  return rec
end

local function status_of(rec)
  local s = rec.status
  if s == "running" then return "working" end
  if s == "cancelled" then return "cancelled" end
  if rec.exit_code ~= nil and (s == "succeeded" or s == "failed") then return "completed" end
  return "failed"
end

--- The Task object of a job record.
---@param rec JobRecord
---@return table
function tasks.task_of(rec)
  local v = jobs.view(rec)
  local msg = rec.reason
  if rec.status == "running" then msg = ("running for %d s"):format(math.floor(v.elapsed_seconds)) end
  return {
    taskId = rec.job_id,
    status = status_of(rec),
    statusMessage = msg,
    createdAt = v.started_at,
    lastUpdatedAt = util.iso_ms(rec.updated_ms or rec.finished_ms or rec.started_ms),
    ttl = math.floor(config.get("jobs_keep_seconds") * 1000),
    pollInterval = POLL_MS,
  }
end

--- The CallToolResult a job's call would have returned without a task (jobs.result: the
--- kind's own result, e.g. an agent's answer and cost).
--- The result is checked against the outputSchema of the job's tool in `registry`.
---@param rec JobRecord
---@param registry ToolRegistry|nil  the session's tools
---@return table
function tasks.result_of(rec, registry)
  local meta = { [RELATED] = { taskId = rec.job_id } }
  if rec.status == "cancelled" or rec.exit_code == nil then
    local why = rec.status == "cancelled" and ("cancelled: " .. tostring(rec.reason or "cancelled"))
      or tostring(rec.reason or rec.status)
    return { content = json.array({ { type = "text", text = ("%s %s"):format(rec.tool or "job", why) } }),
      isError = true, _meta = meta }
  end
  local r, text = jobs.result(rec)
  if not r then
    r = {
      exit_code = rec.exit_code,
      output_dir = rec.output_dir,
      duration_ms = math.max((rec.finished_ms or rec.started_ms) - rec.started_ms, 0),
      timed_out = rec.timed_out == true,
    }
    r.stdout, r.stderr, r.truncated = jobs.collect(rec)
    if rec.kind == "exec" then r.log_dir = rec.log_dir else r.run_id = rec.run_id end
    text = schemas.run_text(r)
  end
  local tool = registry and rec.tool and registry:get(rec.tool)
  local schema = tool and tool.outputSchema
  local ok, errs = true, nil
  if schema then ok, errs = tools.validate(schema, r) end
  if not ok then
    return { content = json.array({ { type = "text", text = ("%s: the job's result does not match the tool's "
      .. "outputSchema: %s"):format(rec.tool, tools.schema.format_errors(errs)) } }), isError = true, _meta = meta }
  end
  return { content = json.array({ { type = "text", text = text } }), structuredContent = r, isError = false,
    _meta = meta }
end

--- tools/call with a `task` (or of a tool whose taskSupport is "required"): runs the tool
--- with background = true and returns CreateTaskResult. Tools without task support give
--- -32601; arguments the tool refuses give -32602 with the tool's message.
---@param tool ToolDescriptor
---@param ctx ToolContext
---@param args table
---@param task table|nil  params.task
---@return table
function tasks.call(tool, ctx, args, task)
  local support = type(tool.execution) == "table" and tool.execution.taskSupport or "forbidden"
  if task == nil then
    rpc_error(METHOD_NOT_FOUND, ("tool %s must be called as a task (params.task)"):format(tool.name))
  end
  if support ~= "optional" and support ~= "required" then
    rpc_error(METHOD_NOT_FOUND, ("tool %s does not support task-augmented calls"):format(tool.name))
  end
  if type(task) ~= "table" or json.is_array(task) then rpc_error(INVALID_PARAMS, "params.task: expected an object") end
  local a = {}
  for k, v in pairs(args) do a[k] = v end
  a.background = true
  local res = tools.call(tool, ctx, a)
  local sc = res.structuredContent
  if res.isError or type(sc) ~= "table" or type(sc.job_id) ~= "string" then
    local text = res.content and res.content[1] and res.content[1].text or "the tool did not start a job"
    rpc_error(INVALID_PARAMS, text)
  end
  return { task = tasks.task_of(must_get(sc.job_id)) }
end

--- JSON-RPC method handlers, merged into lua/mcp/server.lua's table.
tasks.methods = {}

tasks.methods["tasks/get"] = function(_, params)
  return tasks.task_of(must_get(params.taskId))
end

tasks.methods["tasks/result"] = function(session, params)
  local rec = must_get(params.taskId)
  while not jobs.is_terminal(rec.status) do rec = jobs.wait(rec.job_id, 3600 * 1000) end
  return tasks.result_of(rec, session.registry)
end

tasks.methods["tasks/list"] = function(_, params)
  if params.cursor ~= nil and params.cursor ~= json.null and type(params.cursor) ~= "string" then
    rpc_error(INVALID_PARAMS, "params.cursor: expected a string")
  end
  local out = json.array()
  for _, rec in ipairs((jobs.list())) do out[#out + 1] = tasks.task_of(rec) end
  return { tasks = out }
end

tasks.methods["tasks/cancel"] = function(_, params)
  local rec = must_get(params.taskId)
  if jobs.is_terminal(rec.status) then
    rpc_error(INVALID_PARAMS, ("params.taskId: task %s has already ended (%s)"):format(rec.job_id, status_of(rec)))
  end
  local ok, got = pcall(jobs.cancel, rec.job_id, "cancelled by tasks/cancel")
  if not ok then
    if errors.is(got) then rpc_error(INVALID_PARAMS, got.message) end
    error(got, 0)
  end
  return tasks.task_of(got)
end

return tasks
