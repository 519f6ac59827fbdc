-- JSON Schema pieces shared by the sandbox tools, so every tool spells a parameter the same way.
local json = require("demesne.json")
local paths = require("demesne.paths")

local schemas = {}

function schemas.string_list(desc)
  return { type = "array", items = { type = "string" }, description = desc }
end

function schemas.files()
  return schemas.string_list("Host files mounted read-only at /in/<basename>. " .. paths.describe_roots())
end

function schemas.directories()
  return schemas.string_list("Host folders mounted read-only at /in/<basename>. " .. paths.describe_roots())
end

schemas.image = { type = "string", description =
  "Image: a built-in one (default: base + python3 + nodejs + build-essential + git; base; python; node; go) or the reference of an image present in the engine. Default: default." }

schemas.env = { type = "object", additionalProperties = { type = "string" },
  description = "Environment variables for the command (string values). Names starting with DEMESNE_ are reserved." }

schemas.timeout_seconds = { type = "integer", minimum = 1, description =
  "Seconds before the command's whole process group is killed. Default 3600; the ceiling comes from the configuration." }

schemas.limits = { type = "object", additionalProperties = false, description =
  "Resource limits; defaults and ceilings come from the configuration.",
  properties = {
    memory_mb = { type = "integer", minimum = 16, description = "memory limit in MiB" },
    cpus = { type = "number", minimum = 0.01, description = "CPU limit (fractional CPUs)" },
    pids = { type = "integer", minimum = 8, description = "maximum number of processes" },
  } }

schemas.sandbox_id = { type = "string", minLength = 1, description = "The id returned by sandbox_create." }

--- The result of a command: shared by sandbox_script and sandbox_exec.
function schemas.run_result(extra)
  local props = {
    exit_code = { type = "integer", description = "the command's exit status (128+N when killed by signal N)" },
    stdout = { type = "string", description = "head and tail of stdout (full stream in stdout.log)" },
    stderr = { type = "string", description = "head and tail of stderr (full stream in stderr.log)" },
    output_dir = { type = "string", description = "host folder that was /out; kept after the sandbox goes" },
    duration_ms = { type = "integer" },
    timed_out = { type = "boolean" },
    truncated = { type = "boolean", description = "true when stdout or stderr was cut; the logs hold everything" },
  }
  for k, v in pairs(extra or {}) do props[k] = v end
  return { type = "object", properties = props,
    required = json.array({ "exit_code", "stdout", "stderr", "output_dir", "duration_ms", "timed_out", "truncated" }) }
end

--- Readable text for a command result (the structured result carries the same).
function schemas.run_text(r)
  local lines = {
    ("exit_code: %d%s"):format(r.exit_code, r.timed_out and " (timed out)" or ""),
    "output_dir: " .. r.output_dir,
  }
  if r.run_id then lines[#lines + 1] = "run_id: " .. r.run_id end
  lines[#lines + 1] = ("duration_ms: %d"):format(r.duration_ms)
  lines[#lines + 1] = "--- stdout ---"
  lines[#lines + 1] = r.stdout
  lines[#lines + 1] = "--- stderr ---"
  lines[#lines + 1] = r.stderr
  return table.concat(lines, "\n")
end

return schemas
