-- Fuzz harness: an agent's transcript.jsonl as the host reads it when the run ends
-- (lua/agent.lua: agent.finish builds the sandbox_agent result and results.json from it
-- with the adapter's parse_answer; agent.decide reads it to resume a rate-limited session).
-- The CLI writes the transcript inside the sandbox, where the agent (or whatever it was
-- talked into) can write anything to it. Each input is the transcript of a claude_code run
-- and of a codex run that ended with exit code 1.
--
-- Findings: a Lua error; a result that breaks the tools' outputSchema; a decision that is
-- neither a resume with a session and a time nor a stop.
local agent = require("demesne.agent")
local providers = require("demesne.providers")
local schema = require("demesne.mcp.schema")
local fs = require("core.fs")
local fuzz = require("fuzzlib")
local check = fuzz.check

local reg = providers.load({ user_dir = false, quiet = true })
local dir = os.getenv("FUZZ_TMPDIR") .. "/agent"
assert(fs.mkdir_p(dir .. "/out", 448))
assert(fs.mkdir_p(dir .. "/run", 448))
local result_schema = agent.result_schema()

return function(data)
  assert(fs.write_atomic(dir .. "/out/transcript.jsonl", data))
  for _, name in ipairs({ "claude_code", "codex" }) do
    local p = assert(reg:get(name))
    local o = { provider = p, model = p.models[1].name or p.models[1], output_dir = dir .. "/out",
      run_dir = dir .. "/run", exec_id = "e1", run_id = "fuzz-agent" }
    local r = agent.finish(o, 1, nil, 10)
    local ok, errs = schema.validate(result_schema, r)
    check(ok, "%s: the result breaks its outputSchema: %s", name, errs and schema.format_errors(errs) or "")
    check(type(agent.text(r)) == "string", "%s: no text", name)
    local route = { rate = { budget = 3, used = 0, limited = 1, held = 0, resumed = 0, passed_at = 1, attempt_started = 0 },
      save_rate = function() end }
    local d = agent.decide(p, dir .. "/out", route, { attempt = 1, exit_code = 1 })
    check(type(d) == "table" and (d.action == "stop" or (d.action == "resume" and type(d.session) == "string"
      and type(d.at) == "number" and d.at == d.at)), "%s: decision %s", name, tostring(d and d.action))
  end
end
