-- lua/images/devcontainer.lua: what a devcontainer.json may say, what is refused by name,
-- and what a plan makes of a folder holding one (links and paths out of it refused). The
-- builds themselves run on real engines in tests/integration/devcontainer.test.mjs.
local config = require("demesne.config")
local devcontainer = require("demesne.images.devcontainer")
local features = require("demesne.images.features")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local function refused(t, text, pat, what)
  local ok, err = pcall(devcontainer.parse, text, ".devcontainer/devcontainer.json")
  t:ok(not ok, (what or text) .. " is refused")
  t:match(tostring(err), pat, what or text)
end

function tests.each_field_that_cannot_work_is_refused_by_name(t)
  local cases = {
    mounts = '["source=/,target=/host,type=bind"]',
    workspaceMount = '"source=/,target=/w,type=bind"', runArgs = '["--privileged"]', privileged = "true",
    capAdd = '["SYS_ADMIN"]', securityOpt = '["seccomp=unconfined"]', initializeCommand = '"touch /tmp/pwned"',
    dockerComposeFile = '"compose.yml"', appPort = "[8080]",
  }
  for field, v in pairs(cases) do
    refused(t, ('{ "image": "base", // a comment\n "%s": %s, }'):format(field, v),
      "devcontainer%.json: " .. field .. ": refused: ", field)
  end
  refused(t, '{"image": "base", "initializeCommand": "x"}', "runs on the host")
  refused(t, '{"build": {"dockerfile": "D", "options": ["--network=host"]}}', "build%.options: refused")
end

function tests.features_come_from_the_repository_or_a_configured_registry(t)
  -- not configured: ghcr.io, a tarball URL; and options that are no strings
  refused(t, '{"image": "base", "features": {"ghcr.io/devcontainers/features/node:1": {}}}',
    "features%.ghcr%.io/devcontainers/features/node:1: refused: it comes from the registry ghcr%.io, which config%.lua's "
    .. "registries does not name")
  refused(t, '{"image": "base", "features": {"https://example.test/f.tgz": {}}}', "features%.https://example%.test/f%.tgz: "
    .. "refused: a feature from a URL")
  refused(t, '{"image": "base", "features": ["./a"]}', "features: must be an object")
  refused(t, '{"image": "base", "features": {"./a": {"v": {"x": 1}}}}', "features%.%./a%.v: must be a string or a boolean")
  refused(t, '{"image": "base", "features": {"./a": {"v": "a\\nb"}}}', "features%.%./a%.v: holds a line break")
  refused(t, '{"image": "base", "features": {"./a": {"version": 1.10}}}', "features%.%./a%.version: must be a string "
    .. "or a boolean .*write a number as a string")
  -- a registry config.lua names (a scratch XDG_CONFIG_HOME, restored after)
  local dir = ("/tmp/demesne-devcontainer-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  assert(fs.mkdir_p(dir .. "/demesne"))
  assert(fs.write_atomic(dir .. "/demesne/config.lua", 'return { registries = { ["127.0.0.1:5043"] = {} } }'))
  local saved = os.getenv("XDG_CONFIG_HOME")
  loop.setenv("XDG_CONFIG_HOME", dir)
  config.load()
  local okp, c = pcall(devcontainer.parse, '{"image": "base", "features": {"127.0.0.1:5043/team/f/hello:1": "2.0", '
    .. '"./local": {"flag": true, "n": "3"}}}', "f")
  loop.setenv("XDG_CONFIG_HOME", saved or nil)
  config.load()
  fs.remove_tree(dir)
  if not okp then error(c, 0) end
  t:eq(#c.features, 2)
  t:eq(c.features[1].id, "./local")
  t:eq(c.features[1].kind, "local")
  t:eq(c.features[1].options, { flag = "true", n = "3" })
  t:eq(c.features[2].kind, "oci")
  t:eq(c.features[2].options, { version = "2.0" }, "a string is the version option")
end

function tests.a_feature_is_described_ordered_and_installed_as_the_spec_says(t)
  t:eq(features.option_var("install-tools.now"), "INSTALL_TOOLS_NOW")
  t:eq(features.option_var("2fast"), "_FAST")
  local function files(meta)
    return { { name = "devcontainer-feature.json", data = meta, mode = 420 },
      { name = "install.sh", data = "#!/bin/sh\n", mode = 493 } }
  end
  local f = { id = "./a", options = { greeting = "it's here" } }
  local d = features.describe("f", f, files([[{"id": "a", "options": {"greeting": {"type": "string", "default": "hi"},
    "loud": {"type": "boolean", "default": false}}, "containerEnv": {"A_HOME": "/opt/a", "PATH": "/opt/a/bin:${PATH}"},
    "installsAfter": ["./b"]}]]))
  local env = d.files[#d.files]
  t:eq(env.name, "devcontainer-features.env")
  t:match(env.data, "GREETING='it'\\''s here'\n", "the given value over the default, shell-quoted")
  t:match(env.data, "LOUD='false'\n", "a default the file gives")
  t:match(env.data, "_REMOTE_USER='root'\n")
  t:eq(d.env, { A_HOME = "/opt/a", PATH = "/opt/a/bin:${PATH}" })
  local b = features.describe("f", { id = "./b", options = {} }, files('{"id": "b"}'))
  local ordered = features.order("f", { d, b })
  t:eq(ordered[1].id, "./b", "installsAfter puts ./b first")
  local ctx = features.context(ordered)
  local cf = ctx[#ctx].data
  t:match(cf, "^ARG BASE\nFROM %${BASE}\nUSER root\n")
  t:match(cf, "COPY features/02/ /tmp/dev%-container%-features/02/\nENV A_HOME=\"/opt/a\"\nENV PATH=\"/opt/a/bin:%${PATH}\"\n"
    .. "RUN cd /tmp/dev%-container%-features/02 && chmod %-R 0755 %. && set %-a && %. %./devcontainer%-features%.env && "
    .. "set %+a && %./install%.sh\n")
  t:match(cf, "RUN rm %-rf /tmp/dev%-container%-features\n$")
  t:eq(ctx[1].name, "features/01/devcontainer-feature.json")
  -- refusals
  for field, v in pairs({ privileged = "true", capAdd = '["SYS_ADMIN"]', securityOpt = '["seccomp=unconfined"]',
    mounts = '[{"source": "/", "target": "/h", "type": "bind"}]', entrypoint = '"/usr/local/bin/start"' }) do
    local ok, err = pcall(features.describe, "f", { id = "./x", options = {} }, files(('{"id": "x", "%s": %s}'):format(field, v)))
    t:ok(not ok, field .. " is refused")
    t:match(tostring(err), "features%.%./x: devcontainer%-feature%.json: " .. field .. ": refused: ", field)
  end
  local ok, err = pcall(features.describe, "f", { id = "./x", options = {} }, { { name = "install.sh", data = "", mode = 493 } })
  t:ok(not ok)
  t:match(tostring(err), "features%.%./x: holds no devcontainer%-feature%.json")
  ok, err = pcall(features.describe, "f", { id = "./x", options = {} }, files('{"containerEnv": {"HTTPS_PROXY": "x"}}'))
  t:ok(not ok)
  t:match(tostring(err), "containerEnv%.HTTPS_PROXY is demesne's to set")
  ok, err = pcall(features.describe, "f", { id = "./x", options = { ["a-b"] = "1", a_b = "2" } }, files('{"id": "x"}'))
  t:ok(not ok, "two options that make one variable")
  t:match(tostring(err), "the options a%-b and a_b both become the variable A_B")
  ok, err = pcall(features.describe, "f", { id = "./x", options = {} },
    files('{"options": {"n": {"type": "string", "default": {"x": 1}}}}'))
  t:ok(not ok)
  t:match(tostring(err), "options%.n%.default must be a string or a boolean")
  -- a feature's own devcontainer-features.env is not taken: demesne writes that file
  local own = files('{"id": "x"}')
  own[#own + 1] = { name = "devcontainer-features.env", data = "LD_PRELOAD=/evil.so\n", mode = 420 }
  local dx = features.describe("f", { id = "./x", options = {} }, own)
  local envs = 0
  for _, e in ipairs(dx.files) do
    if e.name == "devcontainer-features.env" then
      envs = envs + 1
      t:ok(not e.data:find("LD_PRELOAD", 1, true), "demesne's own file")
    end
  end
  t:eq(envs, 1)
  local dep = features.describe("f", { id = "./c", options = {} }, files('{"dependsOn": {"127.0.0.1:5043/x/y:1": {}}}'))
  ok, err = pcall(features.order, "f", { dep })
  t:ok(not ok)
  t:match(tostring(err), "features%.%./c: dependsOn 127%.0%.0%.1:5043/x/y:1, which the devcontainer's features do not name")
end

function tests.what_a_file_must_say(t)
  refused(t, "{", "is not valid JSON with comments: line 1")
  refused(t, "[1]", "must hold a JSON object")
  refused(t, "{}", "image: the file names neither image nor build")
  refused(t, '{"image": "base", "build": {"dockerfile": "D"}}', "give image or build, not both")
  refused(t, '{"image": "Not A Ref"}', "image: \"Not A Ref\" is not a valid image reference")
  refused(t, '{"build": {}}', "build%.dockerfile: is missing")
  refused(t, '{"build": {"dockerfile": "D", "args": ["a"]}}', "build%.args: must be an object")
  refused(t, '{"build": {"dockerfile": "D", "args": {"A": "${localEnv:HOME}"}}}', "build%.args%.A: names the host's")
  refused(t, '{"image": "base", "containerEnv": {"DEMESNE_RUN_ID": "x"}}', "containerEnv%.DEMESNE_RUN_ID: is demesne's")
  refused(t, '{"image": "base", "remoteEnv": {"HTTPS_PROXY": "http://evil"}}', "remoteEnv%.HTTPS_PROXY: is demesne's")
  refused(t, '{"image": "base", "containerEnv": {"A": 1}}', "containerEnv%.A: must be a string")
  refused(t, '{"image": "base", "remoteEnv": {"A": "${localEnv:SECRET}"}}', "remoteEnv%.A: names the host's")
  refused(t, '{"image": "base", "postCreateCommand": 3}', "postCreateCommand: must be a string")
  refused(t, '{"image": "base", "onCreateCommand": {"a": 1}}', "onCreateCommand%.a: must be a string")
  refused(t, '{"image": "base", "postCreateCommand": ["echo", 1]}', "postCreateCommand%[1%]: must be a string")
  refused(t, '{"image": "base", "forwardPorts": ["db:5432"]}', "forwardPorts%[0%]: db:5432 is not a port")
  refused(t, '{"image": "base", "forwardPorts": [70000]}', "forwardPorts%[0%]")
end

function tests.the_fields_demesne_uses(t)
  local c = devcontainer.parse([[{
    "name": "app", "customizations": { "vscode": {} },
    "build": { "dockerfile": "Dockerfile", "context": "..", "args": { "V": "1" }, "target": "dev", },
    "containerEnv": { "A": "a" }, "remoteEnv": { "A": "over", "B": "${containerEnv:A}" },
    "onCreateCommand": "echo one",
    "postCreateCommand": { "x": "echo x", "y": ["echo", "y"] },
    "postStartCommand": ["touch", "/tmp/s"],
    "forwardPorts": [3000, "localhost:8080"], "remoteUser": "vscode",
  }]], "f")
  t:eq(c.build.dockerfile, "Dockerfile")
  t:eq(c.build.context, "..")
  t:eq(c.build.args, { V = "1" })
  t:eq(c.build.target, "dev")
  t:eq(c.env, { A = "over", B = "${containerEnv:A}" }, "remoteEnv over containerEnv")
  t:eq(#c.steps, 3)
  t:eq(c.steps[1], { field = "onCreateCommand", cmd = "echo one" })
  t:eq(c.steps[2].field, "postCreateCommand")
  t:eq(c.steps[2].parallel, { { name = "x", cmd = "echo x" }, { name = "y", cmd = { "echo", "y" } } })
  t:eq(c.steps[3], { field = "postStartCommand", cmd = { "touch", "/tmp/s" } })
  t:eq(c.ports, { 3000, 8080 })
  t:match(c.notes[1], "remoteUser is not used")
  local s = devcontainer.script(c.steps, "/workspace/it's")
  t:match(s, "cd '/workspace/it'\\''s'", "the folder is quoted")
  t:match(s, "/bin/sh %-c 'echo one' >> /out/devcontainer%.log 2>&1 < /dev/null || dc_fail 'onCreateCommand' %$%?")
  t:match(s, "'echo' 'y' >> /out/devcontainer%.log 2>&1 < /dev/null & dc_p2=%$!")
  t:match(s, "wait %$dc_p1 || dc_fail 'postCreateCommand%.x' %$%?")
end

function tests.a_dockerfile_that_reaches_past_the_build_is_refused(t)
  local function bad(src, pat)
    local ok, err = pcall(devcontainer.check_dockerfile, "D", src)
    t:ok(not ok, src)
    t:match(tostring(err), pat, src)
  end
  bad("FROM base\nADD https://example.com/x /x\n", "D line 2: ADD of a URL")
  bad("FROM base\nADD \\\n  git@github.com:a/b.git /b\n", "D line 2: ADD of a URL or git source")
  bad("FROM base\nRUN --network=host curl x\n", "D line 2: RUN %-%-network")
  bad("FROM base\nrun --security=insecure id\n", "RUN %-%-network and %-%-security")
  -- CVE-2024-9675: a cache id out of the cache folder is a host path on Podman 4.3
  bad("FROM base\nRUN --mount=type=cache,target=/h,id=../../../../../../tmp/x cat /h/y\n", "D line 2: RUN %-%-mount is refused")
  bad("FROM base\nENV A=1\nRUN --mount=type=bind,source=/,target=/h true\n", "D line 3: RUN %-%-mount is refused %(any type%)")
  bad("FROM base\nRUN echo a && \\\n  --MOUNT=type=secret,id=x true\n", "D line 2: RUN %-%-mount")
  bad("FROM base\nARG U\nADD $U /x\n", "D line 3: ADD of a URL or git source %(or of a %$variable")
  t:ok(pcall(devcontainer.check_dockerfile, "D", "FROM base\nADD ./local /x\nCOPY . /src\nRUN echo https://x\n"))
end

function tests.the_dockerfile_is_read_as_the_engine_reads_it(t)
  local function bad(src, pat)
    local ok, err = pcall(devcontainer.check_dockerfile, "D", src)
    t:ok(not ok, src)
    t:match(tostring(err), pat, src)
  end
  -- the escape directive: a backtick continues the line, and the next line is joined with no space
  bad("# escape=`\nFROM base\nADD `\n  https://example.com/x /x\n", "D line 3: ADD of a URL")
  bad("#  ESCAPE = `\nFROM base\nRUN --mo`\nunt=type=cache,target=/h,id=../../x true\n", "D line 3: RUN %-%-mount")
  bad("\239\187\191# escape=`\r\nFROM base\r\nRUN true `\r\n  --network=host x\r\n", "D line 3: RUN %-%-network")
  -- with `, a trailing \ continues nothing: the next line is an instruction of its own
  bad("# escape=`\nFROM base\nRUN echo \\\nADD http://x /x\n", "D line 4: ADD of a URL")
  -- a comment or an empty line inside a continued instruction is skipped, as the engine skips it
  bad("FROM base\nRUN \\\n# a comment\n\n  --mount=type=bind,source=/,target=/h true\n", "D line 2: RUN %-%-mount")
  bad("FROM base\nADD ht\\\ntps://example.com/x /x\n", "D line 2: ADD of a URL")
  bad("# escape=x\nFROM base\n", "D line 1: # escape=x: the escape character is")
  bad("# syntax=docker.io/evil/frontend\nFROM base\n", "D line 1: the parser directive # syntax= is refused: it makes")
  bad("# escape=`\n#Syntax = evil\nFROM base\n", "D line 2: the parser directive # syntax= is refused")
  bad("# shiny=1\nFROM base\n", "D line 1: the parser directive # shiny= is refused")
  bad("FROM base\n# syntax=evil/frontend\n", "D line 2: a # syntax= line is refused")
  bad("FROM base\nONBUILD ADD http://example.com/x /x\n", "D line 2: ONBUILD is refused")
  bad("FROM base\nonbuild RUN true\n", "D line 2: ONBUILD is refused")
  bad("FROM base\nON\\\nBUILD RUN true\n", "D line 2: ONBUILD is refused")
  -- a directive is read only at the top: after a comment (or anything) the line is a comment
  t:ok(pcall(devcontainer.check_dockerfile, "D", "# the app\n# escape=`\nFROM base\nRUN echo `\nCOPY . /x\n"))
  t:ok(pcall(devcontainer.check_dockerfile, "D", "# check=skip=all\n# escape=\\\nFROM base\nRUN echo a \\\n  b\n"))
  local ok, err = pcall(devcontainer.parse, '{"build": {"dockerfile": "D", "args": {"BUILDKIT_SYNTAX": "evil/x"}}}', "f")
  t:ok(not ok)
  t:match(tostring(err), "f: build%.args%.BUILDKIT_SYNTAX: refused: a BUILDKIT_%* argument")
end

-- A scratch folder with a devcontainer; removed afterwards.
local function with_folder(t, files, fn)
  local dir = ("/tmp/demesne-devcontainer-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  for name, data in pairs(files) do
    local path = dir .. "/" .. name
    fs.mkdir_p(path:match("^(.*)/"))
    if type(data) == "table" then assert(fs.symlink(data.link, path)) else assert(fs.write_atomic(path, data)) end
  end
  fs.mkdir_p(dir)
  local ok, err = pcall(fn, dir)
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
  return t
end

local function plan_of(dir, extra)
  local o = { mounts = { { host = dir, target = "/in/x", kind = "directory", field = "directories[0]" } },
    env = { "HOME=/root", "PATH=/usr/bin" }, command = "echo hi" }
  for k, v in pairs(extra or {}) do o[k] = v end
  devcontainer.plan(o, { directories = { dir }, env = { PATH = "/caller" } })
  return o
end

function tests.a_plan_reads_the_folder_and_wraps_the_command(t)
  with_folder(t, {
    [".devcontainer/devcontainer.json"] = '{ "build": { "dockerfile": "Dockerfile", "context": ".." },\n'
      .. '"containerEnv": { "TOOL": "${containerWorkspaceFolder}/bin", "PATH": "/dc" }, "postCreateCommand": "touch m" }',
    [".devcontainer/Dockerfile"] = "FROM base\nENV X=1\n",
  }, function(dir)
    local o = plan_of(dir)
    t:eq(o.devcontainer.file, ".devcontainer/devcontainer.json")
    t:eq(o.devcontainer.root, dir)
    t:eq(o.devcontainer.cfg.build.context_rel, "")
    t:eq(o.devcontainer.cfg.build.dockerfile_rel, ".devcontainer/Dockerfile")
    t:eq(o.env, { "HOME=/root", "PATH=/usr/bin", "TOOL=/workspace/bin" }, "the caller's PATH wins over the file's")
    t:eq(o.argv[1], "/bin/sh")
    t:match(o.argv[3], "touch m.*exec \"%$@\"\n$")
    t:eq({ o.argv[4], o.argv[5], o.argv[6], o.argv[7] }, { "devcontainer", "/bin/sh", "-c", "echo hi" })
  end)
  with_folder(t, { [".devcontainer.json"] = '{"image": "base"}' }, function(dir)
    local o = plan_of(dir)
    t:eq(o.devcontainer.file, ".devcontainer.json")
    t:eq(o.argv, nil, "no create command: the command is left as it is")
  end)
end

local function plan_fails(t, files, pat)
  with_folder(t, files, function(dir)
    local ok, err = pcall(plan_of, dir)
    t:ok(not ok, "refused: " .. pat)
    t:match(tostring(err), pat)
  end)
end

function tests.a_plan_never_leaves_the_folder(t)
  local dc = ".devcontainer/devcontainer.json"
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "../../etc/Dockerfile"}}' },
    "build%.dockerfile: %.%./%.%./etc/Dockerfile leads out of the repository")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "Dockerfile", "context": "../.."}}' },
    "build%.context: %.%./%.%. leads out of the repository")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "/etc/Dockerfile"}}' },
    "build%.dockerfile: /etc/Dockerfile is an absolute path")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "Dockerfile"}}' },
    "build%.dockerfile: %.devcontainer/Dockerfile does not exist in the repository")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "Dockerfile"}}',
    [".devcontainer/Dockerfile"] = { link = "/etc/hostname" } },
    "build%.dockerfile: %.devcontainer/Dockerfile is %(or passes through%) the symbolic link")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "x/Dockerfile", "context": "x"}}', ["real/Dockerfile"] = "FROM base\n",
    [".devcontainer/x"] = { link = "../real" } }, "passes through%) the symbolic link %.devcontainer/x")
  -- the git folder (its config holds the remotes' URLs, credentials and all) never goes into a build
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "Dockerfile", "context": "../.git"}}', [".git/config"] = "x",
    [".devcontainer/Dockerfile"] = "FROM base\n" }, "build%.context: %.%./%.git goes through %.git, refused")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "../.git/Dockerfile", "context": ".."}}',
    [".git/Dockerfile"] = "FROM base\n" }, "build%.dockerfile: %.%./%.git/Dockerfile goes through %.git, refused")
  plan_fails(t, { [dc] = '{"build": {"dockerfile": "Dockerfile", "context": "../sub/.GIT/.."}}',
    ["sub/.GIT/x"] = "", [".devcontainer/Dockerfile"] = "FROM base\n" }, "build%.context: .* goes through %.git")
  plan_fails(t, { [dc] = '{"image": "base", "mounts": []}' }, "mounts: refused")
  local ok, err = pcall(devcontainer.plan, { mounts = {}, env = {} }, {})
  t:ok(not ok)
  t:match(tostring(err), "image: devcontainer needs repository, or a directories entry holding")
end

function tests.a_build_context_never_holds_a_git_folder_or_file(t)
  with_folder(t, { [".git/config"] = "[remote] url = https://user:token@example.com/r", ["app.txt"] = "a",
    ["sub/.git"] = "gitdir: ../.git/modules/sub", ["sub/code.txt"] = "c", ["a/b/.git/HEAD"] = "ref",
    ["a/b/keep.txt"] = "k" }, function(dir)
    local names = {}
    for _, f in ipairs(devcontainer._read_context("f", dir, "")) do names[#names + 1] = f.name end
    table.sort(names)
    t:eq(names, { "a/b/keep.txt", "app.txt", "sub/code.txt" })
  end)
end

function tests.a_from_image_with_onbuild_triggers_is_refused_before_the_build(t)
  -- an engine that has one image, with a trigger; it is asked nothing else (no build, no pull)
  local asked = {}
  local eng = { socket = "/fake", image_inspect = function(_, ref, opts)
    asked[#asked + 1] = ref
    if ref == "docker.io/evil/img:7" then
      local trigger = "RUN --mount=type=cache,id=../..,target=/h x"
      return { id = "x", labels = {}, env = {}, onbuild = opts and opts.onbuild and { trigger } or {} }
    end
  end }
  local function ensure_fails(df, args, pat)
    with_folder(t, { [".devcontainer/devcontainer.json"] = ('{"build": {"dockerfile": "Dockerfile", "args": %s}}'):format(args),
      [".devcontainer/Dockerfile"] = df }, function(dir)
      local o = plan_of(dir)
      local ok, err = pcall(devcontainer.ensure, eng, o)
      t:ok(not ok, df)
      t:match(tostring(err), pat, df)
    end)
  end
  -- the variables are resolved as the engine resolves them: ARG defaults under build.args
  ensure_fails("ARG REG\nARG TAG=1\nFROM ${REG:-docker.io}/evil/$NAME:${TAG}\nENV A=1\n", '{"NAME": "img", "TAG": "7"}',
    "Dockerfile line 3: FROM %${REG:%-docker%.io}/evil/%$NAME:%${TAG}: the image carries ONBUILD triggers %(RUN %-%-mount")
  t:eq(asked[#asked], "docker.io/evil/img:7")
  ensure_fails("FROM docker.io/evil/img:$UNSET\n", "{}", "FROM docker%.io/evil/img:%$UNSET: refused: demesne cannot tell")
end

function tests.prune_takes_the_older_builds_and_those_whose_folder_is_gone(t)
  with_folder(t, { ["x"] = "" }, function(dir)
    local function img(id, created, src, ref)
      return { id = id, created = created, refs = { ref }, size_bytes = 1, labels = {
        ["io.demesne.origin"] = "devcontainer", [devcontainer.SOURCE_LABEL] = src,
        ["io.demesne.devcontainer.file"] = ".devcontainer.json", ["io.demesne.devcontainer.agent"] = "" } }
    end
    local asked
    local eng = { image_list = function(_, labels)
      asked = labels
      return { img("old", 1, dir, "demesne/devcontainer-x:111111111111"),
        img("new", 2, dir, "demesne/devcontainer-x:222222222222"),
        img("base", 1, dir, "demesne/devcontainer-x-base:333333333333"),
        img("gone", 3, dir .. "/nowhere", "demesne/devcontainer-nowhere:444444444444") }
    end }
    local list = assert(devcontainer.built(eng))
    t:eq(asked, { "io.demesne.origin=devcontainer" })
    local stale = {}
    for _, i in ipairs(list) do stale[i.id] = i.stale end
    t:eq(stale, { old = true, new = false, base = false, gone = true })
  end)
end

return tests
