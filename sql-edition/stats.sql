/*
 * The cumulative counters live in the C edition's shared memory, which this
 * edition does not have: like the C edition without
 * shared_preload_libraries, idem_stats_counters() returns no row, and the
 * counter and worker columns of idempotency.stats are NULL.  The view's row
 * counts work as in the C edition.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_stats_counters(OUT claims bigint,
												OUT replays bigint,
												OUT conflicts bigint,
												OUT mismatches bigint,
												OUT takeovers bigint,
												OUT released bigint,
												OUT purged bigint,
												OUT published bigint,
												OUT publish_failures bigint,
												OUT purge_yields bigint,
												OUT worker_last_round timestamptz,
												OUT worker_pid integer)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE PARALLEL SAFE ROWS 1
AS $$
BEGIN
	RETURN;
END
$$;
