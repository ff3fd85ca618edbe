--
-- keys_wait: idem_claim's wait argument in one session: its validation,
-- that NULL and 0 never wait, and the outcomes that never wait.  The waits
-- for another session's request are in specs/claim_wait*.spec.
--
SET search_path = idempotency, public;

-- A key held by a committed claim whose lease runs for an hour.
SELECT outcome, attempt FROM idem_claim('w', 'held', lease => '1 hour');

-- wait must not be negative: 22023, and nothing is written.
SELECT idem_claim('w', 'new', wait => '-1 second');
\echo :SQLSTATE
SELECT idem_claim('w', 'new', wait => '1 day -25 hours');
\echo :SQLSTATE
SELECT count(*) FROM keys WHERE scope = 'w' AND key = 'new';

-- wait must not exceed idempotency.max_wait (a minute by default): 22023
-- through the function and in FROM, and nothing is written.  The
-- setting itself is accepted.
SHOW idempotency.max_wait;
SELECT idem_claim('w', 'new', wait => '61 seconds');
\echo :SQLSTATE
SELECT outcome FROM idem_claim('w', 'new', wait => '1 day');
\echo :SQLSTATE
SELECT count(*) FROM keys WHERE scope = 'w' AND key = 'new';
SELECT outcome FROM idem_claim('w', 'max-wait', wait => '1 minute');
-- 0 refuses every wait but 0 and NULL
SET idempotency.max_wait = 0;
SELECT idem_claim('w', 'new', wait => '1 ms');
\echo :SQLSTATE
SELECT outcome FROM idem_claim('w', 'max-wait', wait => '0');
RESET idempotency.max_wait;
-- the application's role cannot raise it: only a superuser, or a role
-- granted SET on it, can
CREATE ROLE regress_idem_wait;
SET ROLE regress_idem_wait;
SET idempotency.max_wait = '1h';
\echo :SQLSTATE
RESET ROLE;
DROP ROLE regress_idem_wait;
SHOW idempotency.max_wait;

-- The other arguments are checked as before, with or without a wait.
SELECT idem_claim('w', NULL, wait => '1 second');
\echo :SQLSTATE
SELECT idem_claim('w', 'new', lease => '0', wait => '1 second');
\echo :SQLSTATE

-- NULL and 0: in_progress at once, as without the argument.
SELECT outcome, attempt FROM idem_claim('w', 'held', wait => NULL);
SELECT outcome, attempt FROM idem_claim('w', 'held', wait => '0');
SELECT outcome, attempt FROM idem_claim('w', 'held', wait => '0 seconds');

-- A positive wait that runs out: in_progress, after the wait and not
-- before it (in FROM, and through the function).
SELECT outcome, attempt, clock_timestamp() - statement_timestamp() >= '200 ms' AS waited
FROM idem_claim('w', 'held', wait => '200 ms');
SELECT (c).outcome, clock_timestamp() - statement_timestamp() >= '200 ms' AS waited
FROM (SELECT idem_claim('w', 'held', NULL, NULL, NULL, '200 ms') AS c) AS call;

-- The lease of the claim waited for runs out during the wait: the waiter
-- takes the key over, with attempt 2, without waiting for the whole wait.
SELECT outcome, attempt FROM idem_claim('w', 'short lease', lease => '300 ms');
SELECT outcome, attempt, clock_timestamp() - statement_timestamp() < '20 s' AS before_the_wait_ran_out
FROM idem_claim('w', 'short lease', wait => '30 s');

-- A new key, a completed one, and a mismatch: answered at once.
SELECT outcome, clock_timestamp() - statement_timestamp() < '20 s' AS at_once
FROM idem_claim('w', 'fresh', wait => '30 s');
SELECT idem_complete('w', 'fresh', 201, 'done');
SELECT outcome, body, clock_timestamp() - statement_timestamp() < '20 s' AS at_once
FROM idem_claim('w', 'fresh', wait => '30 s');
SELECT outcome FROM idem_claim('w', 'fp', 'fingerprint a', lease => '1 hour');
SELECT outcome, clock_timestamp() - statement_timestamp() < '20 s' AS at_once
FROM idem_claim('w', 'fp', 'fingerprint b', wait => '30 s');

-- A transaction never waits for its own claim: in_progress at once.
BEGIN;
SELECT outcome FROM idem_claim('w', 'mine');
SELECT outcome, clock_timestamp() - statement_timestamp() < '20 s' AS at_once
FROM idem_claim('w', 'mine', wait => '30 s');
ROLLBACK;

-- statement_timeout ends a wait at once: 57014; the key is as it was.
SET statement_timeout = '200ms';
SELECT outcome FROM idem_claim('w', 'held', wait => '1 min');
\echo :SQLSTATE
RESET statement_timeout;
SELECT outcome, attempt FROM idem_claim('w', 'held');

-- The same in a PL/pgSQL exception block, which catches the cancel and
-- goes on in the same transaction: the next wait works as the first.
SET statement_timeout = '200ms';
DO $$
BEGIN
	BEGIN
		PERFORM idem_claim('w', 'held', wait => '1 min');
	EXCEPTION WHEN query_canceled THEN
		RAISE NOTICE 'canceled: %', SQLSTATE;
	END;
END
$$;
RESET statement_timeout;
SELECT outcome, clock_timestamp() - statement_timestamp() >= '100 ms' AS waited
FROM idem_claim('w', 'held', wait => '100 ms');

-- A database still at 1.0 has the five-argument idem_claim, which the
-- library serves too (here a copy of it, by another name): it never waits.
CREATE FUNCTION public.idem_claim_1_0(scope text, key text, fingerprint text DEFAULT NULL,
									  ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idempotency.claim_result AS 'idempotency', 'idem_claim'
LANGUAGE C VOLATILE CALLED ON NULL INPUT;
SELECT outcome, attempt FROM public.idem_claim_1_0('w', 'held');
SELECT (public.idem_claim_1_0('w', 'held')).outcome;
DROP FUNCTION public.idem_claim_1_0;

DELETE FROM keys WHERE scope = 'w';
