--
-- keys_release_policy: final answers are stored, transient ones release the
-- key so that a retry runs the operation again.
--
SET search_path = idempotency, public;

-- With the default idempotency.release_statuses (408,425,429,500-599):
-- every status from 100 to 599, claimed then completed, and what a retry gets.
CREATE TEMP TABLE policy AS
SELECT s AS status,
       (SELECT outcome FROM idem_claim('policy', s::text)) AS claimed,
       idem_complete('policy', s::text, s) AS completed,
       (SELECT outcome FROM idem_claim('policy', s::text)) AS retry
FROM generate_series(100, 599) s;

-- stored, and replayed: 1xx, 2xx, 3xx, 4xx but 408, 425, 429
SELECT completed, retry, min(status), max(status), count(*)
FROM policy GROUP BY completed, retry ORDER BY completed, retry;
SELECT array_agg(status ORDER BY status) AS released_below_500
FROM policy WHERE completed = 'released' AND status < 500;

-- A released key is claimable again with attempt 1: the operation runs anew.
SELECT outcome, attempt FROM idem_claim('policy-503', 'k');
SELECT idem_complete('policy-503', 'k', 503, 'try later');
SELECT outcome, attempt FROM idem_claim('policy-503', 'k');

-- A changed idempotency.release_statuses is honoured at once.
SET idempotency.release_statuses = '409, 500-502';
SELECT outcome FROM idem_claim('policy2', '409');
SELECT idem_complete('policy2', '409', 409);
SELECT outcome FROM idem_claim('policy2', '503');
SELECT idem_complete('policy2', '503', 503);
SELECT outcome FROM idem_claim('policy2', '501');
SELECT idem_complete('policy2', '501', 501);
-- an empty list stores everything
SET idempotency.release_statuses = '';
SELECT outcome FROM idem_claim('policy2', '500');
SELECT idem_complete('policy2', '500', 500);
RESET idempotency.release_statuses;
SHOW idempotency.release_statuses;

-- A bad list is rejected with a clear message; the setting keeps its value.
SET idempotency.release_statuses = '500-599,abc';
SET idempotency.release_statuses = '99';
SET idempotency.release_statuses = '600';
SET idempotency.release_statuses = '599-500';
SET idempotency.release_statuses = '500-';
SET idempotency.release_statuses = '500,';
SET idempotency.release_statuses = '500 501';
SET idempotency.release_statuses = '5000';
SHOW idempotency.release_statuses;
-- and a misspelt setting under the reserved prefix is refused
SET idempotency.release_status = '500';
