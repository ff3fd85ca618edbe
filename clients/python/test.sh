#!/usr/bin/env bash
#
# The Python package's own tests (tests/): every adapter (Starlette, Flask,
# Django) served for real in threads of the test process, dedup and
# dedup_batch, against the database of libpq's environment variables; then
# the offline install of README.md (a venv over Debian's packages, no
# index). Run by make test (scripts/test-examples.sh) with PGHOST PGPORT
# PGUSER PGDATABASE (a database with the extension, direct or through
# pgbouncer) and EXAMPLE_TMP.
#
set -euo pipefail
cd "$(dirname "$0")"

. ../../examples/lib.sh
need_python psycopg:python3-psycopg psycopg_pool:python3-psycopg-pool \
	starlette:python3-starlette uvicorn:python3-uvicorn flask:python3-flask \
	django:python3-django pytest:python3-pytest venv:python3-venv \
	ensurepip:python3-venv setuptools:python3-setuptools wheel:python3-wheel

tmp=${EXAMPLE_TMP:-$(mktemp -d)}
mkdir -p "$tmp"
PYTHONPATH="$PWD:$PWD/tests" $PY -m pytest -q -p no:cacheprovider tests

# The install README.md gives, from a copy (the build writes next to the
# sources); once, on the direct pass: it does not touch the database.
if [ "${IDEM_VIA:-direct}" != pgbouncer ]; then
	rm -rf "$tmp/src" "$tmp/venv"
	cp -r . "$tmp/src"
	$PY -m venv --system-site-packages "$tmp/venv"
	"$tmp/venv/bin/pip" install --quiet --no-index --no-build-isolation \
		"$tmp/src[asgi,flask,django,dedup]"
	(cd / && "$tmp/venv/bin/python" -c '
import pathlib, pg_idempotency, pg_idempotency.asgi, pg_idempotency.flask
package = pathlib.Path(pg_idempotency.__file__).parent
assert "site-packages" in str(package) and (package / "py.typed").exists(), package
print("pip install: ok,", package)')
fi
