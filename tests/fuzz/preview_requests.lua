-- Fuzz harness: the requests of one kept-alive connection to a port preview, as the relay
-- cuts them (lua/sandbox/preview.lua with core.httphead.stream and core.httphead.parse,
-- llhttp). The bytes come from whatever a browser on the host is made to send, and a page
-- of the sandbox can make it send a lot; the relay judges each request's head at the place
-- the stream parser says the previous request ended.
--
-- Findings: a Lua error; a cut that depends on how the bytes were split into reads; a cut
-- past the bytes fed; a request that "ends" where parse() finds no whole head before it.
local httphead = require("core.httphead")
local fuzz = require("fuzzlib")
local check = fuzz.check

-- The places where requests end (and an upgrade starts), feeding `pieces` in order.
local function cuts(pieces)
  local s, at, out, total = httphead.stream(), 0, {}, 0
  for piece in pieces do
    total = total + #piece
    local buf = piece
    while #buf > 0 do
      local n, state = s:execute(buf)
      if not n then
        out[#out + 1] = "error"
        return out, total
      end
      check(math.type(n) == "integer" and n >= 0 and n <= #buf, "execute read %s of %d bytes", tostring(n), #buf)
      at = at + n
      buf = buf:sub(n + 1)
      if state == "ended" or state == "upgraded" then out[#out + 1] = state .. "@" .. at end
      if state == "upgraded" then return out, total end
      check(state ~= "more" or #buf == 0, "more with %d bytes left", #buf)
    end
  end
  return out, total
end

return function(data)
  local whole = cuts(coroutine.wrap(function() coroutine.yield(data) end))
  local pieces = cuts(fuzz.chunks(data))
  check(#whole == #pieces, "%d cuts when read at once, %d in pieces", #whole, #pieces)
  for i = 1, #whole do
    -- an error can come one read later in pieces (llhttp reports it where it sees it)
    if whole[i] ~= "error" and pieces[i] ~= "error" then
      check(whole[i] == pieces[i], "cut %d: %s at once, %s in pieces", i, whole[i], pieces[i])
    end
  end
  -- each request the stream parser ended has a whole head at its start, as the relay needs
  local from = 0
  for _, c in ipairs(whole) do
    local at = tonumber(c:match("@(%d+)$"))
    if not at then break end
    local head = httphead.parse(data:sub(from + 1, at))
    check(head ~= nil, "a request ended at %d with no whole head from %d", at, from)
    check(head.length <= at - from, "the head is longer than the request")
    from = at
  end
end
