-- Text that a sandbox wrote, made safe for the user's terminal, and an agent CLI's event
-- stream (stream-json lines) rendered as readable lines: for `demesne attach --follow`
-- (lua/cmd/attach.lua), and for anything else that shows a run's transcript to a person.
-- Everything in it is hostile: escape sequences would recolour, retitle or rewrite the
-- user's terminal (OSC 52 even sets the clipboard), so no control byte gets through.
local json = require("demesne.json")
local text = require("core.text")

local terminal = {}

local function caret(c)
  local b = c:byte()
  if b == 127 then return "^?" end
  return "^" .. string.char(b + 64)
end

--- `s` with every control character made visible and inert: C0 bytes other than line feed
--- and tab as ^X (ESC is ^[, so "\27[31m" prints as "^[[31m"), DEL as ^?, the C1 controls
--- (U+0080..U+009F, which some terminals obey as CSI/OSC) as <U+009B>, and invalid UTF-8 as
--- U+FFFD. With `oneline`, line feeds and tabs become ^J and ^I too.
---@param s any
---@param oneline boolean|nil
---@return string
function terminal.neutralise(s, oneline)
  s = text.utf8_clean(tostring(s))
  s = s:gsub(oneline and "[%c\127]" or "[\0-\8\11-\31\127]", caret)
  s = s:gsub("\194([\128-\159])", function(c) return ("<U+%04X>"):format(c:byte()) end)
  return s
end

local function short(v, max)
  local s = type(v) == "string" and v or json.encode(v)
  if #s > max then s = s:sub(1, text.utf8_floor(s, max)) .. "…" end
  return s
end

-- The text of a message's content: a string, or the text parts of a list of blocks.
local function blocks(content, out, who)
  if type(content) == "string" then
    out[#out + 1] = who .. ": " .. content
    return
  end
  if type(content) ~= "table" then return end
  for _, b in ipairs(content) do
    if type(b) == "table" then
      if b.type == "text" and b.text then
        out[#out + 1] = who .. ": " .. tostring(b.text)
      elseif b.type == "thinking" and b.thinking then
        out[#out + 1] = "thinking: " .. tostring(b.thinking)
      elseif b.type == "tool_use" then
        out[#out + 1] = ("tool %s: %s"):format(tostring(b.name), short(b.input or {}, 400))
      elseif b.type == "tool_result" then
        local c = b.content
        if type(c) == "table" then
          local parts = {}
          for _, p in ipairs(c) do if type(p) == "table" and p.text then parts[#parts + 1] = tostring(p.text) end end
          c = table.concat(parts, "\n")
        end
        out[#out + 1] = (b.is_error and "tool error: " or "tool result: ") .. short(c or "", 2000)
      end
    end
  end
end

--- One line of an agent CLI's output rendered for a person: a stream-json event of Claude
--- Code (system/init, assistant and user messages, tool calls and results, the result) or
--- of Codex (item events, turn and error events) as "who: text" lines; anything else (not
--- JSON, another shape) as the line itself. Returns the lines, already neutralised.
---@param line string  one line, without its line feed
---@return string[] lines
function terminal.render_event(line)
  local ev = line:sub(1, 1) == "{" and json.decode(line) or nil
  local out = {}
  if type(ev) ~= "table" then
    out[1] = line
  elseif ev.type == "system" then
    out[1] = ("[%s%s]"):format(tostring(ev.subtype or "system"), ev.model and (" model " .. tostring(ev.model)) or "")
  elseif (ev.type == "assistant" or ev.type == "user") and type(ev.message) == "table" then
    blocks(ev.message.content, out, ev.type == "assistant" and "assistant" or "user")
  elseif ev.type == "result" then
    out[1] = ("[result%s] %s"):format(ev.is_error and " (error)" or "", tostring(ev.result or ev.subtype or ""))
  elseif type(ev.item) == "table" then -- Codex: item.started / item.completed
    local it = ev.item
    if it.type == "agent_message" or it.type == "reasoning" then
      out[1] = (it.type == "agent_message" and "assistant: " or "thinking: ") .. tostring(it.text or "")
    elseif it.type == "command_execution" then
      out[1] = ("command: %s%s"):format(tostring(it.command or ""),
        it.aggregated_output and ("\n" .. short(it.aggregated_output, 2000)) or "")
    else
      out[1] = ("[%s] %s"):format(tostring(it.type), short(it, 400))
    end
  elseif ev.type == "error" or ev.type == "turn.failed" then
    out[1] = "error: " .. short(ev.message or ev.error or ev, 1000)
  else
    out[1] = ("[%s]"):format(short(ev.type or "event", 80))
  end
  for i, l in ipairs(out) do out[i] = terminal.neutralise(l) end
  return out
end

return terminal
