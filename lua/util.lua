-- Small helpers the runtime shares instead of copying: timestamps, ids, shell quoting and
-- `<close>` guards.
local loop = require("core.loop")

local util = {}

--- Lowercase hex of a byte string.
---@param bytes string
---@return string
function util.hex(bytes)
  return (bytes:gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

--- `n` random bytes from the OS's random source, as 2n hex digits.
---@param n integer
---@return string
function util.random_hex(n)
  return util.hex(loop.random(n))
end

--- A new id that sorts by creation time: `<prefix><UTC time>-<2n random hex digits>`
--- ("job-20261129T101500Z-3fa9c2d1e0" for new_id("job-", 5)).
---@param prefix string|nil
---@param n integer  random bytes
---@return string
function util.new_id(prefix, n)
  return (prefix or "") .. os.date("!%Y%m%dT%H%M%SZ") .. "-" .. util.random_hex(n)
end

--- Unix time now in whole milliseconds (the loop's clock, refreshed each iteration).
---@return integer
function util.now_ms()
  return math.floor(loop.time() * 1000)
end

--- Unix time in seconds as RFC 3339 UTC without a fraction ("2026-11-29T10:15:00Z").
---@param seconds number
---@return string
function util.iso(seconds)
  return os.date("!%Y-%m-%dT%H:%M:%SZ", math.floor(seconds))
end

--- Unix time in ms as RFC 3339 UTC with milliseconds ("2026-11-29T10:15:00.250Z"); nil
--- for nil.
---@param ms integer|nil
---@return string|nil
function util.iso_ms(ms)
  if not ms then return nil end
  ms = math.floor(ms)
  return os.date("!%Y-%m-%dT%H:%M:%S", ms // 1000) .. (".%03dZ"):format(ms % 1000)
end

--- The current time as RFC 3339 UTC with milliseconds.
---@return string
function util.iso_now()
  return util.iso_ms(loop.time() * 1000)
end

--- Quotes a string for a POSIX shell: one word, whatever it holds.
---@param s any  turned into a string
---@return string
function util.sh_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

--- Percent-encodes every byte of `s` but RFC 3986's unreserved characters (letters,
--- digits, "-", ".", "_", "~"): a URL path segment, query value or form field.
---@param s any  (tostring'd)
---@return string
function util.percent_encode(s)
  return (tostring(s):gsub("[^%w%-%._~]", function(c) return ("%%%02X"):format(c:byte()) end))
end

--- A URL's query from a table of parameters: "?k1=v1&k2=v2" in the keys' sorted order (so
--- a URL is the same for the same table), each key and value percent-encoded, booleans as
--- "true" / "false"; "" for nil or an empty table.
---@param q table<string, string|number|boolean>|nil
---@return string
function util.query_string(q)
  if not q then return "" end
  local keys = {}
  for k in pairs(q) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = q[k]
    if type(v) == "boolean" then v = v and "true" or "false" end
    parts[#parts + 1] = util.percent_encode(k) .. "=" .. util.percent_encode(v)
  end
  return #parts > 0 and ("?" .. table.concat(parts, "&")) or ""
end

--- Base64 (RFC 4648 §4, the standard alphabet, with padding) of a byte string.
---@param bytes string
---@return string
function util.base64(bytes)
  local out = {}
  for i = 1, #bytes, 3 do
    local a, b, c = bytes:byte(i, i + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    out[#out + 1] = B64:sub((n >> 18) + 1, (n >> 18) + 1) .. B64:sub(((n >> 12) & 63) + 1, ((n >> 12) & 63) + 1)
      .. (b and B64:sub(((n >> 6) & 63) + 1, ((n >> 6) & 63) + 1) or "=") .. (c and B64:sub((n & 63) + 1, (n & 63) + 1) or "=")
  end
  return table.concat(out)
end

local B64_INDEX = {}
for i = 1, #B64 do B64_INDEX[B64:byte(i)] = i - 1 end
B64_INDEX[("-"):byte()], B64_INDEX[("_"):byte()] = 62, 63 -- base64url (RFC 4648 §5)

--- Decodes base64 (RFC 4648 §4) or base64url (§5), padded or not: the one decoder (JWT
--- claims, the =?base64?…?= values of MCP headers). Returns the bytes, or nil when `s`
--- holds other characters.
---@param s string
---@return string|nil
function util.base64_decode(s)
  if type(s) ~= "string" then return nil end
  s = s:gsub("=+$", "")
  local out, bits, nbits = {}, 0, 0
  for i = 1, #s do
    local v = B64_INDEX[s:byte(i)]
    if not v then return nil end
    bits = ((bits << 6) | v) & 0xffffff
    nbits = nbits + 6
    if nbits >= 8 then
      nbits = nbits - 8
      out[#out + 1] = string.char((bits >> nbits) & 0xff)
    end
  end
  return table.concat(out)
end

--- A to-be-closed value that calls `fn(err)` when it goes out of scope (on return, error
--- or cancellation): `local _ <close> = util.closer(function() … end)`.
---@param fn fun(err: any)
---@return table
function util.closer(fn)
  return setmetatable({}, { __close = function(_, err) fn(err) end })
end

--- A to-be-closed value that does nothing (where a guard is optional).
util.NOOP = setmetatable({}, { __close = function() end })

return util
