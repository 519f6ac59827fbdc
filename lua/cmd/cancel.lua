-- `demesne cancel`: see lua/cockpit/cli.lua and docs/reference/cli.md#demesne-cancel
local cli = require("demesne.cockpit.cli")

---@param args string[]
---@return integer status
return function(args) return cli.cancel(args) end
