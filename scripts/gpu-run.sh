#!/usr/bin/env bash
# Runs the GPU suite that scripts/gpu-build.sh collected, on the GPU machine. Writes two files
# into LOG_DIR (first argument, else $OUT, else dist/gpu/logs): summary.txt (one line per
# step, then every test binary's result line) and full.log (everything every step printed).
# Exits non-zero when any step failed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:-${OUT:-$here/logs}}
mkdir -p "$logs"
export FERRY_BIN="$here/ferry"
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

step nvidia-smi nvidia-smi
step probe "$here/ferry" probe
# Each test binary, and each GPU test on its own, under a time limit: a hang is reported as
# a failure (exit 124) instead of eating the whole session.
for test in "$here"/tests/*; do
  case $(basename "$test") in
    gpu-*)
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
step "ferry bench" timeout 420 "$here/ferry" bench --paths auto,kernel,copy-engine,batched \
  --json "$logs/bench.json" --plot "$logs/bench.svg"
step "ferry bench over tcp" timeout 300 "$here/ferry" bench --tcp --iterations 3 \
  --workloads contiguous,kv-llama70b-4k,blocks-1m,small-write
{
  echo
  grep -E "^(=====|test result|verified:|[0-9.]+ GB/s|prefill|decode|cuda:|gpu |  gpu|  nvlink|  tcp|peer_copy|workload|contiguous|blocks-|kv-llama|small-write|tp_demo|decode [0-9]|prefill [0-9])" "$full"
} >>"$summary"
cat "$summary"
exit $status
