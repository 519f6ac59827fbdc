-- Agent providers: the registry of adapters that say how to run one AI coding agent CLI
-- in a sandbox, and the pure helpers the vendor route uses with them.
--
-- Provider files load through demesne.plugins from the built-in lua/providers/*.lua (this
-- file excepted), then from $XDG_CONFIG_HOME/demesne/providers/*.lua, each in a restricted
-- environment whose `require` gives providers.API only (docs/reference/runtime-api.md: the
-- helpers below, demesne.providers.codex's make, demesne.oauth, demesne.json,
-- demesne.config, demesne.errors, demesne.log). A file returns an adapter table, or nil when it has
-- nothing to offer (openai_compatible without a configuration). A user file whose adapter
-- has the name of an earlier one replaces it. A file that fails to load or returns a bad
-- adapter is refused with a log naming the file and the field; the others still load.
-- The interface is documented in docs/reference/providers.md.
--
-- Model names are unique across providers, so a model alone picks its provider; the first
-- model an adapter lists is its default. `DEMESNE_<PROVIDER>_ENABLED=false` (or
-- `providers.<name>.enabled = false` in config.lua) turns a provider off.
--
-- The real credential an adapter finds on the host is handed only to the vendor route
-- (swap_auth); argv and env see the per-run token, never the credential.
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local plugins = require("demesne.plugins")
local util = require("demesne.util")
local core_text = require("core.text")

local providers = {}

local LOGGER = "demesne.providers"

---@class ProviderModel
---@field name string          the name callers pass as `model` (unique across providers)
---@field arg string|nil       what the CLI is given instead of the name (default: the name)
---@field description string|nil

---@class ProviderCredential
---@field present boolean      a usable credential was found on the host
---@field kind string|nil      "api_key", "oauth_token", "auth_token", "chatgpt", "none"…: the sandbox gets a fake of this kind
---@field source string|nil    where it was found ("$ANTHROPIC_API_KEY", a file path) — never the value
---@field value (fun(): string|nil)|nil  returns the secret; only the vendor route calls it
---@field hint string|nil      what to set when it is absent
---@field account_id string|nil  ChatGPT account (codex chatgpt login)

---@class ProviderRun
---@field prompt_file string       in-sandbox path of a file holding the prompt
---@field context_file string      in-sandbox path of the generated context file (CLAUDE.md / AGENTS.md)
---@field model string             a model name of this provider
---@field vendor_base_url string   the in-sandbox vendor port, e.g. "http://127.0.0.1:3129"
---@field token string             the per-run random token the agent presents instead of the credential
---@field workdir string           the agent's working folder, e.g. "/workspace"
---@field home string|nil          a writable home for the CLI's own state (default "/root")
---@field credential_kind string|nil  kind of the real credential (default: credentials().kind)
---@field resume_session string|nil  a session/thread id to resume (after a rate limit reset) instead of starting afresh; the adapter must pass it as an argument of its own
---@field resume_prompt string|nil   the prompt sent when resuming (says the rate limit has reset)
---@field max_retries integer|nil  bound on the CLI's own retries of failed API calls
---@field request_timeout_ms integer|nil  how long the CLI waits for one API answer (the vendor route may hold a rate-limited request until its reset)
---@field agent_dir string|nil     in-sandbox folder (read-only): the prompt, the context file, the adapter's files(run)
---@field mcp_servers ProviderMcpServer[]|nil  MCP servers the CLI is to use (only for an adapter with
---  mcp = "http"); nil or empty: none

---@class ProviderMcpServer
---@field name string              what the CLI calls the server ("demesne": Claude Code names its
---  tools mcp__demesne__<tool>)
---@field url string               its Streamable HTTP endpoint in the sandbox ("http://127.0.0.1:3130/mcp")
---@field token string             the bearer token each request carries (Authorization: Bearer <token>)
---@field token_env string         the variable holding the same token in the sandbox's environment
---@field tool_timeout_ms integer  the longest one tool call may take (the CLI must not give up sooner)
---@field startup_timeout_ms integer  how long the CLI may take to connect and list the tools

---@class ProviderUsage
---@field model string|nil
---@field input integer          input tokens billed at the full input rate (cache reads excluded)
---@field output integer         output tokens (reasoning included)
---@field cache_creation integer input tokens written to the prompt cache
---@field cache_read integer     input tokens read from the prompt cache
---@field reasoning integer|nil  reasoning tokens (part of output; OpenAI only)
---@field id string|nil          the response/message id

---@class ProviderVendor
---@field label string|nil     how the context file names the API ("the Anthropic API")
---@field upstream string|fun(cred: ProviderCredential): string  upstream base URL
---@field prefix string|nil    in-sandbox path prefix that stands for the upstream base ("/v1"); default ""
---@field allowed {method: string, path: string}[]  method + Lua pattern on the path (query excluded)
---@field local_answers {method: string, path: string, status: integer}[]|nil  answered by the proxy, not forwarded
---@field presented_token fun(headers: table<string,string>): string|nil
---@field swap_auth fun(headers: table<string,string>, cred: ProviderCredential): table<string,string>

---@class ProviderAdapter
---@field name string
---@field title string|nil
---@field models (string|ProviderModel)[]
---@field image string
---@field context_file_name string
---@field credentials fun(): ProviderCredential
---@field argv fun(run: ProviderRun): string[]
---@field env fun(run: ProviderRun): table<string,string>
---@field vendor ProviderVendor
---@field parse_answer fun(lines: string[]): string|nil, table
---@field usage_from_json fun(body: string|table): ProviderUsage|nil, string|nil
---@field usage_from_sse fun(event: string|nil, data: string): table|nil
---@field prices table<string, {input: number, output: number, cache_creation: number|nil, cache_read: number|nil}>
---@field cost fun(usage: ProviderUsage): number, boolean
---@field max_output_tokens integer|nil  the longest answer (tokens) a model of the provider gives: what a model
---  request whose body names no max_tokens is reserved for against a tree's budget, and the most any is
---  (default providers.MAX_OUTPUT_TOKENS)
---@field mcp "http"|nil      how the CLI takes MCP servers: "http" = argv/env/files wire run.mcp_servers
---  (Streamable HTTP with a bearer token) into it; nil = it takes none (its runs get no demesne tools)
---@field files (fun(run: ProviderRun): table<string,string>)|nil  extra files of a run (name -> text),
---  written read-only into run.agent_dir before the sandbox starts (an MCP configuration, say)
---@field mcp_hint (fun(server: string): string)|nil  one sentence for the context file: how the CLI offers the
---  tools of the MCP server named `server` to the model (their names, where they sit)
---@field origin string       where it was loaded from (set by the loader)

--------------------------------------------------------------------------------------------
-- Small helpers adapters share (pure)

--- Decodes a JSON text, or returns a table unchanged. nil and a message when malformed.
---@param body string|table
---@return table|nil value, string|nil err
function providers.decode(body)
  if type(body) == "table" then return body end
  if type(body) ~= "string" then return nil, "body is not a string" end
  local v, err = json.decode(body)
  if v == nil then return nil, "malformed JSON: " .. tostring(err) end
  if type(v) ~= "table" then return nil, "JSON body is not an object" end
  return v
end

--- A token count from a vendor's JSON: a number from 0 to 2^53 (the range a double holds
--- exactly), rounded down to an integer; anything else (a string, a negative number, NaN,
--- 1e400 decoded as infinity) is nil. An infinite count would make every total and cost
--- infinite, which JSON cannot write, so usage.json would stop being updated.
---@param v any
---@return integer|nil
local function num(v)
  if type(v) == "number" and v >= 0 and v <= 2 ^ 53 then return math.floor(v) end
  return nil
end
providers.num = num

--- The token of an "Authorization: Bearer <token>" header in a lowercase-keyed header map.
---@param headers table<string,string>
---@return string|nil
function providers.bearer(headers)
  local v = headers and headers["authorization"]
  if type(v) ~= "string" then return nil end
  return v:match("^[Bb][Ee][Aa][Rr][Ee][Rr]%s+(%S+)%s*$")
end

--- Header names lowercased (a copy). Accepts a map or a list of {name, value} pairs; with
--- repeated names the last one wins.
---@param headers table
---@return table<string,string>
function providers.headers(headers)
  local out = {}
  if headers[1] ~= nil then
    for _, h in ipairs(headers) do out[tostring(h[1]):lower()] = tostring(h[2]) end
  else
    for k, v in pairs(headers) do out[tostring(k):lower()] = tostring(v) end
  end
  return out
end

--- Compares two strings in time that depends only on their lengths.
---@param a string|nil
---@param b string|nil
---@return boolean
function providers.token_equal(a, b)
  if type(a) ~= "string" or type(b) ~= "string" or #a ~= #b or #a == 0 then return false end
  local diff = 0
  for i = 1, #a do diff = diff | (a:byte(i) ~ b:byte(i)) end
  return diff == 0
end

--- A fresh per-run token: "dmsn-" and 48 hex digits from the OS's random source.
---@return string
function providers.new_token()
  return "dmsn-" .. util.random_hex(24)
end

--- Quotes a string for a POSIX shell.
---@param s string
---@return string
providers.shell_quote = util.sh_quote

local FILE_MAX = 1024 * 1024

--- The extra files of a run (the adapter's files(run), checked): name -> text, each name a
--- plain file name (letters, digits, `.`, `_`, `-`; at most 64) other than the names in
--- `taken` (the runner's own files), each text a string of at most 1 MiB. An adapter
--- without files gives {}. nil and "files: …" when the adapter's answer is unusable.
---@param p ProviderAdapter
---@param run ProviderRun
---@param taken table<string, boolean>|nil
---@return table<string,string>|nil files, string|nil err
function providers.run_files(p, run, taken)
  if p.files == nil then return {} end
  local ok, files = pcall(p.files, run)
  if not ok then return nil, "files: " .. tostring(files) end
  if files == nil then return {} end
  if type(files) ~= "table" then
    return nil, ("files: must return a table of file name -> text, got %s"):format(type(files))
  end
  local out = {}
  for name, text in pairs(files) do
    if type(name) ~= "string" or #name > 64 or not name:match("^[%w][%w._%-]*$") then
      return nil, ("files: %s is not a plain file name (letters, digits, . _ -)"):format(tostring(name))
    end
    if taken and taken[name] then return nil, ("files: %q is a file of the runner's own"):format(name) end
    if type(text) ~= "string" then return nil, ("files[%q]: must be a string"):format(name) end
    if #text > FILE_MAX then return nil, ("files[%q]: %d bytes is more than %d"):format(name, #text, FILE_MAX) end
    out[name] = text
  end
  return out
end

--- The most transcript lines providers.lines hands to parse_answer: the answer, the result
--- and the rate-limit events are at the end, and a transcript is written by the sandbox,
--- which could otherwise make the server decode millions of tiny lines on its loop.
providers.LINES_MAX = 4096

--- Splits transcript text into its non-empty lines (for parse_answer): the last `max`
--- (default providers.LINES_MAX) only.
---@param text string
---@param max integer|nil
---@return string[]
function providers.lines(text, max)
  local out = {}
  text = tostring(text)
  local from = core_text.last_lines(text, max or providers.LINES_MAX)
  if from > 1 then text = text:sub(from) end
  for line in text:gmatch("[^\n]+") do
    line = line:gsub("\r$", "")
    if line ~= "" then out[#out + 1] = line end
  end
  return out
end

--- Decodes each transcript line that is a JSON object (others are skipped) and calls
--- fn(event) in order.
---@param lines string[]
---@param fn fun(ev: table)
function providers.each_event(lines, fn)
  for _, line in ipairs(lines) do
    if type(line) == "string" and line:find("^%s*{") then
      local ev = json.decode(line)
      if type(ev) == "table" then fn(ev) end
    elseif type(line) == "table" then
      fn(line)
    end
  end
end

--------------------------------------------------------------------------------------------
-- Usage and cost

--- A zeroed usage record.
---@return ProviderUsage
function providers.empty_usage()
  return { input = 0, output = 0, cache_creation = 0, cache_read = 0 }
end

--- Applies a partial usage record from one SSE event: each field present replaces the
--- accumulated one (the vendors send running totals, not increments). Returns acc.
---@param acc ProviderUsage
---@param part table|nil
---@return ProviderUsage
function providers.merge_usage(acc, part)
  if type(part) ~= "table" then return acc end
  for _, k in ipairs({ "model", "id" }) do
    if type(part[k]) == "string" and part[k] ~= "" then acc[k] = part[k] end
  end
  for _, k in ipairs({ "input", "output", "cache_creation", "cache_read", "reasoning" }) do
    if num(part[k]) then acc[k] = num(part[k]) end
  end
  return acc
end

--- The price entry for a model: the longest key of `prices` that is a prefix of `model`.
---@param prices table
---@param model string|nil
---@return table|nil rates, string|nil key
function providers.price_for(prices, model)
  if type(prices) ~= "table" or type(model) ~= "string" then return nil end
  local best, key
  for k, rates in pairs(prices) do
    if type(k) == "string" and type(rates) == "table" and model:sub(1, #k) == k and (not key or #k > #key) then
      best, key = rates, k
    end
  end
  return best, key
end

local function cost_at(r, usage)
  local cc = r.cache_creation or r.input or 0
  local cr = r.cache_read or r.input or 0
  return ((usage.input or 0) * (r.input or 0) + (usage.output or 0) * (r.output or 0)
    + (usage.cache_creation or 0) * cc + (usage.cache_read or 0) * cr) / 1e6
end

--- Indicative cost in USD of one usage record under a price table (USD per million tokens:
--- input, output, cache_creation, cache_read). A model with no price (or none named) costs
--- what the dearest entry of the table would charge for the same tokens, and the second
--- result is false: a tree's budget cannot be passed by naming a model demesne has no price
--- for (the vendor charges it all the same). An empty table costs 0.
---@param prices table
---@param usage ProviderUsage
---@return number usd, boolean priced
function providers.cost_with(prices, usage)
  local r = providers.price_for(prices, usage and usage.model)
  if r then return cost_at(r, usage), true end
  local usd = 0
  for _, rates in pairs(type(prices) == "table" and prices or {}) do
    if type(rates) == "table" then usd = math.max(usd, cost_at(rates, usage or {})) end
  end
  return usd, false
end

--------------------------------------------------------------------------------------------
-- Reservations (a tree's budget: lua/vendor reserves before it forwards a model request)

--- The output tokens a request is reserved for when its body names no limit, and the most
--- it is reserved for whatever its body says, unless an adapter sets `max_output_tokens`:
--- the longest answer any model of the built-in providers gives (128 000 tokens).
providers.MAX_OUTPUT_TOKENS = 128000

-- The body fields that limit an answer: Anthropic Messages, OpenAI Responses, Chat Completions.
local MAX_FIELDS = { "max_tokens", "max_output_tokens", "max_completion_tokens" }

--- The largest request body whose JSON is decoded for its model and max_tokens (bytes). A
--- larger one (the sandbox's to write: decoding 64 MiB of tiny values would take the server
--- gigabytes) is reserved at the dearest price of the adapter's table and the longest answer.
providers.RESERVATION_DECODE_MAX = 4 * 1024 * 1024

-- The cost of `usage` under the adapter's cost function (0 when it fails).
local function cost_of(p, usage)
  local ok, usd = pcall(p.cost or function(u) return providers.cost_with(p.prices, u) end, usage)
  usd = ok and tonumber(usd) or 0
  if usd ~= usd or usd < 0 or usd == math.huge then return 0 end
  return usd
end

---@class ProviderReservation
---@field model string|nil  the body's `model`
---@field input integer     input tokens reserved: the body's size in bytes (a token is at least one byte of text)
---@field output integer    output tokens reserved: the body's max_tokens (or max_output_tokens,
---  max_completion_tokens: the largest), else the adapter's max_output_tokens; at most that
---@field usd number        the most the request can cost: `input` at the dearest input rate of
---  the model (input, cache_creation or cache_read) plus `output` at its output rate; 0 unpriced

--- What one model request is reserved against a tree's budget before it is forwarded, from
--- its body as the agent sent it (JSON; anything else reserves the body's size and the
--- default output). The estimate is an upper bound for text: a tokenizer never makes more
--- tokens than bytes, and the answer is cut at max_tokens.
---@param p ProviderAdapter
---@param body string|nil
---@return ProviderReservation
function providers.reservation(p, body)
  body = type(body) == "string" and body or ""
  local b, dearest = nil, #body > providers.RESERVATION_DECODE_MAX
  if not dearest then
    local ok
    ok, b = pcall(json.decode, body)
    if not ok then b = nil end
  end
  if type(b) ~= "table" then b = {} end
  local cap = num(p.max_output_tokens) or providers.MAX_OUTPUT_TOKENS
  local out
  for _, k in ipairs(MAX_FIELDS) do
    local v = num(b[k])
    if v and (not out or v > out) then out = v end
  end
  out = math.min(out or cap, cap)
  local model = type(b.model) == "string" and b.model ~= "" and b.model or nil
  local n = #body
  local usd = 0
  -- the whole input at whichever rate is dearest (a cache write costs more than plain input);
  -- a body too large to read, at the dearest model's
  local models = { model or false } -- none named: priced as an unpriced one (the dearest)
  if dearest then
    models = {}
    for prefix in pairs(type(p.prices) == "table" and p.prices or {}) do models[#models + 1] = prefix end
  end
  for _, m in ipairs(models) do
    for _, k in ipairs({ "input", "cache_creation", "cache_read" }) do
      local u = { model = m or nil, input = 0, output = out, cache_creation = 0, cache_read = 0 }
      u[k] = n
      usd = math.max(usd, cost_of(p, u))
    end
  end
  return { model = model, input = n, output = out, usd = usd }
end

--- The usage a request is charged when its answer did not end (cut mid-stream, or no usage
--- read from it): with `usage` (what the stream said so far: message_start's input counts),
--- those input counts and the reserved output (the vendor may have written all of it; the
--- route cannot tell how much); without, the whole reservation. Returns the usage record
--- and its cost in USD.
---@param p ProviderAdapter
---@param est ProviderReservation
---@param usage ProviderUsage|nil
---@return ProviderUsage usage, number usd
function providers.reserved_usage(p, est, usage)
  if type(usage) ~= "table" then
    return { model = est.model, input = est.input, output = est.output, cache_creation = 0, cache_read = 0 }, est.usd
  end
  local u = { model = usage.model or est.model, id = usage.id, input = usage.input or 0,
    cache_creation = usage.cache_creation or 0, cache_read = usage.cache_read or 0,
    output = math.max(usage.output or 0, est.output) }
  return u, cost_of(p, u)
end

--------------------------------------------------------------------------------------------
-- Server-sent events

local SSE_MAX = 16 * 1024 * 1024 -- bytes of one event kept; a longer one is dropped

--- An incremental SSE parser. `reader:feed(chunk)` returns the events completed by that
--- chunk as {event = name|nil, data = string}; `reader:finish()` flushes a last event that
--- had no blank line after it. Chunks may split lines and CRLFs anywhere.
---@return table reader  {feed = fun(self, chunk): events, finish = fun(self): events, dropped = integer}
function providers.sse_reader()
  local r = { buf = "", event = nil, data = nil, size = 0, dropped = 0 }
  local function dispatch(out)
    if r.data then
      if r.size <= SSE_MAX then out[#out + 1] = { event = r.event, data = table.concat(r.data, "\n") }
      else r.dropped = r.dropped + 1 end
    end
    r.event, r.data, r.size = nil, nil, 0
  end
  local function line(l, out)
    if l == "" then return dispatch(out) end
    if l:sub(1, 1) == ":" then return end
    local field, value = l:match("^([^:]*):? ?(.*)$")
    if field == "event" then
      r.event = value
    elseif field == "data" then
      r.data = r.data or {}
      r.size = r.size + #value
      if r.size <= SSE_MAX then r.data[#r.data + 1] = value end
    end
  end
  function r.feed(self, chunk)
    local out = {}
    self.buf = self.buf .. chunk
    local pos = 1
    while true do
      local s, e = self.buf:find("\r?\n", pos)
      if not s then break end
      line(self.buf:sub(pos, s - 1), out)
      pos = e + 1
    end
    self.buf = self.buf:sub(pos)
    if #self.buf > SSE_MAX then self.buf, self.size = "", SSE_MAX + 1 end
    return out
  end
  function r.finish(self)
    local out = {}
    if self.buf ~= "" then line(self.buf, out); self.buf = "" end
    dispatch(out)
    return out
  end
  return r
end

--------------------------------------------------------------------------------------------
-- Checking adapters

local NAME_PAT = "^[a-z][a-z0-9_]*$"
local MODEL_PAT = "^[A-Za-z0-9][A-Za-z0-9._:/@%-]*$"
local REQUIRED_FUNCS = { "credentials", "argv", "env", "parse_answer", "usage_from_json", "usage_from_sse" }

--- The models of an adapter as ProviderModel entries (strings become {name = s}).
---@param p ProviderAdapter
---@return ProviderModel[]
function providers.models_of(p)
  local out = {}
  for _, m in ipairs(p.models or {}) do
    if type(m) == "string" then out[#out + 1] = { name = m } else out[#out + 1] = m end
  end
  return out
end

--- Checks an adapter. Returns true, or nil and "field: reason".
---@param p any
---@return boolean|nil ok, string|nil err
function providers.check(p)
  if type(p) ~= "table" then return nil, ("the file must return an adapter table (or nil), got %s"):format(type(p)) end
  if type(p.name) ~= "string" or not p.name:match(NAME_PAT) or #p.name > 64 then
    return nil, ("name: must be 1-64 characters of a-z 0-9 _ starting with a letter, got %s"):format(
      type(p.name) == "string" and ("%q"):format(p.name) or type(p.name))
  end
  if p.title ~= nil and type(p.title) ~= "string" then return nil, "title: must be a string" end
  if type(p.models) ~= "table" or p.models[1] == nil then
    return nil, "models: must be a non-empty list of model names"
  end
  local seen = {}
  for i, m in ipairs(p.models) do
    local field = ("models[%d]"):format(i)
    local name = m
    if type(m) == "table" then
      name = m.name
      if m.arg ~= nil and type(m.arg) ~= "string" then return nil, field .. ".arg: must be a string" end
      if m.description ~= nil and type(m.description) ~= "string" then
        return nil, field .. ".description: must be a string"
      end
      field = field .. ".name"
    end
    if type(name) ~= "string" or not name:match(MODEL_PAT) or #name > 128 then
      return nil, ("%s: must be a model name (letters, digits, . _ - : / @), got %s"):format(field, tostring(name))
    end
    if seen[name] then return nil, ("%s: %q is listed twice"):format(field, name) end
    seen[name] = true
  end
  if type(p.image) ~= "string" or p.image == "" then
    return nil, "image: must be an image name (images/<name>) or reference"
  end
  if type(p.context_file_name) ~= "string" or not p.context_file_name:match("^[^/]+$") then
    return nil, "context_file_name: must be a file name such as CLAUDE.md or AGENTS.md"
  end
  for _, f in ipairs(REQUIRED_FUNCS) do
    if type(p[f]) ~= "function" then return nil, f .. ": must be a function" end
  end
  local v = p.vendor
  if type(v) ~= "table" then return nil, "vendor: must be a table {upstream, allowed, presented_token, swap_auth}" end
  if type(v.upstream) ~= "string" and type(v.upstream) ~= "function" then
    return nil, "vendor.upstream: must be a base URL or a function(credential) returning one"
  end
  if type(v.upstream) == "string" and not v.upstream:match("^https?://[^/]+") then
    return nil, ("vendor.upstream: %q is not an http(s) URL"):format(v.upstream)
  end
  if v.prefix ~= nil and (type(v.prefix) ~= "string" or not v.prefix:match("^/[^?#]*[^/]$")) then
    return nil, 'vendor.prefix: must be a path such as "/v1" (no trailing slash)'
  end
  if v.label ~= nil and type(v.label) ~= "string" then return nil, "vendor.label: must be a string" end
  for _, list in ipairs({ "allowed", "local_answers" }) do
    local l = v[list]
    if list == "allowed" and (type(l) ~= "table" or l[1] == nil) then
      return nil, "vendor.allowed: must be a non-empty list of {method, path} pairs"
    end
    if l ~= nil then
      if type(l) ~= "table" then return nil, ("vendor.%s: must be a list"):format(list) end
      for i, a in ipairs(l) do
        local field = ("vendor.%s[%d]"):format(list, i)
        if type(a) ~= "table" then return nil, field .. ": must be a table {method, path}" end
        if type(a.method) ~= "string" or not a.method:match("^[A-Z]+$") then
          return nil, field .. ".method: must be an HTTP method in capitals"
        end
        if type(a.path) ~= "string" or a.path:sub(1, 1) ~= "^" or a.path:sub(-1) ~= "$" then
          return nil, field .. ".path: must be a Lua pattern anchored with ^ and $"
        end
        if list == "local_answers" and (math.type(a.status) ~= "integer" or a.status < 100 or a.status > 599) then
          return nil, field .. ".status: must be an HTTP status"
        end
      end
    end
  end
  for _, f in ipairs({ "presented_token", "swap_auth" }) do
    if type(v[f]) ~= "function" then return nil, ("vendor.%s: must be a function"):format(f) end
  end
  if type(p.prices) ~= "table" then
    return nil, "prices: must be a table of model prefix -> {input, output, cache_creation, cache_read} (USD per million tokens)"
  end
  for k, r in pairs(p.prices) do
    if type(k) ~= "string" or type(r) ~= "table" then return nil, "prices: keys must be model prefixes and values tables" end
    for _, f in ipairs({ "input", "output", "cache_creation", "cache_read" }) do
      if (f == "input" or f == "output" or r[f] ~= nil) and (type(r[f]) ~= "number" or r[f] < 0) then
        return nil, ("prices[%q].%s: must be a number >= 0 (USD per million tokens)"):format(k, f)
      end
    end
  end
  if p.cost ~= nil and type(p.cost) ~= "function" then return nil, "cost: must be a function(usage)" end
  if p.max_output_tokens ~= nil and (math.type(p.max_output_tokens) ~= "integer" or p.max_output_tokens < 1) then
    return nil, "max_output_tokens: must be a whole number of tokens >= 1 (the longest answer a model gives)"
  end
  if p.refresh ~= nil and type(p.refresh) ~= "function" then
    return nil, "refresh: must be a function(credential, seconds) returning true or nil, err"
  end
  if p.mcp ~= nil and p.mcp ~= "http" then
    return nil, ('mcp: must be "http" (the CLI takes Streamable HTTP MCP servers from run.mcp_servers) or nil, got %s')
      :format(type(p.mcp) == "string" and ("%q"):format(p.mcp) or type(p.mcp))
  end
  if p.mcp_hint ~= nil and type(p.mcp_hint) ~= "function" then
    return nil, "mcp_hint: must be a function(server name) returning a sentence"
  end
  if p.files ~= nil and type(p.files) ~= "function" then
    return nil, "files: must be a function(run) returning {[file name] = text}"
  end
  return true
end

--------------------------------------------------------------------------------------------
-- Loading

--- The runtime API of provider files: the modules a provider file may require and the
--- names it sees of each (docs/reference/runtime-api.md). Nothing else is reachable.
providers.API = {
  ["demesne.providers"] = { "decode", "num", "bearer", "headers", "token_equal", "new_token", "shell_quote", "lines",
    "each_event", "empty_usage", "merge_usage", "price_for", "cost_with", "sse_reader", "usage_counter",
    "usage_from_sse_text", "models_of", "settings", "check" },
  ["demesne.providers.codex"] = { "make", "config_toml", "refresh_due" },
  ["demesne.oauth"] = { "base64url_decode", "jwt_claims", "refresh", "check_writable", "write_private_json" },
  ["demesne.json"] = { "encode", "decode", "array", "is_array", "null" },
  ["demesne.config"] = { "get", "dir" },
  ["demesne.errors"] = { "new", "is", "raise", "check" },
  ["demesne.log"] = { "log", "debug", "info", "notice", "warning", "error", "critical", "alert", "emergency" },
}

--- The environment a provider file runs in (demesne.plugins, with providers.API).
---@param origin string
---@return table env
function providers.environment(origin)
  return plugins.environment(origin, { kind = "provider", kinds = "providers", api = providers.API, logger = LOGGER })
end

-- The provider kind of plugin: validation fills in `origin` and a default `cost`.
local function kind(opts)
  return {
    kind = "provider", kinds = "providers", logger = LOGGER, quiet = opts.quiet,
    builtin = opts.builtin ~= false and "lua/providers/" or nil, skip = { ["init.lua"] = true },
    user_dir = opts.user_dir == nil and providers.user_dir() or opts.user_dir,
    env = providers.environment,
    check = function(p, file)
      if p == nil or p == false then return false end
      local good, why = providers.check(p)
      if not good then return nil, why end
      p.origin = file.origin
      if p.cost == nil then
        p.cost = function(usage) return providers.cost_with(p.prices, usage) end
      end
      return p
    end,
    key = function(p) return p.name end,
  }
end

--- Loads one provider file's source in the restricted environment and checks the adapter.
--- Returns the adapter (origin set, cost filled in), false when the file offers none, or
--- nil and an error naming the origin and field.
---@param src string
---@param origin string
---@return ProviderAdapter|false|nil adapter, string|nil err
function providers.load_source(src, origin)
  return plugins.load_source(kind({}), src, { name = origin:match("([^/]+)%.lua$") or origin, origin = origin })
end

--- The folder users drop their own providers into: $XDG_CONFIG_HOME/demesne/providers.
---@return string
function providers.user_dir()
  return config.dir() .. "/providers"
end

---@class ProviderRegistry: PluginSet
---@field model_index table<string, string>   model name -> provider name

--- Loads every provider through demesne.plugins: built-in lua/providers/*.lua, then the
--- user folder (or opts.user_dir; false for none). Refused files are logged (unless
--- opts.quiet) and listed in registry.errors. A provider that repeats a model name of an
--- earlier one is refused too. The result also becomes the registry the module-level
--- functions use.
---@param opts {user_dir: string|false|nil, builtin: boolean|nil, quiet: boolean|nil}|nil
---@return ProviderRegistry
function providers.load(opts)
  opts = opts or {}
  local reg = plugins.load(kind(opts))
  reg.model_index = {}
  -- model names must be unique across providers: a later provider that repeats one is refused
  for _, p in ipairs(reg:list()) do
    local clash
    for i, m in ipairs(providers.models_of(p)) do
      local owner = reg.model_index[m.name]
      if owner then
        clash = ("%s: models[%d]: %q is already a model of provider %s (model names must be unique across providers)")
          :format(p.origin, i, m.name, owner)
        break
      end
    end
    if clash then
      reg:remove(p.name)
      reg:refuse(p.origin, clash)
    else
      for _, m in ipairs(providers.models_of(p)) do reg.model_index[m.name] = p.name end
    end
  end
  providers.current = reg
  return reg
end

-- The registry used by the module-level functions: loaded on first use.
local function current()
  return providers.current or providers.load()
end

--- Whether a provider is turned on: $DEMESNE_<NAME>_ENABLED, else config
--- `providers.<name>.enabled`, else true. The second result says what turned it off.
---@param p ProviderAdapter
---@return boolean enabled, string|nil why
function providers.enabled(p)
  local var = "DEMESNE_" .. p.name:upper() .. "_ENABLED"
  local v = os.getenv(var)
  if v and v ~= "" then
    local s = v:lower()
    if s == "0" or s == "false" or s == "no" or s == "off" then return false, ("%s=%s"):format(var, v) end
    return true
  end
  local section = providers.settings(p.name)
  if section.enabled == false then return false, ("providers.%s.enabled = false in config.lua"):format(p.name) end
  return true
end

--- The config.lua section `providers.<name>` (a table; empty when absent).
---@param name string
---@return table
function providers.settings(name)
  local all = config.get("providers")
  local s = type(all) == "table" and all[name] or nil
  return type(s) == "table" and s or {}
end

local CRED_MT = {
  __name = "demesne.providers.credential",
  __tostring = function(c) return ("credential(%s from %s)"):format(tostring(c.kind), tostring(c.source)) end,
}

--- The provider's credential as found on the host now (credentials() called, its result
--- checked). Never put the result, or its value(), anywhere a sandbox can read.
---@param p ProviderAdapter
---@return ProviderCredential
function providers.credential(p)
  local ok, c = pcall(p.credentials)
  if not ok then
    log.warning(LOGGER, "provider %s: credentials() failed: %s", p.name, tostring(c))
    return setmetatable({ present = false, hint = "credentials() failed: " .. tostring(c) }, CRED_MT)
  end
  if type(c) ~= "table" then return setmetatable({ present = false, hint = "credentials() returned no table" }, CRED_MT) end
  c.present = c.present == true
  return setmetatable(c, CRED_MT)
end

--- The upstream base URL of a provider's vendor route: $DEMESNE_<NAME>_UPSTREAM, else
--- config `providers.<name>.upstream`, else the adapter's vendor.upstream (a function of
--- the credential for providers whose upstream depends on the login kind). No trailing slash.
---@param p ProviderAdapter
---@param cred ProviderCredential|nil
---@return string
function providers.upstream(p, cred)
  local v = os.getenv("DEMESNE_" .. p.name:upper() .. "_UPSTREAM")
  if not v or v == "" then v = providers.settings(p.name).upstream end
  if type(v) ~= "string" or v == "" then
    v = p.vendor.upstream
    if type(v) == "function" then v = v(cred or {}) end
  end
  return (tostring(v):gsub("/+$", ""))
end

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- Whether a provider can run now: enabled and with a credential present. Returns the
--- credential when it can, else nil and the reason.
---@param p ProviderAdapter
---@return ProviderCredential|nil cred, string|nil why
function providers.ready(p)
  local on, why = providers.enabled(p)
  if not on then return nil, ("provider %s is disabled (%s)"):format(p.name, why) end
  local c = providers.credential(p)
  if not c.present then
    return nil, ("provider %s has no credentials: %s"):format(p.name, c.hint or "none found on the host")
  end
  return c
end

--- Model names callers may use now, for the `model` enum of the agent tools: those of
--- enabled providers with credentials, in load order (each provider's default first).
---@param reg ProviderRegistry|nil  default: the current registry
---@return string[]
function providers.available_models(reg)
  reg = reg or current()
  local out = {}
  for _, p in ipairs(reg:list()) do
    if providers.ready(p) then
      for _, m in ipairs(providers.models_of(p)) do out[#out + 1] = m.name end
    end
  end
  return out
end

--- Every model name any loaded provider declares, sorted.
---@param reg ProviderRegistry|nil
---@return string[]
function providers.known_models(reg)
  return sorted_keys((reg or current()).model_index)
end

--- Resolves a model name (nil: the default model of the first provider that is ready) to
--- its provider. Returns provider, model name and the credential found, or nil and a
--- message that names the model and lists the models that can be used.
---@param model string|nil
---@param reg ProviderRegistry|nil
---@return ProviderAdapter|nil provider, string|nil model_or_err, ProviderCredential|nil cred
function providers.resolve(model, reg)
  reg = reg or current()
  local available = providers.available_models(reg)
  local avail_text = #available > 0 and table.concat(available, ", ") or "none"
  if model == nil or model == "" then
    for _, p in ipairs(reg:list()) do
      local cred = providers.ready(p)
      if cred then return p, providers.models_of(p)[1].name, cred end
    end
    local reasons = {}
    for _, p in ipairs(reg:list()) do
      local _, why = providers.ready(p)
      reasons[#reasons + 1] = why
    end
    return nil, ("no agent provider is available%s"):format(#reasons > 0 and (": " .. table.concat(reasons, "; ")) or
      " (none is loaded)")
  end
  local name = reg.model_index[model]
  if not name then
    local known = providers.known_models(reg)
    return nil, ("model %q unknown (known: %s)"):format(model, #known > 0 and table.concat(known, ", ") or "none")
  end
  local p = reg.by_name[name]
  local on, why = providers.enabled(p)
  if not on then
    return nil, ("model %q is unavailable because provider %s is disabled (%s); available: %s"):format(model, name, why,
      avail_text)
  end
  local cred = providers.credential(p)
  if not cred.present then
    return nil, ("model %q has no credentials: %s (provider %s); available: %s"):format(model,
      cred.hint or "none found on the host", name, avail_text)
  end
  return p, model, cred
end

--- The adapter named `name` in the current registry, or nil.
---@param name string
---@return ProviderAdapter|nil
function providers.get(name) return current():get(name) end

--- Every adapter of the current registry, in load order.
---@return ProviderAdapter[]
function providers.list() return current():list() end

--------------------------------------------------------------------------------------------
-- The vendor route's decisions (pure: the proxy does the I/O)

local function split_target(target)
  local path, query = tostring(target):match("^([^?#]*)(%??[^#]*)")
  return path or "", query or ""
end

---@class VendorVerdict
---@field action string          "forward", "local" or "deny"
---@field status integer|nil     HTTP status for "local" and "deny"
---@field reason string|nil      why a request was denied (safe to log: no secrets)
---@field url string|nil         upstream URL for "forward" (query kept)
---@field headers table<string,string>|nil  request headers to send upstream for "forward" (real credential in)

--- Decides one request that arrived on a run's vendor port. `req` = {method, target
--- (path and query as sent), headers (map or {name, value} list)}. Order: answers the
--- provider declares local (no credential needed, nothing forwarded); then the method/path
--- must be allowed (403); then the presented token must equal the run's token (401); then
--- the credential is swapped in, `accept-encoding: identity` asked for (so usage can be
--- read) and the upstream URL built from the upstream base and the path after vendor.prefix.
---@param p ProviderAdapter
---@param req {method: string, target: string, headers: table}
---@param token string   the run's token
---@param cred ProviderCredential  the real credential (providers.credential)
---@return VendorVerdict
function providers.vendor_decide(p, req, token, cred)
  local method = tostring(req.method or ""):upper()
  local path, query = split_target(req.target or "")
  for _, a in ipairs(p.vendor.local_answers or {}) do
    if a.method == method and path:match(a.path) then return { action = "local", status = a.status } end
  end
  local allowed = false
  for _, a in ipairs(p.vendor.allowed) do
    if a.method == method and path:match(a.path) then allowed = true; break end
  end
  if not allowed then
    return { action = "deny", status = 403, reason = ("%s %s is not a route of provider %s"):format(method, path, p.name) }
  end
  local headers = providers.headers(req.headers or {})
  if not providers.token_equal(p.vendor.presented_token(headers), token) then
    return { action = "deny", status = 401, reason = "the request does not carry this run's token" }
  end
  if not cred or not cred.present then
    return { action = "deny", status = 503, reason = ("provider %s has no credentials on the host"):format(p.name) }
  end
  local out = p.vendor.swap_auth(headers, cred)
  out["accept-encoding"] = "identity"
  out["host"] = nil
  local prefix = p.vendor.prefix or ""
  local rest = path
  if prefix ~= "" then
    if path == prefix then rest = ""
    elseif path:sub(1, #prefix + 1) == prefix .. "/" then rest = path:sub(#prefix + 1)
    else
      return { action = "deny", status = 403, reason = ("%s is outside the prefix %s"):format(path, prefix) }
    end
  end
  return { action = "forward", url = providers.upstream(p, cred) .. rest .. query, headers = out }
end

--- A usage counter for one upstream response. `content_type` decides the parser: a JSON
--- content type reads the whole body with usage_from_json, anything else (an event stream,
--- or none) reads it as SSE with usage_from_sse. Feed it the (identity-encoded) body chunks
--- as they pass; finish() returns the usage record, or nil and why there is none.
---@param p ProviderAdapter
---@param content_type string|nil
---@return {feed: fun(self, chunk: string), partial: fun(self): ProviderUsage|nil, finish: fun(self): ProviderUsage|nil, string|nil}
function providers.usage_counter(p, content_type)
  local is_json = type(content_type) == "string" and content_type:lower():find("json", 1, true) ~= nil
  local c = { parts = {}, size = 0, acc = providers.empty_usage(), seen = false, too_big = false }
  local reader = not is_json and providers.sse_reader() or nil
  local function take(events)
    for _, ev in ipairs(events) do
      local ok, part = pcall(p.usage_from_sse, ev.event, ev.data)
      if ok and type(part) == "table" then
        providers.merge_usage(c.acc, part)
        c.seen = true
      end
    end
  end
  function c.feed(self, chunk)
    if reader then return take(reader:feed(chunk)) end
    self.size = self.size + #chunk
    if self.size > SSE_MAX then self.too_big, self.parts = true, {} return end
    self.parts[#self.parts + 1] = chunk
  end
  --- The usage the stream has given so far (an SSE answer's message_start), or nil.
  function c.partial(self) return self.seen and self.acc or nil end
  function c.finish(self)
    if reader then
      take(reader:finish())
      if not self.seen then return nil, "no usage in the event stream" end
      return self.acc
    end
    if self.too_big then return nil, "response body too large to read usage from" end
    local ok, u, err = pcall(p.usage_from_json, table.concat(self.parts))
    if not ok then return nil, tostring(u) end
    if type(u) ~= "table" then return nil, err or "no usage in the response" end
    return providers.merge_usage(providers.empty_usage(), u)
  end
  return c
end

--- Usage of a whole recorded SSE body (a convenience over usage_counter).
---@param p ProviderAdapter
---@param text string
---@return ProviderUsage|nil usage, string|nil err
function providers.usage_from_sse_text(p, text)
  local c = providers.usage_counter(p, "text/event-stream")
  c:feed(text)
  return c:finish()
end

return providers
