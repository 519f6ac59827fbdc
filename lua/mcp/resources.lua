-- Background jobs as MCP resources: `demesne://jobs/<job id>` is a job's status (the JSON
-- sandbox_status gives), and `demesne://jobs` the collection. They exist so that a client
-- can be told when a job ends the way each protocol revision allows:
--   * 2026-07-28: subscriptions/listen with notifications.resourceSubscriptions naming the
--     collection (every job) or one job; the server sends notifications/resources/updated
--     {uri = "demesne://jobs/<id>"} when the job ends (an updated sub-resource of the
--     collection, as the spec allows);
--   * 2025-11-25 and 2025-06-18: the job end is also logged as notifications/message from
--     logger demesne.jobs (lua/jobs.lua), which legacy sessions receive.
-- resources/list, resources/templates/list and resources/read serve both eras.
local json = require("demesne.json")
local jobs = require("demesne.jobs")

local resources = {}

--- The collection URI; a subscription to it covers every job.
resources.COLLECTION = "demesne://jobs"
local PREFIX = resources.COLLECTION .. "/"
local LIST_MAX = 100
local MIME = "application/json"

--- The URI of a job.
---@param job_id string
---@return string
function resources.job_uri(job_id) return PREFIX .. job_id end

--- The job id a URI names, or nil.
---@param uri any
---@return string|nil
function resources.job_of(uri)
  if type(uri) ~= "string" or uri:sub(1, #PREFIX) ~= PREFIX then return nil end
  local id = uri:sub(#PREFIX + 1)
  if jobs.valid_id(id) then return id end
  return nil
end

--- True when `uri` is one a subscription can name: the collection or a job's URI.
---@param uri any
---@return boolean
function resources.subscribable(uri)
  return uri == resources.COLLECTION or resources.job_of(uri) ~= nil
end

--- True when a subscription to `subscribed` covers the job `job_id`.
---@param subscribed string
---@param job_id string
---@return boolean
function resources.covers(subscribed, job_id)
  return subscribed == resources.COLLECTION or subscribed == resources.job_uri(job_id)
end

local function entry(rec)
  return {
    uri = resources.job_uri(rec.job_id),
    name = rec.job_id,
    title = ("%s job %s (%s)"):format(rec.tool or "background", rec.job_id, rec.status),
    mimeType = MIME,
  }
end

--- resources/list: the newest jobs (running first), at most 100, one page.
---@return table ListResourcesResult
function resources.list()
  local out = json.array()
  for _, rec in ipairs((jobs.list(nil, LIST_MAX))) do out[#out + 1] = entry(rec) end
  return { resources = out }
end

--- resources/templates/list: the one template, demesne://jobs/{job_id}.
---@return table ListResourceTemplatesResult
function resources.templates()
  return { resourceTemplates = json.array({ {
    uriTemplate = PREFIX .. "{job_id}",
    name = "job",
    title = "A background job's status",
    description = "The status of a background job (what sandbox_status returns): job_id, status, exit_code, "
      .. "output_dir, started_at, finished_at. Subscribe to demesne://jobs to hear when any job ends.",
    mimeType = MIME,
  } }) }
end

--- resources/read of a job URI. Returns the ReadResourceResult, or nil and why (unknown
--- URI or job).
---@param uri any
---@return table|nil result, string|nil err
function resources.read(uri)
  local id = resources.job_of(uri)
  local rec = id and jobs.get(id)
  if not rec then
    return nil, ("Resource not found: %s (job resources are %s<job id>)"):format(tostring(uri), PREFIX)
  end
  return { contents = json.array({ { uri = uri, mimeType = MIME, text = json.encode(jobs.view(rec)) } }) }
end

--- The terminal status of a job, or nil while it runs or when it is unknown.
---@param job_id string
---@return string|nil
function resources.ended(job_id)
  local rec = jobs.get(job_id)
  if rec and jobs.is_terminal(rec.status) then return rec.status end
  return nil
end

return resources
