-- Provider adapters on recorded fixtures (tests/fixtures/providers/, shapes from
-- shared/reference/agent-clis.md): usage from Anthropic Messages and OpenAI Responses bodies
-- (JSON and SSE), final answers from Claude Code stream-json and Codex exec --json
-- transcripts, cost, model resolution, the vendor route's decisions, the argv scripts run
-- against stand-in CLIs, and user provider files loaded from a temporary config folder.
local providers = require("demesne.providers")
local config = require("demesne.config")
local json = require("demesne.json")
local log = require("demesne.log")
local loop = require("core.loop")
local fs = require("core.fs")

local tests = {}

local SRC = os.getenv("DEMESNE_SOURCE_DIR") or "."
local FIX = SRC .. "/tests/fixtures/providers"

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function fixture(name) return read(FIX .. "/" .. name) end

-- Every variable the providers read, cleared for the test and restored after it.
local VARS = { "XDG_CONFIG_HOME", "ANTHROPIC_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN", "ANTHROPIC_AUTH_TOKEN",
  "OPENAI_API_KEY", "CODEX_HOME", "DEMESNE_CODEX_AUTH_FILE", "GATEWAY_API_KEY", "LOCAL_LLM_KEY",
  "DEMESNE_CLAUDE_CODE_ENABLED", "DEMESNE_CODEX_ENABLED", "DEMESNE_OPENAI_COMPATIBLE_ENABLED",
  "DEMESNE_CLAUDE_CODE_UPSTREAM", "DEMESNE_CODEX_UPSTREAM", "DEMESNE_GATEWAY_UPSTREAM" }

-- A clean environment: a temporary XDG_CONFIG_HOME (with demesne/providers/ made), no
-- credentials, `vars` set. Returns the temp folder and a to-be-closed value that restores
-- the environment, the configuration and the provider registry.
local function scene(vars)
  local dir = os.tmpname()
  os.remove(dir)
  fs.mkdir_p(dir .. "/config/demesne/providers")
  local saved = {}
  for _, k in ipairs(VARS) do saved[k] = os.getenv(k) or false; loop.setenv(k, nil) end
  for k, v in pairs(vars or {}) do
    if saved[k] == nil then saved[k] = os.getenv(k) or false end
    loop.setenv(k, v)
  end
  loop.setenv("XDG_CONFIG_HOME", dir .. "/config")
  loop.setenv("CODEX_HOME", dir .. "/no-codex-home")
  config.load()
  return dir, setmetatable({}, { __close = function()
    for k, v in pairs(saved) do loop.setenv(k, v or nil) end
    config.load()
    providers.current = nil
    fs.remove_tree(dir)
  end })
end

local function reload(quiet)
  config.load()
  return providers.load({ quiet = quiet })
end

local function split(s, size)
  local out = {}
  for i = 1, #s, size do out[#out + 1] = s:sub(i, i + size - 1) end
  return out
end

local function sse_usage(p, text, chunk)
  local c = providers.usage_counter(p, "text/event-stream; charset=utf-8")
  for _, piece in ipairs(split(text, chunk or #text)) do c:feed(piece) end
  return c:finish()
end

local function close(a, b) return math.abs(a - b) < 1e-12 end

--------------------------------------------------------------------------------------------
-- Usage parsing

function tests.anthropic_sse_usage_from_message_start_and_delta(t)
  local _, _env <close> = scene()
  local p = reload().by_name.claude_code
  local want = { model = "claude-sonnet-5", id = "msg_01XbT2", input = 1200, output = 87, cache_creation = 300,
    cache_read = 5000 }
  local text = fixture("anthropic_messages_stream.sse")
  for _, size in ipairs({ #text, 1, 7, 64 }) do
    t:eq(sse_usage(p, text, size), want, "usage with chunks of " .. size)
  end
  t:eq(sse_usage(p, (text:gsub("\n", "\r\n")), 5), want, "CRLF line ends")
  -- a stream with no message_start holds no usage
  local u, err = sse_usage(p, "event: ping\ndata: {\"type\":\"ping\"}\n\n")
  t:eq(u, nil)
  t:match(err, "no usage")
end

-- Found by tests/fuzz/vendor_usage (corpus file regression-infinite-token-count): a count of
-- 1e400 decodes as infinity and was kept, so the run's totals and cost became infinite and
-- usage.json (which JSON cannot write infinity into) was no longer updated.
function tests.infinite_or_huge_token_count_is_not_counted(t)
  local _, _env <close> = scene()
  local reg = reload()
  local text = 'event: message_start\ndata: {"type":"message_start","message":{"model":"claude-sonnet-5",'
    .. '"usage":{"input_tokens":1e400,"output_tokens":3,"cache_read_input_tokens":-1,'
    .. '"cache_creation_input_tokens":1e300}}}\n\n'
  local u = assert(sse_usage(reg.by_name.claude_code, text))
  t:eq(u.input, 0, "infinity is not a count")
  t:eq(u.cache_creation, 0, "nor is 1e300")
  t:eq(u.cache_read, 0, "nor a negative number")
  t:eq(u.output, 3)
  local usd = reg.by_name.claude_code.cost(u)
  t:ok(usd == usd and usd < math.huge, "a finite cost")
  t:eq(providers.num(2 ^ 53), 2 ^ 53)
  t:eq(math.type(providers.num(12.9)), "integer")
  t:eq(providers.num(12.9), 12)
  local ou = assert(reg.by_name.codex.usage_from_json(
    '{"response":{"model":"gpt-5.6-sol","usage":{"input_tokens":1e999,"output_tokens":2}}}'))
  t:eq(ou.input, 0)
  t:eq(ou.output, 2)
end

function tests.anthropic_json_usage_and_error_body(t)
  local _, _env <close> = scene()
  local p = reload().by_name.claude_code
  t:eq(p.usage_from_json(fixture("anthropic_messages.json")), { model = "claude-haiku-4-5-20251001", id = "msg_01Yq",
    input = 2100, output = 12, cache_creation = 0, cache_read = 40000 })
  local c = providers.usage_counter(p, "application/json")
  for _, piece in ipairs(split(fixture("anthropic_messages.json"), 10)) do c:feed(piece) end
  t:eq(c:finish().cache_read, 40000, "counter chose JSON by content type")
  local u, err = p.usage_from_json(fixture("anthropic_error.json"))
  t:eq(u, nil)
  t:match(err, "no usage")
  u, err = p.usage_from_json("{not json")
  t:eq(u, nil)
  t:match(err, "malformed")
end

function tests.openai_sse_usage_from_response_completed(t)
  local _, _env <close> = scene()
  local p = reload().by_name.codex
  local want = { model = "gpt-5.6-sol", id = "resp_68a1", input = 500, cache_read = 1500, cache_creation = 0,
    output = 300, reasoning = 120 }
  t:eq(sse_usage(p, fixture("openai_responses_stream.sse"), 13), want, "named events")
  t:eq(sse_usage(p, fixture("openai_responses_stream_dataonly.sse"), 9), want, "data-only frames, CRLF")
  -- no content type (the ChatGPT backend omits it): read as SSE
  local c = providers.usage_counter(p, nil)
  c:feed(fixture("openai_responses_stream.sse"))
  t:eq(c:finish(), want, "no content type")
  -- a stream cut before response.completed has a model but no counts
  local cut = fixture("openai_responses_stream.sse"):match("^(.-)event: response%.completed")
  local u = sse_usage(p, cut)
  t:eq(u.model, "gpt-5.6-sol")
  t:eq(u.output, 0)
end

function tests.openai_json_usage_and_error_body(t)
  local _, _env <close> = scene()
  local p = reload().by_name.codex
  t:eq(p.usage_from_json(fixture("openai_responses.json")), { model = "gpt-5.4-mini", id = "resp_77b2", input = 800,
    cache_read = 0, cache_creation = 0, output = 50, reasoning = 0 })
  local u, err = p.usage_from_json(fixture("openai_error.json"))
  t:eq(u, nil)
  t:match(err, "no usage")
end

function tests.sse_reader_handles_comments_multiline_data_and_a_missing_last_blank_line(t)
  local r = providers.sse_reader()
  local evs = r:feed(": keep-alive\n\nevent: a\ndata: x\ndata: y\n\ndata:z")
  t:eq(evs, { { event = "a", data = "x\ny" } })
  t:eq(r:finish(), { { data = "z" } })
end

--------------------------------------------------------------------------------------------
-- Final answers

function tests.claude_code_transcript_final_answer(t)
  local _, _env <close> = scene()
  local p = reload().by_name.claude_code
  local answer, d = p.parse_answer(providers.lines(fixture("claude_code_transcript.jsonl")))
  t:eq(answer, 'Done: /out/answer.txt holds "done".')
  t:eq(d.session_id, "5d2f7a0e-1b7c-4c1e-9a53-0f3e2b7c9d11")
  t:eq(d.is_error, false)
  t:eq(d.num_turns, 2)
  -- cut before the result line: the last assistant message's text blocks, joined
  answer, d = p.parse_answer(providers.lines(fixture("claude_code_transcript_cut.jsonl")))
  t:eq(answer, 'Done: /out/answer.txt\nholds "done".')
  t:eq(d.session_id, "5d2f7a0e-1b7c-4c1e-9a53-0f3e2b7c9d11")
  -- an API failure still says subtype "success": is_error and the status tell
  answer, d = p.parse_answer(providers.lines(fixture("claude_code_transcript_429.jsonl")))
  t:match(answer, "^API Error: 429")
  t:eq(d.is_error, true)
  t:eq(d.api_error_status, 429)
  t:eq(d.rate_limited, true)
  t:eq(d.session_id, "77e1c0aa-2f44-4d0b-8c1e-6a1b2c3d4e5f")
  t:eq((p.parse_answer({})), nil, "empty transcript")
  -- recorded from the real CLI in images/agent-claude_code against a scripted upstream
  answer, d = p.parse_answer(providers.lines(fixture("claude_code_transcript_recorded.jsonl")))
  t:eq(answer, "ANSWER-OK from claude-sonnet-5")
  t:eq(d.session_id, "bd052f8a-b5ad-4744-86d5-b017daec75df")
  t:eq(d.num_turns, 2)
end

function tests.codex_transcript_final_answer(t)
  local _, _env <close> = scene()
  local p = reload().by_name.codex
  local answer, d = p.parse_answer(providers.lines(fixture("codex_transcript.jsonl")))
  t:eq(answer, 'Done: /out/answer.txt holds "done".')
  t:eq(d.session_id, "0199f1c2-7a3e-7d10-9b4f-2c8e5a6d1f00")
  t:eq(d.is_error, false)
  t:eq(d.usage.output_tokens, 150)
  answer, d = p.parse_answer(providers.lines(fixture("codex_transcript_failed.jsonl")))
  t:eq(answer, nil)
  t:eq(d.is_error, true)
  t:match(d.error, "usage limit")
  t:eq(d.rate_limited, true)
  -- recorded from the real CLI in images/agent-codex against a scripted upstream
  answer, d = p.parse_answer(providers.lines(fixture("codex_transcript_recorded.jsonl")))
  t:eq(answer, "ANSWER-OK from gpt-5.5")
  t:eq(d.session_id, "01a226e9-db3b-7222-9e80-3043ee7801dd")
  t:eq(d.usage.input_tokens, 400)
end

--------------------------------------------------------------------------------------------
-- Cost

function tests.cost_from_indicative_prices(t)
  local _, _env <close> = scene()
  local reg = reload()
  local claude, codex = reg.by_name.claude_code, reg.by_name.codex
  -- sonnet: 1200 in × 3 + 87 out × 15 + 300 cache-write × 3.75 + 5000 cache-read × 0.30 per million
  local usd, priced = claude.cost(sse_usage(claude, fixture("anthropic_messages_stream.sse")))
  t:ok(close(usd, 0.00753), "sonnet cost " .. usd)
  t:eq(priced, true)
  -- the model id on the wire carries a date: prices match by prefix
  usd = claude.cost(claude.usage_from_json(fixture("anthropic_messages.json")))
  t:ok(close(usd, (2100 * 1 + 12 * 5 + 40000 * 0.10) / 1e6), "haiku cost " .. usd)
  -- gpt-5.6-sol: (2000 - 1500 cached) × 5 + 1500 × 0.50 + 300 × 30 per million
  usd = codex.cost(sse_usage(codex, fixture("openai_responses_stream.sse")))
  t:ok(close(usd, 0.01225), "codex cost " .. usd)
  -- a model with no price costs what the dearest entry would: a budget cannot be passed by
  -- naming one demesne has no price for
  usd, priced = codex.cost({ model = "some-unpriced-model", input = 1e6, output = 1e6, cache_creation = 0, cache_read = 0 })
  local dearest = 0
  for _, r in pairs(codex.prices) do dearest = math.max(dearest, (r.input or 0) + (r.output or 0)) end
  t:ok(dearest > 0 and close(usd, dearest), ("unpriced: %s, dearest %s"):format(usd, dearest))
  t:eq(priced, false)
  t:eq((providers.cost_with({}, { model = "x", input = 5 })), 0, "an empty table costs 0")
  -- longest prefix wins
  local r, key = providers.price_for({ ["gpt-5"] = { input = 1, output = 1 }, ["gpt-5.5"] = { input = 2, output = 2 } },
    "gpt-5.5-2026")
  t:eq(key, "gpt-5.5")
  t:eq(r.input, 2)
end

--------------------------------------------------------------------------------------------
-- Resolution

function tests.model_names_are_unique_and_the_first_is_the_default(t)
  local _, _env <close> = scene({ ANTHROPIC_API_KEY = "sk-ant-host-real", OPENAI_API_KEY = "sk-openai-host-real" })
  local reg = reload()
  t:eq(#reg.errors, 0, "built-ins load cleanly: " .. json.encode(reg.errors))
  t:eq(reg.order, { "claude_code", "codex" }, "openai_compatible offers nothing unconfigured")
  local count = {}
  for _, p in ipairs(reg:list()) do
    for _, m in ipairs(providers.models_of(p)) do count[m.name] = (count[m.name] or 0) + 1 end
  end
  for name, n in pairs(count) do t:eq(n, 1, "providers declaring " .. name) end
  local p, model, cred = providers.resolve("gpt-5.5")
  t:eq(p.name, "codex")
  t:eq(model, "gpt-5.5")
  t:eq(cred.kind, "api_key")
  t:eq(cred.source, "$OPENAI_API_KEY")
  t:ok(not tostring(cred):find("host-real", 1, true), "a credential prints without its value")
  p, model = providers.resolve(nil)
  t:eq(p.name, "claude_code")
  t:eq(model, "sonnet")
  t:eq(providers.available_models(), { "sonnet", "opus", "haiku", "fable", "gpt-5.6-sol", "gpt-5.6-terra",
    "gpt-5.6-luna", "gpt-5.5", "gpt-5.4-mini" })
end

function tests.unknown_model_lists_the_known_ones(t)
  local _, _env <close> = scene({ ANTHROPIC_API_KEY = "k" })
  reload()
  local p, err = providers.resolve("gpt-9-ultra")
  t:eq(p, nil)
  t:eq(err, 'model "gpt-9-ultra" unknown (known: fable, gpt-5.4-mini, gpt-5.5, gpt-5.6-luna, gpt-5.6-sol, '
    .. 'gpt-5.6-terra, haiku, opus, sonnet)')
end

function tests.disabled_provider_is_unavailable_and_left_out_of_the_enum(t)
  local _, _env <close> = scene({ ANTHROPIC_API_KEY = "k", OPENAI_API_KEY = "k2", DEMESNE_CLAUDE_CODE_ENABLED = "false" })
  reload()
  local p, err = providers.resolve("opus")
  t:eq(p, nil)
  t:match(err, '^model "opus" is unavailable because provider claude_code is disabled %(DEMESNE_CLAUDE_CODE_ENABLED=false%)')
  t:match(err, "available: gpt%-5%.6%-sol")
  t:eq(providers.available_models(), { "gpt-5.6-sol", "gpt-5.6-terra", "gpt-5.6-luna", "gpt-5.5", "gpt-5.4-mini" })
  t:eq((providers.resolve(nil)).name, "codex", "the default moves to the next provider that is ready")
  -- the config file can turn one off too
  loop.setenv("DEMESNE_CLAUDE_CODE_ENABLED", nil)
  local dir = os.getenv("XDG_CONFIG_HOME")
  write(dir .. "/demesne/config.lua", "return { providers = { codex = { enabled = false } } }")
  config.load()
  p, err = providers.resolve("gpt-5.5")
  t:eq(p, nil)
  t:match(err, "provider codex is disabled %(providers%.codex%.enabled = false in config%.lua%)")
  t:eq((providers.resolve("opus")).name, "claude_code")
end

function tests.missing_credentials_name_what_to_set(t)
  local _, _env <close> = scene()
  reload()
  local p, err = providers.resolve("sonnet")
  t:eq(p, nil)
  t:match(err, '^model "sonnet" has no credentials: set ANTHROPIC_API_KEY or CLAUDE_CODE_OAUTH_TOKEN')
  t:match(err, "available: none")
  _, err = providers.resolve("gpt-5.5")
  t:match(err, "has no credentials: set OPENAI_API_KEY, or log in with `codex login`")
  p, err = providers.resolve(nil)
  t:eq(p, nil)
  t:match(err, "^no agent provider is available: provider claude_code has no credentials")
  t:eq(providers.available_models(), {})
end

--------------------------------------------------------------------------------------------
-- Credentials and the vendor route

function tests.claude_code_vendor_route_swaps_the_token_for_the_credential(t)
  local _, _env <close> = scene({ ANTHROPIC_API_KEY = "sk-ant-REAL" })
  local p = reload().by_name.claude_code
  local cred = providers.credential(p)
  local token = providers.new_token()
  t:match(token, "^dmsn%-%x+$")
  t:eq(#token, 5 + 48)
  local v = providers.vendor_decide(p, { method = "HEAD", target = "/", headers = {} }, token, cred)
  t:eq(v, { action = "local", status = 200 }, "warm-up HEAD answered locally")
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages?beta=true",
    headers = { { "X-Api-Key", token }, { "Accept-Encoding", "gzip, br" }, { "Host", "127.0.0.1:3129" },
      { "anthropic-version", "2023-06-01" } } }, token, cred)
  t:eq(v.action, "forward")
  t:eq(v.url, "https://api.anthropic.com/v1/messages?beta=true", "query kept")
  t:eq(v.headers["x-api-key"], "sk-ant-REAL")
  t:eq(v.headers["accept-encoding"], "identity")
  t:eq(v.headers["anthropic-version"], "2023-06-01")
  t:eq(v.headers.host, nil)
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages", headers = { ["x-api-key"] = token .. "x" } },
    token, cred)
  t:eq({ v.action, v.status }, { "deny", 401 }, "wrong token")
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages", headers = { ["x-api-key"] = "sk-ant-REAL" } },
    token, cred)
  t:eq({ v.action, v.status }, { "deny", 401 }, "the real key is not the token")
  v = providers.vendor_decide(p, { method = "GET", target = "/v1/models", headers = { ["x-api-key"] = token } }, token, cred)
  t:eq({ v.action, v.status }, { "deny", 403 }, "path outside the allowed pairs")
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages/count_tokens", headers = { ["x-api-key"] = token } },
    token, cred)
  t:eq(v.status, 403)
  -- the upstream is configurable, for tests against a loopback server
  loop.setenv("DEMESNE_CLAUDE_CODE_UPSTREAM", "http://127.0.0.1:45678/")
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages?beta=true", headers = { ["x-api-key"] = token } },
    token, cred)
  t:eq(v.url, "http://127.0.0.1:45678/v1/messages?beta=true")
end

function tests.claude_code_oauth_token_travels_as_bearer(t)
  local _, _env <close> = scene({ CLAUDE_CODE_OAUTH_TOKEN = "sk-ant-oat01-REAL" })
  local p = reload().by_name.claude_code
  local cred = providers.credential(p)
  t:eq(cred.kind, "oauth_token")
  local run = { prompt_file = "/in/.agent/prompt.txt", context_file = "/in/.agent/CLAUDE.md", model = "opus",
    vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok", workdir = "/workspace", credential_kind = cred.kind }
  local env = p.env(run)
  t:eq(env.CLAUDE_CODE_OAUTH_TOKEN, "dmsn-tok", "the sandbox gets a fake of the same kind")
  t:eq(env.ANTHROPIC_API_KEY, nil)
  local v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages",
    headers = { authorization = "Bearer dmsn-tok" } }, "dmsn-tok", cred)
  t:eq(v.headers.authorization, "Bearer sk-ant-oat01-REAL")
  t:eq(v.headers["x-api-key"], nil)
end

function tests.codex_credentials_from_the_auth_file(t)
  local dir, _env <close> = scene()
  local p = reload().by_name.codex
  write(dir .. "/auth.json", json.encode({ OPENAI_API_KEY = json.null,
    tokens = { access_token = "chatgpt-REAL", refresh_token = "r", account_id = "acct-1" } }))
  loop.setenv("DEMESNE_CODEX_AUTH_FILE", dir .. "/auth.json")
  local cred = providers.credential(p)
  t:eq({ cred.present, cred.kind, cred.source, cred.account_id }, { true, "chatgpt", dir .. "/auth.json", "acct-1" })
  local v = providers.vendor_decide(p, { method = "POST", target = "/v1/responses",
    headers = { Authorization = "Bearer tok" } }, "tok", cred)
  t:eq(v.url, "https://chatgpt.com/backend-api/codex/responses")
  t:eq(v.headers.authorization, "Bearer chatgpt-REAL")
  t:eq(v.headers["chatgpt-account-id"], "acct-1")
  -- a refresh on the host is seen by the next request
  write(dir .. "/auth.json", json.encode({ tokens = { access_token = "chatgpt-REFRESHED", account_id = "acct-1" } }))
  t:eq(cred.value(), "chatgpt-REFRESHED")
  -- an API-key login file
  write(dir .. "/auth.json", json.encode({ OPENAI_API_KEY = "sk-file-REAL" }))
  cred = providers.credential(p)
  t:eq({ cred.kind, cred.value() }, { "api_key", "sk-file-REAL" })
  v = providers.vendor_decide(p, { method = "POST", target = "/v1/responses", headers = { Authorization = "Bearer tok" } },
    "tok", cred)
  t:eq(v.url, "https://api.openai.com/v1/responses")
  t:eq(v.headers.authorization, "Bearer sk-file-REAL")
  v = providers.vendor_decide(p, { method = "GET", target = "/v1/responses", headers = { Authorization = "Bearer tok" } },
    "tok", cred)
  t:eq(v.status, 403, "the WebSocket GET is refused")
  write(dir .. "/auth.json", "{}")
  cred = providers.credential(p)
  t:eq(cred.present, false)
  t:match(cred.hint, "neither an API key nor ChatGPT tokens")
end

--------------------------------------------------------------------------------------------
-- argv and env, run against stand-in CLIs

-- Runs argv with env on this host, a stand-in `name` first on PATH that records its
-- arguments (NUL-separated), its stdin, its working folder and (codex) its config.toml.
local function run_stub(dir, name, argv, env)
  fs.mkdir_p(dir .. "/bin")
  write(dir .. "/bin/" .. name, ([[#!/bin/sh
printf '%%s\0' "$@" > %s/args
readlink /proc/self/fd/0 > %s/stdin
pwd > %s/cwd
if [ -f "${CODEX_HOME:-/nonexistent}/config.toml" ]; then cp "$CODEX_HOME/config.toml" %s/config.toml; fi
]]):format(dir, dir, dir, dir))
  os.execute("chmod +x " .. dir .. "/bin/" .. name)
  local parts = { "env", "PATH=" .. dir .. "/bin:/usr/bin:/bin" }
  for k, v in pairs(env) do parts[#parts + 1] = providers.shell_quote(k .. "=" .. v) end
  for _, a in ipairs(argv) do parts[#parts + 1] = providers.shell_quote(a) end
  local ok = os.execute(table.concat(parts, " ") .. " < /dev/zero")
  local args = {}
  for a in read(dir .. "/args"):gmatch("([^%z]*)%z") do args[#args + 1] = a end
  return ok, args, read(dir .. "/stdin"):gsub("%s+$", ""), read(dir .. "/cwd"):gsub("%s+$", "")
end

function tests.claude_code_argv_and_env(t)
  local dir, _env <close> = scene({ ANTHROPIC_API_KEY = "sk-ant-REAL" })
  local p = reload().by_name.claude_code
  fs.mkdir_p(dir .. "/in")
  local prompt = "-n looks like a flag\nsecond line with 'quotes' and $HOME"
  write(dir .. "/in/prompt.txt", prompt)
  write(dir .. "/in/CLAUDE.md", "# context")
  local run = { prompt_file = dir .. "/in/prompt.txt", context_file = dir .. "/in/CLAUDE.md", model = "fable",
    vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok", workdir = dir .. "/ws", home = dir .. "/home" }
  local e = p.env(run)
  t:eq(e.ANTHROPIC_BASE_URL, "http://127.0.0.1:3129")
  t:eq(e.ANTHROPIC_API_KEY, "dmsn-tok")
  t:eq(e.IS_SANDBOX, "1")
  t:eq(e.CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, "1")
  t:eq(e.NO_PROXY, "127.0.0.1,localhost")
  for k, v in pairs(e) do t:ok(not v:find("REAL", 1, true), "env " .. k .. " holds no credential") end
  local ok, args, stdin, cwd = run_stub(dir, "claude", p.argv(run), e)
  t:ok(ok, "the script ran")
  t:eq(args, { "-p", "--strict-mcp-config", "--output-format", "stream-json", "--verbose",
    "--dangerously-skip-permissions", "--model", "claude-fable-5", "--", prompt })
  t:eq(p.files(run), {}, "no MCP server: no files")
  t:eq(e.MCP_TOOL_TIMEOUT, nil)
  t:eq(stdin, "/dev/null")
  t:eq(cwd, dir .. "/ws")
  t:eq(read(dir .. "/ws/CLAUDE.md"), "# context", "context file linked into the working folder")
  -- resuming a session after a quota answer
  run.resume_session = "5d2f7a0e"
  run.max_retries = 2
  t:eq(p.env(run).CLAUDE_CODE_MAX_RETRIES, "2")
  ok, args = run_stub(dir, "claude", p.argv(run), p.env(run))
  t:ok(ok, "the resume script ran")
  t:eq(args, { "--resume", "5d2f7a0e", "-p", "--strict-mcp-config", "--output-format", "stream-json", "--verbose",
    "--dangerously-skip-permissions", "--model", "claude-fable-5", "--", "continue" })
end

-- demesne's in-sandbox MCP server as the runner lists it (lua/agent/init.lua agent.mcp_servers)
local DEMESNE_MCP = { name = "demesne", url = "http://127.0.0.1:3130/mcp", token = "mcp-tok-0123",
  token_env = "DEMESNE_MCP_TOKEN", tool_timeout_ms = 660000, startup_timeout_ms = 60000 }

function tests.claude_code_takes_the_demesne_mcp_server_from_a_file(t)
  local dir, _env <close> = scene({ ANTHROPIC_API_KEY = "sk-ant-REAL" })
  local p = reload().by_name.claude_code
  t:eq(p.mcp, "http")
  fs.mkdir_p(dir .. "/in")
  write(dir .. "/in/prompt.txt", "spawn children")
  local run = { prompt_file = dir .. "/in/prompt.txt", context_file = "", model = "sonnet", agent_dir = dir .. "/in",
    vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok", workdir = dir .. "/ws", home = dir .. "/home",
    mcp_servers = { DEMESNE_MCP } }
  local files = p.files(run)
  t:eq(json.decode(files["mcp.json"]), { mcpServers = { demesne = { type = "http", url = "http://127.0.0.1:3130/mcp",
    headers = { Authorization = "Bearer mcp-tok-0123" }, timeout = 660000 } } })
  local e = p.env(run)
  t:eq({ e.MCP_TIMEOUT, e.MCP_TOOL_TIMEOUT, e.CLAUDE_CODE_MCP_TOOL_IDLE_TIMEOUT }, { "60000", "660000", "660000" })
  local ok, args = run_stub(dir, "claude", p.argv(run), e)
  t:ok(ok, "the script ran")
  t:eq(args, { "-p", "--mcp-config", dir .. "/in/mcp.json", "--strict-mcp-config", "--output-format", "stream-json",
    "--verbose", "--dangerously-skip-permissions", "--model", "sonnet", "--", "spawn children" })
  run.resume_session = "5d2f7a0e"
  ok, args = run_stub(dir, "claude", p.argv(run), e)
  t:ok(ok, "the resume script ran")
  t:eq(args, { "--resume", "5d2f7a0e", "-p", "--mcp-config", dir .. "/in/mcp.json", "--strict-mcp-config",
    "--output-format", "stream-json", "--verbose", "--dangerously-skip-permissions", "--model", "sonnet", "--",
    "continue" }, "a resumed session keeps its MCP server")
end

function tests.codex_takes_the_demesne_mcp_server_in_its_config(t)
  local _, _env <close> = scene({ OPENAI_API_KEY = "sk-openai-REAL" })
  local p = reload().by_name.codex
  t:eq(p.mcp, "http")
  local run = { prompt_file = "/p", model = "gpt-5.5", vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok",
    mcp_servers = { DEMESNE_MCP } }
  local toml = p.config_toml(run)
  t:match(toml, '\n%[mcp_servers%.demesne%]\nurl = "http://127%.0%.0%.1:3130/mcp"\nbearer_token_env_var = '
    .. '"DEMESNE_MCP_TOKEN"\ndefault_tools_approval_mode = "approve"\nstartup_timeout_sec = 60\n'
    .. 'tool_timeout_sec = 660\n$')
  t:ok(not toml:find("mcp-tok-0123", 1, true), "the token stays in the environment (Codex takes no inline token)")
  -- the top-level keys come before every table
  t:ok(toml:find('model_provider = "demesne"', 1, true) < toml:find("[features]", 1, true))
  run.mcp_servers = nil
  t:ok(not p.config_toml(run):find("mcp_servers", 1, true), "no MCP server: no table")
end

function tests.an_adapters_mcp_and_files_are_checked(t)
  local dir, _env <close> = scene({ GATEWAY_API_KEY = "k" })
  local good = fixture("user/gateway.lua")
  local udir = dir .. "/config/demesne/providers"
  write(udir .. "/a.lua", (good:gsub('name = "gateway"', 'name = "stdio_mcp"')
    :gsub('"gw%-sonnet", "gw%-haiku"', '"a-1"'):gsub('mcp = "http"', 'mcp = "stdio"')))
  write(udir .. "/b.lua", (good:gsub('name = "gateway"', 'name = "files_table"'):gsub('"gw%-sonnet", "gw%-haiku"',
    '"b-1"'):gsub("files = function%(run%)", "files = {}, unused = function(run)")))
  write(udir .. "/c.lua", good)
  local reg = reload(true)
  t:eq(#reg.errors, 2, json.encode(reg.errors))
  t:match(reg.errors[1].message, 'a%.lua: mcp: must be "http"')
  t:match(reg.errors[2].message, "b%.lua: files: must be a function")
  -- what files(run) returns is checked when a run is planned
  local p = { files = function() return { ["../escape"] = "x" } end }
  t:match(select(2, providers.run_files(p, {})), "files: %.%./escape is not a plain file name")
  p.files = function() return { ["run.sh"] = "x" } end
  t:match(select(2, providers.run_files(p, {}, { ["run.sh"] = true })), 'files: "run.sh" is a file of the runner')
  p.files = function() return { ["mcp.json"] = 1 } end
  t:match(select(2, providers.run_files(p, {})), 'files%["mcp.json"%]: must be a string')
  p.files = function() error("boom", 0) end
  t:eq(select(2, providers.run_files(p, {})), "files: boom")
  t:eq(providers.run_files({}, {}), {})
  -- the worked example wires the server as the shipped adapter does
  local gw = reg.by_name.gateway
  local files = gw.files({ agent_dir = "/.demesne/agent", mcp_servers = { DEMESNE_MCP } })
  t:eq(json.decode(files["mcp.json"]).mcpServers.demesne.headers, { Authorization = "Bearer mcp-tok-0123" })
  local argv = gw.argv({ prompt_file = "/p", context_file = "/c", workdir = "/w", model = "gw-sonnet",
    agent_dir = "/.demesne/agent", mcp_servers = { DEMESNE_MCP } })
  t:eq(argv[9], "/.demesne/agent/mcp.json")
end

function tests.codex_argv_env_and_config(t)
  local dir, _env <close> = scene({ OPENAI_API_KEY = "sk-openai-REAL" })
  local p = reload().by_name.codex
  fs.mkdir_p(dir .. "/in")
  write(dir .. "/in/prompt.txt", "write 'done' to /out/answer.txt")
  write(dir .. "/in/AGENTS.md", "# context")
  local run = { prompt_file = dir .. "/in/prompt.txt", context_file = dir .. "/in/AGENTS.md", model = "gpt-5.5",
    vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok", workdir = dir .. "/ws", home = dir .. "/home",
    max_retries = 0 }
  local e = p.env(run)
  t:eq(e.AGENT_API_KEY, "dmsn-tok")
  t:eq(e.CODEX_HOME, dir .. "/home/.codex")
  t:eq(e.no_proxy, "127.0.0.1,localhost")
  for k, v in pairs(e) do t:ok(not v:find("REAL", 1, true), "env " .. k .. " holds no credential") end
  local ok, args, stdin, cwd = run_stub(dir, "codex", p.argv(run), e)
  t:ok(ok, "the script ran")
  t:eq(args, { "exec", "--json", "--skip-git-repo-check", "-m", "gpt-5.5", "--", "write 'done' to /out/answer.txt" })
  t:eq(stdin, "/dev/null")
  t:eq(cwd, dir .. "/ws")
  t:eq(read(dir .. "/ws/AGENTS.md"), "# context")
  local toml = read(dir .. "/config.toml")
  t:match(toml, '\nmodel_provider = "demesne"\n')
  t:match(toml, '\nsandbox_mode = "danger%-full%-access"\n')
  t:match(toml, '\napproval_policy = "never"\n')
  t:match(toml, "\n%[features%]\nplugins = false\n")
  t:match(toml, "\n%[analytics%]\nenabled = false\n")
  t:match(toml, '\nbase_url = "http://127%.0%.0%.1:3129/v1"\n')
  t:match(toml, '\nwire_api = "responses"\n')
  t:match(toml, '\nenv_key = "AGENT_API_KEY"\n')
  t:match(toml, "\nrequest_max_retries = 0\nstream_max_retries = 0\n")
  t:ok(not toml:find("REAL", 1, true), "config.toml holds no credential")
  run.resume_session = "0199f1c2"
  ok, args = run_stub(dir, "codex", p.argv(run), e)
  t:ok(ok, "the resume script ran")
  t:eq(args, { "exec", "resume", "0199f1c2", "--json", "--skip-git-repo-check", "-m", "gpt-5.5", "--", "continue" })
end

--------------------------------------------------------------------------------------------
-- Configured and user-added providers

function tests.openai_compatible_from_config(t)
  local dir, _env <close> = scene({ LOCAL_LLM_KEY = "local-REAL" })
  write(dir .. "/config/demesne/config.lua", [[return { providers = { openai_compatible = {
    base_url = "http://127.0.0.1:8000/v1", models = { "qwen3-coder", "gpt-oss-120b" }, api_key_env = "LOCAL_LLM_KEY",
    prices = { ["qwen3-coder"] = { input = 0.1, output = 0.4 } } } } }]])
  local reg = reload()
  t:eq(reg.order, { "claude_code", "codex", "openai_compatible" })
  local p, model, cred = providers.resolve("qwen3-coder")
  t:eq({ p.name, model, p.image, p.context_file_name }, { "openai_compatible", "qwen3-coder", "agent-codex", "AGENTS.md" })
  t:eq(cred.source, "$LOCAL_LLM_KEY")
  local v = providers.vendor_decide(p, { method = "POST", target = "/v1/responses",
    headers = { authorization = "Bearer tok" } }, "tok", cred)
  t:eq(v.url, "http://127.0.0.1:8000/v1/responses")
  t:eq(v.headers.authorization, "Bearer local-REAL")
  t:ok(close(p.cost({ model = "qwen3-coder", input = 1e6, output = 1e6, cache_creation = 0, cache_read = 0 }), 0.5), "cost")
  t:eq(providers.available_models(), { "qwen3-coder", "gpt-oss-120b" }, "only providers with credentials")
  loop.setenv("LOCAL_LLM_KEY", nil)
  local _, err = providers.resolve("gpt-oss-120b")
  t:match(err, "has no credentials: set LOCAL_LLM_KEY on the host")
  -- a bad section is refused with the field named
  write(dir .. "/config/demesne/config.lua", "return { providers = { openai_compatible = { base_url = 'x', models = {'m'} } } }")
  reg = reload(true)
  t:eq(reg.by_name.openai_compatible, nil)
  t:match(reg.errors[1].message, "openai_compatible%.lua: providers%.openai_compatible%.base_url: must be an http")
end

function tests.user_provider_file_is_loaded_resolved_and_run(t)
  local dir, _env <close> = scene({ GATEWAY_API_KEY = "gw-REAL" })
  local udir = dir .. "/config/demesne/providers"
  write(udir .. "/gateway.lua", fixture("user/gateway.lua"))
  write(udir .. "/local_llm.lua", fixture("user/local_llm.lua"))
  local reg = reload()
  t:eq(#reg.errors, 0, json.encode(reg.errors))
  t:eq(reg.order, { "claude_code", "codex", "gateway", "local_llm" })
  t:eq(reg.by_name.gateway.origin, udir .. "/gateway.lua")
  t:eq(providers.available_models(), { "gw-sonnet", "gw-haiku", "qwen3-coder-30b", "gpt-oss-20b" })
  local p, model, cred = providers.resolve("gw-haiku")
  t:eq({ p.name, model, cred.kind }, { "gateway", "gw-haiku", "api_key" })
  t:eq((providers.resolve(nil)).name, "gateway", "first ready provider gives the default model")
  -- run it: argv against a stand-in claude, env without the key
  fs.mkdir_p(dir .. "/in")
  write(dir .. "/in/prompt.txt", "hello")
  write(dir .. "/in/CLAUDE.md", "# context")
  local run = { prompt_file = dir .. "/in/prompt.txt", context_file = dir .. "/in/CLAUDE.md", model = model,
    vendor_base_url = "http://127.0.0.1:3129", token = "dmsn-tok", workdir = dir .. "/ws" }
  local e = p.env(run)
  t:eq(e.ANTHROPIC_API_KEY, "dmsn-tok")
  local ok, args, stdin = run_stub(dir, "claude", p.argv(run), e)
  t:ok(ok, "the script ran")
  t:eq(args[#args - 2], "claude-haiku-4-5")
  t:eq(args[#args], "hello")
  t:eq(stdin, "/dev/null")
  -- its route, parsers and prices on the recorded fixtures
  loop.setenv("DEMESNE_GATEWAY_UPSTREAM", "http://127.0.0.1:45679/anthropic")
  local v = providers.vendor_decide(p, { method = "POST", target = "/v1/messages?beta=true",
    headers = { ["x-api-key"] = "dmsn-tok" } }, "dmsn-tok", cred)
  t:eq(v.url, "http://127.0.0.1:45679/anthropic/v1/messages?beta=true")
  t:eq(v.headers["x-api-key"], "gw-REAL")
  t:eq((p.parse_answer(providers.lines(fixture("claude_code_transcript.jsonl")))), 'Done: /out/answer.txt holds "done".')
  local u = sse_usage(p, fixture("anthropic_messages_stream.sse"), 11)
  t:eq({ u.model, u.input, u.output, u.cache_creation, u.cache_read }, { "claude-sonnet-5", 1200, 87, 300, 5000 })
  t:ok(close(p.cost(u), 0.00753), "cost from the file's prices")
  -- the codex.make one forwards to its local server and drops the token (no key)
  local ll = reg.by_name.local_llm
  v = providers.vendor_decide(ll, { method = "POST", target = "/v1/responses", headers = { authorization = "Bearer t" } },
    "t", providers.credential(ll))
  t:eq(v.url, "http://127.0.0.1:8000/v1/responses")
  t:eq(v.headers.authorization, nil)
end

function tests.bad_and_clashing_provider_files_are_refused_with_file_and_field(t)
  local dir, _env <close> = scene({ ANTHROPIC_API_KEY = "k" })
  local udir = dir .. "/config/demesne/providers"
  local good = fixture("user/gateway.lua")
  write(udir .. "/a_no_swap.lua", (good:gsub('name = "gateway"', 'name = "no_swap"'):gsub("swap_auth = function",
    "swap_auth_typo = function"):gsub('"gw%-sonnet", "gw%-haiku"', '"ns-1"')))
  write(udir .. "/b_clash.lua", (good:gsub('name = "gateway"', 'name = "clash"'):gsub('"gw%-sonnet", "gw%-haiku"',
    '"cl-1", "sonnet"')))
  write(udir .. "/c_syntax.lua", "return {")
  write(udir .. "/d_bad_path.lua", (good:gsub('name = "gateway"', 'name = "bad_path"'):gsub('"gw%-sonnet", "gw%-haiku"',
    '"bp-1"'):gsub('path = "%^/v1/messages%$"', 'path = "/v1/messages"')))
  write(udir .. "/e_ok.lua", good)
  local logged = {}
  local remove = log.add_sink(function(level, _, msg) if level == "error" then logged[#logged + 1] = msg end end)
  local reg = reload()
  remove()
  t:eq(#reg.errors, 4, json.encode(reg.errors))
  t:eq(#logged, 4, "each refusal is logged")
  t:match(logged[1], "a_no_swap%.lua: vendor%.swap_auth: must be a function")
  t:match(logged[2], "c_syntax%.lua")
  t:match(logged[3], "d_bad_path%.lua: vendor%.allowed%[1%]%.path: must be a Lua pattern anchored")
  t:match(logged[4], 'b_clash%.lua: models%[2%]: "sonnet" is already a model of provider claude_code')
  t:eq(reg.order, { "claude_code", "codex", "gateway" }, "the good file still loads")
  t:eq((providers.resolve("sonnet")).name, "claude_code")
  t:eq(select(2, providers.resolve("cl-1")):match("unknown") ~= nil, true)
  -- `demesne providers` lists them and says what was refused: exit status 1
  local out_path = dir .. "/providers.out"
  local stdout = io.stdout
  io.stdout = assert(io.open(out_path, "w")) -- luacheck: ignore 122
  local ok, status = pcall(require("demesne.cmd.providers"), {})
  io.stdout:close()
  io.stdout = stdout -- luacheck: ignore 122
  t:eq({ ok, status }, { true, 1 })
  local printed = read(out_path)
  t:match(printed, "\ngateway +Claude Code via the company gateway\n +from [^\n]*/e_ok%.lua\n +models: gw%-sonnet, gw%-haiku")
  t:match(printed, "refused:\n  [^\n]*a_no_swap%.lua: vendor%.swap_auth: must be a function")
end

function tests.user_file_replaces_a_builtin_of_the_same_name(t)
  local dir, _env <close> = scene({ GATEWAY_API_KEY = "k" })
  write(dir .. "/config/demesne/providers/codex.lua",
    (fixture("user/gateway.lua"):gsub('name = "gateway"', 'name = "codex"')))
  local reg = reload()
  t:eq(reg.order, { "claude_code", "codex" })
  t:eq(reg.by_name.codex.origin, dir .. "/config/demesne/providers/codex.lua")
  t:eq((providers.resolve("gw-sonnet")).name, "codex")
  t:match(select(2, providers.resolve("gpt-5.5")), "unknown")
end

function tests.provider_files_cannot_reach_core_bindings(t)
  local dir, _env <close> = scene()
  write(dir .. "/config/demesne/providers/sneaky.lua", 'local http = require("core.http")\nreturn nil')
  local reg = reload(true)
  t:eq(#reg.errors, 1)
  t:match(reg.errors[1].message, "sneaky%.lua:1: require%(\"core%.http\"%) is not allowed")
end

function tests.docs_worked_example_is_the_tested_fixture(t)
  local doc = read(SRC .. "/docs/reference/providers.md")
  for _, name in ipairs({ "gateway.lua", "local_llm.lua" }) do
    local marker = "<!-- tested copy: tests/fixtures/providers/user/" .. name .. " -->"
    local at = doc:find(marker, 1, true)
    t:ok(at, "docs mark the example " .. name)
    local block = doc:match("```lua\n(.-)```", at)
    t:eq(block, fixture("user/" .. name), "docs example " .. name)
  end
end

function tests.token_equal_is_exact(t)
  t:eq(providers.token_equal("abc", "abc"), true)
  t:eq(providers.token_equal("abc", "abd"), false)
  t:eq(providers.token_equal("abc", "abcd"), false)
  t:eq(providers.token_equal("", ""), false)
  t:eq(providers.token_equal(nil, "a"), false)
  t:ok(providers.new_token() ~= providers.new_token(), "tokens differ")
end

return tests
