-- JSON, decided once: lua-cjson underneath; JSON null is json.null; an empty Lua table
-- encodes as {} unless marked with json.array(), which encodes as [] even when empty.
local cjson = require("core.json")

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
---@param t any
---@return boolean
function json.is_array(t) return getmetatable(t) == array_mt end

local function prepare(v, depth)
  if type(v) ~= "table" or depth > 200 then return v, false end
  if getmetatable(v) == array_mt and next(v) == nil then return EMPTY, true end
  local changed = false
  local copy = {}
  for k, x in pairs(v) do
    local nx, c = prepare(x, depth + 1)
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
  local p, changed = prepare(v, 0)
  local s = cjson.encode(p)
  if changed then s = s:gsub('"\\u0000demesne%-empty%-array\\u0000"', "[]") end
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
