--
-- keys_claim_scan: idem_claim called in FROM (a Function Scan) answers as
-- the function does everywhere else, claiming once per set of arguments.
--
SET search_path = idempotency, public;
CREATE TEMP TABLE counted AS SELECT claims, replays, conflicts FROM idem_stats_counters();

-- The usual call.
SELECT outcome, status_code, attempt, created_at IS NOT NULL AS has_created_at
FROM idem_claim('scan', 'k1');
SELECT idem_complete('scan', 'k1', 201, '{"id": 1}', '{"Location": "/x/1"}');
SELECT outcome, status_code, body, headers, attempt FROM idem_claim('scan', 'k1');

-- A condition on the result filters the one row, but the claim is made all
-- the same: filtered out here, it is in progress for the next call.
SELECT outcome FROM idem_claim('scan', 'k2') WHERE outcome = 'replay';
SELECT outcome FROM idem_claim('scan', 'k2');

-- A query that reads no column still makes the claim.
SELECT count(*) FROM idem_claim('scan', 'k3');
SELECT outcome FROM idem_claim('scan', 'k3');

-- A body stored out of line (TOAST) is replayed whole.
SELECT (idem_claim('scan', 'big')).outcome;
SELECT idem_complete('scan', 'big', 200, repeat('0123456789', 20000));
SELECT outcome, length(body), md5(body) = md5(repeat('0123456789', 20000)) AS same_body
FROM idem_claim('scan', 'big');

-- LATERAL: one claim per outer row, each with its own arguments.
SELECT g, c.outcome, c.attempt
FROM generate_series(1, 3) g, LATERAL idem_claim('scan:lateral', g::text) c;
SELECT g, c.outcome
FROM generate_series(1, 3) g, LATERAL idem_claim('scan:lateral', g::text) c;

-- Rescanned with the same arguments (a subquery run per outer row), the
-- Function Scan rereads its result rather than claiming again: claimed
-- three times, not claimed then in_progress.
SELECT g, (SELECT outcome FROM idem_claim('scan', 'k4') WHERE g > 0)
FROM generate_series(1, 3) g;

-- A cursor can move back over the one row: back from the row finds nothing,
-- forward again finds it again, without a second claim.
BEGIN;
DECLARE claim_cursor CURSOR FOR SELECT outcome, attempt FROM idem_claim('scan', 'k7');
FETCH NEXT FROM claim_cursor;
FETCH PRIOR FROM claim_cursor;
FETCH NEXT FROM claim_cursor;
FETCH NEXT FROM claim_cursor;
FETCH PRIOR FROM claim_cursor;
COMMIT;

-- An argument with a subquery that reads the outer row claims again for
-- each outer row: k8a, then k8b.
CREATE TEMP TABLE outer_rows (k text);
INSERT INTO outer_rows VALUES ('a'), ('b');
SELECT o.k, (SELECT c.outcome FROM idem_claim('scan',
        CASE WHEN 'a' IN (SELECT o.k) THEN 'k8a' ELSE 'k8b' END) c)
FROM outer_rows o ORDER BY o.k;
SELECT outcome FROM idem_claim('scan', 'k8b');

-- A whole row read, and a call inside an INSERT, answer the same.
SELECT c.outcome, (c).status_code FROM idem_claim('scan', 'k1') c;
SELECT row_to_json(c)->>'outcome' AS outcome FROM idem_claim('scan', 'k1') c;
CREATE TEMP TABLE answers (outcome text);
INSERT INTO answers SELECT outcome FROM idem_claim('scan', 'k5');
SELECT * FROM answers;

-- A role that may use the schema but was not granted the function is
-- refused.
CREATE ROLE idem_scan_nobody;
GRANT USAGE ON SCHEMA idempotency TO idem_scan_nobody;
SET ROLE idem_scan_nobody;
SELECT outcome FROM idem_claim('scan', 'k1');
RESET ROLE;
REVOKE USAGE ON SCHEMA idempotency FROM idem_scan_nobody;
DROP ROLE idem_scan_nobody;

-- Bad arguments get the function's errors.
SELECT outcome FROM idem_claim(NULL, 'k');
SELECT outcome FROM idem_claim('scan', '');
SELECT outcome FROM idem_claim('scan', 'k', lease => '-1 second');

-- PL/pgSQL's SELECT INTO, with a key from a variable.
DO $$
DECLARE
	c idempotency.claim_result;
	k text := 'k6';
BEGIN
	SELECT * INTO c FROM idempotency.idem_claim('scan', k);
	RAISE NOTICE 'first: %, attempt %', c.outcome, c.attempt;
	SELECT * INTO c FROM idempotency.idem_claim('scan', k);
	RAISE NOTICE 'second: %', c.outcome;
END $$;

-- Every answer above was counted once.
SELECT s.claims - c.claims AS claims, s.replays - c.replays AS replays,
       s.conflicts - c.conflicts AS conflicts
FROM idem_stats_counters() s, counted c;
