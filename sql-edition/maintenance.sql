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
 * Then the outbox: the published rows past idempotency.outbox_retention
 * (those whose NOTIFY went out truncated past
 * idempotency.notify_truncated_retention too), up to the batch, oldest
 * first (STMT_PURGE_PUBLISHED); and one batch of publishing
 * (publish_fast_then_carefully in src/outbox/publish.c): up to
 * idempotency.publish_batch_size rows in one go, in a subtransaction; if
 * that fails, at most 32, each in a subtransaction of its own, so that the
 * failing row's attempt is recorded and the others go out (outbox.sql).
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
	publish_batch integer;
	now_ts timestamptz;
	truncated_before timestamptz;
	retention interval;
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

	now_ts := clock_timestamp();
	truncated_before := now_ts - idempotency._duration_setting('idempotency.notify_truncated_retention', 's', 3600, 0);
	retention := idempotency._duration_setting('idempotency.outbox_retention', 's', 0, 0);
	/* STMT_PURGE_PUBLISHED; the rows then by ctid, like the events above, not joined to a scan of the table */
	DELETE FROM idempotency.outbox
	WHERE ctid = ANY (ARRAY(
		SELECT o.ctid FROM idempotency.outbox o
		WHERE o.state = 'published'
		  AND o.published_at <= CASE WHEN retention = interval '0' THEN truncated_before ELSE now_ts - retention END
		  AND (o.published_at <= truncated_before OR o.available_at <> 'infinity')
		ORDER BY o.published_at LIMIT batch FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS purged_outbox = ROW_COUNT;

	publish_batch := idempotency._integer_setting('idempotency.publish_batch_size', 1, 10000, 100);
	now_ts := clock_timestamp();
	BEGIN
		SELECT p.published, p.failed INTO published, publish_failures
		FROM idempotency._outbox_publish(now_ts, publish_batch, false) AS p;
	EXCEPTION WHEN OTHERS THEN
		SELECT p.published, p.failed INTO published, publish_failures
		FROM idempotency._outbox_publish(now_ts, least(publish_batch, 32), true) AS p;
	END;
END
$$;
