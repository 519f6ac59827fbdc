-- Newline-delimited framing for MCP over stdio: bytes in, whole lines out.
--
-- A frame may arrive split over several reads, and one read may hold several frames.
-- A line longer than the cap is never buffered whole: once the cap is crossed, the bytes
-- buffered so far are dropped, on_overflow is called once, and the rest of the line is
-- discarded up to its newline. Memory held is bounded by the cap plus one read.
local framing = {}

---@class LineReader
---@field feed fun(chunk: string)  hands the reader the next bytes read
---@field finish fun()              end of input: a last line without a newline is delivered
---@field buffered fun(): integer   bytes held for the current, unfinished line

--- Creates a line reader.
--- `on_line(line)` gets each complete line without its "\n" (and without a trailing "\r");
--- blank lines are skipped. `on_overflow(bytes)` is called once per over-long line, as soon
--- as it crosses `max_line` bytes (`bytes` = how many were seen so far).
---@param max_line integer  the longest line accepted, in bytes (without the newline)
---@param on_line fun(line: string)
---@param on_overflow fun(bytes: integer)
---@return LineReader
function framing.reader(max_line, on_line, on_overflow)
  local parts, len = {}, 0
  local discarding = false
  local self = {}

  local function deliver(line)
    if line:byte(-1) == 13 then line = line:sub(1, -2) end
    if line:find("[^ \t\r]") then on_line(line) end
  end

  local function overflow(seen)
    parts, len = {}, 0
    discarding = true
    on_overflow(seen)
  end

  function self.feed(chunk)
    local pos, n = 1, #chunk
    while pos <= n do
      local nl = chunk:find("\n", pos, true)
      if not nl then
        local rest = n - pos + 1
        if not discarding then
          if len + rest > max_line then
            overflow(len + rest)
          else
            parts[#parts + 1] = pos == 1 and chunk or chunk:sub(pos)
            len = len + rest
          end
        end
        return
      end
      local piece_len = nl - pos
      if discarding then
        discarding = false
      elseif len + piece_len > max_line then
        overflow(len + piece_len)
        discarding = false
      else
        local piece = chunk:sub(pos, nl - 1)
        local line
        if len == 0 then
          line = piece
        else
          parts[#parts + 1] = piece
          line = table.concat(parts)
        end
        parts, len = {}, 0
        deliver(line)
      end
      pos = nl + 1
    end
  end

  function self.finish()
    if not discarding and len > 0 then
      local line = table.concat(parts)
      parts, len = {}, 0
      deliver(line)
    end
    parts, len, discarding = {}, 0, false
  end

  function self.buffered() return len end

  return self
end

return framing
