--
-- keys_extend_lease: what claim_result says about time in every outcome
-- (lease_expires_at, expires_at), and idem_extend_lease.
--
SET search_path = idempotency, public;
CREATE TEMP TABLE stored AS
SELECT scope, key, attempt, recovery_point, lease_expires_at, status_code, expires_at
FROM keys WHERE false;

-- claimed: lease_expires_at is when the new claim's lease runs out, as
-- stored; expires_at is NULL.  A call in FROM and the function agree.
SELECT outcome, lease_expires_at - created_at AS lease, expires_at IS NULL AS no_expires_at
FROM idem_claim('t', 'held', lease => '10 minutes') \gset claimed_
\echo :claimed_outcome :claimed_lease :claimed_no_expires_at
SELECT lease_expires_at - created_at AS stored_lease FROM keys WHERE scope = 't' AND key = 'held';
SELECT (c).outcome, (c).lease_expires_at - (c).created_at AS lease, (c).expires_at IS NULL AS no_expires_at
FROM (SELECT idem_claim('t', 'held-too', lease => '5 minutes') AS c) s;

-- in_progress, the holder's claim committed: its lease_expires_at, when a
-- takeover becomes possible; expires_at is NULL.
SELECT outcome, lease_expires_at = (SELECT lease_expires_at FROM keys WHERE scope = 't' AND key = 'held')
         AS holders_lease,
       expires_at IS NULL AS no_expires_at
FROM idem_claim('t', 'held');
SELECT (idem_claim('t', 'held')).lease_expires_at
       = (SELECT lease_expires_at FROM keys WHERE scope = 't' AND key = 'held') AS holders_lease;

-- in_progress, held by a claim not committed (here, this transaction's own):
-- nobody can tell when it ends, so lease_expires_at is NULL.
BEGIN;
SELECT outcome, lease_expires_at IS NOT NULL AS has_lease FROM idem_claim('t', 'open');
SELECT outcome, lease_expires_at IS NULL AS no_lease, expires_at IS NULL AS no_expires_at
FROM idem_claim('t', 'open');
ROLLBACK;

-- replay: expires_at is when the stored response expires (completion +
-- ttl); lease_expires_at is NULL.
SELECT outcome FROM idem_claim('t', 'done', ttl => '3 days');
SELECT idem_complete('t', 'done', 201, 'created');
SELECT outcome, lease_expires_at IS NULL AS no_lease,
       expires_at = (SELECT completed_at + ttl FROM keys WHERE scope = 't' AND key = 'done')
         AS expires_with_response,
       expires_at - (SELECT completed_at FROM keys WHERE scope = 't' AND key = 'done') AS kept
FROM idem_claim('t', 'done');
SELECT (idem_claim('t', 'done')).expires_at
       = (SELECT expires_at FROM keys WHERE scope = 't' AND key = 'done') AS expires_with_response;

-- mismatch: neither.
SELECT outcome FROM idem_claim('t', 'fp', 'one');
SELECT outcome, lease_expires_at IS NULL AS no_lease, expires_at IS NULL AS no_expires_at
FROM idem_claim('t', 'fp', 'two');

-- A takeover (attempt 2) answers its own new lease.
SELECT outcome FROM idem_claim('t', 'crashed', lease => '1 millisecond');
SELECT pg_sleep(0.01);
SELECT outcome, attempt, lease_expires_at - clock_timestamp() > '59 minutes' AS new_lease,
       lease_expires_at AS takeover_lease
FROM idem_claim('t', 'crashed', lease => '1 hour') \gset
\echo :outcome :attempt :new_lease
SELECT lease_expires_at = :'takeover_lease' AS as_stored
FROM keys WHERE scope = 't' AND key = 'crashed';

-- idem_extend_lease: the holder pushes its lease out, to lease from now;
-- the answer is the new lease_expires_at, as stored, and the row stays
-- kept for a takeover until lease + ttl.
SELECT idem_extend_lease('t', 'held', 1, '2 hours') AS extended \gset
SELECT lease_expires_at = :'extended' AS as_stored,
       lease_expires_at - clock_timestamp() > '119 minutes' AS two_hours,
       expires_at = lease_expires_at + ttl AS kept_until_lease_plus_ttl
FROM keys WHERE scope = 't' AND key = 'held';
SELECT outcome, lease_expires_at = :'extended' AS extended_lease FROM idem_claim('t', 'held');

-- Without a lease, idempotency.lease; a shorter lease shortens it.
SET idempotency.lease = '90s';
SELECT idem_extend_lease('t', 'held', 1) - clock_timestamp() BETWEEN '89 s' AND '90 s' AS ninety_seconds;
RESET idempotency.lease;
SELECT idem_extend_lease('t', 'held', 1, '1 second') - clock_timestamp() <= '1 second' AS one_second;

-- A lease that ran out, not taken over yet, can still be extended: then
-- nobody takes it over.
SELECT outcome FROM idem_claim('t', 'late', lease => '1 millisecond');
SELECT pg_sleep(0.01);
SELECT idem_extend_lease('t', 'late', 1, '1 hour') > clock_timestamp() AS extended;
SELECT outcome, attempt FROM idem_claim('t', 'late');

-- A claim of this transaction's own can be extended too.
BEGIN;
SELECT outcome FROM idem_claim('t', 'own');
SELECT idem_extend_lease('t', 'own', 1, '1 hour') - clock_timestamp() > '59 minutes' AS extended;
ROLLBACK;

-- Errors, as idem_checkpoint's, each changing nothing.
INSERT INTO stored
SELECT scope, key, attempt, recovery_point, lease_expires_at, status_code, expires_at
FROM keys WHERE scope = 't';
-- not claimed (22I01): an unknown key, a released one
SELECT idem_extend_lease('t', 'never', 1);
\echo :SQLSTATE
SELECT outcome FROM idem_claim('t', 'released');
SELECT idem_release('t', 'released', 1);
SELECT idem_extend_lease('t', 'released', 1);
\echo :SQLSTATE
-- completed (22I02)
SELECT idem_extend_lease('t', 'done', 1);
\echo :SQLSTATE
-- a stale attempt (22I03): the holder whose claim was taken over, and an
-- attempt that never held it
SELECT idem_extend_lease('t', 'crashed', 1, '1 day');
\echo :SQLSTATE
SELECT idem_extend_lease('t', 'crashed', 3, '1 day');
\echo :SQLSTATE
-- arguments (class 22): attempt is required, the key and scope are checked
-- as everywhere, the lease must be positive
SELECT idem_extend_lease('t', 'held', NULL);
\echo :SQLSTATE
SELECT idem_extend_lease(NULL, 'held', 1);
\echo :SQLSTATE
SELECT idem_extend_lease('t', '', 1);
\echo :SQLSTATE
SELECT idem_extend_lease('t', 'held', 1, '0');
\echo :SQLSTATE
SELECT idem_extend_lease('t', 'held', 1, '-1 hour');
\echo :SQLSTATE
-- a read-only transaction (25006)
BEGIN READ ONLY;
SELECT idem_extend_lease('t', 'held', 1);
\echo :SQLSTATE
ROLLBACK;
-- nothing changed
(SELECT scope, key, attempt, recovery_point, lease_expires_at, status_code, expires_at
 FROM keys WHERE scope = 't' AND key <> 'released'
 EXCEPT SELECT * FROM stored)
UNION ALL
(SELECT * FROM stored EXCEPT
 SELECT scope, key, attempt, recovery_point, lease_expires_at, status_code, expires_at
 FROM keys WHERE scope = 't');

-- The holder of the takeover (attempt 2) extends, completes, and the
-- response replays.
SELECT idem_extend_lease('t', 'crashed', 2) > clock_timestamp() AS extended;
SELECT idem_complete('t', 'crashed', 200, 'done by attempt 2', attempt => 2);
SELECT outcome, body, attempt FROM idem_claim('t', 'crashed');
