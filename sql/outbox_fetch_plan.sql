--
-- outbox_fetch_plan: the pull API's fetch walks the ready index in order
-- and stops at its batch, from a connection's first call on and whatever
-- the statistics say (issue 29, item 8).  What a fetch read is told by the
-- transaction's own counters (pg_stat_get_xact_*), not by timings: no
-- sequential scan of the outbox, and a few index entries per row handed
-- out, where a scan of the backlog (sequential, or a bitmap scan of an
-- index) reads all 2,000 rows of it.
--
SET search_path = idempotency, public;
TRUNCATE outbox;
-- no autoanalyze in the middle: the statistics are what each case says
ALTER TABLE outbox SET (autovacuum_enabled = off);
-- the rows are for a relay, whatever the default route
SELECT idem_outbox_route('plan', 'none'), idem_outbox_route('plan-keys', 'none');

-- what a statement read of the outbox: its sequential scans and the index
-- entries it was given, from the transaction's own counters
CREATE FUNCTION public.outbox_reads(statement text,
									OUT result text, OUT seq_scans bigint, OUT index_entries bigint)
LANGUAGE plpgsql AS $$
DECLARE
	scans_before bigint;
	entries_before bigint;
BEGIN
	SELECT pg_stat_get_xact_numscans('idempotency.outbox'::regclass),
		   sum(pg_stat_get_xact_tuples_returned(indexrelid))
	INTO scans_before, entries_before
	FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass;
	EXECUTE statement INTO result;
	SELECT pg_stat_get_xact_numscans('idempotency.outbox'::regclass) - scans_before,
		   sum(pg_stat_get_xact_tuples_returned(indexrelid)) - entries_before
	INTO seq_scans, index_entries
	FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass;
END $$;
CREATE FUNCTION public.fetch_reads(topic text, batch integer, per_key integer DEFAULT 1,
								   OUT ids bigint[], OUT seq_scans bigint, OUT index_entries bigint)
LANGUAGE sql AS $$
	SELECT r.result::bigint[], r.seq_scans, r.index_entries
	FROM public.outbox_reads(format('SELECT array_agg(f.id ORDER BY f.id)'
									' FROM idempotency.idem_outbox_fetch(%L, %s, %L, %s) f',
									topic, batch, '1 hour', per_key)) r
$$;

-- A backlog of 2,000 rows, 500 keys, with statistics that say so: a new
-- connection's first fetch (planned for its topic, it read and sorted the
-- whole backlog) and its seventh (past plancache.c's five custom plans).
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan',
	array_fill('{"n": 1}'::jsonb, ARRAY[2000]),
	(SELECT array_agg('k' || n % 500) FROM generate_series(1, 2000) n));
ANALYZE outbox;
\c
SET search_path = idempotency, public;
SELECT ids = (SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM outbox WHERE topic = 'plan' ORDER BY id LIMIT 10) o)
		AS oldest_in_order,
	   seq_scans = 0 AS no_seq_scan, index_entries <= 100 AS bounded_by_the_batch
FROM fetch_reads('plan', 10);
SELECT count(*) AS fetched FROM generate_series(1, 5), LATERAL idem_outbox_fetch('plan', 10, '1 hour');
SELECT seq_scans = 0 AS no_seq_scan, index_entries <= 100 AS bounded_by_the_batch
FROM fetch_reads('plan', 10);

-- Statistics taken on a nearly empty outbox, then a backlog of 2,000: the
-- oldest rows still, in order, and read as few.
TRUNCATE outbox;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan', array_fill('{"n": 0}'::jsonb, ARRAY[3]));
ANALYZE outbox;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan',
	array_fill('{"n": 1}'::jsonb, ARRAY[2000]),
	(SELECT array_agg('k' || n % 500) FROM generate_series(1, 2000) n));
\c
SET search_path = idempotency, public;
SELECT ids = (SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM outbox WHERE topic = 'plan' ORDER BY id LIMIT 10) o)
		AS oldest_in_order,
	   seq_scans = 0 AS no_seq_scan, index_entries <= 100 AS bounded_by_the_batch
FROM fetch_reads('plan', 10);
SELECT count(*) AS fetched FROM generate_series(1, 5), LATERAL idem_outbox_fetch('plan', 10, '1 hour');
SELECT seq_scans = 0 AS no_seq_scan, index_entries <= 100 AS bounded_by_the_batch
FROM fetch_reads('plan', 10);

-- per_key: heads first, then each head's following rows from
-- outbox_key_order, oldest first, up to per_key.  With 4 keys, finding
-- that there are no more heads takes a walk of the topic's rows in the
-- ready index (one, however many rows are handed out), and no sequential
-- scan.
TRUNCATE outbox;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan-keys',
	array_fill('{"n": 1}'::jsonb, ARRAY[2000]),
	(SELECT array_agg('k' || n % 4) FROM generate_series(1, 2000) n));
ANALYZE outbox;
\c
SET search_path = idempotency, public;
SELECT ids = (SELECT array_agg(id ORDER BY id)
			  FROM (SELECT id, row_number() OVER (PARTITION BY key ORDER BY id) AS nth
					FROM outbox WHERE topic = 'plan-keys') o WHERE nth <= 5)
		AS five_oldest_of_each_key,
	   seq_scans = 0 AS no_seq_scan, index_entries <= 2000 + 400 AS one_walk
FROM fetch_reads('plan-keys', 20, 5);

-- A session's plan_cache_mode does not bring the custom plans back.
TRUNCATE outbox;
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan',
	array_fill('{"n": 1}'::jsonb, ARRAY[2000]),
	(SELECT array_agg('k' || n % 500) FROM generate_series(1, 2000) n));
ANALYZE outbox;
\c
SET search_path = idempotency, public;
SET plan_cache_mode = force_custom_plan;
SELECT seq_scans = 0 AS no_seq_scan, index_entries <= 100 AS bounded_by_the_batch
FROM fetch_reads('plan', 10);
RESET plan_cache_mode;

-- The statements that find rows by id, planned while the outbox was small
-- (as it is after a vacuum when relays keep up), and run again in the same
-- connection once a backlog has come in: an ack.  Left to plancache.c, the
-- plan kept after a connection's first five acks was made for the small
-- table, and scanned the whole backlog at each call.  (Publishing's
-- statements, the same way: t/019, where no worker races the test.)
CREATE FUNCTION public.ack_reads(ids bigint[], attempts integer[],
								 OUT acked integer, OUT seq_scans bigint, OUT index_entries bigint)
LANGUAGE sql AS $$
	SELECT r.result::integer, r.seq_scans, r.index_entries
	FROM public.outbox_reads(format('SELECT idempotency.idem_outbox_ack(%L::bigint[], %L::integer[])',
									ids, attempts)) r
$$;
TRUNCATE outbox;
VACUUM ANALYZE outbox;
\c
SET search_path = idempotency, public;
-- ten acks of two rows on a small table
DO $$
DECLARE
	f record;
BEGIN
	FOR g IN 1 .. 10 LOOP
		PERFORM idempotency.idem_outbox_enqueue_batch('plan', array_fill('{"n": 0}'::jsonb, ARRAY[2]));
		SELECT array_agg(o.id) AS ids, array_agg(o.attempts) AS attempts INTO f
		FROM idempotency.idem_outbox_fetch('plan', 2, '1 hour') o;
		IF idempotency.idem_outbox_ack(f.ids, f.attempts) <> 2 THEN
			RAISE EXCEPTION 'ack %: not 2 rows', g;
		END IF;
	END LOOP;
END $$;
-- then a backlog of 2,000 rows
SELECT count(*) AS enqueued FROM idem_outbox_enqueue_batch('plan', array_fill('{"n": 1}'::jsonb, ARRAY[2000]));
SELECT a.acked, a.seq_scans = 0 AS no_seq_scan, a.index_entries <= 100 AS bounded_by_the_batch
FROM (SELECT array_agg(id) AS ids, array_agg(attempts) AS attempts
	  FROM idem_outbox_fetch('plan', 10, '1 hour')) f,
	 LATERAL ack_reads(f.ids, f.attempts) a;

DROP FUNCTION public.ack_reads(bigint[], integer[]);
DROP FUNCTION public.fetch_reads(text, integer, integer);
DROP FUNCTION public.outbox_reads(text);
TRUNCATE outbox;
DELETE FROM outbox_routes WHERE topic IN ('plan', 'plan-keys');
ALTER TABLE outbox RESET (autovacuum_enabled);
