#!/usr/bin/env bash
# The Python part of the GPU suite, run from the repository root on the GPU machine (root,
# Python 3.12 with torch, no network, no cargo) with dist/python/ carried from
# scripts/python-carry.sh. Installs the carried ferry wheel, then runs, each under a time limit:
#   - the host-memory pytest suite and the GPU pytest files (crates/python/tests/gpu);
#   - examples/python/run_gpu.sh, when the repository has it;
#   - python -m ferry_kv.bench on CUDA: ferry alone (SGLang's and vLLM's Mooncake patterns),
#     ferry through NIXL's API (pull and push)
#     beside it, with NIXL's own agent through the same calls when its files were carried
#     (scripts/python-carry.sh --nixl), then ferry and Mooncake in the same run
#     when Mooncake's files were carried; GPU 0 -> GPU 0 and, with two GPUs, GPU 0 -> GPU 1;
#   - the native `ferry bench --workloads kv-llama70b-4k,kv-llama70b-4k-runs` on the same GPUs.
# Usage: scripts/gpu-python.sh LOG_DIR [all|tests|bench]
# (`tests`: the pytest files and the model example; `bench`: the bench rows; `all` by default,
# split so that each part fits one call of a time-limited runner.)
# Writes LOG_DIR/summary.txt (one PASS/FAIL line per step, then the bench tables) and one log
# per step; prints the summary; exits non-zero when any step failed.
set -u
cd "$(dirname "$0")/.."
parts=${2:-all}
case $# in 1 | 2) ;; *) parts=usage ;; esac
case $parts in
  all | tests | bench) ;;
  *)
    echo "usage: scripts/gpu-python.sh LOG_DIR [all|tests|bench]" >&2
    exit 2
    ;;
esac
logs=$1
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
python=${PYTHON:-python3}
dist=dist/python
summary="$logs/summary.txt"
: >"$summary"
status=0
count=0

# step NAME COMMAND...: runs COMMAND, its output into LOG_DIR/NN-<name>.log, one summary line.
step() {
  local name=$1
  shift
  count=$((count + 1))
  local log
  log="$logs/$(printf %02d $count)-$(tr -c 'A-Za-z0-9.\n-' - <<<"$name").log"
  local started=$SECONDS
  echo "\$ $*" >"$log"
  "$@" >>"$log" 2>&1
  local code=$?
  if [ $code -eq 0 ]; then
    echo "PASS $name ($((SECONDS - started)) s)" | tee -a "$summary"
  else
    echo "FAIL $name ($((SECONDS - started)) s, exit $code; see $(basename "$log"))" | tee -a "$summary"
    status=1
  fi
}

# Ubuntu 24.04's system Python refuses plain `pip install` (PEP 668) unless told.
pip_install() {
  "$python" -m pip install --no-input --disable-pip-version-check "$@" ||
    "$python" -m pip install --no-input --disable-pip-version-check --break-system-packages "$@"
}

install_ferry() {
  local wheels=("$dist"/ferry_kv-*.whl)
  [ -f "${wheels[0]}" ] || { echo "no ferry wheel in $dist: run scripts/python-carry.sh here first and carry dist/python"; return 1; }
  pip_install --no-deps --force-reinstall "${wheels[0]}" &&
    (cd / && "$python" -c 'import ferry_kv, sys; print("ferry_kv", ferry_kv.__version__, "from", ferry_kv.__file__)')
}

# pytest from the carried wheels when the machine has none.
install_pytest() {
  if "$python" -c 'import pytest' 2>/dev/null; then
    "$python" -m pytest --version
  else
    pip_install --no-index --find-links "$dist/wheels" pytest
  fi
}

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "GPUs visible: $gpus" | tee -a "$summary"
step "nvidia-smi" nvidia-smi
step "install ferry wheel" install_ferry
step "install pytest" install_pytest
if [ "$parts" != bench ]; then
  step "pytest host-memory tests" timeout 600 "$python" -m pytest crates/python/tests -q -rs
  step "pytest GPU tests" env FERRY_GPU_TESTS=1 timeout 900 "$python" -m pytest crates/python/tests/gpu -q -rs

  if [ -f examples/python/run_gpu.sh ]; then
    step "examples/python/run_gpu.sh" timeout 1500 bash examples/python/run_gpu.sh "$logs/examples"
  else
    echo "---- examples/python/run_gpu.sh is not in this tree: not run" | tee -a "$summary"
  fi
fi
if [ "$parts" = tests ]; then
  exit $status
fi

# Folders unpacked below, removed on exit; libcudart's folder (from the Python nvidia package),
# which Mooncake's engine and UCX's CUDA module link.
unpacked=()
trap 'rm -rf "${unpacked[@]}"' EXIT
cudart=$("$python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null)

# Mooncake, when carried: its package on PYTHONPATH, the system libraries it links (from
# nixl's wheel) and libcudart on LD_LIBRARY_PATH.
mooncake_env=()
if [ -f "$dist/mooncake-0.3.14.tar.xz" ]; then
  mooncake_dir=$(mktemp -d /tmp/ferry-mooncake.XXXXXX)
  unpacked+=("$mooncake_dir")
  tar -C "$mooncake_dir" -xJf "$dist/mooncake-0.3.14.tar.xz"
  mooncake_env=(env
    "PYTHONPATH=$mooncake_dir/mooncake/site${PYTHONPATH:+:$PYTHONPATH}"
    "LD_LIBRARY_PATH=$mooncake_dir/mooncake/lib${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  step "import Mooncake's engine" "${mooncake_env[@]}" FERRY_MOONCAKE=0 MC_INTRANODE_NVLINK=1 \
    "$python" -c 'import mooncake.engine as m; print(m.__file__); assert m.__file__.endswith(".so")'
else
  echo "---- Mooncake was not carried (scripts/python-carry.sh --mooncake): ferry-only bench rows" | tee -a "$summary"
fi

# NIXL's own package, when carried, for the nixl bench step only: its unpacked wheel on
# PYTHONPATH (its libraries find each other, the UCX plugin and UCX's modules through $ORIGIN
# run paths) and libcudart on LD_LIBRARY_PATH. The bench imports it as nixl_cu13._api, a name
# ferry's `nixl` hook does not answer for.
nixl_env=()
if [ -f "$dist/nixl-cu13-1.5.1.tar.xz" ]; then
  nixl_dir=$(mktemp -d /tmp/ferry-nixl.XXXXXX)
  unpacked+=("$nixl_dir")
  tar -C "$nixl_dir" -xJf "$dist/nixl-cu13-1.5.1.tar.xz"
  nixl_env=(env
    "PYTHONPATH=$nixl_dir/nixl/site${PYTHONPATH:+:$PYTHONPATH}"
    "LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+${cudart:+:}$LD_LIBRARY_PATH}")
  step "NIXL's own agent with UCX" "${nixl_env[@]}" "$python" -c '
import nixl_cu13._api as m
print(m.__file__)
assert "/ferry-nixl." in m.__file__, "not the carried package"
agent = m.nixl_agent("check", m.nixl_agent_config(backends=["UCX"]))
assert "UCX" in agent.backends, agent.get_plugin_list()'
else
  echo "---- NIXL was not carried (scripts/python-carry.sh --nixl): its own bench rows are skipped" | tee -a "$summary"
fi

pairs=("0 0")
[ "$gpus" -ge 2 ] && pairs+=("0 1")
for pair in "${pairs[@]}"; do
  read -r prefill decode <<<"$pair"
  where="GPU$prefill->GPU$decode"
  bench=("$python" -m ferry_kv.bench --device cuda --prefill-gpu "$prefill" --decode-gpu "$decode")
  step "bench ferry, SGLang's and vLLM's patterns $where" timeout 600 "${bench[@]}" \
    --engines ferry,ferry-vllm --json "$logs/bench-ferry-$prefill-$decode.json"
  if [ ${#nixl_env[@]} -gt 0 ]; then
    step "bench nixl+nixl-own $where" timeout 900 "${nixl_env[@]}" "${bench[@]}" --api nixl \
      --require-all --json "$logs/bench-nixl-$prefill-$decode.json"
  else
    step "bench nixl $where" timeout 600 "${bench[@]}" --api nixl \
      --json "$logs/bench-nixl-$prefill-$decode.json"
  fi
  if [ ${#mooncake_env[@]} -gt 0 ]; then
    step "bench ferry+mooncake $where" timeout 900 "${mooncake_env[@]}" "${bench[@]}" \
      --engines ferry,mooncake,ferry-vllm,mooncake-vllm --require-all \
      --json "$logs/bench-both-$prefill-$decode.json"
    step "bench ferry+mooncake $where 8 threads" timeout 900 "${mooncake_env[@]}" "${bench[@]}" \
      --engines ferry,mooncake --require-all --threads 8 \
      --json "$logs/bench-both-8threads-$prefill-$decode.json"
  fi
  if [ -x "$dist/ferry" ]; then
    step "ferry bench kv-llama70b-4k $where" timeout 600 "$dist/ferry" bench \
      --workloads kv-llama70b-4k,kv-llama70b-4k-runs --prefill-gpu "$prefill" --decode-gpu "$decode" \
      --json "$logs/ferry-cli-$prefill-$decode.json"
  else
    echo "FAIL ferry bench $where: no $dist/ferry (run scripts/python-carry.sh here first)" | tee -a "$summary"
    status=1
  fi
done
[ "$gpus" -ge 2 ] || echo "---- one GPU: the GPU0->GPU1 rows are owed on a two-GPU machine" | tee -a "$summary"

{
  echo
  echo "==== bench tables"
  for log in "$logs"/*bench*.log; do
    [ -f "$log" ] || continue
    echo "-- $(basename "$log")"
    grep -E "^(kv-llama70b-4k|engine|ferry|mooncake|nixl|ratio|  *tensor|workload|peer_copy|d2d|verified)|GB/s" "$log"
  done
} >>"$summary"
echo
sed -n '/^==== bench tables/,$p' "$summary"
exit $status
