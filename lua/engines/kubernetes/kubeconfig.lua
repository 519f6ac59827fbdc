-- A kubeconfig read into what a client needs to reach one cluster as one user: the API
-- server's URL, the CA that verifies it, a client certificate and key or a bearer token,
-- and the namespace. The subset kubectl writes (clusters, users, contexts,
-- current-context; *-data inline or files beside the kubeconfig); exec and auth-provider
-- credential plugins, basic auth, impersonation and proxies are refused by name.
--
-- Every refusal names the kubeconfig, the field (`users[0].user.exec`) and the reason, and
-- never holds a key or a token. The engine layer: the Kubernetes engine adapter reads it.
local fs = require("core.fs")
local yaml = require("core.yaml")
local util = require("demesne.util")

local kubeconfig = {}

--- Largest kubeconfig, and largest file it names (a CA, a certificate, a key, a token), in bytes.
kubeconfig.MAX_BYTES = 4 * 1024 * 1024

local NOT_YET = "not supported yet"

-- Fields of a cluster, a user and a context that are read; any other field of a user or
-- cluster that changes how demesne would authenticate or connect is in REFUSED.
local REFUSED = {
  cluster = {
    ["proxy-url"] = "a proxy between demesne and the API server is " .. NOT_YET,
    ["tls-server-name"] = "a TLS server name other than the server's host is " .. NOT_YET,
  },
  user = {
    exec = "exec credential plugins are " .. NOT_YET .. " (put a token or a client certificate in the kubeconfig)",
    ["auth-provider"] = "auth-provider plugins are " .. NOT_YET .. " (put a token or a client certificate in the kubeconfig)",
    username = "basic authentication is " .. NOT_YET,
    password = "basic authentication is " .. NOT_YET,
    as = "impersonation is " .. NOT_YET,
    ["as-uid"] = "impersonation is " .. NOT_YET,
    ["as-groups"] = "impersonation is " .. NOT_YET,
    ["as-user-extra"] = "impersonation is " .. NOT_YET,
  },
}

local Reader = {}
Reader.__index = Reader

local function fail(msg) error({ kubeconfig = msg }, 0) end

--- Raises a refusal naming `field` (a path such as `users[0].user.token`) and `why`.
---@param field string
---@param why string
function Reader:refuse(field, why) fail(("kubeconfig %s: %s: %s"):format(self.source, field, why)) end

--- The string at `t[k]` (named `field`), or nil when absent; raises when it is not a string
--- or, with `required`, when it is absent or empty.
---@param t table
---@param k string
---@param field string
---@param required boolean|nil
---@return string|nil
function Reader:string(t, k, field, required)
  local v = t[k]
  if v == nil or v == yaml.null then
    if required then self:refuse(field, "is required") end
    return nil
  end
  if type(v) ~= "string" then
    self:refuse(field, "must be a string, not " .. (type(v) == "table" and "a mapping or a list" or tostring(v)))
  end
  if required and v == "" then self:refuse(field, "must not be empty") end
  return v
end

--- The table at `t[k]`, or nil when absent; raises when it is something else.
---@param t table
---@param k string
---@param field string
---@return table|nil
function Reader:table(t, k, field)
  local v = t[k]
  if v == nil or v == yaml.null then return nil end
  if type(v) ~= "table" then self:refuse(field, "must be a mapping or a list, not " .. tostring(v)) end
  return v
end

--- The bytes of a file the kubeconfig names (relative to the kubeconfig's folder), at
--- most MAX_BYTES.
---@param path string
---@param field string
---@return string
function Reader:file(path, field)
  if path:sub(1, 1) ~= "/" then
    if not self.dir then self:refuse(field, "a relative path, and the kubeconfig has no folder to resolve it in") end
    path = self.dir .. "/" .. path
  end
  local data, msg = self.read(path, kubeconfig.MAX_BYTES + 1)
  if not data then self:refuse(field, ("cannot read %s: %s"):format(path, msg)) end
  if #data > kubeconfig.MAX_BYTES then self:refuse(field, ("%s is larger than %d bytes"):format(path, kubeconfig.MAX_BYTES)) end
  return data
end

--- The bytes of `<k>-data` (base64) or of the file `<k>` names: one of them, not both.
---@param t table
---@param k string
---@param field string  the path of `t` ("users[0].user")
---@return string|nil
function Reader:data_or_file(t, k, field)
  local data = self:string(t, k .. "-data", field .. "." .. k .. "-data")
  local file = self:string(t, k, field .. "." .. k)
  if data and file then self:refuse(field, ("both %s and %s-data: give one"):format(k, k)) end
  if data then
    local bytes = util.base64_decode((data:gsub("%s+", "")))
    if not bytes or bytes == "" then self:refuse(field .. "." .. k .. "-data", "is not base64") end
    return bytes
  end
  if file then return self:file(file, field .. "." .. k) end
  return nil
end

--- `list[i].name` -> {index, value = list[i][inner]}; raises on a missing or repeated name.
---@param top table
---@param k string  "clusters", "users", "contexts"
---@param inner string  "cluster", "user", "context"
---@return table<string, {index: integer, value: table}>
function Reader:named(top, k, inner)
  local list = self:table(top, k, k) or {}
  if next(list) ~= nil and #list == 0 then self:refuse(k, "must be a list") end
  local out = {}
  for i, item in ipairs(list) do
    local field = ("%s[%d]"):format(k, i - 1)
    if type(item) ~= "table" then self:refuse(field, "must be a mapping with name and " .. inner) end
    local name = self:string(item, "name", field .. ".name", true)
    if out[name] then self:refuse(field .. ".name", ("%q is also %s[%d]'s name"):format(name, k, out[name].index)) end
    out[name] = { index = i - 1, value = self:table(item, inner, field .. "." .. inner) or {} }
  end
  return out
end

local function loopback(host)
  return host == "localhost" or host == "[::1]" or host:match("^127%.%d+%.%d+%.%d+$") ~= nil
end

--- The cluster's fields: server, ca_pem, insecure.
---@param c table  the cluster mapping
---@param field string
---@param out table
function Reader:cluster(c, field, out)
  for k, why in pairs(REFUSED.cluster) do
    if c[k] ~= nil and c[k] ~= yaml.null and c[k] ~= "" then self:refuse(field .. "." .. k, why) end
  end
  local server = self:string(c, "server", field .. ".server", true)
  local scheme, host = server:match("^(https?)://([^/?#]+)")
  if not scheme then self:refuse(field .. ".server", ("%q is not an http:// or https:// URL"):format(server)) end
  host = host:gsub(":%d+$", "")
  if host:find("@", 1, true) then self:refuse(field .. ".server", "must not hold a user name or password") end
  if scheme == "http" and not loopback(host) then
    self:refuse(field .. ".server", "plain http:// is only allowed to a loopback address (credentials would travel in clear)")
  end
  out.server = server:gsub("/+$", "")
  out.ca_pem = self:data_or_file(c, "certificate-authority", field)
  local insecure = c["insecure-skip-tls-verify"]
  if insecure ~= nil and insecure ~= yaml.null and type(insecure) ~= "boolean" then
    self:refuse(field .. ".insecure-skip-tls-verify", "must be true or false")
  end
  if insecure == true then
    if out.ca_pem then self:refuse(field, "insecure-skip-tls-verify together with a certificate authority") end
    if not self.allow_insecure then
      self:refuse(field .. ".insecure-skip-tls-verify", "the API server's certificate would not be checked; "
        .. "refused unless the configuration allows it explicitly")
    end
    out.insecure = true
  end
end

local function printable_token(s) return s ~= "" and not s:find("[%c ]") end

--- The user's fields: cert_pem and key_pem, or token (tokenFile wins, as in client-go).
---@param u table  the user mapping
---@param field string
---@param out table
function Reader:user(u, field, out)
  local keys = {}
  for k in pairs(REFUSED.user) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if u[k] ~= nil and u[k] ~= yaml.null then self:refuse(field .. "." .. k, REFUSED.user[k]) end
  end
  out.cert_pem = self:data_or_file(u, "client-certificate", field)
  out.key_pem = self:data_or_file(u, "client-key", field)
  if (out.cert_pem == nil) ~= (out.key_pem == nil) then
    self:refuse(field, out.cert_pem and "a client certificate without client-key(-data)"
      or "a client key without client-certificate(-data)")
  end
  local token = self:string(u, "token", field .. ".token")
  local token_file = self:string(u, "tokenFile", field .. ".tokenFile")
  local token_field = field .. ".token"
  if token_file then
    token, token_field = self:file(token_file, field .. ".tokenFile"):gsub("^%s+", ""):gsub("%s+$", ""), field .. ".tokenFile"
  end
  if token == "" then token = nil end
  if token and not printable_token(token) then self:refuse(token_field, "holds a space or a control character") end
  out.token = token
  if not out.cert_pem and not out.token then
    self:refuse(field, "no credentials: give client-certificate(-data) and client-key(-data), or token or tokenFile")
  end
end

local function dns_label(s)
  return #s <= 63 and (s:match("^[a-z0-9]$") or s:match("^[a-z0-9][-a-z0-9]*[a-z0-9]$")) ~= nil
end

--- The connection settings of the context `want` (nil: current-context) of a parsed kubeconfig.
---@param doc any  core.yaml's value of the kubeconfig
---@param want string|nil
---@return table
function Reader:resolve(doc, want)
  if type(doc) ~= "table" then self:refuse("(top)", "must be a mapping (apiVersion: v1, kind: Config)") end
  local kind = self:string(doc, "kind", "kind")
  if kind and kind ~= "Config" then self:refuse("kind", ("%q, not Config"):format(kind)) end
  local clusters = self:named(doc, "clusters", "cluster")
  local users = self:named(doc, "users", "user")
  local contexts = self:named(doc, "contexts", "context")
  local name = want or self:string(doc, "current-context", "current-context")
  if not name or name == "" then self:refuse("current-context", "is not set, and no context was named") end
  local ctx = contexts[name]
  if not ctx then self:refuse(want and "contexts" or "current-context", ("no context named %q"):format(name)) end
  local cfield = ("contexts[%d].context"):format(ctx.index)
  local cname = self:string(ctx.value, "cluster", cfield .. ".cluster", true)
  local uname = self:string(ctx.value, "user", cfield .. ".user", true)
  if not clusters[cname] then self:refuse(cfield .. ".cluster", ("no cluster named %q"):format(cname)) end
  if not users[uname] then self:refuse(cfield .. ".user", ("no user named %q"):format(uname)) end
  local ns = self:string(ctx.value, "namespace", cfield .. ".namespace") or ""
  if ns == "" then ns = "default" end
  if not dns_label(ns) then self:refuse(cfield .. ".namespace", ("%q is not a namespace name (RFC 1123 label)"):format(ns)) end
  local out = { source = self.source, context = name, cluster = cname, user = uname, namespace = ns }
  self:cluster(clusters[cname].value, ("clusters[%d].cluster"):format(clusters[cname].index), out)
  self:user(users[uname].value, ("users[%d].user"):format(users[uname].index), out)
  return out
end

local function read_file(path, max) return fs.read_file(path, 0, max) end

local function redacted(cfg)
  return ("kubeconfig %s: context %s, server %s, user %s"):format(cfg.source, cfg.context, cfg.server, cfg.user)
end

---@class kubeconfig.Config
---@field source string  the kubeconfig's path (or the name given to parse)
---@field context string
---@field cluster string
---@field user string
---@field server string  the API server's URL, no final "/"
---@field namespace string  the context's, or "default"
---@field ca_pem string|nil  PEM of the CA that verifies the server (nil: the system's)
---@field insecure boolean|nil  true: do not verify the server (only when allowed)
---@field cert_pem string|nil  client certificate (with key_pem)
---@field key_pem string|nil
---@field token string|nil  bearer token

--- Reads a kubeconfig from its text. opts: source (its name in messages, default
--- "(text)"), dir (the folder relative paths resolve against; nil: relative paths are
--- refused), context (a context's name instead of current-context), allow_insecure
--- (accept insecure-skip-tls-verify: true), read (function(path, max_bytes) -> bytes |
--- nil, msg; default core.fs.read_file). Returns the settings (kubeconfig.Config; its
--- tostring names no secret) or nil, msg, "EINVAL".
---@param text string
---@param opts table|nil
---@return kubeconfig.Config|nil cfg, string|nil err, string|nil code
function kubeconfig.parse(text, opts)
  opts = opts or {}
  local r = setmetatable({ source = opts.source or "(text)", dir = opts.dir, read = opts.read or read_file,
    allow_insecure = opts.allow_insecure == true }, Reader)
  local doc, msg = yaml.decode(text, { max_bytes = kubeconfig.MAX_BYTES, max_nodes = 100000 })
  if doc == nil then return nil, ("kubeconfig %s: %s"):format(r.source, msg), "EINVAL" end
  local ok, res = pcall(r.resolve, r, doc, opts.context)
  if not ok then
    if type(res) == "table" and res.kubeconfig then return nil, res.kubeconfig, "EINVAL" end
    error(res, 0)
  end
  return setmetatable(res, { __tostring = redacted })
end

--- The kubeconfig's path: `path`, else the first entry of KUBECONFIG, else ~/.kube/config.
---@param path string|nil
---@param env table|nil  {KUBECONFIG=, HOME=} in place of the process's environment
---@return string
function kubeconfig.path(path, env)
  if path and path ~= "" then return path end
  local getenv = env and function(k) return env[k] end or os.getenv
  local list = getenv("KUBECONFIG")
  local first = list and list:match("^([^:]+)")
  if first then return first end
  return (getenv("HOME") or "/root") .. "/.kube/config"
end

--- Reads a kubeconfig file (kubeconfig.path(opts.path, opts.env)). opts as for
--- kubeconfig.parse, plus path and env. Returns the settings or nil, msg, code (ENOENT
--- when the file is missing, EINVAL for what it holds).
---@param opts table|nil
---@return kubeconfig.Config|nil cfg, string|nil err, string|nil code
function kubeconfig.load(opts)
  opts = opts or {}
  local path = kubeconfig.path(opts.path, opts.env)
  local read = opts.read or read_file
  local text, msg, code = read(path, kubeconfig.MAX_BYTES + 1)
  if not text then return nil, ("kubeconfig %s: cannot read it: %s"):format(path, msg), code or "ENOENT" end
  if #text > kubeconfig.MAX_BYTES then
    return nil, ("kubeconfig %s: larger than %d bytes"):format(path, kubeconfig.MAX_BYTES), "EINVAL"
  end
  local dir = path:match("^(.*)/[^/]*$")
  if dir == "" then dir = "/" elseif not dir then dir = "." end
  return kubeconfig.parse(text, { source = path, dir = dir, context = opts.context, read = read,
    allow_insecure = opts.allow_insecure })
end

return kubeconfig
