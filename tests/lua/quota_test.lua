-- The output quota's walker (core.fs.dir:usage) and checks (lua/sandbox/quota.lua) on a
-- scratch folder holding what a hostile sandbox can leave in its /out: links to a folder
-- outside, FIFOs, sparse files, hard links, trees deeper than the walk goes. Sizes are
-- checked against GNU du (allocated blocks, hard links once, links not followed).
local async = require("demesne.async")
local config = require("demesne.config")
local fs = require("core.fs")
local loop = require("core.loop")
local quota = require("demesne.sandbox.quota")
local timer = require("core.timer")

local tests = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local function sh(cmd) return os.execute(cmd) == true end

local function out_of(cmd)
  local p = assert(io.popen(cmd))
  local s = p:read("a")
  p:close()
  return s
end

-- A scratch folder: tree/ is the output folder under test, canary/ lies beside it.
local function scratch()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-quota-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/canary"))
  assert(fs.mkdir_p(dir .. "/tree"))
  return setmetatable({ path = dir, tree = dir .. "/tree" }, { __close = function(s) fs.remove_tree(s.path) end })
end

-- The allocated bytes du counts below `path`, less the folder's own blocks (the walk counts
-- what is inside it).
local function du_inside(path)
  local total = tonumber(out_of(("du -s -B1 %q"):format(path)):match("^(%d+)"))
  local own = tonumber(out_of(("stat -c %%b %q"):format(path)):match("^(%d+)")) * 512
  return total - own
end

-- Measures `path` off the loop, counting timer ticks meanwhile (a tick: the loop ran on).
local function measure(path, opts)
  local d <close> = assert(fs.opendir(path))
  local ticks = 0
  local tick <close> = timer.new()
  tick:start(1, 1, function() ticks = ticks + 1 end)
  local u, err, code = quota.measure(d, opts)
  return u, err, code, ticks
end

function tests.the_walk_counts_allocated_blocks_hard_links_once_and_follows_nothing(t)
  local s <close> = scratch()
  t:ok(sh(("head -c 3145728 /dev/urandom > %s/canary/big"):format(s.path)), "canary")
  t:ok(sh(table.concat({
    ("cd %q"):format(s.tree),
    "head -c 1048576 /dev/urandom > real",
    "ln real hard1 && ln real hard2 && mkdir sub && ln real sub/hard3", -- the same 1 MiB, four names
    "truncate -s 1G sparse && printf data | dd of=sparse bs=1 seek=4096 conv=notrunc 2>/dev/null",
    ("ln -s %q/canary up && ln -s %q/canary/big link"):format(s.path, s.path),
    "mkfifo fifo",
  }, " && ")), "setup")
  local u, err = measure(s.tree)
  t:ok(u, tostring(err))
  t:eq(u.bytes, du_inside(s.tree), "the same bytes as du")
  t:ok(u.bytes >= 1048576 and u.bytes < 1048576 + 256 * 1024,
    ("1 MiB once, the sparse file's one block, no canary: %d"):format(u.bytes))
  t:eq(u.entries, 9, "real, hard1, hard2, sub, sub/hard3, sparse, up, link, fifo")
  t:eq(u.unreadable, 0)
  t:eq(u.limit, nil)
  t:eq(fs.stat(s.path .. "/canary/big").size, 3145728, "the canary is untouched")
end

function tests.many_hard_linked_files_each_count_once(t)
  local s <close> = scratch()
  -- 600 files of 8 KiB, each under two names: the set of seen inodes grows past its first size
  t:ok(sh(("cd %q && for i in $(seq 1 600); do head -c 8192 /dev/urandom > f$i && ln f$i g$i || exit 1; done")
    :format(s.tree)), "setup")
  local u = assert(measure(s.tree))
  t:eq(u.entries, 1200)
  t:eq(u.bytes, du_inside(s.tree), "the same bytes as du")
  t:ok(u.bytes >= 600 * 8192 and u.bytes < 2 * 600 * 8192, tostring(u.bytes))
end

function tests.a_sparse_file_counts_what_it_holds_in_either_direction(t)
  local s <close> = scratch()
  -- 8 GiB long, 0 held: not over a 1 MiB quota; 2 MiB held in a file 2 MiB long: over it
  t:ok(sh(("truncate -s 8G %q/holes"):format(s.tree)), "setup")
  local u = assert(measure(s.tree, { stop_bytes = 1048576 }))
  t:eq(u.limit, nil, "8 GiB of holes take no space")
  t:ok(sh(("head -c 2097152 /dev/urandom > %q/dense"):format(s.tree)), "setup")
  u = assert(measure(s.tree, { stop_bytes = 1048576 }))
  t:eq(u.limit, "bytes", "2 MiB of data is over 1 MiB")
  t:ok(u.bytes > 1048576, tostring(u.bytes))
end

function tests.the_walk_stops_at_its_bounds(t)
  local s <close> = scratch()
  -- 300 folders deep (the walk goes 256 levels) and 3000 entries
  t:ok(sh(("cd %q && mkdir many && cd many && seq 1 3000 | xargs touch"):format(s.tree)), "setup many")
  t:ok(sh(("cd %q && mkdir deep && cd deep && for i in $(seq 1 300); do mkdir d && cd d || exit 1; done")
    :format(s.tree)), "setup deep")
  local u, err = measure(s.tree .. "/many")
  t:ok(u, tostring(err))
  t:eq(u.entries, 3000)
  u = assert(measure(s.tree .. "/many", { max_entries = 100 }))
  t:eq(u.limit, "entries")
  t:eq(u.entries, 101, "stopped at the first entry past the bound")
  u = assert(measure(s.tree .. "/deep"))
  t:eq(u.limit, "depth", "300 levels are deeper than the walk goes")
  t:ok(u.where and u.where:find("^d/d/d/") ~= nil, tostring(u.where))
  u = assert(measure(s.tree .. "/deep", { max_depth = 10 }))
  t:eq(u.limit, "depth")
  t:eq(u.entries, 11, "ten levels seen, the eleventh refused")
  t:eq(pcall(measure, s.tree, { max_depth = 257 }), false, "max_depth above 256 raises")
end

function tests.a_folder_swapped_or_gone_is_skipped_and_a_fifo_never_blocks(t)
  local s <close> = scratch()
  t:ok(sh(("cd %q && mkfifo a b c && mkdir x && mkfifo x/p"):format(s.tree)), "setup")
  local started = loop.hrtime()
  local u = assert(measure(s.tree))
  t:eq(u.entries, 5)
  t:ok((loop.hrtime() - started) / 1e6 < 10000, "no FIFO opened (an open would block)")
  -- the walk of a folder that is gone fails cleanly
  local d <close> = assert(fs.opendir(s.tree .. "/x"))
  fs.remove_tree(s.tree .. "/x")
  local gone, gerr = quota.measure(d)
  t:ok(gone == nil or gone.entries == 0, tostring(gerr))
end

function tests.cancelling_the_task_stops_the_walk(t)
  local s <close> = scratch()
  t:ok(sh(("cd %q && seq 1 20000 | xargs touch"):format(s.tree)), "setup")
  local d <close> = assert(fs.opendir(s.tree))
  local task = async.spawn("walk", function() return quota.measure(d) end)
  async.cancel(task, "test")
  local ok = task:wait()
  t:eq(ok, false, "the task was cancelled")
end

function tests.statvfs_names_the_filesystem_and_the_reserve_refuses_a_start(t)
  local s <close> = scratch()
  local d <close> = assert(fs.opendir(s.tree))
  local v = assert(d:statvfs())
  t:ok(v.total_bytes > 0 and v.avail_bytes > 0 and v.avail_bytes <= v.free_bytes and v.free_bytes <= v.total_bytes,
    "sizes in order")
  t:ok(v.avail_files >= 0)
  local saved = os.getenv("DEMESNE_OUTPUT_MIN_FREE_BYTES")
  local _ <close> = setmetatable({}, { __close = function()
    loop.setenv("DEMESNE_OUTPUT_MIN_FREE_BYTES", saved)
    config.load()
  end })
  loop.setenv("DEMESNE_OUTPUT_MIN_FREE_BYTES", ("%.0f"):format(v.avail_bytes + 1024 * 1024 * 1024 * 1024))
  config.load()
  local ok, e = pcall(quota.check_reserve, s.tree)
  t:eq(ok, false, "refused")
  t:ok(tostring(e.message):find("output_min_free_bytes", 1, true) ~= nil, tostring(e.message))
  t:ok(tostring(e.message):find("output quota exceeded", 1, true) ~= nil, tostring(e.message))
  t:eq(e.code, "ENOSPC")
  loop.setenv("DEMESNE_OUTPUT_MIN_FREE_BYTES", "0")
  config.load()
  t:eq(pcall(quota.check_reserve, s.tree), true, "no reserve: the start goes ahead")
end

function tests.the_watch_stops_a_folder_over_its_quota_and_says_how_much_was_written(t)
  local s <close> = scratch()
  local saved = os.getenv("DEMESNE_OUTPUT_MAX_BYTES")
  local _ <close> = setmetatable({}, { __close = function()
    loop.setenv("DEMESNE_OUTPUT_MAX_BYTES", saved)
    config.load()
  end })
  loop.setenv("DEMESNE_OUTPUT_MAX_BYTES", "1048576")
  config.load()
  local stopped = async.event()
  local w = quota.watch(s.tree, "test", function(info) stopped.set(info) end)
  local _w <close> = setmetatable({}, { __close = function() w.stop() end })
  async.sleep(100)
  t:eq(w.exceeded, nil, "an empty folder is under its quota")
  t:ok(sh(("head -c 3145728 /dev/urandom > %q/f"):format(s.tree)), "write 3 MiB")
  local info = async.timeout(10000, stopped.wait)
  t:ok(info, "the watch saw it")
  local q = w.settle()
  t:eq(q.reason, "output quota exceeded")
  t:eq(q.output_max_bytes, 1048576)
  t:ok(q.output_bytes >= 3145728, "the full size once stopped: " .. tostring(q.output_bytes))
  t:ok(q.detail:find("output_max_bytes", 1, true) ~= nil, q.detail)
  t:eq(w.task.done, true)
end

return tests
