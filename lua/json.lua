-- JSON, decided once: lua-cjson underneath; JSON null is json.null; an empty Lua table
-- encodes as {} unless marked with json.array(), which encodes as [] even when empty.
local cjson = require("core.json")
local loop = require("core.loop")

local json = {}

--- The JSON null value (decoded nulls are this value; encode it to write null).
json.null = cjson.null

local array_mt = { __name = "json.array" }
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

-- lua-cjson writes a number with at most 14 significant digits (%.14g; 2.1.0 allows no
-- more), so 123456789012345 went out as 1.2345678901234e+14: a JSON-RPC id of 15 digits or
-- more came back as another id, and big counts lost their last digits. A number that does
-- not survive %.14g is written here instead: an integer exactly, any other number with the
-- fewest digits (15 to 17) that give back the same double.

local function precise(x)
  if math.type(x) == "integer" then
    if x > -1e14 and x < 1e14 then return nil end
    return ("%d"):format(x)
  end
  if x ~= x or x == math.huge or x == -math.huge then return nil end -- cjson refuses these
  if tonumber(("%.14g"):format(x)) == x then return nil end
  local i = math.tointeger(x)
  if i and i >= -(1 << 53) and i <= (1 << 53) then return ("%d"):format(i) end
  for _, f in ipairs({ "%.15g", "%.16g" }) do
    local text = f:format(x)
    if tonumber(text) == x then return text end
  end
  return ("%.17g"):format(x)
end

-- What cjson cannot write itself (an empty json.array, a json.raw token, a number that
-- %.14g would change) travels through cjson.encode as a marker string and is put back in
-- the text afterwards. The markers carry a per-process random tag, so no string a sandbox
-- or a client writes can pass for one.
local NONCE = loop.random(8):gsub(".", function(c) return ("%02x"):format(c:byte()) end)
local TAG = "\0demesne-" .. NONCE .. "-"
local EMPTY = TAG .. "e\0"
local MARKER = '"\\u0000demesne%-' .. NONCE .. '%-(%w+)\\u0000"'

-- Returns v with the values above replaced by markers (a copy where anything changed), and
-- whether anything did. `subs` collects the text each numbered marker stands for.
local function prepare(v, depth, subs)
  if type(v) == "number" then
    local text = precise(v)
    if not text then return v, false end
    subs[#subs + 1] = text
    return TAG .. #subs .. "\0", true
  end
  if type(v) ~= "table" or depth > 200 then return v, false end
  local mt = getmetatable(v)
  if mt == array_mt and next(v) == nil then return EMPTY, true end
  if mt == raw_mt then
    subs[#subs + 1] = v.token
    return TAG .. #subs .. "\0", true
  end
  local changed = false
  local copy = {}
  for k, x in pairs(v) do
    local nx, c = prepare(x, depth + 1, subs)
    copy[k] = nx
    changed = changed or c
  end
  if changed then return copy, true end
  return v, false
end

--- Encodes a Lua value as compact JSON (no newlines: safe for newline-delimited framing).
--- Numbers keep every digit (integers exactly; others with the fewest significant digits,
--- up to 17, that read back as the same double). Raises on values JSON cannot hold (functions,
--- sparse arrays, NaN).
---@param v any
---@return string
function json.encode(v)
  local subs = {}
  local p, changed = prepare(v, 0, subs)
  local s = cjson.encode(p)
  if changed then
    s = s:gsub(MARKER, function(k)
      if k == "e" then return "[]" end
      return subs[tonumber(k)]
    end)
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
