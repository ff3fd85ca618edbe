--
-- outbox_routes: where the background worker publishes each topic.  Routes
-- are validated when they are set.
--
SET search_path = idempotency, public;

-- Every topic without a route of its own follows '*'; without any route,
-- rows wait for an external relay (target none).
SELECT count(*) AS routes FROM outbox_routes;

-- notify: NOTIFY on a channel (default idempotency_outbox)
SELECT idem_outbox_route('orders', 'notify', 'orders_events');
SELECT idem_outbox_route('*', 'notify');
-- logical: a logical decoding message with a prefix (default idempotency.outbox)
SELECT idem_outbox_route('payments', 'logical', 'payments.v1');
SELECT idem_outbox_route('audit', 'logical');
-- function: one of yours, taking the row
CREATE FUNCTION public.forward(event idempotency.outbox) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
SELECT idem_outbox_route('forwarded', 'function', 'forward');
SELECT idem_outbox_route('forwarded2', 'function', 'public.forward(idempotency.outbox)');
-- none: an external relay uses idem_outbox_fetch
SELECT idem_outbox_route('relayed', 'none');
-- a function route records who set it: the function runs as that role
SELECT topic, run_as = current_user::regrole AS runs_as_setter
FROM outbox_routes WHERE target = 'function' ORDER BY topic;
-- setting a route again replaces it
SELECT idem_outbox_route('audit', 'logical', 'audit.v2');
SELECT topic, target, destination FROM outbox_routes ORDER BY topic;

-- A target that is not one of the four: 22023
SELECT idem_outbox_route('t', 'kafka');
\echo :SQLSTATE
SELECT idem_outbox_route('t', NULL);
\echo :SQLSTATE
SELECT idem_outbox_route(NULL, 'none');
\echo :SQLSTATE
-- a channel or prefix that is not a valid name: 22023
SELECT idem_outbox_route('t', 'notify', '');
\echo :SQLSTATE
SELECT idem_outbox_route('t', 'notify', repeat('c', 64));
\echo :SQLSTATE
SELECT idem_outbox_route('t', 'logical', 'has space');
\echo :SQLSTATE
SELECT idem_outbox_route('t', 'none', 'somewhere');
\echo :SQLSTATE
-- a function that does not exist: 42883
SELECT idem_outbox_route('t', 'function', 'no_such_function');
\echo :SQLSTATE
SELECT idem_outbox_route('t', 'function', 'public.forward(text)');
\echo :SQLSTATE
SELECT idem_outbox_route('t', 'function', NULL);
\echo :SQLSTATE
-- a function that does not take one outbox row: 42804
CREATE FUNCTION public.two_args(event idempotency.outbox, extra int) RETURNS void
LANGUAGE sql AS $$ SELECT $$;
SELECT idem_outbox_route('t', 'function', 'public.two_args(idempotency.outbox, int)');
\echo :SQLSTATE
CREATE FUNCTION public.takes_text(t text) RETURNS void LANGUAGE sql AS $$ SELECT $$;
SELECT idem_outbox_route('t', 'function', 'public.takes_text(text)');
\echo :SQLSTATE
-- a procedure is not a function: 42809
CREATE PROCEDURE public.a_procedure(event idempotency.outbox) LANGUAGE sql AS $$ SELECT $$;
SELECT idem_outbox_route('t', 'function', 'public.a_procedure');
\echo :SQLSTATE
SELECT count(*) AS route_for_t FROM outbox_routes WHERE topic = 't';

-- The caller must be allowed to execute the function it routes to: 42501
CREATE ROLE idem_route_admin;
GRANT USAGE ON SCHEMA idempotency TO idem_route_admin;
GRANT EXECUTE ON FUNCTION idem_outbox_route(text, text, text) TO idem_route_admin;
REVOKE EXECUTE ON FUNCTION public.forward(idempotency.outbox) FROM PUBLIC;
SET ROLE idem_route_admin;
SELECT idem_outbox_route('t', 'function', 'public.forward');
\echo :SQLSTATE
RESET ROLE;
DROP OWNED BY idem_route_admin;
DROP ROLE idem_route_admin;

DROP FUNCTION public.two_args(idempotency.outbox, int);
DROP FUNCTION public.takes_text(text);
DROP PROCEDURE public.a_procedure(idempotency.outbox);
DELETE FROM outbox_routes;
DROP FUNCTION public.forward(idempotency.outbox);

-- A route row written directly must name its destination too, unless its
-- target is none (23514): the worker could not publish it.
INSERT INTO outbox_routes VALUES ('direct', 'notify', NULL);
\echo :SQLSTATE
INSERT INTO outbox_routes VALUES ('direct', 'function', NULL);
\echo :SQLSTATE
INSERT INTO outbox_routes VALUES ('direct', 'none', NULL);
DELETE FROM outbox_routes;
