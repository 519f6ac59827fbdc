-- TODO(issue24-plan): removed when lua/sandbox/persistent.lua calls demesne.layer itself
-- (that file is being split on the issue24-plan branch and is left alone here). The sandbox
-- hooks of the layers above are the layer contract's (lua/layer.lua): sandbox_plan,
-- sandbox_removing, sandbox_removed, each with its error policy stated there. This file
-- only maps persistent.lua's old calls onto layer.run; it holds no hook list.
local layer = require("demesne.layer")

local runner = {}

--- Runs the layer hook sandbox_<name> (layer.run: an error of a plan hook refuses the plan).
---@param name string  "plan", "removing" or "removed"
---@param ... any      the hook's arguments
function runner.run(name, ...) layer.run("sandbox_" .. name, ...) end

--- Runs the layer hook sandbox_<name> (layer.run: removal hooks never stop the caller's
--- cleanup; a failure is logged, a cancel still propagates).
---@param name string  "removing" or "removed"
---@param ... any      the hook's arguments
function runner.run_removal(name, ...) layer.run("sandbox_" .. name, ...) end

return runner
