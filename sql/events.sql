--
-- events: consumer deduplication with idem_mark_processed.
--
SET search_path = idempotency, public;

-- The first mark says "process it"; every later one says "duplicate".
SELECT idem_mark_processed('billing', 'evt-1') AS first,
       idem_mark_processed('billing', 'evt-1') AS second;
SELECT idem_is_processed('billing', 'evt-1') AS processed,
       idem_is_processed('billing', 'evt-2') AS other_event;

-- Consumers are independent: each processes every event once.
SELECT idem_mark_processed('shipping', 'evt-1') AS shipping_first;
SELECT consumer, event_id, expires_at - processed_at AS retention
FROM processed_events ORDER BY consumer, event_id;

-- The handler pattern: mark and work in one transaction.  A handler that
-- fails rolls back its mark with its writes, so the redelivery processes it.
CREATE TABLE public.ledger (event_id text);
BEGIN;
SELECT idem_mark_processed('billing', 'evt-3') AS process_it;
INSERT INTO public.ledger VALUES ('evt-3');
ROLLBACK;
SELECT idem_is_processed('billing', 'evt-3') AS marked_after_rollback,
       (SELECT count(*) FROM public.ledger) AS ledger_rows;
BEGIN;
SELECT idem_mark_processed('billing', 'evt-3') AS process_it_on_redelivery;
INSERT INTO public.ledger VALUES ('evt-3');
COMMIT;
SELECT idem_mark_processed('billing', 'evt-3') AS third_delivery,
       (SELECT count(*) FROM public.ledger) AS ledger_rows;

-- Inside the handler's transaction a second mark already sees the first.
BEGIN;
SELECT idem_mark_processed('billing', 'evt-4') AS first,
       idem_mark_processed('billing', 'evt-4') AS same_transaction;
COMMIT;

-- An event past its retention counts as not processed, before any purge;
-- marking it again renews it.
SELECT idem_mark_processed('billing', 'evt-5', '1 second');
SELECT idem_is_processed('billing', 'evt-5') AS within_retention;
SELECT pg_sleep(1.1);
SELECT idem_is_processed('billing', 'evt-5') AS after_retention;
SELECT idem_mark_processed('billing', 'evt-5') AS processed_again;
SELECT idem_is_processed('billing', 'evt-5') AS renewed,
       expires_at - processed_at AS default_retention
FROM processed_events WHERE event_id = 'evt-5';

-- The default retention is idempotency.event_retention (14 days).
SHOW idempotency.event_retention;
SET idempotency.event_retention = '1h';
SELECT idem_mark_processed('billing', 'evt-6');
SELECT expires_at - processed_at AS retention FROM processed_events WHERE event_id = 'evt-6';
RESET idempotency.event_retention;

-- idem_is_processed only looks: it works in a read-only transaction.
BEGIN READ ONLY;
SELECT idem_is_processed('billing', 'evt-1') AS read_only_look;
SELECT idem_mark_processed('billing', 'evt-7');
\echo :SQLSTATE
ROLLBACK;

-- Bad arguments: an ERROR with a class-22 SQLSTATE, and nothing written.
SELECT idem_mark_processed(NULL, 'e');
\echo :SQLSTATE
SELECT idem_mark_processed('c', NULL);
\echo :SQLSTATE
SELECT idem_mark_processed('', 'e');
\echo :SQLSTATE
SELECT idem_mark_processed('c', '');
\echo :SQLSTATE
SELECT idem_mark_processed(repeat('é', 128), 'e');
\echo :SQLSTATE
SELECT idem_mark_processed('c', repeat('x', 256));
\echo :SQLSTATE
SELECT idem_mark_processed('c', 'e', '0');
\echo :SQLSTATE
SELECT idem_mark_processed('c', 'e', '-1 day');
\echo :SQLSTATE
SELECT idem_is_processed(NULL, 'e');
\echo :SQLSTATE
SELECT idem_is_processed('c', repeat('x', 256));
\echo :SQLSTATE
SELECT count(*) AS rows_for_consumer_c FROM processed_events WHERE consumer = 'c';
-- the longest ids are accepted
SELECT idem_mark_processed(repeat('é', 127), repeat('x', 255)) AS longest;

DROP TABLE public.ledger;
