-- core.httphead.parse (llhttp) on request heads, core.httphead.stream on where each request
-- of a connection ends, and the port preview's judgement of a request
-- (lua/sandbox/preview.lua: Host, Origin, Sec-Fetch-Site, the secret in the URL or the
-- cookie). The relay itself runs against real engines in tests/integration/preview.test.mjs.
local httphead = require("core.httphead")
local preview = require("demesne.sandbox.preview")

local tests = {}

function tests.parse_gives_method_target_headers_and_length(t)
  local raw = "GET /a?b=1 HTTP/1.1\r\nHost: 127.0.0.1:8\r\nX-Two: a\r\nUpgrade: websocket\r\n"
    .. "Connection: Upgrade\r\n\r\nrest"
  local h = assert(httphead.parse(raw))
  t:eq(h.method, "GET")
  t:eq(h.target, "/a?b=1")
  t:eq(h.version, "1.1")
  t:eq(h.headers, { { "host", "127.0.0.1:8" }, { "x-two", "a" }, { "upgrade", "websocket" },
    { "connection", "Upgrade" } })
  t:eq(h.upgrade, true)
  t:eq(raw:sub(h.length + 1), "rest", "length: the head's bytes, what follows is not part of it")
  local p = assert(httphead.parse("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"))
  t:eq({ p.method, p.upgrade, p.length }, { "POST", false, #"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n" })
end

function tests.parse_says_incomplete_or_malformed(t)
  t:eq({ httphead.parse("GET / HTTP/1.1\r\nHost: x\r\n") }, { nil, "incomplete", "EAGAIN" })
  t:eq({ httphead.parse("") }, { nil, "incomplete", "EAGAIN" })
  local _, _, code = httphead.parse("NOT HTTP\r\n\r\n")
  t:eq(code, "EPROTO")
  _, _, code = httphead.parse("GET / HTTP/1.1\r\nBad Header\r\n\r\n")
  t:eq(code, "EPROTO")
  local many = { "GET / HTTP/1.1\r\n" }
  for i = 1, 129 do many[#many + 1] = ("X-%d: v\r\n"):format(i) end
  many[#many + 1] = "\r\n"
  local _, msg, c = httphead.parse(table.concat(many))
  t:eq({ msg, c }, { "the request has more than 128 headers", "EPROTO" })
end

-- Feeds `chunks` to one stream parser and gives back what the relay would see: the pieces
-- cut at each request's end ("|" between requests, "^" before an upgrade's other protocol).
local function cut(chunks)
  local s, out, rest = httphead.stream(), {}, ""
  for _, chunk in ipairs(chunks) do
    local buf = rest .. chunk
    rest = ""
    while #buf > 0 do
      local n, state = s:execute(buf)
      if not n then return nil, state end
      out[#out + 1] = buf:sub(1, n)
      buf = buf:sub(n + 1)
      if state == "ended" then out[#out + 1] = "|" end
      if state == "upgraded" then
        out[#out + 1] = "^" .. buf
        buf = ""
      end
    end
  end
  return table.concat(out)
end

function tests.stream_finds_where_each_request_of_a_connection_ends(t)
  -- a body that looks like a request head is body, not the next request
  local post = "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 41\r\n\r\n"
    .. "GET /?demesne_preview=0 HTTP/1.1\r\n\r\n12345"
  t:eq(#"GET /?demesne_preview=0 HTTP/1.1\r\n\r\n12345", 41)
  local get = "GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
  t:eq(cut({ post .. get }), post .. "|" .. get .. "|")
  -- the same bytes a byte at a time
  local bytes = {}
  for i = 1, #(post .. get) do bytes[i] = (post .. get):sub(i, i) end
  t:eq(cut(bytes), post .. "|" .. get .. "|")
  -- chunked
  local chunked = "POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
  t:eq(cut({ chunked, get }), chunked .. "|" .. get .. "|")
end

function tests.stream_stops_at_an_upgrade_and_at_bad_bytes(t)
  local up = "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
  t:eq(cut({ up .. "\x81\x85frame GET / HTTP/1.1" }), up .. "^\x81\x85frame GET / HTTP/1.1")
  local s = httphead.stream()
  t:eq({ s:execute(up) }, { #up, "upgraded" })
  t:eq(select(3, s:execute("more")), "EPROTO", "after an upgrade the stream is no longer HTTP")
  t:eq(select(3, httphead.stream():execute("NOT HTTP\r\n\r\n")), "EPROTO")
end

local E = { addr = "127.9.8.7", host_port = 4100, token = ("ab"):rep(24), cookie = "demesne_preview_4100" }

local function judge(lines)
  return preview.judge(E, assert(httphead.parse(table.concat(lines, "\r\n") .. "\r\n\r\n")))
end

function tests.judge_wants_the_secret_in_the_url_or_the_cookie(t)
  local status, why, redirect = judge({ "GET /x?a=1&demesne_preview=" .. E.token .. "&b=2 HTTP/1.1", "Host: 127.9.8.7:4100" })
  t:eq({ status, why, redirect }, { nil, nil, "/x?a=1&b=2" }, "the right token: a redirect to the URL without it")
  status = judge({ "GET /?demesne_preview=" .. ("00"):rep(24) .. " HTTP/1.1", "Host: 127.9.8.7:4100" })
  t:eq(status, 403)
  t:eq({ judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Cookie: a=1; demesne_preview_4100=" .. E.token }) }, {})
  status, why = judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Cookie: demesne_preview_4101=" .. E.token })
  t:eq(status, 403, "another preview's cookie name")
  t:match(why, "needs its secret")
  t:eq(judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100" }), 403)
end

function tests.judge_refuses_other_hosts_and_origins(t)
  local ck = "Cookie: demesne_preview_4100=" .. E.token
  -- (127.0.0.1 and localhost too: another preview's cookies would come along from there)
  for _, host in ipairs({ "evil.example:4100", "127.9.8.7:4101", "127.9.8.7", "127.0.0.1:4100", "localhost:4100",
    "127.9.8.8:4100", "" }) do
    t:eq(judge({ "GET / HTTP/1.1", "Host: " .. host, ck }), 421, host)
  end
  t:eq(judge({ "GET / HTTP/1.1", ck }), 421, "no Host at all")
  t:eq(judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Origin: http://127.9.8.7:4101", ck }), 403)
  t:eq(judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Origin: null", ck }), 403)
  t:eq({ judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Origin: http://127.9.8.7:4100", ck }) }, {})
  t:eq(judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Sec-Fetch-Site: same-site", "Sec-Fetch-Mode: cors", ck }),
    403, "a request another preview's page made")
  t:eq({ judge({ "GET / HTTP/1.1", "Host: 127.9.8.7:4100", "Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: navigate",
    ck }) }, {}, "a navigation from elsewhere is opening the preview")
end

function tests.each_preview_gets_a_loopback_address_of_its_own(t)
  local seen = {}
  for _ = 1, 50 do
    local a = preview.address()
    local x, y, z = a:match("^127%.(%d+)%.(%d+)%.(%d+)$")
    x, y, z = tonumber(x), tonumber(y), tonumber(z)
    t:ok(x and x >= 2 and x <= 254 and y >= 1 and y <= 254 and z >= 1 and z <= 254, a .. " is in 127.2-254.1-254.1-254")
    seen[a] = true
  end
  local n = 0
  for _ in pairs(seen) do n = n + 1 end
  t:ok(n > 40, ("50 draws gave %d addresses"):format(n))
end

return tests
