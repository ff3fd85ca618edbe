\set k random(1, 1000000000000)
SELECT idempotency.idem_mark_processed('bench', :k::text);
