-- Egress: policies and the per-sandbox proxy listeners.
--
-- A sandbox has no network (network mode none). demesne-init relays 127.0.0.1:3128 inside
-- it to <run_dir>/egress.sock on the host; core.proxy listens there, parses each request
-- head and asks this module for a verdict on the *name* (before any DNS lookup). After an
-- allow, C resolves the name itself and dials only an address that passes the address
-- checks (loopback, private, link-local, metadata, IPv6… are refused unless a CIDR rule
-- allows them). Every connection ends as one JSON line in <output_dir>/egress.jsonl.
--
-- A policy file (policies/*.lua, then $XDG_CONFIG_HOME/demesne/policies/*.lua) returns
--
--   return {
--     description = "…",
--     rules = {
--       { ALLOW, host = { "pypi.org", "files.pythonhosted.org" }, port = 443, name = "pypi" },
--       { DENY,  host = "*.internal.example" },
--       { ALLOW, cidr = "127.0.0.0/8", port = 8080 },
--     },
--   }
--
-- Rules are tried in order; the first rule that matches decides; nothing matches → deny.
-- A rule has an action (ALLOW or DENY, first element or `action`), and either `host`
-- patterns or `cidr` blocks (one or a list), optionally `port` (one or a list) and `name`.
-- Host patterns: "example.com" (exactly), "*.example.com" (any subdomain, not the domain
-- itself), ".example.com" (the domain and any subdomain), "*" (any name, never an IP
-- literal). Matching is on whole labels, after lowercasing and dropping a trailing dot.
-- IP literals are judged by CIDR rules only; the same CIDR rules (with their ports) decide
-- which resolved addresses may be dialled. Each rule counts the decisions it made (`hits`).
-- A policy that returns { open = true } gives the sandbox a bridge network and no proxy.
--
-- "Open egress" is a property of the policy, not of its name: a compiled policy has
-- `unrestricted = true` when it lets a sandbox reach hosts it does not name — a bridge
-- network ({ open = true }), an ALLOW rule for every name (host = "*"), an ALLOW rule for
-- a CIDR block of IPv4 /0–/7 or IPv6 /0–/15, whatever ports and DENY rules come with them
-- — or when the file declares { unrestricted = true }. Host inputs plus such a policy is
-- the exfiltration shape: egress.select refuses it for calls that mount files, and
-- sandbox_upload for sandboxes created with it.
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local proxy = require("core.proxy")
local fs = require("core.fs")
local loop = require("core.loop")

local egress = {}

local LOGGER = "demesne.egress"

egress.ALLOW, egress.DENY = "ALLOW", "DENY"
--- The proxy's port inside every sandbox.
egress.PORT = proxy.PORT
--- The socket inside the sandbox (the run folder is bind-mounted at /.demesne/run).
egress.SANDBOX_SOCKET = "/.demesne/run/egress.sock"
--- The socket's name in the host's run folder.
egress.SOCKET_NAME = "egress.sock"

--- The `egress` parameter of sandbox_script and sandbox_create.
egress.schema = { type = "string", minLength = 1, description =
  "Egress policy: 'package-managers' (default: package registries only), 'none' (no network), "
  .. "'open' (unrestricted; refused when files or directories are mounted), 'allowlist' "
  .. "(DEMESNE_EGRESS_ALLOW), or a policy from the user's policies folder. "
  .. "Everything goes through a proxy that judges each host name; see egress.jsonl in output_dir." }

--------------------------------------------------------------------------------------------
-- Policies

local function list_of(v)
  if v == nil then return {} end
  if type(v) ~= "table" then return { v } end
  return v
end

local function compile_pattern(p, where)
  if type(p) ~= "string" or p == "" then return nil, where .. ": must be a non-empty string" end
  if p == "*" then return { kind = "any", text = p } end
  local kind, rest = "exact", p
  if p:sub(1, 2) == "*." then kind, rest = "wildcard", p:sub(3)
  elseif p:sub(1, 1) == "." then kind, rest = "suffix", p:sub(2) end
  if rest:find("*", 1, true) then return nil, where .. (": %q: '*' only as a whole first label ('*.example.com')"):format(p) end
  local host, ip = proxy.normalize_host(rest)
  if not host then return nil, where .. (": %q: %s"):format(p, ip) end
  if ip ~= 0 then
    if kind ~= "exact" then return nil, where .. (": %q: an IP address cannot be a wildcard or suffix"):format(p) end
    return { kind = "cidr", text = host .. (ip == 4 and "/32" or "/128") }
  end
  return { kind = kind, name = host, dotted = "." .. host, text = p }
end

--- Compiles a policy definition (what a policy file returns) into a policy object.
---@param name string
---@param def table   {description, rules = {...}} or {open = true}
---@param origin string|nil  where it came from (for messages)
---@return table|nil policy, string|nil err
function egress.compile(name, def, origin)
  origin = origin or name
  if type(def) ~= "table" then return nil, ("%s: a policy file must return a table"):format(origin) end
  local pol = { name = name, description = def.description or "", origin = origin, open = def.open == true,
    unrestricted = def.open == true or def.unrestricted == true, rules = {}, addr_rules = {} }
  if pol.open then return pol end
  local rules = def.rules or def
  if type(rules) ~= "table" then return nil, ("%s: rules must be a list"):format(origin) end
  for i, r in ipairs(rules) do
    local where = ("%s: rules[%d]"):format(origin, i)
    if type(r) ~= "table" then return nil, where .. ": must be a table" end
    local action = r.action or r[1]
    if action ~= egress.ALLOW and action ~= egress.DENY then
      return nil, where .. ": the action must be ALLOW or DENY"
    end
    if (r.host == nil) == (r.cidr == nil) then return nil, where .. ": give either host or cidr" end
    local rule = { index = i, action = action, name = r.name, hosts = {}, cidrs = {}, ports = nil, hits = 0 }
    for _, p in ipairs(list_of(r.host)) do
      local pat, err = compile_pattern(p, where .. ".host")
      if not pat then return nil, err end
      if pat.kind == "cidr" then rule.cidrs[#rule.cidrs + 1] = pat.text else rule.hosts[#rule.hosts + 1] = pat end
    end
    for _, c in ipairs(list_of(r.cidr)) do
      if type(c) ~= "string" or not proxy.match_cidr(c) then
        return nil, where .. (".cidr: %q is not a CIDR (a.b.c.d/n or v6/n)"):format(tostring(c))
      end
      rule.cidrs[#rule.cidrs + 1] = c
    end
    if action == egress.ALLOW then
      for _, pat in ipairs(rule.hosts) do
        if pat.kind == "any" then pol.unrestricted = true end
      end
      for _, c in ipairs(rule.cidrs) do
        local bits = tonumber(c:match("/(%d+)$") or "")
        if bits and bits < (c:find(":", 1, true) and 16 or 8) then pol.unrestricted = true end
      end
    end
    if r.port ~= nil then
      rule.ports = {}
      for _, p in ipairs(list_of(r.port)) do
        if math.type(p) ~= "integer" or p < 1 or p > 65535 then
          return nil, where .. (".port: %s is not a port (1-65535)"):format(tostring(p))
        end
        rule.ports[p] = true
      end
    end
    rule.label = ("%s#%d%s"):format(name, i, r.name and (" " .. r.name) or "")
    pol.rules[#pol.rules + 1] = rule
    for _, c in ipairs(rule.cidrs) do
      local ports = {}
      for p in pairs(rule.ports or { [0] = true }) do ports[#ports + 1] = p end
      table.sort(ports)
      for _, p in ipairs(ports) do
        pol.addr_rules[#pol.addr_rules + 1] = { cidr = c, allow = action == egress.ALLOW, port = p, index = i }
      end
    end
  end
  return pol
end

local function host_matches(pat, host)
  if pat.kind == "any" then return true end
  if pat.kind == "exact" then return host == pat.name end
  local tail = host:sub(-#pat.dotted) == pat.dotted and #host > #pat.dotted
  if pat.kind == "wildcard" then return tail end
  return tail or host == pat.name -- suffix
end

--- Judges a request on its name (or IP literal) and port, before any lookup. Counts a hit
--- on the deciding rule.
---@param pol table   a compiled policy
---@param req {host: string, port: integer, ip: integer|nil}  host normalised as core.proxy does
---@return string verdict "ALLOW"|"DENY", string rule_label, table|nil rule
function egress.decide(pol, req)
  if pol.open then return egress.ALLOW, pol.name .. ":open" end
  local ip = req.ip and req.ip ~= 0
  for _, rule in ipairs(pol.rules) do
    if not rule.ports or rule.ports[req.port] then
      local hit = false
      if ip then
        for _, c in ipairs(rule.cidrs) do
          if proxy.match_cidr(c, req.host) then hit = true break end
        end
      else
        for _, pat in ipairs(rule.hosts) do
          if host_matches(pat, req.host) then hit = true break end
        end
      end
      if hit then
        rule.hits = rule.hits + 1
        return rule.action, rule.label, rule
      end
    end
  end
  return egress.DENY, pol.name .. ":default-deny"
end

--- Parses one allowlist entry ("host", "host:port", "*.example.com:443", "10.0.0.0/8",
--- "10.0.0.0/8:5432") into a rule definition.
---@return table|nil rule, string|nil err
function egress.allow_entry(s)
  if type(s) ~= "string" or s == "" then return nil, "an allowlist entry must be a non-empty string" end
  local body, port = s:match("^(.-):(%d+)$")
  if not body or body:find(":", 1, true) and not body:find("/", 1, true) then body, port = s, nil end
  local rule = { egress.ALLOW, port = port and tonumber(port) or nil, name = s }
  if body:find("/", 1, true) then rule.cidr = body else rule.host = body end
  return rule
end

--- Helpers a policy file can call (through the global `sources`): package hosts read from
--- this machine's own configuration, so that policies need not spell them.
local sources = {}

--- Hosts of the Debian/Ubuntu archives this machine's apt uses (the images are built from
--- the same sources): URIs in /etc/apt/sources.list and /etc/apt/sources.list.d/*.
function sources.apt_hosts()
  local out, seen = {}, {}
  local files = { "/etc/apt/sources.list" }
  for _, n in ipairs(fs.readdir("/etc/apt/sources.list.d") or {}) do
    if n:match("%.list$") or n:match("%.sources$") then files[#files + 1] = "/etc/apt/sources.list.d/" .. n end
  end
  for _, path in ipairs(files) do
    local s = fs.read_file(path, 0, 1 << 20) or ""
    for line in s:gmatch("[^\n]+") do
      if not line:match("^%s*#") then
        for host in line:gmatch("https?://([%w%.%-]+)") do
          if not seen[host] then seen[host] = true; out[#out + 1] = host end
        end
      end
    end
  end
  return out
end

--- Host of the npm registry: $npm_config_registry, a `registry=` line of ~/.npmrc or the
--- global npmrc, else npm's built-in default as its installed configuration defines it.
function sources.npm_hosts()
  local function host_of(url) return url and url:match("^%s*https?://([%w%.%-]+)") end
  local h = host_of(os.getenv("npm_config_registry") or os.getenv("NPM_CONFIG_REGISTRY"))
  if h then return { h } end
  local home = os.getenv("HOME") or "/root"
  for _, path in ipairs({ home .. "/.npmrc", "/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc" }) do
    local s = fs.read_file(path, 0, 1 << 16)
    h = s and host_of(s:match("\nregistry%s*=%s*(%S+)") or s:match("^registry%s*=%s*(%S+)"))
    if h then return { h } end
  end
  for _, path in ipairs({ "/usr/share/nodejs/@npmcli/config/lib/definitions/definitions.js",
      "/usr/lib/node_modules/npm/node_modules/@npmcli/config/lib/definitions/definitions.js",
      "/usr/local/lib/node_modules/npm/node_modules/@npmcli/config/lib/definitions/definitions.js" }) do
    local s = fs.read_file(path, 0, 1 << 22)
    local at = s and s:find("('registry', {", 1, true)
    h = at and host_of(s:sub(at, at + 300):match("default:%s*'([^']+)'"))
    if h then return { h } end
  end
  return {}
end
egress.sources = sources

local function policy_env(origin)
  local env = require("demesne.tools").sandbox_env(origin)
  env.ALLOW, env.DENY = egress.ALLOW, egress.DENY
  env.sources = sources
  return env
end

--- Loads one policy file's source. Returns the compiled policy or nil, err.
function egress.load_source(name, src, origin)
  local chunk, err = load(src, "@" .. origin:gsub("^embedded:", ""), "t", policy_env(origin))
  if not chunk then return nil, err end
  local ok, def = pcall(chunk)
  if not ok then return nil, tostring(def) end
  return egress.compile(name, def, origin)
end

local registry, load_errors

--- Every policy by name: built-in policies/*.lua, then $XDG_CONFIG_HOME/demesne/policies/*.lua
--- (a user file replaces a built-in of the same name), then "allowlist" from
--- DEMESNE_EGRESS_ALLOW / egress_allow and each allowlist of the config file's
--- egress_policies = { name = { "host", "host:port", "cidr", … } }. Cached; reload() drops it.
---@return table<string, table> policies, table errors  (list of "origin: message")
function egress.policies()
  if registry then return registry, load_errors end
  registry, load_errors = {}, {}
  local function add(name, pol, err)
    if pol then registry[name] = pol
    else
      load_errors[#load_errors + 1] = err
      log.error(LOGGER, "policy refused: %s", err)
    end
  end
  local runtime = require("demesne.runtime")
  for _, rel in ipairs(runtime.list("policies/")) do
    local name = rel:match("^policies/([%w_%-]+)%.lua$")
    if name then
      local src, origin = runtime.source(rel)
      add(name, egress.load_source(name, src or "", origin or rel))
    end
  end
  local dir = config.dir() .. "/policies"
  for _, n in ipairs(fs.readdir(dir) or {}) do
    local name = n:match("^([%w_%-]+)%.lua$")
    if name then
      local path = dir .. "/" .. n
      local src, err = fs.read_file(path)
      if src then add(name, egress.load_source(name, src, path)) else add(name, nil, path .. ": " .. tostring(err)) end
    end
  end
  local function allowlist(name, entries, origin)
    local rules = {}
    for _, e in ipairs(entries) do
      local r, err = egress.allow_entry(e)
      if not r then return nil, origin .. ": " .. err end
      rules[#rules + 1] = r
    end
    return egress.compile(name, { description = "allowlist from " .. origin, rules = rules }, origin)
  end
  local d = config.describe().egress_allow
  if d and #d.value > 0 then add("allowlist", allowlist("allowlist", d.value, d.origin)) end
  local extra = config.get("egress_policies")
  if type(extra) == "table" then
    for name, entries in pairs(extra) do
      if type(name) == "string" and type(entries) == "table" then
        add(name, allowlist(name, entries, config.dir() .. "/config.lua egress_policies." .. name))
      end
    end
  end
  return registry, load_errors
end

--- Forgets the loaded policies (tests, after changing files or the environment).
function egress.reload() registry, load_errors = nil, nil end

--- The policy called `name`, or nil and a message listing the known ones.
---@return table|nil policy, string|nil err
function egress.policy(name)
  local all = egress.policies()
  if all[name] then return all[name] end
  local names = {}
  for n in pairs(all) do names[#names + 1] = n end
  table.sort(names)
  if name == "allowlist" then
    return nil, ("egress: the allowlist policy needs hosts: set DEMESNE_EGRESS_ALLOW (or egress_allow in config.lua); known now: %s")
      :format(table.concat(names, ", "))
  end
  return nil, ("egress: no policy %q (known: %s)"):format(tostring(name), table.concat(names, ", "))
end

--- Whether the policy called `name` gives open egress (its `unrestricted` property; see
--- the top of this file). An unknown name counts as open: a check that cannot tell refuses.
---@param name string
---@return boolean
function egress.is_unrestricted(name)
  local pol = egress.policy(name)
  return pol == nil or pol.unrestricted == true
end

--- Picks the policy for a new sandbox: `name` or the default, refusing an unrestricted
--- one (open egress, whatever its name) when host inputs are mounted. Returns the policy
--- or nil, err.
---@param name string|nil
---@param has_inputs boolean
function egress.select(name, has_inputs)
  name = name or config.get("egress_default") or "package-managers"
  local pol, err = egress.policy(name)
  if not pol then return nil, err end
  if pol.unrestricted and has_inputs then
    return nil, ("egress: %q is not permitted for a call that mounts files or directories: it gives open egress "
      .. "(%s), and host inputs plus open egress is the exfiltration shape; use a restricted policy"):format(name,
      pol.open and "a bridge network" or "an ALLOW rule for any host or a wide address block")
  end
  return pol
end

--------------------------------------------------------------------------------------------
-- Inside the sandbox

local TELEMETRY_OFF = {
  DO_NOT_TRACK = "1", WRANGLER_SEND_METRICS = "false", WRANGLER_SEND_ERROR_REPORTS = "false",
  NEXT_TELEMETRY_DISABLED = "1", NUXT_TELEMETRY_DISABLED = "1", NG_CLI_ANALYTICS = "false",
  STORYBOOK_DISABLE_TELEMETRY = "1", VERCEL_TELEMETRY_DISABLED = "1", YARN_ENABLE_TELEMETRY = "0",
  NO_UPDATE_NOTIFIER = "1", npm_config_fund = "false", npm_config_update_notifier = "false",
  DISABLE_OPENCOLLECTIVE = "true", PIP_DISABLE_PIP_VERSION_CHECK = "1", PIP_NO_INPUT = "1",
  CHECKPOINT_DISABLE = "1", NX_NO_CLOUD = "true", DOTNET_CLI_TELEMETRY_OPTOUT = "1",
  HOMEBREW_NO_ANALYTICS = "1", GATSBY_TELEMETRY_DISABLED = "1", ASTRO_TELEMETRY_DISABLED = "1",
}

--- Environment variables for a sandbox under `pol`: the proxy for every common client
--- (curl, pip, npm, apt, Go, Python, Node…) and build-tool telemetry turned off. The
--- variables only help tools find the proxy; enforcement is the missing network.
---@param pol table|nil  a compiled policy (nil or open: telemetry only)
---@return table<string, string>
function egress.env(pol)
  local env = {}
  for k, v in pairs(TELEMETRY_OFF) do env[k] = v end
  if pol and pol.open then return env end
  local url = ("http://127.0.0.1:%d"):format(egress.PORT)
  for _, k in ipairs({ "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
      "npm_config_proxy", "npm_config_https_proxy", "PIP_PROXY", "YARN_HTTP_PROXY", "YARN_HTTPS_PROXY" }) do
    env[k] = url
  end
  env.NO_PROXY, env.no_proxy = "localhost,127.0.0.1,::1", "localhost,127.0.0.1,::1"
  env.GOPROXY = "https://proxy.golang.org"
  -- apt reads http_proxy/https_proxy itself; APT_CONFIG adds Acquire::*::Proxy for tools
  -- that clear the environment (the file is written by egress.start)
  env.APT_CONFIG = "/.demesne/run/apt.conf"
  return env
end

--- The demesne-init options that start the relay of the proxy port ({} for open egress).
---@param pol table
---@return string[]
function egress.relay_args(pol)
  if pol.open then return {} end
  return { "--relay", ("%d=%s"):format(egress.PORT, egress.SANDBOX_SOCKET) }
end

--------------------------------------------------------------------------------------------
-- The per-sandbox listener

local active = {} -- run_id -> handle

local function iso_now()
  local t = loop.time()
  return os.date("!%Y-%m-%dT%H:%M:%S", math.floor(t)) .. (".%03dZ"):format(math.floor((t % 1) * 1000))
end

local Handle = {}
Handle.__index = Handle

--- Starts the proxy of one sandbox: listens on <run_dir>/egress.sock and appends to
--- <output_dir>/egress.jsonl. `o`: {run_id, run_dir, output_dir, policy (or egress) = compiled policy}.
--- The listener admits at most egress_max_connections connections whose descriptors stay
--- within sandbox_max_descriptors (see core/proxy.h); a connection over either ceiling is
--- answered 503 naming it, and egress.jsonl gets a "ceiling" line (at most one a second,
--- with the count of refusals since the last one).
--- Returns a handle (closing it — or egress.stop — stops the listener and waits for its
--- connections to end), or a handle that does nothing for open egress; nil, err on failure.
function egress.start(o)
  local pol = o.policy or o.egress
  local h = setmetatable({ run_id = o.run_id, policy = pol, pending = {}, closed = false }, Handle)
  if pol.open then h.closed = true return h end
  -- the output and run folders are the sandbox's to write (and it runs already after a
  -- server restart): every file in them is reached through a held folder, confined (no
  -- link, no FIFO, never blocking; core.fs.dir)
  local out, oerr, ocode = fs.opendir(o.output_dir)
  if not out then return nil, "egress: " .. tostring(oerr), ocode end
  local file, ferr, fcode = out:open("egress.jsonl", "a")
  out:close()
  if not file then return nil, "egress: " .. tostring(ferr), fcode end
  h.file = file
  local run, rerr, rcode = fs.opendir(o.run_dir)
  if not run then
    file:close()
    return nil, "egress: " .. tostring(rerr), rcode
  end
  local _ <close> = run
  run:write_atomic("apt.conf", ("Acquire::http::Proxy \"http://127.0.0.1:%d\";\n"
    .. "Acquire::https::Proxy \"http://127.0.0.1:%d\";\n"):format(egress.PORT, egress.PORT))
  local path = o.run_dir .. "/" .. egress.SOCKET_NAME
  local resolver = config.get("egress_resolver")
  local listener, err, code = proxy.listen(path, { rules = pol.addr_rules, resolver = resolver ~= "" and resolver or nil,
      max_conns = math.max(1, math.floor(config.get("egress_max_connections"))),
      max_fds = math.max(1, math.floor(config.get("sandbox_max_descriptors"))),
      ceiling_hint = "(egress_max_connections / sandbox_max_descriptors in the demesne configuration)",
      on_refused = function(info) h:on_refused(info) end },
    function(conn, req) h:on_request(conn, req) end,
    function(conn, res) h:on_done(conn, res) end)
  if not listener then
    file:close()
    return nil, ("egress: cannot listen on %s: %s"):format(path, tostring(err)), code
  end
  run:chmod(egress.SOCKET_NAME, 438) -- 0666: whatever user the image runs as can connect
  h.listener = listener
  active[o.run_id] = h
  return h
end

--- core.proxy's on_request: judges the name and answers allow or deny.
---@param conn userdata  a core.proxy.conn
---@param req table      {method, host, port, ip, form, path, host_header}
function Handle:on_request(conn, req)
  local verdict, label = egress.decide(self.policy, req)
  self.pending[conn] = { req = req, verdict = verdict, rule = label, time = iso_now() }
  if verdict == egress.ALLOW then conn:allow() else conn:deny(("denied by egress policy %s (%s)"):format(self.policy.name, label)) end
end

--- core.proxy's on_done: appends the connection's line to egress.jsonl.
---@param conn userdata
---@param res table  {bytes_up, bytes_down, status, denied, rule, address, error, code}
function Handle:on_done(conn, res)
  local p = self.pending[conn]
  self.pending[conn] = nil
  if not p then return end
  local allowed = p.verdict == egress.ALLOW and not res.denied
  local rule = p.rule
  if res.code == "ELIMIT" then
    allowed, rule = false, "ceiling" -- a descriptor ceiling stopped it while it dialled
  elseif p.verdict == egress.ALLOW and res.denied then
    local r = res.rule and self.policy.rules[res.rule]
    rule = r and r.label or ("address:" .. tostring((res.error or ""):match("is (.*)$") or "refused"))
  end
  local rec = {
    time = p.time, sandbox = self.run_id, method = p.req.method, host = p.req.host, port = p.req.port,
    verdict = allowed and "allow" or "deny", rule = rule, status = res.status,
    bytes_up = res.bytes_up, bytes_down = res.bytes_down, address = res.address, error = res.error,
  }
  if p.req.form ~= "connect" then rec.path = p.req.path end
  if self.file then
    local ok, line = pcall(json.encode, rec)
    if ok then self.file:write(line .. "\n") end
  end
end

-- Writes the pending "ceiling" line: the refusals since the last one, and why.
function Handle:flush_refusals()
  local r = self.refusals
  if not r or r.count == 0 or not self.file then return end
  local ok, line = pcall(json.encode, { time = iso_now(), sandbox = self.run_id, verdict = "deny", rule = "ceiling",
    status = 503, refused = r.count, limit = r.limit, error = r.message })
  if ok then self.file:write(line .. "\n") end
  r.count, r.last = 0, loop.now()
end

--- core.proxy's on_refused: a connection over a ceiling. Counted, and written to
--- egress.jsonl at most once a second (a flood must not become a flood of lines).
---@param info table  {limit, active, ceiling, answered, message}
function Handle:on_refused(info)
  local r = self.refusals or { count = 0, last = -math.huge }
  self.refusals = r
  r.count, r.limit, r.message = r.count + 1, info.limit, info.message
  if r.count == 1 and r.total == nil then
    log.warning(LOGGER, "sandbox %s: egress connection refused: %s", self.run_id, tostring(info.message))
  end
  r.total = (r.total or 0) + 1
  if loop.now() - r.last >= 1000 then self:flush_refusals() end
end

--- Stops the listener; inside a task, waits until every connection has ended (so
--- egress.jsonl is complete). Idempotent.
function Handle:stop()
  if self.closed then return end
  self.closed = true
  if active[self.run_id] == self then active[self.run_id] = nil end
  local async = require("demesne.async")
  local listener = self.listener
  self.listener = nil
  if listener then
    local ev = async.event()
    listener:close(function() ev.set() end)
    if async.current() then
      local ok, err = pcall(async.timeout, 5000, ev.wait)
      if not ok and err == async.CANCELLED then error(err, 0) end
    end
  end
  self:flush_refusals()
  if self.file then self.file:close() self.file = nil end
end
Handle.__close = Handle.stop

--- The live handle of a sandbox, or nil.
function egress.get(run_id) return active[run_id] end

--- Stops the proxy of a sandbox if one runs. Idempotent.
function egress.stop(run_id)
  local h = active[run_id]
  if h then h:stop() end
end

--- Makes sure a persistent sandbox has its proxy (after a server restart the listener is
--- gone while the container lives on). Returns the handle, or nil, err.
---@param run_id string
---@param run_dir string
---@param output_dir string
---@param policy_name string
function egress.ensure(run_id, run_dir, output_dir, policy_name)
  if active[run_id] then return active[run_id] end
  local pol, err = egress.policy(policy_name)
  if not pol then return nil, err end
  if pol.open then return setmetatable({ closed = true }, Handle) end
  log.info(LOGGER, "re-attaching the proxy of sandbox %s (policy %s)", run_id, policy_name)
  return egress.start({ run_id = run_id, run_dir = run_dir, output_dir = output_dir, policy = pol })
end

return egress
