#!/usr/bin/env bash
# Builds the Airlock guest kernel (an uncompressed ELF vmlinux) and caches it
# by the hash of its inputs.
#
# Usage: kernel-config/build.sh
#   The last line on stdout is the absolute path of the cached vmlinux; all
#   build output goes to stderr. The final .config sits next to it as
#   `config`. Rerunning with unchanged inputs only prints the path.
#
# Inputs (the cache key is the sha256 over all of them):
#   - the installed Debian linux-source-6.1 package version (dpkg-query),
#   - airlock.config (fragment merged on top of `make tinyconfig`),
#   - patches/*.patch (applied with patch -p1, in name order),
#   - this script.
#
# Environment:
#   AIRLOCK_CACHE_DIR  cache root (default /var/cache/airlock); the kernel
#                      lands in $AIRLOCK_CACHE_DIR/kernel/<key>/vmlinux.
#   AIRLOCK_JOBS       make -j value (default: nproc).
#   AIRLOCK_KEEP_BUILD 1 keeps the build tree of a failed build for debugging
#                      (it is recreated from scratch by the next run anyway).
set -euo pipefail

readonly SRC_PKG=linux-source-6.1
readonly SRC_TARBALL=/usr/src/linux-source-6.1.tar.xz

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
readonly SCRIPT_DIR
readonly FRAGMENT="$SCRIPT_DIR/airlock.config"
readonly PATCH_DIR="$SCRIPT_DIR/patches"

# Keep stdout for the result line only: fd 3 is the real stdout, and
# everything else (make, tar, apt) writes to stderr.
exec 3>&1 1>&2

log() {
    printf 'kernel-config/build.sh: %s\n' "$*" >&2
}

die() {
    log "error: $*"
    exit 1
}

# Fills the global array PATCHES with the patches in the order they are
# applied (C-locale name order).
find_patches() {
    PATCHES=()
    local p
    while IFS= read -r -d '' p; do
        PATCHES+=("$p")
    done < <(find "$PATCH_DIR" -maxdepth 1 -name '*.patch' -type f -print0 | LC_ALL=C sort -z)
}

# The kernel source and its build dependencies come from the project's one package list.
install_deps() {
    "$SCRIPT_DIR/../scripts/install-deps.sh"
}

# Prints the cache key: sha256 over the source package version and the
# content of every input file, each labelled with its name.
cache_key() {
    local version f
    version=$(dpkg-query -W -f='${Version}' "$SRC_PKG") ||
        die "cannot read the version of $SRC_PKG"
    {
        printf '%s %s\n' "$SRC_PKG" "$version"
        for f in "$FRAGMENT" "${PATCHES[@]}" "$SCRIPT_DIR/build.sh"; do
            printf '%s %s\n' "${f#"$SCRIPT_DIR"/}" "$(sha256sum <"$f" | cut -d' ' -f1)"
        done
    } | sha256sum | cut -d' ' -f1
}

# Unpacks a pristine source tree into $1 (removed first: a previous,
# interrupted build may have left it half done).
unpack_source() {
    local dir=$1
    rm -rf -- "$dir"
    mkdir -p -- "$dir"
    log "unpacking $SRC_TARBALL"
    tar -xJf "$SRC_TARBALL" -C "$dir" --strip-components=1
}

apply_patches() {
    local dir=$1 p
    for p in "${PATCHES[@]}"; do
        log "applying ${p##*/}"
        patch -d "$dir" -p1 --forward --batch --no-backup-if-mismatch -s <"$p" ||
            die "patch ${p##*/} does not apply"
    done
}

configure_kernel() {
    local dir=$1
    make -C "$dir" -s tinyconfig
    (cd "$dir" && scripts/kconfig/merge_config.sh -m .config "$FRAGMENT")
    make -C "$dir" -s olddefconfig
}

# Prints every CONFIG_ symbol defined in the tree's Kconfig files.
kconfig_symbols() {
    local dir=$1
    find "$dir" -name 'Kconfig*' -type f -print0 |
        xargs -0 grep -hoE '^[[:space:]]*(menu)?config[[:space:]]+[A-Za-z0-9_]+' |
        awk '{print "CONFIG_" $2}' | LC_ALL=C sort -u
}

# Checks that every setting of the fragment landed in .config: `=n` (or
# "# CONFIG_X is not set") means unset or absent, anything else must match
# exactly. Unknown symbols (typos) fail too. Lists all mismatches.
verify_config() {
    local dir=$1 line sym want got bad=()
    local symbols
    symbols=$(kconfig_symbols "$dir")
    while IFS= read -r line; do
        if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
            sym=${BASH_REMATCH[1]} want=${BASH_REMATCH[2]}
        elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
            sym=${BASH_REMATCH[1]} want=n
        else
            continue
        fi
        if ! grep -qxF -- "$sym" <<<"$symbols"; then
            bad+=("$sym: no such Kconfig symbol in this tree")
            continue
        fi
        got=$(grep -E "^($sym=|# $sym is not set$)" "$dir/.config" || true)
        if [[ $want == n ]]; then
            [[ -z $got || $got == "# $sym is not set" ]] && continue
        else
            [[ $got == "$sym=$want" ]] && continue
        fi
        bad+=("$sym: wanted ${want}, got ${got:-nothing (dependency missing?)}")
    done <"$FRAGMENT"
    if ((${#bad[@]} > 0)); then
        log "these fragment settings did not land in .config:"
        printf '  %s\n' "${bad[@]}" >&2
        die "config verification failed"
    fi
    log "all fragment settings are in .config"
}

compile_kernel() {
    local dir=$1
    local jobs=${AIRLOCK_JOBS:-$(nproc)}
    log "make -j$jobs vmlinux"
    make -C "$dir" -j"$jobs" KBUILD_BUILD_USER=airlock KBUILD_BUILD_HOST=airlock vmlinux
}

# Copies $1 to $2 through a temporary file in $2's directory and a rename, so
# that $2 is either absent or complete.
install_atomic() {
    local src=$1 dst=$2 tmp
    tmp=$(mktemp "${dst%/*}/.${dst##*/}.XXXXXX")
    cp -- "$src" "$tmp"
    chmod 0644 "$tmp"
    mv -f -- "$tmp" "$dst"
}

# Installs the results; vmlinux goes last, so its presence means the cache
# entry is complete.
install_artifacts() {
    local dir=$1 out=$2
    mkdir -p -- "$out"
    install_atomic "$dir/.config" "$out/config"
    install_atomic "$dir/vmlinux" "$out/vmlinux"
}

# Removes the build tree named in BUILD_TREE, if any (EXIT trap): a failed or
# interrupted build leaves nothing behind unless AIRLOCK_KEEP_BUILD=1.
cleanup_build_tree() {
    if [[ -n ${BUILD_TREE:-} && ${AIRLOCK_KEEP_BUILD:-0} != 1 ]]; then
        rm -rf -- "$BUILD_TREE"
    fi
}

build_kernel() {
    local build=$1 out=$2
    BUILD_TREE=$build
    trap cleanup_build_tree EXIT
    unpack_source "$build"
    apply_patches "$build"
    configure_kernel "$build"
    verify_config "$build"
    compile_kernel "$build"
    install_artifacts "$build" "$out"
    rm -rf -- "$build"
    BUILD_TREE=
}

main() {
    install_deps
    find_patches
    local root key out
    root=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/kernel
    mkdir -p -- "$root"
    root=$(cd -- "$root" && pwd -P)
    key=$(cache_key)
    out=$root/$key
    log "cache key $key"

    if [[ ! -f $out/vmlinux ]]; then
        # One build per key at a time; a second caller waits, then finds
        # the result.
        exec 4>"$root/.$key.lock"
        flock 4
        if [[ ! -f $out/vmlinux ]]; then
            build_kernel "$root/.$key.build" "$out"
        fi
        exec 4>&-
    fi
    log "vmlinux: $out/vmlinux"
    printf '%s\n' "$out/vmlinux" >&3
}

main "$@"
