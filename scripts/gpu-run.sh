#!/usr/bin/env bash
# Runs the GPU suite that scripts/gpu-build.sh collected, on the GPU machine. Writes two files
# into LOG_DIR (first argument, else $OUT, else dist/gpu/logs): summary.txt (one line per
# step, then every test binary's result line) and full.log (everything every step printed).
# Usage: gpu-run.sh [LOG_DIR] [all|tests|containers|bench|host|contend|pairs]: `tests` runs the
# test binaries and the demos, `containers` the namespace matrix, `bench` the single-pair
# benchmarks, `host` what a submit costs the host (no GPU),
# `contend` what a GEMM on the prefill GPU loses per multiprocessor cap of the copy kernel,
# `pairs` the multi-pair ones; `all` (the default) runs them all. One device call is limited to
# 10 minutes, so the parts are run as separate calls there.
# Exits non-zero when any step failed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:-${OUT:-$here/logs}}
mkdir -p "$logs"
export FERRY_BIN="$here/ferry"
export FERRY_EXAMPLES="$here"
summary="$logs/summary.txt"
full="$logs/full.log"
: >"$summary"
: >"$full"
status=0

step() {
  local name=$1
  shift
  local started=$SECONDS
  {
    echo "===== $name: $*"
  } >>"$full"
  if "$@" >>"$full" 2>&1; then
    echo "ok   $name ($((SECONDS - started)) s)" >>"$summary"
  else
    echo "FAIL $name ($((SECONDS - started)) s)" >>"$summary"
    status=1
  fi
}

# GPUs nvidia-smi lists.
gpu_count() {
  nvidia-smi -L 2>/dev/null | grep -c '^GPU'
}

# The decode GPU of a single-pair run: GPU 1 where there are two GPUs or more, else GPU 0 (both
# processes on one GPU, against the device-to-device copy).
decode_gpu() {
  if [ "$(gpu_count)" -ge 2 ]; then echo 1; else echo 0; fi
}

tests() {
  step nvidia-smi nvidia-smi
  step probe "$here/ferry" probe
  # Each test binary, and each GPU test on its own, under a time limit: a hang is reported as
  # a failure (exit 124) instead of eating the whole session. gpu-* is the CLI's suite,
  # rdma_dmabuf-* ferry-rdma's dma-buf export of GPU memory.
  for test in "$here"/tests/*; do
    [ -f "$test" ] || continue
    case $(basename "$test") in
      gpu-* | rdma_dmabuf-*)
        for name in $("$test" --list 2>/dev/null | sed -n 's/: test$//p'); do
          step "gpu $name" timeout 120 "$test" --exact "$name" --nocapture
        done
        ;;
      *) step "test $(basename "$test")" timeout 300 "$test" --test-threads=2 ;;
    esac
  done
  step pd_demo timeout 180 "$here/pd_demo"
  step "pd_demo split CUDA_VISIBLE_DEVICES" timeout 180 "$here/pd_demo" --split-visible-devices --requests 1
  step "pd_demo entries" timeout 180 "$here/pd_demo" --entries
  step "pd_demo host memory" timeout 180 "$here/pd_demo" --host --requests 1
  step "tp_demo prefill TP=2 -> decode TP=2" timeout 180 "$here/tp_demo" --prefill-tp 2 --decode-tp 2
  step "tp_demo prefill TP=2 -> decode TP=1" timeout 180 "$here/tp_demo" --prefill-tp 2 --decode-tp 1
  step "tp_demo prefill TP=4 -> decode TP=2" timeout 180 "$here/tp_demo" --prefill-tp 4 --decode-tp 2
}

containers() {
  step "namespace matrix (containers.sh)" timeout 1200 "$here/containers.sh" "$logs"
  if [ "$(gpu_count)" -ge 2 ]; then
    step "namespace matrix, prefill on GPU 0, decode on GPU 1" timeout 1200 \
      "$here/containers.sh" "$logs/two-gpu" 0 1
  fi
}

# The single-pair rows and the sweep, GPU 0 to decode_gpu.
bench() {
  local decode
  decode=$(decode_gpu)
  step "ferry bench" timeout 420 "$here/ferry" bench --prefill-gpu 0 --decode-gpu "$decode" \
    --paths auto,kernel,copy-engine,batched --json "$logs/bench.json" --plot "$logs/bench.svg"
  step "ferry bench over tcp" timeout 300 "$here/ferry" bench --tcp --iterations 3 \
    --prefill-gpu 0 --decode-gpu "$decode" --workloads contiguous,kv-llama70b-4k,blocks-1m,small-write
  # Servers send a notification with each request (NIXL's and Mooncake's layers do): the same
  # rows with one, against the rows above without.
  step "ferry bench, a notification per request" timeout 300 "$here/ferry" bench \
    --notify-requests --prefill-gpu 0 --decode-gpu "$decode" \
    --workloads kv-llama70b-4k,kv-llama70b-4k-runs,blocks-1m --json "$logs/bench-notify.json"
  # The decode process's cudaMalloc memory through the staging buffers its engine hands over
  # by file descriptor (as between two pods whose servers have equal PIDs), against the same
  # rows mapped directly in the first step.
  step "ferry bench, cudaMalloc through staging" timeout 300 "$here/ferry" bench \
    --stage-cuda-malloc --prefill-gpu 0 --decode-gpu "$decode" \
    --workloads contiguous,kv-llama70b-4k,blocks-1m --json "$logs/bench-staged.json"
}

# What submitting a batch costs this machine's host (benches/submit.rs, no GPU involved): the
# `-entries` and `-runs` rows of `ferry bench` are bound by it.
host_cost() {
  step "host cost of a submit (benches/submit.rs)" timeout 300 "$here/submit-bench" --bench \
    --warm-up-time 1 --measurement-time 2
}

# The curve multiprocessors -> GB/s -> GEMM slowdown, GPU 0 to decode_gpu.
contend() {
  local decode
  decode=$(decode_gpu)
  step "ferry bench --contend" timeout 420 "$here/ferry" bench --contend \
    --prefill-gpu 0 --decode-gpu "$decode" --workloads kv-llama70b-4k,kv-layerwise \
    --kernel-max-sms 8,16,32,66,all --json "$logs/contend.json"
}

# Multi-pair ferry bench: one process per rank, every rank writing at once. The shapes that fit
# the GPUs this machine has; several ranks may share a GPU.
pairs() {
  local gpus
  # The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else all nvidia-smi lists.
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    gpus=$(gpu_count)
  fi
  if [ "$gpus" -lt 2 ]; then
    echo "FAIL bench pairs: need 2 or more GPUs, found $gpus" >>"$summary"
    status=1
    return
  fi
  local bench=("$here/ferry" bench --json)
  if [ "$gpus" -ge 8 ]; then
    step "bench pairs 4P4D TP4->TP4" timeout 300 "${bench[@]}" "$logs/pairs-4p4d-tp4-tp4.json" --prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7
    step "bench pairs 4P4D TP4->TP2" timeout 300 "${bench[@]}" "$logs/pairs-4p4d-tp4-tp2.json" --prefill-gpus 0,1,2,3 --decode-gpus 4,5
    step "bench pairs 2P2D TP2->TP2" timeout 300 "${bench[@]}" "$logs/pairs-2p2d-tp2-tp2.json" --prefill-gpus 0,1 --decode-gpus 2,3
  elif [ "$gpus" -ge 4 ]; then
    step "bench pairs 2P2D TP2->TP2" timeout 300 "${bench[@]}" "$logs/pairs-2p2d-tp2-tp2.json" --prefill-gpus 0,1 --decode-gpus 2,3
    step "bench pairs 2P2D TP2->TP1" timeout 300 "${bench[@]}" "$logs/pairs-2p2d-tp2-tp1.json" --prefill-gpus 0,1 --decode-gpus 2
  fi
  step "bench pairs TP2 on GPU0 -> TP2 on GPU1" timeout 300 "${bench[@]}" "$logs/pairs-tp2-tp2.json" --prefill-gpus 0,0 --decode-gpus 1,1
  step "bench pairs TP2 on GPU0 -> TP1 on GPU1" timeout 300 "${bench[@]}" "$logs/pairs-tp2-tp1.json" --prefill-gpus 0,0 --decode-gpus 1
  step "bench pairs TP1 on GPU0 -> TP2 on GPU1" timeout 300 "${bench[@]}" "$logs/pairs-tp1-tp2.json" --prefill-gpus 0 --decode-gpus 1,1
  step "bench pairs TP1 on GPU0 -> TP4 on GPU1" timeout 300 "${bench[@]}" "$logs/pairs-tp1-tp4.json" --prefill-gpus 0 --decode-gpus 1,1,1,1
  step "bench pairs both ways GPU0 <-> GPU1" timeout 300 "${bench[@]}" "$logs/pairs-both-ways.json" --prefill-gpus 0,1 --decode-gpus 1,0
  step "bench pairs TP4 on GPU0 -> TP4 on GPU1 (the 4P4D pair shape)" timeout 300 "${bench[@]}" "$logs/pairs-tp4-tp4-2gpu.json" --prefill-gpus 0,0,0,0 --decode-gpus 1,1,1,1
}

case ${2:-all} in
  tests) tests ;;
  containers) containers ;;
  bench) bench ;;
  host) host_cost ;;
  contend) contend ;;
  pairs) pairs ;;
  *) tests; containers; bench; host_cost; contend; pairs ;;
esac
{
  echo
  grep -E "^(=====|test result|verified:|[0-9.]+ GB/s|prefill|decode|cuda:|gpu |  gpu|  nvlink|  tcp|peer_copy|path |  p[0-9]|  pair|workload|contiguous|blocks-|kv-llama|small-write|bf16 GEMM|tp_demo|decode [0-9]|prefill [0-9])" "$full"
} >>"$summary"
cat "$summary"
exit $status
