-- Commands in a persistent sandbox (sandbox_exec) through demesne-init: plan, run, kill
-- the process group, and the result. The command goes over demesne-init's control socket
-- (lua/channel.lua) when the sandbox has one, else through the engine's exec API.
local async = require("demesne.async")
local channel = require("demesne.channel")
local config = require("demesne.config")
local egress = require("demesne.egress")
local errors = require("demesne.errors")
local log = require("demesne.log")
local loop = require("core.loop")
local progress = require("demesne.progress")
local util = require("demesne.util")
local files = require("demesne.sandbox.files")
local persistent = require("demesne.sandbox.persistent")
local spec = require("demesne.sandbox.spec")

local exec = {}

local fail = errors.raise
local hex = util.hex
local read_status, collect = files.read_status, files.collect
local renew = persistent.renew
local LABEL, INIT, RUN = spec.LABEL, spec.INIT, spec.RUN

local exec_seq = 0

--- Checks a sandbox_exec call and plans it; nothing runs yet. Renews the sandbox's TTL.
--- Returns the plan {engine, sb, container, exec_id, rel, dir, argv, env, timeout,
--- output_dir, run_dir, log_dir} that exec_run, exec_kill and exec_result take.
---@param args table  sandbox_id, command, timeout_seconds, cwd, env
---@return table plan
function exec.exec_prepare(args)
  local eng = spec.engine()
  local timeout = spec.timeout(args.timeout_seconds)
  local sb = persistent.lookup_running(eng, args.sandbox_id)
  if not sb.running then
    fail(("sandbox_id: sandbox %s is not running%s"):format(args.sandbox_id,
      sb.stopped_reason and (" (" .. sb.stopped_reason .. ")") or ""))
  end
  persistent.check_not_paused(sb, args.sandbox_id)
  local pol = sb.labels[LABEL .. "egress"]
  if pol then -- after a server restart the sandbox's proxy has to be started again
    local _, eerr = egress.ensure(args.sandbox_id, sb.run_dir, sb.output_dir, pol)
    if eerr then log.warning("demesne.sandbox", "sandbox %s: %s", args.sandbox_id, eerr) end
  end
  local cwd = args.cwd or "/out"
  if cwd:sub(1, 1) ~= "/" then fail("cwd: must be an absolute path inside the sandbox") end
  local env = spec.env(args.env)
  spec.check_command("command", args.command)
  renew(sb, timeout)
  exec_seq = exec_seq + 1
  local exec_id = os.date("!%Y%m%dT%H%M%SZ") .. "-" .. exec_seq .. "-" .. hex(loop.random(2))
  local rel = "exec/" .. exec_id
  local dir = RUN .. "/exec/" .. exec_id
  local run = { "--id", exec_id, "--dir", dir,
    "--stdout", "/out/" .. rel .. "/stdout.log", "--stderr", "/out/" .. rel .. "/stderr.log",
    "--cwd", cwd, "--timeout", tostring(timeout), "--", "/bin/sh", "-c", args.command }
  return {
    engine = eng, sb = sb, container = sb.id, exec_id = exec_id, rel = rel, dir = dir, env = env,
    timeout = timeout, output_dir = sb.output_dir, run_dir = sb.run_dir, log_dir = sb.output_dir .. "/" .. rel,
    run_args = run, argv = { INIT, "run", table.unpack(run) },
    started = async.event(), -- set(true) once the command runs, set(false) when that is not known
  }
end

--- Runs a planned exec and waits for it, at most its timeout plus exec_grace_seconds:
--- through demesne-init's control socket when the sandbox has one (a few milliseconds to
--- start), else through the engine's exec API. Returns the exit code `demesne-init run`
--- reported, or nil, message, code ("ETIMEDOUT": the deadline passed and the sandbox did
--- not answer). Sets e.started once the command runs. Cancelling the task stops the wait
--- only: call exec_kill.
---@param e table  the plan from exec_prepare
---@return integer|nil code, string|nil err, string|nil ecode
function exec.exec_run(e)
  -- [channel] a sandbox made before the control socket existed (or one that removed it)
  -- has none: the exec API then runs the same `demesne-init run`
  local conn = channel.connect(e.run_dir)
  if not conn then
    e.started.set(false)
    return e.engine:exec(e.container, e.argv, { env = e.env, timeout_ms = spec.deadline_ms(e.timeout) })
  end
  local _ <close> = conn
  local ok, err, code = conn:send("run", e.run_args, e.env)
  if not ok then
    e.started.set(false)
    return nil, "sandbox_exec: the control socket: " .. tostring(err), code
  end
  -- the command records its own end (status.json); the host waits at most as long as it may run
  local deadline = loop.now() + spec.deadline_ms(e.timeout)
  while true do
    local r
    r, err, code = conn:next(math.max(math.floor(deadline - loop.now()), 1))
    if not r then
      e.started.set(false)
      return nil, "sandbox_exec: " .. tostring(err), code
    end
    if r.kind == "started" then e.started.set(true) end
    if r.kind == "exit" then
      e.started.set(true)
      return r.code
    end
    if r.kind == "error" then
      e.started.set(false)
      return nil, "sandbox_exec: demesne-init refused the command: " .. r.text, "EPROTO"
    end
  end
end

--- Kills a planned exec's whole process group inside the sandbox (demesne-init kill:
--- SIGTERM, SIGKILL after 2 s), through the sandbox's control socket when it has one, else
--- through the engine's exec API. Works after a restart: needs only the container, the
--- exec's folder and the sandbox's id. The kill itself has a host-side deadline (its own
--- 5 s plus exec_grace_seconds): a sandbox that does not answer it is stopped
--- (stop_unresponsive). Returns the kill's exit code, or nil, message, "ETIMEDOUT".
---@param eng table       the engine adapter
---@param container string
---@param dir string      the exec's folder inside the sandbox (/.demesne/run/exec/<id>)
---@param sandbox_id string|nil
function exec.exec_kill(eng, container, dir, sandbox_id)
  local args = { "--dir", dir, "--signal", "TERM", "--grace", "2" }
  local function unresponsive()
    return nil, persistent.stop_unresponsive(eng, container, sandbox_id,
      ("cancelling the command: demesne-init kill did not end within %d s"):format(spec.deadline_ms(5) // 1000)),
      "ETIMEDOUT"
  end
  -- [channel] the run folder of a persistent sandbox is <state_dir>/run/<sandbox id>
  local conn = type(sandbox_id) == "string" and sandbox_id:match("^[%w%-]+$") and
    channel.connect(select(2, spec.dirs(sandbox_id)))
  if conn then
    local _ <close> = conn
    if conn:send("kill", args) then
      local deadline = loop.now() + spec.deadline_ms(5)
      while true do
        local r, _, code = conn:next(math.max(math.floor(deadline - loop.now()), 1))
        if r and r.kind == "exit" then return r.code end
        if not r and code == "ETIMEDOUT" then return unresponsive() end
        if not r or r.kind == "error" then break end -- not a demesne-init that answers: the exec API
      end
    end
  end
  local code, err, ecode = eng:exec(container, { INIT, "kill", table.unpack(args) },
    { timeout_ms = spec.deadline_ms(5) })
  if code == nil and ecode == "ETIMEDOUT" then return unresponsive() end
  return code, err, ecode
end

--- The result table of a finished exec, from status.json and its logs; `code` is what
--- exec_run returned.
---@param e table  the plan from exec_prepare
---@param code integer
---@param duration_ms integer
---@return table result  exit_code, stdout, stderr, output_dir, log_dir, duration_ms, timed_out, truncated, expires_at
function exec.exec_result(e, code, duration_ms)
  local st = read_status(e.run_dir, e.exec_id)
  local stdout, stderr, truncated = collect(e.output_dir, e.rel)
  return {
    exit_code = st and st.exit_code or code,
    stdout = stdout,
    stderr = stderr,
    output_dir = e.output_dir,
    log_dir = e.log_dir,
    duration_ms = duration_ms,
    timed_out = st and st.timed_out or false,
    truncated = truncated,
    expires_at = util.iso(e.sb.expires_at),
    oom_killed = files.oom_note(st, e.sb.memory_mb),
  }
end

--- Runs a command in a persistent sandbox (sandbox_exec).
--- args: sandbox_id, command, timeout_seconds, cwd, env. Returns the result table.
---@param ctx table   the tool call's context (progress, cancel)
---@param args table
---@return table result
function exec.exec(ctx, args)
  local e = exec.exec_prepare(args)
  local started = loop.hrtime()
  local finished = false
  -- cancelling the call kills the command's whole process group inside the sandbox
  local _ <close> = util.closer(function()
    if not finished then exec.exec_kill(e.engine, e.container, e.dir, args.sandbox_id) end
  end)
  local _hb <close> = progress.heartbeat(ctx)
  local code, err, ecode = exec.exec_run(e)
  finished = true
  if code == nil and ecode == "ETIMEDOUT" and not read_status(e.run_dir, e.exec_id) then
    fail("sandbox_exec: " .. persistent.stop_unresponsive(e.engine, e.container, args.sandbox_id,
      ("the command did not end within its timeout (%d s) plus a grace of %s s"):format(e.timeout,
        spec.num(config.get("exec_grace_seconds")))), "ETIMEDOUT")
  end
  -- a sandbox destroyed (or expired) under a running command: say so, not the engine's text
  if not read_status(e.run_dir, e.exec_id) then persistent.check_alive(e.engine, args.sandbox_id) end
  if code == nil then fail("sandbox_exec failed: " .. tostring(err)) end
  return exec.exec_result(e, code, math.floor((loop.hrtime() - started) / 1e6))
end

exec.exec_seq = exec_seq

return exec
