-- The tools a sandbox sees through its in-sandbox MCP endpoint: the host's own tool
-- implementations, each with a caller context (ctx.caller, the calling run) and an input
-- schema derived here, in one place, from the host's:
--
--   * no host paths: `files` and `directories` go, and so do the host-only tree settings
--     (`budget_usd`, `tree`); sandbox_upload, sandbox_download and sandbox_list are not offered;
--   * every spawning call (sandbox_script, sandbox_create, sandbox_agent, sandbox_research)
--     takes a required `name` and goes through tree.spawn (limits, egress, inheritance);
--   * sandbox_status, sandbox_wait, sandbox_cancel, sandbox_exec, sandbox_destroy,
--     sandbox_jobs and sandbox_usage_report act only on the caller's subtree: anything else
--     is refused exactly as an unknown id is;
--   * sandbox_expose previews a port of the calling sandbox itself (sandbox_id omitted or its
--     own; any kind: an agent's run too) or of a persistent sandbox of its subtree; the URLs
--     appear in the caller's agent result (`previews`) and, while it runs, in its host job's
--     status (jobs.view);
--   * sandbox_wait blocks at most tree_wait_seconds (default 240 s) and then returns running;
--   * host paths in results are given as the caller sees them (<its output folder>/… →
--     /out/…).
local config = require("demesne.config")
local continue = require("demesne.agent.continue")
local errors = require("demesne.errors")
local json = require("demesne.json")
local progress = require("demesne.progress")
local sandbox = require("demesne.sandbox")
local schema = require("demesne.jsonschema")
local tools = require("demesne.tools")
local tree = require("demesne.tree")

local child = {}

local SPAWN = { sandbox_script = "script", sandbox_create = "create", sandbox_agent = "agent",
  sandbox_research = "research" }
local BY_JOB = { sandbox_status = true, sandbox_wait = true, sandbox_cancel = true }
local BY_SANDBOX = { sandbox_exec = true, sandbox_destroy = true, sandbox_snapshot = true, sandbox_fork = true,
  sandbox_pause = true, sandbox_resume = true }
local EXPOSE = "sandbox_expose"
-- (sandbox_snapshots and sandbox_snapshot_delete see only the snapshots the caller's subtree took: ctx.caller)
local OTHERS = { sandbox_jobs = true, sandbox_usage_report = true, sandbox_snapshots = true,
  sandbox_snapshot_delete = true }
local HOST_ONLY = { "files", "directories", "budget_usd", "tree" }

--- The names of the tools a sandbox sees, sorted.
child.TOOLS = { "sandbox_agent", "sandbox_cancel", "sandbox_create", "sandbox_destroy", "sandbox_exec",
  "sandbox_expose", "sandbox_fork", "sandbox_jobs", "sandbox_pause", "sandbox_research", "sandbox_resume",
  "sandbox_script", "sandbox_snapshot", "sandbox_snapshot_delete", "sandbox_snapshots", "sandbox_status",
  "sandbox_usage_report", "sandbox_wait" }

local NAME_SCHEMA = { type = "string", minLength = 1, maxLength = 40, pattern = "^[a-z0-9][a-z0-9-]*$",
  description = "The child's name: lowercase letters, digits and inner hyphens, at most 40 characters, unique "
    .. "among this sandbox's children for its whole life. Its /out is /out/child/<name> here, and children "
    .. "spawned after it see that folder at /in/previous-jobs/<name>." }

local NOTE = {
  script = "From inside a sandbox: the child sees this sandbox's /in read-only, shares its /workspace, sees "
    .. "earlier children's outputs at /in/previous-jobs/<name>, and writes /out/child/<name> (read it there). "
    .. "Its egress is never wider than this sandbox's, its isolation never weaker, its limits never larger (by "
    .. "default this sandbox's), and its image is demesne's, the user's or one the configuration lists, already built.",
  create = "From inside a sandbox: as sandbox_script, for a sandbox that stays up for sandbox_exec. A child from a "
    .. "snapshot gets a /workspace of its own holding the snapshot's.",
  agent = "From inside a sandbox: the child agent sees this sandbox's /in, shares /workspace, sees earlier "
    .. "children's outputs at /in/previous-jobs/<name>, writes /out/child/<name>; egress none or this sandbox's; "
    .. "isolation and limits this sandbox's or narrower. "
    .. "Use background: true and sandbox_wait for long runs. `continue` (with a new name) resumes an agent child "
    .. "that ended, in its own session.",
  research = "From inside a sandbox: the research child gets no inputs, its own workspace and open egress; its "
    .. "/out appears at /out/child/<name> here (and to later children at /in/previous-jobs/<name>) once it has "
    .. "ended: while it runs that folder is empty; its isolation and limits are this sandbox's or narrower.",
}

--- The input schema a tool has when a sandbox calls it: the host tool's, without the
--- host-only parameters, with a required `name` for a spawning tool of `kind`.
---@param host table   the host tool's descriptor
---@param kind string|nil  the spawn kind ("script", "create", "agent", "research"), nil for the others
---@return table schema
local function derive(host, kind)
  local s = schema.copy(host.inputSchema)
  s.properties = s.properties or {}
  for _, k in ipairs(HOST_ONLY) do s.properties[k] = nil end
  local req = json.array()
  for _, r in ipairs(s.required or {}) do
    local drop = false
    for _, k in ipairs(HOST_ONLY) do if r == k then drop = true end end
    if not drop then req[#req + 1] = r end
  end
  if s.properties.repository then
    -- a child clones its parent's workspace repository; no host path, no host work tree
    s.properties.repository = { type = "boolean", default = false, description = "Clone this sandbox's own "
      .. "repository (the clone it was given) at its current commit, at <its path>--<name>; the child's branch "
      .. "comes back to the host repository as <this branch>--<name>; its history is this clone's (as deep)." }
    s.properties.include_uncommitted, s.properties.branch, s.properties.depth = nil, nil, nil
  end
  if kind then
    s.properties.name = schema.copy(NAME_SCHEMA)
    table.insert(req, 1, "name")
    if kind == "research" then s.properties.egress = nil end
  end
  if host.name == "sandbox_wait" and s.properties.timeout_seconds then
    local max = config.get("tree_wait_seconds")
    local t = schema.copy(s.properties.timeout_seconds)
    t.maximum, t.default = max, max
    t.description = ("Seconds to wait at most (default and at most %d from inside a sandbox; 0 = just look). "
      .. "Past it the answer says running: call sandbox_wait again."):format(math.floor(max))
    s.properties.timeout_seconds = t
  end
  if host.name == EXPOSE and s.properties.sandbox_id then
    -- from inside, the sandbox to preview is by default the caller's own
    local r2 = json.array()
    for _, r in ipairs(req) do if r ~= "sandbox_id" then r2[#r2 + 1] = r end end
    req = r2
    local sid = schema.copy(s.properties.sandbox_id)
    sid.description = "This sandbox (the default: omit it) or a persistent sandbox made in its subtree."
    s.properties.sandbox_id = sid
  end
  s.required = #req > 0 and req or nil
  return s
end

-- Host paths under the caller's output folder, as the caller sees them.
local function rewrite(v, out)
  if type(v) == "string" then
    if v == out then return "/out" end
    if v:sub(1, #out + 1) == out .. "/" then return "/out" .. v:sub(#out + 1) end
    return v
  end
  if type(v) ~= "table" then return v end
  local copy = {}
  for k, x in pairs(v) do copy[k] = rewrite(x, out) end
  return setmetatable(copy, getmetatable(v))
end

local function rewrite_text(t, out)
  if type(t) ~= "string" then return t end
  local pieces, i = {}, 1
  while true do
    local s, e = t:find(out, i, true)
    if not s then break end
    local nxt = t:sub(e + 1, e + 1)
    pieces[#pieces + 1] = t:sub(i, s - 1)
    if nxt == "" or nxt == "/" or nxt:match("[%s\"',;)]") then
      pieces[#pieces + 1] = "/out"
    else
      pieces[#pieces + 1] = t:sub(s, e)
    end
    i = e + 1
  end
  pieces[#pieces + 1] = t:sub(i)
  return table.concat(pieces)
end

local function fail(msg) error(tools.fail(msg), 0) end

local function unknown_job(id)
  fail(("job_id: no job %s (unknown, or its record was pruned after jobs_keep_seconds)"):format(tostring(id)))
end

local function unknown_sandbox(id)
  fail(("sandbox_id: no sandbox %s (it was destroyed or has expired)"):format(tostring(id)))
end

-- The calling run: the one whose listener the request arrived on.
local function caller_of(ctx)
  local id = tree.run_of_tag(ctx.listener)
  local n = id and tree.get(id)
  if not n or not n.active then fail("the calling sandbox is not a running sandbox of a tree") end
  return n
end

local function caller_view(n)
  local id = n.run_id
  return {
    run_id = id, name = n.name, depth = n.depth, root = n.root,
    sees_job = function(job_id) return tree.sees_job(id, job_id) end,
    sees_sandbox = function(sandbox_id) return tree.sees_sandbox(id, sandbox_id) end,
    sees_run = function(run_id) return tree.sees_run(id, run_id) end,
  }
end

local FORK_NOTE = " From inside a sandbox: the new sandboxes are children of this sandbox (named fork<k>-1 … "
  .. "fork<k>-<count>), counted against the tree's children, running and totals limits (a count above the children "
  .. "left is refused before anything is made), each with a /workspace of its own holding the snapshot's."

-- A fork from inside a tree: its sandboxes are children of the caller, spawned as
-- sandbox_create {snapshot} children; a count above the children left is refused first.
local function fork_in_tree(ctx, n, args, host, create)
  local root = tree.get(n.root)
  local left = (root and root.limits.children or 0) - #n.children
  local count = math.tointeger(args.count) or 0
  if count > left then
    fail(("count: %d sandboxes would pass this sandbox's limit of %d children (tree.children): %d are left"):format(
      count, root and root.limits.children or 0, math.max(left, 0)))
  end
  local base = ("fork%d"):format(#n.children + 1)
  ctx.fork_create = function(i, call)
    call.name = base .. "-" .. i
    local r = tree.spawn(ctx, n.run_id, "create", call, create.run)
    if type(r) == "table" then r.mcp = nil end
    return r
  end
  return host.run(ctx, args)
end

-- The child descriptor of a host tool (`reg`: the host's registry).
local function wrap(host, reg)
  local name = host.name
  local kind = SPAWN[name]
  local d = {}
  for k, v in pairs(host) do d[k] = v end
  d.inputSchema = derive(host, kind)
  d.execution = nil -- no MCP tasks from inside a sandbox: background + sandbox_wait
  if kind then d.description = host.description .. " " .. NOTE[kind] end
  if name == "sandbox_fork" then d.description = host.description .. FORK_NOTE end
  if name == "sandbox_wait" then
    d.description = host.description .. (" From inside a sandbox it waits at most %d s, then returns running.")
      :format(math.floor(config.get("tree_wait_seconds")))
  end
  if name == EXPOSE then
    d.description = host.description .. " From inside a sandbox: a port of this sandbox (omit sandbox_id), or of a "
      .. "persistent sandbox it made; the URL is for the user's browser on the host (this sandbox cannot reach it), "
      .. "and the host's caller sees it in this run's result (previews)."
  end
  if BY_JOB[name] or BY_SANDBOX[name] or OTHERS[name] then
    d.description = host.description .. " From inside a sandbox: only what this sandbox spawned (and what those spawned)."
  end
  d.run = function(ctx, args)
    local n = caller_of(ctx)
    ctx.caller = caller_view(n)
    -- progress while any child call blocks (a spawn that waits for a slot, a cancel that
    -- waits for cleanup), with the caller's token: its client's timeout is reset by it
    local _hb <close> = progress.heartbeat(ctx)
    local res = table.pack(pcall(function()
      if BY_JOB[name] and not tree.sees_job(n.run_id, args.job_id) then unknown_job(args.job_id) end
      if BY_SANDBOX[name] and not tree.sees_sandbox(n.run_id, args.sandbox_id) then unknown_sandbox(args.sandbox_id) end
      -- a background job started from in here counts against the tree's tree.jobs and
      -- tree.job_records (the check and reservation come before anything is made)
      local _job <close> = args.background == true and (kind or name == "sandbox_exec") and tree.job_admit(n.run_id)
        or nil
      if name == "sandbox_fork" then return fork_in_tree(ctx, n, args, host, reg:get("sandbox_create")) end
      if kind then
        -- a continue takes the continued run's egress (and model) before the spawn checks them
        if name == "sandbox_agent" and args.continue ~= nil then continue.resolve(ctx.caller, args) end
        local r, text = tree.spawn(ctx, n.run_id, kind, args, host.run)
        if type(r) == "table" then r.mcp = nil end -- a child's endpoint is reachable only inside it
        return r, text
      end
      if name == EXPOSE then
        local id = args.sandbox_id or n.run_id
        local r
        if id == n.run_id then
          r = sandbox.expose_run(n.run_id, args.port)
        elseif tree.sees_sandbox(n.run_id, id) then
          r = host.run(ctx, args)
        else
          unknown_sandbox(id)
        end
        n.previews = n.previews or json.array()
        n.previews[#n.previews + 1] = { sandbox_id = id, port = r.port, url = r.url }
        return r, ("preview of port %d of %s: %s"):format(r.port, id, r.url)
      end
      if name == "sandbox_wait" then
        local max = config.get("tree_wait_seconds")
        args.timeout_seconds = math.min(args.timeout_seconds or max, max)
      end
      return host.run(ctx, args)
    end))
    if not res[1] then
      local e = res[2]
      if errors.is(e) then e.message = rewrite_text(e.message, n.output_dir) end
      error(e, 0)
    end
    return rewrite(res[2], n.output_dir), rewrite_text(res[3], n.output_dir)
  end
  return d
end

--- The registry of the tools a sandbox sees, derived from the host's registry `host`
--- (the tools of child.TOOLS that it has).
---@param host ToolRegistry
---@return ToolRegistry
function child.registry(host)
  local reg = tools.registry()
  for _, name in ipairs(child.TOOLS) do
    local d = host:get(name)
    if d then reg:add(wrap(d, host)) end
  end
  return reg
end

child.derive_schema = derive

return child
