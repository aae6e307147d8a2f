#!/usr/bin/env bash
# Makes (once) the Python environment of the E2B gateway's tests for one pinned version of the
# unchanged `e2b` SDK from PyPI, with pytest and any further pinned packages (such as
# e2b-code-interpreter==X): ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-VERSION[-EXTRAS].
# Prints the venv's python as its last line. Usage: venv.sh VERSION [PACKAGE==X ...]
set -euo pipefail

version=${1:?usage: venv.sh E2B_VERSION [PACKAGE==VERSION ...]}
shift
extras=("$@")
name=e2b-$version
modules="import e2b, pytest"
for p in "${extras[@]}"; do
  name+="-${p//[^A-Za-z0-9.]/_}"
  m=${p%%[=<>]*}
  modules+=", ${m//-/_}"
done
venv=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/$name
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "$modules" 2>/dev/null; then
  echo "== creating $venv (e2b==$version ${extras[*]} from PyPI)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "e2b==$version" "pytest>=7" "${extras[@]}" >&2
fi
echo "$venv/bin/python"
