#!/usr/bin/env bash
#
# bench/callgrind.sh: the instructions and the WAL one call costs, of
# idem_mark_processed and of its reference (INSERT ... ON CONFLICT DO NOTHING
# RETURNING into a copy of processed_events), counted by callgrind in a
# single-user server: a PREPARE, then N EXECUTEs of new keys, for N = 500
# and 1500; a call costs the difference over 1000.  Unlike make bench's
# throughput, the count does not depend on the machine's load or on other
# versions' timing, so it tells whether one server version makes our side
# dearer than its reference.  Run after make bench or make install (the
# extension installed in PG_CONFIG's server); as root it installs valgrind
# when missing.
#
# With the argument "batch" it counts the batch forms instead, an event
# each: idem_mark_processed_batch of 500 new ids a call against its
# references, the INSERT ... SELECT unnest(...) ON CONFLICT DO NOTHING
# RETURNING of the same rows and 500 single calls; N calls of 500 ids for
# N = 2 and 6, the difference over 2,000 ids.  The bench's
# mark_batch_vs_single ratio is near the single call's count over the
# batch's, plus the round trips that the single calls pay and a
# single-user server does not.
#
# With the argument "keys" it counts the key functions' two hot cases, on
# the direct path and through kept SPI plans (idempotency.keys_spi, issue 29
# item 2): a replay of a completed key (make bench's replay.sql), and a
# claim + complete of a new key in a transaction of its own
# (claim_complete.sql), after 100,000 stored responses and a VACUUM
# (ANALYZE) of the table, as make bench's pairs start.
#
# BENCH_CALLGRIND_KEEP=PREFIX keeps each count's callgrind output (of its
# longer run) as PREFIX.<label>, for callgrind_annotate.
#
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh
use_server
if ! command -v valgrind >/dev/null; then
	[ "$(id -u)" -eq 0 ] || { echo "install valgrind" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends valgrind >/dev/null
fi

dir=$(runner_tmpdir callgrind)
trap 'rm -rf "$dir"' EXIT
trap 'exit 1' INT TERM HUP
as_runner "$PGBIN/initdb" -D "$dir/data" -A trust -U postgres --no-sync >/dev/null
printf "shared_preload_libraries = 'idempotency'\nfsync = off\n" >>"$dir/data/postgresql.conf"

single() {
	as_runner "$@" "$PGBIN/postgres" --single -D "$dir/data" postgres
}
printf '%s\n' "CREATE EXTENSION idempotency;" \
	"CREATE TABLE bench_events (LIKE idempotency.processed_events INCLUDING ALL);" |
	single >/dev/null

# statements, one a line, as single-user mode reads them
calls() {
	local statement=$1 n=$2
	echo "PREPARE s(text) AS $statement;"
	echo "CREATE TEMP TABLE wal AS SELECT pg_current_wal_insert_lsn() AS lsn;"
	for ((k = 1; k <= n; k++)); do echo "EXECUTE s('$n-$k');"; done
	echo "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), lsn) AS wal_bytes FROM wal;"
}

# keys_calls SPI:CASE N: the key functions' case (replay or claim) N times,
# with idempotency.keys_spi = SPI
keys_calls() {
	local spi=${1%%:*} case=${1#*:} n=$2
	echo "SET idempotency.keys_spi = $spi;"
	echo "PREPARE r(text) AS SELECT outcome, status_code, body, headers FROM idempotency.idem_claim('replay', \$1);"
	echo "PREPARE c(text) AS SELECT outcome FROM idempotency.idem_claim('bench', \$1);"
	echo "PREPARE d(text) AS SELECT idempotency.idem_complete('bench', \$1, 201, '{\"id\": 1, \"status\": \"created\"}', '{\"Location\": \"/payments/1\"}');"
	echo "CREATE TEMP TABLE wal AS SELECT pg_current_wal_insert_lsn() AS lsn;"
	for ((k = 1; k <= n; k++)); do
		if [ "$case" = replay ]; then
			echo "EXECUTE r('$(((k * 7919) % 100000 + 1))');"
		else
			printf '%s\n' "BEGIN;" "EXECUTE c('$spi-$n-$k');" "EXECUTE d('$spi-$n-$k');" "COMMIT;"
		fi
	done
	echo "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), lsn) AS wal_bytes FROM wal;"
}

# count_runs LABEL STATEMENT FEW MANY IDS UNIT: runs STATEMENT FEW times,
# then MANY times, each run counted by callgrind; IDS is how many more ids
# the second run wrote.  Prints the instructions an id (the difference of
# the runs over IDS) and the WAL bytes an id (the second run's WAL over its
# ids, MANY * IDS / (MANY - FEW)), labelled "a UNIT".
count_runs() {
	local label=$1 statement=$2 few=$3 many=$4 ids=$5 unit=$6 n ir=() wal
	for n in "$few" "$many"; do
		"${CALLS:-calls}" "$statement" "$n" >"$dir/in"
		chmod 644 "$dir/in"
		single valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
			<"$dir/in" >"$dir/out" 2>"$dir/err"
		ir+=("$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$dir/err")")
		wal=$(sed -n 's/.*wal_bytes = "\([0-9]*\)".*/\1/p' "$dir/out")
	done
	if [ -n "${BENCH_CALLGRIND_KEEP:-}" ]; then
		cp "$dir/callgrind.out" "$BENCH_CALLGRIND_KEEP.$(echo "$label" | tr -c 'a-z0-9\n' _)"
	fi
	printf '%-44s %8d instructions, %4d WAL bytes %s\n' "$label" \
		$(((ir[1] - ir[0]) / ids)) $((wal / (many * ids / (many - few)))) "$unit"
}

# count LABEL STATEMENT: a call of one new key, 500 and 1,500 calls
count() {
	count_runs "$1" "$2" 500 1500 1000 "a call"
}

# count_batch LABEL STATEMENT: an id of a call of 500 new ids ($1 prefixes
# them), 2 and 6 calls
count_batch() {
	count_runs "$1" "$2" 2 6 2000 "an id"
}

echo "PostgreSQL $("$PG_CONFIG" --version | awk '{ print $2 }'), callgrind, postgres --single"
if [ "${1:-}" = keys ]; then
	printf '%s\n' "INSERT INTO idempotency.keys (scope, key, fingerprint, attempt, status_code, body, headers, ttl, created_at, completed_at, expires_at) SELECT 'replay', n::text, NULL, 1, 201, '{\"id\": ' || n || ', \"status\": \"created\"}', '{\"Location\": \"/payments/1\"}', '24 hours', now(), now(), now() + interval '24 hours' FROM generate_series(1, 100000) n;" \
		"VACUUM (ANALYZE) idempotency.keys;" | single >/dev/null
	CALLS=keys_calls
	count "replay, direct" off:replay
	count "replay, SPI" on:replay
	count "claim + complete, direct" off:claim
	count "claim + complete, SPI" on:claim
	exit 0
fi
if [ "${1:-}" = batch ]; then
	ids="ARRAY(SELECT \$1 || '-' || g FROM generate_series(1, 500) g)"
	count_batch "idem_mark_processed_batch of 500" \
		"SELECT count(*) FROM idempotency.idem_mark_processed_batch('bench', $ids)"
	count_batch "INSERT ... SELECT unnest(500) ... RETURNING" \
		"WITH i AS (INSERT INTO bench_events SELECT 'bench', e, now(), now() + interval '14 days' FROM unnest($ids) AS e ON CONFLICT DO NOTHING RETURNING event_id) SELECT count(*) FROM i"
	count "idem_mark_processed (single, for the ratio)" "SELECT idempotency.idem_mark_processed('bench', \$1)"
	exit 0
fi
count "idem_mark_processed" "SELECT idempotency.idem_mark_processed('bench', \$1)"
count "INSERT ... ON CONFLICT DO NOTHING RETURNING" \
	"INSERT INTO bench_events VALUES ('bench', \$1, now(), now() + interval '14 days') ON CONFLICT DO NOTHING RETURNING true"
