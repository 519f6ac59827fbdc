-- Provider openai_compatible: any endpoint that speaks the OpenAI Responses API (a hosted
-- gateway, or a model server on the host), run through the Codex CLI. Configured in
-- $XDG_CONFIG_HOME/demesne/config.lua:
--
--   providers = {
--     openai_compatible = {
--       base_url = "http://127.0.0.1:8000/v1",   -- the endpoint's /v1 base (POST <base_url>/responses)
--       models = { "qwen3-coder", "gpt-oss-120b" }, -- names as the endpoint knows them; the first is the default
--       api_key_env = "LOCAL_LLM_KEY",           -- host variable holding its key; omit for a keyless server
--       prices = { ["qwen3-coder"] = { input = 0, output = 0 } },  -- optional, USD per million tokens
--       title = "local vLLM",                    -- optional
--     },
--   }
--
-- Without a base_url and models the file offers no provider. The sandbox never sees the
-- endpoint: the vendor route forwards to it with the key swapped in.
local P = require("demesne.providers")
local codex = require("demesne.providers.codex")

local cfg = P.settings("openai_compatible")
if cfg.base_url == nil and cfg.models == nil then return nil end
if type(cfg.base_url) ~= "string" or not cfg.base_url:match("^https?://") then
  error("providers.openai_compatible.base_url: must be an http(s) URL such as http://127.0.0.1:8000/v1", 0)
end
if type(cfg.models) ~= "table" or cfg.models[1] == nil then
  error("providers.openai_compatible.models: must be a non-empty list of model names", 0)
end
if cfg.api_key_env ~= nil and (type(cfg.api_key_env) ~= "string" or not cfg.api_key_env:match("^[A-Za-z_][A-Za-z0-9_]*$")) then
  error("providers.openai_compatible.api_key_env: must be the name of an environment variable", 0)
end

local function credentials()
  local var = cfg.api_key_env
  if not var then
    -- a keyless server: the sandbox still gets a token (Codex needs one), the route drops it
    return { present = true, kind = "none", source = "no key configured", value = function() return nil end }
  end
  local v = os.getenv(var)
  if v and v ~= "" then
    return { present = true, kind = "api_key", source = "$" .. var, value = function() return os.getenv(var) end }
  end
  return { present = false, hint = ("set %s on the host (providers.openai_compatible.api_key_env)"):format(var) }
end

return codex.make({
  name = "openai_compatible",
  title = type(cfg.title) == "string" and cfg.title or "OpenAI-compatible endpoint",
  label = ("the model endpoint %s"):format(cfg.base_url),
  models = cfg.models,
  credentials = credentials,
  upstream = cfg.base_url,
  prices = type(cfg.prices) == "table" and cfg.prices or {},
})
