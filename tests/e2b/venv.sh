#!/usr/bin/env bash
# Makes (once) the Python environment of the E2B gateway's tests for one pinned version of the
# unchanged `e2b` SDK from PyPI: ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-VERSION, with
# pytest. Prints the venv's python as its last line. Usage: venv.sh VERSION
set -euo pipefail

version=${1:?usage: venv.sh E2B_VERSION}
venv=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-$version
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import e2b, pytest' 2>/dev/null; then
  echo "== creating $venv (e2b==$version from PyPI)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "e2b==$version" "pytest>=7" >&2
fi
echo "$venv/bin/python"
