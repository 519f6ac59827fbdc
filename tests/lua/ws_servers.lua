-- The loopback servers of tests/fixtures/ws/server.mjs for the core.ws and Kubernetes exec
-- tests: start() runs the fixture under node and returns {ws = port, raw = port}, a <close>
-- value that stops it.
local process = require("core.process")
local fs = require("core.fs")
local json = require("core.json")
local async = require("demesne.async")

local SRC = os.getenv("DEMESNE_SOURCE_DIR") or "."
local FIXTURE = SRC .. "/tests/fixtures/ws/server.mjs"
local WS_MODULE = SRC .. "/tests/integration/node_modules/ws/package.json"

local M = {}

--- Starts the fixture servers; returns {ws = port, raw = port} with __close stopping them.
---@param tls_dir string|nil  a folder from M.certificates: also start the TLS server
function M.start(tls_dir)
  if not fs.stat(WS_MODULE) then
    error(WS_MODULE .. " is missing: run `npm ci` in tests/integration (the `ws` server these tests use)", 0)
  end
  local exited, line = async.event(), async.event()
  local proc, pipes = process.spawn({ file = "node", args = { FIXTURE, tls_dir }, stdin = true, stdout = true },
    function(status) exited.set(status) end)
  assert(proc, pipes)
  local buf = ""
  pipes.stdout:read_start(function(d)
    if not d then return line.set(nil) end
    buf = buf .. d
    if buf:find("\n") then line.set(buf) end
  end)
  local got = async.timeout(10000, function() return line.wait() end)
  assert(got, "the fixture server did not start")
  local s = json.decode(got)
  return setmetatable(s, { __close = function()
    pipes.stdout:close()
    pipes.stdin:close() -- the server exits when its stdin ends
    async.timeout(5000, function() return exited.wait() end)
    if not proc:exited() then proc:kill("KILL") end
  end })
end

--- Makes a CA, a server certificate for 127.0.0.1 and a client certificate (CN ws-client)
--- with the openssl command; returns the folder (a <close> value that removes it) holding
--- ca.crt, server.crt, server.key, client.crt and client.key.
---@return table dir  {path = folder}
function M.certificates()
  local dir = ("%s/demesne-ws-tls-%d-%d"):format(os.getenv("TMPDIR") or "/tmp", os.time(), math.random(1 << 30))
  assert(fs.mkdir_p(dir))
  local script = [[
set -e
cd "$1"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1.key" 2>/dev/null; }
key ca
openssl req -x509 -new -key ca.key -subj /CN=ws-test-ca -days 2 -out ca.crt
for who in server client; do
  key $who
  openssl req -new -key $who.key -subj /CN=ws-$who -out $who.csr
done
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
for who in server client; do
  openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile $who.ext -out $who.crt 2>/dev/null
done
]]
  local exited = async.event()
  local proc, err = process.spawn({ file = "sh", args = { "-c", script, "sh", dir } }, function(status) exited.set(status) end)
  assert(proc, err)
  assert(exited.wait() == 0, "openssl could not make the test certificates")
  return setmetatable({ path = dir }, { __close = function(d) fs.remove_tree(d.path) end })
end

return M
