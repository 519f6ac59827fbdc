-- lua/repo: a host repository in, a branch out, with real git on the host. The sandbox's
-- side (clone, commit, bundle) is played here by git in a folder of the test's own; the
-- host's side is the real code. Every case compares the host repository before and after.
local config = require("demesne.config")
local fs = require("core.fs")
local loop = require("core.loop")
local repo = require("demesne.repo")

local tests = {}

local function sh(cmd)
  local p = assert(io.popen("(" .. cmd .. ") 2>&1"))
  local out = p:read("a")
  local ok = p:close()
  return out, ok
end

local function must(cmd)
  local out, ok = sh(cmd)
  assert(ok, cmd .. ": " .. out)
  return (out:gsub("%s+$", ""))
end

local G = "git -c user.name=t -c user.email=t@t -c init.defaultBranch=main"

-- A temporary folder with an allowed host repository (two commits, an uncommitted change,
-- an untracked file, a hook and a config the test checks stay as they are).
local function setup()
  local d = os.tmpname()
  os.remove(d)
  fs.mkdir_p(d .. "/allowed")
  local h = d .. "/allowed/proj"
  must(("%s init -q %s && cd %s && echo one > a.txt && %s add a.txt && %s commit -qm first && echo two >> a.txt "
    .. "&& %s commit -qam second && echo dirty >> a.txt && echo new > untracked.txt"):format(G, h, h, G, G, G))
  fs.write_atomic(h .. "/.git/hooks/post-checkout", "#!/bin/sh\ntouch " .. d .. "/HOOK-RAN\n", 493)
  loop.setenv("DEMESNE_ALLOWED_PATHS", d .. "/allowed")
  loop.setenv("DEMESNE_STATE_DIR", d .. "/state")
  loop.setenv("DEMESNE_OUTPUT_ROOT", d .. "/out")
  config.load()
  return d, h
end

local function teardown(d)
  for _, k in ipairs({ "DEMESNE_ALLOWED_PATHS", "DEMESNE_STATE_DIR", "DEMESNE_OUTPUT_ROOT", "DEMESNE_REPOSITORY_MAX_BYTES" }) do
    loop.setenv(k, nil)
  end
  config.load()
  fs.remove_tree(d)
end

-- What must not change in the host repository: status, HEAD, refs, config, hooks, index.
local function snapshot(h)
  return {
    status = must(("git -C %s status --porcelain"):format(h)),
    head = must(("git -C %s rev-parse HEAD"):format(h)),
    sym = must(("git -C %s symbolic-ref -q HEAD || echo detached"):format(h)),
    refs = must(("git -C %s for-each-ref --format='%%(refname) %%(objectname)'"):format(h)),
    config = fs.read_file(h .. "/.git/config"),
    hooks = must(("ls -la %s/.git/hooks | sed 1d | awk '{print $1, $5, $9}'"):format(h)),
    index = must(("sha256sum %s/.git/index"):format(h)),
  }
end

local function plan(d, id)
  local o = { run_id = id, mounts = {}, env = {}, output_dir = d .. "/out/" .. id, command = "true" }
  fs.mkdir_p(o.output_dir)
  return o
end

-- The sandbox's part: clone the bundle the host made, run `work` in it, bundle the branch
-- back into /out the way run.sh does.
local function sandbox_side(o, work, bundle_args)
  local g = o.repo
  local ws = o.output_dir .. "-ws"
  if g.depth then -- run.sh's clone of the host's shallow bare clone
    must(("%s clone -q --depth %d -b %s file://%s/in/repo.git %s"):format(G, g.depth, g.branch, g.dir, ws))
  else
    must(("%s clone -q -b %s %s/in/in.bundle %s"):format(G, g.branch, g.dir, ws))
  end
  must(("cd %s && %s"):format(ws, work))
  must(("cd %s && %s bundle create -q %s/%s %s"):format(ws, G, o.output_dir, repo.BUNDLE,
    bundle_args or ("refs/heads/" .. g.branch .. " ^" .. g.host_head)))
  return ws
end

function tests.branch_comes_back_and_nothing_else_changes(t)
  local d, h = setup()
  local before = snapshot(h)
  local o = plan(d, "r1")
  local g = repo.prepare(o, h, { include_uncommitted = true })
  t:eq(g.branch, "demesne/r1", "named for the run")
  t:eq(g.host_head, before.head, "from the host's HEAD")
  t:ok(g.base ~= g.host_head, "the uncommitted changes are a commit of their own")
  t:eq(o.argv[2], repo.MOUNT .. "/run.sh", "the command is wrapped")
  t:eq(repo.mount_of(o).target, repo.MOUNT, "the bundle is mounted")
  t:eq(snapshot(h), before, "preparing changed nothing in the host repository")
  local ws = sandbox_side(o, G .. " show HEAD:a.txt > shown && grep -q dirty a.txt && test -f untracked.txt && "
    .. "echo agent > b.txt && " .. G .. " add b.txt && " .. G .. " commit -qm 'agent: add b'")
  -- hostile settings in the sandbox's clone: nothing of them may run on the host
  fs.write_atomic(ws .. "/.git/config", ("[core]\n\tfsmonitor = touch %s/FSMONITOR-RAN\n\thooksPath = %s\n"
    .. "[includeIf \"gitdir:/\"]\n\tpath = %s/evil\n"):format(d, ws, ws))
  fs.write_atomic(ws .. "/post-checkout", "#!/bin/sh\ntouch " .. d .. "/HOOK-RAN\n", 493)
  local b = repo.hand_back(o)
  t:eq(b.error, nil, "handed back")
  t:eq(b.branch, "demesne/r1")
  t:eq(#b.commits, 1, "the agent's commit only (the base is demesne's commit)")
  t:eq(b.commits[1].subject, "agent: add b")
  t:eq(b.diffstat, { files = 1, insertions = 1, deletions = 0 }, "diffstat against the base")
  t:eq(b.base_is_ancestor, true)
  t:eq(b.bundle, "/out/" .. repo.BUNDLE)
  t:eq(must(("git -C %s rev-parse refs/heads/demesne/r1"):format(h)), b.head, "the ref is in the host repository")
  t:eq(must(("git -C %s log --format=%%s -n 3 demesne/r1"):format(h)),
    "agent: add b\ndemesne: uncommitted changes of the host's work tree at the start of run r1\nsecond")
  local after = snapshot(h)
  t:eq(after.refs, "refs/heads/demesne/r1 " .. b.head .. "\n" .. before.refs, "exactly one ref more")
  after.refs = before.refs
  t:eq(after, before, "work tree, index, HEAD, config and hooks as they were")
  t:eq(fs.lstat(d .. "/HOOK-RAN"), nil, "no hook ran")
  t:eq(fs.lstat(d .. "/FSMONITOR-RAN"), nil, "no fsmonitor ran")
  -- a second run may not take the same branch
  local o2 = plan(d, "r2")
  local ok, err = pcall(repo.prepare, o2, h, { name = "r1" })
  t:eq(ok, false)
  t:match(tostring(err.message or err), "^branch: the branch demesne/r1 already exists", "refused, never overwritten")
  repo.cleanup(o)
  repo.cleanup(o2)
  t:eq(fs.lstat(d .. "/state/repo/r1"), nil, "the scratch folder goes")
  teardown(d)
end

function tests.submodules_are_left_out_with_a_note(t)
  local d, h = setup()
  must(("%s init -q %s/lib && cd %s/lib && %s commit -q --allow-empty -m lib"):format(G, d, d, G))
  must(("cd %s && %s -c protocol.file.allow=always submodule add -q %s/lib vendor/lib && %s commit -qm sub"):format(
    h, G, d, G))
  local before = snapshot(h)
  local o = plan(d, "sub1")
  local g = repo.prepare(o, h)
  t:match(table.concat(g.notes, "\n"), "submodules are left out %(their folders are empty in the clone%): vendor/lib")
  local ws = sandbox_side(o, "test -d vendor/lib && test -z \"$(ls -A vendor/lib)\" && echo y > y.txt && "
    .. G .. " add y.txt && " .. G .. " commit -qm y")
  t:ok(ws)
  local b = repo.hand_back(o)
  t:eq(b.error, nil)
  t:eq(#b.commits, 1)
  local after = snapshot(h)
  after.refs = before.refs
  t:eq(after, before)
  repo.cleanup(o)
  teardown(d)
end

-- A continue (lua/agent: repo.prepare with the branch's name and the head the last hand-back
-- left, `expect`): the same branch fast-forwards, and a branch someone else moved meanwhile
-- is never overwritten: the continue is refused before it starts.
function tests.a_continue_fast_forwards_the_same_branch(t)
  local d, h = setup()
  local o = plan(d, "c1")
  repo.prepare(o, h, { name = "cont" })
  local ws = sandbox_side(o, "echo 1 > one && " .. G .. " add one && " .. G .. " commit -qm one")
  local b1 = repo.hand_back(o)
  t:eq(b1.error, nil)
  -- the host moves on meanwhile: the continue still hands back against the first run's start,
  -- which its kept clone holds (a ^<new HEAD> the clone lacks would make no bundle)
  local start = { base = o.repo.base, host_head = o.repo.host_head }
  must(("cd %s && echo host > host.txt && %s add host.txt && %s commit -qm 'host moved on'"):format(h, G, G))
  local o2 = plan(d, "c2")
  local g = repo.prepare(o2, h, { name = "cont", expect = b1.head, base = start.base, host_head = start.host_head })
  t:eq(g.branch, "demesne/cont", "the same branch")
  t:eq({ base = g.base, host_head = g.host_head }, start, "the first run's start, not the host's new HEAD")
  o2.output_dir = o.output_dir -- the same /out: the sandbox's side below writes its bundle there
  must(("cd %s && echo 2 > two && %s add two && %s commit -qm two && %s bundle create -q %s/%s refs/heads/%s ^%s"):format(
    ws, G, G, G, o.output_dir, repo.BUNDLE, g.branch, g.host_head))
  local b2 = repo.hand_back(o2)
  t:eq(b2.error, nil)
  t:eq(must(("git -C %s rev-parse %s~1"):format(h, b2.head)), b1.head, "fast-forwarded")
  t:eq(#b2.commits, 2, "both runs' commits against the base")
  -- someone moves the branch on the host: the next continue is refused, never overwrites
  must(("git -C %s update-ref refs/heads/demesne/cont %s"):format(h, b1.head))
  local ok, err = pcall(repo.prepare, plan(d, "c3"), h, { name = "cont", expect = b2.head })
  t:eq(ok, false)
  t:match(tostring(err.message), "^branch: the branch demesne/cont already exists", "refused")
  t:eq(must(("git -C %s rev-parse refs/heads/demesne/cont"):format(h)), b1.head, "left where the host put it")
  repo.cleanup(o)
  repo.cleanup(o2)
  teardown(d)
end

function tests.no_commit_no_branch(t)
  local d, h = setup()
  local before = snapshot(h)
  local o = plan(d, "r3")
  repo.prepare(o, h)
  t:eq(o.repo.base, o.repo.host_head, "without include_uncommitted the base is HEAD")
  local b = repo.hand_back(o)
  t:eq(b.error, nil)
  t:eq(b.head, nil, "no head")
  t:match(b.notes[#b.notes], "no branch was made")
  t:eq(snapshot(h), before)
  repo.cleanup(o)
  teardown(d)
end

function tests.detached_head_and_subfolder_are_taken(t)
  local d, h = setup()
  must(("cd %s && git checkout -q --detach HEAD~1 2>/dev/null || (git stash -q && git checkout -q --detach HEAD~1)"):format(h))
  fs.mkdir_p(h .. "/sub")
  local before = snapshot(h)
  local o = plan(d, "r4")
  local g = repo.prepare(o, h .. "/sub")
  t:eq(g.host, h, "the work tree of a folder inside it")
  t:match(table.concat(g.notes, "\n"), "HEAD is detached", "said")
  sandbox_side(o, "echo x > c.txt && " .. G .. " add c.txt && " .. G .. " commit -qm c")
  local b = repo.hand_back(o)
  t:eq(b.error, nil)
  t:eq(#b.commits, 1)
  local after = snapshot(h)
  after.refs = before.refs
  t:eq(after, before, "still detached, nothing else changed")
  repo.cleanup(o)
  teardown(d)
end

-- Each bad hand-back: an error naming the reason, no ref, the host repository unchanged.
function tests.hostile_bundles_are_refused(t)
  local d, h = setup()
  local before = snapshot(h)
  local cases = {
    { "truncated", function(o)
      sandbox_side(o, "echo x > t.txt && " .. G .. " add t.txt && " .. G .. " commit -qm t")
      local f = o.output_dir .. "/" .. repo.BUNDLE
      local data = fs.read_file(f)
      fs.write_atomic(f, data:sub(1, #data - 40))
    end, "failed the checks: .*early EOF" },
    { "garbage", function(o)
      fs.write_atomic(o.output_dir .. "/" .. repo.BUNDLE, "# v2 git bundle\nnot a bundle at all\n")
    end, "not a valid git bundle" },
    { "extra ref", function(o)
      sandbox_side(o, G .. " commit -q --allow-empty -m e && " .. G .. " branch other",
        "refs/heads/" .. o.repo.branch .. " refs/heads/other ^" .. o.repo.host_head)
    end, "must name exactly one ref, refs/heads/demesne/bad%-extra%-ref; it names" },
    { "ref outside the branch", function(o)
      sandbox_side(o, G .. " commit -q --allow-empty -m e && " .. G .. " branch -m main",
        "refs/heads/main ^" .. o.repo.host_head)
    end, "it names refs/heads/main" },
    { "bad objects", function(o)
      -- a commit whose author line fsck rejects
      sandbox_side(o, ("t=$(git write-tree) && c=$(printf 'tree %%s\\nparent %s\\nauthor nobody\\n"
        .. "committer x <x> 1 +0000\\n\\nbad\\n' $t | git hash-object -t commit -w --literally --stdin) && "
        .. "git update-ref refs/heads/%s $c"):format(o.repo.host_head, o.repo.branch))
    end, "failed the checks" },
    { "a link", function(o)
      fs.symlink(h .. "/.git/config", o.output_dir .. "/" .. repo.BUNDLE)
    end, "/out/demesne%-branch.bundle: " },
    { "a fifo", function(o)
      must("mkfifo " .. o.output_dir .. "/" .. repo.BUNDLE)
    end, "not a regular file" },
  }
  for i, c in ipairs(cases) do
    local o = plan(d, "bad-" .. i)
    repo.prepare(o, h, { name = "bad-" .. c[1]:gsub(" ", "-") })
    c[2](o)
    local b = repo.hand_back(o)
    t:match(tostring(b.error), c[3], c[1])
    t:eq(b.head, nil, c[1] .. ": no head")
    t:eq(snapshot(h), before, c[1] .. ": host repository unchanged")
    repo.cleanup(o)
  end
  -- too large
  local o = plan(d, "big")
  repo.prepare(o, h)
  sandbox_side(o, "head -c 300000 /dev/urandom > big && " .. G .. " add big && " .. G .. " commit -qm big")
  loop.setenv("DEMESNE_REPOSITORY_MAX_BYTES", "100000")
  config.load()
  local b = repo.hand_back(o)
  t:match(tostring(b.error), "more than repository_max_bytes", "bounded")
  t:eq(snapshot(h), before, "too large: unchanged")
  repo.cleanup(o)
  teardown(d)
end

-- depth: a shallow bare clone (in/repo.git) instead of a bundle; the sandbox's shallow clone
-- holds `depth` commits, and its branch still fetches into the host repository.
function tests.a_depth_gives_a_shallow_clone_whose_branch_comes_back(t)
  local d, h = setup()
  must(("cd %s && for i in 3 4 5; do echo $i >> a.txt; %s commit -qm c$i a.txt; done && echo dirty >> a.txt"):format(h, G))
  local before = snapshot(h)
  local o = plan(d, "d1")
  local g = repo.prepare(o, h, { depth = 1, name = "shallow" })
  t:eq(g.depth, 1, "the clone's depth")
  t:eq(fs.lstat(g.dir .. "/in/in.bundle"), nil, "no bundle: a bundle cannot carry a shallow history")
  t:eq(must(("git --git-dir=%s/in/repo.git rev-list --count refs/heads/demesne/shallow"):format(g.dir)), "1")
  t:eq(must(("cat %s/in/repo.git/shallow"):format(g.dir)), before.head, "cut below the host's HEAD")
  t:eq(must(("git --git-dir=%s/in/repo.git config --list --local"):format(g.dir)),
    "core.repositoryformatversion=0\ncore.bare=true", "demesne's own config: no remote, no path of the host's")
  t:match(fs.read_file(g.dir .. "/in/settings"), "DEMESNE_REPO_DEPTH='1'", "run.sh is told the depth")
  local ws = sandbox_side(o, "echo w > w.txt && " .. G .. " add w.txt && " .. G .. " commit -qm work")
  t:eq(must(("git -C %s rev-list --count HEAD~1"):format(ws)), "1", "the sandbox's clone holds one commit of history")
  local b = repo.hand_back(o)
  t:eq(b.error, nil, "handed back")
  t:eq(#b.commits, 1)
  t:eq(b.commits[1].subject, "work")
  t:eq(must(("git -C %s rev-parse %s^"):format(h, b.head)), before.head, "its parent is the host's HEAD")
  t:eq(must(("git -C %s rev-list --count demesne/shallow"):format(h)), "6", "the whole history on the host")
  local after = snapshot(h)
  t:eq(after.refs, "refs/heads/demesne/shallow " .. b.head .. "\n" .. before.refs, "exactly one ref more")
  after.refs = before.refs
  t:eq(after, before, "nothing else changed")
  repo.cleanup(o)
  -- with include_uncommitted, demesne's commit comes on top of the depth asked for
  local o2 = plan(d, "d2")
  local g2 = repo.prepare(o2, h, { depth = 2, include_uncommitted = true })
  t:eq(g2.depth, 3, "two commits of history and demesne's")
  ws = sandbox_side(o2, "grep -q dirty a.txt && echo v > v.txt && " .. G .. " add v.txt && " .. G .. " commit -qm v")
  t:eq(must(("git -C %s rev-list --count HEAD"):format(ws)), "4")
  local b2 = repo.hand_back(o2)
  t:eq(b2.error, nil)
  t:eq(#b2.commits, 1, "the base is demesne's commit")
  t:eq(must(("git -C %s rev-parse %s^"):format(h, b2.base)), before.head)
  repo.cleanup(o2)
  teardown(d)
end

-- A shallow host clone is taken with a depth its history reaches, and refused otherwise.
function tests.a_shallow_host_clone_needs_a_depth_it_reaches(t)
  local d, h = setup()
  must(("cd %s && for i in 3 4; do echo $i >> a.txt; %s commit -qm c$i a.txt; done"):format(h, G))
  local s = d .. "/allowed/shallow"
  must(("%s clone -q --depth 2 file://%s %s"):format(G, h, s))
  local before = snapshot(s)
  local o = plan(d, "s1")
  local ok, err = pcall(repo.prepare, o, s)
  t:eq(ok, false)
  t:match(tostring(err.message), "^repository: .* is a shallow clone, .*; give a depth", "no depth")
  repo.cleanup(o)
  ok, err = pcall(repo.prepare, plan(d, "s2"), s, { depth = 3 })
  t:eq(ok, false)
  t:match(tostring(err.message), "^depth: .* has 2 commit%(s%) of history %(first parents%), fewer than the 3 asked for; "
    .. "give a depth of at most 2", "deeper than it holds")
  t:eq(fs.lstat(d .. "/state/repo/s2"), nil, "nothing made")
  local o3 = plan(d, "s3")
  local g = repo.prepare(o3, s, { depth = 2 })
  t:match(table.concat(g.notes, "\n"), "is a shallow clone: the clone's history is cut where it is cut there")
  local ws = sandbox_side(o3, "echo z > z.txt && " .. G .. " add z.txt && " .. G .. " commit -qm z")
  t:eq(must(("git -C %s rev-list --count HEAD"):format(ws)), "3")
  local b = repo.hand_back(o3)
  t:eq(b.error, nil, "fetched into the shallow host clone")
  t:eq(must(("git -C %s rev-parse %s^"):format(s, b.head)), before.head)
  local after = snapshot(s)
  after.refs = before.refs
  t:eq(after, before)
  t:eq(must(("git -C %s rev-parse --is-shallow-repository"):format(s)), "true", "still as shallow as it was")
  repo.cleanup(o3)
  teardown(d)
end

function tests.bad_depths_are_refused_naming_depth(t)
  local d, h = setup()
  local before = snapshot(h)
  for i, c in ipairs({ { 0, "^depth: must be at least 1 commit %(got 0%)" }, { -3, "^depth: must be at least 1" },
    { 1.5, "^depth: must be a whole number of commits" }, { "2", "^depth: must be a whole number" },
    { 10 ^ 12, "^depth: 1000000000000 is more than the 1000000 commits" } }) do
    local o = plan(d, "bd" .. i)
    local ok, err = pcall(repo.prepare, o, h, { depth = c[1] })
    t:eq(ok, false, tostring(c[1]))
    t:match(tostring(type(err) == "table" and err.message or err), c[2], tostring(c[1]))
    t:eq(fs.lstat(d .. "/state/repo/bd" .. i), nil, "nothing made")
  end
  t:eq(snapshot(h), before)
  teardown(d)
end

function tests.bad_repositories_are_refused(t)
  local d, h = setup()
  must(("%s init -q --bare %s/allowed/bare.git"):format(G, d))
  must(("%s init -q %s/allowed/empty"):format(G, d))
  must(("%s clone -q --depth 1 file://%s %s/allowed/shallow"):format(G, h, d))
  fs.mkdir_p(d .. "/allowed/plain")
  fs.mkdir_p(d .. "/outside")
  -- an output root inside the allowed paths, holding a repository a sandbox could have written
  must(("%s init -q %s/allowed/out-repo && cd %s/allowed/out-repo && %s commit -q --allow-empty -m x"):format(G, d, d, G))
  loop.setenv("DEMESNE_OUTPUT_ROOT", d .. "/allowed/out-repo")
  config.load()
  local before = snapshot(h)
  local cases = {
    { d .. "/allowed/plain", nil, "^repository: .* is not a git repository" },
    { d .. "/allowed/bare.git", nil, "^repository: .* is a bare repository" },
    { d .. "/allowed/empty", nil, "^repository: .* has no commit yet" },
    { d .. "/allowed/shallow", nil, "^repository: .* is a shallow clone, .*; give a depth" },
    { d .. "/outside", nil, "^repository: .* is not inside the allowed paths" },
    { h, "bad..name", "^branch: \"bad..name\" is not a valid git ref component" },
    { d .. "/allowed/out-repo", nil, "^repository: .* is inside demesne's output_root" },
    { h, "x.lock", "^branch: .* is not a valid git ref component" },
    { h, "-x", "^branch: .* is not a valid git ref component" },
    { h, "a b", "^branch: .* is not a valid git ref component" },
  }
  for i, c in ipairs(cases) do
    local o = plan(d, "n" .. i)
    local ok, err = pcall(repo.prepare, o, c[1], { name = c[2] })
    t:eq(ok, false, c[1])
    t:match(tostring(type(err) == "table" and err.message or err), c[3], c[3])
    repo.cleanup(o)
  end
  loop.setenv("DEMESNE_REPOSITORY_MAX_BYTES", "10")
  config.load()
  local o = plan(d, "huge")
  local ok, err = pcall(repo.prepare, o, h)
  t:eq(ok, false)
  t:match(tostring(err.message), "^repository: .* more than repository_max_bytes", "a huge repository")
  repo.cleanup(o)
  t:eq(snapshot(h), before, "the host repository is as it was")
  t:eq(fs.lstat(d .. "/HOOK-RAN"), nil)
  teardown(d)
end

return tests
