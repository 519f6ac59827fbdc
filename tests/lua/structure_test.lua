-- The shape of the Lua runtime, read from the files embedded in this binary (or the source
-- tree's, with DEMESNE_SOURCE_DIR):
--   * no module cycle: the graph of require("demesne.…") calls has no cycle;
--   * no back-edge: each module sits in a layer (LAYERS) and requires only its own layer or
--     those below it: MCP → tools → (sandbox | agent | jobs) → engine adapter → core;
--   * no require inside a function, unless the line says why it loads lazily (`-- lazy: …`);
--   * LuaCATS on every public function: a `---` doc comment with an @param for each
--     parameter, on each function of the table a module returns and on each method;
--   * one composition root: only demesne.compose installs a layer (layer.install) or
--     registers a kind of background job (jobs.register);
--   * no function longer than FUNCTION_MAX lines.
-- docs/explanation/architecture.md ("Layers") describes the same layers.
local fs = require("core.fs")
local runtime = require("demesne.runtime")

local tests = {}

-- Layer of each module (the longest matching prefix wins). Higher layers may require lower
-- ones and their own; never a higher one.
local LAYERS = {
  -- 6: the command line, composition roots
  ["demesne.boot"] = 6, ["demesne.cli"] = 6, ["demesne.cmd"] = 6, ["demesne.doctor"] = 6, ["demesne.testing"] = 6,
  ["demesne.compose"] = 6,
  -- 5: the MCP session and its transports
  ["demesne.mcp"] = 5, ["demesne.hostmcp"] = 5,
  -- the cockpit: the control plane of a server and its clients, beside the transports
  ["demesne.cockpit"] = 5,
  -- 4: tools (loader, API, shared schemas)
  ["demesne.tools"] = 4, ["demesne.schemas"] = 4,
  -- the orchestration skills, checked against the live tools (host and in-sandbox)
  ["demesne.skills"] = 4,
  -- 3: sandboxes, agent runs, jobs, and what they are built from
  ["demesne.sandbox"] = 3, ["demesne.agent"] = 3, ["demesne.jobs"] = 3, ["demesne.vendor"] = 3,
  ["demesne.egress"] = 3, ["demesne.providers"] = 3, ["demesne.images"] = 3,
  -- nested sandboxes (lua/tree), the warm pool, demesne-init's control channel, removals
  -- after the answer: beside sandboxes, agent runs and jobs, and hooked into them
  ["demesne.tree"] = 3, ["demesne.pool"] = 3, ["demesne.channel"] = 3, ["demesne.teardown"] = 3,
  -- a child's tools are the host's tools (layer 4), served on an MCP endpoint (layer 5)
  ["demesne.tree.child"] = 4, ["demesne.tree.endpoint"] = 5,
  -- 2: engine adapters
  ["demesne.engines"] = 2,
  -- git on the host (lua/repo): a repository in, a branch out; below sandboxes and jobs
  ["demesne.repo"] = 2,
  -- image registries: the host's credentials for them and their config.lua section; below images
  ["demesne.registries"] = 2,
  -- 1: the base library over the core.* bindings
  ["demesne.async"] = 1, ["demesne.config"] = 1, ["demesne.errors"] = 1, ["demesne.json"] = 1, ["demesne.log"] = 1,
  ["demesne.util"] = 1, ["demesne.proc"] = 1, ["demesne.paths"] = 1, ["demesne.output"] = 1, ["demesne.progress"] = 1,
  ["demesne.plugins"] = 1, ["demesne.runtime"] = 1, ["demesne.terminal"] = 1, ["demesne.oauth"] = 1, ["demesne.jsonschema"] = 1,
  -- the layer contract (lua/layer.lua): the lower layers run the hooks the higher ones declare
  ["demesne.layer"] = 1,
  -- the services runner (lua/services.lua): starts a declared list, stops it in reverse
  ["demesne.services"] = 1,
}

local function layer_of(mod)
  local best, len = nil, -1
  for prefix, l in pairs(LAYERS) do
    if (mod == prefix or mod:sub(1, #prefix + 1) == prefix .. ".") and #prefix > len then best, len = l, #prefix end
  end
  return best
end

-- "lua/mcp/server.lua" -> "demesne.mcp.server"; "lua/engines/init.lua" -> "demesne.engines"
local function module_of(rel)
  local m = rel:gsub("^lua/", ""):gsub("%.lua$", ""):gsub("/init$", ""):gsub("/", ".")
  return "demesne." .. m
end

-- The runtime's files: those embedded in the binary, or with DEMESNE_SOURCE_DIR those of
-- the source tree (which may have moved on since the build).
local function rels()
  local out = {}
  if runtime.source_dir then
    local function walk(rel)
      for _, n in ipairs(fs.readdir(runtime.source_dir .. "/" .. rel) or {}) do
        local st = fs.stat(runtime.source_dir .. "/" .. rel .. n)
        if st and st.type == "directory" then walk(rel .. n .. "/")
        elseif n:match("%.lua$") then out[#out + 1] = rel .. n end
      end
    end
    walk("lua/")
  else
    for rel in pairs(runtime.embedded) do
      if rel:match("^lua/.+%.lua$") then out[#out + 1] = rel end
    end
  end
  return out
end

-- Every runtime file: {rel, module, src}.
local function files()
  local out = {}
  for _, rel in ipairs(rels()) do
    out[#out + 1] = { rel = rel, module = module_of(rel), src = assert(runtime.source(rel)) }
  end
  table.sort(out, function(a, b) return a.rel < b.rel end)
  return out
end

-- Tokens of a Lua source with their lines, comments and strings dropped (string contents
-- kept as a "string" token with its value, so require("x") can be read).
local function tokens(src)
  local out, i, line, n = {}, 1, 1, #src
  local function long_bracket(at)
    local eq = src:match("^%[(=*)%[", at)
    if not eq then return nil end
    local close = "]" .. eq .. "]"
    local s, e = src:find(close, at + #eq + 2, true)
    e = e or n
    return e, src:sub(at + #eq + 2, (s or n + 1) - 1)
  end
  while i <= n do
    local c = src:sub(i, i)
    if c == "\n" then
      line = line + 1
      i = i + 1
    elseif c:match("%s") then
      i = i + 1
    elseif src:sub(i, i + 1) == "--" then
      local e = long_bracket(i + 2)
      if e then
        for _ in src:sub(i, e):gmatch("\n") do line = line + 1 end
        i = e + 1
      else
        i = (src:find("\n", i, true) or n + 1)
      end
    elseif c == '"' or c == "'" then
      local j, buf = i + 1, {}
      while j <= n do
        local d = src:sub(j, j)
        if d == "\\" then
          buf[#buf + 1] = src:sub(j, j + 1)
          j = j + 2
        elseif d == c then
          break
        else
          buf[#buf + 1] = d
          j = j + 1
        end
      end
      out[#out + 1] = { kind = "string", value = table.concat(buf), line = line }
      i = j + 1
    elseif c == "[" and src:match("^%[=*%[", i) then
      local e, body = long_bracket(i)
      out[#out + 1] = { kind = "string", value = body, line = line }
      for _ in src:sub(i, e):gmatch("\n") do line = line + 1 end
      i = e + 1
    elseif c:match("[%a_]") then
      local word = src:match("^[%w_]+", i)
      out[#out + 1] = { kind = "name", value = word, line = line }
      i = i + #word
    elseif c:match("%d") then
      local num = src:match("^[%w%.]+", i)
      i = i + #num
    else
      out[#out + 1] = { kind = "op", value = c, line = line }
      i = i + 1
    end
  end
  return out
end

-- The requires of a file: {module = "demesne.x" | nil (not a literal), line, in_function, lazy}.
local function requires(src)
  local lines = {}
  for l in (src .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
  local toks = tokens(src)
  local stack, out = {}, {}
  local function in_function()
    for _, b in ipairs(stack) do if b == "function" then return true end end
    return false
  end
  for k, t in ipairs(toks) do
    if t.kind == "name" then
      local w = t.value
      local prev = toks[k - 1]
      local field = prev and prev.kind == "op" and (prev.value == "." or prev.value == ":")
      if w == "function" then
        stack[#stack + 1] = "function"
      elseif w == "if" or w == "do" or w == "repeat" then
        stack[#stack + 1] = w
      elseif (w == "end" or w == "until") and not field then
        stack[#stack] = nil
      elseif w == "require" and not field then
        local arg = toks[k + 1]
        if arg and arg.kind == "op" and arg.value == "(" then arg = toks[k + 2] end
        out[#out + 1] = {
          module = arg and arg.kind == "string" and arg.value or nil,
          line = t.line,
          in_function = in_function(),
          lazy = (lines[t.line] or ""):find("%-%- lazy: %S") ~= nil,
        }
      end
    end
  end
  return out
end

function tests.the_lexer_sees_function_scope(t)
  local r = requires([[
local a = require("demesne.a")
local s = "require('x') in a string" -- require("y") in a comment
--[==[ require("z") ]==]
local function f() local b = require("demesne.b") end
if a then local c = require("demesne.c") end
local t = { f = function() return pcall(require, "demesne.d") end }
for _ = 1, 2 do local e = require "demesne.e" end
local g = function() return require("demesne.g") end -- lazy: a test of the marker
env.require = 1
]])
  local got = {}
  for _, x in ipairs(r) do got[#got + 1] = ("%s:%s:%s"):format(x.module, x.in_function, x.lazy) end
  t:eq(got, { "demesne.a:false:false", "demesne.b:true:false", "demesne.c:false:false", "nil:true:false",
    "demesne.e:false:false", "demesne.g:true:true" })
end

function tests.no_require_inside_a_function_without_a_reason(t)
  local bad = {}
  for _, f in ipairs(files()) do
    for _, r in ipairs(requires(f.src)) do
      if r.in_function and not r.lazy then
        bad[#bad + 1] = ("%s:%d: require(%s) inside a function"):format(f.rel, r.line, tostring(r.module))
      end
    end
  end
  t:ok(#files() > 30, "the runtime's files were found")
  if #bad > 0 then
    error(("%d function-local require(s); move each to the top of its file, or say why it must load late "
      .. "with `-- lazy: <reason>` on its line:\n  %s"):format(#bad, table.concat(bad, "\n  ")), 0)
  end
end

-- The graph of module -> the demesne.* modules it requires (by literal name).
local function graph()
  local g, known = {}, {}
  for _, f in ipairs(files()) do
    known[f.module] = true
    g[f.module] = {}
    for _, r in ipairs(requires(f.src)) do
      if r.module and r.module:match("^demesne%.") then g[f.module][#g[f.module] + 1] = r.module end
    end
  end
  known["demesne.runtime"] = true -- installed by lua/boot.lua
  return g, known
end

function tests.no_module_cycle(t)
  local g, known = graph()
  local state, path, cycles = {}, {}, {}
  local function visit(m)
    if state[m] == "done" then return end
    if state[m] == "open" then
      local from
      for i, p in ipairs(path) do if p == m then from = i break end end
      local c = { table.unpack(path, from) }
      c[#c + 1] = m
      cycles[#cycles + 1] = table.concat(c, " -> ")
      return
    end
    state[m] = "open"
    path[#path + 1] = m
    for _, dep in ipairs(g[m] or {}) do visit(dep) end
    path[#path] = nil
    state[m] = "done"
  end
  local names = {}
  for m in pairs(g) do names[#names + 1] = m end
  table.sort(names)
  for _, m in ipairs(names) do visit(m) end
  for _, m in ipairs(names) do
    for _, dep in ipairs(g[m]) do t:ok(known[dep], ("%s requires %s, which is no runtime file"):format(m, dep)) end
  end
  if #cycles > 0 then error("module cycles:\n  " .. table.concat(cycles, "\n  "), 0) end
end

function tests.no_module_requires_a_higher_layer(t)
  local g = graph()
  local bad = {}
  for m, deps in pairs(g) do
    local lm = layer_of(m)
    if not lm then bad[#bad + 1] = m .. " has no layer in structure_test.lua's LAYERS" end
    for _, dep in ipairs(deps) do
      local ld = layer_of(dep)
      if lm and ld and ld > lm then
        bad[#bad + 1] = ("%s (layer %d) requires %s (layer %d)"):format(m, lm, dep, ld)
      end
    end
  end
  table.sort(bad)
  t:ok(layer_of("demesne.mcp.server") > layer_of("demesne.tools"), "the layers are ordered")
  if #bad > 0 then error("layering:\n  " .. table.concat(bad, "\n  "), 0) end
end

-- Public functions of a source lacking LuaCATS: those of the table the file returns
-- (`function M.f(…)`, or `M.f = f` of a `local function f(…)`) and methods
-- (`function T:m(…)`), each needing a `---` doc comment right above it with an @param per
-- parameter. Returns "line: name: what is missing" strings.
local function missing_cats(src)
  local lines = {}
  for l in (src .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
  local mod
  for i = #lines, 1, -1 do
    mod = lines[i]:match("^return ([%w_]+)%s*$")
    if mod or lines[i]:match("%S") then break end
  end
  local function check(i, name, params, out)
    local doc, j = {}, i - 1
    while j > 0 and lines[j]:match("^%-%-%-") do
      table.insert(doc, 1, lines[j])
      j = j - 1
    end
    if #doc == 0 then
      out[#out + 1] = ("%d: %s: no doc comment"):format(i, name)
      return
    end
    local have = {}
    for _, d in ipairs(doc) do
      local p = d:match("^%-%-%-@param%s+([%w_]+%??)") or d:match("^%-%-%-@param%s+(%.%.%.)")
      if p then have[(p:gsub("%?$", ""))] = true end
    end
    local miss = {}
    for p in params:gmatch("[^,%s]+") do
      if not have[p] then miss[#miss + 1] = p end
    end
    if #miss > 0 then out[#out + 1] = ("%d: %s: no @param for %s"):format(i, name, table.concat(miss, ", ")) end
  end
  local locals = {}
  for i, l in ipairs(lines) do
    local name, params = l:match("^local function ([%w_]+)%((.-)%)")
    if name then locals[name] = { line = i, params = params } end
  end
  local out = {}
  for i, l in ipairs(lines) do
    local owner, sep, name, params = l:match("^function ([%w_]+)([%.:])([%w_]+)%((.-)%)")
    if owner and (sep == ":" or owner == mod) then check(i, owner .. sep .. name, params, out) end
    local o2, n2, fn = l:match("^([%w_]+)%.([%w_]+) = ([%w_]+)%s*$")
    if o2 and o2 == mod and locals[fn] then check(locals[fn].line, mod .. "." .. n2, locals[fn].params, out) end
  end
  return out
end

function tests.the_luacats_check_sees_what_is_missing(t)
  local got = missing_cats(table.concat({
    "local M = {}",
    "--- Documented.", "---@param a string", "---@param ... any", "function M.good(a, ...) end",
    "function M.bare(x) end",
    "--- Half.", "---@param a string", "function M.half(a, b) end",
    "--- A method.", "function T:m(c) end",
    "local function helper(d) end", "M.helper = helper",
    "local function hidden(e) end",
    "return M",
  }, "\n"))
  t:eq(#got, 4, table.concat(got, "; "))
  t:match(got[1], "^6: M%.bare: no doc comment")
  t:match(got[2], "M%.half: no @param for b$")
  t:match(got[3], "T:m: no @param for c$")
  t:match(got[4], "^12: M%.helper: no doc comment")
end

function tests.every_public_function_has_luacats(t)
  local bad = {}
  for _, f in ipairs(files()) do
    for _, m in ipairs(missing_cats(f.src)) do bad[#bad + 1] = f.rel .. ":" .. m end
  end
  t:ok(#files() > 50, "the runtime's files were read")
  if #bad > 0 then
    error(("%d public function(s) without LuaCATS (a --- comment and an @param per parameter):\n  %s")
      :format(#bad, table.concat(bad, "\n  ")), 0)
  end
end

-- The calls of `fn` on a module required as `mod` (`local x = require("mod")` … `x.fn(`):
-- {line, text}. A definition (`function x.fn(`) is no call.
local function calls_of(src, mod, fn)
  local aliases = {}
  for name, m in src:gmatch("local%s+([%w_]+)%s*=%s*require%s*%(?%s*[\"']([%w_%.]+)[\"']") do
    if m == mod then aliases[name] = true end
  end
  local toks, out = tokens(src), {}
  for k, t in ipairs(toks) do
    local dot, f, paren, before = toks[k + 1], toks[k + 2], toks[k + 3], toks[k - 1]
    if t.kind == "name" and aliases[t.value] and dot and dot.value == "." and f and f.value == fn
      and paren and (paren.value == "(" or paren.kind == "string" or paren.value == "{")
      and not (before and (before.value == "function" or before.value == "." or before.value == ":")) then
      out[#out + 1] = { line = t.line, text = t.value .. "." .. fn }
    end
  end
  return out
end

function tests.the_composition_check_sees_an_install_and_a_registration(t)
  local src = table.concat({
    'local layer = require("demesne.layer")', 'local j = require("demesne.jobs")', "local other = {}",
    "--- Doc.", "function layer.install(l) end", -- a definition
    "layer.install(x)", "other.install(y)", "local f = function() j.register('k', {}) end",
    "-- layer.install(z) in a comment", 'local s = "j.register(1)"',
  }, "\n")
  local got = {}
  for _, c in ipairs(calls_of(src, "demesne.layer", "install")) do got[#got + 1] = c.line .. ":" .. c.text end
  for _, c in ipairs(calls_of(src, "demesne.jobs", "register")) do got[#got + 1] = c.line .. ":" .. c.text end
  t:eq(got, { "6:layer.install", "8:j.register" })
end

function tests.only_the_composition_root_installs_layers_and_registers_job_kinds(t)
  local bad, seen = {}, 0
  for _, f in ipairs(files()) do
    for _, c in ipairs(calls_of(f.src, "demesne.layer", "install")) do
      if f.module == "demesne.compose" then seen = seen + 1
      else bad[#bad + 1] = ("%s:%d: %s"):format(f.rel, c.line, c.text) end
    end
    for _, c in ipairs(calls_of(f.src, "demesne.jobs", "register")) do
      if f.module == "demesne.compose" then seen = seen + 1
      else bad[#bad + 1] = ("%s:%d: %s"):format(f.rel, c.line, c.text) end
    end
  end
  t:ok(seen >= 2, "lua/compose.lua installs the layers and registers the kinds")
  if #bad > 0 then
    error(("%d layer installation(s) or job kind registration(s) outside lua/compose.lua (declare the layer or "
      .. "the kind in its module and install it in compose.install):\n  %s"):format(#bad, table.concat(bad, "\n  ")), 0)
  end
end

-- The longest a function of lua/ may be, in lines from `function` to its `end`.
local FUNCTION_MAX = 120

-- Every function of a source with its name and extent: {name, line, lines}. A named
-- function (`function a.b:c(`, `local function f(`) is called so; an anonymous one by what it
-- is assigned to (`x.y = function(`, `key = function(` in a table), else "function".
local function functions_of(src)
  local toks, stack, out = tokens(src), {}, {}
  local function name_at(k)
    local nxt = toks[k + 1]
    if nxt and nxt.kind == "name" then
      local parts, j = { nxt.value }, k + 2
      while toks[j] and (toks[j].value == "." or toks[j].value == ":") and toks[j + 1] and toks[j + 1].kind == "name" do
        parts[#parts + 1] = toks[j].value .. toks[j + 1].value
        j = j + 2
      end
      return table.concat(parts)
    end
    local eq = toks[k - 1]
    if eq and eq.value == "=" and toks[k - 2] and toks[k - 2].kind == "name" then
      local parts, j = { toks[k - 2].value }, k - 3
      while toks[j] and toks[j].value == "." and toks[j - 1] and toks[j - 1].kind == "name" do
        table.insert(parts, 1, toks[j - 1].value .. ".")
        j = j - 2
      end
      return table.concat(parts)
    end
    return "function"
  end
  for k, tk in ipairs(toks) do
    if tk.kind == "name" then
      local w, prev = tk.value, toks[k - 1]
      local field = prev and prev.kind == "op" and (prev.value == "." or prev.value == ":")
      if w == "function" then
        stack[#stack + 1] = { name = name_at(k), line = tk.line }
      elseif w == "if" or w == "do" or w == "repeat" then
        stack[#stack + 1] = false
      elseif (w == "end" or w == "until") and not field then
        local top = table.remove(stack)
        if top then out[#out + 1] = { name = top.name, line = top.line, lines = tk.line - top.line + 1 } end
      end
    end
  end
  return out
end

function tests.the_length_check_measures_each_function(t)
  local body = {}
  for i = 1, 5 do body[#body + 1] = "  if x then y = " .. i .. " end" end
  local src = table.concat({
    "local M = {}",
    "function M.a(x)", table.concat(body, "\n"), "end",
    "local function b() for _ = 1, 2 do end return function() end end",
    "M.c = function()", "  repeat until true", "end",
    "function M:d() end",
  }, "\n")
  local got = {}
  for _, f in ipairs(functions_of(src)) do got[#got + 1] = ("%s@%d:%d"):format(f.name, f.line, f.lines) end
  table.sort(got)
  t:eq(got, { "M.a@2:7", "M.c@10:3", "M:d@13:1", "b@9:1", "function@9:1" })
end

function tests.no_function_is_longer_than_function_max(t)
  local bad, n = {}, 0
  for _, f in ipairs(files()) do
    for _, fn in ipairs(functions_of(f.src)) do
      n = n + 1
      if fn.lines > FUNCTION_MAX then
        bad[#bad + 1] = ("%s:%d: %s is %d lines"):format(f.rel, fn.line, fn.name, fn.lines)
      end
    end
  end
  t:ok(n > 1000, "the runtime's functions were measured")
  if #bad > 0 then
    error(("%d function(s) longer than %d lines; split each into well-named helpers:\n  %s")
      :format(#bad, FUNCTION_MAX, table.concat(bad, "\n  ")), 0)
  end
end

return tests
