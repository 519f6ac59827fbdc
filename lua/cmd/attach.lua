-- `demesne attach ID`: an interactive shell in a running sandbox, on a pseudo-terminal that
-- demesne-init makes inside it (`demesne-init pty`, core/init/pty.c). ID is a sandbox_id, a
-- run_id or a job_id, of this configuration's state_dir only. `--follow ID` instead shows
-- a run's transcript (an agent) or stdout (a script) as it grows, read-only.
--
-- How the terminal reaches the sandbox: the CLI listens on a unix socket in the sandbox's
-- run folder (host-mounted at /.demesne/run), and starts `/.demesne/init pty --connect
-- /.demesne/run/attach-….sock -- sh` through the engine's exec API; demesne-init connects
-- out to it (as the egress relay does), so no network interface is needed, egress `none`
-- and gVisor included, on Podman and Docker alike. The bytes are framed (core/init/frame.h)
-- and pumped by core.tty.attach. Ctrl-] detaches: the shell is hung up (SIGHUP), the
-- sandbox runs on. docs/reference/cli.md#demesne-attach
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local paths = require("demesne.paths")
local spec = require("demesne.sandbox.spec")
local stream = require("core.stream")
local terminal = require("demesne.terminal")
local tty = require("core.tty")
local util = require("demesne.util")

local LABEL = "io.demesne."
local ACCEPT_MS = 20000      -- the sandbox's demesne-init must connect back within this
local RECORD_MAX = 1024 * 1024
local FOLLOW_READ = 64 * 1024
local FOLLOW_TICK_MS = 250
local DETACH = 0x1d          -- Ctrl-]
-- the shell: bash where the image has it, else sh; both interactive on the PTY
local SHELL = { "/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; fi; exec sh" }

local USAGE = [[
usage: demesne attach [--cwd DIR] ID
       demesne attach --follow ID
ID is a sandbox_id, a run_id or a job_id of this configuration (its state_dir).
An interactive shell in the running sandbox; Ctrl-] detaches (the sandbox keeps running).
--follow shows a run's transcript (agent) or stdout (script) as it grows, until it ends.
]]

local function fail(msg, code) errors.raise(msg, code) end

-- A job record read from the state folder, or nil. Never jobs.get: that would adopt a job
-- whose server is gone, and the CLI must only look.
local function job_record(id)
  if not jobs.valid_id(id) then return nil end
  local s = fs.read_file(jobs.record_path(id), 0, RECORD_MAX)
  local rec = s and json.decode(s)
  if type(rec) ~= "table" or rec.job_id ~= id or type(rec.status) ~= "string" then return nil end
  return rec
end

-- The job whose run_id or sandbox_id is `id` (the newest), or nil.
local function job_of_run(id)
  local names = fs.readdir(jobs.dir()) or {}
  local best
  for _, n in ipairs(names) do
    local jid = type(n) == "string" and n:match("^(job%-[%w%-]+)%.json$")
    local rec = jid and job_record(jid)
    if rec and (rec.run_id == id) and (not best or (tonumber(rec.started_ms) or 0) > (tonumber(best.started_ms) or 0)) then
      best = rec
    end
  end
  return best
end

-- The running container of run_id that belongs to this state_dir, or nil, why.
local function container_of(eng, run_id)
  if type(run_id) ~= "string" or not run_id:match("^[%w][%w%-%.]*$") or #run_id > 200 then
    fail(("ID: %q is not a sandbox, run or job id"):format(tostring(run_id)), "EINVAL")
  end
  local c, err, code = spec.state_of(eng, run_id)
  if not c then
    if code == "ENOENT" then return nil end
    fail(err, code)
  end
  local l = c.labels or {}
  local run_dir = tostring(l[LABEL .. "run_dir"])
  -- scope: only the sandboxes of this configuration (their run folder under its state_dir)
  if not paths.within(run_dir, config.get("state_dir") .. "/run") then
    fail(("ID: sandbox %s is not one of this configuration's (its run folder is not under state_dir %s)"):format(
      run_id, config.get("state_dir")), "EPERM")
  end
  return { container = c.id, run_id = run_id, run_dir = run_dir, state = c.state, kind = l[LABEL .. "kind"],
    isolation = l[LABEL .. "isolation"] }
end

-- What ID names: {container, run_id, run_dir, ...} of a running sandbox, or a failure that
-- says why there is none.
local function resolve(eng, id)
  local rec = job_record(id)
  local run_id = rec and (rec.sandbox_id or rec.run_id) or id
  if rec and not run_id then fail(("ID: job %s has no sandbox"):format(id), "ENOENT") end
  local t = container_of(eng, run_id)
  if t and t.state == "running" then return t end
  rec = rec or job_of_run(id)
  if rec and rec.status ~= "running" and rec.run_id == run_id then
    fail(("ID: run %s has ended (%s%s): there is no sandbox left to attach to"):format(run_id, rec.status,
      rec.exit_code and (", exit code " .. tostring(rec.exit_code)) or ""), "ENOENT")
  end
  if t then fail(("ID: sandbox %s is not running (%s)"):format(run_id, tostring(t.state)), "ENOENT") end
  fail(("ID: no sandbox, run or job %s (it was destroyed, has ended, or never was)"):format(id), "ENOENT")
end

-- How the sandbox ended when the connection closed without the shell's status: the
-- container's exit code, or 255 when it was removed (no status left).
local function ending(eng, t)
  for _ = 1, 10 do
    local info = eng:inspect(t.container)
    if not info or info.state == "gone" then return 255, ("sandbox %s was destroyed"):format(t.run_id) end
    if info.state ~= "running" and info.state ~= "removing" then
      return info.exit_code or 255, ("sandbox %s stopped (exit code %s)"):format(t.run_id, tostring(info.exit_code))
    end
    async.sleep(200)
  end
  return 255, ("the terminal of sandbox %s closed (the sandbox still runs)"):format(t.run_id)
end

local function attach(id, cwd)
  if not tty.isatty(0) then
    fail("stdin is not a terminal: demesne attach needs one (run a command with sandbox_exec instead, "
      .. "or watch a run with --follow)", "EINVAL")
  end
  local eng = spec.engine()
  local t = resolve(eng, id)
  local name = "attach-" .. util.random_hex(8) .. ".sock"
  local host_path = t.run_dir .. "/" .. name
  local conn = async.event()
  local server, lerr = stream.listen_unix(host_path, function(c) conn.set(c) end)
  if not server then fail(("cannot listen on %s: %s"):format(host_path, tostring(lerr))) end
  local run = fs.opendir(t.run_dir)
  if run then
    run:chmod(name, 438) -- 0666: whatever user the image runs as can connect
    run:close()
  end
  local term = os.getenv("TERM")
  local env = { "TERM=" .. ((term and term:match("^[%w%-%.]+$")) and term or "xterm") }
  local exec_done = async.event()
  async.spawn("attach exec", function()
    local argv = { spec.INIT, "pty", "--connect", "/.demesne/run/" .. name }
    if cwd then argv[#argv + 1] = "--cwd=" .. cwd end
    -- gVisor's PTY (as of runsc 2022) does not turn ^C, ^\ and ^Z into signals: demesne-init does
    if t.isolation == "gvisor" then argv[#argv + 1] = "--signals" end
    argv[#argv + 1] = "--"
    for _, a in ipairs(SHELL) do argv[#argv + 1] = a end
    exec_done.set(eng:exec(t.container, argv, { env = env }))
  end)
  local waiter = async.spawn("attach accept", function()
    local ok, c = pcall(async.timeout, ACCEPT_MS, conn.wait)
    if not ok or not c then conn.set(false) end
  end)
  local c = conn.wait()
  async.cancel(waiter)
  server:close()
  os.remove(host_path)
  if not c then
    local code, err
    if exec_done.is_set() then code, err = exec_done.wait() end
    fail(("sandbox %s did not open a terminal within %d s%s"):format(t.run_id, ACCEPT_MS // 1000,
      code and (" (demesne-init exited " .. tostring(code) .. ")") or (err and (": " .. tostring(err)) or "")))
  end
  io.stderr:write(("[demesne: attached to %s; Ctrl-] detaches]\r\n"):format(t.run_id))
  local how, value = tty.attach(c:fileno(), { detach = DETACH })
  c:close()
  if how == "exit" then
    io.stderr:write(("[demesne: the shell in %s exited with %d]\n"):format(t.run_id, value))
    return value
  elseif how == "detached" then
    io.stderr:write(("[demesne: detached from %s; it keeps running]\n"):format(t.run_id))
    return 0
  elseif how == "signal" then
    io.stderr:write(("[demesne: detached from %s by signal %d; it keeps running]\n"):format(t.run_id, value))
    return 128 + value
  elseif how == "error" then
    fail(("the terminal of %s: %s"):format(t.run_id, tostring(value)))
  end
  local code, msg = ending(eng, t)
  io.stderr:write(("[demesne: %s; exit status %d]\n"):format(msg, code))
  return code
end

-- Prints the run's transcript (agent) or stdout (script) from the start, as it grows, until
-- the run has ended and everything is printed. Returns the run's exit code.
local function follow(id)
  local rec = job_record(id) or job_of_run(id)
  if not rec then
    fail(("ID: no background run or job %s in this configuration (--follow reads a job's output)"):format(id), "ENOENT")
  end
  local cursor, pending = 0, ""
  local function emit(s, final)
    pending = pending .. s
    while true do
      local line, rest = pending:match("^([^\n]*)\n(.*)$")
      if not line then break end
      pending = rest
      for _, l in ipairs(terminal.render_event(line)) do io.stdout:write(l, "\n") end
    end
    if final and pending ~= "" then
      for _, l in ipairs(terminal.render_event(pending)) do io.stdout:write(l, "\n") end
      pending = ""
    end
    io.stdout:flush()
  end
  while true do
    local text, nxt, _, eof = jobs.read_stdout(rec, cursor, FOLLOW_READ)
    cursor = nxt
    emit(text, eof)
    if eof then break end
    if text == "" then
      async.sleep(FOLLOW_TICK_MS)
      rec = job_record(rec.job_id) or rec
    end
  end
  io.stderr:write(("[demesne: %s %s%s]\n"):format(rec.job_id, rec.status,
    rec.exit_code and (", exit code " .. tostring(rec.exit_code)) or ""))
  return math.tointeger(rec.exit_code) or (rec.status == "succeeded" and 0 or 1)
end

---@param args string[]
---@return integer status  the shell's (or the run's) exit code; 0 after a detach; 1 an error; 2 usage
return function(args)
  local id, mode, cwd
  local i = 1
  while args[i] do
    local a = args[i]
    if a == "--follow" or a == "-f" then mode = "follow"
    elseif a == "--cwd" and args[i + 1] then cwd = args[i + 1]; i = i + 1
    elseif a == "--help" or a == "-h" then io.stdout:write(USAGE) return 0
    elseif a:sub(1, 1) == "-" or id then
      io.stderr:write("demesne attach: unexpected argument '", terminal.neutralise(a, true), "'\n", USAGE)
      return 2
    else id = a end
    i = i + 1
  end
  if not id then
    io.stderr:write("demesne attach: an ID is needed\n", USAGE)
    return 2
  end
  if cwd and (cwd:sub(1, 1) ~= "/" or cwd:find("%c")) then
    io.stderr:write("demesne attach: --cwd needs an absolute path\n")
    return 2
  end
  local status
  local ok, err = async.main("attach", function()
    if mode == "follow" then status = follow(id) else status = attach(id, cwd) end
  end)
  if not ok then
    io.stderr:write("demesne attach: ", terminal.neutralise(errors.message(err), true), "\n")
    return 1
  end
  return status or 1
end
