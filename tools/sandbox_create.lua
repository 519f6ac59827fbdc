-- sandbox_create: a persistent sandbox for several sandbox_exec calls.
local repo = require("demesne.repo")
local sandbox = require("demesne.sandbox")
local schemas = require("demesne.schemas")
local json = require("demesne.json")

return {
  name = "sandbox_create",
  title = "Create a persistent sandbox",
  description = "Creates a container that stays up for sandbox_exec, sandbox_upload and sandbox_download "
    .. "until sandbox_destroy or its TTL (renewed by each exec). Inputs are mounted read-only at /in; "
    .. "/out is a host folder kept after the sandbox goes. Network access is decided by its egress policy.",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    properties = {
      image = schemas.image,
      snapshot = { type = "string", minLength = 1, description = "Start from this snapshot (sandbox_snapshot's "
        .. "snapshot_id) instead of an image: its /workspace and files, isolated no weaker than its source." },
      files = schemas.files(),
      directories = schemas.directories(),
      env = schemas.env,
      egress = schemas.egress,
      limits = schemas.limits,
      isolation = schemas.isolation,
      ttl_seconds = { type = "integer", minimum = 60, description = "Seconds the sandbox lives without use. Default 48 h." },
      mcp = schemas.mcp,
      budget_usd = schemas.budget_usd,
      tree = schemas.tree,
      repository = repo.params().repository,
      include_uncommitted = repo.params().include_uncommitted,
      branch = repo.params().branch,
      depth = repo.params().depth,
      ports = { type = "array", uniqueItems = true, items = schemas.port, description = "Ports the sandbox's "
        .. "services listen on (on its 127.0.0.1) to open in a browser on this host: each gets a URL of its own on "
        .. "the host's loopback (see previews in the result), relayed without any network interface, also at "
        .. "egress none. sandbox_expose adds one later." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "sandbox_id", "output_dir", "expires_at" }),
    properties = {
      sandbox_id = { type = "string" },
      output_dir = { type = "string" },
      expires_at = { type = "string", description = "UTC, RFC 3339" },
      image = { type = "string" },
      previews = schemas.previews,
      snapshot = { type = "string", description = "the snapshot it started from" },
      isolation = { type = "string" },
      mcp = { type = "object", description = "with mcp: true, the in-sandbox endpoint: url (inside the sandbox) and "
        .. "the bearer token its commands find in $DEMESNE_MCP_TOKEN" },
      repository = { type = "object", description = "with repository: the clone in the sandbox (path), its branch, "
        .. "base and host_head, and notes; the branch comes back at sandbox_destroy and with sandbox_exec hand_back",
        properties = { branch = { type = "string" }, path = { type = "string" }, base = { type = "string" },
          host_head = { type = "string" }, notes = { type = "array", items = { type = "string" } } } },
    },
  },
  annotations = { readOnlyHint = false, destructiveHint = false, idempotentHint = false, openWorldHint = false },
  run = function(ctx, args)
    local r = sandbox.create(ctx, args)
    local text = ("sandbox_id: %s\noutput_dir: %s\nexpires_at: %s"):format(r.sandbox_id, r.output_dir, r.expires_at)
    if r.repository then text = text .. ("\nrepository: %s on branch %s"):format(r.repository.path, r.repository.branch) end
    for _, p in ipairs(r.previews or {}) do text = text .. ("\npreview of port %d: %s"):format(p.port, p.url) end
    return r, text
  end,
}
