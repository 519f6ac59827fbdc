-- `demesne images list|build [NAME]`: the built-in images and building them ahead of use.
local async = require("demesne.async")
local images = require("demesne.images")
local engines = require("demesne.engines")
local loop = require("core.loop")

return function(args)
  local sub = args[1] or "list"
  if sub ~= "list" and sub ~= "build" then
    io.stderr:write("usage: demesne images list|build [NAME]\n")
    return 2
  end
  local status = 0
  local task = async.spawn("images", function()
    local eng, err = engines.get()
    if not eng then
      io.stderr:write("demesne: ", err, "\n")
      status = 1
      return
    end
    local names = args[2] and { args[2] } or images.list()
    for _, name in ipairs(names) do
      if sub == "list" then
        local spec = images.BUILTIN[name]
        if not spec then
          io.stderr:write("demesne: no built-in image ", name, "\n")
          status = 1
        else
          local tag = images.status(eng, name)
          io.stdout:write(("%-18s %-34s from %s\n"):format(name, tag or "not built", spec.parent == "@rootfs" and "Debian root filesystem" or spec.parent))
        end
      else
        local t0 = loop.hrtime()
        local img, berr = images.ensure(eng, name, nil) -- progress goes to the log on stderr
        if img then
          io.stdout:write(("%-10s %s (%.1f s)\n"):format(name, img.ref, (loop.hrtime() - t0) / 1e9))
        else
          io.stderr:write("demesne: ", berr, "\n")
          status = 1
        end
      end
    end
  end)
  if not task.done then loop.run() end
  if not task.result[1] then
    io.stderr:write("demesne: ", tostring(task.result[2]), "\n")
    return 1
  end
  return status
end
