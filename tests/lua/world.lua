-- A scratch world on the fake engine (tests/fixtures/engines/fake.lua) for the Lua tests
-- of the layers above the engine adapter: a temporary folder with config, state, output
-- and an allowed host folder (host/), the fake installed as a user adapter
-- (engines/fake.lua in the config folder, DEMESNE_ENGINE_ADAPTER=fake), the environment
-- set and config loaded. Closing the world (`local w <close> = world.new(...)`) waits for
-- the removals, stops what is left (containers, proxies, output watches), resets the fake,
-- puts back every replaced engine method, the environment and config, and removes the folder.
--
-- A test file loads it with dofile(here .. "/world.lua"): it is not a test file itself.
local config = require("demesne.config")
local egress = require("demesne.egress")
local engines = require("demesne.engines")
local sandbox = require("demesne.sandbox")
local teardown = require("demesne.teardown")
local fs = require("core.fs")
local loop = require("core.loop")

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."

local world = {}

--- The image every fresh fake engine holds.
world.IMAGE = "fake/base:1"

-- What every world sets (and restores on close); a test names more with opts.vars.
local VARS = { "XDG_CONFIG_HOME", "DEMESNE_ENGINE_ADAPTER", "DEMESNE_ENGINE", "DEMESNE_STATE_DIR",
  "DEMESNE_OUTPUT_ROOT", "DEMESNE_ALLOWED_PATHS", "DEMESNE_INIT" }

--- The mounts of an engine spec by their target path.
---@param mounts table[] spec.mounts
---@return table<string, table>
function world.by_target(mounts)
  local out = {}
  for _, m in ipairs(mounts) do out[m.target] = m end
  return out
end

local World = {}
World.__index = World

--- Replaces the engine's `method` for the life of the world with
--- `fn(inner, eng, ...)`, where `inner` is the method it replaces (call it to go on).
--- Closing the world puts the adapter's own method back.
---@param method string an engine adapter method name, e.g. "create"
---@param fn fun(inner: function, eng: table, ...): ...
function World:wrap(method, fn)
  local inner = self.eng[method]
  self.wrapped[#self.wrapped + 1] = method
  self.eng[method] = function(eng, ...) return fn(inner, eng, ...) end
end

--- Keeps every spec the engine's create() receives in w.specs: in the order received, or
--- by container name (spec.name) when `by_name`.
---@param by_name? boolean
function World:record_creates(by_name)
  self.specs = {}
  self:wrap("create", function(create, eng, s)
    if by_name then self.specs[s.name] = s else self.specs[#self.specs + 1] = s end
    return create(eng, s)
  end)
end

local function close(w)
  if w.on_close then w.on_close(w) end
  assert(teardown.wait(5000), "the removals after the answers finished")
  for _, m in ipairs(w.wrapped) do w.eng[m] = nil end -- the adapter's method again
  w.eng.capabilities = w.caps
  for _, c in ipairs(w.eng:list({ "io.demesne.managed=1" })) do
    local rid = c.labels["io.demesne.run_id"]
    if rid then egress.stop(rid) end
  end
  sandbox.unwatch_all() -- the output quota's watches of what a test left running
  w.eng:reset()
  for _, k in ipairs(w.vars) do loop.setenv(k, w.saved[k]) end
  config.load()
  fs.remove_tree(w.dir)
end
World.__close = close

--- A new scratch world. Every variable in the base set and in `opts.vars` is saved and set
--- to its value here (unset when it has none), and restored on close.
---@param opts? { vars?: string[], env?: table<string,string>, files?: table<string,string>, on_open?: fun(w: table), on_close?: fun(w: table) }
---  vars: more environment variables the world owns; env: values (over the defaults:
---  DEMESNE_ALLOWED_PATHS = <dir>/host, ...); files: path under the folder -> content,
---  written before config loads; on_open(w): after the engine is ready; on_close(w):
---  first thing on close (before the removals are waited for).
---@return table w { dir = the folder, eng = the fake engine, caps = its capabilities as opened } with :wrap and :record_creates
function world.new(opts)
  opts = opts or {}
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d .. "/config/demesne/engines", 493))
  assert(fs.mkdir_p(d .. "/host", 493))
  assert(fs.write_atomic(d .. "/config/demesne/engines/fake.lua",
    assert(fs.read_file(here .. "/../fixtures/engines/fake.lua"))))
  assert(fs.write_atomic(d .. "/demesne-init", "not run: the fake engine models it"))
  for path, content in pairs(opts.files or {}) do
    assert(fs.mkdir_p((d .. "/" .. path):match("^(.*)/[^/]*$"), 493))
    assert(fs.write_atomic(d .. "/" .. path, content))
  end
  local env = { XDG_CONFIG_HOME = d .. "/config", DEMESNE_ENGINE_ADAPTER = "fake", DEMESNE_ENGINE = "",
    DEMESNE_STATE_DIR = d .. "/state", DEMESNE_OUTPUT_ROOT = d .. "/out", DEMESNE_ALLOWED_PATHS = d .. "/host",
    DEMESNE_INIT = d .. "/demesne-init" }
  for k, v in pairs(opts.env or {}) do env[k] = v end
  local vars = table.move(VARS, 1, #VARS, 1, {})
  table.move(opts.vars or {}, 1, #(opts.vars or {}), #vars + 1, vars)
  local saved = {}
  for _, k in ipairs(vars) do
    saved[k] = os.getenv(k)
    loop.setenv(k, env[k])
  end
  config.load()
  local eng = assert(engines.get())
  assert(eng.name == "fake", "the fake engine is the runtime's adapter")
  local w = setmetatable({ dir = d, eng = eng, caps = eng.capabilities, vars = vars, saved = saved, wrapped = {},
    on_close = opts.on_close }, World)
  if opts.on_open then opts.on_open(w) end
  return w
end

return world
