-- Bounded views of a command's output: the head and tail of a log file, cut on UTF-8
-- code-point boundaries, invalid bytes replaced, with a marker naming the full log.
-- Memory use is bounded by head + tail, whatever the log's size.
local fs = require("core.fs")
local text = require("core.text")

local output = {}

-- Opens `root/rel` for reading, confined (core.fs.open_beneath: no symlink, no "..", a
-- regular file only, never blocking). A missing log means the command wrote nothing: nil
-- with no error. Any other failure (a symlink, a FIFO, a folder, EMFILE …) is returned
-- as nil, message, code: it must never read as empty output.
local function open_log(root, rel)
  local f, err, code = fs.open_beneath(root, rel)
  if f then return f end
  if code == "ENOENT" then return nil end
  return nil, ("cannot read %s/%s: %s"):format(root, rel, tostring(err)), code or "EIO"
end

--- Reads a bounded view of `root/rel` (opened beneath root: no symlinks followed, a
--- regular file only). A missing file reads as "" (the command wrote nothing); any other
--- failure returns nil, message, code.
---@param root string  the output folder
---@param rel string   e.g. "stdout.log"
---@param head integer bytes kept from the start
---@param tail integer bytes kept from the end
---@return string|nil text, boolean|string truncated_or_err, integer|string size_or_code
function output.view(root, rel, head, tail)
  local f, err, code = open_log(root, rel)
  if not f then
    if err then return nil, err, code end
    return "", false, 0
  end
  local size = f:size() or 0
  local s, truncated
  if size <= head + tail then
    s = f:read(size, 0) or ""
    truncated = false
    -- the file may have grown since size(): keep the bound regardless
    if #s > head + tail then s = s:sub(1, head + tail) end
    s = text.utf8_clean(s)
  else
    local h = f:read(head, 0) or ""
    local t = f:read(tail, size - tail) or ""
    h = h:sub(1, text.utf8_floor(h, #h))
    -- when the head ends inside a code point, utf8_floor drops the partial sequence
    local start = text.utf8_ceil(t, 1)
    t = t:sub(start)
    local omitted = size - #h - #t
    s = text.utf8_clean(h)
      .. ("\n[... %d bytes omitted; full output in %s/%s ...]\n"):format(omitted, root, rel)
      .. text.utf8_clean(t)
    truncated = true
  end
  f:close()
  return s, truncated, size
end

--- Reads the part of `root/rel` that starts at byte `from`, at most `max` bytes, for a
--- caller that reads a growing log incrementally. The part ends on a code-point boundary
--- (a sequence still being written is left for the next read) unless `final` says the log
--- is complete. Returns the text (invalid bytes replaced by U+FFFD), the offset to read
--- from next (a byte offset into the file: concatenated parts never miss or repeat a
--- byte), and the log's size. A missing log reads as empty; any other failure returns
--- nil, message, code. Opened beneath root: no link is followed.
---@param root string
---@param rel string
---@param from integer  byte offset, >= 0
---@param max integer   bytes, >= 4
---@param final boolean|nil
---@return string|nil text, integer|string next_or_err, integer|string size_or_code
function output.read_from(root, rel, from, max, final)
  local f, err, code = open_log(root, rel)
  if not f then
    if err then return nil, err, code end
    return "", from, 0
  end
  local size = f:size() or 0
  if from >= size then
    f:close()
    return "", from, size
  end
  local s = f:read(math.min(max, size - from), from) or ""
  f:close()
  local cut = #s
  if not (final and from + #s >= size) then cut = text.utf8_floor(s, #s) end
  return text.utf8_clean(s:sub(1, cut)), from + cut, size
end

--- The last `max` bytes of `root/rel`, starting on a code-point boundary and, when the log
--- is longer, after the first line break in them (no partial first line). Returns the
--- text (invalid bytes replaced) and the log's size. A missing log reads as empty; any
--- other failure returns nil, message, code.
---@param root string
---@param rel string
---@param max integer
---@return string|nil text, integer|string size_or_err, string|nil code
function output.tail(root, rel, max)
  local f, err, code = open_log(root, rel)
  if not f then
    if err then return nil, err, code end
    return "", 0
  end
  local size = f:size() or 0
  local from = math.max(size - max, 0)
  local s = f:read(size - from, from) or ""
  f:close()
  if from > 0 then
    local nl = s:find("\n", 1, true)
    s = nl and s:sub(nl + 1) or s:sub(text.utf8_ceil(s, 1))
  end
  return text.utf8_clean(s), size
end

return output
