-- The engine adapter contract (tests/lua/engine_contract.lua) on the fake engine
-- (tests/fixtures/engines/fake.lua): the fake that sandbox_test.lua stands on behaves as
-- the real adapter is required to.
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local contract = dofile(here .. "/engine_contract.lua")
local fake = dofile(here .. "/../fixtures/engines/fake.lua")

return contract(function() return { engine = fake.new(), image = fake.IMAGE } end)
