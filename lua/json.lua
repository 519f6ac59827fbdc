-- JSON, decided once: lua-cjson underneath; JSON null is json.null; an empty Lua table
-- encodes as {} unless marked with json.array(), which encodes as [] even when empty.
local cjson = require("core.json")
local loop = require("core.loop")

local json = {}

--- The JSON null value (decoded nulls are this value; encode it to write null).
json.null = cjson.null

local array_mt = { __name = "json.array" }
local EMPTY = "\0demesne-empty-array\0"

cjson.encode_sparse_array(false, 2, 10)
cjson.decode_max_depth(200)
cjson.encode_max_depth(200)

--- Marks a table as a JSON array (so an empty one encodes as []). Returns it.
---@param t table|nil
---@return table
function json.array(t) return setmetatable(t or {}, array_mt) end

--- True for a table marked with json.array.
function json.is_array(t) return getmetatable(t) == array_mt end

-- lua-cjson writes a number with at most 14 significant digits (%.14g; 2.1.0 allows no
-- more), so 123456789012345 went out as 1.2345678901234e+14: a JSON-RPC id of 15 digits or
-- more came back as another id, and big counts lost their last digits. A number that does
-- not survive %.14g is written here instead: an integer exactly, any other number with the
-- fewest digits (15 to 17) that give back the same double. It travels through cjson as a marker string
-- (a per-process random tag, so no string a sandbox writes can pass for one).
local NUM_NONCE = loop.random(8):gsub(".", function(c) return ("%02x"):format(c:byte()) end)
local NUM_TAG = "\0demesne-number-" .. NUM_NONCE .. "-"
local NUM_PATTERN = '"\\u0000demesne%-number%-' .. NUM_NONCE .. '%-(%d+)\\u0000"'

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

-- Returns v with empty json.array tables and long numbers replaced by markers (a copy
-- where anything changed), and whether anything did. `nums` collects the numbers' text.
local function prepare(v, depth, nums)
  if type(v) == "number" then
    local text = precise(v)
    if not text then return v, false end
    nums[#nums + 1] = text
    return NUM_TAG .. #nums .. "\0", true
  end
  if type(v) ~= "table" or depth > 200 then return v, false end
  if getmetatable(v) == array_mt and next(v) == nil then return EMPTY, true end
  local changed = false
  local copy = {}
  for k, x in pairs(v) do
    local nx, c = prepare(x, depth + 1, nums)
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
  local nums = {}
  local p, changed = prepare(v, 0, nums)
  local s = cjson.encode(p)
  if changed then
    s = s:gsub('"\\u0000demesne%-empty%-array\\u0000"', "[]")
    if #nums > 0 then s = s:gsub(NUM_PATTERN, function(i) return nums[tonumber(i)] end) end
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

return json
