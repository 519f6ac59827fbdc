-- Container images: built locally through the engine on first use, cached by a content hash
-- of the build context (and of the parent images' tags).
-- Built-in images come from images/<name>/ (embedded in the binary, or the source tree).
-- User images come from $XDG_CONFIG_HOME/demesne/images/<name>/ (a Containerfile and its
-- context); one may build FROM any demesne image by name, and one with a built-in's name
-- replaces that built-in. The base image's parent is debian:bookworm-slim from a registry
-- when one answers, otherwise a Debian root filesystem made by mmdebstrap from this
-- machine's own apt sources and imported into the engine.
local async = require("demesne.async")
local runtime = require("demesne.runtime")
local log = require("demesne.log")
local config = require("demesne.config")
local archive = require("core.archive")
local text = require("core.text")
local fs = require("core.fs")
local process = require("core.process")
local plugins = require("demesne.plugins")
local registries = require("demesne.registries")
local util = require("demesne.util")

local images = {}

--- Built-in images: `parent` is the image each builds FROM (passed as the build argument
--- BASE); `user_context` names folders a user may add to the build context from
--- $XDG_CONFIG_HOME/demesne/images/<name>/<folder>/ (see images/twine/README.md).
images.BUILTIN = {
  base = { parent = "@rootfs" },
  python = { parent = "base" },
  node = { parent = "base" },
  go = { parent = "base" },
  default = { parent = "base" },
  ["agent-claude_code"] = { parent = "base" },
  ["agent-codex"] = { parent = "base" },
  browser = { parent = "base" },
  media = { parent = "base" },
  webgamedev = { parent = "browser" },
  twine = { parent = "browser", user_context = { "storyformats" } },
}

--- Limits on a user image's folder, read whole into memory to hash it.
images.USER_MAX_FILES = 10000
images.USER_MAX_BYTES = 256 * 1024 * 1024

local ROOTFS_REPO, ROOTFS_TAG = "demesne/debian-rootfs", "bookworm"
local REGISTRY_BASE = "docker.io/library/debian:bookworm-slim"
local ROOTFS_PACKAGES = "bash,coreutils,ca-certificates,curl,git,procps"
local NAME_PATTERN = "^[a-z0-9][a-z0-9_.-]*$"
local NOTE_PATTERN = "^%s*demesne%-note:%s*(.-)%s*$" -- a build output line that is a note
local NOTES_LABEL = "io.demesne.notes"

local building = {} -- "<engine socket>|<tag>" -> event, while a build runs
local known = {}    -- "<engine socket>|<tag>" -> true once seen
local resolved = setmetatable({}, { __mode = "k" }) -- engine -> built-in name -> tag, once images.ensure found it

--- The folder users drop their own images into: $XDG_CONFIG_HOME/demesne/images.
---@return string
function images.user_dir() return config.dir() .. "/images" end

-- Whether `name` is a usable image name (lower-case letters, digits, `_`, `.`, `-`).
local function valid_name(name)
  return type(name) == "string" and #name <= 64 and name:match(NAME_PATTERN) ~= nil
end

-- A built-in image's context: every file under images/<name>/, recursively, except what
-- npm or a build leaves there (node_modules/, dist/).
local function builtin_files(name)
  local prefix = "images/" .. name .. "/"
  local rels = {}
  if runtime.source_dir then
    local function walk(rel)
      for _, n in ipairs(fs.readdir(runtime.source_dir .. "/" .. prefix .. rel) or {}) do
        local st = fs.lstat(runtime.source_dir .. "/" .. prefix .. rel .. n)
        if st and st.type == "directory" and n ~= "node_modules" and n ~= "dist" then
          walk(rel .. n .. "/")
        elseif st and st.type == "file" then
          rels[#rels + 1] = rel .. n
        end
      end
    end
    walk("")
  else
    for rel in pairs(runtime.embedded) do
      if rel:sub(1, #prefix) == prefix then rels[#rels + 1] = rel:sub(#prefix + 1) end
    end
  end
  table.sort(rels)
  local out = {}
  for _, rel in ipairs(rels) do
    local src = runtime.source(prefix .. rel)
    if src then out[#out + 1] = { name = rel, data = src, mode = 420 } end
  end
  return out
end

-- Reads a folder of the user's into a context list {name, data, mode}, recursively and
-- sorted. Regular files and folders only: a symlink, socket or device is refused by name.
-- Returns the list, or nil and a message.
local function read_folder(dir, prefix, out, total)
  out, total = out or {}, total or { bytes = 0 }
  local names, err = fs.readdir(dir)
  if not names then return nil, err end
  for _, n in ipairs(names) do
    local path, rel = dir .. "/" .. n, (prefix or "") .. n
    local st, serr = fs.lstat(path)
    if not st then return nil, serr end
    if st.type == "directory" then
      local ok, rerr = read_folder(path, rel .. "/", out, total)
      if not ok then return nil, rerr end
    elseif st.type == "file" then
      if #out >= images.USER_MAX_FILES then
        return nil, ("%s holds more than %d files"):format(dir, images.USER_MAX_FILES)
      end
      total.bytes = total.bytes + st.size
      if total.bytes > images.USER_MAX_BYTES then
        return nil, ("the files under %s add up to more than %d MiB"):format(dir, images.USER_MAX_BYTES // 1048576)
      end
      local data, rerr = fs.read_file(path)
      if not data then return nil, rerr end
      out[#out + 1] = { name = rel, data = data, mode = st.mode & 511 }
    else
      return nil, ("%s is a %s: an image folder may hold only files and folders (copy the file in)"):format(path,
        st.type == "link" and "symlink" or st.type)
    end
  end
  return out
end

--- Every image as a plugin (demesne.plugins, folder plugins): the built-in images/<name>/
--- folders, then the user's $XDG_CONFIG_HOME/demesne/images/<name>/ folders holding a
--- Containerfile; a user image replaces a built-in of its name. A folder whose name is not
--- an image name, or a built-in folder with no entry in images.BUILTIN, is refused into the
--- set's errors. A user folder without a Containerfile offers no image (it may hold extra
--- context of a built-in, images/twine/storyformats/). Each plugin is {name, origin =
--- "built-in" | "user", dir = the user's folder}. Read from disk at each call.
---@return PluginSet
function images.catalog()
  return plugins.load({
    kind = "image", kinds = "images", logger = "demesne.images", quiet = true, folders = true,
    builtin = "images/", user_dir = images.user_dir(),
    check = function(_, file)
      if not valid_name(file.name) then
        return nil, ("%q is not an image name (lower-case letters, digits, _ . -, at most 64)"):format(file.name)
      end
      if file.builtin then
        if not images.BUILTIN[file.name] then return nil, "a built-in image needs its entry in images.BUILTIN" end
        return { name = file.name, origin = "built-in" }
      end
      local st = fs.stat(file.dir .. "/Containerfile")
      if not (st and st.type == "file") then return false end
      return { name = file.name, origin = "user", dir = file.dir }
    end,
  })
end

-- The user's image folder for `name`, when it holds a Containerfile.
local function user_image_dir(name)
  if not valid_name(name) then return nil end
  local img = images.catalog():get(name)
  return img and img.dir
end

--- The names of the user's images (folders with a Containerfile), sorted. Folders whose
--- names are not valid image names are left out (images.catalog().errors names them).
---@return string[]
function images.user_names()
  local out = {}
  for _, img in ipairs(images.catalog():list()) do
    if img.origin == "user" then out[#out + 1] = img.name end
  end
  table.sort(out)
  return out
end

--- Every image name, built-in and user, sorted; each once.
---@return string[]
function images.list()
  local names = {}
  for _, img in ipairs(images.catalog():list()) do names[#names + 1] = img.name end
  table.sort(names)
  return names
end

--- Where an image comes from: "user" (it replaces a built-in of the same name),
--- "built-in", or nil when there is no image of that name.
---@param name string
---@return string|nil origin, string|nil dir  dir: the user's folder
function images.origin(name)
  if not valid_name(name) then return nil end
  local img = images.catalog():get(name)
  if img then return img.origin, img.dir end
end

--- The images a Containerfile builds FROM, in order: {line=n, ref=word, stage=alias|nil}.
--- `ref` is the image word as written (`${BASE}`, `python`, `debian:bookworm`, a stage
--- alias); flags such as --platform are skipped. Line continuations are not followed.
---@param src string
---@return {line: integer, ref: string, stage: string|nil}[]
function images.parse_from(src)
  local out, n = {}, 0
  for line in (src .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    local rest = line:match("^%s*[Ff][Rr][Oo][Mm]%s+(.*)$")
    if rest then
      local words = {}
      for w in rest:gmatch("%S+") do words[#words + 1] = w end
      local i = 1
      while words[i] and words[i]:sub(1, 2) == "--" do i = i + 1 end
      if words[i] then
        local stage = words[i + 1] and words[i + 1]:lower() == "as" and words[i + 2] or nil
        out[#out + 1] = { line = n, ref = words[i], stage = stage }
      end
    end
  end
  return out
end

--- Rewrites the FROM lines of a user's Containerfile: each image word that names a demesne
--- image (and no stage defined above it) becomes `tags[word]`. Returns the new text.
---@param src string
---@param tags table<string, string>  image name -> the tag it was built as
---@return string
local function rewrite_from(src, tags)
  local stages, lines = {}, {}
  for line, nl in src:gmatch("([^\n]*)(\n?)") do
    if line:match("^%s*[Ff][Rr][Oo][Mm]%s") then
      local words = {}
      for from, w, to in line:gmatch("()(%S+)()") do words[#words + 1] = { from = from, w = w, to = to } end
      local i = 2
      while words[i] and words[i].w:sub(1, 2) == "--" do i = i + 1 end
      local img = words[i]
      if img and not stages[img.w] and tags[img.w] then
        line = line:sub(1, img.from - 1) .. tags[img.w] .. line:sub(img.to)
      end
      if img and words[i + 1] and words[i + 1].w:lower() == "as" and words[i + 2] then stages[words[i + 2].w] = true end
    end
    lines[#lines + 1] = line .. nl
  end
  return table.concat(lines)
end

--- The same, for tests: rewrite_from(src, {name = tag}).
images._rewrite_from = rewrite_from

local function tmp_path(suffix)
  local dir = config.get("state_dir") .. "/tmp"
  fs.mkdir_p(dir, 448) -- 0700: the state folder is the server user's alone (sandbox.private_roots)
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
  if os.getenv("DEMESNE_NO_PULL") ~= "1" and config.get("image_pull") and eng:pull(REGISTRY_BASE, 30000) then
    return REGISTRY_BASE
  end
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

--- Whether demesne may pull from `registry` (host[:port]): image_pull is on, and with
--- DEMESNE_NO_PULL=1 (tests, machines without a registry) only a registry config.lua's
--- `registries` names. Returns true, or false and why.
---@param registry string
---@return boolean ok, string|nil why
function images.pull_allowed(registry)
  if not config.get("image_pull") then return false, "image_pull is false" end
  if os.getenv("DEMESNE_NO_PULL") == "1" and not registries.conf(registry) then
    return false, ("DEMESNE_NO_PULL=1 and config.lua's registries does not name %s"):format(registry)
  end
  return true
end

local pulling = {} -- "<engine socket>|<ref>" -> event, while a pull runs

-- One pull of `ref` (from `registry`, with the host's credentials for it). Returns true, or
-- nil, a message that names the registry (scrubbed of the credential) and the code.
local function pull_one(eng, ref, registry, ctx)
  local cred, cerr = registries.credentials(ref)
  if cerr then return nil, ("image: %s: %s"):format(ref, cerr), "EACCES" end
  progress(ctx, ("pulling %s from %s%s"):format(ref, registry, cred and " with the host's credentials" or ""))
  local timeout_ms = math.floor((config.get("image_pull_timeout_seconds") or 600) * 1000)
  local ok, err, code = eng:pull(ref, timeout_ms, nil, { auth = cred })
  if ok then return true end
  err = registries.scrub(err, { cred })
  if code == "EACCES" then
    if cred then
      return nil, ("image: registry %s refused the credentials for %s (from %s): %s. Log in again (`podman login "
        .. "%s` or `docker login %s`)"):format(registry, ref, cred.source, err, registry, registry), code
    end
    local files = {}
    for _, f in ipairs(registries.auth_files()) do files[#files + 1] = f.path end
    return nil, ("image: registry %s wants credentials for %s and the host has none for it (looked in %s): %s. "
      .. "Log in with `podman login %s` or `docker login %s`"):format(registry, ref, table.concat(files, ", "), err,
      registry, registry), code
  end
  local none = ""
  if not cred then
    local files = {}
    for _, f in ipairs(registries.auth_files()) do files[#files + 1] = f.path end
    none = (" (no credentials were sent: the host has none for %s in %s)"):format(registry, table.concat(files, ", "))
  end
  return nil, ("image: pulling %s from registry %s failed: %s%s"):format(ref, registry, err, none), code or "EPULL"
end

--- Pulls an image reference into the engine with the host's own registry credentials
--- (lua/registries.lua), trying the registry's mirrors of config.lua first (a mirror's
--- image is then tagged as `ref`). Credentials go to the engine for the pull only. A pull
--- of the same reference that is already running is joined. Returns true, or nil, a
--- message naming the registry, and a code ("EACCES": credentials refused or missing;
--- "EPULL"; "EPOLICY": pulls are off for that registry).
---@param eng table  an engine adapter
---@param ref string  an image reference (images.check_reference accepts it)
---@param ctx ToolContext|nil  gets progress
---@return boolean|nil ok, string|nil err, string|nil code
function images.pull(eng, ref, ctx)
  local registry, path, suffix = registries.split(ref)
  local allowed, why = images.pull_allowed(registry)
  if not allowed then
    return nil, ("image: %q is not in the engine, and it is not pulled from %s: %s"):format(ref, registry, why), "EPOLICY"
  end
  local conf, cerr = registries.config()
  if not conf then return nil, "image: " .. cerr, "EINVAL" end
  local k = eng.socket .. "|" .. ref
  if pulling[k] then
    while pulling[k] do pulling[k].wait() end
    if eng:image_inspect(ref) then return true end -- the pull this one joined brought it
  end
  local ev = async.event()
  pulling[k] = ev
  local _ <close> = util.closer(function() pulling[k] = nil; ev.set() end)
  local errs = {}
  for _, mirror in ipairs(conf[registry] and conf[registry].mirrors or {}) do
    if type(eng.tag) ~= "function" then
      errs[#errs + 1] = ("mirror %s: this engine adapter cannot tag images"):format(mirror)
      break
    end
    local mref = mirror .. "/" .. path .. suffix
    local ok, merr = pull_one(eng, mref, (mirror:match("^[^/]+")), ctx)
    if ok then
      local tok, terr = eng:tag(mref, ref)
      if tok then return true end
      errs[#errs + 1] = ("mirror %s: %s"):format(mirror, terr)
    else
      errs[#errs + 1] = ("mirror %s: %s"):format(mirror, merr)
    end
  end
  local ok, err, code = pull_one(eng, ref, registry, ctx)
  if ok then return true end
  if #errs > 0 then err = err .. " (after its mirrors: " .. table.concat(errs, "; ") .. ")" end
  return nil, err, code
end

-- The image references the FROM lines of a Containerfile name outside demesne (no build
-- stage, no variable, not scratch), each once, in order.
local function external_froms(src)
  local out, seen, stages = {}, {}, {}
  for _, f in ipairs(images.parse_from(src)) do
    local r = f.ref
    if not stages[r] and not seen[r] and r ~= "scratch" and not r:find("$", 1, true) and images.check_reference(r) then
      seen[r] = true
      out[#out + 1] = r
    end
    if f.stage then stages[f.stage] = true end
  end
  return out
end
--- The same, for tests: the image references a Containerfile's FROM lines name outside demesne.
---@param src string
---@return string[]
images._external_froms = function(src) return external_froms(src) end

-- Before a build: every FROM image of the plan's Containerfile that is not in the engine is
-- pulled (with the host's credentials; with `refresh`, pulled again when its registry may be
-- asked). Returns the credentials of those registries (server -> credential, for the
-- build's X-Registry-Config), or nil and a message.
local function prepare_froms(eng, plan, ctx)
  local name = plan.dockerfile or "Containerfile"
  local src
  for _, f in ipairs(plan.files) do if f.name == name then src = f.data end end
  local auth, used = {}, {}
  for _, ref in ipairs(external_froms(src or "")) do
    local present = eng:image_inspect(ref)
    local registry = registries.split(ref)
    if not present or (plan.refresh and images.pull_allowed(registry)) then
      local ok, err = images.pull(eng, ref, ctx)
      if not ok then return nil, ("image %s: FROM %s: %s"):format(plan.name, ref, err) end
    end
    if not used[registry] then
      used[registry] = true
      local cred = registries.credentials(ref)
      if cred then auth[cred.server] = cred end
    end
  end
  return auth
end

-- Builds `plan` (tag, files, buildargs, labels; refresh: build again without the engine's
-- cache, and pull its FROM images again, even when the tag is present) unless it is
-- present; joins a build of the same tag that is already running. Returns the tag, or nil
-- and a message (with `dry`: nil, "not built" and the tag it would be built as).
local function build(eng, plan, ctx, dry)
  local name, tag = plan.name, plan.tag
  local k = eng.socket .. "|" .. tag
  if known[k] and not plan.refresh then return tag end
  while building[k] do building[k].wait() end
  if known[k] and not plan.refresh then return tag end
  if not plan.refresh and eng:image_inspect(tag) then
    known[k] = true
    return tag
  end
  if dry then return nil, "not built", tag end
  -- The build runs in a task of its own: a caller that is cancelled stops waiting, but
  -- the engine's build goes on, and the next caller joins it instead of starting another.
  local ev = async.event()
  building[k] = ev
  local result = {}
  async.spawn("build " .. name, function()
    local _ <close> = util.closer(function() building[k] = nil; ev.set() end)
    progress(ctx, ("building image %s (%s) — first use only"):format(name, tag))
    local files = { table.unpack(plan.files) }
    local has_ca = false
    for _, f in ipairs(files) do has_ca = has_ca or f.name == "host-ca-certificates.crt" end
    if not has_ca then files[#files + 1] = { name = "host-ca-certificates.crt", data = host_ca_certs(), mode = 420 } end
    local tar = tmp_path(".context.tar")
    local _t <close> = util.closer(function() os.remove(tar) end)
    local ok, perr = archive.pack(tar, files)
    if not ok then result.err = "packing the build context failed: " .. tostring(perr) return end
    local auth, aerr = prepare_froms(eng, plan, ctx)
    if not auth then result.err = aerr return end
    local last, tail, notes = "", {}, {}
    local berr
    ok, berr = eng:build(tar, { tag = tag, buildargs = plan.buildargs, network = plan.network or "host",
      labels = plan.labels, dockerfile = plan.dockerfile, target = plan.target, registry_auth = auth,
      no_cache = plan.refresh or nil },
      function(chunk)
        for l in chunk:gmatch("[^\r\n]+") do
          if l:match("%S") then
            last = l:gsub("%s+$", "")
            tail[#tail + 1] = last
            if #tail > 20 then table.remove(tail, 1) end
          end
          local note = l:match(NOTE_PATTERN)
          if note and note ~= "" and not notes[note] then
            notes[note] = true
            notes[#notes + 1] = note
            progress(ctx, name .. ": " .. note)
          elseif l:match("^%[%d+/%d+%] STEP %d") or l:match("^STEP %d") or l:match("^Step %d") then
            progress(ctx, name .. ": " .. l)
          end
        end
      end)
    if not ok then
      local creds = {}
      for _, c in pairs(auth) do creds[#creds + 1] = c end
      if plan.tail then -- the end of the build's output, for a build the user wrote (lua/images/devcontainer.lua)
        result.err = registries.scrub(("building image %s failed: %s; the end of its output:\n%s"):format(name,
          (tostring(berr):gsub("%s+$", "")), table.concat(tail, "\n")), creds)
      else
        result.err = registries.scrub(("building image %s failed: %s (last output: %s)"):format(name, berr, last), creds)
      end
      return
    end
    -- Notes the build printed ("demesne-note: …") become a label of the image, so that they
    -- can be shown for it later: a second, one-line build on top of it, under the same tag.
    -- A step the engine takes from its cache prints nothing: an image prints its notes in
    -- a step after `ARG DEMESNE_TAG` (the build argument is the tag), which runs on every
    -- build of a new tag.
    if #notes > 0 then
      local labels = { [NOTES_LABEL] = table.concat(notes, "\n") }
      for lk, lv in pairs(plan.labels) do labels[lk] = lv end
      local ntar = tmp_path(".notes.tar")
      local _n <close> = util.closer(function() os.remove(ntar) end)
      ok, perr = archive.pack(ntar, { { name = "Containerfile", data = "ARG BASE\nFROM ${BASE}\n" } })
      if ok then ok, perr = eng:build(ntar, { tag = tag, buildargs = { BASE = tag }, labels = labels }) end
      if not ok then log.warning("demesne.images", "image %s: could not record its notes: %s", name, tostring(perr)) end
    end
    known[k] = true
  end)
  ev.wait()
  if result.err then return nil, result.err end
  if not known[k] then return nil, ("building image %s did not finish"):format(name) end
  return tag
end

local ensure_named

-- The tag of a content key: demesne/<name>:<12 hex digits>.
local function tag_of(name, key)
  return ("demesne/%s:%s"):format(name, text.hash(table.concat(key, "\0")):sub(1, 12))
end

-- Whether this resolution rebuilds `name` without the cache: it is the image asked for
-- (not a parent on the way) and the caller asked for a refresh (images.rebuild).
local function refreshing(visiting, name)
  return visiting.refresh == name and #visiting == 1 or nil
end

-- A built-in image: its parent first, then its own context (plus the user folders it takes).
local function ensure_builtin(eng, name, ctx, dry, visiting)
  local spec = images.BUILTIN[name]
  local parent, err
  if spec.parent == "@rootfs" then
    parent, err = ensure_rootfs(eng, ctx, dry)
  else
    parent, err = ensure_named(eng, spec.parent, ctx, dry, visiting)
  end
  if not parent then return nil, err end
  local files = builtin_files(name)
  if #files == 0 then return nil, ("image %q has no build context in this binary"):format(name) end
  for _, folder in ipairs(spec.user_context or {}) do
    local dir = images.user_dir() .. "/" .. name .. "/" .. folder
    local st = fs.stat(dir)
    if st and st.type == "directory" then
      local extra, rerr = read_folder(dir, folder .. "/")
      if not extra then return nil, ("image %s: %s"):format(name, rerr) end
      local byname = {}
      for i, f in ipairs(files) do byname[f.name] = i end
      for _, f in ipairs(extra) do
        if byname[f.name] then files[byname[f.name]] = f else files[#files + 1] = f end
      end
      table.sort(files, function(a, b) return a.name < b.name end)
    end
  end
  local key = { parent }
  for _, f in ipairs(files) do key[#key + 1] = f.name .. "\0" .. f.data end
  local tag = tag_of(name, key)
  local buildargs = { BASE = parent, DEMESNE_TAG = tag }
  if name == "twine" then -- images/twine/install-storyformats.sh
    buildargs.TWINE_FETCH_OFFICIAL = config.get("twine_official_formats") and "1" or "0"
  end
  return build(eng, { name = name, tag = tag, files = files, buildargs = buildargs, refresh = refreshing(visiting, name),
    labels = { ["io.demesne.image"] = name, ["io.demesne.origin"] = "built-in" } }, ctx, dry)
end

-- A user image: every demesne image its FROM lines name, then its own folder. Inside the
-- user image `name`, `FROM name` means the built-in `name` it replaces. BASE is the base
-- image (its root filesystem for a user image named base).
local function ensure_user(eng, name, dir, ctx, dry, visiting)
  local files, err = read_folder(dir)
  if not files then return nil, ("image %s (%s): %s"):format(name, dir, err) end
  local containerfile
  for _, f in ipairs(files) do if f.name == "Containerfile" then containerfile = f end end
  local tags, key, stages = {}, {}, {}
  for _, from in ipairs(images.parse_from(containerfile.data)) do
    local ref = from.ref
    if not tags[ref] and not stages[ref] and valid_name(ref)
      and (ref == name and images.BUILTIN[ref] or images.origin(ref)) then
      local t, perr = ensure_named(eng, ref, ctx, dry, visiting, ref == name)
      if not t then return nil, ("image %s: FROM %s (Containerfile line %d): %s"):format(name, ref, from.line, perr) end
      tags[ref] = t
      key[#key + 1] = ref .. "=" .. t
    end
    if from.stage then stages[from.stage] = true end
  end
  local buildargs = {}
  if (containerfile.data .. "\n"):find("%$%{?BASE[^%w_]") then
    local base, berr
    if name == "base" then
      base, berr = ensure_rootfs(eng, ctx, dry)
    else
      base, berr = ensure_named(eng, "base", ctx, dry, visiting)
    end
    if not base then return nil, berr end
    buildargs.BASE = base
    key[#key + 1] = "BASE=" .. base
  end
  local out = {}
  for _, f in ipairs(files) do
    key[#key + 1] = f.name .. "\0" .. f.mode .. "\0" .. f.data
    if f == containerfile then
      out[#out + 1] = { name = f.name, data = rewrite_from(f.data, tags), mode = f.mode }
    else
      out[#out + 1] = f
    end
  end
  local tag = tag_of(name, key)
  buildargs.DEMESNE_TAG = tag
  return build(eng, { name = name, tag = tag, files = out, buildargs = buildargs, refresh = refreshing(visiting, name),
    labels = { ["io.demesne.image"] = name, ["io.demesne.origin"] = "user" } }, ctx, dry)
end

-- Builds (or finds) the image `name`; returns its tag. With `dry`, builds nothing: returns
-- the tag when the image is present, else nil and the reason. `builtin_only` skips a user
-- image of that name. `visiting` holds the images being resolved, to refuse a cycle.
function ensure_named(eng, name, ctx, dry, visiting, builtin_only)
  local dir = not builtin_only and user_image_dir(name) or nil
  local id = (dir and "user:" or "built-in:") .. name
  visiting = visiting or {}
  if visiting[id] then
    return nil, ("image %s builds FROM itself (through %s)"):format(name, table.concat(visiting, " -> "))
  end
  visiting[id] = true
  visiting[#visiting + 1] = name
  local tag, err, want
  if dir then
    tag, err, want = ensure_user(eng, name, dir, ctx, dry, visiting)
  elseif images.BUILTIN[name] then
    tag, err, want = ensure_builtin(eng, name, ctx, dry, visiting)
  else
    err = ("no image %q"):format(name)
  end
  visiting[id] = nil
  visiting[#visiting] = nil
  return tag, err, want
end

--- Builds demesne image `name` again even when its tag is present: without the engine's
--- cache, so that its package steps fetch what is newest, and with its FROM images pulled
--- again where they come from a registry (`demesne images build --refresh`). Its parents
--- are only built when missing. Returns the tag, or nil and a message.
---@param eng table
---@param name string
---@param ctx ToolContext|nil
---@return string|nil tag, string|nil err
function images.rebuild(eng, name, ctx)
  if not images.origin(name) then return nil, ("no image %q"):format(tostring(name)) end
  local tag, err = ensure_named(eng, name, ctx, false, { refresh = name })
  if tag then
    resolved[eng] = resolved[eng] or {}
    resolved[eng][name] = nil
  end
  return tag, err
end

--- Whether demesne image `name` is built from its current inputs (lua/images.lua's content
--- hash of its build context and its parents' tags). Returns
---   {state = "current", tag}                     built from what it is made of now
---   {state = "changed", tag, built = {ref…}}     built, but from other inputs: `built` are
---                                                the engine's older images of that name
---   {state = "not built", tag|nil, why}          nothing of that name in the engine (tag nil
---                                                when a parent is not built either)
--- or nil and a message (no such image, an image folder that cannot be read).
---@param eng table
---@param name string
---@return table|nil report, string|nil err
function images.freshness(eng, name)
  if not images.origin(name) then return nil, ("no image %q"):format(tostring(name)) end
  local tag, err, want = ensure_named(eng, name, nil, true)
  if tag then return { state = "current", tag = tag } end
  if err ~= "not built" then
    -- a parent not built yet, or the folder cannot be read: nothing to compare against
    if not err:find("not built", 1, true) then return nil, err end
  end
  local built = {}
  if type(eng.image_list) == "function" then
    for _, img in ipairs(eng:image_list({ "io.demesne.image=" .. name }) or {}) do
      for _, r in ipairs(img.refs or {}) do
        local bare = r:gsub("^docker%.io/", ""):gsub("^localhost/", "")
        if bare:match("^demesne/" .. name:gsub("%p", "%%%0") .. ":%x+$") and bare ~= want then
          built[#built + 1] = bare
        end
      end
    end
  end
  table.sort(built)
  if #built > 0 then return { state = "changed", tag = want, built = built } end
  return { state = "not built", tag = want, why = err }
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
  if #ref > NAME_MAX + 1 + 128 + 1 + 7 + 1 + 128 then
    return nil, ("is %d characters long, far over the grammar's limits"):format(#ref)
  end
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
    return nil, ("has an invalid tag %q (letters, digits, '_', '.' and '-', at most 128, not starting with '.' or '-')")
      :format(tag)
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
      if c:lower() ~= c and path_component_ok(c:lower()) then
        return nil, "has uppercase letters: repository names must be lowercase"
      end
      return nil, ("has an invalid path component %q (lowercase letters and digits, separated by one '.', "
        .. "'_', '__' or dashes)"):format(c)
    end
  end
  return true
end

--- Makes sure an image is available. `name` is a demesne image (a user image in
--- $XDG_CONFIG_HOME/demesne/images/<name>/, or a built-in) or the reference of an image
--- already present in the engine (checked against the OCI reference grammar first: a
--- malformed one never reaches the engine). ctx (may be nil) gets build progress.
--- Returns {name=, ref=} or nil and a message that lists the image names.
---@param eng table  an engine adapter object
---@param name string|nil  default: the default_image setting
---@param ctx ToolContext|nil
---@return {name: string, ref: string}|nil image, string|nil err
function images.ensure(eng, name, ctx)
  name = name or config.get("default_image")
  local origin = images.origin(name)
  if origin then
    -- a built-in image found once is not looked up again: its build context is embedded, so
    -- its tag cannot change while this process runs (this saves the engine a round trip per
    -- call). User images, and a source tree (DEMESNE_SOURCE_DIR), may change: looked up each time.
    local cacheable = origin == "built-in" and not runtime.source_dir
    local found = resolved[eng]
    if cacheable and found and found[name] then return { name = name, ref = found[name] } end
    local ref, err = ensure_named(eng, name, ctx)
    if not ref then return nil, err end
    if cacheable then
      resolved[eng] = found or {}
      resolved[eng][name] = ref
    end
    return { name = name, ref = ref }
  end
  local ok, why = images.check_reference(name)
  if not ok then
    local shown = type(name) == "string" and #name > 80 and (name:sub(1, text.utf8_floor(name, 80)) .. "…") or name
    return nil, ("image: %q is not a valid image reference: it %s"):format(tostring(shown), why)
  end
  if eng:image_inspect(name) then return { name = name, ref = name } end
  if not config.get("image_pull") then
    return nil, ("image: %q is neither a built-in or user image (%s) nor an image present in the engine (image_pull "
      .. "is false, so it is not pulled)"):format(name, table.concat(images.list(), ", "))
  end
  local pulled, perr = images.pull(eng, name, ctx)
  if pulled then return { name = name, ref = name } end
  return nil, ("image: %q is neither a built-in or user image (%s) nor an image present in the engine, and pulling it "
    .. "failed: %s"):format(name, table.concat(images.list(), ", "), (perr:gsub("^image: ", "")))
end

--- Builds a prepared context unless its tag is present (for lua/images/devcontainer.lua),
--- as demesne's own images are built: the same join of a build already running and the
--- same progress. plan: {name, tag, files = {{name, data, mode}}, buildargs, labels,
--- dockerfile (default Containerfile), target, network (default "host")}; a failure
--- message ends with the last 20 lines of the build's output. Returns the tag, or nil and
--- the message.
---@param eng table
---@param plan table
---@param ctx ToolContext|nil
---@return string|nil tag, string|nil err
function images.build_context(eng, plan, ctx)
  local p = { tail = true }
  for k, v in pairs(plan) do p[k] = v end
  return build(eng, p, ctx)
end

--- The tag of a content key: demesne/<name>:<12 hex digits of the hash of the key's parts>.
---@param name string
---@param key string[]
---@return string
function images.tag_of(name, key) return tag_of(name, key) end

--- Rewrites the FROM lines of a Containerfile: each word naming a demesne image (and no
--- stage above) becomes tags[word].
---@param src string
---@param tags table<string, string>
---@return string
function images.rewrite_from(src, tags) return rewrite_from(src, tags) end

--- Whether a demesne image is present in the engine, without building anything.
--- Returns its tag and its notes (the lines its build printed as "demesne-note: …", or nil),
--- or nil and "not built" (or the reason it cannot be built).
---@param eng table
---@param name string
---@return string|nil tag, string|nil notes_or_err
function images.status(eng, name)
  local tag, err = ensure_named(eng, name, nil, true)
  if not tag then return nil, err end
  return tag, images.notes(eng, tag)
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
  if not images.origin(name) then
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

--- The Containerfile of demesne image `name`: the user's (when a user image of that name
--- exists) or the built-in's, or nil.
---@param name string
---@return string|nil
function images.containerfile(name)
  local origin, dir = images.origin(name)
  if origin == "user" then return fs.read_file(dir .. "/Containerfile") end
  if origin == "built-in" then return runtime.source("images/" .. name .. "/Containerfile") end
end

--- The notes recorded on a built image (see images.status), or nil.
---@param eng table
---@param tag string
---@return string|nil
function images.notes(eng, tag)
  local info = eng:image_inspect(tag)
  return info and type(info.labels) == "table" and info.labels[NOTES_LABEL] or nil
end

--- The parent of a demesne image, for display: a built-in's parent name ("@rootfs" for
--- base), or for a user image the demesne images its FROM lines name (", "-joined), else
--- the first FROM word.
---@param name string
---@return string|nil
function images.parent(name)
  local origin, dir = images.origin(name)
  if origin == "built-in" then return images.BUILTIN[name].parent end
  if origin ~= "user" then return nil end
  local src = fs.read_file(dir .. "/Containerfile") or ""
  local named, first = {}, nil
  for _, f in ipairs(images.parse_from(src)) do
    first = first or f.ref
    if valid_name(f.ref) and (f.ref == name and images.BUILTIN[f.ref] or images.origin(f.ref)) then
      named[#named + 1] = f.ref == name and (f.ref .. " (built-in)") or f.ref
    end
  end
  return #named > 0 and table.concat(named, ", ") or first
end

return images
