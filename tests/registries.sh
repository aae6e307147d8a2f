#!/usr/bin/env bash
# The registry software the package tests run on loopback: pypiserver (PyPI's simple index) in
# a venv, and verdaccio (an npm registry, with the machine's Node.js) under
# ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/registries. Idempotent. Prints two lines: the
# pypi-server binary, then the verdaccio binary (tests/run.sh exports them as
# AIRLOCK_PYPISERVER and AIRLOCK_VERDACCIO).
set -euo pipefail

readonly PYPISERVER_VERSION=2.4.2
readonly VERDACCIO_VERSION=6.8.0  # the newest that runs on Node.js 20 (the build machines have 20)
root=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/registries
venv=$root/pypiserver
npm_dir=$root/verdaccio

if [[ ! -x $venv/bin/pypi-server || $(cat "$venv/.key" 2>/dev/null) != "$PYPISERVER_VERSION" ]]; then
  echo "== installing pypiserver $PYPISERVER_VERSION into $venv" >&2
  rm -rf "$venv"
  mkdir -p "$root"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "pypiserver==$PYPISERVER_VERSION" >&2
  echo "$PYPISERVER_VERSION" >"$venv/.key"
fi
if [[ ! -x $npm_dir/node_modules/.bin/verdaccio || $(cat "$npm_dir/.key" 2>/dev/null) != "$VERDACCIO_VERSION" ]]; then
  command -v npm >/dev/null || {
    echo "verdaccio needs Node.js and npm on PATH (Debian: apt-get install nodejs npm)" >&2
    exit 1
  }
  echo "== installing verdaccio $VERDACCIO_VERSION into $npm_dir" >&2
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  (cd "$npm_dir" && npm install --no-audit --no-fund --loglevel=error "verdaccio@$VERDACCIO_VERSION" >&2)
  echo "$VERDACCIO_VERSION" >"$npm_dir/.key"
fi
echo "$venv/bin/pypi-server"
echo "$npm_dir/node_modules/.bin/verdaccio"
