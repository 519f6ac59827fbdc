-- One-shot runs (sandbox_script): a fresh container that runs one command and is removed
-- when the call ends, or handed to a background job.
local async = require("demesne.async")
local devcontainer = require("demesne.images.devcontainer")
local egress = require("demesne.egress")
local errors = require("demesne.errors")
local images = require("demesne.images")
local layer = require("demesne.layer")
local log = require("demesne.log")
local loop = require("core.loop")
local progress = require("demesne.progress")
local repo = require("demesne.repo")
local teardown = require("demesne.teardown")
local util = require("demesne.util")
local files = require("demesne.sandbox.files")
local delivery = require("demesne.sandbox.delivery")
local persistent = require("demesne.sandbox.persistent")
local quota = require("demesne.sandbox.quota")
local plan = require("demesne.sandbox.plan")
local run = require("demesne.sandbox.run")
local preview = require("demesne.sandbox.preview")
local spec = require("demesne.sandbox.spec")

local oneshot = {}

local warm_pool -- [pool] set by oneshot.use_pool

local fail, check = errors.raise, errors.check
local read_status, collect = files.read_status, files.collect
local RUN, container_spec, default_env = spec.RUN, spec.container_spec, spec.default_env
local prepare, make_dirs = spec.prepare, spec.make_dirs

--- Checks a sandbox_script call and plans its run; nothing is created yet. `kind` is the
--- container's kind label: "oneshot" (removed when the call ends, or by the reaper once its
--- server is gone) or "job" (a background job's: left to lua/jobs/). Returns the plan
--- {engine, run_id, name, output_dir, run_dir, exec_id, timeout, …} that script_start,
--- script_wait and script_result take.
---@param args table  command, image, files, directories, env, timeout_seconds, limits
---@param kind string|nil
---@return table plan
function oneshot.script_prepare(args, kind)
  local timeout = spec.timeout(args.timeout_seconds)
  local o = prepare(args, kind or "oneshot", "sandbox_script", timeout + 600)
  o.env = spec.env(args.env, default_env(o.run_id, o.egress))
  o.timeout, o.exec_id, o.name = timeout, "main", "demesne-" .. o.run_id
  o.image_arg, o.command = args.image, spec.check_command("command", args.command)
  o.args = args -- for the plan hooks (mcp, tree, budget_usd)
  o.caller_env = args.env -- [channel] script_env: a warm sandbox gets it with its own run id
  if args.repository ~= nil then
    -- the command runs in a clone of the host repository; its branch comes back (lua/repo)
    local ok, err = pcall(repo.prepare, o, args.repository, { include_uncommitted = args.include_uncommitted,
      depth = args.depth, name = args.branch })
    if not ok then
      repo.cleanup(o)
      error(err, 0)
    end
    repo.add_env(o)
  else
    repo.only_with(args)
  end
  if args.image == devcontainer.IMAGE then
    -- the repository's own environment (lua/images/devcontainer.lua): read and checked now
    local ok, err = pcall(devcontainer.plan, o, args)
    if not ok then
      repo.cleanup(o)
      error(err, 0)
    end
  end
  return o
end

--- The environment of a planned one-shot's command: the caller's variables over demesne's
--- own for the plan's run id and egress. A list of "K=V".
---@param o table  the plan
---@return string[]
function oneshot.script_env(o)
  local env = spec.env(o.caller_env, default_env(o.run_id, o.egress))
  if o.repo or o.devcontainer then
    o.env = env
    repo.add_env(o)
    devcontainer.add_env(o)
  end
  return env
end

-- The words of `demesne-init run` (after "run") that run a planned one-shot's command.
local function run_args(o)
  local args = { "--id", o.exec_id, "--dir", RUN .. "/exec/" .. o.exec_id,
    "--stdout", o.stdout_path or "/out/stdout.log", "--stderr", "/out/stderr.log",
    "--cwd", o.cwd or "/out", "--timeout", tostring(o.timeout), "--" }
  for _, a in ipairs(o.argv or { "/bin/sh", "-c", o.command }) do args[#args + 1] = a end
  return args
end

-- Completes a one-shot plan once: its contributors (the plan hooks of the layer above: a
-- tree node's changes its folders, mounts and relay), then the checks of the final plan
-- (spec.check_plan), before anything is made. run_script does it before the pool is asked
-- (a tree node is never pooled), script_start for the others.
local function plan_once(ctx, o)
  if o.planned then return end
  o.planned = true
  layer.run("sandbox_plan", ctx, o, o.args)
  spec.check_plan(o)
end

--- Starts a planned one-shot run: image, folders, container (with `labels`, names without
--- the io.demesne. prefix, added), start. Sets plan.id. ctx (may be nil) gets image progress.
---@param ctx ToolContext|nil
---@param o table  from script_prepare
---@param labels table<string,string>|nil
function oneshot.script_start(ctx, o, labels)
  plan_once(ctx, o)
  run.start(o, util.now_ms()) -- its live state (lua/sandbox/run.lua), if run_script has not
  local img = o.devcontainer and devcontainer.ensure(o.engine, o, ctx) or check(images.ensure(o.engine, o.image_arg, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  -- how the command reaches demesne-init (lua/sandbox/delivery.lua): in its command line
  -- unless the plan chose otherwise (run_script: the control socket; the pool)
  o.delivery = o.delivery or delivery.new("argv")
  o.cmd = o.delivery:init_cmd(spec.relay_args(o), run_args(o))
  if o.before_create then o.before_create(o) end -- e.g. the vendor route of an agent run
  o.egress_handle = check(egress.start(o)) -- stopped by script_remove
  o.labels = labels
  local cspec = container_spec(o)
  -- the create runs in a task of its own: a cancel must not abort it half-way (the engine
  -- may create the container anyway); script_remove waits for it and removes the result
  o.creating = async.spawn("create " .. o.name, function() return o.engine:create(cspec) end)
  local function create_and_start()
    local _, id, err, code = o.creating:wait()
    o.id = check(id, err, code)
    check(o.engine:start(o.id))
  end
  -- a call waits for this: removals and warm fills hold back meanwhile (lua/teardown.lua)
  if o.background then create_and_start() else teardown.urgent(create_and_start) end
  o.delivery:started(o) -- [channel] the connection demesne-init answers on, for "control"
end

--- Hands a started one-shot's command to demesne-init the way its Delivery says
--- (lua/sandbox/delivery.lua): over the control socket ("control": returns once
--- demesne-init accepted it, fails otherwise) or through the engine's exec API ("exec": the
--- exec runs in a task of its own, which script_wait waits for), with the command's
--- environment (script_env) and its timeout. Nothing for "argv", whose command is in the
--- container's command line.
---@param o table  the plan, its container started (script_start, or a warm sandbox)
function oneshot.script_send(o)
  if o.delivery.mode == "argv" then return end
  o.env = oneshot.script_env(o)
  o.delivery:send(o, run_args(o), o.env)
end

--- Removes a one-shot run's container, if it was created (waiting for a create still in
--- flight). Returns true, or nil and the engine's message.
---@param o table  the plan
---@return boolean|nil ok, string|nil err
function oneshot.script_remove(o)
  -- the proxy stops after the container, and waits for its connections: egress.jsonl is complete
  local _eg <close> = o.egress_handle
  -- a tree node's children end once it has (lua/tree), whatever the way out; the cockpit
  -- keeps what a run was once it has gone (lua/cockpit/runs.lua): every planned run's removal
  local _tree <close> = util.closer(function()
    if (o.tree or o.planned) and not o.tree_removed then
      o.tree_removed = true
      layer.run("sandbox_removed", o)
    end
  end)
  -- demesne-init's control connection closes after the removal: a `wait` that sees the
  -- host hang up exits, and Podman refuses to remove a container caught stopping
  local _conn <close> = o.delivery
  if o.quota_watch then o.quota_watch.stop() end
  -- [pool] an exec through the engine's API ("exec" delivery) ends with the container anyway
  if o.delivery then o.delivery:cancel("the sandbox is removed") end
  if not o.id and o.creating then
    local ok, id = o.creating:wait()
    if ok then o.id = id end
  end
  if not o.id or o.removed then return true end
  local ok, err = o.engine:remove(o.id)
  if not ok then log.warning("demesne.sandbox", "remove %s: %s", o.name or o.id, tostring(err)) end
  preview.close(o.run_id) -- those an agent opened from inside (lua/tree/child.lua)
  o.removed = ok or nil -- a second call (the teardown after an early removal) does nothing
  return ok, err
end

--- Starts watching a started one-shot's output folder (lua/sandbox/quota.lua), once: past
--- its quota the container is killed (as a timeout's SIGKILL) and o.quota_watch.settle()
--- says so. script_wait calls it; script_remove ends the watch.
---@param o table  a plan with id and output_dir
function oneshot.watch_quota(o)
  if o.quota_watch or not (o.id and o.output_dir) or o.removed then return end
  local eng, id = o.engine, o.id
  o.quota_watch = quota.watch(o.output_dir, o.run_id or o.name, function()
    -- demesne-init kills the command at once (a loaded engine's kill can take a second, while
    -- a writer fills the page cache at gigabytes a second); the engine's kill makes sure
    if o.delivery then o.delivery:kill() end
    local ok, err = (eng.kill and eng.kill or eng.remove)(eng, id, "KILL")
    if not ok then log.warning("demesne.sandbox", "%s: kill: %s", tostring(o.name or id), tostring(err)) end
  end)
end

--- The fields a result gets when the run's output quota stopped it: reason and
--- output_quota = {written_bytes, max_bytes, detail}. nil when it did not (the watch ends).
---@param o table  the plan
---@return table|nil
function oneshot.quota_outcome(o)
  local q = o.quota_watch and o.quota_watch.settle()
  if not q then return nil end
  return { reason = q.reason, output_quota = { written_bytes = q.output_bytes, max_bytes = q.output_max_bytes,
    detail = q.detail } }
end

--- Waits up to `ms` for a one-shot container to stop. Returns its exit code, or nil, message,
--- code ("ETIMEDOUT", "ENOENT" when the container is gone, "ENOENGINE" …).
---@param o table  a plan with id (a container id or name)
---@param ms integer
function oneshot.script_wait(o, ms)
  oneshot.watch_quota(o)
  -- the one place the exit status is reconciled (lua/sandbox/delivery.lua); a plan without
  -- a Delivery (a job re-attached after a restart) waits for the container's end
  return (o.delivery or delivery.new("argv")):wait(o.engine, o.id, ms)
end

--- The result table of a finished one-shot run, from demesne-init's status.json and the
--- logs (bounded head and tail); `code, err` are what script_wait returned.
---@param o table  the plan
---@param code integer|nil
---@param err string|nil
---@param duration_ms integer
---@return table result  exit_code, stdout, stderr, output_dir, run_id, duration_ms, timed_out, truncated, and
---  reason = "output quota exceeded" with output_quota {written_bytes, max_bytes, detail} when the quota stopped it,
---  devcontainer (devcontainer.summary) for a run in the repository's devcontainer
function oneshot.script_result(o, code, err, duration_ms)
  local st = read_status(o.run_dir, o.exec_id)
  local q = oneshot.quota_outcome(o)
  local timed_out = (st and st.timed_out) or (code == nil and err and err:find("timed out") ~= nil) or false
  local stdout, stderr, truncated = collect(o.output_dir)
  local exit_code = st and st.exit_code or code
  if exit_code == nil and q then exit_code = 137 end -- killed, as a timeout's SIGKILL
  if exit_code == nil then fail("sandbox run failed: " .. tostring(err)) end
  o.exit_code, o.timed_out = exit_code, timed_out and true or false -- (for the removed hooks)
  return {
    reason = q and q.reason,
    output_quota = q and q.output_quota,
    exit_code = exit_code,
    stdout = stdout,
    stderr = stderr,
    output_dir = o.output_dir,
    run_id = o.run_id,
    duration_ms = duration_ms,
    timed_out = timed_out and true or false,
    truncated = truncated,
    oom_killed = files.oom_note(st, o.limits and o.limits.memory_mb) or files.gvisor_kill_note(o, st, code),
    devcontainer = devcontainer.summary(o),
  }
end

--- Runs one command in a fresh container that is removed afterwards (sandbox_script).
--- args: command, image, files, directories, env, timeout_seconds, limits.
--- ctx: the MCP tool context (progress/log). Returns the result table.
---@param ctx table
---@param args table
---@return table result
function oneshot.run_script(ctx, args)
  local o = oneshot.script_prepare(args)
  -- [channel] the command goes to demesne-init over its control socket; not under gVisor,
  -- where the host cannot connect to a socket made in the sandbox (runsc's --host-uds=open):
  -- there it is in the container's command line, and a warm sandbox gets it through the
  -- engine's exec API (the pool's "exec" Delivery)
  o.delivery = delivery.new(o.isolation ~= "gvisor" and "control" or "argv")
  local started = loop.hrtime()
  -- the container goes on success, failure, timeout and cancel alike, after the answer
  -- (a tree node's container goes before the answer: its results.json, written once its
  -- children have ended, must be there when the caller reads the answer; see lua/tree)
  local handed = false
  local _ <close> = util.closer(function()
    if o.repo and not handed and not o.tree then
      -- the call was cancelled (the client gave up, or the server stops): its work still
      -- comes back, as the branch in the host repository (nobody gets the answer)
      oneshot.script_stop_gently(o)
      local b = repo.hand_back(o)
      log.info("demesne.sandbox", "%s: cancelled; %s", tostring(o.run_id), repo.text(b))
    end
    if o.tree then oneshot.script_remove(o) end
    oneshot.script_teardown(o, o.repo and function() repo.cleanup(o) end)
  end)
  plan_once(ctx, o)
  run.start(o, util.now_ms()) -- its SandboxRun (lua/sandbox/run.lua): the live state
  quota.check_reserve() -- also before a warm sandbox (made earlier) is claimed
  -- [pool] a warm sandbox of the same kind when there is one (lua/pool.lua), else a new one
  if not (warm_pool and warm_pool.claim(ctx, o)) then
    oneshot.script_start(ctx, o)
    oneshot.script_send(o)
  end
  plan.launched(o) -- from here on the plan is only read; the live state is its SandboxRun's
  local _hb <close> = progress.heartbeat(ctx)
  -- demesne-init enforces the timeout inside; this host-side deadline covers a stuck engine
  -- or sandbox (the container is removed on the way out either way)
  local code, err = oneshot.script_wait(o, spec.deadline_ms(o.timeout))
  -- every process in the sandbox is gone: the proxy's last lines reach egress.jsonl now
  if o.egress_handle then o.egress_handle:stop() end
  local r = oneshot.script_result(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
  handed = o.repo ~= nil
  if o.repo then r.branch = repo.hand_back(o, r) end -- the container has stopped: /out is still
  return r
end

--- Stops a running one-shot gently: SIGTERM to its demesne-init, which passes it to the
--- command's process group and SIGKILLs it 2 s later, then waits (at most `ms`, default
--- 10000) for the container to stop. A repository run's run.sh hands its branch back in
--- that grace (lua/repo). Never raises.
---@param o table  the plan (o.engine, o.id)
---@param ms integer|nil
function oneshot.script_stop_gently(o, ms)
  if not (o.engine and o.id) then return end
  pcall(o.engine.kill, o.engine, o.id, "TERM")
  pcall(async.timeout, ms or 10000, function() return o.engine:wait(o.id) end)
end

--- Removes a one-shot's container and run folder in a tracked task of its own
--- (lua/teardown.lua), so the call's answer does not wait for the engine; a server that
--- stops gracefully waits for it, and after a crash the reaper removes the container.
--- `after` (optional) runs in the same task once the container is gone; the plan's own
--- `o.after_call` (optional, set by the pool) runs at once.
---@param o table  the plan
---@param after function|nil
function oneshot.script_teardown(o, after)
  if o.after_call then o.after_call() end -- [pool] e.g. the kind refills
  local function remove()
    oneshot.script_remove(o)
    if o.run_dir then
      files.remove_tree(o.run_dir)
      local ef = persistent.expiry_file(o.run_dir)
      if ef then os.remove(ef) end
    end
    if after then after() end
  end
  teardown.spawn("remove " .. tostring(o.name), remove)
end

--- [pool] The warm pool run_script claims from: an object with claim(ctx, plan) ->
--- boolean (lua/pool.lua registers itself when `demesne serve` starts it), or nil.
---@param p table|nil
function oneshot.use_pool(p) warm_pool = p end

return oneshot
