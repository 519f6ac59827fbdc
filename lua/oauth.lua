-- OAuth 2.0 helpers for provider adapters that keep a login on the host (Codex's ChatGPT
-- login): the refresh-token grant (RFC 6749 §6), reading a JWT's claims (RFC 7519; the
-- signature is not checked: only the expiry is read, from a token we hold), and writing a
-- login file back atomically with mode 0600.
local async = require("demesne.async")
local fs = require("core.fs")
local http = require("core.http")
local json = require("demesne.json")

local oauth = {}

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local B64_INDEX = {}
for i = 1, #B64 do B64_INDEX[B64:byte(i)] = i - 1 end

--- Decodes base64url (RFC 4648 §5; the standard alphabet and padding are accepted too).
--- Returns the bytes, or nil when `s` holds other characters.
---@param s string
---@return string|nil
function oauth.base64url_decode(s)
  if type(s) ~= "string" then return nil end
  s = s:gsub("=+$", ""):gsub("%-", "+"):gsub("_", "/")
  local out, bits, nbits = {}, 0, 0
  for i = 1, #s do
    local v = B64_INDEX[s:byte(i)]
    if not v then return nil end
    bits = (bits << 6) | v
    nbits = nbits + 6
    if nbits >= 8 then
      nbits = nbits - 8
      out[#out + 1] = string.char((bits >> nbits) & 0xff)
    end
  end
  return table.concat(out)
end

--- The claims of a JWT (its middle part, decoded), or nil when `token` is not a JWT.
---@param token string
---@return table|nil
function oauth.jwt_claims(token)
  if type(token) ~= "string" then return nil end
  local payload = token:match("^[%w%-_]+%.([%w%-_]+)%.[%w%-_]*$")
  local text = payload and oauth.base64url_decode(payload)
  local ok, claims = pcall(json.decode, text or "")
  return ok and type(claims) == "table" and claims or nil
end

local request = async.wrap(http.request)
local inflight = {} -- url .. refresh token -> event of the refresh in flight

--- The refresh-token grant: POSTs {grant_type = "refresh_token", refresh_token, client_id,
--- scope} to `o.url` as JSON (`o.json`, as Codex does) or as a form, and returns the
--- token response ({access_token, refresh_token?, id_token?, …}). Concurrent calls for the
--- same token share one request (a refresh token may be good for one use only). Must run
--- inside a task. Errors: nil and "HTTP <status>: <error, error_description>" or the
--- transport's message.
---@param o {url: string, refresh_token: string, client_id: string|nil, scope: string|nil, json: boolean|nil, timeout_ms: integer|nil}
---@return table|nil tokens, string|nil err
function oauth.refresh(o)
  local key = o.url .. "\0" .. o.refresh_token
  local ev = inflight[key]
  if ev then return table.unpack(ev.wait(), 1, 2) end
  ev = async.event()
  inflight[key] = ev
  local result = { pcall(function()
    local fields = { grant_type = "refresh_token", refresh_token = o.refresh_token, client_id = o.client_id,
      scope = o.scope }
    local body, ctype
    if o.json then
      body, ctype = json.encode(fields), "application/json"
    else
      local parts = {}
      for _, k in ipairs({ "grant_type", "refresh_token", "client_id", "scope" }) do
        if fields[k] then
          parts[#parts + 1] = k .. "=" .. tostring(fields[k]):gsub("[^%w%-_.~]", function(c)
            return ("%%%02X"):format(c:byte())
          end)
        end
      end
      body, ctype = table.concat(parts, "&"), "application/x-www-form-urlencoded"
    end
    local res, err = request({ url = o.url, method = "POST", body = body, timeout_ms = o.timeout_ms or 30000,
      connect_timeout_ms = 10000, headers = { ["content-type"] = ctype, accept = "application/json" },
      max_body_bytes = 1 << 20 })
    if not res then return nil, tostring(err) end
    local ok, t = pcall(json.decode, res.body or "")
    t = ok and type(t) == "table" and t or {}
    if res.status ~= 200 then
      local why = type(t.error) == "string" and t.error or type(t.error) == "table" and t.error.message or nil
      if type(t.error_description) == "string" then why = (why and (why .. ": ") or "") .. t.error_description end
      return nil, ("HTTP %d%s"):format(res.status, why and (": " .. why) or "")
    end
    if type(t.access_token) ~= "string" or t.access_token == "" then return nil, "the answer holds no access_token" end
    return t
  end) }
  inflight[key] = nil
  local out
  if result[1] then out = { result[2], result[3] } else out = { nil, tostring(result[2]) } end
  ev.set(out)
  if not result[1] and result[2] == async.CANCELLED then error(result[2], 0) end
  return table.unpack(out, 1, 2)
end

--- Writes a login file (a JSON object) atomically with mode 0600. Returns true or nil, err.
---@param path string
---@param t table
function oauth.write_private_json(path, t)
  local ok, text = pcall(json.encode, t)
  if not ok then return nil, tostring(text) end
  return fs.write_atomic(path, text .. "\n", 384) -- 0600
end

return oauth
