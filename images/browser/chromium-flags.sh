# Sourced by Debian's /usr/bin/chromium wrapper (it reads every file in /etc/chromium.d/).
# Flags for a headless Chromium as root in an unprivileged container with no network:
# no setuid/namespace sandbox (the container is the boundary, and root needs --no-sandbox),
# no GPU (WebGL runs on SwiftShader, the CPU), /tmp instead of the small /dev/shm, and no
# background connections (updates, sync, QUIC, first-run) that a closed network refuses.
# Playwright passes --headless and its own --user-data-dir; a plain `chromium` call gets a
# profile under $HOME (a fresh tmpfs in each sandbox).
export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
 --use-angle=swiftshader --enable-unsafe-swiftshader --disable-quic --no-first-run \
 --disable-background-networking --disable-component-update --disable-sync \
 --disable-default-apps --disable-breakpad --no-default-browser-check --mute-audio"
