-- Bounded views of a command's output: the head and tail of a log file, cut on UTF-8
-- code-point boundaries, invalid bytes replaced, with a marker naming the full log.
-- Memory use is bounded by head + tail, whatever the log's size.
local fs = require("core.fs")
local text = require("core.text")

local output = {}

--- Reads a bounded view of `root/rel` (opened beneath root: no symlinks followed).
---@param root string  the output folder
---@param rel string   e.g. "stdout.log"
---@param head integer bytes kept from the start
---@param tail integer bytes kept from the end
---@return string text, boolean truncated, integer size
function output.view(root, rel, head, tail)
  local f = fs.open_beneath(root, rel)
  if not f then return "", false, 0 end
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

return output
