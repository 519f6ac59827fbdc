-- Generates a C file holding every embedded source file as a byte array.
-- usage: lua5.4 embed.lua SOURCE_ROOT OUTPUT.c FILE...
-- Each entry is named by its path relative to SOURCE_ROOT ("lua/async.lua").
local root, out = arg[1], arg[2]
local files = {}
for i = 3, #arg do files[#files + 1] = arg[i] end
table.sort(files)
local parts = { '#include <stddef.h>\n#include "embedded.h"\n' }
local entries = {}
for i, path in ipairs(files) do
  local f = assert(io.open(path, "rb"))
  local data = f:read("a")
  f:close()
  local rel = path:sub(#root + 2)
  local bytes = {}
  for j = 1, #data do
    bytes[#bytes + 1] = string.byte(data, j)
    if j % 24 == 0 then bytes[#bytes + 1] = "\n" end
  end
  local body = table.concat(bytes, ","):gsub(",\n,", ",\n"):gsub(",\n$", "")
  parts[#parts + 1] = ("static const unsigned char f%d[] = {%s%s0};\n"):format(i, body, #data > 0 and "," or "")
  entries[#entries + 1] = ('  {"%s", f%d, %d},\n'):format(rel, i, #data)
end
parts[#parts + 1] = "const struct dm_embedded dm_embedded_files[] = {\n" .. table.concat(entries) .. "  {NULL, NULL, 0}\n};\n"
local f = assert(io.open(out, "wb"))
f:write(table.concat(parts))
f:close()
