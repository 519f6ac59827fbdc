-- open: unrestricted outbound access. The sandbox gets the engine's default bridge network
-- instead of the proxy, so nothing is judged or logged. Refused for calls that mount host
-- inputs (inputs plus open egress is the exfiltration shape).
return {
  description = "unrestricted: a bridge network, no proxy",
  open = true,
}
