-- Image registries: which registry an image reference names, the host's own credentials
-- for it, and the registries section of config.lua (mirrors, credentials on or off).
--
-- Credentials are read where the engines' own clients keep them, in the order Podman
-- reads them (containers-auth.json(5)), then Docker's:
--   $REGISTRY_AUTH_FILE, ${XDG_RUNTIME_DIR}/containers/auth.json,
--   ${XDG_CONFIG_HOME:-~/.config}/containers/auth.json, ${DOCKER_CONFIG:-~/.docker}/config.json
-- In each file an `auths` entry ({auth = base64("user:password")} or {identitytoken = …})
-- or a credential helper (`credHelpers[host]`, else `credsStore`) answers; the first file
-- that knows the registry wins. A helper is `docker-credential-<name> get`, given the
-- server on stdin and bounded in time and output (the Docker credential helper protocol).
--
-- A credential is a neutral table {username, password} or {identity_token}, plus `server`
-- (the address the engine expects) and `source` (the file or helper it came from, for
-- messages: never the secret). It is handed to the engine adapter for one pull or build
-- and is never logged, put in an error, a container, a build context or a job record.
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local oauth = require("demesne.oauth")
local fs = require("core.fs")
local process = require("core.process")

local registries = {}

--- The registry Docker Hub's short names mean, and the server address its clients use as
--- the key of its credentials.
registries.DOCKER_HUB = "docker.io"
registries.DOCKER_HUB_SERVER = "https://index.docker.io/v1/"

--- Largest credentials file read (bytes), and largest answer read from a credential helper.
registries.MAX_FILE_BYTES = 4 * 1024 * 1024
registries.MAX_HELPER_BYTES = 64 * 1024

local HUB_ALIASES = { ["docker.io"] = true, ["index.docker.io"] = true, ["registry-1.docker.io"] = true }

--- Splits an image reference into its registry and repository path, as Docker decides it:
--- the first component is a registry only when it holds a "." or a ":" or is "localhost"
--- (and more components follow); otherwise the registry is docker.io, and a one-component
--- path gets "library/". The tag and digest are returned apart ("" when absent; the digest
--- with its "@", the tag with its ":").
---@param ref string  a reference that images.check_reference accepted
---@return string registry, string path, string suffix  e.g. "127.0.0.1:5000", "team/tools", ":1"
function registries.split(ref)
  local rest, digest = ref, ""
  local at = ref:find("@", 1, true)
  if at then rest, digest = ref:sub(1, at - 1), ref:sub(at) end
  local tag = ""
  local colon = rest:match("^.*():")
  if colon and not rest:find("/", colon, true) then rest, tag = rest:sub(1, colon - 1), rest:sub(colon) end
  local first, more = rest:match("^([^/]+)/(.+)$")
  if first and (first:find("[.:]") or first == "localhost") then
    if HUB_ALIASES[first] then
      return registries.DOCKER_HUB, more:find("/", 1, true) and more or ("library/" .. more), tag .. digest
    end
    return first, more, tag .. digest
  end
  return registries.DOCKER_HUB, rest:find("/", 1, true) and rest or ("library/" .. rest), tag .. digest
end

--- The credentials files looked at, in order: {path, kind = "podman" | "docker"}.
---@return {path: string, kind: string}[]
function registries.auth_files()
  local home = os.getenv("HOME") or "/root"
  local out = {}
  local function add(p, kind) if p and p ~= "" then out[#out + 1] = { path = p, kind = kind } end end
  add(os.getenv("REGISTRY_AUTH_FILE"), "podman")
  local xrd = os.getenv("XDG_RUNTIME_DIR")
  if xrd and xrd ~= "" then add(xrd .. "/containers/auth.json", "podman") end
  local xch = os.getenv("XDG_CONFIG_HOME")
  add(((xch and xch ~= "") and xch or (home .. "/.config")) .. "/containers/auth.json", "podman")
  local dc = os.getenv("DOCKER_CONFIG")
  add(((dc and dc ~= "") and dc or (home .. "/.docker")) .. "/config.json", "docker")
  return out
end

-- The registry (and path) an auths/credHelpers key names: "https://index.docker.io/v1/"
-- -> "docker.io", "http://host:5000/v2/" -> "host:5000", "host/ns/repo" -> "host/ns/repo".
local function normalize_key(k)
  local s = tostring(k):gsub("^%a[%w+.-]*://", "")
  local host, path = s:match("^([^/]+)(.*)$")
  if not host then return nil end
  if HUB_ALIASES[host] then host = registries.DOCKER_HUB end
  if path:match("^/v[12]/?$") or path == "/" then path = "" end
  return host .. path:gsub("/+$", "")
end

-- The entry of `map` whose key is the registry of `reg`/`path` or a repository prefix of it
-- (Podman's namespaced keys): the longest match wins.
local function lookup(map, reg, path)
  if type(map) ~= "table" then return nil end
  local want = reg .. "/" .. path
  local best, best_len
  for k, v in pairs(map) do
    local nk = normalize_key(k)
    if nk and (nk == reg or want == nk or want:sub(1, #nk + 1) == nk .. "/") and (not best_len or #nk > best_len) then
      best, best_len = v, #nk
    end
  end
  return best
end

--- The server address a registry's credentials are given for: Docker Hub's index URL, or
--- the registry's host[:port].
---@param registry string
---@return string
function registries.server(registry)
  return registry == registries.DOCKER_HUB and registries.DOCKER_HUB_SERVER or registry
end

-- Runs `docker-credential-<name> get` with `server` on stdin. Returns {username, password} or
-- {identity_token}, or nil and why (never the helper's output: it may hold the secret).
local function from_helper(name, server)
  if not tostring(name):match("^[%w_.-]+$") then
    return nil, ("credential helper name %q is not a program name"):format(tostring(name))
  end
  local file = "docker-credential-" .. name
  local timeout_ms = math.floor((config.get("registry_helper_timeout_seconds") or 10) * 1000)
  local out, too_long = {}, false
  local size = 0
  local ok, terr, tcode = async.timeout(timeout_ms, function()
    return async.await(function(cb)
      local status, eof = nil, false
      -- the server goes to the helper's stdin through sh's own pipe (printf), as an argument:
      -- never part of the command text; demesne holds only the helper's stdout
      local proc, pipes, serr = process.spawn({ file = "/bin/sh", stdout = true, detached = true,
        args = { "-c", 'printf %s "$2" | exec "$1" get', "sh", file, server } }, function(c)
        status = c
        if eof then cb(status) end
      end)
      if not proc then cb(nil, serr, "ENOEXEC") return end
      pipes.stdout:read_start(function(chunk)
        if not chunk then
          if eof then return end
          pipes.stdout:close()
          eof = true
          if status then cb(status) end
          return
        end
        size = size + #chunk
        if size > registries.MAX_HELPER_BYTES then too_long = true; proc:kill("KILL", true) return end
        out[#out + 1] = chunk
      end)
      return function() proc:kill("KILL", true) end -- the whole group; its stdout ends with it, and is closed then
    end)
  end)
  if ok == nil then
    if tcode == "ETIMEDOUT" then return nil, ("%s did not answer within %d ms"):format(file, timeout_ms) end
    return nil, ("%s could not be run: %s"):format(file, tostring(terr))
  end
  if too_long then return nil, ("%s answered more than %d bytes"):format(file, registries.MAX_HELPER_BYTES) end
  if ok == 126 or ok == 127 then -- sh's own: the helper is not on PATH, or not executable
    return nil, ("%s could not be run: no such program on PATH, or not executable"):format(file)
  end
  if ok ~= 0 then return nil, ("%s found no credentials (exit %s)"):format(file, tostring(ok)), "ENOENT" end
  local t = json.decode(table.concat(out))
  if type(t) ~= "table" or type(t.Secret) ~= "string" or t.Secret == "" then
    return nil, ("%s answered no Secret"):format(file)
  end
  if t.Username == "<token>" then return { identity_token = t.Secret } end
  return { username = type(t.Username) == "string" and t.Username or "", password = t.Secret }
end

-- The credentials one file holds for reg/path: cred, or nil (none here), or nil and an error.
local function from_file(f, reg, path)
  local st = fs.stat(f.path)
  if not (st and st.type == "file") then return nil end
  if st.size > registries.MAX_FILE_BYTES then
    return nil, ("%s is larger than %d bytes"):format(f.path, registries.MAX_FILE_BYTES)
  end
  local data, rerr = fs.read_file(f.path)
  if not data then return nil, ("%s: %s"):format(f.path, tostring(rerr)) end
  local t = json.decode(data)
  if type(t) ~= "table" then return nil, ("%s is not a JSON object"):format(f.path) end
  local helper = lookup(t.credHelpers, reg, path)
  local entry = lookup(t.auths, reg, path)
  local function helper_cred(name, what)
    local c, herr, hcode = from_helper(name, registries.server(reg))
    if c then c.source = ("%s (%s %s in %s)"):format("docker-credential-" .. name, what, name, f.path) return c end
    if hcode == "ENOENT" then return nil end
    if what == "credsStore" then -- the store for every registry: one that fails leaves this one without credentials
      log.warning("demesne.registries", "registry %s: %s (credsStore in %s): pulling without credentials", reg, herr,
        f.path)
      return nil
    end
    return nil, ("registry %s: %s (%s in %s)"):format(reg, herr, what, f.path)
  end
  if type(helper) == "string" and helper ~= "" then return helper_cred(helper, "credHelpers") end
  if type(entry) == "table" then
    if type(entry.identitytoken) == "string" and entry.identitytoken ~= "" then
      return { identity_token = entry.identitytoken, source = f.path }
    end
    if type(entry.auth) == "string" and entry.auth ~= "" then
      local plain = oauth.base64url_decode((entry.auth:gsub("%s", "")))
      local user, pass = (plain or ""):match("^([^:]*):(.*)$")
      if not user then
        return nil, ("registry %s: the auths entry in %s is not base64 of \"user:password\""):format(reg, f.path)
      end
      return { username = user, password = pass, source = f.path }
    end
    if type(entry.username) == "string" and type(entry.password) == "string" then
      return { username = entry.username, password = entry.password, source = f.path }
    end
  end
  -- Docker keeps an empty auths entry for a registry whose secret is in credsStore
  if type(t.credsStore) == "string" and t.credsStore ~= "" then return helper_cred(t.credsStore, "credsStore") end
  return nil
end

--- The host's credentials for the registry of an image reference (see the file's head for
--- where they are looked for). Returns the credential ({username, password} or
--- {identity_token}, with `server` and `source`), or nil and nothing when no file knows
--- the registry (or config.lua's `registries[reg].credentials` is false), or nil and a
--- message naming the file or helper that failed (never a secret).
---@param ref string  an image reference (or a registry host[:port] followed by "/")
---@return table|nil cred, string|nil err
function registries.credentials(ref)
  local reg, path = registries.split(ref)
  local conf = registries.conf(reg)
  if conf and conf.credentials == false then return nil end
  for _, f in ipairs(registries.auth_files()) do
    local c, err = from_file(f, reg, path)
    if c then
      c.server = registries.server(reg)
      return c
    end
    if err then return nil, err end
  end
  return nil
end

--- Every secret string of a credential (password, identity token, and their encodings a
--- header or file would carry), for scrubbing a message.
---@param cred table|nil
---@return string[]
function registries.secrets(cred)
  local out = {}
  if not cred then return out end
  for _, s in ipairs({ cred.password, cred.identity_token }) do
    if type(s) == "string" and #s >= 4 then out[#out + 1] = s end
  end
  return out
end

--- `msg` with every secret of the credentials in `creds` replaced by "***".
---@param msg string
---@param creds table[]  credentials
---@return string
function registries.scrub(msg, creds)
  msg = tostring(msg)
  for _, c in ipairs(creds or {}) do
    for _, s in ipairs(registries.secrets(c)) do
      local i = msg:find(s, 1, true)
      while i do
        msg = msg:sub(1, i - 1) .. "***" .. msg:sub(i + #s)
        i = msg:find(s, i + 3, true)
      end
    end
  end
  return msg
end

-- Whether a registries entry's name is host[:port].
local function valid_registry_name(n)
  return type(n) == "string" and n:match("^[%w.-]+$") ~= nil or (type(n) == "string" and n:match("^[%w.-]+:%d+$") ~= nil)
    or (type(n) == "string" and n:match("^%[[%x:.]+%]:?%d*$") ~= nil)
end

--- The registries section of config.lua, checked: { [host[:port]] = {mirrors = {host[:port]
--- [/path]…}, credentials = true|false} }. Returns the table (registry -> entry), or nil and
--- a message naming the entry and field that is wrong.
---@return table<string, {mirrors: string[], credentials: boolean}>|nil section, string|nil err
function registries.config()
  local raw = config.get("registries")
  if raw == nil then return {} end
  if type(raw) ~= "table" then return nil, "registries must be a table: { [\"host:port\"] = { mirrors = {…} } }" end
  local out = {}
  for name, e in pairs(raw) do
    local where = ("registries[%q]"):format(tostring(name))
    if not valid_registry_name(name) then
      return nil, ("%s: the key must be a registry host or host:port"):format(where)
    end
    if type(e) ~= "table" then return nil, ("%s must be a table {mirrors = {…}, credentials = …}"):format(where) end
    for k in pairs(e) do
      if k ~= "mirrors" and k ~= "credentials" then
        return nil, ("%s.%s: not a field (mirrors, credentials; insecure registries and certificates are the "
          .. "engine's own configuration)"):format(where, tostring(k))
      end
    end
    local mirrors = {}
    if e.mirrors ~= nil then
      if type(e.mirrors) ~= "table" then return nil, ("%s.mirrors must be a list of registries"):format(where) end
      for i, m in ipairs(e.mirrors) do
        if type(m) ~= "string" or not m:match("^[%w.:%[%]-]+[%w/._-]*$") then
          return nil, ("%s.mirrors[%d] must be a registry host[:port][/path]"):format(where, i)
        end
        mirrors[#mirrors + 1] = (m:gsub("/+$", ""))
      end
    end
    if e.credentials ~= nil and type(e.credentials) ~= "boolean" then
      return nil, ("%s.credentials must be true or false"):format(where)
    end
    out[HUB_ALIASES[name] and registries.DOCKER_HUB or name] = { mirrors = mirrors, credentials = e.credentials ~= false }
  end
  return out
end

--- The config.lua entry of one registry, or nil (none, or a malformed section: the error
--- is logged; `demesne check-config` reports it).
---@param registry string
---@return {mirrors: string[], credentials: boolean}|nil
function registries.conf(registry)
  local section, err = registries.config()
  if not section then
    log.warning("demesne.registries", "%s", err)
    return nil
  end
  return section[registry]
end

return registries
