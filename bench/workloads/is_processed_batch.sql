\set k random(1, 400)
SELECT count(*) FROM idempotency.idem_is_processed_batch('bench', ARRAY(SELECT (:k * 500 + n)::text FROM generate_series(1, 500) n));
