-- A small client of the OCI Distribution Specification (v1.1, "pull"): the manifest of a
-- reference and the blobs it names, from a registry that config.lua's `registries` names,
-- with the host's own credentials (lua/registries.lua) and the certificate authority the
-- engines use for it (certs.d). The engines pull images themselves; this is for artifacts
-- that are no image: Dev Container Features (containers.dev/implementors/features-distribution),
-- an OCI manifest whose one layer is a tar of application/vnd.devcontainers.layer.v1+tar.
--
-- Authentication as the distribution registry and its token service define it: a request
-- is sent with Basic credentials when the host has a password for the registry; an answer
-- 401 with `WWW-Authenticate: Bearer realm=…,service=…,scope=…` is followed once, asking
-- the realm (https, or http on loopback) for a token with those credentials (or none).
-- A credential never appears in a message; every answer is bounded (MAX_MANIFEST_BYTES,
-- the caller's blob cap) and a blob is checked against its sha256 digest before use.
local async = require("demesne.async")
local http = require("core.http")
local json = require("demesne.json")
local registries = require("demesne.registries")
local text = require("core.text")
local fs = require("core.fs")
local util = require("demesne.util")

local oci = {}

--- Largest manifest read (bytes).
oci.MAX_MANIFEST_BYTES = 4 * 1024 * 1024
--- Time limit of one request (ms).
oci.TIMEOUT_MS = 120000

oci.MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json"

local request = async.wrap(http.request)

-- Where the engines keep a registry's certificate authority (containers-certs.d(5),
-- Docker's certs.d): the first that exists, or nil (the system's).
local function ca_file(registry)
  for _, dir in ipairs({ "/etc/containers/certs.d/", "/etc/docker/certs.d/" }) do
    local p = dir .. registry .. "/ca.crt"
    local st = fs.stat(p)
    if st and st.type == "file" then return p end
  end
  local d = "/etc/containers/certs.d/" .. registry
  for _, n in ipairs(fs.readdir(d) or {}) do
    if n:match("%.crt$") then
      local st = fs.stat(d .. "/" .. n)
      if st and st.type == "file" then return d .. "/" .. n end
    end
  end
  return nil
end

-- Whether `host` (host[:port]) is loopback: a registry there may speak plain http.
local function loopback(host)
  local h = host:gsub(":%d+$", ""):gsub("^%[(.*)%]$", "%1")
  return h == "localhost" or h:match("^127%.%d+%.%d+%.%d+$") ~= nil or h == "::1"
end

--- The parameters of a `Bearer` challenge (RFC 6750 §3, a WWW-Authenticate value):
--- {realm, service, scope}, or nil when it is no Bearer challenge with a realm.
---@param h string|nil
---@return {realm: string, service: string|nil, scope: string|nil}|nil
function oci.parse_challenge(h)
  if type(h) ~= "string" then return nil end
  local rest = h:match("^%s*[Bb]earer%s+(.*)$")
  if not rest then return nil end
  local out = {}
  for k, v in rest:gmatch('([%a_]+)="([^"]*)"') do out[k:lower()] = v end
  if not out.realm then return nil end
  return out
end

---@class OciSession
---@field registry string   host[:port]
---@field path string       repository path
---@field cred table|nil    the host's credential (registries.credentials)
---@field token string|nil  a bearer token once the realm gave one
---@field ca string|nil     the registry's certificate authority file (certs.d)
---@field reference string  the tag or digest asked for

-- The Basic Authorization value of the session's credential, or nil (none, or a token).
local function basic(s)
  return s.cred and s.cred.username and ("Basic " .. util.base64(s.cred.username .. ":" .. s.cred.password)) or nil
end

-- One GET to the registry (`url` absolute), the credential or token attached, a 401's
-- challenge followed once. Returns the response, or nil, message, code.
local function get(s, url, accept, max_bytes)
  local function once()
    local headers = { ["User-Agent"] = "demesne", Accept = accept }
    headers.Authorization = s.token and ("Bearer " .. s.token) or basic(s)
    return request({ url = url, headers = headers, ca_file = s.ca, max_body_bytes = max_bytes,
      timeout_ms = oci.TIMEOUT_MS, connect_timeout_ms = 10000 })
  end
  local res, err, code = once()
  if not res then return nil, registries.scrub(err, { s.cred }), code end
  if res.status == 401 and not s.token then
    local ch = oci.parse_challenge(res.headers["www-authenticate"])
    if ch then
      local realm_host = ch.realm:match("^https://([^/?#]+)") or (ch.realm:match("^http://([^/?#]+)"))
      -- http only for a registry on loopback itself (a remote one may not send the host's
      -- credentials in clear to whatever listens on the host's loopback)
      if not realm_host or (ch.realm:match("^http://") and not (loopback(realm_host) and loopback(s.registry))) then
        return nil, ("registry %s: its token service %s is not an https URL"):format(s.registry, ch.realm), "EPROTO"
      end
      local q = {}
      if ch.service then q[#q + 1] = "service=" .. util.percent_encode(ch.service) end
      q[#q + 1] = "scope=" .. util.percent_encode(ch.scope or ("repository:" .. s.path .. ":pull"))
      local headers = { ["User-Agent"] = "demesne" }
      -- the credentials go to the registry's own host only (Docker Hub's token service is
      -- auth.docker.io); a realm elsewhere is asked without them
      local own = realm_host == s.registry or (s.registry == "registry-1.docker.io" and realm_host == "auth.docker.io")
      if own then headers.Authorization = basic(s) end
      local tr, terr, tcode = request({ url = ch.realm .. (ch.realm:find("?", 1, true) and "&" or "?") .. table.concat(q, "&"),
        headers = headers, ca_file = realm_host == s.registry and s.ca or nil, max_body_bytes = 256 * 1024,
        timeout_ms = oci.TIMEOUT_MS, connect_timeout_ms = 10000 })
      if not tr then return nil, registries.scrub(terr, { s.cred }), tcode end
      if tr.status == 401 or tr.status == 403 then
        return nil, ("registry %s refused the credentials%s"):format(s.registry,
          s.cred and (" (from " .. tostring(s.cred.source) .. ")") or " (the host has none for it)"), "EACCES"
      end
      local ok, t = pcall(json.decode, tr.body or "")
      local token = ok and type(t) == "table" and (t.token or t.access_token)
      -- RFC 6750's b64token: nothing else goes into a header
      if tr.status ~= 200 or type(token) ~= "string" or #token > 16384 or not token:match("^[%w%-._~+/]+=*$") then
        return nil, ("registry %s: its token service answered %d without a token"):format(s.registry, tr.status), "EPROTO"
      end
      s.token = token
      res, err, code = once()
      if not res then return nil, registries.scrub(err, { s.cred }), code end
    end
  end
  if res.status == 401 or res.status == 403 then
    return nil, ("registry %s refused the credentials%s"):format(s.registry,
      s.cred and (" (from " .. tostring(s.cred.source) .. ")") or " (the host has none for it)"), "EACCES"
  end
  return res
end

--- Opens a pull session for `ref` (an image reference whose registry config.lua's
--- `registries` names; the caller checks that). Returns the session, or nil, message, code.
---@param ref string
---@return OciSession|nil s, string|nil err, string|nil code
function oci.session(ref)
  local registry, path, suffix = registries.split(ref)
  local cred, cerr = registries.credentials(ref)
  if cerr then return nil, cerr, "EACCES" end
  if cred and not cred.username then cred = nil end -- an identity token is the engine's to use
  local tag = suffix:match("^:([%w_][%w_.-]*)$") or (suffix == "" and "latest") or nil
  local digest = suffix:match("@(sha256:%x+)$")
  if digest then
    digest = digest:lower()
    if #digest ~= 71 then return nil, ("%s: a sha256 digest has 64 hex digits"):format(ref), "EINVAL" end
  elseif not tag then
    return nil, ("%s: only a tag or a sha256 digest names a feature (%s)"):format(ref, suffix), "EINVAL"
  end
  return { registry = registry == registries.DOCKER_HUB and "registry-1.docker.io" or registry, path = path,
    cred = cred, ca = ca_file(registry), reference = digest or tag or "latest" }
end

--- The manifest of the session's reference, decoded and checked: {raw, manifest, digest}.
--- Fails (nil, message, code) when the registry has none ("ENOENT"), refuses, answers
--- something that is no OCI image manifest, or a digest reference that does not match.
---@param s OciSession
---@return table|nil m, string|nil err, string|nil code
function oci.manifest(s)
  local url = ("https://%s/v2/%s/manifests/%s"):format(s.registry, s.path, s.reference)
  local res, err, code = get(s, url, oci.MANIFEST_TYPES, oci.MAX_MANIFEST_BYTES)
  if not res then return nil, ("registry %s: %s"):format(s.registry, err), code end
  if res.status == 404 then
    return nil, ("registry %s has no %s:%s"):format(s.registry, s.path, s.reference), "ENOENT"
  end
  if res.status ~= 200 then
    return nil, ("registry %s answered %d for the manifest of %s"):format(s.registry, res.status, s.path), "EPROTO"
  end
  local ok, m = pcall(json.decode, res.body or "")
  if not ok or type(m) ~= "table" or m.schemaVersion ~= 2 or type(m.layers) ~= "table" then
    return nil, ("registry %s: the manifest of %s:%s is not an OCI image manifest"):format(s.registry, s.path,
      s.reference), "EPROTO"
  end
  local digest = "sha256:" .. text.sha256(res.body)
  if s.reference:match("^sha256:") and s.reference ~= digest then
    return nil, ("registry %s: the manifest of %s is not the one its digest %s names"):format(s.registry, s.path,
      s.reference), "EPROTO"
  end
  return { raw = res.body, manifest = m, digest = digest }
end

--- A blob by its descriptor ({digest = "sha256:…", size}), read whole into memory when it
--- is at most `max_bytes` and its sha256 matches. Returns the bytes, or nil, message, code.
---@param s OciSession
---@param desc {digest: string, size: integer}
---@param max_bytes integer
---@return string|nil data, string|nil err, string|nil code
function oci.blob(s, desc, max_bytes)
  local hex = type(desc.digest) == "string" and desc.digest:match("^sha256:(%x+)$")
  if not hex or #hex ~= 64 then return nil, ("a layer's digest %q is not sha256"):format(tostring(desc.digest)), "EPROTO" end
  local size = math.tointeger(desc.size)
  if not size or size < 0 then return nil, ("a layer's size %s is not a byte count"):format(tostring(desc.size)), "EPROTO" end
  if size > max_bytes then
    return nil, ("a layer of %d bytes is over the %d bytes allowed"):format(size, max_bytes), "E2BIG"
  end
  local url = ("https://%s/v2/%s/blobs/%s"):format(s.registry, s.path, desc.digest)
  local res, err, code
  for _ = 1, 4 do -- a registry may redirect a blob to its storage: followed without the credentials
    res, err, code = get(s, url, "*/*", max_bytes)
    if not res then return nil, ("registry %s: %s"):format(s.registry, err), code end
    local loc = res.headers.location
    if type(loc) == "string" and loc:sub(1, 1) == "/" and loc:sub(2, 2) ~= "/" then
      loc = "https://" .. s.registry .. loc -- a path on the registry itself
    end
    if res.status >= 300 and res.status < 400 and type(loc) == "string" and loc:match("^https://") then
      if not loc:match("^https://" .. s.registry:gsub("%p", "%%%0") .. "/") then
        res, err, code = request({ url = loc, headers = { ["User-Agent"] = "demesne" }, max_body_bytes = max_bytes,
          timeout_ms = oci.TIMEOUT_MS, connect_timeout_ms = 10000 })
        if not res then return nil, ("registry %s: %s"):format(s.registry, err), code end
        break
      end
      url = loc
    else
      break
    end
  end
  if res.status ~= 200 then
    return nil, ("registry %s answered %d for the blob %s"):format(s.registry, res.status, desc.digest), "EPROTO"
  end
  local data = res.body or ""
  if #data ~= size or text.sha256(data) ~= hex:lower() then
    return nil, ("registry %s: the blob %s is not what its digest names"):format(s.registry, desc.digest), "EPROTO"
  end
  return data
end

return oci
