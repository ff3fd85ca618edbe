--
-- test/fuzz/setup.sql: a database for the fuzzers (scripts/check-fuzz.sh).
--
-- Run as a superuser in a new database: the extension, two login roles, the
-- helper functions that outbox routes may name, and rows of every kind in
-- the extension's tables, made through the extension's own functions (the
-- tables and their columns are left as the extension created them):
--
--   keys              in progress, in progress with a recovery point,
--                     completed (stored responses), expired
--   processed_events  within retention, and past it
--   outbox            pending, leased (1 h), dead, and rows of routed topics
--                     that the background worker publishes
--   outbox_routes     one route of each target
--
-- Roles (cluster-wide, created when missing):
--   idem_fuzz_app   USAGE on the schema, EXECUTE on every function and
--                   SELECT on every table and view of the extension: the
--                   README's app, relay and ops roles in one
--   idem_fuzz_none  nothing (every call should be 42501)
--
DO $$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idem_fuzz_app') THEN
		CREATE ROLE idem_fuzz_app LOGIN;
	END IF;
	IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idem_fuzz_none') THEN
		CREATE ROLE idem_fuzz_none LOGIN;
	END IF;
END
$$;

CREATE EXTENSION idempotency;

GRANT USAGE ON SCHEMA idempotency TO idem_fuzz_app;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency TO idem_fuzz_app;
GRANT SELECT ON ALL TABLES IN SCHEMA idempotency TO idem_fuzz_app;

-- What a function route may name: one that works (and fails on request),
-- a procedure (42809), one of the wrong argument type (42804), an
-- overloaded name, a set-returning one, and one the app may not execute
-- (42501).
CREATE FUNCTION public.fuzz_sink(event idempotency.outbox) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	IF event.payload ? 'fail' THEN
		RAISE EXCEPTION 'fuzz_sink refuses event %', event.id;
	END IF;
END
$$;
CREATE PROCEDURE public.fuzz_proc(event idempotency.outbox)
LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.fuzz_wrong(event integer) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.fuzz_overloaded(event idempotency.outbox) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.fuzz_overloaded(event text) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.fuzz_setof(event idempotency.outbox) RETURNS SETOF integer
LANGUAGE sql AS $$ SELECT 1 $$;
CREATE FUNCTION public.fuzz_private(event idempotency.outbox) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
REVOKE EXECUTE ON FUNCTION public.fuzz_private(idempotency.outbox) FROM PUBLIC;

-- Keys.
SELECT count(idempotency.idem_claim('seed', 'in-progress-' || g, 'fp-' || g, NULL, '1 hour'))
FROM generate_series(1, 20) AS g;
SELECT count(idempotency.idem_checkpoint('seed', 'in-progress-' || g, 'step ' || g))
FROM generate_series(1, 5) AS g;
SELECT count(idempotency.idem_claim('seed', 'done-' || g, NULL, '1 day', '1 hour'))
FROM generate_series(1, 20) AS g;
SELECT count(idempotency.idem_complete('seed', 'done-' || g, 200 + g, '{"n": ' || g || '}',
                                       jsonb_build_object('Location', '/r/' || g), 1))
FROM generate_series(1, 20) AS g;
SELECT count(idempotency.idem_claim('seed', 'expired-' || g, NULL, '1 us', '1 us'))
FROM generate_series(1, 5) AS g;

-- Processed events.
SELECT count(idempotency.idem_mark_processed('seed', 'event-' || g)) FROM generate_series(1, 50) AS g;
SELECT count(idempotency.idem_mark_processed('seed', 'old-' || g, '1 us')) FROM generate_series(1, 5) AS g;

-- Routes: one of each target.
SELECT idempotency.idem_outbox_route('seed-notify', 'notify', 'fuzz_channel');
SELECT idempotency.idem_outbox_route('seed-logical', 'logical', 'fuzz.prefix');
SELECT idempotency.idem_outbox_route('seed-function', 'function', 'public.fuzz_sink');
SELECT idempotency.idem_outbox_route('seed-none', 'none');

-- Outbox rows: pending (no route), leased, dead, and rows for the worker
-- (some of which fuzz_sink refuses, so they back off and are retried).
SELECT count(idempotency.idem_outbox_enqueue('seed-pending', jsonb_build_object('n', g), 'k' || g % 3))
FROM generate_series(1, 30) AS g;
SELECT count(idempotency.idem_outbox_enqueue('seed-leased', jsonb_build_object('n', g),
                                             CASE WHEN g <= 3 THEN 'k' || g END, '{"h": "v"}'))
FROM generate_series(1, 10) AS g;
SELECT count(*) FROM idempotency.idem_outbox_fetch('seed-leased', 100, '1 hour');
SELECT count(idempotency.idem_outbox_enqueue('seed-dead', jsonb_build_object('n', g),
                                             CASE WHEN g <= 2 THEN 'k' || g END))
FROM generate_series(1, 6) AS g;
SET idempotency.outbox_max_attempts = 1;
SELECT count(idempotency.idem_outbox_nack(id, 'seeded failure'))
FROM idempotency.idem_outbox_fetch('seed-dead', 100, '1 hour');
RESET idempotency.outbox_max_attempts;
SELECT count(idempotency.idem_outbox_enqueue(t, CASE WHEN g % 4 = 0 THEN '{"fail": true}' ELSE '{}' END::jsonb,
                                             'k' || g % 2))
FROM unnest(ARRAY['seed-notify', 'seed-logical', 'seed-function', 'seed-none']) AS t,
     generate_series(1, 8) AS g;

SELECT state, count(*) FROM idempotency.outbox GROUP BY state ORDER BY state;
