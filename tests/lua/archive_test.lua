-- core.archive through the binding: pack/list/extract round trip, unsafe archives (built
-- here byte by byte as ustar), limits and argument errors.
local archive = require("core.archive")
local fs = require("core.fs")
local loop = require("core.loop")
local process = require("core.process")
local async = require("demesne.async")

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local function tmpdir()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-archive-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

local function write(path, data)
  local f = assert(fs.open(path, "w"))
  assert(f:write(data))
  f:close()
end

local function run(file, args)
  local ev = async.event()
  local proc, err = process.spawn({ file = file, args = args }, function(status) ev.set(status) end)
  assert(proc, err)
  return ev.wait()
end

-- A ustar member: type "0" file, "1" hardlink, "2" symlink, "5" folder, "6" fifo.
local function member(name, typeflag, data, link)
  data = data or ""
  local function field(s, w) return s .. ("\0"):rep(w - #s) end
  local function octal(n, w) return ("%0" .. (w - 1) .. "o"):format(n) .. "\0" end
  local h = field(name, 100) .. octal(420, 8) .. octal(0, 8) .. octal(0, 8) .. octal(#data, 12)
    .. octal(1700000000, 12) .. ("        ") .. typeflag .. field(link or "", 100)
    .. "ustar\0" .. "00" .. field("", 32) .. field("", 32) .. octal(0, 8) .. octal(0, 8)
    .. field("", 155) .. ("\0"):rep(12)
  assert(#h == 512)
  local sum = 0
  for i = 1, 512 do sum = sum + h:byte(i) end
  h = h:sub(1, 148) .. ("%06o\0 "):format(sum) .. h:sub(157)
  return h .. data .. ("\0"):rep((512 - #data % 512) % 512)
end

local function tar(path, members)
  write(path, table.concat(members) .. ("\0"):rep(1024))
end

local tests = {}

function tests.pack_list_extract_round_trip(t)
  local d <close> = tmpdir()
  local src = d.path .. "/src"
  assert(fs.mkdir_p(src .. "/sub"))
  local big = loop.random(65536) .. loop.random(65536) .. loop.random(1234)
  write(src .. "/a.txt", "hello")
  write(src .. "/sub/big.bin", big)
  write(src .. "/empty", "")
  t:eq(run("ln", { "-s", "a.txt", src .. "/link" }), 0, "ln -s")
  local out = d.path .. "/ctx.tar"
  local res, msg = archive.pack(out, {
    { src = src, name = "src" },
    { name = "Containerfile", data = "FROM scratch\n", mode = tonumber("600", 8) },
  })
  t:ok(res, msg)
  t:eq(res, { files = 4, bytes = 5 + #big + 13 }, "pack counts")

  local list = assert(archive.list(out))
  local by = {}
  for _, e in ipairs(list) do by[e.name:gsub("/$", "")] = e end
  t:eq(by["src"].type, "directory")
  t:eq({ by["src/a.txt"].type, by["src/a.txt"].size }, { "file", 5 })
  t:eq({ by["src/link"].type, by["src/link"].target }, { "link", "a.txt" })
  t:eq({ by["Containerfile"].size, by["Containerfile"].mode }, { 13, tonumber("600", 8) })

  local dest = d.path .. "/out"
  local x, xmsg = archive.extract(out, dest)
  t:ok(x, xmsg)
  t:eq({ x.files, x.bytes }, { 4, 5 + #big + 13 })
  t:eq(#x.entries, #list, "every entry named")
  t:eq(fs.read_file(dest .. "/src/a.txt"), "hello")
  t:ok(fs.read_file(dest .. "/src/sub/big.bin") == big, "big file identical")
  t:eq(fs.read_file(dest .. "/src/empty"), "")
  t:eq(fs.read_file(dest .. "/src/link"), "hello", "symlink kept")
  t:eq(fs.lstat(dest .. "/src/link").type, "link")
  t:eq(fs.read_file(dest .. "/Containerfile"), "FROM scratch\n")
  t:eq(fs.stat(dest .. "/Containerfile").mode & 511, tonumber("600", 8))
end

local function expect_unsafe(t, d, label, members, culprit)
  local file = d.path .. "/" .. label .. ".tar"
  tar(file, members)
  local dest = d.path .. "/dest-" .. label
  local res, msg, code = archive.extract(file, dest)
  t:eq(res, nil, label)
  t:eq(code, "EUNSAFE", label .. " code")
  t:ok(msg:find(culprit, 1, true), label .. ": message names the entry: " .. tostring(msg))
  t:eq(fs.lstat(dest), nil, label .. ": nothing left behind")
end

function tests.unsafe_archives_are_refused_whole(t)
  local d <close> = tmpdir()
  local ok = member("good.txt", "0", "fine")
  expect_unsafe(t, d, "dotdot", { ok, member("../evil", "0", "x") }, "../evil")
  expect_unsafe(t, d, "absolute", { ok, member("/tmp/demesne-evil", "0", "x") }, "/tmp/demesne-evil")
  expect_unsafe(t, d, "symlink-abs", { ok, member("l", "2", nil, "/etc") }, "'l'")
  expect_unsafe(t, d, "symlink-up", { member("d/", "5"), member("d/l", "2", nil, "../../x") }, "d/l")
  expect_unsafe(t, d, "symlink-chain", { member("l", "2", nil, "s/.."), member("s", "2", nil, ".") }, "'l'")
  expect_unsafe(t, d, "hardlink-outside", { ok, member("h", "1", nil, "/etc/passwd") }, "'h'")
  expect_unsafe(t, d, "hardlink-first", { member("h", "1", nil, "good.txt"), ok }, "'h'")
  expect_unsafe(t, d, "fifo", { member("p", "6") }, "'p'")
  t:eq(fs.lstat(d.path .. "/evil"), nil, "no escape happened")
  t:eq(fs.lstat("/tmp/demesne-evil"), nil, "no absolute write happened")
end

function tests.limits_and_errors(t)
  local d <close> = tmpdir()
  local file = d.path .. "/two.tar"
  tar(file, { member("a", "0", "1234"), member("b", "0", "5678") })
  local res, _, code = archive.extract(file, d.path .. "/x1", { max_entries = 1 })
  t:eq({ res, code }, { nil, "E2BIG" })
  res, _, code = archive.extract(file, d.path .. "/x2", { max_bytes = 7 })
  t:eq({ res, code }, { nil, "E2BIG" })
  t:eq(fs.lstat(d.path .. "/x2"), nil, "removed after E2BIG")
  res = assert(archive.extract(file, d.path .. "/x3", { max_bytes = 8, max_entries = 2 }))
  t:eq(res.entries, { "a", "b" })

  res, _, code = archive.extract(d.path .. "/missing.tar", d.path .. "/x4")
  t:eq({ res, code }, { nil, "ENOENT" })
  res, _, code = archive.list(d.path .. "/missing.tar")
  t:eq({ res, code }, { nil, "ENOENT" })
  res, _, code = archive.extract(file, d.path .. "/x3") -- not empty any more
  t:eq({ res, code }, { nil, "ENOTEMPTY" })
  res, _, code = archive.pack(d.path .. "/p.tar", { { src = d.path .. "/nope", name = "x" } })
  t:eq({ res, code }, { nil, "ENOENT" })
  res, _, code = archive.pack(d.path .. "/p.tar", { { name = "../x", data = "" } })
  t:eq({ res, code }, { nil, "EINVAL" })
  t:eq(fs.lstat(d.path .. "/p.tar"), nil, "no output left after a failed pack")
end

function tests.bad_arguments_raise(t)
  t:ok(not pcall(archive.pack, nil, {}), "output path")
  t:ok(not pcall(archive.pack, "/tmp/x.tar", { "not a table" }), "entry type")
  t:ok(not pcall(archive.pack, "/tmp/x.tar", { { name = "x" } }), "neither src nor data")
  t:ok(not pcall(archive.pack, "/tmp/x.tar", { { name = "x", src = "/a", data = "b" } }), "both")
  t:ok(not pcall(archive.pack, "/tmp/x.tar", { { src = "/a" } }), "name required")
  t:ok(not pcall(archive.pack, "/tmp/x.tar", { { name = "x", data = "", mode = "644" } }), "mode type")
  t:ok(not pcall(archive.extract, "/tmp/x.tar", "/tmp/y", { max_bytes = -1 }), "negative cap")
  t:ok(not pcall(archive.extract, "/tmp/x.tar"), "dest required")
  t:ok(not pcall(archive.list), "path required")
end

function tests.a_hard_link_to_a_file_inside_is_kept(t)
  local d <close> = tmpdir()
  local file = d.path .. "/hard.tar"
  tar(file, { member("dir/", "5"), member("dir/orig", "0", "shared"), member("dir/link", "1", nil, "dir/orig") })
  local res, msg = archive.extract(file, d.path .. "/x")
  t:ok(res, msg)
  t:eq(res.files, 2)
  t:eq(fs.read_file(d.path .. "/x/dir/link"), "shared")
  local f = assert(io.open(d.path .. "/x/dir/link", "a"))
  f:write("+")
  f:close()
  t:eq(fs.read_file(d.path .. "/x/dir/orig"), "shared+", "one file, two names")
end

return tests
