-- The command line: demesne [serve] | tools | check-config | doctor | images | policy | skills | reap | branches |
-- attach | ps | logs | cancel | ui |
-- test | --help |
-- --version
local loop = require("core.loop")

local cli = {}

local USAGE = [[
usage: demesne [COMMAND] [OPTIONS]

Commands:
  serve               run the MCP server over stdio (the default)
  serve --http ADDR   run it over Streamable HTTP on ADDR instead: 127.0.0.1:PORT,
                      [::1]:PORT or unix:/path (repeatable; endpoint /mcp; bearer token
                      from DEMESNE_HTTP_TOKEN or the file check-config names)
  tools               list the loaded tools and where each came from
  check-config        print the effective configuration and where each value came from
  doctor              check the engine, images, config, folders and demesne-init; say how to fix each problem
  images list [NAME...]
                      list the images (built-in and your own) and whether each is built
  images build [--refresh] [--all | NAME...]
                      build images ahead of use (all when no NAME is given); --refresh
                      builds them again without the cache
  images outdated [--no-packages] [NAME...]
                      which built images are outdated: changed inputs, newer packages
  policy list         list the egress policies and where each came from
  providers           list the agent providers, their models, and whether each can run
  policy test NAME HOST[:PORT]
                      what egress policy NAME decides for HOST (or a URL)
  skills list         list the orchestration skills (built-in and your own)
  skills show NAME    print a skill's SKILL.md
  skills check [DIR...]
                      check skills against the live tool schemas
  skills install [--claude] [--codex] [--dir DIR]
                      link the skills into Claude Code's and Codex's skill folders
  reap                remove what servers that are gone left behind (their one-shot and
                      warm sandboxes, run folders) and expired sandboxes; keeps running jobs
  branches [REPO] [--delete NAME]... [--prune] [--json]
                      list the branches demesne made in a repository (run, status, cost,
                      diffstat); --delete removes one, --prune those merged into HEAD
  attach ID           an interactive shell in a running sandbox (ID: sandbox_id, run_id or
                      job_id); Ctrl-] detaches, the sandbox keeps running
  attach --follow ID  show a background run's transcript or stdout as it grows
  ps [--json]         every tree of every running demesne server of this user
  logs ID [--stream S] [--follow]
                      a tree node's transcript, stdout or stderr (S); --follow as it grows
  cancel ID [--subtree]
                      end a tree node (--subtree: with its running children)
  ui [--port N] [--no-open]
                      the cockpit: a local web page of every tree, live, with their actions
  test DIR...         run the Lua tests in DIR inside this binary
  --help              show this help
  --version           print the version

Options:
  --source-dir DIR    load the Lua runtime, tools and policies from a source tree
  --fixtures DIR      also load the tools in DIR (test fixtures)

Environment: DEMESNE_ENGINE, DEMESNE_ALLOWED_PATHS, DEMESNE_OUTPUT_ROOT, DEMESNE_STATE_DIR,
DEMESNE_LOG_LEVEL, DEMESNE_EGRESS_ALLOW, DEMESNE_HTTP_TOKEN (see `demesne check-config`).
]]

--- Entry point. argv: list of strings (without the program name). Returns the exit status.
---@param argv string[]
---@return integer
function cli.main(argv)
  local opts, rest = {}, {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then
      io.stdout:write(USAGE)
      return 0
    elseif a == "--version" then
      io.stdout:write("demesne ", loop.version, "\n")
      return 0
    elseif a == "--fixtures" then
      opts.fixtures = argv[i + 1]
      i = i + 1
    else
      rest[#rest + 1] = a
    end
    i = i + 1
  end
  local cmd = rest[1] or "serve"
  local fn
  if cmd:match("^[%w%-]+$") then
    -- each command lives in lua/cmd/<name>.lua ("check-config" -> check_config.lua) and
    -- returns function(args, opts) -> exit status. Only the command that runs is loaded:
    -- `demesne --version` or `demesne test` need no MCP server, engine or providers.
    local ok, mod = pcall(require, "demesne.cmd." .. cmd:gsub("%-", "_")) -- lazy: one command's modules
    if ok then fn = mod elseif not tostring(mod):find("no demesne runtime file", 1, true) then error(mod, 0) end
  end
  if not fn then
    io.stderr:write("demesne: unknown command '", cmd, "'\n", USAGE)
    return 2
  end
  table.remove(rest, 1)
  return fn(rest, opts) or 0
end

return cli
