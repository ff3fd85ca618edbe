--
-- keys_complete: idem_complete, idem_release and idem_checkpoint act only on
-- a claim in progress; anything else is an error that changes nothing.
--
SET search_path = idempotency, public;

-- Completing a key that was never claimed: 22I01, nothing written.
SELECT idem_complete('c', 'never-claimed', 200, 'ok');
\echo :SQLSTATE
SELECT idem_release('c', 'never-claimed');
\echo :SQLSTATE
SELECT idem_checkpoint('c', 'never-claimed', 'step 1');
\echo :SQLSTATE
SELECT count(*) AS rows_written FROM keys WHERE scope = 'c';

-- Completing a key that is already completed: 22I02, the stored response
-- is untouched.
SELECT outcome FROM idem_claim('c', 'done');
SELECT idem_complete('c', 'done', 201, 'first');
SELECT idem_complete('c', 'done', 200, 'second');
\echo :SQLSTATE
SELECT idem_release('c', 'done');
\echo :SQLSTATE
SELECT idem_checkpoint('c', 'done', 'late');
\echo :SQLSTATE
SELECT outcome, status_code, body, recovery_point FROM idem_claim('c', 'done');

-- A released key is no longer claimed.
SELECT outcome FROM idem_claim('c', 'released');
SELECT idem_release('c', 'released');
SELECT idem_complete('c', 'released', 200);
\echo :SQLSTATE
SELECT outcome, attempt FROM idem_claim('c', 'released');

-- Checkpoints record how far the operation got; NULL clears the mark.
SELECT idem_checkpoint('c', 'released', 'charged card');
SELECT recovery_point FROM keys WHERE scope = 'c' AND key = 'released';
SELECT idem_checkpoint('c', 'released', NULL);
SELECT recovery_point FROM keys WHERE scope = 'c' AND key = 'released';

-- The attempt is a fencing token: a wrong one is refused (22I03) and
-- nothing changes.
SELECT idem_checkpoint('c', 'released', 'step', 7);
\echo :SQLSTATE
SELECT idem_complete('c', 'released', 200, 'x', NULL, 2);
\echo :SQLSTATE
SELECT idem_release('c', 'released', 0);
\echo :SQLSTATE
SELECT attempt, status_code, recovery_point FROM keys WHERE scope = 'c' AND key = 'released';
-- the right one is accepted
SELECT idem_complete('c', 'released', 200, 'x', NULL, 1);

-- NULL status is refused (22004); so is anything outside 100..599 (22023).
SELECT outcome FROM idem_claim('c', 'status');
SELECT idem_complete('c', 'status', NULL);
\echo :SQLSTATE
SELECT idem_complete('c', 'status', 99);
\echo :SQLSTATE
SELECT idem_complete('c', 'status', 600);
\echo :SQLSTATE
SELECT idem_complete('c', 'status', -200);
\echo :SQLSTATE
SELECT status_code IS NULL AS still_in_progress FROM keys WHERE scope = 'c' AND key = 'status';
SELECT idem_complete('c', 'status', 100, 'continue');
SELECT idem_complete('c', 'status', 599);
\echo :SQLSTATE

-- A body to store over idempotency.max_response_bytes (1MB by default) is
-- refused with 54000, and nothing is written: the key stays in progress.
SHOW idempotency.max_response_bytes;
SELECT outcome FROM idem_claim('c', 'too-big');
SELECT idem_complete('c', 'too-big', 200, repeat('x', 1024 * 1024 + 1));
\echo :SQLSTATE
SELECT status_code IS NULL AS still_in_progress, body IS NULL AS no_body
FROM keys WHERE scope = 'c' AND key = 'too-big';
-- exactly the limit is stored; the bytes are counted, not the characters
SELECT idem_complete('c', 'too-big', 200, repeat('é', 512 * 1024 + 1));
\echo :SQLSTATE
SELECT idem_complete('c', 'too-big', 200, repeat('x', 1024 * 1024));
SELECT outcome, octet_length(body) AS body_bytes FROM idem_claim('c', 'too-big');
-- a body read from a table, compressed there, is counted uncompressed
CREATE TEMP TABLE big_bodies AS SELECT repeat('x', 2 * 1024 * 1024) AS body;
SELECT outcome FROM idem_claim('c', 'too-big-toasted');
SELECT idem_complete('c', 'too-big-toasted', 200, body) FROM big_bodies;
\echo :SQLSTATE
SELECT status_code IS NULL AS still_in_progress FROM keys WHERE scope = 'c' AND key = 'too-big-toasted';
-- a released answer is not stored, so its body is not counted
SELECT idem_complete('c', 'too-big-toasted', 503, body) FROM big_bodies;
SELECT count(*) FROM keys WHERE scope = 'c' AND key = 'too-big-toasted';
DROP TABLE big_bodies;
-- the application's role cannot raise the limit itself
CREATE ROLE regress_idem_body;
SET ROLE regress_idem_body;
SET idempotency.max_response_bytes = '1GB';
\echo :SQLSTATE
RESET ROLE;
DROP ROLE regress_idem_body;

-- A 10 MB body round-trips byte for byte (it is TOASTed on the way), once
-- a superuser raised the limit.
SET idempotency.max_response_bytes = '16MB';
SELECT outcome FROM idem_claim('c', 'big');
SELECT idem_complete('c', 'big', 200, repeat('0123456789abcdef', 655360));
SELECT outcome, length(body) AS body_bytes, md5(body) = md5(repeat('0123456789abcdef', 655360)) AS same_body
FROM idem_claim('c', 'big');

-- Headers are any jsonb; NULL body and headers are stored as NULL.
SELECT outcome FROM idem_claim('c', 'no-body');
SELECT idem_complete('c', 'no-body', 204);
SELECT outcome, status_code, body IS NULL AS no_body, headers IS NULL AS no_headers
FROM idem_claim('c', 'no-body');
