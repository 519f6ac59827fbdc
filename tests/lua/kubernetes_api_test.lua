-- lua/engines/kubernetes/api.lua without a cluster: paths, names, the errors made of a Status, the
-- objects it builds. tests/lua/kubernetes_live_test.lua runs it against a real API server.
local api = require("demesne.engines.kubernetes.api")
local json = require("demesne.json")
local util = require("demesne.util")

local tests = {}

function tests.kubernetes_api_paths_and_names(t)
  t:eq(api.path("pods", "ns1"), "/api/v1/namespaces/ns1/pods")
  t:eq(api.path("pods", "ns1", "p", "log"), "/api/v1/namespaces/ns1/pods/p/log")
  t:eq(api.path("leases", "ns1", "l.x"), "/apis/coordination.k8s.io/v1/namespaces/ns1/leases/l.x")
  t:eq(api.path("networkpolicies", "n"), "/apis/networking.k8s.io/v1/namespaces/n/networkpolicies")
  t:eq(api.path("namespaces", nil, "n"), "/api/v1/namespaces/n")
  for _, bad in ipairs({ "", "A", "a/b", "..", "a?b", "-a", "a-", ("a"):rep(254) }) do
    t:ok(not pcall(api.path, "pods", "ns", bad), "refused name " .. bad)
  end
  t:ok(not pcall(api.path, "pods", nil), "a namespaced resource needs a namespace")
  t:ok(not pcall(api.path, "secrets", "ns"), "an unknown resource")
end

local function status(code, reason, message)
  return { status = code, headers = {}, body = json.encode({ kind = "Status", apiVersion = "v1", status = "Failure",
    message = message, reason = reason, code = code }) }
end

function tests.kubernetes_api_errors_carry_the_status_message_and_a_code(t)
  local cases = {
    { status(404, "NotFound", 'pods "x" not found'), "ENOENT" },
    { status(409, "AlreadyExists", 'configmaps "x" already exists'), "EEXIST" },
    { status(409, "Conflict", 'Operation cannot be fulfilled on leases.coordination.k8s.io "l": the object has been modified'),
      "ECONFLICT" },
    { status(403, "Forbidden", 'pods is forbidden: User "u" cannot create resource "pods"'), "EACCES" },
    { status(422, "Invalid", 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes'), "EINVAL" },
    { status(410, "Gone", "too old resource version"), "ESTALE" },
    { status(500, "InternalError", "boom"), "EENGINE" },
    { { status = 502, headers = {}, body = "<html>bad gateway</html>\n" }, "EENGINE" },
  }
  for _, c in ipairs(cases) do
    local v, msg, code, st = api.status_error(c[1], "do it")
    t:eq(v, nil)
    t:eq(code, c[2], msg)
    t:eq(st, c[1].status)
    local m = json.decode(c[1].body)
    t:eq(msg, "do it: " .. (type(m) == "table" and m.message or "<html>bad gateway</html>"))
  end
  local _, msg = api.status_error(status(401, "Unauthorized", "Unauthorized"), "get pods")
  t:eq(msg, "get pods: the API server did not accept the kubeconfig's credentials: Unauthorized")
  _, msg = api.status_error({ status = 503, headers = {}, body = "" }, "x")
  t:eq(msg, "x: HTTP 503")
end

function tests.kubernetes_api_objects_it_builds(t)
  local cm = api.configmap("init-1", { ["demesne-init"] = "\0\1\2binary" }, { a = "b" })
  t:eq(cm.binaryData["demesne-init"], util.base64("\0\1\2binary"))
  t:eq(api.configmap_file(cm, "demesne-init"), "\0\1\2binary")
  t:eq(select(2, api.configmap_file(cm, "other")), 'configmaps/init-1: no binaryData key "other"')
  local np = api.deny_all_policy("deny", {})
  t:match(json.encode(np.spec), '"podSelector":{"matchLabels":{}}', "an empty selector is an object")
  t:match(json.encode(np.spec), '"policyTypes":%["Ingress","Egress"%]')
  local l = api.lease("inst-1", "host-a", 30, nil, 1764770000.25)
  t:eq(l.spec.renewTime, "2025-12-03T13:53:20.250000Z")
  t:eq(l.spec.leaseDurationSeconds, 30)
end

function tests.kubernetes_api_never_shows_credentials(t)
  local c = api.new({ server = "https://127.0.0.1:1", namespace = "n", token = "TOPSECRET", key_pem = "KEYPEM",
    cert_pem = "CERT" })
  local ok, text = pcall(json.encode, c)
  t:ok(not ok or not (text:find("TOPSECRET", 1, true) or text:find("KEYPEM", 1, true)), "no secret in the client's fields")
  for k, v in pairs(c) do
    t:ok(type(v) ~= "string" or not v:find("TOPSECRET", 1, true), "field " .. k)
  end
  -- a refused connection names the server, and neither the token nor the key
  local v, msg, code = c:version()
  t:eq(v, nil)
  t:eq(code, "ENOENGINE")
  t:match(msg, "^get version: the Kubernetes API server at https://127%.0%.0%.1:1 is not answering")
  t:ok(not msg:find("TOPSECRET", 1, true), "no token in the message")
end

return tests
