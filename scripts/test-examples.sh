#!/usr/bin/env bash
#
# The "examples" suite of make test: every examples/*/test.sh, run against a
# temporary instance that preloads the library, twice: once connected
# directly, once through pgbouncer in transaction pooling mode (where one
# client's transactions may each run on a different server session, so
# nothing may lean on session state).
#
# Run by scripts/test.sh as the unprivileged runner, from the copy of the tree
# the suites run in.  Each example's test.sh is called from its own folder
# with these variables set, and must exit non-zero on any failure:
#
#   PGHOST PGPORT PGUSER PGDATABASE   a fresh database with the extension
#                                     created, reached directly or through
#                                     pgbouncer; PGUSER is a superuser
#   IDEM_VIA                          "direct" or "pgbouncer"
#   EXAMPLE_TMP                       a scratch folder of its own
#
# EXAMPLES picks a subset by folder name, e.g. EXAMPLES=http-python.
#
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGBIN=$("$PG_CONFIG" --bindir)
dir=$root/tmp_check_examples
rm -rf "$dir"
mkdir -p "$dir"

free_port() {
	local port=$((20000 + RANDOM % 20000))
	while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || [ -e "$dir/.s.PGSQL.$port" ]; do
		port=$((port + 1))
	done
	echo "$port"
}

cleanup() {
	[ -f "$dir/pgbouncer.pid" ] && kill "$(cat "$dir/pgbouncer.pid")" 2>/dev/null
	"$PGBIN/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

user=$(id -un)
pgport=$(free_port)
"$PGBIN/initdb" -D "$dir/data" -A trust -U "$user" --no-sync >/dev/null || exit 1
cat >>"$dir/data/postgresql.conf" <<EOF
shared_preload_libraries = 'idempotency'
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
port = $pgport
max_connections = 120
wal_level = logical
idempotency.purge_interval = '1s'
EOF
"$PGBIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null || {
	cat "$dir/server.log"
	exit 1
}

# pgbouncer forwards every database name to the instance; "trust" still
# wants the user in its auth file.
bouncerport=$(free_port)
while [ "$bouncerport" = "$pgport" ]; do bouncerport=$(free_port); done
cat >"$dir/pgbouncer.ini" <<EOF
[databases]
* = host=$dir port=$pgport

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bouncerport
unix_socket_dir = $dir
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
max_client_conn = 200
default_pool_size = 10
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
EOF
echo "\"$user\" \"\"" >"$dir/userlist.txt"
/usr/sbin/pgbouncer -d -q "$dir/pgbouncer.ini" || exit 1
for _ in $(seq 50); do
	"$PGBIN/psql" -X -q -h "$dir" -p "$bouncerport" -U "$user" -d postgres \
		-c 'SELECT 1' >/dev/null 2>&1 && break
	sleep 0.1
done

status=0
for test in examples/*/test.sh; do
	example=$(basename "$(dirname "$test")")
	if [ -n "${EXAMPLES:-}" ] && [[ " $EXAMPLES " != *" $example "* ]]; then
		continue
	fi
	for via in direct pgbouncer; do
		db=$(echo "ex_${example}_$via" | tr -c 'a-z0-9_\n' '_')
		port=$pgport
		[ "$via" = pgbouncer ] && port=$bouncerport
		"$PGBIN/psql" -X -q -h "$dir" -p "$pgport" -U "$user" -d postgres \
			-v ON_ERROR_STOP=1 -c "CREATE DATABASE $db" >/dev/null || exit 1
		"$PGBIN/psql" -X -q -h "$dir" -p "$pgport" -U "$user" -d "$db" \
			-v ON_ERROR_STOP=1 -c "CREATE EXTENSION idempotency" >/dev/null || exit 1
		scratch=$dir/$db
		mkdir -p "$scratch"

		echo "-- examples/$example ($via)"
		if (cd "$(dirname "$test")" &&
			PGHOST=$dir PGPORT=$port PGUSER=$user PGDATABASE=$db \
				IDEM_VIA=$via EXAMPLE_TMP=$scratch ./test.sh); then
			echo "ok: examples/$example ($via)"
		else
			echo "FAILED: examples/$example ($via)"
			status=1
		fi
	done
done

if [ $status -ne 0 ]; then
	echo "-- server log (last 40 lines)"
	tail -n 40 "$dir/server.log"
	echo "-- pgbouncer log (last 20 lines)"
	tail -n 20 "$dir/pgbouncer.log"
fi
exit $status
