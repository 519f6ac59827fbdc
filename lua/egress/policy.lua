-- Egress policies: compiling what a policy file returns, judging a request by it, and
-- loading the policies (built-in policies/*.lua, the user's, allowlists from config).
--
-- A policy file (policies/*.lua, then $XDG_CONFIG_HOME/demesne/policies/*.lua) returns
--
--   return {
--     description = "…",
--     rules = {
--       { ALLOW, host = { "pypi.org", "files.pythonhosted.org" }, port = 443, name = "pypi" },
--       { DENY,  host = "*.internal.example" },
--       { ALLOW, cidr = "127.0.0.0/8", port = 8080 },
--       { ASK,   host = "*.example.org", port = 443 },
--     },
--     ask = { "*" },            -- optional: names no rule decided are asked about
--     extends = "package-managers", -- optional: that policy's rules come first
--   }
--
-- Rules are tried in order; the first rule that matches decides; nothing matches → deny.
-- A rule has an action (ALLOW, DENY or ASK, first element or `action`), and either `host`
-- patterns or `cidr` blocks (one or a list), optionally `port` (one or a list) and `name`.
-- ASK (host patterns only) neither allows nor denies: the connection is held while a person
-- decides (lua/egress/ask.lua). The `ask` field is a list of allowlist entries ("host",
-- "host:port", patterns) that become ASK rules after every rule of the file; `extends`
-- names a policy whose rules (not its `ask`) go before this file's, resolved when the
-- policies load (policy.policies), one level deep.
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
-- the exfiltration shape: policy.select refuses it for calls that mount files, and
-- sandbox_upload for sandboxes created with it.
local config = require("demesne.config")
local fs = require("core.fs")
local plugins = require("demesne.plugins")
local proxy = require("core.proxy")

local policy = {}

local LOGGER = "demesne.egress"

policy.ALLOW, policy.DENY, policy.ASK = "ALLOW", "DENY", "ASK"

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
function policy.compile(name, def, origin)
  origin = origin or name
  if type(def) ~= "table" then return nil, ("%s: a policy file must return a table"):format(origin) end
  local pol = { name = name, description = def.description or "", origin = origin, open = def.open == true,
    unrestricted = def.open == true or def.unrestricted == true, rules = {}, addr_rules = {}, def = def,
    asks = false }
  if pol.open then return pol end
  if def.extends ~= nil and (type(def.extends) ~= "string" or def.extends == "") then
    return nil, ("%s: extends must be the name of a policy"):format(origin)
  end
  pol.extends = def.extends
  local rules = def.rules or def
  if type(rules) ~= "table" then return nil, ("%s: rules must be a list"):format(origin) end
  if def.ask ~= nil then
    if type(def.ask) ~= "table" then return nil, ("%s: ask must be a list of host patterns"):format(origin) end
    local all = {}
    for _, r in ipairs(rules) do all[#all + 1] = r end
    for i, e in ipairs(def.ask) do
      local r, err = policy.allow_entry(e)
      if not r then return nil, ("%s: ask[%d]: %s"):format(origin, i, err) end
      if r.cidr then return nil, ("%s: ask[%d]: %q: ask takes host names and patterns, not addresses"):format(origin, i, e) end
      r[1], r.name = policy.ASK, "ask " .. e
      all[#all + 1] = r
    end
    rules = all
  end
  for i, r in ipairs(rules) do
    local where = ("%s: rules[%d]"):format(origin, i)
    if type(r) ~= "table" then return nil, where .. ": must be a table" end
    local action = r.action or r[1]
    if action ~= policy.ALLOW and action ~= policy.DENY and action ~= policy.ASK then
      return nil, where .. ": the action must be ALLOW, DENY or ASK"
    end
    if (r.host == nil) == (r.cidr == nil) then return nil, where .. ": give either host or cidr" end
    if action == policy.ASK and r.cidr ~= nil then
      return nil, where .. ": ASK takes host names and patterns, not cidr (an address is never asked about)"
    end
    if action == policy.ASK then pol.asks = true end
    local rule = { index = i, action = action, name = r.name, hosts = {}, cidrs = {}, ports = nil, hits = 0 }
    for _, p in ipairs(list_of(r.host)) do
      local pat, err = compile_pattern(p, where .. ".host")
      if not pat then return nil, err end
      if pat.kind == "cidr" and action == policy.ASK then
        return nil, where .. (".host: %q: ASK takes host names and patterns, not addresses"):format(p)
      end
      if pat.kind == "cidr" then rule.cidrs[#rule.cidrs + 1] = pat.text else rule.hosts[#rule.hosts + 1] = pat end
    end
    for _, c in ipairs(list_of(r.cidr)) do
      if type(c) ~= "string" or not proxy.match_cidr(c) then
        return nil, where .. (".cidr: %q is not a CIDR (a.b.c.d/n or v6/n)"):format(tostring(c))
      end
      rule.cidrs[#rule.cidrs + 1] = c
    end
    if action == policy.ALLOW then
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
        pol.addr_rules[#pol.addr_rules + 1] = { cidr = c, allow = action == policy.ALLOW, port = p, index = i }
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
---@return string verdict "ALLOW"|"DENY"|"ASK", string rule_label, table|nil rule
function policy.decide(pol, req)
  if pol.open then return policy.ALLOW, pol.name .. ":open" end
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
  return policy.DENY, pol.name .. ":default-deny"
end

--- Resolves `extends`: compiles `pol` again with the rules of `base` (a compiled policy, or
--- nil when there is none of that name) before its own. One level deep: a base that extends
--- another, or gives open egress, is refused.
---@param pol table   a compiled policy with pol.extends
---@param base table|nil
---@return table|nil policy, string|nil err
function policy.extend(pol, base)
  local where = ("%s: extends %q"):format(pol.origin, pol.extends)
  if not base then return nil, where .. ": there is no such policy" end
  if base.extends then return nil, where .. (": it extends %q itself (one level only)"):format(base.extends) end
  if base.open then return nil, where .. ": it is open (a bridge network): there are no rules to extend" end
  local def = {}
  for k, v in pairs(pol.def) do def[k] = v end
  local rules = {}
  for _, r in ipairs(base.def.rules or base.def) do rules[#rules + 1] = r end
  for _, r in ipairs(pol.def.rules or pol.def) do rules[#rules + 1] = r end
  def.rules, def.extends = rules, nil
  def.unrestricted = pol.def.unrestricted or base.def.unrestricted
  local out, err = policy.compile(pol.name, def, pol.origin)
  if not out then return nil, err end
  out.extends = pol.extends
  return out
end

--- Parses one allowlist entry ("host", "host:port", "*.example.com:443", "10.0.0.0/8",
--- "10.0.0.0/8:5432") into a rule definition.
---@return table|nil rule, string|nil err
---@param s string
function policy.allow_entry(s)
  if type(s) ~= "string" or s == "" then return nil, "an allowlist entry must be a non-empty string" end
  local body, port = s:match("^(.-):(%d+)$")
  if not body or body:find(":", 1, true) and not body:find("/", 1, true) then body, port = s, nil end
  local rule = { policy.ALLOW, port = port and tonumber(port) or nil, name = s }
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
policy.sources = sources

--- The runtime API of policy files: the modules a policy file may require (a policy is
--- data: its rules). The globals ALLOW, DENY, ASK and `sources` come with the environment.
policy.API = {
  ["demesne.json"] = { "encode", "decode", "array", "is_array", "null" },
}

--- The environment a policy file runs in (demesne.plugins): the safe globals, ALLOW, DENY,
--- ASK and `sources` (policy.sources), and `require` of policy.API only.
---@param origin string
---@return table env
function policy.environment(origin)
  local env = plugins.environment(origin, { kind = "policy", kinds = "policies", api = policy.API, logger = LOGGER })
  env.ALLOW, env.DENY, env.ASK = policy.ALLOW, policy.DENY, policy.ASK
  env.sources = sources
  return env
end

-- The policy kind of plugin: a file's name (without .lua) is the policy's name.
local function kind(opts)
  return {
    kind = "policy", kinds = "policies", logger = LOGGER, quiet = opts.quiet,
    builtin = "policies/", user_dir = opts.user_dir,
    env = policy.environment,
    check = function(def, file)
      if not file.name:match("^[%w_%-]+$") then
        return nil, "a policy's file name must be letters, digits, '_' and '-' (it is the policy's name)"
      end
      local pol, err = policy.compile(file.name, def, file.origin)
      if not pol then return nil, (err:gsub("^" .. file.origin:gsub("%p", "%%%0") .. ": ", "")) end
      return pol
    end,
  }
end

--- Loads one policy file's source. Returns the compiled policy or nil, err.
---@param name string
---@param src string
---@param origin string
---@return table|nil policy, string|nil err
function policy.load_source(name, src, origin)
  return plugins.load_source(kind({}), src, { name = name, origin = origin })
end

local registry, load_errors -- the loaded policies (policy.policies) and the files refused

--- Every policy by name: built-in policies/*.lua, then $XDG_CONFIG_HOME/demesne/policies/*.lua
--- (a user file replaces a built-in of the same name), then "allowlist" from
--- DEMESNE_EGRESS_ALLOW / egress_allow and each allowlist of the config file's
--- egress_policies = { name = { "host", "host:port", "cidr", … } }. Cached; reload() drops it.
---@return table<string, table> policies, {origin: string, message: string}[] errors
function policy.policies()
  if registry then return registry, load_errors end
  local set = plugins.load(kind({ user_dir = config.dir() .. "/policies" }))
  registry, load_errors = set.by_name, set.errors
  local function add(name, origin, pol, err)
    if pol then registry[name] = pol else set:refuse(origin, err) end
  end
  local extending = {}
  for name, pol in pairs(registry) do
    if pol.extends then extending[#extending + 1] = name end
  end
  table.sort(extending)
  for _, name in ipairs(extending) do
    local pol = registry[name]
    registry[name] = nil
    add(name, pol.origin, policy.extend(pol, registry[pol.extends]))
  end
  local function allowlist(name, entries, origin)
    local rules = {}
    for _, e in ipairs(entries) do
      local r, err = policy.allow_entry(e)
      if not r then return nil, origin .. ": " .. err end
      rules[#rules + 1] = r
    end
    return policy.compile(name, { description = "allowlist from " .. origin, rules = rules }, origin)
  end
  local d = config.describe().egress_allow
  if d and #d.value > 0 then add("allowlist", d.origin, allowlist("allowlist", d.value, d.origin)) end
  local extra = config.get("egress_policies")
  if type(extra) == "table" then
    for name, entries in pairs(extra) do
      if type(name) == "string" and type(entries) == "table" then
        local origin = config.dir() .. "/config.lua egress_policies." .. name
        add(name, origin, allowlist(name, entries, origin))
      end
    end
  end
  return registry, load_errors
end

--- Forgets the loaded policies (tests, after changing files or the environment).
function policy.reload() registry, load_errors = nil, nil end

--- The policy called `name`, or nil and a message listing the known ones.
---@return table|nil policy, string|nil err
---@param name string
function policy.policy(name)
  local all = policy.policies()
  if all[name] then return all[name] end
  local names = {}
  for n in pairs(all) do names[#names + 1] = n end
  table.sort(names)
  if name == "allowlist" then
    return nil, ("egress: the allowlist policy needs hosts: set DEMESNE_EGRESS_ALLOW (or egress_allow in config.lua); "
      .. "known now: %s")
      :format(table.concat(names, ", "))
  end
  return nil, ("egress: no policy %q (known: %s)"):format(tostring(name), table.concat(names, ", "))
end

--- Whether the policy called `name` gives open egress (its `unrestricted` property; see
--- the top of this file). An unknown name counts as open: a check that cannot tell refuses.
---@param name string
---@return boolean
function policy.is_unrestricted(name)
  local pol = policy.policy(name)
  return pol == nil or pol.unrestricted == true
end

--- Picks the policy for a new sandbox: `name` or the default, refusing an unrestricted
--- one (open egress, whatever its name) when host inputs are mounted. Returns the policy
--- or nil, err.
---@param name string|nil
---@param has_inputs boolean
function policy.select(name, has_inputs)
  name = name or config.get("egress_default") or "package-managers"
  local pol, err = policy.policy(name)
  if not pol then return nil, err end
  if pol.unrestricted and has_inputs then
    return nil, ("egress: %q is not permitted for a call that mounts files or directories: it gives open egress "
      .. "(%s), and host inputs plus open egress is the exfiltration shape; use a restricted policy"):format(name,
      pol.open and "a bridge network" or "an ALLOW rule for any host or a wide address block")
  end
  return pol
end

return policy
