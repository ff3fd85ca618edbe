#!/usr/bin/env bash
#
# The express example's test, run by make test (scripts/test-examples.sh) from
# this folder, directly and through pgbouncer, with PGHOST PGPORT PGUSER
# PGDATABASE pointing at a fresh database that has the extension, and
# EXAMPLE_TMP a scratch folder. It starts the app with ./serve on free ports
# and drives it over HTTP (../orders.test.js). By hand: PG*=... ./test.sh
#
set -euo pipefail
cd "$(dirname "$0")"

for tool in node npm; do
	command -v "$tool" >/dev/null || {
		echo "$tool is missing: apt-get install nodejs npm (make test does it as root)" >&2
		exit 1
	}
done

# The packages pinned by package-lock.json, into ./node_modules (and the
# package's own, clients/node, linked); the npm cache goes to the scratch
# folder, so this works as any user.
export npm_config_cache=${npm_config_cache:-${EXAMPLE_TMP:-${TMPDIR:-/tmp}}/npm-cache}
export npm_config_update_notifier=false
npm ci --no-audit --no-fund --loglevel=error

SERVE=./serve node --test ../orders.test.js
