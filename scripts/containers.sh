#!/usr/bin/env bash
# The namespace matrix: a decode and a prefill process started as two "containers" would be,
# each layout with cudaMalloc and with VMM memory, every block verified by the decode side.
# Runs as root on the GPU machine, from the folder scripts/gpu-build.sh fills (dist/gpu/).
# Usage: containers.sh [LOG_DIR] [PREFILL_GPU DECODE_GPU]   (GPUs 0 0 by default)
# MEMORY="cuda vmm" (the default) picks the memory kinds; "host" runs the layouts without a GPU
# (the notification path still crosses the fd socket, so the socket-directory rows mean
# something there too). LAYOUTS="pod-dir-secret pod-dir ..." runs only the layouts named;
# REQUESTS (5 by default) sets the requests per case, whose median GB/s after the first each
# row gives. SHAPE sets the request's shape (see below). STAGING (auto by default) sets the
# engines' FERRY_CUDA_MALLOC_STAGING.
# Writes LOG_DIR/containers.txt (one row per case) and LOG_DIR/containers.log (all output);
# exits non-zero when any case failed to verify, hung, fell back to TCP without saying why, or
# (the socket-directory rows) did not take the path its layout must take.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:-${OUT:-$here/logs}}
prefill_gpu=${2:-0}
decode_gpu=${3:-0}
mkdir -p "$logs"
table="$logs/containers.txt"
log="$logs/containers.log"
: >"$table"
: >"$log"
status=0

# Outside /tmp (one layout mounts a private /tmp) and readable by other users (one layout
# runs prefill as nobody).
bin=/opt/ferry-containers
rm -rf "$bin"
mkdir -p "$bin"
cp "$here/decode" "$here/prefill" "$here/ferry" "$bin/"
chmod 755 "$bin" "$bin"/*
work=$(mktemp -d /var/tmp/ferry-containers.XXXXXX)
chmod 755 "$work"

# cudaMalloc memory whose IPC handle does not open (equal PIDs) goes through the owner's
# staging buffer in every row (the engines' FERRY_CUDA_MALLOC_STAGING, auto as by default);
# STAGING=never runs the matrix without it.
export FERRY_CUDA_MALLOC_STAGING=${STAGING:-auto}
case $FERRY_CUDA_MALLOC_STAGING in
  never | auto | always) ;;
  *) echo "containers.sh: STAGING=$FERRY_CUDA_MALLOC_STAGING is none of never, auto, always" >&2; exit 2 ;;
esac
# SHAPE (decode and prefill's shape options) replaces the small default, for figures of a
# larger request on a few layouts.
read -r -a shape <<<"${SHAPE:---layers 4 --pool-blocks 512 --request-blocks 128}"
# Requests per case: the first warms up; the row's GB/s is the median of the others, so that
# a layout's figure can stand beside the plain processes' at the same shape.
requests=${REQUESTS:-5}
private_tmp='mount -t tmpfs ferry-tmp /tmp && exec "$0" "$@"'
# The program as PID 2 of a new PID namespace: the shell stays PID 1 (`; exit` keeps it from
# replacing itself with the program). No `--`: run_case splits its wrappers there.
as_pid2=(unshare -p -f --mount-proc sh -c '"$@"; exit $?' sh)
# A pod's own host name (UTS namespace) and private /tmp, then the program.
decode_pod='hostname decode-pod && mount -t tmpfs ferry-tmp /tmp && exec "$0" "$@"'
prefill_pod='hostname prefill-pod && mount -t tmpfs ferry-tmp /tmp && exec "$0" "$@"'
own_hostname='hostname "ferry-$$" && exec "$0" "$@"'
netns_ready=false
# The two-pod rows' hostPath volume: one directory both "pods" see at the same path, where each
# engine serves its fd socket as a file (FERRY_SOCKET_DIR). Sticky and open to all users, as a
# hostPath shared by pods of different runAsUser is; at most 63 bytes long.
sockets="$work/sockets"
mkdir -p "$sockets"
chmod 1777 "$sockets"
# The two-pod rows' shared secret, as a Kubernetes Secret would put it in FERRY_SECRET.
secret=$("$bin/ferry" secret)
# A pod's own host name and private /tmp, then the program as user $2 (a pod's runAsUser).
pod_as() {
  echo "hostname $1 && mount -t tmpfs ferry-tmp /tmp && exec setpriv --reuid=$2 --regid=$2 --clear-groups \"\$0\" \"\$@\""
}
# The same, but the program runs as PID 2 of the pod's PID namespace under a shell that stays
# PID 1 (as under an init such as tini): the two pods' processes then have different PIDs,
# which decides whether CUDA IPC handles cross (docs/containers.md, rows pid-*).
pod_as_child() {
  echo "hostname $1 && mount -t tmpfs ferry-tmp /tmp && setpriv --reuid=$2 --regid=$2 --clear-groups \"\$0\" \"\$@\"; exit \$?"
}
# Inside each network namespace; `env -u` keeps a wrapped ip's library path out of ferry.
in_d=(ip netns exec ferry-d env -u LD_LIBRARY_PATH)
in_p=(ip netns exec ferry-p env -u LD_LIBRARY_PATH)

setup_netns() {
  command -v ip >/dev/null || { echo "no ip command (iproute2)" >>"$log"; return 1; }
  ip netns del ferry-d 2>/dev/null
  ip netns del ferry-p 2>/dev/null
  ip netns add ferry-d && ip netns add ferry-p &&
    ip link add ferry-vd type veth peer name ferry-vp &&
    ip link set ferry-vd netns ferry-d && ip link set ferry-vp netns ferry-p &&
    ip -n ferry-d addr add 10.231.0.1/24 dev ferry-vd &&
    ip -n ferry-p addr add 10.231.0.2/24 dev ferry-vp &&
    ip -n ferry-d link set ferry-vd up && ip -n ferry-p link set ferry-vp up &&
    ip -n ferry-d link set lo up && ip -n ferry-p link set lo up
}

teardown_netns() {
  ip netns del ferry-d 2>/dev/null
  ip netns del ferry-p 2>/dev/null
}

# Whether LAYOUT is one LAYOUTS asks for (all when LAYOUTS is unset).
wanted() {
  [ -z "${LAYOUTS:-}" ] || [[ " $LAYOUTS " == *" $1 "* ]]
}

# run_case LAYOUT MEMORY LISTEN DECODE_WRAPPER... -- PREFILL_WRAPPER...
run_case() {
  local layout=$1 memory=$2 listen=$3
  shift 3
  wanted "$layout" || return 0
  local decode_wrap=() prefill_wrap=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do decode_wrap+=("$1"); shift; done
  shift
  prefill_wrap=("$@")
  # With CUDA_VISIBLE_DEVICES narrowed, each process sees its one GPU as GPU 0.
  local on_decode=$decode_gpu on_prefill=$prefill_gpu
  [ "$layout" = visible-gpu ] && on_decode=0 on_prefill=0
  local decode_memory=(--gpu "$on_decode") prefill_memory=(--gpu "$on_prefill")
  case $memory in
    vmm) decode_memory+=(--vmm-pieces 2) prefill_memory+=(--vmm-pieces 2) ;;
    host) decode_memory=() prefill_memory=() ;;
  esac
  # The decode side answers only the prefill engine it is told about (never a notification's
  # claimed sender), so the prefill listens at a known address.
  local prefill_listen=127.0.0.1:17321
  [ "${listen%%:*}" = 10.231.0.1 ] && prefill_listen=10.231.0.2:17321
  local case_dir="$work/$layout-$memory"
  mkdir -p "$case_dir"
  chmod 777 "$case_dir"
  local started=$SECONDS
  {
    echo "===== $layout / $memory"
    echo "decode:  ${decode_wrap[*]} decode --listen $listen"
    echo "prefill: ${prefill_wrap[*]} prefill"
  } >>"$log"
  timeout 150 "${decode_wrap[@]}" "$bin/decode" "${shape[@]}" "${decode_memory[@]}" \
    --listen "$listen" --reply-to "$prefill_listen" --requests "$requests" \
    >"$case_dir/decode.out" 2>"$case_dir/decode.err" </dev/null &
  local decode_pid=$!
  local segment=""
  for _ in $(seq 1 300); do
    segment=$(sed -n 's/^segment: //p' "$case_dir/decode.out" 2>/dev/null)
    [ -n "$segment" ] && break
    kill -0 "$decode_pid" 2>/dev/null || break
    sleep 0.1
  done
  local probe_route="-" transport="-" verified="false" outcome="FAIL" reason="-" notify="-" gbps="-"
  if [ -z "$segment" ]; then
    reason="decode did not start"
  else
    timeout 60 "${prefill_wrap[@]}" "$bin/ferry" probe --peer "$segment" >"$case_dir/probe.out" 2>"$case_dir/probe.err"
    # The transport the probe names for the peer's buffers from the GPUs here.
    probe_route=$(awk '/^  from gpu/ { gpu = 1; next } /^  from / { gpu = 0 }
      gpu && /^    buffer/ { sub(/.*\): /, ""); print $1 }' "$case_dir/probe.out" | sort -u | tr '\n' ' ')
    timeout 120 "${prefill_wrap[@]}" "$bin/prefill" "${shape[@]}" "${prefill_memory[@]}" \
      --listen "$prefill_listen" --peer "$segment" --requests "$requests" \
      >"$case_dir/prefill.out" 2>"$case_dir/prefill.err"
    local prefill_status=$?
    wait "$decode_pid"
    local decode_status=$?
    transport=$(sed -n 's/^transport: //p' "$case_dir/prefill.out" | sort -u | tr '\n' ' ')
    gbps=$(awk '/^request [0-9]+:/ && $2 != "0:" { print $NF }' "$case_dir/prefill.out" | sort -g |
      awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "-" }')
    grep -q '^verified: true' "$case_dir/decode.out" && verified=true
    reason=$(grep -ho 'mapping the peer.s [^)]*([^)]*)' "$case_dir/prefill.err" | sort -u | head -1)
    reason=${reason:--}
    # Notifications go through the shared-memory ring handed over the fd socket unless either
    # side logged that they took the control connection instead.
    notify=ring
    grep -q 'notifications to this peer go over the control connection' \
      "$case_dir/prefill.err" "$case_dir/decode.err" && notify=tcp
    # What the socket-directory rows must show: with a secret (or one user) the directory
    # carries VMM memory, cudaMalloc memory (mapped, or with staging on through the owner's
    # staging buffer where the PIDs clash) and notifications; users that differ without a
    # secret share nothing.
    local must_transport="" must_notify=""
    case $layout in
      pod-dir-secret | pod-dir-same-uid | pod-dir-secret-pid2 | pod-dir-restart | uid-secret) must_notify=ring
        [ "$memory" = vmm ] && must_transport=nvlink
        [ "$memory" = cuda ] && [ "$FERRY_CUDA_MALLOC_STAGING" != never ] && must_transport=nvlink ;;
      pod-dir) must_notify=tcp
        [ "$memory" != host ] && must_transport=tcp ;;
    esac
    if [ "$prefill_status" -ne 0 ] || [ "$decode_status" -ne 0 ] || [ "$verified" != true ]; then
      reason="prefill exit $prefill_status, decode exit $decode_status; $reason"
    elif [ "$memory" != host ] && [[ "$transport" == *tcp* ]] && [ "$reason" = - ]; then
      reason="fell back to tcp without a logged cause"
    elif [ -n "$must_transport" ] && [ "${transport% }" != "$must_transport" ]; then
      reason="took ${transport% } where this layout must take $must_transport; $reason"
    elif [ -n "$must_notify" ] && [ "$notify" != "$must_notify" ]; then
      reason="notifications took $notify where this layout must take $must_notify; $reason"
    elif [ "$stale_socket" = - ]; then
      reason="no socket file was left to clean up: planting it failed (see containers.log)"
    elif [ -n "$stale_socket" ] && [ -e "$stale_socket" ]; then
      reason="the killed engine's socket file $(basename "$stale_socket") was left in the directory"
    else
      outcome=ok
    fi
  fi
  kill "$decode_pid" 2>/dev/null
  wait "$decode_pid" 2>/dev/null
  for file in "$case_dir"/*; do
    echo "--- $(basename "$file")" >>"$log"
    grep -v '^$' "$file" | tail -n 40 >>"$log"
  done
  [ "$outcome" = ok ] || status=1
  printf '%-4s %-19s %-6s transport=%-8s probe=%-8s notify=%-4s verified=%-5s gbps=%-8s %3ss  %s\n' \
    "$outcome" "$layout" "$memory" "${transport% }" "${probe_route% }" "$notify" "$verified" "$gbps" \
    "$((SECONDS - started))" "$reason" >>"$table"
  rm -f "$sockets"/ferry-*.sock
  stale_socket=""
}

# A socket file left in the shared directory by a decode pod's engine killed with SIGKILL (a
# restarted container), aged past the minute the engines leave young files alone; run_case's
# next case fails unless that case's engines removed it (or when planting failed: `-`).
# Prints nothing; sets stale_socket.
stale_socket=""
plant_stale_socket() {
  local memory=$1
  local dir="$work/stale-$memory"
  mkdir -p "$dir"
  local memory_args=(--gpu "$decode_gpu")
  case $memory in
    vmm) memory_args+=(--vmm-pieces 2) ;;
    host) memory_args=() ;;
  esac
  rm -f "$sockets"/ferry-*.sock
  timeout 60 "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
    unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" \
    "$bin/decode" "${shape[@]}" "${memory_args[@]}" --listen 10.231.0.1:0 \
    --reply-to 10.231.0.2:17321 --requests 1 >"$dir/decode.out" 2>"$dir/decode.err" </dev/null &
  local wrapper=$!
  for _ in $(seq 1 300); do
    grep -q '^segment: ' "$dir/decode.out" 2>/dev/null && break
    kill -0 "$wrapper" 2>/dev/null || break
    sleep 0.1
  done
  pkill -KILL -f "^$bin/decode "
  # Bounded by its timeout should nothing have matched (the decode never started).
  wait "$wrapper" 2>/dev/null
  pkill -KILL -f "^$bin/decode "
  local left=("$sockets"/ferry-*.sock)
  if [ "${#left[@]}" -eq 1 ] && [ -S "${left[0]}" ]; then
    touch -h -d '2 minutes ago' "${left[0]}"
    stale_socket=${left[0]}
    echo "planted: the killed decode engine left $(basename "$stale_socket")" >>"$log"
  else
    echo "planting a stale socket failed: found ${left[*]}" >>"$log"
    stale_socket=-
  fi
}

for memory in ${MEMORY:-cuda vmm}; do
  run_case host "$memory" 127.0.0.1:0 env -- env
  run_case pid "$memory" 127.0.0.1:0 unshare -p -f --mount-proc -- unshare -p -f --mount-proc
  # The same with either side or both as PID 2 of its namespace (a shell stays PID 1): equal
  # PID numbers, not separate namespaces, decide whether a CUDA IPC handle crosses.
  run_case pid-1-2 "$memory" 127.0.0.1:0 unshare -p -f --mount-proc -- "${as_pid2[@]}"
  run_case pid-2-1 "$memory" 127.0.0.1:0 "${as_pid2[@]}" -- unshare -p -f --mount-proc
  run_case pid-2-2 "$memory" 127.0.0.1:0 "${as_pid2[@]}" -- "${as_pid2[@]}"
  run_case mount "$memory" 127.0.0.1:0 unshare -m sh -c "$private_tmp" -- unshare -m sh -c "$private_tmp"
  run_case ipc "$memory" 127.0.0.1:0 unshare -i -- unshare -i
  run_case visible-gpu "$memory" 127.0.0.1:0 env CUDA_VISIBLE_DEVICES="$decode_gpu" -- env CUDA_VISIBLE_DEVICES="$prefill_gpu"
  run_case uid "$memory" 127.0.0.1:0 env -- setpriv --reuid=65534 --regid=65534 --clear-groups
  run_case uts "$memory" 127.0.0.1:0 unshare -u sh -c "$own_hostname" -- unshare -u sh -c "$own_hostname"
  # Different users with a shared secret: the secret, not the user, is the credential.
  run_case uid-secret "$memory" 127.0.0.1:0 env FERRY_SECRET="$secret" -- \
    env FERRY_SECRET="$secret" setpriv --reuid=65534 --regid=65534 --clear-groups
  # Two containers of one pod: their own PID, mount, IPC and UTS namespaces, one network.
  run_case pod-shared-net "$memory" 127.0.0.1:0 \
    unshare -p -f --mount-proc -i -u sh -c "$decode_pod" -- \
    unshare -p -f --mount-proc -i -u sh -c "$prefill_pod"
  if setup_netns; then
    netns_ready=true
    run_case net "$memory" 10.231.0.1:0 "${in_d[@]}" -- "${in_p[@]}"
    # Two pods: nothing shared.
    run_case pod "$memory" 10.231.0.1:0 \
      "${in_d[@]}" unshare -p -f --mount-proc -i -u sh -c "$decode_pod" -- \
      "${in_p[@]}" unshare -p -f --mount-proc -i -u sh -c "$prefill_pod"
    # Two pods with hostPID: only the PID namespace shared.
    run_case pod-host-pid "$memory" 10.231.0.1:0 \
      "${in_d[@]}" unshare -m -i -u sh -c "$decode_pod" -- \
      "${in_p[@]}" unshare -m -i -u sh -c "$prefill_pod"
    # Two pods of different users sharing one socket directory (a hostPath volume) and a
    # secret: docs/containers.md's pod YAML pair. Nothing else shared.
    run_case pod-dir-secret "$memory" 10.231.0.1:0 \
      "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" -- \
      "${in_p[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as prefill-pod 1002)"
    # The same with the prefill's program as PID 2 of its pod (the decode's is PID 1).
    run_case pod-dir-secret-pid2 "$memory" 10.231.0.1:0 \
      "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" -- \
      "${in_p[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as_child prefill-pod 1002)"
    # The decode pod restarted after a SIGKILL left its socket file: the new engine removes
    # that file (old enough, nothing listening) and the pair crosses as in pod-dir-secret.
    if wanted pod-dir-restart; then
      plant_stale_socket "$memory"
      run_case pod-dir-restart "$memory" 10.231.0.1:0 \
        "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
        unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" -- \
        "${in_p[@]}" env FERRY_SOCKET_DIR="$sockets" FERRY_SECRET="$secret" \
        unshare -p -f --mount-proc -i -u sh -c "$(pod_as prefill-pod 1002)"
    fi
    # The same without a secret: users that differ share nothing (TCP, with the cause).
    run_case pod-dir "$memory" 10.231.0.1:0 \
      "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" -- \
      "${in_p[@]}" env FERRY_SOCKET_DIR="$sockets" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as prefill-pod 1002)"
    # Without a secret but with one user: the socket files (mode 0o600) serve that user.
    run_case pod-dir-same-uid "$memory" 10.231.0.1:0 \
      "${in_d[@]}" env FERRY_SOCKET_DIR="$sockets" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as decode-pod 1001)" -- \
      "${in_p[@]}" env FERRY_SOCKET_DIR="$sockets" \
      unshare -p -f --mount-proc -i -u sh -c "$(pod_as prefill-pod 1001)"
    teardown_netns
  else
    echo "FAIL net/pod  $memory  network namespaces could not be set up (see containers.log)" >>"$table"
    status=1
  fi
done
[ "$netns_ready" = true ] || echo "network namespaces were not available" >>"$log"
cat "$table"
exit $status
