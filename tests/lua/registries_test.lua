-- lua/registries.lua: which registry a reference names, and the host's own credentials for
-- it from real files (Podman's auth.json, Docker's config.json) and real credential helper
-- programs (shell scripts on PATH that speak the docker-credential protocol).
local registries = require("demesne.registries")
local docker = require("demesne.engines.docker")
local oci = require("demesne.images.oci")
local text = require("core.text")
local async = require("demesne.async")
local config = require("demesne.config")
local json = require("demesne.json")
local oauth = require("demesne.oauth")
local util = require("demesne.util")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local VARS = { "HOME", "REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "DOCKER_CONFIG", "PATH" }

-- A scratch HOME with nothing in it; `fn(dir)` sets up files. The environment is restored.
local function with_home(fn)
  local dir = ("/tmp/demesne-registries-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  fs.mkdir_p(dir .. "/home")
  fs.mkdir_p(dir .. "/bin")
  local saved = {}
  for _, k in ipairs(VARS) do saved[k] = os.getenv(k) or false end
  for _, k in ipairs(VARS) do loop.setenv(k, nil) end
  loop.setenv("HOME", dir .. "/home")
  loop.setenv("PATH", dir .. "/bin:/usr/bin:/bin")
  config.load()
  local ok, err = pcall(fn, dir)
  for k, v in pairs(saved) do loop.setenv(k, v or nil) end
  config.load()
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

local function write(path, data, mode)
  fs.mkdir_p(path:match("^(.*)/"))
  assert(fs.write_atomic(path, data))
  if mode then os.execute(("chmod %o %s"):format(mode, util.sh_quote(path))) end
end

local function auth(user, pass) return util.base64(user .. ":" .. pass) end

function tests.a_reference_names_its_registry_as_docker_decides(t)
  t:eq({ registries.split("127.0.0.1:5000/team/tools:1") }, { "127.0.0.1:5000", "team/tools", ":1" })
  t:eq({ registries.split("registry.example/x@sha256:" .. ("a"):rep(64)) },
    { "registry.example", "x", "@sha256:" .. ("a"):rep(64) })
  t:eq({ registries.split("debian:bookworm") }, { "docker.io", "library/debian", ":bookworm" })
  t:eq({ registries.split("team/tools") }, { "docker.io", "team/tools", "" })
  t:eq({ registries.split("localhost/x") }, { "localhost", "x", "" })
  t:eq({ registries.split("index.docker.io/library/debian") }, { "docker.io", "library/debian", "" })
  t:eq(registries.server("docker.io"), "https://index.docker.io/v1/")
  t:eq(registries.server("127.0.0.1:5000"), "127.0.0.1:5000")
end

function tests.no_file_means_no_credentials(t)
  with_home(function()
    local cred, err = registries.credentials("127.0.0.1:5000/x:1")
    t:eq(cred, nil)
    t:eq(err, nil)
  end)
end

-- Podman's files come before Docker's, REGISTRY_AUTH_FILE first of all; the most specific key wins.
function tests.auth_files_are_read_in_podmans_order(t)
  with_home(function(dir)
    write(dir .. "/home/.docker/config.json", json.encode({ auths = {
      ["127.0.0.1:5000"] = { auth = auth("docker-user", "docker-pw") },
      ["https://index.docker.io/v1/"] = { auth = auth("hub", "hub-pw") },
      ["other.example"] = { identitytoken = "tok-123456" } } }))
    local c = registries.credentials("127.0.0.1:5000/x:1")
    t:eq({ c.username, c.password, c.server, c.source }, { "docker-user", "docker-pw", "127.0.0.1:5000",
      dir .. "/home/.docker/config.json" })
    c = registries.credentials("debian:bookworm")
    t:eq({ c.username, c.password, c.server }, { "hub", "hub-pw", "https://index.docker.io/v1/" })
    c = registries.credentials("other.example/a/b")
    t:eq({ c.identity_token, c.username }, { "tok-123456", nil })

    write(dir .. "/home/.config/containers/auth.json", json.encode({ auths = {
      ["127.0.0.1:5000"] = { auth = auth("podman-user", "podman-pw") },
      ["127.0.0.1:5000/team"] = { auth = auth("team-user", "team:pw") } } }))
    c = registries.credentials("127.0.0.1:5000/x:1")
    t:eq({ c.username, c.password }, { "podman-user", "podman-pw" }, "auth.json before config.json")
    c = registries.credentials("127.0.0.1:5000/team/tools:1")
    t:eq({ c.username, c.password }, { "team-user", "team:pw" }, "a namespaced key wins for its repositories")
    c = registries.credentials("127.0.0.1:5000/teamx/tools:1")
    t:eq(c.username, "podman-user", "a namespace matches whole components only")

    write(dir .. "/explicit.json", json.encode({ auths = { ["127.0.0.1:5000"] = { auth = auth("explicit", "e-pw") } } }))
    loop.setenv("REGISTRY_AUTH_FILE", dir .. "/explicit.json")
    c = registries.credentials("127.0.0.1:5000/x:1")
    t:eq({ c.username, c.source }, { "explicit", dir .. "/explicit.json" })
  end)
end

function tests.a_bad_file_is_named_without_its_contents(t)
  with_home(function(dir)
    write(dir .. "/home/.docker/config.json", '{"auths": {"127.0.0.1:5000": {"auth": "!!not-base64 s3cr3t!!"}}}')
    local c, err = registries.credentials("127.0.0.1:5000/x:1")
    t:eq(c, nil)
    t:match(err, "registry 127.0.0.1:5000: the auths entry in .*config.json is not base64")
    t:ok(not err:find("s3cr3t", 1, true), "the message holds none of the file's secret")
    write(dir .. "/home/.docker/config.json", "{ not json s3cr3t")
    c, err = registries.credentials("127.0.0.1:5000/x:1")
    t:eq(c, nil)
    t:match(err, "config.json is not a JSON object")
    t:ok(not err:find("s3cr3t", 1, true))
  end)
end

-- A credential helper: run with "get", the server on stdin, its JSON answer read.
function tests.credential_helpers_answer_for_their_registries(t)
  with_home(function(dir)
    write(dir .. "/bin/docker-credential-dmtest", ("#!/bin/sh\n[ \"$1\" = get ] || exit 3\ncat > %s/asked\n"
      .. "printf '{\"ServerURL\":\"x\",\"Username\":\"helper-user\",\"Secret\":\"helper-pw\"}'\n"):format(dir), 493)
    write(dir .. "/bin/docker-credential-dmtoken", "#!/bin/sh\ncat >/dev/null\n"
      .. "printf '{\"Username\":\"<token>\",\"Secret\":\"tok-abcdef\"}'\n", 493)
    write(dir .. "/bin/docker-credential-dmnone", "#!/bin/sh\ncat >/dev/null\n"
      .. "echo 'credentials not found in native keychain'\nexit 1\n", 493)
    write(dir .. "/home/.docker/config.json", json.encode({
      credHelpers = { ["127.0.0.1:5000"] = "dmtest", ["tok.example"] = "dmtoken" },
      credsStore = "dmnone", auths = { ["store.example"] = {} } }))
    local c = registries.credentials("127.0.0.1:5000/x:1")
    t:eq({ c.username, c.password }, { "helper-user", "helper-pw" })
    t:eq(fs.read_file(dir .. "/asked"), "127.0.0.1:5000", "the helper is asked for the server")
    t:match(c.source, "docker%-credential%-dmtest")
    c = registries.credentials("tok.example/y")
    t:eq({ c.identity_token, c.password }, { "tok-abcdef", nil })
    local none, err = registries.credentials("store.example/z")
    t:eq({ none, err }, { nil, nil }, "a store that knows nothing: no credentials, no error")
  end)
end

-- A helper that hangs is stopped at registry_helper_timeout_seconds; one that is missing is
-- named. Neither leaves a process behind (the hanging one is killed).
function tests.a_helper_is_bounded_in_time(t)
  with_home(function(dir)
    write(dir .. "/home/.config/demesne/config.lua", "return { registry_helper_timeout_seconds = 0.3 }")
    loop.setenv("XDG_CONFIG_HOME", dir .. "/home/.config")
    config.load()
    write(dir .. "/bin/docker-credential-dmhang", ("#!/bin/sh\necho $$ > %s/pid\nexec sleep 30\n"):format(dir), 493)
    write(dir .. "/home/.docker/config.json", json.encode({ credHelpers = { ["hang.example"] = "dmhang",
      ["gone.example"] = "dmgone" } }))
    local c, err = registries.credentials("hang.example/x")
    t:eq(c, nil)
    t:match(err, "registry hang.example: docker%-credential%-dmhang did not answer within 300 ms")
    local pid = fs.read_file(dir .. "/pid")
    t:ok(pid and pid:match("%d+"), "the helper ran")
    -- killed at once; reaped (no longer a zombie) once the loop has seen it exit
    local st
    for _ = 1, 250 do
      local f = io.open("/proc/" .. pid:match("%d+") .. "/stat")
      st = f and f:read("a"):match("^%d+ %b() (%a)")
      if f then f:close() end
      if not st or st == "Z" then break end
      async.sleep(20)
    end
    t:ok(st == nil or st == "Z", "the helper was killed (state " .. tostring(st) .. ")")
    c, err = registries.credentials("gone.example/x")
    t:eq(c, nil)
    t:match(err, "registry gone.example: docker%-credential%-dmgone could not be run")
  end)
end

function tests.credentials_false_in_config_sends_none(t)
  with_home(function(dir)
    write(dir .. "/home/.docker/config.json", json.encode({ auths = { ["127.0.0.1:5000"] = { auth = auth("u", "p") } } }))
    write(dir .. "/home/.config/demesne/config.lua",
      'return { registries = { ["127.0.0.1:5000"] = { credentials = false, mirrors = { "127.0.0.1:5001/m/" } } } }')
    loop.setenv("XDG_CONFIG_HOME", dir .. "/home/.config")
    config.load()
    t:eq(registries.credentials("127.0.0.1:5000/x:1"), nil)
    t:eq(registries.config(), { ["127.0.0.1:5000"] = { credentials = false, mirrors = { "127.0.0.1:5001/m" } } })
    write(dir .. "/home/.config/demesne/config.lua",
      'return { registries = { ["127.0.0.1:5000"] = { insecure = true } } }')
    config.load()
    local conf, err = registries.config()
    t:eq(conf, nil)
    t:match(err, 'registries%["127.0.0.1:5000"%]%.insecure: not a field .*engine\'s own configuration')
  end)
end

-- What the engine adapter sends: base64url JSON, decoded back to the same credential.
function tests.the_engine_headers_carry_the_credential(t)
  local h = docker.registry_auth({ username = "u", password = "p>?~", server = "127.0.0.1:5000" })
  t:ok(not h:find("[+/]"), "base64url")
  t:eq(json.decode(oauth.base64url_decode(h)), { username = "u", password = "p>?~", serveraddress = "127.0.0.1:5000" })
  local c = docker.registry_config({ ["127.0.0.1:5000"] = { identity_token = "tok", server = "127.0.0.1:5000" } })
  t:eq(json.decode(oauth.base64url_decode(c)), { ["127.0.0.1:5000"] = { identitytoken = "tok",
    serveraddress = "127.0.0.1:5000" } })
  t:eq(registries.scrub("bad password p>?~ for u", { { password = "p>?~" } }), "bad password *** for u")
end

-- The OCI client's pieces that need no registry (tests/integration/registry.test.mjs pulls
-- a feature from a real one): a Bearer challenge as ghcr.io and Docker Hub send it, the
-- session a reference makes, and the digest function blobs are checked with.
function tests.an_oci_pull_reads_the_challenge_and_the_reference(t)
  t:eq(oci.parse_challenge('Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:a/b:pull"'),
    { realm = "https://ghcr.io/token", service = "ghcr.io", scope = "repository:a/b:pull" })
  t:eq(oci.parse_challenge('Basic realm="x"'), nil, "no Bearer")
  t:eq(oci.parse_challenge('Bearer service="x"'), nil, "no realm")
  local s = oci.session("127.0.0.1:5043/team/features/go:1")
  t:eq({ s.registry, s.path, s.reference }, { "127.0.0.1:5043", "team/features/go", "1" })
  s = oci.session("127.0.0.1:5043/team/go@sha256:" .. ("A"):rep(64))
  t:eq(s.reference, "sha256:" .. ("a"):rep(64), "a digest in lower case")
  local none, err = oci.session("127.0.0.1:5043/team/go@sha512:" .. ("a"):rep(128))
  t:eq(none, nil, "a sha512 pin is not taken for latest")
  t:match(err, "only a tag or a sha256 digest names a feature")
  t:eq(text.sha256("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", "FIPS 180-2's example")
  t:eq(text.sha256(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
end

return tests
