-- One-shot runs (sandbox_script): a fresh container that runs one command and is removed
-- when the call ends, or handed to a background job.
local async = require("demesne.async")
local egress = require("demesne.egress")
local errors = require("demesne.errors")
local images = require("demesne.images")
local log = require("demesne.log")
local loop = require("core.loop")
local progress = require("demesne.progress")
local util = require("demesne.util")
local files = require("demesne.sandbox.files")
local spec = require("demesne.sandbox.spec")

local oneshot = {}

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
  return o
end

--- Starts a planned one-shot run: image, folders, container (with `labels`, names without
--- the io.demesne. prefix, added), start. Sets plan.id. ctx (may be nil) gets image progress.
---@param ctx ToolContext|nil
---@param o table  from script_prepare
---@param labels table<string,string>|nil
function oneshot.script_start(ctx, o, labels)
  local img = check(images.ensure(o.engine, o.image_arg, ctx))
  make_dirs(o)
  o.image_ref, o.image_name = img.ref, img.name
  o.cmd = { "run", "--id", o.exec_id, "--dir", RUN .. "/exec/" .. o.exec_id,
    "--stdout", o.stdout_path or "/out/stdout.log", "--stderr", "/out/stderr.log",
    "--cwd", o.cwd or "/out", "--timeout", tostring(o.timeout), "--" }
  if o.argv then
    for _, a in ipairs(o.argv) do o.cmd[#o.cmd + 1] = a end
  else
    for _, a in ipairs({ "/bin/sh", "-c", o.command }) do o.cmd[#o.cmd + 1] = a end
  end
  local relay = egress.relay_args(o.egress)
  for _, a in ipairs(o.extra_relay or {}) do relay[#relay + 1] = a end
  for i, a in ipairs(relay) do table.insert(o.cmd, 1 + i, a) end
  if o.before_create then o.before_create(o) end -- e.g. the vendor route of an agent run
  o.egress_handle = check(egress.start(o)) -- stopped by script_remove
  o.labels = labels
  local cspec = container_spec(o)
  -- the create runs in a task of its own: a cancel must not abort it half-way (the engine
  -- may create the container anyway); script_remove waits for it and removes the result
  o.creating = async.spawn("create " .. o.name, function() return o.engine:create(cspec) end)
  local _, id, err, code = o.creating:wait()
  o.id = check(id, err, code)
  check(o.engine:start(o.id))
end

--- Removes a one-shot run's container, if it was created (waiting for a create still in
--- flight). Returns true, or nil and the engine's message.
---@param o table  the plan
---@return boolean|nil ok, string|nil err
function oneshot.script_remove(o)
  -- the proxy stops after the container, and waits for its connections: egress.jsonl is complete
  local _eg <close> = o.egress_handle
  if not o.id and o.creating then
    local ok, id = o.creating:wait()
    if ok then o.id = id end
  end
  if not o.id then return true end
  local ok, err = o.engine:remove(o.id)
  if not ok then log.warning("demesne.sandbox", "remove %s: %s", o.name or o.id, tostring(err)) end
  return ok, err
end

--- Waits up to `ms` for a one-shot container to stop. Returns its exit code, or nil, message,
--- code ("ETIMEDOUT", "ENOENT" when the container is gone, "ENOENGINE" …).
---@param o table  a plan with id (a container id or name)
---@param ms integer
function oneshot.script_wait(o, ms)
  return async.timeout(ms, function() return o.engine:wait(o.id) end)
end

--- The result table of a finished one-shot run, from demesne-init's status.json and the
--- logs (bounded head and tail); `code, err` are what script_wait returned.
---@param o table  the plan
---@param code integer|nil
---@param err string|nil
---@param duration_ms integer
---@return table result  exit_code, stdout, stderr, output_dir, run_id, duration_ms, timed_out, truncated
function oneshot.script_result(o, code, err, duration_ms)
  local st = read_status(o.run_dir, o.exec_id)
  local timed_out = (st and st.timed_out) or (code == nil and err and err:find("timed out") ~= nil) or false
  local stdout, stderr, truncated = collect(o.output_dir)
  local exit_code = st and st.exit_code or code
  if exit_code == nil then fail("sandbox run failed: " .. tostring(err)) end
  return {
    exit_code = exit_code,
    stdout = stdout,
    stderr = stderr,
    output_dir = o.output_dir,
    run_id = o.run_id,
    duration_ms = duration_ms,
    timed_out = timed_out and true or false,
    truncated = truncated,
    oom_killed = files.oom_note(st, o.limits and o.limits.memory_mb),
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
  local started = loop.hrtime()
  -- the container goes on success, failure, timeout and cancel alike
  local _ <close> = util.closer(function()
    oneshot.script_remove(o)
    files.remove_tree(o.run_dir)
  end)
  oneshot.script_start(ctx, o)
  local _hb <close> = progress.heartbeat(ctx)
  -- demesne-init enforces the timeout inside; this host-side deadline covers a stuck engine
  -- or sandbox (the container is removed on the way out either way)
  local code, err = oneshot.script_wait(o, spec.deadline_ms(o.timeout))
  return oneshot.script_result(o, code, err, math.floor((loop.hrtime() - started) / 1e6))
end

return oneshot
