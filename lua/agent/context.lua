-- The context file of an agent run (CLAUDE.md, AGENTS.md, …): what the agent is told about
-- its sandbox, its network and the definition of done, then the task.
local context = {}

local AGENT_DIR = "/.demesne/agent" -- the run's read-only folder in the sandbox (lua/agent/init.lua mounts it)

local EGRESS_TEXT = {
  none = "There is no network access except the model API (used by your CLI itself). Package installs and "
    .. "downloads will fail; work with what is in the image and the inputs.",
  ["package-managers"] = "Outbound access is limited to package registries (npm, PyPI, Debian archives, …) "
    .. "through an HTTP proxy already configured in the environment. Other hosts are refused.",
  open = "Outbound network access is open (no host inputs are mounted).",
}

--- The context file's text for the run planned in `o` (agent.prepare) and the call's args.
---@param o table     the plan: mounts, egress
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
  add("- `/workspace`: your writable working folder (scratch; discarded after the run).")
  add("- `/out`: the deliverables folder. Everything written here is kept on the host.")
  add(("- `%s`: this file and the task (read-only)."):format(AGENT_DIR))
  if #(o.mounts or {}) > 0 then
    add("- `/in`: read-only inputs from the host:")
    for _, m in ipairs(o.mounts) do
      if m.target:sub(1, 4) == "/in/" or m.target == "/in" then add("  - `" .. m.target .. "`") end
    end
  end
  add("")
  add("## Network")
  add("")
  add(EGRESS_TEXT[o.egress.name] or ("Egress policy `" .. o.egress.name .. "`: other hosts are refused."))
  add("")
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
