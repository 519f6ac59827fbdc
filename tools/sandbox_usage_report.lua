-- sandbox_usage_report: the cost and tokens of a sandbox tree (a run and everything it spawned).
local agent = require("demesne.agent")
local jobs = require("demesne.jobs")
local json = require("demesne.json")
local tree = require("demesne.tree")
local tools = require("demesne.tools")

local function fail(msg) error(tools.fail(msg), 0) end

local function text_of(r)
  local lines = {
    ("run_id: %s%s"):format(r.run_id, r.root ~= r.run_id and (" (tree root " .. r.root .. ")") or ""),
    ("total_cost_usd: %.4f (indicative)"):format(r.total_cost_usd),
  }
  if r.budget_usd then
    lines[#lines + 1] = ("budget_usd: %.2f, spent by the tree: %.4f, reserved by its requests in flight: %.4f%s")
      :format(r.budget_usd, r.tree_spent_usd, r.tree_reserved_usd or 0, r.budget_spent and " (spent: the tree was ended)" or "")
  end
  local t = r.tokens
  lines[#lines + 1] = ("tokens: input %d, output %d, cache_creation %d, cache_read %d (cache-read share %.1f%%)")
    :format(t.input, t.output, t.cache_creation, t.cache_read, r.cache_read_share * 100)
  if #r.by_model > 0 then
    lines[#lines + 1] = "--- by model ---"
    for _, m in ipairs(r.by_model) do
      lines[#lines + 1] = ("%s: %d requests, input %d, output %d, cache_creation %d, cache_read %d, $%.4f"):format(
        m.model, m.requests, m.input, m.output, m.cache_creation, m.cache_read, m.cost_usd)
    end
  end
  lines[#lines + 1] = "--- nodes (path, depth, kind, status, own cost) ---"
  for _, n in ipairs(r.nodes) do
    lines[#lines + 1] = ("%s  %d  %s  %s  $%.4f"):format(n.path ~= "" and n.path or "(this run)", n.depth, n.kind,
      n.status, n.cost_usd)
  end
  if r.continuation then
    lines[#lines + 1] = ("--- continuation (first to latest; together $%.4f) ---"):format(r.continuation.total_cost_usd)
    for _, c in ipairs(r.continuation.runs) do
      lines[#lines + 1] = ("%s  %s  $%.4f%s"):format(c.run_id, tostring(c.status), c.cost_usd or 0,
        c.continues and (" (continues " .. c.continues .. ")") or "")
    end
  end
  return table.concat(lines, "\n")
end

return {
  name = "sandbox_usage_report",
  title = "Cost and tokens of a sandbox tree",
  description = "Reports what a run and every sandbox it spawned (its tree of children, grandchildren, …) cost: "
    .. "the total in USD, tokens by type (input, output, cache creation, cache read) and by model, the share of "
    .. "prompt tokens read from cache, and one row per node (path of names, depth, kind, status, own cost). "
    .. "Name the run by run_id, or by the job_id of a background run. Works while the tree runs (live cost).",
  inputSchema = {
    type = "object",
    additionalProperties = false,
    properties = {
      run_id = { type = "string", minLength = 1, description = "The run_id of a sandbox_agent, sandbox_research "
        .. "or sandbox_script run, or the sandbox_id of a sandbox_create sandbox." },
      job_id = { type = "string", minLength = 1, description = "The job_id of a background run." },
    },
  },
  outputSchema = {
    type = "object",
    required = json.array({ "run_id", "root", "total_cost_usd", "tokens", "cache_read_share", "by_model", "nodes" }),
    properties = {
      run_id = { type = "string" },
      root = { type = "string", description = "the run at the top of the tree" },
      total_cost_usd = { type = "number", description = "indicative cost of the run and everything below it" },
      tokens = { type = "object", properties = { input = { type = "integer" }, output = { type = "integer" },
        cache_creation = { type = "integer" }, cache_read = { type = "integer" } } },
      cache_read_share = { type = "number", description = "cache_read / (input + cache_creation + cache_read), 0..1" },
      by_model = { type = "array", items = { type = "object", properties = { model = { type = "string" },
        requests = { type = "integer" }, input = { type = "integer" }, output = { type = "integer" },
        cache_creation = { type = "integer" }, cache_read = { type = "integer" }, cost_usd = { type = "number" } } } },
      nodes = { type = "array", items = { type = "object", properties = { run_id = { type = "string" },
        name = { type = "string" }, path = { type = "string" }, depth = { type = "integer" },
        kind = { type = "string" }, status = { type = "string" }, cost_usd = { type = "number" },
        tokens = { type = "integer" }, exit_code = { type = "integer" }, job_id = { type = "string" },
        output_dir = { type = "string" } } } },
      budget_usd = { type = "number", description = "the tree's budget, when it has one" },
      tree_spent_usd = { type = "number", description = "what the whole tree has spent (counted by its vendor routes)" },
      tree_reserved_usd = { type = "number", description = "what the tree's model requests in flight hold reserved "
        .. "against its budget (each the most it can still cost)" },
      budget_spent = { type = "boolean" },
      continuation = { type = "object", description = "when the run continues another or was continued "
        .. "(sandbox_agent `continue`): every run of the chain, first to latest, with its own cost, and their total",
        properties = { total_cost_usd = { type = "number" }, runs = { type = "array", items = { type = "object",
          properties = { run_id = { type = "string" }, status = { type = "string" }, cost_usd = { type = "number" },
            continues = { type = "string" }, exit_code = { type = "integer" } } } } } },
    },
  },
  annotations = { readOnlyHint = true, destructiveHint = false, idempotentHint = true, openWorldHint = false },
  run = function(ctx, args)
    local run_id = args.run_id
    if args.job_id then
      local rec = jobs.get(args.job_id)
      local visible = rec and (not ctx.caller or ctx.caller.sees_job(args.job_id))
      if not visible then
        fail(("job_id: no job %s (unknown, or its record was pruned after jobs_keep_seconds)"):format(args.job_id))
      end
      if run_id and rec.run_id ~= run_id then fail("run_id and job_id name different runs; give one") end
      run_id = rec.run_id or rec.sandbox_id
    end
    if not run_id then
      if not ctx.caller then fail("run_id or job_id: name the run to report on") end
      run_id = ctx.caller.run_id -- from inside a sandbox: its own subtree
    end
    if ctx.caller and not ctx.caller.sees_run(run_id) then
      fail(("run_id: no run %s in this sandbox's tree"):format(run_id))
    end
    local r, err = tree.report(run_id)
    if not r then fail("run_id: " .. err) end
    local chain = agent.chain(run_id)
    if chain and #chain > 1 then
      local runs, total = json.array(), 0
      for _, c in ipairs(chain) do
        if not ctx.caller or ctx.caller.sees_run(c.run_id) then
          runs[#runs + 1] = c
          total = total + (tonumber(c.cost_usd) or 0)
        end
      end
      r.continuation = { runs = runs, total_cost_usd = total }
    end
    return r, text_of(r)
  end,
}
