#!/usr/bin/env bash
# The test command: installs the Debian packages it needs, builds every artifact the tests need
# (guest kernel, base and code-interpreter images, binaries), then runs formatting and lint
# checks, unit tests, KVM micro tests and a short run of every fuzz target (while the shared test
# template boots in the background, and the code-interpreter template is imported or built),
# then the system tests and the Python SDK and CLI tests (pytest against a live airlockd), then
# the code interpreter's system tests. At its end (pass or fail) it prints a timing table: each stage,
# each test binary, the ten slowest tests and the total (tests/times.py; also written as JSON to
# target/test-times.json), with a warning when the run passes its budget.
#
#   ./tests/run.sh           the default run (CI's)
#   ./tests/run.sh --soak    the same, then the soaks: tests/jail.rs with 1,000 create/destroy
#                            cycles and `benches/run.sh soak` (10,000)
#
# Env: AIRLOCK_TEST_JOBS   system test binaries run at once (default 2)
# Artifacts are cached under ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}, keyed by their inputs.
set -euo pipefail

soak=0
for arg in "$@"; do
  case $arg in
    --soak) soak=1 ;;
    *) echo "usage: $0 [--soak]" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The binaries the system tests and the SDK tests start (CARGO_TARGET_DIR may put them outside
# the checkout: .ci/run does).
export AIRLOCK_BIN_DIR=${AIRLOCK_BIN_DIR:-${CARGO_TARGET_DIR:-$root/target}/debug}

# Where the timing table's records go (tests/times.py).
export AIRLOCK_TIMES_DIR=$root/target/test-times
rm -rf "$AIRLOCK_TIMES_DIR"
mkdir -p "$AIRLOCK_TIMES_DIR"
timing() { python3 "$root/tests/times.py" "$@"; }

# `stage NAME COMMAND...` runs COMMAND in this shell (a failure still ends the run: set -e) and
# records how long it took; the EXIT trap records a stage that failed and prints the table.
current_stage="" stage_t0=""
stage() {
  current_stage=$1 stage_t0=$(date +%s.%N)
  shift
  "$@"
  timing stage "$current_stage" "$stage_t0" "$(date +%s.%N)" 0
  current_stage=""
}
template_pid="" interp_template_pid=""
on_exit() {
  local rc=$?
  trap - EXIT
  # A template build still running when the run fails (its daemon follows it: parent-death
  # signal).
  local pid
  for pid in "$template_pid" "$interp_template_pid"; do
    if [[ -n $pid ]]; then
      kill "$pid" 2>/dev/null || true
    fi
  done
  if [[ -n $current_stage ]]; then
    timing stage "$current_stage" "$stage_t0" "$(date +%s.%N)" "$rc" || true
  fi
  timing report || true
  exit "$rc"
}
trap on_exit EXIT

# Everything from Debian that the builds and the tests need (idempotent, quiet when present).
install_packages() {
  echo "== Debian packages (scripts/install-deps.sh --tests)" >&2
  scripts/install-deps.sh --tests
}

kernel() {
  echo "== guest kernel" >&2
  AIRLOCK_KERNEL=$(kernel-config/build.sh | tail -n1)
  export AIRLOCK_KERNEL
  echo "kernel: $AIRLOCK_KERNEL" >&2
}

image() {
  echo "== base image" >&2
  AIRLOCK_ROOTFS=$(rootfs/build.sh | tail -n1)
  export AIRLOCK_ROOTFS
  echo "rootfs: $AIRLOCK_ROOTFS" >&2
}

# The code-interpreter image (tests/interpreter.rs makes the `code-interpreter` template of it,
# kept across runs under kept-templates/ while the VMM's sources stay the same).
interpreter_image() {
  echo "== code-interpreter image" >&2
  AIRLOCK_INTERPRETER_ROOTFS=$(rootfs/build.sh code-interpreter | tail -n1)
  export AIRLOCK_INTERPRETER_ROOTFS
  echo "code-interpreter image: $AIRLOCK_INTERPRETER_ROOTFS" >&2
}

registries() {
  echo "== registry software of the package tests (tests/registries.sh)" >&2
  local out
  out=$(tests/registries.sh | tail -n2)
  AIRLOCK_PYPISERVER=$(head -n1 <<<"$out")
  AIRLOCK_VERDACCIO=$(tail -n1 <<<"$out")
  export AIRLOCK_PYPISERVER AIRLOCK_VERDACCIO
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

fmt() {
  echo "== fmt" >&2
  cargo fmt --all -- --check
}

clippy() {
  echo "== clippy" >&2
  cargo clippy --workspace --all-targets -- -D warnings
}

# The binaries the system tests start (airlock-vmm, airlockd, airlock: `cargo test` alone does
# not build them for packages without integration tests) and every test binary.
build() {
  echo "== build" >&2
  cargo build --workspace --bins
  cargo test --workspace --no-run
}

# Unit tests and the VMM's KVM micro tests: every package but the system tests. Each command is
# killed (with what it started) past AIRLOCK_UNIT_TIMEOUT seconds (default 900, some thirty times
# their usual time), so that a hung test fails the run in minutes instead of using up CI's time.
unit_tests() {
  echo "== unit tests" >&2
  local limit=${AIRLOCK_UNIT_TIMEOUT:-900}
  timeout -k 10 "$limit" cargo test --workspace --exclude airlock-system-tests -- --nocapture 2>&1 |
    timing tee "unit tests" || unit_failed "$limit"
  timeout -k 10 "$limit" cargo test -p airlock-system-tests --lib -- --nocapture 2>&1 |
    timing tee "unit tests" || unit_failed "$limit"
}
unit_failed() {
  local rc=${PIPESTATUS[0]:-1}
  [[ $rc == 124 || $rc == 137 ]] && echo "== unit tests: killed after ${1} s (AIRLOCK_UNIT_TIMEOUT)" >&2
  return 1
}

# The Python SDK's environment (a venv with pytest and this checkout's SDK; sdk/python/venv.sh).
sdk_venv() {
  echo "== Python SDK environment" >&2
  AIRLOCK_SDK_PYTHON=$(sdk/python/venv.sh | tail -n1)
  export AIRLOCK_SDK_PYTHON
}

# The system tests (tests/*.rs, each its own binary with its own daemon) and the Python SDK and
# CLI tests (sdk/python/tests: pytest against a live airlockd of their own, the debug binaries
# that build made), AIRLOCK_TEST_JOBS at once, longest first (by the last run's times); each
# one's output is shown whole when it ends.
system_tests() {
  echo "== system tests, SDK and CLI tests (${AIRLOCK_TEST_JOBS:-2} at once)" >&2
  local specs=()
  local f
  # Every [[test]] target of tests/Cargo.toml but the interpreter's (a stage of its own, after
  # its template's background build).
  for f in $(awk '/^\[/ { t = ($0 == "[[test]]") } t && /^path = "[a-z_0-9]*\.rs"$/ { gsub(/^path = "|"$/, ""); print }' tests/Cargo.toml); do
    [[ $f == interpreter.rs ]] || specs+=("tests/$f")
  done
  specs+=("pytest:sdk/python/tests")
  timing lanes "system tests" "${AIRLOCK_TEST_JOBS:-2}" -- "${specs[@]}"
}

# The shared test template (tests/template.rs): built in the background beside the unit tests
# and the fuzz smoke, so that the system tests import it instead of one lane booting it first.
test_template_start() {
  echo "== shared test template (airlock-test-template, in the background)" >&2
  template_log=$AIRLOCK_TIMES_DIR/test-template.log
  "$AIRLOCK_BIN_DIR/airlock-test-template" >"$template_log" 2>&1 &
  template_pid=$!
}
test_template_wait() {
  echo "== waiting for the shared test template" >&2
  local rc=0
  wait "$template_pid" || rc=$?
  template_pid=""
  cat "$template_log"
  return "$rc"
}

# The code-interpreter template (tests/interp.rs): imported when an earlier run kept it, else
# built in the background from here on (tens of minutes on nested KVM), beside everything else;
# the interpreter's system tests wait for it after the other system tests.
interp_template_start() {
  echo "== code-interpreter template (airlock-test-template --interpreter, in the background)" >&2
  interp_template_log=$AIRLOCK_TIMES_DIR/interpreter-template.log
  "$AIRLOCK_BIN_DIR/airlock-test-template" --interpreter >"$interp_template_log" 2>&1 &
  interp_template_pid=$!
}
interp_template_wait() {
  echo "== waiting for the code-interpreter template" >&2
  local rc=0
  wait "$interp_template_pid" || rc=$?
  interp_template_pid=""
  # A failed background build shows why here; tests/interpreter.rs then builds it itself
  # (and fails with the same cause if it fails again).
  tail -n 60 "$interp_template_log"
  ((rc == 0)) || echo "== the code-interpreter template's background build failed ($rc)" >&2
}

# The code interpreter in VMs (tests/interpreter.rs): the unchanged e2b-code-interpreter
# package through the gateway, RunCode, the SDK and the CLI. Killed past
# AIRLOCK_TEST_BINARY_TIMEOUT seconds, as each system test binary is (tests/times.py).
interpreter_system_tests() {
  echo "== interpreter system tests (tests/interpreter.rs)" >&2
  timeout -k 10 "${AIRLOCK_TEST_BINARY_TIMEOUT:-1500}" \
    cargo test -p airlock-system-tests --test interpreter -- --nocapture 2>&1 |
    timing tee "interpreter system tests"
}

# The code interpreter's guest server (rootfs/interpreter) against real Jupyter kernels on this
# host, with the unchanged e2b-code-interpreter package parsing what it sends (a venv of pinned
# packages, made once by rootfs/interpreter/tests/venv.sh).
interpreter_server_tests() {
  echo "== interpreter server tests (rootfs/interpreter/tests)" >&2
  local python
  python=$(rootfs/interpreter/tests/venv.sh | tail -n1)
  timeout -k 10 "${AIRLOCK_UNIT_TIMEOUT:-900}" "$python" -m pytest -q -p no:cacheprovider \
    rootfs/interpreter/tests 2>&1 | timing tee "interpreter server tests"
}

# Every fuzz target for a short while from its seeds (fuzz/run.sh; a longer run: fuzz/run.sh 600).
fuzz_smoke() {
  echo "== fuzz smoke (${AIRLOCK_FUZZ_SECONDS:-10} s per target)" >&2
  fuzz/run.sh "${AIRLOCK_FUZZ_SECONDS:-10}"
}

# The long runs, only with --soak: 1,000 jailed create/destroy cycles in tests/jail.rs and the
# 10,000-cycle soak of benches/run.sh.
soaks() {
  echo "== soaks" >&2
  AIRLOCK_TEST_JAIL_CYCLES=1000 cargo test -p airlock-system-tests --test jail -- --nocapture 2>&1 |
    timing tee soaks
  benches/run.sh soak
}

stage "debian packages" install_packages
stage "guest kernel" kernel
stage "base image" image
stage "code-interpreter image" interpreter_image
stage "registries" registries
ensure_cgroup2
stage "fmt" fmt
stage "clippy" clippy
stage "build" build
test_template_start
interp_template_start
stage "sdk venv" sdk_venv
stage "unit tests" unit_tests
stage "fuzz smoke" fuzz_smoke
stage "interpreter server tests" interpreter_server_tests
stage "test template" test_template_wait
stage "system tests" system_tests
stage "code-interpreter template" interp_template_wait
stage "interpreter system tests" interpreter_system_tests
if ((soak)); then
  stage "soaks" soaks
fi
