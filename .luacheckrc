-- luacheck (Debian package lua-check) over every Lua file of the repository:
-- `luacheck .` from the top, as tests/run and tests/lint do.
std = "lua54"
max_line_length = 130
max_comment_line_length = false -- LuaCATS annotations name whole shapes on one line
exclude_files = { "build/", "build-*/", "**/node_modules/" }
ignore = {
  "211/_.*", "212/_.*", "213/_.*", -- a name starting with _ is unused on purpose (`local _ <close> = guard`)
  "212/self", "212/ctx", "212/args", -- a method's self, a tool's run(ctx, args): the interface, used or not
}
-- policy files run with the rule actions and the host sources as globals (lua/egress/policy.lua)
files["policies/"] = { read_globals = { "ALLOW", "DENY", "ASK", "sources" } }
-- the fuzz driver (tests/fuzz/driver/lua_target.c) sets the source folder as a global
files["tests/fuzz/"] = { read_globals = { "FUZZ_SOURCE_DIR" } }
