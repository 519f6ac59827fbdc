-- lua/images.lua: which images exist, what each builds FROM, and what reaches the engine.
-- The engine here is a small stand-in that keeps the build contexts it is sent (the real
-- engines build these images in tests/integration/images.test.mjs).
local images = require("demesne.images")
local config = require("demesne.config")
local archive = require("core.archive")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local ROOTFS = "demesne/debian-rootfs:bookworm"

-- A scratch config and state folder for one test; restores the environment afterwards.
local function with_config(fn)
  local dir = ("/tmp/demesne-images-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  fs.mkdir_p(dir .. "/config/demesne/images")
  fs.mkdir_p(dir .. "/state")
  loop.setenv("XDG_CONFIG_HOME", dir .. "/config")
  loop.setenv("DEMESNE_STATE_DIR", dir .. "/state")
  config.load()
  local ok, err = pcall(fn, dir .. "/config/demesne/images")
  loop.setenv("XDG_CONFIG_HOME", nil)
  loop.setenv("DEMESNE_STATE_DIR", nil)
  config.load()
  fs.remove_tree(dir)
  if not ok then error(err, 0) end
end

local function write(path, data)
  fs.mkdir_p(path:match("^(.*)/"))
  assert(fs.write_atomic(path, data))
end

-- An engine that has the root filesystem, records every build and "builds" by noting the
-- tag. fail[name] makes the build of that image fail; notes[name] is printed by its build.
local engines_made = 0
local function engine(opts)
  opts = opts or {}
  engines_made = engines_made + 1
  -- a socket name of its own: lua/images.lua caches what it saw per engine socket (a
  -- table's address, as before, can come back once the table is collected)
  local e = { socket = ("test:%d:%d"):format(loop.getpid(), engines_made), present = { [ROOTFS] = true }, labels = {},
    builds = {} }
  function e.image_inspect(self, ref)
    if self.present[ref] then return { id = ref, labels = self.labels[ref] or {} } end
    return nil, "inspect image: no such image", "ENOENT"
  end
  function e.build(self, tar, o, on_line)
    local dest = tar .. ".x"
    local res = assert(archive.extract(tar, dest))
    local files = {}
    for _, n in ipairs(res.entries) do files[n] = fs.read_file(dest .. "/" .. n) end
    fs.remove_tree(dest)
    local name = o.labels["io.demesne.image"]
    self.builds[#self.builds + 1] = { name = name, tag = o.tag, base = o.buildargs.BASE, args = o.buildargs,
      files = files, labels = o.labels }
    if (opts.fail or {})[name] then return nil, "image build failed: " .. opts.fail[name], "EBUILD" end
    if on_line and (opts.notes or {})[name] then -- printed twice: kept once
      on_line("demesne-note: " .. opts.notes[name] .. "\n")
      on_line("Step 9/9 : RUN x\n  demesne-note: " .. opts.notes[name] .. "  \n")
    end
    self.present[o.tag] = true
    self.labels[o.tag] = o.labels
    return true
  end
  return e
end

function tests.from_lines_are_read_with_flags_and_stages(t)
  t:eq(images.parse_from("ARG BASE\nFROM ${BASE}\n"), { { line = 2, ref = "${BASE}" } })
  t:eq(images.parse_from("from --platform=linux/amd64 python AS build\nRUN x\nFROM build\n"),
    { { line = 1, ref = "python", stage = "build" }, { line = 3, ref = "build" } })
  t:eq(images.parse_from("# FROM python\nRUN echo FROM node\n"), {})
end

function tests.from_names_are_rewritten_and_nothing_else(t)
  local tags = { python = "demesne/python:aaa", build = "demesne/build:bbb" }
  local src = "FROM python AS build\nRUN true\nFROM  --platform=x python\nFROM build\nFROM debian:bookworm\nFROM ${BASE}"
  t:eq(images._rewrite_from(src, tags), "FROM demesne/python:aaa AS build\nRUN true\n"
    .. "FROM  --platform=x demesne/python:aaa\nFROM build\nFROM debian:bookworm\nFROM ${BASE}")
  t:eq(images._rewrite_from("FROM python\n", tags), "FROM demesne/python:aaa\n", "the final newline is kept")
end

-- Images load through the one plugin loader: a folder that cannot be an image is refused
-- into the one error list, naming the folder; a folder without a Containerfile offers none.
function tests.image_folders_load_through_the_plugin_loader(t)
  with_config(function(dir)
    write(dir .. "/Bad Name/Containerfile", "FROM base\n")
    write(dir .. "/twine/storyformats/x/format.js", "window.storyFormat({})\n")
    write(dir .. "/mine/Containerfile", "FROM base\n")
    local cat = images.catalog()
    t:eq(#cat.errors, 1, "one refusal")
    t:match(cat.errors[1].message, "Bad Name: \"Bad Name\" is not an image name")
    t:eq(cat:get("Bad Name"), nil)
    t:eq(images.origin("twine"), "built-in", "extra context does not replace the built-in")
    t:eq(images.origin("mine"), "user")
    t:eq(images.origin("base"), "built-in")
    t:eq(images.user_names(), { "mine" })
  end)
end

function tests.a_user_image_builds_from_a_builtin_by_name(t)
  with_config(function(dir)
    write(dir .. "/mine/Containerfile", "FROM python\nCOPY hello.txt /hello.txt\n")
    write(dir .. "/mine/sub/hello.txt", "hi\n")
    local eng = engine()
    t:eq(images.origin("mine"), "user")
    t:ok(#images.list() > #images.user_names() and images.user_names()[1] == "mine", "listed")
    local img, err = images.ensure(eng, "mine")
    t:eq(err, nil)
    t:match(img.ref, "^demesne/mine:%x+$")
    local names = {}
    for _, b in ipairs(eng.builds) do names[#names + 1] = b.name end
    t:eq(names, { "base", "python", "mine" }, "parents first")
    local python, mine = eng.builds[2], eng.builds[3]
    t:eq(mine.files["Containerfile"], "FROM " .. python.tag .. "\nCOPY hello.txt /hello.txt\n")
    t:eq(mine.files["sub/hello.txt"], "hi\n")
    t:ok(mine.files["host-ca-certificates.crt"] ~= nil, "the host CAs are in every context")
    t:eq(mine.labels["io.demesne.origin"], "user")
    t:eq(mine.base, nil, "no BASE argument for a Containerfile that does not use it")
    t:eq(images.parent("mine"), "python")
    -- the same folder again: the same tag, nothing rebuilt
    t:eq(images.ensure(eng, "mine").ref, img.ref)
    t:eq(#eng.builds, 3)
    -- a change to a context file is a new image
    write(dir .. "/mine/sub/hello.txt", "hello\n")
    local img2 = images.ensure(eng, "mine")
    t:ok(img2.ref ~= img.ref, "new tag after a change")
  end)
end

function tests.a_user_image_replaces_the_builtin_of_its_name(t)
  with_config(function(dir)
    write(dir .. "/python/Containerfile", "FROM python\nRUN pip --version\n")
    local eng = engine()
    t:eq(images.origin("python"), "user")
    local img = assert(images.ensure(eng, "python"))
    local builtin, user = eng.builds[2], eng.builds[3]
    t:eq(builtin.labels["io.demesne.origin"], "built-in")
    t:eq(user.labels["io.demesne.origin"], "user")
    t:eq(img.ref, user.tag)
    t:eq(user.files["Containerfile"], "FROM " .. builtin.tag .. "\nRUN pip --version\n",
      "FROM python inside the user's python is the built-in python")
    t:eq(images.parent("python"), "python (built-in)")
  end)
end

function tests.a_copied_builtin_containerfile_gets_base(t)
  with_config(function(dir)
    write(dir .. "/go/Containerfile", "ARG BASE\nFROM ${BASE}\nRUN true\n")
    local eng = engine()
    assert(images.ensure(eng, "go"))
    t:eq(eng.builds[#eng.builds].base, eng.builds[1].tag, "BASE is the base image")
    t:eq(eng.builds[1].name, "base")
  end)
end

function tests.broken_user_images_are_refused_by_name(t)
  with_config(function(dir)
    write(dir .. "/a/Containerfile", "FROM b\n")
    write(dir .. "/b/Containerfile", "FROM a\n")
    write(dir .. "/linked/Containerfile", "FROM base\n")
    assert(fs.mkdir_p(dir .. "/linked"))
    os.execute(("ln -s /etc/passwd %q"):format(dir .. "/linked/passwd"))
    write(dir .. "/broken/Containerfile", "FROM base\nRUN exit 3\n")
    local eng = engine({ fail = { broken = "RUN exit 3: exit status 3" } })
    local _, err = images.ensure(eng, "a")
    t:match(err, "builds FROM itself")
    _, err = images.ensure(eng, "linked")
    t:match(err, "linked/passwd is a symlink")
    _, err = images.ensure(eng, "broken")
    t:match(err, "^building image broken failed: image build failed: RUN exit 3: exit status 3")
    local before = #eng.builds
    _, err = images.ensure(eng, "broken")
    t:ok(err and #eng.builds == before + 1, "a failed build is tried again, not remembered")
    t:ok(images.ensure(eng, "base"), "the other images still work")
    _, err = images.ensure(eng, "Bad Name")
    t:match(err, '^image: "Bad Name" is not a valid image reference', "a user folder with a bad name is no image")
  end)
end

function tests.twine_takes_the_users_story_formats_and_keeps_its_notes(t)
  with_config(function(dir)
    local eng = engine({ notes = { twine = "story format Minimal 1.0.0 (user)" } })
    local plain = assert(images.ensure(eng, "twine")).ref
    write(dir .. "/twine/storyformats/minimal-1.0.0/format.js", "window.storyFormat({});\n")
    t:eq(images.origin("twine"), "built-in", "a folder without a Containerfile does not replace twine")
    local img = assert(images.ensure(eng, "twine"))
    t:ok(img.ref ~= plain, "the formats are part of the tag")
    local last = eng.builds[#eng.builds - 1] -- the last build only stamps the notes
    t:eq(last.files["storyformats/minimal-1.0.0/format.js"], "window.storyFormat({});\n")
    t:eq(last.args.DEMESNE_TAG, img.ref, "the tag is passed, so the step printing notes is not cached")
    t:ok(last.files["storyformats/README.md"] ~= nil, "the built-in placeholder stays")
    local stamp = eng.builds[#eng.builds]
    t:eq(stamp.base, img.ref)
    t:eq(stamp.labels["io.demesne.notes"], "story format Minimal 1.0.0 (user)")
    local tag, notes = images.status(eng, "twine")
    t:eq(tag, img.ref)
    t:eq(notes, "story format Minimal 1.0.0 (user)")
  end)
end

-- images.pull: DEMESNE_NO_PULL lets only config.lua's registries through; mirrors are tried
-- first and what one served is tagged as the reference; a refusal names the registry and
-- the credentials' file, never the password. A user image's registry FROM is pulled before
-- its build, and the build gets that registry's credentials.
function tests.pulls_go_through_mirrors_with_the_hosts_credentials(t)
  with_config(function(dir)
    local root = dir:match("^(.*)/config/demesne/images$")
    write(root .. "/auth.json", '{"auths": {"127.0.0.1:5000": {"auth": "dXNlcjpzM2NyM3QtcHc="}}}') -- user:s3cr3t-pw
    write(root .. "/config/demesne/config.lua",
      'return { registries = { ["127.0.0.1:5000"] = { mirrors = { "127.0.0.1:5001/m" } } } }')
    loop.setenv("REGISTRY_AUTH_FILE", root .. "/auth.json")
    loop.setenv("DEMESNE_NO_PULL", "1")
    config.load()
    local ok, err = pcall(function()
      local eng = engine()
      eng.pulls, eng.tags = {}, {}
      function eng.pull(self, ref, _, _, o)
        self.pulls[#self.pulls + 1] = { ref = ref, user = o.auth and o.auth.username, server = o.auth and o.auth.server }
        if ref:find("^127%.0%.0%.1:5001/") and not self.mirror_ok then
          return nil, "pull failed: manifest unknown", "EPULL"
        end
        if self.refuse then return nil, "pull failed: unauthorized: bad password s3cr3t-pw", "EACCES" end
        self.present[ref] = true
        return true
      end
      function eng.tag(self, src, ref) self.tags[#self.tags + 1] = { src, ref }; self.present[ref] = true return true end

      local _, perr, code = images.pull(eng, "docker.io/library/alpine:3")
      t:eq(code, "EPOLICY")
      t:match(perr, "not pulled from docker.io: DEMESNE_NO_PULL=1 and config.lua's registries does not name docker.io")
      t:eq(#eng.pulls, 0, "nothing asked of the engine")

      t:eq(images.pull(eng, "127.0.0.1:5000/team/x:1"), true)
      t:eq(eng.pulls, { { ref = "127.0.0.1:5001/m/team/x:1" }, { ref = "127.0.0.1:5000/team/x:1", user = "user",
        server = "127.0.0.1:5000" } }, "the mirror first (no credentials for it), then the registry with them")
      eng.mirror_ok, eng.pulls = true, {}
      t:eq(images.pull(eng, "127.0.0.1:5000/team/y:2"), true)
      t:eq(eng.tags, { { "127.0.0.1:5001/m/team/y:2", "127.0.0.1:5000/team/y:2" } }, "what the mirror served is named")
      t:eq(#eng.pulls, 1)

      eng.mirror_ok, eng.refuse = false, true
      local _, rerr, rcode = images.pull(eng, "127.0.0.1:5000/team/z:3")
      t:eq(rcode, "EACCES")
      t:match(rerr, "^image: registry 127%.0%.0%.1:5000 refused the credentials for 127%.0%.0%.1:5000/team/z:3 %(from "
        .. root:gsub("%p", "%%%0") .. "/auth%.json%)")
      t:ok(not rerr:find("s3cr3t-pw", 1, true), "the password is scrubbed from the engine's message: " .. rerr)

      eng.refuse, eng.pulls = false, {}
      eng.builds = {}
      write(dir .. "/frommine/Containerfile", "FROM 127.0.0.1:5000/team/base:7 AS b\nFROM b\nRUN true\n")
      local builds = {}
      local build0 = eng.build
      function eng.build(self, tar, o, on_line)
        builds[#builds + 1] = o.registry_auth
        return build0(self, tar, o, on_line)
      end
      local img, berr = images.ensure(eng, "frommine")
      t:eq(berr, nil)
      t:ok(img and img.ref:match("^demesne/frommine:"), "built")
      t:eq(eng.pulls[#eng.pulls].ref, "127.0.0.1:5000/team/base:7", "the FROM image was pulled before the build")
      local auth = builds[#builds]["127.0.0.1:5000"]
      t:eq({ auth.username, auth.password }, { "user", "s3cr3t-pw" }, "the build has the FROM registry's credentials")
      t:eq(images._external_froms("FROM ${BASE}\nFROM scratch\nFROM a:1 AS x\nFROM x\nFROM a:1\n"), { "a:1" })
    end)
    loop.setenv("REGISTRY_AUTH_FILE", nil)
    loop.setenv("DEMESNE_NO_PULL", nil)
    if not ok then error(err, 0) end
  end)
end

-- images.freshness: current, changed (older builds of that name in the engine), not built.
function tests.freshness_compares_the_tag_of_the_current_inputs(t)
  with_config(function(dir)
    write(dir .. "/fr/Containerfile", "FROM base\nRUN echo 1\n")
    local eng = engine()
    eng.listed = {}
    function eng.image_list(self, labels)
      t:eq(labels, { "io.demesne.image=fr" })
      return self.listed
    end
    local f = images.freshness(eng, "fr")
    t:eq(f.state, "not built")
    t:eq(f.tag, nil, "base is not built either: no tag to name")
    local tag1 = assert(images.ensure(eng, "fr")).ref
    t:eq(images.freshness(eng, "fr"), { state = "current", tag = tag1 })
    eng.listed = { { refs = { "docker.io/" .. tag1 } } }
    write(dir .. "/fr/Containerfile", "FROM base\nRUN echo 2\n")
    f = images.freshness(eng, "fr")
    t:eq(f.state, "changed")
    t:eq(f.built, { tag1 })
    t:ok(f.tag ~= tag1 and f.tag:match("^demesne/fr:%x+$"), "the tag it would be built as")
    t:eq(select(2, images.freshness(eng, "nosuch")), 'no image "nosuch"')
  end)
end

return tests
