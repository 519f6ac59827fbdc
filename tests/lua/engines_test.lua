-- lua/engines/init.lua: what a user engine adapter's new() must return.
local engines = require("demesne.engines")

local tests = {}

function tests.a_user_adapter_must_build_a_whole_engine(t)
  local function try(new) return select(2, engines.new_user("mine", { new = new }, "unix:///x.sock")) end
  t:eq(try(function() return nil end), "engine_adapter mine: new() returned nothing")
  t:eq(try(function() return nil, "no such host" end), "engine_adapter mine: no such host")
  t:eq(try(function() return 5 end), "engine_adapter mine: new() returned a number, not an engine object")
  t:match(try(function() error("boom") end), "^engine_adapter mine: new%(%) failed: .*boom")
  local partial = {}
  for _, m in ipairs(engines.METHODS) do partial[m] = function() end end
  partial.pull = nil
  t:eq(try(function() return partial end), "engine_adapter mine: the engine new() returned has no method pull")
  partial.pull = function() end
  t:eq(try(function() return partial end), "engine_adapter mine: the engine new() returned has no capabilities table "
    .. '(docs/reference/engines.md, "Capabilities")')
  local docker = require("demesne.engines.docker")
  local eng = engines.new_user("mine", { new = function(e) return docker.new(e:gsub("^unix://", ""), nil) end },
    "unix:///x.sock")
  t:eq(eng.socket, "/x.sock", "the built-in adapter is a whole engine")
end

return tests
