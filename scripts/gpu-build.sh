#!/usr/bin/env bash
# Builds everything the GPU machine runs into dist/gpu/ (ignored by git): the test binaries
# with the `gpu-tests` feature (ferry-cli/gpu-tests), the examples, the `ferry` CLI (crates/cli),
# the host-cost bench (benches/submit.rs) and the runner script.
# Then, on the GPU machine: dist/gpu/gpu-run.sh [LOG_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=dist/gpu
target=${CARGO_TARGET_DIR:-target}
rm -rf "$out"
mkdir -p "$out/tests"
cargo build --release -p ferry-cli --bin ferry
cargo build --release -p ferry --examples
# ferry-cli/gpu-tests turns on ferry/gpu-tests too: the CLI's suite starts `ferry serve`, and
# ferry-rdma/gpu-tests adds its rdma_dmabuf binary (dma-buf export of GPU memory).
cargo test --release --workspace --features ferry-cli/gpu-tests --no-run --message-format=json 2>/dev/null |
  python3 scripts/test-binaries.py |
  while read -r executable; do
    cp "$executable" "$out/tests/"
  done
# The unit tests replay the committed fuzz corpora, which they look for beside themselves.
for krate in core nvlink rdma; do
  mkdir -p "$out/tests/fuzz-data"
  cp -r "crates/$krate/tests/data/fuzz" "$out/tests/fuzz-data/$krate"
done
for binary in "$target"/release/ferry "$target"/release/examples/{pd_demo,decode,prefill,tp_demo}; do
  cp "$binary" "$out/"
done
# The host's cost of submitting batches (benches/submit.rs): no GPU needed, but run on the GPU
# machine it says what a flat entry costs on the host the GPU rows were measured on.
cargo bench --bench submit --no-run
cargo bench --bench submit --no-run --message-format=json 2>/dev/null |
  python3 scripts/test-binaries.py |
  while read -r executable; do
    cp "$executable" "$out/submit-bench"
  done
[ -x "$out/submit-bench" ] || { echo "benches/submit.rs built no executable"; exit 1; }
cp scripts/gpu-run.sh scripts/containers.sh "$out/"
find "$out/tests" -maxdepth 1 -type f -exec strip {} +
strip "$out"/ferry "$out"/pd_demo "$out"/decode "$out"/prefill "$out"/tp_demo "$out"/submit-bench
du -sh "$out"
ls "$out" "$out/tests"
