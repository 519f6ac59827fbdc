-- File transfers into and out of a persistent sandbox (sandbox_upload, sandbox_download):
-- through a tar in the sandbox's run folder and the image's own tar, confined on the host.
local archive = require("core.archive")
local async = require("demesne.async")
local config = require("demesne.config")
local egress_policy = require("demesne.egress.policy")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local loop = require("core.loop")
local output = require("demesne.output")
local paths = require("demesne.paths")
local util = require("demesne.util")
local files = require("demesne.sandbox.files")
local persistent = require("demesne.sandbox.persistent")
local spec = require("demesne.sandbox.spec")

local transfer = {}

local fail, check = errors.raise, errors.check
local hex = util.hex
local closer = util.closer
local read_status = files.read_status
local renew = persistent.renew
local LABEL, INIT, RUN = spec.LABEL, spec.INIT, spec.RUN

local xfer_seq = 0

-- Runs argv (no shell) in a persistent sandbox through demesne-init and waits for it.
-- Returns exit_code, stderr text (bounded). Used for file transfers.
local function run_quiet(eng, sb, argv)
  xfer_seq = xfer_seq + 1
  local id = ("xfer-%d-%s"):format(xfer_seq, hex(loop.random(4)))
  local dir = RUN .. "/exec/" .. id
  local cmd = { INIT, "run", "--id", id, "--dir", dir, "--timeout", "3600", "--" }
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local code, err, ecode = eng:exec(sb.id, cmd, { env = json.array(), timeout_ms = spec.deadline_ms(3600) })
  if code == nil and ecode == "ETIMEDOUT" then
    fail("file transfer failed: " .. persistent.stop_unresponsive(eng, sb.id, sb.labels[LABEL .. "run_id"],
      "the transfer did not end within its hour plus the grace"), "ETIMEDOUT")
  end
  if code == nil then
    persistent.check_alive(eng, sb.labels[LABEL .. "run_id"])
    fail("file transfer failed: " .. tostring(err))
  end
  local run = check(fs.opendir(sb.run_dir))
  local _ <close> = run
  local _rm <close> = closer(function() files.remove_in(run, "exec/" .. id) end)
  local st = read_status(sb.run_dir, id)
  local msg, merr = output.view(sb.run_dir, "exec/" .. id .. "/stderr.log", 2048, 2048)
  if not msg then fail("file transfer: " .. tostring(merr)) end
  return st and st.exit_code or code, msg:match("^(.*%S)") or "", st -- (linear: not "%s+$")
end

-- A transfer step that failed in an unexpected way: says when the sandbox is gone or ran
-- out of memory (its tmpfs folders count against the limit), else the exit code and stderr.
local function transfer_failure(eng, sb, what, code, msg, st)
  persistent.check_alive(eng, sb.labels[LABEL .. "run_id"])
  local oom = files.oom_note(st, sb.memory_mb)
  if not oom and code == 137 then
    oom = "it was killed (exit 137): out of memory or out of processes, most likely"
  end
  fail(("%s failed (exit %s)%s%s"):format(what, tostring(code), msg ~= "" and (": " .. msg) or "",
    oom and ("; " .. oom) or ""))
end

-- Transfers go through a tar in the sandbox's run folder (bind-mounted at /.demesne/run)
-- and the image's own tar, not the engine's archive API: Docker's archive API neither
-- sees nor writes tmpfs mounts (/tmp, /workspace), where an upload would vanish.
-- The sandbox can write that folder while the host works in it, so the host holds the
-- xfer folder by descriptor (core.fs.dir) and touches the tar only through it. Returns
-- the held folder (closed, with the tar removed, when the returned guard closes), the
-- tar's name in it and its path inside the sandbox.
local function xfer_dir(sb)
  local run = check(fs.opendir(sb.run_dir))
  local ok, err, code = run:mkdir("xfer", 448) -- 0700
  if not ok and code ~= "EEXIST" then
    run:close()
    fail("file transfer: " .. tostring(err), code)
  end
  local x, xerr = run:opendir("xfer")
  run:close()
  if not x then
    fail(("file transfer refused: the sandbox's run folder has an xfer entry that is not a plain folder; "
      .. "refusing to work through it (%s)"):format(tostring(xerr)))
  end
  local name = hex(loop.random(8)) .. ".tar"
  local guard = closer(function()
    x:unlink(name)
    x:close()
  end)
  return x, name, RUN .. "/xfer/" .. name, guard
end

-- Waits inside the current task for a core.* work started by `start(cb)` (which returns
-- a core.fs.work, or nil, msg, code). Cancelling the task cancels the work.
local function await_work(start)
  return async.await(function(cb)
    local w, err, code = start(cb)
    if not w then
      cb(nil, err, code)
      return nil
    end
    return function() w:cancel() end
  end)
end

-- Bytes of the tar the sandbox may write for a download of at most `max` bytes of files:
-- room for headers (512 B per entry, pax records for long names) on top of the data.
local function download_tar_cap(max)
  return max + math.max(64 * 1024 * 1024, max // 8)
end

--- Copies a host file or folder into a sandbox (sandbox_upload).
--- args: sandbox_id, src (host path inside an allowed root), dst (absolute path in the sandbox).
--- The tar is packed off the loop into a file created O_EXCL in the held xfer folder;
--- src is walked by descriptors (never through a link) and its files' sizes (sparse files
--- count in full) are summed against upload_max_bytes before anything is written.
---@param ctx table
---@param args table
---@return table result
function transfer.upload(ctx, args)
  local eng = spec.engine()
  local src = check(paths.check("src", args.src, "any"))
  local dst = args.dst
  if type(dst) ~= "string" or dst:sub(1, 1) ~= "/" then fail("dst: must be an absolute path inside the sandbox") end
  dst = dst:gsub("/+$", "")
  local parent, base = dst:match("^(.*)/([^/]+)$")
  if not base or base == "." or base == ".." then fail("dst: must name a file or folder, e.g. /out/data.csv") end
  if parent == "" then parent = "/" end
  local sb = persistent.lookup(eng, args.sandbox_id)
  persistent.check_not_paused(sb, args.sandbox_id)
  -- host inputs plus open egress is the exfiltration shape sandbox_create refuses: open as
  -- the policy was at create (label), or as the policy of that name is now (the proxy of a
  -- re-attached sandbox follows the current file)
  local pol_name = sb.labels[LABEL .. "egress"] or "none"
  if sb.labels[LABEL .. "egress_unrestricted"] == "1" or egress_policy.is_unrestricted(pol_name) then
    fail(("sandbox_id: %s has open egress (policy %q); host files cannot be uploaded into it"):format(args.sandbox_id,
      pol_name))
  end
  -- tar would silently replace an existing file with a folder, or an empty folder with a file
  -- (the checks exit 1 for a clash; anything else is a failure of the check itself)
  if fs.stat(src).type == "directory" then
    local code, msg, st = run_quiet(eng, sb, { "/bin/sh", "-c", '[ ! -e "$1" ] || [ -d "$1" ]', "sh", dst })
    if code == 1 then fail(("dst: %s exists in the sandbox and is not a folder; a folder cannot replace it"):format(dst)) end
    if code ~= 0 then transfer_failure(eng, sb, "checking dst in the sandbox", code, msg, st) end
  else
    local code, msg, st = run_quiet(eng, sb, { "/bin/sh", "-c", '[ ! -d "$1" ]', "sh", dst })
    if code == 1 then
      fail(("dst: %s is a folder in the sandbox; name the file's own path inside it (e.g. %s/%s)"):format(dst, dst,
        src:match("[^/]+$")))
    end
    if code ~= 0 then transfer_failure(eng, sb, "checking dst in the sandbox", code, msg, st) end
  end
  local max = config.get("upload_max_bytes")
  local xfer, name, sandbox_tar, guard = xfer_dir(sb)
  local _ <close> = guard
  local f <close>, ferr, fcode = xfer:open(name, "wx", 420) -- 0644
  if not f then fail("file transfer: " .. tostring(ferr), fcode) end
  local stats, perr, pcode = await_work(function(cb)
    return archive.pack_to(f, { { src = src, name = base } }, { max_bytes = max, max_entries = 1000000, strict = true },
      cb)
  end)
  f:close()
  if not stats then
    if pcode == "E2BIG" and tostring(perr):find("max_bytes", 1, true) then
      fail(("src: %s holds more than %s bytes of files, over upload_max_bytes (%s); raise it with "
        .. "DEMESNE_UPLOAD_MAX_BYTES or upload less"):format(src, spec.num(max), spec.num(max)))
    end
    fail(("src: %s cannot be packed: %s"):format(src, tostring(perr)), pcode)
  end
  -- --no-overwrite-dir: uploading into an existing folder (/tmp) keeps its mode and owner
  local code, msg, st = run_quiet(eng, sb,
    { "tar", "-x", "--no-same-owner", "--no-overwrite-dir", "-f", sandbox_tar, "-C", parent })
  if code ~= 0 then
    if msg:find("Cannot open: No such file", 1, true) or msg:find("Cannot chdir", 1, true) then
      fail(("dst: the folder %s does not exist in the sandbox"):format(parent))
    end
    if msg:find("File exists", 1, true) or msg:find("Is a directory", 1, true) then
      fail(("dst: %s is a folder in the sandbox; name the file's own path inside it (e.g. %s/%s)"):format(dst, dst,
        src:match("[^/]+$")))
    end
    transfer_failure(eng, sb, "upload to " .. dst, code, msg, st)
  end
  renew(sb)
  return { sandbox_id = args.sandbox_id, src = src, dst = dst, files = stats.files, bytes = stats.bytes }
end

--- Copies a file or folder out of a sandbox into <output_dir>/downloads/<basename>
--- (sandbox_download). The sandbox's own tar writes the archive into its run folder (at
--- most download_max_bytes plus room for headers: RLIMIT_FSIZE through `ulimit -f`); the
--- host opens it through the held xfer folder (a regular file only) and extracts it off the
--- loop into a fresh staging folder under the held downloads folder, writing every entry
--- itself on held descriptors. Entries with absolute paths, "..", links leading outside,
--- devices, or more than 256 levels are refused; the unpacked size is capped by
--- download_max_bytes while writing (holes of sparse files count). The result is then
--- renamed into place within the held downloads folder.
---@param ctx table
---@param args table
---@return table result
function transfer.download(ctx, args)
  local eng = spec.engine()
  local src = args.src
  if type(src) ~= "string" or src:sub(1, 1) ~= "/" then fail("src: must be an absolute path inside the sandbox") end
  for c in src:gmatch("[^/]+") do
    if c == ".." then fail("src: must not contain '..'") end
  end
  src = src:gsub("/+$", "")
  local top = src:match("^/+([^/]+)")
  if top == "proc" or top == "sys" then
    -- kernel files claim a size of 0 (or 4096) whatever they hold: a copy would be empty or cut
    fail(("src: %s is under /%s, whose files are generated by the kernel; copy one first "
      .. "(e.g. sandbox_exec 'cat %s > /out/x') and download that"):format(src, top, src))
  end
  local parent, base = src:match("^(.*)/([^/]+)$")
  if not base or base == "." then fail("src: must name a file or folder (not / and not ending in /.)") end
  if parent == "" then parent = "/" end
  local sb = persistent.lookup(eng, args.sandbox_id)
  persistent.check_not_paused(sb, args.sandbox_id)
  local max = config.get("download_max_bytes")
  local cap = download_tar_cap(max)
  -- the sandbox can write its own /out: the downloads folder is held by descriptor and
  -- never followed through a link it planted there
  local out = check(fs.opendir(sb.output_dir))
  local _o <close> = out
  local mk, merr, mcode = out:mkdir("downloads", 493) -- 0755 (Lua has no octal literals)
  if not mk and mcode ~= "EEXIST" then fail("download: " .. tostring(merr), mcode) end
  local dl, derr = out:opendir("downloads")
  if not dl then
    fail(("the sandbox's output folder has a downloads entry that is not a plain folder; refusing to write "
      .. "through it (%s)"):format(tostring(derr)))
  end
  local _d <close> = dl
  local xfer, name, sandbox_tar, guard = xfer_dir(sb)
  local _x <close> = guard
  -- ulimit -f counts 512-byte blocks (POSIX sh): tar is stopped (SIGXFSZ) at the cap
  local code, msg, xst = run_quiet(eng, sb, { "/bin/sh", "-c", 'ulimit -f "$1" && shift && exec tar "$@"', "sh",
    tostring(cap // 512 + 1), "-c", "-f", sandbox_tar, "-C", parent, "--", base })
  if code ~= 0 then
    if msg:find("No such file", 1, true) then fail(("src: %s does not exist in the sandbox"):format(src)) end
    if code == 128 + 25 or msg:find("File too large", 1, true) then
      fail(("src: %s holds more than download_max_bytes (%s bytes) of files and archive headers; raise it with "
        .. "DEMESNE_DOWNLOAD_MAX_BYTES or download less"):format(src, spec.num(max)), "E2BIG")
    end
    transfer_failure(eng, sb, "download of " .. src, code, msg, xst)
  end
  local tar, terr = xfer:open(name, "r")
  if not tar then fail("download refused: the archive written in the sandbox cannot be read: " .. tostring(terr)) end
  local _t <close> = tar
  local staging = ".incoming-" .. hex(loop.random(6))
  local stats, xerr, xcode = await_work(function(cb)
    return archive.extract_at(tar, dl, staging, { max_bytes = max, max_entries = 100000, max_archive_bytes = cap }, cb)
  end)
  if not stats then fail("download refused: " .. tostring(xerr), xcode) end
  -- the extraction removed its folder on failure; after success it goes here
  local _s <close> = closer(function() files.remove_in(dl, staging) end)
  local moved, rerr, rcode
  for _ = 1, 3 do -- the sandbox may put something at the target again meanwhile
    files.remove_in(dl, base)
    moved, rerr, rcode = dl:rename(staging .. "/" .. base, dl, base, true)
    if moved or (rcode ~= "EEXIST" and rcode ~= "ENOTEMPTY") then break end
  end
  if not moved then
    if rcode == "ENOENT" then fail(("download refused: the archive from the sandbox does not hold %s"):format(base)) end
    fail("download: cannot move the result into place: " .. tostring(rerr), rcode)
  end
  return { sandbox_id = args.sandbox_id, src = src, path = sb.output_dir .. "/downloads/" .. base, files = stats.files,
    bytes = stats.bytes }
end

--- Runs argv (no shell) in a persistent sandbox through demesne-init and waits for it
--- (lua/sandbox/snapshot.lua packs /workspace with it). Returns exit code, stderr text
--- (bounded) and the exec's status record; fails when the sandbox is gone or hung.
---@param eng table
---@param sb table  persistent.lookup's sandbox
---@param argv string[]
---@return integer code, string stderr, table|nil status
function transfer.run_quiet(eng, sb, argv) return run_quiet(eng, sb, argv) end

--- Fails for a step that went wrong in the sandbox: gone, out of memory, or its exit code
--- and stderr.
---@param eng table
---@param sb table
---@param what string  the step, for the message
---@param code integer|nil
---@param msg string
---@param st table|nil  the exec's status record
function transfer.transfer_failure(eng, sb, what, code, msg, st) return transfer_failure(eng, sb, what, code, msg, st) end

--- The sandbox's transfer folder, held: returns the folder, a fresh tar name in it, that
--- tar's path inside the sandbox, and a guard that removes the tar and closes the folder.
---@param sb table
---@return table dir, string name, string sandbox_path, table guard
function transfer.xfer_dir(sb) return xfer_dir(sb) end

--- Waits in the current task for core work started by start(cb); cancelling the task cancels it.
---@param start fun(cb: function): table|nil, string|nil, string|nil
---@return any ...
function transfer.await_work(start) return await_work(start) end

return transfer
