-- lua/images/jsonc.lua: JSON with comments and trailing commas, as devcontainer.json is
-- written. Fixed cases, then random documents: a value written out with comments, blanks
-- and trailing commas between its tokens (and strings holding //, /*, commas and quotes)
-- must decode to the same value; random cuts and splices of such texts must give a value or
-- an error, never a crash.
local jsonc = require("demesne.images.jsonc")
local json = require("demesne.json")

local tests = {}

function tests.comments_and_trailing_commas_are_blanks(t)
  local v = assert(jsonc.decode([[
// a devcontainer
{
  /* the image */ "image": "base", // trailing
  "url": "http://x//y/*not a comment*/",
  "list": [1, 2, 3,],
  "nested": { "a": "b", /* c */ },
  "esc": "a \"quoted // text\" and \\",
}
]]))
  t:eq(v.image, "base")
  t:eq(v.url, "http://x//y/*not a comment*/")
  t:eq(v.list, { 1, 2, 3 })
  t:eq(v.nested, { a = "b" })
  t:eq(v.esc, 'a "quoted // text" and \\')
  -- lines stay where they were: the fault is on line 3
  local s = assert(jsonc.strip('{\n/* one\ntwo */ "a": 1,\n}'))
  t:eq(select(2, s:gsub("\n", "")), 3, "newlines of a block comment are kept")
  local _, err = jsonc.decode('{\n"a": 1,\n"b": nope\n}')
  t:match(err, "^line 3: ")
  t:eq(jsonc.decode("\239\187\191{\"a\": 1}").a, 1, "a byte order mark is dropped")
end

function tests.what_is_not_jsonc_is_refused_with_its_line(t)
  local cases = {
    { '{"a": 1 /* open', "^line 1: the comment /%* … is never closed" },
    { '{\n"a": "open\n}', "^line 2: a string is never closed" },
    { "", "empty" }, { "// only a comment", "empty" },
    { "{,}", "line 1" }, { "[1,,]", "line 1" },
    { '{"a": 1} x', "" },
  }
  for _, c in ipairs(cases) do
    local v, err = jsonc.decode(c[1])
    t:eq(v, nil, c[1])
    t:match(err, c[2], c[1])
  end
  local _, big = jsonc.decode(("x"):rep(jsonc.MAX_BYTES + 1))
  t:match(big, "more than the 1024 KiB")
end

-- A small deterministic generator (xorshift), so a failure can be replayed by its seed.
local function rng(seed)
  local x = seed
  return function(n)
    x = x ~ (x << 13) & 0xffffffff
    x = x ~ (x >> 17)
    x = x ~ (x << 5) & 0xffffffff
    return x % n + 1
  end
end

local ATOMS = { "a", "//", "/*", "*/", ",", "]", "}", "\\\"", "\\\\", "\\n", "\\u00e9", " ", "x,]", "{", "é" }

local function gen_string(r)
  local parts = {}
  for _ = 1, r(6) - 1 do parts[#parts + 1] = ATOMS[r(#ATOMS)] end
  return table.concat(parts)
end

local function noise(r)
  local n = r(8)
  if n == 1 then return " // line comment , ] }\n" end
  if n == 2 then return "/* block , ] } \" */" end
  if n == 3 then return "\n\t " end
  if n == 4 then return "/* multi\nline */" end
  return n == 5 and " " or ""
end

-- A random value written twice: as plain JSON, and as JSONC with comments and blanks
-- between its tokens and a trailing comma now and then, at every depth.
local function doc(r, depth)
  local k = depth > 3 and r(4) or r(6)
  if k == 1 then local s = '"' .. gen_string(r) .. '"' return s, s end
  if k == 2 then local n = tostring(r(2000) - 1000) return n, n end
  if k == 3 then local b = r(2) == 1 and "true" or "false" return b, b end
  if k == 4 then return "null", "null" end
  local plain, fancy = {}, {}
  for i = 1, r(5) - 1 do
    local p, f = doc(r, depth + 1)
    if k == 5 then
      plain[#plain + 1] = p
      fancy[#fancy + 1] = noise(r) .. f .. noise(r)
    else
      local key = '"k' .. i .. gen_string(r) .. '"'
      plain[#plain + 1] = key .. ":" .. p
      fancy[#fancy + 1] = noise(r) .. key .. noise(r) .. ":" .. noise(r) .. f .. noise(r)
    end
  end
  local open, close = k == 5 and "[" or "{", k == 5 and "]" or "}"
  local trail = #fancy > 0 and r(2) == 1 and ("," .. noise(r)) or ""
  return open .. table.concat(plain, ",") .. close,
    open .. noise(r) .. table.concat(fancy, ",") .. trail .. noise(r) .. close
end

function tests.random_documents_decode_as_their_plain_json(t)
  local checked = 0
  for seed = 1, 400 do
    local r = rng(seed * 2654435761 % 0xffffffff + 1)
    local plain, fancy = doc(r, 0)
    local want = json.decode(plain)
    if want ~= nil then
      local got, err = jsonc.decode(noise(r) .. fancy .. noise(r))
      if err then error(("seed %d: %s\n%s"):format(seed, err, fancy), 0) end
      t:eq(got, want, ("seed %d: %s"):format(seed, fancy))
      checked = checked + 1
    end
  end
  t:ok(checked > 300, "most generated documents were valid JSON and were checked")
end

function tests.random_cuts_never_crash(t)
  local refused = 0
  for seed = 1, 300 do
    local r = rng(seed * 40503 + 7)
    local _, fancy = doc(r, 0)
    local a, b = r(#fancy + 1) - 1, r(#fancy + 1) - 1
    local cut = fancy:sub(1, math.min(a, b)) .. fancy:sub(math.max(a, b) + 1) .. ("/*\"],"):sub(r(5), r(5))
    local ok, v, err = pcall(jsonc.decode, cut)
    t:ok(ok, ("seed %d: decode raised %s"):format(seed, tostring(v)))
    t:ok(v ~= nil or type(err) == "string", ("seed %d: a value or a reason"):format(seed))
    if v == nil then refused = refused + 1 end
  end
  t:ok(refused > 50, "cut documents were refused")
end

return tests
