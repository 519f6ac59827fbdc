local config = require("demesne.config")
local loop = require("core.loop")

local tests = {}

local function with_env(vars, fn)
  for k, v in pairs(vars) do loop.setenv(k, v) end
  config.load()
  local ok, err = pcall(fn)
  for k in pairs(vars) do loop.setenv(k, nil) end
  config.load()
  if not ok then error(err, 0) end
end

function tests.invalid_numbers_keep_the_default_and_say_why(t)
  with_env({ DEMESNE_OUTPUT_HEAD_BYTES = "-5", DEMESNE_TIMEOUT_MAX = "0" }, function()
    t:eq(config.get("output_head_bytes"), 32768)
    t:eq(config.get("timeout_max"), 48 * 3600)
    local _, err = config.describe()
    t:match(err, "must be a positive number")
  end)
  with_env({ DEMESNE_OUTPUT_TAIL_BYTES = "abc" }, function()
    local _, err = config.describe()
    t:match(err, "output_tail_bytes must be a number")
  end)
end

function tests.zero_switches_off_only_where_it_means_never(t)
  with_env({ DEMESNE_AGENT_RATE_LIMIT_RETRIES = "0", DEMESNE_AGENT_RATE_LIMIT_HOLD_SECONDS = "0" }, function()
    t:eq(config.get("agent_rate_limit_retries"), 0)
    t:eq(config.get("agent_rate_limit_hold_seconds"), 0)
    local _, err = config.describe()
    t:eq(err, nil)
  end)
  with_env({ DEMESNE_AGENT_RATE_LIMIT_RETRIES = "-1" }, function()
    t:eq(config.get("agent_rate_limit_retries"), 3)
    local _, err = config.describe()
    t:match(err, "agent_rate_limit_retries must be a non%-negative number, got %-1")
  end)
end

function tests.allowed_paths_must_be_absolute(t)
  with_env({ DEMESNE_ALLOWED_PATHS = "/srv/data:relative/dir" }, function()
    t:eq(config.get("allowed_paths"), {})
    local _, err = config.describe()
    t:match(err, '"relative/dir" is not an absolute path')
  end)
  with_env({ DEMESNE_ALLOWED_PATHS = "/srv/data:/home/me" }, function()
    t:eq(config.get("allowed_paths"), { "/srv/data", "/home/me" })
  end)
end

return tests
