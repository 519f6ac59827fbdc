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
  return ("%s/%s-%s%s"):format(dir, os.date("!%Y%m%dT%H%M%S"), text.hash(tostring({}) .. os.clock()), suffix)
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
    if not proc then
      -- not started (EMFILE, ENOENT…): the reason is the error, never an empty tail
      tail = ("cannot start %s: %s"):format(file, tostring(streams))
      cb(127)
      return
    end
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
  local _ <close> = setmetatable({}, { __close = function() os.remove(tar) end })
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
    local _ <close> = setmetatable({}, { __close = function() building[k] = nil; ev.set() end })
    progress(ctx, ("building image %s (%s) — first use only"):format(name, tag))
    files[#files + 1] = { name = "host-ca-certificates.crt", data = host_ca_certs(), mode = 420 }
    local tar = tmp_path(".context.tar")
    local _t <close> = setmetatable({}, { __close = function() os.remove(tar) end })
    local ok, perr = archive.pack(tar, files)
    if not ok then result.err = "packing the build context failed: " .. tostring(perr) return end
    local last = ""
    local berr
    ok, berr = eng:build(tar, { tag = tag, buildargs = { BASE = parent }, networkmode = "host",
      labels = { ["io.demesne.image"] = name } }, function(line)
      if line.stream and line.stream:match("%S") then
        last = line.stream:gsub("%s+$", "")
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

--------------------------------------------------------------------------------------------
-- Image references (the OCI distribution reference grammar, as distribution/reference
-- writes it):
--
--   reference        := name [ ":" tag ] [ "@" digest ]
--   name             := [domain "/"] path-component ["/" path-component]*   (at most 255 characters)
--   domain           := host [":" port]      host: domain-name | IPv4 | "[" IPv6 "]"
--   domain-component := [a-zA-Z0-9] | [a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]
--   path-component   := [a-z0-9]+ ( ("." | "_" | "__" | "-"+) [a-z0-9]+ )*
--   tag              := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
--   digest           := algorithm ":" [0-9a-fA-F]{32,}   algorithm: [A-Za-z][A-Za-z0-9]* ([+._-] [A-Za-z][A-Za-z0-9]*)*
--
-- As Docker decides it, the first component is a domain only when it holds a "." or a
-- ":" or is "localhost" (and there are more components); otherwise it is part of the
-- repository path, which must be lowercase.

local NAME_MAX = 255

local function path_component_ok(c)
  local _, e = c:find("^[a-z0-9]+")
  if not e then return false end
  local i = e + 1
  while i <= #c do
    local sep = c:match("^__", i) or c:match("^[._]", i) or c:match("^%-+", i)
    if not sep then return false end
    _, e = c:find("^[a-z0-9]+", i + #sep)
    if not e then return false end
    i = e + 1
  end
  return true
end

local function domain_ok(d)
  local host, port = d:match("^(.-):(%d+)$")
  host = host or d
  if port and (#port > 5 or tonumber(port) > 65535) then return false end
  if host:match("^%[[%x:.]+%]$") then return true end -- an IPv6 literal
  if host == "" or #host > 253 then return false end
  for label in (host .. "."):gmatch("(.-)%.") do
    if not (label:match("^[A-Za-z0-9]$") or label:match("^[A-Za-z0-9][A-Za-z0-9%-]*[A-Za-z0-9]$")) then return false end
  end
  return true
end

--- Checks an image reference against the OCI distribution reference grammar (above).
--- Returns true, or nil and the reason (a sentence without the field name).
---@param ref any
---@return boolean|nil ok, string|nil why
function images.check_reference(ref)
  if type(ref) ~= "string" then return nil, "must be a string" end
  if ref == "" then return nil, "must not be empty" end
  if #ref > NAME_MAX + 1 + 128 + 1 + 7 + 1 + 128 then return nil, ("is %d characters long, far over the grammar's limits"):format(#ref) end
  local rest, digest = ref, nil
  local at = ref:find("@", 1, true)
  if at then rest, digest = ref:sub(1, at - 1), ref:sub(at + 1) end
  if digest then
    local alg, hexd = digest:match("^([^:]+):(.*)$")
    local alg_ok = alg and (alg .. "+"):gsub("[A-Za-z][A-Za-z0-9]*[+._%-]", "") == ""
    if not (alg_ok and hexd:match("^%x+$") and #hexd >= 32) then
      return nil, ("has an invalid digest %q (algorithm:hex, e.g. sha256: and 64 hex digits)"):format(digest)
    end
  end
  local name, tag = rest, nil
  local colon = rest:match("^.*():") -- the last ':'
  if colon and not rest:find("/", colon, true) then name, tag = rest:sub(1, colon - 1), rest:sub(colon + 1) end
  if tag and not (tag:match("^[A-Za-z0-9_][A-Za-z0-9_.%-]*$") and #tag <= 128) then
    return nil, ("has an invalid tag %q (letters, digits, '_', '.' and '-', at most 128, not starting with '.' or '-')"):format(tag)
  end
  if name == "" then return nil, "has no repository name" end
  if #name > NAME_MAX then return nil, ("has a name of %d characters, more than %d"):format(#name, NAME_MAX) end
  local parts = {}
  for p in (name .. "/"):gmatch("(.-)/") do parts[#parts + 1] = p end
  local first = 1
  if #parts > 1 and (parts[1]:find("[.:]") or parts[1] == "localhost") then
    if not domain_ok(parts[1]) then return nil, ("has an invalid registry host %q"):format(parts[1]) end
    first = 2
  end
  for i = first, #parts do
    local c = parts[i]
    if not path_component_ok(c) then
      if c:lower() ~= c and path_component_ok(c:lower()) then return nil, "has uppercase letters: repository names must be lowercase" end
      return nil, ("has an invalid path component %q (lowercase letters and digits, separated by one '.', "
        .. "'_', '__' or dashes)"):format(c)
    end
  end
  return true
end

--- Makes sure an image is available. `name` is a built-in image (base, python, node, go,
--- default) or the reference of an image already present in the engine (checked against
--- the OCI reference grammar first: a malformed one never reaches the engine).
--- Returns {name=, ref=} or nil and a message that names `image` and lists the built-in names.
function images.ensure(eng, name, ctx)
  name = name or config.get("default_image")
  if images.BUILTIN[name] then
    local ref, err = ensure_builtin(eng, name, ctx)
    if not ref then return nil, err end
    return { name = name, ref = ref }
  end
  local ok, why = images.check_reference(name)
  if not ok then
    local shown = type(name) == "string" and #name > 80 and (name:sub(1, text.utf8_floor(name, 80)) .. "…") or name
    return nil, ("image: %q is not a valid image reference: it %s"):format(tostring(shown), why)
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

--- The names of the built-in images, sorted.
function images.list()
  local names = {}
  for n in pairs(images.BUILTIN) do names[#names + 1] = n end
  table.sort(names)
  return names
end

return images
