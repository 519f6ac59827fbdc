-- Bootstrap: installs the module searcher for the demesne runtime, then hands the command
-- line to demesne.cli. Runs with argv as its only argument and returns the exit status.
-- Run with no argv (nil), as an embedder such as the fuzz harnesses (tests/fuzz) does, it
-- installs the searcher and returns nil without running a command.
--
-- Module names map to files: "demesne.async" -> lua/async.lua,
-- "demesne.mcp.server" -> lua/mcp/server.lua, "demesne.engines" -> lua/engines/init.lua.
-- With DEMESNE_SOURCE_DIR set (or --source-dir DIR first on the command line), files are
-- read from that source tree instead of the copies embedded in the binary.
local argv = ...
local fs = require("core.fs")
local loop = require("core.loop")

local source_dir = os.getenv("DEMESNE_SOURCE_DIR")
if argv and argv[1] == "--source-dir" and argv[2] then
  source_dir = argv[2]
  table.remove(argv, 1)
  table.remove(argv, 1)
end
if source_dir == "" then source_dir = nil end

local embedded = loop.embedded()

--- Reads a file of the runtime by its path relative to the source root
--- ("lua/async.lua", "tools/sandbox_script.lua", "images/base/Containerfile").
---@param rel string
---@return string|nil contents, string|nil origin  origin is "embedded" or the disk path
local function source(rel)
  if source_dir then
    local path = source_dir .. "/" .. rel
    local f = io.open(path, "rb")
    if f then
      local s = f:read("a")
      f:close()
      return s, path
    end
    return nil
  end
  local s = embedded[rel]
  if s then return s, "embedded:" .. rel end
  return nil
end

--- Lists the runtime files under a folder ("tools/"), sorted.
---@param prefix string
---@return string[] rel_paths
local function list(prefix)
  local out = {}
  if source_dir then
    local names = fs.readdir(source_dir .. "/" .. prefix) or {}
    for _, n in ipairs(names) do out[#out + 1] = prefix .. n end
  else
    for rel in pairs(embedded) do
      if rel:sub(1, #prefix) == prefix and not rel:find("/", #prefix + 1, true) then
        out[#out + 1] = rel
      end
    end
  end
  table.sort(out)
  return out
end

--- Lists every runtime file under a folder ("skills/"), at any depth, sorted. From a source
--- tree, symlinks and hidden names are skipped (what is embedded is files only).
---@param prefix string  ends with "/"
---@return string[] rel_paths
local function files(prefix)
  local out = {}
  if source_dir then
    local function walk(rel)
      for _, n in ipairs(fs.readdir(source_dir .. "/" .. rel) or {}) do
        if n:sub(1, 1) ~= "." then
          local st = fs.lstat(source_dir .. "/" .. rel .. n)
          if st and st.type == "directory" then
            walk(rel .. n .. "/")
          elseif st and st.type == "file" then
            out[#out + 1] = rel .. n
          end
        end
      end
    end
    walk(prefix)
  else
    for rel in pairs(embedded) do
      if rel:sub(1, #prefix) == prefix then out[#out + 1] = rel end
    end
  end
  table.sort(out)
  return out
end

table.insert(package.searchers, 2, function(name)
  local rest = name:match("^demesne%.(.+)$") or (name == "demesne" and "init")
  if not rest then return nil end
  local base = "lua/" .. rest:gsub("%.", "/")
  for _, rel in ipairs({ base .. ".lua", base .. "/init.lua" }) do
    local src, origin = source(rel)
    if src then
      local chunk, err = load(src, "@" .. rel, "t")
      if not chunk then error(err, 0) end
      return chunk, origin
    end
  end
  return "\n\tno demesne runtime file " .. base .. ".lua"
end)

--- Lists the folders of the runtime directly under a folder ("images/" -> "base", …), sorted.
---@param prefix string
---@return string[] names
local function dirs(prefix)
  local out, seen = {}, {}
  if source_dir then
    for _, n in ipairs(fs.readdir(source_dir .. "/" .. prefix) or {}) do
      local st = fs.stat(source_dir .. "/" .. prefix .. n)
      if st and st.type == "directory" then out[#out + 1] = n end
    end
  else
    for rel in pairs(embedded) do
      local n = rel:sub(1, #prefix) == prefix and rel:match("^([^/]+)/", #prefix + 1)
      if n and not seen[n] then seen[n] = true; out[#out + 1] = n end
    end
  end
  table.sort(out)
  return out
end

package.loaded["demesne.runtime"] = {
  source = source,
  list = list,
  dirs = dirs,
  embedded = embedded,
  files = files,
  source_dir = source_dir,
}

if argv == nil then return nil end
return require("demesne.cli").main(argv)
