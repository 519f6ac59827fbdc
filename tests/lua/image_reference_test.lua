-- Image references: the OCI distribution reference grammar that lua/images.lua checks
-- before any caller's image name reaches the engine's API path (issue 10: "../events?x="
-- hung a call, "../images/<ref>/get?x=" pulled an image export into memory).
local images = require("demesne.images")

local tests = {}

local VALID = {
  "python", "demesne/python:56fd313de453", "docker.io/library/debian:bookworm-slim", "debian:bookworm",
  "localhost/x", "localhost:5000/team/app:v1.2_3", "registry.example.com:443/a/b/c", "lib/a.b-c__d---e",
  "Registry.Example.com/lower/path", "[::1]:5000/x:latest", "192.168.1.10:5000/x",
  "x@sha256:" .. ("a"):rep(64), "x:1@sha256:" .. ("0123456789abcdef"):rep(4), "agent-claude_code",
  ("a"):rep(255), "x:" .. ("t"):rep(128),
}

function tests.valid_references_pass(t)
  for _, ref in ipairs(VALID) do
    local ok, why = images.check_reference(ref)
    t:ok(ok, ("%q should pass (%s)"):format(ref, tostring(why)))
  end
end

local INVALID = {
  { "", "must not be empty" },
  { "../events?x=", "invalid registry host" },
  { "../images/x/get?x=", "invalid registry host" },
  { "x/../../events", "invalid path component" },
  { "a/../events", "invalid path component" },
  { "UPPER/case", "uppercase" },
  { "Python", "uppercase" },
  { "x?y", "invalid path component" },
  { "x#frag", "invalid path component" },
  { "x y", "invalid path component" },
  { "x/", "invalid path component" },
  { "/x", "invalid path component" },
  { "x//y", "invalid path component" },
  { "-x", "invalid path component" },
  { "x.", "invalid path component" },
  { "x..y", "invalid path component" },
  { "x___y", "invalid path component" },
  { "x%2Fy", "invalid path component" },
  { "x:", "invalid tag" },
  { "x:.tag", "invalid tag" },
  { "x:" .. ("t"):rep(129), "invalid tag" },
  { "x:t/ag", "invalid" },
  { "x@sha256:abc", "invalid digest" },
  { "x@:" .. ("a"):rep(64), "invalid digest" },
  { "bad_host.com:99999/x", "invalid registry host" },
  { "-bad.com/x", "invalid registry host" },
  { ("a"):rep(256), "more than 255" },
  { ("a/"):rep(200) .. "a", "more than 255" },
  { ("x"):rep(5000), "far over" },
  { 42, "must be a string" },
}

function tests.invalid_references_are_refused_with_the_reason(t)
  for _, case in ipairs(INVALID) do
    local ok, why = images.check_reference(case[1])
    t:eq(ok, nil, ("%q must be refused"):format(tostring(case[1])))
    t:ok(type(why) == "string" and why:find(case[2], 1, true), ("%q: %q should say %q"):format(tostring(case[1]),
      tostring(why), case[2]))
  end
end

-- images.ensure refuses before asking the engine: the adapter here fails the test if called.
function tests.ensure_refuses_a_bad_reference_without_calling_the_engine(t)
  local eng = setmetatable({ socket = "/nowhere" }, { __index = function(_, k)
    return function() error("the engine was called: " .. k) end
  end })
  for _, ref in ipairs({ "../events?x=", "../images/x/get?x=", "UPPER/case", "", ("a"):rep(300) }) do
    local r, err = images.ensure(eng, ref)
    t:eq(r, nil, ref)
    t:match(err, "^image: ", "the error names the field")
    t:match(err, "not a valid image reference", "and says why")
  end
end

return tests
