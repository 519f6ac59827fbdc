-- The egress verdict `ask`: a connection to a name the sandbox's policy neither allows nor
-- denies (an ASK rule, lua/egress/policy.lua) is held while a person decides.
--
-- Interface for the cockpit (stable; require "demesne.egress.ask"):
--
--   ask.pending() -> {question, …}, oldest first. A question is a copy:
--     { id = "q-…", run_id, sandbox_id (= run_id: the sandbox that connects), root_id (its
--       tree's root; = run_id outside a tree), host, port, has_inputs (true when the sandbox
--       holds host inputs: files, directories or a repository of the host, or when that
--       cannot be told), since (ISO-8601 UTC), expires_at (ISO-8601: then it is denied),
--       policy, rule (the ASK rule's label), tool, connections (how many are held on it) }
--   ask.answer(id, decision, who) -> true | nil, err
--     decision: "once" (the connections held on this question go through), "run" (they do,
--     and later connections to the same host:port from this run or any run of its subtree go
--     through without asking, for as long as the run lives) or "deny". `who` (a short text,
--     e.g. "cockpit") is written to egress.jsonl as decided_by. err when the question is not
--     pending (answered, timed out, its sandbox gone) or the decision is not one of these.
--   ask.subscribe(fn) -> unsubscribe()
--     fn(event) on every change: { type = "asked" | "answered" | "withdrawn", question = a copy
--     as in pending(), decision = "once"|"run"|"deny" and decided_by (answered only) }.
--     "withdrawn": every connection held on it ended first (its sandbox stopped). fn runs on
--     the loop: it must not wait; an error in it is logged and changes nothing.
--
-- Who is asked: the host MCP client of the sandbox's tree root (the session whose tool call
-- made the root: the plan hook in lua/tree puts it on the plan, egress.start registers it),
-- through MCP elicitation
-- (elicitation/create, form mode) when that client declared the elicitation capability on a
-- 2025-06-18 / 2025-11-25 session (2026-07-28 has no requests from server to client outside a
-- call's own result, so its clients are not asked); and whoever watches ask.pending (the
-- cockpit). The first answer decides; the other is withdrawn (the elicitation request is
-- cancelled). Nobody answers within ask_timeout_seconds: denied (decided_by "timeout").
-- Connections held at once per sandbox are bounded by ask_max_held (more are denied at once).
-- Connections to the same host:port from the same run while a question is pending wait on
-- that question (one question, not a flood of them).
local async = require("demesne.async")
local config = require("demesne.config")
local log = require("demesne.log")
local util = require("demesne.util")
local loop = require("core.loop")
local timer = require("core.timer")

local ask = {}

local LOGGER = "demesne.egress"

--- The decisions a question takes.
ask.DECISIONS = { once = true, run = true, deny = true }

local questions = {} -- id -> question (internal: with waiters, timer, task)
local by_key = {}    -- run_id|host|port -> question
local order = {}     -- ids, oldest first
local subscribers = {}
local clients = {}   -- root run id -> client (ask.bind)
local grants = {}    -- run id -> { ["host:port"] = {by, at} }
local seq = 0

local function public(q)
  return { id = q.id, run_id = q.run_id, sandbox_id = q.run_id, root_id = q.root_id, host = q.host, port = q.port,
    has_inputs = q.has_inputs, since = q.since, expires_at = q.expires_at, policy = q.policy, rule = q.rule,
    tool = q.tool, connections = #q.waiters }
end

local function emit(event)
  for _, fn in ipairs({ table.unpack(subscribers) }) do
    local ok, err = pcall(fn, event)
    if not ok then log.warning(LOGGER, "an ask subscriber failed: %s", tostring(err)) end
  end
end

--- Subscribes `fn(event)` to every change of the pending questions (see the top of the file).
---@param fn fun(event: {type: string, question: table, decision: string|nil, decided_by: string|nil})
---@return fun() unsubscribe
function ask.subscribe(fn)
  assert(type(fn) == "function", "ask.subscribe: fn must be a function")
  subscribers[#subscribers + 1] = fn
  return function()
    for i, f in ipairs(subscribers) do
      if f == fn then table.remove(subscribers, i) return end
    end
  end
end

--- The questions waiting for an answer, oldest first (copies; see the top of the file).
---@return table[]
function ask.pending()
  local out = {}
  for _, id in ipairs(order) do
    local q = questions[id]
    if q then out[#out + 1] = public(q) end
  end
  return out
end

-- Takes the question out of the tables; stops its timer and its elicitation.
local function retire(q)
  questions[q.id], by_key[q.key] = nil, nil
  for i, id in ipairs(order) do
    if id == q.id then table.remove(order, i) break end
  end
  if q.timer then q.timer:close() q.timer = nil end
  local t = q.task
  q.task = nil
  if t and not t.done and async.current() ~= t then async.cancel(t, "answered") end
end

--- Answers a pending question: "once", "run" or "deny", decided by `who` (written to
--- egress.jsonl as decided_by). Returns true, or nil and why not.
---@param id string
---@param decision string  "once"|"run"|"deny"
---@param who string  e.g. "cockpit", "elicitation", "timeout"
---@return boolean|nil ok, string|nil err
function ask.answer(id, decision, who)
  if type(decision) ~= "string" or not ask.DECISIONS[decision] then
    return nil, ("decision: %q is not one of once, run, deny"):format(tostring(decision))
  end
  if type(who) ~= "string" or who == "" then return nil, "who: a non-empty string (who decided)" end
  if #who > 64 then who = who:sub(1, 64) end
  local q = type(id) == "string" and questions[id]
  if not q then
    return nil, ("id: no pending question %q (answered already, timed out, or its sandbox is gone)"):format(tostring(id))
  end
  retire(q)
  if decision == "run" then
    local g = grants[q.run_id]
    if g then g[q.host .. ":" .. q.port] = { by = who, question = q.id } end
  end
  log.info(LOGGER, "sandbox %s: %s:%d asked (%s): %s, decided by %s", q.run_id, q.host, q.port, q.id, decision, who)
  for _, w in ipairs(q.waiters) do
    local ok, err = pcall(w.decided, decision, who, q.id)
    if not ok then log.warning(LOGGER, "sandbox %s: releasing a held connection: %s", q.run_id, tostring(err)) end
  end
  emit({ type = "answered", question = public(q), decision = decision, decided_by = who })
  return true
end

--- Binds a tree root to its host MCP client, which elicitation questions of the tree go
--- to. `client` = {request = fun(method, params, opts): result|nil, err, code (inside a
--- task), capabilities = the client's declared capabilities, protocol_version = string,
--- modern = boolean|nil}. nil unbinds.
---@param root_id string
---@param client table|nil
function ask.bind(root_id, client) clients[root_id] = client end

--- Registers a live run (egress.start): its grants, and for a root its host client (as
--- ask.bind takes it, or nil), live until ask.forget(run_id).
---@param run_id string
---@param client table|nil
function ask.register(run_id, client)
  grants[run_id] = grants[run_id] or {}
  if client ~= nil then clients[run_id] = client end
end

--- Forgets a run that has ended: its grants and, for a root, its client binding. Questions
--- still pending for it end with its connections (ask.release).
---@param run_id string
function ask.forget(run_id)
  grants[run_id], clients[run_id] = nil, nil
end

--- The grant ("run") that lets a connection to host:port from a run of `lineage` (the run,
--- its parent, …, its root) through without asking, or nil.
---@param lineage string[]
---@param host string
---@param port integer
---@return {by: string, question: string}|nil
function ask.granted(lineage, host, port)
  local k = host .. ":" .. port
  for _, id in ipairs(lineage or {}) do
    local g = grants[id] and grants[id][k]
    if g then return g end
  end
  return nil
end

--- Whether the client declared form-mode elicitation on a session that can carry a request
--- from the server (not 2026-07-28).
---@param client table|nil  as ask.bind takes it
---@return boolean
function ask.can_elicit(client)
  if type(client) ~= "table" or client.modern or type(client.request) ~= "function" then return false end
  local e = type(client.capabilities) == "table" and client.capabilities.elicitation
  if type(e) ~= "table" then return false end
  return next(e) == nil or e.form ~= nil -- {} means form (2025-11-25), url alone does not
end

--- The text the person reads: plain text, no markup; the run, the host and port, and first
--- of all whether the sandbox holds host inputs.
---@param q table  a question
---@return string
function ask.message(q)
  local inputs = q.has_inputs
    and "WARNING: this sandbox HOLDS HOST INPUTS (files, directories or a repository from your machine). "
      .. "Allowing this connection could let them leave."
    or "This sandbox holds no host inputs."
  return ("%s\n\ndemesne: run %s%s (%s, egress policy %s) asks to connect to %s port %d.\n\n"
    .. "Allow once (this connection), allow for this run and its subtree (later connections to %s:%d "
    .. "go through without asking), or deny. No answer within %d s: denied.")
    :format(inputs, q.run_id, q.root_id ~= q.run_id and (" in the tree of " .. q.root_id) or "", q.tool or "sandbox",
      q.policy, q.host, q.port, q.host, q.port, q.timeout_s)
end

--- The elicitation/create params of a question (form mode: one choice). 2025-11-25 gets
--- titled choices (oneOf), 2025-06-18 enum + enumNames.
---@param q table
---@param protocol_version string|nil
---@return table
function ask.elicitation(q, protocol_version)
  local values = { "once", "run", "deny" }
  local titles = { "Allow once", "Allow for this run and its subtree", "Deny" }
  local prop = { type = "string", title = ("Connection to %s:%d"):format(q.host, q.port), default = "once",
    description = "What the sandbox may do" }
  if protocol_version == "2025-06-18" then
    prop.enum, prop.enumNames = values, titles
  else
    prop.oneOf = {}
    for i, v in ipairs(values) do prop.oneOf[i] = { const = v, title = titles[i] } end
  end
  return { mode = protocol_version ~= "2025-06-18" and "form" or nil, message = ask.message(q),
    requestedSchema = { type = "object", properties = { decision = prop }, required = { "decision" } } }
end

-- Asks the root's host client (in a task of its own); its answer answers the question.
local function elicit(q, client)
  q.task = async.spawn("egress ask " .. q.id, function()
    local res, err = client.request("elicitation/create", ask.elicitation(q, client.protocol_version),
      { timeout_ms = q.timeout_s * 1000 })
    if not questions[q.id] then return end
    if not res then
      log.info(LOGGER, "sandbox %s: elicitation for %s:%d got no answer: %s", q.run_id, q.host, q.port, tostring(err))
      return
    end
    local action = type(res) == "table" and res.action
    local content = type(res) == "table" and type(res.content) == "table" and res.content or {}
    if action == "accept" then
      local d = content.decision
      if not ask.DECISIONS[d] then d = "deny" end -- an accept without a choice we know is no allow
      ask.answer(q.id, d, "elicitation")
    elseif action == "decline" then
      ask.answer(q.id, "deny", "elicitation")
    else -- "cancel" (dismissed): no decision; the cockpit or the timeout has it
      log.info(LOGGER, "sandbox %s: the client dismissed the question for %s:%d", q.run_id, q.host, q.port)
    end
  end)
end

--- Holds a connection on the question for (run, host, port), asking one when none is
--- pending. `o` = {run_id, root_id, lineage, has_inputs, policy, rule, tool, host, port,
--- decided = fun(decision, who, question_id), held = integer (the connections this sandbox
--- holds now)}. Returns the question's id, nil and the waiter (for ask.release), or nil and
--- why the connection is refused at once (ask_max_held). Never waits.
---@param o table
---@return string|nil id, string|nil err, table|nil waiter
function ask.hold(o)
  local max = math.max(1, math.floor(config.get("ask_max_held")))
  if (o.held or 0) >= max then
    return nil, ("%d connections of this sandbox already wait for an answer (ask_max_held in the demesne "
      .. "configuration)"):format(max)
  end
  local key = o.run_id .. "|" .. o.host .. "|" .. o.port
  local q = by_key[key]
  local waiter = { decided = o.decided }
  if q then
    q.waiters[#q.waiters + 1] = waiter
    return q.id, nil, waiter
  end
  seq = seq + 1
  local timeout_s = math.max(1, math.floor(config.get("ask_timeout_seconds")))
  q = { id = ("q-%d-%s"):format(seq, util.hex(loop.random(4))), key = key, run_id = o.run_id,
    root_id = o.root_id or o.run_id, host = o.host, port = o.port, has_inputs = o.has_inputs ~= false,
    since = util.iso_now(), expires_at = util.iso_ms(loop.time() * 1000 + timeout_s * 1000), policy = o.policy,
    rule = o.rule, tool = o.tool, timeout_s = timeout_s, waiters = { waiter } }
  questions[q.id], by_key[key] = q, q
  order[#order + 1] = q.id
  q.timer = timer.after(timeout_s * 1000, function()
    q.timer = nil
    if questions[q.id] then ask.answer(q.id, "deny", "timeout") end
  end)
  log.info(LOGGER, "sandbox %s: %s:%d held: asking (%s, %d s)", q.run_id, q.host, q.port, q.id, timeout_s)
  emit({ type = "asked", question = public(q) })
  local client = clients[q.root_id]
  if ask.can_elicit(client) then elicit(q, client) end
  return q.id, nil, waiter
end

--- A held connection ended before its question was answered (its sandbox stopped, the
--- proxy closed it): it leaves the question, and a question with nobody left is withdrawn.
---@param id string  the question
---@param waiter table  the third result of ask.hold
function ask.release(id, waiter)
  local q = questions[id]
  if not q then return end
  for i, w in ipairs(q.waiters) do
    if w == waiter then table.remove(q.waiters, i) break end
  end
  if #q.waiters == 0 then
    retire(q)
    emit({ type = "withdrawn", question = public(q) })
  end
end

return ask
