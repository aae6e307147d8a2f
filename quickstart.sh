#!/usr/bin/env bash
# Sets up and runs Airlock on this machine: builds the guest kernel, the base image, the
# binaries and the Python SDK (each cached by its inputs), starts airlockd on its default socket
# (unless one already answers there), makes the template `base` once, and runs the README's
# Python quickstart (sdk/python/examples/quickstart.py): Python inside a microVM prints 42.
# Needs root (for apt, /dev/kvm, cgroups and the image build). KEEP_DAEMON=1 leaves the daemon
# it started running.
set -euo pipefail

root=$(cd "$(dirname "$0")" && pwd)
cd "$root"

build() {
  echo "== guest kernel (first build: minutes)" >&2
  AIRLOCK_KERNEL=$(kernel-config/build.sh | tail -n1)
  echo "== base image" >&2
  AIRLOCK_ROOTFS=$(rootfs/build.sh | tail -n1)
  export AIRLOCK_KERNEL AIRLOCK_ROOTFS
  echo "== binaries" >&2
  cargo build --release -q -p airlock-vmm -p airlockd -p airlock-cli
  echo "== Python SDK" >&2
  python=$(sdk/python/venv.sh | tail -n1)
}

airlock=target/release/airlock
daemon_pid=

start_daemon() {
  if "$airlock" ls >/dev/null 2>&1; then
    echo "== airlockd is already running at ${AIRLOCK_ADDR:-its default socket}; using it" >&2
    return
  fi
  echo "== starting airlockd (log: /tmp/airlockd-quickstart.log)" >&2
  target/release/airlockd >/tmp/airlockd-quickstart.log 2>&1 &
  daemon_pid=$!
  if [[ -z ${KEEP_DAEMON:-} ]]; then
    trap stop_daemon EXIT
  fi
  for _ in $(seq 100); do
    "$airlock" ls >/dev/null 2>&1 && return
    kill -0 "$daemon_pid" 2>/dev/null || { tail -20 /tmp/airlockd-quickstart.log >&2; exit 1; }
    sleep 0.1
  done
  echo "airlockd did not answer within 10 s" >&2
  exit 1
}

stop_daemon() {
  if [[ -n $daemon_pid ]]; then
    echo "== stopping airlockd" >&2
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
}

ensure_template() {
  if ! "$airlock" template ls | awk '{print $1}' | grep -qx base; then
    echo "== template base: a cold boot, a warm-up and a snapshot (about 90 s on nested KVM)" >&2
    "$airlock" template create base >/dev/null
  fi
}

run_code() {
  echo "== running Python in a sandbox (sdk/python/examples/quickstart.py)" >&2
  echo "   (on nested-KVM build machines the guest kernel is emulated: expect about a minute)" >&2
  "$python" sdk/python/examples/quickstart.py
}

scripts/install-deps.sh
build
start_daemon
ensure_template
run_code
