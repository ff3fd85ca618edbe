-- Reference tables for the benchmark, each shaped like the extension's own.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- floor for claim + complete: one INSERT of the same full row
CREATE TABLE bench_floor (LIKE idempotency.keys INCLUDING ALL);

-- replay: a PK SELECT of the same stored rows
CREATE TABLE bench_replay (LIKE idempotency.keys INCLUDING ALL);
INSERT INTO idempotency.keys (scope, key, fingerprint, attempt, status_code, body, headers,
                              ttl, created_at, completed_at, expires_at)
SELECT 'replay', n::text, NULL, 1, 201, '{"id": ' || n || ', "status": "created"}',
       '{"Location": "/payments/1"}', '24 hours', now(), now(), now() + interval '24 hours'
FROM generate_series(1, 100000) n;
INSERT INTO bench_replay SELECT * FROM idempotency.keys WHERE scope = 'replay';

-- mark_processed: INSERT ... ON CONFLICT DO NOTHING RETURNING
CREATE TABLE bench_events (LIKE idempotency.processed_events INCLUDING ALL);

-- enqueue: INSERT into a table shaped like the outbox, with its indexes and
-- its storage parameters (its fillfactor), which LIKE ... INCLUDING ALL
-- does not copy
CREATE TABLE bench_outbox (LIKE idempotency.outbox INCLUDING ALL);
DO $$ BEGIN
	EXECUTE coalesce((SELECT format('ALTER TABLE bench_outbox SET (%s)', array_to_string(reloptions, ', '))
	                  FROM pg_class WHERE oid = 'idempotency.outbox'::regclass), 'SELECT');
END $$;

-- the worker's publishing target
CREATE TABLE sink (id bigint, created_at timestamptz, published_at timestamptz);
CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO public.sink VALUES (e.id, e.created_at, clock_timestamp());
END $$;
SELECT idempotency.idem_outbox_route('published', 'function', 'sink_it');

-- a plain batched DELETE, for the purge's reference figure
CREATE TABLE bench_purge (LIKE idempotency.keys INCLUDING ALL);
CREATE PROCEDURE plain_batched_delete(batch int) LANGUAGE plpgsql AS $$
DECLARE
	n int;
BEGIN
	LOOP
		DELETE FROM bench_purge WHERE ctid = ANY (ARRAY(
			SELECT ctid FROM bench_purge WHERE expires_at <= now() LIMIT batch));
		GET DIAGNOSTICS n = ROW_COUNT;
		COMMIT;
		EXIT WHEN n = 0;
	END LOOP;
END $$;

-- hint bits and visibility map set on every table alike before the first run
VACUUM ANALYZE;
