#!/usr/bin/env bash
#
# make demo: a tour of the extension on a throwaway cluster.
#
# Starts a temporary PostgreSQL (unix socket only, a port of its own, in a
# temporary directory) with the library preloaded, creates the extension,
# and shows each behaviour with the SQL an application would send.  The
# cluster is stopped and removed at the end, whatever happens.
#
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh
scripts/deps.sh demo
use_server

echo "== building and installing the extension"
build_and_install

dir=$(runner_tmpdir demo)
cleanup() {
	as_runner "$PGBIN/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
	rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP PIPE

# a port nobody listens on
port=$((20000 + RANDOM % 20000))
while [ -e "$dir/.s.PGSQL.$port" ] || (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
	port=$((port + 1))
done

echo "== starting a throwaway cluster in $dir (port $port, unix socket only)"
as_runner "$PGBIN/initdb" -D "$dir/data" -A trust -U postgres --no-sync >/dev/null
cat >>"$dir/data/postgresql.conf" <<EOF
shared_preload_libraries = 'idempotency'
idempotency.purge_interval = '1s'
listen_addresses = ''
unix_socket_directories = '$dir'
port = $port
EOF
as_runner "$PGBIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null

psql_demo() {
	as_runner "$PGBIN/psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres \
		-v ON_ERROR_STOP=1 -P pager=off -e "$@"
}

section() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

section "install"
psql_demo <<'SQL'
CREATE EXTENSION idempotency;
SQL

section "claim -> complete -> replay (one transaction: claim, business write, complete, commit)"
psql_demo <<'SQL'
CREATE TABLE payments (id serial PRIMARY KEY, amount int);
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_claim('alice:POST /payments', 'key-1',
       idempotency.idem_fingerprint('{"amount": 10}'::jsonb));
INSERT INTO payments (amount) VALUES (10);
SELECT idempotency.idem_complete('alice:POST /payments', 'key-1', 201,
       '{"id": 1, "amount": 10}', '{"Location": "/payments/1"}');
COMMIT;
\echo '-- the client retries: the stored response comes back, byte for byte (HTTP: + Idempotent-Replayed: true)'
SELECT outcome, status_code, body, headers FROM idempotency.idem_claim('alice:POST /payments', 'key-1',
       idempotency.idem_fingerprint('{"amount":10}'::jsonb));
SELECT count(*) AS payments FROM payments;
SQL

section "a concurrent duplicate gets in_progress at once (HTTP 409), then replay"
# a first request holds its transaction open for two seconds
as_runner "$PGBIN/psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres -c "
	BEGIN;
	SELECT idempotency.idem_claim('alice:POST /payments', 'key-2');
	SELECT pg_sleep(2);
	SELECT idempotency.idem_complete('alice:POST /payments', 'key-2', 201, '{\"id\": 2}');
	COMMIT;" >/dev/null &
first=$!
until as_runner "$PGBIN/psql" -X -Atq -h "$dir" -p "$port" -U postgres -d postgres \
	-c "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'" | grep -q 1; do
	sleep 0.1
done
psql_demo <<'SQL'
\echo '-- while the first request is still running:'
SELECT outcome FROM idempotency.idem_claim('alice:POST /payments', 'key-2');
SQL
wait $first
psql_demo <<'SQL'
\echo '-- after it committed:'
SELECT outcome, status_code, body FROM idempotency.idem_claim('alice:POST /payments', 'key-2');
SQL

section "the same key with another request body is a mismatch (HTTP 422)"
psql_demo <<'SQL'
SELECT outcome FROM idempotency.idem_claim('alice:POST /payments', 'key-1',
       idempotency.idem_fingerprint('{"amount": 99}'::jsonb));
SQL

section "a transient answer (503) is not stored: the key is released and a retry runs again"
psql_demo <<'SQL'
SELECT outcome, attempt FROM idempotency.idem_claim('alice:POST /payments', 'key-3');
SELECT idempotency.idem_complete('alice:POST /payments', 'key-3', 503, 'upstream unavailable');
SELECT outcome, attempt FROM idempotency.idem_claim('alice:POST /payments', 'key-3');
\echo '-- this time the request succeeds, and its answer is stored:'
SELECT idempotency.idem_complete('alice:POST /payments', 'key-3', 201, '{"id": 3}');
SQL

section "two transactions: a crashed client's lease runs out and a retry takes over"
psql_demo <<'SQL'
SELECT outcome, attempt FROM idempotency.idem_claim('alice:POST /charges', 'key-4', lease => '1 second');
SELECT idempotency.idem_checkpoint('alice:POST /charges', 'key-4', 'card charged', 1);
\echo '-- ... the client crashes here; a second later the retry arrives:'
SELECT pg_sleep(1.1);
SELECT outcome, attempt, recovery_point FROM idempotency.idem_claim('alice:POST /charges', 'key-4');
SELECT idempotency.idem_complete('alice:POST /charges', 'key-4', 200, 'charged once', NULL, 2);
SQL

section "consumer deduplication: the first delivery is processed, a redelivery is skipped"
psql_demo <<'SQL'
CREATE TABLE invoices (order_id int);
BEGIN;
SELECT idempotency.idem_mark_processed('billing', 'evt-1001') AS process_it;
INSERT INTO invoices VALUES (1001);
COMMIT;
\echo '-- the broker delivers evt-1001 again:'
BEGIN;
SELECT idempotency.idem_mark_processed('billing', 'evt-1001') AS process_it;
COMMIT;
SELECT count(*) AS invoices FROM invoices;
SQL

section "transactional outbox: events exist only if their transaction commits"
psql_demo <<'SQL'
BEGIN;
SELECT idempotency.idem_outbox_enqueue('orders', '{"order": 7, "event": "created"}', 'order-7');
ROLLBACK;
BEGIN;
SELECT idempotency.idem_outbox_enqueue('orders', '{"order": 7, "event": "created"}', 'order-7');
SELECT idempotency.idem_outbox_enqueue('orders', '{"order": 7, "event": "paid"}', 'order-7');
SELECT idempotency.idem_outbox_enqueue('orders', '{"order": 8, "event": "created"}', 'order-8');
COMMIT;
SELECT id, topic, key, payload, state FROM idempotency.outbox ORDER BY id;
SQL

section "a relay pulls them: one row per key at a time, in order; ack publishes, nack retries later"
psql_demo <<'SQL'
SELECT id, key, payload, attempts FROM idempotency.idem_outbox_fetch('orders', 10);
\echo '-- ack and nack name the attempt each row was fetched with (the fence): a relay whose'
\echo '-- lease ran out, and whose rows another relay fetched again, changes nothing'
SELECT idempotency.idem_outbox_ack(ARRAY[2], ARRAY[1]) AS acknowledged;
SELECT idempotency.idem_outbox_nack(4, 'broker timeout', 1) AS nacked;
\echo '-- order 7 moves on to its next event; order 8 waits for its backoff:'
SELECT id, key, payload, attempts FROM idempotency.idem_outbox_fetch('orders', 10);
SELECT idempotency.idem_outbox_ack(ARRAY[3], ARRAY[1]) AS acknowledged;
SELECT id, key, state, attempts, last_error, available_at > now() AS backing_off
FROM idempotency.outbox ORDER BY id;
SQL

section "the background worker publishes routed topics: a function of yours receives each row, in order"
psql_demo <<'SQL'
CREATE TABLE shipments (event_id bigint, order_no int, event text, published_at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION ship(e idempotency.outbox) RETURNS void LANGUAGE sql AS $$
  INSERT INTO public.shipments (event_id, order_no, event) VALUES (e.id, (e.payload->>'order')::int, e.payload->>'event')
$$;
SELECT idempotency.idem_outbox_route('shipping', 'function', 'ship');
BEGIN;
SELECT idempotency.idem_outbox_enqueue('shipping', '{"order": 9, "event": "packed"}', 'order-9');
SELECT idempotency.idem_outbox_enqueue('shipping', '{"order": 9, "event": "shipped"}', 'order-9');
COMMIT;
SELECT pg_sleep(0.5);
\echo '-- the commit woke the worker; it published both rows and removed them from the outbox:'
SELECT event_id, order_no, event FROM shipments ORDER BY event_id;
SELECT count(*) AS left_in_outbox FROM idempotency.outbox WHERE topic = 'shipping';
SQL

section "the background worker purges expired keys"
psql_demo <<'SQL'
SELECT outcome FROM idempotency.idem_claim('demo:POST /short', 'k', ttl => '1 second');
SELECT idempotency.idem_complete('demo:POST /short', 'k', 200, 'short-lived');
SELECT count(*) AS keys_before FROM idempotency.keys WHERE scope = 'demo:POST /short';
SELECT pg_sleep(2.5);
SELECT count(*) AS keys_after FROM idempotency.keys WHERE scope = 'demo:POST /short';
SQL

section "idempotency.stats"
psql_demo <<'SQL'
\echo '-- every key was completed: none is left in progress (keys_in_progress 0); the outbox'
\echo '-- holds order 8''s event, waiting for its retry after the broker timeout (outbox_pending 1)'
\x on
SELECT * FROM idempotency.stats;
SQL

section "the stored keys"
psql_demo <<'SQL'
SELECT scope, key, attempt, status_code, recovery_point FROM idempotency.keys ORDER BY scope, key;
SQL

section "done: stopping and removing the cluster"
