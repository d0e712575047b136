#!/usr/bin/env bash
# Builds everything the GPU machine runs into dist/gpu/ (ignored by git): the test binaries
# with the `gpu-tests` feature, the examples, the `ferry` CLI and the runner script.
# Then, on the GPU machine: dist/gpu/gpu-run.sh [LOG_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=dist/gpu
rm -rf "$out"
mkdir -p "$out/tests"
cargo build --release --bins --examples
cargo test --release --workspace --features ferry/gpu-tests --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if message.get("reason") == "compiler-artifact" and message.get("profile", {}).get("test") and message.get("executable"):
        print(message["executable"])
' |
  while read -r executable; do
    cp "$executable" "$out/tests/"
  done
for binary in target/release/ferry target/release/examples/{pd_demo,decode,prefill,tp_demo}; do
  cp "$binary" "$out/"
done
cp scripts/gpu-run.sh scripts/containers.sh "$out/"
strip "$out"/tests/* "$out"/ferry "$out"/pd_demo "$out"/decode "$out"/prefill "$out"/tp_demo
du -sh "$out"
ls "$out" "$out/tests"
