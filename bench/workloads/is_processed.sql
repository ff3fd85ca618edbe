\set k random(1, 200000)
SELECT idempotency.idem_is_processed('bench', :k::text);
