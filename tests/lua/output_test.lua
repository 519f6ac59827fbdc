local output = require("demesne.output")
local fs = require("core.fs")

local tests = {}

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d))
  return d
end

function tests.small_output_is_whole(t)
  local d = tmpdir()
  assert(fs.write_atomic(d .. "/stdout.log", "hello\n"))
  local s, cut, size = output.view(d, "stdout.log", 16, 16)
  t:eq(s, "hello\n")
  t:eq(cut, false)
  t:eq(size, 6)
  fs.remove_tree(d)
end

function tests.C07_multibyte_cut_on_code_points(t)
  local d = tmpdir()
  local unit = "日本語🎉"
  assert(fs.write_atomic(d .. "/stdout.log", unit:rep(60000) .. "\n"))
  local s, cut = output.view(d, "stdout.log", 32768, 32768)
  t:eq(cut, true)
  t:ok(utf8.len(s) ~= nil, "result is valid UTF-8")
  t:match(s, "bytes omitted; full output in .*/stdout.log")
  t:ok(#s < 70000, "bounded")
  t:ok(not s:find("\xEF\xBF\xBD", 1, true), "no code point was split")
  fs.remove_tree(d)
end

function tests.utf8_floor_drops_a_partial_sequence(t)
  local text = require("core.text")
  local s = "a\xE6\x97\xA5b" -- a 日 b
  t:eq(text.utf8_floor(s, 1), 1)
  t:eq(text.utf8_floor(s, 2), 1)
  t:eq(text.utf8_floor(s, 3), 1)
  t:eq(text.utf8_floor(s, 4), 4)
  t:eq(text.utf8_floor("a\xE6\x97", 3), 1)
  t:eq(text.utf8_floor("\xF0\x9F\x8E\x89", 4), 4)
  t:eq(text.utf8_ceil(s, 3), 5)
end

function tests.C08_invalid_bytes_are_replaced(t)
  local d = tmpdir()
  local bytes = {}
  for i = 0, 255 do bytes[#bytes + 1] = string.char(i) end
  assert(fs.write_atomic(d .. "/stdout.log", table.concat(bytes):rep(10)))
  local s = output.view(d, "stdout.log", 32768, 32768)
  t:ok(utf8.len(s) ~= nil, "result is valid UTF-8")
  t:ok(s:find("\xEF\xBF\xBD", 1, true) ~= nil, "replacement character present")
  fs.remove_tree(d)
end

function tests.C13_symlinked_log_is_not_followed(t)
  local d = tmpdir()
  os.execute("ln -s /etc/passwd " .. d .. "/stdout.log")
  local s, err, code = output.view(d, "stdout.log", 100, 100)
  t:eq({ s, code }, { nil, "ELOOP" }, "a link is an error, never empty output")
  t:match(err, "stdout%.log")
  fs.remove_tree(d)
end

function tests.a_missing_log_is_empty_output(t)
  local d = tmpdir()
  t:eq({ output.view(d, "stdout.log", 100, 100) }, { "", false, 0 })
  t:eq({ output.tail(d, "stdout.log", 100) }, { "", 0 })
  fs.remove_tree(d)
end

function tests.a_fifo_log_is_an_error_at_once(t)
  local d = tmpdir()
  t:eq(os.execute("mkfifo " .. d .. "/stdout.log"), true, "mkfifo")
  local loop = require("core.loop")
  local started = loop.hrtime()
  for _, read in ipairs({
    function() return output.view(d, "stdout.log", 100, 100) end,
    function() return output.read_from(d, "stdout.log", 0, 100) end,
    function() return output.tail(d, "stdout.log", 100) end,
  }) do
    local s, err = read()
    t:eq(s, nil, "no text from a FIFO")
    t:match(err, "not a regular file %(a fifo%)")
  end
  t:ok(loop.hrtime() - started < 1e9, "never blocks")
  fs.remove_tree(d)
end

return tests
