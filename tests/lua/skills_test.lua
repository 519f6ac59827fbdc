-- lua/skills.lua and `demesne skills`: reading SKILL.md, finding the tool calls it names,
-- checking them against the live tools (the host's and those a sandbox sees), and
-- installing skills as links into agents' skill folders. The shipped skills are checked
-- here too: every one must pass with no error and no warning, and a tool whose parameter
-- is renamed must break the check of every skill that uses it.
local skills = require("demesne.skills")
local fs = require("core.fs")
local loop = require("core.loop")

local tests = {}

local function source_root()
  local dir = os.getenv("DEMESNE_SOURCE_DIR")
  if dir and dir ~= "" then return dir end
  local here = debug.getinfo(1, "S").source:match("^@(.*)$") or ""
  return here:match("^(.*)/tests/lua/[^/]+$") or "."
end

local function scratch()
  local dir = ("/tmp/demesne-skills-test-%d-%d"):format(loop.getpid(), loop.hrtime())
  assert(fs.mkdir_p(dir))
  return dir
end

local function write(path, data)
  assert(fs.mkdir_p(path:match("^(.*)/")))
  assert(fs.write_atomic(path, data))
end

-- A skill folder `root`/`name` with SKILL.md = front .. body (and extra files).
local function make_skill(root, name, front, body, extra)
  write(root .. "/" .. name .. "/SKILL.md", front .. body)
  for rel, data in pairs(extra or {}) do write(root .. "/" .. name .. "/" .. rel, data) end
  return assert(skills.from_dir(root .. "/" .. name))
end

local GOOD_FRONT = [[
---
name: demo
description: >-
  Demonstrates the check. Use for tests. Not for anything else.
---
]]

local GOOD_BODY = [[
# Demo

## Procedure

1. Start a child:

```call child
sandbox_script
{"name": "first", "command": "echo hi > /out/hi.txt", "background": true}
```

2. Wait with `sandbox_wait(job_id, timeout_seconds=240)`:

   ```call child
   sandbox_wait
   {"job_id": "<job_id of first>", "timeout_seconds": 240}
   ```

3. Read [the notes](resources/notes.md).

## Output contract

- `/out/hi.txt`
]]

local surf -- loaded once: the live tool registries
local function surfaces()
  surf = surf or skills.surfaces({ user_dir = false })
  return surf
end

local function messages(problems, level)
  local out = {}
  for _, p in ipairs(problems) do
    if not level or p.level == level then out[#out + 1] = (p.line and (p.line .. ": ") or "") .. p.message end
  end
  return out
end

local function has(list, pat)
  for _, m in ipairs(list) do if m:find(pat) then return true end end
  return false
end

function tests.parse_front_matter_and_body(t)
  local doc = assert(skills.parse(GOOD_FRONT .. GOOD_BODY))
  t:eq(doc.front.name, "demo")
  t:eq(doc.front.description, "Demonstrates the check. Use for tests. Not for anything else.")
  t:eq(doc.body_line, 6, "the body starts after the closing ---")
  t:match(doc.body, "^# Demo")
  local _, err = skills.parse("# no front matter\n")
  t:match(err, "^line 1: SKILL.md must start with YAML front matter")
  _, err = skills.parse("---\nname: x\n")
  t:match(err, "no closing '%-%-%-' line")
  _, err = skills.parse("---\nname: x\ndescription: [unclosed\n---\nbody\n")
  t:match(err, "^front matter: ")
  _, err = skills.parse("---\n- a\n- b\n---\nbody\n")
  t:ok(err == nil, "a YAML list parses") -- but is not a mapping with a name: check says so
end

function tests.calls_are_found_with_their_lines_and_indentation(t)
  local doc = assert(skills.parse(GOOD_FRONT .. GOOD_BODY))
  local calls = skills.calls(doc)
  t:eq(#calls, 2)
  t:eq({ calls[1].surface, calls[1].tool, calls[1].args.name, calls[1].line },
    { "child", "sandbox_script", "first", 12 })
  t:eq({ calls[2].surface, calls[2].tool, calls[2].args.timeout_seconds, calls[2].line },
    { "child", "sandbox_wait", 240, 19 })
  local bad = assert(skills.parse(GOOD_FRONT .. "```call\nsandbox_wait {}\n```\n"
    .. "```call host\nsandbox_wait {job_id: 1}\n```\n"
    .. "```call host\nsandbox_wait [1, 2]\n```\n```call host\nsandbox_jobs\n```\n"))
  calls = skills.calls(bad)
  t:match(calls[1].error, "call host or ```call child")
  t:match(calls[2].error, "^sandbox_wait: the arguments must be one JSON object")
  t:match(calls[3].error, "^sandbox_wait: the arguments must be one JSON object")
  t:eq({ calls[4].tool, calls[4].error }, { "sandbox_jobs", nil }, "no arguments is an empty object")
end

function tests.mentions_in_prose_and_other_code_blocks(t)
  local doc = assert(skills.parse(GOOD_FRONT .. "Use sandbox_status(job_id, include_stdout_tail=true) or "
    .. "`mcp__demesne__sandbox_jobs`.\n```sh\n# not a tool: my_sandbox_thing\nsandbox_nope\n```\n"))
  local m = skills.mentions(doc)
  local seen = {}
  for _, x in ipairs(m) do seen[#seen + 1] = x.tool .. (x.params and ("(" .. table.concat(x.params, ",") .. ")") or "")
    .. (x.child and "@child" or "") .. ":" .. x.line end
  table.sort(seen)
  t:eq(seen, { "sandbox_jobs@child:6", "sandbox_nope:9", "sandbox_status(job_id,include_stdout_tail):6" })
end

function tests.a_good_skill_passes(t)
  local dir = scratch()
  local s = make_skill(dir, "demo", GOOD_FRONT, GOOD_BODY, { ["resources/notes.md"] = "notes\n" })
  local problems = skills.check(s, surfaces())
  fs.remove_tree(dir)
  t:eq(messages(problems), {})
end

function tests.the_check_names_each_problem_and_its_line(t)
  local dir = scratch()
  local front = "---\nname: Other_Name\ndescription: does things\nmetadata:\n  version: 2\nextra: 1\n---\n"
  local body = [[
# Broken

## Procedure

```call child
sandbox_scrpt
{"name": "z", "command": "true"}
```

```call child
sandbox_script
{"name": "a", "command": "true"}
```

```call child
sandbox_script
{"name": "a", "comand": "true", "background": "yes"}
```

```call child
sandbox_agent
{"name": "Bad_Name", "prompt": "x", "model": "<any model>"}
```

```call child
sandbox_agent
{"name": "b-<n>", "prompt": "x", "egress": "<not an enum value>"}
```

```call host
sandbox_script
{"name": "c", "command": "true"}
```

Call sandbox_wait(job_id, timeout) and sandbox_nothing, see [x](missing.md) and [y](https://example.invalid/x).

## Output contract

Nothing here.
]]
  local s = make_skill(dir, "demo", front, body)
  local problems = skills.check(s, surfaces())
  fs.remove_tree(dir)
  local errs, warns = messages(problems, "error"), messages(problems, "warning")
  local want = {
    "^1: name: \"Other_Name\" must be 1%-64 lowercase",
    "^1: name: \"Other_Name\" must be the skill's folder name, \"demo\"",
    "^1: metadata%.version: must map a string to a string",
    "^12: sandbox_scrpt: no such tool among the tools a sandbox sees",
    "^22: sandbox_script: no parameter \"comand\" among the tools a sandbox sees %(it takes .*command",
    "^22: sandbox_script: command: is required",
    "^22: sandbox_script: background: expected boolean",
    "^22: sandbox_script: the child name \"a\" is already used on line 17",
    "^27: sandbox_agent: name: must match the pattern",
    "^37: sandbox_script: no parameter \"name\" among the host tools",
    "^42: sandbox_wait%(timeout%): no parameter \"timeout\"",
    "^42: sandbox_nothing: no such tool",
    "^42: link to missing%.md: no such file",
    "the output contract names no file under /out/",
  }
  for _, w in ipairs(want) do t:ok(has(errs, w), "error " .. w .. " in:\n  " .. table.concat(errs, "\n  ")) end
  t:eq(#errs, #want, "no other error:\n  " .. table.concat(errs, "\n  "))
  t:ok(not has(errs, "^27: sandbox_agent: model"), "a template value skips the enum")
  t:ok(not has(errs, "^32:"), "a template name is checked against the pattern as x1 (b-x1 is fine)")
  t:ok(has(warns, "\"extra\" is not a field of the Agent Skills format"), table.concat(warns, "; "))
  t:ok(has(warns, "say when not to use the skill"), table.concat(warns, "; "))
end

function tests.a_skill_folder_is_bounded(t)
  local dir = scratch()
  local extra = {}
  for i = 1, skills.MAX_FILES + 5 do extra[("resources/r%03d.md"):format(i)] = "x" end
  local s = make_skill(dir, "demo", GOOD_FRONT, GOOD_BODY, extra)
  local n = 0
  for _ in pairs(s.files) do n = n + 1 end
  local errs = messages(skills.check(s, surfaces()), "error")
  write(dir .. "/big/SKILL.md", GOOD_FRONT:gsub("name: demo", "name: big") .. GOOD_BODY)
  write(dir .. "/big/resources/notes.md", ("x"):rep(skills.MAX_FILE + 1))
  local big = messages(skills.check(assert(skills.from_dir(dir .. "/big")), surfaces()), "error")
  fs.remove_tree(dir)
  t:eq(n, skills.MAX_FILES, "the walk stops at the bound")
  t:ok(has(errs, "holds more than " .. skills.MAX_FILES .. " files"), table.concat(errs, "; "))
  t:ok(has(big, "bytes, more than the " .. skills.MAX_FILE), table.concat(big, "; "))
end

function tests.sections_and_front_matter_are_required(t)
  local dir = scratch()
  local s = make_skill(dir, "demo", "---\ndescription: 3\n---\n", "# nothing\n")
  local errs = messages(skills.check(s, surfaces()), "error")
  fs.remove_tree(dir)
  t:ok(has(errs, "^1: name: required"), table.concat(errs, "; "))
  t:ok(has(errs, "^1: description: required"), table.concat(errs, "; "))
  t:ok(has(errs, "no '## Procedure' section"), table.concat(errs, "; "))
  t:ok(has(errs, "no '## Output contract' section"), table.concat(errs, "; "))
end

-- The skills in the source tree's skills/ folder: every one passes with no error and no
-- warning against the live tools, and there are the ten the project ships.
function tests.every_shipped_skill_passes_the_check(t)
  local list = skills.in_dir(source_root() .. "/skills")
  t:ok(#list >= 10, ("found the shipped skills (%d)"):format(#list))
  local s = surfaces()
  t:ok(s.child ~= nil, "this build offers the tools a sandbox sees")
  local bad = {}
  for _, sk in ipairs(list) do
    for _, m in ipairs(messages(skills.check(sk, s))) do bad[#bad + 1] = sk.name .. ": " .. m end
  end
  t:eq(bad, {}, "problems of the shipped skills")
end

-- The check reads the live schemas: a user tool that replaces sandbox_wait with its
-- parameter renamed breaks every skill that waits, on both sides, at the line of the call.
function tests.renamed_parameter_breaks_the_check(t)
  local fixtures = source_root() .. "/tests/fixtures/skills/renamed-tool"
  local renamed = skills.surfaces({ user_dir = fixtures })
  t:ok(renamed.host:get("sandbox_wait").inputSchema.properties.wait_seconds, "the user tool replaced sandbox_wait")
  local list = skills.in_dir(source_root() .. "/skills")
  local broken, waiting = 0, 0
  for _, sk in ipairs(list) do
    local text = assert(skills.read(sk, "SKILL.md"))
    local doc = assert(skills.parse(text))
    local lines = {}
    for _, c in ipairs(skills.calls(doc)) do
      if c.tool == "sandbox_wait" and c.args and c.args.timeout_seconds then lines[#lines + 1] = c.line end
    end
    if #lines > 0 then
      waiting = waiting + 1
      local errs = messages(skills.check(sk, renamed), "error")
      for _, l in ipairs(lines) do
        t:ok(has(errs, "^" .. l .. ": sandbox_wait: no parameter \"timeout_seconds\""),
          sk.name .. ": the wait on line " .. l .. " fails: " .. table.concat(errs, "; "))
      end
      if #errs > 0 then broken = broken + 1 end
    end
  end
  t:ok(waiting >= 10, "every shipped skill waits with timeout_seconds (" .. waiting .. ")")
  t:eq(broken, waiting, "each of them fails the check")
end

-- The example in docs/how-to/write-a-skill.md is a skill that passes the check.
function tests.the_how_to_example_passes_the_check(t)
  local doc = assert(fs.read_file(source_root() .. "/docs/how-to/write-a-skill.md"))
  local example = doc:match("\n````markdown\n(.-\n)````\n")
  t:ok(example, "the how-to has a ````markdown example")
  local dir = scratch()
  write(dir .. "/lint-sweep/SKILL.md", example)
  local problems = skills.check(assert(skills.from_dir(dir .. "/lint-sweep")), surfaces())
  fs.remove_tree(dir)
  t:eq(messages(problems), {})
end

function tests.user_skills_replace_builtin_ones(t)
  local dir = scratch()
  make_skill(dir, "demesne-bisect-hunt", GOOD_FRONT:gsub("name: demo", "name: demesne-bisect-hunt"), GOOD_BODY)
  make_skill(dir, "mine", GOOD_FRONT:gsub("name: demo", "name: mine"), GOOD_BODY)
  write(dir .. "/not-a-skill/README.md", "no SKILL.md here\n")
  local all = skills.all({ user_dir = dir })
  local by = {}
  for _, s in ipairs(all) do by[s.name] = s end
  fs.remove_tree(dir)
  t:ok(by["demesne-build-and-land"] and by["demesne-build-and-land"].builtin, "a built-in skill")
  t:ok(by["demesne-bisect-hunt"].replaces, "a user skill replaces the built-in of its name")
  t:eq(by["demesne-bisect-hunt"].dir, dir .. "/demesne-bisect-hunt")
  t:ok(by.mine and not by.mine.builtin and not by.mine.replaces, "a user skill of its own")
  t:eq(by["not-a-skill"], nil, "a folder without SKILL.md is no skill")
end

function tests.materialize_writes_once_and_replaces_whole(t)
  local dir = scratch()
  local files = { ["SKILL.md"] = "one", ["resources/a.md"] = "a" }
  local s = { name = "emb", origin = "embedded", files = {} }
  for rel in pairs(files) do s.files[rel] = function() return files[rel] end end
  local dest, how = skills.materialize(s, dir)
  t:eq({ dest, how }, { dir .. "/emb", "written" })
  t:eq(fs.read_file(dir .. "/emb/resources/a.md"), "a")
  t:eq({ skills.materialize(s, dir) }, { dir .. "/emb", "unchanged" })
  files["SKILL.md"] = "two"
  files["resources/a.md"] = nil
  s.files["resources/a.md"] = nil
  t:eq({ skills.materialize(s, dir) }, { dir .. "/emb", "written" })
  t:eq(fs.read_file(dir .. "/emb/SKILL.md"), "two")
  t:eq(fs.stat(dir .. "/emb/resources/a.md"), nil, "a file the skill no longer has is gone")
  t:eq(fs.readdir(dir), { "emb" }, "no temporary folder is left")
  fs.remove_tree(dir)
end

function tests.install_links_twice_safely_and_leaves_others_alone(t)
  local dir = scratch()
  loop.setenv("XDG_DATA_HOME", dir .. "/data")
  local src = dir .. "/src"
  local list = {
    make_skill(src, "alpha", GOOD_FRONT:gsub("name: demo", "name: alpha"), GOOD_BODY,
      { ["resources/notes.md"] = "n\n" }),
    make_skill(src, "beta", GOOD_FRONT:gsub("name: demo", "name: beta"), GOOD_BODY,
      { ["resources/notes.md"] = "n\n" }),
    make_skill(src, "broken", GOOD_FRONT:gsub("name: demo", "name: broken"), "no sections\n"),
  }
  -- an embedded skill (no folder): written to the data folder first
  list[#list + 1] = { name = "gamma", origin = "embedded", files = {
    ["SKILL.md"] = function() return (GOOD_FRONT:gsub("name: demo", "name: gamma")) .. GOOD_BODY end,
    ["resources/notes.md"] = function() return "n\n" end } }
  local target = dir .. "/agent/skills"
  write(target .. "/beta/SKILL.md", "the user's own beta\n")
  assert(fs.symlink(dir .. "/data/demesne/skills/retired", target .. "/retired"))
  assert(fs.symlink("/somewhere/else", target .. "/foreign"))
  local lines = {}
  local ok = skills.install(list, surfaces(), { target .. "/" }, function(l) lines[#lines + 1] = l end)
  t:eq(ok, false, "a skipped skill and a refused link make it fail")
  local text = table.concat(lines, "\n")
  t:match(text, "skipped  broken: it fails `demesne skills check`")
  t:match(text, "refused  " .. target:gsub("%p", "%%%0") .. "/beta already exists and is not a link")
  t:match(text, "removed  " .. target:gsub("%p", "%%%0") .. "/retired")
  t:eq(fs.readlink(target .. "/alpha"), src .. "/alpha", "a skill on disk is linked where it is")
  t:eq(fs.readlink(target .. "/gamma"), dir .. "/data/demesne/skills/gamma", "an embedded one from the data folder")
  t:eq(fs.read_file(target .. "/gamma/resources/notes.md"), "n\n")
  t:eq(fs.read_file(target .. "/beta/SKILL.md"), "the user's own beta\n", "the user's folder is untouched")
  t:eq(fs.readlink(target .. "/foreign"), "/somewhere/else", "someone else's link is untouched")
  t:eq(fs.lstat(target .. "/broken"), nil, "a failing skill is not installed")

  local again = {}
  skills.install({ list[1], list[4] }, surfaces(), { target }, function(l) again[#again + 1] = l end)
  t:eq(again, { target .. ": 0 skill(s) linked, 0 relinked, 2 already in place" }, "the second run changes nothing")
  loop.setenv("XDG_DATA_HOME", nil)
  fs.remove_tree(dir)
end

return tests
