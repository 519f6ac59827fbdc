-- Fuzz harness: YAML through core.yaml (core/bind/yaml.c over libyaml) and a kubeconfig
-- through demesne.engines.kubernetes.kubeconfig. A kubeconfig comes from the user's machine, a
-- cloud's CLI or a colleague; it must be refused with a message, never crash, hang or blow
-- up (aliases), and no value may come out but the ones core.yaml documents.
--
-- Findings: a Lua error or a crash; decode's value of a type it does not make; a refusal
-- without "yaml: line L, column C:" (or the size bound); a kubeconfig that is neither read
-- nor refused with its name; settings that break what kubeconfig.parse promises.
local yaml = require("core.yaml")
local kubeconfig = require("demesne.engines.kubernetes.kubeconfig")
local fuzz = require("fuzzlib")
local check = fuzz.check

local OK_TYPES = { string = true, number = true, boolean = true, table = true }

-- Every value is a documented one; shared tables (aliases) are walked once
local function walk(v, seen, depth)
  check(depth <= 65, "deeper than max_depth: %d", depth)
  if v == yaml.null then return end
  check(OK_TYPES[type(v)], "a value of type %s", type(v))
  if type(v) ~= "table" or seen[v] then return end
  seen[v] = true
  check(getmetatable(v) == nil, "a table with a metatable")
  for k, x in pairs(v) do
    check(type(k) == "string" or math.type(k) == "integer", "a key of type %s", type(k))
    walk(x, seen, depth + 1)
  end
end

-- the files a kubeconfig may name: one of each, small
local FILES = { ["/k/ca.crt"] = "-----BEGIN CERTIFICATE-----\nQQ==\n-----END CERTIFICATE-----\n",
  ["/k/token"] = "tok-en\n" }
local function read(path) return FILES[path], "No such file or directory", "ENOENT" end

return function(data)
  local v, msg, code = yaml.decode(data, { max_nodes = 20000 })
  if v == nil then
    check(code == "EINVAL" or code == "ENOMEM", "code %s", tostring(code))
    check(type(msg) == "string" and (msg:find("^yaml: line %d+, column %d+: ") or msg:find("^yaml: the text")),
      "a refusal that names no place: %s", tostring(msg))
  else
    walk(v, {}, 0)
  end
  for _, allow in ipairs({ false, true }) do
    local cfg, kmsg, kcode = kubeconfig.parse(data, { source = "fuzz", dir = "/k", read = read, allow_insecure = allow })
    if cfg then
      check(type(cfg.server) == "string" and cfg.server:find("^https?://"), "server %s", tostring(cfg.server))
      check(type(cfg.namespace) == "string" and #cfg.namespace <= 63, "namespace")
      check(cfg.cert_pem or cfg.token, "neither a client certificate nor a token")
      check((cfg.cert_pem == nil) == (cfg.key_pem == nil), "a certificate without its key, or a key alone")
      check(not cfg.token or not cfg.token:find("[%c ]"), "a token that would break the header")
      check(allow or not cfg.insecure, "insecure without allow_insecure")
      check(not (cfg.insecure and cfg.ca_pem), "insecure with a CA")
    else
      check(kcode == "EINVAL", "code %s", tostring(kcode))
      check(type(kmsg) == "string" and kmsg:find("^kubeconfig fuzz: "), "a refusal that names no kubeconfig: %s", tostring(kmsg))
    end
  end
end
