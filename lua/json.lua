-- JSON, decided once: lua-cjson underneath; JSON null is json.null; an empty Lua table
-- encodes as {} unless marked with json.array(), which encodes as [] even when empty.
local cjson = require("core.json")

local json = {}

--- The JSON null value (decoded nulls are this value; encode it to write null).
json.null = cjson.null

local array_mt = { __name = "json.array" }
local EMPTY = "\0demesne-empty-array\0"
local raw_mt = { __name = "json.raw", __tostring = function(r) return r.token end }

cjson.encode_sparse_array(false, 2, 10)
cjson.decode_max_depth(200)
cjson.encode_max_depth(200)

--- Marks a table as a JSON array (so an empty one encodes as []). Returns it.
---@param t table|nil
---@return table
function json.array(t) return setmetatable(t or {}, array_mt) end

--- True for a table marked with json.array.
function json.is_array(t) return getmetatable(t) == array_mt end

--- A value written verbatim as the JSON token `token` (which must be one valid JSON
--- value, as read from a message with core.text.json_raw). `value` is its decoded Lua
--- value, kept for comparisons and logs. tostring() gives the token. Used for JSON-RPC ids:
--- lua-cjson decodes every number to a double, so 9007199254740993 would not come back.
---@param token string
---@param value any
---@return table
function json.raw(token, value) return setmetatable({ token = token, value = value }, raw_mt) end

--- True for a value made by json.raw.
function json.is_raw(v) return getmetatable(v) == raw_mt end

local function prepare(v, depth, raws)
  if type(v) ~= "table" or depth > 200 then return v, false end
  local mt = getmetatable(v)
  if mt == array_mt and next(v) == nil then return EMPTY, true end
  if mt == raw_mt then
    raws[#raws + 1] = v.token
    return "\0demesne-raw-" .. #raws .. "\0", true
  end
  local changed = false
  local copy = {}
  for k, x in pairs(v) do
    local nx, c = prepare(x, depth + 1, raws)
    copy[k] = nx
    changed = changed or c
  end
  if changed then return copy, true end
  return v, false
end

--- Encodes a Lua value as compact JSON (no newlines: safe for newline-delimited framing).
--- Raises on values JSON cannot hold (functions, sparse arrays, NaN).
---@param v any
---@return string
function json.encode(v)
  local raws = {}
  local p, changed = prepare(v, 0, raws)
  local s = cjson.encode(p)
  if changed then
    s = s:gsub('"\\u0000demesne%-empty%-array\\u0000"', "[]")
    if #raws > 0 then
      s = s:gsub('"\\u0000demesne%-raw%-(%d+)\\u0000"', function(i) return raws[tonumber(i)] end)
    end
  end
  return s
end

--- Decodes JSON text. Returns value, or nil and a message on malformed input.
---@param s string
---@return any|nil value, string|nil err
function json.decode(s)
  local ok, v = pcall(cjson.decode, s)
  if not ok then return nil, (tostring(v):gsub("^.-: ", "")) end
  return v
end

local SENTINEL = "\0demesne-empty-array\0"

local function mark_arrays(t, depth)
  if depth > 200 then return end
  for k, x in pairs(t) do
    if x == SENTINEL then t[k] = json.array()
    elseif type(x) == "table" then mark_arrays(x, depth + 1) end
  end
end

--- Decodes JSON text as json.decode does, but marks every empty JSON array with json.array,
--- so that encoding the value again gives `[]` back (lua-cjson decodes `[]` and `{}` to the
--- same empty table). For messages that are passed on unchanged, such as the tool listing of
--- a proxied MCP server, whose inputSchema may hold `"required": []`.
---@param s string
---@return any|nil value, string|nil err
function json.decode_arrays(s)
  -- find each `[`, JSON whitespace, `]` outside strings (string.find jumps, so this is a
  -- scan at C speed between the interesting characters)
  local marks
  local pos = 1
  while true do
    local i = s:find('["%[]', pos)
    if not i then break end
    if s:byte(i) == 34 then
      local j = i + 1
      while true do
        local k = s:find('["\\]', j)
        if not k then return json.decode(s) end -- an unterminated string: cjson says why
        if s:byte(k) == 92 then j = k + 2 else pos = k + 1 break end
      end
    else
      local close = s:match("^[ \t\r\n]*()%]", i + 1)
      if close then
        marks = marks or {}
        marks[#marks + 1] = { i, close }
        pos = close + 1
      else
        pos = i + 1
      end
    end
  end
  if not marks then return json.decode(s) end
  local parts, last = {}, 1
  for _, m in ipairs(marks) do
    parts[#parts + 1] = s:sub(last, m[1] - 1)
    parts[#parts + 1] = '"\\u0000demesne-empty-array\\u0000"'
    last = m[2] + 1
  end
  parts[#parts + 1] = s:sub(last)
  local v, err = json.decode(table.concat(parts))
  if v == nil then return nil, err end
  if v == SENTINEL then return json.array() end
  if type(v) == "table" then mark_arrays(v, 0) end
  return v
end

return json
