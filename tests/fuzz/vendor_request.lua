-- Fuzz harness: what an agent in a sandbox sends to its vendor port, through the vendor
-- route's own HTTP reading (lua/vendor.lua: Route:accept, the head parser, the
-- Content-Length and chunked body readers) and its verdict (providers.vendor_decide with
-- each built-in provider, the attempt-end path). Each input goes to a claude_code route and
-- to a codex route, in socket-sized pieces, over a no-op connection that records what the
-- route writes; then the connection ends (EOF), as when the agent hangs up.
--
-- The routes hold no credential, so no request is forwarded: every verdict is answered by
-- the route itself (local, 401, 403, 503, the attempt answer) and nothing leaves the process.
-- The forwarding half (upstream responses, usage counting) is tests/fuzz/vendor_usage.lua.
--
-- Findings: a Lua error, an answer that is not one HTTP/1.1 response with a Content-Length
-- that matches its body, a connection left open or counted after EOF, a timer left running
-- (the driver checks handles).
local fs = require("core.fs")
local providers = require("demesne.providers")
local vendor = require("demesne.vendor")
local fuzz = require("fuzzlib")
local check = fuzz.check

local TOKEN = "dmsn-fuzz" -- the run's token: the seeds and the dictionary carry it

local reg = providers.load({ user_dir = false, quiet = true })
local routes = {}
for _, name in ipairs({ "claude_code", "codex" }) do
  local dir = os.getenv("FUZZ_TMPDIR") .. "/vendor-" .. name
  assert(fs.mkdir_p(dir .. "/run", 448))
  assert(fs.mkdir_p(dir .. "/out", 448))
  local route = assert(vendor.start({ run_id = "fuzz-" .. name, run_dir = dir .. "/run", output_dir = dir .. "/out",
    provider = assert(reg:get(name)), token = TOKEN, credential = { present = false, hint = "fuzzing" },
    holds = false, rate_limit_retries = 0 }))
  -- usage.jsonl would grow by a line per input: nothing to read there
  route.file:close()
  route.file = nil
  routes[#routes + 1] = route
end

-- A connection that goes nowhere: it records writes and runs their callbacks when asked.
local function no_op_conn()
  local c = { out = {}, closed = false, reading = false, pending = {} }
  function c.read_start(self, cb)
    check(not self.closed, "read_start after close")
    self.on_read, self.reading = cb, true
    return true
  end
  function c.read_stop(self) self.reading = false return true end
  function c.write(self, data, cb)
    check(not self.closed, "write after close")
    check(type(data) == "string", "write of a %s", type(data))
    self.out[#self.out + 1] = data
    if cb then self.pending[#self.pending + 1] = function() cb(true) end end
    return true
  end
  function c.shutdown(self, cb)
    if cb then self.pending[#self.pending + 1] = function() cb(true) end end
    return true
  end
  function c.close(self) self.closed, self.reading = true, false end
  -- what the loop would do next: write callbacks, later, never re-entrantly
  function c.settle(self)
    while #self.pending > 0 do
      local p = self.pending
      self.pending = {}
      for _, f in ipairs(p) do f() end
    end
  end
  return c
end

-- The answer is one HTTP/1.1 response whose Content-Length matches its body.
local function check_answer(text)
  local status, head, body = text:match("^HTTP/1%.1 (%d%d%d) [^\r\n]*\r\n(.-\r\n)\r\n(.*)$")
  check(status, "not an HTTP/1.1 response: %q", text:sub(1, 200))
  local len = head:lower():match("content%-length: (%d+)\r\n")
  check(len and tonumber(len) == #body, "Content-Length %s for a %d-byte body", tostring(len), #body)
  check(head:lower():find("connection: close\r\n", 1, true), "no Connection: close")
end

return function(data)
  for _, route in ipairs(routes) do
    local c = no_op_conn()
    route:accept(c)
    check(c.reading, "the route does not read a new connection")
    for piece in fuzz.chunks(data) do
      if not c.reading then break end -- the route has stopped reading: the rest stays unread
      c.on_read(piece)
      c:settle()
    end
    if c.reading then -- the agent hangs up
      c.on_read(nil, "EOF")
      c:settle()
    end
    check(c.closed, "the connection is still open after EOF")
    check(route.nconns == 0 and next(route.conns) == nil, "the route still counts %d connections", route.nconns)
    check(#c.out <= 1, "%d answers to one request", #c.out)
    if #c.out == 1 then check_answer(c.out[1]) end
  end
end
