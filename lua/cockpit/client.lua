-- The client side of the control plane (lua/cockpit/control.lua): the servers of this user
-- (lua/cockpit/registry.lua) and requests to their control sockets, for `demesne ps`,
-- `logs`, `cancel` and `ui`. Inside a task.
local async = require("demesne.async")
local errors = require("demesne.errors")
local json = require("demesne.json")
local registry = require("demesne.cockpit.registry")
local http = require("core.http")

local client = {}

local request = async.wrap(http.request)
local BODY_MAX = 64 * 1024 * 1024

--- The live servers of this user (registry.list()).
---@return table[]
function client.servers() return registry.list() end

--- One request to a server's control API. Returns status, the decoded JSON body (or the raw
--- body for a file), the headers and the raw body (a decoded empty array is {}: pass the
--- raw text on); nil and why when the server cannot be reached.
---@param entry table            a registry entry
---@param method string
---@param path string            "/v1/trees", …
---@param body table|nil         sent as JSON
---@param timeout_ms integer|nil default 120000
---@return integer|nil status, any body_or_err, table|nil headers, string|nil raw
function client.call(entry, method, path, body, timeout_ms)
  local res, err = request({ url = "http://localhost" .. path, unix_socket = entry.socket, method = method,
    headers = body and { ["Content-Type"] = "application/json" } or nil, body = body and json.encode(body) or nil,
    timeout_ms = timeout_ms or 120000, connect_timeout_ms = 5000, max_body_bytes = BODY_MAX })
  if not res then return nil, ("server %s: %s"):format(tostring(entry.pid), tostring(err)) end
  if (res.headers["content-type"] or ""):find("application/json", 1, true) then
    local v = json.decode(res.body)
    return res.status, v, res.headers, res.body
  end
  return res.status, res.body, res.headers, res.body
end

--- The message of an error answer ({error = {message}}), or a generic one.
---@param status integer|nil
---@param body any
---@return string
function client.message(status, body)
  if type(body) == "table" and type(body.error) == "table" and type(body.error.message) == "string" then
    return body.error.message
  end
  if status == nil then return tostring(body) end
  return ("the server answered %s"):format(tostring(status))
end

--- The server that holds the tree node `id`: entry and its detail, or fails (ENOENT) naming
--- the servers asked.
---@param id string
---@return table entry, table detail
function client.find(id)
  if type(id) ~= "string" or not id:match("^[%w][%w%-]*$") or #id > 64 then
    errors.raise(("ID: %q is not a run id"):format(tostring(id)), "EINVAL")
  end
  local servers = client.servers()
  for _, e in ipairs(servers) do
    local status, d = client.call(e, "GET", "/v1/nodes/" .. id, nil, 30000)
    if status == 200 and type(d) == "table" then return e, d end
  end
  errors.raise(("ID: no run %s (tree node, job or sandbox) in the %d running demesne server(s) of this user"):format(id,
    #servers),
    "ENOENT")
end

--- Follows a server's event stream: on_event(name, data) for each event (data decoded when
--- JSON) until it ends; then on_end(err). Returns a handle with cancel().
---@param entry table
---@param on_event fun(name: string, data: any)
---@param on_end fun(err: string|nil)
---@return table|nil handle, string|nil err
function client.events(entry, on_event, on_end)
  local buf = ""
  local req, err = http.request({ url = "http://localhost/v1/events", unix_socket = entry.socket,
    connect_timeout_ms = 5000, on_data = function(chunk)
      buf = buf .. chunk
      while true do
        local block, rest = buf:match("^(.-)\r?\n\r?\n(.*)$")
        if not block then break end
        buf = rest
        local name, data = "message", {}
        for line in block:gmatch("[^\r\n]+") do
          local k, v = line:match("^(%w+): ?(.*)$")
          if k == "event" then name = v elseif k == "data" then data[#data + 1] = v end
        end
        if #data > 0 then
          local text = table.concat(data, "\n")
          local v = json.decode(text)
          on_event(name, v == nil and text or v)
        end
      end
      if #buf > 1024 * 1024 then buf = "" end
    end }, function(_, e) on_end(e) end)
  if not req then return nil, err end
  return req
end

return client
