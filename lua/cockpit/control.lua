-- The control plane of one `demesne serve` (stdio or HTTP): a small JSON API on a unix
-- socket in the control folder (lua/cockpit/registry.lua; the socket 0600 in a 0700 folder
-- is the authentication: only this user reaches it, and no sandbox: it is on no relay),
-- served by core.httpd (llhttp in C). `demesne ps`, `logs`, `cancel` and `ui` are its
-- clients (lua/cockpit/client.lua). docs/reference/cli.md#the-control-api
--
--   GET  /v1/server                   {pid, owner, transport, urls, state_dir, started_ms, version}
--   GET  /v1/trees                    {server, trees = view.trees(), totals = view.totals(), asks}
--   GET  /v1/nodes/ID                 view.detail(ID)
--   GET  /v1/nodes/ID/log?stream=S&from=N   view.log: {lines, next, eof}
--   GET  /v1/nodes/ID/file?path=REL   the bytes of a file in the node's /out (application/octet-stream)
--   POST /v1/nodes/ID/cancel          {subtree = bool}: ends the run (and, with subtree, its running children);
--                                      a sandbox that is no tree node (ID: its run id or job id): a background
--                                      job is cancelled (lua/jobs), a persistent sandbox destroyed, a
--                                      foreground run's container killed (its call answers exit code 137)
--   POST /v1/nodes/ID/ttl             {seconds}: a persistent sandbox's expiry moves that much later
--   POST /v1/trees/ID/budget          {budget_usd}: the tree's budget, raised
--   GET  /v1/asks, POST /v1/asks/ID   {decision = once|run|deny}: pending egress questions (demesne.egress.ask)
--   GET  /v1/events                   server-sent events: `changed` {seq} whenever the trees, their
--                                      nodes or the pending questions change; keep-alive comments
--
-- Errors: {error = {message, code}} with 400 (bad input, naming the field), 404 (no such
-- node of this server), 409 (not possible now), 500.
local async = require("demesne.async")
local config = require("demesne.config")
local ask = require("demesne.egress.ask")
local errors = require("demesne.errors")
local json = require("demesne.json")
local log = require("demesne.log")
local jobs = require("demesne.jobs")
local registry = require("demesne.cockpit.registry")
local runs = require("demesne.cockpit.runs")
local sandbox = require("demesne.sandbox")
local store = require("demesne.tree.store")
local tree = require("demesne.tree")
local view = require("demesne.cockpit.view")
local util = require("demesne.util")
local httpd = require("core.httpd")
local loop = require("core.loop")
local timer = require("core.timer")


local control = {}

local LOGGER = "demesne.cockpit"
local TICK_MS = 500
local KEEPALIVE_MS = 15000
local JSON = { ["Content-Type"] = "application/json" }
local SSE = { ["Content-Type"] = "text/event-stream", ["Cache-Control"] = "no-cache" }
local CANCEL_REASON = "cancelled from the cockpit"

local state -- {http, entry, streams = {conn -> true}, seq, digest, tick, keepalive}

local function answer(conn, status, v) conn:respond(status, JSON, json.encode(v)) end

local function refuse(conn, status, message, code)
  answer(conn, status, { error = { message = message, code = code } })
end

local function query(target)
  local q = {}
  for k, v in (target:match("%?(.*)$") or ""):gmatch("([^&=]+)=([^&]*)") do
    q[k] = v:gsub("+", " "):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end)
  end
  return q
end

local function asks()
  local ok, list = pcall(ask.pending)
  if not ok or type(list) ~= "table" then return json.array() end
  local out = json.array()
  for _, a in ipairs(list) do out[#out + 1] = a end
  return out
end

local function server_info()
  local e = state.entry or {}
  return { pid = loop.getpid(), owner = sandbox.owner(), transport = e.transport, urls = e.urls,
    state_dir = config.get("state_dir"), started_ms = e.started_ms, version = loop.version }
end

-- The node `id` of this server for an action: this process's copy (the one its tasks change).
local function own_node(id)
  local n, err = view.node(id)
  if not n then return nil, err end
  return store.get(id)
end

local function body_of(req)
  if req.body == "" then return {} end
  local b = json.decode(req.body)
  if type(b) ~= "table" then errors.raise("the body must be a JSON object", "EINVAL") end
  return b
end

-- Ends a sandbox that is no tree node (runs.list's entry r).
local function cancel_run(conn, id, r)
  if not r.active then return refuse(conn, 409, ("run %s has ended (%s)"):format(id, tostring(r.status)), "EALREADY") end
  local status
  if r.job_id then
    log.notice(LOGGER, "%s: job %s cancelled from the cockpit", r.run_id, r.job_id)
    local rec = jobs.cancel(r.job_id, CANCEL_REASON)
    status = rec and rec.status or "cancelled"
  elseif r.kind == "create" then
    log.notice(LOGGER, "%s: persistent sandbox destroyed from the cockpit", r.run_id)
    status = sandbox.destroy(nil, { sandbox_id = r.run_id }).status
  else
    log.notice(LOGGER, "%s: killed from the cockpit", r.run_id)
    local eng = sandbox.engine()
    local ok, kerr = (eng.kill and eng.kill or eng.remove)(eng, r.container, "KILL")
    if not ok then return refuse(conn, 500, ("run %s: %s"):format(r.run_id, tostring(kerr)), "EENGINE") end
    status = "killed"
  end
  runs.changed()
  answer(conn, 200, { run_id = r.run_id, job_id = r.job_id, status = status, active = false })
end

local function cancel(conn, id, b)
  if b.subtree ~= nil and type(b.subtree) ~= "boolean" then
    return refuse(conn, 400, "subtree: true or false", "EINVAL")
  end
  local v = view.node(id)
  if v and v.standalone then return cancel_run(conn, id, v) end
  local n, err = own_node(id)
  if not n then return refuse(conn, 404, err, "ENOENT") end
  if not n.active then return refuse(conn, 409, ("run %s has ended (%s)"):format(id, tostring(n.status)), "EALREADY") end
  local running = 0
  for _, c in ipairs(n.children or {}) do
    local x = c.run_id and store.get(c.run_id)
    if x and x.active then running = running + 1 end
  end
  if running > 0 and not b.subtree then
    return refuse(conn, 409, ("run %s has %d running child run(s): cancel its subtree (subtree = true, "
      .. "`demesne cancel --subtree`) to end them with it"):format(id, running), "EBUSY")
  end
  log.notice(LOGGER, "%s: cancelled from the cockpit%s", id, running > 0 and " with its subtree" or "")
  tree.stop(id, CANCEL_REASON)
  local after = store.get(id)
  answer(conn, 200, { run_id = id, status = after and after.status or "cancelled", active = after and after.active })
end

local function extend(conn, id, b)
  local n, err = own_node(id)
  if not n then
    local v = view.node(id)
    if not (v and v.standalone) then return refuse(conn, 404, err, "ENOENT") end
    n = v -- a persistent sandbox that is no tree node (kind "create")
  end
  local secs = type(b.seconds) == "number" and math.tointeger(b.seconds) or nil -- (JSON numbers decode as floats)
  if not secs or secs <= 0 then
    return refuse(conn, 400, "seconds: a whole number of seconds above 0", "EINVAL")
  end
  if n.kind ~= "create" then
    return refuse(conn, 409, ("run %s is a %s run: only a persistent sandbox (sandbox_create) has a TTL; a "
      .. "one-shot run ends at its timeout"):format(id, tostring(n.kind)), "EINVAL")
  end
  local sb = sandbox.lookup(sandbox.engine(), id)
  local now = math.floor(loop.time())
  local max = math.floor(config.get("ttl_max"))
  local new = math.max(sb.expires_at or now, now) + secs
  if new - now > max then
    return refuse(conn, 400, ("seconds: the sandbox would expire in %d s, above ttl_max (%d s, the demesne "
      .. "configuration's ceiling)"):format(new - now, max), "EINVAL")
  end
  sandbox.write_expiry(sb.run_dir, new)
  log.notice(LOGGER, "%s: TTL extended by %d s from the cockpit (expires at %s)", id, secs, util.iso(new))
  answer(conn, 200, { run_id = id, expires_at = new })
end

local function raise_budget(conn, id, b)
  local n, err = own_node(id)
  if not n then return refuse(conn, 404, err, "ENOENT") end
  local r = store.get(n.root)
  if not r then return refuse(conn, 404, ("no tree of %s"):format(id), "ENOENT") end
  local usd = b.budget_usd
  if type(usd) ~= "number" or usd ~= usd or usd <= 0 or usd == math.huge then
    return refuse(conn, 400, "budget_usd: a number of USD above 0", "EINVAL")
  end
  local max = tonumber(config.get("tree_budget_usd_max")) or 0
  if max > 0 and usd > max then
    return refuse(conn, 400, ("budget_usd: $%s is above the ceiling of $%s (tree_budget_usd_max in the demesne "
      .. "configuration)"):format(store.money(usd), store.money(max)), "EINVAL")
  end
  if r.budget_usd and usd <= tonumber(r.budget_usd) then
    return refuse(conn, 400, ("budget_usd: $%s does not raise the tree's budget of $%s"):format(store.money(usd),
      store.money(r.budget_usd)), "EINVAL")
  end
  if r.budget_spent then
    return refuse(conn, 409, ("tree %s has ended: its budget was spent"):format(r.run_id), "EALREADY")
  end
  r.budget_usd = usd
  store.save(r)
  log.notice(LOGGER, "tree %s: budget raised to $%s from the cockpit", r.run_id, store.money(usd))
  answer(conn, 200, { run_id = r.run_id, budget_usd = usd, spent_usd = tonumber(r.spent_usd) or 0 })
end

local function answer_ask(conn, id, b)
  if b.decision ~= "once" and b.decision ~= "run" and b.decision ~= "deny" then
    return refuse(conn, 400, "decision: one of once, run, deny", "EINVAL")
  end
  local ok, aerr = ask.answer(id, b.decision, "cockpit")
  if not ok then return refuse(conn, 404, tostring(aerr), "ENOENT") end
  answer(conn, 200, { id = id, decision = b.decision })
end

-- What the event stream watches: a digest of the trees and the pending questions.
local function digest()
  local ok, trees = pcall(view.trees)
  if not ok then return state.digest end
  for _, t in ipairs(trees) do
    for _, n in ipairs(t.nodes) do
      n.elapsed_seconds = nil -- it moves on its own: the page counts it
      -- the memory used moves all the time: a change of a whole MiB is one worth an event
      n.memory_used_bytes = n.memory_used_bytes and n.memory_used_bytes // 1048576
    end
  end
  return json.encode({ trees, asks() })
end

local function route(conn, req)
  local path = req.target:match("^[^?#]*")
  local m = req.method
  if m == "GET" and path == "/v1/server" then return answer(conn, 200, server_info()) end
  if m == "GET" and path == "/v1/trees" then
    local trees = view.trees()
    return answer(conn, 200, { server = server_info(), trees = trees, totals = view.totals(trees), asks = asks() })
  end
  if m == "GET" and path == "/v1/asks" then return answer(conn, 200, { asks = asks() }) end
  if m == "GET" and path == "/v1/events" then
    if not conn:start(200, SSE) then return end
    if next(state.streams) == nil then state.digest = digest() end -- the first watcher: from now on
    state.streams[conn] = true
    conn:write(("event: changed\ndata: {\"seq\":%d}\n\n"):format(state.seq))
    return
  end
  local id, rest = path:match("^/v1/nodes/([%w][%w%-]*)(.*)$")
  if id then
    if m == "GET" and rest == "" then
      local d, err = view.detail(id)
      if not d then return refuse(conn, 404, err, "ENOENT") end
      return answer(conn, 200, d)
    end
    if m == "GET" and rest == "/log" then
      local n, err = view.node(id)
      if not n then return refuse(conn, 404, err, "ENOENT") end
      local q = query(req.target)
      local part, lerr = view.log(n, q.stream or "transcript", math.tointeger(tonumber(q.from) or 0) or 0)
      if not part then return refuse(conn, 400, lerr, "EINVAL") end
      return answer(conn, 200, part)
    end
    if m == "GET" and rest == "/file" then
      local n, err = view.node(id)
      if not n then return refuse(conn, 404, err, "ENOENT") end
      local data, ferr, code = view.file(n, query(req.target).path)
      if not data then return refuse(conn, code == "EINVAL" and 400 or 404, "path: " .. tostring(ferr), code) end
      return conn:respond(200, { ["Content-Type"] = "application/octet-stream" }, data)
    end
    if m == "POST" and rest == "/cancel" then return cancel(conn, id, body_of(req)) end
    if m == "POST" and rest == "/ttl" then return extend(conn, id, body_of(req)) end
  end
  local tid = path:match("^/v1/trees/([%w][%w%-]*)/budget$")
  if tid and m == "POST" then return raise_budget(conn, tid, body_of(req)) end
  local aid = path:match("^/v1/asks/([%w%-_%.]+)$")
  if aid and m == "POST" then return answer_ask(conn, aid, body_of(req)) end
  refuse(conn, 404, ("no %s %s in the control API"):format(m, path), "ENOENT")
end

local function on_request(conn, req)
  async.spawn("control request", function()
    local ok, err = pcall(route, conn, req)
    if not ok and conn:is_open() then
      if errors.is(err) then
        pcall(refuse, conn, err.code == "ENOENT" and 404 or 400, err.message, err.code)
      else
        log.error(LOGGER, "control request %s %s: %s", req.method, req.target, tostring(err))
        pcall(refuse, conn, 500, "internal error", "EINTERNAL")
      end
    end
  end)
end

local function tick()
  if not state or next(state.streams) == nil then return end -- nobody watches: nothing is read
  local d = digest()
  if d == state.digest then return end
  state.digest = d
  state.seq = state.seq + 1
  local ev = ("event: changed\ndata: {\"seq\":%d}\n\n"):format(state.seq)
  for c in pairs(state.streams) do
    if c:is_open() then c:write(ev) else state.streams[c] = nil end
  end
end

--- Registers this server in the control folder and serves the control API on its socket.
--- Failures are logged (the server runs on without a cockpit). Idempotent.
---@param info {transport: string, urls: string[]|nil}
---@return boolean ok
function control.start(info)
  if state then return true end
  local dir, err = registry.ensure()
  if not dir then
    log.warning(LOGGER, "no control socket (%s): demesne ps and demesne ui will not see this server", err)
    return false
  end
  state = { streams = {}, seq = 0 }
  state.http = httpd.new({ max_body = 64 * 1024, max_output = 32 * 1024 * 1024, max_conns = 64 }, on_request,
    function(conn) if state then state.streams[conn] = nil end end)
  local path = registry.socket_path(loop.getpid())
  local ok, lerr = state.http:listen_unix(path, { tag = "control" })
  if not ok then
    log.warning(LOGGER, "no control socket at %s (%s): demesne ps and demesne ui will not see this server", path,
      tostring(lerr))
    state.http:close()
    state = nil
    return false
  end
  pcall(runs.prune)
  local entry, rerr = registry.register(info)
  if not entry then
    log.warning(LOGGER, "%s: demesne ps and demesne ui will not see this server", rerr)
  end
  state.entry = entry
  state.tick = timer.new()
  state.tick:start(TICK_MS, TICK_MS, function() async.spawn("cockpit tick", tick) end)
  state.keepalive = timer.new()
  state.keepalive:start(KEEPALIVE_MS, KEEPALIVE_MS, function()
    for c in pairs(state.streams) do
      if c:is_open() and c:queued() < 65536 then c:write(": keepalive\n\n") end
    end
  end)
  -- a question asked or answered shows at once (fn runs on the loop and must not wait)
  state.unsubscribe = ask.subscribe(function() async.spawn("cockpit tick", tick) end)
  log.info(LOGGER, "control socket %s", path)
  return true
end

--- Records the URLs this server listens on (an HTTP server's, once bound) in its entry.
---@param urls string[]
function control.set_urls(urls)
  if not state or not state.entry then return end
  local entry = registry.register({ transport = state.entry.transport, urls = urls, started_ms = state.entry.started_ms })
  if entry then state.entry = entry end
end

--- Unregisters and stops serving (the socket file goes). Idempotent.
function control.stop()
  if not state then return end
  registry.unregister()
  if state.unsubscribe then state.unsubscribe() end
  state.tick:close()
  state.keepalive:close()
  state.http:close()
  state = nil
end

return control
