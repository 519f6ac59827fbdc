-- `demesne logs`: see lua/cockpit/cli.lua and docs/reference/cli.md#demesne-logs
local cli = require("demesne.cockpit.cli")

---@param args string[]
---@return integer status
return function(args) return cli.logs(args) end
