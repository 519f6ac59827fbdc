-- Newline framing of MCP over stdio: split frames, several per read, over-long lines.
local framing = require("demesne.mcp.framing")

local tests = {}

local function collect(max)
  local got = { lines = {}, overflows = {} }
  got.reader = framing.reader(max or 1024, function(l) got.lines[#got.lines + 1] = l end,
    function(n) got.overflows[#got.overflows + 1] = n end)
  return got
end

function tests.one_frame_split_over_reads(t)
  local g = collect()
  for _, part in ipairs({ '{"jsonrpc":', '"2.0","id"', ':1,"method":"ping"}', "\n" }) do g.reader.feed(part) end
  t:eq(g.lines, { '{"jsonrpc":"2.0","id":1,"method":"ping"}' })
end

function tests.several_frames_in_one_read(t)
  local g = collect()
  g.reader.feed('{"a":1}\n{"b":2}\n{"c":')
  t:eq(g.lines, { '{"a":1}', '{"b":2}' })
  g.reader.feed('3}\n')
  t:eq(g.lines, { '{"a":1}', '{"b":2}', '{"c":3}' })
  t:eq(g.reader.buffered(), 0)
end

function tests.byte_at_a_time(t)
  local g = collect()
  local s = '{"x":"héllo"}\n{"y":2}\n'
  for i = 1, #s do g.reader.feed(s:sub(i, i)) end
  t:eq(g.lines, { '{"x":"héllo"}', '{"y":2}' })
end

function tests.crlf_and_blank_lines(t)
  local g = collect()
  g.reader.feed('{"a":1}\r\n\n   \n{"b":2}\n')
  t:eq(g.lines, { '{"a":1}', '{"b":2}' })
end

function tests.overlong_line_is_discarded_up_to_its_newline(t)
  local g = collect(16)
  g.reader.feed('{"ok":1}\n' .. ("x"):rep(10))
  t:eq(#g.overflows, 0)
  g.reader.feed(("x"):rep(10)) -- crosses 16: reported once, buffer dropped
  t:eq(#g.overflows, 1)
  t:eq(g.reader.buffered(), 0)
  g.reader.feed(("x"):rep(1000)) -- still discarding, nothing held
  t:eq(g.reader.buffered(), 0)
  t:eq(#g.overflows, 1)
  g.reader.feed('xx\n{"next":2}\n')
  t:eq(g.lines, { '{"ok":1}', '{"next":2}' })
  t:eq(#g.overflows, 1)
end

function tests.overlong_line_within_one_read(t)
  local g = collect(8)
  g.reader.feed(("y"):rep(20) .. '\n{"a":1}\n')
  t:eq(#g.overflows, 1)
  t:eq(g.lines, { '{"a":1}' })
end

function tests.line_of_exactly_the_cap_is_accepted(t)
  local g = collect(8)
  g.reader.feed("12345678\n")
  g.reader.feed("1234")
  g.reader.feed("5678\n")
  t:eq(g.lines, { "12345678", "12345678" })
  t:eq(#g.overflows, 0)
end

function tests.finish_delivers_an_unterminated_last_line(t)
  local g = collect()
  g.reader.feed('{"a":1}\n{"b":')
  g.reader.feed('2}')
  g.reader.finish()
  t:eq(g.lines, { '{"a":1}', '{"b":2}' })
end

return tests
