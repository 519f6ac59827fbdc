-- The walls of a tree node and how a child's narrow from its parent's (DESIGN.md "A tree
-- only narrows"; docs/explanation/nested-sandboxes.md#inheritance): the one comparison of
-- a child's plan against its parent's, made by lua/tree where the child's plan is made
-- (tree.spawn fills in and refuses from the call; tree.plan checks the plan that came out
-- of it). The tools never check any of this themselves.
--
--   * isolation is a floor: container < gvisor. A child that names none gets the stronger
--     of its parent's and isolation_default; asking for less is refused. A parent in a user
--     namespace has children in one (the userns setting: refused if a child's plan has none).
--   * limits (memory_mb, cpus, pids) default to the parent's and never exceed them.
--   * the tree's totals (tree.memory_mb, tree.cpus, tree.pids, on the root's record):
--     what the tree's running sandboxes may hold together; by default the root's own limits
--     times tree.running, lower when the host's call says so.
--   * images: from inside a sandbox only demesne's images (built-in and the user's) and
--     those the configuration lists (child_images, default_image); a demesne image that is
--     not built yet is refused unless child_image_builds is true.
--
-- A node's walls, recorded in its record (survives a restart):
--   {isolation = "container"|"gvisor", userns = boolean, limits = {memory_mb, cpus, pids},
--    tree = {memory_mb, cpus, pids} (a root's only: the tree's totals)}
local config = require("demesne.config")
local errors = require("demesne.errors")
local images = require("demesne.images")
local sandbox = require("demesne.sandbox")

local walls = {}

local fail = errors.raise
local num = sandbox.num

--- The isolation levels, weakest first: a child's may be equal or stronger.
walls.RANK = { container = 1, gvisor = 2 }

--- The limits a sandbox has (spec.limits), each narrowed from the parent's.
walls.LIMITS = { "memory_mb", "cpus", "pids" }

local UNIT = { memory_mb = "MB", cpus = "CPUs", pids = "processes" }

--- The walls of a plan made by sandbox.prepare ({isolation, userns, limits}).
---@param o table  the plan
---@return table walls  {isolation, userns, limits = {memory_mb, cpus, pids}}
function walls.of_plan(o)
  local l = o.limits or {}
  return { isolation = o.isolation or "container", userns = o.userns == true,
    limits = { memory_mb = l.memory_mb, cpus = l.cpus, pids = l.pids } }
end

local function parent_walls(parent)
  local w = type(parent) == "table" and parent.walls
  if type(w) ~= "table" or not walls.RANK[w.isolation] or type(w.limits) ~= "table" then
    fail("this sandbox's record holds no isolation and limits (it was started by an earlier demesne), so a child "
      .. "cannot be checked against them; spawn from a sandbox started since")
  end
  return w
end

--- Fills in and checks a spawning call's isolation and limits against its parent's walls:
--- isolation nil becomes the stronger of the parent's and isolation_default, a weaker one
--- is refused; each limit nil becomes the parent's, a larger one is refused. Changes `args`
--- (args.isolation, args.limits: all three set). Fails naming the field and the parent's value.
---@param parent TreeNode  the calling node (its walls)
---@param args table  the child's call (isolation, limits)
---@return table limits  {memory_mb, cpus, pids}: what the child will hold
function walls.narrow(parent, args)
  local pw = parent_walls(parent)
  local iso = args.isolation
  if iso == nil then
    local d = config.get("isolation_default")
    iso = (walls.RANK[d] or 0) > walls.RANK[pw.isolation] and d or pw.isolation
  end
  walls.check(parent, { isolation = iso, limits = args.limits })
  local l = type(args.limits) == "table" and args.limits or {}
  local out = {}
  for _, k in ipairs(walls.LIMITS) do out[k] = l[k] or pw.limits[k] end
  args.isolation, args.limits = iso, out
  return out
end

--- The comparison: refuses a child's walls `cw` ({isolation, userns|nil, limits|nil}, parts
--- nil are not checked) that are weaker than the parent's. Used by walls.narrow on the call
--- and by lua/tree on the plan that came out of it.
---@param parent TreeNode
---@param cw table
function walls.check(parent, cw)
  local pw = parent_walls(parent)
  if cw.isolation ~= nil then
    local r = walls.RANK[cw.isolation]
    if not r then fail(("isolation: %q is not container or gvisor"):format(tostring(cw.isolation))) end
    if r < walls.RANK[pw.isolation] then
      fail(("isolation: %q is weaker than this sandbox's own isolation (%s); a child runs on %s"):format(
        cw.isolation, pw.isolation, pw.isolation))
    end
  end
  if cw.userns == false and pw.userns then
    fail("userns: this sandbox runs in a user namespace and its child would not (the userns setting or the engine "
      .. "changed since it started); a child is never less isolated than its parent")
  end
  for _, k in ipairs(walls.LIMITS) do
    local v, max = type(cw.limits) == "table" and cw.limits[k], pw.limits[k]
    if type(v) == "number" and type(max) == "number" and v > max then
      fail(("limits.%s: %s is more than this sandbox's own limit of %s (the parent's); a child may have at most %s")
        :format(k, num(v), num(max), num(max)))
    end
  end
end

--- The totals of a new tree: `t` (the host call's `tree`: memory_mb, cpus, pids, each
--- optional) against the root's own limits and the tree's running limit. Default: the
--- root's limits times `running`; a total below the root's own limit is refused.
---@param t table|nil  the `tree` argument
---@param own table  the root's limits {memory_mb, cpus, pids}
---@param running integer  tree.running
---@return table totals  {memory_mb, cpus, pids}
function walls.totals(t, own, running)
  t = type(t) == "table" and t or {}
  local out = {}
  for _, k in ipairs(walls.LIMITS) do
    local v = t[k]
    if type(own[k]) ~= "number" then
      v = nil -- a plan without limits (none was resolved): no total either
    elseif v == nil then
      v = own[k] * running
    elseif type(v) ~= "number" or v ~= v or v < own[k] then
      fail(("tree.%s: %s is less than this run's own limits.%s (%s): the tree's total holds the root too"):format(k,
        tostring(v), k, num(own[k])))
    end
    out[k] = v
  end
  return out
end

--- Whether `want` ({memory_mb, cpus, pids}) fits in the tree's totals `caps` beside `held`
--- (what its running and reserved sandboxes hold). Returns true, or nil, the field and the
--- refusal ("limits.memory_mb: this tree's running sandboxes already hold …").
--- `whose` says who holds `held` (default "this tree's running sandboxes already hold").
---@param caps table
---@param held table
---@param want table
---@param whose string|nil
---@return boolean|nil ok, string|nil field, string|nil why
function walls.fits(caps, held, want, whose)
  for _, k in ipairs(walls.LIMITS) do
    if caps[k] and want[k] and held[k] + want[k] > caps[k] + 1e-9 then
      return nil, k, ("limits.%s: %s %s of its %s %s (tree.%s: the root's limits x tree.running unless the host's "
        .. "call set it), so a child of %s does not fit"):format(k, whose or "this tree's running sandboxes already hold",
        num(held[k]), num(caps[k]), UNIT[k], k, num(want[k]))
    end
  end
  return true
end

--- Refuses an image a sandbox may not name for its child. Allowed: demesne's built-in
--- images and the user's (the user image folder), and those the configuration names
--- (child_images, default_image). A demesne image not built yet is refused unless
--- child_image_builds is true (building one from inside costs minutes of CPU and GBs of
--- disk the host did not ask for). Runs inside a task (asks the engine).
---@param eng table  the engine adapter
---@param name string|nil  the image asked for (nil: default_image)
function walls.image(eng, name)
  local named = name
  name = name or config.get("default_image")
  local origin = images.origin(name)
  if not origin then
    if name == config.get("default_image") then return end
    for _, x in ipairs(config.get("child_images") or {}) do if x == name then return end end
    fail(("image: %q is not an image a sandbox may start: from inside a sandbox only demesne's images (%s) and "
      .. "those the configuration lists in child_images may be named"):format(tostring(named),
      table.concat(images.list(), ", ")))
  end
  if config.get("child_image_builds") then return end
  local tag = images.status(eng, name)
  if not tag then
    fail(("image: %q is not built yet, and a sandbox may not start its build (minutes of CPU and GBs of disk); ask "
      .. "the host to build it (`demesne images build %s`), or set child_image_builds = true"):format(name, name))
  end
end

return walls
