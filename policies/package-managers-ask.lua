-- package-managers-ask: what package-managers allows goes out at once; any other name on
-- the web ports (80, 443) is neither allowed nor denied: the connection is held while the
-- person is asked (the cockpit, or the host client through MCP elicitation), and denied
-- when nobody answers within ask_timeout_seconds. Addresses (IP literals) are never asked
-- about: they stay denied.
return {
  description = "package registries as package-managers; any other host on ports 80 and 443 is asked about",
  extends = "package-managers",
  rules = {
    { ASK, name = "web", host = "*", port = { 80, 443 } },
  },
}
