/*
 * idem_run_maintenance() without a worker: what pg_cron (or the
 * application's scheduler) calls, as in the C edition
 * (src/worker/run_maintenance.c, src/worker/purge.c), in the caller's
 * transaction.
 *
 * The purge: keys whose expires_at has passed (a completed key ttl after
 * its completion, an abandoned claim lease + ttl after its last lease) and
 * processed events past their retention, up to
 * idempotency.purge_batch_size rows of each table per call, so that a call
 * holds its row locks for one bounded batch.  The rows are chosen by a
 * sequential scan that stops at the batch's last row (the tables have no
 * index on expires_at, which would make idem_complete's update non-HOT),
 * locked with SKIP LOCKED so that a row another transaction is writing or
 * holds is left for the next call, as the C edition leaves it, and deleted
 * by their ctids.  A claim that meets a row being purged waits for this
 * transaction, then finds it gone (keys.sql).
 *
 * The outbox's columns are 0: this edition has no outbox functions yet, so
 * no outbox row can exist to purge or publish (the outbox part fills them).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_run_maintenance(OUT purged_keys bigint,
												 OUT purged_events bigint,
												 OUT purged_outbox bigint,
												 OUT published bigint,
												 OUT publish_failures bigint)
RETURNS record
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	batch integer;
	now_ts timestamptz;
BEGIN
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_run_maintenance()');
	END IF;
	batch := idempotency._integer_setting('idempotency.purge_batch_size', 1, 1000000, 5000);

	now_ts := clock_timestamp();
	DELETE FROM idempotency.keys
	WHERE ctid = ANY (ARRAY(SELECT k.ctid FROM idempotency.keys AS k
							WHERE k.expires_at <= now_ts
							LIMIT batch FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS purged_keys = ROW_COUNT;

	now_ts := clock_timestamp();
	DELETE FROM idempotency.processed_events
	WHERE ctid = ANY (ARRAY(SELECT e.ctid FROM idempotency.processed_events AS e
							WHERE e.expires_at <= now_ts
							LIMIT batch FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS purged_events = ROW_COUNT;

	purged_outbox := 0;
	published := 0;
	publish_failures := 0;
END
$$;
