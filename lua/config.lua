-- Configuration: built-in defaults, then $XDG_CONFIG_HOME/demesne/config.lua (a Lua
-- table), then environment variables. Every other module asks this one, and
-- `demesne check-config` prints each value with where it came from.
local fs = require("core.fs")
local loop = require("core.loop")

local config = {}

local function home() return os.getenv("HOME") or "/root" end

local function xdg(var, fallback)
  local v = os.getenv(var)
  if v and v ~= "" then return v end
  return home() .. "/" .. fallback
end

--- The folder that holds config.lua and the user's tools/, policies/, providers/, engines/.
---@return string
function config.dir() return xdg("XDG_CONFIG_HOME", ".config") .. "/demesne" end

local function nproc()
  local f = io.open("/proc/cpuinfo")
  if not f then return 2 end
  local n = 0
  for line in f:lines() do if line:match("^processor") then n = n + 1 end end
  f:close()
  return math.max(n, 1)
end

-- name -> {default, env = variable, parse = function(string) -> value|nil, err, doc}
local SPEC = {
  engine = { env = "DEMESNE_ENGINE", doc = "container engine socket (unix:///path); empty = discover. With another "
    .. "engine_adapter: that adapter's endpoint" },
  engine_adapter = { env = "DEMESNE_ENGINE_ADAPTER", default = "docker",
    doc = "the engine adapter: docker (the Docker Engine API: Docker, Podman), kubernetes (Pods on a cluster; also "
      .. "chosen by engine = \"kubernetes\") or a file engines/<name>.lua in the config folder" },
  kubeconfig = { env = "DEMESNE_KUBECONFIG",
    doc = "kubernetes: the kubeconfig file (server, CA, client certificate or bearer token); unset: KUBECONFIG's "
      .. "first file, else ~/.kube/config" },
  kubernetes_context = { env = "DEMESNE_KUBERNETES_CONTEXT",
    doc = "kubernetes: the kubeconfig context to use; unset: its current-context" },
  kubernetes_namespace = { env = "DEMESNE_KUBERNETES_NAMESPACE",
    doc = "kubernetes: the namespace of demesne's Pods; unset: the context's namespace (default: default)" },
  kubernetes_image_prefix = { env = "DEMESNE_KUBERNETES_IMAGE_PREFIX",
    doc = "kubernetes: the registry the cluster pulls demesne's images from (host[:port][/path]), put in front of "
      .. "image references that name no registry" },
  kubernetes_pull_secrets = { env = "DEMESNE_KUBERNETES_PULL_SECRETS", default = {}, list = true, sep = ",",
    doc = "kubernetes: Secrets of the namespace given to each Pod as imagePullSecrets (','-separated)" },
  kubernetes_node = { env = "DEMESNE_KUBERNETES_NODE",
    doc = "kubernetes: the node to place Pods on (spec.nodeName), for a cluster without a scheduler; unset: the "
      .. "scheduler places them" },
  allowed_paths = { env = "DEMESNE_ALLOWED_PATHS", default = {}, list = true, absolute = true,
    doc = "host roots that files/directories/src may come from (':'-separated)" },
  output_root = { env = "DEMESNE_OUTPUT_ROOT",
    default = function() return xdg("XDG_DATA_HOME", ".local/share") .. "/demesne/out" end,
    doc = "where each run's output folder (/out) is kept" },
  state_dir = { env = "DEMESNE_STATE_DIR", default = function() return xdg("XDG_STATE_HOME", ".local/state") .. "/demesne" end,
    doc = "job records and per-sandbox run folders" },
  log_level = { env = "DEMESNE_LOG_LEVEL", default = "info", doc = "stderr log level (debug … emergency)" },
  egress_allow = { env = "DEMESNE_EGRESS_ALLOW", default = {}, list = true, sep = ",",
    doc = "hosts for the config-defined allowlist egress policy (','-separated)" },
  egress_default = { env = "DEMESNE_EGRESS_DEFAULT", default = "package-managers",
    doc = "egress policy of a sandbox whose call names none" },
  egress_https_proxy = { env = "DEMESNE_EGRESS_HTTPS_PROXY",
    default = function() return os.getenv("HTTPS_PROXY") or os.getenv("https_proxy") or "" end,
    doc = "the host's own proxy that allowed CONNECT (HTTPS) requests go on through, http://[user:password@]host:port; "
      .. "default: HTTPS_PROXY (or https_proxy) of demesne's environment; empty = dial directly" },
  egress_http_proxy = { env = "DEMESNE_EGRESS_HTTP_PROXY",
    default = function() return os.getenv("HTTP_PROXY") or os.getenv("http_proxy") or "" end,
    doc = "the same for allowed plain HTTP requests; default: HTTP_PROXY (or http_proxy) of demesne's environment" },
  egress_no_proxy = { env = "DEMESNE_EGRESS_NO_PROXY", list = true, sep = ",",
    default = function()
      local v = os.getenv("NO_PROXY") or os.getenv("no_proxy") or ""
      local out = {}
      for item in v:gmatch("[^,]+") do out[#out + 1] = item end
      return out
    end,
    doc = "names (and their subdomains), IP addresses and host:port pairs that are dialled directly rather than "
      .. "through egress_https_proxy / egress_http_proxy, ','-separated; * = all; default: NO_PROXY (or no_proxy)" },
  ask_timeout_seconds = { env = "DEMESNE_ASK_TIMEOUT_SECONDS", default = 120, number = true,
    doc = "how long a connection the egress policy asks about (ASK) is held for an answer before it is denied" },
  ask_max_held = { env = "DEMESNE_ASK_MAX_HELD", default = 16, number = true,
    doc = "connections one sandbox may have held waiting for an ask answer at once; more are denied at once" },
  egress_resolver = { env = "DEMESNE_EGRESS_RESOLVER", default = "",
    doc = "test mode: ip:port of a DNS server the egress proxy asks instead of the system resolver" },
  init_path = { env = "DEMESNE_INIT", doc = "demesne-init binary mounted into sandboxes; default: beside the demesne binary" },
  default_image = { env = "DEMESNE_DEFAULT_IMAGE", default = "default", doc = "image used when a call names none" },
  devcontainer_build_network = { env = "DEMESNE_DEVCONTAINER_BUILD_NETWORK", default = "none", choices = { "none", "host" },
    doc = "the network of a repository's devcontainer build (image: devcontainer): none, or the host's (the "
      .. "build's commands then have the host's network); under none, an engine that does not keep a build step off "
      .. "the network (probed once per engine) refuses a Dockerfile with RUN" },
  timeout_default = { default = 3600, number = true, doc = "seconds a command may run when the call sets no timeout" },
  timeout_max = { env = "DEMESNE_TIMEOUT_MAX", default = 48 * 3600, number = true, doc = "ceiling for timeout_seconds" },
  ttl_default = { default = 48 * 3600, number = true, doc = "seconds a persistent sandbox lives without use" },
  ttl_max = { env = "DEMESNE_TTL_MAX", default = 7 * 24 * 3600, number = true, doc = "ceiling for ttl_seconds" },
  previews_max = { env = "DEMESNE_PREVIEWS_MAX", default = 8, number = true,
    doc = "port previews (ports, sandbox_expose) per sandbox, each a listener on the host's loopback" },
  preview_connections_max = { default = 64, number = true,
    doc = "open connections per port preview; more are refused with 503" },
  snapshot_keep_seconds = { env = "DEMESNE_SNAPSHOT_KEEP_SECONDS", default = 7 * 24 * 3600, number = true,
    doc = "seconds a snapshot (sandbox_snapshot, sandbox_fork) is kept before the reaper removes it (once no "
      .. "sandbox runs from it)" },
  snapshot_max_count = { env = "DEMESNE_SNAPSHOT_MAX_COUNT", default = 20, number = true,
    doc = "snapshots kept at most; past it the oldest go (the reaper and each new snapshot prune)" },
  snapshot_max_bytes = { env = "DEMESNE_SNAPSHOT_MAX_BYTES", default = 2 * 1024 * 1024 * 1024, number = true,
    doc = "largest snapshot: the bytes of /workspace (as a tar) plus the root filesystem's changes; a larger one "
      .. "is refused before anything is made" },
  fork_max_count = { env = "DEMESNE_FORK_MAX_COUNT", default = 8, number = true,
    doc = "ceiling for sandbox_fork's count (sandboxes started from one snapshot in one call)" },
  memory_mb_default = { default = 2048, number = true, doc = "memory limit per sandbox (MiB)" },
  memory_mb_max = { env = "DEMESNE_MEMORY_MB_MAX", default = 16384, number = true, doc = "ceiling for limits.memory_mb" },
  cpus_default = { default = 2, number = true, doc = "CPU limit per sandbox" },
  cpus_max = { default = function() return nproc() end, number = true, doc = "ceiling for limits.cpus" },
  pids_default = { default = 1024, number = true, doc = "process limit per sandbox" },
  pids_max = { default = 32768, number = true, doc = "ceiling for limits.pids" },
  agent_rate_limit_retries = { env = "DEMESNE_AGENT_RATE_LIMIT_RETRIES", default = 3, number = true, zero = true,
    doc = "times per agent run a vendor 429 is waited out until its reset (a held request or a resumed session); 0: never" },
  agent_rate_limit_max_wait_seconds = { env = "DEMESNE_AGENT_RATE_LIMIT_MAX_WAIT_SECONDS", default = 3600, number = true,
    doc = "longest wait for a vendor rate-limit reset; a later reset ends the run" },
  agent_rate_limit_hold_seconds = { env = "DEMESNE_AGENT_RATE_LIMIT_HOLD_SECONDS", default = 60, number = true,
    zero = true, doc = "longest reset the vendor route waits out holding the request; a later one ends the CLI's "
      .. "attempt and its session is resumed after the reset; 0: never hold" },
  host_mcp_import = { env = "DEMESNE_HOST_MCP_IMPORT", default = {}, list = true, sep = ",",
    doc = "host MCP servers to import as well as host_mcp's (','-separated): claude_code (~/.claude.json), "
      .. "codex (~/.codex/config.toml); an imported server offers no tool until host_mcp names its tools" },
  host_mcp_timeout_seconds = { env = "DEMESNE_HOST_MCP_TIMEOUT_SECONDS", default = 120, number = true,
    doc = "longest wait for a host MCP server's answer to one tool call (a call may ask for less)" },
  host_mcp_startup_timeout_seconds = { default = 30, number = true,
    doc = "longest wait for a host MCP server to start and answer initialize" },
  host_mcp_idle_seconds = { env = "DEMESNE_HOST_MCP_IDLE_SECONDS", default = 600, number = true,
    doc = "a host MCP server unused this long is stopped (started again on its next use)" },
  host_mcp_max_message_bytes = { default = 4 * 1024 * 1024, number = true,
    doc = "largest message exchanged with a host MCP server, either way" },
  host_mcp_record_arguments = { env = "DEMESNE_HOST_MCP_RECORD_ARGUMENTS", default = false, bool = true,
    doc = "also write each proxied call's arguments to mcp.jsonl in the run's output folder" },
  output_head_bytes = { env = "DEMESNE_OUTPUT_HEAD_BYTES", default = 32768, number = true,
    doc = "bytes of the start of each stream kept in a result" },
  output_tail_bytes = { env = "DEMESNE_OUTPUT_TAIL_BYTES", default = 32768, number = true,
    doc = "bytes of the end of each stream kept in a result" },
  download_max_bytes = { env = "DEMESNE_DOWNLOAD_MAX_BYTES", default = 1024 * 1024 * 1024, number = true,
    doc = "ceiling on the unpacked size of one sandbox_download" },
  repository_max_bytes = { env = "DEMESNE_REPOSITORY_MAX_BYTES", default = 2 * 1024 * 1024 * 1024, number = true,
    doc = "ceiling on a host repository given to a sandbox (its objects on disk, and the bundle made of it) and on "
      .. "the bundle a sandbox hands back" },
  repository_timeout_seconds = { env = "DEMESNE_REPOSITORY_TIMEOUT_SECONDS", default = 300, number = true,
    doc = "seconds one git command on the host (bundling a repository, fetching a handed-back branch) may take" },
  upload_max_bytes = { env = "DEMESNE_UPLOAD_MAX_BYTES", default = 4 * 1024 * 1024 * 1024, number = true,
    doc = "ceiling on the size of the files one sandbox_upload copies (sparse files count in full)" },
  output_max_bytes = { env = "DEMESNE_OUTPUT_MAX_BYTES", default = 16 * 1024 * 1024 * 1024, number = true,
    doc = "disk space (allocated bytes) one run's output folder may take, its children's folders in it included; "
      .. "past it the sandbox is stopped (output quota exceeded)" },
  output_max_entries = { env = "DEMESNE_OUTPUT_MAX_ENTRIES", default = 1000000, number = true,
    doc = "files, folders and links one run's output folder may hold; past it the sandbox is stopped" },
  output_min_free_bytes = { env = "DEMESNE_OUTPUT_MIN_FREE_BYTES", default = 2 * 1024 * 1024 * 1024, number = true,
    zero = true, doc = "free space kept on the filesystem of output_root: a sandbox does not start below it and "
      .. "is stopped when its writes would go below it" },
  output_min_free_percent = { env = "DEMESNE_OUTPUT_MIN_FREE_PERCENT", default = 2, number = true, zero = true,
    doc = "the same reserve as a percentage of that filesystem's size; the larger of the two holds" },
  output_quota_interval_ms = { env = "DEMESNE_OUTPUT_QUOTA_INTERVAL_MS", default = 1000, number = true,
    doc = "longest time between two measurements of a running sandbox's output folder (sooner as it nears "
      .. "its quota, or when its filesystem's free space drops, down to 10 ms)" },
  egress_max_connections = { env = "DEMESNE_EGRESS_MAX_CONNECTIONS", default = 256, number = true,
    doc = "connections one sandbox may hold open through its egress proxy at once; more are answered 503" },
  sandbox_max_descriptors = { env = "DEMESNE_SANDBOX_MAX_DESCRIPTORS", default = 1024, number = true,
    doc = "descriptors one sandbox's egress connections may make the server hold (a CONNECT tunnel holds 6); "
      .. "sized so that many sandboxes at their ceiling stay under the server's open-file limit" },
  vendor_max_connections = { env = "DEMESNE_VENDOR_MAX_CONNECTIONS", default = 32, number = true,
    doc = "connections one agent sandbox may hold open on its vendor (model API) route at once; more are answered 503" },
  vendor_max_buffered_bytes = { env = "DEMESNE_VENDOR_MAX_BUFFERED_BYTES", default = 64 * 1024 * 1024, number = true,
    doc = "bytes of request bodies one agent sandbox's vendor route may hold in the server's memory at once (being "
      .. "read, sent or held for a rate-limit retry); a request over it is answered 503" },
  vendor_max_buffered_bytes_total = { env = "DEMESNE_VENDOR_MAX_BUFFERED_BYTES_TOTAL", default = 256 * 1024 * 1024,
    number = true, doc = "the same, for the vendor routes of all sandboxes together" },
  exec_grace_seconds = { env = "DEMESNE_EXEC_GRACE_SECONDS", default = 30, number = true,
    doc = "seconds the host waits for a sandbox beyond a command's own timeout (and for demesne-init kill) before "
      .. "it calls the sandbox unresponsive and stops it" },
  reap_interval = { default = 300, number = true, doc = "seconds between reaper passes" },
  progress_interval = { env = "DEMESNE_PROGRESS_INTERVAL", default = 10, number = true,
    doc = "seconds between notifications/progress while a call waits (when the caller sent a progressToken)" },
  jobs_keep_seconds = { env = "DEMESNE_JOBS_KEEP_SECONDS", default = 7 * 24 * 3600, number = true,
    doc = "seconds a finished background job's record is kept before it is pruned" },
  workspace_keep_seconds = { env = "DEMESNE_WORKSPACE_KEEP_SECONDS", default = 24 * 3600, number = true, zero = true,
    doc = "seconds a sandbox_agent run's /workspace and CLI session state are kept after it ends, for a "
      .. "`continue`; 0 keeps nothing" },
  workspace_keep_max_mb = { env = "DEMESNE_WORKSPACE_KEEP_MAX_MB", default = 2048, number = true,
    doc = "a run's kept workspace and session state larger than this (MB) are removed when it ends (not continuable)" },
  workspace_keep_max_count = { env = "DEMESNE_WORKSPACE_KEEP_MAX_COUNT", default = 20, number = true, zero = true,
    doc = "kept workspaces at most; past it the one expiring soonest goes" },
  jobs_poll_interval = { env = "DEMESNE_JOBS_POLL_INTERVAL", default = 1, number = true,
    doc = "seconds between checks of a re-attached exec job's status file" },
  jobs_tail_bytes = { default = 16384, number = true, doc = "bytes of stdout in sandbox_status's stdout_tail" },
  jobs_read_bytes = { default = 65536, number = true, doc = "default bytes of stdout one sandbox_status `since` read returns" },
  pool_size = { env = "DEMESNE_POOL_SIZE", default = 2, number = true, zero = true,
    doc = "warm sandboxes kept started per kind of sandbox_script sandbox (image, egress, limits); 0 turns the pool off" },
  pool_images = { env = "DEMESNE_POOL_IMAGES", default = { "default" }, list = true, sep = ",",
    doc = "images whose pool (default egress and limits) fills when the server starts, if the image is built "
      .. "(','-separated); other kinds fill after their first call" },
  pool_idle_seconds = { env = "DEMESNE_POOL_IDLE_SECONDS", default = 600, number = true, zero = true,
    doc = "a kind of sandbox no call has used for this long gives up its warm sandboxes; 0: never" },
  pool_max = { env = "DEMESNE_POOL_MAX", default = 8, number = true, zero = true,
    doc = "warm sandboxes in all kinds together; the least recently used kind gives way" },
  twine_official_formats = { env = "DEMESNE_TWINE_OFFICIAL_FORMATS", default = true, bool = true,
    doc = "when the twine image is built, also fetch the official Harlowe and SugarCube story formats "
      .. "(from the Twine repository on GitHub; skipped when unreachable)" },
  mcp_max_line_bytes = { env = "DEMESNE_MCP_MAX_LINE_BYTES", default = 16 * 1024 * 1024, number = true,
    doc = "longest incoming JSON-RPC line on stdio (a longer one is discarded with an error)" },
  mcp_max_message_bytes = { env = "DEMESNE_MCP_MAX_MESSAGE_BYTES", default = 4 * 1024 * 1024, number = true,
    doc = "largest outgoing MCP message (stdio and HTTP)" },
  mcp_shutdown_timeout_ms = { env = "DEMESNE_MCP_SHUTDOWN_TIMEOUT_MS", default = 20000, number = true,
    doc = "milliseconds a server's graceful stop waits for cancelled calls to clean up" },
  http_max_body_bytes = { env = "DEMESNE_HTTP_MAX_BODY_BYTES", default = 4 * 1024 * 1024, number = true,
    doc = "largest request body `serve --http` accepts (413 above, refused before it is read)" },
  http_max_sessions = { env = "DEMESNE_HTTP_MAX_SESSIONS", default = 1000, number = true,
    doc = "MCP sessions (2025 revisions) `serve --http` keeps at once; past it the longest-idle one without a "
      .. "request in progress, an open stream or a job or sandbox it started goes, else initialize gets 503" },
  http_max_connections = { env = "DEMESNE_HTTP_MAX_CONNECTIONS", default = 1024, number = true,
    doc = "connections `serve --http` serves at once once they presented the bearer token (503 past it); those "
      .. "that have not yet do not count (http_max_preauth_connections)" },
  http_max_preauth_connections = { env = "DEMESNE_HTTP_MAX_PREAUTH_CONNECTIONS", default = 256, number = true,
    doc = "connections per `serve --http` address that have not yet sent a request head with the bearer token; "
      .. "a new one past it closes the oldest such (one that has sent nothing first), so they never keep out a client "
      .. "that has the token; a client opening more at once than this may see some reset" },
  http_head_timeout_seconds = { env = "DEMESNE_HTTP_HEAD_TIMEOUT_SECONDS", default = 5, number = true,
    doc = "a new connection to `serve --http` or to a sandbox's MCP endpoint must send its first request head "
      .. "whole within this, else it is closed (an authenticated connection may then idle 120 s between requests)" },
  http_sse_replay_events = { env = "DEMESNE_HTTP_SSE_REPLAY_EVENTS", default = 128, number = true, zero = true,
    doc = "events each SSE stream of a request keeps for a client that resumes it (GET with Last-Event-ID), the "
      .. "oldest dropped past it (the answer is always the newest); 0 = no event ids, streams are not resumable" },
  http_sse_replay_seconds = { env = "DEMESNE_HTTP_SSE_REPLAY_SECONDS", default = 300, number = true,
    doc = "how long a request's SSE stream whose connection dropped is kept for its client to resume, from the "
      .. "drop (or from its answer, when that came while no client was connected); then it and its answer go" },
  endpoint_max_connections = { env = "DEMESNE_ENDPOINT_MAX_CONNECTIONS", default = 32, number = true,
    doc = "connections one sandbox's MCP endpoint (127.0.0.1:3130 inside it) serves at once once they presented "
      .. "its token (503 past it); its own, so no sandbox takes another's" },
  endpoint_max_preauth_connections = { env = "DEMESNE_ENDPOINT_MAX_PREAUTH_CONNECTIONS", default = 32, number = true,
    doc = "connections to one sandbox's MCP endpoint that have not yet sent a head with its token; a new one past "
      .. "it closes the oldest such" },
  endpoint_max_sessions = { env = "DEMESNE_ENDPOINT_MAX_SESSIONS", default = 16, number = true,
    doc = "MCP sessions one sandbox's MCP endpoint keeps at once (its own, apart from http_max_sessions); past it "
      .. "its longest-idle session without a request in progress or an open stream goes, else initialize gets 503" },
  readonly_rootfs = { env = "DEMESNE_READONLY_ROOTFS", default = true, bool = true,
    doc = "mount each sandbox's root filesystem read-only (tmpfs on /tmp, /var/tmp, /root, /run)" },
  -- nested sandboxes (lua/tree): a host call's `tree` and `budget_usd` override the defaults within the ceilings
  tree_depth_default = { default = 3, number = true,
    doc = "deepest level of a sandbox tree: the host's run is level 0, its children level 1, …" },
  tree_depth_max = { env = "DEMESNE_TREE_DEPTH_MAX", default = 5, number = true, doc = "ceiling for tree.depth" },
  tree_children_default = { default = 32, number = true,
    doc = "children one run may spawn in its life (every name counts, even a spawn that failed)" },
  tree_children_max = { env = "DEMESNE_TREE_CHILDREN_MAX", default = 256, number = true,
    doc = "ceiling for tree.children" },
  tree_running_default = { default = 8, number = true,
    doc = "sandboxes of one tree running at once, its root included; a spawn past it waits its turn" },
  tree_running_max = { env = "DEMESNE_TREE_RUNNING_MAX", default = 32, number = true, doc = "ceiling for tree.running" },
  tree_jobs_default = { default = 32, number = true,
    doc = "background jobs (sandbox_exec, background spawns) running at once on the sandboxes below a tree's root; "
      .. "one more is refused" },
  tree_jobs_max = { env = "DEMESNE_TREE_JOBS_MAX", default = 256, number = true, doc = "ceiling for tree.jobs" },
  tree_job_records_default = { default = 256, number = true,
    doc = "job records a tree keeps of the background jobs below its root; at it, a new job removes the oldest "
      .. "finished one's record, and is refused when all are running" },
  tree_job_records_max = { env = "DEMESNE_TREE_JOB_RECORDS_MAX", default = 4096, number = true,
    doc = "ceiling for tree.job_records" },
  tree_budget_usd_default = { env = "DEMESNE_TREE_BUDGET_USD", default = 0, number = true, zero = true,
    doc = "USD a tree's model requests may spend when the call names no budget_usd; 0: no budget" },
  tree_budget_usd_max = { env = "DEMESNE_TREE_BUDGET_USD_MAX", default = 0, number = true, zero = true,
    doc = "ceiling for budget_usd; 0: none. With a ceiling, a tree without a budget gets the ceiling" },
  tree_wait_seconds = { env = "DEMESNE_TREE_WAIT_SECONDS", default = 240, number = true,
    doc = "longest a call from inside a sandbox blocks on sandbox_wait or on a free slot (then it returns running "
      .. "or is refused), so that no MCP client timeout is hit" },
  image_pull = { env = "DEMESNE_IMAGE_PULL", default = true, bool = true,
    doc = "pull an image reference the engine does not hold when a call or a user image's FROM names it (with the "
      .. "host's registry credentials); false: only images already in the engine" },
  image_pull_timeout_seconds = { default = 600, number = true,
    doc = "longest one image pull (from a registry or one of its mirrors) may take" },
  registry_helper_timeout_seconds = { default = 10, number = true,
    doc = "longest a registry credential helper (docker-credential-<name> get) may take to answer" },
  image_outdated_timeout_seconds = { default = 300, number = true,
    doc = "longest `demesne images outdated` spends checking one image for newer packages" },
  agent_cli_max_age_days = { env = "DEMESNE_AGENT_CLI_MAX_AGE_DAYS", default = 30, number = true, zero = true,
    doc = "`demesne doctor` warns when the Claude Code or Codex CLI installed in an agent image is older than this "
      .. "many days; 0: never" },
  child_images = { env = "DEMESNE_CHILD_IMAGES", default = {}, list = true, sep = ",",
    doc = "images of the engine's store (references) that a sandbox may name for its children, besides demesne's "
      .. "built-in and user images (','-separated); any other engine image is refused from inside a sandbox" },
  child_image_builds = { env = "DEMESNE_CHILD_IMAGE_BUILDS", default = false, bool = true,
    doc = "let a call from inside a sandbox build a demesne image that is not built yet (minutes of CPU, GBs of "
      .. "disk); false refuses it: the host builds it (`demesne images build NAME`)" },
  isolation_default = { env = "DEMESNE_ISOLATION", default = "container", choices = { "container", "gvisor" },
    doc = "isolation of a sandbox whose call names none: container (the engine's runtime) or gvisor (gVisor's "
      .. "own kernel in between; the engine must offer it, see gvisor_runtime and gvisor_engine)" },
  gvisor_runtime = { env = "DEMESNE_GVISOR_RUNTIME", default = "runsc",
    doc = "Docker: the name gVisor is registered under in daemon.json (runtimes; with --host-uds=open)" },
  gvisor_engine = { env = "DEMESNE_GVISOR_ENGINE",
    doc = "Podman: the socket (unix:///path) of a second Podman API service whose default runtime is gVisor "
      .. "(Podman's API cannot choose a runtime per container); unset: no gVisor on Podman" },
  enforce_limits = { env = "DEMESNE_ENFORCE_LIMITS", default = true, bool = true,
    doc = "refuse to start sandboxes on an engine that would not enforce their memory, process and CPU limits "
      .. "(rootless Podman on cgroup v1); false starts them without limits, with a warning" },
  protected_paths = { env = "DEMESNE_PROTECTED_PATHS", list = true, absolute = true,
    default = function()
      local h = home()
      local codex = os.getenv("CODEX_HOME")
      local list = { h .. "/.claude", h .. "/.claude.json", (codex and codex ~= "" and codex or h .. "/.codex"),
        h .. "/.docker/config.json", xdg("XDG_CONFIG_HOME", ".config") .. "/containers/auth.json" }
      local rt = os.getenv("XDG_RUNTIME_DIR")
      if rt and rt ~= "" then list[#list + 1] = rt .. "/containers/auth.json" end
      return list
    end,
    doc = "host paths no input (files, directories) may be or contain, beside demesne's own folders "
      .. "(state_dir, control_dir, output_root, the configuration folder): the agent CLIs' and the engines' "
      .. "credential files by default; ':'-separated" },
  control_dir = { env = "DEMESNE_CONTROL_DIR",
    default = function()
      local rt = os.getenv("XDG_RUNTIME_DIR")
      if rt and rt ~= "" then return rt .. "/demesne" end
      return xdg("XDG_STATE_HOME", ".local/state") .. "/demesne/control"
    end,
    doc = "the private folder (0700) where every running `demesne serve` of this user registers itself (a "
      .. "<pid>.json entry and its control socket <pid>.sock) for `demesne ps`, `logs`, `cancel` and `ui`" },
  ui_dir = { env = "DEMESNE_UI_DIR",
    doc = "the built cockpit page (index.html, app.js, app.css) that `demesne ui` serves; unset: <bindir>/ui "
      .. "(the build tree) or <bindir>/../share/demesne/ui (installed)" },
  userns = { env = "DEMESNE_USERNS", default = true, bool = true,
    doc = "run sandboxes in a user namespace where the engine supports it, so that uid 0 inside is an "
      .. "unprivileged uid on the host (rootful Podman: an automatic range; Docker: when userns-remap is on)" },
}

local values, origins
local file_error

local function parse(spec, name, raw)
  if spec.list then
    if type(raw) == "table" then return raw end
    local out = {}
    for part in tostring(raw):gmatch("[^" .. (spec.sep or ":") .. "]+") do
      part = part:match("^%s*(.-)%s*$")
      if part ~= "" then
        if spec.absolute and part:sub(1, 1) ~= "/" then
          return nil, ("%s: %q is not an absolute path"):format(name, part)
        end
        out[#out + 1] = part
      end
    end
    return out
  elseif spec.number then
    local n = tonumber(raw)
    if not n then return nil, ("%s must be a number, got %q"):format(name, tostring(raw)) end
    -- numeric settings are sizes, counts and durations: zero makes sense only where it
    -- switches something off (spec.zero), less never (a zero ceiling would refuse every
    -- call, zero head bytes would cut every result)
    if n ~= n or n < 0 or (n == 0 and not spec.zero) then
      return nil, ("%s must be a %s number, got %s"):format(name, spec.zero and "non-negative" or "positive", tostring(raw))
    end
    return n
  elseif spec.bool then
    if type(raw) == "boolean" then return raw end
    local s = tostring(raw):lower()
    if s == "1" or s == "true" or s == "yes" then return true end
    if s == "0" or s == "false" or s == "no" then return false end
    return nil, ("%s must be true or false, got %q"):format(name, s)
  elseif spec.choices then
    local s = tostring(raw)
    for _, c in ipairs(spec.choices) do
      if s == c then return s end
    end
    return nil, ("%s must be one of %s, got %q"):format(name, table.concat(spec.choices, ", "), s)
  end
  return tostring(raw)
end

--- (Re)reads the configuration. Called lazily by config.get; tests call it after changing
--- the environment.
function config.load()
  values, origins, file_error = {}, {}, nil
  local file = {}
  local path = config.dir() .. "/config.lua"
  local f = io.open(path)
  if f then
    local src = f:read("a")
    f:close()
    local chunk, err = load(src, "@" .. path, "t", {})
    if chunk then
      local ok, t = pcall(chunk)
      if ok and type(t) == "table" then file = t else file_error = ok and (path .. " must return a table") or tostring(t) end
    else
      file_error = err
    end
  end
  for name, spec in pairs(SPEC) do
    local v, origin = spec.default, "default"
    if type(v) == "function" then v = v() end
    if file[name] ~= nil then
      local pv, err = parse(spec, name, file[name])
      if pv ~= nil then v, origin = pv, path else file_error = err end
    end
    local ev = spec.env and os.getenv(spec.env)
    if ev and ev ~= "" then
      local pv, err = parse(spec, name, ev)
      if pv ~= nil then v, origin = pv, "$" .. spec.env else file_error = err end
    end
    values[name], origins[name] = v, origin
  end
  -- sections with structure (policies, providers) pass through from the file
  for k, v in pairs(file) do
    if SPEC[k] == nil then values[k], origins[k] = v, path end
  end
end

--- Returns the effective value of a setting (see SPEC for names).
---@param name string
---@return any
function config.get(name)
  if not values then config.load() end
  return values[name]
end

--- Returns {name = {value, origin, doc}} for every setting, and the config file's error if any.
---@return table<string, {value: any, origin: string, doc: string, env: string|nil}> settings, string|nil err
function config.describe()
  if not values then config.load() end
  local out = {}
  for name, spec in pairs(SPEC) do
    out[name] = { value = values[name], origin = origins[name], doc = spec.doc, env = spec.env }
  end
  return out, file_error
end

--- The places demesne-init is looked for when `init_path` is unset, in order: beside the
--- `demesne` binary (the build tree, or both copied into one folder), then the installed
--- layout's libexec folder (`<bindir>/../libexec/demesne`, compiled in as
--- core.loop.libexec_dir). Empty when the binary's own path is unknown.
---@return string[] paths
function config.init_candidates()
  local exe = loop.exepath()
  if not exe then return {} end
  local dir = exe:gsub("/[^/]*$", "")
  local out = { dir .. "/demesne-init" }
  local rel = loop.libexec_dir
  if rel and rel ~= "" and rel ~= "." then
    -- the binary's path is already resolved (/proc/self/exe), so ".." is removed by text
    local parts = {}
    for c in ((rel:sub(1, 1) == "/" and "" or dir .. "/") .. rel):gmatch("[^/]+") do
      if c == ".." then parts[#parts] = nil elseif c ~= "." then parts[#parts + 1] = c end
    end
    out[#out + 1] = "/" .. table.concat(parts, "/") .. "/demesne-init"
  end
  return out
end

--- Path of the demesne-init binary to mount into sandboxes: `init_path` (DEMESNE_INIT)
--- when set, else the first of config.init_candidates() that is a regular file.
---@return string|nil path, string|nil err  err names every path that was tried
function config.init_path()
  local p = config.get("init_path")
  local tried = p and { p } or config.init_candidates()
  for _, c in ipairs(tried) do
    local st = fs.stat(c)
    if st and st.type == "file" then return c end
  end
  if p then return nil, ("demesne-init not found at %s (set DEMESNE_INIT)"):format(p) end
  return nil, ("demesne-init not found at %s (set DEMESNE_INIT)"):format(
    #tried > 0 and table.concat(tried, " or ") or "(the demesne binary's path is unknown)")
end

return config
