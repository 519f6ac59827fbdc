-- The one plugin loader: tools, egress policies, agent providers and engine adapters are
-- Lua files loaded the same way; images are folders found the same way.
--
-- A kind of plugin names a built-in folder of the runtime (embedded in the binary, or read
-- from the source tree), a user folder ($XDG_CONFIG_HOME/demesne/<kind>s/), the
-- environment its files run in, and a validation hook. Files load in that order (built-in
-- files, then the user's, then any extra folder such as --fixtures), each sorted by name;
-- a later plugin with the name of an earlier one replaces it (logged). A file that cannot
-- be read, does not compile, raises while it runs, or fails validation is refused: the
-- refusal goes into the set's one error list as {origin, message}, the message starting
-- with the file, and the other files still load.
--
-- The environments: a plugin file runs in a fresh table of safe globals, never the real
-- ones. `require` gives only the modules of its kind's API (docs/reference/runtime-api.md),
-- and of each module only the names the API lists, as a read-only copy: what is not in
-- the API cannot be reached from the file. The raw core.* bindings are never in it.
-- Engine adapters are the exception: they are the engine layer, trusted like config.lua,
-- and get the full runtime (`trusted = true`).
local fs = require("core.fs")
local log = require("demesne.log")
local runtime = require("demesne.runtime")

local plugins = {}

--------------------------------------------------------------------------------------------
-- Environments

local SAFE_GLOBALS = { "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget", "rawlen",
  "rawset", "select", "setmetatable", "getmetatable", "tonumber", "tostring", "type", "xpcall", "_VERSION",
  "collectgarbage" }
local OS_ALLOWED = { "clock", "date", "difftime", "getenv", "time", "tmpname" }
local DOC = "docs/reference/runtime-api.md"

local function copy_lib(lib, names)
  local out = {}
  if names then
    for _, k in ipairs(names) do out[k] = lib[k] end
  else
    for k, v in pairs(lib) do out[k] = v end
  end
  return out
end

local READONLY = {
  __newindex = function(_, k) error(("cannot set %s: a runtime module is read-only"):format(tostring(k)), 2) end,
  __metatable = "read-only",
}

--- A read-only table holding the fields `names` of `mod` (and nothing else): what a plugin
--- file sees of a runtime module. A name `mod` lacks is an error (the API names it).
---@param mod table
---@param names string[]
---@param modname string  for the message
---@return table
function plugins.expose(mod, names, modname)
  local out = {}
  for _, k in ipairs(names) do
    if mod[k] == nil then error(("runtime API: %s has no field %s"):format(modname or "module", k), 0) end
    out[k] = mod[k]
  end
  return setmetatable(out, READONLY)
end

---@class PluginEnvOptions
---@field kind string        "tool", "policy", "provider", "engine": for messages
---@field kinds string       its plural, for messages ("tools", "policies")
---@field api table<string, string[]>|nil  module name -> the names a file sees of it
---@field globals table<string, any>|nil   extra globals (a policy's ALLOW, DENY, sources)
---@field trusted boolean|nil  the full runtime: every module, the real io and os (engines)
---@field logger string|nil  logger of print()

--- Builds the environment a plugin file runs in. `origin` names the file in messages.
--- Safe globals; copies of string, table, math, utf8; os without execute, exit, remove,
--- rename and setlocale; io with open, lines (with a file name) and type; print writes a
--- log record (stdout carries the protocol); load compiles text only, in this environment.
--- `require` gives the standard libraries above and the API's modules, and refuses the
--- rest naming the reason.
---@param origin string
---@param opts PluginEnvOptions
---@return table env
function plugins.environment(origin, opts)
  if opts.trusted then
    local env = setmetatable({}, { __index = _G })
    env._G = env
    return env
  end
  local env = {}
  for _, k in ipairs(SAFE_GLOBALS) do env[k] = _G[k] end
  local libs = {
    string = copy_lib(string), table = copy_lib(table), math = copy_lib(math), utf8 = copy_lib(utf8),
    os = copy_lib(os, OS_ALLOWED),
  }
  for k, v in pairs(libs) do env[k] = v end
  env.io = {
    open = function(path, mode)
      if type(path) ~= "string" then error("io.open: a file name is required", 2) end
      return io.open(path, mode)
    end,
    lines = function(path, ...)
      if type(path) ~= "string" then error("io.lines: a file name is required (stdin carries the protocol)", 2) end
      return io.lines(path, ...)
    end,
    type = io.type,
  }
  local logger = opts.logger or ("demesne." .. opts.kinds)
  env.print = function(...)
    local parts = table.pack(...)
    for i = 1, parts.n do parts[i] = tostring(parts[i]) end
    log.info(logger, "%s: %s", origin, table.concat(parts, "\t", 1, parts.n))
  end
  env.load = function(chunk, name, mode, e)
    if mode ~= nil and mode ~= "t" then error(("load: only text chunks are allowed in a %s"):format(opts.kind), 2) end
    return load(chunk, name, "t", e == nil and env or e)
  end
  local api, seen = opts.api or {}, {}
  env.require = function(name)
    if type(name) ~= "string" then error("require: module name must be a string", 2) end
    if libs[name] then return libs[name] end
    if seen[name] then return seen[name] end
    if name:match("^core%.") or name == "core" then
      error(("require(%q) is not allowed in a %s: the raw core.* bindings are not available to %s; "
        .. "use the demesne.* runtime modules (%s)"):format(name, opts.kind, opts.kinds, DOC), 2)
    end
    local names = api[name]
    if not names then
      error(("require(%q): module not available to %s (only string, table, math, utf8, os and the runtime API "
        .. "in %s)"):format(name, opts.kinds, DOC), 2)
    end
    -- the API's modules load when a file first asks for one: this is `require` itself
    seen[name] = plugins.expose(require(name), names, name) -- lazy: the plugin's own require
    return seen[name]
  end
  env._G = env
  return env
end

--------------------------------------------------------------------------------------------
-- Loading

---@class PluginFile
---@field name string     the file's name without .lua ("sandbox_script"), or a folder plugin's folder name
---@field origin string   "embedded:tools/sandbox_script.lua", or a path on disk
---@field builtin boolean
---@field dir string|nil  a folder plugin's folder on disk (nil for a built-in one: the runtime holds it)

---@class PluginKind
---@field kind string               "tool", "policy", "provider", "engine"
---@field kinds string              the plural ("tools", "policies", …)
---@field builtin string|nil        runtime folder of the built-in files ("tools/"), nil for none
---@field skip table<string, boolean>|nil  built-in file names that are not plugins ({["init.lua"] = true})
---@field user_dir string|false|nil the user folder (false: none)
---@field dirs string[]|nil         more folders, loaded last (--fixtures)
---@field only string|nil           load only the files named <only>.lua
---@field folders boolean|nil       plugins are folders, not Lua files (images): nothing runs; check gets (nil, file)
---@field env (fun(origin: string): table)|nil  the environment of one file (plugins.environment)
---@field check fun(value: any, file: PluginFile): any, string|nil  validation hook: the plugin, false when the file offers none, or nil and "field: reason"
---@field key (fun(plugin: any, file: PluginFile): string)|nil  the plugin's name (default: file.name)
---@field quiet boolean|nil         do not log refusals (commands that print them)
---@field logger string|nil

---@class PluginSet
---@field kind string
---@field by_name table<string, any>        name -> plugin
---@field origins table<string, string>     name -> where it came from
---@field order string[]                    names in load order (a replaced plugin keeps its place)
---@field errors {origin: string, message: string}[]  refused files; each message starts with its origin
local Set = {}
Set.__index = Set

--- The plugin named `name`, or nil.
---@param name string
---@return any
function Set:get(name) return self.by_name[name] end

--- Every plugin, in load order.
---@return any[]
function Set:list()
  local out = {}
  for _, n in ipairs(self.order) do out[#out + 1] = self.by_name[n] end
  return out
end

--- Records a refusal in the set's error list (and the log unless the set is quiet).
---@param origin string
---@param message string  starts with the origin
function Set:refuse(origin, message)
  self.errors[#self.errors + 1] = { origin = origin, message = message }
  if not self.quiet then log.error(self.logger, "refused %s", message) end
end

--- Adds a plugin under `name`; one of that name is replaced (and that is logged).
---@param name string
---@param plugin any
---@param origin string
function Set:add(name, plugin, origin)
  local prev = self.origins[name]
  if prev then
    log.info(self.logger, "%s %s from %s replaces the one from %s", self.kind, name, origin, prev)
  else
    self.order[#self.order + 1] = name
  end
  self.by_name[name], self.origins[name] = plugin, origin
end

--- Drops the plugin `name` (a later check refused it).
---@param name string
function Set:remove(name)
  if not self.by_name[name] then return end
  self.by_name[name], self.origins[name] = nil, nil
  for i, n in ipairs(self.order) do
    if n == name then table.remove(self.order, i) break end
  end
end

--- The plugin files of a folder on disk: its *.lua files (not hidden), sorted by name. A
--- missing folder gives an empty list.
---@param dir string
---@return string[] paths
function plugins.files_in(dir)
  local st = fs.stat(dir)
  if not st or st.type ~= "directory" then return {} end
  local out = {}
  for _, n in ipairs(fs.readdir(dir) or {}) do
    if n:match("%.lua$") and not n:match("^%.") then out[#out + 1] = dir .. "/" .. n end
  end
  table.sort(out)
  return out
end

local function read(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s, rerr = f:read("a")
  f:close()
  if not s then return nil, rerr end
  return s
end

--- Runs one plugin file's source in its environment and validates what it returns.
--- Returns the plugin, false when the file offers none, or nil and an error that starts
--- with the origin.
---@param spec PluginKind
---@param src string
---@param file PluginFile
---@return any plugin, string|nil err
function plugins.load_source(spec, src, file)
  local origin = file.origin
  local chunkname = origin:gsub("^embedded:", "")
  -- Lua errors already start with "chunkname:line:"; others get the origin in front
  local function located(e)
    e = tostring(e)
    if e:sub(1, #chunkname + 1) == chunkname .. ":" then return e end
    return ("%s: %s"):format(origin, e)
  end
  local chunk, err = load(src, "@" .. chunkname, "t", spec.env(origin))
  if not chunk then return nil, located(err) end
  local ok, value = pcall(chunk)
  if not ok then return nil, located(value) end
  local plugin, why = spec.check(value, file)
  if plugin == nil then return nil, ("%s: %s"):format(origin, tostring(why)) end
  return plugin
end

-- Folder plugins (images): each folder of the built-in runtime folder, then of the user
-- folder, is handed to the validation hook as is.
local function load_folders(spec, set)
  local function take(file)
    local plugin, why = spec.check(nil, file)
    if plugin == false then
      log.debug(set.logger, "%s offers no %s", file.origin, spec.kind)
    elseif plugin == nil then
      set:refuse(file.origin, ("%s: %s"):format(file.origin, tostring(why)))
    else
      set:add(spec.key and spec.key(plugin, file) or file.name, plugin, file.origin)
    end
  end
  if spec.builtin then
    for _, n in ipairs(runtime.dirs(spec.builtin)) do
      take({ name = n, origin = "embedded:" .. spec.builtin .. n .. "/", builtin = true })
    end
  end
  local names = spec.user_dir and fs.readdir(spec.user_dir) or {}
  table.sort(names)
  for _, n in ipairs(names) do
    local path = spec.user_dir .. "/" .. n
    local st = fs.stat(path)
    if st and st.type == "directory" and not n:match("^%.") then
      take({ name = n, origin = path, builtin = false, dir = path })
    end
  end
  return set
end

--- Loads every plugin of a kind (see PluginKind) into a new set. Never raises for a bad
--- file: it is refused into set.errors.
---@param spec PluginKind
---@return PluginSet
function plugins.load(spec)
  local set = setmetatable({ kind = spec.kind, by_name = {}, origins = {}, order = {}, errors = {},
    quiet = spec.quiet, logger = spec.logger or ("demesne." .. spec.kinds) }, Set)
  if spec.folders then return load_folders(spec, set) end
  local function wanted(base)
    return base:match("%.lua$") and not base:match("^%.") and (not spec.only or base == spec.only .. ".lua")
  end
  local function take(src, file, read_err)
    if not src then return set:refuse(file.origin, ("%s: %s"):format(file.origin, tostring(read_err))) end
    local plugin, err = plugins.load_source(spec, src, file)
    if plugin == false then
      log.debug(set.logger, "%s offers no %s", file.origin, spec.kind)
    elseif plugin == nil then
      set:refuse(file.origin, err)
    else
      local name = spec.key and spec.key(plugin, file) or file.name
      set:add(name, plugin, file.origin)
      log.debug(set.logger, "loaded %s %s from %s", spec.kind, name, file.origin)
    end
  end
  if spec.builtin then
    for _, rel in ipairs(runtime.list(spec.builtin)) do
      local base = rel:sub(#spec.builtin + 1)
      if wanted(base) and not (spec.skip and spec.skip[base]) then
        local src, origin = runtime.source(rel)
        take(src, { name = base:sub(1, -5), origin = origin or rel, builtin = true }, "cannot read")
      end
    end
  end
  local dirs = {}
  if spec.user_dir then dirs[1] = spec.user_dir end
  for _, d in ipairs(spec.dirs or {}) do dirs[#dirs + 1] = d end
  for i, dir in ipairs(dirs) do
    local files = plugins.files_in(dir)
    if #files == 0 and (i > 1 or not spec.user_dir) then
      log.warning(set.logger, "no %s files in %s", spec.kind, dir)
    end
    for _, path in ipairs(files) do
      local base = path:match("[^/]+$")
      if wanted(base) then
        local src, err = read(path)
        take(src, { name = base:sub(1, -5), origin = path, builtin = false }, err)
      end
    end
  end
  return set
end

return plugins
