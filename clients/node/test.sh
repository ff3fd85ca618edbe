#!/usr/bin/env bash
#
# The tests of pg-idempotency, run by make test (scripts/test-examples.sh,
# EXAMPLES=node) from this folder, directly and through pgbouncer in
# transaction pooling mode (which is what shows that the package leans on no
# session state and no named prepared statement), with PGHOST PGPORT PGUSER
# PGDATABASE pointing at a fresh database that has the extension, and
# EXAMPLE_TMP a scratch folder. By hand: PG*=... ./test.sh
#
# node --test runs test/*.test.js against real Express and Fastify servers
# on free ports; tsc --noEmit checks index.d.ts against test/types.ts.
#
set -euo pipefail
cd "$(dirname "$0")"

. ../../examples/lib.sh
# The dev dependencies pinned by package-lock.json (Express, Fastify, pg,
# TypeScript), into ./node_modules; the npm cache goes to the scratch folder.
need_node

node --test test/*.test.js
node_modules/.bin/tsc -p test
