-- `demesne images list [NAME...]` and `demesne images build [--all | NAME...]`: the images
-- (built-in and the user's own) and building them ahead of use; `demesne images prune`: the
-- stale devcontainer images go (lua/images/devcontainer.lua).
local async = require("demesne.async")
local images = require("demesne.images")
local devcontainer = require("demesne.images.devcontainer")
local engines = require("demesne.engines")
local loop = require("core.loop")

local USAGE = "usage: demesne images list [NAME...] | build [--all | NAME...] | prune\n"

local function origin_text(name)
  local origin, dir = images.origin(name)
  if origin == "user" then
    return (images.BUILTIN[name] and "user (replaces the built-in) " or "user ") .. dir
  end
  return origin or "?"
end

local function print_notes(notes)
  for line in (notes or ""):gmatch("[^\n]+") do io.stdout:write("    ", line, "\n") end
end

-- The devcontainer images built from repositories and folders (list), or removes the stale
-- ones (prune: a newer build of the same source exists, or the source folder is gone; an
-- image a container still uses stays). Returns the exit status.
local function devcontainer_images(eng, prune)
  local list, err = devcontainer.built(eng)
  if not list then
    io.stderr:write("demesne: ", tostring(err), "\n")
    return 1
  end
  local status, removed = 0, 0
  for _, i in ipairs(list) do
    if not prune then
      io.stdout:write(("%-18s %-50s from %s (%s)%s%s\n"):format("devcontainer", i.ref, i.source, tostring(i.file),
        i.agent and (", with " .. i.agent) or "", i.stale and ", stale" or ""))
    elseif i.stale then
      local ok, rerr = eng:image_remove(i.ref)
      if ok then
        removed = removed + 1
        io.stdout:write("removed ", i.ref, " (from ", i.source, ")\n")
      else
        io.stderr:write("demesne: ", i.ref, " kept: ", tostring(rerr), "\n")
        status = 1
      end
    end
  end
  if prune then io.stdout:write(("%d stale devcontainer image(s) removed\n"):format(removed)) end
  return status
end

return function(args)
  local sub = args[1] or "list"
  if sub == "prune" and #args > 1 then io.stderr:write(USAGE) return 2 end
  if sub ~= "list" and sub ~= "build" and sub ~= "prune" then
    io.stderr:write(USAGE)
    return 2
  end
  local names, all = {}, false
  for i = 2, #args do
    if args[i] == "--all" and sub == "build" then all = true
    elseif args[i]:sub(1, 1) == "-" then io.stderr:write("demesne: images: unknown option ", args[i], "\n", USAGE) return 2
    else names[#names + 1] = args[i] end
  end
  if all and #names > 0 then io.stderr:write("demesne: images build: --all takes no NAME\n", USAGE) return 2 end
  local status = 0
  local every = #names == 0
  if every then
    names = images.list()
    -- image folders that are not images (a bad name) are said once, as the other plugin kinds say theirs
    for _, e in ipairs(images.catalog().errors) do
      io.stderr:write("demesne: refused ", e.message, "\n")
      status = 1
    end
  end
  local task = async.spawn("images", function()
    local eng, err = engines.get()
    if not eng then
      io.stderr:write("demesne: ", err, "\n")
      status = 1
      return
    end
    if sub == "prune" then
      status = devcontainer_images(eng, true)
      return
    end
    for _, name in ipairs(names) do
      if sub == "list" then
        if not images.origin(name) then
          io.stderr:write("demesne: no image ", name, "\n")
          status = 1
        else
          local tag, notes = images.status(eng, name)
          io.stdout:write(("%-18s %-34s %s, from %s\n"):format(name, tag or notes or "not built", origin_text(name),
            images.parent(name) or "?"))
          if tag then print_notes(notes) end
        end
      else
        local t0 = loop.hrtime()
        local img, berr = images.ensure(eng, name, nil) -- progress goes to the log on stderr
        if img then
          io.stdout:write(("%-18s %s (%.1f s)\n"):format(name, img.ref, (loop.hrtime() - t0) / 1e9))
          print_notes(images.origin(name) and images.notes(eng, img.ref))
        else
          io.stderr:write("demesne: ", berr, "\n")
          status = 1
        end
      end
    end
    if sub == "list" and every and devcontainer_images(eng, false) ~= 0 then status = 1 end
  end)
  if not task.done then loop.run() end
  if not task.result[1] then
    io.stderr:write("demesne: ", tostring(task.result[2]), "\n")
    return 1
  end
  return status
end
