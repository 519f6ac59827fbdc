-- The engine adapter contract (tests/lua/engine_contract.lua) on the engine the runtime
-- finds (DEMESNE_ENGINE; the built-in docker adapter unless DEMESNE_ENGINE_ADAPTER says
-- otherwise), with the built-in base image. Not a *_test.lua file: CTest has no engine.
-- tests/integration/engine-contract.test.mjs runs it on each engine of tests/run:
--   DEMESNE_ENGINE=unix:///run/podman/podman.sock build/demesne test tests/lua/engine_contract_live.lua
-- and tests/run once more on the Kubernetes test bed (DEMESNE_ENGINE=kubernetes).
local engines = require("demesne.engines")
local images = require("demesne.images")
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local contract = dofile(here .. "/engine_contract.lua")

-- DEMESNE_CONTRACT_IMAGE names the image instead, for an engine that takes its images from
-- elsewhere (the Kubernetes test bed: demesne/base built on Podman, imported into its
-- containerd by tests/kubernetes/load).
local given = os.getenv("DEMESNE_CONTRACT_IMAGE")

return contract(function()
  local eng = assert(engines.get())
  if given and given ~= "" then return { engine = eng, image = given } end
  local img = assert(images.ensure(eng, "base"))
  return { engine = eng, image = img.ref }
end)
