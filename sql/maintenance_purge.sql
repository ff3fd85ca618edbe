--
-- maintenance_purge: idem_run_maintenance() purges the keys whose
-- expires_at has passed (a completed key ttl after its completion, an
-- abandoned claim lease + ttl after its lease) and the processed events
-- past their retention, and nothing else.  Both editions run this file
-- (scripts/check-sql-edition.sh).  The rows are written in one transaction,
-- rolled back at the end: no background worker can see them, nor purge them
-- first.
--

-- a read-only transaction cannot purge
BEGIN READ ONLY;
SELECT * FROM idempotency.idem_run_maintenance();
ROLLBACK;

BEGIN;
-- this test's rows only (the earlier tests leave keys and events behind)
DELETE FROM idempotency.keys;
DELETE FROM idempotency.processed_events;
INSERT INTO idempotency.keys (scope, key, attempt, lease_expires_at, status_code, ttl,
							  created_at, completed_at, expires_at)
SELECT 'purge', k, 1, lease_end, status, '1 hour', c - interval '3 hours', done, expires
FROM (SELECT clock_timestamp() AS c) AS now_ts,
LATERAL (VALUES
	-- completed, ttl over: purged
	('done-expired', NULL::timestamptz, 200, c - interval '2 hours', c - interval '1 second'),
	-- completed, ttl running: kept
	('done-live', NULL, 201, c - interval '1 minute', c + interval '1 hour'),
	-- abandoned claim, lease over, lease + ttl not: kept (a takeover may come)
	('abandoned-lease-over', c - interval '1 minute', NULL, NULL, c - interval '1 minute' + interval '1 hour'),
	-- abandoned claim, lease + ttl over: purged
	('abandoned-expired', c - interval '2 hours', NULL, NULL, c - interval '1 hour'),
	-- a claim whose lease is running: kept
	('held', c + interval '1 minute', NULL, NULL, c + interval '1 minute' + interval '1 hour')
) AS v(k, lease_end, status, done, expires);
INSERT INTO idempotency.processed_events (consumer, event_id, processed_at, expires_at)
SELECT 'purge', e, c - interval '2 days', c + offset_by
FROM (SELECT clock_timestamp() AS c) AS now_ts,
LATERAL (VALUES ('ev-expired-1', interval '-1 second'), ('ev-expired-2', interval '-1 day'),
				('ev-live', interval '1 day')) AS v(e, offset_by);
-- and what the functions write in this transaction, within its ttl and retention
SELECT outcome FROM idempotency.idem_claim('purge', 'claimed-now');
SELECT idempotency.idem_mark_processed('purge', 'ev-marked-now');

SELECT * FROM idempotency.idem_run_maintenance();
SELECT key, status_code FROM idempotency.keys ORDER BY key;
SELECT event_id FROM idempotency.processed_events ORDER BY event_id;
-- nothing left to purge
SELECT * FROM idempotency.idem_run_maintenance();
-- a purged key is claimable as a new one
SELECT outcome, attempt FROM idempotency.idem_claim('purge', 'done-expired');
ROLLBACK;
