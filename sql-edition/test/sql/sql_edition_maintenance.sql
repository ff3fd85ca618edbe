--
-- sql_edition_maintenance: what the SQL edition's idem_run_maintenance()
-- does that the C edition's tests cannot show, since there
-- idempotency.purge_batch_size is set only in postgresql.conf: a call purges
-- at most that many rows of each table, and the setting is checked where
-- it is used, with the errors the C edition's SET gives.
--
\set SHOW_CONTEXT never
BEGIN;
DELETE FROM idempotency.keys;
DELETE FROM idempotency.processed_events;
INSERT INTO idempotency.keys (scope, key, attempt, status_code, ttl, created_at, completed_at, expires_at)
SELECT 'batch', 'k' || i, 1, 200, '1 hour', c - interval '3 hours', c - interval '2 hours', c - interval '1 hour'
FROM (SELECT clock_timestamp() AS c) AS now_ts, generate_series(1, 5) AS i;
INSERT INTO idempotency.processed_events (consumer, event_id, processed_at, expires_at)
SELECT 'batch', 'e' || i, c - interval '2 days', c - interval '1 day'
FROM (SELECT clock_timestamp() AS c) AS now_ts, generate_series(1, 3) AS i;
SET LOCAL idempotency.purge_batch_size = 2;
SELECT * FROM idempotency.idem_run_maintenance();
SELECT * FROM idempotency.idem_run_maintenance();
SELECT * FROM idempotency.idem_run_maintenance();
SELECT count(*) AS keys_left FROM idempotency.keys;
ROLLBACK;

-- a fraction is rounded as the server rounds an integer setting (half to even)
BEGIN;
DELETE FROM idempotency.keys;
INSERT INTO idempotency.keys (scope, key, attempt, status_code, ttl, created_at, completed_at, expires_at)
SELECT 'batch', 'k' || i, 1, 200, '1 hour', c - interval '3 hours', c - interval '2 hours', c - interval '1 hour'
FROM (SELECT clock_timestamp() AS c) AS now_ts, generate_series(1, 30) AS i;
SET LOCAL idempotency.purge_batch_size = ' 2.5 ';
SELECT purged_keys FROM idempotency.idem_run_maintenance();
SET LOCAL idempotency.purge_batch_size = '1.5';
SELECT purged_keys FROM idempotency.idem_run_maintenance();
SET LOCAL idempotency.purge_batch_size = '010';	-- octal
SELECT purged_keys FROM idempotency.idem_run_maintenance();
SET LOCAL idempotency.purge_batch_size = '0x10';
SELECT purged_keys FROM idempotency.idem_run_maintenance();
SELECT count(*) AS keys_left FROM idempotency.keys;
ROLLBACK;

-- bad values: the C edition's errors
SET idempotency.purge_batch_size = 0;
SELECT * FROM idempotency.idem_run_maintenance();
SET idempotency.purge_batch_size = 1000001;
SELECT * FROM idempotency.idem_run_maintenance();
SET idempotency.purge_batch_size = '10 rows';
SELECT * FROM idempotency.idem_run_maintenance();
SET idempotency.purge_batch_size = 99999999999;
SELECT * FROM idempotency.idem_run_maintenance();
SET idempotency.purge_batch_size = '08';
SELECT * FROM idempotency.idem_run_maintenance();
RESET idempotency.purge_batch_size;
