-- git on the host, as a process off the loop: every call runs `git` with a clean environment
-- (no GIT_DIR, GIT_CONFIG_PARAMETERS or other variable of demesne's own environment reaches
-- it), configuration that stops git from running anything a repository names (hooks,
-- fsmonitor, external diff and textconv drivers, automatic gc), a timeout, and bounded
-- output. The repositories it runs in are the user's own (trusted) and demesne's private
-- scratch repositories under the state folder; never one a sandbox wrote (lua/repo/init.lua).
local proc = require("demesne.proc")

local git = {}

--- Configuration given on every call (`-c`), over whatever the repository or the user's
--- global configuration says: nothing runs, no protocol but the bundle file, objects checked.
git.SAFE = {
  "core.hooksPath=/dev/null", "core.fsmonitor=false", "core.untrackedCache=false",
  "core.sshCommand=false", "core.askPass=", "credential.helper=",
  "transfer.fsckObjects=true", "fetch.fsckObjects=true", "receive.fsckObjects=true",
  "protocol.allow=never", "protocol.file.allow=always",
  "gc.auto=0", "maintenance.auto=false", "fetch.writeCommitGraph=false", "fetch.recurseSubmodules=false",
  "submodule.recurse=false", "diff.external=", "advice.detachedHead=false", "commit.gpgSign=false",
  "tag.gpgSign=false", "core.pager=cat", "safe.bareRepository=all",
}

local OUT_MAX = 4 * 1024 * 1024 -- bytes of stdout kept by default
local ERR_MAX = 2000            -- bytes of the end of stderr kept

-- The environment of every git process: only what git needs, nothing inherited that could
-- point it elsewhere (GIT_DIR, GIT_INDEX_FILE, GIT_CONFIG_*, GIT_EXEC_PATH …).
local function environment(extra)
  local env = {
    "PATH=" .. (os.getenv("PATH") or "/usr/bin:/bin"), "LC_ALL=C", "LANG=C",
    "GIT_TERMINAL_PROMPT=0", "GIT_CONFIG_NOSYSTEM=1", "GIT_OPTIONAL_LOCKS=0", "GIT_NO_REPLACE_OBJECTS=1",
    "GIT_PROTOCOL_FROM_USER=0",
  }
  local home = os.getenv("HOME") -- the user's global configuration (safe.directory, identity) is theirs
  if home then env[#env + 1] = "HOME=" .. home end
  for k, v in pairs(extra or {}) do env[#env + 1] = k .. "=" .. v end
  table.sort(env)
  return env
end

--- Runs `git -c <SAFE>… <args>` and waits for it (inside a task). opts: cwd (string), env
--- (table name -> value, added to the clean environment: GIT_DIR, GIT_INDEX_FILE …),
--- timeout_ms (default 120000; then the process group is killed), max_out (bytes of stdout
--- kept, default 4 MiB; past it the process is killed and the call fails with EFBIG).
--- Returns {status = integer, out = string, err = string (its tail)} whatever the exit
--- status, or nil, message, code when git could not run, timed out (ETIMEDOUT) or wrote too
--- much (EFBIG). opts.stdin = {path, offset}: git's standard input is that file from byte
--- `offset` on (through `tail -c`: no data passes through demesne's loop).
---@param args string[]
---@param opts table|nil
---@return table|nil r, string|nil err, string|nil code
function git.run(args, opts)
  opts = opts or {}
  local argv = {}
  for _, c in ipairs(git.SAFE) do argv[#argv + 1] = "-c"; argv[#argv + 1] = c end
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  local max_out = opts.max_out or OUT_MAX
  local file, pargs = "git", argv
  if opts.stdin then
    file, pargs = "/bin/sh", { "-c", 'o=$1; f=$2; shift 2; tail -c +"$o" -- "$f" | git "$@"', "sh",
      tostring(math.floor(opts.stdin.offset or 0) + 1), opts.stdin.path }
    for _, a in ipairs(argv) do pargs[#pargs + 1] = a end
  end
  local r, e, code = proc.run({ file = file, args = pargs, env = environment(opts.env), cwd = opts.cwd, detached = true,
    timeout_ms = opts.timeout_ms or 120000, max_out = max_out, err_max = ERR_MAX })
  if not r then return nil, "git cannot be run on the host: " .. e, code end
  local what = "git " .. tostring(args[1])
  if r.timed_out then
    return nil, ("%s did not finish within %d s"):format(what, (opts.timeout_ms or 120000) // 1000), "ETIMEDOUT"
  end
  if r.over then return nil, ("%s wrote more than %d bytes"):format(what, max_out), "EFBIG" end
  if r.signal ~= 0 then return nil, ("%s was killed by signal %d"):format(what, r.signal), "EINTR" end
  return { status = r.status, out = r.out, err = r.err }
end

--- As git.run, but a non-zero exit status is a failure too: returns the trimmed stdout, or
--- nil, "<what>: <git's message>", code ("EGIT" for an exit status).
---@param args string[]
---@param opts table|nil
---@return string|nil out, string|nil err, string|nil code
function git.ok(args, opts)
  local r, err, code = git.run(args, opts)
  if not r then return nil, err, code end
  if r.status ~= 0 then
    local msg = (r.err:gsub("%s+$", ""):gsub("\n", "; "))
    return nil, ("git %s failed (status %d): %s"):format(tostring(args[1]), r.status, msg ~= "" and msg or "no message"),
      "EGIT"
  end
  return (r.out:gsub("%s+$", ""))
end

return git
