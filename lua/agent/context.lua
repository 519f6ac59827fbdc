-- The context file of an agent run (CLAUDE.md, AGENTS.md, …): what the agent is told about
-- its sandbox, its network, the child sandboxes it may spawn (lua/tree), the definition of
-- done, then the task.
local text = require("core.text")

local context = {}

--- The name of demesne's own MCP server on the in-sandbox endpoint (agent.MCP_SERVER): a
--- host MCP server of that name is never wired nor listed.
context.MCP_SERVER = "demesne"
local HOST_DESCRIPTION_MAX = 160

local AGENT_DIR = "/.demesne/agent" -- the run's read-only folder in the sandbox (lua/agent/init.lua mounts it)

local EGRESS_TEXT = {
  none = "There is no network access except the model API (used by your CLI itself). Package installs and "
    .. "downloads will fail; work with what is in the image and the inputs.",
  ["package-managers"] = "Outbound access is limited to package registries (npm, PyPI, Debian archives, …) "
    .. "through an HTTP proxy already configured in the environment. Other hosts are refused.",
  open = "Outbound network access is open (no host inputs are mounted).",
}

-- A sum in USD for the context file: cents, or four decimals below a cent.
local function usd(x)
  if x >= 0.01 or x == 0 then return ("$%.2f"):format(x) end
  return ("$%.4f"):format(x)
end

--- Adds the context file's section on child sandboxes (through the `demesne` MCP server) to
--- `add`, when the run's CLI is wired to its endpoint (o.run.mcp_servers). The limits come
--- from o.endpoint.tree (lua/tree's tree.info: {depth, limits = {depth, children, running},
--- children_used, budget_usd, spent_usd}); missing ones are left out.
---@param o table  the plan
---@param add fun(line: string)
function context.children(o, add)
  local servers = o.run and o.run.mcp_servers
  if type(o.endpoint) ~= "table" then return end
  if not servers or #servers == 0 then
    add("## demesne")
    add("")
    add("demesne's MCP server (Streamable HTTP) is at `$DEMESNE_MCP_URL` with `Authorization: Bearer "
      .. "$DEMESNE_MCP_TOKEN`; your CLI is not connected to it.")
    add("")
    return
  end
  local t = type(o.endpoint.tree) == "table" and o.endpoint.tree or {}
  local limits = type(t.limits) == "table" and t.limits or {}
  local depth, max = tonumber(t.depth), tonumber(limits.depth)
  add("## Child sandboxes (the `demesne` tools)")
  add("")
  add("You can hand work to child sandboxes with the tools of the MCP server `demesne` (already connected, no "
    .. "approval needed). Each child is a fresh disposable container started by the host, not inside yours.")
  if o.provider.mcp_hint then
    local ok, hint = pcall(o.provider.mcp_hint, servers[1].name)
    if ok and type(hint) == "string" and hint ~= "" then add(hint) end
  end
  add("")
  add("- `sandbox_script`: run a shell command in a fresh sandbox (pick an `image`); returns its exit code and output.")
  add("- `sandbox_agent`: another AI agent with a prompt of its own (and a `model`); `sandbox_research`: an agent "
    .. "with open network access and no inputs, for web research. To send more work to an agent child that "
    .. "ended (a reviewer's findings), call `sandbox_agent` with `continue: <its run_id>`, a new `name` and the new "
    .. "`prompt`: its own session resumes where it stopped.")
  add("- `sandbox_create`, `sandbox_exec`, `sandbox_destroy`: a sandbox that stays up for several commands; "
    .. "`sandbox_snapshot`, `sandbox_fork` (a snapshot and `count` new sandboxes from it, each a child of yours), "
    .. "`sandbox_snapshots`, `sandbox_snapshot_delete`, `sandbox_pause`, `sandbox_resume` for those sandboxes.")
  add("- `sandbox_status`, `sandbox_wait`, `sandbox_cancel`, `sandbox_jobs`: children running in the background.")
  add("- `sandbox_usage_report`: the cost and tokens of everything below you.")
  add("")
  add("How children relate to you:")
  add("")
  add("- Every spawning call takes a `name`: lowercase letters, digits and inner hyphens, at most 40 characters, "
    .. "unique among your children for your whole run (a name is used up even when the spawn fails). Use "
    .. "distinct, descriptive names (`fetch-data`, `review-2`).")
  add("- A child's `/out` is your `/out/child/<name>/` (read-only for you): read its results there.")
  add("- Script, create and agent children see your `/in` read-only and share your `/workspace` read-write: hand "
    .. "them files through `/workspace` and give each child its own paths to write.")
  add("- A child sees the output of each child you spawned before it at `/in/previous-jobs/<name>/`.")
  add("- `sandbox_research` children get none of that (no `/in`, no `/workspace`, no previous jobs), and their "
    .. "`/out` appears at `/out/child/<name>/` (and to later children) only once they have ended.")
  add("- A child's egress is never wider than yours; `open` is only for `sandbox_research`.")
  add("- A child runs with your isolation and your limits (memory, CPUs, processes) or less, and the tree's running "
    .. "sandboxes share its totals: ask a child for less when several run at once. Its image is one of demesne's "
    .. "or the user's (already built), or one the host configured.")
  add("- Children you leave running are cancelled when you finish.")
  add("")
  add("Habits that work:")
  add("")
  add("- Fan out with `background: true`: each spawn answers at once with a `job_id`. Then call `sandbox_wait` "
    .. "on every job as a barrier. From here `sandbox_wait` waits at most a few minutes and then answers "
    .. "`status: running`: call it again until the status is final. Block (no `background`) only for short calls.")
  add("- Check each child's `status` and `exit_code`; for a failed one read `/out/child/<name>/stderr.log` (a "
    .. "script) or its `results.json` and `transcript.jsonl` (an agent).")
  add("- Verify claims with a script child (build, run the tests) instead of trusting an answer.")
  add("- Your caller reads your `/out` and your final message, not your children's answers: copy or summarise "
    .. "what must surface into your own `/out` files yourself (a child cannot write there).")
  add("")
  add("Limits of this tree:")
  add("")
  if depth and max then
    if depth >= max then
      add(("- You are at depth %d, the deepest allowed (%d): you cannot spawn children; do the work yourself."):format(
        depth, max))
    else
      add(("- You are at depth %d (the host's run is 0); children may go down to depth %d."):format(depth, max))
    end
  end
  if tonumber(limits.children) then
    add(("- At most %d children in your run."):format(math.floor(limits.children)))
  end
  if tonumber(limits.running) then
    add(("- At most %d sandboxes of the whole tree run at once (you included); a spawn past that waits its turn.")
      :format(math.floor(limits.running)))
  end
  local budget = tonumber(t.budget_usd)
  if budget then
    local spent = tonumber(t.spent_usd) or 0
    add(("- The whole tree may spend %s on model requests (%s left when you started). Past it every model request "
      .. "is refused and every run of the tree ends: prefer scripts to agents where a script will do, and a "
      .. "cheaper model for simple work."):format(usd(budget), usd(math.max(budget - spent, 0))))
  else
    add("- No budget is set for the tree's model requests; spend with care all the same.")
  end
  add("")
end

--- Adds the context file's section on the host MCP servers offered to the run (o.host_mcp,
--- set by lua/tree's plan hook: {name, tools = {{name, description}} | nil, error}), when
--- the run's CLI is wired to them: each server with its allowed tools (a description's first
--- line, bounded).
---@param o table  the plan
---@param add fun(line: string)
function context.host_mcp(o, add)
  local wired = {}
  for _, m in ipairs(o.run and o.run.mcp_servers or {}) do wired[m.name] = true end
  local list = {}
  for _, h in ipairs(type(o.host_mcp) == "table" and o.host_mcp or {}) do
    if wired[h.name] and h.name ~= context.MCP_SERVER then list[#list + 1] = h end
  end
  if #list == 0 then return end
  add("## Host tools (MCP servers of your operator)")
  add("")
  add("These MCP servers run on the host, not in your container, and are already connected (no approval "
    .. "needed). Only the tools listed here are offered. Files a tool writes on the host do not appear in "
    .. "your container: use what its result returns. Every call is recorded in `/out/mcp.jsonl`.")
  add(("Your CLI names their tools as it names any MCP server's: `mcp__<server>__<tool>` (e.g. `mcp__%s__%s`).")
    :format(list[1].name, list[1].tools and list[1].tools[1] and tostring(list[1].tools[1].name) or "<tool>"))
  add("")
  for _, h in ipairs(list) do
    if h.tools then
      add(("- `%s`: %s"):format(h.name, #h.tools == 0 and "no tools at the moment" or (#h.tools .. " tools")))
      for _, t in ipairs(h.tools) do
        local d = type(t.description) == "string" and t.description:match("^%s*([^\n]*)") or ""
        if #d > HOST_DESCRIPTION_MAX then d = d:sub(1, text.utf8_floor(d, HOST_DESCRIPTION_MAX)) .. "…" end
        add(("  - `%s`%s"):format(tostring(t.name), d ~= "" and (": " .. d) or ""))
      end
    else
      add(("- `%s`: its tools could not be listed when you started (%s); list them through your MCP client.")
        :format(h.name, tostring(h.error or "unknown error")))
    end
  end
  add("")
end

--- The context file's text for the run planned in `o` (agent.prepare) and the call's args.
---@param o table     the plan: mounts, egress, workspace, endpoint, provider, run
---@param args table  prompt, preamble, success_criteria, output_path, output_format
---@return string
function context.text(o, args)
  local out = {}
  local function add(s) out[#out + 1] = s end
  if args.preamble and args.preamble ~= "" then add(args.preamble) add("") end
  add("# Your environment")
  add("")
  add("You run with full autonomy inside a disposable Linux container that is removed when you finish. "
    .. "Nobody answers questions: decide and proceed.")
  add("")
  if o.workspace and o.endpoint then
    add("- `/workspace`: your writable working folder, shared with the child sandboxes of your tree (removed "
      .. "when the run that made it ends).")
  else
    add("- `/workspace`: your writable working folder (scratch; discarded after the run).")
  end
  add("- `/out`: the deliverables folder. Everything written here is kept on the host.")
  add(("- `%s`: this file and the task (read-only)."):format(AGENT_DIR))
  if #(o.mounts or {}) > 0 then
    add("- `/in`: read-only inputs from the host:")
    for _, m in ipairs(o.mounts) do
      local sibling = m.target:match("^/in/previous%-jobs/(.+)$")
      if sibling then
        add(("  - `%s` (the output of `%s`, a child your parent spawned before you)"):format(m.target, sibling))
      elseif m.target:sub(1, 4) == "/in/" or m.target == "/in" then
        add("  - `" .. m.target .. "`")
      end
    end
  end
  add("")
  add("## Network")
  add("")
  add(EGRESS_TEXT[o.egress.name] or ("Egress policy `" .. o.egress.name .. "`: other hosts are refused."))
  add("")
  context.children(o, add)
  context.host_mcp(o, add)
  add("## Definition of done")
  add("")
  local any = false
  if args.success_criteria and #args.success_criteria > 0 then
    for _, c in ipairs(args.success_criteria) do add("- [ ] " .. c) any = true end
  end
  if args.output_path then
    add(("- [ ] The deliverable is written to `/out/%s`%s."):format(args.output_path,
      args.output_format and (" as " .. args.output_format) or "")) any = true
  elseif args.output_format then
    add("- [ ] Deliverables in `/out` are in this format: " .. args.output_format) any = true
  end
  add("- [ ] Your final message summarises what you did and where the results are.")
  if not any then add("- [ ] The task below is complete.") end
  add("")
  add("## Task")
  add("")
  add(args.prompt)
  add("")
  return table.concat(out, "\n")
end

return context
