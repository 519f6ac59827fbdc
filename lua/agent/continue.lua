-- Follow-ups continue the run: `sandbox_agent {continue = "<run_id>", prompt = "…"}` runs the
-- same provider and model with the same inputs in the same /workspace, resuming the CLI's own
-- session (Claude Code `--resume <session_id>`, Codex `exec resume <thread_id>`: the
-- providers' argv with run.resume_session, as the rate-limit resume of lua/agent/resume.lua).
--
-- What makes that possible is kept by lua/sandbox/keep.lua: every sandbox_agent run gets a
-- keep (<state_dir>/kept/<id>/), its home/ mounted at /root (the CLI's session state:
-- ~/.claude/projects/…, ~/.codex/sessions/…) and, for a root, its workspace/ mounted at
-- /workspace; after the run they stay for workspace_keep_seconds. A continue claims the keep
-- of the run it continues (one continue at a time), mounts the same folders, and when it ends
-- becomes the keep's latest run: the chain A → B → C shares one keep, and only its latest run
-- can be continued (an earlier one is refused naming the run that continued it).
--
-- Scope: a host call continues a root run (one the host started); from inside a tree
-- (lua/tree/child.lua) a sandbox continues a run of its own subtree that worked in its own
-- /workspace, and the continuation is a new child of the caller (it needs a `name` of its
-- own). The host never continues a child: its workspace was its tree's.
--
-- With the git hand-back (lua/repo): continue.INHERITED includes `repository`,
-- `include_uncommitted`, `branch` and `depth`, so a continue of a run that had a repository
-- gets the same one, and its clone is already in the kept /workspace. The one place that connects the two is the repository step of
-- agent.prepare: it passes continue.repo_opts(o) ({name, expect}) to repo.prepare, so that
-- the continuation's hand-back (repo.hand_back at agent.finish, as for every repository
-- run) fast-forwards the same branch `demesne/<name>` from the head the run it continues
-- handed back (`expect`) instead of making a new one, against the same start (`base`,
-- `host_head`: the kept clone's, whatever the host's HEAD is now). continue.finished records that head
-- (r.branch.head) and the branch's name for the next continue.
local config = require("demesne.config")
local errors = require("demesne.errors")
local json = require("demesne.json")
local keep = require("demesne.sandbox.keep")
local log = require("demesne.log")
local loop = require("core.loop")
local store = require("demesne.tree.store")
local util = require("demesne.util")

local continue = {}

--- The arguments a continue takes from the run it continues: given with another value they
--- are refused, naming the field; left out they are the first run's.
continue.INHERITED = { "model", "files", "directories", "egress", "isolation", "host_mcp", "repository",
  "include_uncommitted", "branch", "image", "depth" }

local LOGGER = "demesne.continue"
local fail = errors.raise

local function same(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then return a == b end
  for k, v in pairs(a) do if not same(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function refuse(fmt, ...) fail("continue: " .. fmt:format(...)) end

--- Checks a call's `continue` and fills the call from the run it continues (the fields of
--- continue.INHERITED). `caller` is ctx.caller of a call from inside a tree (nil on the
--- host): only runs of its subtree that worked in its /workspace can be continued. Refuses
--- (errors.raise, naming `continue` or the conflicting field) a run that is unknown, not a
--- sandbox_agent run, still running, already continued, expired, without a session, or out
--- of the caller's scope. Sets args.continue_of = {run_id, keep, session_id} for
--- continue.plan. Idempotent: a call filled once passes again.
---@param caller table|nil  {run_id, sees_run} from lua/tree/child.lua
---@param args table        the call's arguments (continue, prompt, …)
function continue.resolve(caller, args)
  local id = args.continue
  if id == nil then return end
  if not keep.valid_id(id) then refuse("%q is not a run id", tostring(id)) end
  local r = keep.run(id)
  if caller and not caller.sees_run(id) then r = nil end
  if not r then
    refuse("no run %s to continue (unknown, not a sandbox_agent run%s, or its record was pruned)", id,
      caller and " of this sandbox's tree" or "")
  end
  if r.tool ~= "sandbox_agent" then refuse("run %s is a %s run; only sandbox_agent runs continue", id, tostring(r.tool)) end
  if r.status == "running" then
    refuse("run %s is still running; wait for it to end (sandbox_wait) and continue it then", id)
  end
  local k = keep.get(r.keep)
  if k and not k.gone and not k.busy and k.expires_at and k.expires_at < loop.time() then
    keep.remove(k.id, "expired") -- the reaper's next pass would: a continue does not wait for it
    k = keep.get(r.keep)
  end
  if not k or k.gone then
    local why = k and k.gone or "expired"
    if why == "expired" then
      refuse("run %s has expired: its workspace and session were kept for workspace_keep_seconds (%d s) after "
        .. "it ended and are gone", id, math.floor(tonumber(config.get("workspace_keep_seconds")) or 0))
    end
    refuse("run %s cannot be continued: its workspace and session are gone (%s)", id, why)
  end
  if k.busy and k.busy ~= id then refuse("run %s is being continued by run %s, still running", id, k.busy) end
  if k.latest ~= id then
    refuse("run %s was continued by run %s; continue %s instead", id, tostring(k.latest), tostring(k.latest))
  end
  if caller then
    local me = store.get(caller.run_id)
    if not me or me.workspace ~= r.workspace then
      refuse("run %s worked in another /workspace than this sandbox's; only a run that shared it continues here", id)
    end
  elseif r.parent then
    refuse("run %s is a child in the tree of %s; only a sandbox of that tree can continue it", id, tostring(r.root))
  end
  if type(r.session_id) ~= "string" or r.session_id == "" then
    refuse("run %s named no session to resume (its CLI ended before it started one)", id)
  end
  local first = type(r.args) == "table" and r.args or {}
  for _, f in ipairs(continue.INHERITED) do
    local want = first[f]
    if want == json.null then want = nil end
    -- false is the schema's default of a flag (include_uncommitted; inside a tree `repository`
    -- is one), there whether the caller gave it or not: as absent
    local given = args[f]
    if given == false then given = nil end
    if given ~= nil and not same(given, want) then
      fail(("%s: a continue runs with the %s of run %s (%s); leave it out"):format(f, f, id,
        want == nil and "none" or json.encode(want)))
    end
    args[f] = want
  end
  args.continue_of = { run_id = id, keep = r.keep, session_id = r.session_id }
end

--- Fills the run of a plan that continues (args.continue_of, set by continue.resolve): the
--- session to resume and the prompt that resumes it. Nothing is claimed yet.
---@param o table     the plan (agent.prepare), o.run its ProviderRun
---@param args table
function continue.plan(o, args)
  local c = args.continue_of
  if type(c) ~= "table" then return end
  o.run.resume_session, o.run.resume_prompt = c.session_id, args.prompt
  o.continues = c.run_id
  o.chain = c.keep
end

--- What repo.prepare takes for a continuation's repository (see the header): `name`, the
--- branch component after demesne/ of the run it continues (the chain's first run id when
--- it recorded none), `expect`, the head that run handed back, which the continuation's
--- hand-back fast-forwards (nil: it made none; the branch is then made), and `base` and
--- `host_head`, the branch's start as that run recorded it: the kept clone holds those
--- commits, not a HEAD the host moved to since. {} for a plan that continues nothing.
---@param o table  the plan (continue.plan ran)
---@return {name: string|nil, expect: string|nil, base: string|nil, host_head: string|nil}
function continue.repo_opts(o)
  if not o.continues then return {} end
  local prev = keep.run(o.continues)
  if not prev then return { name = o.chain } end
  return { name = prev.branch_name or o.chain, expect = prev.branch_head, base = prev.branch_base,
    host_head = prev.branch_host_head }
end

--- Takes the plan's keep, the last step of agent.prepare (nothing after it fails): a
--- continue claims the keep of the run it continues (refused when another continue took it
--- meanwhile), any other sandbox_agent run makes its own (none while workspace_keep_seconds
--- is 0). Sets o.keep_id, o.home (mounted at /root) and o.keep_workspace (the /workspace of a
--- root: lua/tree/init.lua's plan takes it).
---@param o table  the plan
function continue.claim(o)
  if o.tool ~= "sandbox_agent" then return end
  local id
  if o.continues then
    local rec, why, held = keep.claim(o.chain, o.run_id)
    if not rec then
      if why == "busy" then refuse("run %s is being continued by run %s, still running", o.continues, tostring(held)) end
      refuse("run %s cannot be continued: its workspace and session are gone", o.continues)
    end
    if rec.latest ~= o.continues then
      keep.release(o.chain, o.run_id, false)
      refuse("run %s was continued by run %s; continue %s instead", o.continues, tostring(rec.latest),
        tostring(rec.latest))
    end
    id = o.chain
  else
    if (tonumber(config.get("workspace_keep_seconds")) or 0) <= 0 then return end
    local ok, rec = pcall(keep.new, o.run_id)
    if not ok then
      log.warning(LOGGER, "%s: not kept: %s", o.run_id, tostring(rec))
      return
    end
    id = rec.id
  end
  local p = keep.paths(id)
  o.keep_id, o.home, o.keep_workspace = id, p.home, p.workspace
end

--- Records the run in its keep once its tree position is known (the plan hooks ran: o.tree,
--- o.workspace): called from the plan's before_create.
---@param o table  the plan
function continue.started(o)
  if not o.keep_id then return end
  local n = o.tree and store.get(o.tree)
  local a = {}
  for _, f in ipairs(continue.INHERITED) do a[f] = o.args and o.args[f] end
  a.model = o.model
  keep.save_run({ run_id = o.run_id, keep = o.keep_id, tool = o.tool, provider = o.provider and o.provider.name,
    model = o.model, status = "running", started_at = loop.time(), continues = o.continues,
    parent = n and n.parent or nil, root = n and n.root or o.run_id, workspace = o.workspace, args = a,
    output_dir = o.output_dir })
end

--- A run with a keep ended (agent.finish, before results.json is written; its container is
--- gone): the result says which run it continues (r.continues), the branch it handed back is noted, the
--- run record keeps the session the CLI named (or the one it resumed) and its cost, and the
--- keep is released for the next continue (measured, and removed when over its bounds).
---@param o table  the plan (or the re-attached job's: only run_id is relied on)
---@param r table  the result
function continue.finished(o, r)
  local rec = keep.run(o.run_id)
  if not rec then
    if o.keep_id then keep.release(o.keep_id, o.run_id, false) end -- never started
    return
  end
  local prev = rec.continues and keep.run(rec.continues)
  if rec.continues then r.continues = rec.continues end
  -- the branch a repository run handed back (r.branch of lua/repo): the next continue's start
  local b = type(r.branch) == "table" and r.branch or nil
  rec.branch_name = b and type(b.branch) == "string" and b.branch:match("^demesne/(.+)$") or (prev and prev.branch_name)
  rec.branch_head = b and type(b.head) == "string" and b.head or (prev and prev.branch_head)
  -- where the branch starts (the first run's base and host HEAD): a continue hands back against them
  rec.branch_base = prev and prev.branch_base or (b and type(b.base) == "string" and b.base or nil)
  rec.branch_host_head = prev and prev.branch_host_head or (b and type(b.host_head) == "string" and b.host_head or nil)
  local session = type(r.session_id) == "string" and r.session_id or nil
  if not session and prev then -- the CLI said nothing (it failed at once): the chain's session stands
    session = prev.session_id
  end
  rec.status, rec.session_id, rec.finished_at = "finished", session, loop.time()
  rec.exit_code, rec.cost_usd = r.exit_code, r.cost_usd
  keep.save_run(rec)
  local k = keep.release(rec.keep, o.run_id, true)
  if k and k.gone then log.info(LOGGER, "%s: not continuable: %s", o.run_id, tostring(k.gone)) end
end

--- A run that ended before it started (no agent.finish): frees its keep (a new one goes).
---@param o table  the plan
function continue.abandon(o)
  if not o.keep_id then return end
  local rec = keep.run(o.run_id)
  if rec and rec.status == "running" then
    rec.status, rec.finished_at = "failed", loop.time()
    keep.save_run(rec)
  end
  keep.release(o.keep_id, o.run_id, false)
  o.keep_id = nil
end

--- The runs of a run's chain, first to latest: {run_id, status, exit_code, cost_usd,
--- continues, started, finished} each, or nil when the run has no keep record. For
--- sandbox_usage_report.
---@param run_id string
---@return table[]|nil
function continue.chain(run_id)
  local r = keep.run(run_id)
  if not r then return nil end
  local k = keep.get(r.keep)
  local ids = k and k.runs or { run_id }
  local out = json.array()
  for _, id in ipairs(ids) do
    local x = keep.run(id)
    if x then
      out[#out + 1] = { run_id = id, status = x.status, exit_code = x.exit_code, cost_usd = x.cost_usd or 0,
        continues = x.continues, started = x.started_at and util.iso(x.started_at) or nil,
        finished = x.finished_at and util.iso(x.finished_at) or nil }
    end
  end
  return out
end

return continue
