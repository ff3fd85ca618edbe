#!/usr/bin/env bash
#
# End-to-end test of the HTTP example: starts the provider stub and the
# service on free ports of 127.0.0.1, waits until both listen, then drives
# them over HTTP with test_e2e.py. Run by make test (scripts/test-examples.sh)
# with PGHOST PGPORT PGUSER PGDATABASE (a database with the extension; direct
# or through pgbouncer, IDEM_VIA says which) and EXAMPLE_TMP; by hand, any
# database where `CREATE EXTENSION idempotency` was run will do.
#
set -euo pipefail
cd "$(dirname "$0")"

PY=/usr/bin/python3 # Debian's, which has python3-psycopg
tmp=${EXAMPLE_TMP:-$(mktemp -d)}
mkdir -p "$tmp"

# A short lease, so that taking over a crashed request takes 2 s, and a
# provider timeout below it, as in production (30 s and 10 s by default).
export IDEM_LEASE=2 PROVIDER_TIMEOUT=1.5

# Every process started here or by test_e2e.py leaves its pid in $tmp/*.pid.
cleanup() {
	local pidfile
	for pidfile in "$tmp"/*.pid; do
		[ -e "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null
		rm -f "$pidfile"
	done
	return 0
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# start NAME SCRIPT [VAR=value...]: start it on a free port, print its URL
start() {
	local name=$1 script=$2
	shift 2
	: >"$tmp/$name.log" # now, not in the background: no old line may be read
	env PORT=0 "$@" "$PY" "$script" >>"$tmp/$name.log" 2>&1 &
	echo $! >"$tmp/$name.pid"
	for _ in $(seq 100); do
		if grep -q '^listening on http://.*:[0-9]' "$tmp/$name.log"; then
			sed -n 's/^listening on //p' "$tmp/$name.log"
			return 0
		fi
		kill -0 "$(cat "$tmp/$name.pid")" 2>/dev/null || break
		sleep 0.1
	done
	echo "$name did not start:" >&2
	cat "$tmp/$name.log" >&2
	return 1
}

provider_url=$(start provider provider.py)
service_url=$(start service app.py PROVIDER_URL="$provider_url")
echo "provider stub at $provider_url, service at $service_url (database ${PGDATABASE:-?} via ${IDEM_VIA:-direct})"

status=0
SERVICE_URL=$service_url PROVIDER_URL=$provider_url EXAMPLE_TMP=$tmp \
	"$PY" test_e2e.py || status=$?

if [ $status -ne 0 ]; then
	for log in "$tmp"/*.log; do
		echo "-- $log (last 30 lines)"
		tail -n 30 "$log"
	done
fi
exit $status
