-- The egress verdict `ask`: ASK rules, the `ask` field and `extends` in policies, the
-- built-in package-managers-ask, and one sandbox proxy on loopback whose connections are
-- held, answered through demesne.egress.ask (once, run, deny, the timeout, the ceiling) and
-- logged in egress.jsonl with who decided.
local egress = require("demesne.egress")
local egress_policy = require("demesne.egress.policy")
local ask = require("demesne.egress.ask")
local config = require("demesne.config")
local json = require("demesne.json")
local async = require("demesne.async")
local proxy = require("core.proxy")
local stream = require("core.stream")
local fs = require("core.fs")
local loop = require("core.loop")

local T = {}

local ALLOW, DENY, ASK = egress_policy.ALLOW, egress_policy.DENY, egress_policy.ASK

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local function tmpdir()
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-ask-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run"))
  assert(fs.mkdir_p(dir .. "/out"))
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

local function req_of(target)
  local scheme, rest = target:match("^(%a+)://(.*)$")
  local default = scheme == "http" and 80 or 443
  local host, port, ip = assert(proxy.split_authority((rest or target):match("^[^/]*"), default))
  return { host = host, port = port, ip = ip }
end

local function verdict(pol, target) return (egress_policy.decide(pol, req_of(target))) end

function T.ask_rules_are_a_third_verdict(t)
  local p = assert(egress_policy.compile("t", { rules = {
    { DENY, host = "bad.ask.test" },
    { ASK, host = ".ask.test", port = 443, name = "asked" },
    { ALLOW, host = "ok.test" },
  } }))
  local v, label = egress_policy.decide(p, req_of("https://x.ask.test"))
  t:eq({ v, label }, { "ASK", "t#2 asked" }, "labelled like any rule")
  t:eq(verdict(p, "https://bad.ask.test"), "DENY", "an earlier DENY wins")
  t:eq(verdict(p, "http://x.ask.test"), "DENY", "another port: no rule, denied")
  t:eq(verdict(p, "ok.test"), "ALLOW", "ALLOW")
  t:eq(p.asks, true, "the policy is marked as one that asks")
  t:eq(p.unrestricted, false, "asking is not open egress")
  local any = assert(egress_policy.compile("any", { rules = { { ASK, host = "*" } } }))
  t:eq(any.unrestricted, false, "ASK for every name is not open egress")
  t:eq(verdict(any, "https://10.1.2.3"), "DENY", "an IP literal is never asked about")
  t:eq(verdict(any, "http://[fd00::1]"), "DENY", "nor a v6 one")
  t:eq(assert(egress_policy.compile("n", { rules = { { ALLOW, host = "a.test" } } })).asks, false, "no ASK rule")
end

function T.ask_field_comes_after_the_rules(t)
  local p = assert(egress_policy.compile("f", { rules = { { DENY, host = "no.test" }, { ALLOW, host = "yes.test" } },
    ask = { "*.maybe.test:443", "no.test", "plain.test" } }))
  t:eq(verdict(p, "https://a.maybe.test"), "ASK", "a pattern with a port")
  t:eq(verdict(p, "http://a.maybe.test"), "DENY", "not on another port")
  t:eq(verdict(p, "no.test"), "DENY", "a rule before it decides first")
  t:eq(verdict(p, "http://plain.test:8080"), "ASK", "a name, any port")
  local _, label = egress_policy.decide(p, req_of("plain.test"))
  t:eq(label, "f#5 ask plain.test", "the label names the entry")
end

function T.ask_refuses_addresses(t)
  local _, err = egress_policy.compile("c", { rules = { { ASK, cidr = "10.0.0.0/8" } } })
  t:match(err, "rules%[1%]: ASK takes host names and patterns, not cidr", "cidr")
  _, err = egress_policy.compile("c", { rules = { { ASK, host = "10.1.2.3" } } })
  t:match(err, "not addresses", "an IP literal as host")
  _, err = egress_policy.compile("c", { rules = {}, ask = { "10.0.0.0/8" } })
  t:match(err, "ask%[1%].*not addresses", "an ask entry")
  _, err = egress_policy.compile("c", { rules = {}, ask = "x.test" })
  t:match(err, "ask must be a list", "ask is a list")
  _, err = egress_policy.compile("c", { rules = { { "MAYBE", host = "x.test" } } })
  t:match(err, "ALLOW, DENY or ASK", "the actions are named")
end

function T.extends_puts_the_base_rules_first(t)
  local base = assert(egress_policy.compile("base", { rules = { { ALLOW, host = "pkg.test", port = 443, name = "pkg" } },
    ask = { "base-only.test" } }))
  local mine = assert(egress_policy.compile("mine", { extends = "base", rules = { { ASK, host = "*", port = 443 } } }))
  local p = assert(egress_policy.extend(mine, base))
  t:eq(verdict(p, "https://pkg.test"), "ALLOW", "the base's rule")
  local _, label = egress_policy.decide(p, req_of("https://pkg.test"))
  t:eq(label, "mine#1 pkg", "numbered in the extending policy")
  t:eq(verdict(p, "https://other.test"), "ASK", "its own rule after")
  t:eq(verdict(p, "http://base-only.test"), "DENY", "the base's ask field is not taken")
  local _, err = egress_policy.extend(mine, nil)
  t:match(err, 'extends "base": there is no such policy', "a missing base")
  local chained = assert(egress_policy.compile("c2", { extends = "mine", rules = {} }))
  _, err = egress_policy.extend(chained, p)
  t:match(err, "one level only", "one level")
  _, err = egress_policy.extend(mine, assert(egress_policy.compile("o", { open = true })))
  t:match(err, "open", "an open base")
end

function T.package_managers_ask_builtin(t)
  egress_policy.reload()
  local p = assert(egress_policy.policy("package-managers-ask"))
  t:eq(verdict(p, "https://pypi.org"), "ALLOW", "a registry goes out at once")
  t:eq(verdict(p, "https://proxy.golang.org"), "ALLOW", "the Go proxy")
  t:eq(verdict(p, "https://example.com"), "ASK", "another name on 443 is asked about")
  t:eq(verdict(p, "http://example.com"), "ASK", "and on 80")
  t:eq(verdict(p, "example.com:22"), "DENY", "another port is denied")
  t:eq(verdict(p, "https://93.184.215.14"), "DENY", "an address is denied")
  t:eq(p.unrestricted, false, "not open egress")
  t:ok(egress_policy.select("package-managers-ask", true), "allowed with host inputs (the question says so)")
  local base = assert(egress_policy.policy("package-managers"))
  t:eq(#p.rules, #base.rules + 1, "every rule of package-managers, then the ASK rule")
end

function T.message_and_elicitation_are_plain_and_say_the_inputs(t)
  local q = { run_id = "r-child", root_id = "r-root", host = "__x__.test", port = 443, has_inputs = true,
    policy = "p", tool = "sandbox_script", timeout_s = 30 }
  local m = ask.message(q)
  t:match(m, "^WARNING: this sandbox HOLDS HOST INPUTS", "the inputs come first")
  t:match(m, "run r%-child in the tree of r%-root", "the run and its root")
  t:match(m, "__x__%.test port 443", "the host and port, as they are")
  q.has_inputs = false
  t:match(ask.message(q), "^This sandbox holds no host inputs%.", "no inputs")
  local e = ask.elicitation(q, "2025-11-25")
  t:eq(e.mode, "form", "form mode")
  t:eq(e.requestedSchema.required, { "decision" }, "one field")
  local vals = {}
  for _, o in ipairs(e.requestedSchema.properties.decision.oneOf) do vals[#vals + 1] = o.const end
  t:eq(vals, { "once", "run", "deny" }, "titled choices")
  local old = ask.elicitation(q, "2025-06-18")
  t:eq({ old.mode, old.requestedSchema.properties.decision.enum }, { nil, { "once", "run", "deny" } }, "2025-06-18: enum")
  t:eq(ask.can_elicit({ request = print, capabilities = { elicitation = {} } }), true, "{} is form")
  t:eq(ask.can_elicit({ request = print, capabilities = { elicitation = { url = {} } } }), false, "url only")
  t:eq(ask.can_elicit({ request = print, capabilities = {} }), false, "not declared")
  t:eq(ask.can_elicit({ request = print, capabilities = { elicitation = {} }, modern = true }), false, "2026-07-28")
end

-- One exchange over the sandbox's socket in a task of its own: everything until EOF.
local function exchange(path, req)
  return async.spawn("exchange", function()
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
    async.timeout(20000, done.wait)
    c:close()
    return table.concat(got)
  end)
end

local function result(task)
  local ok, out = task:wait()
  assert(ok, out)
  return out
end

local function until_pending(n)
  for _ = 1, 500 do
    local p = ask.pending()
    if #p >= n then return p end
    async.sleep(10)
  end
  return ask.pending()
end

local function lines_of(dir)
  local out = {}
  for line in (fs.read_file(dir .. "/out/egress.jsonl") or ""):gmatch("[^\n]+") do out[#out + 1] = json.decode(line) end
  return out
end

local function with_env(vars, fn)
  for k, v in pairs(vars) do loop.setenv(k, v) end
  config.load()
  local ok, err = pcall(fn)
  for k in pairs(vars) do loop.setenv(k, nil) end
  config.load()
  if not ok then error(err, 0) end
end

function T.held_connections_are_answered_and_logged(t)
  local dir <close> = tmpdir()
  local upstream, port = assert(stream.listen_tcp("127.0.0.1", 0, function(c)
    c:read_start(function(d)
      if d and d:find("ping", 1, true) then c:write("pong", function() c:close() end)
      elseif not d then c:close() end
    end)
  end))
  local p = assert(egress_policy.compile("asks", { rules = {
    { ASK, host = "localhost", name = "local" },
    { ALLOW, cidr = "127.0.0.1/32", port = port },
  } }))
  local events = {}
  local unsubscribe = ask.subscribe(function(e) events[#events + 1] = e.type .. ":" .. (e.decision or "") end)
  local h = assert(egress.start({ run_id = "ra", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out", policy = p,
    ask = { root = "ra", lineage = { "ra" }, has_inputs = false, tool = "sandbox_script" } }))
  local sock = dir.path .. "/run/egress.sock"
  local head = ("CONNECT localhost:%d HTTP/1.1\r\n\r\n"):format(port)

  -- once
  local a = exchange(sock, head)
  local pend = until_pending(1)
  t:eq(#pend, 1, "one question")
  -- while it is held, the same sandbox and another one go on: nothing waits for the answer
  local other <close> = tmpdir()
  local h2 = assert(egress.start({ run_id = "rb", run_dir = other.path .. "/run", output_dir = other.path .. "/out",
    policy = p }))
  local direct = ("CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n"):format(port)
  t:match(result(exchange(sock, direct)), "pong$", "the same sandbox's allowed connection goes through")
  t:match(result(exchange(other.path .. "/run/egress.sock", direct)), "pong$", "another sandbox's too")
  h2:stop()
  t:eq(#ask.pending(), 1, "still held")
  t:eq({ pend[1].run_id, pend[1].sandbox_id, pend[1].root_id, pend[1].host, pend[1].port, pend[1].has_inputs,
    pend[1].connections, pend[1].rule }, { "ra", "ra", "ra", "localhost", port, false, 1, "asks#1 local" }, "the question")
  t:match(pend[1].since, "^%d%d%d%d%-%d%d%-%d%dT", "since")
  t:eq({ ask.answer(pend[1].id, "maybe", "cockpit") }, { nil, 'decision: "maybe" is not one of once, run, deny' },
    "a bad decision")
  t:eq(ask.answer(pend[1].id, "once", "cockpit"), true, "answered")
  t:match(result(a), "^HTTP/1.1 200 Connection established\r\n\r\npong$", "the held connection went through")
  local again, err = ask.answer(pend[1].id, "deny", "cockpit")
  t:eq(again, nil, "a question is answered once")
  t:match(err, "no pending question", "why")

  -- once is once: the next connection is asked again; deny
  local b = exchange(sock, head)
  pend = until_pending(1)
  t:eq(#pend, 1, "asked again")
  t:ok(ask.answer(pend[1].id, "deny", "cockpit"), "deny")
  local out = result(b)
  t:match(out, "^HTTP/1.1 403 Forbidden", "denied")
  t:match(out, "the answer %(cockpit%) was deny", "the sandbox is told why")

  -- run: this one and every later one of the run
  local c = exchange(sock, head)
  pend = until_pending(1)
  t:ok(ask.answer(pend[1].id, "run", "elicitation"), "allow for the run")
  t:match(result(c), "pong$", "through")
  t:match(result(exchange(sock, head)), "pong$", "the next one goes through without a question")
  t:eq(#ask.pending(), 0, "nothing asked")
  -- the answer covers the run's subtree: a child (lineage child, ra) goes through too, a
  -- sibling tree does not
  local kid <close> = tmpdir()
  local hk = assert(egress.start({ run_id = "rc", run_dir = kid.path .. "/run", output_dir = kid.path .. "/out", policy = p,
    ask = { root = "ra", lineage = { "rc", "ra" }, has_inputs = true } }))
  t:match(result(exchange(kid.path .. "/run/egress.sock", head)), "pong$", "a child of the run: no question")
  hk:stop()
  t:eq(ask.granted({ "rz" }, "localhost", port), nil, "another run has no grant")
  t:ok(ask.granted({ "rc", "ra" }, "localhost", port), "the subtree has")
  t:eq(ask.granted({ "ra" }, "localhost", port + 1), nil, "for that port only")
  h:stop()
  upstream:close()
  unsubscribe()

  local lines = lines_of(dir.path)
  t:eq(#lines, 5, "one line per connection")
  t:eq({ lines[1].verdict, lines[1].rule, lines[1].decision }, { "allow", "asks#2", nil }, "the direct one, first to end")
  table.remove(lines, 1)
  local got = {}
  for _, l in ipairs(lines) do got[#got + 1] = { l.verdict, l.decision, l.decided_by, l.granted or false } end
  t:eq(got, { { "allow", "once", "cockpit", false }, { "deny", "deny", "cockpit", false },
    { "allow", "run", "elicitation", false }, { "allow", "run", "elicitation", true } }, "who decided, and how")
  t:eq(lines[1].rule, "asks#1 local", "the ASK rule")
  t:eq(lines[3].question, lines[4].question, "the grant names the question that made it")
  t:eq(events, { "asked:", "answered:once", "asked:", "answered:deny", "asked:", "answered:run" }, "the events")
  t:eq(ask.granted({ "ra" }, "localhost", port), nil, "the run's grants end with it")
end

function T.nobody_answers_denied_and_ceiling(t)
  local dir <close> = tmpdir()
  local p = assert(egress_policy.compile("asks", { rules = { { ASK, host = "localhost" } } }))
  with_env({ DEMESNE_ASK_TIMEOUT_SECONDS = "1", DEMESNE_ASK_MAX_HELD = "1" }, function()
    local h = assert(egress.start({ run_id = "rt", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out",
      policy = p }))
    local sock = dir.path .. "/run/egress.sock"
    local a = exchange(sock, "CONNECT localhost:9 HTTP/1.1\r\n\r\n")
    local pend = until_pending(1)
    t:eq(pend[1] and pend[1].has_inputs, true, "without the plan's word, a sandbox counts as holding inputs")
    local over = result(exchange(sock, "CONNECT localhost:10 HTTP/1.1\r\n\r\n"))
    t:match(over, "^HTTP/1.1 403", "over ask_max_held: denied at once")
    t:match(over, "ask_max_held", "naming the setting")
    local out = result(a)
    t:match(out, "^HTTP/1.1 403", "no answer: denied")
    t:match(out, "nobody answered within ask_timeout_seconds", "why")
    t:eq(#ask.pending(), 0, "the question is gone")
    h:stop()
  end)
  local lines = lines_of(dir.path)
  t:eq(#lines, 2, "two lines")
  table.sort(lines, function(x, y) return x.port > y.port end)
  t:eq({ lines[1].port, lines[1].verdict, lines[1].decided_by }, { 10, "deny", "ask_max_held" }, "the ceiling")
  t:eq({ lines[2].port, lines[2].verdict, lines[2].decision, lines[2].decided_by }, { 9, "deny", "deny", "timeout" },
    "the timeout")
end

function T.a_held_connection_of_a_stopped_sandbox_withdraws_its_question(t)
  local dir <close> = tmpdir()
  local p = assert(egress_policy.compile("asks", { rules = { { ASK, host = "localhost" } } }))
  local events = {}
  local unsubscribe = ask.subscribe(function(e) events[#events + 1] = e.type end)
  local h = assert(egress.start({ run_id = "rw", run_dir = dir.path .. "/run", output_dir = dir.path .. "/out", policy = p }))
  local a = exchange(dir.path .. "/run/egress.sock", "CONNECT localhost:9 HTTP/1.1\r\n\r\n")
  local pend = until_pending(1)
  t:eq(#pend, 1, "held")
  h:stop()
  result(a)
  unsubscribe()
  t:eq(#ask.pending(), 0, "withdrawn")
  t:eq(events, { "asked", "withdrawn" }, "the events")
  local _, err = ask.answer(pend[1].id, "once", "cockpit")
  t:match(err, "no pending question", "too late to answer")
  local lines = lines_of(dir.path)
  t:eq({ #lines, lines[1] and lines[1].verdict }, { 1, "deny" }, "logged as denied")
end

return T
