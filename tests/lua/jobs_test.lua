-- Job records: persistence, the single terminal transition and notification, cancel of a
-- job tree, adoption of a dead server's running jobs, pruning, listing, and reading a log
-- incrementally with a byte cursor. No engine: the jobs here are of a fake kind.
local async = require("demesne.async")
local config = require("demesne.config")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")
local loop = require("core.loop")
local fs = require("core.fs")

local tests = {}

-- A fresh state folder, a fake job kind, and a sink that counts demesne.jobs records.
local function setup()
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d .. "/out/exec/x"))
  loop.setenv("DEMESNE_STATE_DIR", d .. "/state")
  config.load()
  jobs.reset()
  local env = { dir = d, notes = {}, closed = 0 }
  env.remove_sink = log.add_sink(function(level, logger, msg, data)
    if logger == "demesne.jobs" and data then env.notes[#env.notes + 1] = { level = level, msg = msg, data = data } end
  end)
  jobs.kinds.fake = {
    -- plan: {ms = how long, outcome = table | nil, err = string | nil}
    run = function(job, plan)
      local _ <close> = setmetatable({}, { __close = function()
        async.sleep(1) -- cleanup may wait, as a container removal does
        env.closed = env.closed + 1
      end })
      async.sleep(plan.ms or 0)
      if plan.err then error(plan.err) end
      return plan.outcome or { status = "succeeded", exit_code = 0 }
    end,
    attach = function(job)
      env.attached = job.rec.job_id
      return { status = "failed", exit_code = 9, reason = "the command exited with code 9" }
    end,
  }
  return env
end

local function teardown(env)
  jobs.reset()
  jobs.kinds.fake = nil
  env.remove_sink()
  loop.setenv("DEMESNE_STATE_DIR", nil)
  config.load()
  fs.remove_tree(env.dir)
end

local function on_disk(id)
  return json.decode(assert(fs.read_file(jobs.dir() .. "/" .. id .. ".json")))
end

local function fake(env, plan, parent)
  return jobs.launch({ tool = "fixture", kind = "fake", command = "echo hi", timeout_seconds = 60,
    output_dir = env.dir .. "/out", log_dir = env.dir .. "/out" }, plan, parent)
end

function tests.record_is_persisted_and_ends_once(t)
  local env = setup()
  local rec = fake(env, { ms = 20 })
  t:match(rec.job_id, "^job%-")
  local disk = on_disk(rec.job_id)
  t:eq(disk.status, "running")
  t:eq(disk.command, "echo hi")
  t:eq(disk.owner, require("demesne.sandbox").owner())
  t:ok(disk.started_ms % 1 == 0 and disk.started_ms > 1.7e12, "started_ms is Unix time in ms")
  local done = jobs.wait(rec.job_id, 5000)
  t:eq(done.status, "succeeded")
  disk = on_disk(rec.job_id)
  t:eq(disk.status, "succeeded")
  t:eq(disk.exit_code, 0)
  t:ok(disk.finished_ms >= disk.started_ms, "finished after it started")
  t:eq(#env.notes, 1)
  t:eq(env.notes[1].data, { job_id = rec.job_id, status = "succeeded", exit_code = 0 })
  t:eq(env.notes[1].level, "info")
  -- a second terminal transition changes nothing and notifies nobody
  local changed = jobs.finish({ rec = done, done = async.event() }, "failed", { reason = "late" })
  t:eq(changed, false)
  t:eq(on_disk(rec.job_id).status, "succeeded")
  t:eq(#env.notes, 1)
  teardown(env)
end

function tests.elapsed_is_frozen_at_the_end(t)
  local env = setup()
  local rec = jobs.wait(fake(env, { ms = 10 }).job_id, 5000)
  local a = jobs.view(rec).elapsed_seconds
  async.sleep(30)
  t:eq(jobs.view(rec).elapsed_seconds, a)
  t:match(jobs.view(rec).finished_at, "^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$")
  teardown(env)
end

function tests.a_raising_job_fails_with_the_reason(t)
  local env = setup()
  local rec = jobs.wait(fake(env, { ms = 1, err = "engine said no" }).job_id, 5000)
  t:eq(rec.status, "failed")
  t:match(rec.reason, "engine said no")
  t:eq(env.closed, 1)
  teardown(env)
end

function tests.wait_times_out_with_running(t)
  local env = setup()
  local rec = fake(env, { ms = 200 })
  t:eq(jobs.wait(rec.job_id, 10).status, "running")
  t:eq(jobs.wait(rec.job_id, 5000).status, "succeeded")
  teardown(env)
end

function tests.cancel_children_first_and_cleanup_runs(t)
  local env = setup()
  local parent = fake(env, { ms = 60000 })
  local child = fake(env, { ms = 60000 }, parent.job_id)
  local grandchild = fake(env, { ms = 60000 }, child.job_id)
  t:eq(on_disk(parent.job_id).children, { child.job_id })
  t:eq(on_disk(child.job_id).parent, parent.job_id)
  local rec, cancelled = jobs.cancel(parent.job_id, "test")
  t:eq(rec.status, "cancelled")
  t:eq(cancelled, { grandchild.job_id, child.job_id, parent.job_id })
  t:eq(env.closed, 3, "every job's cleanup ran")
  for _, id in ipairs(cancelled) do t:eq(on_disk(id).status, "cancelled") end
  t:eq(#env.notes, 3)
  -- cancelling a finished job changes nothing
  local again, none = jobs.cancel(parent.job_id)
  t:eq(again.status, "cancelled")
  t:eq(#none, 0)
  t:eq(#env.notes, 3)
  teardown(env)
end

function tests.a_dead_servers_running_job_is_adopted(t)
  local env = setup()
  assert(fs.mkdir_p(jobs.dir()))
  local id = "job-20260101T000000Z-0123456789"
  local rec = { job_id = id, tool = "fixture", kind = "fake", status = "running", owner = loop.hostname() .. "/999999999/1",
    started_ms = math.floor(loop.time() * 1000) - 5000, children = json.array(), output_dir = env.dir .. "/out",
    timeout_seconds = 60 }
  assert(fs.write_atomic(jobs.dir() .. "/" .. id .. ".json", json.encode(rec)))
  -- a live server's job (this process) and a malformed file are left alone
  local mine = { job_id = "job-20260101T000000Z-aaaaaaaaaa", kind = "fake", status = "running",
    owner = require("demesne.sandbox").owner(), started_ms = 1, children = json.array() }
  assert(fs.write_atomic(jobs.dir() .. "/" .. mine.job_id .. ".json", json.encode(mine)))
  assert(fs.write_atomic(jobs.dir() .. "/job-bad.json", "{not json"))
  t:eq(jobs.resume(), 1)
  local done = jobs.wait(id, 5000)
  t:eq(env.attached, id)
  t:eq(done.status, "failed")
  t:eq(done.exit_code, 9)
  local disk = on_disk(id)
  t:eq(disk.status, "failed")
  t:eq(disk.owner, require("demesne.sandbox").owner())
  t:eq(on_disk(mine.job_id).status, "running")
  t:eq(#env.notes, 1)
  teardown(env)
end

function tests.only_one_server_adopts_an_orphan(t)
  local env = setup()
  assert(fs.mkdir_p(jobs.dir()))
  local text = require("core.text")
  local dead = loop.hostname() .. "/999999998/1"
  local function orphan(id)
    assert(fs.write_atomic(jobs.dir() .. "/" .. id .. ".json", json.encode({ job_id = id, tool = "fixture", kind = "fake",
      status = "running", owner = dead, started_ms = math.floor(loop.time() * 1000) - 5000, children = json.array(),
      output_dir = env.dir .. "/out", timeout_seconds = 60 })))
  end
  local taken, free = "job-20260101T000000Z-1111111111", "job-20260101T000000Z-2222222222"
  orphan(taken)
  orphan(free)
  -- another server has claimed `taken` from the dead owner first (it is still writing the record)
  assert(fs.write_atomic(jobs.dir() .. "/" .. taken .. ".adopt-" .. text.hash(dead), "other/1/1\n"))
  -- a claim from an earlier owner does not block a later adoption
  assert(fs.write_atomic(jobs.dir() .. "/" .. free .. ".adopt-" .. text.hash("earlier/2/2"), "x\n"))
  t:eq(jobs.resume(), 1, "only the unclaimed orphan is adopted")
  t:eq(jobs.wait(free, 5000).status, "failed")
  t:eq(on_disk(taken).status, "running", "the claimed one is left to the server that claimed it")
  t:eq(on_disk(taken).owner, dead)
  t:ok(fs.stat(jobs.dir() .. "/" .. free .. ".adopt-" .. text.hash(dead)), "the adoption left its claim")
  -- a claim whose holder died before it took the record over is stale: the job is adopted
  local stale = "job-20260101T000000Z-3333333333"
  orphan(stale)
  assert(fs.write_atomic(jobs.dir() .. "/" .. stale .. ".adopt-" .. text.hash(dead), loop.hostname() .. "/999999997/1\n"))
  t:eq(jobs.resume(), 1, "the stale claim is taken over")
  t:eq(jobs.wait(stale, 5000).status, "failed")
  t:eq(on_disk(stale).owner, require("demesne.sandbox").owner())
  -- once a record is pruned its claims go too
  fs.unlink(jobs.dir() .. "/" .. taken .. ".json")
  jobs.prune()
  t:eq(fs.stat(jobs.dir() .. "/" .. taken .. ".adopt-" .. text.hash(dead)), nil)
  teardown(env)
end

function tests.prune_keeps_running_and_recent(t)
  local env = setup()
  local old = jobs.wait(fake(env, {}).job_id, 5000)
  local recent = jobs.wait(fake(env, {}).job_id, 5000)
  local running = fake(env, { ms = 60000 })
  old.finished_ms = old.finished_ms - (config.get("jobs_keep_seconds") + 10) * 1000
  old.started_ms = old.finished_ms - 1000
  t:eq(jobs.prune(), 1)
  t:eq(jobs.get(old.job_id), nil)
  t:eq(fs.stat(jobs.dir() .. "/" .. old.job_id .. ".json"), nil)
  t:ok(jobs.get(recent.job_id), "a recent record stays")
  t:ok(jobs.get(running.job_id), "a running record stays")
  jobs.cancel(running.job_id)
  teardown(env)
end

function tests.list_running_first_and_filter(t)
  local env = setup()
  local a = jobs.wait(fake(env, {}).job_id, 5000)
  local b = fake(env, { ms = 60000 })
  local c = jobs.wait(fake(env, { outcome = { status = "failed", exit_code = 2, reason = "exit 2" } }).job_id, 5000)
  local list, matched = jobs.list()
  t:eq(matched, 3)
  t:eq(list[1].job_id, b.job_id)
  local failed = jobs.list("failed")
  t:eq(#failed, 1)
  t:eq(failed[1].job_id, c.job_id)
  local one, n = jobs.list(nil, 1)
  t:eq(#one, 1)
  t:eq(n, 3)
  t:ok(a.status == "succeeded", "a succeeded")
  jobs.cancel(b.job_id)
  teardown(env)
end

function tests.ids_are_checked_before_any_path_is_built(t)
  t:eq(jobs.valid_id("job-20260101T000000Z-ab12"), true)
  t:eq(jobs.valid_id("job-../../etc/passwd"), false)
  t:eq(jobs.valid_id("../job-x"), false)
  t:eq(jobs.valid_id(5), false)
  t:eq(jobs.get("job-../x"), nil)
end

function tests.cursor_reads_reassemble_bytes_and_cut_on_code_points(t)
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d))
  local unit = "a日本語🎉\n"
  local all = unit:rep(50)
  assert(fs.write_atomic(d .. "/stdout.log", all))
  local got, cursor = {}, 0
  for _ = 1, 1000 do
    local s, nxt, size = output.read_from(d, "stdout.log", cursor, 7, false)
    t:eq(size, #all)
    t:ok(utf8.len(s) ~= nil, "each part is whole code points")
    got[#got + 1] = s
    if nxt == cursor then break end
    cursor = nxt
  end
  t:eq(table.concat(got), all)
  -- a sequence still being written waits for the next read; a finished log gives it out
  assert(fs.write_atomic(d .. "/stdout.log", "ok\xe6\x97"))
  local s, nxt = output.read_from(d, "stdout.log", 0, 100, false)
  t:eq({ s, nxt }, { "ok", 2 })
  s, nxt = output.read_from(d, "stdout.log", 2, 100, true)
  t:eq(nxt, 4)
  t:match(s, "\u{FFFD}")
  -- a missing log reads as empty; a link is not followed: an error, never empty output
  t:eq({ output.read_from(d, "nope.log", 0, 100) }, { "", 0, 0 })
  os.execute(("ln -s /etc/hostname %s/link.log"):format(d))
  local none, err, code = output.read_from(d, "link.log", 0, 100)
  t:eq({ none, code }, { nil, "ELOOP" })
  t:match(err, "link%.log")
  local tail = output.tail(d, "stdout.log", 100)
  t:eq(tail, "ok\u{FFFD}\u{FFFD}")
  fs.remove_tree(d)
end

function tests.tail_starts_on_a_whole_line(t)
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d))
  assert(fs.write_atomic(d .. "/stdout.log", "first line\nsecond 日本\nthird\n"))
  local tail, size = output.tail(d, "stdout.log", 16)
  t:eq(tail, "third\n")
  t:eq(size, 31)
  fs.remove_tree(d)
end

return tests
