#!/usr/bin/env bash
# Makes (once) the test venv for rootfs/interpreter and prints its python as the last line.
# Cached under ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/interpreter-venv-<hash of requirements.txt>.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"
hash="$(sha256sum "$req" | cut -c1-16)"
cache="${AIRLOCK_CACHE_DIR:-/var/cache/airlock}"
venv="$cache/interpreter-venv-$hash"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    mkdir -p "$cache"
    tmp="$venv.tmp.$$"
    rm -rf "$tmp"
    "$py" -m venv "$tmp" >&2
    "$tmp/bin/python" -m pip install --disable-pip-version-check -q -r "$req" >&2
    # (bin/ scripts keep the tmp path in their shebangs; the tests use `python -m pytest`.)
    rm -rf "$venv"
    mv "$tmp" "$venv"
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
