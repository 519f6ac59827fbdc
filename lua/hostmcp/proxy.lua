-- One host MCP server as a tool registry that an MCP session serves (the in-sandbox
-- endpoint's /mcp/host/<server>, lua/tree/endpoint.lua): its listing is the server's
-- allowed tools as lua/hostmcp lists them (filtered every time, following
-- notifications/tools/list_changed), and a call goes to hostmcp.call, which refuses a tool
-- that is not allowed before the upstream sees it and appends the call to mcp.jsonl in the
-- caller's output folder. Arguments are checked by the upstream against its own schema;
-- the result is the upstream's CallToolResult as it came.
--
-- The registry has the shape lua/mcp/server.lua uses (ToolRegistry: listing, get, list),
-- with `list_changed = true` (the session announces tools.listChanged) and a listing that
-- may fail (nil, why: the upstream cannot be reached). It sits beside the tools: it knows
-- nothing of trees or sandboxes; who the caller is and where its record goes come from
-- `opts.output_dir(ctx)`.
local errors = require("demesne.errors")
local hostmcp = require("demesne.hostmcp")
local json = require("demesne.json")

local proxy = {}

-- the Tool fields a listing passes on (MCP 2025-11-25 Tool; unknown ones are dropped)
local FIELDS = { "name", "title", "description", "inputSchema", "outputSchema", "annotations", "icons", "_meta" }

-- Arguments are the upstream's to check: the session only makes sure they are an object.
local ANY_OBJECT = { type = "object" }

---@class HostMcpRegistry
---@field server string
---@field list_changed boolean
local Registry = {}
Registry.__index = Registry

--- The server's allowed tools, for tools/list; nil and why when the upstream cannot be
--- reached or listed. Inside a task (it may start the upstream).
---@return table[]|nil tools, string|nil err
function Registry:listing()
  local list, err = hostmcp.list_tools(self.server)
  if not list then return nil, err end
  local out = json.array()
  for _, t in ipairs(list) do
    local e = {}
    for _, k in ipairs(FIELDS) do e[k] = t[k] end
    out[#out + 1] = e
  end
  return out
end

--- No tool is listed up front (the listing is live): an empty list.
---@return table[]
function Registry:list() return {} end

--- The descriptor that proxies a call of `name`. Any name gets one: hostmcp.call decides
--- (a tool that is not allowed, or not there, is refused as an isError result naming the
--- allowed tools, and the refusal is recorded).
---@param name string
---@return ToolDescriptor
function Registry:get(name)
  local server, opts = self.server, self.opts
  return {
    name = name,
    description = "",
    inputSchema = ANY_OBJECT,
    origin = "host MCP server " .. server,
    run = function(ctx, args)
      local out = opts.output_dir and opts.output_dir(ctx) or nil
      local res, err = hostmcp.call(server, name, args, {
        output_dir = out,
        on_progress = function(p)
          if type(p) == "table" and type(p.progress) == "number" then
            ctx.progress(p.progress, type(p.total) == "number" and p.total or nil,
              type(p.message) == "string" and p.message or nil)
          end
        end,
      })
      if not res then errors.raise(("%s/%s: %s"):format(server, name, tostring(err))) end
      return res
    end,
  }
end

--- The registry of host MCP server `server` for a session.
--- `opts.output_dir(ctx)`: the caller's output folder (its mcp.jsonl gets each call), or nil.
---@param server string
---@param opts {output_dir: (fun(ctx: ToolContext): string|nil)|nil}|nil
---@return HostMcpRegistry
function proxy.registry(server, opts)
  return setmetatable({ server = server, opts = opts or {}, list_changed = true }, Registry)
end

return proxy
