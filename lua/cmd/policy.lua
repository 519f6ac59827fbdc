-- `demesne policy list` and `demesne policy test NAME HOST[:PORT]`: the egress policies and
-- what one of them decides for a host, without starting a sandbox.
--   demesne policy test package-managers pypi.org          -> ALLOW package-managers#2 pypi
--   demesne policy test none https://example.com            -> DENY none:default-deny
-- HOST may be a URL (http:// defaults to port 80, https:// to 443); a bare host defaults to
-- 443. Exit status: 0 allow, 1 deny, 3 ask (the connection would be held while the person
-- is asked), 2 usage or unknown policy.
local policy = require("demesne.egress.policy")
local proxy = require("core.proxy")

local USAGE = "usage: demesne policy list\n       demesne policy test NAME HOST[:PORT]|URL\n"

--- Parses HOST[:PORT] or a URL into the request the proxy would see.
---@return table|nil req, string|nil err
local function target(s)
  local scheme, rest = s:match("^(%a[%w+.-]*)://(.*)$")
  local default = 443
  if scheme then
    scheme = scheme:lower()
    if scheme == "http" then default = 80 elseif scheme ~= "https" then return nil, "only http:// and https:// URLs" end
    s = rest:match("^([^/?#]*)")
  end
  local host, port, ip = proxy.split_authority(s, default)
  if not host then return nil, port end
  return { host = host, port = port, ip = ip, method = scheme == "http" and "GET" or "CONNECT" }
end

local function list()
  local all, errors = policy.policies()
  local names = {}
  for n in pairs(all) do names[#names + 1] = n end
  table.sort(names)
  for _, n in ipairs(names) do
    local p = all[n]
    local marks = (p.unrestricted and " [open egress]" or "") .. (p.asks and " [asks]" or "")
    io.stdout:write(("%-20s %s%s (%s)\n"):format(n, p.description, marks, p.origin))
  end
  for _, e in ipairs(errors) do io.stderr:write("refused: ", e.message, "\n") end
  return #errors > 0 and 1 or 0
end

---@param args string[]
---@return integer status
return function(args)
  if args[1] == "list" then return list() end
  if args[1] ~= "test" or not args[2] or not args[3] or args[4] then
    io.stderr:write(USAGE)
    return 2
  end
  local pol, err = policy.policy(args[2])
  if not pol then
    io.stderr:write("demesne: ", err, "\n")
    return 2
  end
  local req, terr = target(args[3])
  if not req then
    io.stderr:write(("demesne: %s: %s\n"):format(args[3], terr))
    return 2
  end
  local verdict, rule = policy.decide(pol, req)
  local extra = ""
  if req.ip ~= 0 then extra = (" (address class: %s)"):format(proxy.classify(req.host)) end
  io.stdout:write(("%s %s:%d %s%s\n"):format(verdict, req.host, req.port, rule, extra))
  return verdict == policy.ALLOW and 0 or verdict == policy.ASK and 3 or 1
end
