-- none: no outbound access. Every attempt through the proxy is refused and logged in
-- egress.jsonl; the sandbox has no network interface but loopback.
return {
  description = "no outbound access",
  rules = {},
}
