#!/bin/bash
# Runs inside a fresh container of demesne's base image (tests/package/run mounts the .deb
# at /pkg and this machine's Debian apt sources file at /host-sources/<name>). Installs the
# .deb with apt, then prints what the host side checks, each part after a "== name" line.
# Exits non-zero only when it could not get as far as installing.
set -u
export DEBIAN_FRONTEND=noninteractive

deb=$(ls /pkg/*.deb)
# A fresh Debian root installs man pages and docs; the base image was made without them
# (mmdebstrap's --dpkgopt path-exclude, or the registry image's own dpkg.cfg.d file).
grep -l '^path-exclude' /etc/dpkg/dpkg.cfg.d/* 2>/dev/null | xargs -r rm -f
# apt sees only this machine's Debian sources, as mmdebstrap did when it made the image
rm -f /etc/apt/sources.list
rm -rf /etc/apt/sources.list.d
mkdir -p /etc/apt/sources.list.d
cp /host-sources/* /etc/apt/sources.list.d/

deps=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed 's/^ *//; s/[ (|].*//' | grep .)
echo "== installed before"
for p in $deps; do
	dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$p" 2>/dev/null | grep -E '^\S+ ii' | cut -d' ' -f1
done

echo "== apt"
apt-get update -q 2>&1 || { echo "== apt status update-failed"; exit 1; }
apt-get install -y -q --no-install-recommends "$deb" 2>&1
echo "== apt status $?"

echo "== installed after"
for p in $deps; do
	dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$p" 2>/dev/null | grep -E '^\S+ ii' | cut -d' ' -f1
done

echo "== version"
demesne --version 2>&1
echo "== version status $?"

echo "== doctor"
demesne doctor 2>&1
echo "== doctor status $?"

echo "== skills"
demesne skills check 2>&1 | tail -1
echo "== skills status ${PIPESTATUS[0]}"

echo "== skills install"
demesne skills install --dir /tmp/agent-skills 2>&1 | tail -1
test -f /tmp/agent-skills/demesne-bisect-hunt/SKILL.md && echo "linked file readable"

echo "== files"
for f in /usr/bin/demesne /usr/libexec/demesne/demesne-init /usr/share/man/man1/demesne.1.gz \
	/usr/share/doc/demesne/README.md /usr/share/doc/demesne/copyright \
	/usr/share/doc/demesne/reference/cli.md /usr/share/demesne/ui/index.html /usr/share/demesne/ui/app.js; do
	[ -f "$f" ] && echo "$f $(stat -c %a "$f")"
done
[ -e /usr/bin/demesne-init ] && echo "/usr/bin/demesne-init (must not exist)"

echo "== man"
zcat /usr/share/man/man1/demesne.1.gz 2>&1 | grep '^\.TH'

echo "== owned"
dpkg -L demesne | grep -E '^/usr/(bin|libexec/demesne|share/man/man1)/.' | sort
echo "== end"
