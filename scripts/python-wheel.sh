#!/usr/bin/env bash
# Builds the `ferry_kv` wheel that installs on any x86_64 Linux with glibc 2.28 or later and
# CPython 3.10 or later (abi3), without Rust: a release build linked by zig against glibc 2.28,
# tagged manylinux_2_28 (check it with `auditwheel show`). Prints the wheel's path and size.
# Usage: scripts/python-wheel.sh [OUT_DIR]   (default dist/wheel)
# Needs cargo, python3 with venv; maturin and ziglang are installed into a build venv.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist/wheel}
# Absolute: zig runs from build scripts' own folders.
venv=$(realpath -m "${CARGO_TARGET_DIR:-target}/wheel-venv")
if ! [ -x "$venv/bin/maturin" ] || ! "$venv/bin/python" -c "import ziglang" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check maturin==1.16.0 ziglang==0.17.1
fi
rm -rf "$out"
PATH="$venv/bin:$PATH" maturin build --release --zig --compatibility manylinux_2_28 \
  --manifest-path crates/python/Cargo.toml --interpreter "$venv/bin/python" --out "$out"
wheel=$(ls "$out"/ferry_kv-*-manylinux_2_28_x86_64.whl)
echo "$wheel: $(du -k "$wheel" | cut -f1) KiB"
