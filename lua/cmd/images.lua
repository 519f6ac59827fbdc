-- `demesne images list [NAME...]`, `demesne images build [--refresh] [--all | NAME...]`,
-- `demesne images outdated [--no-packages] [NAME...]` and `demesne images prune`: the images
-- (built-in and the user's own), building them ahead of use, which of them are outdated, and
-- the stale devcontainer images removed (lua/images/devcontainer.lua).
local async = require("demesne.async")
local config = require("demesne.config")
local images = require("demesne.images")
local devcontainer = require("demesne.images.devcontainer")
local engines = require("demesne.engines")
local json = require("demesne.json")
local oneshot = require("demesne.sandbox.oneshot")
local loop = require("core.loop")

local USAGE = "usage: demesne images list [NAME...] | build [--refresh] [--all | NAME...] | "
  .. "outdated [--no-packages] [NAME...] | prune\n"

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

-- What runs inside a sandbox of the image to find newer packages: apt's lists go to /tmp
-- (the root filesystem is read-only), a simulated dist-upgrade names what would change,
-- and npm lists its outdated global packages. Every line the host reads starts with a marker.
local PACKAGE_CHECK = [==[
L=/tmp/demesne-apt
O="-o Dir::State::Lists=$L/lists -o Dir::Cache=$L/cache -o APT::Sandbox::User=root -o Debug::NoLocking=1"
if command -v apt-get >/dev/null 2>&1; then
  mkdir -p "$L/lists/partial" "$L/cache/archives/partial"
  if apt-get $O -qq update >"$L/update.log" 2>&1; then
    apt-get $O -s -qq dist-upgrade 2>/dev/null |
      sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\] (\([^ ]*\) .*/demesne-deb \1 \2 \3/p'
  else
    echo "demesne-deb-error $(grep -E '^(E|W|Err):' "$L/update.log" | head -n 2 | tr '\n' ' ' | cut -c1-300)"
  fi
fi
if command -v npm >/dev/null 2>&1; then
  echo demesne-npm-begin
  npm outdated -g --json 2>/dev/null
  echo
  echo demesne-npm-end
fi
]==]

-- Looks for newer Debian and npm packages in a sandbox of image `name` (egress
-- package-managers). Returns {deb = {{name, installed, newest}…}, npm = {…}, errors = {…}}.
local function package_report(name)
  local ok, r = pcall(oneshot.run_script, {}, { command = PACKAGE_CHECK, image = name, egress = "package-managers",
    timeout_seconds = math.floor(config.get("image_outdated_timeout_seconds") or 300) })
  if not ok then return { deb = {}, npm = {}, errors = { "the check could not run: " .. tostring(r) } } end
  local out = { deb = {}, npm = {}, errors = {} }
  local stdout = r.stdout or ""
  for pkg, old, new in stdout:gmatch("demesne%-deb (%S+) (%S+) (%S+)") do
    out.deb[#out.deb + 1] = { name = pkg, installed = old, newest = new }
  end
  local derr = stdout:match("demesne%-deb%-error ([^\n]*)")
  if derr then out.errors[#out.errors + 1] = "Debian packages not checked: apt-get update failed: " .. derr end
  local npm = stdout:match("demesne%-npm%-begin\n(.-)\ndemesne%-npm%-end")
  local t = npm and npm:match("%S") and json.decode(npm)
  if type(t) == "table" then
    for pkg, v in pairs(t) do
      if type(v) == "table" and v.current and v.latest and v.current ~= v.latest then
        out.npm[#out.npm + 1] = { name = pkg, installed = tostring(v.current), newest = tostring(v.latest) }
      end
    end
    table.sort(out.npm, function(a, b) return a.name < b.name end)
  elseif npm and npm:match("%S") then
    out.errors[#out.errors + 1] = "npm packages not checked: npm outdated answered no JSON"
  end
  if r.exit_code ~= 0 then out.errors[#out.errors + 1] = ("the check exited %s"):format(tostring(r.exit_code)) end
  return out
end

-- Prints the freshness of one image by its inputs; returns whether it is outdated.
local function report_inputs(eng, name)
  local f, err = images.freshness(eng, name)
  if not f then
    io.stderr:write("demesne: ", err, "\n")
    return false, true
  end
  if f.state == "current" then
    io.stdout:write(("%-18s %-34s current inputs\n"):format(name, f.tag))
  elseif f.state == "changed" then
    io.stdout:write(("%-18s %-34s outdated: its inputs changed since %s (not built from them yet)\n"):format(name,
      f.tag or "?", table.concat(f.built, ", ")))
    return true
  else
    io.stdout:write(("%-18s %-34s not built\n"):format(name, f.tag or "-"))
  end
  return false, false, f.state == "current"
end

local function outdated(eng, names, packages)
  local status = 0
  for _, name in ipairs(names) do
    local stale, failed, current = report_inputs(eng, name)
    if stale then status = 1 end
    if failed then status = 1 end
    if current and packages then
      local p = package_report(name)
      for _, d in ipairs(p.deb) do
        io.stdout:write(("    deb %s %s -> %s\n"):format(d.name, d.installed, d.newest))
      end
      for _, d in ipairs(p.npm) do
        io.stdout:write(("    npm %s %s -> %s\n"):format(d.name, d.installed, d.newest))
      end
      if #p.deb + #p.npm > 0 then
        io.stdout:write(("    outdated: %d Debian and %d npm packages have newer versions (`demesne images build "
          .. "--refresh %s`)\n"):format(#p.deb, #p.npm, name))
        status = 1
      end
      for _, e in ipairs(p.errors) do io.stdout:write("    ", e, "\n") end
    end
  end
  return status
end

return function(args)
  local sub = args[1] or "list"
  if sub == "prune" and #args > 1 then io.stderr:write(USAGE) return 2 end
  if sub ~= "list" and sub ~= "build" and sub ~= "outdated" and sub ~= "prune" then
    io.stderr:write(USAGE)
    return 2
  end
  local names, all, refresh, packages = {}, false, false, true
  for i = 2, #args do
    if args[i] == "--all" and sub == "build" then all = true
    elseif args[i] == "--refresh" and sub == "build" then refresh = true
    elseif args[i] == "--no-packages" and sub == "outdated" then packages = false
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
    if sub == "outdated" then
      for _, name in ipairs(names) do
        if not images.origin(name) then
          io.stderr:write("demesne: no image ", name, "\n")
          status = 1
        end
      end
      if status == 0 then status = outdated(eng, names, packages) end
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
        -- the same report as `images outdated` (by inputs): what this build replaces
        local f = images.origin(name) and images.freshness(eng, name)
        if f and f.state == "changed" then
          io.stdout:write(("%-18s outdated: its inputs changed since %s; building %s\n"):format(name,
            table.concat(f.built, ", "), tostring(f.tag)))
        end
        local img, berr
        if refresh and images.origin(name) then
          local tag, rerr = images.rebuild(eng, name, nil)
          img, berr = tag and { ref = tag }, rerr
        else
          img, berr = images.ensure(eng, name, nil) -- progress goes to the log on stderr
        end
        if img then
          io.stdout:write(("%-18s %s (%.1f s)%s\n"):format(name, img.ref, (loop.hrtime() - t0) / 1e9,
            refresh and ", rebuilt without the cache" or ""))
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
