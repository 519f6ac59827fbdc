-- lua/engines/kubernetes.lua without a cluster: the Pod a sandbox spec becomes (every wall of
-- the spec kept, or the spec refused), the container info read back from a Pod, names and
-- image references. tests/lua/engine_contract_live.lua runs the adapter on a real cluster.
local kubernetes = require("demesne.engines.kubernetes")
local config = require("demesne.config")
local fs = require("core.fs")

local tests = {}

local O = { namespace = "sbx", instance = "abcd1234", init_configmap = "demesne-init-0123456789abcdef",
  image_prefix = "localhost" }

local function spec(over)
  local s = {
    name = "demesne-20261203T190000Z-3fa9c2d1", image = "demesne/base:3f9c0a1b2c4d",
    entrypoint = { "/bin/sh", "-c" }, command = { "sleep 60" }, env = { "A=1", "B=x=y" }, workdir = "/out",
    hostname = "sandbox", user = "1000:1000",
    labels = { ["io.demesne.run_id"] = "r1", ["io.demesne.owner"] = "host/12/34" },
    tmpfs = { { target = "/tmp", mode = "1777", exec = true } },
    limits = { memory_bytes = 268435456, cpus = 0.5, pids = 64 },
    network = "none", read_only_rootfs = true, security = { no_new_privileges = true, cap_drop = { "NET_RAW" } },
  }
  for k, v in pairs(over or {}) do s[k] = v end
  return s
end

function tests.a_spec_becomes_a_pod_that_holds_its_walls(t)
  local pod = t:ok(kubernetes.pod(spec(), O))
  local ps, c = pod.spec, pod.spec.containers[1]
  t:eq(pod.metadata.name, "demesne-20261203t190000z-3fa9c2d1", "an RFC 1123 name")
  t:eq(pod.metadata.annotations["demesne.dev/name"], "demesne-20261203T190000Z-3fa9c2d1", "the spec's name kept")
  t:eq(pod.metadata.labels, { ["app.kubernetes.io/managed-by"] = "demesne",
    ["demesne.dev/sandbox"] = "demesne-20261203t190000z-3fa9c2d1", ["demesne.dev/instance"] = "abcd1234" }, "labels")
  t:eq({ ps.restartPolicy, ps.automountServiceAccountToken, ps.enableServiceLinks, ps.dnsPolicy },
    { "Never", false, false, "None" }, "no restarts, no service account token, no service links, no cluster DNS")
  t:eq(c.command, { "/.demesne/bin/demesne-init", "hold", "/.demesne/gate/start", "--", "/bin/sh", "-c", "sleep 60" },
    "demesne-init holds the command until start")
  t:eq(c.image, "localhost/demesne/base:3f9c0a1b2c4d", "the image from the configured registry")
  t:eq(c.env, { { name = "A", value = "1" }, { name = "B", value = "x=y" } }, "env")
  t:eq(c.resources.limits, { memory = "268435456", cpu = "500m" }, "limits")
  t:eq(c.resources.requests, c.resources.limits, "requests = limits")
  t:eq({ c.securityContext.runAsUser, c.securityContext.runAsGroup, c.securityContext.allowPrivilegeEscalation,
    c.securityContext.readOnlyRootFilesystem, c.securityContext.seccompProfile.type },
    { 1000, 1000, false, true, "RuntimeDefault" }, "security context")
  t:eq(c.securityContext.capabilities.drop, { "NET_RAW" }, "capabilities dropped")
  t:eq(ps.volumes[1].configMap, { name = O.init_configmap, defaultMode = 365 }, "demesne-init from its ConfigMap, 0555")
  t:eq(c.volumeMounts[1], { name = "demesne-init", mountPath = "/.demesne/bin", readOnly = true }, "mounted read-only")
  t:eq(c.volumeMounts[3].mountPath, "/tmp", "the tmpfs as a memory emptyDir")
  t:eq(ps.volumes[3].emptyDir.medium, "Memory", "in memory")
end

function tests.what_a_pod_cannot_express_is_refused(t)
  local _, msg, code = kubernetes.pod(spec({ user = "nobody" }), O)
  t:eq(code, "ENOTSUP", "a user name")
  t:match(msg, "^spec%.user:", "names the field")
  local bare = spec()
  bare.entrypoint = nil
  _, msg, code = kubernetes.pod(bare, O)
  t:eq(code, "ENOTSUP", "no entrypoint")
  t:match(msg, "^spec%.entrypoint:", "names the field")
  _, msg, code = kubernetes.pod(spec({ runtime = "gvisor" }), O)
  t:eq(code, "ENOTSUP", "gvisor on a cluster without its RuntimeClass is refused, never run plainly")
  t:match(msg, "^spec%.runtime:", "names the field")
  local pod = t:ok(kubernetes.pod(spec({ runtime = "gvisor" }), { runtime_classes = { gvisor = "gvisor" },
    init_configmap = "x", instance = "i" }))
  t:eq(pod.spec.runtimeClassName, "gvisor", "runtimeClassName where the class exists")
end

function tests.container_info_reads_a_pod_back(t)
  local pod = t:ok(kubernetes.pod(spec(), O))
  local i = kubernetes.container_info(pod)
  t:eq({ i.id, i.name, i.state, i.exit_code }, { pod.metadata.name, "demesne-20261203T190000Z-3fa9c2d1", "created", nil },
    "a Pod not started is created")
  t:eq(i.labels, spec().labels, "the spec's labels, any string")
  t:eq(i.limits, spec().limits, "limits as asked")
  pod.metadata.annotations["demesne.dev/started"] = "1"
  pod.status = { phase = "Running", containerStatuses = { { state = { running = {} } } } }
  t:eq(kubernetes.container_info(pod).state, "running", "started")
  pod.status = { phase = "Failed", containerStatuses = { { state = { terminated = { exitCode = 7 } } } } }
  i = kubernetes.container_info(pod)
  t:eq({ i.state, i.exit_code }, { "exited", 7 }, "ended")
  pod.metadata.deletionTimestamp = "2026-12-03T19:00:00Z"
  t:eq(kubernetes.container_info(pod).state, "removing", "being deleted")
  pod.metadata.annotations["demesne.dev/labels"] = "{not json"
  t:eq(kubernetes.container_info(pod).labels, {}, "a damaged annotation reads as no labels")
  -- a Pod anyone may write: annotations of the wrong shape read as nothing, never raise
  for _, bad in ipairs({ "5", "null", "[1,2]", '{"a":{"b":1},"c":"d"}', '"x"' }) do
    pod.metadata.annotations["demesne.dev/labels"] = bad
    pod.metadata.annotations["demesne.dev/limits"] = bad
    i = kubernetes.container_info(pod)
    t:eq(i.labels, bad == '{"a":{"b":1},"c":"d"}' and { c = "d" } or {}, "labels of " .. bad)
    t:eq(i.limits, {}, "limits of " .. bad)
  end
  t:eq(kubernetes.container_info({ metadata = { name = "p", annotations = { ["demesne.dev/labels"] = 5 } } }).labels, {},
    "a non-string annotation")
end

function tests.commands_reach_the_program_as_written(t)
  t:eq(kubernetes.literal("echo $$ $(HOME) $HOME"), "echo $$$$ $$(HOME) $$HOME", "every $ doubled")
  local pod = t:ok(kubernetes.pod(spec({ command = { "echo $(PATH) $$" }, env = { "X=$(A)" } }), O))
  local c = pod.spec.containers[1]
  t:eq(c.command[#c.command], "echo $$(PATH) $$$$", "the kubelet expands $(VAR) and $$: both escaped")
  t:eq(c.env[1], { name = "X", value = "$$(A)" }, "env values too")
  t:eq(c.command[1], "/.demesne/bin/demesne-init", "demesne-init's own argv has no $")
end

function tests.only_demesnes_own_deny_all_policy_counts(t)
  local api = require("demesne.engines.kubernetes.api")
  local good = api.deny_all_policy("demesne-deny-all", { ["app.kubernetes.io/managed-by"] = "demesne" })
  t:eq(kubernetes.is_deny_all(good), true, "the policy demesne makes")
  local function with(f)
    local p = require("demesne.json").decode(require("demesne.json").encode(good))
    f(p)
    return kubernetes.is_deny_all(p)
  end
  t:eq(with(function(p) p.spec.egress = { {} } end), false, "an egress rule that allows all")
  t:eq(with(function(p) p.spec.ingress = { { from = {} } } end), false, "an ingress rule")
  t:eq(with(function(p) p.spec.policyTypes = { "Ingress" } end), false, "not for Egress")
  t:eq(with(function(p) p.spec.podSelector.matchLabels = { app = "other" } end), false, "other Pods")
  t:eq(with(function(p) p.spec.podSelector.matchLabels.extra = "x" end), false, "a narrower selector")
  t:eq(with(function(p) p.spec.podSelector.matchExpressions = { { key = "k", operator = "Exists" } } end), false,
    "an expression")
  t:eq(kubernetes.is_deny_all({}), false, "no spec")
end

function tests.names_and_image_references(t)
  t:eq(kubernetes.pod_name("Demesne_run.1"), "demesne-run-1", "lower case, '-' for '_' and '.'")
  t:eq(#kubernetes.pod_name(("x"):rep(100)), 63, "at most 63 bytes")
  t:eq(kubernetes.image_ref("demesne/base:1", "localhost"), "localhost/demesne/base:1", "prefixed")
  t:eq(kubernetes.image_ref("registry.example:5000/x/y:1", "localhost"), "registry.example:5000/x/y:1",
    "a reference with a registry is kept")
  t:eq(kubernetes.image_ref("demesne/base:1", nil), "demesne/base:1", "no prefix")
end

-- A ConfigMap holds at most 1,048,576 bytes of values: demesne-init must stay well under, so
-- this fails at 960 KiB, before the adapter cannot deliver it (then split or compress it).
function tests.demesne_init_fits_a_configmap(t)
  local path = t:ok(config.init_path(), "the demesne-init the runtime mounts")
  local size = t:ok(fs.stat(path), "stat").size
  local limit = 960 * 1024
  t:ok(size <= limit, ("%s is %d bytes, over %d: a ConfigMap holds at most %d (split or compress it)"):format(path,
    size, limit, kubernetes.CONFIGMAP_MAX_BYTES))
end

function tests.lease_times_are_read_as_utc(t)
  t:eq(kubernetes.epoch("1970-01-01T00:00:00Z"), 0, "the epoch")
  t:eq(kubernetes.epoch("2026-12-03T19:00:00.123456Z"), 1796324400, "a renewTime with microseconds")
  t:eq(kubernetes.epoch("2024-02-29T23:59:59Z"), 1709251199, "a leap day")
  t:eq(kubernetes.epoch("2000-03-01T00:00:00Z"), 951868800, "after a leap century's February")
  t:eq(kubernetes.epoch("yesterday"), nil, "not a time")
end

return tests
