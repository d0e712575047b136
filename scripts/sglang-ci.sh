#!/usr/bin/env bash
# SGLang's own Mooncake disaggregation code (its KV manager, sender, receiver and bootstrap
# server, sglang 0.5.23 unmodified) between two processes on host memory, with ferry's wheel
# answering `from mooncake.engine import TransferEngine`: every KV page and metadata row is
# checked byte for byte, and then a decode killed mid-request must fail every request promptly.
# Usage: scripts/sglang-ci.sh WHEEL   (a ferry_kv wheel, e.g. from scripts/python-wheel.sh)
# Needs python3 with venv and PyPI (about 3 GB of wheels: torch and its CUDA libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$1
venv=${CARGO_TARGET_DIR:-target}/sglang-venv
here=crates/python/tests/sglang
python3 -m venv --clear "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$here/requirements.txt"
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" --no-deps --force-reinstall "$wheel"
"$venv/bin/python" "$here/sglang_disagg_cpu.py"
"$venv/bin/python" "$here/sglang_disagg_cpu.py" --kill-decode
