#!/usr/bin/env bash
# Sets up and runs Airlock on this machine: builds the guest kernel, the base image and the
# binaries (each cached by its inputs), then boots one microVM with `airlock-vmm run`, waits for
# the guest agent and runs Python code in the VM (it prints 42). Needs root (for apt, /dev/kvm
# and the image build).
set -euo pipefail

root=$(cd "$(dirname "$0")" && pwd)
cd "$root"

install_packages() {
  local pkgs=(linux-source-6.1 bc bison flex libelf-dev libssl-dev debootstrap busybox-static
              e2fsprogs protobuf-compiler)
  local missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
}

build() {
  echo "== guest kernel (first build: minutes)" >&2
  kernel=$(kernel-config/build.sh | tail -n1)
  echo "== base image" >&2
  rootfs=$(rootfs/build.sh | tail -n1)
  echo "== binaries" >&2
  cargo build --release -q -p airlock-vmm
}

run_code() {
  echo "== running Python in a microVM (kernel $kernel, image $rootfs)" >&2
  echo "   (on nested-KVM build machines the guest kernel is emulated: expect 1-2 minutes)" >&2
  target/release/airlock-vmm run --kernel "$kernel" --rootfs "$rootfs" --vcpus "${VCPUS:-1}" \
    --mem-mib "${MEM_MIB:-512}" -- python3 -c 'print(6*7)'
}

install_packages
build
run_code
