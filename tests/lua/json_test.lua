-- lua/json.lua: the one place that decides how values become JSON text.
local json = require("demesne.json")

local tests = {}

-- Found by tests/fuzz/mcp_server (corpus file regression-long-numeric-id): lua-cjson
-- writes numbers with 14 significant digits, so a request id of 15 digits or more was
-- answered with another id (123456789012345 -> 1.2345678901234e+14) and the client never
-- matched the answer.
function tests.json_encode_keeps_every_digit_of_a_number(t)
  local cases = {
    { 123456789012345, "123456789012345" },
    { 9007199254740991, "9007199254740991" },
    { math.maxinteger, "9223372036854775807" },
    { math.mininteger, "-9223372036854775808" },
    { -123456789012345678, "-123456789012345678" },
    { 9007199254740991.0, "9007199254740991" },
    { 0.1, "0.1" },
    { 1 / 3, "0.3333333333333333" },
    { 42, "42" },
    { 1e300, "1e+300" },
    { 6.6666666666666666e55, "6.666666666666666e+55" }, { 0.1 + 0.2, "0.30000000000000004" },
  }
  for _, c in ipairs(cases) do
    local text = json.encode({ v = c[1] })
    t:eq(text, '{"v":' .. c[2] .. '}', "encoding of " .. c[2])
    t:eq(json.decode(text).v, c[1] + 0.0, "the same double back for " .. c[2])
  end
  -- inside arrays and next to the empty-array marker
  t:eq(json.encode({ 1, 123456789012345, json.array() }), "[1,123456789012345,[]]")
  -- a string that looks like the marker is a string
  local s = "\0demesne-number-0000000000000000-1\0"
  t:eq(json.decode(json.encode({ s, 123456789012345 }))[1], s)
end

return tests
