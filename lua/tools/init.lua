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
-- Tool files run in a fresh environment of safe globals (demesne.plugins) whose `require`
-- gives string/table/math/utf8/os (os without execute, exit, remove, rename, setlocale)
-- and the runtime API of lua/tools/api.lua, documented in docs/reference/runtime-api.md:
-- of each module only the names listed there. Everything else, the raw core.* bindings and
-- the engine adapter included, is unreachable. `io` offers open, lines (with a file name)
-- and type only; `print` writes a log record to stderr.
local api = require("demesne.tools.api")
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local json = require("demesne.json")
local log = require("demesne.log")
local plugins = require("demesne.plugins")
local schema = require("demesne.jsonschema")

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
---@field client {capabilities: table, protocol_version: string, modern: boolean, info: table|nil, request: fun(method: string, params: table|nil, opts: table|nil): table|nil, string|nil, any}|nil
---   the host client behind the call, for asking it something later (the egress `ask` verdict):
---   request() uses the call's stream while the call lasts, else the session's own

--------------------------------------------------------------------------------------------
-- The environment tool files run in

--- Builds the environment a tool file runs in (demesne.plugins: safe globals, and `require`
--- of the runtime API in lua/tools/api.lua only). `origin` names the file in errors.
---@param origin string
---@return table env
function tools.environment(origin)
  return plugins.environment(origin, { kind = "tool", kinds = "tools", api = api, logger = LOGGER })
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

-- The tool kind of plugin (demesne.plugins); `opts` as tools.load takes them.
local function kind(opts)
  return {
    kind = "tool", kinds = "tools", logger = LOGGER, quiet = opts.quiet,
    builtin = opts.builtin ~= false and "tools/" or nil,
    user_dir = opts.user_dir == nil and (config.dir() .. "/tools") or opts.user_dir,
    dirs = opts.fixtures and { opts.fixtures } or nil,
    env = tools.environment,
    check = function(d, file)
      local good, why = tools.check_descriptor(d)
      if not good then return nil, why end
      d.origin = file.origin
      return d
    end,
    key = function(d) return d.name end,
  }
end

--- Loads one tool file's source in the tool environment and checks its descriptor.
--- Returns the descriptor (with `origin` set), or nil and an error naming the origin and field.
---@param src string      the file's contents
---@param origin string   where it came from (a path or "embedded:tools/x.lua"), used in messages
---@return ToolDescriptor|nil tool, string|nil err
function tools.load_source(src, origin)
  local d, err = plugins.load_source(kind({}), src, { name = origin:match("([^/]+)%.lua$") or origin, origin = origin })
  if not d then return nil, err or ("%s: the file must return a descriptor table"):format(origin) end
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

--- Loads every tool: built-in tools/*.lua, then the user folder
--- ($XDG_CONFIG_HOME/demesne/tools), then `opts.fixtures`, through demesne.plugins. A later
--- tool with the same name replaces an earlier one. Refused files are logged (unless
--- opts.quiet) and listed in registry.errors.
---@param opts {fixtures: string|nil, user_dir: string|false|nil, builtin: boolean|nil, quiet: boolean|nil}|nil
---   builtin = false skips the built-in tools; user_dir overrides the user folder (false: none)
---@return ToolRegistry
function tools.load(opts)
  opts = opts or {}
  local set = plugins.load(kind(opts))
  local reg = tools.registry()
  for _, d in ipairs(set:list()) do reg.by_name[d.name] = d end
  reg.errors = set.errors
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
  if type(res) == "table" and not errors.is(res) and type(res.content) == "table" then
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
--- tool in the current task and returns a CallToolResult. Invalid arguments, demesne.errors
--- and any other error become `isError: true` results; a Lua error's traceback goes to the
--- log only. async.CANCELLED is re-raised (the caller sends no response for it).
---@param tool ToolDescriptor
---@param ctx ToolContext
---@param args table|nil
---@return table result
function tools.call(tool, ctx, args)
  if args == nil then args = {} end
  local prepared = schema.apply_defaults(tool.inputSchema, args)
  local ok, errs = schema.validate(tool.inputSchema, prepared)
  if not ok then
    local msg = ("Invalid arguments for tool %s: %s"):format(tool.name, schema.format_errors(errs))
    return error_result(msg)
  end
  local packed = table.pack(xpcall(tool.run, function(e)
    if e == async.CANCELLED or errors.is(e) then return e end
    return { traceback = debug.traceback(tostring(e), 2), message = e }
  end, ctx, prepared))
  if not packed[1] then
    local e = packed[2]
    if e == async.CANCELLED then error(e, 0) end
    if errors.is(e) then return error_result(e.message, e.data) end
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

--- The error constructor under its older name (demesne.errors.new): tool files written
--- before demesne.errors raise `error(require("demesne.tools").fail("field: reason"))`.
tools.fail = errors.new

--- Validates a value against a JSON Schema: see demesne.jsonschema.validate.
tools.validate = schema.validate

return tools
