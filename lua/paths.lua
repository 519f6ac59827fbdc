-- Host paths that callers hand in (files, directories, upload sources): absolute,
-- symlinks resolved before the check, inside an allowed root compared by path components.
local fs = require("core.fs")
local config = require("demesne.config")

local paths = {}

local function split(p)
  local parts = {}
  for c in p:gmatch("[^/]+") do parts[#parts + 1] = c end
  return parts
end

--- True when `path` equals `root` or lies beneath it, by whole components
--- ("/a/b1" is not inside "/a/b"). Both must be absolute and normalised.
---@param path string
---@param root string
---@return boolean
function paths.within(path, root)
  local p, r = split(path), split(root)
  if #p < #r then return false end
  for i = 1, #r do if p[i] ~= r[i] then return false end end
  return true
end

--- The allowed roots, resolved. Returns list (possibly empty).
---@return string[]
function paths.roots()
  local out = {}
  for _, r in ipairs(config.get("allowed_paths")) do
    local real = fs.realpath(r)
    if real then out[#out + 1] = real end
  end
  return out
end

--- A sentence for tool descriptions: where inputs may come from.
---@return string
function paths.describe_roots()
  local roots = config.get("allowed_paths")
  if #roots == 0 then
    return "No host inputs can be mounted: DEMESNE_ALLOWED_PATHS is not configured."
  end
  return "Host paths must be inside: " .. table.concat(roots, ", ") .. "."
end

--- Checks one caller-supplied host path. kind: "file", "directory" or "any".
--- Returns the resolved path, or nil and a message naming the field, the path and the reason.
---@param field string  e.g. "files[2]"
---@param path any
---@param kind string
---@return string|nil real, string|nil err
function paths.check(field, path, kind)
  if type(path) ~= "string" or path == "" then return nil, field .. ": path is empty" end
  if path:sub(1, 1) ~= "/" then return nil, ("%s: path must be absolute: %s"):format(field, path) end
  local roots = paths.roots()
  if #roots == 0 then
    return nil, ("%s: %s cannot be used: no host inputs can be mounted because DEMESNE_ALLOWED_PATHS is not "
      .. "configured"):format(field, path)
  end
  local real, err = fs.realpath(path)
  if not real then return nil, ("%s: cannot resolve %s: %s"):format(field, path, (err or ""):gsub("^realpath [^:]*: ", "")) end
  local inside = false
  for _, r in ipairs(roots) do
    if paths.within(real, r) then inside = true break end
  end
  if not inside then
    local via = real ~= path and (" (resolves to " .. real .. ")") or ""
    return nil, ("%s: %s%s is not inside the allowed paths (%s)"):format(field, path, via, table.concat(roots, ", "))
  end
  local st = fs.stat(real)
  if kind == "file" and (not st or st.type ~= "file") then
    return nil, ("%s: %s is not a regular file"):format(field, path)
  elseif kind == "directory" and (not st or st.type ~= "directory") then
    return nil, ("%s: %s is not a directory"):format(field, path)
  elseif kind == "any" and (not st or (st.type ~= "file" and st.type ~= "directory")) then
    return nil, ("%s: %s is not a regular file or a directory"):format(field, path)
  end
  return real
end

--- Validates the files and directories of a call and plans their mounts at /in/<basename>.
--- Returns list of {host=, target=, kind=, field=} (field: "files[0]"…, for messages) or nil
--- and a message. Two inputs with the same basename are refused.
---@param files string[]|nil
---@param directories string[]|nil
---@return {host: string, target: string, kind: string}[]|nil mounts, string|nil err
function paths.inputs(files, directories)
  local out, seen = {}, {}
  local function add(list, field, kind)
    for i, p in ipairs(list or {}) do
      local f = ("%s[%d]"):format(field, i - 1)
      local real, err = paths.check(f, p, kind)
      if not real then return nil, err end
      local base = real:match("([^/]+)$") or ""
      if base == "" then return nil, f .. ": cannot mount the root folder" end
      if seen[base] then
        return nil, ('%s: basename "%s" would collide at /in/%s: %s and %s'):format(f, base, base, seen[base], p)
      end
      seen[base] = p
      out[#out + 1] = { host = real, target = "/in/" .. base, kind = kind, field = f }
    end
    return true
  end
  local ok, err = add(files, "files", "file")
  if not ok then return nil, err end
  ok, err = add(directories, "directories", "directory")
  if not ok then return nil, err end
  return out
end

return paths
