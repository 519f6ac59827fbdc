-- The Kubernetes exec stream (lua/engines/kubernetes/exec.lua): its framing and status
-- reading, then whole runs against a fake exec endpoint on the `ws` server
-- (tests/fixtures/ws/server.mjs: v5 and v4), then against the real test bed of
-- tests/kubernetes (Kubernetes 1.20: v4 only) when it is up. Without the bed the live test
-- says so and passes: CI does not start one yet.
local fs = require("core.fs")
local async = require("demesne.async")
local json = require("demesne.json")
local api = require("demesne.engines.kubernetes.api")
local exec = require("demesne.engines.kubernetes.exec")
local kubeconfig = require("demesne.engines.kubernetes.kubeconfig")

local servers = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]+$") or ".") .. "/ws_servers.lua").start

local tests = {}

function tests.the_path_carries_each_argument_as_a_command(t)
  t:eq(exec.path("ns", "p", "sandbox", { "sh", "-c", "echo a&b" }, true),
    "/api/v1/namespaces/ns/pods/p/exec?container=sandbox&command=sh&command=-c&command=echo%20a%26b"
      .. "&stdin=true&stdout=true&stderr=true&tty=false")
  t:eq(exec.path("ns", "p", nil, { "true" }, false),
    "/api/v1/namespaces/ns/pods/p/exec?command=true&stdin=false&stdout=true&stderr=true&tty=false")
end

function tests.frames_start_with_the_channel_byte(t)
  t:eq(exec.frame(exec.STDIN, "abc"), "\0abc")
  t:eq(exec.frame(exec.CLOSE, "\0"), "\255\0", "v5's close signal for stdin")
  t:eq({ exec.unframe("\1out") }, { 1, "out" })
  t:eq({ exec.unframe("\3") }, { 3, "" })
  t:eq(exec.unframe(""), nil)
end

function tests.the_status_gives_the_exit_code(t)
  t:eq(exec.exit_code('{"metadata":{},"status":"Success"}'), 0)
  t:eq(exec.exit_code(json.encode({ metadata = {}, status = "Failure", reason = "NonZeroExitCode",
    message = "command terminated with non-zero exit code: error executing command [sh -c exit 3], exit code 3",
    details = { causes = { { reason = "ExitCode", message = "3" } } } })), 3)
  local code, err, ecode = exec.exit_code('{"status":"Failure","message":"exec: \\"nope\\": executable file not found"}')
  t:eq({ code, ecode }, { nil, "EEXEC" })
  t:match(err, "executable file not found")
  t:eq(select(3, exec.exit_code("not json")), "EPROTO")
end

local function fake(s, namespace, command, extra)
  local o = { server = ("http://127.0.0.1:%d"):format(s.ws), namespace = namespace, pod = "p", container = "sandbox",
    command = command, timeout_ms = 10000 }
  for k, v in pairs(extra or {}) do o[k] = v end
  return exec.run(o)
end

function tests.v5_ends_stdin_and_reports_the_exit_code(t)
  local s <close> = servers()
  local r = assert(fake(s, "ns", { "cat" }, { stdin = ("x"):rep(100000) }))
  t:eq({ r.protocol, r.exit_code, #r.stdout, r.stderr }, { "v5.channel.k8s.io", 0, 100000, "" },
    "stdin ended by the close signal, so cat finished")
  r = assert(fake(s, "ns", { "exit", "3" }))
  t:eq({ r.stdout, r.stderr, r.exit_code }, { "out\n", "err\n", 3 })
  r = assert(fake(s, "ns", { "whoami" }, { token = "secret-token" }))
  t:eq(r.stdout, "Bearer secret-token", "the bearer token is sent")
  local none, err, code = fake(s, "ns", { "missing" })
  t:eq({ none, code }, { nil, "EEXEC" }, err)
end

function tests.v4_is_chosen_when_the_server_has_no_v5(t)
  local s <close> = servers()
  local r = assert(fake(s, "v4only", { "exit", "0" }))
  t:eq({ r.protocol, r.exit_code, r.stdout }, { "v4.channel.k8s.io", 0, "out\n" })
  -- under v4 stdin cannot end: a cat never finishes, and the run's deadline ends it
  local none, err, code = fake(s, "v4only", { "cat" }, { stdin = "abc", timeout_ms = 500 })
  t:eq({ none, code }, { nil, "ETIMEDOUT" }, err)
end

-- ---------------------------------------------------------------- the real test bed

local STATE = os.getenv("DEMESNE_K8S_STATE") or "/var/lib/demesne/kubernetes"
local KUBECONFIG = STATE .. "/admin.kubeconfig"
local NS, POD = "demesne-ws-test", "dmsn-ws-test"
local IMAGE = "localhost/busybox:demesne"

--- The bed's kubeconfig settings and an API client (demesne.engines.kubernetes.api), or
--- nil and why there is none.
local function bed()
  if not fs.stat(KUBECONFIG) then return nil, "no Kubernetes test bed at " .. STATE .. " (tests/kubernetes/up makes one)" end
  local cfg = assert(kubeconfig.load({ path = KUBECONFIG }))
  local c = api.new(cfg, { timeout_ms = 30000, namespace = NS })
  local v, err = c:version()
  if not v then return nil, "the test bed's API server does not answer: " .. tostring(err) end
  -- the admin's bearer token, for the token variant (up writes it beside the certificates)
  local token = (fs.read_file(STATE .. "/pki/admin.token") or ""):match("%S+")
  return { cfg = cfg, c = c, version = v.gitVersion, token = token }
end

--- Makes the namespace (and its default ServiceAccount when no controller manager does) and
--- a Pod that sleeps; waits until it runs.
local function make_pod(b)
  local c = b.c
  local _, err, code = c:create("namespaces", { apiVersion = "v1", kind = "Namespace", metadata = { name = NS } })
  assert(code == nil or code == "EEXIST", err)
  for _ = 1, 25 do
    if c:get("serviceaccounts", "default") then break end
    if not c:get("serviceaccounts", "default", { namespace = "default" }) then
      c:create("serviceaccounts", { apiVersion = "v1", kind = "ServiceAccount", metadata = { name = "default" } })
    end
    async.sleep(200)
  end
  c:delete("pods", POD, { grace_seconds = 0 })
  for _ = 1, 150 do
    if select(3, c:get("pods", POD)) == "ENOENT" then break end
    async.sleep(200)
  end
  assert(c:create("pods", {
    apiVersion = "v1", kind = "Pod", metadata = { name = POD, labels = { ["app.kubernetes.io/managed-by"] = "demesne" } },
    spec = { nodeName = "demesne-node", restartPolicy = "Never", automountServiceAccountToken = false,
      enableServiceLinks = false, terminationGracePeriodSeconds = 1,
      containers = { { name = "sandbox", image = IMAGE, imagePullPolicy = "Never",
        command = { "/bin/sh", "-c", "sleep 3600" } } } },
  }))
  local phase, state = c:wait_pod(POD, { timeout_ms = 60000 })
  assert(phase == "Running", ("the Pod is %s (%s)"):format(tostring(phase), json.encode(state)))
end

function tests.exec_in_a_pod_of_the_real_test_bed(t)
  local b, why = bed()
  if not b then
    print("# skip kubernetes_exec_test: exec_in_a_pod_of_the_real_test_bed: " .. why)
    return
  end
  make_pod(b)
  local _cleanup <close> = setmetatable({}, { __close = function()
    b.c:delete("pods", POD, { grace_seconds = 0 })
    b.c:delete("namespaces", NS)
  end })
  local base = { server = b.cfg.server, namespace = NS, pod = POD, container = "sandbox", ca_pem = b.cfg.ca_pem,
    timeout_ms = 30000 }
  local function run(extra)
    local o = {}
    for k, v in pairs(base) do o[k] = v end
    for k, v in pairs(extra) do o[k] = v end
    return exec.run(o)
  end
  -- with the client certificate
  local r = assert(run({ cert_pem = b.cfg.cert_pem, key_pem = b.cfg.key_pem,
    command = { "sh", "-c", "echo out; echo err >&2; exit 3" } }))
  print(("# kubernetes_exec_test: the bed's API server is %s; it chose %s"):format(tostring(b.version), r.protocol))
  t:eq({ r.stdout, r.stderr, r.exit_code }, { "out\n", "err\n", 3 }, "stdout, stderr and the exit code")
  t:ok(r.protocol == "v4.channel.k8s.io" or r.protocol == "v5.channel.k8s.io", r.protocol)
  -- with the bearer token; stdin of a known length (v4 cannot end stdin), and a big stdout
  r = assert(run({ token = b.token, stdin = "hello", command = { "head", "-c", "5" } }))
  t:eq({ r.stdout, r.exit_code }, { "hello", 0 }, "stdin reached the command")
  r = assert(run({ token = b.token, command = { "sh", "-c", "head -c 1000000 /dev/zero" } }))
  t:eq({ #r.stdout, r.exit_code }, { 1000000, 0 }, "1 MB of stdout")
  local none, err, code = run({ token = b.token, command = { "/no/such/program" } })
  t:eq({ none, code }, { nil, "EEXEC" }, err)
  -- a refused upgrade: a pod that does not exist
  none, err, code = run({ token = b.token, pod = "no-such-pod", command = { "true" } })
  t:eq({ none, code }, { nil, "EHANDSHAKE" }, err)
  t:match(err, "HTTP 404")
end

return tests
