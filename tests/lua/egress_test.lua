-- Egress policies (matching, first decisive rule wins, hit counts, the cases C17 and C18 on
-- the names the proxy would hand over) and one sandbox proxy end to end on loopback:
-- core.proxy listening on a unix socket, verdicts from demesne.egress, egress.jsonl lines.
local egress = require("demesne.egress")
local egress_policy = require("demesne.egress.policy")
local json = require("demesne.json")
local async = require("demesne.async")
local proxy = require("core.proxy")
local stream = require("core.stream")
local fs = require("core.fs")
local loop = require("core.loop")

local T = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local function tmpdir()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-egress-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

local function policy(rules, name)
  return assert(egress_policy.compile(name or "t", { rules = rules }))
end

-- What the proxy hands Lua for a URL or HOST[:PORT] typed in the sandbox.
local function req_of(target)
  local scheme, rest = target:match("^(%a+)://(.*)$")
  local default = scheme == "http" and 80 or 443
  local host, port, ip = assert(proxy.split_authority((rest or target):match("^[^/]*"), default))
  return { host = host, port = port, ip = ip }
end

local TEST_RULES = {
  { egress_policy.DENY, host = "blocked.allowed.test", name = "carve-out" },
  { egress_policy.ALLOW, host = { "allowed.test", "*.allowed.test" }, port = { 80, 443 }, name = "allowed" },
  { egress_policy.DENY, host = ".denied.test", name = "denied" },
  { egress_policy.ALLOW, cidr = "127.0.0.0/8", port = 8080, name = "loopback" },
}

function T.matching_exact_suffix_wildcard_port_cidr(t)
  local p = policy({
    { egress_policy.ALLOW, host = "exact.test" },
    { egress_policy.ALLOW, host = ".suffix.test" },
    { egress_policy.ALLOW, host = "*.wild.test", port = 443 },
    { egress_policy.ALLOW, cidr = { "10.1.0.0/16", "fd00::/8" } },
  })
  local function v(target) return (egress_policy.decide(p, req_of(target))) end
  t:eq(v("exact.test"), "ALLOW", "exact")
  t:eq(v("a.exact.test"), "DENY", "exact is not a suffix")
  t:eq(v("suffix.test"), "ALLOW", "suffix: the domain")
  t:eq(v("a.b.suffix.test"), "ALLOW", "suffix: a subdomain")
  t:eq(v("xsuffix.test"), "DENY", "suffix on whole labels")
  t:eq(v("a.wild.test"), "ALLOW", "wildcard")
  t:eq(v("wild.test"), "DENY", "wildcard is not the domain")
  t:eq(v("http://a.wild.test"), "DENY", "wildcard rule with port 443 only")
  t:eq(v("10.1.2.3:22"), "ALLOW", "cidr")
  t:eq(v("10.2.0.1"), "DENY", "outside the cidr")
  t:eq(v("[fd00::1]:8080"), "ALLOW", "v6 cidr")
  t:eq(v("nothing.test"), "DENY", "no match: deny")
end

function T.first_decisive_rule_wins_and_counts_hits(t)
  local p = policy(TEST_RULES)
  local verdict, label = egress_policy.decide(p, req_of("https://blocked.allowed.test"))
  t:eq(verdict, "DENY", "the earlier DENY wins over the later ALLOW")
  t:eq(label, "t#1 carve-out", "label")
  verdict, label = egress_policy.decide(p, req_of("https://x.allowed.test"))
  t:eq({ verdict, label }, { "ALLOW", "t#2 allowed" }, "the next rule decides")
  egress_policy.decide(p, req_of("https://allowed.test"))
  egress_policy.decide(p, req_of("http://allowed.test"))
  verdict, label = egress_policy.decide(p, req_of("https://nothing.test"))
  t:eq(verdict, "DENY", "nothing matched: deny")
  t:eq(label, "t:default-deny", "default")
  t:eq({ p.rules[1].hits, p.rules[2].hits, p.rules[3].hits, p.rules[4].hits }, { 1, 3, 0, 0 }, "hits")
end

function T.C17_every_spelling_of_a_denied_name_is_denied(t)
  local p = policy(TEST_RULES)
  local spellings = { "https://denied.test", "http://denied.test", "denied.test:8443", "DENIED.TEST",
    "denied.test.", "allowed.test.denied.test", "denied-allowed.test" }
  for round = 1, 50 do
    for _, s in ipairs(spellings) do
      local verdict, label = egress_policy.decide(p, req_of(s))
      if verdict ~= "DENY" then error(("round %d: %s was allowed by %s"):format(round, s, label)) end
    end
  end
  t:eq(p.rules[2].hits, 0, "the allow rule never matched")
end

function T.C18_allowed_spellings_succeed(t)
  local p = policy(TEST_RULES)
  for _, s in ipairs({ "https://allowed.test", "https://allowed.test:443", "https://sub.allowed.test",
      "http://allowed.test:80", "ALLOWED.TEST.", "https://a.b.allowed.test" }) do
    t:eq((egress_policy.decide(p, req_of(s))), "ALLOW", s)
  end
end

function T.ip_literals_need_a_rule_that_names_them(t)
  local p = policy({ { egress_policy.ALLOW, host = "*" } })
  for _, s in ipairs({ "1.2.3.4", "http://127.0.0.1", "[::1]:443", "2130706433:80", "0x7f.1", "169.254.169.254" }) do
    t:eq((egress_policy.decide(p, req_of(s))), "DENY", s .. " under host = '*'")
  end
  t:eq((egress_policy.decide(p, req_of("example.test"))), "ALLOW", "names match '*'")
  local q = policy({ { egress_policy.ALLOW, host = "127.0.0.1", port = 8080 } })
  t:eq((egress_policy.decide(q, req_of("127.1:8080"))), "ALLOW", "an IP host rule is a /32")
  t:eq(q.addr_rules, { { cidr = "127.0.0.1/32", allow = true, port = 8080, index = 1 } }, "address rules for C")
end

function T.bad_policies_are_refused_with_their_field(t)
  local cases = {
    { { { "MAYBE", host = "a" } }, "ALLOW, DENY or ASK" },
    { { { egress_policy.ALLOW } }, "either host or cidr" },
    { { { egress_policy.ALLOW, host = "a", cidr = "10.0.0.0/8" } }, "either host or cidr" },
    { { { egress_policy.ALLOW, host = "a*.test" } }, "only as a whole first label" },
    { { { egress_policy.ALLOW, host = "a b" } }, "invalid character" },
    { { { egress_policy.ALLOW, cidr = "10.0.0.0/99" } }, "not a CIDR" },
    { { { egress_policy.ALLOW, host = "a", port = 70000 } }, "not a port" },
  }
  for _, c in ipairs(cases) do
    local p, err = egress_policy.compile("bad", { rules = c[1] })
    t:eq(p, nil, c[2])
    t:match(err, c[2], "message")
  end
end

function T.policy_files_load_without_raw_core(t)
  local p, err = egress_policy.load_source("x", 'local fs = require("core.fs") return { rules = {} }', "x.lua")
  t:eq(p, nil, "core.* refused")
  t:match(err, "not allowed", "why")
  p = assert(egress_policy.load_source("y", 'return { rules = { { ALLOW, host = sources and "ok.test" } } }', "y.lua"))
  t:eq((egress_policy.decide(p, req_of("ok.test"))), "ALLOW", "ALLOW, DENY and sources are there")
end

function T.builtin_policies(t)
  egress_policy.reload()
  local pm = assert(egress_policy.policy("package-managers"))
  t:eq((egress_policy.decide(pm, req_of("https://pypi.org"))), "ALLOW", "pypi")
  t:eq((egress_policy.decide(pm, req_of("https://files.pythonhosted.org"))), "ALLOW", "pypi files")
  t:eq((egress_policy.decide(pm, req_of("https://proxy.golang.org"))), "ALLOW", "go proxy")
  t:eq((egress_policy.decide(pm, req_of("https://sum.golang.org"))), "ALLOW", "go sumdb")
  t:eq((egress_policy.decide(pm, req_of("https://static.crates.io"))), "ALLOW", "crates")
  t:eq((egress_policy.decide(pm, req_of("https://rubygems.org"))), "ALLOW", "rubygems")
  t:eq((egress_policy.decide(pm, req_of("http://us.archive.ubuntu.com"))), "ALLOW", "ubuntu mirror")
  t:eq((egress_policy.decide(pm, req_of("http://pypi.org"))), "DENY", "pypi over port 80")
  t:eq((egress_policy.decide(pm, req_of("https://pypi.org.evil.test"))), "DENY", "look-alike")
  t:eq((egress_policy.decide(pm, req_of("https://169.254.169.254"))), "DENY", "metadata")
  local none = assert(egress_policy.policy("none"))
  t:eq((egress_policy.decide(none, req_of("https://pypi.org"))), "DENY", "none")
  t:ok(assert(egress_policy.policy("open")).open, "open")
  local sel, err = egress_policy.select("open", true)
  t:eq(sel, nil, "open with inputs")
  t:match(err, "exfiltration", "why")
  t:ok(egress_policy.select(nil, true), "the default is fine with inputs")
  t:eq(egress_policy.select(nil, false).name, "package-managers", "default")
end

function T.allowlist_entries(t)
  local p = policy({
    assert(egress_policy.allow_entry("a.test")), assert(egress_policy.allow_entry("*.b.test:8443")),
    assert(egress_policy.allow_entry("10.0.0.0/8:5432")), assert(egress_policy.allow_entry("fd00::1")),
  })
  t:eq((egress_policy.decide(p, req_of("a.test:1"))), "ALLOW", "host, any port")
  t:eq((egress_policy.decide(p, req_of("x.b.test:8443"))), "ALLOW", "wildcard with port")
  t:eq((egress_policy.decide(p, req_of("x.b.test:443"))), "DENY", "other port")
  t:eq((egress_policy.decide(p, req_of("10.9.9.9:5432"))), "ALLOW", "cidr with port")
  t:eq((egress_policy.decide(p, req_of("[fd00::1]:80"))), "ALLOW", "v6 literal")
end

function T.environment_points_tools_at_the_proxy(t)
  local env = egress.env(assert(egress_policy.policy("none")))
  t:eq(env.HTTPS_PROXY, "http://127.0.0.1:3128", "HTTPS_PROXY")
  t:eq(env.http_proxy, "http://127.0.0.1:3128", "http_proxy")
  t:eq(env.no_proxy, "localhost,127.0.0.1,::1", "no_proxy")
  t:eq(env.DO_NOT_TRACK, "1", "telemetry off")
  t:eq(egress.env(assert(egress_policy.policy("open"))).HTTPS_PROXY, nil, "open: no proxy")
  t:eq(egress.relay_args(assert(egress_policy.policy("none"))), { "--relay", "3128=/.demesne/run/egress.sock" }, "relay")
end

-- One exchange over the sandbox's socket: sends `req`, returns everything until EOF.
local function exchange(path, req)
  local c = assert(async.wrap(stream.connect_unix)(path))
  local got, done = {}, async.event()
  c:read_start(function(d)
    if d then
      got[#got + 1] = d
      if d:find("200 Connection established", 1, true) then c:write("ping") end
    else
      done.set()
    end
  end)
  c:write(req)
  async.timeout(5000, done.wait)
  c:close()
  return table.concat(got)
end

function T.sandbox_proxy_end_to_end(t)
  local dir <close> = tmpdir()
  fs.mkdir_p(dir.path .. "/run")
  fs.mkdir_p(dir.path .. "/out")
  -- an upstream on loopback that answers "pong" to "ping" and closes
  local upstream, port = assert(stream.listen_tcp("127.0.0.1", 0, function(c)
    c:read_start(function(d)
      if d and d:find("ping", 1, true) then c:write("pong", function() c:close() end)
      elseif d and d:find("\r\n\r\n", 1, true) then
        c:write("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", function() c:close() end)
      elseif not d then c:close() end
    end)
  end))
  local p = policy({
    { egress_policy.DENY, host = ".denied.test" },
    { egress_policy.ALLOW, cidr = "127.0.0.1/32", port = port, name = "upstream" },
  }, "e2e")
  local h = assert(egress.start({ run_id = "r1", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out", policy = p }))
  local sock = dir.path .. "/run/egress.sock"
  t:eq(fs.stat(sock).type, "socket", "listening")
  local out = exchange(sock, ("CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n"):format(port))
  t:match(out, "^HTTP/1.1 200 Connection established\r\n\r\npong$", "tunnel")
  out = exchange(sock, ("GET http://127.0.0.1:%d/x HTTP/1.1\r\nHost: y\r\n\r\n"):format(port))
  t:match(out, "^HTTP/1.1 200 OK.*ok$", "plain")
  out = exchange(sock, "CONNECT exfil-1.denied.test:443 HTTP/1.1\r\n\r\n")
  t:match(out, "^HTTP/1.1 403 Forbidden", "denied")
  t:match(out, "e2e#1", "the rule is named")
  out = exchange(sock, "CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n")
  t:match(out, "^HTTP/1.1 403", "loopback on another port: no rule allows it")
  h:stop()
  upstream:close()
  t:eq(fs.stat(sock), nil, "socket removed")
  local lines = {}
  for line in (fs.read_file(dir.path .. "/out/egress.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(line) end
  t:eq(#lines, 4, "one line per connection")
  t:eq({ lines[1].method, lines[1].verdict, lines[1].rule, lines[1].status, lines[1].bytes_up, lines[1].bytes_down },
    { "CONNECT", "allow", "e2e#2 upstream", 200, 4, 4 }, "tunnel line")
  t:eq({ lines[2].method, lines[2].verdict, lines[2].path }, { "GET", "allow", "/x" }, "plain line")
  t:eq({ lines[3].host, lines[3].verdict, lines[3].rule }, { "exfil-1.denied.test", "deny", "e2e#1" }, "denied line")
  t:eq({ lines[4].verdict, lines[4].rule }, { "deny", "e2e:default-deny" }, "no rule for an IP literal")
  t:eq(lines[1].sandbox, "r1", "sandbox id")
  t:match(lines[1].time, "^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", "time")
end

-- Under gVisor demesne-init's relay cannot pass the sandbox's socket: it sends the byte
-- "\0" and copies the client's bytes over the unix connection. The proxy drops the byte;
-- listen_relay (the vendor route's listener) hands that connection itself to its callback.
function T.relay_copy_marker(t)
  local dir <close> = tmpdir()
  fs.mkdir_p(dir.path .. "/run")
  fs.mkdir_p(dir.path .. "/out")
  local upstream, port = assert(stream.listen_tcp("127.0.0.1", 0, function(c)
    c:read_start(function(d)
      if d and d:find("ping", 1, true) then c:write("pong", function() c:close() end)
      elseif not d then c:close() end
    end)
  end))
  local p = policy({ { egress.ALLOW, cidr = "127.0.0.1/32", port = port, name = "upstream" } }, "copy")
  local h = assert(egress.start({ run_id = "r2", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out", policy = p }))
  local out = exchange(dir.path .. "/run/egress.sock", ("\0CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n"):format(port))
  t:match(out, "^HTTP/1.1 200 Connection established\r\n\r\npong$", "the proxy: a tunnel through the copied connection")
  h:stop()
  upstream:close()

  local got, called = {}, 0
  local path = dir.path .. "/run/relay.sock"
  local server = assert(stream.listen_relay(path, function(conn)
    called = called + 1
    conn:read_start(function(d)
      if not d then conn:close() return end
      got[#got + 1] = d
      if table.concat(got):find("hello", 1, true) then conn:write("world", function() conn:close() end) end
    end)
  end))
  local function talk(bytes)
    local c = assert(async.wrap(stream.connect_unix)(path))
    local back, done = {}, async.event()
    c:read_start(function(d) if d then back[#back + 1] = d else done.set() end end)
    c:write(bytes)
    async.timeout(5000, done.wait)
    c:close()
    return table.concat(back)
  end
  t:eq(talk("\0hello"), "world", "listen_relay: the copied connection is the client")
  t:eq({ called, table.concat(got) }, { 1, "hello" }, "one callback, the marker byte dropped")
  t:eq(talk("hello"), "", "listen_relay: bytes without the marker or a socket are refused")
  t:eq(called, 1, "no callback for them")

  -- connections that hand nothing over are bounded (core/relay.c, DM_RELAY_PENDING_MAX 16):
  -- past the bound the oldest silent one gives way, so a hand-over is still served
  local silent = {}
  for i = 1, 20 do silent[i] = assert(async.wrap(stream.connect_unix)(path)) end
  async.sleep(10)
  t:eq(talk("\0hello"), "world", "a hand-over beside 20 silent connections is served")
  t:eq(called, 2, "its callback ran")
  for _, c in ipairs(silent) do c:close() end
  server:close()
end

-- "Open egress" is a property of the policy, not its name (issue 10): a bridge network, an
-- ALLOW for every name or a wide address block, or a declaration.
function T.open_egress_is_a_property_not_a_name(t)
  local function unrestricted(def) return assert(egress_policy.compile("mine", def)).unrestricted end
  t:eq(unrestricted({ open = true }), true, "bridge network")
  t:eq(unrestricted({ rules = { { egress_policy.ALLOW, host = "*" } } }), true, "any name")
  t:eq(unrestricted({ rules = { { egress_policy.DENY, host = ".evil.test" }, { egress_policy.ALLOW, host = "*", port = 443 } } }),
    true, "any name on one port, after a carve-out")
  t:eq(unrestricted({ rules = { { egress_policy.ALLOW, cidr = "0.0.0.0/0" } } }), true, "every IPv4 address")
  t:eq(unrestricted({ rules = { { egress_policy.ALLOW, cidr = { "0.0.0.0/1", "128.0.0.0/1" } } } }), true, "two halves")
  t:eq(unrestricted({ rules = { { egress_policy.ALLOW, cidr = "::/0" } } }), true, "every IPv6 address")
  t:eq(unrestricted({ unrestricted = true, rules = {} }), true, "declared")
  t:eq(unrestricted({ rules = { { egress_policy.DENY, host = "*" } } }), false, "a DENY for every name is not open")
  t:eq(unrestricted({ rules = { { egress_policy.ALLOW, host = ".example.com" }, { egress_policy.ALLOW, cidr = "10.0.0.0/8" } } }),
    false, "named hosts and a private block")
  t:eq(assert(egress_policy.policy("package-managers")).unrestricted, false, "package-managers")
  t:eq(assert(egress_policy.policy("none")).unrestricted, false, "none")
  t:eq(assert(egress_policy.policy("open")).unrestricted, true, "open")
  -- a user's open policy under another name is refused with host inputs
  local all = egress_policy.policies()
  all.wideopen = assert(egress_policy.compile("wideopen", { rules = { { egress_policy.ALLOW, host = "*" } } }))
  local pol, err = egress_policy.select("wideopen", true)
  all.wideopen = nil
  t:eq(pol, nil, "refused with inputs")
  t:match(err, "open egress", "the refusal says why")
  t:ok(egress_policy.select("package-managers", true), "a restricted policy is fine")
  t:eq(egress_policy.is_unrestricted("no-such-policy"), true, "an unknown name counts as open")
end

-- A sandbox over its ceiling gets a 503 that names it, and egress.jsonl says why.
function T.sandbox_proxy_connection_ceiling(t)
  local config = require("demesne.config")
  local dir <close> = tmpdir()
  fs.mkdir_p(dir.path .. "/run")
  fs.mkdir_p(dir.path .. "/out")
  loop.setenv("DEMESNE_EGRESS_MAX_CONNECTIONS", "2")
  config.load()
  local h = assert(egress.start({ run_id = "r2", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out",
    policy = assert(egress_policy.policy("none")) }))
  loop.setenv("DEMESNE_EGRESS_MAX_CONNECTIONS", nil)
  config.load()
  local sock = dir.path .. "/run/egress.sock"
  local connect = async.wrap(stream.connect_unix)
  local a, b = assert(connect(sock)), assert(connect(sock))
  for _ = 1, 100 do
    if h.listener:active() == 2 then break end
    async.sleep(10)
  end
  t:eq(h.listener:active(), 2, "two idle connections held")
  t:eq(h.listener:descriptors(), 4, "two descriptors each")
  local held, cap = proxy.descriptors()
  t:ok(held >= 4 and cap > held, "the process-wide count")
  local out = exchange(sock, "CONNECT pypi.org:443 HTTP/1.1\r\n\r\n")
  t:match(out, "^HTTP/1.1 503 Service Unavailable", "over the ceiling")
  t:match(out, "X%-Demesne%-Egress: ceiling", "marked")
  t:match(out, "egress_max_connections", "the setting is named")
  a:close()
  b:close()
  h:stop()
  local lines = {}
  for line in (fs.read_file(dir.path .. "/out/egress.jsonl") or ""):gmatch("[^\n]+") do lines[#lines + 1] = json.decode(line) end
  t:eq(#lines, 1, "one line for the refusal")
  t:eq({ lines[1].verdict, lines[1].rule, lines[1].refused, lines[1].limit, lines[1].status },
    { "deny", "ceiling", 1, "connections", 503 }, "the ceiling line")
end

return T
