-- `demesne ps`: see lua/cockpit/cli.lua and docs/reference/cli.md#demesne-ps
local cli = require("demesne.cockpit.cli")

---@param args string[]
---@return integer status
return function(args) return cli.ps(args) end
