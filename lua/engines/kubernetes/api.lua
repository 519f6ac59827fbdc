-- A small Kubernetes REST client over core.http: the calls the Kubernetes engine adapter
-- makes (the version, access reviews, ConfigMaps, NetworkPolicies, Pods and their logs,
-- Leases), each as one JSON request from inside an async task. Connection and credentials
-- come from a kubeconfig (demesne.engines.kubernetes.kubeconfig): the server's CA and a client
-- certificate, or a bearer token, held in memory and never logged.
--
-- Every call returns the decoded JSON (or true, or the text of a log), or nil, msg, code,
-- status: msg is the API server's own metav1.Status message prefixed with what was asked
-- ("create configmaps demesne-init-1 in ns: ..."), code a stable string (ENOENT, EEXIST,
-- ECONFLICT, EACCES, EINVAL, ...). Exec is elsewhere (it is a WebSocket).
local http = require("core.http")
local loop = require("core.loop")
local async = require("demesne.async")
local json = require("demesne.json")
local util = require("demesne.util")

local api = {}
local Client = {}
Client.__index = Client

local request = async.wrap(http.request)

api.DEFAULT_TIMEOUT_MS = 30000
--- Largest answer read, in bytes (a list of many pods, a log).
api.MAX_BODY_BYTES = 64 * 1024 * 1024

--- The group/version and scope of each resource this client names.
api.RESOURCES = {
  namespaces = { prefix = "/api/v1", namespaced = false },
  nodes = { prefix = "/api/v1", namespaced = false },
  pods = { prefix = "/api/v1", namespaced = true },
  configmaps = { prefix = "/api/v1", namespaced = true },
  events = { prefix = "/api/v1", namespaced = true },
  serviceaccounts = { prefix = "/api/v1", namespaced = true },
  networkpolicies = { prefix = "/apis/networking.k8s.io/v1", namespaced = true, group = "networking.k8s.io" },
  leases = { prefix = "/apis/coordination.k8s.io/v1", namespaced = true, group = "coordination.k8s.io" },
  runtimeclasses = { prefix = "/apis/node.k8s.io/v1", namespaced = false, group = "node.k8s.io" },
}

-- The error code of an answer: by its Status reason first (409 is both a name taken and a
-- stale resourceVersion), then by its HTTP status.
local REASONS = { AlreadyExists = "EEXIST", Conflict = "ECONFLICT", NotFound = "ENOENT", Forbidden = "EACCES",
  Unauthorized = "EACCES", Invalid = "EINVAL", BadRequest = "EINVAL", Gone = "ESTALE", TooManyRequests = "EAGAIN",
  RequestEntityTooLarge = "E2BIG", Timeout = "ETIMEDOUT", ServerTimeout = "ETIMEDOUT" }
local STATUSES = { [400] = "EINVAL", [401] = "EACCES", [403] = "EACCES", [404] = "ENOENT", [405] = "EINVAL",
  [409] = "ECONFLICT", [410] = "ESTALE", [413] = "E2BIG", [415] = "EINVAL", [422] = "EINVAL", [429] = "EAGAIN",
  [504] = "ETIMEDOUT" }

local VERBS = { GET = "get", POST = "create", PUT = "update", PATCH = "patch", DELETE = "delete" }

--- A name the API accepts in a path (an RFC 1123 subdomain: lower-case letters, digits,
--- '-' and '.', at most 253 bytes). Raises otherwise: the callers build names themselves.
---@param name string
---@return string
function api.name(name)
  if type(name) ~= "string" or #name == 0 or #name > 253 or not name:match("^[a-z0-9]")
    or not name:match("[a-z0-9]$") or name:find("[^a-z0-9%.%-]") then
    error(("kubernetes: %q is not an object name (RFC 1123 subdomain)"):format(tostring(name)), 2)
  end
  return name
end

--- The API path of `resource` (in namespace `ns` when it is namespaced), optionally of
--- one object `name` and its `sub`resource ("log", "status").
---@param resource string  a key of api.RESOURCES
---@param ns string|nil
---@param name string|nil
---@param sub string|nil
---@return string
function api.path(resource, ns, name, sub)
  local r = api.RESOURCES[resource] or error("kubernetes: unknown resource " .. tostring(resource), 2)
  local p = r.prefix
  if r.namespaced then p = p .. "/namespaces/" .. api.name(ns) end
  p = p .. "/" .. resource
  if name then p = p .. "/" .. api.name(name) end
  if sub then p = p .. "/" .. sub end
  return p
end

local query = util.query_string

-- "create pods/x in ns" from the method and path, for messages
local function describe(method, path)
  local verb = VERBS[method] or method
  local ns, rest = path:match("/namespaces/([^/]+)/(.+)$")
  rest = rest or path:match("^/api/v1/(.+)$") or path:match("^/apis/[^/]+/[^/]+/(.+)$") or path:gsub("^/", "")
  if method == "GET" and api.RESOURCES[rest] then verb = "list" end
  return ns and ("%s %s in %s"):format(verb, rest, ns) or ("%s %s"):format(verb, rest)
end

--- The error of an answer that is not 2xx: its metav1.Status message (or the start of its
--- body), prefixed with `what`. Returns nil, msg, code, status.
---@param res table  core.http's {status, headers, body}
---@param what string
---@return nil, string, string, integer
function api.status_error(res, what)
  local st = json.decode(res.body or "")
  local msg, reason
  if type(st) == "table" and st.kind == "Status" then
    msg = type(st.message) == "string" and st.message or nil
    reason = type(st.reason) == "string" and st.reason or nil
  end
  if not msg then
    msg = (res.body or ""):gsub("%s+$", ""):sub(1, 300)
    if msg == "" then msg = "HTTP " .. res.status end
  end
  local code = REASONS[reason] or STATUSES[res.status] or (res.status >= 500 and "EENGINE") or "EKUBERNETES"
  if res.status == 401 then msg = "the API server did not accept the kubeconfig's credentials: " .. msg end
  return nil, ("%s: %s"):format(what, msg), code, res.status
end

--- A client for the cluster `cfg` describes (a kubeconfig.Config). opts: timeout_ms
--- (each request, default api.DEFAULT_TIMEOUT_MS), namespace (default cfg.namespace).
---@param cfg table
---@param opts table|nil
---@return table client
function api.new(cfg, opts)
  opts = opts or {}
  assert(type(cfg) == "table" and type(cfg.server) == "string", "api.new: a kubeconfig.Config")
  local headers = { Accept = "application/json", ["User-Agent"] = "demesne/" .. loop.version }
  local c = setmetatable({ server = cfg.server, namespace = opts.namespace or cfg.namespace or "default",
    timeout_ms = opts.timeout_ms or api.DEFAULT_TIMEOUT_MS, headers = headers }, Client)
  -- the credentials stay in a closure: not a field a log or a JSON dump of the client would show
  local tls = { ca_pem = cfg.ca_pem, cert_pem = cfg.cert_pem, key_pem = cfg.key_pem, insecure = cfg.insecure or nil }
  local bearer = cfg.token and ("Bearer " .. cfg.token) or nil
  c.credentials = function(req)
    for k, v in pairs(tls) do req[k] = v end
    if bearer then req.headers.Authorization = bearer end
    return req
  end
  return c
end

---@class kubernetes.RequestOpts
---@field query table|nil  query parameters
---@field raw boolean|nil  return the body as text (a log), not decoded JSON
---@field content_type string|nil  of the body (default application/json)
---@field timeout_ms integer|nil
---@field what string|nil  what the call does, for messages (default: from the method and path)

--- One API call: `method` on `path` (built with api.path) with the JSON `body` (a table,
--- or nil). Returns the decoded answer (true when it has no body; the text with opts.raw),
--- or nil, msg, code, status.
---@param method string
---@param path string
---@param body table|nil
---@param opts kubernetes.RequestOpts|nil
---@return any|nil value, string|nil err, string|nil code, integer|nil status
function Client:request(method, path, body, opts)
  opts = opts or {}
  local headers = {}
  for k, v in pairs(self.headers) do headers[k] = v end
  local req = self.credentials({ method = method, url = self.server .. path .. query(opts.query), headers = headers,
    timeout_ms = opts.timeout_ms or self.timeout_ms, connect_timeout_ms = 5000, max_body_bytes = api.MAX_BODY_BYTES })
  if body ~= nil then
    req.body = json.encode(body)
    headers["Content-Type"] = opts.content_type or "application/json"
  end
  local what = opts.what or describe(method, path)
  local res, err, code = request(req)
  if not res then
    if code == "ECONNREFUSED" or code == "EAI_NONAME" or code == "ETIMEDOUT" and err:find("onnect") then
      return nil, ("%s: the Kubernetes API server at %s is not answering (%s)"):format(what, self.server, err), "ENOENGINE"
    end
    return nil, ("%s: %s"):format(what, err), code
  end
  if res.status < 200 or res.status >= 300 then return api.status_error(res, what) end
  if opts.raw then return res.body end
  if res.body == nil or res.body == "" then return true end
  local v = json.decode(res.body)
  if v == nil then return nil, what .. ": the API server's answer is not JSON", "EPROTO", res.status end
  return v
end

--- GET /version: {major, minor, gitVersion, ...}.
---@return table|nil version, string|nil err, string|nil code
function Client:version() return self:request("GET", "/version") end

--- Whether the kubeconfig's user may `verb` the `resource` in the client's namespace
--- (SelfSubjectAccessReview). opts: group (the API group, default the resource's), sub
--- (subresource: "exec", "log"), name, namespace. Returns allowed, reason (the
--- authorizer's words, or "") or nil, msg, code.
---@param verb string  "create", "get", "list", "watch", "delete", "update"...
---@param resource string
---@param opts table|nil
---@return boolean|nil allowed, string|nil reason, string|nil code
function Client:can_i(verb, resource, opts)
  opts = opts or {}
  local known = api.RESOURCES[resource]
  local attrs = { verb = verb, resource = resource, namespace = opts.namespace or self.namespace,
    group = opts.group or (known and known.group) or "", subresource = opts.sub, name = opts.name }
  local v, err, code = self:request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
    { apiVersion = "authorization.k8s.io/v1", kind = "SelfSubjectAccessReview", spec = { resourceAttributes = attrs } },
    { what = ("may I %s %s%s"):format(verb, resource, opts.sub and "/" .. opts.sub or "") })
  if not v then return nil, err, code end
  local st = type(v.status) == "table" and v.status or {}
  return st.allowed == true, type(st.reason) == "string" and st.reason or ""
end

--- Creates `obj` (its kind's resource `resource`) in the client's namespace, or in
--- opts.namespace. Returns the object the server made.
---@param resource string
---@param obj table
---@param opts table|nil  {namespace=}
---@return table|nil obj, string|nil err, string|nil code
function Client:create(resource, obj, opts)
  local ns = opts and opts.namespace or self.namespace
  local name = type(obj.metadata) == "table" and obj.metadata.name or "?"
  return self:request("POST", api.path(resource, ns), obj,
    { what = ("create %s/%s%s"):format(resource, name, api.RESOURCES[resource].namespaced and " in " .. ns or "") })
end

--- The object `name` of `resource` (ENOENT when there is none).
---@param resource string
---@param name string
---@param opts table|nil  {namespace=}
---@return table|nil obj, string|nil err, string|nil code
function Client:get(resource, name, opts)
  return self:request("GET", api.path(resource, opts and opts.namespace or self.namespace, name))
end

--- Replaces `obj` (PUT): its metadata.resourceVersion must be the one read, or the server
--- answers ECONFLICT (someone changed it since).
---@param resource string
---@param obj table
---@param opts table|nil  {namespace=}
---@return table|nil obj, string|nil err, string|nil code
function Client:update(resource, obj, opts)
  return self:request("PUT", api.path(resource, opts and opts.namespace or self.namespace, obj.metadata.name), obj)
end

--- Changes the object `name` with a JSON merge patch (RFC 7386: `patch` holds the fields to
--- set; a field set to json.null is removed), e.g. {metadata = {annotations = {k = "v"}}}.
--- Returns the changed object.
---@param resource string
---@param name string
---@param patch table
---@param opts table|nil  {namespace=}
---@return table|nil obj, string|nil err, string|nil code
function Client:patch(resource, name, patch, opts)
  return self:request("PATCH", api.path(resource, (opts or {}).namespace or self.namespace, name), patch,
    { content_type = "application/merge-patch+json" })
end

--- Deletes the object `name`. opts: grace_seconds (gracePeriodSeconds; 0 for pods: at
--- once), namespace. Returns true (or the Status or object the server answers) or nil, msg, code.
---@param resource string
---@param name string
---@param opts table|nil
---@return any|nil ok, string|nil err, string|nil code
function Client:delete(resource, name, opts)
  opts = opts or {}
  local q = opts.grace_seconds and { gracePeriodSeconds = opts.grace_seconds } or nil
  return self:request("DELETE", api.path(resource, opts.namespace or self.namespace, name), nil, { query = q })
end

--- The objects of `resource` in the namespace whose labels match `selector` (a
--- labelSelector: "a=b,c"); opts: field (a fieldSelector), namespace. Returns the items
--- (an array) and the list's resourceVersion.
---@param resource string
---@param selector string|nil
---@param opts table|nil
---@return table|nil items, string|nil err_or_rv, string|nil code
function Client:list(resource, selector, opts)
  opts = opts or {}
  local q = {}
  if selector then q.labelSelector = selector end
  if opts.field then q.fieldSelector = opts.field end
  local v, err, code = self:request("GET", api.path(resource, opts.namespace or self.namespace), nil, { query = q })
  if not v then return nil, err, code end
  return type(v.items) == "table" and v.items or {}, type(v.metadata) == "table" and v.metadata.resourceVersion or nil
end

--- The log of a pod's container (text), at most opts.limit_bytes (default 1 MiB).
---@param name string
---@param container string|nil
---@param opts table|nil  {limit_bytes=, namespace=}
---@return string|nil log, string|nil err, string|nil code
function Client:pod_log(name, container, opts)
  opts = opts or {}
  return self:request("GET", api.path("pods", opts.namespace or self.namespace, name, "log"), nil,
    { raw = true, query = { container = container, limitBytes = opts.limit_bytes or 1024 * 1024 } })
end

---@class kubernetes.ContainerState
---@field state string  "waiting", "running", "terminated" or "unknown"
---@field reason string|nil  ("ContainerCreating", "Completed", "Error", "ErrImageNeverPull"...)
---@field message string|nil
---@field exit_code integer|nil  (terminated)

-- The first container's state in a pod's status
local function container_state(pod)
  local cs = type(pod.status) == "table" and pod.status.containerStatuses
  local s = type(cs) == "table" and type(cs[1]) == "table" and cs[1].state
  if type(s) ~= "table" then return { state = "unknown" } end
  for _, k in ipairs({ "terminated", "running", "waiting" }) do
    local v = s[k]
    if type(v) == "table" then
      return { state = k, reason = v.reason, message = v.message,
        exit_code = type(v.exitCode) == "number" and math.tointeger(v.exitCode) or nil }
    end
  end
  return { state = "unknown" }
end

local WAITING_FOR_GOOD = { ErrImageNeverPull = true, InvalidImageName = true, CreateContainerConfigError = true,
  CreateContainerError = true }

--- Waits until the pod `name` is Running (opts.wait_for = "running", the default) or has
--- ended (wait_for = "ended": Succeeded or Failed), polling every opts.interval_ms (default
--- 100) for at most opts.timeout_ms (default 60000). A container that cannot start
--- (ErrImageNeverPull, CreateContainerError...) ends the wait as well. Returns the phase
--- ("Running", "Succeeded", "Failed", or "Pending" for a container that cannot start),
--- the first container's state and the pod; or nil, msg, code (ETIMEDOUT with the last
--- phase and state in msg, ENOENT when the pod is gone).
---@param name string
---@param opts table|nil
---@return string|nil phase, kubernetes.ContainerState|string state_or_err, table|string|nil pod_or_code
function Client:wait_pod(name, opts)
  opts = opts or {}
  local want_end = opts.wait_for == "ended"
  local deadline = loop.now() + (opts.timeout_ms or 60000)
  local phase, state
  repeat
    local pod, err, code = self:get("pods", name, opts)
    if not pod then return nil, err, code end
    phase = type(pod.status) == "table" and pod.status.phase or "Pending"
    state = container_state(pod)
    if phase == "Succeeded" or phase == "Failed" then return phase, state, pod end
    if phase == "Running" and not want_end then return phase, state, pod end
    if state.state == "waiting" and WAITING_FOR_GOOD[state.reason] then return phase, state, pod end
    async.sleep(opts.interval_ms or 100)
  until loop.now() >= deadline
  return nil, ("wait for pods/%s in %s: still %s (container %s%s) after %d ms"):format(name, opts.namespace or self.namespace,
    phase, state.state, state.reason and ", " .. state.reason or "", opts.timeout_ms or 60000), "ETIMEDOUT"
end

--- A ConfigMap named `name` whose binaryData holds `files` (key -> bytes; keys are file
--- names in a mounted volume), with `labels`. The API refuses one whose values add up to
--- more than 1,048,576 bytes (before base64; keys are not counted).
---@param name string
---@param files table<string, string>
---@param labels table|nil
---@return table
function api.configmap(name, files, labels)
  local data = {}
  for k, v in pairs(files) do data[k] = util.base64(v) end
  return { apiVersion = "v1", kind = "ConfigMap", metadata = { name = api.name(name), labels = labels },
    binaryData = data, immutable = true }
end

--- The bytes of a ConfigMap's binaryData key `key` (nil, msg when it is missing or not base64).
---@param cm table
---@param key string
---@return string|nil bytes, string|nil err
function api.configmap_file(cm, key)
  local b = type(cm.binaryData) == "table" and cm.binaryData[key]
  if type(b) ~= "string" then return nil, ("configmaps/%s: no binaryData key %q"):format(cm.metadata.name, key) end
  local bytes = util.base64_decode(b)
  if not bytes then return nil, ("configmaps/%s: binaryData %q is not base64"):format(cm.metadata.name, key) end
  return bytes
end

--- A NetworkPolicy named `name` that denies all ingress and egress of the pods whose labels
--- match `match_labels` (a table; {} selects every pod of the namespace).
---@param name string
---@param match_labels table
---@return table
function api.deny_all_policy(name, match_labels)
  return { apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy", metadata = { name = api.name(name) },
    spec = { podSelector = { matchLabels = match_labels }, policyTypes = json.array({ "Ingress", "Egress" }) } }
end

-- RFC 3339 with microseconds, as metav1.MicroTime wants (a Lease's times), of seconds since the epoch
local function micro_time(t)
  local s = math.floor(t)
  return os.date("!%Y-%m-%dT%H:%M:%S", s) .. (".%06dZ"):format(math.floor((t - s) * 1e6))
end

--- A Lease named `name` held by `holder` for `duration_s` seconds, renewed now (`now`:
--- seconds since the epoch, default core.loop.time()).
---@param name string
---@param holder string
---@param duration_s integer
---@param labels table|nil
---@param now number|nil
---@return table
function api.lease(name, holder, duration_s, labels, now)
  now = micro_time(now or loop.time())
  return { apiVersion = "coordination.k8s.io/v1", kind = "Lease", metadata = { name = api.name(name), labels = labels },
    spec = { holderIdentity = holder, leaseDurationSeconds = duration_s, acquireTime = now, renewTime = now } }
end

--- Renews a Lease read earlier (`lease`, as the server returned it): sets renewTime to now
--- and PUTs it with its resourceVersion. Returns the renewed Lease, or nil, msg,
--- "ECONFLICT" when it changed since it was read.
---@param lease table
---@param now number|nil  seconds since the epoch (default core.loop.time())
---@return table|nil lease, string|nil err, string|nil code
function Client:renew_lease(lease, now)
  lease.spec.renewTime = micro_time(now or loop.time())
  return self:update("leases", lease, { namespace = lease.metadata.namespace })
end

return api
