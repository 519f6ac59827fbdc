-- JSON Schema validation for tool arguments (the subset tools use), on values decoded by
-- demesne.json. Supported keywords: type (incl. integer vs number, lists of types), enum,
-- const, properties, required, additionalProperties (false or a schema),
-- minProperties/maxProperties, items (schema or list), prefixItems, minItems/maxItems,
-- uniqueItems, minimum/maximum, exclusiveMinimum/exclusiveMaximum (numeric),
-- multipleOf, minLength/maxLength (in code points), allOf/anyOf/oneOf/not,
-- if/then/else, dependentRequired, local $ref ("#/$defs/x", "#/definitions/x"), and
-- default (applied to a copy of the value by schema.apply_defaults). `pattern` is
-- checked only when the regular expression is simple enough to translate to a Lua
-- pattern (character classes, anchors, quantifiers on single items, no groups or
-- alternation); other patterns and `format` are not checked.
--
-- Error paths name the field the way a caller writes it: `limits.memory_mb`, `files[2]`
-- (array indexes 0-based, as in JSON).
local json = require("demesne.json")

local schema = {}

local null = json.null
local MAX_ERRORS = 10

--- The JSON type of a decoded value: "null", "boolean", "integer", "number", "string",
--- "array" or "object". An empty Lua table not marked with json.array is "object" (JSON
--- decoding cannot tell an empty array from an empty object; the validator accepts an
--- empty table for both).
---@param v any
---@return string
function schema.type_of(v)
  local t = type(v)
  if v == nil or v == null then return "null" end
  if t == "boolean" or t == "string" then return t end
  if t == "number" then
    -- an integral float counts as an integer only within the 64-bit range the runtime can
    -- use as one (1e20 is a number here, so a field typed integer refuses it)
    if math.type(v) == "integer" or math.tointeger(v) then return "integer" end
    return "number"
  end
  if t == "table" then
    if json.is_array(v) then return "array" end
    local n = #v
    if n > 0 then
      local count = 0
      for _ in pairs(v) do count = count + 1 end
      if count == n then return "array" end
    end
    return "object"
  end
  return t
end

local function is_empty_table(v) return type(v) == "table" and next(v) == nil end

local function type_matches(want, v, got)
  if want == got then return true end
  if want == "number" and got == "integer" then return true end
  if (want == "array" or want == "object") and is_empty_table(v) then return true end
  return false
end

local function describe(v)
  local t = schema.type_of(v)
  if t == "string" then
    if #v > 40 then return ("string %q…"):format(v:sub(1, 37)) end
    return ("string %q"):format(v)
  elseif t == "integer" then
    return ("integer %d"):format(math.tointeger(v) or v)
  elseif t == "number" or t == "boolean" then
    return ("%s %s"):format(t, tostring(v))
  end
  return t
end

local function deep_equal(a, b)
  if a == b then return true end
  if type(a) == "number" and type(b) == "number" then return a == b end
  if type(a) ~= "table" or type(b) ~= "table" then return false end
  for k, v in pairs(a) do if not deep_equal(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function num(x)
  local i = math.tointeger(x)
  if i then return tostring(i) end
  return tostring(x)
end

local function join(path, key)
  if type(key) == "number" then return path .. "[" .. key .. "]" end
  if path == "" then return key end
  return path .. "." .. key
end

local function list_of(t) return type(t) == "table" and t or {} end

local pattern_cache = {}

--- Translates a simple ECMA-262 regular expression into a Lua pattern; nil when it uses
--- anything without a faithful Lua equivalent.
---@param re string
---@return string|nil
local function translate(re)
  if pattern_cache[re] ~= nil then return pattern_cache[re] or nil end
  local out, i, n = {}, 1, #re
  local ok = true
  local ESC = { d = "%d", D = "%D", w = "[%w_]", s = "%s", S = "%S" }
  local function lit(c)
    if c:match("[%^%$%(%)%%%.%[%]%*%+%-%?]") then return "%" .. c end
    return c
  end
  while i <= n and ok do
    local c = re:sub(i, i)
    if c == "^" and i == 1 then out[#out + 1] = "^"; i = i + 1
    elseif c == "$" and i == n then out[#out + 1] = "$"; i = i + 1
    elseif c == "." then out[#out + 1] = "."; i = i + 1
    elseif c == "\\" then
      local e = re:sub(i + 1, i + 1)
      if ESC[e] then out[#out + 1] = ESC[e]
      elseif e:match("[%p]") then out[#out + 1] = lit(e)
      else ok = false end
      i = i + 2
    elseif c == "[" then
      local j = i + 1
      local parts = { "[" }
      if re:sub(j, j) == "^" then parts[#parts + 1] = "^"; j = j + 1 end
      local closed = false
      while j <= n do
        local d = re:sub(j, j)
        if d == "]" and #parts > 1 and not (parts[#parts] == "^" and #parts == 2) then closed = true; break end
        if d == "\\" then
          local e = re:sub(j + 1, j + 1)
          if e == "d" then parts[#parts + 1] = "%d"
          elseif e == "w" then parts[#parts + 1] = "%w_"
          elseif e == "s" then parts[#parts + 1] = "%s"
          elseif e:match("[%p]") then parts[#parts + 1] = "%" .. e
          else ok = false end
          j = j + 2
        elseif d == "-" and #parts > 1 and re:sub(j + 1, j + 1) ~= "]" then
          parts[#parts + 1] = "-"; j = j + 1
        elseif d:match("[%%%[%]%-%^]") then parts[#parts + 1] = "%" .. d; j = j + 1
        else parts[#parts + 1] = d; j = j + 1 end
      end
      if not closed then ok = false end
      parts[#parts + 1] = "]"
      out[#out + 1] = table.concat(parts)
      i = j + 1
    elseif c == "*" or c == "+" or c == "?" then
      if #out == 0 or out[#out]:match("[%*%+%-%?]$") and not out[#out]:match("%%.$") then ok = false end
      if re:sub(i + 1, i + 1) == "?" then
        if c ~= "*" then ok = false end
        out[#out] = out[#out] .. "-"; i = i + 2
      else
        out[#out] = out[#out] .. c; i = i + 1
      end
    elseif c:match("[%(%)%|%{%}%^%$]") then ok = false
    else out[#out + 1] = lit(c); i = i + 1 end
  end
  local pat = ok and table.concat(out) or false
  pattern_cache[re] = pat
  return pat or nil
end
schema.translate_pattern = translate

local function resolve_ref(root, ref)
  if type(ref) ~= "string" or ref:sub(1, 1) ~= "#" then return nil end
  local node = root
  for part in ref:sub(2):gmatch("[^/]+") do
    part = part:gsub("~1", "/"):gsub("~0", "~")
    if type(node) ~= "table" then return nil end
    node = node[part] or node[tonumber(part) and tonumber(part) + 1]
  end
  return node
end

local validate

local function add(errs, path, msg)
  if #errs < MAX_ERRORS then errs[#errs + 1] = { path = path, message = msg } end
end

local function check_object(s, v, path, errs, root, depth)
  local props = type(s.properties) == "table" and s.properties or nil
  for _, name in ipairs(list_of(s.required)) do
    if v[name] == nil then add(errs, join(path, name), "is required") end
  end
  local count = 0
  for k, x in pairs(v) do
    count = count + 1
    local sub = props and props[k]
    if sub ~= nil then
      validate(sub, x, join(path, k), errs, root, depth)
    elseif s.additionalProperties == false then
      add(errs, join(path, tostring(k)), "is not an allowed property")
    elseif type(s.additionalProperties) == "table" then
      validate(s.additionalProperties, x, join(path, tostring(k)), errs, root, depth)
    end
  end
  if s.minProperties and count < s.minProperties then
    add(errs, path, ("must have at least %d properties"):format(s.minProperties))
  end
  if s.maxProperties and count > s.maxProperties then
    add(errs, path, ("must have at most %d properties"):format(s.maxProperties))
  end
  if type(s.dependentRequired) == "table" then
    for k, needs in pairs(s.dependentRequired) do
      if v[k] ~= nil then
        for _, other in ipairs(list_of(needs)) do
          if v[other] == nil then add(errs, join(path, other), ("is required when %s is given"):format(k)) end
        end
      end
    end
  end
end

local function check_array(s, v, path, errs, root, depth)
  local n = #v
  local prefix = s.prefixItems
  local items = s.items
  if type(items) == "table" and schema.type_of(items) == "array" and next(items) ~= nil then
    prefix, items = items, s.additionalItems
  end
  for i = 1, n do
    local sub
    if type(prefix) == "table" and prefix[i] ~= nil then sub = prefix[i] else sub = items end
    if sub == false then
      add(errs, join(path, i - 1), "is not allowed (too many items)")
    elseif type(sub) == "table" then
      validate(sub, v[i], join(path, i - 1), errs, root, depth)
    end
  end
  if s.minItems and n < s.minItems then add(errs, path, ("must have at least %d items (got %d)"):format(s.minItems, n)) end
  if s.maxItems and n > s.maxItems then add(errs, path, ("must have at most %d items (got %d)"):format(s.maxItems, n)) end
  if s.uniqueItems == true then
    for i = 2, n do
      for j = 1, i - 1 do
        if deep_equal(v[i], v[j]) then
          add(errs, join(path, i - 1), ("duplicates item %d (items must be unique)"):format(j - 1))
          break
        end
      end
    end
  end
end

local function check_number(s, v, path, errs)
  if type(s.minimum) == "number" and v < s.minimum then
    add(errs, path, ("must be >= %s (got %s)"):format(num(s.minimum), num(v)))
  end
  if type(s.maximum) == "number" and v > s.maximum then
    add(errs, path, ("must be <= %s (got %s)"):format(num(s.maximum), num(v)))
  end
  if type(s.exclusiveMinimum) == "number" and v <= s.exclusiveMinimum then
    add(errs, path, ("must be > %s (got %s)"):format(num(s.exclusiveMinimum), num(v)))
  end
  if type(s.exclusiveMaximum) == "number" and v >= s.exclusiveMaximum then
    add(errs, path, ("must be < %s (got %s)"):format(num(s.exclusiveMaximum), num(v)))
  end
  if type(s.multipleOf) == "number" and s.multipleOf > 0 then
    local q = v / s.multipleOf
    if math.abs(q - math.floor(q + 0.5)) > 1e-9 then add(errs, path, ("must be a multiple of %s"):format(num(s.multipleOf))) end
  end
end

local function check_string(s, v, path, errs)
  local len = utf8.len(v) or #v
  if s.minLength and len < s.minLength then
    add(errs, path, ("must be at least %d characters long (got %d)"):format(s.minLength, len))
  end
  if s.maxLength and len > s.maxLength then
    add(errs, path, ("must be at most %d characters long (got %d)"):format(s.maxLength, len))
  end
  if type(s.pattern) == "string" then
    local pat = translate(s.pattern)
    if pat and not v:find(pat) then add(errs, path, ("must match the pattern %s"):format(s.pattern)) end
  end
end

local function type_list(t)
  if type(t) == "string" then return { t } end
  return list_of(t)
end

validate = function(s, v, path, errs, root, depth)
  if s == true or s == nil then return end
  if s == false then add(errs, path, "is not allowed") return end
  if type(s) ~= "table" then return end
  if depth > 64 then add(errs, path, "is nested too deeply") return end
  depth = depth + 1
  if s["$ref"] ~= nil then
    local target = resolve_ref(root, s["$ref"])
    if target ~= nil then validate(target, v, path, errs, root, depth) end
  end
  local got = schema.type_of(v)
  if s.type ~= nil then
    local okt = false
    for _, t in ipairs(type_list(s.type)) do
      if type_matches(t, v, got) then okt = true break end
    end
    if not okt then
      local want = table.concat(type_list(s.type), " or ")
      add(errs, path, ("expected %s, got %s"):format(want, describe(v)))
      return
    end
  end
  if s.enum ~= nil then
    local found = false
    for _, e in ipairs(list_of(s.enum)) do
      if deep_equal(e, v) then found = true break end
    end
    if not found then
      local opts = {}
      for i, e in ipairs(list_of(s.enum)) do
        if i > 20 then opts[#opts + 1] = "…" break end
        opts[#opts + 1] = type(e) == "string" and ("%q"):format(e)
          or (e == null and "null" or type(e) == "number" and num(e) or tostring(e))
      end
      add(errs, path, ("must be one of %s (got %s)"):format(table.concat(opts, ", "), describe(v)))
    end
  end
  if s.const ~= nil and not deep_equal(s.const, v) then
    local c = s.const
    add(errs, path, ("must be %s"):format(type(c) == "string" and ("%q"):format(c)
      or (c == null and "null" or type(c) == "number" and num(c) or tostring(c))))
  end
  if got == "object" and type(v) == "table" then check_object(s, v, path, errs, root, depth) end
  if got == "array" or (got == "object" and is_empty_table(v) and s.type == "array") then
    check_array(s, v, path, errs, root, depth)
  end
  if got == "integer" or got == "number" then check_number(s, v, path, errs) end
  if got == "string" then check_string(s, v, path, errs) end
  if type(s.allOf) == "table" then
    for _, sub in ipairs(s.allOf) do validate(sub, v, path, errs, root, depth) end
  end
  if type(s.anyOf) == "table" then
    local any = false
    for _, sub in ipairs(s.anyOf) do
      local e = {}
      validate(sub, v, path, e, root, depth)
      if #e == 0 then any = true break end
    end
    if not any then add(errs, path, "does not match any of the allowed forms (anyOf)") end
  end
  if type(s.oneOf) == "table" then
    local matched = 0
    for _, sub in ipairs(s.oneOf) do
      local e = {}
      validate(sub, v, path, e, root, depth)
      if #e == 0 then matched = matched + 1 end
    end
    if matched ~= 1 then
      add(errs, path, matched == 0 and "does not match any of the allowed forms (oneOf)"
        or "matches more than one of the allowed forms (oneOf)")
    end
  end
  if s["not"] ~= nil then
    local e = {}
    validate(s["not"], v, path, e, root, depth)
    if #e == 0 then add(errs, path, "matches a form that is not allowed (not)") end
  end
  if s["if"] ~= nil then
    local e = {}
    validate(s["if"], v, path, e, root, depth)
    local branch = #e == 0 and s["then"] or s["else"]
    if branch ~= nil then validate(branch, v, path, errs, root, depth) end
  end
end

---@class SchemaError
---@field path string     the field, e.g. "limits.memory_mb" or "files[0]"; "" for the value itself
---@field message string  the reason, e.g. "expected integer, got number 1.5"

--- Validates `value` against `s`. Returns true, or false and a list of errors (at most 10).
---@param s table     a JSON Schema (Lua table as decoded from JSON or written in a tool file)
---@param value any
---@return boolean ok, SchemaError[]|nil errors
function schema.validate(s, value)
  local errs = {}
  validate(s, value, "", errs, s, 0)
  if #errs == 0 then return true end
  return false, errs
end

--- Formats validation errors as one line: `limits.memory_mb: must be >= 16 (got 4); command: is required`.
---@param errs SchemaError[]
---@param root_name string|nil  how to name the value itself when an error has an empty path (default "arguments")
---@return string
function schema.format_errors(errs, root_name)
  local parts = {}
  for _, e in ipairs(errs) do
    local root = root_name or "arguments"
    local path = e.path == "" and root or (e.path:sub(1, 1) == "[" and root .. e.path) or e.path
    parts[#parts + 1] = path .. ": " .. e.message
  end
  return table.concat(parts, "; ")
end

--- A deep copy of a JSON value (tables copied with their metatables: json.array stays one).
---@param v any
---@return any
local function copy(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = copy(x) end
  return setmetatable(out, getmetatable(v))
end
schema.copy = copy

local function defaults(s, v, root, depth)
  if type(s) ~= "table" or type(v) ~= "table" or depth > 64 then return end
  if s["$ref"] ~= nil then defaults(resolve_ref(root, s["$ref"]), v, root, depth + 1) end
  if type(s.allOf) == "table" then
    for _, sub in ipairs(s.allOf) do defaults(sub, v, root, depth + 1) end
  end
  local t = schema.type_of(v)
  if t == "object" and type(s.properties) == "table" then
    for k, sub in pairs(s.properties) do
      if type(sub) == "table" then
        local target = sub
        if target["$ref"] ~= nil and target.default == nil then target = resolve_ref(root, target["$ref"]) or sub end
        if v[k] == nil and target.default ~= nil then v[k] = copy(target.default) end
        if v[k] ~= nil then defaults(sub, v[k], root, depth + 1) end
      end
    end
  elseif t == "array" and type(s.items) == "table" and schema.type_of(s.items) == "object" then
    for i = 1, #v do defaults(s.items, v[i], root, depth + 1) end
  end
end

--- Returns a deep copy of `value` with every missing property that has a `default` in
--- `s` filled in (recursively, for objects that are present). `value` is not changed.
---@param s table
---@param value any
---@return any
function schema.apply_defaults(s, value)
  local v = copy(value)
  defaults(s, v, s, 0)
  return v
end

local ARRAY_KEYS = { required = true, enum = true, anyOf = true, oneOf = true, allOf = true, prefixItems = true, examples = true }
local MAP_KEYS = { properties = true, patternProperties = true, ["$defs"] = true, definitions = true, dependentSchemas = true }
local VALUE_KEYS = { default = true, const = true, examples = true, enum = true }

--- Returns a copy of a schema ready for JSON: lists that JSON Schema defines as arrays
--- (required, enum, anyOf, …, a list of types) encode as [] even when empty; subschemas
--- are normalised recursively. Values (default, const, enum members) are copied as is.
---@param s any
---@param depth integer|nil  nesting so far (internal)
---@return any
function schema.for_json(s, depth)
  depth = depth or 0
  if type(s) ~= "table" or depth > 64 then return s end
  local out = {}
  for k, v in pairs(s) do
    if ARRAY_KEYS[k] and type(v) == "table" then
      local arr = json.array()
      for i, x in ipairs(v) do arr[i] = VALUE_KEYS[k] and copy(x) or schema.for_json(x, depth + 1) end
      out[k] = arr
    elseif k == "type" and type(v) == "table" then
      out[k] = json.array(copy(v))
    elseif MAP_KEYS[k] and type(v) == "table" then
      local m = {}
      for name, sub in pairs(v) do m[name] = schema.for_json(sub, depth + 1) end
      out[k] = m
    elseif VALUE_KEYS[k] then
      out[k] = copy(v)
    elseif type(v) == "table" then
      out[k] = schema.for_json(v, depth + 1)
    else
      out[k] = v
    end
  end
  return setmetatable(out, getmetatable(s))
end

local TYPES = { object = true, array = true, string = true, number = true, integer = true, boolean = true, null = true }

--- Checks that a schema is well-formed enough to validate with (types are known names,
--- properties is a table of schemas, required is a list of strings, numbers are numbers).
--- Returns true, or nil and "path: reason" (path like `properties.limits.type`).
---@param s any
---@param path string|nil
---@param depth integer|nil  nesting so far (internal)
---@return boolean|nil ok, string|nil err
function schema.check(s, path, depth)
  path = path or ""
  depth = depth or 0
  local function at(k) return path == "" and k or (path .. "." .. k) end
  if type(s) == "boolean" then return true end
  if type(s) ~= "table" then return nil, (path == "" and "schema" or path) .. ": must be a table (a JSON Schema)" end
  if depth > 32 then return nil, path .. ": nested too deeply" end
  if s.type ~= nil then
    for _, t in ipairs(type_list(s.type)) do
      if not TYPES[t] then return nil, ("%s: unknown type %q"):format(at("type"), tostring(t)) end
    end
    if type(s.type) ~= "string" and type(s.type) ~= "table" then
      return nil, at("type") .. ": must be a string or a list of strings"
    end
  end
  if s.properties ~= nil then
    if type(s.properties) ~= "table" then return nil, at("properties") .. ": must be a table" end
    for name, sub in pairs(s.properties) do
      if type(name) ~= "string" then return nil, at("properties") .. ": property names must be strings" end
      local ok, err = schema.check(sub, at("properties") .. "." .. name, depth + 1)
      if not ok then return nil, err end
    end
  end
  if s.required ~= nil then
    if type(s.required) ~= "table" then return nil, at("required") .. ": must be a list of property names" end
    for i, name in pairs(s.required) do
      if type(i) ~= "number" or type(name) ~= "string" then return nil, at("required") .. ": must be a list of property names" end
    end
  end
  for _, k in ipairs({ "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                       "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties" }) do
    if s[k] ~= nil and type(s[k]) ~= "number" then return nil, at(k) .. ": must be a number" end
  end
  if s.enum ~= nil and (type(s.enum) ~= "table" or schema.type_of(s.enum) ~= "array") then
    return nil, at("enum") .. ": must be a non-empty list"
  end
  for _, k in ipairs({ "items", "additionalProperties", "not", "if", "then", "else" }) do
    local sub = s[k]
    if sub ~= nil and not (k == "items" and type(sub) == "table" and schema.type_of(sub) == "array") then
      local ok, err = schema.check(sub, at(k), depth + 1)
      if not ok then return nil, err end
    end
  end
  for _, k in ipairs({ "allOf", "anyOf", "oneOf", "prefixItems" }) do
    if s[k] ~= nil then
      if type(s[k]) ~= "table" then return nil, at(k) .. ": must be a list of schemas" end
      for i, sub in ipairs(s[k]) do
        local ok, err = schema.check(sub, at(k) .. "[" .. (i - 1) .. "]", depth + 1)
        if not ok then return nil, err end
      end
    end
  end
  return true
end

return schema
