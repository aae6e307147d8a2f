#!/usr/bin/env bash
# The test command: installs the Debian packages it needs, builds every artifact the tests need
# (guest kernel, base image, binaries), then runs formatting and lint checks, unit tests, KVM
# micro tests, system tests, the Python SDK and CLI tests (pytest against a live airlockd), and a
# short run of every fuzz target.
# Artifacts are cached under ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}, keyed by their inputs.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Everything from Debian that the builds and the tests need (idempotent, quiet when present).
install_packages() {
  echo "== Debian packages (scripts/install-deps.sh --tests)" >&2
  scripts/install-deps.sh --tests
}

build_artifacts() {
  echo "== guest kernel" >&2
  AIRLOCK_KERNEL=$(kernel-config/build.sh | tail -n1)
  echo "== base image" >&2
  AIRLOCK_ROOTFS=$(rootfs/build.sh | tail -n1)
  echo "== registry software of the package tests (tests/registries.sh)" >&2
  local registries
  registries=$(tests/registries.sh | tail -n2)
  AIRLOCK_PYPISERVER=$(head -n1 <<<"$registries")
  AIRLOCK_VERDACCIO=$(tail -n1 <<<"$registries")
  export AIRLOCK_KERNEL AIRLOCK_ROOTFS AIRLOCK_PYPISERVER AIRLOCK_VERDACCIO
  echo "kernel: $AIRLOCK_KERNEL" >&2
  echo "rootfs: $AIRLOCK_ROOTFS" >&2
}

# The agent's cgroup tests need a writable cgroup v2 hierarchy. Hybrid-mode hosts (cgroup v1
# controllers, as on the build machines) mount it at /sys/fs/cgroup/unified; mount it there when
# no cgroup2 is mounted at all and we are root.
ensure_cgroup2() {
  if ! awk '$3 == "cgroup2" { found = 1 } END { exit !found }' /proc/self/mounts; then
    if [[ $(id -u) == 0 ]]; then
      echo "== mounting cgroup2 at /sys/fs/cgroup/unified" >&2
      mkdir -p /sys/fs/cgroup/unified
      mount -t cgroup2 none /sys/fs/cgroup/unified
    fi
  fi
}

static_checks() {
  echo "== fmt, clippy" >&2
  cargo fmt --all -- --check
  cargo clippy --workspace --all-targets -- -D warnings
}

run_tests() {
  echo "== tests" >&2
  # The system tests start the binaries (airlock-vmm, airlockd), which `cargo test` alone
  # does not build for packages without integration tests.
  cargo build --workspace --bins
  cargo test --workspace -- --nocapture
}

# The Python SDK and the `airlock` CLI against a live airlockd (sdk/python/tests; the daemon
# fixture uses the debug binaries that run_tests built).
sdk_tests() {
  echo "== Python SDK and CLI tests" >&2
  local python
  python=$(sdk/python/venv.sh | tail -n1)
  "$(dirname "$python")/pytest" -q -rA sdk/python/tests
}

install_packages
# Every fuzz target for a short while from its seeds (fuzz/run.sh; a longer run: fuzz/run.sh 600).
fuzz_smoke() {
  echo "== fuzz smoke (${AIRLOCK_FUZZ_SECONDS:-10} s per target)" >&2
  fuzz/run.sh "${AIRLOCK_FUZZ_SECONDS:-10}"
}

build_artifacts
ensure_cgroup2
static_checks
run_tests
sdk_tests
fuzz_smoke
