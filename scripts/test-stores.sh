#!/usr/bin/env bash
# Runs the metadata-store tests against real servers: starts etcd and redis on free ports of
# 127.0.0.1 with their data in a temporary directory, runs the tests built with
# `--features etcd,redis`, and stops both servers by PID whatever happens.
# Needs `etcd` and `redis-server` on PATH (Debian: etcd-server, redis-server) and protoc.
set -euo pipefail
cd "$(dirname "$0")/.."
data=$(mktemp -d)
pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$data"
}
trap stop EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Waits until something accepts connections on 127.0.0.1:$1, for up to 20 s.
wait_port() {
  for _ in $(seq 1 200); do
    if python3 -c "import socket, sys; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  echo "nothing listens on 127.0.0.1:$1 after 20 s" >&2
  return 1
}

etcd_port=$(free_port)
peer_port=$(free_port)
etcd --name ferry-test --data-dir "$data/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "ferry-test=http://127.0.0.1:$peer_port" >"$data/etcd.log" 2>&1 &
pids+=($!)
redis_port=$(free_port)
redis-server --bind 127.0.0.1 --port "$redis_port" --dir "$data" --save "" --appendonly no \
  >"$data/redis.log" 2>&1 &
pids+=($!)
wait_port "$etcd_port" || { cat "$data/etcd.log"; exit 1; }
wait_port "$redis_port" || { cat "$data/redis.log"; exit 1; }
echo "etcd on 127.0.0.1:$etcd_port, redis on 127.0.0.1:$redis_port"

export FERRY_TEST_ETCD="etcd://127.0.0.1:$etcd_port/ferry-test"
export FERRY_TEST_REDIS="redis://127.0.0.1:$redis_port/0"
cargo test -p ferry-cli --features etcd,redis --test stores -- --test-threads=1
cargo test -p ferry-metadata --features etcd,redis
