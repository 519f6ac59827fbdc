-- Host MCP servers: which ones there are, where each was declared, and which of its tools
-- it may offer. Read by lua/hostmcp (the upstreams) and `demesne check-config`.
--
-- Sources, in order (a name declared earlier wins; the later one is reported and ignored):
--   1. `host_mcp` in config.lua: name = {command, args, env, env_vars, cwd, tools,
--      timeout_seconds} for stdio, or {url, http_headers, env_http_headers,
--      bearer_token_env_var, tools, timeout_seconds} for Streamable HTTP. An entry with
--      only `tools` (and timeout_seconds) names the tools of an imported server.
--   2. with `host_mcp_import` naming claude_code: $CLAUDE_CONFIG_DIR/.claude.json, else
--      ~/.claude.json — its top-level `mcpServers`, then each `projects[<path>].mcpServers`
--      (type stdio or http; ${VAR} and ${VAR:-default} expanded from demesne's environment in
--      command, args, env, url and headers, as Claude Code does).
--   3. with `host_mcp_import` naming codex: $CODEX_HOME/config.toml, else
--      ~/.codex/config.toml — its `[mcp_servers.<name>]` tables (command/args/env/env_vars/
--      cwd, or url/bearer_token_env_var/http_headers/env_http_headers; enabled = false is
--      skipped). TOML is read by Python's standard tomllib in a short-lived helper process.
-- An imported server offers no tool until config.lua names its tools. The server named
-- "demesne", and any entry that runs the demesne binary or reaches demesne's own HTTP
-- endpoint (its token variable DEMESNE_HTTP_TOKEN), is skipped: that one is demesne itself.
-- A malformed entry is refused with a message naming the file, the server and the field;
-- the others still load.
local config = require("demesne.config")
local json = require("demesne.json")
local proc = require("demesne.proc")
local fs = require("core.fs")
local loop = require("core.loop")

local M = {}

--- Names a server may have: they become `mcp__<server>__<tool>` in Claude Code and a TOML
--- key in Codex.
M.NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]*$"
M.NAME_MAX = 64
M.RESERVED = "demesne"
M.SOURCES = { claude_code = true, codex = true }
local MAX_FILE_BYTES = 16 * 1024 * 1024   -- a client's config file read for import
local MAX_HELPER_OUTPUT = 4 * 1024 * 1024 -- the TOML helper's JSON
local HELPER_TIMEOUT_MS = 15000

local CONFIG_KEYS = {
  command = true, args = true, env = true, env_vars = true, cwd = true, url = true, http_headers = true,
  env_http_headers = true, bearer_token_env_var = true, tools = true, timeout_seconds = true,
}

local function home() return os.getenv("HOME") or "/root" end

--- Where Claude Code keeps its user configuration: $CLAUDE_CONFIG_DIR/.claude.json, else
--- ~/.claude.json.
---@return string
function M.claude_code_path()
  local d = os.getenv("CLAUDE_CONFIG_DIR")
  if d and d ~= "" then return d .. "/.claude.json" end
  return home() .. "/.claude.json"
end

--- Where Codex keeps its configuration: $CODEX_HOME/config.toml, else ~/.codex/config.toml.
---@return string
function M.codex_path()
  local d = os.getenv("CODEX_HOME")
  if d and d ~= "" then return d .. "/config.toml" end
  return home() .. "/.codex/config.toml"
end

local function quote(s) return ("%q"):format(tostring(s)) end

-- A problem with one entry. level: "error" (config.lua: the operator's own file) or
-- "warning" (an imported file, or a skipped entry).
local function problem(list, level, origin, server, field, msg)
  local text = ("%s: server %s"):format(origin, quote(server))
  if field then text = text .. ": field " .. field end
  list[#list + 1] = { level = level, origin = origin, server = server, field = field, message = text .. ": " .. msg }
end

local function is_list_of_strings(v)
  if type(v) ~= "table" then return false end
  local n = 0
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 then return false end
    n = n + 1
  end
  for i = 1, n do if type(v[i]) ~= "string" then return false end end
  return true
end

local function is_string_map(v)
  if type(v) ~= "table" then return false end
  for k, x in pairs(v) do
    if type(k) ~= "string" or type(x) ~= "string" then return false end
  end
  return true
end

local function env_name_ok(s) return type(s) == "string" and s:match("^[A-Za-z_][A-Za-z0-9_]*$") ~= nil end

local function header_name_ok(s) return type(s) == "string" and s:match("^[!#$%%&'*+.^_`|~0-9A-Za-z-]+$") ~= nil end

--- Parses a `tools` value: nil (no tool), "*", "read-only" or a list of tool names.
--- Returns {mode = "none"|"all"|"read-only"|"names", names = {...}, set = {name = true}}
--- or nil, reason.
---@param v any
---@return table|nil spec, string|nil err
function M.parse_tools(v)
  if v == nil then return { mode = "none", names = {}, set = {} } end
  if v == "*" then return { mode = "all", names = {}, set = {} } end
  if v == "read-only" then return { mode = "read-only", names = {}, set = {} } end
  if type(v) == "string" then
    return nil, ("%s is neither \"*\", \"read-only\" nor a list of tool names"):format(quote(v))
  end
  if not is_list_of_strings(v) then return nil, "must be \"*\", \"read-only\" or a list of tool names (strings)" end
  local names, set = {}, {}
  for _, n in ipairs(v) do
    if n == "" then return nil, "a tool name is empty" end
    if not set[n] then set[n] = true; names[#names + 1] = n end
  end
  table.sort(names)
  return { mode = #names > 0 and "names" or "none", names = names, set = set }
end

--- A tools spec as one line for people: "none", "*", "read-only" or the names.
---@param spec table
---@return string
function M.tools_text(spec)
  if spec.mode == "all" then return "*" end
  if spec.mode == "read-only" then return "read-only (readOnlyHint: true)" end
  if spec.mode == "names" then return table.concat(spec.names, ", ") end
  return "none"
end

-- Expands ${VAR} and ${VAR:-default} (Claude Code's syntax) from demesne's environment.
local function expand(s)
  local missing
  local out = s:gsub("%${([A-Za-z_][A-Za-z0-9_]*)([^}]*)}", function(name, rest)
    local v = os.getenv(name)
    if rest == "" then
      if v ~= nil then return v end
    elseif rest:sub(1, 2) == ":-" then
      if v ~= nil and v ~= "" then return v end
      return rest:sub(3)
    else
      return nil -- not Claude Code's syntax: left as it is
    end
    missing = missing or name
    return ""
  end)
  if missing then return nil, ("${%s} is not set in demesne's environment"):format(missing) end
  return out
end

-- Checks the transport fields of an entry (config.lua or Codex naming) and fills `decl`.
-- Returns true, or nil, field, reason.
local function transport_fields(decl, e)
  if e.command ~= nil and e.url ~= nil then return nil, "url", "a server has either command (stdio) or url (HTTP), not both" end
  if e.command ~= nil then
    if type(e.command) ~= "string" or e.command == "" then return nil, "command", "must be a non-empty string" end
    for _, k in ipairs({ "url", "http_headers", "env_http_headers", "bearer_token_env_var" }) do
      if e[k] ~= nil then return nil, k, "is for HTTP servers (this one has a command)" end
    end
    if e.args ~= nil and not is_list_of_strings(e.args) then return nil, "args", "must be a list of strings" end
    if e.env ~= nil and not is_string_map(e.env) then return nil, "env", "must be a table of NAME = \"value\" strings" end
    for k in pairs(e.env or {}) do
      if not env_name_ok(k) then return nil, "env", ("%s is not an environment variable name"):format(quote(k)) end
    end
    local env_vars = {}
    if e.env_vars ~= nil then
      if type(e.env_vars) ~= "table" then return nil, "env_vars", "must be a list of environment variable names" end
      for i, v in ipairs(e.env_vars) do
        -- Codex also accepts {name = "X", source = "local"}
        local n = type(v) == "table" and v.name or v
        if type(v) == "table" and v.source ~= nil and v.source ~= "local" then
          return nil, ("env_vars[%d].source"):format(i), ("%s is not supported (only local)"):format(quote(v.source))
        end
        if not env_name_ok(n) then return nil, ("env_vars[%d]"):format(i), "must be an environment variable name" end
        env_vars[#env_vars + 1] = n
      end
    end
    if e.cwd ~= nil and (type(e.cwd) ~= "string" or e.cwd:sub(1, 1) ~= "/") then
      return nil, "cwd", "must be an absolute path"
    end
    decl.transport = "stdio"
    decl.command = e.command
    decl.args = {}
    for i, a in ipairs(e.args or {}) do decl.args[i] = a end
    decl.env = {}
    for k, v in pairs(e.env or {}) do decl.env[k] = v end
    decl.env_vars = env_vars
    decl.cwd = e.cwd
    return true
  end
  if e.url ~= nil then
    if type(e.url) ~= "string" or not e.url:match("^https?://[^/%s]+") or e.url:find("%s") then
      return nil, "url", "must be an http:// or https:// URL"
    end
    for _, k in ipairs({ "args", "env", "env_vars", "cwd" }) do
      if e[k] ~= nil then return nil, k, "is for stdio servers (this one has a url)" end
    end
    if e.http_headers ~= nil and not is_string_map(e.http_headers) then
      return nil, "http_headers", "must be a table of Header = \"value\" strings"
    end
    if e.env_http_headers ~= nil and not is_string_map(e.env_http_headers) then
      return nil, "env_http_headers", "must be a table of Header = \"ENV_VAR\" strings"
    end
    for k, v in pairs(e.http_headers or {}) do
      if not header_name_ok(k) then return nil, "http_headers", ("%s is not a header name"):format(quote(k)) end
      if v:find("[\r\n]") then return nil, "http_headers." .. k, "must not contain a line break" end
    end
    for k, v in pairs(e.env_http_headers or {}) do
      if not header_name_ok(k) then return nil, "env_http_headers", ("%s is not a header name"):format(quote(k)) end
      if not env_name_ok(v) then return nil, "env_http_headers." .. k, "must name an environment variable" end
    end
    if e.bearer_token_env_var ~= nil and not env_name_ok(e.bearer_token_env_var) then
      return nil, "bearer_token_env_var", "must name an environment variable"
    end
    decl.transport = "http"
    decl.url = e.url
    decl.http_headers = {}
    for k, v in pairs(e.http_headers or {}) do decl.http_headers[k] = v end
    decl.env_http_headers = {}
    for k, v in pairs(e.env_http_headers or {}) do decl.env_http_headers[k] = v end
    decl.bearer_token_env_var = e.bearer_token_env_var
    return true
  end
  return nil, "command", "a server needs command (stdio) or url (Streamable HTTP)"
end

local function check_name(name)
  if type(name) ~= "string" or not name:match(M.NAME_PATTERN) or #name > M.NAME_MAX then
    return nil, ("the name must be letters, digits, '_' or '-' (at most %d characters)"):format(M.NAME_MAX)
  end
  return true
end

-- The real path of a program (searched in PATH when it has no '/'), or nil.
local function program_path(cmd)
  if cmd:find("/", 1, true) then return fs.realpath(cmd) end
  for dir in (os.getenv("PATH") or ""):gmatch("[^:]+") do
    local st = fs.stat(dir .. "/" .. cmd)
    if st and st.type == "file" then return fs.realpath(dir .. "/" .. cmd) end
  end
end

-- The bearer tokens of demesne's own HTTP endpoint: $DEMESNE_HTTP_TOKEN and the token
-- file `serve --http` keeps in the state folder.
local function own_tokens()
  local out = {}
  local env = os.getenv("DEMESNE_HTTP_TOKEN")
  if env and #env >= 16 then out[#out + 1] = env end
  local t = fs.read_file(config.get("state_dir") .. "/http-token", 0, 4096)
  t = t and t:match("^%s*(%S+)%s*$")
  if t and #t >= 16 then out[#out + 1] = t end
  return out
end

--- Whether a declaration is demesne itself (so it is never proxied into a sandbox): the
--- name "demesne", a command that is the demesne binary (by name or real path), or an HTTP
--- entry that authenticates with demesne's token (it names DEMESNE_HTTP_TOKEN, or a header
--- carries the token of $DEMESNE_HTTP_TOKEN or of `serve --http`'s token file).
---@param decl table
---@return boolean is_demesne, string|nil why
function M.is_demesne(decl)
  if decl.name == M.RESERVED then return true, "the name demesne is demesne's own server in every sandbox" end
  if decl.transport == "stdio" then
    local base = decl.command:match("([^/]+)$")
    if base == "demesne" then return true, "its command is the demesne binary" end
    local exe = loop.exepath()
    local real = program_path(decl.command)
    if exe and real and real == (fs.realpath(exe) or exe) then return true, "its command is the demesne binary" end
    return false
  end
  local why = "it authenticates with demesne's own token (DEMESNE_HTTP_TOKEN)"
  local values = {}
  local function add(v) if type(v) == "string" then values[#values + 1] = v end end
  add(decl.bearer_token_env_var)
  if decl.bearer_token_env_var then add(os.getenv(decl.bearer_token_env_var)) end
  for _, v in pairs(decl.env_http_headers or {}) do add(v); add(os.getenv(v)) end
  for _, v in pairs(decl.raw_headers or {}) do add(v) end
  for _, v in pairs(decl.http_headers or {}) do add(v) end
  local tokens = own_tokens()
  for _, v in ipairs(values) do
    if v:find("DEMESNE_HTTP_TOKEN", 1, true) then return true, why end
    for _, t in ipairs(tokens) do
      if v:find(t, 1, true) then return true, why end
    end
  end
  return false
end

local function timeout_field(decl, e)
  if e.timeout_seconds == nil then return true end
  if type(e.timeout_seconds) ~= "number" or e.timeout_seconds <= 0 or e.timeout_seconds ~= e.timeout_seconds then
    return nil, "timeout_seconds", "must be a positive number"
  end
  decl.timeout_ms = math.floor(e.timeout_seconds * 1000)
  return true
end

---------------------------------------------------------------------------------------------
-- config.lua

local function from_config(raw, origin, problems)
  local decls, tools_only = {}, {}
  if raw == nil then return decls, tools_only end
  if type(raw) ~= "table" then
    problems[#problems + 1] = { level = "error", origin = origin,
      message = origin .. ": host_mcp must be a table of servers (name = {...})" }
    return decls, tools_only
  end
  local names = {}
  for name in pairs(raw) do names[#names + 1] = tostring(name) end
  table.sort(names)
  for _, name in ipairs(names) do
    local e = raw[name]
    local ok, why = check_name(name)
    if not ok then
      problem(problems, "error", origin, name, nil, why)
    elseif type(e) ~= "table" then
      problem(problems, "error", origin, name, nil, "must be a table")
    else
      local bad
      for k in pairs(e) do
        if not CONFIG_KEYS[k] and not bad then bad = k end
      end
      local tools, terr = M.parse_tools(e.tools)
      if bad then
        problem(problems, "error", origin, name, tostring(bad), "is not a host_mcp field (one of: " ..
          "command, args, env, env_vars, cwd, url, http_headers, env_http_headers, bearer_token_env_var, tools, timeout_seconds)")
      elseif not tools then
        problem(problems, "error", origin, name, "tools", terr)
      elseif e.command == nil and e.url == nil then
        -- the tools of an imported server
        local decl = { name = name, tools = tools, tools_origin = origin }
        local tok, tfield, treason = timeout_field(decl, e)
        if not tok then problem(problems, "error", origin, name, tfield, treason)
        elseif e.tools == nil then
          problem(problems, "error", origin, name, "command", "a server needs command (stdio) or url (Streamable HTTP); "
            .. "an entry for an imported server names its tools")
        else
          tools_only[name] = decl
        end
      elseif e.tools == nil then
        problem(problems, "error", origin, name, "tools",
          "is required: a list of tool names, \"*\" or \"read-only\" (the tools this server offers in sandboxes)")
      else
        local decl = { name = name, origin = origin, source = "config", tools = tools, tools_origin = origin }
        local tok, field, reason = transport_fields(decl, e)
        if tok then tok, field, reason = timeout_field(decl, e) end
        if not tok then
          problem(problems, "error", origin, name, field, reason)
        else
          local self_, why2 = M.is_demesne(decl)
          if self_ then problem(problems, "error", origin, name, nil, "refused: " .. why2)
          else decls[#decls + 1] = decl end
        end
      end
    end
  end
  return decls, tools_only
end

---------------------------------------------------------------------------------------------
-- Claude Code

local function claude_entry(name, e, origin, cwd, problems)
  local ok, why = check_name(name)
  if not ok then problem(problems, "warning", origin, name, nil, why) return end
  if type(e) ~= "table" then problem(problems, "warning", origin, name, nil, "must be an object") return end
  local typ = e.type
  if typ == nil then typ = e.url ~= nil and "http" or "stdio" end
  if typ ~= "stdio" and typ ~= "http" then
    problem(problems, "warning", origin, name, "type", ("%s is not supported (demesne speaks stdio and Streamable HTTP)")
      :format(quote(typ)))
    return
  end
  local decl = { name = name, origin = origin, source = "claude_code" }
  local fields = {}
  if typ == "stdio" then
    if e.url ~= nil then problem(problems, "warning", origin, name, "url", "is for type http") return end
    if type(e.command) ~= "string" then problem(problems, "warning", origin, name, "command", "must be a string") return end
    local cmd, err = expand(e.command)
    if not cmd then problem(problems, "warning", origin, name, "command", err) return end
    fields.command = cmd
    if e.args ~= nil then
      if not is_list_of_strings(e.args) then
        problem(problems, "warning", origin, name, "args", "must be a list of strings")
        return
      end
      fields.args = {}
      for i, a in ipairs(e.args) do
        local v, aerr = expand(a)
        if not v then problem(problems, "warning", origin, name, ("args[%d]"):format(i - 1), aerr) return end
        fields.args[i] = v
      end
    end
    if e.env ~= nil then
      if not is_string_map(e.env) then
        problem(problems, "warning", origin, name, "env", "must be an object of strings")
        return
      end
      fields.env = {}
      for k, v in pairs(e.env) do
        local x, eerr = expand(v)
        if not x then problem(problems, "warning", origin, name, "env." .. k, eerr) return end
        fields.env[k] = x
      end
    end
    fields.cwd = cwd
  else
    if e.command ~= nil then problem(problems, "warning", origin, name, "command", "is for type stdio") return end
    if e.headersHelper ~= nil then
      problem(problems, "warning", origin, name, "headersHelper", "is not supported (demesne runs no helper for headers)")
      return
    end
    if type(e.url) ~= "string" then problem(problems, "warning", origin, name, "url", "must be a string") return end
    local url, err = expand(e.url)
    if not url then problem(problems, "warning", origin, name, "url", err) return end
    fields.url = url
    if e.headers ~= nil then
      if not is_string_map(e.headers) then
        problem(problems, "warning", origin, name, "headers", "must be an object of strings")
        return
      end
      fields.http_headers = {}
      decl.raw_headers = {}
      for k, v in pairs(e.headers) do
        decl.raw_headers[k] = v
        local x, herr = expand(v)
        if not x then problem(problems, "warning", origin, name, "headers." .. k, herr) return end
        fields.http_headers[k] = x
      end
    end
  end
  local tok, field, reason = transport_fields(decl, fields)
  if not tok then problem(problems, "warning", origin, name, field, reason) return end
  return decl
end

local function from_claude_code(path, problems)
  local out = {}
  local st = fs.stat(path)
  if not st then return out, false end
  if st.type ~= "file" then
    problems[#problems + 1] = { level = "warning", origin = path, message = path .. ": not a regular file" }
    return out, true
  end
  if st.size > MAX_FILE_BYTES then
    problems[#problems + 1] = { level = "warning", origin = path,
      message = ("%s: %d bytes, more than the %d read for import"):format(path, st.size, MAX_FILE_BYTES) }
    return out, true
  end
  local text, rerr = fs.read_file(path, 0, MAX_FILE_BYTES)
  local doc, jerr
  if text then doc, jerr = json.decode(text) end
  if type(doc) ~= "table" then
    problems[#problems + 1] = { level = "warning", origin = path,
      message = ("%s: cannot be read as JSON: %s"):format(path, tostring(rerr or jerr or "not an object")) }
    return out, true
  end
  local function take(servers, origin, cwd)
    if servers == nil then return end
    if type(servers) ~= "table" then
      problems[#problems + 1] = { level = "warning", origin = origin, message = origin .. ": mcpServers must be an object" }
      return
    end
    local names = {}
    for n in pairs(servers) do names[#names + 1] = tostring(n) end
    table.sort(names)
    for _, n in ipairs(names) do
      local d = claude_entry(n, servers[n], origin, cwd, problems)
      if d then out[#out + 1] = d end
    end
  end
  take(doc.mcpServers, path .. " mcpServers")
  if type(doc.projects) == "table" then
    local dirs = {}
    for d in pairs(doc.projects) do dirs[#dirs + 1] = tostring(d) end
    table.sort(dirs)
    for _, d in ipairs(dirs) do
      local p = doc.projects[d]
      if type(p) == "table" and p.mcpServers ~= nil then
        -- Claude Code starts a project's servers in that project's folder
        local cst = d:sub(1, 1) == "/" and fs.stat(d)
        take(p.mcpServers, ("%s projects[%s].mcpServers"):format(path, d), (cst and cst.type == "directory") and d or nil)
      end
    end
  end
  return out, true
end

---------------------------------------------------------------------------------------------
-- Codex (TOML through Python's tomllib)

-- Python 3.11's standard tomllib (TOML 1.0) in a short-lived process with no site packages
-- and no PYTHON* variables (-I). It prints one JSON object: {"mcp_servers": {...}} or
-- {"error": "..."}; TOML dates become strings.
local TOML_HELPER = [[
import json, sys
try:
    import tomllib
except ImportError:
    print(json.dumps({"error": "python3 has no tomllib (Python 3.11 or later is needed)"}))
    sys.exit(0)
try:
    with open(sys.argv[1], "rb") as f:
        doc = tomllib.load(f)
except tomllib.TOMLDecodeError as e:
    print(json.dumps({"error": "not valid TOML: " + str(e)}))
    sys.exit(0)
except OSError as e:
    print(json.dumps({"error": e.strerror or str(e)}))
    sys.exit(0)
print(json.dumps({"mcp_servers": doc.get("mcp_servers", {})}, default=str))
]]

--- Reads a TOML file with Python's tomllib (inside a task) and returns its
--- `mcp_servers` table, or nil, message.
---@param path string
---@return table|nil servers, string|nil err
function M.read_codex_toml(path)
  local r, err = proc.run({ file = "python3", args = { "-I", "-c", TOML_HELPER, path },
    env = { "PATH=" .. (os.getenv("PATH") or "/usr/bin:/bin"), "LC_ALL=C.UTF-8" },
    timeout_ms = HELPER_TIMEOUT_MS, max_out = MAX_HELPER_OUTPUT, err_max = 500 })
  if not r then return nil, ("python3 (3.11 or later, for tomllib) is needed to read %s: %s"):format(path, err) end
  if r.over then return nil, ("%s: the TOML reader wrote more than %d bytes"):format(path, MAX_HELPER_OUTPUT) end
  if r.status ~= 0 or r.signal ~= 0 then
    return nil, ("%s: the TOML reader (python3) failed (status %s, signal %s): %s"):format(path, tostring(r.status),
      tostring(r.signal), (r.err:gsub("%s+", " ")))
  end
  local doc = json.decode(r.out)
  if type(doc) ~= "table" then return nil, path .. ": the TOML reader's output is not JSON" end
  if doc.error then return nil, ("%s: %s"):format(path, tostring(doc.error)) end
  if type(doc.mcp_servers) ~= "table" then return nil, path .. ": mcp_servers must be a table" end
  return doc.mcp_servers
end

local CODEX_KEYS = {
  command = true, args = true, env = true, env_vars = true, cwd = true, url = true, bearer_token_env_var = true,
  http_headers = true, env_http_headers = true,
}

local function from_codex(path, problems)
  local out = {}
  local st = fs.stat(path)
  if not st then return out, false end
  if st.type ~= "file" or st.size > MAX_FILE_BYTES then
    problems[#problems + 1] = { level = "warning", origin = path,
      message = ("%s: not a regular file of at most %d bytes"):format(path, MAX_FILE_BYTES) }
    return out, true
  end
  local servers, err = M.read_codex_toml(path)
  if not servers then
    problems[#problems + 1] = { level = "warning", origin = path, message = err }
    return out, true
  end
  local names = {}
  for n in pairs(servers) do names[#names + 1] = tostring(n) end
  table.sort(names)
  for _, name in ipairs(names) do
    local e = servers[name]
    local origin = path .. " [mcp_servers." .. name .. "]"
    local ok, why = check_name(name)
    if not ok then
      problem(problems, "warning", path, name, nil, why)
    elseif type(e) ~= "table" then
      problem(problems, "warning", path, name, nil, "must be a table")
    elseif e.enabled == false then
      problem(problems, "warning", path, name, "enabled", "false: not imported")
    elseif e.bearer_token ~= nil then
      problem(problems, "warning", path, name, "bearer_token", "an inline token is refused (Codex refuses it too); "
        .. "use bearer_token_env_var")
    else
      local fields = {}
      for k in pairs(CODEX_KEYS) do fields[k] = e[k] end
      local decl = { name = name, origin = origin, source = "codex" }
      local tok, field, reason = transport_fields(decl, fields)
      if tok then out[#out + 1] = decl else problem(problems, "warning", path, name, field, reason) end
    end
  end
  return out, true
end

---------------------------------------------------------------------------------------------

local function same_target(a, b)
  if a.transport ~= b.transport then return false end
  if a.transport == "http" then return a.url == b.url end
  if a.command ~= b.command or #a.args ~= #b.args then return false end
  for i = 1, #a.args do if a.args[i] ~= b.args[i] then return false end end
  return true
end

--- Reads every source and returns what is declared. Call it inside a task when Codex
--- import is on (the TOML helper is awaited).
--- Returns {servers = {name = decl}, names = {sorted}, problems = {{level, origin, server?,
--- field?, message}}, import = {sources}, imported_files = {path = true}}, where decl is
--- {name, origin, source = "config"|"claude_code"|"codex", transport = "stdio"|"http",
--- command, args, env, env_vars, cwd | url, http_headers, env_http_headers,
--- bearer_token_env_var; tools = parse_tools() result, tools_origin, timeout_ms?}.
---@return table
function M.load()
  local problems = {}
  local cfg_origin = config.dir() .. "/config.lua"
  local decls, tools_only = from_config(config.get("host_mcp"), cfg_origin, problems)
  local servers, names = {}, {}
  for _, d in ipairs(decls) do servers[d.name] = d; names[#names + 1] = d.name end

  local import = config.get("host_mcp_import") or {}
  local sources, files = {}, {}
  for _, s in ipairs(import) do
    if not M.SOURCES[s] then
      problems[#problems + 1] = { level = "error", origin = "host_mcp_import",
        message = ("host_mcp_import: %s is not a source (claude_code, codex)"):format(quote(s)) }
    else
      sources[#sources + 1] = s
    end
  end
  local imported = {}
  for _, s in ipairs(sources) do
    local path = s == "claude_code" and M.claude_code_path() or M.codex_path()
    local list, found
    if s == "claude_code" then list, found = from_claude_code(path, problems) else list, found = from_codex(path, problems) end
    files[path] = found
    for _, d in ipairs(list) do imported[#imported + 1] = d end
  end
  for _, d in ipairs(imported) do
    local self_, why = M.is_demesne(d)
    local prev = servers[d.name]
    if self_ then
      problem(problems, "warning", d.origin, d.name, nil, "skipped: " .. why)
    elseif prev and prev.source == "config" then
      problem(problems, "warning", d.origin, d.name, nil, "not imported: config.lua declares a server of that name")
    elseif prev then
      if not same_target(prev, d) then
        problem(problems, "warning", d.origin, d.name, nil, ("not imported: %s declares another server of that name; "
          .. "declare the one you want in host_mcp"):format(prev.origin))
      end
    else
      local t = tools_only[d.name]
      d.tools = t and t.tools or M.parse_tools(nil)
      d.tools_origin = t and t.tools_origin or nil
      d.timeout_ms = t and t.timeout_ms or nil
      servers[d.name] = d
      names[#names + 1] = d.name
    end
  end
  for name, t in pairs(tools_only) do
    if not servers[name] or servers[name].source == "config" then
      problem(problems, "warning", t.tools_origin, name, nil, "names tools for an imported server, but no source imports "
        .. "one of that name" .. (#sources == 0 and " (host_mcp_import is off)" or ""))
    end
  end
  table.sort(names)
  return { servers = servers, names = names, problems = problems, import = sources, imported_files = files }
end

return M
