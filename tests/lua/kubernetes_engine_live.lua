-- The Kubernetes adapter's own checks on the test bed (tests/kubernetes/lane, with
-- DEMESNE_ENGINE=kubernetes and demesne's base image loaded): what the engine contract
-- suite cannot say of other engines. Not a *_test.lua file: CTest has no cluster.
local async = require("demesne.async")
local engines = require("demesne.engines")
local loop = require("core.loop")

local tests = {}

local function engine()
  local eng = assert(engines.get())
  assert(eng.adapter_name == "kubernetes", "DEMESNE_ENGINE=kubernetes (tests/kubernetes/lane sets it)")
  return setmetatable({ eng = eng }, { __close = function() eng:close() end })
end

-- The bed's Pods have no route out and the host holds no address on their bridge: the
-- probe Pod, under demesne's labels, reaches nothing, and says it has no default route.
function tests.the_network_check_finds_the_bed_closed(t)
  local e <close> = engine()
  local r = t:ok(e.eng:check_network(os.getenv("DEMESNE_CONTRACT_IMAGE")))
  t:eq(r.ok, true, "closed")
  t:eq(r.reached, {}, "reached nothing")
  t:ok(#r.blocked >= 1, "it tried at least one address of the node: " .. table.concat(r.blocked, ", "))
  t:eq(r.default_route, false, "no default route in the Pod")
  t:match(r.detail, "no default route", "the detail says so")
end

-- The check can fail: a probe Pod on its node's network (where no NetworkPolicy applies)
-- reaches the listener on the host, and the answer names it and how to close it.
function tests.the_network_check_reports_what_a_pod_reached(t)
  local e <close> = engine()
  local r = t:ok(e.eng:check_network(os.getenv("DEMESNE_CONTRACT_IMAGE"), { host_network = true }))
  t:eq(r.ok, false, "open")
  t:ok(#r.reached >= 1, "it reached the host's listener")
  t:match(r.detail, "does not enforce the NetworkPolicy demesne%-deny%-all", "the detail names the policy")
  t:match(r.fix, "NetworkPolicy", "a fix")
  local pods = t:ok(e.eng.client:list("pods", "app.kubernetes.io/managed-by=demesne"))
  t:eq(#pods, 0, "the probe Pod is gone")
end

-- A Lease not renewed past its duration is a server that is gone (SIGKILL): the next
-- instance's first create removes that instance's Pods and its Lease.
function tests.pods_of_an_instance_whose_lease_expired_are_reaped(t)
  local e <close> = engine()
  local eng = e.eng
  local image = os.getenv("DEMESNE_CONTRACT_IMAGE")
  local spec = { image = image, entrypoint = { "sh", "-c" }, command = { "sleep 600" }, labels = {},
    security = { cap_drop = { "ALL" } }, network = "none" }
  spec.name = "demesne-reap-" .. eng.instance
  local id = t:ok(eng:create(spec))
  t:ok(eng:start(id))
  -- what a SIGKILL leaves: the Pod, and a Lease nobody renews (made to look expired)
  local lease_name = eng.lease.metadata.name
  eng.renewer:close(); eng.renewer = nil
  local l = eng.lease
  l.spec.renewTime = "2020-01-01T00:00:00.000000Z"
  t:ok(eng.client:update("leases", l))
  eng.lease, eng.prepared = nil, nil
  -- a new server: a new instance, whose first prepare reaps
  local orig = eng.instance
  eng.instance = orig .. "0"
  t:ok(eng:prepare())
  local deadline = loop.now() + 20000
  local gone
  repeat
    local _, _, code = eng.client:get("pods", id)
    gone = code == "ENOENT"
    if not gone then async.sleep(200) end
  until gone or loop.now() > deadline
  if not gone then eng:remove(id) end
  t:eq(gone, true, "the Pod of the instance whose Lease expired is removed")
  local _, _, lcode = eng.client:get("leases", lease_name)
  t:eq(lcode, "ENOENT", "its Lease too")
end

-- What someone else put in the namespace is checked, not trusted by name: a deny-all
-- policy that allows something, a Pod demesne did not make.
function tests.a_tampered_policy_is_refused_and_a_foreign_pod_is_not_demesnes(t)
  local e <close> = engine()
  local eng = e.eng
  t:ok(eng:prepare())
  local policy = t:ok(eng.client:get("networkpolicies", "demesne-deny-all"))
  policy.spec.egress = { {} } -- allow all egress
  t:ok(eng.client:update("networkpolicies", policy))
  eng:close()
  local ok, msg, code = eng:prepare()
  t:eq({ ok, code }, { nil, "ECONFLICT" }, "prepare refuses a deny-all policy that allows egress")
  t:match(msg, "not demesne's deny%-all policy", "the message says why")
  t:ok(eng.client:delete("networkpolicies", "demesne-deny-all"))
  eng.prepared, eng.prepare_err, eng.prepare_code = nil, nil, nil
  t:ok(eng:prepare(), "a deleted policy is made again")
  t:eq(require("demesne.engines.kubernetes").is_deny_all(t:ok(eng.client:get("networkpolicies", "demesne-deny-all"))),
    true, "as deny-all")
  -- a Pod of the namespace without demesne's label
  local name = "foreign-" .. eng.instance
  t:ok(eng.client:create("pods", { apiVersion = "v1", kind = "Pod", metadata = { name = name },
    spec = { restartPolicy = "Never", automountServiceAccountToken = false, nodeName = os.getenv("DEMESNE_KUBERNETES_NODE"),
      containers = { { name = "c", image = os.getenv("DEMESNE_CONTRACT_IMAGE"), command = { "sleep", "600" } } } } }))
  local _, _, icode = eng:inspect(name)
  t:eq(icode, "ENOENT", "inspect of a Pod demesne did not make")
  local _, _, xcode = eng:exec(name, { "true" })
  t:eq(xcode, "ENOENT", "exec in it")
  t:eq(select(2, eng:remove(name)), "gone", "remove leaves it alone")
  t:ok(eng.client:get("pods", name), "it is still there")
  eng.client:delete("pods", name, { grace_seconds = 0 })
end

return tests
