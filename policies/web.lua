-- web: any host name on the web ports (80 and 443), through the proxy. The proxy still
-- judges the name before any DNS lookup, dials only public addresses (never loopback,
-- private, link-local or metadata ranges, unless a CIDR rule allows them) and logs every
-- request to egress.jsonl. It is what a research run gets under gVisor, which has no
-- network but loopback, in place of the open policy's bridge network.
return {
  description = "any host name on ports 80 and 443, public addresses only, through the proxy",
  rules = {
    { ALLOW, name = "web", host = "*", port = { 80, 443 } },
  },
}
