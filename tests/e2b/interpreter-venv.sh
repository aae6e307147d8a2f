#!/usr/bin/env bash
# Makes (once) the Python environment of the code interpreter's E2B test: the unchanged
# `e2b-code-interpreter` package from PyPI, pinned with the `e2b` SDK it runs on, and pytest, in
# ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-code-interpreter-VERSION. Prints the venv's
# python as its last line.
set -euo pipefail

readonly VERSION=2.11.5 E2B_VERSION=2.63.0
venv=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-code-interpreter-$VERSION-e2b-$E2B_VERSION
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import e2b_code_interpreter, pytest' 2>/dev/null; then
  echo "== creating $venv (e2b-code-interpreter==$VERSION, e2b==$E2B_VERSION from PyPI)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "e2b-code-interpreter==$VERSION" "e2b==$E2B_VERSION" "pytest>=7" >&2
fi
echo "$venv/bin/python"
