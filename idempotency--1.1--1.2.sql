/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * The update has one section per concern, each saying what it changes and
 * why; a section changes only what it names.
 */

/* ---- Outbox fences: attempts counts hand-outs, failures the failed tries ----
 *
 * A fenced ack or nack names the hand-out it acts for by the attempts that
 * fetch returned.  At 1.1 attempts also counted the failed tries that
 * backoff and outbox_max_attempts are decided on, so a requeue reset it and
 * a nack's put-back of the later rows of its hand-out took that hand-out
 * back: the next hand-out of such a row carried a fence an earlier one had
 * carried, and a stale relay's ack or nack acted on the new holder's lease.
 * From 1.2, attempts counts hand-outs and never goes back (a put-back and a
 * requeue leave it), and failures counts the failed tries: a nack, a lease
 * that ran out, a failed publication; a requeue resets it.  A NOT NULL
 * column with a constant default: no rewrite of the table.
 */
ALTER TABLE idempotency.outbox ADD COLUMN failures integer NOT NULL DEFAULT 0;

/*
 * The rows in flight carry their failures over: a pending or dead row's
 * attempts were its failed tries, a leased row's one more (the try in
 * hand).  A leased row keeps its attempts, the fence its relay holds.  A
 * pending row's next hand-out must carry a fence no 1.1 hand-out of it
 * carried: one more than its attempts is above the fence of a hand-out a
 * nack put back (taken back by one), and a row requeued at 1.1 (attempts
 * reset to 0) may have been handed out up to outbox_max_attempts times
 * before it died.  A pending row never handed out nor failed has no earlier
 * fence (attempts 0, no last_error, and available since it was enqueued: a
 * put-back made it available later), and is left as it is, as are
 * published rows (failures 0): no decision reads them, and the update is
 * spared the rewrite of most of a backlog.
 */
DO $$
DECLARE
	max_attempts integer := coalesce(current_setting('idempotency.outbox_max_attempts', true),
									 '10')::integer;
BEGIN
	UPDATE idempotency.outbox
	SET failures = attempts, attempts = greatest(attempts + 1, max_attempts)
	WHERE state = 'pending'
	  AND (attempts > 0 OR last_error IS NOT NULL OR available_at <> created_at);
	UPDATE idempotency.outbox SET failures = attempts
	WHERE state = 'dead' AND attempts > 0;
	UPDATE idempotency.outbox SET failures = attempts - 1
	WHERE state = 'leased' AND attempts > 1;
END
$$;

COMMENT ON COLUMN idempotency.outbox.attempts IS
	'how many times the row was handed out (fetched, or tried by the worker); never goes back: a fenced ack or nack names its hand-out by it';
COMMENT ON COLUMN idempotency.outbox.failures IS
	'failed tries since the row was enqueued or requeued: nacks, leases that ran out, failed publications; the backoff and outbox_max_attempts are decided on it';

/* ---- A leaner outbox: one index fewer ----
 *
 * 1.1 kept the primary key (topic, id), which Citus needs to hold the
 * topic, and beside it outbox_id (id), for the calls that name rows by id
 * alone (ack, nack, requeue, discard, publishing).  From 1.2 the primary
 * key is (id, topic): it finds a row by id as outbox_id did, and still
 * holds the topic; outbox_ready, the (topic, id) index of the unpublished
 * rows, serves the walks in order by topic.  An enqueue writes an entry
 * into one index fewer, and a row takes 22 bytes less (make bench's cold
 * part).  The fillfactor stays at 50: at 85 a row took 699 bytes with its
 * indexes against 1,139, but most of a hand-out's new versions no longer
 * found room on their page, and a drain cost the server 1.3 times the CPU
 * (1.7 times with keys): see bench/README.md.
 */
ALTER TABLE idempotency.outbox
	DROP CONSTRAINT outbox_pkey,
	ADD CONSTRAINT outbox_pkey PRIMARY KEY (id, topic);
DROP INDEX idempotency.outbox_id;
