#!/usr/bin/env bash
#
# The Flask example's tests: ../orders_test.py (shared by the Python
# examples) starts ./serve on a free port of 127.0.0.1 and drives it over
# HTTP. Run by make test (scripts/test-examples.sh) with PGHOST PGPORT
# PGUSER PGDATABASE (a database with the extension, direct or through
# pgbouncer) and EXAMPLE_TMP; by hand, any database where
# `CREATE EXTENSION idempotency` was run will do.
#
set -euo pipefail
cd "$(dirname "$0")"

. ../lib.sh
need_python flask:python3-flask gunicorn:python3-gunicorn psycopg:python3-psycopg psycopg_pool:python3-psycopg-pool pytest:python3-pytest
run_orders_test
