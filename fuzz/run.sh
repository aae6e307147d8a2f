#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets: agent frames, control-socket lines, snapshot state
# files, virtio-blk and virtio-vsock queues, package index pages and packuments) for SECONDS
# each (default 60) with libFuzzer through cargo-fuzz, starting from the seeds in fuzz/seeds,
# and prints one JSON object as its last line: per target the executions, executions per
# second and crashes. Exits 1 on a crash
# (the input is kept under the cache's fuzz/artifacts and named in the output).
#   fuzz/run.sh [SECONDS]     FUZZ_SANITIZER=none (default; stable toolchain) | address (needs
#                             RUSTC_BOOTSTRAP=1 on a stable toolchain)
# The builds, corpora and artifacts live under ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/fuzz,
# outside the checkout; cargo-fuzz is installed from crates.io if missing.
set -euo pipefail

fuzz=$(cd "$(dirname "$0")" && pwd)
secs=${1:-60}
sanitizer=${FUZZ_SANITIZER:-none}
cache=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/fuzz
export CARGO_TARGET_DIR=$cache/target-$sanitizer

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz" >&2
  cargo install -q cargo-fuzz --locked --version 0.13.2 >&2
fi
cd "$fuzz"
echo "== building the fuzz targets (sanitizer: $sanitizer)" >&2
cargo fuzz build -s "$sanitizer" -O >&2

json="{\"bench\":\"fuzz\",\"seconds_each\":$secs,\"targets\":{"
failed=0
first=1
for t in $(cargo fuzz list); do
  corpus=$cache/corpus/$t
  artifacts=$cache/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  cp -n "$fuzz/seeds/$t/"* "$corpus/" 2>/dev/null || true
  log=$cache/$t.log
  echo "== $t: ${secs} s" >&2
  rc=0
  cargo fuzz run -s "$sanitizer" -O "$t" "$corpus" -- -max_total_time="$secs" \
    -print_final_stats=1 -artifact_prefix="$artifacts/" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n1)
  crashes=0
  if ((rc != 0)); then
    crashes=1
    failed=1
    echo "!! $t crashed (exit $rc); input: $(grep -o "$artifacts/[^ ]*" "$log" | tail -n1)" >&2
    tail -n 30 "$log" >&2
  fi
  ((first)) || json+=","
  first=0
  json+="\"$t\":{\"runs\":${runs:-0},\"exec_per_s\":${speed:-0},\"crashes\":$crashes}"
done
json+="}}"
echo "$json"
exit "$failed"
