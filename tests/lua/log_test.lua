-- lua/log.lua: records can carry a sandbox's text (a request path, an error string): no
-- control byte of it reaches a terminal or splits a record, and printable() bounds it.
local log = require("demesne.log")

local tests = {}

function tests.printable_escapes_control_bytes_and_cuts(t)
  t:eq(log.printable("a\27[31mb\r\nc\127"), "a\\x1b[31mb\\x0d\\x0ac\\x7f")
  t:eq(log.printable(("x"):rep(600)), ("x"):rep(512) .. "…", "cut at 512 by default")
  t:eq(log.printable("aé", 2), "a…", "never inside a code point")
  t:eq(log.printable(42), "42")
end

function tests.records_never_carry_terminal_escapes(t)
  local got
  local remove = log.add_sink(function(_, _, msg) got = msg end)
  log.log("debug", "demesne.test", "path \27]0;title\7 and\ttab\nline")
  remove()
  t:eq(got, "path \\x1b]0;title\\x07 and\ttab\nline", "escapes written out; tab and line feed kept")
end

return tests
