-- Nested sandboxes: the tree of runs that agents (and script orchestrators) inside sandboxes
-- spawn through demesne's in-sandbox MCP endpoint (docs/explanation/nested-sandboxes.md).
--
-- API for the agent wiring (the vendor route and the agent CLIs' configuration):
--
--   * Endpoint on the run plan. Every sandbox_agent / sandbox_research run, and every
--     sandbox_script / sandbox_create run with mcp = true, is a tree node with an endpoint.
--     By the time the plan's `before_create(o)` runs (sandbox.script_start), `o.endpoint` is
--       { url = "http://127.0.0.1:3130/mcp", port = 3130, token = "<64 hex>",
--         socket = "<run_dir>/mcp.sock", sandbox_socket = "/.demesne/run/mcp.sock",
--         tree = tree.info(run_id) }  (what the agent's context file tells it: see tree.info)
--     and, for an agent run, `o.host_mcp` lists the host MCP servers offered to it
--     ({name, url = tree.host_mcp_url(name), timeout_ms, tools | error}: see host_offer;
--     the servers come from lua/hostmcp, a layer above, installed by the in-sandbox
--     endpoint with tree.set_host_mcp),
--     and the container's environment carries DEMESNE_MCP_URL and DEMESNE_MCP_TOKEN (each
--     request must send `Authorization: Bearer <token>`). The URL and port never change, so
--     an argv or a config file can name them as constants (tree.URL, tree.PORT); only the
--     token is per run. `o.endpoint` is nil when no endpoint server is installed
--     (tree.set_endpoint, done by the in-sandbox endpoint when `demesne serve` starts it).
--   * How a run registers as a node: nothing to call. The plan hook (tree.plan, run by
--     sandbox.script_start and sandbox.create) makes a host call of those tools a root, and
--     a call from inside a sandbox (ctx.spawn, set by tree.spawn) a child; `o.tree` then
--     holds the node's run id (= o.run_id). The node ends when its container goes
--     (script_remove, destroy, the reaper); agent.finish reports its result and usage
--     (the layer hook agent_result -> tree.result, which also adds `children` to results.json).
--   * What a run may do, for its context file: info(run_id) -> {run_id, root, name, depth,
--     limits = {depth, children, running, jobs, job_records}, children_used, budget_usd, spent_usd}.
--   * Budget, from the vendor route: check(run_id, resv) -> true | nil, why before
--     forwarding a model request reserves what it may cost at most (refused when the budget
--     is spent, or the spend and the reservations in flight leave no room); charge(run_id,
--     usd, usage, resv) -> true | nil, "budget of $X spent" after it ended gives the
--     reservation back and counts the usage (optional: {model, input, output,
--     cache_creation, cache_read}; it feeds the live usage report); spent(run_id) -> usd
--     spent by its tree, budget (nil: none). The charge that reaches the budget starts the
--     reaction: every run of the tree still going ends with reason "budget of $X spent",
--     children first, and no container is left. A run that is no tree node always passes.
--   * info, check, charge and spent live in demesne.tree.store, which the agent and vendor
--     layers can require (it sits below them); demesne.tree re-exports them. The vendor route
--     reaches check and charge through the layer hooks vendor_admit/vendor_charge of
--     tree.layer, declared at the end of this file and installed by lua/compose.lua (the
--     route itself knows nothing of trees); the agent's context file gets info on the plan
--     (o.endpoint.tree).
--
-- Records: <state_dir>/tree/<run id>.json (0600, out of every sandbox's reach), one per
-- node; a root's also holds the tree's limits, budget, spend, member list and the background
-- jobs started below it (tree.job_admit). A research child's /out is <output_root>/<run id>
-- until it ends, then <parent out>/child/<name> (hand_over). Workspaces
-- shared by a tree: <state_dir>/workspaces/<run id>/ (bind-mounted rw at /workspace, never
-- read by the host, removed when the run that made it ends).
local async = require("demesne.async")
local errors = require("demesne.errors")
local config = require("demesne.config")
local egress_policy = require("demesne.egress.policy")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local log = require("demesne.log")
local progress = require("demesne.progress")
local sandbox = require("demesne.sandbox")
local store = require("demesne.tree.store")
local walls = require("demesne.tree.walls")
local quota = require("demesne.sandbox.quota")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")

local tree = {}

-- the records (lua/tree/store.lua), re-exported: tree.get, tree.within, tree.sees_*, …
local save, must, m = store.save, store.must, store.mem
for _, k in ipairs({ "dir", "get", "within", "sees_job", "sees_sandbox", "sees_run", "budget_reason", "limits",
  "spent", "check", "charge", "info", "totals", "children", "report" }) do
  tree[k] = store[k]
end

local LOGGER = "demesne.tree"

--- The endpoint's port inside a sandbox, its URL, and its socket there and on the host.
tree.PORT = 3130
tree.URL = ("http://127.0.0.1:%d/mcp"):format(tree.PORT)
tree.SANDBOX_SOCKET = "/.demesne/run/mcp.sock"
tree.SOCKET_NAME = "mcp.sock"
--- Where each host MCP server offered to an agent run is served on the same port, behind the
--- same token: /mcp/host/<server> (lua/tree/endpoint.lua, lua/hostmcp/proxy.lua).
tree.HOST_MCP_PATH = "/mcp/host/"

--- The in-sandbox URL of host MCP server `server`.
---@param server string
---@return string
function tree.host_mcp_url(server) return ("http://127.0.0.1:%d%s%s"):format(tree.PORT, tree.HOST_MCP_PATH, server) end

--- The kinds of node, by the tool that made them.
tree.KIND_OF_TOOL = { sandbox_script = "script", sandbox_create = "create", sandbox_agent = "agent",
  sandbox_research = "research" }

local NAME_MAX = 40
local TOKENS = { "input", "output", "cache_creation", "cache_read" }

local endpoint       -- {open = fn(node) -> ok, err; close = fn(run_id)} (tree.set_endpoint)
local host_offer     -- below
local host_servers   -- {servers_for, call_timeout_ms, list_tools} (tree.set_host_mcp)
local service        -- the resume task of tree.start


local now_ms, hex, closer = util.now_ms, util.hex, util.closer
local fail = errors.raise

--------------------------------------------------------------------------------------------
-- Folders

-- Creates the folder `name` in the host folder `parent` without following a link anywhere
-- the sandbox could have put one: `parent` is held (core.fs.opendir: a final link is not
-- followed) and the new folder made in it with mkdirat (EEXIST when anything, a link
-- included, is there). Returns the new folder's path, or nil, err, code.
local function make_dir_in(parent, name, mode)
  local d, err, code = fs.opendir(parent)
  if not d then return nil, err, code end
  local ok, merr, mcode = d:mkdir(name, mode)
  d:close()
  if not ok then return nil, merr, mcode end
  return parent .. "/" .. name
end

local function new_workspace(run_id)
  local base = config.get("state_dir") .. "/workspaces"
  assert(fs.mkdir_p(base, 448)) -- 0700: no other host user reaches into it
  local dir, err = make_dir_in(base, run_id, 511)
  if not dir then fail(("cannot make the workspace of %s: %s"):format(run_id, tostring(err))) end
  local d = fs.opendir(base)
  if d then
    d:chmod(run_id, 511) -- 0777 as the tmpfs it replaces: whatever user the image runs as writes it
    d:close()
  end
  return dir
end

-- Removes a workspace the node made: unlinkat on held folders, never through a link, off
-- the loop (sandbox.remove_in). The host never reads it.
local function remove_workspace(n)
  if not (n.owns_workspace and n.workspace) then return end
  local base, id = n.workspace:match("^(.*/workspaces)/([^/]+)$")
  if not base or id ~= n.run_id then return end
  local d = fs.opendir(base)
  if d then
    sandbox.remove_in(d, id)
    d:close()
  end
  n.owns_workspace = false
end

--------------------------------------------------------------------------------------------
-- The endpoint

--- Installs the in-sandbox endpoint server (lua/tree/endpoint.lua, by `demesne serve`):
--- `impl.open(node)` listens on <run_dir>/mcp.sock for the node (true or nil, err) and
--- `impl.close(run_id)` stops that listener and its sessions. nil uninstalls it.
---@param impl {open: fun(node: TreeNode): boolean|nil, string|nil, close: fun(run_id: string)}|nil
function tree.set_endpoint(impl) endpoint = impl end

--- Installs the host MCP servers (lua/hostmcp, a layer above: `demesne serve` and the
--- in-sandbox endpoint install that module) that agent runs may be offered.
--- `impl.servers_for({host_mcp = names|nil, parent = names|nil})` -> names | nil, err (the
--- set of a run, checked against the configuration and the parent's set);
--- `impl.call_timeout_ms(name)` -> ms; `impl.list_tools(name)` -> tools | nil, err (inside
--- a task). nil uninstalls it: runs are then offered none, and a `host_mcp` that names a
--- server is refused.
---@param impl {servers_for: fun(o: table): string[]|nil, string|nil, call_timeout_ms: fun(name: string): integer, list_tools: fun(name: string): table[]|nil, string|nil}|nil
function tree.set_host_mcp(impl) host_servers = impl end

--- The listener tag of a node's endpoint ("run:<run id>"): the identity of every request
--- that arrives on it.
---@param run_id string
---@return string
function tree.tag(run_id) return "run:" .. run_id end

--- The run a listener tag names, or nil.
---@param tag any  a listener tag (tree.tag)
---@return string|nil
function tree.run_of_tag(tag) return type(tag) == "string" and tag:match("^run:([%w][%w%-]*)$") or nil end

local function open_endpoint(n)
  if not endpoint or not n.endpoint then return nil, "no endpoint server" end
  return endpoint.open(n)
end

local function close_endpoint(n)
  if endpoint and n.endpoint then pcall(endpoint.close, n.run_id) end
end

--------------------------------------------------------------------------------------------
-- The plan hook: a host call of an agent tool (or sandbox_create with mcp) becomes a root, a
-- call from inside a sandbox (ctx.spawn) a child.

local function copy_inputs(list)
  local out = json.array()
  for _, x in ipairs(list or {}) do out[#out + 1] = { host = x.host, target = x.target, kind = x.kind } end
  return out
end

local function has_endpoint(kind, args)
  return kind == "agent" or kind == "research" or (type(args) == "table" and args.mcp == true)
end

-- Gives the plan its endpoint: the relay of tree.PORT to <run_dir>/mcp.sock, the listener,
-- the environment, and /out/child read-only.
local function plan_endpoint(n, o)
  if not n.parent then assert(fs.mkdir_p(o.output_dir, 493)) end -- a root's: a new folder of its own
  local child, cerr = make_dir_in(o.output_dir, "child", 493)
  if not child then fail(("cannot make %s/child: %s"):format(o.output_dir, tostring(cerr))) end
  -- the parent reads its children's /out here; read-only, so it can neither plant a link
  -- the engine would follow when it mounts a child's folder nor swap one
  o.mounts[#o.mounts + 1] = { host = child, target = "/out/child" }
  n.endpoint = { token = hex(loop.random(32)), socket = o.run_dir .. "/" .. tree.SOCKET_NAME }
  assert(fs.mkdir_p(o.run_dir, 493))
  if endpoint then
    local ok, err = open_endpoint(n)
    if not ok then fail("the in-sandbox MCP endpoint: " .. tostring(err)) end
    o.extra_relay = o.extra_relay or {}
    o.extra_relay[#o.extra_relay + 1] = "--relay"
    o.extra_relay[#o.extra_relay + 1] = ("%d=%s"):format(tree.PORT, tree.SANDBOX_SOCKET)
    o.env = o.env or json.array()
    o.env[#o.env + 1] = "DEMESNE_MCP_URL=" .. tree.URL
    o.env[#o.env + 1] = "DEMESNE_MCP_TOKEN=" .. n.endpoint.token
    o.endpoint = { url = tree.URL, port = tree.PORT, token = n.endpoint.token, socket = n.endpoint.socket,
      sandbox_socket = tree.SANDBOX_SOCKET, tree = tree.info(n.run_id) } -- for the agent's context file
    o.host_mcp = host_offer(n)
  else
    n.endpoint = nil
  end
end

--- Whether host MCP server `server` is offered to the run `run_id` (an active agent node whose
--- set names it): the in-sandbox endpoint serves /mcp/host/<server> to that run only then.
---@param run_id string|nil
---@param server string
---@return boolean
function tree.offers_host_mcp(run_id, server)
  local n = run_id and tree.get(run_id)
  if not n or not n.active or n.kind ~= "agent" or not n.endpoint then return false end
  for _, x in ipairs(n.host_mcp or {}) do if x == server then return true end end
  return false
end

-- The host MCP servers of a node's subtree: a host call of sandbox_agent gets those its
-- `host_mcp` names (default: every configured server that offers a tool); a child at most its
-- parent's (asking for one outside them is refused); sandbox_research and its children none
-- (its open egress must not meet host data); a script or create node passes its parent's set
-- on (a root's: all) without being offered any itself.
local function host_mcp_set(kind, args, parent)
  if kind == "research" then return json.array() end
  local want = kind == "agent" and type(args) == "table" and args.host_mcp or nil
  if not host_servers then
    if type(want) == "table" and want[1] ~= nil then
      fail(("host_mcp[1]: no host MCP server is named %q (none is served here)"):format(tostring(want[1])))
    end
    return json.array()
  end
  local names, err = host_servers.servers_for({ host_mcp = want, parent = parent and (parent.host_mcp or {}) or nil })
  if not names then fail(err) end
  return json.array({ table.unpack(names) })
end

-- What the agent's wiring and context file get of the node's host MCP servers: one entry per
-- offered server {name, url, timeout_ms, tools = {{name, description}} | nil, error}. The
-- listings (in parallel) start the upstreams (they are used next anyway); one that fails is
-- still wired, and the context says why its tools are not known.
host_offer = function(n)
  local out = json.array()
  if n.kind ~= "agent" then return out end
  local tasks = {}
  local hs = host_servers
  if not hs then return out end
  for i, name in ipairs(n.host_mcp or {}) do
    out[i] = { name = name, url = tree.host_mcp_url(name), timeout_ms = hs.call_timeout_ms(name) }
    tasks[i] = async.spawn("host MCP listing: " .. name, hs.list_tools, name)
  end
  local _ <close> = closer(function() for _, t in ipairs(tasks) do async.cancel(t, "the plan ended") end end)
  for i, t in ipairs(tasks) do
    local ok, list, err = t:wait()
    if ok and list then
      local e = {}
      for _, x in ipairs(list) do e[#e + 1] = { name = x.name, description = x.description } end
      out[i].tools = e
    else
      out[i].error = tostring(ok and err or list)
    end
  end
  return out
end

-- Gives back a spawn's reservation: its slot and what it would hold (its limits).
local function unhold(root_id, want)
  local rm = m(root_id)
  rm.reserved = math.max(rm.reserved - 1, 0)
  if want and rm.held then
    for _, k in ipairs(walls.LIMITS) do rm.held[k] = math.max((rm.held[k] or 0) - (want[k] or 0), 0) end
  end
end

local function new_node(o, kind)
  return {
    run_id = o.run_id, kind = kind, tool = o.tool, status = "running", active = true, owner = sandbox.owner(),
    started_ms = now_ms(), output_dir = o.output_dir, run_dir = o.run_dir,
    egress = o.egress and o.egress.name or "none", children = json.array(), inputs = json.array(), cost_usd = 0,
    image = type(o.image_arg) == "string" and o.image_arg or nil,
  }
end

--- The plan hook (tree.layer.sandbox_plan): called by sandbox.script_start and sandbox.create
--- before anything is made. A host call of sandbox_agent / sandbox_research (or
--- sandbox_create with mcp = true) becomes a root: its /workspace a host folder, its
--- /out/child read-only, its endpoint open. A call from inside a sandbox (ctx.spawn) becomes
--- a child of the caller, with the caller's inputs, workspace and earlier siblings' outputs
--- (none for research), its /out in <caller out>/child/<name>. Other calls are left alone.
---@param ctx ToolContext|nil
---@param o table   the plan (sandbox.script_prepare, agent.prepare, sandbox.create)
---@param args table|nil  the call's arguments (mcp, tree, budget_usd)
function tree.plan(ctx, o, args)
  local kind = tree.KIND_OF_TOOL[o.tool]
  local spawn = type(ctx) == "table" and ctx.spawn or nil
  if not kind then return end
  args = args or o.args
  -- checked before anything is recorded: a bad host_mcp leaves no node behind
  local host_set = has_endpoint(kind, args) and host_mcp_set(kind, args, spawn and must(spawn.parent) or nil) or nil
  local n
  if spawn then
    local parent = must(spawn.parent)
    local root = must(parent.root)
    -- the plan that came out of the call (tree.spawn narrowed it) against the parent's walls,
    -- and an agent's image (its provider's), which the call did not name
    walls.check(parent, walls.of_plan(o))
    if kind == "agent" or kind == "research" then walls.image(o.engine, o.image_arg, true) end
    n = new_node(o, kind)
    n.root, n.parent, n.depth, n.name = root.run_id, parent.run_id, parent.depth + 1, spawn.name
    if kind == "research" then
      -- its /out is a folder of its own under the output root, seen by no other sandbox
      -- while it runs (a socket bound in it would be a live channel to its parent, which
      -- holds host inputs: a read-only mount does not stop connect); hand_over moves it to
      -- <parent out>/child/<name> once it has ended
      assert(fs.mkdir_p(config.get("output_root"), 493))
      local dir, derr = make_dir_in(config.get("output_root"), o.run_id, 493)
      if not dir then fail(("cannot make the output folder of %s: %s"):format(o.run_id, tostring(derr))) end
      o.output_dir, n.final_dir = dir, spawn.output_dir
      quota.include(root.output_dir, dir) -- still the root's quota while it runs here
    else
      o.output_dir = spawn.output_dir
    end
    n.output_dir = o.output_dir
    o.mounts = {}
    if kind ~= "research" then
      -- the parent's host inputs, read-only; earlier siblings' outputs; the shared workspace
      n.inputs = copy_inputs(parent.inputs)
      for _, x in ipairs(n.inputs) do o.mounts[#o.mounts + 1] = { host = x.host, target = x.target } end
      for _, c in ipairs(parent.children) do
        local sib = c.run_id and tree.get(c.run_id)
        if sib and c.name ~= spawn.name and not sib.final_dir then -- (a research child's: once handed over)
          o.mounts[#o.mounts + 1] = { host = sib.output_dir, target = "/in/previous-jobs/" .. c.name }
        end
      end
      if args and args.snapshot then
        -- a child from a snapshot (sandbox_fork): a workspace of its own, holding the snapshot's
        n.workspace, n.owns_workspace = new_workspace(n.run_id), true
      else
        n.workspace = parent.workspace
      end
    end
    if has_endpoint(kind, args) and not n.workspace then
      n.workspace, n.owns_workspace = new_workspace(n.run_id), true
    end
    spawn.run_id = n.run_id
    m(n.run_id).task = async.current() -- the spawning call's task (tree.stop may cancel it)
    root.members[#root.members + 1] = n.run_id
    for _, c in ipairs(parent.children) do
      if c.name == spawn.name then c.run_id = n.run_id end
    end
    if spawn.reserved then
      spawn.reserved = false
      unhold(root.run_id, spawn.want) -- the node holds it now (it is active)
    end
    save(parent)
    save(root)
  else
    if not has_endpoint(kind, args) then return end
    n = new_node(o, kind)
    n.root, n.depth = n.run_id, 0
    n.limits, n.budget_usd = tree.limits(args and args.tree, args and args.budget_usd)
    n.walls = walls.of_plan(o)
    n.walls.tree = walls.totals(args and args.tree, n.walls.limits, n.limits.running)
    n.spent_usd, n.members = 0, json.array({ n.run_id })
    for _, x in ipairs(o.mounts or {}) do
      if x.target == "/in/previous-jobs" then
        fail("files/directories: the basename previous-jobs is kept for the outputs of a run's earlier children")
      end
    end
    n.inputs = copy_inputs(o.mounts)
    if o.keep_workspace then -- a sandbox_agent run's, kept for a `continue` (lua/agent/continue.lua): not ours to remove
      n.workspace = o.keep_workspace
    else
      n.workspace, n.owns_workspace = new_workspace(n.run_id), true
    end
  end
  n.host_mcp = host_set
  -- what the cockpit shows: the image the call named, else the default (an agent's: its provider's)
  n.image = n.image or (type(args) == "table" and type(args.image) == "string" and args.image or nil)
    or config.get("default_image")
  n.walls = n.walls or walls.of_plan(o)
  store.put(n)
  m(n.run_id)
  o.tree = n.run_id
  o.workspace = n.workspace
  if has_endpoint(kind, args) then plan_endpoint(n, o) end
  save(n)
  log.info(LOGGER, "%s: %s %s%s", n.run_id, n.parent and "child" or "root", kind,
    n.parent and (" %q of %s (depth %d)"):format(n.name, n.parent, n.depth) or "")
end

--------------------------------------------------------------------------------------------
-- Ending

local FINAL = { succeeded = true, failed = true, cancelled = true, lost = true, destroyed = true }
local RANK = { default = 1, result = 2, job = 3 }

-- Records a node's outcome; a later source of higher rank (default < result < job) refines it.
local function settle(n, status, fields, src)
  fields = fields or {}
  if n.settled and RANK[n.settled] > RANK[src] then return end
  if n.cancel_reason and src ~= "job" then
    status, fields.reason = "cancelled", n.cancel_reason -- the tree ended it: say why
  end
  n.status = status
  n.settled = src
  if math.type(fields.exit_code) == "integer" then n.exit_code = fields.exit_code end
  if fields.reason ~= nil then n.reason = tostring(fields.reason) end
  n.finished_ms = n.finished_ms or now_ms()
end

local function status_of(run_dir)
  local ok, st = pcall(sandbox.read_status, run_dir, "main")
  if not ok then return "failed", nil, type(st) == "table" and st.message or tostring(st) end
  local code = st and math.tointeger(st.exit_code)
  if not code then return "failed", nil, "the run recorded no exit status" end
  if code == 0 then return "succeeded", 0 end
  return "failed", code, ("exited with code %d"):format(code)
end

local function wake_root(root_id)
  local rm = m(root_id)
  if rm and rm.slot then
    local ev = rm.slot
    rm.slot = nil
    ev.set()
  end
end

local write_usage, write_results, write_out -- below

-- The node's container is gone: it frees its slot, its running children end ("parent
-- ended"), its endpoint closes, its workspace goes when it made it.
local function ended(n, why)
  if not n.active then return end
  n.active = false
  save(n)
  wake_root(n.root)
  local ok, err = pcall(tree.stop_children, n.run_id, n.cancel_reason or "parent ended")
  if not ok and err == async.CANCELLED then error(err, 0) end
  if not ok then log.warning(LOGGER, "%s: ending its children: %s", n.run_id, tostring(err)) end
  close_endpoint(n)
  if not FINAL[n.status] or not n.settled then
    if n.kind == "create" then
      settle(n, n.cancel_reason and "cancelled" or "destroyed", { reason = why }, "default")
    else
      local status, code, reason = status_of(n.run_dir)
      settle(n, status, { exit_code = code, reason = why or reason }, "default")
    end
  end
  remove_workspace(n)
  if n.endpoint and n.kind ~= "agent" and n.kind ~= "research" then
    -- an agent run's results.json is written by lua/agent/init.lua (tree.result adds to it)
    local ok2, werr = pcall(write_results, n)
    if not ok2 then log.warning(LOGGER, "%s: results.json: %s", n.run_id, tostring(werr)) end
  end
  save(n)
  m(n.run_id).ended.set()
  log.info(LOGGER, "%s: ended (%s%s)", n.run_id, n.status, n.reason and (": " .. n.reason) or "")
end

-- A research child's output folder (made in tree.plan under the output root, where no other
-- sandbox sees it) goes to <parent out>/child/<name> once the child has ended and the host
-- has written its results there: renamed between held folders (no link followed) over the
-- empty folder tree.spawn made, which no sandbox can write (the parent sees it read-only).
-- The paths in the records of the subtree and of its jobs follow. A failure is logged and
-- the folder stays where it was (the host still reads it there).
local function hand_over(n)
  if not n.final_dir or n.active then return end
  local from, to = n.output_dir, n.final_dir
  local root = tree.get(n.root)
  if root then quota.exclude(root.output_dir, from) end -- once moved, the root's walk finds it
  local fp, fname = from:match("^(.*)/([^/]+)$")
  local tp, tname = to:match("^(.*)/([^/]+)$")
  local a, aerr = fs.opendir(fp)
  local b, berr = fs.opendir(tp)
  local ok, err = a and b, aerr or berr
  if ok then ok, err = a:rename(fname, b, tname) end
  if a then a:close() end
  if b then b:close() end
  n.final_dir = nil
  if not ok then
    log.warning(LOGGER, "%s: its output folder stays in %s: not moved to %s: %s", n.run_id, from, to, tostring(err))
    save(n)
    return
  end
  for _, w in ipairs(store.walk(n)) do
    local x = w.node
    if x.output_dir == from or x.output_dir:sub(1, #from + 1) == from .. "/" then
      x.output_dir = to .. x.output_dir:sub(#from + 1)
    end
    if x.job_id then jobs.moved(x.job_id, from, to) end
    save(x)
  end
  for _, id in ipairs(root and root.jobs or {}) do jobs.moved(id, from, to) end
  log.info(LOGGER, "%s: output folder handed over to %s", n.run_id, to)
end

--- The removed hook (tree.layer.sandbox_removed): a one-shot run's container is gone, or a
--- persistent sandbox was destroyed or reaped. Ends the node (see above).
---@param o table  the plan (SandboxPlan, read only; its live fields through it), or {tree} or {run_id}; `why` optional
---@param why string|nil
function tree.removed(o, why)
  local id = type(o) == "table" and (o.tree or o.run_id) or o
  local n = id and tree.get(id)
  if n then ended(n, why) end
end

--- The removing hook (tree.layer.sandbox_removing): a persistent sandbox is about to be
--- destroyed: its children go first.
---@param run_id string
function tree.removing(run_id)
  local n = tree.get(run_id)
  if n and n.active then tree.stop_children(run_id, n.cancel_reason or "parent ended") end
end

--- Records the result of a run that came back to its caller: `r` as sandbox_script or an
--- agent tool returns it ({exit_code, reason?, cost_usd?, usage?}).
---@param run_id string
---@param r table
function tree.finish(run_id, r)
  local n = tree.get(run_id)
  if not n or type(r) ~= "table" then return end
  if type(r.usage) == "table" then
    n.usage = { models = r.usage }
    n.cost_usd = math.max(tonumber(r.cost_usd) or 0, n.cost_usd or 0)
  end
  local code = math.tointeger(r.exit_code)
  local status = code == 0 and not r.reason and "succeeded" or "failed"
  settle(n, status, { exit_code = code, reason = r.reason }, "result")
  save(n)
end

--- The job finish hook (tree.layer.job_finish): a background run's job ended.
---@param rec JobRecord
function tree.job_finished(rec)
  local n = rec.run_id and tree.get(rec.run_id)
  if not n then return end
  n.job_id = n.job_id or rec.job_id
  settle(n, rec.status, { exit_code = rec.exit_code, reason = rec.reason }, "job")
  if n.active and (rec.status ~= "running") then ended(n) end
  save(n)
  if jobs.is_terminal(rec.status) then hand_over(n) end -- results.json is written by now
end

--- The job launch hook (tree.layer.job_launch): a run handed to a background job records the
--- job at once, so that a restart knows a job (not a call) watches it; a job on a member
--- below the root (a background child, an exec in a child sandbox) joins the root's list of
--- the tree's jobs (tree.job_admit bounds it).
---@param rec JobRecord
function tree.job_launched(rec)
  local n = rec.run_id and tree.get(rec.run_id)
  if n and not n.job_id then
    n.job_id = rec.job_id
    save(n)
  end
  local on = n or (rec.sandbox_id and tree.get(rec.sandbox_id))
  local root = on and on.root ~= on.run_id and tree.get(on.root)
  if root then
    root.jobs = root.jobs or json.array()
    root.jobs[#root.jobs + 1] = rec.job_id
    save(root)
  end
end

--- Admits one more background job that a call from inside the run `run_id` is about to
--- start (sandbox_exec or a spawn with background: true), against its tree's limits:
--- tree.jobs running at once, tree.job_records kept. At tree.job_records the oldest
--- finished records of the tree go (jobs.forget) to make room. Fails naming the limit.
--- Returns a to-be-closed value that ends the reservation (by then the job is launched and
--- counted through tree.job_launched, or it never started).
---@param run_id string  the calling run (an active node)
---@return table reservation  close it (local x <close> = tree.job_admit(id))
function tree.job_admit(run_id)
  local root = must(must(run_id).root)
  local max_running = root.limits.jobs or config.get("tree_jobs_default")
  local max_kept = math.max(root.limits.job_records or config.get("tree_job_records_default"), max_running)
  local rm = m(root.run_id)
  rm.job_pending = rm.job_pending or 0
  local kept, finished, running = json.array(), {}, 0
  for _, id in ipairs(root.jobs or {}) do
    local rec = jobs.get(id)
    if rec then
      kept[#kept + 1] = id
      if jobs.is_terminal(rec.status) then finished[#finished + 1] = { rec = rec, at = #kept }
      else running = running + 1 end
    end
  end
  if running + rm.job_pending >= max_running then
    root.jobs = kept
    save(root)
    fail(("this tree already runs %d background jobs, its limit (tree.jobs); wait for one to end (sandbox_wait) "
      .. "or cancel one (sandbox_cancel), then start it again"):format(running + rm.job_pending))
  end
  -- room among the kept records: the tree's oldest finished ones go
  table.sort(finished, function(a, b)
    local fa, fb = a.rec.finished_ms or a.rec.started_ms, b.rec.finished_ms or b.rec.started_ms
    if fa ~= fb then return fa < fb end
    return a.at < b.at -- (the list is in launch order)
  end)
  local gone = {}
  local over = #kept + rm.job_pending + 1 - max_kept
  for i = 1, over do
    local f = finished[i]
    if not f then break end
    if jobs.forget(f.rec.job_id) then gone[f.rec.job_id] = true end
  end
  local left = json.array()
  for _, id in ipairs(kept) do if not gone[id] then left[#left + 1] = id end end
  root.jobs = left
  save(root)
  if #left + rm.job_pending >= max_kept then
    fail(("this tree keeps %d job records, its limit (tree.job_records), and none of them can go yet; wait for a "
      .. "job to end, then start it again"):format(#left + rm.job_pending))
  end
  rm.job_pending = rm.job_pending + 1
  return closer(function() rm.job_pending = math.max(rm.job_pending - 1, 0) end)
end

--- The job cancel hook (tree.layer.job_cancel): a cancelled job's run takes its children with
--- it, children first.
---@param rec JobRecord
---@param reason string
function tree.job_cancelling(rec, reason)
  local n = rec.run_id and tree.get(rec.run_id)
  if n and n.active then
    -- a cancel from the tree (parent ended, budget spent) passes its reason down; one from
    -- outside (sandbox_cancel) says the parent was cancelled
    local down = n.cancel_reason or "parent cancelled"
    n.cancel_reason = n.cancel_reason or reason
    save(n)
    tree.stop_children(n.run_id, down)
  end
end

-- Waits (bounded) until a node's container is gone.
local function wait_ended(n, ms)
  if not n.active then return true end
  return async.timeout(ms, function() m(n.run_id).ended.wait() return true end)
end

local function stop_one(n, reason)
  if not n.active then return end
  n.cancel_reason = n.cancel_reason or reason
  save(n)
  local rec = n.job_id and jobs.get(n.job_id)
  if rec and not jobs.is_terminal(rec.status) then
    local ok, err = pcall(jobs.cancel, n.job_id, reason)
    if not ok then log.warning(LOGGER, "%s: cancel of job %s: %s", n.run_id, n.job_id, tostring(err and err.message or err)) end
  elseif n.kind == "create" then
    local ok, err = pcall(sandbox.destroy, nil, { sandbox_id = n.run_id })
    if not ok then log.warning(LOGGER, "%s: destroy: %s", n.run_id, tostring(err and err.message or err)) end
    ended(n, reason)
  else
    -- a run a call is waiting for: its container goes, the call comes back and ends it
    local mine = n.owner == sandbox.owner()
    local eng = sandbox.engine()
    eng:remove("demesne-" .. n.run_id)
    if mine and not wait_ended(n, 10000) then
      -- no container yet (an image being built, a create in flight): a child's spawning call
      -- is cancelled, its cleanup removes whatever it made (a root's call is the host's: it
      -- must answer, so only its container goes)
      local task = m(n.run_id).task
      if n.parent and task and not task.done then async.cancel(task, reason) end
      eng:remove("demesne-" .. n.run_id)
    end
    if not mine or not wait_ended(n, 30000) then
      ended(n, reason) -- nobody is waiting for it (its server is gone), or it is stuck: end it here
    end
  end
  if n.active and wait_ended(n, 60000) == nil then
    log.warning(LOGGER, "%s: still not ended after cancel", n.run_id)
  end
end

--- Ends the running children of a run (their own children first), each with `reason`.
---@param run_id string
---@param reason string
function tree.stop_children(run_id, reason)
  local n = tree.get(run_id)
  if not n then return end
  for i = #n.children, 1, -1 do
    local c = n.children[i].run_id and tree.get(n.children[i].run_id)
    if c and c.active then tree.stop(c.run_id, reason) end
  end
end

--- Ends a run and everything below it, children first, each with `reason` ("parent
--- ended", "budget of $X spent", …): background runs are cancelled as jobs, persistent
--- sandboxes destroyed, runs a call waits for lose their container (the call then returns).
---@param run_id string
---@param reason string
function tree.stop(run_id, reason)
  local n = tree.get(run_id)
  if not n then return end
  tree.stop_children(run_id, reason)
  stop_one(n, reason)
end

--------------------------------------------------------------------------------------------
-- Spawning (from inside a sandbox: lua/tree/child.lua)

local NAME_PATTERN = "^[a-z0-9][a-z0-9%-]*$"

--- Checks a child's name: lowercase letters, digits and inner hyphens, at most 40 bytes.
---@param name any
---@return boolean|nil ok, string|nil why
function tree.check_name(name)
  if type(name) ~= "string" or name == "" then return nil, "name: required (the child's name)" end
  if #name > NAME_MAX then return nil, ("name: %q is longer than %d characters"):format(name, NAME_MAX) end
  if not name:match(NAME_PATTERN) or name:sub(-1) == "-" then
    return nil, ("name: %q must be lowercase letters, digits and inner hyphens (e.g. \"fetch-data\")"):format(name)
  end
  return true
end

local function running_in(root)
  local count = m(root.run_id).reserved
  for _, id in ipairs(root.members or {}) do
    local x = tree.get(id)
    if x and x.active then count = count + 1 end
  end
  return count
end

-- What the tree's running nodes and reserved spawns hold together: {memory_mb, cpus, pids}.
local function held_in(root)
  local held = m(root.run_id).held or {}
  local h = {}
  for _, k in ipairs(walls.LIMITS) do h[k] = held[k] or 0 end
  for _, id in ipairs(root.members or {}) do
    local x = tree.get(id)
    local l = x and x.active and type(x.walls) == "table" and x.walls.limits
    if type(l) == "table" then
      for _, k in ipairs(walls.LIMITS) do h[k] = h[k] + (tonumber(l[k]) or 0) end
    end
  end
  return h
end

-- What `n` and the nodes above it hold, and how many they are: they run at least as long as
-- a call of `n` does.
local function chain_held(n)
  local h, count = {}, 0
  for _, k in ipairs(walls.LIMITS) do h[k] = 0 end
  for _ = 1, 64 do
    if not n then break end
    count = count + 1
    local l = type(n.walls) == "table" and n.walls.limits
    if type(l) == "table" then
      for _, k in ipairs(walls.LIMITS) do h[k] = h[k] + (tonumber(l[k]) or 0) end
    end
    n = n.parent and tree.get(n.parent)
  end
  return h, count
end

-- Waits until the tree has a free slot and room in its totals for `want` (the child's
-- limits) and reserves both (released by tree.plan or by the caller). Refuses at once a
-- child that can never fit beside its parent and the nodes above it (waiting would be in
-- vain: they run as long as this call). Sends progress while waiting; fails after
-- tree_wait_seconds.
local function reserve_slot(ctx, root, parent, want)
  local max = root.limits.running
  local caps = type(root.walls) == "table" and root.walls.tree or nil
  local chain, above = chain_held(parent)
  if above >= max then
    fail(("this tree runs at most %d sandboxes at once (tree.running), and this sandbox and those above it, which "
      .. "run as long as this call, are %d of them: a child here never gets a slot; do the work in this sandbox"):format(
      max, above))
  end
  if caps then
    local ok, _, why = walls.fits(caps, chain, want, "this sandbox and those above it, which run as long as this call, hold")
    if not ok then fail(why .. " while they run; ask for less") end
  end
  local function room()
    if running_in(root) >= max then return nil, "slot" end
    if caps then
      local ok, _, why = walls.fits(caps, held_in(root), want)
      if not ok then return nil, why end
    end
    return true
  end
  local ok, why = room()
  if not ok then
    local wait_s = config.get("tree_wait_seconds")
    local _hb <close> = progress.heartbeat(ctx, { total = wait_s, message = function(s)
      if why ~= "slot" then return ("waiting for room: %s; waited %d s"):format(tostring(why), math.floor(s)) end
      return ("waiting for a free slot: %d sandboxes of this tree run at once (its limit); waited %d s")
        :format(max, math.floor(s))
    end })
    local deadline = loop.now() + wait_s * 1000
    while true do
      ok, why = room()
      if ok then break end
      local left = deadline - loop.now()
      if left <= 0 then
        if why ~= "slot" then
          fail(("%s; waited %d s for a sandbox of this tree to end. Wait for a child (sandbox_wait) and spawn again, "
            .. "or ask for less"):format(why, math.floor(wait_s)))
        end
        fail(("this tree already runs %d sandboxes at once, its limit (tree.running); waited %d s for one to end. "
          .. "Wait for a child (sandbox_wait) and spawn again"):format(max, math.floor(wait_s)))
      end
      local rm = m(root.run_id)
      rm.slot = rm.slot or async.event()
      local ev = rm.slot
      async.timeout(math.min(left, 5000), function() ev.wait() return true end)
    end
  end
  local rm = m(root.run_id)
  rm.reserved = rm.reserved + 1
  rm.held = rm.held or {}
  for _, k in ipairs(walls.LIMITS) do rm.held[k] = (rm.held[k] or 0) + (want[k] or 0) end
end

local function policy_open(name)
  local pol = egress_policy.policy(name)
  return pol and pol.open == true
end

-- The child's egress: never wider than its parent's; open only for research (no inputs).
local function child_egress(parent, kind, asked)
  if kind == "research" then return "open" end
  local tool = kind == "agent" and "sandbox_agent" or ("sandbox_" .. kind)
  local name = asked
  if name == nil then
    if kind == "agent" then
      name = "none"
    elseif policy_open(parent.egress) then
      name = config.get("egress_default") or "package-managers"
      if policy_open(name) then name = "none" end
    else
      name = parent.egress
    end
  end
  if policy_open(name) then
    fail(("egress: %q is not permitted for a child %s: it would combine the parent's inputs with unrestricted "
      .. "outbound access. Use sandbox_research (no inputs) for open egress"):format(name, tool))
  end
  if name ~= "none" and name ~= parent.egress and not policy_open(parent.egress) then
    fail(("egress: %q is wider than this sandbox's own egress (%s); a child may have %s"):format(name,
      parent.egress, parent.egress == "none" and "none" or ("none or " .. parent.egress)))
  end
  return name
end

--- Spawns a child of the run `parent_id` (the caller, known by the listener its request came
--- on): checks the name (unique in the parent for its life), the depth, the number of
--- children, the egress, the walls (isolation, limits, image: lua/tree/walls.lua, which fills
--- in the call's isolation and limits), waits for a free slot and room in the tree's totals,
--- makes <parent out>/child/<name>, then runs
--- `run(ctx, args)` (the host tool's run) with ctx.spawn set so that the plan hook makes
--- the child. Returns what `run` returns; a run that came back (not in the background) is
--- recorded as the child's result.
---@param ctx ToolContext
---@param parent_id string
---@param kind string  script, create, agent or research
---@param args table   the call's arguments (name and the tool's own)
---@param run fun(ctx: ToolContext, args: table): any, string|nil
function tree.spawn(ctx, parent_id, kind, args, run)
  local parent = tree.get(parent_id)
  if not parent or not parent.active then fail("the calling sandbox is no longer running") end
  local root = must(parent.root)
  if root.budget_spent then fail(tree.budget_reason(root.budget_usd)) end
  local ok, why = tree.check_name(args.name)
  if not ok then fail(why) end
  local name = args.name
  for _, c in ipairs(parent.children) do
    if c.name == name then
      fail(("name: %q is already used by a child of this sandbox (names are unique for the sandbox's life)"):format(name))
    end
  end
  if parent.depth + 1 > root.limits.depth then
    fail(("depth: a child here would be at depth %d, below the tree's limit of %d (tree.depth); do the work in "
      .. "this sandbox or in a shallower one"):format(parent.depth + 1, root.limits.depth))
  end
  if #parent.children >= root.limits.children then
    fail(("this sandbox has spawned %d children, its limit (tree.children)"):format(#parent.children))
  end
  local eg = child_egress(parent, kind, args.egress)
  if kind ~= "research" then args.egress = eg end
  -- isolation no weaker, limits no larger than the parent's (the defaults: the parent's); an
  -- image demesne's, the user's or the configuration's, and built (lua/tree/walls.lua)
  local want = walls.narrow(parent, args)
  -- (a child from a snapshot runs on the snapshot's image, which the sandbox layer checks is in scope)
  if (kind == "script" or kind == "create") and args.snapshot == nil then walls.image(sandbox.engine(), args.image) end
  local call = {}
  for k, v in pairs(args) do if k ~= "name" then call[k] = v end end
  -- repository: true clones the parent's workspace repository (lua/repo prepare_child); a
  -- continue keeps the spec of the run it continues (continue.resolve took it from that run's
  -- own record, not from the caller: the schema lets a caller give only a boolean)
  if call.repository == true then
    call.repository = { parent = parent_id, name = name }
  elseif not (type(call.repository) == "table" and call.continue_of) then
    call.repository = nil
  end
  -- the name is taken from here on, even if the spawn fails
  parent.children[#parent.children + 1] = { name = name }
  save(parent)
  reserve_slot(ctx, root, parent, want)
  local spawn = { parent = parent_id, name = name, kind = kind, reserved = true, want = want }
  local _ <close> = closer(function()
    if spawn.reserved then
      unhold(root.run_id, want)
      wake_root(root.run_id)
    end
  end)
  if not parent.active then fail("the calling sandbox ended") end
  local out, err, code = make_dir_in(parent.output_dir .. "/child", name, 493)
  if not out then
    fail(("name: cannot make the child's output folder %s/child/%s: %s"):format(parent.output_dir, name,
      code == "EEXIST" and "something is already there" or tostring(err)))
  end
  spawn.output_dir = out
  ctx.spawn = spawn
  ctx.job_id = parent.job_id
  local res = table.pack(pcall(run, ctx, call))
  local child = spawn.run_id and tree.get(spawn.run_id)
  local staged = child and child.final_dir and child.output_dir
  local _handed <close> = closer(function()
    -- a research child that came back (or failed) has ended: its folder is handed over
    if child and not (child.job_id and res[1]) then
      local hok, herr = pcall(hand_over, child)
      if not hok then log.warning(LOGGER, "%s: handing over its output folder: %s", child.run_id, tostring(herr)) end
    end
  end)
  if staged and res[1] and type(res[2]) == "table" then
    -- what the caller reads names the folder where it sees it: <its out>/child/<name>
    local r = res[2]
    if r.output_dir == staged then r.output_dir = spawn.output_dir end
    if type(res[3]) == "string" then
      local s_, e_ = res[3]:find(staged, 1, true)
      if s_ then res[3] = res[3]:sub(1, s_ - 1) .. spawn.output_dir .. res[3]:sub(e_ + 1) end
    end
  end
  if not res[1] then
    if res[2] == async.CANCELLED then
      -- the caller's request was cancelled (or its session ended): the child went with it
      if child then
        settle(child, "cancelled", { reason = child.cancel_reason or "the call that spawned it was cancelled" }, "result")
        save(child)
      end
      error(res[2], 0)
    end
    if child then
      settle(child, "failed", { reason = type(res[2]) == "table" and res[2].message or tostring(res[2]) }, "result")
      save(child)
    end
    error(res[2], 0)
  end
  local r = res[2]
  if child and type(r) == "table" then
    if r.job_id and r.status == "running" then
      child.job_id = r.job_id
      save(child)
    elseif kind ~= "create" then
      tree.finish(child.run_id, r)
    end
  end
  return table.unpack(res, 2, res.n)
end

-- Rewrites usage.json in the node's output folder from the host's own numbers only: at the
-- top level `route` (the totals its vendor route holds in memory: Route:totals, for an
-- agent run) or else the node's own usage as its record has it (none for a script), and
-- its subtree's totals. Nothing the sandbox wrote into usage.json is read. Called once its
-- container is gone, so nothing in the sandbox can redirect it.
write_usage = function(n, route)
  local own = store.own_usage(n)
  local t = tree.totals(n.run_id)
  local doc = {}
  if type(route) == "table" then
    for k, v in pairs(route) do doc[k] = v end
  else
    doc.models, doc.cost_usd = own.models, own.cost_usd
    for _, k in ipairs(TOKENS) do doc[k] = own[k] end
  end
  doc.subtree = { cost_usd = t.cost_usd, input = t.input, output = t.output, cache_creation = t.cache_creation,
    cache_read = t.cache_read, models = t.models, nodes = t.nodes }
  write_out(n, "usage.json", json.encode(doc) .. "\n")
end

-- Writes `text` to `name` in the node's output folder, never through a link the sandbox left.
write_out = function(n, name, text)
  local d, err = fs.opendir(n.output_dir)
  local ok
  if d then
    ok, err = d:write_atomic(name, text)
    d:close()
  end
  if not ok then log.warning(LOGGER, "%s: %s: %s", n.run_id, name, tostring(err)) end
end

-- results.json of a script or persistent sandbox that had an endpoint: its outcome and children.
write_results = function(n)
  local t = tree.totals(n.run_id)
  write_out(n, "results.json", json.encode({ run_id = n.run_id, kind = n.kind, status = n.status,
    exit_code = n.exit_code, reason = n.reason, children = tree.children(n.run_id),
    total_cost_usd = t.cost_usd }) .. "\n")
  if #n.children > 0 then write_usage(n) end
end

--- The agent result hook (tree.layer.agent_result): before results.json is written, a tree
--- node's result gains `children` (tree.children) and, when the tree ended it, its reason;
--- its own usage is recorded and usage.json gains the subtree's totals.
---@param o table  the agent plan
---@param r table  the result
function tree.result(o, r)
  local n = o.tree and tree.get(o.tree)
  if not n then return end
  if n.cancel_reason then r.reason = n.cancel_reason end
  -- a run whose own request was refused for the spent budget may end before the tree's stop
  -- has marked it (the CLI exits on the 400 at once): the reason is the budget all the same
  local root = not r.reason and r.exit_code ~= 0 and tree.get(n.root)
  if root and root.budget_spent then r.reason = tree.budget_reason(root.budget_usd) end
  tree.finish(n.run_id, r)
  r.children = tree.children(n.run_id)
  if n.previews and #n.previews > 0 then r.previews = n.previews end -- sandbox_expose from inside
  local t = tree.totals(n.run_id)
  r.total_cost_usd = t.cost_usd
  local ok, err = pcall(write_usage, n, o.vendor and o.vendor:totals() or nil)
  if not ok then log.warning(LOGGER, "%s: usage.json: %s", n.run_id, tostring(err)) end
end

--- What a host's sandbox_status / sandbox_wait shows of a tree a job runs (tree.layer.job_view):
--- {cost_usd (the subtree's), nodes, running, budget_usd, spent_usd}.
---@param rec JobRecord
---@param v table  the view being built
function tree.view(rec, v)
  local n = rec.run_id and tree.get(rec.run_id)
  if not n then return end
  local t = tree.totals(n.run_id)
  local spent, budget = tree.spent(n.root)
  v.tree = { run_id = n.run_id, root = n.root, cost_usd = t.cost_usd, nodes = t.nodes, running = t.running,
    budget_usd = budget, spent_usd = spent }
end

--------------------------------------------------------------------------------------------
-- After a restart

-- Takes up a node a server that is gone left active.
local function resume_node(n)
  local eng = sandbox.engine()
  local info, _, code = sandbox.state_of(eng, n.run_id) -- by list: no inspect (Podman 4.3 deadlock)
  local alive = info and info.state == "running"
  if not info and code ~= "ENOENT" then return end -- the engine does not answer: next sweep
  local rec = n.job_id and jobs.get(n.job_id)
  if n.job_id then
    if rec and jobs.is_terminal(rec.status) then
      tree.job_finished(rec)
      return ended(n)
    end
    if not rec and not info then
      settle(n, "lost", { reason = "its job record and its container are gone" }, "job")
      ended(n)
      return hand_over(n)
    end
  elseif n.kind ~= "create" then
    -- a run a call was waiting for: that call died with its server
    if sandbox.owner_alive(n.owner) and n.owner ~= sandbox.owner() then return end
    if n.owner ~= sandbox.owner() then
      n.cancel_reason = n.cancel_reason or "lost: the server stopped while it ran"
      if info then eng:remove(info.id) end
      settle(n, "lost", { reason = "the server that ran it stopped while it ran" }, "job")
      ended(n)
      return hand_over(n)
    end
    return
  elseif not info then
    -- not on this server's engine: a live server of the same state folder may run it on
    -- another engine (or another socket), and it is that server's to settle
    if n.owner ~= sandbox.owner() and sandbox.owner_alive(n.owner) then return end
    return ended(n, "the sandbox was removed while no server watched it")
  end
  if alive and n.endpoint and (n.owner ~= sandbox.owner()) and not sandbox.owner_alive(n.owner) then
    n.owner = sandbox.owner()
    save(n)
    local ok, err = open_endpoint(n)
    if ok then log.info(LOGGER, "%s: endpoint re-opened", n.run_id)
    else log.warning(LOGGER, "%s: endpoint not re-opened: %s", n.run_id, tostring(err)) end
  end
end

--- Loads the records: re-opens the endpoints of running nodes a server that is gone left,
--- ends the nodes whose run is gone, and ends the running children of ended parents
--- ("parent ended"). Returns the number of active nodes found.
---@return integer
function tree.resume()
  local active = 0
  local list = {}
  for _, name in ipairs(fs.readdir(tree.dir()) or {}) do
    local id = name:match("^([%w][%w%-]*)%.json$")
    local n = id and tree.get(id)
    if n and n.active then list[#list + 1] = n end
  end
  table.sort(list, function(a, b) return (a.depth or 0) < (b.depth or 0) end)
  for _, n in ipairs(list) do
    local ok, err = pcall(resume_node, n)
    if not ok and err == async.CANCELLED then error(err, 0) end
    if not ok then log.warning(LOGGER, "%s: %s", n.run_id, tostring(err and err.message or err)) end
  end
  for _, n in ipairs(list) do
    local p = n.parent and tree.get(n.parent)
    if n.active and p and not p.active then
      pcall(tree.stop, n.run_id, p.cancel_reason or "parent ended")
    end
    if n.active then active = active + 1 end
  end
  tree.prune()
  return active
end

--- Removes ended trees whose every node finished more than jobs_keep_seconds ago (their
--- records, and any workspace left behind). Returns how many records went.
---@return integer
function tree.prune()
  local keep_ms = config.get("jobs_keep_seconds") * 1000
  local n = 0
  for _, name in ipairs(fs.readdir(tree.dir()) or {}) do
    local id = name:match("^([%w][%w%-]*)%.json$")
    local r = id and tree.get(id)
    if r and r.root == r.run_id and not r.active then
      local all_old = true
      for _, mid in ipairs(r.members or {}) do
        local x = tree.get(mid)
        if x and (x.active or (x.finished_ms or x.started_ms) + keep_ms > now_ms()) then all_old = false break end
      end
      if all_old then
        for _, mid in ipairs(r.members or {}) do
          local x = tree.get(mid)
          if x then remove_workspace(x) end
          if fs.unlink(store.record_path(mid)) then n = n + 1 end
          store.forget(mid)
        end
      end
    end
  end
  return n
end

--- Starts the service of `demesne serve`: resume at once, then a sweep every
--- reap_interval seconds. Idempotent.
function tree.start()
  if service and not service.done then return service end
  service = async.every("tree", function() return config.get("reap_interval") * 1000 end, function() tree.resume() end,
    { logger = LOGGER })
  return service
end

--- Stops the sweep. Running trees are left running: the next server takes them up.
function tree.stop_service()
  if service then async.cancel(service, "shutdown") end
  service = nil
end

--- Forgets every node this process holds (tests only).
function tree.reset() store.reset() end

--- The budget's reaction: the charge that reaches a tree's budget (lua/tree/store.lua,
--- store.on_budget_spent, which the composition root points here) ends the tree, in a task
--- of its own: every run of it still going ends with reason `why`, children first.
---@param root_id string
---@param why string  "budget of $X spent"
function tree.budget_spent(root_id, why)
  async.spawn("budget " .. root_id, function()
    local ok, err = pcall(tree.stop, root_id, why)
    if not ok and err ~= async.CANCELLED then log.warning(LOGGER, "tree %s: %s", root_id, tostring(err)) end
  end)
end

--- The ask hook (the tree layer's sandbox_plan, after tree.plan): whom the egress `ask` verdict of the
--- sandbox asks (lua/egress/ask.lua). Sets o.ask = {root, lineage = {run, parent, …, root},
--- has_inputs, tool, client} for egress.start: a root made by a host call gets that call's
--- host client (ctx.client), which the questions of its whole tree go to. A sandbox holds
--- host inputs when it mounts host files or directories, works on a host repository, or is
--- a child (not research) of a run that does (it shares that run's /in and /workspace).
---@param ctx ToolContext|nil
---@param o table  the plan
function tree.ask_plan(ctx, o)
  local n = o.tree and tree.get(o.tree)
  local lineage, id = {}, n and n.run_id
  while id do
    lineage[#lineage + 1] = id
    local x = tree.get(id)
    id = x and x.parent
  end
  if #lineage == 0 then lineage = { o.run_id } end
  local inputs = n and n.inputs or o.mounts or {}
  local has = #inputs > 0 or o.repo ~= nil
  if n and n.parent and n.kind ~= "research" then
    local pm = m(n.parent)
    has = has or not pm or pm.has_inputs ~= false
  end
  if n then m(n.run_id).has_inputs = has end
  o.ask = { root = lineage[#lineage], lineage = lineage, has_inputs = has, tool = o.tool }
  local spawn = type(ctx) == "table" and ctx.spawn or nil
  if not spawn and #lineage == 1 and type(ctx) == "table" and type(ctx.client) == "table" then
    o.ask.client = ctx.client -- bound while the root's proxy lives (egress.start, ask.register)
  end
end

--- The tree's layer (lua/layer.lua): its hooks into the sandbox, job, agent and vendor
--- layers below, and its service, installed by the composition root (lua/compose.lua).
--- Every model request of a tree's runs is charged to the tree, and refused once its
--- budget is spent (vendor_admit, vendor_charge).
tree.layer = {
  name = "tree",
  sandbox_plan = function(ctx, o, args)
    tree.plan(ctx, o, args)
    tree.ask_plan(ctx, o)
  end,
  sandbox_removing = tree.removing,
  sandbox_removed = tree.removed,
  job_launch = tree.job_launched,
  job_cancel = tree.job_cancelling,
  job_finish = tree.job_finished,
  job_view = tree.view,
  agent_result = tree.result,
  vendor_admit = tree.check,
  vendor_charge = tree.charge,
  -- resume the trees a previous server left, then sweep every reap_interval seconds
  services = { { name = "tree", start = tree.start, stop = tree.stop_service } },
}

return tree
