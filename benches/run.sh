#!/usr/bin/env bash
# Benchmarks. Usage: benches/run.sh boot|exec|restore|settle|net|create|jail|disk|cluster|image|soak|e2b|interpreter|plot
#   boot  time from process start to `airlock: userspace up`, airlock-vmm vs QEMU microvm
#         (same kernel, image, vCPUs and memory, interleaved runs), and the VMM's resident
#         memory outside guest RAM. RUNS (default 5), VCPUS (1), MEM_MIB (256).
#   exec  exec round trip of `true` and stdout throughput (`head -c MIB M /dev/zero`) through
#         the guest agent over virtio-vsock, a fresh agent connection (handshake and Ready:
#         what airlockd pays per execution), and the same agent on the host over a Unix socket
#         in the same run. RUNS (default 10), MIB (4), VCPUS (1), MEM_MIB (512); the guest kernel
#         is emulated on nested-KVM build hosts, where a MiB of output takes seconds.
#   restore  snapshot restore: VMM-side restore time at 256 MiB and 2 GiB, process spawn to
#         agent answer, VMM overhead, PSS of 1 and of CLONES (20) idle clones, and QEMU
#         restoring its own snapshot of the same guest in the same run. RUNS (default 10),
#         VCPUS (1); two cold boots make the snapshots.
#   settle  restore -> agent Ready of clones of a snapshot taken right after the warm-up and of
#         one taken once the guest settled (`airlock-vmm snapshot --settle-ms`), alternating
#         warm pool restores. RUNS (default 15).
#   net   restore with the network card on and off: the VMM's restore time and process spawn
#         -> agent Ready of clones of a snapshot booted with a virtio-net card (each clone on a
#         TAP of its own, in a network namespace the bench makes) and of one without, fresh
#         `airlock-vmm restore` processes, alternating. RUNS (default 10), VCPUS (1). Then the
#         guest's TCP through airlockd's egress proxy against a plain TAP, side by side: a clone
#         of the card snapshot on a TAP holding the gateway address (server there, no proxy)
#         and a sandbox of a live airlockd allowed `bench.test` (its host map: a server in an
#         upstream namespace, veth 10.214.0.0/30); in each guest, connection setup (CONNS
#         (default 30) connect + request + one-byte answer) and upload throughput (TCP_RUNS (3)
#         uploads of MIB (2) MiB, timed in the guest and by the server), and the ratios
#         proxied/plain (benches/nettcp.py). NET_TCP=0: the restore part only.
#   create  CreateSandbox -> ready through a live airlockd (gRPC, warm pool) at concurrency
#         LEVELS (default 1,10,50), RUNS creates per level (default 20), the host's and the
#         guest's share, creates/s, and the host memory (PSS) of IDLE (100) idle sandboxes;
#         then, in one sandbox, EXEC_RUNS (10) executions of `true` and ReadFiles through the
#         daemon and `head -c EXEC_MIB (2) MiB` of stdout streamed (`daemon_exec`).
#         AIRLOCKD=PATH runs another airlockd binary (say, an earlier commit's) under the
#         same bench client.
#   soak  CYCLES (default 10000) create/destroy cycles through a live, jailed airlockd (4 at a
#         time; the system test tests/jail.rs with AIRLOCK_TEST_JAIL_CYCLES), which fails on any
#         leak: processes, cgroups, run directories, uids, mounts, PID namespaces, the daemon's
#         descriptors. Prints the cycles, seconds, cycles/s and what was counted after them.
#   jail  CreateSandbox -> ready with and without the VMM jail (namespaces, pivot_root, uid,
#         seccomp), two daemons side by side, RUNS (default 30) creates each, alternating; and
#         a warm VMM's start (spawn -> exec'd in its jail, -> ready) on each side.
#   disk  CreateSandbox -> ready with a writable root (a copy-on-write disk over the base image)
#         and with a read-only one, two daemons side by side, RUNS (default 20) creates each,
#         alternating; then in one sandbox of each DD_RUNS (3) times dd writes DD_MIB (16) MiB
#         where it writes (/root on the layer, /tmp on the tmpfs) and reads it back, uncached.
#   cluster  cluster mode's routing hop: one etcd member and two airlockd nodes (placement
#         "pack", node a the smaller, so every sandbox lands on a); RUNS (default 10) rounds of
#         create -> ready, GetSandbox and destroy through a (local) and through b (forwarded to
#         a), alternating, each over TCP with a tenant token; p50/p90/p99 of each, the ratios
#         forwarded/local and the create's p50 difference. Needs etcd (scripts/install-deps.sh
#         --tests).
#   image  templates from OCI images: a local docker-registry (127.0.0.1, storage in a temporary
#         directory) gets two images built by the bench without network (tests/images/layout.rs):
#         IMAGE_MIB (default 200) MiB of host files (/usr/lib/x86_64-linux-gnu, /usr/share) in
#         two gzip layers and one with busybox and /etc/passwd; and the same three layers under
#         a small top layer. One airlockd (a tenant whose egress ceiling allows 127.0.0.1) then,
#         RUNS (default 3) times, imports the first with its layer cache and root filesystems
#         deleted (cold) and the second with the base layers cached (warm: the top layer fetched,
#         its root filesystem made again): the time to "unpacking" (pull + unpack) and to
#         "ready" (the whole build) of each; then create -> ready of sandboxes of the imported
#         template and of `base`, alternating, CREATE_RUNS (10) each, and the ratio of their
#         p50s (about 1: a restore does not depend on the image). And RUNS times a Dockerfile
#         build (BuildTemplate, FROM base, a COPY and three cheap RUNs, the step cache empty)
#         and a rebuild with only the last line changed: the time to "ready" of each and the
#         steps the rebuild took from the cache (3 of 4). One JSON line per measure, then the
#         summary. Needs docker-registry and skopeo (scripts/install-deps.sh --tests),
#         busybox-static.
#   e2b   the E2B gateway's cost: the same steps (create, a first command, 5 more, a 64 KiB
#         file written and read, kill) through the unchanged `e2b` SDK and the gateway and
#         through Airlock's Python SDK over gRPC, one live airlockd, alternating; RUNS (default
#         10); the p50 ratios gateway / gRPC (benches/gateway.py, in a venv with both SDKs).
#   interpreter  the code interpreter's cells against `exec python3 -c` of the same code, in
#         sandboxes of the `code-interpreter` template (the image `rootfs/build.sh
#         code-interpreter`), one live airlockd, alternating: create -> the first `1+1`
#         result, a `1+1` round trip (CELLS (default 5) per run) and a matplotlib PNG; RUNS
#         (default 5); the p50 ratios exec / cell (benches/interpreter.py). The template's first
#         build takes minutes on nested KVM; it is kept (by image) and imported after that.
#   plot  OUT.png LABEL=RESULT.json...: the distributions in bench results (the JSON lines that
#         create and exec print; say, one before a change and one after) as CDFs, one panel per
#         measure and one curve per LABEL (benches/plot.py; matplotlib goes into a venv under
#         the cache directory the first time).
# AIRLOCK_KERNEL / AIRLOCK_ROOTFS default to the outputs of kernel-config/build.sh and
# rootfs/build.sh. The last line of output is one JSON object.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

artifacts() {
  if [[ -z "${AIRLOCK_KERNEL:-}" ]]; then
    AIRLOCK_KERNEL=$("$root/kernel-config/build.sh" | tail -n1)
  fi
  if [[ -z "${AIRLOCK_ROOTFS:-}" ]]; then
    AIRLOCK_ROOTFS=$("$root/rootfs/build.sh" | tail -n1)
  fi
  export AIRLOCK_KERNEL AIRLOCK_ROOTFS
}

build_release() {
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlock-agent -p airlock-bench >&2)
}

bench_boot() {
  command -v qemu-system-x86_64 >/dev/null || {
    echo "qemu-system-x86_64 is missing: apt-get install -y qemu-system-x86" >&2
    exit 1
  }
  artifacts
  build_release
  python3 "$root/benches/boot.py" \
    --vmm "$root/target/release/airlock-vmm" \
    --qemu "$root/kernel-config/qemu-boot.sh" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" \
    --runs "${RUNS:-5}" --vcpus "${VCPUS:-1}" --mem-mib "${MEM_MIB:-256}"
}

bench_exec() {
  artifacts
  build_release
  "$root/target/release/airlock-bench" exec \
    --vmm "$root/target/release/airlock-vmm" --agent "$root/target/release/airlock-agent" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" \
    --runs "${RUNS:-10}" --mib "${MIB:-4}" --vcpus "${VCPUS:-1}" --mem-mib "${MEM_MIB:-512}"
}

bench_restore() {
  command -v qemu-system-x86_64 >/dev/null || {
    echo "qemu-system-x86_64 is missing: apt-get install -y qemu-system-x86" >&2
    exit 1
  }
  artifacts
  build_release
  python3 "$root/benches/restore.py" \
    --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" \
    --runs "${RUNS:-10}" --clones "${CLONES:-20}" --vcpus "${VCPUS:-1}"
}

bench_net() {
  command -v ip >/dev/null || {
    echo "ip is missing: apt-get install -y iproute2" >&2
    exit 1
  }
  artifacts
  local tcp=(--no-tcp)
  if [[ ${NET_TCP:-1} != 0 ]]; then
    (cd "$root" && cargo build --release -q -p airlock-vmm -p airlock-agent -p airlockd \
      -p airlock-bench >&2)
    tcp=(--bench "$root/target/release/airlock-bench"
      --create-bench "$root/target/release/airlock-create-bench"
      --daemon "$root/target/release/airlockd"
      --conns "${CONNS:-30}" --mib "${MIB:-2}" --tcp-runs "${TCP_RUNS:-3}")
  else
    build_release
  fi
  python3 "$root/benches/net.py" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-10}" \
    --vcpus "${VCPUS:-1}" "${tcp[@]}"
}

bench_settle() {
  artifacts
  build_release
  python3 "$root/benches/settle.py" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-15}"
}

bench_create() {
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd -p airlock-bench >&2)
  "$root/target/release/airlock-create-bench" \
    --daemon "${AIRLOCKD:-$root/target/release/airlockd}" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" \
    --runs "${RUNS:-20}" --levels "${LEVELS:-1,10,50}" --idle "${IDLE:-100}" \
    --exec-runs "${EXEC_RUNS:-10}" --exec-mib "${EXEC_MIB:-2}"
}

bench_jail() {
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd -p airlock-bench >&2)
  "$root/target/release/airlock-create-bench" --compare-jail \
    --daemon "$root/target/release/airlockd" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-30}"
}

bench_disk() {
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd -p airlock-bench >&2)
  "$root/target/release/airlock-create-bench" --compare-disk \
    --daemon "$root/target/release/airlockd" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-20}" \
    --dd-runs "${DD_RUNS:-3}" --dd-mib "${DD_MIB:-16}"
}

bench_cluster() {
  local etcd
  etcd=$(command -v etcd || true)
  [[ -n $etcd ]] || {
    echo "etcd is missing: scripts/install-deps.sh --tests (Debian etcd-server)" >&2
    exit 1
  }
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd -p airlock-bench >&2)
  "$root/target/release/airlock-create-bench" --compare-cluster --etcd "$etcd" \
    --daemon "$root/target/release/airlockd" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-10}"
}

bench_image() {
  local tool
  for tool in /usr/bin/docker-registry skopeo /usr/bin/busybox; do
    command -v "$tool" >/dev/null || {
      echo "$tool is missing: scripts/install-deps.sh --tests" >&2
      exit 1
    }
  done
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd -p airlock-bench >&2)
  "$root/target/release/airlock-create-bench" --compare-image \
    --daemon "$root/target/release/airlockd" --vmm "$root/target/release/airlock-vmm" \
    --kernel "$AIRLOCK_KERNEL" --rootfs "$AIRLOCK_ROOTFS" --runs "${RUNS:-3}" \
    --create-runs "${CREATE_RUNS:-10}" --image-mib "${IMAGE_MIB:-200}"
}

bench_soak() {
  artifacts
  local cycles=${CYCLES:-10000} log
  log=$(mktemp)
  (cd "$root" && cargo build -q --workspace --bins >&2)
  (cd "$root" && AIRLOCK_TEST_JAIL_CYCLES=$cycles cargo test -q -p airlock-system-tests \
    --test jail -- --nocapture 2>&1 | tee "$log" >&2)
  local secs counted
  secs=$(sed -n "s/^step $cycles create\/destroy cycles: \([0-9.]*\) s$/\1/p" "$log" | tail -n1)
  counted=$(sed -n "s/^after $cycles cycles: //p" "$log" | tail -n1)
  rm -f "$log"
  printf '{"bench":"soak","cycles":%s,"seconds":%s,"cycles_per_s":%s,"leaks":0,"after":"%s"}\n' \
    "$cycles" "${secs:-0}" "$(awk -v c="$cycles" -v s="${secs:-0}" 'BEGIN { printf "%.2f", (s > 0 ? c / s : 0) }')" \
    "$counted"
}

bench_e2b() {
  artifacts
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd >&2)
  local venv=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/bench-e2b
  if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q e2b==2.63.0 >&2
  fi
  "$venv/bin/pip" install -q "$root/sdk/python" >&2
  rm -rf "$root/sdk/python/build" "$root"/sdk/python/*.egg-info
  "$venv/bin/python" "$root/benches/gateway.py" --daemon "$root/target/release/airlockd" \
    --vmm "$root/target/release/airlock-vmm" --runs "${RUNS:-10}"
}

bench_interpreter() {
  artifacts
  local image=${AIRLOCK_INTERPRETER_ROOTFS:-}
  if [[ -z $image ]]; then
    image=$("$root/rootfs/build.sh" code-interpreter | tail -n1)
  fi
  (cd "$root" && cargo build --release -q -p airlock-vmm -p airlockd >&2)
  local python
  python=$("$root/sdk/python/venv.sh" | tail -n1)
  "$python" "$root/benches/interpreter.py" --daemon "$root/target/release/airlockd" \
    --vmm "$root/target/release/airlock-vmm" --kernel "$AIRLOCK_KERNEL" --rootfs "$image" \
    --runs "${RUNS:-5}" --cells "${CELLS:-5}"
}

bench_plot() {
  local venv="${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/bench-python"
  if ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet matplotlib >&2
  fi
  "$venv/bin/python" "$root/benches/plot.py" "$@"
}

main() {
  case "${1:-}" in
    plot)
      shift
      bench_plot "$@"
      ;;
    boot) bench_boot ;;
    exec) bench_exec ;;
    restore) bench_restore ;;
    settle) bench_settle ;;
    net) bench_net ;;
    create) bench_create ;;
    jail) bench_jail ;;
    disk) bench_disk ;;
    cluster) bench_cluster ;;
    image) bench_image ;;
    soak) bench_soak ;;
    e2b) bench_e2b ;;
    interpreter) bench_interpreter ;;
    *)
      sed -n '2,84p' "$0" | sed 's/^# \{0,1\}//' >&2
      exit 2
      ;;
  esac
}

main "$@"
