#!/usr/bin/env bash
#
# The fastify example's test, run by make test (scripts/test-examples.sh) from
# this folder, directly and through pgbouncer, with PGHOST PGPORT PGUSER
# PGDATABASE pointing at a fresh database that has the extension, and
# EXAMPLE_TMP a scratch folder. It starts the app with ./serve on free ports
# and drives it over HTTP (../orders.test.js). By hand: PG*=... ./test.sh
#
set -euo pipefail
cd "$(dirname "$0")"

. ../lib.sh
# The packages pinned by package-lock.json, into ./node_modules (and the
# package's own, clients/node, linked); the npm cache goes to the scratch
# folder, so this works as any user.
need_node

SERVE=./serve node --test ../orders.test.js
