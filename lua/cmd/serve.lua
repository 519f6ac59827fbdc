-- `demesne serve` (the default command): the MCP server over stdio.
-- stdout carries only the protocol; logs go to stderr (level from DEMESNE_LOG_LEVEL).
-- `--fixtures DIR` also loads the tool files in DIR (test fixtures).

---@param args string[]
---@param opts {fixtures: string|nil}
---@return integer status
return function(args, opts)
  if args[1] then
    io.stderr:write("demesne serve: unexpected argument '", args[1], "'\n")
    return 2
  end
  return require("demesne.mcp.stdio").serve({ fixtures = opts.fixtures })
end
