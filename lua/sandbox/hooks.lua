-- Hooks of the layer above (nested sandboxes, lua/tree) into the sandbox lifecycle, shared
-- by the files of this folder and re-exported as sandbox.hooks. Each list runs in order:
--   plan(ctx, o, args)  before a sandbox is made (script_start, create): may change the plan
--                       (output_dir, mounts, workspace, extra_relay, env; sets o.tree, o.endpoint);
--                       the plan's checks (spec.check_plan) run after it, on the final plan
--   removing(run_id)    a persistent sandbox is about to be destroyed
--   removed(o, why)     a sandbox's container is gone (script_remove of a planned one-shot:
--                       o.tree for a tree node, o.exit_code once its result was read;
--                       destroy, the reaper: o = {run_id})
local async = require("demesne.async")
local errors = require("demesne.errors")
local log = require("demesne.log")

local hooks = { plan = {}, removing = {}, removed = {} }

local runner = {}

--- The hook lists (sandbox.hooks): the layer above appends its functions to them.
runner.hooks = hooks

--- Runs the hooks of `name` in order; an error stops the caller (a plan hook refuses a plan).
---@param name string  "plan", "removing" or "removed"
---@param ... any      the hook's arguments
function runner.run(name, ...)
  for _, fn in ipairs(hooks[name]) do fn(...) end
end

--- Runs the removal hooks of `name` in order. They never stop the cleanup of the caller: a
--- failure is logged (a cancel still propagates).
---@param name string  "removing" or "removed"
---@param ... any      the hook's arguments
function runner.run_removal(name, ...)
  for _, fn in ipairs(hooks[name]) do
    local ok, err = pcall(fn, ...)
    if not ok then
      if err == async.CANCELLED then error(err, 0) end
      log.warning("demesne.sandbox", "%s hook: %s", name, errors.message(err))
    end
  end
end

return runner
