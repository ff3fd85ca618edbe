#!/usr/bin/env bash
#
# Run a command against a temporary PostgreSQL instance that preloads the
# library, with pgbouncer in front of it in transaction pooling mode:
#
#   scripts/with-server.sh make installcheck
#
# The instance is configured from test/idempotency.conf plus what the
# integrations need (wal_level = logical for decoding slots, a TCP listener
# on 127.0.0.1).  The command gets PGHOST, PGPORT and PGUSER for the
# instance (a superuser, over the unix socket) and IDEM_BOUNCER_PORT for
# pgbouncer on the same socket directory; the server's and pgbouncer's logs
# are shown if it fails.  Both are stopped at the end, whatever happens.
#
# Run as the unprivileged runner (scripts/test.sh sees to that), in a tree
# it can write: the instance lives in ./tmp_check_server.
#
set -uo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh
use_server
dir=$PWD/tmp_check_server
rm -rf "$dir"
mkdir -p "$dir"

# a port nobody listens on, other than $1
free_port() {
	local port=$((20000 + RANDOM % 20000))
	while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || [ -e "$dir/.s.PGSQL.$port" ] ||
		[ "$port" = "${1:-}" ]; do
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
{
	cat test/idempotency.conf
	echo "listen_addresses = '127.0.0.1'"
	echo "unix_socket_directories = '$dir'"
	echo "port = $pgport"
	echo "max_connections = 120"
	echo "wal_level = logical"
} >>"$dir/data/postgresql.conf"
"$PGBIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null || {
	cat "$dir/server.log"
	exit 1
}

# pgbouncer forwards every database name to the instance; "trust" still
# wants the user in its auth file.
bouncerport=$(free_port "$pgport")
printf '%s\n' \
	"[databases]" \
	"* = host=$dir port=$pgport" \
	"[pgbouncer]" \
	"listen_addr = 127.0.0.1" \
	"listen_port = $bouncerport" \
	"unix_socket_dir = $dir" \
	"auth_type = trust" \
	"auth_file = $dir/userlist.txt" \
	"pool_mode = transaction" \
	"max_client_conn = 200" \
	"default_pool_size = 10" \
	"logfile = $dir/pgbouncer.log" \
	"pidfile = $dir/pgbouncer.pid" >"$dir/pgbouncer.ini"
echo "\"$user\" \"\"" >"$dir/userlist.txt"
/usr/sbin/pgbouncer -d -q "$dir/pgbouncer.ini" || exit 1
for _ in $(seq 50); do
	"$PGBIN/psql" -X -q -h "$dir" -p "$bouncerport" -U "$user" -d postgres \
		-c 'SELECT 1' >/dev/null 2>&1 && break
	sleep 0.1
done

PGHOST=$dir PGPORT=$pgport PGUSER=$user IDEM_BOUNCER_PORT=$bouncerport "$@"
status=$?
if [ $status -ne 0 ]; then
	echo "-- server log (last 40 lines)"
	tail -n 40 "$dir/server.log"
	echo "-- pgbouncer log (last 20 lines)"
	tail -n 20 "$dir/pgbouncer.log"
fi
exit $status
