#!/usr/bin/env bash
#
# The Django example's tests: ../orders_test.py (shared by the Python
# examples) starts ./serve on a free port of 127.0.0.1 and drives it over
# HTTP. Run by make test (scripts/test-examples.sh) with PGHOST PGPORT
# PGUSER PGDATABASE (a database with the extension, direct or through
# pgbouncer) and EXAMPLE_TMP; by hand, any database where
# `CREATE EXTENSION idempotency` was run will do.
#
set -euo pipefail
cd "$(dirname "$0")"

PY=/usr/bin/python3 # Debian's, with the python3-* packages below
missing=()
for need in django:python3-django gunicorn:python3-gunicorn psycopg:python3-psycopg pytest:python3-pytest; do
	$PY -c "import ${need%%:*}" 2>/dev/null || missing+=("${need#*:}")
done
# Django 3.2 (bookworm) runs on psycopg2; 4.2 and later on psycopg 3
$PY -c 'import django, sys; sys.exit(django.VERSION < (4, 2))' 2>/dev/null ||
	$PY -c 'import psycopg2' 2>/dev/null || missing+=(python3-psycopg2)
if [ ${#missing[@]} -gt 0 ]; then
	echo "missing Debian packages: ${missing[*]} (scripts/deps.sh installs them as root)" >&2
	exit 1
fi

export EXAMPLE_DIR=$PWD EXAMPLE_TMP=${EXAMPLE_TMP:-$(mktemp -d)} PYTHONDONTWRITEBYTECODE=1
mkdir -p "$EXAMPLE_TMP"
status=0
$PY -m pytest -q -p no:cacheprovider --durations=3 ../orders_test.py || status=$?
if [ $status -ne 0 ]; then
	echo "-- $EXAMPLE_TMP/serve.log (last 40 lines)"
	tail -n 40 "$EXAMPLE_TMP/serve.log"
fi
exit $status
