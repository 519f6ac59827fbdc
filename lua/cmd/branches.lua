-- `demesne branches [REPO] [--delete NAME]... [--prune] [--json]`: the branches demesne made in a
-- host repository (refs/heads/demesne/…, lua/repo), each with the run that made it (from
-- the ref's reflog, "demesne: run <id>"), that run's status and cost (its results.json or
-- usage.json in the output folder, read confined) and its diffstat against the merge base
-- with HEAD; `--delete NAME` removes one (only below demesne/), `--prune` those already
-- merged into HEAD. git runs as lua/repo/git.lua runs it: nothing the repository names runs.
local async = require("demesne.async")
local config = require("demesne.config")
local fs = require("core.fs")
local json = require("demesne.json")
local git = require("demesne.repo.git")

local USAGE = "usage: demesne branches [REPO] [--delete NAME]... [--prune] [--json]\n"

-- The run that made a branch, from its reflog (update-ref -m "demesne: run <id>").
local function run_of(top, ref)
  local out = git.ok({ "reflog", "show", "--format=%gs", ref, "--" }, { cwd = top, max_out = 256 * 1024 }) or ""
  local id
  for line in out:gmatch("[^\n]+") do id = line:match("demesne: run ([%w%-]+)") or id end
  return id
end

-- Status and cost of run `id` from its output folder (the sandbox wrote it: read confined,
-- bounded, and only the fields named here).
local function run_info(id)
  local info = { status = "unknown" }
  if not id then return info end
  local dir = fs.opendir(config.get("output_root") .. "/" .. id)
  if not dir then info.status = "gone"; return info end
  local res = dir:read("results.json", 1 << 20)
  local usage = dir:read("usage.json", 1 << 20)
  dir:close()
  local ok, r = pcall(json.decode, res or "")
  if ok and type(r) == "table" then
    if type(r.status) == "string" then info.status = r.status
    elseif type(r.exit_code) == "number" then info.status = r.exit_code == 0 and "succeeded" or "failed" end -- JSON numbers decode as floats
    if type(r.total_cost_usd) == "number" then info.cost_usd = r.total_cost_usd
    elseif type(r.cost_usd) == "number" then info.cost_usd = r.cost_usd end
  else
    info.status = "ended"
  end
  local uok, u = pcall(json.decode, usage or "")
  if not info.cost_usd and uok and type(u) == "table" and type(u.cost_usd) == "number" then info.cost_usd = u.cost_usd end
  return info
end

local function diffstat(top, ref)
  local base = git.ok({ "merge-base", "HEAD", ref }, { cwd = top })
  if not base then return nil end
  local s = git.ok({ "diff", "--no-ext-diff", "--no-textconv", "--shortstat", base, ref, "--" }, { cwd = top }) or ""
  return { files = tonumber(s:match("(%d+) files? changed")) or 0, insertions = tonumber(s:match("(%d+) insertions?")) or 0,
    deletions = tonumber(s:match("(%d+) deletions?")) or 0 }
end

-- The demesne branches of the repository at `top`: {name, head, run_id, status, cost_usd, diffstat, merged}.
local function list(top)
  local out = assert(git.ok({ "for-each-ref", "--format=%(refname)%09%(objectname)", "refs/heads/demesne/" },
    { cwd = top }))
  local rows = {}
  for ref, oid in out:gmatch("(refs/heads/demesne/[^\t\n]+)\t(%x+)") do
    local id = run_of(top, ref)
    local info = run_info(id)
    local merged = git.run({ "merge-base", "--is-ancestor", ref, "HEAD" }, { cwd = top })
    rows[#rows + 1] = { name = ref:sub(#"refs/heads/" + 1), head = oid, run_id = id, status = info.status,
      cost_usd = info.cost_usd, diffstat = diffstat(top, ref), merged = merged ~= nil and merged.status == 0 }
  end
  return rows
end

local function delete(top, name, rows)
  local full = name:match("^demesne/") and name or ("demesne/" .. name)
  for _, r in ipairs(rows) do
    if r.name == full then
      local ok, err = git.ok({ "update-ref", "-d", "refs/heads/" .. full, r.head }, { cwd = top })
      if not ok then return nil, err end
      return full
    end
  end
  return nil, ("no branch %s in %s (demesne branches lists them)"):format(full, top)
end

---@param args string[]
---@return integer status  0 done, 1 failed, 2 usage
return function(args)
  local repo_path, deletes, prune, as_json = nil, {}, false, false
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--delete" and args[i + 1] then deletes[#deletes + 1] = args[i + 1]; i = i + 1
    elseif a == "--prune" then prune = true
    elseif a == "--json" then as_json = true
    elseif a:sub(1, 1) ~= "-" and not repo_path then repo_path = a
    else io.stderr:write("demesne branches: unexpected argument '", a, "'\n", USAGE); return 2 end
    i = i + 1
  end
  local status = 0
  local ok, terr = async.main("branches", function()
    local top, err = git.ok({ "rev-parse", "--show-toplevel" }, { cwd = repo_path or "." })
    if not top then
      io.stderr:write(("demesne branches: %s is not a git work tree: %s\n"):format(repo_path or ".", tostring(err)))
      status = 1
      return
    end
    local rows = list(top)
    if #deletes > 0 or prune then
      local names = {}
      for _, d in ipairs(deletes) do names[#names + 1] = d end
      if prune then for _, r in ipairs(rows) do if r.merged then names[#names + 1] = r.name end end end
      for _, n in ipairs(names) do
        local done, derr = delete(top, n, rows)
        if done then
          io.stdout:write("deleted ", done, "\n")
        else
          io.stderr:write("demesne branches: ", derr, "\n")
          status = 1
        end
      end
      return
    end
    if as_json then
      local out = json.array()
      for _, r in ipairs(rows) do out[#out + 1] = r end
      io.stdout:write(json.encode({ repository = top, branches = out }), "\n")
      return
    end
    if #rows == 0 then io.stdout:write("no demesne branches in ", top, "\n") return end
    for _, r in ipairs(rows) do
      local d = r.diffstat or {}
      io.stdout:write(("%-32s %s  run %s  %s  %s  %d file(s) +%d -%d%s\n"):format(r.name, r.head:sub(1, 12),
        r.run_id or "?", r.status, r.cost_usd and ("$%.4f"):format(r.cost_usd) or "$-", d.files or 0,
        d.insertions or 0, d.deletions or 0, r.merged and "  merged" or ""))
    end
  end)
  if not ok then
    io.stderr:write("demesne branches: ", tostring(terr), "\n")
    return 1
  end
  return status
end
