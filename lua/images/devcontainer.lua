-- The repository's own environment: `image: "devcontainer"` with `repository` or a
-- `directories` entry that holds .devcontainer/devcontainer.json (or .devcontainer.json).
-- demesne reads the file (JSON with comments: lua/images/jsonc.lua), builds what it
-- describes (`image`, or `build.dockerfile` with `context`, `args`, `target`) through the
-- engine's build path, adds its own layer on top (USER root, and for an agent run the
-- agent's CLI copied from demesne's agent image), and runs the sandbox in it:
-- containerEnv and remoteEnv become the sandbox's variables, the create commands
-- (onCreateCommand, updateContentCommand, postCreateCommand, postStartCommand) run inside
-- the sandbox when it is created, with its egress; forwardPorts become previews of a
-- persistent sandbox. docs/how-to/use-a-devcontainer.md says it for users.
--
-- Trust: the repository (or folder) is the host's input, but what its devcontainer.json
-- says is the repository's: it names no host path outside that folder (a link, an
-- absolute path or a `..` out of it is refused), runs nothing on the host, widens no
-- privilege of the sandbox (the fields that would are refused by name), and its build gets
-- no network (devcontainer_build_network; on an engine that ignores a build's "none",
-- probed by build_network_isolated, RUN is refused unless it says "host") and no URL the
-- engine would fetch on the host.
local async = require("demesne.async")
local config = require("demesne.config")
local errors = require("demesne.errors")
local features = require("demesne.images.features")
local fs = require("core.fs")
local images = require("demesne.images")
local json = require("demesne.json")
local jsonc = require("demesne.images.jsonc")
local log = require("demesne.log")
local loop = require("core.loop")
local paths = require("demesne.paths")
local stream = require("core.stream")
local util = require("demesne.util")

local devcontainer = {}

local fail = errors.raise

--- The image name that asks for the repository's devcontainer.
devcontainer.IMAGE = "devcontainer"
--- Where the file is looked for, in order, relative to the repository (or folder).
devcontainer.FILES = { ".devcontainer/devcontainer.json", ".devcontainer.json" }
--- The label that says which folder a devcontainer image was built from.
devcontainer.SOURCE_LABEL = "io.demesne.devcontainer.source"
--- The origin label value of devcontainer images (io.demesne.origin).
devcontainer.ORIGIN = "devcontainer"
--- Where the create commands write their output, in the sandbox.
devcontainer.LOG = "/out/devcontainer.log"

--- Fields that cannot work in a sandbox, each with the reason it is refused.
devcontainer.REFUSED = {
  mounts = "a mount would bring host paths into the sandbox; demesne mounts only /in, /out and /workspace",
  workspaceMount = "a mount would bring host paths into the sandbox; the repository comes in as a clone",
  runArgs = "engine command-line arguments would go around demesne's sandbox settings",
  privileged = "a privileged container is no sandbox",
  capAdd = "demesne grants a sandbox no extra capability",
  securityOpt = "a sandbox's security options are demesne's own",
  initializeCommand = "it runs on the host, and nothing a repository says runs on the host",
  dockerComposeFile = "a Docker Compose setup is several containers; a sandbox is one (use image or build)",
  appPort = "a published port would listen on the host's network; use forwardPorts (previews on loopback)",
}

--- The create commands, in the order the devcontainer.json reference runs them.
devcontainer.STEPS = { "onCreateCommand", "updateContentCommand", "postCreateCommand", "postStartCommand" }

-- Fields read and used; any other field is left alone (customizations, name, remoteUser…).
local BUILD_FIELDS = { dockerfile = true, context = true, args = true, target = true, cacheFrom = true }


-- The Dockerfile name in the build context (the repository's own is sent under its name too).
local DOCKERFILE = ".demesne-devcontainer.Dockerfile"

-- Steps waiting for a persistent sandbox to run them (sandbox id -> script).
local pending = {}

local function field_fail(where, field, why)
  fail(("image: devcontainer: %s: %s: %s"):format(where, field, why))
end

-- A string field's value: non-empty, naming nothing of the host's (${localEnv…}).
local function str(where, v, field)
  if type(v) ~= "string" or v == "" then field_fail(where, field, "must be a non-empty string") end
  if v:find("${localEnv:", 1, true) or v:find("${localWorkspaceFolder", 1, true) then
    field_fail(where, field, "names the host's environment or folders (${localEnv…}/${localWorkspaceFolder…}), "
      .. "which a sandbox never sees")
  end
  return v
end

-- `build`: {dockerfile, context, args, target}, checked into out.build (and out.notes).
local function parse_build(where, b, out)
  if type(b) ~= "table" then field_fail(where, "build", "must be an object") end
  for k in pairs(b) do
    if not BUILD_FIELDS[k] then
      field_fail(where, "build." .. tostring(k), k == "options" and "refused: engine build options would go around "
        .. "demesne's build settings" or "is not a build field demesne knows (dockerfile, context, args, target)")
    end
  end
  if b.dockerfile == nil then field_fail(where, "build.dockerfile", "is missing (the Dockerfile to build)") end
  out.build = { dockerfile = str(where, b.dockerfile, "build.dockerfile"), context = b.context ~= nil
    and str(where, b.context, "build.context") or ".", args = {} }
  if b.target ~= nil then out.build.target = str(where, b.target, "build.target") end
  if b.args ~= nil then
    if type(b.args) ~= "table" or b.args[1] ~= nil then field_fail(where, "build.args", "must be an object") end
    for k, v in pairs(b.args) do
      if type(k) ~= "string" or not k:match("^[%a_][%w_]*$") then
        field_fail(where, "build.args", ("%q is not a build argument name"):format(tostring(k)))
      end
      if k:upper():sub(1, 9) == "BUILDKIT_" then
        field_fail(where, "build.args." .. k, "refused: a BUILDKIT_* argument sets the builder itself "
          .. "(BUILDKIT_SYNTAX makes it pull and run a parser image)")
      end
      out.build.args[k] = str(where, v, "build.args." .. k)
    end
  end
  if b.cacheFrom ~= nil then out.notes[#out.notes + 1] = "build.cacheFrom is not used: the engine's own cache is" end
end

-- containerEnv, then remoteEnv over it, into out.env.
local function parse_env(where, cfg, out)
  for _, f in ipairs({ "containerEnv", "remoteEnv" }) do
    local env = cfg[f]
    if env ~= nil then
      if type(env) ~= "table" or env[1] ~= nil then field_fail(where, f, "must be an object of strings") end
      local keys = {}
      for k in pairs(env) do keys[#keys + 1] = k end
      table.sort(keys)
      for _, k in ipairs(keys) do
        local v = env[k]
        if type(k) ~= "string" or not k:match("^[%a_][%w_]*$") then
          field_fail(where, f, ("%q is not a variable name"):format(tostring(k)))
        end
        if features.reserved_var(k) then
          field_fail(where, f .. "." .. k, "is demesne's to set (DEMESNE_* and the proxy variables of the egress)")
        end
        if v ~= nil and type(v) ~= "string" then field_fail(where, f .. "." .. k, "must be a string") end
        if v ~= nil then
          if v:find("${localEnv:", 1, true) or v:find("${localWorkspaceFolder", 1, true) then str(where, v, f .. "." .. k) end
          out.env[k] = v
        end
      end
    end
  end
end

-- A command's argv form: a non-empty list of strings.
local function argv_of(where, list, field)
  if #list == 0 then field_fail(where, field, "an empty command") end
  for i, a in ipairs(list) do
    if type(a) ~= "string" then field_fail(where, ("%s[%d]"):format(field, i - 1), "must be a string") end
  end
  local n = 0
  for _ in pairs(list) do n = n + 1 end
  if n ~= #list then field_fail(where, field, "must be a list of strings") end
  return list
end

-- The create commands (devcontainer.STEPS), in order, into out.steps.
local function parse_steps(where, cfg, out)
  for _, f in ipairs(devcontainer.STEPS) do
    local c = cfg[f]
    if c ~= nil then
      if type(c) == "string" then
        if c:find("%S") then out.steps[#out.steps + 1] = { field = f, cmd = c } end
      elseif type(c) == "table" and c[1] ~= nil then
        out.steps[#out.steps + 1] = { field = f, cmd = argv_of(where, c, f) }
      elseif type(c) == "table" then
        local par, keys = {}, {}
        for k in pairs(c) do keys[#keys + 1] = k end
        table.sort(keys)
        for _, k in ipairs(keys) do
          local v = c[k]
          if type(v) == "string" then par[#par + 1] = { name = k, cmd = v }
          elseif type(v) == "table" then par[#par + 1] = { name = k, cmd = argv_of(where, v, f .. "." .. k) }
          else field_fail(where, f .. "." .. k, "must be a string or a list of strings") end
        end
        if #par > 0 then out.steps[#out.steps + 1] = { field = f, parallel = par } end
      else
        field_fail(where, f, "must be a string, a list of strings or an object of them")
      end
    end
  end
end

-- forwardPorts into out.ports.
local function parse_ports(where, ports, out)
  if type(ports) ~= "table" then field_fail(where, "forwardPorts", "must be a list") end
  for i, p in ipairs(ports) do
    local n = math.tointeger(p) or (type(p) == "string" and math.tointeger(tonumber(p:match("^localhost:(%d+)$")
      or p:match("^127%.0%.0%.1:(%d+)$") or "")))
    if not n or n < 1 or n > 65535 then
      field_fail(where, ("forwardPorts[%d]"):format(i - 1), ("%s is not a port of the sandbox (1-65535, or "
        .. "\"localhost:N\"); a sandbox forwards only its own ports"):format(tostring(p)))
    end
    out.ports[#out.ports + 1] = n
  end
end

--- Reads the JSON-with-comments text of a devcontainer.json and checks it. `where` names
--- the file in messages. Returns the plan's part that needs no engine:
--- {image = ref | nil, build = {dockerfile, context, args, target} | nil (paths relative to
--- the file's folder, as written), env = {name = value} (containerEnv, then remoteEnv over
--- it), steps = {{field, cmd}} (cmd: a string, an argv list, or {name = string|argv}),
--- ports = {integer}, features = (features.parse's list) | nil, notes = {string}}. Fails
--- naming the field and the reason.
---@param text string
---@param where string
---@return table
function devcontainer.parse(text, where)
  local cfg, err = jsonc.decode(text)
  if cfg == nil then fail(("image: devcontainer: %s is not valid JSON with comments: %s"):format(where, err)) end
  if type(cfg) ~= "table" or cfg[1] ~= nil then fail(("image: devcontainer: %s: must hold a JSON object"):format(where)) end
  local names = {}
  for k in pairs(cfg) do names[#names + 1] = tostring(k) end
  table.sort(names)
  for _, k in ipairs(names) do
    if devcontainer.REFUSED[k] then field_fail(where, k, "refused: " .. devcontainer.REFUSED[k]) end
  end
  local out = { env = {}, steps = {}, ports = {}, notes = {} }
  if cfg.image ~= nil and cfg.build ~= nil then field_fail(where, "image", "give image or build, not both") end
  if cfg.image ~= nil then
    out.image = str(where, cfg.image, "image")
    local ok, why = images.check_reference(out.image)
    if not ok then field_fail(where, "image", ("%q is not a valid image reference: it %s"):format(out.image, why)) end
  elseif cfg.build ~= nil then
    parse_build(where, cfg.build, out)
  else
    field_fail(where, "image", "the file names neither image nor build (a Dockerfile); one of them is needed")
  end
  parse_env(where, cfg, out)
  parse_steps(where, cfg, out)
  if cfg.forwardPorts ~= nil then parse_ports(where, cfg.forwardPorts, out) end
  if cfg.features ~= nil then
    out.features = features.parse(cfg.features, where)
    if #out.features == 0 then out.features = nil end
  end
  if cfg.overrideFeatureInstallOrder ~= nil then
    out.notes[#out.notes + 1] = "overrideFeatureInstallOrder is not used: features install in the order their "
      .. "dependsOn and installsAfter give, else by id"
  end
  for _, k in ipairs({ "remoteUser", "containerUser" }) do
    if cfg[k] ~= nil then
      out.notes[#out.notes + 1] = k .. " is not used: a sandbox runs as root, as demesne's own images do"
    end
  end
  return out
end

-- A path of the devcontainer file (relative to the folder `root`, "/"-separated) joined
-- with `p` (relative to the file's folder `base`), normalised. Fails when it is absolute,
-- leaves the folder, or has a `.git` part (the repository's git folder holds its config,
-- with any credentials in its remote URLs: it never goes into an image).
local function join(where, field, base, p)
  if p:sub(1, 1) == "/" then
    field_fail(where, field, ("%s is an absolute path: it must be relative to the devcontainer file, inside the "
      .. "repository"):format(p))
  end
  for c in p:gmatch("[^/]+") do
    if c:lower() == ".git" then
      field_fail(where, field, ("%s goes through .git, refused: the git folder (its config may hold credentials) "
        .. "never goes into a build"):format(p))
    end
  end
  local parts = {}
  for c in (base .. "/" .. p):gmatch("[^/]+") do
    if c == ".." then
      if #parts == 0 then field_fail(where, field, ("%s leads out of the repository (..)"):format(p)) end
      parts[#parts] = nil
    elseif c ~= "." then
      parts[#parts + 1] = c
    end
  end
  return table.concat(parts, "/")
end

-- Checks that no part of `rel` under `root` is a link and that it is of `kind`; returns its
-- lstat, or fails naming the field.
local function walk_to(where, field, root, rel, kind)
  local at = root
  local st = fs.lstat(root)
  for c in rel:gmatch("[^/]+") do
    at = at .. "/" .. c
    st = fs.lstat(at)
    if not st then field_fail(where, field, ("%s does not exist in the repository"):format(rel)) end
    if st.type == "link" then
      field_fail(where, field, ("%s is (or passes through) the symbolic link %s, which demesne does not follow out "
        .. "of a devcontainer"):format(rel, at:sub(#root + 2)))
    end
  end
  if kind and (not st or st.type ~= kind) then
    field_fail(where, field, ("%s is not a %s"):format(rel == "" and "." or rel, kind == "file" and "regular file"
      or "folder"))
  end
  return st
end

--- Reads the folder `rel` under `root` into a build context list {name, data, mode}, sorted:
--- regular files and folders only (a link, FIFO, socket or device is refused by name); a
--- .git folder or file (a worktree's or submodule's) is left out at any depth; at most
--- images.USER_MAX_FILES files and USER_MAX_BYTES bytes. Fails naming build.context.
---@param where string  the devcontainer file, for messages
---@param root string  the repository (or folder)
---@param rel string  the folder, relative to root ("" for root itself)
---@param out table|nil  the list so far (recursion)
---@param total {bytes: integer}|nil  the bytes so far (recursion)
---@param prefix string|nil  the names' prefix in the context (recursion)
---@param field string|nil  the field messages name (default "build.context")
---@return {name: string, data: string, mode: integer}[]
local function read_context(where, root, rel, out, total, prefix, field)
  out, total, prefix, field = out or {}, total or { bytes = 0 }, prefix or "", field or "build.context"
  local dir = rel == "" and root or (root .. "/" .. rel)
  local names, err = fs.readdir(dir)
  if not names then field_fail(where, field, ("%s cannot be read: %s"):format(rel, tostring(err))) end
  for _, n in ipairs(names) do
    if n:lower() ~= ".git" then -- a .git folder or file is left out, whatever it is
      local r = rel == "" and n or (rel .. "/" .. n)
      local st = fs.lstat(root .. "/" .. r)
      if st and st.type == "directory" then
        read_context(where, root, r, out, total, prefix .. n .. "/", field)
      elseif st and st.type == "file" then
        if #out >= images.USER_MAX_FILES then
          field_fail(where, field, ("holds more than %d files"):format(images.USER_MAX_FILES))
        end
        total.bytes = total.bytes + st.size
        if total.bytes > images.USER_MAX_BYTES then
          field_fail(where, field, ("its files add up to more than %d MiB"):format(images.USER_MAX_BYTES // 1048576))
        end
        local f, ferr = fs.open_beneath(root, r)
        local data = f and f:read(st.size + 1)
        if f then f:close() end
        if not data then field_fail(where, field, ("%s cannot be read: %s"):format(r, tostring(ferr))) end
        out[#out + 1] = { name = prefix .. n, data = data, mode = st.mode & 511 }
      else
        field_fail(where, field, ("%s is a %s: a build context may hold only files and folders (a link is "
          .. "not followed)"):format(r, st and (st.type == "link" and "symbolic link" or st.type) or "missing file"))
      end
    end
  end
  return out
end

-- The parser directives a devcontainer's Dockerfile may carry: `escape` (honoured below)
-- and `check` (build checks: they change no step). `syntax` is refused: BuildKit would
-- pull the image it names and run it as the Dockerfile's parser.
local DIRECTIVES = { escape = true, check = true }

-- Splits a Dockerfile into its instructions as the engine's parser does:
-- {line = first line number, text}. The leading parser directives are read (an unknown one
-- and `syntax` are refused, `# escape=` sets the line-continuation character); a line
-- ending in the escape character goes on with the next (joined with no space, as the
-- engine joins them), and comment and empty lines inside a continued instruction are
-- skipped, as the engine skips them.
local function instructions(where, src)
  local out, cur, n = {}, nil, 0
  local esc, directives = "\\", true
  src = src:gsub("^\239\187\191", "")
  for line in (src .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    line = line:gsub("\r$", "")
    local comment = line:find("^%s*#") ~= nil
    if directives then
      local key, value = line:match("^%s*#%s*(%a%w*)%s*=%s*(.-)%s*$")
      if key then
        key = key:lower()
        if not DIRECTIVES[key] then
          fail(("image: devcontainer: %s line %d: the parser directive # %s= is refused: %s"):format(where, n, key,
            key == "syntax" and "it makes the engine pull the image it names and run it as the Dockerfile's parser"
            or "demesne reads only # escape= and # check= (the engine may honour one it does not know)"))
        end
        if key == "escape" then
          if value ~= "\\" and value ~= "`" then
            fail(("image: devcontainer: %s line %d: # escape=%s: the escape character is \\ or `"):format(where, n, value))
          end
          esc = value
        end
      else
        directives = false
      end
    end
    if comment and line:lower():find("^%s*#%s*syntax%s*=") then
      fail(("image: devcontainer: %s line %d: a # syntax= line is refused: it makes BuildKit pull the image it "
        .. "names and run it as the Dockerfile's parser"):format(where, n))
    end
    if not comment and line:find("%S") then
      local text, more = line:gsub("%" .. esc .. "%s*$", "")
      if cur then cur.text = cur.text .. text else cur = { line = n, text = text } end
      if more == 0 then
        out[#out + 1] = cur
        cur = nil
      end
    end
  end
  if cur then out[#out + 1] = cur end
  return out
end

--- The build context list of the folder `rel` under `root` (for tests: read_context).
devcontainer._read_context = read_context

--- Checks a devcontainer's Dockerfile for what would reach past the build's sandbox: an
--- ADD of a URL, a git source or a $variable (the engine fetches a URL on the host,
--- outside any egress policy), ONBUILD (it would run in demesne's layer), a parser
--- directive other than escape and check (syntax pulls a parser image), RUN --network or --security (BuildKit flags that give a step the host's
--- network or privileges), RUN --mount of any type (a mount reaches host paths outside
--- the context). Fails naming the line.
--- Returns the line of its first RUN instruction (nil when it has none).
---@param where string  the Dockerfile's path, for messages
---@param src string
---@return integer|nil first_run
function devcontainer.check_dockerfile(where, src)
  local first_run
  for _, ins in ipairs(instructions(where, src)) do
    local word, rest = ins.text:match("^%s*(%a+)%s+(.*)$")
    word = word and word:upper()
    if word == "ONBUILD" then
      fail(("image: devcontainer: %s line %d: ONBUILD is refused: its instruction would run when demesne builds "
        .. "its own layer on the image, outside these checks"):format(where, ins.line))
    end
    if word == "ADD" and (rest:find("%a[%w+.-]*://") or rest:find("git@", 1, true) or rest:find("$", 1, true)) then
      fail(("image: devcontainer: %s line %d: ADD of a URL or git source (or of a $variable, which may hold one) "
        .. "is refused: the engine would fetch it on the host, outside the sandbox's egress (download it in a RUN "
        .. "step of a build with network, or put the file in the repository and COPY it)"):format(where, ins.line))
    end
    if word == "RUN" and (rest:find("%-%-network") or rest:find("%-%-security")) then
      fail(("image: devcontainer: %s line %d: RUN --network and --security are refused: a build step gets no more "
        .. "than the build's own settings"):format(where, ins.line))
    end
    -- Any type: a cache mount's id is a host path on Podman 4.3 (CVE-2024-9675, `id=../..`
    -- reads and writes any host path as root), a bind or secret mount reaches past the context.
    if word == "RUN" and rest:lower():find("%-%-mount") then
      fail(("image: devcontainer: %s line %d: RUN --mount is refused (any type): a mount can reach host paths "
        .. "outside the build context (a cache mount's id does on Podman 4.3, CVE-2024-9675); copy what the step "
        .. "needs from the context instead"):format(where, ins.line))
    end
    if word == "RUN" then first_run = first_run or ins.line end
  end
  return first_run
end

--- The shell script that runs the create steps (devcontainer.parse's steps) in `workdir`,
--- their output appended to devcontainer.LOG; a step that fails ends the script with its
--- exit code and the log's tail on stderr. Parallel commands (the object form) run at once,
--- and all must succeed.
---@param steps table[]
---@param workdir string
---@return string
function devcontainer.script(steps, workdir)
  local q = util.sh_quote
  local function cmdline(cmd)
    if type(cmd) == "string" then return "/bin/sh -c " .. q(cmd) end
    local w = {}
    for _, a in ipairs(cmd) do w[#w + 1] = q(a) end
    return table.concat(w, " ")
  end
  local lines = {
    "dc_fail() { printf 'demesne: devcontainer.json %s failed (exit %s); the end of " .. devcontainer.LOG
      .. ":\\n' \"$1\" \"$2\" >&2; tail -n 20 " .. devcontainer.LOG .. " >&2; exit \"$2\"; }",
    "cd " .. q(workdir) .. " || { echo 'demesne: devcontainer: no folder " .. workdir:gsub("'", "") .. "' >&2; exit 125; }",
  }
  for _, s in ipairs(steps) do
    lines[#lines + 1] = ("echo %s >> %s"):format(q("== " .. s.field), devcontainer.LOG)
    if s.parallel then
      local waits = {}
      for i, p in ipairs(s.parallel) do
        lines[#lines + 1] = ("%s >> %s 2>&1 < /dev/null & dc_p%d=$!"):format(cmdline(p.cmd), devcontainer.LOG, i)
        waits[#waits + 1] = ("wait $dc_p%d || dc_fail %s $?"):format(i, q(s.field .. "." .. p.name))
      end
      for _, w in ipairs(waits) do lines[#lines + 1] = w end
    else
      lines[#lines + 1] = ("%s >> %s 2>&1 < /dev/null || dc_fail %s $?"):format(cmdline(s.cmd), devcontainer.LOG,
        q(s.field))
    end
  end
  return table.concat(lines, "\n") .. "\n"
end

-- The folder holding a devcontainer file among the plan's inputs: the repository's work
-- tree, else the one `directories` entry that holds one. Returns root, rel (the file), field.
local function find_source(o, args)
  local function has(root)
    for _, rel in ipairs(devcontainer.FILES) do
      local st = fs.lstat(root .. "/" .. rel)
      if st then return rel end
    end
  end
  if args.repository ~= nil then
    if not (o.repo and o.repo.host) then
      fail("image: devcontainer: a sandbox's own repository (a child's) has no devcontainer of the host's to build")
    end
    local rel = has(o.repo.host)
    if not rel then
      fail(("image: devcontainer: the repository %s holds neither %s"):format(o.repo.host,
        table.concat(devcontainer.FILES, " nor ")))
    end
    return o.repo.host, rel, "repository"
  end
  local found = {}
  for _, m in ipairs(o.mounts or {}) do
    if m.kind == "directory" then
      local rel = has(m.host)
      if rel then found[#found + 1] = { root = m.host, rel = rel, field = m.field } end
    end
  end
  if #found == 0 then
    fail("image: devcontainer needs repository, or a directories entry holding " .. table.concat(devcontainer.FILES,
      " or ") .. ((#(o.mounts or {}) > 0) and "; none of the directories given holds one" or ""))
  end
  if #found > 1 then
    fail(("image: devcontainer: %s and %s both hold a devcontainer file; give one"):format(found[1].field, found[2].field))
  end
  for _, name in ipairs({ "output_root", "state_dir" }) do
    local r = fs.realpath(config.get(name))
    if r and paths.within(found[1].root, r) then
      fail(("%s: %s is inside demesne's %s, which sandboxes write: a devcontainer is not built from there"):format(
        found[1].field, found[1].root, name))
    end
  end
  return found[1].root, found[1].rel, found[1].field
end

--- Plans a sandbox in the repository's devcontainer (call it after repo.prepare, before
--- anything is made): finds and reads the devcontainer file (find_source), checks it and
--- its build's paths (no link, nothing outside the folder, the Dockerfile there), adds its
--- variables to o.env (the caller's own win), and — unless opts.persistent — wraps the
--- plan's command so that the create steps run first. Sets o.devcontainer = {root, file,
--- field, cfg (devcontainer.parse), workdir, agent (opts.agent: the provider's image),
--- script (or nil)}. Fails naming the field.
---@param o table  the plan (sandbox.prepare, agent.prepare), with mounts, env, argv or command
---@param args table  the call's arguments (repository, directories, env)
---@param opts {agent: string|nil, persistent: boolean|nil}|nil
---@return table o.devcontainer
function devcontainer.plan(o, args, opts)
  opts = opts or {}
  local root, rel, field = find_source(o, args)
  local where = rel
  walk_to(where, "image", root, rel, "file")
  local f, err = fs.open_beneath(root, rel)
  local text = f and f:read(jsonc.MAX_BYTES + 1)
  if f then f:close() end
  if not text then fail(("image: devcontainer: %s cannot be read: %s"):format(rel, tostring(err))) end
  local cfg = devcontainer.parse(text, where)
  local base = rel:match("^(.*)/[^/]*$") or ""
  if cfg.build then
    local b = cfg.build
    b.context_rel = join(where, "build.context", base, b.context)
    walk_to(where, "build.context", root, b.context_rel, "directory")
    b.dockerfile_rel = join(where, "build.dockerfile", base, b.dockerfile)
    if not fs.lstat(root .. "/" .. b.dockerfile_rel) then
      field_fail(where, "build.dockerfile", ("%s does not exist in the repository"):format(b.dockerfile_rel))
    end
    local st = walk_to(where, "build.dockerfile", root, b.dockerfile_rel, "file")
    local df = fs.open_beneath(root, b.dockerfile_rel)
    b.dockerfile_text = df and df:read(st.size + 1)
    if df then df:close() end
    if not b.dockerfile_text then field_fail(where, "build.dockerfile", b.dockerfile_rel .. " cannot be read") end
    b.first_run = devcontainer.check_dockerfile(b.dockerfile_rel, b.dockerfile_text)
  end
  for _, ft in ipairs(cfg.features or {}) do
    if ft.kind == "local" then
      ft.rel = join(where, "features." .. ft.id, base, ft.id)
      walk_to(where, "features." .. ft.id, root, ft.rel, "directory")
    end
  end
  local workdir = o.repo and o.repo.path or "/workspace"
  for k, v in pairs(cfg.env) do
    cfg.env[k] = v:gsub("%${containerWorkspaceFolder}", workdir)
  end
  o.devcontainer = { root = root, file = rel, field = field, cfg = cfg, workdir = workdir, agent = opts.agent,
    caller_env = args.env or {} }
  if #cfg.steps > 0 then o.devcontainer.script = devcontainer.script(cfg.steps, workdir) end
  devcontainer.add_env(o)
  if o.devcontainer.script and not opts.persistent then
    -- the steps, then the command (a repository run: inside run.sh, in the clone)
    local inner, keep = o.argv or { "/bin/sh", "-c", o.command }, 0
    if o.repo then keep = 2 end -- { "/bin/sh", "/.demesne/repo/run.sh", … }
    local argv = {}
    for i = 1, keep do argv[i] = inner[i] end
    argv[#argv + 1] = "/bin/sh"
    argv[#argv + 1] = "-c"
    argv[#argv + 1] = o.devcontainer.script .. 'exec "$@"\n'
    argv[#argv + 1] = "devcontainer"
    for i = keep + 1, #inner do argv[#argv + 1] = inner[i] end
    o.argv = argv
  end
  for _, n in ipairs(cfg.notes) do log.info("demesne.images", "devcontainer %s/%s: %s", root, rel, n) end
  return o.devcontainer
end

--- Adds the devcontainer's variables to the plan's environment list (o.env, "K=V"
--- strings), under the caller's own: containerEnv and remoteEnv (`${containerEnv:NAME}`
--- in them is the value the image or containerEnv gives NAME), and the image's PATH once it
--- is known (devcontainer.ensure), unless the caller or the file sets PATH.
---@param o table  a plan with o.devcontainer
function devcontainer.add_env(o)
  local dc = o.devcontainer
  if not dc or not o.env then return end
  local image_env = dc.image_env or {}
  local vars = {}
  for k, v in pairs(dc.cfg.env) do
    vars[k] = v:gsub("%${containerEnv:([%w_]+)}", function(n) return dc.cfg.env[n] or image_env[n] or "" end)
  end
  if not vars.PATH and image_env.PATH then vars.PATH = image_env.PATH end
  for k in pairs(dc.caller_env) do vars[k] = nil end
  local keep = {}
  for _, kv in ipairs(o.env) do
    if not vars[kv:match("^([^=]*)")] then keep[#keep + 1] = kv end
  end
  local names = {}
  for k in pairs(vars) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do keep[#keep + 1] = k .. "=" .. vars[k] end
  for i = 1, math.max(#o.env, #keep) do o.env[i] = keep[i] end
end

-- The files demesne adds to put an agent's CLI into a devcontainer image, by the provider's
-- image: paths copied from the agent image, and a start script at /usr/local/bin/<cli>.
local AGENT_LAYERS = {
  ["agent-claude_code"] = {
    copy = { { "/usr/local/lib/node_modules/@anthropic-ai/claude-code",
      "/usr/local/lib/node_modules/@anthropic-ai/claude-code" } },
    cli = "claude",
    start = '#!/bin/sh\nexec /usr/local/lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe "$@"\n',
  },
  ["agent-codex"] = {
    -- the native binary (static, musl) without its node wrapper: a devcontainer need not have node
    copy = { { "/usr/local/lib/node_modules/@openai/codex/node_modules/@openai/codex-linux-x64/vendor", "/opt/demesne/codex" } },
    cli = "codex",
    start = "#!/bin/sh\nfor d in /opt/demesne/codex/*/; do :; done\n"
      .. 'PATH="${d}codex-path:$PATH" CODEX_MANAGED_BY_NPM=1 exec "${d}bin/codex" "$@"\n',
  },
}

-- The demesne layer's Containerfile (and the start script of an agent CLI, and the
-- image's PATH kept for login shells: Debian's /etc/profile sets PATH anew, so `bash -lc`,
-- which Codex runs its commands with, would lose what the devcontainer's ENV put there).
local function layer_files(agent, image_path)
  local lines = { "ARG BASE" }
  local files = {}
  local spec = agent and AGENT_LAYERS[agent]
  if spec then
    lines[#lines + 1] = "ARG AGENT"
    lines[#lines + 1] = "FROM ${AGENT} AS agent"
  end
  lines[#lines + 1] = "FROM ${BASE}"
  lines[#lines + 1] = "USER root"
  if spec then
    for _, c in ipairs(spec.copy) do lines[#lines + 1] = ("COPY --from=agent %s %s"):format(c[1], c[2]) end
    lines[#lines + 1] = ("COPY demesne-%s /usr/local/bin/%s"):format(spec.cli, spec.cli)
    files[#files + 1] = { name = "demesne-" .. spec.cli, data = spec.start, mode = 493 }
  end
  if image_path and not image_path:find("[%z\n]") then
    lines[#lines + 1] = "COPY demesne-path.sh /etc/profile.d/zz-demesne-devcontainer-path.sh"
    files[#files + 1] = { name = "demesne-path.sh", mode = 420, data = "# demesne: the image's own PATH (its ENV), "
      .. "which /etc/profile sets anew for a login shell\nexport PATH=" .. util.sh_quote(image_path) .. "\n" }
  end
  files[#files + 1] = { name = "Containerfile", data = table.concat(lines, "\n") .. "\n", mode = 420 }
  return files
end

-- A short name for the image of a source folder: devcontainer-<basename>.
local function slug(root)
  local s = (root:match("([^/]+)$") or "repo"):lower():gsub("[^a-z0-9_.-]", "-"):gsub("^[^a-z0-9]+", "")
  if s == "" then s = "repo" end
  return "devcontainer-" .. s:sub(1, 40)
end

-- What the build-network probe found, by engine socket: {isolated, reason}; and the probes
-- running (socket -> event), which a second caller joins.
local isolation, probing = {}, {}

-- The probe's Containerfile: a step that fails (saying why, on a "demesne-probe:" line)
-- when it reaches the listener on the host's 127.0.0.1:`port`, or sees a network interface
-- other than lo; `nonce` keeps the engine from taking the step from its cache.
local function probe_files(port, nonce)
  local run = table.concat({
    ("RUN if command -v bash >/dev/null && bash -c 'exec 3<>/dev/tcp/127.0.0.1/%d' 2>/dev/null; then"):format(port),
    ("echo 'demesne-probe: a build step reached a listener on the host'\\''s 127.0.0.1:%d'; exit 4; fi;"):format(port),
    "ifs=''; while IFS=: read -r n rest; do n=$(echo $n); case \"$n\" in *'|'*|lo|'') ;; *) ifs=\"$ifs $n\";; esac;"
      .. " done < /proc/net/dev;",
    "if [ -n \"$ifs\" ]; then echo \"demesne-probe: a build step sees the network interfaces$ifs\"; exit 3; fi;",
    "command -v bash >/dev/null || { echo 'demesne-probe: the base image has no bash to try a connection'; exit 5; };",
    "echo demesne-probe: isolated " .. nonce,
  }, " ")
  return { { name = "Containerfile", data = "ARG BASE\nFROM ${BASE}\n" .. run .. "\n", mode = 420 } }
end

--- Whether the engine keeps a build step off the network when a build asks for none
--- (networkmode=none): Docker does; Podman 4.3 ignores it and runs the steps in the
--- host's network. The probe, once per engine (its socket) per server, the answer cached:
--- demesne listens on the host's 127.0.0.1 (a random port) and builds, FROM demesne's base
--- image with network none, one step that fails if it sees a network interface other than
--- lo or reaches that listener; the probe image is removed. The engine isolates builds only
--- when the step ran and saw neither; a probe that cannot tell (no base image, a build that
--- fails for another reason) counts as no isolation. Returns isolated, and the reason when
--- not (for messages: "a build step reached a listener on the host's 127.0.0.1:N").
---@param eng table  the engine adapter
---@param ctx ToolContext|nil  build progress
---@return boolean isolated, string|nil reason
function devcontainer.build_network_isolated(eng, ctx)
  local key = eng.socket or tostring(eng)
  while probing[key] do probing[key].wait() end
  if isolation[key] then return isolation[key].isolated, isolation[key].reason end
  local ev = async.event()
  probing[key] = ev
  local _ <close> = util.closer(function() probing[key] = nil; ev.set() end)
  local reached = false
  local listener, port = stream.listen_tcp("127.0.0.1", 0, function(c)
    reached = true
    c:close()
  end)
  local isolated, reason = false, nil
  if not listener then
    reason = "the probe could not listen on the host's 127.0.0.1: " .. tostring(port)
  else
    local base, berr = images.ensure(eng, "base", ctx)
    if not base then
      reason = "the probe found no base image to build from: " .. tostring(berr)
    else
      local nonce = loop.random(8):gsub(".", function(c) return ("%02x"):format(c:byte()) end)
      local tag = "demesne/devcontainer-network-probe:" .. nonce:sub(1, 12)
      local ok, err = images.build_context(eng, { name = "devcontainer-network-probe", tag = tag,
        files = probe_files(port, nonce), buildargs = { BASE = base.ref }, network = "none",
        labels = { ["io.demesne.image"] = "devcontainer-network-probe" } }, ctx)
      if ok then eng:image_remove(tag) end
      isolated = ok ~= nil and not reached
      if not isolated then
        reason = reached and ("a build step reached a listener on the host's 127.0.0.1:%d"):format(port)
          or tostring(err):match("demesne%-probe: ([^\n]+)")
          or ("the probe could not tell (its build failed: %s)"):format((tostring(err):match("^[^\n]*")))
      end
    end
    listener:close()
  end
  isolation[key] = { isolated = isolated, reason = reason }
  log.info("demesne.images", "engine %s: build steps %s", key, isolated and "get no network when a build asks for none"
    or ("are not kept off the network: " .. reason))
  return isolated, reason
end

-- The image a FROM word names, its variables resolved as the engine resolves them: the
-- ARG defaults above the first FROM, under the devcontainer's build.args ($NAME, ${NAME},
-- ${NAME:-word}). Nil when a variable is left (one without a value, or a form not known).
local function from_image(ref, b)
  if not ref:find("$", 1, true) then return ref end
  local vars = {}
  for line in (b.dockerfile_text .. "\n"):gmatch("([^\n]*)\n") do
    if line:match("^%s*[Ff][Rr][Oo][Mm]%s") then break end
    local name, rest = line:match("^%s*[Aa][Rr][Gg]%s+([%a_][%w_]*)(.*)$")
    if name then vars[name] = rest:match("^=(%S*)") end
  end
  for k, v in pairs(b.args) do vars[k] = v end
  local out = ref:gsub("%${([%a_][%w_]*):%-([^}]*)}", function(n, word)
    return (vars[n] and vars[n] ~= "") and vars[n] or word
  end):gsub("%${([%a_][%w_]*)}", function(n) return vars[n] end):gsub("%$([%a_][%w_]*)", function(n) return vars[n] end)
  if out:find("$", 1, true) or out == "" then return nil end
  return out
end

-- Refuses a build with RUN steps (the Dockerfile's line `line` of `file`, or the features)
-- when devcontainer_build_network is "none" and the engine does not keep steps off the network.
local function check_run_network(eng, dc, ctx, what)
  if config.get("devcontainer_build_network") == "host" then return end
  local isolated, why = devcontainer.build_network_isolated(eng, ctx)
  if not isolated then
    fail(("image: devcontainer: %s (%s): RUN is refused: the engine (%s at %s) does not keep a build "
      .. "step off the network (%s), so the Dockerfile's RUN steps would have the host's network, its loopback "
      .. "services included. Set devcontainer_build_network = \"host\" (DEMESNE_DEVCONTAINER_BUILD_NETWORK=host) "
      .. "to build it with the host's network anyway (a repository you trust), or build without RUN"):format(
      dc.file, what, eng.kind or "the engine", eng.socket or "?", why))
  end
end

-- The image of the devcontainer itself (before its features and demesne's layer): its tag.
local function ensure_own(eng, dc, ctx)
  local cfg = dc.cfg
  if cfg.image then
    -- a reference the engine lacks is pulled there, with the host's registry credentials
    local img, err = images.ensure(eng, cfg.image, ctx)
    if not img then fail(("image: devcontainer: %s: image: %s"):format(dc.file, err)) end
    return img.ref
  end
  local b = cfg.build
  local where = dc.file
  local files = read_context(where, dc.root, b.context_rel)
  -- FROM a demesne image by name (as a user image may): the name becomes its tag
  local tags, stages = {}, {}
  for _, from in ipairs(images.parse_from(b.dockerfile_text)) do
    local ref = from.ref
    if not tags[ref] and not stages[ref] and images.origin(ref) then
      local img, err = images.ensure(eng, ref, ctx)
      if not img then
        fail(("image: devcontainer: %s line %d: FROM %s: %s"):format(b.dockerfile_rel, from.line, ref, err))
      end
      tags[ref] = img.ref
    end
    -- an image that carries ONBUILD triggers would run them in this build, outside the
    -- checks: every FROM image is in the engine (pulled first if need be) and checked
    if not tags[ref] and not stages[ref] and ref ~= "scratch" then
      local named = from_image(ref, b)
      if not named then
        fail(("image: devcontainer: %s line %d: FROM %s: refused: demesne cannot tell which image it names (a "
          .. "variable it cannot resolve from the ARG defaults and build.args), and so cannot check it for ONBUILD "
          .. "triggers"):format(b.dockerfile_rel, from.line, ref))
      end
      local present = not stages[named] and eng:image_inspect(named, { onbuild = true })
      if not present and not stages[named] and not images.origin(named) then
        local ok, perr = images.pull(eng, named, ctx)
        if not ok then fail(("image: devcontainer: %s line %d: FROM %s: %s"):format(b.dockerfile_rel, from.line, ref, perr)) end
        present = eng:image_inspect(named, { onbuild = true })
      end
      if present and #(present.onbuild or {}) > 0 then
        fail(("image: devcontainer: %s line %d: FROM %s: the image carries ONBUILD triggers (%s), refused: they "
          .. "would run in this build, outside the Dockerfile's checks"):format(b.dockerfile_rel, from.line, ref,
          (table.concat(present.onbuild, "; "):sub(1, 200))))
      end
    end
    if from.stage then stages[from.stage] = true end
  end
  local dockerfile = images.rewrite_from(b.dockerfile_text, tags)
  local key = { "devcontainer", dc.root, dc.file, dockerfile, b.target or "" }
  local argnames = {}
  for k in pairs(b.args) do argnames[#argnames + 1] = k end
  table.sort(argnames)
  for _, k in ipairs(argnames) do key[#key + 1] = k .. "=" .. b.args[k] end
  local out = {}
  for _, f in ipairs(files) do
    key[#key + 1] = f.name .. "\0" .. f.mode .. "\0" .. f.data
    if f.name ~= DOCKERFILE then out[#out + 1] = f end
  end
  out[#out + 1] = { name = DOCKERFILE, data = dockerfile, mode = 420 }
  local name = slug(dc.root) .. "-base"
  local tag = images.tag_of(name, key)
  local network = config.get("devcontainer_build_network")
  if b.first_run and not eng:image_inspect(tag) then
    check_run_network(eng, dc, ctx, ("%s line %d"):format(b.dockerfile_rel, b.first_run))
  end
  local ref, err = images.build_context(eng, { name = name, tag = tag, files = out, buildargs = b.args,
    dockerfile = DOCKERFILE, target = b.target, network = network,
    labels = { ["io.demesne.image"] = devcontainer.IMAGE, ["io.demesne.origin"] = devcontainer.ORIGIN,
      [devcontainer.SOURCE_LABEL] = dc.root, ["io.demesne.devcontainer.file"] = dc.file } }, ctx)
  if not ref then fail(("image: devcontainer: %s (%s): %s"):format(dc.file, b.dockerfile_rel, err)) end
  return ref
end

-- The files of each feature (features.parse's list): a local one's folder in the
-- repository, an OCI one pulled into the host's private folder (and removed from there
-- once read); each described (features.describe), then put in install order.
local function read_features(dc)
  local where, list = dc.file, {}
  -- one budget of images.USER_MAX_BYTES for all of them; a folder named twice is refused
  local total, seen = { bytes = 0 }, {}
  if #dc.cfg.features > features.MAX_COUNT then
    fail(("image: devcontainer: %s: features: %d of them, more than the %d demesne installs"):format(where,
      #dc.cfg.features, features.MAX_COUNT))
  end
  for _, ft in ipairs(dc.cfg.features) do
    local files
    if ft.kind == "local" then
      if seen[ft.rel] then
        fail(("image: devcontainer: %s: features.%s: names the folder %s, as features.%s does"):format(where, ft.id,
          ft.rel, seen[ft.rel]))
      end
      seen[ft.rel] = ft.id
      files = read_context(where, dc.root, ft.rel, nil, total, nil, "features." .. ft.id)
    else
      local dir, dpath = features.private_dir()
      local _d <close> = dir
      local name = util.random_hex(8)
      local _rm <close> = util.closer(function() fs.remove_tree(dpath .. "/" .. name) end)
      ft.digest = features.pull(where, ft.id, dir, name)
      files = read_context(where, dpath, name, nil, total, nil, "features." .. ft.id)
    end
    list[#list + 1] = features.describe(where, ft, files)
  end
  return features.order(where, list)
end

-- The inspect of an image a layer is built FROM (`what`: "the features", "its own layer"),
-- refused when it carries ONBUILD triggers: they would run in that build, outside the
-- Dockerfile's checks (a user adapter may not report them).
local function checked_image(eng, dc, ref, what)
  local info = eng:image_inspect(ref, { onbuild = true })
  if not info then fail(("image: devcontainer: %s: the image %s is not in the engine"):format(dc.file, ref)) end
  if #(info.onbuild or {}) > 0 then
    fail(("image: devcontainer: %s: the image %s carries ONBUILD triggers (%s), refused: they would run when "
      .. "demesne builds %s on it, outside the Dockerfile's checks"):format(dc.file,
      dc.cfg.image or "the Dockerfile builds", (table.concat(info.onbuild, "; "):sub(1, 200)), what))
  end
  return info
end

-- The devcontainer's image with its features installed (or the image itself without any).
local function ensure_base(eng, dc, ctx)
  local own = ensure_own(eng, dc, ctx)
  if not dc.cfg.features then return own end
  -- the features' layer is built FROM it: its triggers would run there (the check of
  -- devcontainer.ensure sees only the features' image, which carries none of them)
  local info = checked_image(eng, dc, own, "the features")
  local ordered = read_features(dc)
  local files = features.context(ordered)
  local key = { "devcontainer-features", own, tostring(info and info.id) }
  for _, f in ipairs(files) do key[#key + 1] = f.name .. "\0" .. f.mode .. "\0" .. f.data end
  local name = slug(dc.root) .. "-features"
  local tag = images.tag_of(name, key)
  if not eng:image_inspect(tag) then check_run_network(eng, dc, ctx, "features") end
  local ids = {}
  for _, d in ipairs(ordered) do ids[#ids + 1] = d.id end
  dc.features = ids
  local ref, err = images.build_context(eng, { name = name, tag = tag, files = files, buildargs = { BASE = own },
    network = config.get("devcontainer_build_network"),
    labels = { ["io.demesne.image"] = devcontainer.IMAGE, ["io.demesne.origin"] = devcontainer.ORIGIN,
      [devcontainer.SOURCE_LABEL] = dc.root, ["io.demesne.devcontainer.file"] = dc.file } }, ctx)
  if not ref then fail(("image: devcontainer: %s: features: %s"):format(dc.file, err)) end
  return ref
end

--- Builds (or finds, by the hash of its inputs) the image a planned devcontainer sandbox
--- runs in: the devcontainer's own image, then demesne's layer on top (USER root, and the
--- agent's CLI for an agent run). Sets o.devcontainer.image_env (the image's variables) and
--- adds its PATH to o.env. Returns {name = "devcontainer", ref = tag}; fails with the
--- build's reason (and the tail of its output) naming the devcontainer file.
---@param eng table  the engine adapter
---@param o table  a plan with o.devcontainer (devcontainer.plan)
---@param ctx ToolContext|nil  build progress
---@return {name: string, ref: string}
function devcontainer.ensure(eng, o, ctx)
  local dc = o.devcontainer
  local base = ensure_base(eng, dc, ctx)
  local info = checked_image(eng, dc, base, "its own layer")
  local buildargs = { BASE = base }
  local key = { "devcontainer-layer", base, tostring(info.id) }
  if dc.agent then
    if not AGENT_LAYERS[dc.agent] then
      fail(("image: devcontainer: the agent image %s has no CLI demesne can add to a devcontainer (%s can)"):format(
        dc.agent, "agent-claude_code, agent-codex"))
    end
    local a, aerr = images.ensure(eng, dc.agent, ctx)
    if not a then fail(("image: devcontainer: the agent's image %s: %s"):format(dc.agent, tostring(aerr))) end
    buildargs.AGENT = a.ref
    key[#key + 1] = a.ref
  end
  local image_path
  for _, kv in ipairs(info.env or {}) do image_path = kv:match("^PATH=(.*)$") or image_path end
  local files = layer_files(dc.agent, image_path)
  for _, f in ipairs(files) do key[#key + 1] = f.name .. "\0" .. f.data end
  local name = slug(dc.root) .. (dc.agent and ("-" .. dc.agent) or "")
  local tag = images.tag_of(name, key)
  local ref, err = images.build_context(eng, { name = name, tag = tag, files = files, buildargs = buildargs,
    network = "none", labels = { ["io.demesne.image"] = devcontainer.IMAGE, ["io.demesne.origin"] = devcontainer.ORIGIN,
      [devcontainer.SOURCE_LABEL] = dc.root, ["io.demesne.devcontainer.file"] = dc.file,
      ["io.demesne.devcontainer.agent"] = dc.agent or "" } }, ctx)
  if not ref then fail(("image: devcontainer: %s: demesne's layer: %s"):format(dc.file, err)) end
  local top = eng:image_inspect(ref)
  local env = {}
  for _, kv in ipairs(top and top.env or {}) do
    local k, v = kv:match("^([^=]+)=(.*)$")
    if k then env[k] = v end
  end
  dc.image_env = env
  devcontainer.add_env(o)
  return { name = devcontainer.IMAGE, ref = ref }
end

--- The result's `devcontainer` field: {source, file, image, ports, steps, features (the
--- ids installed, in order), notes}.
---@param o table  a plan with o.devcontainer (and o.image_ref once made)
---@return table|nil
function devcontainer.summary(o)
  local dc = o.devcontainer
  if not dc then return nil end
  local steps = {}
  for _, s in ipairs(dc.cfg.steps) do steps[#steps + 1] = s.field end
  local function list(t)
    local out = json.array()
    for i, v in ipairs(t or {}) do out[i] = v end
    return out
  end
  return { source = dc.root, file = dc.file, image = o.image_ref, ports = list(dc.cfg.ports), steps = list(steps),
    features = list(dc.features), notes = list(dc.cfg.notes) }
end

--- Keeps a persistent sandbox's create script until its creation (lua/sandbox/repository.lua)
--- runs it: set with a script, read (and forgotten) without one.
---@param sandbox_id string
---@param script string|nil
---@return string|nil
function devcontainer.pending(sandbox_id, script)
  if script then pending[sandbox_id] = script return script end
  local s = pending[sandbox_id]
  pending[sandbox_id] = nil
  return s
end

--- The devcontainer images in the engine (built by demesne: label io.demesne.origin =
--- devcontainer), newest first: {ref, id, source, file, agent, created, size_bytes, stale}.
--- `stale`: its source folder is gone, or a newer image of the same source, file and
--- agent exists.
---@param eng table
---@return table[]|nil list, string|nil err
function devcontainer.built(eng)
  local list, err = eng:image_list({ "io.demesne.origin=" .. devcontainer.ORIGIN })
  if not list then return nil, err end
  table.sort(list, function(a, b) return (a.created or 0) > (b.created or 0) end)
  local seen, out = {}, {}
  for _, i in ipairs(list) do
    local l = i.labels or {}
    local src = l[devcontainer.SOURCE_LABEL] or "?"
    local k = table.concat({ src, l["io.demesne.devcontainer.file"] or "", l["io.demesne.devcontainer.agent"] or "",
      (i.refs[1] or ""):match("^(.*):") or "" }, "\0")
    local st = fs.stat(src)
    out[#out + 1] = { ref = i.refs[1] or i.id, id = i.id, source = src, file = l["io.demesne.devcontainer.file"],
      agent = l["io.demesne.devcontainer.agent"] ~= "" and l["io.demesne.devcontainer.agent"] or nil,
      created = i.created, size_bytes = i.size_bytes, stale = seen[k] or not (st and st.type == "directory") }
    seen[k] = true
  end
  return out
end

return devcontainer
