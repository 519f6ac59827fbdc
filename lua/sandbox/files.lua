-- What the host reads and removes of a sandbox's files, all of them writable from inside:
-- a command's exit record (status.json), the head and tail of its logs, and folder trees.
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local json = require("demesne.json")
local log = require("demesne.log")
local output = require("demesne.output")

local files = {}

local fail = errors.raise

--- What a status.json says about the OOM killer: a sentence for the result when it killed a
--- process in the sandbox while the command ran (demesne-init's "oom_kills"), else nil.
--- `memory_mb`: the sandbox's limit when known.
---@param st table|nil
---@param memory_mb number|nil
---@return string|nil
function files.oom_note(st, memory_mb)
  local n = st and math.tointeger(st.oom_kills)
  if not n or n <= 0 then return nil end
  return ("the kernel killed %d process%s in the sandbox for lack of memory%s; files in /tmp and /workspace "
    .. "count against the limit"):format(n, n == 1 and "" or "es",
    memory_mb and (" (its limit is %d MiB)"):format(math.floor(memory_mb)) or "")
end

-- The largest status.json read; demesne-init writes well under 8 KiB.
local STATUS_MAX = 65536

-- An integer JSON number within [lo, hi] (JSON numbers decode as floats), or nil.
local function int_in(v, lo, hi)
  if type(v) ~= "number" or v ~= v or v < lo or v > hi or v ~= math.floor(v) then return nil end
  return math.tointeger(v)
end

--- Under gVisor a sandbox that passes its memory limit is ended as a whole by the host's
--- OOM killer (gVisor's kernel is one host process), so no status.json says so: a sentence
--- for the result when a gVisor one-shot's container ended with 137 and no status, else nil.
---@param o table  the plan (isolation, limits)
---@param st table|nil  status.json
---@param code integer|nil  the container's exit code
---@return string|nil
function files.gvisor_kill_note(o, st, code)
  if o.isolation ~= "gvisor" or st ~= nil or code ~= 137 then return nil end
  local mb = o.limits and o.limits.memory_mb
  return ("the sandbox was killed (exit 137) before its command finished, most likely for passing its memory "
    .. "limit%s: under gVisor the whole sandbox ends when it does; files in /tmp and /workspace count against it")
    :format(mb and (" of %d MiB"):format(math.floor(mb)) or "")
end

--- Checks a decoded status.json (demesne-init's record of one command, written inside the
--- sandbox and therefore untrusted: core/init/run.c writes id, exit_code (0-255), signal
--- (null or 1-64), timed_out, cancelled, started_at, finished_at, duration_ms (ms),
--- oom_kills (optional), error (optional)). Returns a new table holding only well-typed
--- fields, or nil and the first field that is wrong.
---@param t any
---@return table|nil status, string|nil why
function files.check_status(t)
  if type(t) ~= "table" then return nil, "it is not a JSON object" end
  local out = { exit_code = int_in(t.exit_code, 0, 255) }
  if not out.exit_code then return nil, "exit_code is not an integer from 0 to 255" end
  for _, k in ipairs({ "timed_out", "cancelled" }) do
    if t[k] ~= nil and type(t[k]) ~= "boolean" then return nil, k .. " is not a boolean" end
    out[k] = t[k] == true
  end
  if t.signal ~= nil and t.signal ~= json.null then
    out.signal = int_in(t.signal, 1, 64)
    if not out.signal then return nil, "signal is not null or an integer from 1 to 64" end
  end
  for _, k in ipairs({ "started_at", "finished_at", "duration_ms", "oom_kills" }) do
    if t[k] ~= nil then
      out[k] = int_in(t[k], 0, 2 ^ 53)
      if not out[k] then return nil, k .. " is not a non-negative integer" end
    end
  end
  if t.error ~= nil then
    if type(t.error) ~= "string" or #t.error > 4096 then return nil, "error is not a string of at most 4096 bytes" end
    out.error = t.error
  end
  return out
end

--- The exit status demesne-init recorded for one command (run_dir/exec/<exec_id>/status.json),
--- read confined (no symlink, no FIFO, a regular file of at most 64 KiB) and checked field
--- by field. Returns the status table, or nil when there is none (the command has not ended,
--- or nothing was recorded). Any other failure (a FIFO, a link, a folder, a huge or
--- malformed file, EMFILE) fails with a message naming the file: it never reads as
--- "no status" or as success.
---@param run_dir string
---@param exec_id string
---@return table|nil
local function read_status(run_dir, exec_id)
  local rel = "exec/" .. exec_id .. "/status.json"
  local d, derr, dcode = fs.opendir(run_dir)
  if not d then
    if dcode == "ENOENT" then return nil end
    fail(("cannot read the command's exit status: %s"):format(tostring(derr)), dcode)
  end
  local s, err, code = d:read(rel, STATUS_MAX)
  d:close()
  if not s then
    if code == "ENOENT" then return nil end
    fail(("cannot read the command's exit status: %s"):format(tostring(err)), code)
  end
  local t, jerr = json.decode(s)
  local st, why = files.check_status(t)
  if not st then
    if t == nil then why = "it is not JSON: " .. tostring(jerr) end
    fail(("the command's exit status %s/%s is not valid (%s); it was written inside the sandbox"):format(run_dir, rel,
      why), "EINVAL")
  end
  return st
end

--- Bounded stdout/stderr of one command, from its log files under the output folder. A log
--- that cannot be read (anything but missing) fails: a result never shows it as empty.
---@param output_dir string
---@param rel_dir string|nil  the command's log folder under it (exec/<n>), nil for the top
---@return string stdout, string stderr, boolean|nil truncated
local function collect(output_dir, rel_dir)
  local head, tail = config.get("output_head_bytes"), config.get("output_tail_bytes")
  local prefix = rel_dir and (rel_dir .. "/") or ""
  local so, cut1, c1 = output.view(output_dir, prefix .. "stdout.log", head, tail)
  if not so then fail("cannot read the command's output: " .. tostring(cut1), c1) end
  local se, cut2, c2 = output.view(output_dir, prefix .. "stderr.log", head, tail)
  if not se then fail("cannot read the command's output: " .. tostring(cut2), c2) end
  return so, se, cut1 or cut2
end

--- Removes `name` (a file, a link or a folder with everything in it) from the held folder
--- `dir` off the loop (dir:remove_tree: unlinkat on held descriptors, never through a
--- link). Inside a task it waits for the removal; outside one it starts it and returns.
--- Failures are logged and returned.
---@param dir userdata  a core.fs.dir
---@param name string
---@return boolean|nil ok, string|nil err
function files.remove_in(dir, name)
  local function start(cb)
    local w, e, c = dir:remove_tree(name, cb)
    if not w then cb(nil, e, c) end
  end
  local function report(ok, e)
    if not ok then log.warning("demesne.sandbox", "remove %s: %s", name, tostring(e)) end
    return ok, e
  end
  if not async.current() then
    start(report)
    return true
  end
  return report(async.await(start))
end

--- Removes a folder the host made but a sandbox could write (a run folder) with everything
--- in it, as files.remove_in does, from its parent folder. A missing folder is fine.
---@param path string
---@return boolean|nil ok, string|nil err
function files.remove_tree(path)
  local parent, name = tostring(path):match("^(.*)/([^/]+)$")
  if not parent then return nil, "not an absolute path: " .. tostring(path) end
  local d, err, code = fs.opendir(parent ~= "" and parent or "/")
  if not d then
    if code == "ENOENT" then return true end
    log.warning("demesne.sandbox", "remove %s: %s", path, tostring(err))
    return nil, err
  end
  local _ <close> = d
  return files.remove_in(d, name)
end

files.read_status = read_status
files.collect = collect

return files
