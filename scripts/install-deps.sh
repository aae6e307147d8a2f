#!/usr/bin/env bash
# The one list of what Airlock needs from Debian, and its installer. quickstart.sh, tests/run.sh
# and .ci/run call it; it is idempotent and prints nothing when everything is already there.
#
#   scripts/install-deps.sh            build + run packages (what quickstart.sh needs)
#   scripts/install-deps.sh --tests    the same, plus what only tests and benches need
#   scripts/install-deps.sh --list     prints the packages (with --tests: all of them), installs nothing
#
# Not from Debian, and expected on PATH: a Rust toolchain (rustup; rust-toolchain.toml pins it),
# gcc and make. On other distributions install the equivalents of the packages below: the
# Linux 6.1 kernel source (kernel-config/build.sh unpacks /usr/src/linux-source-6.1.tar.xz;
# AIRLOCK_KERNEL can point at a vmlinux built elsewhere), bc, bison, flex, libelf and OpenSSL
# headers, debootstrap, a static busybox, e2fsprogs (mkfs.ext4 -d), protoc, Python 3 with venv.
set -euo pipefail

# Building and running: the guest kernel, the base image, the proto crates, the Python SDK.
build_pkgs=(
  linux-source-6.1 bc bison flex libelf-dev libssl-dev   # guest kernel (kernel-config/build.sh)
  debootstrap busybox-static e2fsprogs file              # base image (rootfs/build.sh)
  protobuf-compiler                                      # proto/ (prost, tonic)
  python3 python3-venv                                   # sdk/python/venv.sh
  nftables                                               # airlockd: each sandbox network's ruleset
  gpgv debian-archive-keyring  # airlockd: the package proxy checks Debian repositories' signatures
)
# Only tests and benchmarks need these.
test_pkgs=(
  qemu-system-x86   # the reference VMM of benches/run.sh boot and restore
  iproute2          # tests/egress.rs, benches/run.sh net: namespaces and veths of their own
  etcd-server etcd-client  # tests/cluster.rs, benches/run.sh cluster: the nodes' etcd members
  git               # tests/egress.rs: the repository the guest's git clones
  docker-registry skopeo  # tests/images.rs: a local OCI registry, and pushing layouts to it
  gnupg xz-utils    # tests/packages.rs: a Debian repository of the test's own, signed by its key
)

tests=0 list=0
for arg in "$@"; do
  case $arg in
    --tests) tests=1 ;;
    --list) list=1 ;;
    *) echo "usage: $0 [--tests] [--list]" >&2; exit 2 ;;
  esac
done

pkgs=("${build_pkgs[@]}")
((tests)) && pkgs+=("${test_pkgs[@]}")
if ((list)); then
  printf '%s\n' "${pkgs[@]}"
  exit 0
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0

command -v apt-get >/dev/null || {
  echo "not a Debian system: install the equivalents of: ${missing[*]} (see the top of $0)" >&2
  exit 1
}
sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "== installing ${missing[*]}" >&2
"${sudo[@]}" apt-get update -q >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
