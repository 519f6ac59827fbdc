-- Dev Container Features in a devcontainer.json's `features` (containers.dev/implementors/features):
-- each is a folder with devcontainer-feature.json and install.sh, installed as root in an
-- image layer on top of the devcontainer's image, its options as environment variables.
-- demesne takes a feature from two places only:
--   - a folder of the repository itself, "./name" relative to the devcontainer file;
--   - an OCI artifact in a registry that config.lua's `registries` names (the team's own,
--     or a mirror it keeps), pulled by the host (lua/images/oci.lua) with the host's
--     credentials and the engines' certificate authority, its digest checked, its tar
--     extracted with the archive module's checks (no link out, no device, bounded).
-- Any other source (ghcr.io when it is not configured, a tarball URL) is refused naming
-- the feature; so is a feature that asks for what no sandbox gets (privileged, capAdd,
-- securityOpt, mounts, entrypoint). The install steps run in the build with the devcontainer
-- build's network (devcontainer_build_network).
local archive = require("core.archive")
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local fs = require("core.fs")
local images = require("demesne.images")
local jsonc = require("demesne.images.jsonc")
local log = require("demesne.log")
local oci = require("demesne.images.oci")
local registries = require("demesne.registries")
local util = require("demesne.util")

local features = {}

local fail = errors.raise

--- The media type of a feature's one layer (a plain tar), and of its artifact's config.
features.LAYER_TYPE = "application/vnd.devcontainers.layer.v1+tar"
--- The largest feature tar taken (bytes), and the most entries it may hold.
features.MAX_BYTES = 16 * 1024 * 1024
features.MAX_ENTRIES = 2000
--- The most features one devcontainer.json may name.
features.MAX_COUNT = 32
--- Where the features' folders are copied in the build, as the devcontainer CLI does.
features.DIR = "/tmp/dev-container-features"

--- Fields of devcontainer-feature.json refused, with the reason.
features.REFUSED = {
  privileged = "a privileged container is no sandbox",
  capAdd = "demesne grants a sandbox no extra capability",
  securityOpt = "a sandbox's security options are demesne's own",
  mounts = "a mount would bring host paths or volumes into the sandbox",
  entrypoint = "a sandbox's first process is demesne-init",
}

--- Whether a devcontainer (its containerEnv/remoteEnv, a feature's containerEnv) may not
--- set the variable `name`: demesne's own (DEMESNE_*) and the egress's proxy variables.
---@param name string
---@return boolean
function features.reserved_var(name)
  local up = name:upper()
  return up:sub(1, 8) == "DEMESNE_" or up == "HTTP_PROXY" or up == "HTTPS_PROXY" or up == "NO_PROXY"
    or up == "ALL_PROXY"
end

local function ffail(where, id, why)
  fail(("image: devcontainer: %s: features.%s: %s"):format(where, id, why))
end

--- The variable an option id becomes (the spec's rule: characters other than letters,
--- digits and `_` become `_`, a leading run of digits and `_` becomes one `_`, upper case).
---@param id string
---@return string
function features.option_var(id)
  return (id:gsub("[^%w_]", "_"):gsub("^[%d_]+", "_"):upper())
end

--- Checks the `features` object of a devcontainer.json: {[id] = options | "version"}.
--- Returns the list, sorted by id, of {id, kind = "local"|"oci", options = {name = string}}:
--- a local id is "./path" (or "../path") relative to the devcontainer file; any other must be
--- an image reference whose registry config.lua's `registries` names. Fails naming the
--- feature and the reason.
---@param value any
---@param where string  the devcontainer file, for messages
---@return table[]
function features.parse(value, where)
  if type(value) ~= "table" or value[1] ~= nil then
    fail(("image: devcontainer: %s: features: must be an object of feature id = options"):format(where))
  end
  local out = {}
  for id, opts in pairs(value) do
    if type(id) ~= "string" or id == "" then fail(("image: devcontainer: %s: features: an id must be a string"):format(where)) end
    local f = { id = id, options = {} }
    if id:find("://", 1, true) then
      ffail(where, id, "refused: a feature from a URL (a tarball) is fetched from outside any registry demesne is "
        .. "configured for; push it to a registry that config.lua's registries names")
    elseif id:sub(1, 2) == "./" or id:sub(1, 3) == "../" then
      f.kind = "local"
    else
      local ok, why = images.check_reference(id)
      if not ok then ffail(where, id, ("is not a feature reference (an OCI reference or ./folder): it %s"):format(why)) end
      local reg = registries.split(id)
      local section = registries.config() or {}
      if not section[reg] then
        ffail(where, id, ("refused: it comes from the registry %s, which config.lua's registries does not name; "
          .. "features are fetched only from a registry you configured (add it, or a mirror of it, to registries), or "
          .. "from a folder of the repository (\"./name\")"):format(reg))
      end
      f.kind = "oci"
    end
    if type(opts) == "string" then opts = { version = opts } end
    if type(opts) ~= "table" or (opts[1] ~= nil) then ffail(where, id, "its options must be an object (or a version string)") end
    for k, v in pairs(opts) do
      if type(k) ~= "string" or not k:match("^[%w_.-]+$") then
        ffail(where, id, ("%q is not an option id"):format(tostring(k)))
      end
      if type(v) == "boolean" then v = tostring(v)
      elseif type(v) ~= "string" then
        ffail(where, id .. "." .. k, "must be a string or a boolean (the spec's option types; write a number as a "
          .. "string: JSON numbers lose their text, 1.10 becomes 1.1)")
      end
      if v:find("[%z\n\r]") then ffail(where, id .. "." .. k, "holds a line break or NUL") end
      f.options[k] = v
    end
    out[#out + 1] = f
  end
  table.sort(out, function(a, b) return a.id < b.id end)
  return out
end

--- Pulls an OCI feature into a new folder `name` under the core.fs.dir `dir` (the host's
--- private folder): its manifest, its one layer of LAYER_TYPE (at most MAX_BYTES, sha256
--- checked), extracted with core.archive's checks. Returns the manifest's digest; fails
--- naming the feature (never a credential).
---@param where string
---@param id string
---@param dir userdata  core.fs.dir
---@param name string
---@return string digest
function features.pull(where, id, dir, name)
  log.info("demesne.images", "pulling %s (a devcontainer feature)", id)
  local s, err = oci.session(id)
  if not s then ffail(where, id, err) end
  local m, merr = oci.manifest(s)
  if not m then ffail(where, id, merr) end
  local layer
  for _, l in ipairs(m.manifest.layers) do
    if type(l) == "table" and l.mediaType == features.LAYER_TYPE then
      if layer then ffail(where, id, "its artifact has more than one feature layer") end
      layer = l
    end
  end
  if not layer then
    ffail(where, id, ("its artifact holds no layer of %s: it is not a Dev Container Feature"):format(features.LAYER_TYPE))
  end
  local data, berr = oci.blob(s, layer, features.MAX_BYTES)
  if not data then ffail(where, id, berr) end
  local tarname = name .. ".tar"
  local w <close>, ferr = dir:open(tarname, "wx", 384) -- 0600
  if not w then ffail(where, id, "cannot keep its tar: " .. tostring(ferr)) end
  local _rm <close> = setmetatable({}, { __close = function() dir:unlink(tarname) end })
  local ok, werr = w:write(data)
  w:close()
  if not ok then ffail(where, id, "cannot keep its tar: " .. tostring(werr)) end
  local f <close>, rerr = dir:open(tarname, "r")
  if not f then ffail(where, id, "cannot read its tar: " .. tostring(rerr)) end
  local done, xerr = async.await(function(cb)
    local job, e, c = archive.extract_at(f, dir, name, { max_bytes = features.MAX_BYTES * 4,
      max_entries = features.MAX_ENTRIES, max_archive_bytes = features.MAX_BYTES }, cb)
    if not job then cb(nil, e, c) end
    return job and function() job:cancel() end
  end)
  if not done then ffail(where, id, "its tar: " .. tostring(xerr)) end
  return m.digest
end

--- Reads a feature's devcontainer-feature.json (from its files: {name, data, mode}, names
--- relative to the feature's folder) and checks it; adds the options' environment file.
--- Returns {id, files (the folder's, plus devcontainer-features.env), env = {name =
--- value} (its containerEnv), depends = {id}, after = {id}}. Fails naming the feature.
---@param where string
---@param f table  one entry of features.parse
---@param files table[]
---@return table
function features.describe(where, f, files)
  local meta_text, has_install
  for _, e in ipairs(files) do
    if e.name == "devcontainer-feature.json" then meta_text = e.data end
    if e.name == "install.sh" then has_install = true end
  end
  if not meta_text then ffail(where, f.id, "holds no devcontainer-feature.json") end
  if not has_install then ffail(where, f.id, "holds no install.sh") end
  local meta, jerr = jsonc.decode(meta_text)
  if type(meta) ~= "table" or meta[1] ~= nil then
    ffail(where, f.id, "its devcontainer-feature.json is not a JSON object: " .. tostring(jerr))
  end
  local keys = {}
  for k in pairs(meta) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if features.REFUSED[k] and meta[k] ~= false and not (type(meta[k]) == "table" and next(meta[k]) == nil) then
      ffail(where, f.id, ("devcontainer-feature.json: %s: refused: %s"):format(k, features.REFUSED[k]))
    end
  end
  -- the options: the file's defaults, the devcontainer.json's values over them
  local vars, lines = {}, {}
  local declared = type(meta.options) == "table" and meta.options or {}
  local from = {} -- variable -> the option it came from: two options may not make one variable
  local function set(name, v, field)
    local var = features.option_var(name)
    if from[var] and from[var] ~= name then
      ffail(where, f.id, ("%s: the options %s and %s both become the variable %s"):format(field, from[var], name, var))
    end
    from[var], vars[var] = name, v
  end
  local names0 = {}
  for name in pairs(declared) do names0[#names0 + 1] = name end
  table.sort(names0, function(a, b) return tostring(a) < tostring(b) end)
  for _, name in ipairs(names0) do
    local spec = declared[name]
    if type(name) ~= "string" or not name:match("^[%w_.-]+$") then
      ffail(where, f.id, ("devcontainer-feature.json: options: %q is not an option id"):format(tostring(name)))
    end
    if type(spec) == "table" and spec.default ~= nil then
      local d = spec.default
      if type(d) ~= "string" and type(d) ~= "boolean" then
        ffail(where, f.id, ("devcontainer-feature.json: options.%s.default must be a string or a boolean"):format(name))
      end
      set(name, tostring(d), "devcontainer-feature.json")
    end
  end
  local given = {}
  for name in pairs(f.options) do given[#given + 1] = name end
  table.sort(given)
  for _, name in ipairs(given) do set(name, f.options[name], "its options") end
  vars._REMOTE_USER, vars._CONTAINER_USER = "root", "root"
  vars._REMOTE_USER_HOME, vars._CONTAINER_USER_HOME = "/root", "/root"
  local names = {}
  for k, v in pairs(vars) do
    if v:find("[%z\n\r]") then ffail(where, f.id, ("the option %s holds a line break or NUL"):format(k)) end
    names[#names + 1] = k
  end
  table.sort(names)
  for _, k in ipairs(names) do lines[#lines + 1] = k .. "=" .. util.sh_quote(vars[k]) end
  local env = {}
  if meta.containerEnv ~= nil then
    if type(meta.containerEnv) ~= "table" or meta.containerEnv[1] ~= nil then
      ffail(where, f.id, "devcontainer-feature.json: containerEnv must be an object of strings")
    end
    for k, v in pairs(meta.containerEnv) do
      if type(k) ~= "string" or not k:match("^[%a_][%w_]*$") or type(v) ~= "string" or v:find("[%z\n\r]") then
        ffail(where, f.id, ("devcontainer-feature.json: containerEnv.%s must be a variable name = a one-line string")
          :format(tostring(k)))
      end
      if features.reserved_var(k) then
        ffail(where, f.id, ("devcontainer-feature.json: containerEnv.%s is demesne's to set"):format(k))
      end
      env[k] = v
    end
  end
  local function ids(list)
    local o = {}
    if type(list) == "table" then
      for k, v in pairs(list) do o[#o + 1] = type(k) == "string" and k or tostring(v) end
    end
    table.sort(o)
    return o
  end
  local out = {}
  for _, e in ipairs(files) do
    if e.name ~= "devcontainer-features.env" then out[#out + 1] = e end -- demesne writes its own
  end
  out[#out + 1] = { name = "devcontainer-features.env", data = table.concat(lines, "\n") .. "\n", mode = 420 }
  return { id = f.id, files = out, env = env, depends = ids(meta.dependsOn), after = ids(meta.installsAfter),
    version = type(meta.version) == "string" and meta.version or nil }
end

--- The install order of described features (features.describe): a feature after those it
--- dependsOn or installsAfter among them, else by id; a dependsOn that names a feature not
--- in the list is refused (demesne fetches only what the file names).
---@param where string
---@param list table[]
---@return table[]
function features.order(where, list)
  local by, short = {}, {}
  for _, d in ipairs(list) do
    by[d.id] = d
    -- installsAfter names a feature without its version ("ghcr.io/x/y"): match it too
    short[(d.id:gsub(":[%w_.-]+$", ""))] = d
  end
  for _, d in ipairs(list) do
    for _, dep in ipairs(d.depends) do
      if not by[dep] and not short[(dep:gsub(":[%w_.-]+$", ""))] then
        ffail(where, d.id, ("dependsOn %s, which the devcontainer's features do not name; add it there"):format(dep))
      end
    end
  end
  local out, state = {}, {}
  local function visit(d)
    if state[d] == "done" then return end
    if state[d] == "visiting" then ffail(where, d.id, "its dependsOn/installsAfter make a cycle") end
    state[d] = "visiting"
    for _, list2 in ipairs({ d.depends, d.after }) do
      for _, dep in ipairs(list2) do
        local x = by[dep] or short[(dep:gsub(":[%w_.-]+$", ""))]
        if x and x ~= d then visit(x) end
      end
    end
    state[d] = "done"
    out[#out + 1] = d
  end
  local sorted = {}
  for _, d in ipairs(list) do sorted[#sorted + 1] = d end
  table.sort(sorted, function(a, b) return a.id < b.id end)
  for _, d in ipairs(sorted) do visit(d) end
  return out
end

-- A Dockerfile ENV value: double-quoted, `"` and `\` escaped ($ is left to expand, as the
-- devcontainer CLI leaves ${PATH} in a feature's containerEnv to the builder).
local function env_value(v) return '"' .. v:gsub('[\\"]', "\\%0") .. '"' end

--- The build context of the features layer, on top of the image given as build argument
--- BASE: every feature's folder under features/<n>/, and a Containerfile that, for each in
--- order, copies it to features.DIR/<n>, sets its containerEnv and runs its install.sh as
--- root with its options' variables. Returns the context's files {name, data, mode}.
---@param ordered table[]  features.order's list
---@return table[]
function features.context(ordered)
  local files = {}
  local lines = { "ARG BASE", "FROM ${BASE}", "USER root" }
  for i, d in ipairs(ordered) do
    local n = ("%02d"):format(i)
    for _, e in ipairs(d.files) do
      files[#files + 1] = { name = "features/" .. n .. "/" .. e.name, data = e.data, mode = e.mode }
    end
    lines[#lines + 1] = ("# %s"):format(d.id:gsub("[%c]", "?"))
    lines[#lines + 1] = ("COPY features/%s/ %s/%s/"):format(n, features.DIR, n)
    local keys = {}
    for k in pairs(d.env) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do lines[#lines + 1] = ("ENV %s=%s"):format(k, env_value(d.env[k])) end
    lines[#lines + 1] = ("RUN cd %s/%s && chmod -R 0755 . && set -a && . ./devcontainer-features.env && set +a && ./install.sh")
      :format(features.DIR, n)
  end
  lines[#lines + 1] = "RUN rm -rf " .. features.DIR
  files[#files + 1] = { name = "Containerfile", data = table.concat(lines, "\n") .. "\n", mode = 420 }
  return files
end

--- The host's private folder where OCI features are pulled: <state_dir>/features (0700).
---@return userdata dir, string path
function features.private_dir()
  local path = config.get("state_dir") .. "/features"
  errors.check(fs.mkdir_p(path, 448))
  return errors.check(fs.opendir(path)), path
end

return features
