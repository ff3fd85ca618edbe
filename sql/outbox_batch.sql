--
-- outbox_batch: many events in one call (idem_outbox_enqueue_batch), a
-- key's consecutive rows in one hand-out (idem_outbox_fetch's per_key), and
-- acknowledgements fenced by the hand-out (idem_outbox_ack(ids, attempts),
-- idem_outbox_nack(id, error, attempt)).
--
SET search_path = idempotency, public;

-- The ids come back in array order, and rows of one key keep the array's
-- order; keys and headers are optional, element by element.
SELECT array_agg(id) AS ids FROM idem_outbox_enqueue_batch('batch',
	ARRAY['{"n": 1}', '{"n": 2}', '{"n": 3}', '{"n": 4}', '{"n": 5}']::jsonb[],
	ARRAY['a', 'b', 'a', NULL, 'a'],
	ARRAY['{"h": 1}', NULL, NULL, NULL, '{"h": 5}']::jsonb[]) AS e(id) \gset
SELECT id = (:'ids'::bigint[])[n] AS in_array_order, key, payload, headers, state, attempts
FROM outbox o
JOIN generate_series(1, 5) n ON o.id = (:'ids'::bigint[])[n]
ORDER BY n;
-- without keys and headers; an empty array enqueues nothing
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('batch-none', ARRAY['{}', '{}']::jsonb[]);
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('batch-none', ARRAY[]::jsonb[]);
SELECT count(*) AS rows_of_batch_none FROM outbox WHERE topic = 'batch-none' AND key IS NULL AND headers IS NULL;

-- An event exists if and only if its transaction commits.
BEGIN;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('rolled-back', ARRAY['{}']::jsonb[], ARRAY['k']);
ROLLBACK;
SELECT count(*) AS after_rollback FROM outbox WHERE topic = 'rolled-back';

-- Bad arguments: an ERROR of class 22, and nothing written.
SELECT count(*) AS rows_before FROM outbox \gset
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', NULL]::jsonb[]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', NULL);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', '{}']::jsonb[], ARRAY['k']);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', '{}']::jsonb[], NULL, ARRAY['{}']::jsonb[]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', '{}']::jsonb[], ARRAY['k', '']);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', '{}']::jsonb[], ARRAY['k', repeat('k', 256)]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY['{}', '{}']::jsonb[], NULL, ARRAY['{}', '[1]']::jsonb[]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('batch', ARRAY[['{}'], ['{}']]::jsonb[]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch('*', ARRAY['{}']::jsonb[]);
\echo :SQLSTATE
SELECT idem_outbox_enqueue_batch(NULL, ARRAY['{}']::jsonb[]);
\echo :SQLSTATE
SELECT count(*) = :rows_before AS nothing_written FROM outbox;
TRUNCATE outbox RESTART IDENTITY;

-- per_key: up to per_key consecutive ready rows of one key in one
-- hand-out, in id order, all leased to the caller.  The batch goes to the
-- keys' heads first; the room left to the rows that follow them.
SELECT count(*) FROM idem_outbox_enqueue_batch('orders',
	array_fill('{}'::jsonb, ARRAY[9]),
	ARRAY['a', 'a', 'a', 'a', 'b', 'b', NULL, 'a', 'c']);
SELECT id, key, state, attempts FROM idem_outbox_fetch('orders', 5, '1 hour', 3);
-- the rest of the topic: a's fourth row waits behind the leased ones
SELECT id, key FROM idem_outbox_fetch('orders', 10, '1 hour', 3);
-- per_key = 1 (the default) is one row per key, as before
SELECT idem_outbox_ack(array_agg(id ORDER BY id)) AS acknowledged FROM outbox WHERE state = 'leased';
SELECT count(*) FROM idem_outbox_enqueue_batch('orders', array_fill('{}'::jsonb, ARRAY[3]), ARRAY['d', 'd', 'd']);
SELECT key, count(*) AS rows_handed_out FROM idem_outbox_fetch('orders', 10) GROUP BY key ORDER BY key;

-- A row not ready ends its key's hand-out: here, the third row of e is
-- backing off after a failure (as rows do after a requeue with a delay).
TRUNCATE outbox;
SELECT array_agg(id) AS e_ids FROM idem_outbox_enqueue_batch('gaps',
	array_fill('{}'::jsonb, ARRAY[4]), ARRAY['e', 'e', 'e', 'e']) AS e(id) \gset
UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = (:'e_ids'::bigint[])[3];
SELECT id = ANY ((:'e_ids'::bigint[])[1:2]) AS first_two FROM idem_outbox_fetch('gaps', 10, '1 hour', 10);

-- Acknowledging: a row only together with or after every earlier row of its
-- key.  Acknowledging the second row alone counts nothing; the two together,
-- both.
SELECT idem_outbox_ack(ARRAY[(:'e_ids'::bigint[])[2]]) AS second_alone;
SELECT state FROM outbox WHERE id = (:'e_ids'::bigint[])[2];
SELECT idem_outbox_ack(ARRAY[(:'e_ids'::bigint[])[2], (:'e_ids'::bigint[])[1]]) AS both;

-- Fenced acknowledgements act only on rows still leased under the hand-out
-- that returned them: attempts as fetched.
TRUNCATE outbox;
SELECT count(*) FROM idem_outbox_enqueue_batch('fenced', array_fill('{}'::jsonb, ARRAY[3]), ARRAY['f', 'f', 'f']);
CREATE TEMP TABLE first_handout AS SELECT id, attempts FROM idem_outbox_fetch('fenced', 10, '1 hour', 3);
SELECT array_agg(attempts ORDER BY id) AS attempts FROM first_handout;
-- (time passes: the lease runs out, and another relay takes the rows)
UPDATE outbox SET available_at = now() - interval '1 second' WHERE topic = 'fenced';
CREATE TEMP TABLE second_handout AS SELECT id, attempts FROM idem_outbox_fetch('fenced', 10, '1 hour', 3);
SELECT array_agg(attempts ORDER BY id) AS attempts FROM second_handout;
-- the first relay's acknowledgement and nack are refused; the second's count
SELECT idem_outbox_ack(array_agg(id ORDER BY id), array_agg(attempts ORDER BY id)) AS stale_ack
FROM first_handout;
SELECT idem_outbox_nack(min(id), 'stale', min(attempts)) AS stale_nack FROM first_handout;
SELECT count(*) AS still_leased FROM outbox WHERE topic = 'fenced' AND state = 'leased';
SELECT idem_outbox_ack(array_agg(id ORDER BY id), array_agg(attempts ORDER BY id)) AS current_ack
FROM second_handout;
-- unknown ids and null attempts count nothing
SELECT idem_outbox_ack(ARRAY[999, NULL]::bigint[], ARRAY[1, NULL]) AS nothing;
SELECT idem_outbox_ack(ARRAY[]::bigint[], ARRAY[]::int[]) AS empty;

-- A row whose attempt is stale in a fenced acknowledgement is not taken by
-- it, and so holds back the later rows of its key named beside it.
TRUNCATE outbox;
SELECT array_agg(id) AS h_ids FROM idem_outbox_enqueue_batch('stale-head',
	array_fill('{}'::jsonb, ARRAY[2]), ARRAY['h', 'h']) AS h(id) \gset
SELECT count(*) AS handed_out FROM idem_outbox_fetch('stale-head', 10, '1 hour', 2);
SELECT idem_outbox_ack(:'h_ids'::bigint[], ARRAY[0, 1]) AS behind_a_stale_head;
SELECT idem_outbox_ack(:'h_ids'::bigint[], ARRAY[1, 1]) AS both_current;

-- The same when many rows of other keys lie between a key's rows (the
-- check then descends into the key's index entries rather than walking the
-- topic): the later row of k acknowledged alone counts nothing while the
-- earlier one, leased in the same hand-out, is not named; the two, both.
TRUNCATE outbox;
SELECT array_agg(id) AS k_ids FROM idem_outbox_enqueue_batch('far-apart',
	array_fill('{}'::jsonb, ARRAY[42]),
	ARRAY['k'] || ARRAY(SELECT 'x' || n FROM generate_series(1, 40) n) || ARRAY['k']) AS k(id) \gset
SELECT count(*) AS handed_out FROM idem_outbox_fetch('far-apart', 100, '1 hour', 2);
SELECT idem_outbox_ack(ARRAY[(:'k_ids'::bigint[])[42]]) AS later_alone;
SELECT idem_outbox_ack(ARRAY[(:'k_ids'::bigint[])[42], (:'k_ids'::bigint[])[1]]) AS both_named;

-- A nack of a row of a hand-out puts the later rows of that hand-out back
-- to pending at once, their hand-out not counted as a failure; the nacked
-- row backs off, holding its key.  The earlier rows stay leased.
TRUNCATE outbox;
SELECT array_agg(id) AS g_ids FROM idem_outbox_enqueue_batch('nacks',
	array_fill('{}'::jsonb, ARRAY[4]), ARRAY['g', 'g', 'g', 'g']) AS e(id) \gset
SELECT array_agg(attempts ORDER BY id) AS attempts FROM idem_outbox_fetch('nacks', 10, '1 hour', 4);
SELECT idem_outbox_nack((:'g_ids'::bigint[])[2], 'broker down', 0) AS wrong_attempt;
SELECT idem_outbox_nack((:'g_ids'::bigint[])[2], 'broker down', 1) AS nacked;
SELECT id = (:'g_ids'::bigint[])[n] AS in_order, state, attempts, last_error,
       available_at > now() AS backing_off
FROM outbox o JOIN generate_series(1, 4) n ON o.id = (:'g_ids'::bigint[])[n] ORDER BY n;
SELECT count(*) AS ready_behind_the_nacked_row FROM idem_outbox_fetch('nacks', 10, '1 hour', 4);
-- the first row is acknowledged alone; the later ones wait for the second
SELECT idem_outbox_ack(ARRAY[(:'g_ids'::bigint[])[1]], ARRAY[1]) AS first_acknowledged;
-- the unfenced nack (1.0) puts the later rows back too
UPDATE outbox SET available_at = now() WHERE id = (:'g_ids'::bigint[])[2];
SELECT array_agg(attempts ORDER BY id) AS attempts FROM idem_outbox_fetch('nacks', 10, '1 hour', 4);
SELECT idem_outbox_nack((:'g_ids'::bigint[])[2], 'again') AS nacked_unfenced;
SELECT array_agg(state ORDER BY id) AS states, array_agg(attempts ORDER BY id) AS attempts
FROM outbox WHERE topic = 'nacks';

-- Fences are never handed out twice (1.2): attempts counts the hand-outs
-- and never goes back, failures the failed tries, which the backoff and
-- outbox_max_attempts are decided on.  A nack's put-back counts the
-- hand-out of the later rows, not a failure: their next hand-out carries a
-- new fence, and the nacking relay's fence for them acts on nothing.
TRUNCATE outbox;
SELECT array_agg(id) AS p_ids FROM idem_outbox_enqueue_batch('putback',
	array_fill('{}'::jsonb, ARRAY[2]), ARRAY['p', 'p']) AS e(id) \gset
SELECT array_agg(attempts ORDER BY id) AS first_handout FROM idem_outbox_fetch('putback', 10, '1 hour', 2);
SELECT idem_outbox_nack((:'p_ids'::bigint[])[1], 'broker down', 1) AS nacked;
SELECT array_agg(state || ':' || attempts || ':' || failures ORDER BY id) AS rows
FROM outbox WHERE topic = 'putback';
UPDATE outbox SET available_at = now() WHERE topic = 'putback';
SELECT array_agg(attempts ORDER BY id) AS second_handout FROM idem_outbox_fetch('putback', 10, '1 hour', 2);
SELECT idem_outbox_ack(ARRAY[(:'p_ids'::bigint[])[2]], ARRAY[1]) AS stale_ack,
       idem_outbox_nack((:'p_ids'::bigint[])[2], 'stale', 1) AS stale_nack;
SELECT idem_outbox_ack(:'p_ids'::bigint[], ARRAY[2, 2]) AS new_holder_ack;

-- A lease that runs out is a failed try: counted, and the next hand-out
-- has a new fence.  A requeue resets the failures, not the attempts: the
-- hand-out after it carries a fence that none before it did.
SET idempotency.outbox_max_attempts = 2;
SELECT idem_outbox_enqueue('requeued', '{}', 'r') AS r_id \gset
SELECT attempts AS first FROM idem_outbox_fetch('requeued', 1, '1 hour');
UPDATE outbox SET available_at = now() - interval '1 second' WHERE id = :r_id;
SELECT attempts AS second FROM idem_outbox_fetch('requeued', 1, '1 hour');
SELECT idem_outbox_nack(:r_id, 'rejected', 1) AS stale_nack, idem_outbox_nack(:r_id, 'rejected', 2) AS nacked;
SELECT state, attempts, failures, last_error FROM outbox WHERE id = :r_id;
SELECT idem_outbox_requeue(:r_id) AS requeued;
SELECT state, attempts, failures FROM outbox WHERE id = :r_id;
SELECT attempts AS after_requeue FROM idem_outbox_fetch('requeued', 1, '1 hour');
SELECT idem_outbox_ack(ARRAY[:r_id]::bigint[], ARRAY[1]) AS ack_first_handout,
       idem_outbox_ack(ARRAY[:r_id]::bigint[], ARRAY[2]) AS ack_second_handout,
       idem_outbox_nack(:r_id, 'stale', 2) AS nack_second_handout;
-- an id given twice is fenced by the attempts beside its first place
SELECT idem_outbox_ack(ARRAY[:r_id, :r_id]::bigint[], ARRAY[2, 3]) AS twice_first_stale;
SELECT idem_outbox_ack(ARRAY[:r_id, :r_id]::bigint[], ARRAY[3, 2]) AS ack_after_requeue;
RESET idempotency.outbox_max_attempts;

-- A relation of another kind under the name of an index the check reads (a
-- superuser's doing): the check is made in SQL, with the same answers.
TRUNCATE outbox;
SELECT array_agg(id) AS r_ids FROM idem_outbox_enqueue_batch('not-an-index',
	array_fill('{}'::jsonb, ARRAY[2]), ARRAY['r', 'r']) AS r(id) \gset
SELECT count(*) AS handed_out FROM idem_outbox_fetch('not-an-index', 10, '1 hour', 2);
BEGIN;
DROP INDEX idempotency.outbox_key_order;
CREATE TABLE idempotency.outbox_key_order ();
SELECT idem_outbox_ack(ARRAY[(:'r_ids'::bigint[])[2]], ARRAY[1]) AS later_alone;
SELECT idem_outbox_ack(:'r_ids'::bigint[], ARRAY[1, 1]) AS both_named;
ROLLBACK;

-- Bad arguments of the new forms.
SELECT idem_outbox_fetch('orders', 10, '1 hour', 0);
\echo :SQLSTATE
SELECT idem_outbox_fetch('orders', 10, '1 hour', NULL);
\echo :SQLSTATE
SELECT idem_outbox_ack(ARRAY[1, 2]::bigint[], ARRAY[1]);
\echo :SQLSTATE
SELECT idem_outbox_ack(ARRAY[1]::bigint[], NULL);
\echo :SQLSTATE
SELECT idem_outbox_ack(NULL, ARRAY[1]);
\echo :SQLSTATE
SELECT idem_outbox_nack(1, 'x', NULL);
\echo :SQLSTATE
TRUNCATE outbox;

-- A hand-out writes no index entry: every row of a page it takes is updated
-- in place (HOT), as the fillfactor leaves room for a new version of each.
-- Counted within one transaction, the earlier ones' counts sent off first.
SELECT pg_stat_force_next_flush();
BEGIN;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('hot',
	array_fill('{"order_id": 123456, "status": "created"}'::jsonb, ARRAY[500]),
	(SELECT array_agg('k' || n % 7) FROM generate_series(1, 500) n));
SELECT count(*) AS handed_out FROM idem_outbox_fetch('hot', 500, '1 hour', 500);
SELECT n_tup_hot_upd AS hot, n_tup_upd - n_tup_hot_upd AS not_hot
FROM pg_stat_xact_user_tables WHERE relid = 'idempotency.outbox'::regclass;
ROLLBACK;
