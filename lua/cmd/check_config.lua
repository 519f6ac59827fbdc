-- `demesne check-config`: the effective configuration and where each value came from.
local config = require("demesne.config")
local engines = require("demesne.engines")
local http = require("demesne.mcp.http")

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
  if (config.get("engine_adapter") or "docker") ~= "docker" then
    local adapter, aerr = engines.check_adapter()
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("engine adapter file", adapter and adapter.origin or "not loaded",
      adapter and "loaded" or tostring(aerr)))
    err = err or aerr
  else
    local sock, tried = engines.discover()
    io.stdout:write(("%-20s = %-40s (%s)\n"):format("engine socket", tostring(sock or "none found"),
      sock and "discovered" or ("tried " .. table.concat(tried or {}, ", "))))
  end
  if err then
    io.stderr:write("demesne: config error: ", err, "\n")
    return 1
  end
  return 0
end
