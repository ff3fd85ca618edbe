--
-- keys_lease: leases, takeover, fencing, and TTL expiry.
--
SET search_path = idempotency, public;

-- A claim committed on its own holds a lease; while it runs, others get
-- in_progress.
SELECT outcome, attempt FROM idem_claim('l', 'live', lease => '1 hour');
SELECT outcome, attempt FROM idem_claim('l', 'live');

-- When the lease runs out without a completion (the client crashed), the
-- next claim takes over with attempt 2 and the last recovery point.
SELECT outcome, attempt FROM idem_claim('l', 'crash', lease => '50 milliseconds');
SELECT idem_checkpoint('l', 'crash', 'charged card, receipt not sent', 1);
SELECT pg_sleep(0.1);
SELECT outcome, attempt, recovery_point FROM idem_claim('l', 'crash', lease => '1 hour');

-- The old owner (attempt 1) comes back: its complete, release and checkpoint
-- are refused and change nothing.
SELECT idem_complete('l', 'crash', 201, 'from attempt 1', NULL, 1);
\echo :SQLSTATE
SELECT idem_release('l', 'crash', 1);
\echo :SQLSTATE
SELECT idem_checkpoint('l', 'crash', 'attempt 1 was here', 1);
\echo :SQLSTATE
SELECT attempt, status_code, recovery_point FROM keys WHERE scope = 'l' AND key = 'crash';

-- The new owner finishes.
SELECT idem_checkpoint('l', 'crash', 'receipt sent', 2);
SELECT idem_complete('l', 'crash', 201, 'from attempt 2', NULL, 2);
SELECT outcome, status_code, body, attempt, recovery_point FROM idem_claim('l', 'crash');

-- A takeover can be taken over again.
SELECT outcome, attempt FROM idem_claim('l', 'twice', lease => '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT outcome, attempt FROM idem_claim('l', 'twice', lease => '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT outcome, attempt FROM idem_claim('l', 'twice');

-- A late completion is accepted when nobody took over in the meantime.
SELECT outcome FROM idem_claim('l', 'late', lease => '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT idem_complete('l', 'late', 200, 'late but fine', NULL, 1);

-- TTL: a completed key expires ttl after completion, and an expired key is
-- claimable again at once, before any purge, as a new key (attempt 1).
SELECT outcome FROM idem_claim('l', 'short-lived', ttl => '1 second');
SELECT idem_complete('l', 'short-lived', 200, 'old response');
SELECT outcome, body FROM idem_claim('l', 'short-lived');
SELECT pg_sleep(1.1);
SELECT outcome, attempt, body FROM idem_claim('l', 'short-lived');
SELECT count(*) AS rows_for_key FROM keys WHERE scope = 'l' AND key = 'short-lived';

-- An abandoned claim is kept for a takeover until lease + ttl, then it too
-- counts as absent: the next claim starts again at attempt 1.
SELECT outcome FROM idem_claim('l', 'abandoned', ttl => '20 milliseconds', lease => '20 milliseconds');
SELECT expires_at - lease_expires_at AS kept_after_lease FROM keys WHERE scope = 'l' AND key = 'abandoned';
SELECT pg_sleep(0.1);
SELECT outcome, attempt FROM idem_claim('l', 'abandoned');
-- and a caller holding the expired claim can no longer complete it
SELECT outcome FROM idem_claim('l', 'expired-claim', ttl => '10 milliseconds', lease => '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT idem_complete('l', 'expired-claim', 200);
\echo :SQLSTATE

-- The defaults come from idempotency.key_ttl and idempotency.lease.
SET idempotency.key_ttl = '2h';
SET idempotency.lease = '90s';
SELECT outcome FROM idem_claim('l', 'defaults');
SELECT ttl, lease_expires_at - created_at AS lease FROM keys WHERE scope = 'l' AND key = 'defaults';
RESET idempotency.key_ttl;
RESET idempotency.lease;

-- Calendar intervals are accepted.
SELECT outcome FROM idem_claim('l', 'calendar', ttl => '1 mon 2 days');
SELECT ttl FROM keys WHERE scope = 'l' AND key = 'calendar';

-- Zero or negative ttl or lease is refused (22023) and nothing is written.
SELECT idem_claim('l', 'bad-ttl', ttl => '0');
\echo :SQLSTATE
SELECT idem_claim('l', 'bad-ttl', ttl => '-1 hour');
\echo :SQLSTATE
SELECT idem_claim('l', 'bad-ttl', ttl => '1 day -25 hours');
\echo :SQLSTATE
SELECT idem_claim('l', 'bad-lease', lease => '0 seconds');
\echo :SQLSTATE
SELECT idem_claim('l', 'bad-lease', lease => '-5 minutes');
\echo :SQLSTATE
SELECT count(*) AS rows_written FROM keys WHERE key IN ('bad-ttl', 'bad-lease');
-- and so are settings below their minimum (the server words the range of an
-- interval setting differently from one version to the next: its SQLSTATE
-- and the value kept are what the extension decides)
\set VERBOSITY sqlstate
SET idempotency.lease = 0;
SET idempotency.key_ttl = '-1';
\set VERBOSITY default
SHOW idempotency.lease;
SHOW idempotency.key_ttl;
