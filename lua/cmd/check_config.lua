-- `demesne check-config`: the effective configuration and where each value came from,
-- the engine socket, the warm sandboxes (lua/pool.lua) the engine holds, and the host MCP
-- servers.
local async = require("demesne.async")
local config = require("demesne.config")
local engines = require("demesne.engines")
local http = require("demesne.mcp.http")
local hostmcp = require("demesne.hostmcp")
local pool = require("demesne.pool")
local registries = require("demesne.registries")

-- The warm pool: its settings in one line, then each warm sandbox on the engine.
local function show_pool()
  local size = config.get("pool_size")
  if size <= 0 then
    io.stdout:write(("%-20s = %s\n"):format("warm pool", "off (pool_size = 0)"))
  else
    local idle = config.get("pool_idle_seconds")
    io.stdout:write(("%-20s = %d per kind, %d in all, idle after %s, warmed at start: %s\n"):format("warm pool", size,
      math.floor(config.get("pool_max")), idle > 0 and (idle .. " s") or "never",
      table.concat(config.get("pool_images") or {}, ",")))
  end
  local rows, err
  local _, terr = async.main("check-config pool", function()
    local eng, eerr = engines.get()
    if not eng then err = eerr return end
    local r, e, code = async.timeout(10000, pool.on_engine, eng) -- an engine that hangs must not hang us
    rows, err = r, (code == "ETIMEDOUT" and "the engine did not answer within 10 s" or e)
  end)
  if not rows then
    io.stdout:write(("%-20s = %s\n"):format("warm sandboxes", "unknown (" .. tostring(err or terr) .. ")"))
    return
  end
  io.stdout:write(("%-20s = %d on the engine\n"):format("warm sandboxes", #rows))
  for _, r in ipairs(rows) do
    io.stdout:write(("  %s  %-8s image %s, egress %s, %s, owner %s\n"):format(tostring(r.run_id), tostring(r.state),
      tostring(r.image), tostring(r.egress),
      r.claimed and "claimed by a call" or r.starting and "starting" or "waiting", tostring(r.owner)))
  end
end

-- The registries of config.lua (mirrors, credentials on or off) and the credentials files
-- looked in (never a credential). Returns the section's error, if any.
local function registries_section()
  io.stdout:write("\nregistries (pulls of image references and FROM lines; image_pull = ",
    tostring(config.get("image_pull")), ")\n")
  local conf, err = registries.config()
  if not conf then
    io.stdout:write("  refused: ", err, "\n")
    return err
  end
  local names = {}
  for k in pairs(conf) do names[#names + 1] = k end
  table.sort(names)
  if #names == 0 then io.stdout:write("  none configured (every registry is pulled from directly)\n") end
  for _, n in ipairs(names) do
    local e = conf[n]
    io.stdout:write(("  %s  mirrors: %s  credentials: %s\n"):format(n,
      #e.mirrors > 0 and table.concat(e.mirrors, ", ") or "none", e.credentials and "the host's" or "none"))
  end
  local files = {}
  for _, f in ipairs(registries.auth_files()) do files[#files + 1] = f.path end
  io.stdout:write("  credentials looked for in: ", table.concat(files, ", "), "\n")
end

-- The host MCP servers that will be offered to agent sandboxes (server, origin, transport,
-- allowed tools) and the entries refused. Returns true when config.lua has an error there.
local function host_mcp_section()
  local ok, rows, problems = async.main("check-config: host MCP", hostmcp.describe)
  if not ok then
    io.stderr:write("demesne: host MCP servers: ", tostring(rows), "\n")
    return true
  end
  local import = config.get("host_mcp_import") or {}
  io.stdout:write(("\nhost MCP servers (offered to agent sandboxes; import: %s)\n"):format(
    #import > 0 and table.concat(import, ", ") or "off"))
  if #rows == 0 then io.stdout:write("  none\n") end
  for _, r in ipairs(rows) do
    io.stdout:write(("  %s  %s  %s\n    from:  %s\n    tools: %s%s\n"):format(r.name, r.transport, r.target, r.origin,
      r.tools, r.source ~= "config" and r.tools == "none" and " (imported: name its tools in host_mcp in config.lua)" or ""))
  end
  local failed = false
  for _, p in ipairs(problems) do
    io.stdout:write(("  %s: %s\n"):format(p.level == "error" and "refused" or "note", p.message))
    if p.level == "error" then failed = true end
  end
  return failed
end

return function()
  local d, err = config.describe()
  local names = {}
  for k in pairs(d) do names[#names + 1] = k end
  table.sort(names)
  io.stdout:write("config file: ", config.dir(), "/config.lua\n")
  for _, k in ipairs(names) do
    local v = d[k].value
    if type(v) == "table" then v = table.concat(v, ":") end
    if v == nil then v = "(unset)" end
    io.stdout:write(("%-20s = %-40s (%s)\n"):format(k, tostring(v), d[k].origin))
  end
  -- the bearer token of `serve --http`: where it comes from, never its value
  local tok, where = http.token(false)
  if tok then
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("http token", where == "$DEMESNE_HTTP_TOKEN" and "(set)" or where,
      where == "$DEMESNE_HTTP_TOKEN" and where or "file, mode 0600"))
  elseif os.getenv("DEMESNE_HTTP_TOKEN") and os.getenv("DEMESNE_HTTP_TOKEN") ~= "" then
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("http token", "(unusable)", where))
    err = err or where
  else
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("http token", http.token_path(),
      "created by the first `serve --http`; or set DEMESNE_HTTP_TOKEN"))
  end
  if engines.adapter_name() ~= "docker" then
    local adapter, aerr = engines.check_adapter()
    local builtin = adapter and adapter.origin == "built-in"
    io.stdout:write(("%-20s = %-40s (%s)\n"):format(builtin and "engine adapter" or "engine adapter file",
      adapter and (builtin and adapter.name or adapter.origin) or "not loaded",
      adapter and (builtin and "built-in" or "loaded") or tostring(aerr)))
    err = err or aerr
  else
    local sock, tried = engines.discover()
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("engine socket", tostring(sock or "none found"),
      sock and "discovered" or ("tried " .. table.concat(tried or {}, ", "))))
  end
  show_pool()
  err = err or registries_section()
  if host_mcp_section() then err = err or "host_mcp has refused entries (see above)" end
  if err then
    io.stderr:write("demesne: config error: ", err, "\n")
    return 1
  end
  return 0
end
