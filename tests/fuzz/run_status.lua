-- Fuzz harness: a command's status.json as the host reads it back (lua/sandbox.lua:
-- read_status, then the sandbox_exec and sandbox_script results built from it). demesne-init
-- writes the file in the run folder, where any process of a persistent sandbox can rewrite
-- it; the host must make of it only what the tools' outputSchema allows.
--
-- Findings: a Lua error; a result that breaks its tool's outputSchema (MCP clients check
-- structuredContent against it); an OOM note that is not text.
local sandbox = require("demesne.sandbox")
local schema = require("demesne.mcp.schema")
local tools = require("demesne.tools")
local fs = require("core.fs")
local fuzz = require("fuzzlib")
local check = fuzz.check

local dir = os.getenv("FUZZ_TMPDIR") .. "/status"
assert(fs.mkdir_p(dir .. "/run/exec/e1", 448))
assert(fs.mkdir_p(dir .. "/out", 448))
local reg = tools.load({ user_dir = false, quiet = true })
local exec_schema = reg:get("sandbox_exec").outputSchema
local script_schema = reg:get("sandbox_script").outputSchema

local function valid(sch, r, what)
  local ok, errs = schema.validate(sch, r)
  check(ok, "%s breaks its outputSchema: %s", what, errs and schema.format_errors(errs) or "")
end

-- A forged record may be refused: then with a user-facing error naming status.json (never a
-- Lua error); otherwise the result must fit the tool's outputSchema.
local function result_or_refusal(what, sch, fn, ...)
  local ok, r = pcall(fn, ...)
  if ok then return valid(sch, r, what) end
  check(type(r) == "table" and r.demesne_error == true and type(r.message) == "string",
    "%s raised a Lua error: %s", what, tostring(r))
  check(r.message:find("status.json", 1, true) ~= nil, "%s refused without naming status.json: %s", what, r.message)
end

return function(data)
  assert(fs.write_atomic(dir .. "/run/exec/e1/status.json", data))
  local ok, st = pcall(sandbox.read_status, dir .. "/run", "e1")
  if ok and st then
    local note = sandbox.oom_note(st, 256)
    check(note == nil or type(note) == "string", "oom_note gave a %s", type(note))
  end
  local e = { run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out", log_dir = dir .. "/out",
    sb = { expires_at = 0, memory_mb = 256 } }
  result_or_refusal("sandbox_exec's result", exec_schema, sandbox.exec_result, e, 3, 10)
  result_or_refusal("sandbox_script's result", script_schema, sandbox.script_result,
    { run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out", run_id = "r" }, 3, nil, 10)
end
