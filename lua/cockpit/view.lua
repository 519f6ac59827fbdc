-- What the cockpit shows of this server's trees, read from the node records (lua/tree/store)
-- and the runs' folders: the trees and their nodes, one node's detail (prompt, logs, /out
-- files, egress and host MCP records, branch), the totals. Everything read from an output or
-- run folder is the sandbox's to write: it is read through held folders (core.fs.dir: no
-- link followed, no FIFO opened, never blocking) and bounded; callers insert it as text only.
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local output = require("demesne.output")
local pool = require("demesne.pool")
local runs = require("demesne.cockpit.runs")
local sandbox = require("demesne.sandbox")
local store = require("demesne.tree.store")
local terminal = require("demesne.terminal")
local util = require("demesne.util")
local fs = require("core.fs")

local view = {}

local RECORD_MAX = 4 * 1024 * 1024
local PROMPT_MAX = 64 * 1024
local TAIL_MAX = 64 * 1024
local RECORDS_MAX = 200        -- egress.jsonl / mcp.jsonl lines shown
local FILES_MAX = 500          -- /out entries listed
local FILES_DEPTH = 6
local FILE_MAX = 16 * 1024 * 1024 -- a /out file served at most this long
local DAY_MS = 86400 * 1000
local KEEP_MS = runs.KEEP_MS   -- ended trees (and runs: lua/cockpit/runs.lua) are shown this long

local function num(x) return tonumber(x) or 0 end

-- Every node record of the state folder, read from disk (this process's copies are saved on
-- every change; other servers' records are never taken into this process's cache).
local function records()
  local out = {}
  local dir = store.dir()
  for _, name in ipairs(fs.readdir(dir) or {}) do
    local id = type(name) == "string" and name:match("^([%w][%w%-]*)%.json$")
    if id then
      local s = fs.read_file(dir .. "/" .. name, 0, RECORD_MAX)
      local n = s and json.decode(s)
      if type(n) == "table" and n.run_id == id and type(n.root) == "string" then out[id] = n end
    end
  end
  return out
end

-- One node as the cockpit lists it.
local function summary(n, root, total)
  local walls = type(n.walls) == "table" and n.walls or {}
  local stop = n.finished_ms or util.now_ms()
  local budget = root.budget_usd and num(root.budget_usd) or nil
  local kids = json.array()
  for _, c in ipairs(n.children or {}) do
    if type(c) == "table" and type(c.run_id) == "string" then kids[#kids + 1] = c.run_id end
  end
  return {
    run_id = n.run_id, root = n.root, parent = n.parent, name = n.name, depth = math.tointeger(n.depth) or 0,
    kind = n.kind, tool = n.tool, image = n.image, isolation = walls.isolation or "container", egress = n.egress,
    status = n.status, reason = n.reason or n.cancel_reason, active = n.active == true, exit_code = n.exit_code,
    started_ms = n.started_ms, finished_ms = n.finished_ms,
    elapsed_seconds = math.max(num(stop) - num(n.started_ms), 0) / 1000,
    cost_usd = num(n.cost_usd), total_cost_usd = total,
    budget_usd = budget, spent_usd = num(root.spent_usd),
    budget_left_usd = budget and math.max(budget - num(root.spent_usd), 0) or nil,
    limits = { memory_mb = walls.limits and walls.limits.memory_mb, cpus = walls.limits and walls.limits.cpus,
      pids = walls.limits and walls.limits.pids },
    tree_limits = n.parent == nil and root.limits or nil,
    job_id = n.job_id, children = kids,
  }
end

-- The subtree cost of every node of a tree (records: id -> node).
local function subtree_costs(recs, root)
  local costs = {}
  local function walk(n, seen)
    if seen[n.run_id] then return 0 end
    seen[n.run_id] = true
    local c = num(n.cost_usd)
    for _, ch in ipairs(n.children or {}) do
      local x = type(ch) == "table" and recs[ch.run_id]
      if x and x.root == root.run_id then c = c + walk(x, seen) end
    end
    costs[n.run_id] = c
    return c
  end
  walk(root, {})
  return costs
end

local function mine(n)
  return n.owner == sandbox.owner()
end

--- This server's trees (roots it owns, running, or ended within a week), newest first:
--- {run_id, name, status, started_ms, finished_ms, cost_usd, budget_usd, spent_usd, nodes =
--- {summary…} (root first, depth-first)}.
---@return table[]
function view.trees()
  local recs = records()
  local out = json.array()
  local now = util.now_ms()
  for _, r in pairs(recs) do
    if r.parent == nil and r.root == r.run_id and mine(r)
      and (r.status == "running" or now - num(r.finished_ms or r.updated_ms) < KEEP_MS) then
      local costs = subtree_costs(recs, r)
      local nodes = json.array()
      local function walk(n, seen)
        if seen[n.run_id] then return end
        seen[n.run_id] = true
        nodes[#nodes + 1] = summary(n, r, costs[n.run_id] or num(n.cost_usd))
        for _, ch in ipairs(n.children or {}) do
          local x = type(ch) == "table" and recs[ch.run_id]
          if x and x.root == r.run_id then walk(x, seen) end
        end
      end
      walk(r, {})
      out[#out + 1] = { run_id = r.run_id, status = r.status, started_ms = r.started_ms, finished_ms = r.finished_ms,
        cost_usd = costs[r.run_id] or 0, budget_usd = r.budget_usd, spent_usd = num(r.spent_usd), nodes = nodes }
    end
  end
  -- the sandboxes that are no tree node: each listed as a tree of one node (standalone = true)
  local nodes_of = {}
  for id in pairs(recs) do nodes_of[id] = true end
  for _, r in ipairs(runs.list(nodes_of)) do
    out[#out + 1] = { run_id = r.run_id, status = r.status, started_ms = r.started_ms, finished_ms = r.finished_ms,
      cost_usd = 0, spent_usd = 0, standalone = true, nodes = json.array({ r }) }
  end
  table.sort(out, function(a, b) return num(a.started_ms) > num(b.started_ms) end)
  -- the memory each running sandbox uses now (memory_used_bytes; eng:stats, sampled every few seconds)
  local running, ids, want = runs.running(), {}, {}
  for _, t in ipairs(out) do
    for _, n in ipairs(t.nodes) do
      local c = n.active and running[n.run_id]
      if c and c.state == "running" then
        ids[#ids + 1] = c.id
        want[n] = c.id
      end
    end
  end
  local used = #ids > 0 and runs.memory(ids) or {}
  for n, cid in pairs(want) do n.memory_used_bytes = used[cid] end
  return out
end

--- The totals of this server: spend today and in the last 7 days per model and per tree
--- (a node's spend counts on the day it started), sandboxes running, warm, memory reserved
--- (memory_mb: the running sandboxes' limits) and used (memory_used_bytes: what they use now,
--- as the engine measures it).
---@param trees table[]|nil  view.trees(), when the caller has it
---@return table
function view.totals(trees)
  trees = trees or view.trees()
  local recs = records()
  local now = util.now_ms()
  local day0 = now - now % DAY_MS
  local t = { today = { usd = 0, models = {}, trees = {} }, week = { usd = 0, models = {}, trees = {} },
    running = 0, memory_mb = 0, memory_used_bytes = 0, warm = 0 }
  for _, tr in ipairs(trees) do
    for _, s in ipairs(tr.nodes) do
      local n = recs[s.run_id] or {}
      if s.active then
        t.running = t.running + 1
        t.memory_mb = t.memory_mb + num(s.limits.memory_mb)
        t.memory_used_bytes = t.memory_used_bytes + num(s.memory_used_bytes)
      end
      local models = type(n.usage) == "table" and type(n.usage.models) == "table" and n.usage.models or {}
      for _, span in ipairs({ { t.today, day0 }, { t.week, now - 7 * DAY_MS } }) do
        if num(s.started_ms) >= span[2] then
          local acc = span[1]
          acc.usd = acc.usd + s.cost_usd
          acc.trees[tr.run_id] = (acc.trees[tr.run_id] or 0) + s.cost_usd
          for model, u in pairs(models) do
            if type(u) == "table" then acc.models[model] = (acc.models[model] or 0) + num(u.cost_usd) end
          end
        end
      end
    end
  end
  for _, k in ipairs(pool.status()) do t.warm = t.warm + num(k.ready) end
  return t
end

--- The node `id` of this server, or nil and why.
---@param id string
---@return TreeNode|nil node, string|nil err
function view.node(id)
  if type(id) ~= "string" or #id > 64 or not id:match("^[%w][%w%-]*$") then
    return nil, ("%q is not a run id"):format(tostring(id))
  end
  local s = fs.read_file(store.record_path(id), 0, RECORD_MAX)
  local n = s and json.decode(s)
  if type(n) ~= "table" or n.run_id ~= id then
    -- a sandbox that is no tree node (lua/cockpit/runs.lua), by run id or job id
    local r = runs.find(id, records())
    if r then return r end
    return nil, ("no run %s here (no tree node, job or sandbox of this server)"):format(id)
  end
  if not mine(n) then return nil, ("node %s belongs to another server"):format(id) end
  return n
end

-- The job record of a node, or nil.
local function job_of(n)
  if not jobs.valid_id(n.job_id) then return nil end
  local s = fs.read_file(jobs.record_path(n.job_id), 0, RECORD_MAX)
  local rec = s and json.decode(s)
  return type(rec) == "table" and rec.job_id == n.job_id and rec or nil
end

-- A file of a held folder, confined and bounded; "" when missing or unreadable.
local function read_in(dir, rel, max)
  local d = fs.opendir(dir)
  if not d then return "" end
  local text = d:read(rel, max)
  d:close()
  return text and terminal.neutralise(text) or ""
end

-- The last RECORDS_MAX JSON lines of a log in the output folder, decoded (a line that is
-- not a JSON object is kept as {line = text}).
local function records_of(dir, rel)
  local text = output.tail(dir, rel, TAIL_MAX) or ""
  local out = json.array()
  for line in text:gmatch("[^\n]+") do
    local x = json.decode(line)
    out[#out + 1] = type(x) == "table" and x or { line = line }
  end
  while #out > RECORDS_MAX do table.remove(out, 1) end
  return out
end

--- The files of a node's /out, breadth first, at most FILES_MAX: {path, type ("file",
--- "directory", "link", "other"), size}. Links are listed, never followed; each folder is
--- read through the held output folder (core.fs dir:list), at most the entries still to list.
---@param n TreeNode
---@return table[]
function view.files(n)
  local out = json.array()
  local root = fs.opendir(n.output_dir)
  if not root then return out end
  local queue = { { rel = "", depth = 0 } }
  while #queue > 0 and #out < FILES_MAX do
    local q = table.remove(queue, 1)
    -- through the held folder (no link followed) and bounded: a folder of a million names
    -- costs no more than the entries still to list
    local names = root:list(q.rel, FILES_MAX - #out) or {}
    table.sort(names)
    for _, name in ipairs(names) do
      if #out >= FILES_MAX then break end
      local rel = q.rel ~= "" and (q.rel .. "/" .. name) or name
      local st = root:stat(rel)
      if st then
        local t = (st.type == "file" or st.type == "directory" or st.type == "link") and st.type or "other"
        out[#out + 1] = { path = rel, type = t, size = t == "file" and st.size or nil }
        if t == "directory" and q.depth + 1 < FILES_DEPTH then queue[#queue + 1] = { rel = rel, depth = q.depth + 1 } end
      end
    end
  end
  root:close()
  return out
end

--- Checks a path inside /out that a caller named: relative, no "..", no empty or "."
--- component, no NUL. Returns it, or nil and why.
---@param rel any
---@return string|nil rel, string|nil err
function view.check_rel(rel)
  if type(rel) ~= "string" or rel == "" or #rel > 4096 or rel:find("%z") or rel:sub(1, 1) == "/" then
    return nil, "path: a relative path inside /out"
  end
  for c in rel:gmatch("[^/]*") do
    if c == ".." or c == "." then return nil, "path: no '.' or '..' components" end
  end
  return rel
end

--- One file of a node's /out (a regular file, confined, at most FILE_MAX bytes): its bytes,
--- or nil, why, code (ENOENT, ELOOP for a link, EINVAL for a FIFO, EFBIG).
---@param n TreeNode
---@param rel string
---@return string|nil bytes, string|nil err, string|nil code
function view.file(n, rel)
  local ok, err = view.check_rel(rel)
  if not ok then return nil, err, "EINVAL" end
  local d, derr, dcode = fs.opendir(n.output_dir)
  if not d then return nil, derr, dcode end
  local data, rerr, rcode = d:read(rel, FILE_MAX)
  d:close()
  return data, rerr, rcode
end

-- The log file of a stream, relative to the output folder.
local function log_rel(n, rec, stream)
  if stream == "transcript" or stream == "stdout" then
    if rec and rec.stdout_file then return rec.stdout_file end
    if n.kind == "agent" or n.kind == "research" then return "transcript.jsonl" end
    return "stdout.log"
  end
  return "stderr.log"
end

--- A part of a node's log from byte `from` (stream "transcript" or "stdout": the CLI's
--- stdout; "stderr"). Whole lines only until the run has ended. The transcript of an agent
--- is rendered (lua/terminal.lua: Claude Code stream-json, Codex JSONL) into `lines`;
--- other logs come as neutralised text in `lines` too. Returns {lines, next, eof} or nil, why.
---@param n TreeNode
---@param stream string
---@param from integer
---@param max integer|nil  bytes read at most (64 KiB)
---@return table|nil part, string|nil err
function view.log(n, stream, from, max)
  if stream ~= "transcript" and stream ~= "stdout" and stream ~= "stderr" then
    return nil, "stream: one of transcript, stdout, stderr"
  end
  local rec = job_of(n)
  local final = n.status ~= "running"
  local text, nxt, size = output.read_from(n.output_dir, log_rel(n, rec, stream), math.max(0, from or 0),
    math.max(4, max or 65536), final)
  if not text then return nil, tostring(nxt) end
  if not final or nxt < size then
    local cut = text:match("^.*()\n")
    if cut then
      nxt = nxt - (#text - cut)
      text = text:sub(1, cut)
    else
      nxt = nxt - #text
      text = ""
    end
  end
  local lines = json.array()
  local agentish = (n.kind == "agent" or n.kind == "research") and stream ~= "stderr"
  for line in text:gmatch("([^\n]*)\n?") do
    if line ~= "" then
      if agentish then
        for _, l in ipairs(terminal.render_event(line)) do lines[#lines + 1] = l end
      else
        lines[#lines + 1] = terminal.neutralise(line)
      end
    end
  end
  return { lines = lines, next = nxt, eof = final and nxt >= size }
end

--- A node's detail: its summary, prompt, stderr tail, egress and host MCP records, /out
--- files, children, branch, and while it runs its port previews and the command that opens a
--- terminal in it. nil and why for a node of no tree of this server.
---@param id string
---@return table|nil detail, string|nil err
function view.detail(id)
  local n, err = view.node(id)
  if not n then return nil, err end
  if n.standalone then return view.run_detail(n) end
  local recs = records()
  local root = recs[n.root] or n
  local costs = subtree_costs(recs, n)
  local d = summary(n, root, costs[n.run_id] or num(n.cost_usd))
  local rec = job_of(n)
  d.prompt = read_in(n.run_dir, "agent/prompt.md", PROMPT_MAX)
  if d.prompt == "" and rec and type(rec.command) == "string" then d.prompt = terminal.neutralise(rec.command) end
  d.output_dir = n.output_dir
  d.stderr = terminal.neutralise(output.tail(n.output_dir, "stderr.log", TAIL_MAX) or "")
  if n.kind ~= "agent" and n.kind ~= "research" then
    d.stdout = terminal.neutralise(output.tail(n.output_dir, log_rel(n, rec, "stdout"), TAIL_MAX) or "")
  end
  d.egress_log = records_of(n.output_dir, "egress.jsonl")
  d.mcp_log = records_of(n.output_dir, "mcp.jsonl")
  d.files = view.files(n)
  d.branch = rec and type(rec.branch) == "table" and rec.branch or nil
  local kids = json.array()
  for _, c in ipairs(n.children or {}) do
    local x = type(c) == "table" and c.run_id and recs[c.run_id]
    if x then kids[#kids + 1] = summary(x, root, costs[x.run_id] or num(x.cost_usd)) end
  end
  d.children_nodes = kids
  if n.kind == "create" then
    local ok, sb = pcall(sandbox.lookup, sandbox.engine(), n.run_id)
    if ok and type(sb) == "table" then d.expires_at = sb.expires_at end
  end
  d.ttl_max = config.get("ttl_max")
  if n.active then
    d.previews = sandbox.previews(n.run_id) -- this server's port previews of it: [{port, url}]
    d.attach = ("demesne attach %s"):format(n.run_id)
  end
  return d
end

--- The detail of a sandbox that is no tree node (runs.list's entry `r`): r's fields plus
--- its command, stdout and stderr tails, egress and host MCP records, /out files, and while
--- it runs the memory it uses, its port previews and the command that opens a terminal in it.
---@param r table
---@return table detail
function view.run_detail(r)
  local d = {}
  for k, v in pairs(r) do d[k] = v end
  local rec = job_of(r)
  local kept = fs.read_file(runs.dir() .. "/" .. r.run_id .. ".json", 0, RECORD_MAX)
  kept = kept and json.decode(kept)
  local command = rec and rec.command or type(kept) == "table" and kept.command or nil
  d.prompt = type(command) == "string" and terminal.neutralise(command) or ""
  d.stderr = terminal.neutralise(output.tail(r.output_dir, "stderr.log", TAIL_MAX) or "")
  d.stdout = terminal.neutralise(output.tail(r.output_dir, log_rel(r, rec, "stdout"), TAIL_MAX) or "")
  d.egress_log = records_of(r.output_dir, "egress.jsonl")
  d.mcp_log = records_of(r.output_dir, "mcp.jsonl")
  d.files = r.output_dir and view.files(r) or json.array()
  d.children_nodes = json.array()
  d.ttl_max = config.get("ttl_max")
  if r.active and r.container then
    d.memory_used_bytes = runs.memory({ r.container })[r.container]
    d.previews = sandbox.previews(r.run_id)
    d.attach = ("demesne attach %s"):format(r.run_id)
  end
  return d
end

return view
