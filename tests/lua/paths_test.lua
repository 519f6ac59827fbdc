local paths = require("demesne.paths")
local config = require("demesne.config")
local loop = require("core.loop")
local fs = require("core.fs")

local tests = {}

local function setup()
  local d = os.tmpname()
  os.remove(d)
  fs.mkdir_p(d .. "/allowed1/sub")
  fs.mkdir_p(d .. "/allowed10")
  fs.write_atomic(d .. "/allowed1/a.txt", "a")
  fs.write_atomic(d .. "/allowed10/x", "x")
  os.execute(("ln -s /etc %s/allowed1/etc-link"):format(d))
  loop.setenv("DEMESNE_ALLOWED_PATHS", d .. "/allowed1")
  config.load()
  return d
end

local function teardown(d)
  loop.setenv("DEMESNE_ALLOWED_PATHS", nil)
  config.load()
  fs.remove_tree(d)
end

function tests.within_compares_components(t)
  t:eq(paths.within("/a/b1", "/a/b"), false)
  t:eq(paths.within("/a/b/c", "/a/b"), true)
  t:eq(paths.within("/a/b", "/a/b"), true)
  t:eq(paths.within("/x", "/"), true)
end

function tests.C12_traversal_prefix_symlink_and_encoded_refused(t)
  local d = setup()
  local cases = {
    { d .. "/allowed1/../../../etc/passwd", "not inside the allowed paths" },
    { d .. "/allowed10/x", "not inside the allowed paths" },
    { d .. "/allowed1/etc-link", "resolves to /etc" },
    { d .. "/allowed1/%2e%2e/%2e%2e/etc/passwd", "cannot resolve" },
    { "relative/path", "must be absolute" },
  }
  for _, c in ipairs(cases) do
    local real, err = paths.check("files[0]", c[1], "any")
    t:eq(real, nil, c[1])
    t:match(err, c[2], c[1])
    t:match(err, "files%[0%]", c[1])
  end
  t:ok(paths.check("files[0]", d .. "/allowed1/a.txt", "file"), "allowed file accepted")
  teardown(d)
end

function tests.duplicate_basenames_refused(t)
  local d = setup()
  fs.mkdir_p(d .. "/allowed1/sub/a.txt.d")
  fs.write_atomic(d .. "/allowed1/sub/a.txt", "b")
  local m, err = paths.inputs({ d .. "/allowed1/a.txt", d .. "/allowed1/sub/a.txt" })
  t:eq(m, nil)
  t:match(err, "would collide")
  teardown(d)
end

function tests.nothing_configured_says_so(t)
  loop.setenv("DEMESNE_ALLOWED_PATHS", nil)
  config.load()
  local _, err = paths.check("files[0]", "/etc/hostname", "file")
  t:match(err, "DEMESNE_ALLOWED_PATHS is not configured")
end

return tests
