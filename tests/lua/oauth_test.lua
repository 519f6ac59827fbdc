-- lua/oauth.lua and the Codex ChatGPT login refresh (lua/providers/codex.lua) against a
-- token endpoint on 127.0.0.1 in this test: when a refresh is due, the request it sends,
-- the auth.json it writes back (other fields kept, mode 0600), one request for concurrent
-- runs, and a refused refresh that leaves the file as it was.
local oauth = require("demesne.oauth")
local providers = require("demesne.providers")
local json = require("demesne.json")
local async = require("demesne.async")
local stream = require("core.stream")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local function b64url(s)
  local A = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    local chars = 2 + (b and 1 or 0) + (c and 1 or 0)
    for k = 1, chars do
      local v = (n >> (18 - 6 * (k - 1))) & 63
      out[#out + 1] = A:sub(v + 1, v + 1)
    end
  end
  return table.concat(out)
end

local function jwt(claims) return b64url('{"alg":"none"}') .. "." .. b64url(json.encode(claims)) .. ".sig" end

function tests.base64url_and_jwt_claims(t)
  t:eq(oauth.base64url_decode("aGVsbG8"), "hello")
  t:eq(oauth.base64url_decode("aGVsbG8="), "hello")
  t:eq(oauth.base64url_decode("-_8"), "\251\255")
  t:eq(oauth.base64url_decode("a*b"), nil)
  t:eq(oauth.jwt_claims(jwt({ exp = 1800000000, sub = "u" })).exp, 1800000000)
  t:eq(oauth.jwt_claims("not-a-jwt"), nil)
  t:eq(oauth.jwt_claims(nil), nil)
end

function tests.codex_refresh_is_due_on_expiry_or_age(t)
  local codex = providers.load({ user_dir = false, quiet = true }):get("codex")
  local due = codex.refresh_due
  local now = 1800000000
  local fresh = { tokens = { access_token = jwt({ exp = now + 7200 }) }, last_refresh = "2027-01-15T07:00:00Z" }
  t:eq(due(fresh, 600, now), false)
  t:eq(due(fresh, 7200, now), true, "a run longer than the token's life")
  local old = { tokens = { access_token = "opaque" }, last_refresh = "2027-01-01T00:00:00Z" }
  t:eq(due(old, 600, now), true, "last refreshed more than 8 days ago")
  t:eq(due({ tokens = { access_token = "opaque" } }, 600, now), false, "nothing says it is due")
end

-- A token endpoint: answers each POST with `answer(body)` -> status, table.
local function token_server(answer)
  local srv = { seen = {} }
  local function on_client(c)
    local buf = ""
    c:read_start(function(data)
      if not data then c:close() return end
      buf = buf .. data
      local s, e = buf:find("\r\n\r\n", 1, true)
      if not s then return end
      local len = tonumber(buf:sub(1, s):lower():match("content%-length:%s*(%d+)") or "0")
      if #buf - e < len then return end
      c:read_stop()
      local body = buf:sub(e + 1, e + len)
      srv.seen[#srv.seen + 1] = { head = buf:sub(1, s - 1), body = json.decode(body) }
      local status, t = answer(srv.seen[#srv.seen].body)
      local out = json.encode(t)
      -- a slow answer, so that concurrent refreshes overlap
      require("core.timer").after(50, function()
        c:write(("HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s")
          :format(status, #out, out), function() c:close() end)
      end)
    end)
  end
  srv.listener, srv.port = assert(stream.listen_tcp("127.0.0.1", 0, on_client))
  return srv
end

local function scene(auth, answer)
  local dir = (os.getenv("TMPDIR") or "/tmp") .. "/demesne-oauth-" .. ("%x"):format(math.floor(loop.hrtime() % 1e9))
  assert(fs.mkdir_p(dir, 448))
  local path = dir .. "/auth.json"
  assert(fs.write_atomic(path, json.encode(auth), 420)) -- 0644: the refresh writes 0600
  local srv = token_server(answer)
  loop.setenv("DEMESNE_CODEX_REFRESH_URL", ("http://127.0.0.1:%d/oauth/token"):format(srv.port))
  loop.setenv("DEMESNE_CODEX_AUTH_FILE", path)
  loop.setenv("OPENAI_API_KEY", nil)
  local env = { dir = dir, path = path, srv = srv }
  return setmetatable(env, { __close = function()
    srv.listener:close()
    loop.setenv("DEMESNE_CODEX_REFRESH_URL", nil)
    loop.setenv("DEMESNE_CODEX_AUTH_FILE", nil)
    fs.remove_tree(dir)
  end })
end

function tests.codex_login_is_refreshed_and_written_back(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local now = os.time()
  local s <close> = scene({ OPENAI_API_KEY = json.null, auth_mode = "chatgpt",
    tokens = { id_token = "id-old", access_token = jwt({ exp = now - 60 }), refresh_token = "rt-old", account_id = "acct-1" },
    last_refresh = "2020-01-01T00:00:00Z" },
    function() return 200, { access_token = "at-new", id_token = "id-new", refresh_token = "rt-new" } end)
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  local cred = providers.credential(p)
  t:eq(cred.kind, "chatgpt")
  -- two runs at once: one refresh request
  local a = async.spawn("r1", function() return p.refresh(cred, 600) end)
  local b = async.spawn("r2", function() return p.refresh(cred, 600) end)
  t:eq(select(2, a:wait()), true)
  t:eq(select(2, b:wait()), true)
  t:eq(#s.srv.seen, 1, "one request for both")
  local req = s.srv.seen[1]
  t:eq(req.body, { grant_type = "refresh_token", refresh_token = "rt-old", client_id = "app_EMoamEEZ73f0CkXaXp7hrann",
    scope = "openid profile email" })
  t:match(req.head, "^POST /oauth/token HTTP/1%.1")
  local auth = json.decode(assert(fs.read_file(s.path)))
  t:eq(auth.tokens.access_token, "at-new")
  t:eq(auth.tokens.id_token, "id-new")
  t:eq(auth.tokens.refresh_token, "rt-new")
  t:eq(auth.tokens.account_id, "acct-1", "other fields are kept")
  t:eq(auth.auth_mode, "chatgpt")
  t:match(auth.last_refresh, "^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$")
  t:eq(fs.stat(s.path).mode & 511, 384, "mode 0600")
  t:eq(cred.value(), "at-new", "the vendor route reads the new token")
  -- not due any more: no second request
  t:eq(p.refresh(providers.credential(p), 600), true)
  t:eq(#s.srv.seen, 1)
  loop.setenv("OPENAI_API_KEY", saved_key)
end

function tests.a_refused_codex_refresh_says_run_codex_login(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local now = os.time()
  local before = { tokens = { access_token = jwt({ exp = now - 60 }), refresh_token = "rt-spent" } }
  local s <close> = scene(before, function()
    return 400, { error = "invalid_grant", error_description = "refresh token already used" }
  end)
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  local ok, err = p.refresh(providers.credential(p), 600)
  t:eq(ok, nil)
  t:match(err, "codex login refresh refused %(HTTP 400: invalid_grant: refresh token already used%)")
  t:match(err, "run `codex login` on the host")
  t:eq(json.decode(assert(fs.read_file(s.path))), before, "the file is left as it was")
  loop.setenv("OPENAI_API_KEY", saved_key)
end

function tests.codex_refresh_writes_through_a_symlink_keeping_the_files_form(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local now = os.time()
  local s <close> = scene({}, function() return 200, { access_token = "at-2", refresh_token = "rt-2" } end)
  -- the real file elsewhere, with values a decode/encode would change; the configured path a link
  local real = s.dir .. "/real-auth.json"
  local original = '{\n  "tokens": {"access_token": "' .. jwt({ exp = now - 1 }) .. '", "refresh_token": "rt-1",'
    .. ' "account_id": "acct"},\n  "big": 12345678901234567890,\n  "list": [],\n  "last_refresh": "2020-01-01T00:00:00Z"\n}\n'
  assert(fs.write_atomic(real, original, 384))
  os.remove(s.path)
  assert(os.execute(("ln -s %q %q"):format(real, s.path)))
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  t:eq(p.refresh(providers.credential(p), 600), true)
  t:eq(fs.lstat(s.path).type, "link", "the link stays a link")
  local text = assert(fs.read_file(real))
  t:ok(text:find('"big": 12345678901234567890', 1, true), "a big number is kept as written")
  t:ok(text:find('"list": []', 1, true), "an empty array stays an array")
  t:ok(text:find('"access_token": "at-2"', 1, true), text)
  t:ok(text:find('"refresh_token": "rt-2"', 1, true), text)
  t:ok(not text:find("2020-01-01", 1, true), "last_refresh is new")
  t:eq(fs.stat(real).mode & 511, 384)
  loop.setenv("OPENAI_API_KEY", saved_key)
end

function tests.codex_refresh_spends_nothing_when_the_file_cannot_be_kept(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local s <close> = scene({ tokens = { access_token = jwt({ exp = os.time() - 1 }), refresh_token = "rt-keep" } },
    function() return 200, { access_token = "at-x" } end)
  -- the probe file name is taken by a folder: creating it fails, as on a read-only mount
  local probe = ("%s/.demesne-write-check.%d"):format(s.dir, loop.getpid())
  assert(fs.mkdir_p(probe .. "/x", 448))
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  local ok, err = p.refresh(providers.credential(p), 600)
  fs.remove_tree(probe)
  t:eq(ok, nil)
  t:match(err, "needs a refresh .* cannot be rewritten")
  t:eq(#s.srv.seen, 0, "the refresh token was not spent")
  loop.setenv("OPENAI_API_KEY", saved_key)
end

function tests.a_cancelled_caller_does_not_fail_the_shared_refresh(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local s <close> = scene({ tokens = { access_token = jwt({ exp = os.time() - 1 }), refresh_token = "rt-c" } },
    function() return 200, { access_token = "at-c" } end)
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  local cred = providers.credential(p)
  local a = async.spawn("first", function() return p.refresh(cred, 600) end)
  local b = async.spawn("second", function() return p.refresh(cred, 600) end)
  async.sleep(10)
  async.cancel(a, "gone")
  local _, ok = b:wait()
  t:eq(ok, true, "the other caller still gets the refresh")
  t:eq(#s.srv.seen, 1)
  t:eq(json.decode(assert(fs.read_file(s.path))).tokens.access_token, "at-c")
  loop.setenv("OPENAI_API_KEY", saved_key)
end

function tests.a_failing_token_endpoint_says_try_again(t)
  local saved_key = os.getenv("OPENAI_API_KEY")
  local s <close> = scene({ tokens = { access_token = jwt({ exp = os.time() - 1 }), refresh_token = "rt-5" } },
    function() return 503, { error = "unavailable" } end)
  local p = providers.load({ user_dir = false, quiet = true }):get("codex")
  local ok, err = p.refresh(providers.credential(p), 600)
  t:eq(ok, nil)
  t:match(err, "codex login refresh failed %(HTTP 503: unavailable%): the token endpoint .* did not answer; try again later")
  t:eq(#s.srv.seen, 1)
  loop.setenv("OPENAI_API_KEY", saved_key)
end

return tests
