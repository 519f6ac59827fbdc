-- lua/engines/kubernetes/ against the real test bed's API server (tests/kubernetes/up;
-- docs/how-to/kubernetes-test-bed.md): the kubeconfig read by demesne.engines.kubernetes.kubeconfig,
-- every call of demesne.engines.kubernetes.api on a namespace of its own, which it deletes.
-- Without a cluster (no kubeconfig, or its server does not answer) each test says so and
-- passes, unless DEMESNE_K8S_REQUIRED=1 (tests/kubernetes/lane, where a missing bed is a
-- failure). DEMESNE_K8S_KUBECONFIG names another kubeconfig.
local kubeconfig = require("demesne.engines.kubernetes.kubeconfig")
local api = require("demesne.engines.kubernetes.api")
local fs = require("core.fs")
local loop = require("core.loop")
local async = require("demesne.async")
local util = require("demesne.util")

local tests = {}

local STATE = os.getenv("DEMESNE_K8S_STATE") or "/var/lib/demesne/kubernetes"
local KUBECONFIG = os.getenv("DEMESNE_K8S_KUBECONFIG") or STATE .. "/admin.kubeconfig"

local function skip(why)
  if os.getenv("DEMESNE_K8S_REQUIRED") == "1" then error("DEMESNE_K8S_REQUIRED=1, but " .. why, 2) end
  io.stdout:write(("# skipped: %s\n"):format(why))
  return nil
end

-- The client, or nil (after saying why) when there is no cluster to talk to
local function client()
  if not fs.stat(KUBECONFIG) then return skip("no Kubernetes test bed (" .. KUBECONFIG .. " is missing; tests/kubernetes/up)") end
  local cfg = assert(kubeconfig.load({ path = KUBECONFIG }))
  assert(cfg.server:match("^https?://127%.") or cfg.server:match("^https?://localhost[:/]"),
    "the test bed's API server is on loopback: " .. cfg.server)
  local c = api.new(cfg, { timeout_ms = 20000 })
  local v, err, code = c:version()
  if not v and code == "ENOENGINE" then return skip(err) end
  return assert(v and c, err)
end

-- The image pods run: the first one `up` imported that is not its own, else its busybox
local function image()
  for line in ((fs.read_file(STATE .. "/images") or "") .. "\n"):gmatch("([^\n]*)\n") do
    if line ~= "" and line ~= "localhost/pause:demesne" and line ~= "localhost/busybox:demesne" then return line end
  end
  return "localhost/busybox:demesne"
end

-- Runs fn(ns) with the client's namespace set to a new one of its own (with the default
-- ServiceAccount Pods need), then deletes the namespace, whether fn failed or not
local function in_namespace(t, c, fn)
  local name = ("demesne-kapi-test-%s"):format(util.base64(loop.random(6)):lower():gsub("[^a-z0-9]", "x"))
  assert(c:create("namespaces", { apiVersion = "v1", kind = "Namespace", metadata = { name = name } }))
  local ok, err = pcall(function()
    local has_kcm = c:get("serviceaccounts", "default", { namespace = "default" })
    local deadline = loop.now() + 30000
    while not c:get("serviceaccounts", "default", { namespace = name }) do
      if not has_kcm then
        assert(c:create("serviceaccounts", { apiVersion = "v1", kind = "ServiceAccount", metadata = { name = "default" } },
          { namespace = name }))
        break
      end
      t:ok(loop.now() < deadline, "the controller manager made the default ServiceAccount in 30 s")
      async.sleep(200)
    end
    c.namespace = name
    fn(name)
  end)
  assert(c:delete("namespaces", name))
  if not ok then error(err, 0) end
end

local function ready_node(c)
  local nodes = assert(c:list("nodes"))
  for _, n in ipairs(nodes) do
    for _, cond in ipairs(n.status and n.status.conditions or {}) do
      if cond.type == "Ready" and cond.status == "True" then return n.metadata.name end
    end
  end
  error("no Ready node")
end

function tests.kubernetes_live_version_and_access_reviews(t)
  local c = client()
  if not c then return end
  local v = assert(c:version())
  t:match(v.gitVersion, "^v1%.%d+")
  in_namespace(t, c, function()
    for _, check in ipairs({ { "create", "pods" }, { "delete", "pods" }, { "create", "pods", sub = "exec" },
      { "get", "pods", sub = "log" }, { "update", "leases" }, { "create", "configmaps" }, { "create", "networkpolicies" } }) do
      local allowed, reason = c:can_i(check[1], check[2], { sub = check.sub })
      t:eq(allowed, true, ("the admin may %s %s%s (%s)"):format(check[1], check[2], check.sub and "/" .. check.sub or "",
        tostring(reason)))
    end
    local allowed = c:can_i("frobnicate", "widgets", { group = "example.com" })
    t:eq(allowed, true, "the admin (system:masters) may do anything, even what does not exist")
  end)
end

function tests.kubernetes_live_configmap_binary_data_and_its_size_limit(t)
  local c = client()
  if not c then return end
  in_namespace(t, c, function(ns)
    local parts = {}
    for i = 1, 15 do parts[i] = loop.random(60 * 1024) end
    local bytes = table.concat(parts) -- 900 KiB, every byte value
    local made = assert(c:create("configmaps", api.configmap("init-900k", { ["demesne-init"] = bytes },
      { ["app.kubernetes.io/managed-by"] = "demesne" })))
    t:eq(made.metadata.name, "init-900k")
    local got = assert(c:get("configmaps", "init-900k"))
    t:ok(api.configmap_file(got, "demesne-init") == bytes, "900 KiB of binaryData come back byte for byte")
    local _, msg, code = c:create("configmaps", api.configmap("init-900k", { x = "y" }))
    t:eq(code, "EEXIST")
    t:match(msg, '^create configmaps/init%-900k in ' .. ns:gsub("%-", "%%-") .. ': configmaps "init%-900k" already exists')
    -- 1,048,576 bytes of values is the limit (keys do not count); one more is refused, and
    -- the message says why
    local too_big = api.configmap("init-1m1", { ["demesne-init"] = ("x"):rep(1048577) })
    local _, msg2, code2, status = c:create("configmaps", too_big)
    t:eq({ code2, status }, { "EINVAL", 422 })
    t:match(msg2, 'ConfigMap "init%-1m1" is invalid: %[%]: Too long: must have at most 1048576 bytes')
    assert(c:create("configmaps", api.configmap("init-1m", { ["demesne-init"] = ("x"):rep(1048576) })))
    assert(c:delete("configmaps", "init-900k"))
    local _, _, gone = c:get("configmaps", "init-900k")
    t:eq(gone, "ENOENT")
    local _, dmsg, dcode = c:delete("configmaps", "init-900k")
    t:eq(dcode, "ENOENT")
    t:match(dmsg, 'configmaps "init%-900k" not found')
  end)
end

function tests.kubernetes_live_network_policy(t)
  local c = client()
  if not c then return end
  in_namespace(t, c, function()
    local np = assert(c:create("networkpolicies", api.deny_all_policy("demesne-deny-all", { ["demesne.dev/sandbox"] = "x" })))
    t:eq(np.spec.policyTypes, { "Ingress", "Egress" })
    np = assert(c:create("networkpolicies", api.deny_all_policy("deny-every-pod", {})))
    t:ok(type(np.spec.podSelector) == "table", "an empty podSelector selects every pod")
    t:eq(#assert(c:list("networkpolicies")), 2)
    assert(c:delete("networkpolicies", "deny-every-pod"))
  end)
end

function tests.kubernetes_live_lease_create_renew_and_conflict(t)
  local c = client()
  if not c then return end
  in_namespace(t, c, function()
    local lease = assert(c:create("leases", api.lease("demesne-instance-a", "host-a", 30, { ["demesne.dev/instance"] = "a" })))
    t:eq(lease.spec.holderIdentity, "host-a")
    local stale = assert(c:get("leases", "demesne-instance-a"))
    local renewed = assert(c:renew_lease(lease, loop.time() + 1))
    t:ok(renewed.metadata.resourceVersion ~= lease.metadata.resourceVersion, "a renewal makes a new resourceVersion")
    t:ok(renewed.spec.renewTime ~= stale.spec.renewTime, "renewTime moved")
    local _, msg, code, status = c:renew_lease(stale, loop.time() + 2)
    t:eq({ code, status }, { "ECONFLICT", 409 })
    t:match(msg, "the object has been modified")
    assert(c:renew_lease(renewed, loop.time() + 3))
    local _, _, ecode = c:create("leases", api.lease("demesne-instance-a", "host-b", 30))
    t:eq(ecode, "EEXIST")
  end)
end

function tests.kubernetes_live_pod_runs_ends_logs_lists_and_goes(t)
  local c = client()
  if not c then return end
  in_namespace(t, c, function()
    local node = ready_node(c)
    local function pod(name, labels, script)
      return { apiVersion = "v1", kind = "Pod", metadata = { name = name, labels = labels },
        spec = { nodeName = node, restartPolicy = "Never", automountServiceAccountToken = false, enableServiceLinks = false,
          terminationGracePeriodSeconds = 1, securityContext = { seccompProfile = { type = "RuntimeDefault" } },
          containers = { { name = "sandbox", image = image(), imagePullPolicy = "Never", command = { "/bin/sh", "-c", script },
            securityContext = { allowPrivilegeEscalation = false, capabilities = { drop = { "ALL" } } } } } } }
    end
    local labels = { ["demesne.dev/sandbox"] = "hi", ["app.kubernetes.io/managed-by"] = "demesne" }
    assert(c:create("pods", pod("hi", labels, "echo hi")))
    assert(c:create("pods", pod("sleeper", { ["demesne.dev/sandbox"] = "sleeper" }, "sleep 60")))
    local phase, state = assert(c:wait_pod("hi", { wait_for = "ended", timeout_ms = 60000 }))
    t:eq(phase, "Succeeded")
    t:eq({ state.state, state.exit_code, state.reason }, { "terminated", 0, "Completed" })
    t:eq(assert(c:pod_log("hi", "sandbox")), "hi\n")
    phase, state = assert(c:wait_pod("sleeper", { timeout_ms = 60000 }))
    t:eq({ phase, state.state }, { "Running", "running" })
    local _, msg, code = c:wait_pod("sleeper", { wait_for = "ended", timeout_ms = 300 })
    t:eq(code, "ETIMEDOUT")
    t:match(msg, "^wait for pods/sleeper in .*: still Running %(container running%) after 300 ms")
    local items = assert(c:list("pods", "app.kubernetes.io/managed-by=demesne"))
    t:eq(#items, 1)
    t:eq(items[1].metadata.name, "hi")
    t:eq(#assert(c:list("pods", "demesne.dev/sandbox")), 2, "a selector of a key alone")
    t:eq(#assert(c:list("pods", nil, { field = "metadata.name=sleeper" })), 1)
    for _, name in ipairs({ "hi", "sleeper" }) do assert(c:delete("pods", name, { grace_seconds = 0 })) end
    local deadline = loop.now() + 30000
    while #assert(c:list("pods")) > 0 and loop.now() < deadline do async.sleep(200) end
    t:eq(#assert(c:list("pods")), 0, "both pods are gone")
    local _, _, ncode = c:wait_pod("hi")
    t:eq(ncode, "ENOENT")
  end)
end

-- A ServiceAccount with no Role: its token (made by the controller manager's token
-- controller) authenticates, and everything it asks is forbidden, by verb and resource
function tests.kubernetes_live_forbidden_names_the_verb_and_resource(t)
  local c = client()
  if not c then return end
  if not c:get("serviceaccounts", "default", { namespace = "default" }) then
    return io.stdout:write("# skipped: no controller manager, so no ServiceAccount tokens\n")
  end
  in_namespace(t, c, function(ns)
    assert(c:create("serviceaccounts", { apiVersion = "v1", kind = "ServiceAccount", metadata = { name = "nobody" } }))
    local token
    local deadline = loop.now() + 30000
    repeat
      local sa = assert(c:get("serviceaccounts", "nobody"))
      local ref = type(sa.secrets) == "table" and sa.secrets[1]
      local secret = ref and c:request("GET", "/api/v1/namespaces/" .. ns .. "/secrets/" .. api.name(ref.name))
      token = secret and secret.data and secret.data.token and util.base64_decode(secret.data.token)
      if not token then async.sleep(200) end
    until token or loop.now() > deadline
    t:ok(token, "the token controller made the ServiceAccount's token")
    local cfg = assert(kubeconfig.load({ path = KUBECONFIG }))
    local nobody = api.new({ server = cfg.server, ca_pem = cfg.ca_pem, token = token, namespace = ns })
    local allowed, reason = nobody:can_i("create", "pods")
    t:eq(allowed, false, "a ServiceAccount without a Role may not create pods")
    t:eq(type(reason), "string")
    local _, msg, code, status = nobody:create("pods", { apiVersion = "v1", kind = "Pod", metadata = { name = "p" },
      spec = { containers = { { name = "c", image = "x" } } } })
    t:eq({ code, status }, { "EACCES", 403 })
    t:match(msg, "^create pods/p in " .. ns:gsub("%-", "%%-") .. ': pods is forbidden: User "system:serviceaccount:'
      .. ns:gsub("%-", "%%-") .. ':nobody" cannot create resource "pods" in API group "" in the namespace')
    _, msg = nobody:list("leases")
    t:match(msg, 'cannot list resource "leases" in API group "coordination%.k8s%.io"')
  end)
end

function tests.kubernetes_live_errors_name_the_verb_and_resource(t)
  local c = client()
  if not c then return end
  local _, msg, code = c:get("pods", "nope", { namespace = "demesne-kapi-absent" })
  t:eq(code, "ENOENT")
  t:match(msg, '^get pods/nope in demesne%-kapi%-absent: pods "nope" not found')
  -- a user the server does not know: 401, named as such
  local cfg = assert(kubeconfig.load({ path = KUBECONFIG }))
  local bad = api.new({ server = cfg.server, ca_pem = cfg.ca_pem, token = "not-a-token", namespace = "default" })
  local _, umsg, ucode, status = bad:get("pods", "x")
  t:eq({ ucode, status }, { "EACCES", 401 })
  t:match(umsg, "did not accept the kubeconfig's credentials")
  -- the bed's bearer token (pki/admin.token) is as good as its client certificate
  local token = fs.read_file(STATE .. "/pki/admin.token")
  if token then
    local tc = api.new({ server = cfg.server, ca_pem = cfg.ca_pem, token = token:gsub("%s+$", ""), namespace = "default" })
    t:ok(tc:list("pods"), "a bearer token is accepted")
  end
  -- a CA that did not sign the server's certificate: the TLS handshake fails
  local other = api.new({ server = cfg.server, token = "x", namespace = "default" })
  local _, tmsg = other:version()
  t:match(tmsg, "^get version: http: SSL certificate problem")
end

return tests
