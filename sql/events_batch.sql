--
-- events_batch: consumer deduplication a batch at a time, with
-- idem_mark_processed_batch and idem_is_processed_batch.
--
SET search_path = idempotency, public;

-- A batch returns the ids that are new to the consumer, in the array's
-- order (not sorted: the order the broker delivered them in).
SELECT n, event_id
FROM idem_mark_processed_batch('orders', ARRAY['evt-3', 'evt-1', 'evt-2'])
     WITH ORDINALITY AS t (event_id, n);

-- Delivered again, nothing in it is new.
SELECT count(*) AS new_on_redelivery
FROM idem_mark_processed_batch('orders', ARRAY['evt-1', 'evt-2', 'evt-3']);

-- A batch mixing new and processed ids returns only the new ones, in the
-- array's order, each once however often the array repeats it; every id is
-- stored once, with the default retention.
SELECT n, event_id
FROM idem_mark_processed_batch('orders',
        ARRAY['evt-5', 'evt-1', 'evt-4', 'evt-5', 'evt-2', 'evt-4', 'evt-5'])
     WITH ORDINALITY AS t (event_id, n);
SELECT event_id, count(*) AS rows, min(expires_at - processed_at) AS retention
FROM processed_events WHERE consumer = 'orders'
GROUP BY event_id ORDER BY event_id;

-- The order returned is the array's, whatever the ids' own order (here
-- bytewise, in which the batch marks them, differs from both).
SELECT n, event_id
FROM idem_mark_processed_batch('orders',
        ARRAY['b', 'é', 'B', 'a', 'ab', 'A', 'a b', 'Z'])
     WITH ORDINALITY AS t (event_id, n);

-- The batch and the single call agree, both ways round.
SELECT idem_mark_processed('orders', 'evt-1') AS single_after_batch;
SELECT idem_mark_processed('orders', 'evt-6') AS single_first;
SELECT event_id
FROM idem_mark_processed_batch('orders', ARRAY['evt-6', 'evt-7']) AS event_id;

-- Consumers are independent: each processes every event once.
SELECT event_id
FROM idem_mark_processed_batch('packing', ARRAY['evt-2', 'evt-1']) AS event_id;

-- A set-returning function, it works in the select list too.
SELECT idem_mark_processed_batch('orders', ARRAY['evt-8', 'evt-1']) AS event_id;

-- The retention given is every mark's.
SELECT event_id
FROM idem_mark_processed_batch('audit', ARRAY['evt-1', 'evt-2'], '1 hour') AS event_id;
SELECT event_id, expires_at - processed_at AS retention
FROM processed_events WHERE consumer = 'audit' ORDER BY event_id;

-- The handler pattern: the marks and the handler's writes commit or vanish
-- together; the redelivery of a batch whose handler failed is new again.
CREATE TABLE public.ledger (event_id text);
BEGIN;
INSERT INTO public.ledger
SELECT event_id FROM idem_mark_processed_batch('orders', ARRAY['evt-9', 'evt-10']) AS event_id;
ROLLBACK;
SELECT count(*) AS marked_after_rollback
FROM idem_is_processed_batch('orders', ARRAY['evt-9', 'evt-10']);
BEGIN;
INSERT INTO public.ledger
SELECT event_id FROM idem_mark_processed_batch('orders', ARRAY['evt-9', 'evt-10']) AS event_id;
-- inside the transaction, its own marks already count
SELECT count(*) AS new_in_same_transaction
FROM idem_mark_processed_batch('orders', ARRAY['evt-10', 'evt-9']);
COMMIT;
SELECT event_id FROM public.ledger ORDER BY event_id;

-- idem_is_processed_batch returns the processed ids, in the array's order,
-- each once; unknown ids and other consumers' events are left out.
SELECT n, event_id
FROM idem_is_processed_batch('orders',
        ARRAY['evt-9', 'unknown', 'evt-2', 'evt-9', 'evt-1', 'evt-11'])
     WITH ORDINALITY AS t (event_id, n);
SELECT event_id
FROM idem_is_processed_batch('packing', ARRAY['evt-3', 'evt-2', 'evt-1']) AS event_id;

-- An event past its retention counts as not processed, before any purge (the
-- row is made to expire here by hand); a batch marks it again, renewing its
-- row, and returns it as new.
UPDATE processed_events SET expires_at = now() - interval '1 minute'
WHERE consumer = 'orders' AND event_id = 'evt-2';
SELECT event_id
FROM idem_is_processed_batch('orders', ARRAY['evt-1', 'evt-2', 'evt-3']) AS event_id;
SELECT event_id
FROM idem_mark_processed_batch('orders', ARRAY['evt-1', 'evt-2', 'evt-3']) AS event_id;
SELECT event_id, expires_at > now() + interval '13 days' AS renewed
FROM processed_events WHERE consumer = 'orders' AND event_id = 'evt-2';

-- An empty array is a batch of no events: nothing is returned.
SELECT count(*) AS marked FROM idem_mark_processed_batch('orders', '{}');
SELECT count(*) AS processed FROM idem_is_processed_batch('orders', '{}');

-- A large batch: no cap on the array's length beyond the server's own.
SELECT count(*) AS new
FROM idem_mark_processed_batch('bulk', ARRAY(SELECT 'e' || g FROM generate_series(1, 20000) g));
SELECT count(*) AS new_on_redelivery
FROM idem_mark_processed_batch('bulk', ARRAY(SELECT 'e' || g FROM generate_series(20000, 1, -1) g));
SELECT count(*) AS processed
FROM idem_is_processed_batch('bulk', ARRAY(SELECT 'e' || g FROM generate_series(0, 20001) g));

-- idem_is_processed_batch only looks: it works in a read-only transaction,
-- where marking is refused.
BEGIN READ ONLY;
SELECT event_id FROM idem_is_processed_batch('orders', ARRAY['evt-1']) AS event_id;
SELECT * FROM idem_mark_processed_batch('orders', ARRAY['evt-12']);
\echo :SQLSTATE
ROLLBACK;

-- Bad arguments: an ERROR with a class-22 SQLSTATE.  The whole array is
-- checked before anything is written, so the valid ids before a bad one are
-- not marked either.
SELECT * FROM idem_mark_processed_batch(NULL, ARRAY['e']);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('', ARRAY['e']);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch(repeat('x', 256), ARRAY['e']);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', NULL);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY['e1', 'e2', NULL]);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY['e1', 'e2', '']);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY['e1', 'e2', repeat('é', 128)]);
\echo :SQLSTATE
-- an element is named by its subscript, from the array's lower bound
SELECT * FROM idem_mark_processed_batch('bad', '[0:2]={e1,e2,""}');
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY[['e1', 'e2'], ['e3', 'e4']]);
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY['e1', 'e2'], '0');
\echo :SQLSTATE
SELECT * FROM idem_mark_processed_batch('bad', ARRAY['e1', 'e2'], '-1 day');
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch(NULL, ARRAY['e']);
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch('bad', NULL);
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch('bad', ARRAY['e1', NULL]);
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch('bad', ARRAY['e1', repeat('x', 256)]);
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch('bad', ARRAY[['e1'], ['e2']]);
\echo :SQLSTATE
SELECT count(*) AS rows_for_consumer_bad FROM processed_events WHERE consumer = 'bad';
-- the longest ids are accepted, and lower bounds other than 1
SELECT length(event_id) AS longest
FROM idem_mark_processed_batch(repeat('é', 127) || 'x', ARRAY[repeat('x', 255)]) AS event_id;
SELECT event_id FROM idem_mark_processed_batch('bad', '[-1:0]={e1,e2}') AS event_id;

-- With the README's grants (EXECUTE only, no privilege on the table), an
-- application role uses both; without them, neither.
CREATE ROLE idem_batch_app;
CREATE ROLE idem_batch_nobody;
GRANT USAGE ON SCHEMA idempotency TO idem_batch_app, idem_batch_nobody;
GRANT EXECUTE ON FUNCTION
    idempotency.idem_mark_processed_batch(text, text[], interval),
    idempotency.idem_is_processed_batch(text, text[])
  TO idem_batch_app;
SET ROLE idem_batch_app;
SELECT event_id FROM idem_mark_processed_batch('app', ARRAY['e1', 'e2', 'e1']) AS event_id;
SELECT event_id FROM idem_is_processed_batch('app', ARRAY['e2', 'e3']) AS event_id;
SELECT count(*) FROM processed_events;
\echo :SQLSTATE
RESET ROLE;
SET ROLE idem_batch_nobody;
SELECT * FROM idem_mark_processed_batch('app', ARRAY['e3']);
\echo :SQLSTATE
SELECT * FROM idem_is_processed_batch('app', ARRAY['e1']);
\echo :SQLSTATE
RESET ROLE;
DROP OWNED BY idem_batch_app, idem_batch_nobody;
DROP ROLE idem_batch_app, idem_batch_nobody;

DROP TABLE public.ledger;

-- The batch look is planned for the ids it is given, at each call, whatever
-- the statistics and the session's plan_cache_mode say.  A generic plan,
-- made while the consumer had a few rows, read them all and tested each
-- against the whole array (a parameter: = ANY searches it linearly): over
-- a minute for 100,000 ids among as many rows, found by the differential
-- fuzz (seed 2129685116).  A custom plan's = ANY is over a constant array,
-- hashed from 9 ids on, wherever it is a filter.  Here, the answers under
-- the same conditions: statistics of a 3-row consumer, a generic plan
-- asked for, then 5,000 rows.
ALTER TABLE processed_events SET (autovacuum_enabled = off);
SELECT count(*) AS marked FROM idem_mark_processed_batch('plan', ARRAY['p1', 'p2', 'p3']);
ANALYZE processed_events;
SET plan_cache_mode = force_generic_plan;
SELECT count(*) AS looked FROM generate_series(1, 6), LATERAL idem_is_processed_batch('plan', ARRAY['p1', 'p9']);
SELECT count(*) AS marked FROM idem_mark_processed_batch('plan', (SELECT array_agg('q' || n) FROM generate_series(1, 5000) n));
SELECT count(*) AS found FROM idem_is_processed_batch('plan',
	(SELECT array_agg(id) FROM unnest(ARRAY['p1', 'q77', 'nope', 'q5000', 'q5001']) id));
SELECT count(*) AS found, min(n) AS first, max(n) AS last
FROM idem_is_processed_batch('plan', (SELECT array_agg('q' || n) FROM generate_series(2, 9999, 2) n)) id,
	 LATERAL (SELECT substr(id, 2)::integer) AS x(n);
RESET plan_cache_mode;
ALTER TABLE processed_events RESET (autovacuum_enabled);
