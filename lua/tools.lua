-- Tools: loading, checking and calling the Lua files that implement MCP tools.
--
-- A tool file returns a descriptor:
--
--   return {
--     name = "sandbox_script",            -- 1–128 of [A-Za-z0-9_.-], unique
--     title = "Run a script",             -- optional, for people
--     description = "…",                  -- required, for the model
--     inputSchema = { type = "object", properties = {…}, required = {…} },
--     outputSchema = { type = "object", … },      -- optional
--     annotations = { readOnlyHint = true, … },   -- optional
--     run = function(ctx, args) … return result_table [, text] end,
--   }
--
-- Files load from the built-in tools/ folder, then $XDG_CONFIG_HOME/demesne/tools/, then
-- the --fixtures folder; a later file with the same tool name replaces the earlier one.
-- A file that fails to load or returns a bad descriptor is refused with a log message
-- naming the file and the field; the others still load.
--
-- Tool files run in a fresh environment of safe globals whose `require` gives the
-- demesne.* runtime modules and string/table/math/utf8/os (os without execute, exit,
-- remove, rename, setlocale), and refuses the raw core.* bindings. `io` offers open,
-- lines (with a file name) and type only; `print` writes a log record to stderr.
local json = require("demesne.json")
local log = require("demesne.log")
local schema = require("demesne.mcp.schema")

local tools = {}

local LOGGER = "demesne.tools"

---@class ToolDescriptor
---@field name string
---@field title string|nil
---@field description string
---@field inputSchema table
---@field outputSchema table|nil
---@field annotations table|nil
---@field execution table|nil  {taskSupport = "forbidden"|"optional"|"required"} (MCP 2025-11-25 tasks)
---@field clientCapabilities string[]|nil  client capabilities the tool needs ("sampling", "elicitation",
---   "roots"); a 2026-07-28 call from a client that did not declare one is refused with -32021
---@field run fun(ctx: ToolContext, args: table): any, string|nil
---@field origin string   where it was loaded from (set by the loader)

---@class ToolContext
---@field request_id string|number        the JSON-RPC id of the tools/call request
---@field tool string                      the tool's name
---@field client_info table|nil            clientInfo from initialize ({name, version, …})
---@field client_capabilities table        capabilities from initialize
---@field protocol_version string          the negotiated protocol revision
---@field meta table|nil                   the request's params._meta
---@field progress fun(progress: number, total: number|nil, message: string|nil): boolean
---@field log fun(level: string, message: string, data: any|nil)
---@field is_cancelled fun(): boolean
---@field request fun(method: string, params: table|nil, opts: table|nil): table|nil, string|nil, any

--------------------------------------------------------------------------------------------
-- Failures

local Fail = {}
Fail.__index = Fail
Fail.__name = "demesne.tools.fail"
Fail.__tostring = function(e) return e.message end

--- A user-facing failure. Raise it from a tool with `error(tools.fail("files[0]: no such file"))`:
--- the call returns `isError: true` with `msg` as its text (and `data`, when given, as a
--- second text block holding its JSON). The message should name the field and the reason.
---@param msg string
---@param data any|nil  extra detail (JSON-encodable)
---@return table err
function tools.fail(msg, data)
  return setmetatable({ demesne_error = true, message = tostring(msg), data = data }, Fail)
end

--- True for an error raised with tools.fail (or any table with demesne_error = true and a
--- message, as lua/sandbox.lua raises).
---@param e any
---@return boolean
function tools.is_fail(e)
  return type(e) == "table" and e.demesne_error == true and e.message ~= nil
end

--------------------------------------------------------------------------------------------
-- The environment tool files run in

local SAFE_GLOBALS = { "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget", "rawlen",
  "rawset", "select", "setmetatable", "getmetatable", "tonumber", "tostring", "type", "xpcall", "_VERSION",
  "collectgarbage" }
local OS_ALLOWED = { "clock", "date", "difftime", "getenv", "time", "tmpname" }

local function copy_lib(lib, names)
  local out = {}
  if names then
    for _, k in ipairs(names) do out[k] = lib[k] end
  else
    for k, v in pairs(lib) do out[k] = v end
  end
  return out
end

--- Builds the environment a tool file runs in. `origin` names the file in errors.
---@param origin string
---@return table env
function tools.sandbox_env(origin)
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
  env.print = function(...)
    local parts = table.pack(...)
    for i = 1, parts.n do parts[i] = tostring(parts[i]) end
    log.info(LOGGER, "%s: %s", origin, table.concat(parts, "\t", 1, parts.n))
  end
  env.load = function(chunk, name, mode, e)
    if mode ~= nil and mode ~= "t" then error("load: only text chunks are allowed in a tool", 2) end
    return load(chunk, name, "t", e == nil and env or e)
  end
  env.require = function(name)
    if type(name) ~= "string" then error("require: module name must be a string", 2) end
    if libs[name] then return libs[name] end
    if name:match("^core%.") or name == "core" then
      error(("require(%q) is not allowed in a tool: the raw core.* bindings are not available to tools; "
        .. "use the demesne.* runtime modules"):format(name), 2)
    end
    if name:match("^demesne%.") or name == "demesne" then return require(name) end
    error(("require(%q): module not available to tools (only demesne.* and string, table, math, utf8, os)"):format(name), 2)
  end
  env._G = env
  return env
end

--------------------------------------------------------------------------------------------
-- Descriptors

local NAME_MAX = 128
local HINTS = { readOnlyHint = true, destructiveHint = true, idempotentHint = true, openWorldHint = true }

--- Checks a descriptor. Returns true, or nil and "field: reason".
---@param d any
---@return boolean|nil ok, string|nil err
function tools.check_descriptor(d)
  if type(d) ~= "table" then return nil, ("the file must return a descriptor table, got %s"):format(type(d)) end
  if type(d.name) ~= "string" then return nil, "name: must be a string" end
  if #d.name < 1 or #d.name > NAME_MAX or not d.name:match("^[A-Za-z0-9_%.%-]+$") then
    return nil, ("name: %q must be 1-128 characters of A-Z a-z 0-9 _ . -"):format(d.name)
  end
  if d.title ~= nil and type(d.title) ~= "string" then return nil, "title: must be a string" end
  if type(d.description) ~= "string" or d.description == "" then return nil, "description: must be a non-empty string" end
  if type(d.inputSchema) ~= "table" then return nil, "inputSchema: must be a table (a JSON Schema object)" end
  if d.inputSchema.type ~= "object" then return nil, 'inputSchema.type: must be "object"' end
  local ok, err = schema.check(d.inputSchema, "inputSchema")
  if not ok then return nil, err end
  if d.outputSchema ~= nil then
    if type(d.outputSchema) ~= "table" then return nil, "outputSchema: must be a table (a JSON Schema object)" end
    if d.outputSchema.type ~= "object" then return nil, 'outputSchema.type: must be "object"' end
    ok, err = schema.check(d.outputSchema, "outputSchema")
    if not ok then return nil, err end
  end
  if d.annotations ~= nil then
    if type(d.annotations) ~= "table" then return nil, "annotations: must be a table" end
    for k, v in pairs(d.annotations) do
      if HINTS[k] and type(v) ~= "boolean" then return nil, ("annotations.%s: must be a boolean"):format(k) end
      if k == "title" and type(v) ~= "string" then return nil, "annotations.title: must be a string" end
    end
  end
  if d.execution ~= nil then
    if type(d.execution) ~= "table" then return nil, "execution: must be a table" end
    local ts = d.execution.taskSupport
    if ts ~= nil and ts ~= "forbidden" and ts ~= "optional" and ts ~= "required" then
      return nil, 'execution.taskSupport: must be "forbidden", "optional" or "required"'
    end
  end
  if d.clientCapabilities ~= nil then
    if type(d.clientCapabilities) ~= "table" then return nil, "clientCapabilities: must be a list of strings" end
    for i, c in ipairs(d.clientCapabilities) do
      if type(c) ~= "string" then return nil, ("clientCapabilities[%d]: must be a string"):format(i - 1) end
    end
  end
  if type(d.run) ~= "function" then return nil, "run: must be a function(ctx, args)" end
  return true
end

--- Loads one tool file's source in the tool environment and checks its descriptor.
--- Returns the descriptor (with `origin` set), or nil and an error naming the origin and field.
---@param src string      the file's contents
---@param origin string   where it came from (a path or "embedded:tools/x.lua"), used in messages
---@return ToolDescriptor|nil tool, string|nil err
function tools.load_source(src, origin)
  local env = tools.sandbox_env(origin)
  local chunkname = origin:gsub("^embedded:", "")
  -- Lua errors already start with "chunkname:line:"; others get the origin in front
  local function located(e)
    e = tostring(e)
    if e:sub(1, #chunkname + 1) == chunkname .. ":" then return e end
    return ("%s: %s"):format(origin, e)
  end
  local chunk, err = load(src, "@" .. chunkname, "t", env)
  if not chunk then return nil, located(err) end
  local ok, d = pcall(chunk)
  if not ok then return nil, located(d) end
  local good, why = tools.check_descriptor(d)
  if not good then return nil, ("%s: %s"):format(origin, why) end
  d.origin = origin
  return d
end

---@class ToolRegistry
---@field by_name table<string, ToolDescriptor>
---@field errors {origin: string, message: string}[]  files that were refused
local Registry = {}
Registry.__index = Registry

--- An empty registry.
---@return ToolRegistry
function tools.registry()
  return setmetatable({ by_name = {}, errors = {}, listing_cache = nil }, Registry)
end

--- Adds a checked descriptor; a tool with the same name is replaced (and that is logged).
---@param d ToolDescriptor
function Registry:add(d)
  local ok, err = tools.check_descriptor(d)
  if not ok then error(("tool %s: %s"):format(tostring(type(d) == "table" and d.name), err), 2) end
  d.origin = d.origin or "(added)"
  local prev = self.by_name[d.name]
  if prev then
    log.info(LOGGER, "tool %s from %s replaces the one from %s", d.name, d.origin, prev.origin)
  end
  self.by_name[d.name] = d
  self.listing_cache = nil
end

--- The tool named `name`, or nil.
---@param name string
---@return ToolDescriptor|nil
function Registry:get(name) return self.by_name[name] end

--- Every tool, sorted by name.
---@return ToolDescriptor[]
function Registry:list()
  local out = {}
  for _, d in pairs(self.by_name) do out[#out + 1] = d end
  table.sort(out, function(a, b) return a.name < b.name end)
  return out
end

--- The tools/list entries (name, title, description, inputSchema, outputSchema,
--- annotations), sorted by name, ready for JSON. Cached until the registry changes.
---@return table[]
function Registry:listing()
  if self.listing_cache then return self.listing_cache end
  local out = json.array()
  for _, d in ipairs(self:list()) do
    out[#out + 1] = {
      name = d.name,
      title = d.title,
      description = d.description,
      inputSchema = schema.for_json(d.inputSchema),
      outputSchema = d.outputSchema and schema.for_json(d.outputSchema) or nil,
      annotations = d.annotations and schema.copy(d.annotations) or nil,
      execution = d.execution and schema.copy(d.execution) or nil,
    }
  end
  self.listing_cache = out
  return out
end

--- The plugin files of a user folder: its *.lua files (not hidden), sorted by name.
--- A missing folder gives an empty list. Shared by the tool and provider loaders.
---@param dir string
---@return string[] paths
function tools.lua_files_in(dir)
  local fs = require("core.fs")
  local st = fs.stat(dir)
  if not st or st.type ~= "directory" then return {} end
  local out = {}
  for _, n in ipairs(fs.readdir(dir) or {}) do
    if n:match("%.lua$") and not n:match("^%.") then out[#out + 1] = dir .. "/" .. n end
  end
  table.sort(out)
  return out
end

--- Reads a whole file. Returns its contents, or nil and the error.
---@param path string
---@return string|nil contents, string|nil err
function tools.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

local lua_files_in, read = tools.lua_files_in, tools.read_file

--- The folder users drop their own tools into: $XDG_CONFIG_HOME/demesne/tools.
---@return string
function tools.user_dir()
  local ok, config = pcall(require, "demesne.config")
  if ok and type(config) == "table" and config.dir then return config.dir() .. "/tools" end
  local base = os.getenv("XDG_CONFIG_HOME")
  if not base or base == "" then base = (os.getenv("HOME") or "/root") .. "/.config" end
  return base .. "/demesne/tools"
end

--- Loads every tool: built-in tools/*.lua, then the user folder, then `opts.fixtures`.
--- Refused files are logged (unless opts.quiet) and listed in registry.errors.
---@param opts {fixtures: string|nil, user_dir: string|nil, builtin: boolean|nil, quiet: boolean|nil}|nil
---   builtin = false skips the built-in tools; user_dir overrides the user folder (false: none)
---@return ToolRegistry
function tools.load(opts)
  opts = opts or {}
  local reg = tools.registry()
  local function take(src, origin, read_err)
    local d, err
    if not src then
      err = ("%s: %s"):format(origin, tostring(read_err))
    else
      d, err = tools.load_source(src, origin)
    end
    if d then
      reg:add(d)
      log.debug(LOGGER, "loaded tool %s from %s", d.name, origin)
    else
      reg.errors[#reg.errors + 1] = { origin = origin, message = err }
      if not opts.quiet then log.error(LOGGER, "refused %s", err) end
    end
  end
  if opts.builtin ~= false then
    local runtime = require("demesne.runtime")
    for _, rel in ipairs(runtime.list("tools/")) do
      if rel:match("%.lua$") then
        local src, origin = runtime.source(rel)
        take(src, origin or rel, "cannot read")
      end
    end
  end
  local user = opts.user_dir
  if user == nil then user = tools.user_dir() end
  if user then
    for _, path in ipairs(lua_files_in(user)) do take(read(path), path) end
  end
  if opts.fixtures then
    local files = lua_files_in(opts.fixtures)
    if #files == 0 then log.warning(LOGGER, "no tool files in --fixtures folder %s", opts.fixtures) end
    for _, path in ipairs(files) do take(read(path), path) end
  end
  return reg
end

--------------------------------------------------------------------------------------------
-- Calling

local function text_block(s) return { type = "text", text = s } end

local function error_result(msg, data)
  local content = json.array({ text_block(msg) })
  if data ~= nil then
    local ok, s = pcall(json.encode, data)
    if ok then content[2] = text_block(s) end
  end
  return { content = content, isError = true }
end

--- A CallToolResult that reports a failure to the caller: `{content = [{type="text", text=msg}], isError = true}`.
---@param msg string
---@param data any|nil
---@return table
function tools.error_result(msg, data) return error_result(msg, data) end

-- The first line of an error: the caller sees the reason (with its file:line), never a traceback.
local function first_line(s)
  s = tostring(s)
  return s:match("^[^\n]*") or s
end

--- Turns what `run` returned into a CallToolResult.
--- `res` a table with a `content` list = a raw CallToolResult (content, structuredContent,
--- isError, _meta passed through); any other table = structuredContent, with `text` (or its
--- JSON) as the one text block; a string = the text; nil = `text` or "".
---@param res any
---@param text string|nil
---@return table
function tools.to_result(res, text)
  if type(res) == "table" and getmetatable(res) ~= Fail and type(res.content) == "table" then
    local content = json.array()
    for i, c in ipairs(res.content) do content[i] = c end
    return { content = content, structuredContent = res.structuredContent, isError = res.isError == true,
      _meta = res._meta }
  end
  if type(res) == "table" then
    return { content = json.array({ text_block(text ~= nil and tostring(text) or json.encode(res)) }),
      structuredContent = res, isError = false }
  end
  if res == nil then return { content = json.array({ text_block(text ~= nil and tostring(text) or "") }), isError = false } end
  if type(res) == "string" then return { content = json.array({ text_block(res) }), isError = false } end
  return { content = json.array({ text_block(text ~= nil and tostring(text) or json.encode(res)) }), isError = false }
end

--- Validates `args` against the tool's inputSchema (defaults applied to a copy), runs the
--- tool in the current task and returns a CallToolResult. Invalid arguments, tools.fail()
--- and any other error become `isError: true` results; a Lua error's traceback goes to the
--- log only. async.CANCELLED is re-raised (the caller sends no response for it).
---@param tool ToolDescriptor
---@param ctx ToolContext
---@param args table|nil
---@return table result
function tools.call(tool, ctx, args)
  local async = require("demesne.async")
  if args == nil then args = {} end
  local prepared = schema.apply_defaults(tool.inputSchema, args)
  local ok, errs = schema.validate(tool.inputSchema, prepared)
  if not ok then
    local msg = ("Invalid arguments for tool %s: %s"):format(tool.name, schema.format_errors(errs))
    return error_result(msg)
  end
  local packed = table.pack(xpcall(tool.run, function(e)
    if e == async.CANCELLED or tools.is_fail(e) then return e end
    return { traceback = debug.traceback(tostring(e), 2), message = e }
  end, ctx, prepared))
  if not packed[1] then
    local e = packed[2]
    if e == async.CANCELLED then error(e, 0) end
    if tools.is_fail(e) then return error_result(tostring(e.message), e.data) end
    log.error(LOGGER, "tool %s failed: %s", tool.name, e.traceback or tostring(e))
    return error_result(("Tool %s failed: %s"):format(tool.name, first_line(e.message)))
  end
  local res_ok, result = pcall(tools.to_result, packed[2], packed[3])
  if not res_ok then
    log.error(LOGGER, "tool %s returned a result that cannot be encoded: %s", tool.name, tostring(result))
    return error_result(("Tool %s returned a result that cannot be encoded as JSON: %s"):format(tool.name,
      first_line(result)))
  end
  return result
end

tools.schema = schema

--- Validates a value against a JSON Schema: see demesne.mcp.schema.validate.
tools.validate = schema.validate

return tools
