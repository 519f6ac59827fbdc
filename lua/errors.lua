-- The one error type of the runtime: a failure the caller is meant to read.
--
-- Lua code below the MCP layer raises these for bad input and for operational failures
-- worth a sentence (a path outside the allowed roots, a sandbox that is gone, an engine
-- that answered an error). lua/tools/init.lua turns one into an `isError: true` result whose
-- text is the message; any other Lua error is a bug and becomes "Tool X failed: …" with
-- the traceback in the log. The message names the field and the reason
-- ("files[0]: /etc/passwd is not inside the allowed paths").
--
--   error(errors.new("job_id: no job job-x"))        -- raise one
--   errors.raise("job_id: no job job-x")              -- the same
--   local v = errors.check(engine:inspect(id))        -- nil, msg, code → raised
--   if errors.is(e) then … e.message, e.code, e.data end
--
-- The C bindings and the engine adapters keep their own contract (`nil, message, code`);
-- errors.check turns that into a raised error where a caller wants one.
local errors = {}

---@class DemesneError
---@field message string   what went wrong, naming the field and the reason
---@field code string|nil  a short stable code ("ENOENT", "ETIMEDOUT", "ENOENGINE", …)
---@field data any         extra detail for the caller (JSON-encodable), or nil

local Error = {}
Error.__index = Error
Error.__name = "demesne.error"
Error.__tostring = function(e) return e.message end

--- Makes an error. Raise it with `error(errors.new(…))` (no position is added to a table).
---@param message any       turned into a string
---@param code string|nil   a short stable code
---@param data any          extra detail for the caller (JSON-encodable)
---@return DemesneError
function errors.new(message, code, data)
  return setmetatable({ message = tostring(message), code = code, data = data }, Error)
end

--- True for an error made by errors.new.
---@param e any
---@return boolean
function errors.is(e)
  return getmetatable(e) == Error
end

--- Raises errors.new(message, code, data). Does not return.
---@param message any
---@param code string|nil
---@param data any
function errors.raise(message, code, data)
  error(errors.new(message, code, data), 0)
end

--- Passes `v` through, or raises `err` (with `code`) when `v` is nil: for the
--- `nil, message, code` returns of the bindings and adapters.
---@generic T
---@param v T|nil
---@param err any
---@param code string|nil
---@return T
function errors.check(v, err, code)
  if v == nil then errors.raise(err, code) end
  return v
end

--- The message of any error value: an error's message, else the first line of its text.
---@param e any
---@return string
function errors.message(e)
  if errors.is(e) then return e.message end
  return (tostring(e):match("^[^\n]*"))
end

return errors
