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
for test in "$here"/tests/*; do
  step "test $(basename "$test")" "$test" --test-threads=2
done
step pd_demo "$here/pd_demo"
{
  echo
  grep -E "^(test result|verified:|moved |prefill |cuda:)" "$full"
} >>"$summary"
cat "$summary"
exit $status
