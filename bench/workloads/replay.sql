\set k random(1, 100000)
SELECT outcome, status_code, body, headers FROM idempotency.idem_claim('replay', :k::text);
