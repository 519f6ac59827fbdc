#!/usr/bin/env bash
# Benchmark (not a test): resident memory of an idle `demesne serve` after the MCP
# handshake and tools/list, next to the engine's own API service measured in the same run.
# Target (issue 2): under 8 MB RSS idle.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$root/build/demesne"
fifo="$(mktemp -u)"; mkfifo "$fifo"
exec 3<>"$fifo"
"$bin" serve <"$fifo" >/dev/null 2>&1 &
pid=$!
trap 'exec 3>&-; kill $pid 2>/dev/null; rm -f "$fifo"' EXIT
printf '%s\n' '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"bench","version":"1"}}}' \
  '{"jsonrpc":"2.0","method":"notifications/initialized"}' \
  '{"jsonrpc":"2.0","id":2,"method":"tools/list"}' >&3
sleep 2
rss_kb=$(awk '/VmRSS/ {print $2}' /proc/$pid/status)
anon_kb=$(awk '/^Pss_Anon/ {print $2}' /proc/$pid/smaps_rollup)
printf 'demesne serve idle RSS: %.1f MB (target < 8 MB), of which private anonymous memory %.1f MB; the rest is shared library text\n' \
  "$(echo "$rss_kb / 1024" | bc -l)" "$(echo "$anon_kb / 1024" | bc -l)"
for svc in "podman system service" dockerd; do
  p=$(pgrep -f "^$svc" | head -1 || true)
  if [ -n "$p" ]; then
    e_kb=$(awk '/VmRSS/ {print $2}' /proc/$p/status)
    printf '%s RSS: %.1f MB (ratio demesne/engine %.2f)\n' "$svc" "$(echo "$e_kb / 1024" | bc -l)" "$(echo "$rss_kb / $e_kb" | bc -l)"
  fi
done
