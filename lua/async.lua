-- Tasks on coroutines: the only module that resumes coroutines.
--
-- C primitives stay callback-shaped (they call back exactly once, from the loop);
-- async.await turns one of them into a straight-line call inside a task. A pending
-- operation belongs to its task: async.cancel(task) cancels the operation and raises
-- async.CANCELLED inside the task, so the error unwinds the task's stack and every
-- `<close>` handler runs (and may itself await, e.g. to remove a container).
local log = require("demesne.log")
local loop = require("core.loop")
local timer = require("core.timer")

local async = {}

--- The error value raised inside a cancelled task. tostring() gives "cancelled".
async.CANCELLED = setmetatable({}, { __tostring = function() return "cancelled" end, __name = "cancelled" })

local CANCEL = {} -- resume token meaning "your operation was cancelled"
local current = nil

---@class Task
---@field name string
---@field done boolean
---@field cancelled boolean   true once async.cancel was called
---@field cancel_reason string|nil
---@field result table|nil    table.pack(ok, ...) once done (pcall-style)
local Task = {}
Task.__index = Task

local function finish(task, ...)
  task.done = true
  task.result = table.pack(...)
  local waiters = task.waiters
  task.waiters = {}
  for _, w in ipairs(waiters) do w(task) end
end

local function step(task, ...)
  local prev = current
  current = task
  local ok, err = coroutine.resume(task.co, ...)
  current = prev
  if not ok then
    -- cannot happen: the body runs under pcall; keep the loop alive regardless
    io.stderr:write("demesne: task ", task.name, " crashed: ", tostring(err), "\n")
    if not task.done then finish(task, false, err) end
  end
end

--- Starts `fn(...)` in a new task. It runs at once until its first await.
---@param name string  shown in logs
---@param fn function
---@param ... any  fn's arguments
---@return Task
function async.spawn(name, fn, ...)
  local task = setmetatable({ name = name, done = false, cancelled = false, waiters = {} }, Task)
  local args = table.pack(...)
  task.co = coroutine.create(function()
    finish(task, xpcall(fn, function(e)
      if e == async.CANCELLED then return e end
      if type(e) == "table" then return e end
      return debug.traceback(tostring(e), 2)
    end, table.unpack(args, 1, args.n)))
  end)
  step(task)
  return task
end

--- Runs `fn(...)` in a new task and drives the event loop until that task ends: the one
--- way a command (lua/cmd/*.lua) that is not a server runs its work. Called outside any
--- task, from the command's entry function; the loop is stopped as soon as the task ends,
--- even if other handles (a removal after the answer, a timer) are still open.
--- Returns the task's pcall-style results: true and fn's results, or false and the error
--- (a table error as raised, another with its traceback); false and a message when the
--- loop ran out of work before the task ended.
---@param name string  the task's name, shown in logs
---@param fn function
---@param ... any  fn's arguments
---@return boolean ok, any ...
function async.main(name, fn, ...)
  local task = async.spawn(name, fn, ...)
  if not task.done then
    task:on_done(function() loop.stop() end)
    loop.run()
  end
  if not task.done then return false, "the event loop ran out of work before " .. name .. " ended" end
  return table.unpack(task.result, 1, task.result.n)
end

--- The running task, or nil outside a task.
---@return Task|nil
function async.current() return current end

--- Runs an operation and waits for its callback inside the current task.
--- `start(callback)` begins the operation and may return a function that cancels it.
--- Returns whatever the operation passed to its callback.
--- Raises async.CANCELLED if the task is cancelled while waiting (the operation's cancel
--- function is called first and its callback is then ignored).
---@param start fun(cb: function): function|nil
---@return any ...  what the operation passed to its callback
function async.await(start)
  local task = current
  assert(task, "async.await called outside a task")
  if task.cancelled and not task.cancel_delivered then
    task.cancel_delivered = true
    error(async.CANCELLED, 0)
  end
  local state = { done = false, waiting = false }
  local function cb(...)
    if state.done then return end
    state.done = true
    state.results = table.pack(...)
    if state.waiting then step(task) end
  end
  local cancel = start(cb)
  if state.done then return table.unpack(state.results, 1, state.results.n) end
  state.waiting = true
  task.pending = function()
    state.done = true
    if cancel then cancel() end
  end
  local token = coroutine.yield()
  task.pending = nil
  if token == CANCEL then
    task.cancel_delivered = true
    error(async.CANCELLED, 0)
  end
  return table.unpack(state.results, 1, state.results.n)
end

--- Cancels a task: its pending operation is cancelled and async.CANCELLED is raised in it
--- once. Cleanup that runs afterwards (close handlers) may await normally.
--- Cancelling a finished task does nothing.
---@param task Task
---@param reason string|nil
function async.cancel(task, reason)
  if task.done or task.cancelled then return end
  task.cancelled = true
  task.cancel_reason = reason
  if task.pending and task ~= current then
    local pending = task.pending
    task.pending = nil
    pending()
    step(task, CANCEL)
  end
end

--- Waits for another task to finish; returns its pcall-style results (ok, ...).
---@return boolean ok, any ...
function Task:wait()
  if not self.done then
    async.await(function(cb)
      self.waiters[#self.waiters + 1] = cb
      return function()
        for i, w in ipairs(self.waiters) do
          if w == cb then table.remove(self.waiters, i) break end
        end
      end
    end)
  end
  return table.unpack(self.result, 1, self.result.n)
end

--- Calls fn(task) when the task finishes (at once if it has).
---@param fn fun(task: Task)
function Task:on_done(fn)
  if self.done then fn(self) else self.waiters[#self.waiters + 1] = fn end
end

--- Sleeps for `ms` milliseconds inside the current task.
---@param ms integer
function async.sleep(ms)
  async.await(function(cb)
    local t = timer.after(ms, cb)
    return function() t:close() end
  end)
end

--- Runs fn(...) in a child task with a deadline of `ms` milliseconds.
--- Returns fn's results, or nil, "timed out after N ms", "ETIMEDOUT" when the deadline
--- passes (the child is cancelled and its cleanup has finished by then). An error in fn
--- is re-raised. Cancelling the caller cancels the child.
---@param ms integer
---@param fn function
---@param ... any  fn's arguments
---@return any ...  fn's results, or nil, "timed out after N ms", "ETIMEDOUT"
function async.timeout(ms, fn, ...)
  local child = async.spawn("timeout", fn, ...)
  local timed_out = false
  if not child.done then
    local t
    local ok, err = pcall(async.await, function(cb)
      t = timer.after(ms, function() timed_out = true; cb() end)
      child:on_done(function() cb() end)
      return function() t:close() end
    end)
    if t then t:close() end -- the child may finish first: the timer must not outlive the call
    if not ok then
      async.cancel(child, "caller cancelled")
      if not child.done then pcall(child.wait, child) end
      error(err, 0)
    end
    if timed_out and not child.done then
      async.cancel(child, "timed out")
      child:wait()
    end
  end
  local r = child.result
  if timed_out and (r[1] == false and r[2] == async.CANCELLED) then
    return nil, ("timed out after %d ms"):format(ms), "ETIMEDOUT"
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- Runs `fn()` at once and then every `interval_ms` milliseconds, in a new task named
--- `name`: the loop of a server's long-running part (the reaper, the jobs' and the trees'
--- sweeps) that takes up what a previous server left, then sweeps. `opts.first`, when
--- given, runs instead of `fn` on the first pass (a resume that differs from the sweep).
--- `interval_ms` is milliseconds, or a function that answers them, read before each sleep
--- (so a changed reap_interval is seen at the next sweep); it is floored to an integer.
--- An error in a pass is logged as a warning under `opts.logger` (default "demesne.async")
--- and the loop goes on at the next interval; async.CANCELLED (async.cancel on the
--- returned task, in a pass or in the sleep) ends it.
---@param name string  the task's name, shown in logs
---@param interval_ms number|fun(): number  milliseconds between the end of a pass and the next
---@param fn fun()  one pass; may await
---@param opts {logger: string|nil, first: fun()|nil}|nil
---@return Task
function async.every(name, interval_ms, fn, opts)
  opts = opts or {}
  local logger = opts.logger or "demesne.async"
  return async.spawn(name, function()
    local pass = opts.first or fn
    while true do
      local ok, err = pcall(pass)
      if err == async.CANCELLED then return end
      if not ok then log.warning(logger, "%s", tostring(err)) end
      pass = fn
      local ms = type(interval_ms) == "function" and interval_ms() or interval_ms
      async.sleep(math.floor(ms))
    end
  end)
end

--- A one-shot event: wait() blocks the current task until set(...) is called; later
--- waits return the same values at once.
---@return {set: fun(...), wait: fun(): any, is_set: fun(): boolean}
function async.event()
  local ev = { fired = false, waiters = {} }
  function ev.set(...)
    if ev.fired then return end
    ev.fired = true
    ev.values = table.pack(...)
    local ws = ev.waiters
    ev.waiters = {}
    for _, w in ipairs(ws) do w() end
  end
  function ev.is_set() return ev.fired end
  function ev.wait()
    if not ev.fired then
      async.await(function(cb)
        ev.waiters[#ev.waiters + 1] = cb
        return function()
          for i, w in ipairs(ev.waiters) do
            if w == cb then table.remove(ev.waiters, i) break end
          end
        end
      end)
    end
    return table.unpack(ev.values, 1, ev.values.n)
  end
  return ev
end

--- Wraps a callback-style core function whose last argument is the callback and which
--- returns a handle (with :cancel() or :close()) or nil, msg, code on synchronous failure.
--- The wrapped function awaits the callback and returns its arguments.
---@param fn function
---@return function
function async.wrap(fn)
  return function(...)
    local args = table.pack(...)
    local sync_err
    local res = table.pack(async.await(function(cb)
      args[args.n + 1] = cb
      local h, msg, code = fn(table.unpack(args, 1, args.n + 1))
      if h == nil and msg ~= nil then
        sync_err = { msg, code }
        cb()
        return nil
      end
      if type(h) == "userdata" or type(h) == "table" then
        return function()
          if h.cancel then h:cancel() elseif h.close then h:close() end
        end
      end
    end))
    if sync_err then return nil, sync_err[1], sync_err[2] end
    return table.unpack(res, 1, res.n)
  end
end

return async
