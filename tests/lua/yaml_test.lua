-- core.yaml (core/bind/yaml.c): libyaml's events to Lua values, the core schema, the bounds.
local yaml = require("core.yaml")
local json = require("demesne.json")
local loop = require("core.loop")

local tests = {}

function tests.yaml_scalars_follow_the_core_schema(t)
  local v = assert(yaml.decode([[
s: hello
n: 42
neg: -7
oct: 0o17
hex: 0x1F
f: 1.5
e: 1e3
inf: -.inf
t: true
F: FALSE
nul: null
tilde: ~
empty:
quoted: "42"
single: 'true'
yes11: yes
octal11: 0777
block: |
  line one
  line two
big: 0xFFFFFFFFFFFFFFFFFF
tagged: !!str 12
]]))
  t:eq(v.s, "hello")
  t:eq(math.type(v.n), "integer", "42 is an integer")
  t:eq(v.n, 42)
  t:eq(v.neg, -7)
  t:eq(v.oct, 15)
  t:eq(v.hex, 31)
  t:eq(v.f, 1.5)
  t:eq(v.e, 1000.0)
  t:eq(v.inf, -math.huge)
  t:eq(v.t, true)
  t:eq(v.F, false)
  t:eq(v.nul, yaml.null)
  t:eq(v.tilde, yaml.null)
  t:eq(v.empty, yaml.null)
  t:ok(yaml.null == json.null, "core.yaml.null is JSON's null")
  t:eq(v.quoted, "42")
  t:eq(v.single, "true")
  t:eq(v.yes11, "yes", "YAML 1.1 booleans are strings")
  t:eq(v.octal11, 777, "0777 is decimal in YAML 1.2")
  t:eq(v.block, "line one\nline two\n")
  t:eq(v.big, "0xFFFFFFFFFFFFFFFFFF")
  t:eq(v.tagged, "12")
end

function tests.yaml_collections_and_flow_style(t)
  local v = assert(yaml.decode("a: [1, two, {b: c}]\n'1': x\nd: {}\ne: []\n"))
  t:eq(v, { a = { 1, "two", { b = "c" } }, ["1"] = "x", d = {}, e = {} })
  t:eq(assert(yaml.decode("- a\n- - b\n  - c\n")), { "a", { "b", "c" } })
  t:eq(assert(yaml.decode('{"k": "v"}')), { k = "v" }, "JSON is YAML")
  t:eq(yaml.decode(""), yaml.null, "an empty text")
  t:eq(yaml.decode("# only a comment\n"), yaml.null)
  t:eq(yaml.decode("---\nplain\n...\n"), "plain")
end

function tests.yaml_errors_name_the_line_and_column(t)
  local v, msg, code = yaml.decode("a: b\nc: d: e\n")
  t:eq(v, nil)
  t:eq(code, "EINVAL")
  t:match(msg, "^yaml: line 2, column %d+: mapping values are not allowed")
  msg = select(2, yaml.decode("a: 1\nb: 2\na: 3\n"))
  t:eq(msg, "yaml: line 3, column 1: a key appears twice in one mapping")
  msg = select(2, yaml.decode("? [a]\n: b\n"))
  t:match(msg, "a mapping key must be a scalar")
  msg = select(2, yaml.decode("a: *nothing\n"))
  t:match(msg, "^yaml: line 1, column 4: an alias names no anchor before it")
  msg = select(2, yaml.decode("a: !!int twelve\n"))
  t:match(msg, "does not match its tag")
  msg = select(2, yaml.decode("a: !custom x\n"))
  t:match(msg, "unsupported tag")
  msg = select(2, yaml.decode("a: 1\n---\nb: 2\n"))
  t:match(msg, "more than one document")
  v, msg = yaml.decode("a: \"unterminated\n")
  t:match(msg, "^yaml: line %d+, column %d+: ")
  t:eq(v, nil)
end

function tests.yaml_aliases_are_shared_and_counted(t)
  local v = assert(yaml.decode("base: &b {x: 1}\nuse: *b\ns: &s text\nt: *s\n"))
  t:eq(v.use, { x = 1 })
  t:ok(rawequal(v.use, v.base), "an alias gives the anchored table itself")
  t:eq(v.t, "text")
  -- the whole document is 1 + 2 key/value pairs ... counted with the alias's size again
  t:eq(yaml.decode("a: &a [1, 2, 3]\nb: *a\n", { max_nodes = 9 }), nil)
  t:ok(yaml.decode("a: &a [1, 2, 3]\nb: *a\n", { max_nodes = 11 }), "within the bound")
end

function tests.yaml_a_billion_laughs_fails_fast(t)
  local lines = { "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]" }
  for i = 1, 9 do
    local refs = {}
    for _ = 1, 10 do refs[#refs + 1] = "*a" .. (i - 1) end
    lines[#lines + 1] = ("a%d: &a%d [%s]"):format(i, i, table.concat(refs, ", "))
  end
  local t0 = loop.hrtime()
  local v, msg = yaml.decode(table.concat(lines, "\n") .. "\n")
  local ms = (loop.hrtime() - t0) / 1e6
  t:eq(v, nil)
  t:match(msg, "^yaml: line %d+, column %d+: too many nodes")
  t:ok(ms < 200, ("refused in %.1f ms"):format(ms))
end

function tests.yaml_bounds_depth_and_size(t)
  local deep = string.rep("[", 65) .. string.rep("]", 65)
  local v, msg = yaml.decode(deep)
  t:eq(v, nil)
  t:match(msg, "nested too deeply")
  t:ok(yaml.decode(string.rep("[", 64) .. string.rep("]", 64)), "64 levels are read")
  t:ok(yaml.decode(deep, { max_depth = 100 }), "a larger max_depth")
  msg = select(2, yaml.decode("a: b\n", { max_bytes = 3 }))
  t:eq(msg, "yaml: the text is longer than max_bytes")
  t:ok(not pcall(yaml.decode, "a", { max_depth = -1 }), "a negative bound raises")
  t:ok(not pcall(yaml.decode, {}), "text must be a string")
end

return tests
