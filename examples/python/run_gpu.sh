#!/usr/bin/env bash
# Runs disagg_llama.py on a CUDA machine with PyTorch's default allocator (cudaMalloc) and with
# expandable segments (VMM memory), in bf16 and fp32: four separate invocations, each bounded by
# `timeout`. Logs go to the folder given as $1; further arguments go to every invocation
# (e.g. --prefill-gpu 0 --decode-gpu 1). Needs a python3 (or $PYTHON) that imports torch,
# transformers and ferry_kv. Exits 1 if any invocation failed or found a prompt that differs.
set -u
logs=${1:?usage: run_gpu.sh LOG_DIR [disagg_llama.py options]}
shift
mkdir -p "$logs"
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
limit=${RUN_TIMEOUT:-360}

{
    nvidia-smi -L
    "$python" -c 'import torch, transformers, ferry_kv
print("python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "transformers", transformers.__version__, "cuda devices", torch.cuda.device_count())'
} > "$logs/versions.txt" 2>&1
status=$?
cat "$logs/versions.txt"
[ $status -eq 0 ] || { echo "torch, transformers or ferry_kv is missing; see above"; exit 1; }

failed=0
for allocator in default expandable_segments; do
    for dtype in bf16 fp32; do
        log="$logs/$allocator-$dtype.log"
        if [ "$allocator" = default ]; then
            alloc_env=(-u PYTORCH_CUDA_ALLOC_CONF)
        else
            alloc_env=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
        fi
        env "${alloc_env[@]}" FERRY_LOG="${FERRY_LOG:-info}" PYTHONUNBUFFERED=1 \
            timeout --kill-after=15 "$limit" \
            "$python" "$here/disagg_llama.py" --device cuda --dtype "$dtype" "$@" > "$log" 2>&1
        code=$?
        echo "$allocator $dtype: exit $code, $(grep -c ': IDENTICAL' "$log") IDENTICAL, $(grep -c ': DIFFERENT' "$log") DIFFERENT ($log)"
        grep ': IDENTICAL\|: DIFFERENT' "$log"
        [ $code -eq 0 ] || failed=1
    done
done
exit $failed
