#!/usr/bin/env bash
# Installs (once) the pinned `e2b` npm package the E2B gateway's JavaScript scenario runs:
# ${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-js-VERSION/node_modules. It needs Node.js 20.18
# or newer (the package's engines) with npm. Prints the node_modules directory.
set -euo pipefail

readonly VERSION=2.51.0
dir=${AIRLOCK_CACHE_DIR:-/var/cache/airlock}/e2b-js-$VERSION
command -v npm >/dev/null || {
  echo "the e2b npm package needs Node.js (>= 20.18) and npm on PATH" >&2
  exit 1
}
if [[ ! -f $dir/node_modules/e2b/package.json ]]; then
  echo "== installing e2b@$VERSION into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && npm install --no-audit --no-fund --loglevel=error "e2b@$VERSION" >&2)
fi
echo "$dir/node_modules"
