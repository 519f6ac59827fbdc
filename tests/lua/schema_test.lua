-- JSON Schema validation of tool arguments (demesne.jsonschema, exposed as tools.validate).
local json = require("demesne.json")
local schema = require("demesne.jsonschema")

local tests = {}

local function errors_of(s, v)
  local ok, errs = schema.validate(s, v)
  if ok then return "" end
  return schema.format_errors(errs)
end

local OBJ = {
  type = "object",
  additionalProperties = false,
  required = { "command" },
  properties = {
    command = { type = "string", minLength = 1, maxLength = 5 },
    count = { type = "integer", minimum = 1, maximum = 10 },
    ratio = { type = "number", exclusiveMinimum = 0, exclusiveMaximum = 1 },
    mode = { type = "string", enum = { "a", "b" } },
    files = { type = "array", items = { type = "string" }, minItems = 1, maxItems = 2 },
    limits = { type = "object", additionalProperties = false, properties = {
      memory_mb = { type = "integer", minimum = 16 },
    } },
    env = { type = "object", additionalProperties = { type = "string" } },
    flag = { type = "boolean" },
  },
}

local function decode(s) return assert(json.decode(s)) end

function tests.valid_arguments_pass(t)
  t:eq(errors_of(OBJ, decode('{"command":"ls","count":3,"ratio":0.5,"mode":"a","files":["x"],'
    .. '"limits":{"memory_mb":64},"env":{"A":"1"},"flag":true}')), "")
end

function tests.required_field_is_named(t)
  t:eq(errors_of(OBJ, decode('{}')), "command: is required")
end

function tests.integer_vs_number(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","count":2.0}')), "") -- 2.0 is an integer in JSON Schema
  t:eq(errors_of(OBJ, decode('{"command":"x","count":2.5}')), "count: expected integer, got number 2.5")
  t:eq(errors_of(OBJ, decode('{"command":"x","ratio":1}')), "ratio: must be < 1 (got 1)")
  t:eq(errors_of(OBJ, decode('{"command":"x","count":"3"}')), 'count: expected integer, got string "3"')
end

function tests.minimum_maximum(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","count":0}')), "count: must be >= 1 (got 0)")
  t:eq(errors_of(OBJ, decode('{"command":"x","count":11}')), "count: must be <= 10 (got 11)")
end

function tests.string_lengths_count_code_points(t)
  t:eq(errors_of(OBJ, decode('{"command":""}')), "command: must be at least 1 characters long (got 0)")
  t:eq(errors_of(OBJ, decode('{"command":"ééééé"}')), "") -- 5 code points, 10 bytes
  t:eq(errors_of(OBJ, decode('{"command":"abcdef"}')), "command: must be at most 5 characters long (got 6)")
end

function tests.enum(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","mode":"c"}')), 'mode: must be one of "a", "b" (got string "c")')
end

function tests.arrays_items_and_bounds(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","files":["a",2]}')), "files[1]: expected string, got integer 2")
  t:eq(errors_of(OBJ, decode('{"command":"x","files":["a","b","c"]}')), "files: must have at most 2 items (got 3)")
  t:eq(errors_of(OBJ, decode('{"command":"x","files":[]}')), "files: must have at least 1 items (got 0)")
  t:eq(errors_of(OBJ, decode('{"command":"x","files":"a"}')), 'files: expected array, got string "a"')
end

function tests.additional_properties(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","bogus":1}')), "bogus: is not an allowed property")
  t:eq(errors_of(OBJ, decode('{"command":"x","limits":{"cpu":1}}')), "limits.cpu: is not an allowed property")
  t:eq(errors_of(OBJ, decode('{"command":"x","env":{"A":1}}')), "env.A: expected string, got integer 1")
end

function tests.nested_objects(t)
  t:eq(errors_of(OBJ, decode('{"command":"x","limits":{"memory_mb":4}}')), "limits.memory_mb: must be >= 16 (got 4)")
  t:eq(errors_of(OBJ, decode('{"command":"x","limits":[1]}')), "limits: expected object, got array")
end

function tests.several_errors_are_all_reported(t)
  local e = errors_of(OBJ, decode('{"count":0,"flag":"yes"}'))
  t:match(e, "command: is required")
  t:match(e, "count: must be >= 1")
  t:match(e, 'flag: expected boolean, got string "yes"')
end

function tests.null_is_a_type(t)
  t:eq(errors_of(OBJ, decode('{"command":null}')), "command: expected string, got null")
  t:eq(errors_of({ type = { "string", "null" } }, json.null), "")
end

function tests.top_level_type(t)
  t:eq(errors_of(OBJ, "x"), 'arguments: expected object, got string "x"')
end

function tests.combinators_and_const(t)
  local s = { anyOf = { { type = "string" }, { type = "integer" } } }
  t:eq(errors_of(s, 1), "")
  t:eq(errors_of(s, true), "arguments: does not match any of the allowed forms (anyOf)")
  local one = { oneOf = { { type = "integer" }, { type = "number" } } }
  t:eq(errors_of(one, 1.5), "")
  t:eq(errors_of(one, 1), "arguments: matches more than one of the allowed forms (oneOf)")
  t:eq(errors_of({ const = "x" }, "y"), 'arguments: must be "x"')
  t:eq(errors_of({ ["not"] = { type = "string" } }, "y"), "arguments: matches a form that is not allowed (not)")
  t:eq(errors_of({ allOf = { { minimum = 1 }, { maximum = 3 } } }, 5), "arguments: must be <= 3 (got 5)")
end

function tests.local_refs(t)
  local s = decode([[{"type":"object","$defs":{"address":{"type":"object","properties":{"city":{"type":"string"}}}},
    "properties":{"address":{"$ref":"#/$defs/address"}},"additionalProperties":false}]])
  t:eq(errors_of(s, decode('{"address":{"city":"Paris"}}')), "")
  t:eq(errors_of(s, decode('{"address":{"city":7}}')), "address.city: expected string, got integer 7")
end

function tests.unique_items(t)
  t:eq(errors_of({ type = "array", uniqueItems = true }, decode('[1,2,1]')),
    "arguments[2]: duplicates item 0 (items must be unique)")
end

function tests.simple_patterns_are_checked(t)
  local s = { type = "string", pattern = "^[a-z0-9-]+$" }
  t:eq(errors_of(s, "abc-12"), "")
  t:eq(errors_of(s, "ABC"), "arguments: must match the pattern ^[a-z0-9-]+$")
  t:eq(errors_of({ type = "string", pattern = "\\d{3}" }, "x"), "") -- {n} is not translated: not checked
  t:eq(errors_of({ type = "string", pattern = "^a.c$" }, "abc"), "")
  t:eq(errors_of({ type = "string", pattern = "^\\w+@\\w+\\.com$" }, "a@b.com"), "")
  t:eq(errors_of({ type = "string", pattern = "^\\w+@\\w+\\.com$" }, "a@bxcom"),
    "arguments: must match the pattern ^\\w+@\\w+\\.com$")
  t:eq(schema.translate_pattern("(a|b)"), nil)
end

function tests.defaults_are_applied_to_a_copy(t)
  local s = { type = "object", properties = {
    count = { type = "integer", default = 1 },
    opts = { type = "object", properties = { upper = { type = "boolean", default = false } } },
    tags = { type = "array", default = json.array() },
  } }
  local args = { opts = {} }
  local v = schema.apply_defaults(s, args)
  t:eq(v.count, 1)
  t:eq(v.opts.upper, false)
  t:ok(json.is_array(v.tags), "default array keeps its JSON array mark")
  t:eq(args.count, nil, "the caller's table is unchanged")
  t:eq(args.opts.upper, nil, "nested caller table is unchanged")
end

function tests.empty_table_counts_as_array_or_object(t)
  -- JSON [] and {} both decode to an empty Lua table
  t:eq(errors_of({ type = "array", maxItems = 0 }, decode("[]")), "")
  t:eq(errors_of({ type = "object" }, decode("[]")), "")
end

function tests.check_rejects_malformed_schemas(t)
  t:ok(schema.check(OBJ))
  local ok, err = schema.check({ type = "object", properties = { a = { type = "strin" } } }, "inputSchema")
  t:eq(ok, nil)
  t:eq(err, 'inputSchema.properties.a.type: unknown type "strin"')
  ok, err = schema.check({ type = "object", required = "a" }, "inputSchema")
  t:eq(ok, nil)
  t:eq(err, "inputSchema.required: must be a list of property names")
  ok, err = schema.check({ type = "object", properties = { n = { type = "integer", minimum = "1" } } }, "inputSchema")
  t:eq(ok, nil)
  t:eq(err, "inputSchema.properties.n.minimum: must be a number")
end

function tests.for_json_keeps_arrays_arrays(t)
  local s = schema.for_json({ type = "object", properties = {}, required = {}, anyOf = {} })
  local back = json.encode(s)
  t:match(back, '"required":%[%]')
  t:match(back, '"properties":{}')
  t:match(back, '"anyOf":%[%]')
end

return tests
