-- A small test runner that runs inside the real binary: each tests/lua/*_test.lua returns
-- a table of name -> function(t); every test runs in its own task on the real loop. The
-- run fails when a test fails or when registry refs or loop handles leak across it. The
-- runtime is composed as `demesne serve` composes it (lua/compose.lua: the layers installed,
-- the job kinds registered) before the first test.
local loop = require("core.loop")
local async = require("demesne.async")
local compose = require("demesne.compose")
local fs = require("core.fs")
local json = require("demesne.json")

local testing = {}

local function deep_eq(a, b)
  if a == b then return true end
  if type(a) ~= "table" or type(b) ~= "table" then return false end
  for k, v in pairs(a) do if not deep_eq(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function fmt(v)
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) == "table" then
    local ok, s = pcall(json.encode, v)
    if ok then return s end
  end
  return tostring(v)
end

local T = {}
T.__index = T
--- Fails the test unless `got` deep-equals `want`, naming `what` and both values.
---@param _ table  the test handle
---@param got any
---@param want any
---@param what string|nil
function T.eq(_, got, want, what)
  if not deep_eq(got, want) then
    error(("%s: expected %s, got %s"):format(what or "value", fmt(want), fmt(got)), 2)
  end
end
--- Fails the test unless `cond` is truthy; returns it.
---@param _ table  the test handle
---@param cond any
---@param what string|nil
---@return any cond
function T.ok(_, cond, what)
  if not cond then error((what or "assertion") .. " failed", 2) end
  return cond
end
--- Fails the test unless `s` is a string in which the Lua pattern `pat` is found.
---@param _ table  the test handle
---@param s any
---@param pat string
---@param what string|nil
function T.match(_, s, pat, what)
  if type(s) ~= "string" or not s:find(pat) then
    error(("%s: %s does not match %q"):format(what or "value", fmt(s), pat), 2)
  end
end

--- Runs the tests in each folder (or file) of `args`. Returns 0 when all pass, else 1.
---@param args string[]
---@return integer
function testing.run(args)
  compose.install()
  local files = {}
  for _, a in ipairs(args) do
    local st = fs.stat(a)
    if st and st.type == "directory" then
      for _, n in ipairs(fs.readdir(a)) do
        if n:match("_test%.lua$") then files[#files + 1] = a .. "/" .. n end
      end
    elseif st then
      files[#files + 1] = a
    end
  end
  local passed, failed = 0, 0
  local filter = os.getenv("DEMESNE_TEST_FILTER")
  -- a write of a sandbox plan's undeclared field raises (lua/sandbox/plan.lua)
  if os.getenv("DEMESNE_STRICT") == nil then loop.setenv("DEMESNE_STRICT", "1") end
  for _, file in ipairs(files) do
    local chunk, err = loadfile(file)
    if not chunk then
      print("not ok - " .. file .. ": " .. err)
      failed = failed + 1
    else
      local suite = chunk()
      local names = {}
      for name in pairs(suite) do names[#names + 1] = name end
      table.sort(names)
      for _, name in ipairs(names) do
        local full = file:match("([^/]+)%.lua$") .. ": " .. name
        if not filter or full:find(filter, 1, true) then
          collectgarbage("collect")
          loop.run("nowait")
          local before = loop.stats()
          local t = setmetatable({}, T)
          local task = async.spawn(full, suite[name], t)
          if not task.done then loop.run() end
          collectgarbage("collect")
          collectgarbage("collect")
          loop.run("nowait") -- let close callbacks of collected handles run
          local after = loop.stats()
          local ok, e = true, nil
          if not task.done then
            ok, e = false, "test did not finish (the loop ran out of work while it waited)"
          elseif not task.result[1] then
            ok, e = false, tostring(task.result[2])
          elseif after.refs ~= before.refs then
            ok, e = false, ("leaked %d registry refs"):format(after.refs - before.refs)
          elseif after.handles ~= before.handles then
            ok, e = false, ("leaked %d loop handles"):format(after.handles - before.handles)
          end
          if ok then
            passed = passed + 1
            print("ok - " .. full)
          else
            failed = failed + 1
            print("not ok - " .. full .. "\n  " .. e:gsub("\n", "\n  "))
          end
        end
      end
    end
  end
  print(("%d passed, %d failed"):format(passed, failed))
  return failed == 0 and 0 or 1
end

return testing
