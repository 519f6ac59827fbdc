-- Kept workspaces (lua/sandbox/keep.lua) and the checks of a `continue` (lua/agent/continue.lua):
-- a keep made, claimed and released; expiry, the size and count bounds and a stale claim
-- handled by the reaper's sweep; a link planted in a kept folder neither followed nor its
-- target removed; every refusal of a continue naming the field and the reason. Real folders
-- in a scratch state_dir; no engine.
local config = require("demesne.config")
local continue = require("demesne.agent.continue")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local keep = require("demesne.sandbox.keep")
local loop = require("core.loop")
local store = require("demesne.tree.store")

local tests = {}

local VARS = { "DEMESNE_STATE_DIR", "DEMESNE_WORKSPACE_KEEP_SECONDS", "DEMESNE_WORKSPACE_KEEP_MAX_MB",
  "DEMESNE_WORKSPACE_KEEP_MAX_COUNT" }

-- Runs fn(d, state) with a scratch state folder and the given settings; restores them after.
local function with_state(env, fn)
  local d = os.tmpname()
  os.remove(d)
  assert(fs.mkdir_p(d, 448))
  loop.setenv("DEMESNE_STATE_DIR", d .. "/state")
  for k, v in pairs(env) do loop.setenv(k, v) end
  config.load()
  store.reset()
  local ok, err = pcall(fn, d, d .. "/state")
  for _, k in ipairs(VARS) do loop.setenv(k, nil) end
  config.load()
  store.reset()
  fs.remove_tree(d)
  if not ok then error(err, 0) end
end

local function exists(p) return fs.lstat(p) ~= nil end

-- A finished run `id` with its own keep (as agent.prepare, before_create and finish make it).
local function finished_run(id, fields)
  local rec = keep.new(id)
  local r = { run_id = id, keep = rec.id, tool = "sandbox_agent", provider = "claude_code", model = "sonnet",
    status = "finished", session_id = "sess-" .. id, root = id, workspace = keep.paths(id).workspace,
    args = { model = "sonnet", egress = "none" } }
  for k, v in pairs(fields or {}) do r[k] = v end
  keep.save_run(r)
  keep.release(rec.id, id, true)
  return r
end

-- The message continue.resolve refuses `args` with (nil when it passes).
local function refusal(caller, args)
  local ok, e = pcall(continue.resolve, caller, args)
  if ok then return nil end
  return errors.is(e) and e.message or tostring(e)
end

function tests.a_keep_is_made_claimed_one_at_a_time_and_released(t)
  with_state({}, function(_, state)
    local rec = keep.new("run-a")
    t:ok(exists(state .. "/kept/run-a/workspace") and exists(state .. "/kept/run-a/home"), "workspace/ and home/ made")
    t:eq(fs.stat(state .. "/kept").mode & 511, 448, "the keeps' folder is 0700")
    t:eq(rec.busy, "run-a", "claimed by the run that made it")
    local _, why = keep.claim("run-a", "run-b")
    t:eq(why, "busy", "a second run cannot claim it while the first uses it")
    keep.save_run({ run_id = "run-a", keep = "run-a", tool = "sandbox_agent", status = "finished",
      session_id = "s1", args = {} })
    local after = keep.release("run-a", "run-a", true)
    t:eq(after.latest, "run-a", "the run that ended is the latest")
    t:eq(after.busy, nil, "no longer busy")
    t:ok(after.expires_at > loop.time() + 86000, "expires a day from now by default")
    local c = keep.claim("run-a", "run-b")
    t:eq(c and c.busy, "run-b", "a continue claims it")
    t:eq(c.runs, { "run-a", "run-b" }, "both runs listed")
    local _, why2, held = keep.claim("run-a", "run-c")
    t:eq({ why2, held }, { "busy", "run-b" }, "a third waits: the claim names the run holding it")
    keep.release("run-a", "run-b", false) -- run-b never started
    t:eq(keep.get("run-a").latest, "run-a", "a continue that never started leaves the chain as it was")
    t:eq(keep.get("run-a").runs, { "run-a" }, "and is not listed")
    t:ok(exists(state .. "/kept/run-a/workspace"), "the kept workspace stays")
  end)
end

function tests.a_first_run_that_never_started_leaves_nothing(t)
  with_state({}, function(_, state)
    keep.new("run-x")
    keep.release("run-x", "run-x", false)
    t:eq(exists(state .. "/kept/run-x"), false, "its folders are gone")
    t:eq(keep.get("run-x").gone, "its first run did not start", "the record says why")
  end)
end

function tests.expired_keeps_are_swept_and_a_continue_says_expired(t)
  with_state({ DEMESNE_WORKSPACE_KEEP_SECONDS = "1" }, function(d, state)
    finished_run("run-old")
    assert(fs.write_atomic(state .. "/kept/run-old/workspace/f.txt", "work"))
    -- a link the sandbox planted, to a host file: the sweep removes the link, never its target
    assert(fs.write_atomic(d .. "/outside.txt", "keep me"))
    assert(fs.symlink(d .. "/outside.txt", state .. "/kept/run-old/home/link"))
    assert(fs.symlink(d, state .. "/kept/run-old/home/dirlink"))
    local rec = keep.get("run-old")
    t:eq(keep.sweep(), 0, "nothing has expired yet")
    rec.expires_at = loop.time() - 1
    keep.save(rec)
    t:eq(keep.sweep(), 1, "the expired keep goes")
    t:eq(exists(state .. "/kept/run-old"), false, "its folder is gone")
    t:eq(fs.read_file(d .. "/outside.txt"), "keep me", "the link's target is untouched")
    t:eq(keep.get("run-old").gone, "expired", "its record says expired")
    t:match(refusal(nil, { continue = "run-old", prompt = "more" }) or "", "^continue: run run%-old has expired",
      "a continue of it is refused as expired")
  end)
end

function tests.a_keep_over_the_size_bound_is_removed_when_its_run_ends(t)
  with_state({ DEMESNE_WORKSPACE_KEEP_MAX_MB = "0.001" }, function(_, state)
    local rec = keep.new("run-big")
    assert(fs.write_atomic(state .. "/kept/run-big/workspace/big", ("x"):rep(4096)))
    keep.save_run({ run_id = "run-big", keep = rec.id, tool = "sandbox_agent", status = "finished",
      session_id = "s", args = {}, root = "run-big" })
    local after = keep.release("run-big", "run-big", true)
    t:match(after.gone or "", "too large to keep: 1 MB, more than workspace_keep_max_mb", "removed, saying why")
    t:eq(exists(state .. "/kept/run-big"), false, "its folder is gone")
    t:match(refusal(nil, { continue = "run-big", prompt = "p" }) or "", "too large to keep",
      "a continue says why it cannot be continued")
  end)
end

function tests.the_size_walk_counts_files_and_never_follows_links(t)
  with_state({}, function(d)
    assert(fs.mkdir_p(d .. "/w/a/b", 493))
    assert(fs.write_atomic(d .. "/w/a/one", ("1"):rep(100)))
    assert(fs.write_atomic(d .. "/w/a/b/two", ("2"):rep(50)))
    assert(fs.write_atomic(d .. "/big", ("3"):rep(100000)))
    assert(fs.symlink(d .. "/big", d .. "/w/link"))
    assert(fs.symlink(d, d .. "/w/a/up"))
    t:eq(keep.size(d .. "/w"), 150, "the two files only")
    local n, err = keep.size(d .. "/w", 3)
    t:eq(n, nil, "bounded in entries")
    t:match(err or "", "more than 3 files", "and says so")
  end)
end

function tests.past_the_count_bound_the_soonest_to_expire_goes(t)
  with_state({ DEMESNE_WORKSPACE_KEEP_MAX_COUNT = "2" }, function(_, state)
    finished_run("run-1")
    local r1 = keep.get("run-1")
    r1.expires_at = r1.expires_at - 100
    keep.save(r1)
    finished_run("run-2")
    t:eq(keep.get("run-1").gone, nil, "two fit")
    local busy = keep.new("run-3") -- in use: never removed for the bound
    t:eq(keep.enforce_count(), 0, "a keep without an end yet does not push others out")
    keep.save_run({ run_id = "run-3", keep = busy.id, tool = "sandbox_agent", status = "finished", session_id = "s",
      args = {}, root = "run-3" })
    keep.release("run-3", "run-3", true)
    t:match(keep.get("run-1").gone or "", "workspace_keep_max_count", "the one expiring soonest went")
    t:eq(exists(state .. "/kept/run-1"), false, "with its folder")
    t:eq(keep.get("run-2").gone, nil, "the others stay")
    t:eq(keep.get("run-3").gone, nil, "the new one stays")
  end)
end

function tests.a_claim_whose_run_is_gone_is_freed_by_the_sweep(t)
  with_state({}, function(_, state)
    finished_run("run-s")
    keep.claim("run-s", "run-t")
    -- the claim of a server that is gone, older than any run may last
    assert(fs.write_atomic(state .. "/kept/claims/run-s/owner", json.encode({ run_id = "run-t",
      owner = loop.hostname() .. "/999999999/1", since = loop.time() - 10 * 24 * 3600 })))
    t:eq(keep.get("run-s").busy, "run-t", "held")
    keep.sweep()
    local rec = keep.get("run-s")
    t:eq(rec.busy, nil, "freed")
    t:eq(rec.latest, "run-s", "the chain is as it was")
    t:eq(exists(state .. "/kept/claims/run-s"), false, "the claim is gone")
    t:ok(keep.claim("run-s", "run-u") ~= nil, "a new continue can claim it")
  end)
end

function tests.a_continue_is_refused_with_the_reason(t)
  with_state({}, function()
    t:match(refusal(nil, { continue = "../x", prompt = "p" }) or "", '^continue: "%.%./x" is not a run id', "bad id")
    t:match(refusal(nil, { continue = "run-none", prompt = "p" }) or "", "^continue: no run run%-none to continue",
      "unknown")
    finished_run("run-r")
    local running = keep.claim("run-r", "run-r2")
    keep.save_run({ run_id = "run-r2", keep = running.id, tool = "sandbox_agent", status = "running", args = {} })
    t:match(refusal(nil, { continue = "run-r2", prompt = "p" }) or "", "^continue: run run%-r2 is still running",
      "still running")
    t:match(refusal(nil, { continue = "run-r", prompt = "p" }) or "", "is being continued by run run%-r2",
      "the run being continued")
    keep.save_run({ run_id = "run-r2", keep = running.id, tool = "sandbox_agent", status = "finished",
      session_id = "s2", args = {}, root = "run-r2" })
    keep.release(running.id, "run-r2", true)
    t:match(refusal(nil, { continue = "run-r", prompt = "p" }) or "", "was continued by run run%-r2; continue run%-r2",
      "an earlier run of a chain names the latest")
    finished_run("run-child", { parent = "run-root", root = "run-root" })
    t:match(refusal(nil, { continue = "run-child", prompt = "p" }) or "",
      "is a child in the tree of run%-root; only a sandbox of that tree", "the host does not continue a child")
    finished_run("run-nos", { session_id = json.null })
    t:match(refusal(nil, { continue = "run-nos", prompt = "p" }) or "", "named no session", "no session")
    finished_run("run-res", { tool = "sandbox_research" })
    t:match(refusal(nil, { continue = "run-res", prompt = "p" }) or "", "is a sandbox_research run", "research")
    finished_run("run-ok")
    t:match(refusal(nil, { continue = "run-ok", prompt = "p", model = "opus" }) or "",
      '^model: a continue runs with the model of run run%-ok %("sonnet"%)', "a different model")
    t:match(refusal(nil, { continue = "run-ok", prompt = "p", egress = "package-managers" }) or "",
      "^egress: a continue runs with the egress of run run%-ok", "a different egress")
    t:match(refusal(nil, { continue = "run-ok", prompt = "p", files = { "/etc/hostname" } }) or "",
      "^files: a continue runs with the files of run run%-ok %(none%)", "other inputs")
    local args = { continue = "run-ok", prompt = "p", egress = "none" }
    t:eq(refusal(nil, args), nil, "the same values pass")
    t:eq({ args.model, args.egress, args.continue_of }, { "sonnet", "none",
      { run_id = "run-ok", keep = "run-ok", session_id = "sess-run-ok" } }, "filled from the first run")
    t:eq(refusal(nil, args), nil, "and pass again (the in-sandbox path checks twice)")
    -- from inside a tree: only the caller's subtree, only its own /workspace
    local outside = { run_id = "run-caller", sees_run = function() return false end }
    t:match(refusal(outside, { continue = "run-ok", prompt = "p" }) or "",
      "no run run%-ok to continue %(unknown, not a sandbox_agent run of this sandbox's tree", "outside the subtree")
    store.put({ run_id = "run-caller", workspace = "/elsewhere", children = {} })
    local inside = { run_id = "run-caller", sees_run = function() return true end }
    t:match(refusal(inside, { continue = "run-ok", prompt = "p" }) or "", "worked in another /workspace",
      "another workspace")
  end)
end

function tests.a_continuation_ends_as_the_latest_run_and_hands_its_branch_on(t)
  with_state({}, function()
    finished_run("run-g")
    local o = { run_id = "run-h", continues = "run-g", chain = "run-g", keep_id = "run-g", tool = "sandbox_agent" }
    keep.claim("run-g", "run-h")
    keep.save_run({ run_id = "run-h", keep = "run-g", tool = "sandbox_agent", status = "running", continues = "run-g",
      args = {} })
    t:eq(continue.repo_opts(o), { name = "run-g" }, "a first run without a branch: the chain's first run names it")
    t:eq(continue.repo_opts({ run_id = "run-z" }), {}, "a run that continues nothing")
    local r = { exit_code = 0, cost_usd = 0.5, branch = { branch = "demesne/run-g", head = ("a"):rep(40) } }
    continue.finished(o, r)
    t:eq(r.continues, "run-g", "the result names the run it continues")
    local h = keep.run("run-h")
    t:eq({ h.status, h.session_id, h.branch_name, h.branch_head, h.cost_usd },
      { "finished", "sess-run-g", "run-g", ("a"):rep(40), 0.5 },
      "no session named: the resumed one stands; the branch and its head are recorded")
    t:eq({ keep.get("run-g").latest, keep.get("run-g").busy }, { "run-h", nil }, "the latest, and free")
    t:eq(continue.repo_opts({ run_id = "run-i", continues = "run-h", chain = "run-g" }),
      { name = "run-g", expect = ("a"):rep(40) }, "the next continue fast-forwards the same branch from that head")
    t:eq(#continue.chain("run-h"), 2, "the chain has both runs")
    t:eq(continue.chain("run-g")[2].continues, "run-g", "first to latest")
  end)
end

return tests
