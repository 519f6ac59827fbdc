-- lua/engines/kubernetes/kubeconfig.lua: kubeconfigs as kubectl and the clouds write them, and
-- hostile ones; every refusal names the field and the reason, and no secret.
local kubeconfig = require("demesne.engines.kubernetes.kubeconfig")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local CA = "-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"
local CERT = "-----BEGIN CERTIFICATE-----\nCLIENT\n-----END CERTIFICATE-----\n"
local KEY = "-----BEGIN RSA PRIVATE KEY-----\nSECRETKEY\n-----END RSA PRIVATE KEY-----\n"
local TOKEN = "s3cr3t-token.abc"

-- What `kubectl config view --raw` writes (kubectl 1.32), with an extension minikube adds
local KUBECTL = ([[
apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: %s
    extensions:
    - extension:
        last-update: Thu, 03 Dec 2026 10:00:00 UTC
        provider: minikube.sigs.k8s.io
        version: v1.34.0
      name: cluster_info
    server: https://127.0.0.1:16443
  name: demesne-test
- cluster:
    server: https://10.0.0.1:6443
  name: other
contexts:
- context:
    cluster: demesne-test
    namespace: sandboxes
    user: admin
  name: demesne-test
- context:
    cluster: other
    user: robot
  name: robot@other
current-context: demesne-test
kind: Config
preferences: {}
users:
- name: admin
  user:
    client-certificate-data: %s
    client-key-data: %s
- name: robot
  user:
    token: %s
]]):format(util.base64(CA), util.base64(CERT), util.base64(KEY), TOKEN)

local function reader(files)
  return function(path) return files[path] or nil, "No such file or directory", "ENOENT" end
end

function tests.kubeconfig_kubectl_writes_current_context_with_client_certificate(t)
  local cfg = assert(kubeconfig.parse(KUBECTL, { source = "admin.kubeconfig" }))
  t:eq(cfg.server, "https://127.0.0.1:16443")
  t:eq(cfg.namespace, "sandboxes")
  t:eq(cfg.context, "demesne-test")
  t:eq(cfg.ca_pem, CA)
  t:eq(cfg.cert_pem, CERT)
  t:eq(cfg.key_pem, KEY)
  t:eq(cfg.token, nil)
  t:eq(cfg.insecure, nil)
  local s = tostring(cfg)
  t:match(s, "context demesne%-test, server https://127%.0%.0%.1:16443")
  t:ok(not s:find("SECRETKEY", 1, true), "tostring holds no key")
end

function tests.kubeconfig_a_named_context_with_a_token_and_the_default_namespace(t)
  local cfg = assert(kubeconfig.parse(KUBECTL, { context = "robot@other" }))
  t:eq(cfg.server, "https://10.0.0.1:6443")
  t:eq(cfg.token, TOKEN)
  t:eq(cfg.namespace, "default")
  t:eq(cfg.ca_pem, nil, "the system's CAs")
  local _, msg = kubeconfig.parse(KUBECTL, { context = "nope" })
  t:eq(msg, 'kubeconfig (text): contexts: no context named "nope"')
end

function tests.kubeconfig_files_resolve_against_its_folder(t)
  local text = [[
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:6443", certificate-authority: ca.crt}
users:
- name: u
  user: {client-certificate: /abs/client.crt, client-key: ../keys/client.key}
- name: t
  user: {tokenFile: token}
contexts:
- {name: x, context: {cluster: c, user: u}}
- {name: y, context: {cluster: c, user: t}}
current-context: x
]]
  local files = { ["/home/me/.kube/ca.crt"] = CA, ["/abs/client.crt"] = CERT,
    ["/home/me/.kube/../keys/client.key"] = KEY, ["/home/me/.kube/config"] = text,
    ["/home/me/.kube/token"] = "  " .. TOKEN .. "\n" }
  local cfg = assert(kubeconfig.load({ env = { HOME = "/home/me" }, read = reader(files) }))
  t:eq(cfg.source, "/home/me/.kube/config")
  t:eq({ cfg.ca_pem, cfg.cert_pem, cfg.key_pem }, { CA, CERT, KEY })
  cfg = assert(kubeconfig.load({ env = { HOME = "/home/me" }, read = reader(files), context = "y" }))
  t:eq(cfg.token, TOKEN, "tokenFile, trimmed")
  files["/home/me/.kube/ca.crt"] = nil
  local _, msg, code = kubeconfig.load({ env = { HOME = "/home/me" }, read = reader(files) })
  t:eq(code, "EINVAL")
  t:eq(msg, "kubeconfig /home/me/.kube/config: clusters[0].cluster.certificate-authority: "
    .. "cannot read /home/me/.kube/ca.crt: No such file or directory")
  _, msg = kubeconfig.parse(text, {})
  t:match(msg, "clusters%[0%]%.cluster%.certificate%-authority: a relative path, and the kubeconfig has no folder")
end

function tests.kubeconfig_path_from_argument_kubeconfig_or_home(t)
  t:eq(kubeconfig.path("/x/y", { KUBECONFIG = "/a" }), "/x/y")
  t:eq(kubeconfig.path(nil, { KUBECONFIG = "/a/one:/b/two", HOME = "/h" }), "/a/one")
  t:eq(kubeconfig.path(nil, { HOME = "/h" }), "/h/.kube/config")
  local _, msg, code = kubeconfig.load({ path = "/nonexistent/kubeconfig" })
  t:eq(code, "ENOENT")
  t:match(msg, "^kubeconfig /nonexistent/kubeconfig: cannot read it: ")
end

function tests.kubeconfig_reads_a_real_file(t)
  local dir = os.getenv("TMPDIR") or "/tmp"
  dir = dir .. "/kubeconfig-test-" .. loop.getpid()
  assert(fs.mkdir_p(dir, 448))
  assert(fs.write_atomic(dir .. "/ca.pem", CA))
  assert(fs.write_atomic(dir .. "/config", ([[
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", certificate-authority: ca.pem}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
]])))
  local cfg, err = kubeconfig.load({ path = dir .. "/config" })
  fs.remove_tree(dir)
  t:ok(cfg, err)
  t:eq(cfg.ca_pem, CA)
end

-- GKE, EKS and AKS kubeconfigs call a plugin; those are refused by name for now
function tests.kubeconfig_exec_and_auth_provider_plugins_are_refused_by_name(t)
  local base = [[
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
users:
- name: u
  user:
]]
  local _, msg = kubeconfig.parse(base .. [[
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      command: gke-gcloud-auth-plugin
      installHint: Install gke-gcloud-auth-plugin
      provideClusterInfo: true
]])
  t:match(msg, "^kubeconfig %(text%): users%[0%]%.user%.exec: exec credential plugins are not supported yet")
  _, msg = kubeconfig.parse(base .. "    auth-provider: {name: gcp}\n")
  t:match(msg, "users%[0%]%.user%.auth%-provider: auth%-provider plugins are not supported yet")
  _, msg = kubeconfig.parse(base .. "    username: admin\n    password: hunter2\n")
  t:match(msg, "basic authentication is not supported yet")
  t:ok(not msg:find("hunter2", 1, true), "no password in the message")
  _, msg = kubeconfig.parse(base .. "    token: abc\n    as: system:admin\n")
  t:match(msg, "users%[0%]%.user%.as: impersonation")
end

-- Each hostile or broken kubeconfig is refused with the field and the reason.
function tests.kubeconfig_hostile_and_broken_ones_name_the_field(t)
  local function cfg(cluster, user, extra)
    return ("clusters: [{name: c, cluster: %s}]\nusers: [{name: u, user: %s}]\n"
      .. "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n%s"):format(cluster, user, extra or "")
  end
  local ok_user = "{token: abc}"
  local cases = {
    { cfg('{server: "https://h:1"}', ok_user, "current-context: y\n"), "line 5, column 1: a key appears twice" },
    { "just text", "%(top%): must be a mapping" },
    { "a: [", "^kubeconfig %(text%): yaml: line %d+, column %d+: " },
    { cfg('{server: "https://h:1"}', ok_user):gsub("current%-context: x\n", ""), "current%-context: is not set" },
    { cfg("{}", ok_user), "clusters%[0%]%.cluster%.server: is required" },
    { cfg("{server: 42}", ok_user), "clusters%[0%]%.cluster%.server: must be a string" },
    { cfg('{server: "ftp://h"}', ok_user), 'server: "ftp://h" is not an http:// or https:// URL' },
    { cfg('{server: "http://10.1.2.3:8080"}', ok_user), "plain http:// is only allowed to a loopback address" },
    { cfg('{server: "https://u:p@h"}', ok_user), "must not hold a user name or password" },
    { cfg('{server: "https://h", insecure-skip-tls-verify: true}', ok_user),
      "clusters%[0%]%.cluster%.insecure%-skip%-tls%-verify: the API server's certificate would not be checked; refused unless" },
    { cfg('{server: "https://h", insecure-skip-tls-verify: "yes"}', ok_user),
      "insecure%-skip%-tls%-verify: must be true or false" },
    { cfg('{server: "https://h", certificate-authority-data: "!!notbase64"}', ok_user),
      "certificate%-authority%-data: is not base64" },
    { cfg('{server: "https://h", certificate-authority: /a, certificate-authority-data: QQ==}', ok_user),
      "clusters%[0%]%.cluster: both certificate%-authority and certificate%-authority%-data: give one" },
    { cfg('{server: "https://h", proxy-url: "http://proxy:3128"}', ok_user), "proxy%-url: a proxy" },
    { cfg('{server: "https://h"}', "{}"), "users%[0%]%.user: no credentials" },
    { cfg('{server: "https://h"}', "{client-certificate-data: QQ==}"), "a client certificate without client%-key" },
    { cfg('{server: "https://h"}', '{token: "a\\r\\nX-Evil: 1"}'),
      "users%[0%]%.user%.token: holds a space or a control character" },
    { cfg('{server: "https://h"}', ok_user):gsub("context: {cluster: c,", "context: {cluster: d,"),
      'contexts%[0%]%.context%.cluster: no cluster named "d"' },
    { cfg('{server: "https://h"}', ok_user):gsub("user: u}", "user: v}"),
      'contexts%[0%]%.context%.user: no user named "v"' },
    { cfg('{server: "https://h"}', ok_user):gsub("user: u}", "user: u, namespace: Bad_NS}"),
      'namespace: "Bad_NS" is not a namespace name' },
    { cfg('{server: "https://h"}', ok_user) .. "kind: Pod\n", 'kind: "Pod", not Config' },
    { "clusters: {a: b}\n", "clusters: must be a list" },
    { "clusters: [{name: c, cluster: {}}, {name: c, cluster: {}}]\n",
      'clusters%[1%]%.name: "c" is also clusters%[0%]\'s name' },
    { "clusters: [{cluster: {}}]\n", "clusters%[0%]%.name: is required" },
    { "users: [7]\n", "users%[0%]: must be a mapping with name and user" },
  }
  for i, c in ipairs(cases) do
    local v, msg, code = kubeconfig.parse(c[1])
    t:eq(v, nil, "case " .. i)
    t:eq(code, "EINVAL", "case " .. i)
    t:match(msg, c[2], "case " .. i)
  end
end

function tests.kubeconfig_insecure_only_when_allowed_and_never_with_a_ca(t)
  local text = [[
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
]]
  local cfg = assert(kubeconfig.parse(text, { allow_insecure = true }))
  t:eq(cfg.insecure, true)
  local _, msg = kubeconfig.parse(text:gsub("true}", "true, certificate-authority-data: QQ==}"), { allow_insecure = true })
  t:match(msg, "insecure%-skip%-tls%-verify together with a certificate authority")
end

function tests.kubeconfig_a_billion_laughs_is_refused(t)
  local lines = { "a0: &a0 [x, x, x, x, x, x, x, x, x, x]" }
  for i = 1, 8 do lines[#lines + 1] = ("a%d: &a%d [%s]"):format(i, i, ("*a%d, "):format(i - 1):rep(10):sub(1, -3)) end
  local _, msg = kubeconfig.parse(table.concat(lines, "\n"))
  t:match(msg, "too many nodes")
end

return tests
