-- `demesne doctor`'s checks: is this machine ready to run sandboxes? Each check is one
-- entry of doctor.CHECKS, run in order inside one task; a check that needs another's
-- result reads it from the shared `ctx` (the engine check leaves `ctx.engine`).
--
-- A check returns one result table:
--   {ok = true, detail = "what was found"}
--   {ok = false, detail = "what is wrong", fix = "what to do about it"}
--   {skip = "why it could not run"}        (only after another check failed)
local config = require("demesne.config")
local engines = require("demesne.engines")
local images = require("demesne.images")
local sandbox = require("demesne.sandbox")
local fs = require("core.fs")
local loop = require("core.loop")

local doctor = {}

local function fail(detail, fix) return { ok = false, detail = detail, fix = fix } end
local function ok(detail) return { ok = true, detail = detail } end

-- "1.41" >= "1.41"? Dotted versions compared part by part as numbers.
local function version_at_least(v, min)
  local a, b = {}, {}
  for n in tostring(v):gmatch("%d+") do a[#a + 1] = tonumber(n) end
  for n in min:gmatch("%d+") do b[#b + 1] = tonumber(n) end
  for i = 1, #b do
    if (a[i] or 0) ~= b[i] then return (a[i] or 0) > b[i] end
  end
  return true
end

-- The Docker Engine API version lua/engines/docker.lua speaks (its URLs start /v1.41).
local MIN_API = "1.41"

-- engines.discover()'s reasons, as the verdict says them
local FOUND = { DEMESNE_ENGINE = "the engine setting", DOCKER_HOST = "from DOCKER_HOST",
  ["rootful Podman"] = "the rootful Podman socket", ["rootless Podman"] = "your rootless Podman socket",
  Docker = "the Docker socket" }

local START_ENGINE = "install Podman (`apt-get install podman`) and start its API socket: "
  .. "`podman system service --time=0 unix:///run/podman/podman.sock &` (or Docker: `apt-get install docker.io`, "
  .. "`dockerd &`); or set DEMESNE_ENGINE=unix:///path/to/socket to an engine that runs"

local function check_engine(ctx)
  local which = engines.adapter_name()
  local sock, tried, why
  if which == "docker" then
    sock, tried, why = engines.discover()
    if not sock then
      if config.get("engine") then
        return fail(("the engine setting (%s) names %s, which is not a socket"):format(
          config.describe().engine.origin, tried[#tried]),
          "start the engine there, or correct the setting (unset it to let demesne look in the usual places: "
            .. "DOCKER_HOST, the Podman sockets, /var/run/docker.sock)")
      end
      return fail(("no container engine found (tried %s)"):format(table.concat(tried, ", ")), START_ENGINE)
    end
  end
  local eng, err = engines.get()
  if not eng then
    local fix = which == "docker" and START_ENGINE
      or which == "kubernetes" and "correct the kubeconfig (the kubeconfig setting, DEMESNE_KUBECONFIG), or set engine "
        .. "back to a Podman or Docker socket"
      or ("correct %s/engines/%s.lua, or set engine_adapter back to docker"):format(config.dir(), which)
    return fail(err, fix)
  end
  if type(eng.info) ~= "function" then
    ctx.engine = eng
    return ok(("engine adapter %s (it has no info method, so its engine was not asked)"):format(which))
  end
  local info, ierr, code = eng:info()
  if not info then
    local fix = "start the engine's API service on that socket (Podman: `podman system service --time=0 unix://"
      .. tostring(sock or eng.socket) .. " &`; Docker: `dockerd &`), or remove the stale socket file"
    if code == "EACCES" or tostring(ierr):find("ermission denied", 1, true) then
      fix = "give your user access to the socket (Docker: the docker group), or use rootless Podman: "
        .. "`systemctl --user start podman.socket` or `podman system service --time=0 &`"
    end
    if code == "ENOENGINE" then return fail(tostring(ierr), fix) end -- the adapter's message names the socket
    return fail(("the engine at %s does not answer: %s"):format(tostring(sock or eng.socket), tostring(ierr)), fix)
  end
  local where = sock and ("at unix://%s (%s)"):format(sock, FOUND[why] or why) or ("through the %s adapter"):format(which)
  local what = ("%s %s, %s API %s, %s"):format(info.name or "engine", tostring(info.version),
    which == "kubernetes" and "Kubernetes" or "Docker Engine", tostring(info.api), where)
  if which == "docker" and not version_at_least(info.api, MIN_API) then
    return fail(what .. (": demesne needs API %s or later"):format(MIN_API),
      "upgrade the engine (Docker 20.10 or later, Podman 4 or later)")
  end
  ctx.engine = eng
  return ok(what)
end

local function check_images(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  local name = config.get("default_image") or "default"
  local st, reason, fix = images.readiness(ctx.engine, name)
  if not st then return fail(reason, fix) end
  if st.state == "built" then return ok(("default image %s is built (%s)"):format(name, st.ref)) end
  if st.from ~= "mmdebstrap" then
    return ok(("default image %s builds on first use, from %s (`demesne images build` builds it now)"):format(name,
      st.from))
  end
  return ok(("default image %s builds on first use; the Debian root filesystem comes from a registry or, "
    .. "without one, from %s with %s (`demesne images build` builds it now)"):format(name,
      st.sources or "mmdebstrap's default mirror", st.mmdebstrap))
end

local function check_config()
  local _, err = config.describe()
  if err then
    return fail("config error: " .. err, ("correct %s/config.lua or the environment variable it names "
      .. "(`demesne check-config` shows every value and where it came from)"):format(config.dir()))
  end
  local adapter, aerr = engines.check_adapter()
  if not adapter then
    local which = engines.adapter_name()
    if which == "kubernetes" then
      return fail(aerr, "correct the kubeconfig (the kubeconfig setting, DEMESNE_KUBECONFIG), or set engine back to "
        .. "a Podman or Docker socket")
    end
    return fail(aerr, ("correct %s/engines/%s.lua, or set engine_adapter back to docker"):format(config.dir(), which))
  end
  local missing = {}
  for _, r in ipairs(config.get("allowed_paths")) do
    local st = fs.stat(r)
    if not st or st.type ~= "directory" then missing[#missing + 1] = r end
  end
  if #missing > 0 then
    return fail(("allowed_paths: %s %s not an existing folder"):format(table.concat(missing, ", "),
      #missing == 1 and "is" or "are"), "create it, or remove it from DEMESNE_ALLOWED_PATHS (allowed_paths)")
  end
  local file = config.dir() .. "/config.lua"
  local roots = config.get("allowed_paths")
  return ok(("%s; %s; engine adapter %s"):format(fs.stat(file) and file or "no config file (defaults and environment)",
    #roots > 0 and ("host inputs from " .. table.concat(roots, ":")) or "no host inputs (DEMESNE_ALLOWED_PATHS unset)",
    adapter.name))
end

-- Whether `dir` can be written, or, when it does not exist yet, created: a probe file is
-- made and removed in it or in its nearest existing ancestor. Returns true, or nil and why.
local function writable(dir)
  local at = dir
  while true do
    local st = fs.stat(at)
    if st then
      if st.type ~= "directory" then return nil, at .. " is not a folder" end
      break
    end
    local up = at:match("^(.*)/[^/]*$")
    if not up or up == at then return nil, "no existing ancestor" end
    at = up == "" and "/" or up
  end
  local probe = ("%s/.demesne-doctor-%d"):format(at == "/" and "" or at, loop.getpid())
  local f, err = fs.open(probe, "wx", 384) -- 0600
  if not f then return nil, ("cannot write in %s: %s"):format(at, tostring(err)) end
  f:close()
  fs.unlink(probe)
  return true, at ~= dir and ("will be created under " .. at) or nil
end

local function check_folders()
  local found, problems = {}, {}
  for _, name in ipairs({ "output_root", "state_dir" }) do
    local dir = config.get(name)
    local w, note = writable(dir)
    if w then
      found[#found + 1] = ("%s %s%s"):format(name, dir, note and (" (" .. note .. ")") or "")
    else
      problems[#problems + 1] = ("%s %s: %s"):format(name, dir, note)
    end
  end
  if #problems > 0 then
    return fail(table.concat(problems, "; "), "make the folder writable by this user, or point DEMESNE_OUTPUT_ROOT / "
      .. "DEMESNE_STATE_DIR at one that is")
  end
  local open = sandbox.private_roots(false)
  if #open > 0 then
    return fail(table.concat(open, "; "), "make the folders private to this user (chmod 700), or put them on a "
      .. "filesystem mounted nosuid,nodev (see docs/explanation/trust-boundary.md)")
  end
  return ok(table.concat(found, ", ") .. ": writable, private to this user")
end

-- ELF facts from a file's header (the ELF specification: e_ident, e_machine, program
-- headers). Returns {machine = integer, interp = boolean}, or nil and why.
local function elf_info(path)
  local h = fs.read_file(path, 0, 64)
  if not h or #h < 52 or h:sub(1, 4) ~= "\127ELF" then return nil, "not an ELF executable" end
  local class, data = h:byte(5), h:byte(6)
  if (class ~= 1 and class ~= 2) or (data ~= 1 and data ~= 2) then return nil, "not an ELF executable" end
  local e = data == 1 and "<" or ">"
  local machine = string.unpack(e .. "I2", h, 19)
  local phoff, phentsize, phnum
  if class == 2 then
    if #h < 64 then return nil, "truncated ELF header" end
    phoff, phentsize, phnum = string.unpack(e .. "I8", h, 33), string.unpack(e .. "I2", h, 55),
      string.unpack(e .. "I2", h, 57)
  else
    phoff, phentsize, phnum = string.unpack(e .. "I4", h, 29), string.unpack(e .. "I2", h, 43),
      string.unpack(e .. "I2", h, 45)
  end
  if phnum > 512 or phentsize < 4 then return nil, "implausible ELF program headers" end
  local ph = fs.read_file(path, phoff, phnum * phentsize)
  if not ph or #ph < phnum * phentsize then return nil, "truncated ELF program headers" end
  local interp = false
  for i = 0, phnum - 1 do
    if string.unpack(e .. "I4", ph, i * phentsize + 1) == 3 then interp = true end -- PT_INTERP
  end
  return { machine = machine, interp = interp }
end

local function check_init()
  local path, err = config.init_path()
  if not path then
    return fail(err, "install demesne-init with demesne (the package puts it in /usr/libexec/demesne), or set "
      .. "DEMESNE_INIT=/path/to/demesne-init (`cmake --build` makes one beside demesne)")
  end
  local st = fs.stat(path)
  if not st or st.mode & 73 == 0 then -- 73 = 0111
    return fail(path .. " is not executable", "chmod 755 " .. path)
  end
  local elf, eerr = elf_info(path)
  if not elf then return fail(("%s: %s"):format(path, eerr), "point DEMESNE_INIT at the demesne-init binary") end
  if elf.interp then
    return fail(path .. " is dynamically linked: it runs inside sandboxes, whose images may not have its libraries",
      "use a static demesne-init (the CMake target links it with -static), or point DEMESNE_INIT at one")
  end
  local self = loop.exepath()
  local mine = self and elf_info(self)
  if mine and mine.machine ~= elf.machine then
    return fail(("%s is built for another machine (ELF e_machine %d, demesne is %d)"):format(path, elf.machine,
      mine.machine), "use the demesne-init built together with this demesne")
  end
  return ok(path .. " (static)")
end

-- Whether /etc/subuid and /etc/subgid give the user "containers" a range (rootful Podman's
-- userns=auto takes its ranges from there). Returns true, or false and the files without one.
local function containers_ranges()
  local missing = {}
  for _, f in ipairs({ "/etc/subuid", "/etc/subgid" }) do
    local text = fs.read_file(f, 0, 1024 * 1024) or ""
    local found = false
    for line in text:gmatch("[^\n]+") do
      if line:match("^containers:%d+:%d+$") then found = true end
    end
    if not found then missing[#missing + 1] = f end
  end
  return #missing == 0, missing
end

local function check_gvisor(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  if type(ctx.engine.probe) ~= "function" then
    return ok("the engine adapter does not say whether it offers gVisor (it has no probe method)")
  end
  local f, err = ctx.engine:probe({ gvisor = true })
  if not f then return fail("the engine did not answer: " .. tostring(err), "start the engine, then run doctor again") end
  ctx.facts = f
  local g = f.gvisor or {}
  local default = config.get("isolation_default")
  if g.ok then
    return ok(("available (isolation gvisor): %s%s"):format(g.detail,
      default == "gvisor" and "; sandboxes use it unless a call says otherwise" or ""))
  end
  if default == "gvisor" then
    return fail(("isolation_default is gvisor but gVisor is not available: %s"):format(tostring(g.detail)),
      tostring(g.fix) .. "; or set isolation_default back to container")
  end
  return ok(("not available, so calls that ask for isolation gvisor fail: %s (to offer it: %s)"):format(
    tostring(g.detail), tostring(g.fix)))
end

local function check_userns(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  local f = ctx.facts
  if not f and type(ctx.engine.probe) == "function" then f = ctx.engine:probe() end
  if not f then return ok("the engine adapter does not say whether it offers a user namespace") end
  if not config.get("userns") then
    return ok("off (userns = false in the configuration): uid 0 in a sandbox is uid 0 on the host, held back by "
      .. "namespaces, capabilities and seccomp")
  end
  if f.userns == "auto" then
    local have, missing = containers_ranges()
    if not have then
      return fail(("on, but %s give%s the user containers no range, so Podman cannot make one"):format(
        table.concat(missing, " and "), #missing == 1 and "s" or ""),
        "add the line containers:2147483647:2147483648 to /etc/subuid and /etc/subgid (or set userns = false)")
    end
  end
  if f.userns then return ok(("on: %s"):format(f.userns_detail)) end
  return ok(("not available: %s"):format(f.userns_detail))
end

local function check_limits(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  local f = ctx.facts
  if not f and type(ctx.engine.probe) == "function" then f = ctx.engine:probe() end
  if not f or not f.limits then return ok("the engine adapter does not say whether it enforces limits") end
  if f.limits.ok then return ok(("memory, process and CPU limits: %s"):format(f.limits.detail)) end
  if config.get("enforce_limits") then
    return fail(("not enforced: %s, so demesne starts no sandbox on this engine"):format(f.limits.detail), f.limits.fix)
  end
  return ok(("NOT enforced (%s): sandboxes run without memory, process and CPU limits, as enforce_limits = false "
    .. "allows"):format(f.limits.detail))
end

-- An engine whose "no network" is a policy someone else enforces (Kubernetes: a
-- NetworkPolicy, which only some network plugins honour) checks it for real, with a probe
-- on demesne's base image (eng:check_network, docs/reference/engines.md).
local function check_network(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  if type(ctx.engine.check_network) ~= "function" then
    return ok("network none gives a sandbox no interface but loopback")
  end
  local st = images.readiness(ctx.engine, "base")
  local r, err, code = ctx.engine:check_network(st and st.state == "built" and st.ref or nil)
  if not r and code == "ENOENT" then
    return { skip = tostring(err) .. " (build demesne's images on Podman or Docker and push them to the registry "
      .. "kubernetes_image_prefix names)" }
  end
  if not r then return fail(tostring(err), "see the probe Pod's events: kubectl describe pod demesne-probe-…") end
  if r.ok then return ok("closed: " .. r.detail) end
  return fail("OPEN: " .. r.detail .. ", so a sandbox there would not be cut off", r.fix)
end

-- The agent images and the CLI each installs (the build argument that pins its version).
local AGENT_CLIS = {
  { image = "agent-claude_code", cli = "Claude Code", arg = "CLAUDE_CODE_VERSION", package = "@anthropic-ai/claude-code" },
  { image = "agent-codex", cli = "Codex", arg = "CODEX_VERSION", package = "@openai/codex" },
}

-- The version an agent image's Containerfile pins (ARG NAME=version), or nil.
local function pinned_version(image, arg)
  local src = images.containerfile(image)
  return src and src:match("\n%s*ARG%s+" .. arg .. "=(%S+)") or nil
end

-- How old the agent CLIs in the built agent images are (since their image was built, which
-- is when the CLI was installed), against agent_cli_max_age_days.
local function check_agent_clis(ctx)
  if not ctx.engine then return { skip = "needs an engine" } end
  local max_days = config.get("agent_cli_max_age_days") or 0
  local seen, old = {}, {}
  for _, a in ipairs(AGENT_CLIS) do
    local tag = images.status(ctx.engine, a.image)
    local info = tag and ctx.engine:image_inspect(tag)
    if info and info.created then
      local age = os.time() - info.created
      local days = math.floor(age / 86400)
      local version = pinned_version(a.image, a.arg)
      local what = ("%s%s in %s, installed %d day%s ago"):format(a.cli, version and (" " .. version) or "", a.image,
        days, days == 1 and "" or "s")
      seen[#seen + 1] = what
      if max_days > 0 and age > max_days * 86400 then old[#old + 1] = { a = a, what = what } end
    end
  end
  if #seen == 0 then return ok("no agent image is built") end
  if #old == 0 then
    return ok(table.concat(seen, "; ") .. (max_days > 0 and (" (within agent_cli_max_age_days = %g)"):format(max_days)
      or " (agent_cli_max_age_days = 0: not checked)"))
  end
  local whats, fixes = {}, {}
  for _, o in ipairs(old) do
    whats[#whats + 1] = o.what
    fixes[#fixes + 1] = ("a user image %s (FROM %s, then RUN npm install -g %s@<newer version>) or a newer demesne, "
      .. "then `demesne images build %s`"):format(o.a.image, o.a.image, o.a.package, o.a.image)
  end
  return fail(("%s: older than agent_cli_max_age_days = %g (the CLIs release weekly)"):format(
    table.concat(whats, "; "), max_days), table.concat(fixes, "; ") .. " (see docs/reference/images.md)")
end

--- The checks, in the order they run and print: {name = string, run = function(ctx) -> result}.
--- Add a check by adding an entry; see the top of this file for the result shapes.
doctor.CHECKS = {
  { name = "engine", run = check_engine },
  { name = "images", run = check_images },
  { name = "agent-clis", run = check_agent_clis },
  { name = "config", run = check_config },
  { name = "folders", run = check_folders },
  { name = "demesne-init", run = check_init },
  { name = "gvisor", run = check_gvisor },
  { name = "userns", run = check_userns },
  { name = "limits", run = check_limits },
  { name = "network", run = check_network },
}

--- Runs every check in order (inside a task: the engine checks make requests). A check
--- that raises counts as failed, with the error as its detail. Returns a list of
--- {name, ok, skip, detail, fix} in the order of doctor.CHECKS.
---@return {name: string, ok: boolean, skip: string|nil, detail: string, fix: string|nil}[]
function doctor.run()
  local ctx, out = {}, {}
  for _, c in ipairs(doctor.CHECKS) do
    local pok, r = pcall(c.run, ctx)
    if not pok then
      r = fail(("the check failed: %s"):format(tostring(r)), "report this as a bug in demesne doctor")
    end
    out[#out + 1] = { name = c.name, ok = r.ok == true, skip = r.skip, detail = r.detail or r.skip or "", fix = r.fix }
  end
  -- what the checks started in the engine (the Kubernetes adapter's Lease) ends with them
  if ctx.engine and type(ctx.engine.close) == "function" then ctx.engine:close() end
  return out
end

return doctor
