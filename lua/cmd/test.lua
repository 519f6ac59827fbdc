-- `demesne test DIR|FILE...`: the Lua tests in the folders or files, run inside this binary
-- (lua/testing.lua). Exit status 0 when every test passed.
local testing = require("demesne.testing")

---@param args string[]
---@return integer status
return function(args)
  return testing.run(args)
end
