#!/usr/bin/env bash
# Runs each cargo-fuzz target (fuzz/) for SECONDS seconds (60 by default), starting from the
# committed seeds listed below. New corpus entries go to
# fuzz/corpus/<target>/ (not committed); a crash stops the run, leaves its input in
# fuzz/artifacts/<target>/ and fails the script. A fixed crash belongs in
# crates/core/tests/data/fuzz/<target>-crashes/ with a .expected file, where `cargo test`
# replays it. Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
# Each target with its committed seeds.
targets=(
  "frame crates/core/tests/data/fuzz/frame"
  "session crates/core/tests/data/fuzz/session"
  "sealed_session crates/core/tests/data/fuzz/sealed_session"
  "client crates/core/tests/data/fuzz/client"
  "rdma_peer_input crates/rdma/tests/data/fuzz/peer_input"
  "message_ring crates/nvlink/tests/data/fuzz/message_ring"
  "staging_request crates/nvlink/tests/data/fuzz/staging_request"
  "handshake crates/core/tests/data/fuzz/handshake"
  "descriptor crates/core/tests/data/fuzz/descriptor"
)
for entry in "${targets[@]}"; do
  read -r target seeds <<<"$entry"
  corpus="fuzz/corpus/$target"
  mkdir -p "$corpus"
  echo "== fuzz $target for ${seconds}s"
  # Memory is bounded per allocation and in total: a session must never allocate what a
  # peer announces, only what its limits allow.
  cargo +nightly fuzz run "$target" "$corpus" "$seeds" -- \
    -max_total_time="$seconds" -max_len=20000 -malloc_limit_mb=64 -rss_limit_mb=1024 \
    -print_final_stats=1
done
