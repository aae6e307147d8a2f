#!/usr/bin/env bash
# Makes (or refreshes) the Python environment of the SDK and its tests: a venv under
# ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/python with pytest, and this checkout's SDK installed
# into it (`pip install ./sdk/python`, which generates the gRPC stubs from proto/airlock.proto).
# Prints the venv's python as its last line. Needs python3 with venv (Debian: python3-venv) and
# PyPI (pip's own cache makes later runs offline-fast).
set -euo pipefail

sdk=$(cd "$(dirname "$0")" && pwd)
venv=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/python

if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
  "$sdk/../../scripts/install-deps.sh"
fi
if [[ ! -x $venv/bin/python ]]; then
  echo "== creating $venv" >&2
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
fi
# The SDK is (re)installed from this checkout when it or the proto changed (its stubs are
# generated from the proto at build time).
key=$(cd "$sdk" && cat pyproject.toml setup.py airlock/*.py ../../proto/airlock.proto | sha256sum | cut -d' ' -f1)
if [[ $(cat "$venv/.sdk-key" 2>/dev/null) != "$key" ]]; then
  echo "== installing the SDK into $venv" >&2
  "$venv/bin/pip" install -q "pytest>=7" >&2
  "$venv/bin/pip" install -q "$sdk" >&2
  # An in-tree build leaves these behind.
  rm -rf "$sdk/build" "$sdk"/*.egg-info
  echo "$key" >"$venv/.sdk-key"
fi
echo "$venv/bin/python"
