#!/usr/bin/env bash
# Builds the GPU bundle of another commit (a branch under evaluation, or the commit before a
# change) beside this checkout's, so that one device call measures both on the same machine:
# dist/gpu-ab.tar.xz holds that commit's `ferry` CLI and host-cost bench as gpu-ab/ferry and
# gpu-ab/submit-bench. On the GPU machine, after unpacking both bundles into /tmp/g:
#   for build in gpu gpu-ab gpu gpu-ab; do
#     /tmp/g/$build/ferry bench --prefill-gpu 0 --decode-gpu 0 --direction both \
#       --workloads kv-llama70b-4k,kv-llama70b-4k-entries,blocks-4k-entries --json $OUT/$build-$RANDOM.json
#   done
#   /tmp/g/gpu/submit-bench --bench 'one entry'; /tmp/g/gpu-ab/submit-bench --bench 'one entry'
# Usage: scripts/gpu-ab.sh REF   (a branch, tag or commit of this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: scripts/gpu-ab.sh REF}
commit=$(git rev-parse --verify "$ref^{commit}")
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
git worktree add --detach "$tree" "$commit" >/dev/null
# A target directory of its own: the other commit's artifacts must not replace this one's.
target=$(realpath -m "${CARGO_TARGET_DIR:-target}/gpu-ab")
(
  cd "$tree"
  CARGO_TARGET_DIR=$target cargo build --release -p ferry-cli --bin ferry
  CARGO_TARGET_DIR=$target cargo bench --bench submit --no-run
  CARGO_TARGET_DIR=$target cargo bench --bench submit --no-run --message-format=json 2>/dev/null |
    python3 scripts/test-binaries.py >"$target/submit-bench-path"
)
out=dist/gpu-ab
rm -rf "$out"
mkdir -p "$out"
cp "$target/release/ferry" "$out/ferry"
cp "$(cat "$target/submit-bench-path")" "$out/submit-bench"
strip "$out/ferry" "$out/submit-bench"
git -C "$tree" log -1 --format='%H %s' >"$out/COMMIT"
tar cf - -C dist gpu-ab | xz -T2 -6 >dist/gpu-ab.tar.xz
echo "dist/gpu-ab.tar.xz: $(cat "$out/COMMIT" | cut -c1-60)... ($(du -h dist/gpu-ab.tar.xz | cut -f1))"
