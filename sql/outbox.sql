--
-- outbox: enqueue in the business transaction, and the pull API a relay
-- uses (fetch, ack, nack, requeue, discard).
--
SET search_path = idempotency, public;

-- An event exists if and only if its transaction commits.
BEGIN;
SELECT idem_outbox_enqueue('orders', '{"order": 1, "status": "created"}', 'order-1') AS id;
ROLLBACK;
SELECT count(*) AS after_rollback FROM outbox;
BEGIN;
SELECT idem_outbox_enqueue('orders', '{"order": 1, "status": "created"}', 'order-1',
                           '{"trace-id": "abc"}') AS id;
SELECT idem_outbox_enqueue('orders', '{"order": 1, "status": "paid"}', 'order-1') AS id;
SELECT idem_outbox_enqueue('orders', '{"order": 2, "status": "created"}', 'order-2') AS id;
SELECT idem_outbox_enqueue('orders', '{"note": "no key"}') AS id;
SELECT idem_outbox_enqueue('orders', '{"note": "no key either"}') AS id;
COMMIT;
SELECT id, topic, key, payload, headers, state, attempts, last_error,
       created_at IS NOT NULL AS has_created_at, published_at
FROM outbox ORDER BY id;

-- A fetch leases the ready head of every key, oldest first; rows without a
-- key are independent.  Order 1's second event waits behind its first.
SELECT id, key, payload, state, attempts FROM idem_outbox_fetch('orders', 10);
-- nothing else is ready while those are leased
SELECT count(*) AS fetched_again FROM idem_outbox_fetch('orders', 10);
-- other topics are separate
SELECT count(*) AS other_topic FROM idem_outbox_fetch('payments', 10);

-- Acknowledging publishes: with outbox_retention = 0 (the default) the rows
-- are deleted.  Only leased rows count: unknown ids, repeated ids and rows
-- not leased are not acknowledged.
SELECT idem_outbox_ack(ARRAY[2, 3, 3, 999, -1]::bigint[]) AS acknowledged;
SELECT idem_outbox_ack(ARRAY[]::bigint[]) AS nothing;
SELECT idem_outbox_ack(ARRAY[NULL]::bigint[]) AS null_element;
SELECT id, state FROM outbox ORDER BY id;

-- Order 1's second event comes out only once the first is acknowledged.
SELECT idem_outbox_ack(ARRAY[4, 5]::bigint[]) AS acknowledged;
SELECT id, key, payload FROM idem_outbox_fetch('orders', 10);
SELECT idem_outbox_ack(ARRAY[3, 6]::bigint[]) AS acknowledged;
SELECT count(*) AS fetched_after_all FROM idem_outbox_fetch('orders', 10);
SELECT count(*) AS left_in_outbox FROM outbox;

-- The batch limits how many rows one fetch leases.
SELECT count(idem_outbox_enqueue('batch', jsonb_build_object('n', n))) FROM generate_series(1, 5) n;
SELECT array_agg(id ORDER BY id) AS first_batch FROM idem_outbox_fetch('batch', 2);
SELECT array_agg(id ORDER BY id) AS second_batch FROM idem_outbox_fetch('batch', 2);
SELECT idem_outbox_ack(array_agg(id)) AS acknowledged FROM outbox WHERE topic = 'batch';

-- A row whose lease runs out unacknowledged is handed out again at once,
-- and that counts as an attempt.
SELECT idem_outbox_enqueue('leases', '{"n": 1}', 'k') AS id \gset
SELECT id = :id AS fetched, attempts FROM idem_outbox_fetch('leases', 10, '1 hour');
SELECT count(*) AS while_leased FROM idem_outbox_fetch('leases', 10);
-- (time passes: the lease runs out)
UPDATE outbox SET available_at = now() - interval '1 second' WHERE id = :id;
SELECT id = :id AS fetched_again, attempts FROM idem_outbox_fetch('leases', 10, '1 hour');

-- A nack records the error and schedules the next try no sooner than
-- idempotency.outbox_backoff_min (1 s by default); the row keeps holding
-- back its key meanwhile.  A nack of a row that is not leased is false.
SELECT idem_outbox_enqueue('leases', '{"n": 2}', 'k') AS later_id \gset
SELECT clock_timestamp() AS before_nack \gset
SELECT idem_outbox_nack(:id, 'broker unavailable') AS nacked;
SELECT idem_outbox_nack(:id, 'again') AS nack_when_not_leased;
SELECT idem_outbox_nack(999, 'unknown') AS nack_unknown;
SELECT state, attempts, last_error,
       available_at >= :'before_nack'::timestamptz + interval '1 second' AS waits_at_least_min
FROM outbox WHERE id = :id;
SELECT count(*) AS ready_during_backoff FROM idem_outbox_fetch('leases', 10);

-- Backoff grows exponentially between the two settings, with jitter, and
-- after idempotency.outbox_max_attempts the row is dead.
SET idempotency.outbox_backoff_min = '10ms';
SET idempotency.outbox_backoff_max = '40ms';
SET idempotency.outbox_max_attempts = 4;
-- (time passes: the backoff is over)
UPDATE outbox SET available_at = now() WHERE id = :id;
CREATE TEMP TABLE tries (attempts int, state text, delay_ms float8);
DO $$
DECLARE
	r idempotency.outbox;
BEGIN
	FOR i IN 1 .. 6 LOOP
		PERFORM pg_sleep(0.05);
		SELECT * INTO r FROM idempotency.idem_outbox_fetch('leases', 1);
		EXIT WHEN r.id IS NULL;
		PERFORM idempotency.idem_outbox_nack(r.id, 'failure ' || r.attempts);
		INSERT INTO tries
		SELECT o.attempts, o.state,
			   extract(epoch FROM o.available_at - clock_timestamp()) * 1000
		FROM idempotency.outbox o WHERE o.id = r.id;
	END LOOP;
END $$;
-- attempt 3 waits at most the maximum, attempt 4 dies
SELECT attempts, state, delay_ms <= 40 AS within_max FROM tries ORDER BY attempts;
SELECT id = :id AS dead_row, state, attempts, last_error FROM outbox WHERE topic = 'leases' ORDER BY id;
-- a dead row keeps holding back its key
SELECT count(*) AS fetched_behind_dead FROM idem_outbox_fetch('leases', 10);

-- A lease that runs out on the last attempt also makes the row dead.
SELECT idem_outbox_enqueue('expiry', '{}', 'k') AS expiry_id \gset
SET idempotency.outbox_max_attempts = 1;
SELECT count(*) AS fetched FROM idem_outbox_fetch('expiry', 1, '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT count(*) AS fetched_after_expiry FROM idem_outbox_fetch('expiry', 1);
SELECT state, attempts, last_error FROM outbox WHERE id = :expiry_id;
RESET idempotency.outbox_max_attempts;

-- Requeue brings a dead row back with its failures reset (its attempts,
-- the hand-outs, stay); discard drops
-- one.  Both are false for a row that is not dead.
SELECT idem_outbox_requeue(:id) AS requeued, idem_outbox_requeue(:id) AS requeued_twice;
SELECT state, attempts, failures FROM outbox WHERE id = :id;
SELECT id = :id AS head_is_back FROM idem_outbox_fetch('leases', 10);
SELECT idem_outbox_discard(:later_id) AS discard_not_dead;
SELECT idem_outbox_discard(:expiry_id) AS discarded, idem_outbox_discard(:expiry_id) AS discarded_twice;
SELECT idem_outbox_requeue(999) AS requeue_unknown, idem_outbox_discard(999) AS discard_unknown;
RESET idempotency.outbox_backoff_min;
RESET idempotency.outbox_backoff_max;

-- With idempotency.outbox_retention above zero, acknowledged rows are kept
-- as published (the worker purges them later), and still do not come back.
SET idempotency.outbox_retention = '1h';
SELECT idem_outbox_ack(ARRAY[:id]::bigint[]) AS acknowledged;
SELECT state, published_at IS NOT NULL AS has_published_at FROM outbox WHERE id = :id;
SELECT id = :later_id AS next_in_key FROM idem_outbox_fetch('leases', 10);
RESET idempotency.outbox_retention;

-- idem_outbox_enqueue writes the table and its indexes itself: every row is
-- in each index that should hold it (amcheck's heapallindexed), and in no
-- partial index whose predicate it fails (the planner trusts the predicate
-- and does not check published_at again, so a stray entry would show here).
SELECT count(idem_outbox_enqueue('amcheck', jsonb_build_object('n', n), 'k' || n % 3)) AS enqueued
FROM generate_series(1, 50) n;
CREATE EXTENSION amcheck;
SELECT c.relname AS index, bt_index_check(c.oid, true) AS consistent
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = 'outbox'::regclass ORDER BY 1;
DROP EXTENSION amcheck;
-- The worker may purge the published row at any moment (its retention is
-- the server's, 0): the index and the heap are compared in one snapshot.
BEGIN ISOLATION LEVEL REPEATABLE READ;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM outbox WHERE published_at IS NOT NULL;
SELECT count(*) AS published_through_index FROM outbox WHERE published_at IS NOT NULL \gset
SELECT count(*) AS pending_through_index FROM outbox
WHERE topic = 'amcheck' AND published_at IS NULL;
SELECT count(*) AS by_id FROM outbox
WHERE id IN (SELECT id FROM outbox WHERE topic = 'amcheck');
SET LOCAL enable_seqscan = on;
SET LOCAL enable_indexscan = off;
SET LOCAL enable_indexonlyscan = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM outbox WHERE published_at IS NOT NULL;
SELECT count(*) = :published_through_index AS scan_agrees_with_index
FROM outbox WHERE state = 'published';
ROLLBACK;

-- Bad arguments get an ERROR with a class-22 SQLSTATE, and nothing is written.
SELECT count(*) AS rows_before FROM outbox \gset
SELECT idem_outbox_enqueue(NULL, '{}');
\echo :SQLSTATE
SELECT idem_outbox_enqueue('', '{}');
\echo :SQLSTATE
SELECT idem_outbox_enqueue(repeat('t', 256), '{}');
\echo :SQLSTATE
SELECT idem_outbox_enqueue('*', '{}');
\echo :SQLSTATE
SELECT idem_outbox_enqueue('orders', NULL);
\echo :SQLSTATE
SELECT idem_outbox_enqueue('orders', '{}', '');
\echo :SQLSTATE
SELECT idem_outbox_enqueue('orders', '{}', repeat('é', 128));
\echo :SQLSTATE
SELECT idem_outbox_enqueue('orders', '{}', 'k', '["not", "an", "object"]');
\echo :SQLSTATE
SELECT count(*) = :rows_before AS nothing_written FROM outbox;
SELECT idem_outbox_fetch('orders', 0);
\echo :SQLSTATE
SELECT idem_outbox_fetch('orders', -5);
\echo :SQLSTATE
SELECT idem_outbox_fetch('orders', NULL);
\echo :SQLSTATE
SELECT idem_outbox_fetch('orders', 10, '-1 second');
\echo :SQLSTATE
SELECT idem_outbox_fetch('orders', 10, '0');
\echo :SQLSTATE
SELECT idem_outbox_fetch(NULL);
\echo :SQLSTATE
SELECT idem_outbox_ack(NULL);
\echo :SQLSTATE
SELECT idem_outbox_nack(NULL, 'x');
\echo :SQLSTATE
SELECT idem_outbox_requeue(NULL);
\echo :SQLSTATE
SELECT idem_outbox_discard(NULL);
\echo :SQLSTATE
