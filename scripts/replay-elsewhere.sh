#!/usr/bin/env bash
# The unit-test binaries of ferry-core, ferry-nvlink and ferry-rdma copied into an empty
# folder, as gpu-build.sh lays them out for the GPU machine (the fuzz corpora in fuzz-data/
# beside them), and their corpus replays run from there: they must find the corpora beside
# themselves, not through the build machine's source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
elsewhere=$(mktemp -d)
trap 'rm -rf "$elsewhere"' EXIT
mkdir -p "$elsewhere/fuzz-data"
for krate in core nvlink rdma; do
  cp -r "crates/$krate/tests/data/fuzz" "$elsewhere/fuzz-data/$krate"
done
cargo test -p ferry-core -p ferry-nvlink -p ferry-rdma --lib --no-run --message-format=json 2>/dev/null |
  python3 scripts/test-binaries.py |
  while read -r executable; do
    cp "$executable" "$elsewhere/"
  done
count=0
for test in "$elsewhere"/ferry_*; do
  (cd "$elsewhere" && "$test" fuzzing --test-threads=2 -q)
  count=$((count + 1))
done
[ "$count" -eq 3 ] || { echo "expected 3 unit-test binaries, found $count"; exit 1; }
echo "the corpus replays of $count unit-test binaries passed from $elsewhere"
