-- package-managers: the public package registries, over HTTPS (and the Debian/Ubuntu
-- archives over HTTP too, as apt uses them), nothing else. The default for sandbox_script
-- and sandbox_create.
--
-- The npm registry and the Debian archives are taken from this machine's own npm and apt
-- configuration (`sources`, see lua/egress/policy.lua): the images are built from the same
-- sources, and a mirror configured on the host is then the one allowed.
local npm = sources.npm_hosts()
local apt = sources.apt_hosts()

return {
  description = "package registries: npm, PyPI, conda, Debian/Ubuntu archives, Go module proxy and checksum DB, "
    .. "crates.io, RubyGems",
  rules = {
    { ALLOW, name = "npm", host = npm, port = 443 },
    { ALLOW, name = "pypi", host = { "pypi.org", "files.pythonhosted.org" }, port = 443 },
    { ALLOW, name = "conda", host = { "repo.anaconda.com", "conda.anaconda.org" }, port = 443 },
    { ALLOW, name = "apt", host = apt, port = { 80, 443 } },
    { ALLOW, name = "ubuntu", host = { "archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com",
      "*.archive.ubuntu.com" }, port = { 80, 443 } },
    { ALLOW, name = "go", host = { "proxy.golang.org", "sum.golang.org" }, port = 443 },
    { ALLOW, name = "crates", host = { "crates.io", "index.crates.io", "static.crates.io" }, port = 443 },
    { ALLOW, name = "rubygems", host = { "rubygems.org", "index.rubygems.org" }, port = 443 },
  },
}
