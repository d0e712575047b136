#!/usr/bin/env bash
# Which PID-namespace layouts let a CUDA IPC handle (cudaMalloc memory) cross between a decode
# and a prefill process: each side in its own PID namespace, as PID 1 (the program itself) or
# as PID 2 (under a shell that stays PID 1), every combination, cudaMalloc pools only, every
# block verified by the decode side. Runs as root on the GPU machine from the folder
# scripts/gpu-build.sh fills (dist/gpu/), as containers.sh does.
# Usage: ipc-pid-namespaces.sh [LOG_DIR]
# Writes LOG_DIR/ipc-pid.txt (one row per layout: the transport the prefill took, and the
# mapping error when it fell back to TCP) and LOG_DIR/ipc-pid.log (all output).
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:-${OUT:-$here/logs}}
mkdir -p "$logs"
table="$logs/ipc-pid.txt"
log="$logs/ipc-pid.log"
: >"$table"
: >"$log"
work=$(mktemp -d /var/tmp/ferry-ipc-pid.XXXXXX)
shape=(--layers 4 --pool-blocks 512 --request-blocks 128 --gpu 0)

# wrap AS: the command words that start a program as PID 1 or PID 2 of a new PID namespace,
# or ("host") in this one. As PID 2 the shell stays PID 1: `; exit` keeps it from replacing
# itself with the program.
wrap() {
  case $1 in
    1) wrapper=(unshare -p -f --mount-proc --) ;;
    2) wrapper=(unshare -p -f --mount-proc -- sh -c '"$@"; exit $?' sh) ;;
    *) wrapper=(env) ;;
  esac
}

# run DECODE_AS PREFILL_AS: one transfer of two requests, each side started by `wrap`.
run() {
  local decode_as=$1 prefill_as=$2 dir="$work/$1-$2"
  mkdir -p "$dir"
  echo "===== decode as PID $decode_as, prefill as PID $prefill_as" >>"$log"
  wrap "$decode_as"
  timeout 120 "${wrapper[@]}" "$here/decode" "${shape[@]}" --listen 127.0.0.1:0 \
    --reply-to 127.0.0.1:17321 --requests 2 >"$dir/decode.out" 2>"$dir/decode.err" </dev/null &
  local decode=$! segment=""
  for _ in $(seq 1 300); do
    segment=$(sed -n 's/^segment: //p' "$dir/decode.out" 2>/dev/null)
    [ -n "$segment" ] && break
    kill -0 "$decode" 2>/dev/null || break
    sleep 0.1
  done
  local transport="-" verified=false reason="-"
  if [ -n "$segment" ]; then
    wrap "$prefill_as"
    timeout 90 "${wrapper[@]}" "$here/prefill" "${shape[@]}" --listen 127.0.0.1:17321 \
      --peer "$segment" --requests 2 >"$dir/prefill.out" 2>"$dir/prefill.err"
    wait "$decode"
    transport=$(sed -n 's/^transport: //p' "$dir/prefill.out" | sort -u | tr '\n' ' ')
    grep -q '^verified: true' "$dir/decode.out" && verified=true
    reason=$(grep -ho 'failed with [A-Z_]* ([0-9]*)' "$dir/prefill.err" | sort -u | head -1)
  else
    reason="decode did not start"
  fi
  kill "$decode" 2>/dev/null
  wait "$decode" 2>/dev/null
  for file in "$dir"/*; do
    echo "--- $(basename "$file")" >>"$log"
    grep -v '^$' "$file" | tail -n 30 >>"$log"
  done
  printf 'decode as %-4s prefill as %-4s transport=%-8s verified=%-5s %s\n' \
    "$decode_as" "$prefill_as" "${transport% }" "$verified" "${reason:--}" >>"$table"
}

run host host
for decode_as in 1 2; do
  for prefill_as in 1 2 host; do
    run "$decode_as" "$prefill_as"
  done
done
run host 1
run host 2
rm -rf "$work"
cat "$table"
