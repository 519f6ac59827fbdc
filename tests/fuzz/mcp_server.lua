-- Fuzz harness: what an MCP client sends over stdio, through the receive path that
-- lua/mcp/stdio.lua wires up: the line framer (lua/mcp/framing.lua) fed in socket-sized
-- pieces, each line to server:receive (lua/mcp/server.lua: JSON-RPC decoding, dispatch,
-- tools/call with argument validation against the tool's inputSchema), then the graceful
-- stop stdio does at EOF (server:shutdown). The transport writes nowhere; it checks what
-- the server sends.
--
-- The tools are test fixtures that touch nothing outside the process (echo with a rich
-- schema, progress, sampling and elicitation requests to the client, a $ref schema), and
-- the built-in tools with their real inputSchema (so the arguments a client sends them go
-- through the same validation) but a run that only echoes: no engine is reached. A line
-- over the cap (2 KiB here, so inputs reach it) takes the overflow path; one outgoing
-- message is capped at 40 KiB: tools/list (32 KiB) fits, an echo of control characters
-- (six bytes each once escaped) can go over and be replaced.
--
-- Findings: a Lua error out of receive/overflow/shutdown (stdio would only log it and the
-- client would wait for an answer forever), a message sent that is not one line of JSON-RPC
-- 2.0, a response to an id the client never used, a request still pending after shutdown,
-- or a ref or handle left behind (the driver checks those).
local async = require("demesne.async")
local json = require("demesne.json")
local framing = require("demesne.mcp.framing")
local server = require("demesne.mcp.server")
local tools = require("demesne.tools")
local loop = require("core.loop")
local text = require("core.text")
local fuzz = require("fuzzlib")
local check = fuzz.check

local MAX_LINE = 2048
local MAX_MESSAGE = 40 * 1024
local SHUTDOWN_MS = 2000

local registry = tools.registry()
for _, d in ipairs(tools.load({ user_dir = false, quiet = true }):list()) do
  local stub = {}
  for k, v in pairs(d) do stub[k] = v end
  stub.run = function(_, args) return { content = { { type = "text", text = "stub" } }, structuredContent = args } end
  registry:add(stub)
end
for _, name in ipairs({ "fixture_echo", "fixture_progress", "json_schema_2020_12_tool", "test_sampling",
  "test_elicitation", "test_elicitation_sep1034_defaults", "test_elicitation_sep1330_enums" }) do
  local path = FUZZ_SOURCE_DIR .. "/tests/fixtures/tools/" .. name .. ".lua"
  local src = assert(tools.read_file(path))
  registry:add(assert(tools.load_source(src, path)))
end

return function(data)
  local ids = {}  -- id keys of the requests the client sent
  -- every message goes out with invalid UTF-8 replaced (as a client's decoder sees it too)
  local function key(id)
    if type(id) == "number" then return ("n:%.17g"):format(id) end
    if type(id) == "string" then return "s:" .. text.utf8_clean(id) end
    return type(id) .. ":" .. tostring(id)
  end
  local srv
  srv = server.new({
    registry = registry,
    max_message_bytes = MAX_MESSAGE,
    send = function(line)
      check(type(line) == "string" and not line:find("\n", 1, true), "a message that is not one line: %q",
        tostring(line):sub(1, 200))
      check(#line <= MAX_MESSAGE, "a message of %d bytes, over the cap of %d", #line, MAX_MESSAGE)
      local msg = json.decode(line)
      check(type(msg) == "table" and msg.jsonrpc == "2.0", "not JSON-RPC 2.0: %s", line:sub(1, 200))
      if msg.method == nil then -- a response
        check((msg.result == nil) ~= (msg.error == nil), "a response needs exactly one of result, error: %s",
          line:sub(1, 200))
        check(msg.id == json.null or ids[key(msg.id)], "a response to id %s, which the client never sent",
          tostring(msg.id))
      end
      return true
    end,
  })
  local reader = framing.reader(MAX_LINE, function(line)
    local msg = json.decode(line)
    if type(msg) == "table" and msg.id ~= nil then ids[key(msg.id)] = true end
    srv:receive(line)
  end, function(bytes)
    srv:overflow(bytes, MAX_LINE)
  end)
  for piece in fuzz.chunks(data) do reader.feed(piece) end
  reader.finish()
  check(reader.buffered() == 0, "the framer holds %d bytes after finish", reader.buffered())
  -- stdin ended: stop as lua/mcp/stdio.lua does
  local stop = async.spawn("fuzz shutdown", function() return srv:shutdown(SHUTDOWN_MS) end)
  if not stop.done then loop.run() end
  check(stop.done, "shutdown did not finish")
  if not stop.result[1] then error(stop.result[2], 0) end
  check(stop.result[2] == true, "shutdown left cancelled requests running after %d ms", SHUTDOWN_MS)
  check(srv:pending() == 0, "%d requests pending after shutdown", srv:pending())
end
