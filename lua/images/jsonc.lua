-- JSON with comments (JSONC, as devcontainer.json and VS Code's settings are written): `//`
-- and `/* */` comments and trailing commas before `]` or `}`. strip() turns such a text into
-- plain JSON by one pass over it that knows where strings begin and end (a `//` inside a
-- string is text), replacing each comment and each trailing comma by blanks of the same
-- length (so lines and columns stay where they were); lua-cjson (demesne.json) then parses
-- the result, so the grammar of the values is a real JSON parser's. No npm parser is
-- available at run time and Debian ships no Lua one; this is the small part a JSONC parser
-- adds to JSON, tested on random documents (tests/lua/jsonc_test.lua).
local json = require("demesne.json")

local jsonc = {}

--- The largest text decode() takes.
jsonc.MAX_BYTES = 1024 * 1024

-- The line (1-based) of byte `pos` in `s`.
local function line_of(s, pos)
  local n = 1
  for _ in s:sub(1, pos - 1):gmatch("\n") do n = n + 1 end
  return n
end

--- Turns JSONC text into JSON text: comments and trailing commas become blanks (newlines in
--- a block comment stay), a leading UTF-8 byte order mark is dropped. Returns the JSON text,
--- or nil and the reason with its line ("line 3: the comment /* … is never closed").
---@param s string
---@return string|nil json, string|nil err
function jsonc.strip(s)
  if s:sub(1, 3) == "\239\187\191" then s = s:sub(4) end
  local out, n, i = {}, #s, 1
  local last_comma -- index in `out` of a ',' with only blanks and comments after it so far
  local prev -- the last character of a token so far (not a blank, not a comment)
  while i <= n do
    local c = s:sub(i, i)
    if c == '"' then
      local j = i + 1
      while true do
        local k = s:find('["\\\n]', j)
        if not k or s:sub(k, k) == "\n" then return nil, ("line %d: a string is never closed"):format(line_of(s, i)) end
        if s:sub(k, k) == "\\" then j = k + 2 else j = k break end
      end
      out[#out + 1] = s:sub(i, j)
      last_comma, prev = nil, '"'
      i = j + 1
    elseif c == "/" and s:sub(i + 1, i + 1) == "/" then
      local e = s:find("\n", i, true) or n + 1
      out[#out + 1] = (" "):rep(e - i)
      i = e
    elseif c == "/" and s:sub(i + 1, i + 1) == "*" then
      local _, e = s:find("*/", i + 2, true)
      if not e then return nil, ("line %d: the comment /* … is never closed"):format(line_of(s, i)) end
      out[#out + 1] = (s:sub(i, e):gsub("[^\n]", " "))
      i = e + 1
    elseif c == "," then
      out[#out + 1] = ","
      -- only a comma after a value can be a trailing one: `[,]` and `[1,,]` stay faults
      last_comma = prev and not prev:find("[%[{,]") and #out or nil
      prev = ","
      i = i + 1
    elseif c == "]" or c == "}" then
      if last_comma then out[last_comma] = " " end
      last_comma, prev = nil, c
      out[#out + 1] = c
      i = i + 1
    else
      -- a run up to the next character that matters; a lone '/' is a fault JSON reports
      local j = s:find('["/,%]}]', i + 1) or n + 1
      local run = s:sub(i, j - 1)
      local last = run:match("(%S)%s*$")
      if last then last_comma, prev = nil, last end
      out[#out + 1] = run
      i = j
    end
  end
  return table.concat(out)
end

--- Parses JSONC text (jsonc.strip, then the JSON parser). Returns the value, or nil and the
--- reason: the line of the fault where it can be told. At most jsonc.MAX_BYTES.
---@param s string
---@return any|nil value, string|nil err
function jsonc.decode(s)
  if type(s) ~= "string" then return nil, "not a text" end
  if #s > jsonc.MAX_BYTES then
    return nil, ("%d bytes is more than the %d KiB a JSON-with-comments file may have here"):format(#s,
      jsonc.MAX_BYTES // 1024)
  end
  local text, err = jsonc.strip(s)
  if not text then return nil, err end
  if not text:find("%S") then return nil, "the file is empty" end
  local v, derr = json.decode(text)
  if v ~= nil then return v end
  local msg = tostring(derr or "not JSON")
  local at = tonumber(msg:match("at character (%d+)"))
  if at then msg = ("line %d: %s"):format(line_of(text, at), msg) end
  return nil, msg
end

return jsonc
