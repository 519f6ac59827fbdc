-- The host's own proxy, which the egress proxy sends allowed requests on through: a
-- corporate proxy named by HTTPS_PROXY / HTTP_PROXY and skipped for NO_PROXY, as curl and
-- most tools read them (or egress_https_proxy, egress_http_proxy, egress_no_proxy in the
-- configuration). The policy has judged the request first; this only says how an allowed
-- one leaves the host (core.proxy conn:allow_via).
local config = require("demesne.config")
local util = require("demesne.util")

local upstream = {}

-- "%41" -> "A" (userinfo in a proxy URL is percent-encoded, RFC 3986 §2.1)
local function unescape(s)
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end

--- Parses a proxy setting: "http://[user[:password]@]host[:port][/]" or "host:port" (a
--- scheme-less value is http, as curl takes it; the port defaults to 1080, curl's). The
--- host may be a name, an IPv4 address or a bracketed IPv6 address.
---@param field string  the setting's name, for errors
---@param url string
---@return {host: string, port: integer, authorization: string|nil, url: string}|nil proxy  nil for ""
---@return string|nil err  "field: reason" when the value is not a proxy URL
function upstream.parse(field, url)
  if type(url) ~= "string" or url == "" then return nil end
  local scheme, rest = url:match("^(%a[%w+.-]*)://(.*)$")
  if scheme and scheme:lower() ~= "http" then
    return nil, ("%s: %q: only http:// proxies are supported (the connection to the proxy is not TLS)"):format(field, url)
  end
  rest = (rest or url):gsub("/$", "")
  local userinfo, hostport = rest:match("^(.*)@([^@]*)$")
  hostport = hostport or rest
  local host, port = hostport:match("^%[([%x:.]+)%]:?(%d*)$")
  if not host then host, port = hostport:match("^([%w._-]+):?(%d*)$") end
  if not host or host == "" then
    return nil, ("%s: %q is not http://[user:password@]host:port"):format(field, url)
  end
  port = port ~= "" and tonumber(port) or 1080
  if port < 1 or port > 65535 then return nil, ("%s: %q: the port must be 1 to 65535"):format(field, url) end
  local auth
  if userinfo then auth = "Basic " .. util.base64(unescape(userinfo)) end
  return { host = host:lower(), port = math.tointeger(port), authorization = auth,
    url = ("http://%s%s:%d"):format(userinfo and "…@" or "", host, port) }
end

--- Whether `host` (normalised, as the proxy has it) on `port` is in a NO_PROXY list: "*";
--- a name, which also covers its subdomains (a leading "." or "*." is the same); an IP
--- address, exactly; any of these with ":port", for that port only.
---@param list string[]
---@param host string
---@param port integer
---@return boolean
function upstream.bypassed(list, host, port)
  for _, raw in ipairs(list or {}) do
    local e = raw:lower():gsub("^%s+", ""):gsub("%s+$", "")
    if e == "*" then return true end
    local name, p = e:match("^%[([%x:.]+)%]:?(%d*)$")
    if not name then name, p = e:match("^([^:]+):(%d+)$") end
    if not name then name, p = e, "" end
    name = name:gsub("^%*", ""):gsub("^%.", ""):gsub("%.$", "")
    if name ~= "" and (p == "" or tonumber(p) == port) then
      if host == name or (#host > #name and host:sub(-#name - 1) == "." .. name) then return true end
    end
  end
  return false
end

--- The upstream proxies of the configuration: {https = proxy|nil, http = proxy|nil,
--- no_proxy = {…}}, or nil and "field: reason" when a setting is not a proxy URL.
---@return table|nil settings, string|nil err
function upstream.settings()
  local https, e1 = upstream.parse("egress_https_proxy", config.get("egress_https_proxy"))
  if e1 then return nil, e1 end
  local http, e2 = upstream.parse("egress_http_proxy", config.get("egress_http_proxy"))
  if e2 then return nil, e2 end
  return { https = https, http = http, no_proxy = config.get("egress_no_proxy") }
end

--- The upstream proxy an allowed request goes through under `settings` (upstream.settings),
--- or nil to dial directly: the https one for a CONNECT, the http one for a plain request,
--- unless no_proxy covers the host and port.
---@param settings table
---@param req table  the request head ({host, port, form})
---@return {host: string, port: integer, authorization: string|nil, url: string}|nil
function upstream.for_request(settings, req)
  local p = req.form == "connect" and settings.https or settings.http
  if not p or upstream.bypassed(settings.no_proxy, req.host, req.port) then return nil end
  return p
end

return upstream
