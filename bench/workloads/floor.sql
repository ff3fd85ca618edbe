\set k random(1, 1000000000000)
BEGIN;
INSERT INTO bench_floor (scope, key, fingerprint, attempt, recovery_point, lease_expires_at, status_code, body, headers, ttl, created_at, completed_at, expires_at)
VALUES ('bench:' || :client_id, :k::text, NULL, 1, NULL, NULL, 201, '{"id": 1, "status": "created"}', '{"Location": "/payments/1"}', '24 hours', now(), now(), now() + interval '24 hours')
ON CONFLICT DO NOTHING RETURNING 1;
SELECT 1;
COMMIT;
