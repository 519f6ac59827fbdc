-- Container images: built locally from images/<name>/Containerfile through the engine on
-- first use, cached by a content hash of the build context (and of the parent image).
-- The base image's parent is debian:bookworm-slim from a registry when one answers,
-- otherwise a Debian root filesystem made by mmdebstrap from this machine's own apt
-- sources and imported into the engine.
local async = require("demesne.async")
local runtime = require("demesne.runtime")
local log = require("demesne.log")
local config = require("demesne.config")
local archive = require("core.archive")
local text = require("core.text")
local fs = require("core.fs")
local process = require("core.process")
local util = require("demesne.util")

local images = {}

--- Built-in images and their parents.
images.BUILTIN = {
  base = { parent = "@rootfs" },
  python = { parent = "base" },
  node = { parent = "base" },
  go = { parent = "base" },
  default = { parent = "base" },
  ["agent-claude_code"] = { parent = "base" },
  ["agent-codex"] = { parent = "base" },
}

local ROOTFS_REPO, ROOTFS_TAG = "demesne/debian-rootfs", "bookworm"
local REGISTRY_BASE = "docker.io/library/debian:bookworm-slim"
local ROOTFS_PACKAGES = "bash,coreutils,ca-certificates,curl,git,procps"

local building = {} -- "<engine socket>|<tag>" -> event, while a build runs
local known = {}    -- "<engine socket>|<tag>" -> true once seen

local function context_files(name)
  local prefix = "images/" .. name .. "/"
  local files = {}
  if runtime.source_dir then
    for _, n in ipairs(fs.readdir(runtime.source_dir .. "/" .. prefix) or {}) do
      files[#files + 1] = prefix .. n
    end
  else
    for rel in pairs(require("core.loop").embedded()) do
      if rel:sub(1, #prefix) == prefix then files[#files + 1] = rel end
    end
  end
  table.sort(files)
  local out = {}
  for _, rel in ipairs(files) do
    local src = runtime.source(rel)
    if src then out[#out + 1] = { name = rel:sub(#prefix + 1), data = src, mode = 420 } end
  end
  return out
end

local function tmp_path(suffix)
  local dir = config.get("state_dir") .. "/tmp"
  fs.mkdir_p(dir)
  return ("%s/%s%s"):format(dir, util.new_id("", 8), suffix)
end

local function progress(ctx, msg)
  log.info("demesne.images", "%s", msg)
  if ctx and ctx.progress then
    ctx._image_steps = (ctx._image_steps or 0) + 1
    ctx.progress(ctx._image_steps, nil, msg)
  end
end

-- Runs a program to completion; returns exit code and the tail of its stderr.
local function run(file, args)
  local tail = ""
  local code = async.await(function(cb)
    local proc, streams = process.spawn({ file = file, args = args, stderr = true, stdout = true }, function(c) cb(c) end)
    if not proc then cb(127); return end
    for _, s in pairs(streams) do
      s:read_start(function(chunk)
        if chunk then tail = (tail .. chunk):sub(-2000) else s:close() end
      end)
    end
    return function() proc:kill("KILL") end
  end)
  return code, tail
end

local function apt_sources()
  for _, p in ipairs({ "/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list" }) do
    local st = fs.stat(p)
    if st and st.type == "file" and st.size > 0 then return p end
  end
end

-- The parent of the base image: the registry's debian image, or an mmdebstrap rootfs.
local function ensure_rootfs(eng, ctx, dry)
  local ref = ROOTFS_REPO .. ":" .. ROOTFS_TAG
  if eng:image_inspect(ref) then return ref end
  if eng:image_inspect(REGISTRY_BASE) then return REGISTRY_BASE end
  if dry then return nil, "not built" end
  progress(ctx, "pulling " .. REGISTRY_BASE)
  if os.getenv("DEMESNE_NO_PULL") ~= "1" and eng:pull(REGISTRY_BASE, 30000) then return REGISTRY_BASE end
  progress(ctx, "no registry reachable: building a Debian root filesystem with mmdebstrap")
  local tar = tmp_path(".rootfs.tar")
  local _ <close> = util.closer(function() os.remove(tar) end)
  local args = { "--variant=minbase", "--include=" .. ROOTFS_PACKAGES, "--format=tar",
    "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    -- the host's resolver and name must not leak into the image
    "--customize-hook=rm -f \"$1/etc/resolv.conf\" \"$1/etc/hostname\"",
    "bookworm", tar }
  local sources = apt_sources()
  if sources then args[#args + 1] = sources end
  local code, err = run("mmdebstrap", args)
  if code ~= 0 then
    return nil, ("building the base root filesystem failed (mmdebstrap exit %s): %s"):format(tostring(code), err)
  end
  progress(ctx, "importing the root filesystem into the engine")
  local ok, ierr = eng:import(tar, ROOTFS_REPO, ROOTFS_TAG)
  if not ok then return nil, ierr end
  return ref
end

-- The certificate authorities the host added (/usr/local/share/ca-certificates/*.crt), put
-- into every build context as host-ca-certificates.crt (not part of the tag): behind a
-- TLS-intercepting proxy, a build step that downloads over HTTPS (npm) needs them.
local function host_ca_certs()
  local dir, parts = "/usr/local/share/ca-certificates", {}
  local names = fs.readdir(dir) or {}
  table.sort(names)
  for _, n in ipairs(names) do
    local f = n:match("%.crt$") and io.open(dir .. "/" .. n, "rb")
    if f then parts[#parts + 1] = f:read("a"); f:close() end
  end
  return table.concat(parts, "\n")
end

-- Builds (or finds) the image `name`; returns its tag. With `dry`, builds nothing:
-- returns the tag when the image is present, else nil and the reason.
local function ensure_builtin(eng, name, ctx, dry)
  local spec = images.BUILTIN[name]
  local parent, err
  if spec.parent == "@rootfs" then
    parent, err = ensure_rootfs(eng, ctx, dry)
  else
    parent, err = ensure_builtin(eng, spec.parent, ctx, dry)
  end
  if not parent then return nil, err end
  local files = context_files(name)
  if #files == 0 then return nil, ("image %q has no build context in this binary"):format(name) end
  local key = { parent }
  for _, f in ipairs(files) do key[#key + 1] = f.name .. "\0" .. f.data end
  local tag = ("demesne/%s:%s"):format(name, text.hash(table.concat(key, "\0")):sub(1, 12))
  local k = eng.socket .. "|" .. tag
  if known[k] then return tag end
  while building[k] do building[k].wait() end
  if known[k] then return tag end
  if eng:image_inspect(tag) then
    known[k] = true
    return tag
  end
  if dry then return nil, "not built" end
  -- The build runs in a task of its own: a caller that is cancelled stops waiting, but
  -- the engine's build goes on, and the next caller joins it instead of starting another.
  local ev = async.event()
  building[k] = ev
  local result = {}
  async.spawn("build " .. name, function()
    local _ <close> = util.closer(function() building[k] = nil; ev.set() end)
    progress(ctx, ("building image %s (%s) — first use only"):format(name, tag))
    files[#files + 1] = { name = "host-ca-certificates.crt", data = host_ca_certs(), mode = 420 }
    local tar = tmp_path(".context.tar")
    local _t <close> = util.closer(function() os.remove(tar) end)
    local ok, perr = archive.pack(tar, files)
    if not ok then result.err = "packing the build context failed: " .. tostring(perr) return end
    local last = ""
    local berr
    ok, berr = eng:build(tar, { tag = tag, buildargs = { BASE = parent }, network = "host",
      labels = { ["io.demesne.image"] = name } }, function(line)
      if line:match("%S") then
        last = line:gsub("%s+$", "")
        if last:match("^STEP") or last:match("^Step") then progress(ctx, name .. ": " .. last) end
      end
    end)
    if not ok then result.err = ("building image %s failed: %s (last output: %s)"):format(name, berr, last) return end
    known[k] = true
  end)
  ev.wait()
  if result.err then return nil, result.err end
  if not known[k] then return nil, ("building image %s did not finish"):format(name) end
  return tag
end

--- Makes sure an image is available. `name` is a built-in image (base, python, node, go,
--- default) or the reference of an image already present in the engine.
--- Returns {name=, ref=} or nil and a message that lists the built-in names.
function images.ensure(eng, name, ctx)
  name = name or config.get("default_image")
  if images.BUILTIN[name] then
    local ref, err = ensure_builtin(eng, name, ctx)
    if not ref then return nil, err end
    return { name = name, ref = ref }
  end
  if eng:image_inspect(name) then return { name = name, ref = name } end
  local names = {}
  for n in pairs(images.BUILTIN) do names[#names + 1] = n end
  table.sort(names)
  return nil, ("image: %q is neither a built-in image (%s) nor an image present in the engine"):format(name,
    table.concat(names, ", "))
end

--- Whether a built-in image is present in the engine, without building anything.
--- Returns its tag, or nil and "not built".
function images.status(eng, name)
  return ensure_builtin(eng, name, nil, true)
end

-- The first executable file `prog` in $PATH, or nil.
local function on_path(prog)
  for dir in (os.getenv("PATH") or "/usr/local/bin:/usr/bin:/bin"):gmatch("[^:]+") do
    local st = fs.stat(dir .. "/" .. prog)
    if st and st.type == "file" and st.mode & 73 ~= 0 then return dir .. "/" .. prog end -- 73 = 0111
  end
end

-- Whether an apt sources file names at least one binary ("deb") source, in the one-line
-- format (sources.list(5): "deb URI SUITE ...") or deb822 ("Types: deb ...").
local function has_deb_source(path)
  local data = fs.read_file(path, 0, 1024 * 1024)
  if not data then return false end
  for line in data:gmatch("[^\n]+") do
    if line:match("^%s*deb%s") or line:match("^%s*deb%[") then return true end
    local types = line:match("^[Tt]ypes:%s*(.*)$")
    if types then
      for w in types:gmatch("%S+") do if w == "deb" then return true end end
    end
  end
  return false
end

--- Whether image `name` (a built-in name or an image reference) can be used here, without
--- building or pulling anything. Returns one of
---   {state = "built", ref = tag}                  the image is in the engine
---   {state = "buildable", from = ref}             the Debian root filesystem image is in the engine
---   {state = "buildable", from = "mmdebstrap", mmdebstrap = path, sources = path|nil}
---                                                 mmdebstrap can make the root filesystem from
---                                                 this machine's apt sources (nil: its default mirror)
--- or nil, the reason and the fix. A registry that would serve debian:bookworm-slim is not
--- asked (that would need the network): without mmdebstrap the answer is nil.
---@param eng table  an engine adapter
---@param name string
---@return table|nil state, string|nil reason, string|nil fix
function images.readiness(eng, name)
  if not images.BUILTIN[name] then
    if eng:image_inspect(name) then return { state = "built", ref = name } end
    return nil, ("image %q is neither built-in nor present in the engine"):format(name),
      ("pull or build %s into the engine, or set default_image to a built-in image (%s)"):format(name,
        table.concat(images.list(), ", "))
  end
  local tag = images.status(eng, name)
  if tag then return { state = "built", ref = tag } end
  local rootfs = ensure_rootfs(eng, nil, true)
  if rootfs then return { state = "buildable", from = rootfs } end
  local mm = on_path("mmdebstrap")
  if not mm then
    return nil, ("image %s is not built, no Debian root filesystem image is in the engine, and mmdebstrap is not "
      .. "installed to make one"):format(name),
      "apt-get install mmdebstrap, then `demesne images build` (or run `demesne images build` where a registry "
      .. "serving " .. REGISTRY_BASE .. " is reachable)"
  end
  local sources = apt_sources()
  if sources and not has_deb_source(sources) then
    return nil, ("image %s is not built and mmdebstrap would use %s, which names no \"deb\" source"):format(name,
      sources), "add a Debian mirror to " .. sources .. " (see sources.list(5)), then `demesne images build`"
  end
  return { state = "buildable", from = "mmdebstrap", mmdebstrap = mm, sources = sources }
end

--- The names of the built-in images, sorted.
function images.list()
  local names = {}
  for n in pairs(images.BUILTIN) do names[#names + 1] = n end
  table.sort(names)
  return names
end

return images
