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
    -- forged records: a clear error naming the file and the field, never a result in a
    -- shape the outputSchema does not allow, never an internal Lua error
    local forged = {
      { '{"exit_code":"zzz","timed_out":{"a":1},"oom_kills":"many","signal":[],"error":7}', "exit_code" },
      { '{"exit_code":1e300,"timed_out":"yes","cancelled":1}', "exit_code" },
      { '{"exit_code":2.5,"timed_out":true}', "exit_code" },
      { '{"exit_code":3,"timed_out":"yes"}', "timed_out" },
      { '{"exit_code":3,"oom_kills":-1}', "oom_kills" },
      { '[1,2,3]', "status.json" },
    }
    local e = { run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out", log_dir = dir .. "/out",
      sb = { expires_at = 0, memory_mb = 256 } }
    for _, c in ipairs(forged) do
      assert(fs.write_atomic(dir .. "/run/exec/e1/status.json", c[1]))
      local rok, rerr = pcall(sandbox.exec_result, e, 3, 10)
      t:eq(rok, false, "a forged record is an error: " .. c[1])
      local msg = type(rerr) == "table" and rerr.message or tostring(rerr)
      t:ok(type(rerr) == "table" and rerr.demesne_error, "a user-facing error, not a Lua error: " .. msg)
      t:match(msg, "status%.json", "names the file: " .. msg)
      t:match(msg, c[2], "names what is wrong: " .. msg)
      local sok = pcall(sandbox.script_result, { run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out",
        run_id = "r" }, 3, nil, 10)
      t:eq(sok, false, "sandbox_script too: " .. c[1])
    end
    -- a well-formed record gives a result that fits the schema
    assert(fs.write_atomic(dir .. "/run/exec/e1/status.json", '{"exit_code":137,"signal":9,"timed_out":false,"oom_kills":2}'))
    local r = sandbox.exec_result(e, 3, 10)
    local good, errs = schema.validate(reg:get("sandbox_exec").outputSchema, r)
    t:ok(good, "sandbox_exec result: " .. (errs and schema.format_errors(errs) or ""))
    t:eq(r.exit_code, 137)
    local sres = sandbox.script_result({ run_dir = dir .. "/run", exec_id = "e1", output_dir = dir .. "/out", run_id = "r" },
      3, nil, 10)
    good, errs = schema.validate(reg:get("sandbox_script").outputSchema, sres)
    t:ok(good, "sandbox_script result: " .. (errs and schema.format_errors(errs) or ""))
    local st = sandbox.read_status(dir .. "/run", "e1")
    t:eq(st.oom_kills, 2)
    t:match(sandbox.oom_note(st, 256), "killed 2 processes")
  end)
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

return tests
