#!/usr/bin/env bash
#
# The "examples" suite of make test: every clients/*/test.sh (the client
# packages' own tests) and examples/*/test.sh, twice: once
# connected to the server directly, once through pgbouncer in transaction
# pooling mode (where one client's transactions may each run on a different
# server session, so nothing may lean on session state).
#
# Run inside scripts/with-server.sh, which provides the server (PGHOST,
# PGPORT, PGUSER) and pgbouncer (IDEM_BOUNCER_PORT).  Each example's test.sh
# is called from its own folder with these variables set, and must exit
# non-zero on any failure:
#
#   PGHOST PGPORT PGUSER PGDATABASE   a fresh database with the extension
#                                     created, reached directly or through
#                                     pgbouncer; PGUSER is a superuser
#   IDEM_VIA                          "direct" or "pgbouncer"
#   EXAMPLE_TMP                       a scratch folder of its own
#
# EXAMPLES picks a subset by folder name, e.g. EXAMPLES=http-python (or
# EXAMPLES=node for clients/node).
#
set -uo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGBIN=$("$PG_CONFIG" --bindir)
: "${PGHOST:?run me through scripts/with-server.sh}" "${IDEM_BOUNCER_PORT:?}"
server_port=$PGPORT

status=0
for test in clients/*/test.sh examples/*/test.sh; do
	[ -e "$test" ] || continue
	example=$(basename "$(dirname "$test")")
	if [ -n "${EXAMPLES:-}" ] && [[ " $EXAMPLES " != *" $example "* ]]; then
		continue
	fi
	for via in direct pgbouncer; do
		db=$(echo "ex_${example}_$via" | tr -c 'a-z0-9_\n' '_')
		port=$server_port
		[ "$via" = pgbouncer ] && port=$IDEM_BOUNCER_PORT
		"$PGBIN/psql" -X -q -p "$server_port" -d postgres -v ON_ERROR_STOP=1 \
			-c "SET client_min_messages = warning" \
			-c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null || exit 1
		"$PGBIN/psql" -X -q -p "$server_port" -d "$db" -v ON_ERROR_STOP=1 \
			-c "CREATE EXTENSION idempotency" >/dev/null || exit 1
		scratch=$PWD/tmp_check_examples/$db
		rm -rf "$scratch"
		mkdir -p "$scratch"

		where=$(dirname "$test")
		echo "-- $where ($via)"
		if (cd "$(dirname "$test")" &&
			PGPORT=$port PGDATABASE=$db IDEM_VIA=$via EXAMPLE_TMP=$scratch ./test.sh); then
			echo "ok: $where ($via)"
		else
			echo "FAILED: $where ($via)"
			status=1
		fi
	done
done
exit $status
