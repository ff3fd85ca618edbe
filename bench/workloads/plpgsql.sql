\set k random(1, 1000000000000)
BEGIN;
SELECT outcome FROM peer_claim('bench:' || :client_id, :k::text);
SELECT peer_complete('bench:' || :client_id, :k::text, 201, '{"id": 1, "status": "created"}', '{"Location": "/payments/1"}');
COMMIT;
