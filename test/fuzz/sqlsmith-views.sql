--
-- test/fuzz/sqlsmith-views.sql: views that call the extension's functions,
-- for sqlsmith's database only (after test/fuzz/setup.sql).
--
-- sqlsmith picks functions among the server's thousands, so a random query
-- rarely calls one of the extension's.  It picks relations among the few of
-- the database, though (--exclude-catalog): through these views, its joins,
-- subqueries, LATERAL rescans and limits run the functions, over the seeded
-- rows, in query shapes no test writes.  Every query is rolled back by
-- sqlsmith, so the rows stay as seeded.
--
CREATE SCHEMA fuzz;
GRANT USAGE ON SCHEMA fuzz TO idem_fuzz_app;

CREATE VIEW fuzz.claim_new AS
	SELECT * FROM idempotency.idem_claim('smith', 'new-key', 'fp', '1 min', '1 min');
CREATE VIEW fuzz.claim_in_progress AS
	SELECT * FROM idempotency.idem_claim('seed', 'in-progress-1', 'fp-1');
CREATE VIEW fuzz.claim_replay AS
	SELECT * FROM idempotency.idem_claim('seed', 'done-1');
CREATE VIEW fuzz.claim_each_key AS
	SELECT k.scope, k.key, c.*
	FROM idempotency.keys AS k,
	     LATERAL idempotency.idem_claim(k.scope, k.key, k.fingerprint) AS c;
CREATE VIEW fuzz.completions AS
	SELECT k.key, idempotency.idem_complete(k.scope, k.key, 201, 'smith', k.headers, k.attempt) AS result
	FROM idempotency.keys AS k WHERE k.status_code IS NULL;
CREATE VIEW fuzz.checkpoints AS
	SELECT k.key, idempotency.idem_checkpoint(k.scope, k.key, 'smith step', k.attempt)::text AS done
	FROM idempotency.keys AS k WHERE k.status_code IS NULL;
CREATE VIEW fuzz.releases AS
	SELECT k.key, idempotency.idem_release(k.scope, k.key) AS released
	FROM idempotency.keys AS k;
CREATE VIEW fuzz.fingerprints AS
	SELECT o.id, idempotency.idem_fingerprint(o.payload) AS payload_fp,
	       idempotency.idem_fingerprint(o.topic) AS topic_fp,
	       idempotency.idem_fingerprint(convert_to(o.last_error, 'UTF8')) AS error_fp
	FROM idempotency.outbox AS o;
CREATE VIEW fuzz.marks AS
	SELECT e.event_id, idempotency.idem_mark_processed(e.consumer, e.event_id) AS first,
	       idempotency.idem_is_processed(e.consumer, e.event_id) AS seen
	FROM idempotency.processed_events AS e;
CREATE VIEW fuzz.batch_marks AS
	SELECT c.consumer, m.event_id
	FROM (SELECT consumer, array_agg(event_id ORDER BY event_id DESC) AS ids
	      FROM idempotency.processed_events GROUP BY consumer) AS c,
	     LATERAL idempotency.idem_mark_processed_batch(c.consumer, c.ids || ARRAY['smith-new']) AS m (event_id);
CREATE VIEW fuzz.batch_looks AS
	SELECT * FROM idempotency.idem_is_processed_batch('seed', ARRAY['event-1', 'old-1', 'smith', 'event-2'])
		AS l (event_id);
CREATE VIEW fuzz.fetched AS
	SELECT * FROM idempotency.idem_outbox_fetch('seed-pending', 5, '1 min');
CREATE VIEW fuzz.enqueued AS
	SELECT g, idempotency.idem_outbox_enqueue('smith', jsonb_build_object('g', g), 'k' || g % 2) AS id
	FROM generate_series(1, 3) AS g;
CREATE VIEW fuzz.acks AS
	SELECT idempotency.idem_outbox_ack(array_agg(id)) AS acked
	FROM idempotency.outbox WHERE state = 'leased';
CREATE VIEW fuzz.nacks AS
	SELECT id, idempotency.idem_outbox_nack(id, 'smith') AS nacked
	FROM idempotency.outbox WHERE state = 'leased';
CREATE VIEW fuzz.requeues AS
	SELECT id, idempotency.idem_outbox_requeue(id) AS requeued
	FROM idempotency.outbox WHERE state = 'dead';
CREATE VIEW fuzz.maintenance AS
	SELECT * FROM idempotency.idem_run_maintenance();

GRANT SELECT ON ALL TABLES IN SCHEMA fuzz TO idem_fuzz_app;
