-- `demesne ps`, `demesne logs` and `demesne cancel`: the cockpit's actions on a terminal,
-- over the control sockets of every running server of this user (lua/cockpit/client.lua).
-- docs/reference/cli.md#demesne-ps
local async = require("demesne.async")
local client = require("demesne.cockpit.client")
local errors = require("demesne.errors")
local json = require("demesne.json")
local terminal = require("demesne.terminal")
local loop = require("core.loop")

local cli = {}

local FOLLOW_MS = 500

local function out(s) io.stdout:write(s) end

-- Runs fn() in a task on the loop; returns its status, or 1 after printing the error.
local function run(cmd, fn)
  local status
  local task = async.spawn(cmd, function() status = fn() end)
  if not task.done then
    task:on_done(function() loop.stop() end)
    loop.run()
  end
  if not task.result[1] then
    io.stderr:write("demesne ", cmd, ": ", terminal.neutralise(errors.message(task.result[2]), true), "\n")
    return 1
  end
  return status or 0
end

local function money(x) return ("$%.4f"):format(tonumber(x) or 0) end

local function duration(s)
  s = math.floor(tonumber(s) or 0)
  if s < 60 then return s .. "s" end
  if s < 3600 then return ("%dm%02ds"):format(s // 60, s % 60) end
  return ("%dh%02dm"):format(s // 3600, (s % 3600) // 60)
end

local function cell(s, w)
  s = terminal.neutralise(tostring(s == nil and "-" or s), true)
  if #s > w then s = s:sub(1, w - 1) .. "~" end
  return s .. (" "):rep(w - #s)
end

local function mb(bytes) return bytes and ("%.1fM"):format(bytes / 1048576) or "-" end

--- `demesne ps [--json]`: every tree of every server, one row per node, indented by depth,
--- and every sandbox that is no tree node (a plain sandbox_script run or background job, a
--- persistent sandbox), with the memory each running one uses and its memory limit.
---@param args string[]
---@return integer status
function cli.ps(args)
  local as_json = false
  for _, a in ipairs(args) do
    if a == "--json" then as_json = true
    else io.stderr:write("demesne ps: unexpected argument '", a, "'\nusage: demesne ps [--json]\n") return 2 end
  end
  return run("ps", function()
    local all, raw = json.array(), json.array()
    for _, e in ipairs(client.servers()) do
      local status, body, _, text = client.call(e, "GET", "/v1/trees", nil, 30000)
      if status == 200 and type(body) == "table" then
        all[#all + 1] = body
        raw[#raw + 1] = json.raw(text, body) -- as it came (decoding loses the empty arrays)
      end
    end
    if as_json then
      out(json.encode({ servers = raw }) .. "\n")
      return 0
    end
    local cols = { { "SERVER", 14 }, { "RUN", 26 }, { "NAME", 22 }, { "KIND", 8 }, { "IMAGE", 12 }, { "ISOLATION", 9 },
      { "EGRESS", 16 }, { "STATUS", 10 }, { "ELAPSED", 8 }, { "MEMORY", 13 }, { "COST", 10 }, { "BUDGET LEFT", 11 } }
    local head = {}
    for _, c in ipairs(cols) do head[#head + 1] = cell(c[1], c[2]) end
    out(table.concat(head, " "):gsub("%s+$", "") .. "\n")
    local rows = 0
    for _, s in ipairs(all) do
      local srv = ("%s/%s"):format(tostring(s.server.transport), tostring(math.tointeger(s.server.pid) or s.server.pid))
      for _, t in ipairs(s.trees or {}) do
        for _, n in ipairs(t.nodes or {}) do
          local name = (" "):rep(2 * (n.depth or 0)) .. (n.name or n.standalone and (n.kind == "create"
            and "(persistent)" or n.job_id or "(" .. tostring(n.tool) .. ")") or (n.depth == 0 and "(root)" or "-"))
          local lim = type(n.limits) == "table" and tonumber(n.limits.memory_mb)
          local memory = ("%s/%s"):format(mb(tonumber(n.memory_used_bytes)), lim and (math.floor(lim) .. "M") or "-")
          local row = { cell(srv, 14), cell(n.run_id, 26), cell(name, 22), cell(n.kind, 8), cell(n.image, 12),
            cell(n.isolation, 9), cell(n.egress, 16), cell(n.status, 10), cell(duration(n.elapsed_seconds), 8),
            cell(memory, 13), cell(money(n.total_cost_usd), 10), cell(n.budget_left_usd and money(n.budget_left_usd) or "-", 11) }
          out(table.concat(row, " "):gsub("%s+$", "") .. "\n")
          rows = rows + 1
        end
      end
    end
    if rows == 0 then out(("(no trees or sandboxes in the %d running server(s))\n"):format(#all)) end
    return 0
  end)
end

--- `demesne logs ID [--stream transcript|stdout|stderr] [--follow]`: a run's transcript
--- (rendered) or log; with --follow, as it grows until the run ends.
---@param args string[]
---@return integer status
function cli.logs(args)
  local id, follow, stream
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--follow" or a == "-f" then follow = true
    elseif a == "--stream" then stream = args[i + 1] i = i + 1
    elseif a:match("^%-") or id then
      io.stderr:write("demesne logs: unexpected argument '", a, "'\n",
        "usage: demesne logs ID [--stream transcript|stdout|stderr] [--follow]\n")
      return 2
    else id = a end
    i = i + 1
  end
  if not id then io.stderr:write("usage: demesne logs ID [--stream transcript|stdout|stderr] [--follow]\n") return 2 end
  return run("logs", function()
    local e = client.find(id)
    local from = 0
    stream = stream or "transcript"
    while true do
      local status, part = client.call(e, "GET", ("/v1/nodes/%s/log?stream=%s&from=%d"):format(id, stream, from))
      if status ~= 200 or type(part) ~= "table" then errors.raise(client.message(status, part)) end
      for _, l in ipairs(part.lines or {}) do out(tostring(l) .. "\n") end
      io.stdout:flush()
      from = math.tointeger(part.next) or from
      if part.eof or not follow then return 0 end
      if #(part.lines or {}) == 0 then async.sleep(FOLLOW_MS) end
    end
  end)
end

--- `demesne cancel ID [--subtree]`: ends a run (with --subtree, its running children too;
--- a run with running children is refused without it).
---@param args string[]
---@return integer status
function cli.cancel(args)
  local id, subtree
  for _, a in ipairs(args) do
    if a == "--subtree" then subtree = true
    elseif a:match("^%-") or id then
      io.stderr:write("demesne cancel: unexpected argument '", a, "'\nusage: demesne cancel ID [--subtree]\n")
      return 2
    else id = a end
  end
  if not id then io.stderr:write("usage: demesne cancel ID [--subtree]\n") return 2 end
  return run("cancel", function()
    local e = client.find(id)
    local status, body = client.call(e, "POST", "/v1/nodes/" .. id .. "/cancel", { subtree = subtree == true }, 300000)
    if status ~= 200 then errors.raise(client.message(status, body)) end
    out(("%s: %s\n"):format(id, tostring(body.status)))
    return 0
  end)
end

return cli
