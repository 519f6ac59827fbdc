-- The Kubernetes engine adapter: each sandbox is one Pod on a cluster, reached through the
-- API server (lua/engines/kubernetes/api.lua) with the kubeconfig's credentials, and
-- commands run in it by the exec subresource over a WebSocket (lua/engines/kubernetes/exec.lua).
-- No controller, CRD or in-cluster daemon of demesne's own: what lives in the cluster is
--   * one Pod per sandbox (restartPolicy Never), labelled app.kubernetes.io/managed-by=demesne,
--     demesne.dev/sandbox=<pod> and demesne.dev/instance=<this server's instance>, with the
--     spec's own labels (any string) kept in the annotation demesne.dev/labels;
--   * a ConfigMap demesne-init-<hash> holding demesne-init, made once per build of it and
--     mounted read-only at /.demesne/bin: the Pod's PID 1 (no registry image of demesne's own);
--   * the NetworkPolicy demesne-deny-all (no ingress, no egress for demesne's Pods), made
--     once per namespace;
--   * a Lease demesne-instance-<id> per server instance, renewed while it runs: at start-up
--     the Pods of an instance whose Lease expired are removed.
-- A Pod cannot be created without starting it, so `create` starts its container as
-- `demesne-init hold /.demesne/gate/start -- <entrypoint> <command>`, which waits for the
-- gate file, and `start` writes that file (an exec of `demesne-init release`), then marks
-- the Pod started (the annotation demesne.dev/started): the engine-neutral "created" state
-- is a Pod whose container holds at the gate.
-- Engine-neutral terms only above this file (docs/reference/engines.md); the Pod's JSON is
-- built and read here.
local api = require("demesne.engines.kubernetes.api")
local async = require("demesne.async")
local config = require("demesne.config")
local engine_spec = require("demesne.engines.spec")
local exec = require("demesne.engines.kubernetes.exec")
local fs = require("core.fs")
local httpd = require("core.httpd")
local json = require("demesne.json")
local kubeconfig = require("demesne.engines.kubernetes.kubeconfig")
local log = require("demesne.log")
local loop = require("core.loop")
local text = require("core.text")
local timer = require("core.timer")

local kubernetes = {}

local LOG = "demesne.engines.kubernetes"

--- Where demesne-init is mounted in every Pod, and the gate folder `hold` waits on.
kubernetes.BIN = "/.demesne/bin"
kubernetes.INIT = kubernetes.BIN .. "/demesne-init"
kubernetes.GATE = "/.demesne/gate/start"
--- The container's name in each Pod.
kubernetes.CONTAINER = "sandbox"
--- The most bytes of values a ConfigMap may hold (the API server refuses more).
kubernetes.CONFIGMAP_MAX_BYTES = 1048576

local MANAGED = "app.kubernetes.io/managed-by"
local A_LABELS, A_NAME, A_STARTED, A_LIMITS = "demesne.dev/labels", "demesne.dev/name", "demesne.dev/started",
  "demesne.dev/limits"
local L_SANDBOX, L_INSTANCE = "demesne.dev/sandbox", "demesne.dev/instance"
local POLICY = "demesne-deny-all"
local LEASE_SECONDS = 120 -- a Lease not renewed for this long is an instance that is gone
local RENEW_MS = 30000

local function hex(n) return (loop.random(n):gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

--- The Pod name of a container name or id: lower case, '_' and '.' as '-' (an RFC 1123
--- label, at most 63 bytes, which Pod hostnames need).
---@param name string
---@return string
function kubernetes.pod_name(name)
  local n = tostring(name):lower():gsub("[^a-z0-9-]", "-"):gsub("^-+", ""):sub(1, 63):gsub("-+$", "")
  return n ~= "" and n or "demesne"
end

--- A string as Kubernetes keeps it in a container's command, args and env values: the
--- kubelet expands $(VAR) there and turns $$ into $, so every $ is doubled and the program
--- gets the string as written.
---@param s string
---@return string
function kubernetes.literal(s) return (tostring(s):gsub("%$", "$$")) end

-- Quantity strings of the API (resource.Quantity): bytes as an integer, CPUs in millicores.
local function cpu_quantity(cpus) return ("%dm"):format(math.max(1, math.floor(cpus * 1000 + 0.5))) end

-- uid[:gid] of spec.user: the Pod's securityContext takes numbers only.
local function numeric_user(u)
  local uid, gid = tostring(u):match("^(%d+):(%d+)$")
  if uid then return math.tointeger(uid), math.tointeger(gid) end
  uid = tostring(u):match("^(%d+)$")
  if uid then return math.tointeger(uid) end
  return nil
end

--- The Pod a sandbox spec describes (already checked by engine_spec.check), for the
--- adapter's settings `o` {namespace, instance, init_configmap, image_prefix, pull_secrets,
--- runtime_classes, node_name}. Returns the Pod, or nil, message, "ENOTSUP"/"EINVAL" for
--- what a Pod cannot express.
---@param s table  the sandbox spec (docs/reference/engines.md)
---@param o table
---@return table|nil pod, string|nil err, string|nil code
function kubernetes.pod(s, o)
  if not s.entrypoint or #s.entrypoint == 0 then
    return nil, "spec.entrypoint: the kubernetes adapter needs the program to run (it cannot read an image's ENTRYPOINT)",
      "ENOTSUP"
  end
  local uid, gid
  if s.user then
    uid, gid = numeric_user(s.user)
    if not uid then
      return nil, ("spec.user: %q: a Pod runs as a numeric uid[:gid] only"):format(s.user), "ENOTSUP"
    end
  end
  local name = kubernetes.pod_name(s.name or ("demesne-" .. hex(6)))
  local cmd = { kubernetes.INIT, "hold", kubernetes.GATE, "--" }
  for _, a in ipairs(s.entrypoint) do cmd[#cmd + 1] = kubernetes.literal(a) end
  for _, a in ipairs(s.command or {}) do cmd[#cmd + 1] = kubernetes.literal(a) end
  local env = {}
  for _, e in ipairs(s.env or {}) do
    local k, v = e:match("^([^=]+)=(.*)$")
    env[#env + 1] = { name = k, value = kubernetes.literal(v) }
  end
  local volumes = {
    { name = "demesne-init", configMap = { name = o.init_configmap, defaultMode = 365 } }, -- 0555
    { name = "demesne-gate", emptyDir = { medium = "Memory", sizeLimit = "1Mi" } },
  }
  local mounts = {
    { name = "demesne-init", mountPath = kubernetes.BIN, readOnly = true },
    { name = "demesne-gate", mountPath = "/.demesne/gate" },
  }
  for i, t in ipairs(s.tmpfs or {}) do
    volumes[#volumes + 1] = { name = ("tmpfs-%d"):format(i), emptyDir = { medium = "Memory" } }
    mounts[#mounts + 1] = { name = ("tmpfs-%d"):format(i), mountPath = t.target }
  end
  local limits = {}
  local l = s.limits or {}
  if l.memory_bytes then limits.memory = tostring(l.memory_bytes) end
  if l.cpus then limits.cpu = cpu_quantity(l.cpus) end
  local sec = s.security or {}
  local container = {
    name = kubernetes.CONTAINER, image = kubernetes.image_ref(s.image, o.image_prefix),
    imagePullPolicy = "IfNotPresent", command = cmd, env = json.array(env), workingDir = s.workdir,
    volumeMounts = mounts, resources = { limits = limits, requests = limits },
    securityContext = {
      runAsUser = uid, runAsGroup = gid, allowPrivilegeEscalation = false,
      readOnlyRootFilesystem = s.read_only_rootfs or false,
      capabilities = { drop = json.array(sec.cap_drop or {}) },
      seccompProfile = { type = "RuntimeDefault" },
    },
  }
  local annotations = { [A_LABELS] = json.encode(s.labels or {}), [A_NAME] = s.name or name,
    [A_LIMITS] = json.encode(l) }
  local pod = {
    apiVersion = "v1", kind = "Pod",
    metadata = { name = name, namespace = o.namespace, annotations = annotations,
      labels = { [MANAGED] = "demesne", [L_SANDBOX] = name, [L_INSTANCE] = o.instance } },
    spec = {
      restartPolicy = "Never", automountServiceAccountToken = false, enableServiceLinks = false,
      -- no cluster DNS: a sandbox resolves names through demesne's proxy, not the cluster's
      dnsPolicy = "None", dnsConfig = { nameservers = { "127.0.0.1" } },
      hostname = s.hostname and kubernetes.pod_name(s.hostname) or nil,
      terminationGracePeriodSeconds = 1, containers = { container }, volumes = volumes,
      nodeName = o.node_name,
    },
  }
  if o.pull_secrets and #o.pull_secrets > 0 then
    local list = {}
    for _, n in ipairs(o.pull_secrets) do list[#list + 1] = { name = n } end
    pod.spec.imagePullSecrets = list
  end
  if s.runtime then
    local class = (o.runtime_classes or {})[s.runtime]
    if not class then
      return nil, ("spec.runtime: the cluster has no RuntimeClass for %s"):format(s.runtime), "ENOTSUP"
    end
    pod.spec.runtimeClassName = class
  end
  return pod
end

--- The image reference the cluster pulls for `ref`: with an image prefix (the registry the
--- cluster pulls demesne's images from, e.g. "registry.example:5000" or "localhost"), a
--- reference that names no registry host gets it in front.
---@param ref string
---@param prefix string|nil
---@return string
function kubernetes.image_ref(ref, prefix)
  if not prefix or prefix == "" then return ref end
  local first = ref:match("^([^/]+)/")
  if first and (first:find("[.:]") or first == "localhost") then return ref end
  return prefix:gsub("/+$", "") .. "/" .. ref
end

local STATE_OF_PHASE = { Succeeded = "exited", Failed = "exited" }

-- The first container's status of a Pod, or {}.
local function container_status(pod)
  local cs = type(pod.status) == "table" and pod.status.containerStatuses
  return type(cs) == "table" and type(cs[1]) == "table" and cs[1] or {}
end

--- Container info (docs/reference/engines.md, "Container info") of a Pod.
---@param pod table
---@return table info
function kubernetes.container_info(pod)
  local md = pod.metadata or {}
  local ann = md.annotations or {}
  local phase = type(pod.status) == "table" and pod.status.phase or "Pending"
  local cs = container_status(pod)
  local term = type(cs.state) == "table" and cs.state.terminated
  local state = STATE_OF_PHASE[phase] or (ann[A_STARTED] and "running" or "created")
  if type(term) == "table" then state = "exited" end
  if md.deletionTimestamp then state = "removing" end
  -- annotations are whatever the Pod's writer put there: only tables of strings count
  local labels, limits = {}, {}
  local decoded = type(ann[A_LABELS]) == "string" and json.decode(ann[A_LABELS])
  if type(decoded) == "table" then
    for k, v in pairs(decoded) do
      if type(k) == "string" and type(v) == "string" then labels[k] = v end
    end
  end
  decoded = type(ann[A_LIMITS]) == "string" and json.decode(ann[A_LIMITS])
  if type(decoded) == "table" then
    for _, k in ipairs({ "memory_bytes", "cpus", "pids" }) do
      if type(decoded[k]) == "number" then limits[k] = decoded[k] end
    end
  end
  local code = type(term) == "table" and math.tointeger(term.exitCode) or nil
  if state == "exited" and code == nil and phase == "Failed" then code = 137 end -- killed (activeDeadlineSeconds)
  return {
    id = md.name, name = ann[A_NAME] or md.name, image = pod.spec and pod.spec.containers
      and pod.spec.containers[1] and pod.spec.containers[1].image,
    state = state, exit_code = state == "exited" and code or nil, paused = false, labels = labels,
    limits = { memory_bytes = limits.memory_bytes, cpus = limits.cpus, pids = limits.pids },
  }
end

---@class KubernetesEngine
local Engine = {}
Engine.__index = Engine

--- A Kubernetes engine (not contacted yet). `endpoint`: "kubernetes" or
--- "kubernetes:<kubeconfig path>" (the `engine` setting); the kubeconfig is otherwise the
--- `kubeconfig` setting, KUBECONFIG's first file or ~/.kube/config; the namespace the
--- `kubernetes_namespace` setting, else the kubeconfig context's. Returns the engine, or
--- nil and a message naming what is wrong with the kubeconfig.
---@param endpoint string|nil
---@return KubernetesEngine|nil engine, string|nil err
function kubernetes.new(endpoint)
  local path = endpoint and endpoint:match("^kubernetes:(.+)$")
  path = path and path:gsub("^//", "") or config.get("kubeconfig")
  local cfg, err = kubeconfig.load({ path = path ~= "" and path or nil, context = config.get("kubernetes_context") })
  if not cfg then return nil, err end
  local ns = config.get("kubernetes_namespace")
  ns = ns and ns ~= "" and ns or cfg.namespace
  local client = api.new(cfg, { namespace = ns })
  local eng = setmetatable({
    client = client, cfg = cfg, namespace = client.namespace, instance = hex(8),
    socket = ("kubernetes:%s/%s"):format(cfg.server, client.namespace),
    image_prefix = config.get("kubernetes_image_prefix"), pull_secrets = config.get("kubernetes_pull_secrets"),
    capabilities = {
      bind_mounts = false, unix_socket_mounts = false, tmpfs = true, read_only_rootfs = true, bounded_logs = false,
      networks = { none = true }, network_none = "policy", runtimes = {}, userns = false, snapshots = false,
      pause = false, limits = true, exec_user = false,
    },
  }, Engine)
  return eng
end

--- {name = "Kubernetes", version = the API server's gitVersion, api = "v1"}.
function Engine:info()
  local v, err, code = self.client:version()
  if not v then return nil, err, code end
  return { name = "Kubernetes", version = tostring(v.gitVersion or (tostring(v.major) .. "." .. tostring(v.minor))),
    api = "v1" }
end

--- What the cluster offers beyond the defaults (docs/reference/engines.md, eng:probe): a
--- RuntimeClass for gVisor (named gvisor, or with the handler runsc), whose name a Pod with
--- spec.runtime "gvisor" gets as runtimeClassName. Returns {engine = "kubernetes", gvisor =
--- {ok, detail, fix}, limits = {ok, detail}, userns = false, userns_detail} and sets
--- capabilities.runtimes.
function Engine:probe()
  local classes, err, code = self.client:request("GET", api.path("runtimeclasses"))
  if not classes then
    if code ~= "ENOENT" and code ~= "EACCES" then return nil, err, code end
    classes = { items = {} }
  end
  local gvisor
  for _, c in ipairs(classes.items or {}) do
    local name = c.metadata and c.metadata.name
    if name == "gvisor" or c.handler == "runsc" then gvisor = gvisor or name end
  end
  self.runtime_classes = { gvisor = gvisor }
  self.capabilities.runtimes = { gvisor = gvisor and true or nil }
  return {
    engine = "kubernetes",
    gvisor = gvisor and { ok = true, detail = ("RuntimeClass %s"):format(gvisor) }
      or { ok = false, detail = "the cluster has no RuntimeClass gvisor (or with the handler runsc)",
        fix = "install gVisor on the nodes and create a RuntimeClass for it (handler runsc)" },
    limits = { ok = true, detail = "memory and CPU limits are Pod resources (limits = requests); the process limit "
      .. "is the node's (the kubelet's podPidsLimit), not the sandbox's" },
    userns = false,
    userns_detail = "a Pod runs in its node's user namespace (Kubernetes 1.20 cannot give it one of its own)",
  }
end

-- The object `name` of `resource` as the API has it, made from make() when there is none
-- (another instance making it at the same moment is EEXIST: then it is read). The caller
-- checks what it got: an object found by name is anyone's.
local function get_or_create(self, resource, name, make)
  local obj, err, code = self.client:get(resource, name)
  if obj or code ~= "ENOENT" then return obj, err, code end
  obj, err, code = self.client:create(resource, make())
  if not obj and code == "EEXIST" then return self.client:get(resource, name) end
  return obj, err, code
end

-- demesne-init as a ConfigMap named by its hash, made once.
local function ensure_init(self)
  local path, perr = config.init_path()
  if not path then return nil, perr, "ENOENT" end
  local bytes = fs.read_file(path)
  if not bytes then return nil, "cannot read demesne-init at " .. path, "EIO" end
  if #bytes > kubernetes.CONFIGMAP_MAX_BYTES then
    return nil, ("demesne-init at %s is %d bytes, more than the %d a ConfigMap holds"):format(path, #bytes,
      kubernetes.CONFIGMAP_MAX_BYTES), "E2BIG"
  end
  local name = "demesne-init-" .. text.sha256(bytes):sub(1, 16)
  local cm, err, code = get_or_create(self, "configmaps", name, function()
    return api.configmap(name, { ["demesne-init"] = bytes }, { [MANAGED] = "demesne" })
  end)
  if not cm then return nil, err, code end
  -- its name is public (the hash of a public binary): anyone who may create ConfigMaps
  -- could have made it first, and its program would be every sandbox's PID 1
  if cm.immutable ~= true or api.configmap_file(cm, "demesne-init") ~= bytes then
    return nil, ("configmaps/%s in %s does not hold this demesne-init (or is not immutable): delete it, and "
      .. "find out who made it"):format(name, self.namespace), "ECONFLICT"
  end
  return name
end

--- Whether a NetworkPolicy is demesne's deny-all one: it selects exactly demesne's Pods,
--- applies to Ingress and Egress, and allows nothing (no rules).
---@param p table  a NetworkPolicy
---@return boolean
function kubernetes.is_deny_all(p)
  local sp = type(p) == "table" and type(p.spec) == "table" and p.spec or {}
  local sel = type(sp.podSelector) == "table" and sp.podSelector or {}
  local ml = type(sel.matchLabels) == "table" and sel.matchLabels or {}
  local n = 0
  for _ in pairs(ml) do n = n + 1 end
  local types = {}
  for _, t in ipairs(type(sp.policyTypes) == "table" and sp.policyTypes or {}) do types[t] = true end
  local function empty(x) return x == nil or (type(x) == "table" and next(x) == nil) end
  return n == 1 and ml[MANAGED] == "demesne" and empty(sel.matchExpressions) and types.Ingress == true
    and types.Egress == true and empty(sp.ingress) and empty(sp.egress)
end

local function ensure_policy(self)
  local p, err, code = get_or_create(self, "networkpolicies", POLICY, function()
    return api.deny_all_policy(POLICY, { [MANAGED] = "demesne" })
  end)
  if not p then return nil, err, code end
  if not kubernetes.is_deny_all(p) then
    return nil, ("networkpolicies/%s in %s is not demesne's deny-all policy (it selects other Pods or allows "
      .. "traffic): delete it, and find out who changed it"):format(POLICY, self.namespace), "ECONFLICT"
  end
  return true
end

--- Seconds since the epoch of an RFC 3339 time in UTC ("2026-12-03T19:00:00.123456Z", as
--- the API writes a Lease's renewTime), or nil. The days come from the civil date (H.
--- Hinnant's days_from_civil), not os.time, which reads a date as local time.
---@param s string
---@return integer|nil seconds
function kubernetes.epoch(s)
  local y, mo, d, h, mi, sec = tostring(s):match("^(%d+)-(%d+)-(%d+)T(%d+):(%d+):(%d+)")
  if not y then return nil end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  if mo <= 2 then y = y - 1 end
  local era = y // 400
  local yoe = y - era * 400
  local doy = (153 * (mo > 2 and mo - 3 or mo + 9) + 2) // 5 + d - 1
  local days = era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468
  return days * 86400 + tonumber(h) * 3600 + tonumber(mi) * 60 + tonumber(sec)
end
local epoch = kubernetes.epoch

-- This instance's Lease, renewed every RENEW_MS until eng:close(); and, once, the removal of
-- the Pods of instances whose Lease expired (or that have none).
local function ensure_lease(self)
  local name = "demesne-instance-" .. self.instance
  local lease, err, code = self.client:create("leases", api.lease(name, self.instance, LEASE_SECONDS,
    { [MANAGED] = "demesne" }))
  if not lease then return nil, err, code end
  self.lease = lease
  self.renewer = timer.new()
  self.renewer:start(RENEW_MS, RENEW_MS, function()
    async.spawn("renew lease " .. name, function()
      local l, rerr = self.client:renew_lease(self.lease)
      if l then self.lease = l else log.warning(LOG, "renewing %s: %s", name, tostring(rerr)) end
    end)
  end)
  return true
end

-- The Pods of instances whose Lease is gone or expired: removed (the servers that made them
-- were SIGKILLed, or their machine went away).
local function reap(self)
  local leases = self.client:list("leases", MANAGED .. "=demesne") or {}
  local alive, now = {}, loop.time()
  for _, l in ipairs(leases) do
    local sp = l.spec or {}
    local renewed = epoch(sp.renewTime)
    if renewed and type(sp.holderIdentity) == "string"
      and renewed + (tonumber(sp.leaseDurationSeconds) or LEASE_SECONDS) > now then
      alive[sp.holderIdentity] = true
    elseif l.metadata and l.metadata.name then
      self.client:delete("leases", l.metadata.name)
    end
  end
  local pods = self.client:list("pods", MANAGED .. "=demesne") or {}
  for _, p in ipairs(pods) do
    local inst = p.metadata.labels and p.metadata.labels[L_INSTANCE]
    if inst and not alive[inst] and inst ~= self.instance then
      log.info(LOG, "removing pods/%s of instance %s, whose Lease expired", p.metadata.name, inst)
      self.client:delete("pods", p.metadata.name, { grace_seconds = 1 })
    end
  end
end

--- What a Pod needs before the first create, once per engine: demesne-init's ConfigMap, the
--- deny-all NetworkPolicy, this instance's Lease, the reaping of gone instances' Pods, and
--- the node to place Pods on when the cluster has no scheduler (kubernetes_node). Callers
--- that come while it runs wait for the first. Returns true, or nil, msg, code.
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:prepare()
  if self.prepared then return true end
  if self.preparing then
    async.await(function(resume) self.preparing[#self.preparing + 1] = resume end)
    return self.prepared or nil, self.prepare_err, self.prepare_code
  end
  self.preparing = {}
  local function step()
    local name, err, code = ensure_init(self)
    if not name then return nil, err, code end
    self.init_configmap = name
    local ok
    ok, err, code = ensure_policy(self)
    if not ok then return nil, err, code end
    ok, err, code = ensure_lease(self)
    if not ok then return nil, err, code end
    reap(self)
    return true
  end
  local pok, ok, err, code = pcall(step)
  if not pok then ok, err, code = nil, "prepare: " .. tostring(ok), "EENGINE" end
  self.prepared, self.prepare_err, self.prepare_code = ok, err, code
  local waiting = self.preparing
  self.preparing = nil
  for _, r in ipairs(waiting) do r() end
  return ok, err, code
end

--- Stops renewing this instance's Lease and deletes it (its Pods are then the next
--- instance's to reap). For a server that shuts down, and for tests.
function Engine:close()
  if self.renewer then self.renewer:close(); self.renewer = nil end
  if self.lease then
    self.client:delete("leases", self.lease.metadata.name)
    self.lease, self.prepared = nil, nil
  end
end

local IMAGE_MISSING = { ErrImageNeverPull = true, ErrImagePull = true, ImagePullBackOff = true,
  InvalidImageName = true }

-- Waits until the container of Pod `name` runs (at the gate) or cannot start. Returns true,
-- or nil, msg, code (ENOENT for a missing image).
local function wait_running(self, name, image, timeout_ms)
  local deadline = loop.now() + timeout_ms
  repeat
    local pod, err, code = self.client:get("pods", name)
    if not pod then return nil, err, code end
    local phase = pod.status and pod.status.phase
    local st = container_status(pod).state or {}
    if st.running or phase == "Running" or phase == "Succeeded" or phase == "Failed" then return true end
    local w = st.waiting or {}
    if IMAGE_MISSING[w.reason] then
      return nil, ("create container: no such image: %s (%s: %s)"):format(image, w.reason, tostring(w.message or "")),
        "ENOENT"
    end
    if w.reason == "CreateContainerConfigError" or w.reason == "CreateContainerError" then
      return nil, ("create container: %s: %s"):format(w.reason, tostring(w.message or "")), "EENGINE"
    end
    async.sleep(100)
  until loop.now() >= deadline
  return nil, ("create container: pods/%s did not start within %d ms"):format(name, timeout_ms), "ETIMEDOUT"
end

--- Creates the sandbox's Pod and waits for its container to hold at the gate (state
--- "created"). Errors: EINVAL/ENOTSUP (spec), ECONFLICT (the name is taken), ENOENT (no
--- such image: the Pod is deleted again), ETIMEDOUT, or the API's.
---@param s table  the sandbox spec
---@return string|nil id, string|nil err, string|nil code
function Engine:create(s)
  local ok, err, code = engine_spec.check(s, self.capabilities)
  if not ok then return nil, "create container: " .. err, code end
  ok, err, code = self:prepare()
  if not ok then return nil, "create container: " .. tostring(err), code end
  local pod
  pod, err, code = kubernetes.pod(s, { namespace = self.namespace, instance = self.instance,
    init_configmap = self.init_configmap, image_prefix = self.image_prefix, pull_secrets = self.pull_secrets,
    runtime_classes = self.runtime_classes, node_name = config.get("kubernetes_node") })
  if not pod then return nil, "create container: " .. err, code end
  local made
  made, err, code = self.client:create("pods", pod)
  if not made then
    if code == "EEXIST" then return nil, ("create container: the name %s is taken"):format(pod.metadata.name), "ECONFLICT" end
    return nil, err, code
  end
  local name = pod.metadata.name
  ok, err, code = wait_running(self, name, pod.spec.containers[1].image, 120000)
  if not ok then
    self.client:delete("pods", name, { grace_seconds = 0 })
    return nil, err, code
  end
  return name
end

-- The Pod of sandbox `id`: only one demesne made (another Pod of the namespace, whatever its
-- name, is none of demesne's to exec in or remove).
local function get_pod(self, id, what)
  local pod, err, code = self.client:get("pods", kubernetes.pod_name(id))
  local labels = pod and type(pod.metadata) == "table" and type(pod.metadata.labels) == "table" and pod.metadata.labels
  if pod and (not labels or labels[MANAGED] ~= "demesne") then pod, code = nil, "ENOENT" end
  if not pod then
    if code == "ENOENT" then return nil, ("%s: no such container: %s"):format(what, id), "ENOENT" end
    return nil, err, code
  end
  pod.metadata.annotations = type(pod.metadata.annotations) == "table" and pod.metadata.annotations or {}
  return pod
end

-- Runs argv in the Pod's container through the exec subresource; returns the exec.run result.
local function run(self, pod_name, argv, opts)
  local cfg = self.cfg
  return exec.run({ server = cfg.server, namespace = self.namespace, pod = pod_name, container = kubernetes.CONTAINER,
    command = argv, token = cfg.token, ca_pem = cfg.ca_pem, cert_pem = cfg.cert_pem, key_pem = cfg.key_pem,
    timeout_ms = opts and opts.timeout_ms or 60000, stdin = opts and opts.stdin,
    max_output = opts and opts.max_output or 64 * 1024 })
end

--- Starts the held container: opens its gate, then marks the Pod started. `true` also when
--- it runs already. Errors: ENOENT, ECONFLICT (it ended without being started).
---@param id string
---@return boolean|nil ok, string|nil err, string|nil code
function Engine:start(id)
  local pod, err, code = get_pod(self, id, "start container")
  if not pod then return nil, err, code end
  local info = kubernetes.container_info(pod)
  -- the mark comes only after a release that worked: a marked Pod was started
  if info.state == "running" or (info.state == "exited" and pod.metadata.annotations[A_STARTED]) then return true end
  if info.state ~= "created" then
    return nil, ("start container %s: it is %s"):format(id, info.state), "ECONFLICT"
  end
  local r
  r, err, code = run(self, pod.metadata.name, { kubernetes.INIT, "release", kubernetes.GATE }, { timeout_ms = 30000 })
  if not r then return nil, "start container: " .. tostring(err), code end
  if r.exit_code ~= 0 then
    return nil, ("start container: demesne-init release exited %d: %s"):format(r.exit_code, r.stderr), "EENGINE"
  end
  -- a mark that fails leaves a running container that reads as created: the next start
  -- releases again (a no-op) and marks it
  local ok
  ok, err, code = self.client:patch("pods", pod.metadata.name, { metadata = { annotations = { [A_STARTED] = "1" } } })
  if not ok then return nil, err, code end
  return true
end

--- Waits for the main process to end; its exit code. Polls the Pod every 200 ms
--- (cancellable). Errors: ENOENT (no such Pod, or removed while waited for).
---@param id string
---@return integer|nil exit_code, string|nil err, string|nil code
function Engine:wait(id)
  while true do
    local pod, err, code = get_pod(self, id, "wait for container")
    if not pod then return nil, err, code end
    local info = kubernetes.container_info(pod)
    if info.state == "exited" then return info.exit_code or 0 end
    if info.state == "removing" then return nil, ("wait for container %s: it was removed"):format(id), "ENOENT" end
    async.sleep(200)
  end
end

--- Deletes the Pod with a grace of 1 s (its terminationGracePeriodSeconds: SIGTERM, then
--- SIGKILL) and waits, at most 15 s, until the API no longer has it, which is once the
--- kubelet has stopped its container (grace 0 would be a force deletion: the object goes at
--- once, while the container may still run). `true`; `true, "gone"` when there was none.
---@param id string
---@return boolean|nil ok, string|nil note_or_err, string|nil code
function Engine:remove(id)
  local name = kubernetes.pod_name(id)
  local pod, gerr, gcode = get_pod(self, id, "remove container")
  if not pod then
    if gcode == "ENOENT" then return true, "gone" end
    return nil, gerr, gcode
  end
  local ok, err, code = self.client:delete("pods", name, { grace_seconds = 1 })
  if not ok then
    if code == "ENOENT" then return true, "gone" end
    return nil, err, code
  end
  local deadline = loop.now() + 15000
  while loop.now() < deadline do
    local _, _, c = self.client:get("pods", name)
    if c == "ENOENT" then return true end
    async.sleep(100)
  end
  log.warning(LOG, "pods/%s is still there 15 s after its deletion (its node may be unreachable)", name)
  return true
end

--- Container info of the Pod `id` (kubernetes.container_info; ENOENT when there is none).
---@param id string
---@return table|nil info, string|nil err, string|nil code
function Engine:inspect(id)
  local pod, err, code = get_pod(self, id, "inspect container")
  if not pod then return nil, err, code end
  return kubernetes.container_info(pod)
end

--- The containers (Pods demesne made, in the namespace) whose labels match every filter
--- ("k=v" or "k"), stopped ones included. Spec labels live in an annotation (label values
--- are too narrow for them), so the filters apply here, not in the API's label selector.
---@param filters string[]|nil
---@return table[]|nil list, string|nil err, string|nil code
function Engine:list(filters)
  local pods, err, code = self.client:list("pods", MANAGED .. "=demesne")
  if not pods then return nil, err, code end
  local out = {}
  for _, p in ipairs(pods) do
    local info = kubernetes.container_info(p)
    local match = true
    for _, f in ipairs(filters or {}) do
      local k, v = f:match("^([^=]+)=(.*)$")
      if k then match = match and info.labels[k] == v else match = match and info.labels[f] ~= nil end
    end
    if match then
      info.limits, info.exit_code = nil, nil
      out[#out + 1] = info
    end
  end
  return out
end

--- Runs argv in the running container; its exit code. The exec subresource has no
--- environment or folder of its own, so argv runs under `demesne-init hold` with --env and
--- --workdir (the gate is open by then, so it execs at once); it runs as the Pod's user
--- (capability exec_user false: another opts.user is ENOTSUP).
--- opts: {env, workdir, user, timeout_ms}. Errors: ENOENT, ECONFLICT (not running),
--- ETIMEDOUT.
---@param id string
---@param argv string[]
---@param opts {env: string[]|nil, workdir: string|nil, user: string|nil, timeout_ms: integer|nil}|nil
---@return integer|nil code, string|nil err, string|nil ecode
function Engine:exec(id, argv, opts)
  opts = opts or {}
  local pod, err, code = get_pod(self, id, "exec")
  if not pod then return nil, err, code end
  local info = kubernetes.container_info(pod)
  if info.state ~= "running" then
    return nil, ("exec in %s: the container is %s, not running"):format(id, info.state), "ECONFLICT"
  end
  -- an exec runs as the container's user: becoming another would need the privilege the
  -- Pod drops (allowPrivilegeEscalation false, capabilities dropped)
  local sc = pod.spec.containers[1].securityContext or {}
  local own = sc.runAsUser and (sc.runAsGroup and ("%d:%d"):format(sc.runAsUser, sc.runAsGroup)
    or tostring(math.tointeger(sc.runAsUser))) or nil
  if opts.user and opts.user ~= own and not (own and own:match("^(%d+)") == opts.user) then
    return nil, ("exec in %s: opts.user %q: an exec on Kubernetes runs as the Pod's user (%s), capability exec_user is "
      .. "false"):format(id, opts.user, own or "the image's"), "ENOTSUP"
  end
  local cmd = { kubernetes.INIT, "hold" }
  for _, e in ipairs(opts.env or {}) do cmd[#cmd + 1] = "--env"; cmd[#cmd + 1] = e end
  if opts.workdir then cmd[#cmd + 1] = "--workdir"; cmd[#cmd + 1] = opts.workdir end
  -- the gate of an exec is demesne-init itself, on its read-only mount: always there (the
  -- start gate's folder is the sandbox's to write, and it could delete that file)
  cmd[#cmd + 1] = kubernetes.INIT
  cmd[#cmd + 1] = "--"
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local r
  r, err, code = run(self, pod.metadata.name, cmd, { timeout_ms = opts.timeout_ms or 24 * 3600 * 1000 })
  if not r then
    if code == "EEXEC" or code == "EHANDSHAKE" then
      local now = self.client:get("pods", pod.metadata.name)
      if not now then return nil, ("exec in %s: the container is gone"):format(id), "ENOENT" end
      if kubernetes.container_info(now).state ~= "running" then
        return nil, ("exec in %s: the container is not running"):format(id), "ECONFLICT"
      end
    end
    return nil, "exec: " .. tostring(err), code
  end
  return r.exit_code
end

-- Node images: the references of every image on the cluster's nodes (their status.images).
local function node_images(self)
  local nodes, err, code = self.client:request("GET", "/api/v1/nodes")
  if not nodes then return nil, err, code end
  local refs = {}
  for _, n in ipairs(nodes.items or {}) do
    for _, img in ipairs(n.status and n.status.images or {}) do
      for _, ref in ipairs(img.names or {}) do refs[ref] = img end
    end
  end
  return refs
end

-- The IPv4 addresses a probe Pod should not reach: every node's (status.addresses) and the
-- API server's, when its URL names an address that is not loopback.
local function probe_addresses(self)
  local out, seen = {}, {}
  local function add(a)
    if a and a:match("^%d+%.%d+%.%d+%.%d+$") and not a:match("^127%.") and not seen[a] then
      seen[a] = true
      out[#out + 1] = a
    end
  end
  local nodes = self.client:request("GET", "/api/v1/nodes")
  for _, n in ipairs(type(nodes) == "table" and nodes.items or {}) do
    for _, a in ipairs(n.status and n.status.addresses or {}) do
      if a.type == "InternalIP" or a.type == "ExternalIP" then add(a.address) end
    end
  end
  add(tostring(self.cfg.server):match("^https?://([%d.]+)[:/]"))
  return out
end

--- Whether the cluster keeps demesne's Pods off the network, checked for real: a
--- NetworkPolicy is only enforced by a network plugin that implements it, and no API says
--- which does. A probe Pod with the labels of demesne's sandboxes (so that the deny-all
--- NetworkPolicy applies to it) runs `demesne-init probe` against a listener this process
--- opens on 0.0.0.0, at every address of the cluster's nodes and of the API server, and
--- reports which it reached and whether it had a default route. `image`: an image the
--- cluster has (the probe needs only a root filesystem: demesne-init comes from the
--- ConfigMap); nil: the first image named demesne/… that a node holds (ENOENT: none). opts.host_network (tests): the probe Pod on its node's network, where the
--- NetworkPolicy does not apply, so it must reach the node's listener.
--- Returns {ok = nothing reached, detail, fix, reached = {"A:P"...}, blocked = {"A:P"...},
--- default_route = boolean}, or nil, msg, code when the probe could not run.
---@param image string|nil
---@param opts {host_network: boolean|nil, timeout_ms: integer|nil}|nil
---@return table|nil result, string|nil err, string|nil code
function Engine:check_network(image, opts)
  opts = opts or {}
  local ok, err, code = self:prepare()
  if not ok then return nil, err, code end
  if not image then
    local refs = node_images(self) or {}
    local names = {}
    for ref in pairs(refs) do
      if ref:match("^docker%.io/demesne/") or ref:match("^demesne/") then names[#names + 1] = ref end
    end
    table.sort(names)
    image = names[1]
    if not image then return nil, "check the network: no node of the cluster holds an image named demesne/…", "ENOENT" end
  end
  local server = httpd.new({ max_body = 1024, max_conns = 8, max_output = 1024 }, function(conn)
    conn:respond(204, {}, "")
  end, function() end)
  local port
  port, err = server:listen_tcp("0.0.0.0", 0, { tag = "probe" })
  if not port then
    server:close()
    return nil, ("check the network: cannot listen on 0.0.0.0: %s"):format(tostring(err)), "EIO"
  end
  local targets = {}
  for _, a in ipairs(probe_addresses(self)) do targets[#targets + 1] = ("%s:%d"):format(a, port) end
  if #targets == 0 then
    server:close()
    return nil, "check the network: the cluster reports no IPv4 address of a node or of its API server", "ENOENT"
  end
  local name = "demesne-probe-" .. hex(4)
  local argv = { kubernetes.INIT, "probe" }
  table.move(targets, 1, #targets, 3, argv)
  local pod = kubernetes.pod({ image = image, name = name, entrypoint = argv, security = { cap_drop = { "ALL" } },
    user = "65534" }, { namespace = self.namespace, instance = self.instance, init_configmap = self.init_configmap,
    image_prefix = self.image_prefix, pull_secrets = self.pull_secrets, node_name = config.get("kubernetes_node") })
  pod.spec.containers[1].command = argv -- no gate: the probe runs as soon as its container starts
  if opts.host_network then pod.spec.hostNetwork = true end
  local made
  made, err, code = self.client:create("pods", pod)
  local result
  if made then
    local ended, werr, wcode = self.client:wait_pod(name, { wait_for = "ended", timeout_ms = opts.timeout_ms or 60000 })
    local logs = ended and self.client:pod_log(name, kubernetes.CONTAINER, { limit_bytes = 64 * 1024 })
    if type(logs) == "string" and logs:find("default-route ", 1, true) then
      result = { reached = {}, blocked = {}, default_route = logs:find("default-route yes", 1, true) ~= nil }
      for what, target in logs:gmatch("(%a+) (%d+%.%d+%.%d+%.%d+:%d+)") do
        if what == "reached" then result.reached[#result.reached + 1] = target
        elseif what == "blocked" then result.blocked[#result.blocked + 1] = target end
      end
    else
      err, code = ("check the network: the probe Pod %s gave no answer: %s"):format(name,
        tostring(ended and logs or werr)), ended and "EENGINE" or wcode
    end
    self.client:delete("pods", name, { grace_seconds = 0 })
  end
  server:close()
  if not result then return nil, err, code end
  local closed = #result.reached == 0
  result.ok = closed
  if closed then
    result.detail = ("a Pod with demesne's labels reached none of %d address(es) of the nodes and the API server "
      .. "(%s)%s"):format(#result.blocked, table.concat(result.blocked, ", "),
      result.default_route and "; it has a default route, so only the NetworkPolicy holds it"
      or "; it has no default route")
  else
    result.detail = ("a Pod with demesne's labels reached %s: the cluster's network plugin does not enforce the "
      .. "NetworkPolicy %s"):format(table.concat(result.reached, ", "), POLICY)
    result.fix = "use a network plugin that enforces NetworkPolicy (Calico, Cilium, …), or keep demesne's Pods on "
      .. "nodes whose Pod network has no route out"
  end
  return result
end

--- {id, labels = {}, env = {}} of an image a node of the cluster holds (ENOENT otherwise).
--- Kubernetes says nothing more of an image; demesne's image tags carry their content hash,
--- so that is enough for lua/images.lua.
---@param ref string  an image reference as demesne names it (demesne/base:…)
---@return table|nil image, string|nil err, string|nil code
function Engine:image_inspect(ref)
  local refs, err, code = node_images(self)
  if not refs then return nil, err, code end
  local want = kubernetes.image_ref(ref, self.image_prefix)
  for _, r in ipairs({ want, "docker.io/" .. want, "docker.io/library/" .. want }) do
    if refs[r] then return { id = r, labels = {}, env = {}, onbuild = {} } end
  end
  return nil, ("no such image: %s (no node of the cluster has %s)"):format(ref, want), "ENOENT"
end

local function no_images(what)
  return nil, ("%s: the kubernetes adapter takes images from a registry the cluster pulls from: build them on "
    .. "Podman or Docker and push them there (kubernetes_image_prefix names it)"):format(what), "ENOTSUP"
end

--- Not on Kubernetes: always nil, msg, "ENOTSUP" (images come from a registry).
---@return nil, string, string
function Engine:build() return no_images("build") end
--- Not on Kubernetes: always nil, msg, "ENOTSUP".
---@return nil, string, string
function Engine:import() return no_images("import") end
--- Not on Kubernetes: always nil, msg, "ENOTSUP" (the kubelet pulls what a Pod names).
---@param ref string
---@return nil, string, string
function Engine:pull(ref) return no_images("pull " .. tostring(ref)) end

return kubernetes
