-- Helpers shared by the Lua fuzz harnesses (tests/fuzz/*.lua, run by driver/lua_target.c).
local fuzzlib = {}

--- Raises (a finding: the driver aborts) when `cond` is false.
---@param cond any
---@param fmt string  string.format pattern for the message
function fuzzlib.check(cond, fmt, ...)
  if not cond then error("check failed: " .. fmt:format(...), 2) end
  return cond
end

-- FNV-1a over the bytes: seeds the split, so an input always splits the same way.
local function seed_of(data)
  local h = -3750763034362895579 -- 14695981039346656037 as a signed 64-bit integer
  for i = 1, #data do h = (h ~ data:byte(i)) * 1099511628211 end
  return h | 1
end

--- Iterates over `data` in the pieces a socket read might deliver: mostly small, sometimes
--- all that is left (the same generator as tests/fuzz/fuzz.h).
---@param data string
---@return fun(): string|nil
function fuzzlib.chunks(data)
  local s, pos, n = seed_of(data), 1, #data
  return function()
    if pos > n then return nil end
    s = s ~ (s << 13)
    s = s ~ (s >> 7)
    s = s ~ (s << 17)
    local pick = (s >> 56) & 0xff
    local len
    if pick < 64 then len = n - pos + 1
    else len = 1 + (s & 0x7fffffff) % (pick < 192 and 16 or 512) end
    local piece = data:sub(pos, pos + len - 1)
    pos = pos + len
    return piece
  end
end

--- Splits `data` at each occurrence of `sep` (plain), at most `max` parts; the last part
--- keeps the rest.
---@return string[]
function fuzzlib.split(data, sep, max)
  local out, pos = {}, 1
  while #out < max - 1 do
    local s, e = data:find(sep, pos, true)
    if not s then break end
    out[#out + 1] = data:sub(pos, s - 1)
    pos = e + 1
  end
  out[#out + 1] = data:sub(pos)
  return out
end

return fuzzlib
