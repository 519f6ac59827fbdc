-- The confined file layer (core.fs.dir, core.fs.work, core.archive.pack_to/extract_at)
-- and its callers, against the files a hostile sandbox leaves in its output and run
-- folders: symlinks to a canary folder outside, FIFOs, huge and malformed records, trees
-- deeper than any limit. Nothing may follow a link, block, or say success.
local archive = require("core.archive")
local async = require("demesne.async")
local fs = require("core.fs")
local json = require("demesne.json")
local loop = require("core.loop")
local timer = require("core.timer")

local tests = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- A scratch folder with a canary folder beside the tree under attack.
local function scratch()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-confined-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/canary"))
  assert(fs.mkdir_p(dir .. "/tree"))
  assert(fs.write_atomic(dir .. "/canary/keep", "canary\n"))
  return setmetatable({ path = dir, tree = dir .. "/tree" }, { __close = function(s) fs.remove_tree(s.path) end })
end

local function canary_intact(s)
  local names = fs.readdir(s.path .. "/canary")
  return #names == 1 and names[1] == "keep" and fs.read_file(s.path .. "/canary/keep") == "canary\n"
end

local function sh(cmd) return os.execute(cmd) == true end

-- Runs `start(cb)` (returns a core.fs.work) and waits, counting timer ticks meanwhile: a
-- tick proves the loop kept running while the work was pending.
local function await_work(start)
  local ticks = 0
  local tick = timer.new()
  tick:start(5, 5, function() ticks = ticks + 1 end)
  local r = table.pack(async.await(function(cb)
    local w, err, code = start(cb)
    if not w then cb(nil, err, code) end
    return w and function() w:cancel() end
  end))
  tick:close()
  return ticks, table.unpack(r, 1, r.n)
end

function tests.a_held_folder_never_follows_or_opens_what_the_sandbox_planted(t)
  local s <close> = scratch()
  assert(fs.write_atomic(s.tree .. "/f", "hello"))
  t:ok(sh(("mkfifo %s/fifo && ln -s %s/canary %s/up && ln -s %s/canary/keep %s/link"):format(s.tree, s.path, s.tree,
    s.path, s.tree)), "setup")
  local d <close> = assert(fs.opendir(s.tree))
  t:eq(d:read("f", 100), "hello")
  local started = loop.hrtime()
  for _, rel in ipairs({ "fifo", "link", "up/keep", "../canary/keep", s.path .. "/canary/keep" }) do
    local data, err, code = d:read(rel, 100)
    t:eq(data, nil, rel .. " is not read")
    t:ok(code == "EINVAL" or code == "ELOOP" or code == "EXDEV", rel .. ": " .. tostring(code) .. " " .. tostring(err))
  end
  local _, ferr = d:read("fifo", 100)
  t:match(ferr, "not a regular file %(a fifo%)")
  t:eq(select(3, d:read("missing", 100)), "ENOENT", "missing is told apart")
  t:eq(select(3, d:read("f", 4)), "EFBIG", "bounded")
  t:eq(select(3, d:open("fifo", "a")), "EINVAL", "append to a FIFO refused")
  t:eq(select(3, d:open("up/new", "wx")), "ELOOP", "create through a link refused")
  t:eq(select(3, d:mkdir("up/x")), "ELOOP", "mkdir through a link refused")
  t:eq(select(3, d:chmod("link", 511)), "ELOOP", "chmod of a link refused")
  t:eq(select(3, d:opendir("up")), "ELOOP", "a linked folder is not opened")
  t:eq(d:stat("link").type, "link")
  t:ok(loop.hrtime() - started < 2e9, "nothing blocked")
  -- writes replace what is planted, never write through it
  assert(d:write_atomic("fifo", "x"))
  assert(d:write_atomic("link", "x"))
  t:eq(d:stat("fifo").type, "file")
  t:eq(select(3, d:write_atomic("up/usage.json", "x")), "ELOOP")
  local f <close> = assert(d:open("usage.jsonl", "a"))
  assert(f:write("line\n"))
  t:eq(select(3, d:open("usage.jsonl", "wx")), "EEXIST")
  assert(d:mkdir("sub"))
  assert(d:rename("f", d, "sub/f"))
  t:eq(select(3, d:rename("sub/f", d, "usage.jsonl", true)), "EEXIST", "noreplace")
  t:ok(canary_intact(s), "the canary is untouched")
  -- open_beneath (one-shot) refuses the FIFO too
  t:ok(sh(("rm %s/fifo && mkfifo %s/fifo"):format(s.tree, s.tree)), "fifo again")
  t:eq(select(3, fs.open_beneath(s.tree, "fifo")), "EINVAL")
end

function tests.list_reads_a_held_folder_bounded_and_never_through_a_link(t)
  local s <close> = scratch()
  assert(fs.mkdir_p(s.tree .. "/many", 493))
  for i = 1, 50 do assert(fs.write_atomic(("%s/many/f%02d"):format(s.tree, i), "")) end
  assert(fs.symlink(s.path .. "/canary", s.tree .. "/to-canary"))
  assert(fs.symlink(s.path .. "/canary", s.tree .. "/many/link"))
  local d <close> = assert(fs.opendir(s.tree))
  local names, more = d:list("many", 10)
  t:eq({ #names, more }, { 10, true }, "at most max names, and word of more")
  names, more = d:list("many", 100)
  t:eq({ #names, more }, { 51, false }, "all of them (the link listed as a name)")
  local top = d:list(100)
  table.sort(top)
  t:eq(top, { "many", "to-canary" }, "the held folder itself")
  local none, err, code = d:list("to-canary", 10)
  t:eq(none, nil, "a link to a folder is not listed")
  t:ok(code == "ELOOP" or code == "ENOTDIR", tostring(err))
  local below, _, bcode = d:list("many/link", 10)
  t:eq(below, nil, "nor a link below")
  t:ok(bcode == "ELOOP" or bcode == "ENOTDIR", tostring(bcode))
  t:eq((d:list("../canary", 10)), nil, "nor a path out")
  t:ok(canary_intact(s), "the canary is untouched")
end

function tests.remove_tree_runs_off_the_loop_and_never_follows_a_link(t)
  local s <close> = scratch()
  -- 3000 levels, with links to the canary on the way
  local d = assert(fs.opendir(s.tree))
  for i = 1, 3000 do
    assert(d:mkdir("a"))
    local n = assert(d:opendir("a"))
    if i % 250 == 0 then assert(n:write_atomic("f", "x")) end
    d:close()
    d = n
  end
  d:close()
  -- links to the canary near the top and 500 levels down
  t:ok(sh(("ln -s %s/canary %s/a/link && ln -s %s/canary %s/%slink"):format(s.path, s.tree, s.path, s.tree,
    ("a/"):rep(500))), "links to the canary")
  local top <close> = assert(fs.opendir(s.path))
  local ticks, ok, err = await_work(function(cb) return top:remove_tree("tree", cb) end)
  t:eq({ ok, err }, { true, nil })
  t:eq(fs.lstat(s.tree), nil, "the tree is gone")
  t:ok(canary_intact(s), "the canary is untouched")
  t:ok(ticks > 0, "the loop ran timers while the removal worked: " .. ticks)
  -- a missing tree is success; a bad name is refused up front
  t:eq(select(2, await_work(function(cb) return top:remove_tree("tree", cb) end)), true)
  t:eq(select(3, top:remove_tree("../x", function() end)), "EXDEV")
end

function tests.pack_to_and_extract_at_round_trip_with_limits(t)
  local s <close> = scratch()
  assert(fs.mkdir_p(s.tree .. "/src/sub"))
  local big = loop.random(60000) .. loop.random(10000)
  assert(fs.write_atomic(s.tree .. "/src/sub/big.bin", big))
  assert(fs.write_atomic(s.tree .. "/src/a.txt", "a"))
  local d <close> = assert(fs.opendir(s.tree))
  local f = assert(d:open("x.tar", "wx"))
  local _, res, err = await_work(function(cb) return archive.pack_to(f, { { src = s.tree .. "/src", name = "src" } },
    { strict = true }, cb) end)
  f:close()
  t:ok(res, tostring(err))
  t:eq({ res.files, res.bytes }, { 2, 70001 })
  local tar <close> = assert(d:open("x.tar", "r"))
  local _, x, xerr = await_work(function(cb) return archive.extract_at(tar, d, "staging", {}, cb) end)
  t:ok(x, tostring(xerr))
  t:eq(fs.read_file(s.tree .. "/staging/src/sub/big.bin"), big)
  -- the staging folder must be new; a refused extraction leaves nothing
  local _, none, e2, c2 = await_work(function(cb) return archive.extract_at(tar, d, "staging", {}, cb) end)
  t:eq({ none, c2 }, { nil, "EEXIST" }, tostring(e2))
  local _, capped, e3, c3 = await_work(function(cb)
    return archive.extract_at(tar, d, "capped", { max_bytes = 1000 }, cb)
  end)
  t:eq({ capped, c3 }, { nil, "E2BIG" }, tostring(e3))
  t:eq(d:stat("capped"), nil, "nothing left of a refused extraction")
  local _, small, e4, c4 = await_work(function(cb)
    return archive.extract_at(tar, d, "small", { max_archive_bytes = 512 }, cb)
  end)
  t:eq({ small, c4 }, { nil, "E2BIG" }, tostring(e4))
  -- pack_to sums the sizes first: over the cap nothing is written
  local g = assert(d:open("y.tar", "wx"))
  local _, over, e5, c5 = await_work(function(cb)
    return archive.pack_to(g, { { src = s.tree .. "/src", name = "src" } }, { max_bytes = 100 }, cb)
  end)
  t:eq({ over, c5 }, { nil, "E2BIG" }, tostring(e5))
  t:eq(g:size(), 0, "nothing written over the cap")
  g:close()
  t:ok(canary_intact(s))
end

function tests.a_cancelled_extraction_leaves_nothing(t)
  local s <close> = scratch()
  assert(fs.mkdir_p(s.tree .. "/src"))
  for i = 1, 300 do assert(fs.write_atomic(("%s/src/f%d"):format(s.tree, i), ("x"):rep(1000))) end
  local d <close> = assert(fs.opendir(s.tree))
  local f = assert(d:open("x.tar", "wx"))
  assert(select(2, await_work(function(cb) return archive.pack_to(f, { { src = s.tree .. "/src", name = "." } }, nil, cb) end)))
  f:close()
  local tar <close> = assert(d:open("x.tar", "r"))
  local result
  local w = assert(archive.extract_at(tar, d, "staging", nil, function(...) result = table.pack(...) end))
  w:cancel()
  while not result do async.sleep(5) end
  t:eq({ result[1], result[3] }, { nil, "ECANCELED" })
  t:eq(d:stat("staging"), nil, "the cancelled extraction removed its folder")
  w:cancel() -- done: nothing happens
end

function tests.a_tree_deeper_than_256_levels_is_refused_naming_the_path(t)
  local s <close> = scratch()
  -- build the deep source with held folders (no path length limit)
  local d = assert(fs.opendir(s.tree))
  assert(d:mkdir("src"))
  local cur = assert(d:opendir("src"))
  for _ = 1, 300 do
    assert(cur:mkdir("a"))
    local n = assert(cur:opendir("a"))
    cur:close()
    cur = n
  end
  assert(cur:write_atomic("f", "x"))
  cur:close()
  local f = assert(d:open("deep.tar", "wx"))
  local _, res, err, code = await_work(function(cb)
    return archive.pack_to(f, { { src = s.tree .. "/src", name = "src" } }, nil, cb)
  end)
  f:close()
  t:eq({ res, code }, { nil, "E2BIG" })
  t:match(err, "src/a/a/a.*256")
  -- the same tree packed with a higher cap extracts only up to the default depth
  f = assert(d:open("deep2.tar", "wx"))
  assert(select(2, await_work(function(cb)
    return archive.pack_to(f, { { src = s.tree .. "/src", name = "src" } }, { max_depth = 400 }, cb)
  end)))
  f:close()
  local tar <close> = assert(d:open("deep2.tar", "r"))
  local _, x, xerr, xcode = await_work(function(cb) return archive.extract_at(tar, d, "out", nil, cb) end)
  t:eq({ x, xcode }, { nil, "E2BIG" })
  t:match(xerr, "src/a/a/a.*more than 256 levels deep")
  t:eq(d:stat("out"), nil)
  d:close()
end

function tests.status_json_is_checked_field_by_field(t)
  local sandbox = require("demesne.sandbox")
  local good = { id = "main", exit_code = 3, signal = json.null, timed_out = false, cancelled = false,
    started_at = 1700000000000, finished_at = 1700000000500, duration_ms = 500, oom_kills = 0 }
  local st = assert(sandbox.check_status(good))
  t:eq({ st.exit_code, st.timed_out, math.type(st.exit_code) }, { 3, false, "integer" })
  local forged = {
    { exit_code = "0" }, { exit_code = 0.5 }, { exit_code = -1 }, { exit_code = 256 }, { exit_code = 1e300 },
    { exit_code = 0 / 0 }, { exit_code = 2 ^ 63 }, {}, { exit_code = 0, timed_out = "yes" },
    { exit_code = 0, signal = "KILL" }, { exit_code = 0, signal = 99 }, { exit_code = 0, oom_kills = -3 },
    { exit_code = 0, finished_at = {} }, { exit_code = 0, error = ("e"):rep(5000) }, { exit_code = 0, error = 7 },
    "string", 42, json.null,
  }
  for i, f in ipairs(forged) do
    local ok, why = sandbox.check_status(f)
    t:eq(ok, nil, "forged record " .. i)
    t:ok(type(why) == "string" and #why > 0, "a reason for record " .. i)
  end
end

function tests.read_status_tells_missing_from_unreadable(t)
  local sandbox = require("demesne.sandbox")
  local s <close> = scratch()
  local run = s.tree
  assert(fs.mkdir_p(run .. "/exec/ok"))
  assert(fs.write_atomic(run .. "/exec/ok/status.json", '{"exit_code":7,"timed_out":false}'))
  t:eq(sandbox.read_status(run, "ok").exit_code, 7)
  t:eq(sandbox.read_status(run, "missing"), nil, "no status: nil")
  local function failure(id)
    local ok, e = pcall(sandbox.read_status, run, id)
    t:eq(ok, false, id .. " must fail")
    t:ok(require("demesne.errors").is(e), id .. ": a user-facing error, not a Lua error: " .. tostring(e))
    return e.message
  end
  assert(fs.mkdir_p(run .. "/exec/fifo"))
  t:ok(sh("mkfifo " .. run .. "/exec/fifo/status.json"), "mkfifo")
  t:match(failure("fifo"), "status%.json: not a regular file %(a fifo%)")
  assert(fs.mkdir_p(run .. "/exec/link"))
  t:ok(sh(("ln -s %s/canary/keep %s/exec/link/status.json"):format(s.path, run)), "ln")
  t:match(failure("link"), "symlink")
  assert(fs.mkdir_p(run .. "/exec/huge"))
  assert(fs.write_atomic(run .. "/exec/huge/status.json", '{"exit_code":0,"pad":"' .. ("x"):rep(100000) .. '"}'))
  t:match(failure("huge"), "more than the 65536")
  assert(fs.mkdir_p(run .. "/exec/bad"))
  assert(fs.write_atomic(run .. "/exec/bad/status.json", '{"exit_code":"0"}'))
  t:match(failure("bad"), "exit_code is not an integer")
  assert(fs.mkdir_p(run .. "/exec/notjson"))
  assert(fs.write_atomic(run .. "/exec/notjson/status.json", "{exit"))
  t:match(failure("notjson"), "not JSON")
  assert(fs.mkdir_p(run .. "/exec/dir/status.json"))
  t:match(failure("dir"), "a directory")
  -- the exec folder itself a link: not followed
  t:ok(sh(("ln -s %s/canary %s/exec/swapped"):format(s.path, run)), "ln")
  t:match(failure("swapped"), "symlink")
  t:ok(canary_intact(s))
end

function tests.egress_and_vendor_files_never_block_or_follow(t)
  local s <close> = scratch()
  local egress = require("demesne.egress")
  local policy = require("demesne.egress.policy")
  local out, run = s.tree .. "/out", s.tree .. "/run"
  assert(fs.mkdir_p(out))
  assert(fs.mkdir_p(run))
  t:ok(sh(("mkfifo %s/egress.jsonl && ln -s %s/canary/keep %s/apt.conf"):format(out, s.path, run)), "setup")
  local started = loop.hrtime()
  local pol = assert(policy.policy("none"))
  local h, err = egress.start({ run_id = "ct-" .. hex(loop.random(3)), run_dir = run, output_dir = out, policy = pol })
  t:eq(h, nil, "a FIFO at egress.jsonl is refused")
  t:match(err, "egress%.jsonl: not a regular file %(a fifo%)")
  t:ok(loop.hrtime() - started < 2e9, "not blocked")
  -- with a regular log, apt.conf (a link to the canary) is replaced, not written through
  t:ok(sh(("rm %s/egress.jsonl"):format(out)), "rm")
  h = assert(egress.start({ run_id = "ct-" .. hex(loop.random(3)), run_dir = run, output_dir = out, policy = pol }))
  t:eq(fs.lstat(run .. "/apt.conf").type, "file")
  h:stop()
  -- the vendor route: a FIFO at usage.json (never read: the host keeps its own totals) is replaced, one at
  -- usage.jsonl is refused; neither blocks
  local vendor = require("demesne.vendor")
  local reg = require("demesne.providers").load({ user_dir = false, quiet = true })
  local p = reg:get("claude_code")
  local cred = { present = true, kind = "api_key", value = function() return "x" end }
  t:ok(sh(("mkfifo %s/usage.json"):format(out)), "mkfifo usage.json")
  local route, verr = vendor.start({ run_id = "ct-v" .. hex(loop.random(3)), run_dir = run, output_dir = out,
    provider = p, token = "dmsn-x", credential = cred })
  t:ok(route, tostring(verr))
  if route then
    route:stop()
    vendor.forget(route.run_id) -- (the host's copy of its totals, in the state folder)
  end
  t:eq(fs.lstat(out .. "/usage.json").type, "file", "the FIFO was replaced by the totals, never opened")
  t:ok(sh(("rm %s/usage.jsonl && mkfifo %s/usage.jsonl"):format(out, out)), "mkfifo usage.jsonl")
  local none, uerr = vendor.start({ run_id = "ct-v" .. hex(loop.random(3)), run_dir = run, output_dir = out,
    provider = p, token = "dmsn-x", credential = cred })
  t:eq(none, nil)
  t:match(uerr, "usage%.jsonl: not a regular file %(a fifo%)")
  t:ok(loop.hrtime() - started < 4e9, "nothing blocked")
  t:ok(canary_intact(s))
end

return tests
