--
-- keys_claim: claim -> complete -> replay, in one transaction and in two.
--
SET search_path = idempotency, public;

-- A first claim owns the key: attempt 1, nothing stored yet.
SELECT outcome, status_code, body, headers, attempt, recovery_point,
       created_at IS NOT NULL AS has_created_at
FROM idem_claim('alice:POST /payments', 'key-1');

-- A second claim while the first is in progress (and its lease runs) is a
-- conflict: the caller answers 409.
SELECT outcome, attempt FROM idem_claim('alice:POST /payments', 'key-1');

-- Completing stores the response; a JSON body keeps its spacing and key
-- order byte for byte, because it is stored as text.
SELECT idem_complete('alice:POST /payments', 'key-1', 201,
                     E'{"id": 42,   "amount":10,\n "a": true}',
                     '{"Location": "/payments/42", "Content-Type": "application/json"}');

-- Every later claim replays it: same status, body and headers.
SELECT outcome, status_code, body, headers, attempt
FROM idem_claim('alice:POST /payments', 'key-1');
SELECT body = E'{"id": 42,   "amount":10,\n "a": true}' AS body_byte_for_byte
FROM idem_claim('alice:POST /payments', 'key-1');

-- Scopes are independent namespaces: the same key under another user or
-- endpoint is a different key.
SELECT outcome FROM idem_claim('bob:POST /payments', 'key-1');
SELECT outcome FROM idem_claim('alice:POST /refunds', 'key-1');
-- the empty scope is a scope like any other
SELECT outcome FROM idem_claim('', 'key-1');

-- One-transaction mode: claim, business writes, complete, commit.
CREATE TABLE public.payments (id serial PRIMARY KEY, amount int);
BEGIN;
SELECT outcome FROM idem_claim('alice:POST /payments', 'key-2');
INSERT INTO payments (amount) VALUES (10);
SELECT idem_complete('alice:POST /payments', 'key-2', 201, '{"id": 1}');
-- inside the same transaction the key already replays
SELECT outcome, status_code, body FROM idem_claim('alice:POST /payments', 'key-2');
COMMIT;
SELECT outcome, status_code, body FROM idem_claim('alice:POST /payments', 'key-2');

-- Claim and complete may even share one statement.
SELECT (idem_claim('s', 'same-statement')).outcome,
       idem_complete('s', 'same-statement', 200, 'ok');
SELECT outcome, body FROM idem_claim('s', 'same-statement');

-- A transaction that rolls back leaves nothing: the key is free again and
-- the next claim is attempt 1 (partial failures are never cached).
BEGIN;
SELECT outcome FROM idem_claim('alice:POST /payments', 'key-3');
INSERT INTO payments (amount) VALUES (30);
SELECT idem_complete('alice:POST /payments', 'key-3', 201, '{"id": 2}');
ROLLBACK;
SELECT count(*) AS key_3_rows FROM keys WHERE key = 'key-3';
SELECT outcome, attempt FROM idem_claim('alice:POST /payments', 'key-3');

-- A savepoint rolled back undoes the claim too.
BEGIN;
SAVEPOINT before_claim;
SELECT outcome FROM idem_claim('alice:POST /payments', 'key-4');
ROLLBACK TO SAVEPOINT before_claim;
SELECT outcome, attempt FROM idem_claim('alice:POST /payments', 'key-4');
COMMIT;

-- Two-transaction mode: the claim commits on its own (autocommit here),
-- the completion comes in a later transaction.
SELECT outcome, attempt FROM idem_claim('alice:POST /charges', 'key-5');
SELECT outcome FROM idem_claim('alice:POST /charges', 'key-5');
SELECT idem_complete('alice:POST /charges', 'key-5', 200, 'charged', NULL, 1);
SELECT outcome, status_code, body, attempt FROM idem_claim('alice:POST /charges', 'key-5');

-- The stored rows, as a user would inspect them.
SELECT scope, key, attempt, status_code, body,
       lease_expires_at IS NULL AS lease_cleared,
       expires_at > completed_at AS kept_after_completion
FROM keys WHERE scope = 'alice:POST /payments' ORDER BY key;

-- A claim keeps its lock on the table (not on any row another claim could
-- wait for) until its transaction ends, so that DDL such as REINDEX
-- CONCURRENTLY cannot slip in under an uncommitted claim.
BEGIN;
SELECT outcome FROM idem_claim('locks', 'k');
SELECT mode FROM pg_locks
WHERE pid = pg_backend_pid() AND relation = 'idempotency.keys'::regclass;
COMMIT;
