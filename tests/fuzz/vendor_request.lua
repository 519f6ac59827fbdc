-- Fuzz harness: what an agent in a sandbox sends to its vendor port, through the vendor
-- route's own server (core.httpd: llhttp, with the server's head, body and chunk checks;
-- lua/vendor/init.lua: Route:on_request, Route:serve, the attempt endpoint) and its
-- verdict (providers.vendor_decide with each built-in provider). Each input goes to a
-- claude_code route and to a codex route, in socket-sized pieces, over a unix-socket
-- listener of the route's server (the relay hands it TCP connections; the bytes are the
-- same); then the agent half-closes its side, as when it hangs up after its requests.
--
-- The routes hold no credential, so no request is forwarded: every verdict is answered by
-- the route itself or the server (local, 400, 401, 403, 413, 431, 503, the attempt answer)
-- and nothing leaves the process. The forwarding half (upstream responses, usage counting)
-- is tests/fuzz/vendor_usage.lua.
--
-- Findings: a Lua error, an answer that is not a sequence of HTTP/1.1 responses each framed
-- by its Content-Length or chunked, an answer after one that said Connection: close, a
-- connection left open, a request task left behind, a timer left running (the driver
-- checks handles).
local async = require("demesne.async")
local fs = require("core.fs")
local loop = require("core.loop")
local providers = require("demesne.providers")
local stream = require("core.stream")
local vendor = require("demesne.vendor")
local fuzz = require("fuzzlib")
local check = fuzz.check

local TOKEN = "dmsn-fuzz" -- the run's token: the seeds and the dictionary carry it
local WAIT_MS = 5000      -- an answer to a half-closed connection comes at once, or never

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
  route.fuzz_socket = dir .. "/fuzz.sock"
  assert(route.server:listen_unix(route.fuzz_socket, { tag = "fuzz" }))
  routes[#routes + 1] = route
end

-- The answers are HTTP/1.1 responses one after the other, each framed by its
-- Content-Length or chunked, nothing after one that said Connection: close.
local function check_answers(text)
  local pos, closed = 1, false
  while pos <= #text do
    check(not closed, "bytes after an answer that said Connection: close: %q", text:sub(pos, pos + 200))
    local s, e, status, head = text:find("^HTTP/1%.1 (%d%d%d) [^\r\n]*\r\n(.-\r\n)\r\n", pos)
    check(s, "not an HTTP/1.1 response: %q", text:sub(pos, pos + 200))
    local h = head:lower()
    pos = e + 1
    closed = h:find("connection: close\r\n", 1, true) ~= nil
    local len = h:match("content%-length: (%d+)\r\n")
    if h:find("transfer-encoding: chunked\r\n", 1, true) then
      check(not len, "both Content-Length and chunked")
      while true do
        local cs, ce, size = text:find("^(%x+)\r\n", pos)
        check(cs, "a broken chunk in a %s answer: %q", status, text:sub(pos, pos + 200))
        local n = tonumber(size, 16)
        pos = ce + 1 + n
        check(text:sub(pos, pos + 1) == "\r\n", "chunk data not followed by CRLF")
        pos = pos + 2
        if n == 0 then break end
      end
    else
      check(len, "a %s answer with neither Content-Length nor chunked", status)
      check(#text - pos + 1 >= tonumber(len), "Content-Length %s for a %d-byte rest", len, #text - pos + 1)
      pos = pos + tonumber(len)
    end
  end
end

-- One agent connection: sends the pieces, half-closes, returns what came back up to EOF.
local function exchange(path, data)
  local conn = async.await(function(cb) assert(stream.connect_unix(path, cb)) end)
  check(conn, "cannot connect to the route's server")
  local got, ended = {}, async.event()
  conn:read_start(function(bytes)
    if bytes then got[#got + 1] = bytes else ended.set() end
  end)
  for piece in fuzz.chunks(data) do
    if ended.is_set() then break end -- the server is done with us
    local ok = async.await(function(cb) conn:write(piece, cb) end)
    if not ok then break end -- it closed while we wrote: the rest stays unsent
  end
  async.await(function(cb) conn:shutdown(cb) end)
  local ok = pcall(async.timeout, WAIT_MS, ended.wait)
  conn:close()
  check(ok, "no EOF %d ms after the agent hung up", WAIT_MS)
  return table.concat(got)
end

return function(data)
  local task = async.spawn("fuzz vendor_request", function()
    for _, route in ipairs(routes) do
      check_answers(exchange(route.fuzz_socket, data))
      -- the server lets the connection go within a few turns of the loop
      for _ = 1, 100 do
        if route.server:connections() == 0 and next(route.tasks) == nil then break end
        async.sleep(1)
      end
      check(route.server:connections() == 0, "the server still holds %d connections", route.server:connections())
      check(next(route.tasks) == nil, "a request task is left after the connection ended")
    end
  end)
  if not task.done then
    task:on_done(function() loop.stop() end)
    loop.run()
  end
  if not task.result[1] then error(task.result[2], 0) end
end
