-- A host repository in, a branch out (docs/how-to/hand-back-a-branch.md).
--
-- In: git on the HOST, in the user's own repository (trusted), makes a bundle of HEAD (and,
-- with include_uncommitted, of one commit by demesne holding the work tree's changes) in a
-- private scratch repository under the state folder whose objects borrow the host's
-- (objects/info/alternates): nothing is written to the host repository. The bundle and
-- a small script are mounted read-only at /.demesne/repo; the script clones the bundle to
-- /workspace/<basename> on the run's branch, with no remote, runs the command there, and at
-- the end commits what was left uncommitted and writes a bundle of the branch to
-- /out/demesne-branch.bundle. With a `depth` (a bundle cannot carry a shallow history) the
-- host makes a shallow bare clone of the scratch repository instead (in/repo.git, its own
-- config written by demesne, no remote), and the script clones that with --depth.
--
-- Out: the bundle is hostile. The host copies it out of the output folder confined and
-- bounded (as sandbox_download does), checks it with `git bundle list-heads` (exactly one
-- head: the run's branch) and `git bundle verify` in the host repository, fetches its
-- objects with fsck checks on and no ref written, then creates refs/heads/<branch> with
-- `git update-ref <ref> <new> <old>` (old = none, or this run's own previous head for a
-- continue): never an overwrite of a ref that is not the run's. The work tree, the index,
-- HEAD, the config and every other ref stay as they were. git on the host never runs in a
-- repository the sandbox wrote; only on the bundle FILE, from the host repository.
--
-- Layout: <state_dir>/repo/<run id>/scratch.git  (private scratch repository)
--         <state_dir>/repo/<run id>/in/           (mounted at /.demesne/repo: in.bundle or, with a
--                                                  depth, repo.git; run.sh, settings)
--         <state_dir>/repo/<run id>/back.bundle   (the copy of what the sandbox handed back)
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local paths = require("demesne.paths")
local util = require("demesne.util")
local git = require("demesne.repo.git")

local repo = {}

local fail = errors.raise

--- Where the repository's files are inside the sandbox.
repo.MOUNT = "/.demesne/repo"
--- The bundle the sandbox hands back, relative to /out.
repo.BUNDLE = "demesne-branch.bundle"
--- The prefix of every branch demesne makes.
repo.PREFIX = "demesne/"

local IDENTITY = { GIT_AUTHOR_NAME = "demesne", GIT_AUTHOR_EMAIL = "demesne@localhost",
  GIT_COMMITTER_NAME = "demesne", GIT_COMMITTER_EMAIL = "demesne@localhost" }
local COMMITS_MAX = 200 -- commits listed in a result
--- The largest `depth` taken (commits); past it, leave depth out for the whole history.
repo.DEPTH_MAX = 1000000

local function timeout_ms() return math.floor(config.get("repository_timeout_seconds") * 1000) end

-- git in the host repository `top` (its own config: the user's, trusted).
local function host_git(top, args, opts)
  opts = opts or {}
  opts.cwd, opts.timeout_ms = top, opts.timeout_ms or timeout_ms()
  return git.ok(args, opts)
end

-- git in a private scratch repository (a bare one, GIT_DIR).
local function scratch_git(dir, args, env)
  env = env or {}
  env.GIT_DIR = dir
  return git.ok(args, { cwd = dir, env = env, timeout_ms = timeout_ms() })
end

--- Checks a branch name component (the part after demesne/): letters, digits, '.', '_', '-'
--- and '/' between parts, as git check-ref-format allows. Returns the name or fails naming
--- `field`.
---@param field string
---@param name string
---@return string
function repo.check_name(field, name)
  if type(name) ~= "string" or name == "" then fail(field .. ": must be a non-empty string") end
  if #name > 200 then fail(("%s: %d characters is more than the 200 a branch name may have here"):format(field, #name)) end
  local bad = not name:match("^[A-Za-z0-9._/-]+$") or name:find("//", 1, true) or name:find("%.%.")
    or name:match("^[/.-]") or name:match("[/.]$") or name:find("/%.") or name:find("%.lock/")
    or name:match("%.lock$") or name:find("@{", 1, true)
  if bad then
    fail(("%s: %q is not a valid git ref component (letters, digits, '.', '_', '-', '/' between parts; no '..', "
      .. "no part starting with '.' or ending in '.lock')"):format(field, name))
  end
  return name
end

--- Checks a `depth` (the commits of history the clone holds): nil (the whole history) or an
--- integer from 1 to repo.DEPTH_MAX. Returns it as an integer or fails naming `field`.
---@param field string
---@param depth any
---@return integer|nil
function repo.check_depth(field, depth)
  if depth == nil then return nil end
  if math.type(depth) == "float" and depth == math.floor(depth) and math.abs(depth) < 2 ^ 53 then
    depth = math.tointeger(depth)
  end
  if math.type(depth) ~= "integer" then
    fail(("%s: must be a whole number of commits, at least 1 (got %s)"):format(field, tostring(depth)))
  end
  if depth < 1 then fail(("%s: must be at least 1 commit (got %d); leave it out for the whole history"):format(field, depth)) end
  if depth > repo.DEPTH_MAX then
    fail(("%s: %d is more than the %d commits a depth may be; leave it out for the whole history"):format(field, depth,
      repo.DEPTH_MAX))
  end
  return depth
end

-- A repository in the output root or the state folder is one a sandbox could have written
-- (its .git/config, hooks, filters): git on the host never runs there.
local function refuse_sandbox_written(field, path, real)
  for _, name in ipairs({ "output_root", "state_dir" }) do
    local root = fs.realpath(config.get(name))
    if root and paths.within(real, root) then
      fail(("%s: %s is inside demesne's %s (%s), which sandboxes write; git on the host never runs in a "
        .. "repository a sandbox could have written. Clone it elsewhere first"):format(field, path, name, root))
    end
  end
end

--- Looks at a host repository (read only): resolves `path` inside the allowed paths, finds
--- its work tree, and refuses what demesne does not take (not a repository, bare, no commit
--- yet, too large; a shallow clone without a `depth`, or whose HEAD has fewer first-parent
--- commits than `depth`). Returns {top, common (the git folder holding objects), head,
--- symbolic (the branch HEAD is on, or nil when detached), format, shallow (the path of its
--- shallow file when it is a shallow clone), notes = {string…}}. Fails naming `field` (or
--- `depth`) and the reason.
---@param field string
---@param path string
---@param depth integer|nil  the depth asked for (repo.check_depth), nil for the whole history
---@return table info
function repo.inspect(field, path, depth)
  local real, err = paths.check(field, path, "directory")
  if not real then fail(err) end
  refuse_sandbox_written(field, path, real)
  local r = git.run({ "rev-parse", "--is-bare-repository", "--is-inside-work-tree" },
    { cwd = real, timeout_ms = timeout_ms() })
  if not r or r.status ~= 0 then
    fail(("%s: %s is not a git repository (git rev-parse: %s)"):format(field, path,
      r and (r.err:gsub("%s+$", "")) or "git could not run"))
  end
  local bare, inside = r.out:match("^(%S+)\n(%S+)")
  if bare == "true" or inside ~= "true" then
    fail(("%s: %s is a bare repository or a git folder, not a work tree; give the path of a checked-out work "
      .. "tree"):format(field, path))
  end
  local top = assert(host_git(real, { "rev-parse", "--show-toplevel" }))
  local ok2, rerr = paths.check(field, top, "directory")
  if not ok2 then fail(("%s: the work tree %s holds %s, and %s"):format(field, top, path, rerr)) end
  refuse_sandbox_written(field, path, top)
  local notes = {}
  if top ~= real then notes[#notes + 1] = ("%s is inside the work tree %s: the whole repository is used"):format(path, top) end
  local head = host_git(top, { "rev-parse", "--verify", "--quiet", "HEAD^{commit}" })
  if not head or head == "" then
    fail(("%s: %s has no commit yet (HEAD is unborn); commit something first"):format(field, top))
  end
  local shallow
  if host_git(top, { "rev-parse", "--is-shallow-repository" }) == "true" then
    -- a shallow clone is taken with a depth its history reaches (along HEAD's first parents)
    if not depth then
      fail(("%s: %s is a shallow clone, whose whole history demesne cannot hand over; give a depth (commits of "
        .. "history), or run `git fetch --unshallow` in it first"):format(field, top))
    end
    local have = tonumber(host_git(top, { "rev-list", "--first-parent", "--count", "--max-count=" .. tostring(depth),
      head }) or "") or 0
    if have < depth then
      fail(("depth: %s is a shallow clone whose HEAD has %d commit(s) of history (first parents), fewer than the %d "
        .. "asked for; give a depth of at most %d, or run `git fetch --unshallow` in it first"):format(top, have, depth,
        have, have))
    end
    shallow = assert(host_git(top, { "rev-parse", "--path-format=absolute", "--git-path", "shallow" }))
    notes[#notes + 1] = ("%s is a shallow clone: the clone's history is cut where it is cut there"):format(top)
  end
  local symbolic = host_git(top, { "symbolic-ref", "--quiet", "HEAD" })
  if not symbolic then notes[#notes + 1] = ("HEAD is detached at %s: the branch starts there"):format(head:sub(1, 12)) end
  local common = assert(host_git(top, { "rev-parse", "--path-format=absolute", "--git-common-dir" }))
  local objects = assert(host_git(top, { "rev-parse", "--path-format=absolute", "--git-path", "objects" }))
  local format = host_git(top, { "rev-parse", "--show-object-format" }) or "sha1"
  -- the repository's size on disk, before anything is bundled
  local counts = host_git(top, { "count-objects", "-v" }) or ""
  local kib = 0
  for k, v in counts:gmatch("([%w-]+): (%d+)") do
    if k == "size" or k == "size-pack" then kib = kib + tonumber(v) end
  end
  local max = config.get("repository_max_bytes")
  if kib * 1024 > max then
    fail(("%s: %s holds %d MiB of objects, more than repository_max_bytes (%d MiB, in the configuration) "
      .. "allows"):format(field, top, kib // 1024, max // (1024 * 1024)), "EFBIG")
  end
  local subs = host_git(top, { "config", "--blob", head .. ":.gitmodules", "--get-regexp", "^submodule\\..*\\.path$" })
  if subs and subs ~= "" then
    local list = {}
    for p in subs:gmatch("%S+%s+([^\n]+)") do list[#list + 1] = p end
    notes[#notes + 1] = ("submodules are left out (their folders are empty in the clone): %s"):format(table.concat(list, ", "))
  end
  return { top = top, common = common, objects = objects, head = head, symbolic = symbolic, format = format,
    shallow = shallow, notes = notes }
end

-- The script the sandbox runs (mounted at /.demesne/repo/run.sh): clone, run "$@" in the
-- clone, hand back. Its settings come in variables: DEMESNE_REPO_PATH, DEMESNE_REPO_BRANCH,
-- DEMESNE_REPO_HOST_HEAD.
local RUN_SH = [=[#!/bin/sh
# demesne: the run's repository (lua/repo/init.lua). `run.sh CMD…` clones the bundle, runs
# the command in the clone (a shallow clone of repo.git with a depth), then hands the
# branch back as /out/demesne-branch.bundle;
# `run.sh --setup` only clones, `run.sh --handback` only hands back (a persistent sandbox).
# The settings file is the host's (read-only here).
. /.demesne/repo/settings
W="$DEMESNE_REPO_PATH"; B="$DEMESNE_REPO_BRANCH"; H="$DEMESNE_REPO_HOST_HEAD"; X="${DEMESNE_REPO_CONTEXT:-}"
S="${DEMESNE_REPO_SOURCE:-}"; D="${DEMESNE_REPO_DEPTH:-}"
say() { printf 'demesne: %s\n' "$*" >&2; }
git() { command git -c core.fsmonitor=false -c core.hooksPath=/dev/null "$@"; }
handback() {
  trap '' TERM INT
  cd "$W" 2>/dev/null || { say "$W is gone: nothing to hand back"; return 1; }
  # the agent's context file, linked into the clone by the CLI's start script, is not work
  if [ -n "$X" ] && [ -L "$X" ] && case "$(readlink "$X")" in /.demesne/*) true;; *) false;; esac; then
    rm -f "$X"; git checkout -q -- "$X" 2>/dev/null || true
  fi
  if [ "$(git symbolic-ref -q HEAD 2>/dev/null)" = "refs/heads/$B" ]; then
    git add -A >/dev/null 2>&1
    if ! git diff --cached --quiet 2>/dev/null; then
      git -c user.name=demesne -c user.email=demesne@localhost -c commit.gpgSign=false commit -q --no-verify \
        -m "demesne: work left uncommitted at the end of run $DEMESNE_RUN_ID" || say "the uncommitted work could not be committed"
    fi
  else
    say "HEAD is not on $B at the end: work outside that branch is not handed back"
  fi
  if [ -z "$(git rev-list -n 1 "refs/heads/$B" "^$H" 2>/dev/null)" ]; then
    rm -f /out/demesne-branch.bundle; say "no new commit on $B: nothing to hand back"; return 0
  fi
  rm -f /out/.demesne-branch.bundle.tmp
  git bundle create -q /out/.demesne-branch.bundle.tmp "refs/heads/$B" "^$H" 2>&1 >/dev/null | sed 's/^/demesne: /' >&2
  mv -f /out/.demesne-branch.bundle.tmp /out/demesne-branch.bundle || say "the bundle could not be written"
}
setup() {
  mkdir -p "$(dirname "$W")"
  if [ -d "$W/.git" ]; then
    say "the clone at $W is there already (a continued run): it is used as it is"; return 0
  fi
  if [ -n "$S" ]; then
    # a child in a tree: a clone of the parent's clone (in the shared /workspace) at its HEAD
    if ! git clone -q --no-local --no-hardlinks "$S" "$W" >&2 || ! (cd "$W" && git checkout -q -b "$B"); then
      say "could not clone $S"; return 125
    fi
    (cd "$W" && git rev-parse HEAD) > /out/demesne-branch.base 2>/dev/null
  elif [ -n "$D" ]; then
    # the host's shallow bare clone (read-only here, owned by the host's user: upload-pack
    # is told it is safe); a bundle cannot carry a shallow history
    R=/.demesne/repo/repo.git
    if ! git clone -q --depth "$D" -b "$B" -u "git -c safe.directory=$R upload-pack" "file://$R" "$W" >&2; then
      say "could not clone the repository"; return 125
    fi
  elif ! git clone -q -b "$B" /.demesne/repo/in.bundle "$W" >&2; then say "could not clone the repository"; return 125; fi
  (cd "$W" && git remote remove origin && git config user.name "demesne agent" \
    && git config user.email agent@demesne.invalid \
    && if [ -n "$X" ] && ! git ls-files --error-unmatch -- "$X" >/dev/null 2>&1; then echo "/$X" >> .git/info/exclude; fi) \
    >&2 || say "could not set up the clone"
}
case "${1:-}" in
  --setup) setup; exit $? ;;
  --handback) handback; exit $? ;;
esac
trap 'stopped=1' TERM INT
stopped=0
setup || exit 125
(unset -f git; cd "$W" && exec "$@")
rc=$?
handback
exit $rc
]=]

-- With a depth: a shallow bare clone of the scratch repository's one branch at in/repo.git
-- (host git, the scratch repository its only source), `depth` commits deep, readable by the
-- sandbox, with a config of demesne's own (no remote: the scratch path stays on the host),
-- bounded by repository_max_bytes.
local function shallow_copy(field, info, scratch, dir, branch, depth)
  local into = dir .. "/in/repo.git"
  local ok, err = git.ok({ "-c", "core.sharedRepository=0644", "clone", "-q", "--bare", "--template=", "--depth",
    tostring(depth), "--single-branch", "-b", branch, "file://" .. scratch, into }, { cwd = dir, timeout_ms = timeout_ms() })
  if not ok then fail(("%s: could not make a clone of %s %d commit(s) deep: %s"):format(field, info.top, depth, err)) end
  local conf = info.format == "sha1" and "[core]\n\trepositoryformatversion = 0\n\tbare = true\n"
    or ("[core]\n\trepositoryformatversion = 1\n\tbare = true\n[extensions]\n\tobjectformat = %s\n"):format(info.format)
  assert(fs.write_atomic(into .. "/config", conf, 420))
  local counts = scratch_git(into, { "count-objects", "-v" }) or ""
  local kib = 0
  for k, v in counts:gmatch("([%w-]+): (%d+)") do
    if k == "size" or k == "size-pack" then kib = kib + tonumber(v) end
  end
  local max = config.get("repository_max_bytes")
  if kib * 1024 > max then
    fail(("%s: the clone of %s %d commit(s) deep is %d MiB, more than repository_max_bytes (%d MiB) allows"):format(field,
      info.top, depth, kib // 1024, max // (1024 * 1024)), "EFBIG")
  end
end

-- Saves a plan's repository (repo.save) and wraps its command so that it runs in the clone
-- (/.demesne/repo/run.sh CMD…, from /workspace), with the repository's variables. Returns o.repo.
local function wrap(o)
  repo.save(o)
  local argv = { "/bin/sh", repo.MOUNT .. "/run.sh" }
  for _, a in ipairs(o.argv or { "/bin/sh", "-c", o.command }) do argv[#argv + 1] = a end
  o.argv = argv
  o.cwd = "/workspace"
  repo.add_env(o)
  return o.repo
end

--- Plans a run on a host repository: checks it (repo.inspect), bundles HEAD (and the
--- uncommitted work) into the plan's private scratch folder, mounts it at /.demesne/repo
--- and wraps the plan's command so that it runs in the clone at /workspace/<basename> and
--- hands the branch back at the end. Sets o.repo = {host, field, base, host_head, branch,
--- ref, path, notes, dir}; o.argv (wrapped), o.cwd, o.env. The sandbox spec mounts
--- repo.mount_of(o) (not o.mounts: a tree's children inherit those). Fails naming `field`.
--- opts: include_uncommitted (boolean), name (the branch component after demesne/,
--- default the run id), name_field (for messages), expect (a continue: the branch's
--- current head, which it fast-forwards), base and host_head (a continue: the start of the
--- run it continues, which its kept clone holds; taken when the host has them), depth
--- (commits of the host's history the clone holds, repo.check_depth; nil: all of it; the
--- commit of include_uncommitted comes on top). Runs inside a task.
---@param o table  the plan (sandbox.prepare), with run_id, mounts, env; argv or command
---@param path string  the host path
---@param opts table|nil
---@return table o.repo
function repo.prepare(o, path, opts)
  opts = opts or {}
  if type(path) == "table" then return repo.prepare_child(o, path, opts) end
  local field = opts.field or "repository"
  local name = repo.check_name(opts.name_field or "branch", opts.name or o.run_id)
  local depth = repo.check_depth("depth", opts.depth)
  local info = repo.inspect(field, path, depth)
  local branch = repo.PREFIX .. name
  local ref = "refs/heads/" .. branch
  if not host_git(info.top, { "check-ref-format", ref }) then
    fail(("%s: %q is not a valid git ref name"):format(opts.name_field or "branch", branch))
  end
  local cur = host_git(info.top, { "rev-parse", "--verify", "--quiet", ref .. "^{commit}" })
  if cur and cur ~= "" and cur ~= opts.expect then
    fail(("%s: the branch %s already exists in %s (at %s) and is not this run's; choose another name or delete it "
      .. "(demesne branches --delete)"):format(opts.name_field or "branch", branch, info.top, cur:sub(1, 12)))
  end
  local dir = config.get("state_dir") .. "/repo/" .. o.run_id
  assert(fs.mkdir_p(dir .. "/in", 448)) -- 0700; the files in it are read by the sandbox's root
  assert(fs.chmod(dir .. "/in", 493))
  local scratch = dir .. "/scratch.git"
  local ok, err = git.ok({ "init", "-q", "--bare", "--template=", "--object-format=" .. info.format, scratch },
    { cwd = dir, timeout_ms = timeout_ms() })
  if not ok then fail(("%s: could not make the scratch repository: %s"):format(field, err)) end
  assert(fs.mkdir_p(scratch .. "/objects/info", 493))
  assert(fs.write_atomic(scratch .. "/objects/info/alternates", info.objects .. "\n"))
  if info.shallow then
    -- the host's own record of where its history is cut, so the scratch repository's walk stops there too
    local cut = fs.read_file(info.shallow, 0, 64 * 1024 * 1024)
    if not cut then fail(("%s: the shallow file of %s cannot be read"):format(field, info.top)) end
    assert(fs.write_atomic(scratch .. "/shallow", cut, 420))
  end
  local base = info.head
  if opts.include_uncommitted then
    -- the work tree's changes as one commit by demesne, its objects in the scratch repository
    -- only: a temporary index, the host's own config (filters, excludes), no write to its .git
    local env = { GIT_INDEX_FILE = dir .. "/index", GIT_OBJECT_DIRECTORY = scratch .. "/objects",
      GIT_ALTERNATE_OBJECT_DIRECTORIES = info.objects }
    for k, v in pairs(IDENTITY) do env[k] = v end
    local step, serr = host_git(info.top, { "read-tree", info.head }, { env = env })
    if step then step, serr = host_git(info.top, { "add", "-A", "--", "." }, { env = env }) end
    local tree
    if step then tree, serr = host_git(info.top, { "write-tree" }, { env = env }) end
    if not tree then fail(("include_uncommitted: the work tree's changes could not be read: %s"):format(tostring(serr))) end
    local head_tree = host_git(info.top, { "rev-parse", info.head .. "^{tree}" })
    if tree ~= head_tree then
      base, serr = host_git(info.top, { "commit-tree", tree, "-p", info.head, "-m",
        "demesne: uncommitted changes of the host's work tree at the start of run " .. o.run_id }, { env = env })
      if not base then fail("include_uncommitted: " .. tostring(serr)) end
    else
      info.notes[#info.notes + 1] = "include_uncommitted: the work tree had no uncommitted changes"
    end
  end
  local step, serr = scratch_git(scratch, { "update-ref", ref, base })
  if not step then fail(("%s: could not bundle %s: %s"):format(field, info.top, tostring(serr))) end
  if depth then
    shallow_copy(field, info, scratch, dir, branch, base ~= info.head and depth + 1 or depth)
  else
    step, serr = scratch_git(scratch, { "bundle", "create", "-q", dir .. "/in/in.bundle", ref })
    if not step then fail(("%s: could not bundle %s: %s"):format(field, info.top, tostring(serr))) end
    local st = fs.stat(dir .. "/in/in.bundle")
    local max = config.get("repository_max_bytes")
    if not st or st.size > max then
      fail(("%s: the bundle of %s is %d MiB, more than repository_max_bytes (%d MiB) allows"):format(field, info.top,
        (st and st.size or 0) // (1024 * 1024), max // (1024 * 1024)), "EFBIG")
    end
    assert(fs.chmod(dir .. "/in/in.bundle", 420)) -- 0644
  end
  assert(fs.write_atomic(dir .. "/in/run.sh", RUN_SH, 420))
  local basename = info.top:match("([^/]+)$") or "repo"
  if basename:sub(1, 1) == "." then basename = "repo" end
  local inside = "/workspace/" .. basename
  -- a continue hands back against the start of the run it continues (its kept clone holds
  -- those commits, not a HEAD the host moved to since), when the host still has them
  local start, host_head = base, info.head
  if opts.host_head and host_git(info.top, { "cat-file", "-e", opts.host_head .. "^{commit}" })
    and host_git(info.top, { "cat-file", "-e", (opts.base or opts.host_head) .. "^{commit}" }) then
    start, host_head = opts.base or opts.host_head, opts.host_head
  end
  o.repo = { host = info.top, field = field, base = start, host_head = host_head, branch = branch, ref = ref,
    path = inside, notes = info.notes, dir = dir, expect = opts.expect, name = name, objects = info.objects,
    depth = depth and (base ~= info.head and depth + 1 or depth) or nil }
  o.repo.context = opts.context
  return wrap(o)
end

local SAVED = { "host", "field", "base", "host_head", "branch", "ref", "path", "notes", "dir", "expect", "name",
  "objects", "context", "source", "depth" }

--- Writes a run's repository plan where the sandbox cannot reach it (<dir>/plan.json) and
--- the settings run.sh reads (<dir>/in/settings, mounted read-only): a persistent sandbox's
--- later hand-backs (and a continue) find them with repo.load.
---@param o table  a plan with o.repo
function repo.save(o)
  local g = o.repo
  local keep = {}
  for _, k in ipairs(SAVED) do keep[k] = g[k] end
  keep.notes = json.array(g.notes or {})
  assert(fs.write_atomic(g.dir .. "/plan.json", json.encode(keep) .. "\n", 384)) -- 0600
  local lines = {}
  for k, v in pairs({ DEMESNE_REPO_PATH = g.path, DEMESNE_REPO_BRANCH = g.branch, DEMESNE_REPO_HOST_HEAD = g.host_head,
    DEMESNE_REPO_BASE = g.base, DEMESNE_REPO_CONTEXT = g.context or "", DEMESNE_REPO_SOURCE = g.source or "",
    DEMESNE_REPO_DEPTH = g.depth and tostring(math.tointeger(g.depth)) or "" }) do
    lines[#lines + 1] = k .. "=" .. util.sh_quote(v)
  end
  table.sort(lines)
  assert(fs.write_atomic(g.dir .. "/in/settings", table.concat(lines, "\n") .. "\n", 420)) -- 0644
end

--- The repository plan of run `run_id` saved by repo.save (from the state folder, the
--- host's own), or nil when the run has none.
---@param run_id string
---@return table|nil repo  the o.repo fields
function repo.load(run_id)
  if type(run_id) ~= "string" or not run_id:match("^[%w%-]+$") then return nil end
  local text = fs.read_file(config.get("state_dir") .. "/repo/" .. run_id .. "/plan.json", 0, 1024 * 1024)
  local ok, g = pcall(json.decode, text or "")
  if not ok or type(g) ~= "table" or type(g.dir) ~= "string" then return nil end
  return g
end

--- Removes the repository folder of run `run_id` (see repo.cleanup), if it has one.
---@param run_id string
function repo.forget(run_id)
  if type(run_id) == "string" and run_id:match("^[%w%-]+$") then
    fs.remove_tree(config.get("state_dir") .. "/repo/" .. run_id)
  end
end

--- Plans a tree child's repository (`repository: true` from inside a sandbox; lua/tree
--- passes spec = {parent = run id, name = child name}): a clone, made inside the child, of
--- the parent's clone in the shared /workspace at its current commit, at
--- <parent's path>--<name>, on branch <parent's branch>--<name> (git cannot hold a branch
--- and branches below it under one name). It comes back to the host repository of the
--- tree's root like any other. The host runs no git in the parent's clone (the sandbox's).
--- Fails naming `repository` when the parent has no repository. A continue of a child
--- (lua/agent/continue.lua) passes the spec of the run it continues, and opts.expect and
--- opts.base: the same clone, the same branch fast-forwarded.
---@param o table  the plan
---@param spec {parent: string, name: string}
---@param opts table|nil  context (the agent's context file name), expect, base
---@return table o.repo
function repo.prepare_child(o, spec, opts)
  opts = opts or {}
  local p = repo.load(spec.parent)
  if not p then fail("repository: the calling sandbox was not given a repository, so it has none to clone") end
  local name = repo.check_name("name", p.name .. "--" .. tostring(spec.name))
  local branch = repo.PREFIX .. name
  local ref = "refs/heads/" .. branch
  local cur = host_git(p.host, { "rev-parse", "--verify", "--quiet", ref .. "^{commit}" })
  if cur and cur ~= "" and cur ~= opts.expect then
    fail(("name: the branch %s already exists in %s and is not this run's; choose another name"):format(branch, p.host))
  end
  local dir = config.get("state_dir") .. "/repo/" .. o.run_id
  assert(fs.mkdir_p(dir .. "/in", 448))
  assert(fs.chmod(dir .. "/in", 493))
  assert(fs.write_atomic(dir .. "/in/run.sh", RUN_SH, 420))
  local base = p.host_head
  if opts.base and host_git(p.host, { "cat-file", "-e", opts.base .. "^{commit}" }) then base = opts.base end
  o.repo = { host = p.host, field = "repository", base = base, host_head = p.host_head, branch = branch,
    ref = ref, path = p.path .. "--" .. spec.name, notes = {}, dir = dir, name = name, objects = p.objects,
    source = p.path, context = opts.context, expect = opts.expect }
  return wrap(o)
end

--- The read-only mount of a plan's repository folder (run.sh, settings, the bundle) at
--- /.demesne/repo, or nil: {host, target}.
---@param o table  a plan
---@return table|nil
function repo.mount_of(o)
  if type(o.repo) == "table" and o.repo.dir then return { host = o.repo.dir .. "/in", target = repo.MOUNT } end
  return nil
end

--- Adds the repository's variables to a plan's environment list (o.env, "K=V" strings):
--- DEMESNE_REPO_PATH, DEMESNE_REPO_BRANCH, DEMESNE_REPO_HOST_HEAD, DEMESNE_REPO_BASE, and
--- DEMESNE_REPO_CONTEXT (o.repo.context: an agent's context file name, linked into the
--- clone by its CLI's start script and never handed back).
---@param o table  a plan with o.repo
function repo.add_env(o)
  if not o.repo or not o.env then return end
  local vars = { DEMESNE_REPO_PATH = o.repo.path, DEMESNE_REPO_BRANCH = o.repo.branch,
    DEMESNE_REPO_HOST_HEAD = o.repo.host_head, DEMESNE_REPO_BASE = o.repo.base, DEMESNE_REPO_CONTEXT = o.repo.context }
  local keep = {}
  for _, kv in ipairs(o.env) do
    if not vars[kv:match("^([^=]*)")] then keep[#keep + 1] = kv end
  end
  for k, v in pairs(vars) do keep[#keep + 1] = k .. "=" .. v end
  for i = 1, math.max(#o.env, #keep) do o.env[i] = keep[i] end
end

-- Copies the bundle the sandbox wrote (relative `rel` in the output folder, hostile) to the
-- private path `to`: opened confined (no link, no FIFO), at most `max` bytes. Returns true,
-- false when there is none, or fails.
local function copy_out(output_dir, rel, to, max)
  local out, oerr = fs.opendir(output_dir)
  if not out then fail("the output folder cannot be opened: " .. tostring(oerr)) end
  local _o <close> = out
  local f, err, code = out:open(rel, "r")
  if not f and code == "ENOENT" then return false end
  if not f then fail(("/out/%s: %s"):format(rel, tostring(err))) end
  local _f <close> = f
  local size = f:size() or 0
  if size > max then
    fail(("/out/%s is %d MiB, more than repository_max_bytes (%d MiB) allows"):format(rel, size // 1048576, max // 1048576),
      "EFBIG")
  end
  os.remove(to)
  local w = assert(fs.open(to, "wx", 384)) -- 0600
  local _w <close> = w
  local n = 0
  while true do
    local chunk, rerr = f:read(1024 * 1024)
    if not chunk then fail(("/out/%s: %s"):format(rel, tostring(rerr))) end
    if chunk == "" then break end
    n = n + #chunk
    if n > max then fail(("/out/%s grew past repository_max_bytes while it was copied"):format(rel), "EFBIG") end
    assert(w:write(chunk))
    async.sleep(0) -- a large bundle does not hold the loop
  end
  return true
end

-- The bundle's heads: {ref = oid}, in the order listed; or fails.
local function bundle_heads(top, file)
  local out, err = host_git(top, { "bundle", "list-heads", file }, { max_out = 64 * 1024 })
  if not out then fail("the bundle the sandbox handed back is not a valid git bundle: " .. tostring(err), "EBUNDLE") end
  local heads = {}
  for line in out:gmatch("[^\n]+") do
    local oid, name = line:match("^(%x+) (%S+)$")
    if not oid then fail("the bundle the sandbox handed back lists a malformed head: " .. line:sub(1, 200), "EBUNDLE") end
    heads[#heads + 1] = { oid = oid, name = name }
  end
  return heads
end

-- Checks every object of a handed-back bundle before any reaches the host repository:
-- its pack is indexed with `git index-pack --strict` (fsck's checks, links included) into a
-- quarantine object folder of the scratch area, the host's objects borrowed as alternates
-- for the thin pack's bases. (git before 2.43 does not apply fetch.fsckObjects to a bundle.)
local function check_objects(g, file)
  local f = assert(fs.open(file, "r"))
  local head = f:read(64 * 1024) or ""
  f:close()
  local stop = head:find("\n\n", 1, true)
  if not stop then fail("the bundle the sandbox handed back has no end to its header", "EBUNDLE") end
  local q = g.dir .. "/quarantine"
  fs.remove_tree(q)
  assert(fs.mkdir_p(q .. "/pack", 448))
  local ok, err = git.ok({ "index-pack", "--strict", "--fix-thin", "--stdin" }, { cwd = g.host,
    timeout_ms = timeout_ms(), stdin = { path = file, offset = stop + 1 },
    env = { GIT_OBJECT_DIRECTORY = q, GIT_ALTERNATE_OBJECT_DIRECTORIES = g.objects } })
  fs.remove_tree(q)
  if not ok then fail("the objects of the bundle the sandbox handed back failed the checks: " .. err, "EBUNDLE") end
end

-- A tree child's base: the parent's commit it cloned, as its run.sh recorded it in
-- /out/demesne-branch.base (the sandbox's word: taken only when it names a commit that is an
-- ancestor of the handed-back head; else the root's host HEAD stays the base).
local function child_base(o, r)
  local out = fs.opendir(o.output_dir)
  local text = out and out:read("demesne-branch.base", 200)
  if out then out:close() end
  local oid = type(text) == "string" and text:match("^(%x+)%s*$")
  if not oid or (#oid ~= 40 and #oid ~= 64) then return end
  local anc = git.run({ "merge-base", "--is-ancestor", oid, r.head }, { cwd = o.repo.host, timeout_ms = timeout_ms() })
  if anc and anc.status == 0 then r.base = oid end
end

--- The branch fields of a result from the host repository (after the fetch): commits
--- base..head (hash, subject; at most 200), the diffstat, whether base is an ancestor.
---@param top string
---@param r table  {branch, base, head}
---@return table r
local function describe(top, r)
  local log = host_git(top, { "log", "--no-decorate", "--no-show-signature", "--format=%H%x09%s", "-n",
    tostring(COMMITS_MAX), r.base .. ".." .. r.head, "--" }) or ""
  r.commits = {}
  for h, s in log:gmatch("(%x+)\t([^\n]*)") do r.commits[#r.commits + 1] = { hash = h, subject = s } end
  local stat = host_git(top, { "diff", "--no-ext-diff", "--no-textconv", "--no-renames", "--shortstat", r.base, r.head,
    "--" }) or ""
  r.diffstat = { files = tonumber(stat:match("(%d+) files? changed")) or 0,
    insertions = tonumber(stat:match("(%d+) insertions?")) or 0, deletions = tonumber(stat:match("(%d+) deletions?")) or 0 }
  local anc = git.run({ "merge-base", "--is-ancestor", r.base, r.head }, { cwd = top, timeout_ms = timeout_ms() })
  r.base_is_ancestor = anc ~= nil and anc.status == 0
  if not r.base_is_ancestor then
    r.notes[#r.notes + 1] = "the base is no longer an ancestor of the branch: the run rewrote history"
  end
  return r
end

--- Takes a finished run's work back into the host repository: copies /out/demesne-branch.bundle
--- out confined and bounded, checks it (one head, the run's branch; git bundle verify),
--- fetches its objects with fsck checks and no ref, then creates (or, for a continue,
--- fast-forwards) refs/heads/<branch> with a compare-and-swap update. Never fails: returns
--- {branch, base, head, commits = {{hash, subject}}, diffstat = {files, insertions,
--- deletions}, base_is_ancestor, bundle = "/out/demesne-branch.bundle", repository, notes}
--- or, when nothing could be taken back, {branch, base, repository, error, notes} (error
--- says why; the host repository is unchanged). `run` (optional) is the result the branch
--- belongs to (unused now; for callers that continue a run).
---@param o table  a plan with o.repo and o.output_dir
---@param run table|nil
---@return table branch
function repo.hand_back(o, run)
  local _ = run
  local g = o.repo
  local r = { branch = g.branch, base = g.base, host_head = g.host_head, repository = g.host, notes = {} }
  for _, n in ipairs(g.notes or {}) do r.notes[#r.notes + 1] = n end
  local ok, err = pcall(function()
    local file = g.dir .. "/back.bundle"
    local max = config.get("repository_max_bytes")
    if not copy_out(o.output_dir, repo.BUNDLE, file, max) then
      r.head = g.expect or nil
      r.commits, r.diffstat = {}, { files = 0, insertions = 0, deletions = 0 }
      r.notes[#r.notes + 1] = "the run made no commit and left nothing uncommitted: no branch was made (see stderr.log)"
      return
    end
    local heads = bundle_heads(g.host, file)
    if #heads ~= 1 or heads[1].name ~= g.ref then
      local names = {}
      for _, h in ipairs(heads) do names[#names + 1] = h.name end
      fail(("the bundle the sandbox handed back must name exactly one ref, %s; it names %s"):format(g.ref,
        #names > 0 and table.concat(names, ", ") or "none"), "EBUNDLE")
    end
    local head = heads[1].oid
    local v, verr = host_git(g.host, { "bundle", "verify", "-q", file })
    if not v then fail("the bundle the sandbox handed back does not verify against the host repository: " .. verr, "EBUNDLE") end
    check_objects(g, file)
    -- objects only (no ref, no FETCH_HEAD), checked by fsck; the ref is written below
    local f, ferr = host_git(g.host, { "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--no-auto-gc",
      "--no-auto-maintenance", "--recurse-submodules=no", "--no-show-forced-updates", file, g.ref })
    if not f then fail("the objects of the bundle the sandbox handed back failed the checks: " .. ferr, "EBUNDLE") end
    local t = host_git(g.host, { "cat-file", "-t", head })
    if t ~= "commit" then fail(("the bundle's head %s is not a commit"):format(head), "EBUNDLE") end
    local old = g.expect or ("0"):rep(#head)
    local u, uerr = host_git(g.host, { "update-ref", "-m", "demesne: run " .. tostring(o.run_id), g.ref, head, old })
    if not u then
      fail(("the branch %s could not be written (it exists and is not this run's, or it moved meanwhile): %s")
        :format(g.branch, uerr), "EEXIST")
    end
    r.head = head
    r.bundle = "/out/" .. repo.BUNDLE
    if g.source then
      child_base(o, r)
      r.repository = nil -- a tree child's result goes to its parent sandbox: no host path in it
    end
    describe(g.host, r)
    g.expect = head -- a later hand-back of the same run (or a continue) fast-forwards it
    pcall(repo.save, o)
  end)
  if not ok then
    r.error = errors.message(err)
    if err == async.CANCELLED then error(err, 0) end
  end
  os.remove(g.dir .. "/back.bundle")
  return r
end

--- Removes a run's private repository folder (the scratch repository and the bundles).
---@param o table  a plan (with or without o.repo)
function repo.cleanup(o)
  if o.repo and o.repo.dir then fs.remove_tree(o.repo.dir) end
end

--- Readable lines of a branch result, for a tool's text answer.
---@param b table  repo.hand_back's result
---@return string
function repo.text(b)
  if b.error then return ("branch: %s not handed back: %s"):format(b.branch, b.error) end
  if not b.head or #(b.commits or {}) == 0 and not b.bundle then
    return ("branch: %s not made (no commit, nothing uncommitted)"):format(b.branch)
  end
  local d = b.diffstat or {}
  return ("branch: %s in %s (%s..%s, %d commit(s), %d file(s) +%d -%d)%s"):format(b.branch, b.repository,
    b.base:sub(1, 12), b.head:sub(1, 12), #b.commits, d.files or 0, d.insertions or 0, d.deletions or 0,
    b.base_is_ancestor == false and " [history rewritten]" or "")
end

--- The outputSchema of a result's `branch` field.
repo.SCHEMA = { type = "object", description = "repository runs: the branch demesne made in the host repository "
  .. "(docs/how-to/hand-back-a-branch.md)", properties = {
    branch = { type = "string", description = "the branch, demesne/<name>" },
    repository = { type = "string", description = "the host repository's work tree" },
    base = { type = "string", description = "the commit the branch started from (with include_uncommitted: demesne's "
      .. "commit of the host's changes)" },
    host_head = { type = "string", description = "the host's HEAD commit when the run started" },
    head = { type = "string", description = "the branch's commit (absent when nothing was handed back)" },
    commits = { type = "array", description = "base..head, newest first (at most 200)",
      items = { type = "object", properties = { hash = { type = "string" }, subject = { type = "string" } } } },
    diffstat = { type = "object", properties = { files = { type = "integer" }, insertions = { type = "integer" },
      deletions = { type = "integer" } } },
    base_is_ancestor = { type = "boolean", description = "false when the run rewrote history (still fetched)" },
    bundle = { type = "string", description = "the bundle in /out it came from" },
    notes = { type = "array", items = { type = "string" } },
    error = { type = "string", description = "why nothing was taken back (the host repository is unchanged)" },
  } }

--- Refuses a call that gives a parameter of repo.params() but no `repository`, naming it.
---@param args table  the tool's arguments
function repo.only_with(args)
  for _, k in ipairs({ "branch", "include_uncommitted", "depth" }) do
    if args[k] ~= nil and args[k] ~= false then fail(k .. ": only with repository") end
  end
end

--- The input parameters every tool that takes a repository adds to its inputSchema.
---@return table<string, table>
function repo.params()
  return {
    repository = { type = "string", minLength = 1, description = "A host git work tree (inside the allowed paths): "
      .. "the sandbox gets a clone at /workspace/<basename> on branch demesne/<branch>, checked out at the host's "
      .. "HEAD, without its config, hooks or remotes; the commits made there (and what is left uncommitted) come "
      .. "back as that branch in the host repository. Nothing else of the host repository is changed." },
    include_uncommitted = { type = "boolean", default = false, description = "With repository: the host work tree's "
      .. "uncommitted changes (tracked and untracked, not ignored) go in too, as a first commit by demesne." },
    branch = { type = "string", minLength = 1, maxLength = 200, description = "With repository: the branch name after "
      .. "demesne/ (default: the run id). Refused when that branch exists." },
    depth = { type = "integer", minimum = 1, maximum = repo.DEPTH_MAX, description = "With repository: the commits of "
      .. "history the clone holds (a shallow clone: `git clone --depth`); left out, the whole history. The commit of "
      .. "include_uncommitted comes on top. A shallow host repository needs a depth its HEAD's history reaches." },
  }
end

return repo
