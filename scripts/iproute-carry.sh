#!/usr/bin/env bash
# Fetches iproute2 and its libraries from Debian into dist/iproute/ (ignored by git), with a
# bin/ip wrapper that finds them, for GPU machines without an `ip` command: the namespace
# matrix (containers.sh) needs it for its network-namespace layouts. Carry dist/iproute and
# put dist/iproute/bin first on PATH there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=dist/iproute
rm -rf "$out"
mkdir -p "$out/bin" "$out/debs"
(cd "$out/debs" && apt-get download iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12)
for deb in "$out"/debs/*.deb; do
  dpkg -x "$deb" "$out/root"
done
rm -rf "$out/debs" "$out/root/usr/share"
cat >"$out/bin/ip" <<'WRAPPER'
#!/bin/sh
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/root/usr/lib/x86_64-linux-gnu:$here/root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/root/bin/ip" "$@"
WRAPPER
chmod +x "$out/bin/ip"
"$out/bin/ip" -V
