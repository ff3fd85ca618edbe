--
-- sql_edition_outbox: publishing without a worker.  idem_run_maintenance()
-- publishes what the routes say, as the C edition's worker does: a
-- function's rows in id order per key, a failing row's attempt recorded
-- while the others go out; a row of a notify or logical route is
-- published by its enqueue, in the enqueuing transaction, so that it goes
-- out at commit without waiting for the schedule; a NOTIFY too long for
-- its payload goes out as a reference to its row, which is kept for
-- idempotency.notify_truncated_retention.  A route function runs as the
-- edition's owner only (0A000 for a route another role set).
--
\set SHOW_CONTEXT never
SET search_path = idempotency, public;
DELETE FROM outbox;
DELETE FROM outbox_routes;
SELECT format('GRANT CREATE ON SCHEMA public TO %I', 'idem_owner') \gexec
SET ROLE idem_owner;
CREATE TABLE public.sink (id bigint, key text, payload jsonb);
CREATE FUNCTION public.forward(event idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
	IF event.payload ? 'fail' THEN
		RAISE EXCEPTION 'the broker refused %', event.payload ->> 'n';
	END IF;
	-- unqualified: the function runs with the database's search_path
	INSERT INTO sink VALUES (event.id, event.key, event.payload);
END $$;
SELECT idem_outbox_route('fn', 'function', 'forward');
SELECT idem_outbox_route('n', 'notify', 'chan');
SELECT idem_outbox_route('lg', 'logical', 'pfx');

-- notify and logical: published by the enqueue, in its transaction; a
-- rolled back enqueue publishes nothing
BEGIN;
SELECT idem_outbox_enqueue('n', '{"a": 1}', 'k') IS NOT NULL AS enqueued;
SELECT idem_outbox_enqueue('n', jsonb_build_object('s', repeat('x', 8050)), 'k') AS long_id \gset
SELECT count(*) FILTER (WHERE NOT enqueued) AS batch
FROM (SELECT idem_outbox_enqueue_batch('lg', ARRAY['{"l": 1}', '{"l": 2}']::jsonb[], ARRAY['a', 'a']) IS NULL AS enqueued) AS b;
-- only the long one is left, published and kept for its reference
SELECT id = :long_id AS long_one, state, available_at = 'infinity' AS kept_for_reference FROM outbox;
COMMIT;
BEGIN;
SELECT idem_outbox_enqueue('n', '{"a": 2}') IS NOT NULL AS enqueued;
ROLLBACK;
SELECT count(*) AS rows_left FROM outbox;

-- it is purged once notify_truncated_retention has passed
SET idempotency.notify_truncated_retention = '1h';
SELECT purged_outbox FROM idem_run_maintenance();
UPDATE outbox SET published_at = published_at - interval '2 hours';
SELECT purged_outbox FROM idem_run_maintenance();

-- function routes: by idem_run_maintenance(), in id order per key; a row
-- that fails is recorded (backoff, failures) and holds back its key, the
-- others go out
SELECT count(*) AS enqueued FROM (SELECT idem_outbox_enqueue('fn', p, k)
	FROM (VALUES ('{"n": 1}'::jsonb, 'a'), ('{"n": 2, "fail": true}', 'b'), ('{"n": 3}', 'b'),
				 ('{"n": 4}', 'a'), ('{"n": 5}', NULL)) AS v(p, k)) AS e;
SELECT published, publish_failures FROM idem_run_maintenance();
SELECT key, payload FROM sink ORDER BY id;
SELECT key, payload, state, failures, last_error FROM outbox ORDER BY id;
RESET ROLE;

-- a route another role set: its function is not run (0A000 recorded)
CREATE ROLE idem_router;
GRANT USAGE ON SCHEMA idempotency TO idem_router;
GRANT EXECUTE ON FUNCTION idem_outbox_route(text, text, text) TO idem_router;
SET ROLE idem_router;
SELECT idem_outbox_route('fn2', 'function', 'public.forward');
RESET ROLE;
SELECT idem_outbox_enqueue('fn2', '{"n": 6}') AS fn2_id \gset
SELECT published, publish_failures FROM idem_run_maintenance();
SELECT state, failures, last_error FROM outbox WHERE id = :fn2_id;
DELETE FROM outbox;
DELETE FROM outbox_routes;
DROP OWNED BY idem_router;
DROP ROLE idem_router;
DROP TABLE public.sink;
DROP FUNCTION public.forward(idempotency.outbox);

-- A default route: the walk across the topics is the primary key's, which
-- holds the published rows kept for outbox_retention as well.  It is
-- planned to walk in order from the oldest unpublished row of any topic (a
-- loose index scan of outbox_ready), as the C edition's worker walks it:
-- with statistics taken while most rows were published and kept, a batch
-- reads about its rows, not the backlog (before: every pending row, probed
-- and sorted); and a round with nothing to publish reads none of the kept
-- rows (before: all of them).  Index entries read, counted in the
-- transaction.
SET ROLE idem_owner;
CREATE TABLE public.kept (id bigint);
CREATE FUNCTION public.keep(event idempotency.outbox) RETURNS void LANGUAGE sql
	AS 'INSERT INTO public.kept VALUES (event.id)';
SELECT idem_outbox_route('*', 'function', 'public.keep');
RESET ROLE;
CREATE FUNCTION public.round_reads(OUT published bigint, OUT index_entries bigint)
LANGUAGE plpgsql AS $$
DECLARE
	before bigint;
BEGIN
	SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) INTO before
	FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass;
	SELECT m.published INTO published FROM idempotency.idem_run_maintenance() m;
	SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) - before INTO index_entries
	FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass;
END $$;
SET idempotency.outbox_retention = '1h';
SELECT count(*) AS enqueued FROM generate_series(1, 3) t,
	LATERAL idem_outbox_enqueue_batch('spread' || t, array_fill('{"n": 1}'::jsonb, ARRAY[700]));
-- each batch in a transaction of its own
\set ECHO none
\o /dev/null
SELECT 'SELECT published FROM idem_run_maintenance()' FROM generate_series(1, 22) \gexec
\o
\set ECHO all
SELECT count(*) AS published_and_kept FROM outbox WHERE state = 'published';
ANALYZE outbox;
SELECT count(*) AS enqueued FROM generate_series(1, 3) t,
	LATERAL idem_outbox_enqueue_batch('spread' || t, array_fill('{"n": 2}'::jsonb, ARRAY[700]));
SELECT published, index_entries <= 400 AS reads_about_its_batch FROM round_reads();
ANALYZE outbox;
\set ECHO none
\o /dev/null
SELECT 'SELECT published FROM idem_run_maintenance()' FROM generate_series(1, 22) \gexec
\o
\set ECHO all
SELECT count(*) AS published FROM kept;
SELECT published, index_entries <= 50 AS reads_none_of_the_kept FROM round_reads();
-- more topics than the loose scan looks through (1,000): the walk starts at
-- the first entry, and every row goes out
SELECT count(*) AS enqueued FROM generate_series(1, 1001) t,
	LATERAL idem_outbox_enqueue('many' || t, '{"n": 3}');
\set ECHO none
\o /dev/null
SELECT 'SELECT published FROM idem_run_maintenance()' FROM generate_series(1, 12) \gexec
\o
\set ECHO all
SELECT count(*) FILTER (WHERE state = 'published') AS published, count(*) AS enqueued
FROM outbox WHERE topic LIKE 'many%';
RESET idempotency.outbox_retention;
DELETE FROM outbox;
DELETE FROM outbox_routes;
DROP FUNCTION public.round_reads();
DROP TABLE public.kept;
DROP FUNCTION public.keep(idempotency.outbox);
