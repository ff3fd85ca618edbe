#!/usr/bin/env bash
#
# make bench: install what is missing, build and install the extension, and
# run bench/run.py (a throwaway cluster; about 15 minutes).  Not part of
# make test: timing is never a test.
#
# run.py starts psql and pgbench as the runner (the "postgres" OS user when
# run as root) with the SQL files under bench/, and that user may not be
# able to read the checkout (one under /root), so it runs from a copy of
# bench/ that the runner owns, removed at the end.
#
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh
scripts/deps.sh
use_server
build_and_install

copy=$(runner_tmpdir bench)
trap 'rm -rf "$copy"' EXIT
trap 'exit 1' INT TERM HUP
cp -R bench "$copy/"
# EDITION=sql: the SQL edition's script, for bench/run.py's edition lines
if [ "${EDITION:-c}" = sql ]; then
	python3 scripts/build-sql-edition.py --out "$copy/dist" >/dev/null || exit 1
	export BENCH_SQL_EDITION=$(ls "$copy"/dist/idempotency-sql--*.sql)
fi
[ "$(id -u)" -eq 0 ] && chown -R "$RUN_AS" "$copy"
cd "$copy"
# Debian's python3, for which deps.sh installs psycopg (the wait part
# needs it), not whatever python3 comes first on the PATH
/usr/bin/python3 bench/run.py
