-- lua/terminal.lua: what `demesne attach --follow` prints of a sandbox's transcript.
local terminal = require("demesne.terminal")

local tests = {}

function tests.control_characters_are_made_visible(t)
  t:eq(terminal.neutralise("a\27[31mb\27]52;c;aGk=\7c"), "a^[[31mb^[]52;c;aGk=^Gc")
  t:eq(terminal.neutralise("line\r\nnext\tx\127"), "line^M\nnext\tx^?")
  t:eq(terminal.neutralise("x\194\155y"), "x<U+009B>y", "a C1 CSI")
  t:eq(terminal.neutralise("bad\255"), "bad\u{FFFD}")
  t:eq(terminal.neutralise("a\nb\tc", true), "a^Jb^Ic")
  t:eq(terminal.neutralise("héllo ✓"), "héllo ✓", "text stays as it is")
end

function tests.stream_json_events_become_lines(t)
  local l = terminal.render_event('{"type":"assistant","message":{"content":[{"type":"text","text":"hi \\u001b[2J"},'
    .. '{"type":"tool_use","name":"Bash","input":{"command":"ls"}}]}}')
  t:eq(l, { "assistant: hi ^[[2J", 'tool Bash: {"command":"ls"}' })
  l = terminal.render_event('{"type":"user","message":{"content":[{"type":"tool_result","content":"out\\u0007"}]}}')
  t:eq(l, { "tool result: out^G" })
  t:eq(terminal.render_event('{"type":"result","result":"done","is_error":false}'), { "[result] done" })
  t:eq(terminal.render_event('{"type":"item.completed","item":{"type":"agent_message","text":"ok"}}'),
    { "assistant: ok" })
  t:eq(terminal.render_event("plain \27[1m"), { "plain ^[[1m" })
  t:eq(terminal.render_event("{not json"), { "{not json" })
end

return tests
