-- What the host makes of a command's status.json (lua/sandbox.lua read_status), which a
-- process inside the sandbox can rewrite.
local sandbox = require("demesne.sandbox")
local schema = require("demesne.mcp.schema")
local tools = require("demesne.tools")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- Found while writing tests/fuzz/run_status (its seed regression-status-types): read_status kept
-- whatever JSON the file held, so a status.json rewritten inside a persistent sandbox with
-- "exit_code":"zzz" or "timed_out":{} made sandbox_exec's structuredContent break its own
-- outputSchema, which MCP clients check (the TypeScript SDK throws).
function tests.status_json_written_in_the_sandbox_cannot_break_the_output_schema(t)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-status-" .. hex(loop.random(6))
  assert(fs.mkdir_p(dir .. "/run/exec/e1", 448))
  assert(fs.mkdir_p(dir .. "/out", 448))
  local reg = tools.load({ user_dir = false, quiet = true })
  local ok, err = pcall(function()
    local cases = {
      { '{"exit_code":"zzz","timed_out":{"a":1},"oom_kills":"many","signal":[],"error":7}', 3, false },
      { '{"exit_code":1e300,"timed_out":"yes","cancelled":1}', 3, false },
      { '{"exit_code":2.5,"timed_out":true}', 3, true },
      { '[1,2,3]', 3, false },
      { '{"exit_code":137,"signal":9,"timed_out":false,"oom_kills":2}', 137, false },
    }
    for _, c in ipairs(cases) do
      assert(fs.write_atomic(dir .. "/run/exec/e1/status.json", c[1]))
      local e = { run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out", log_dir = dir .. "/out",
        sb = { expires_at = 0, memory_mb = 256 } }
      local r = sandbox.exec_result(e, 3, 10)
      local good, errs = schema.validate(reg:get("sandbox_exec").outputSchema, r)
      t:ok(good, "sandbox_exec result for " .. c[1] .. ": " .. (errs and schema.format_errors(errs) or ""))
      t:eq(r.exit_code, c[2], "exit code for " .. c[1])
      t:eq(r.timed_out, c[3], "timed_out for " .. c[1])
      local s = sandbox.script_result({ run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out",
        run_id = "r" }, 3, nil, 10)
      good, errs = schema.validate(reg:get("sandbox_script").outputSchema, s)
      t:ok(good, "sandbox_script result for " .. c[1] .. ": " .. (errs and schema.format_errors(errs) or ""))
    end
    local st = sandbox.read_status(dir .. "/run", "e1")
    t:eq(st.oom_kills, 2)
    t:match(sandbox.oom_note(st, 256), "killed 2 processes")
  end)
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

return tests
