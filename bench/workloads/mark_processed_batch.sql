\set k random(1, 1000000000000)
SELECT * FROM idempotency.idem_mark_processed_batch('bench', ARRAY(SELECT :k || '-' || n FROM generate_series(1, 500) n));
