-- OAuth 2.0 helpers for provider adapters that keep a login on the host (Codex's ChatGPT
-- login): the refresh-token grant (RFC 6749 §6), reading a JWT's claims (RFC 7519; the
-- signature is not checked: only the expiry is read, from a token we hold), and writing a
-- login file back atomically with mode 0600.
local async = require("demesne.async")
local fs = require("core.fs")
local http = require("core.http")
local loop = require("core.loop")
local json = require("demesne.json")
local util = require("demesne.util")

local oauth = {}

--- Decodes base64url (RFC 4648 §5; the standard alphabet and padding are accepted too):
--- util.base64_decode. Returns the bytes, or nil when `s` holds other characters.
---@param s string
---@return string|nil
function oauth.base64url_decode(s) return util.base64_decode(s) end

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

-- The grant itself (see oauth.refresh). Returns tokens or nil, err, status.
local function grant(o)
  local fields = { grant_type = "refresh_token", refresh_token = o.refresh_token, client_id = o.client_id,
    scope = o.scope }
  local body, ctype
  if o.json then
    body, ctype = json.encode(fields), "application/json"
  else
    local parts = {}
    for _, k in ipairs({ "grant_type", "refresh_token", "client_id", "scope" }) do
      if fields[k] then
        parts[#parts + 1] = k .. "=" .. util.percent_encode(fields[k])
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
    if type(why) ~= "string" then why = nil end
    if type(t.error_description) == "string" then why = (why and (why .. ": ") or "") .. t.error_description end
    return nil, ("HTTP %d%s"):format(res.status, why and (": " .. why) or ""), res.status
  end
  if type(t.access_token) ~= "string" or t.access_token == "" then return nil, "the answer holds no access_token" end
  return t
end

--- The refresh-token grant: POSTs {grant_type = "refresh_token", refresh_token, client_id,
--- scope} to `o.url` as JSON (`o.json`, as Codex does) or as a form, and returns the
--- token response ({access_token, refresh_token?, id_token?, …}). The request runs in a
--- task of its own that every caller for the same token waits on (a refresh token may be
--- good for one use only): cancelling one caller does not fail the others. Must run inside
--- a task. Errors: nil, "HTTP <status>: <error>[: <error_description>]" or the transport's
--- message, and the HTTP status when there was one (400/401: the grant was refused).
---@param o {url: string, refresh_token: string, client_id: string|nil, scope: string|nil, json: boolean|nil, timeout_ms: integer|nil}
---@return table|nil tokens, string|nil err, integer|nil status
function oauth.refresh(o)
  local key = o.url .. "\0" .. o.refresh_token
  local ev = inflight[key]
  if not ev then
    ev = async.event()
    inflight[key] = ev
    async.spawn("oauth refresh", function()
      local ok, t, err, status = pcall(grant, o)
      inflight[key] = nil
      if ok then ev.set({ t, err, status }) else ev.set({ nil, tostring(t) }) end
    end)
  end
  local out = ev.wait()
  return out[1], out[2], out[3]
end

--- Checks that a file in `path`'s folder can be written and renamed over it (as
--- oauth.write_private_json will), before anything is spent: creates and removes a probe
--- file there. `path` is resolved through symlinks first. Returns the real path, or nil, err.
---@param path string
---@return string|nil real, string|nil err
function oauth.check_writable(path)
  local real = fs.realpath(path) or path
  local dir = real:match("^(.*)/[^/]*$") or "."
  local probe = ("%s/.demesne-write-check.%d"):format(dir, loop.getpid())
  local f, err = fs.open(probe, "wx", 384)
  if not f then
    if tostring(err):find("exist", 1, true) then fs.unlink(probe) f, err = fs.open(probe, "wx", 384) end
    if not f then return nil, ("%s cannot be rewritten: %s"):format(real, tostring(err)) end
  end
  f:close()
  fs.unlink(probe)
  return real
end

--- Writes a login file atomically with mode 0600, through a symlink to the file it names.
--- `t` is the new JSON object; `text` (optional) the file's current text: when given and
--- `changes` ({key = new string value}, keys unique in the text) can be made in place, only
--- those values are replaced, so the rest of the file keeps its exact form (big numbers,
--- empty arrays, key order). Returns true or nil, err.
---@param path string
---@param t table
---@param text string|nil
---@param changes table<string,string>|nil
---@return boolean|nil ok, string|nil err
function oauth.write_private_json(path, t, text, changes)
  local real = fs.realpath(path) or path
  local out
  if text and changes then
    out = text
    for k, v in pairs(changes) do
      local pat = '("' .. k:gsub("%p", "%%%0") .. '"%s*:%s*)"[^"\\]*"'
      local _, n = out:gsub(pat, "")
      if n ~= 1 then out = nil break end
      local enc = json.encode(v)
      out = out:gsub(pat, function(prefix) return prefix .. enc end)
    end
    -- the edit must read back as the object we mean
    if out then
      local ok, back = pcall(json.decode, out)
      for k, v in pairs(changes) do
        if not ok or type(back) ~= "table" or not (back[k] == v or (type(back.tokens) == "table" and back.tokens[k] == v)) then
          out = nil
          break
        end
      end
    end
  end
  if not out then
    local ok, enc = pcall(json.encode, t)
    if not ok then return nil, tostring(enc) end
    out = enc .. "\n"
  end
  return fs.write_atomic(real, out, 384) -- 0600
end

return oauth
