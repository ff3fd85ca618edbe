/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

/*
 * A route that publishes somewhere names where.  idem_outbox_route never
 * stored a NULL destination for the notify, logical or function targets,
 * but 1.0's CHECK allowed a row written directly with one, which the worker
 * could not publish.  NOT VALID: a database updated from 1.0 keeps whatever
 * rows it has (the worker counts each of their rows' attempts as failed,
 * with "has no destination", until the route is set again); new rows are
 * checked.
 */
ALTER TABLE idempotency.outbox_routes
	ADD CONSTRAINT outbox_routes_destination_check
	CHECK (target = 'none' OR destination IS NOT NULL) NOT VALID;

/* ---------------------------------------------------------------------
 * Outbox (issue 19, items 2-4): batch enqueue, per-key batched fetch,
 * fenced acknowledgements, and a pull path whose hand-out is a HOT update.
 * ---------------------------------------------------------------------
 */

/*
 * A hand-out changes state, attempts, available_at and last_error.  In 1.0
 * three indexes named state in their predicates, so that every hand-out
 * wrote a new entry into each index (a row went out as a non-HOT update),
 * and a relay's next scan waded through the entries the last one left.
 * From 1.1 the partial indexes are told by published_at, which only
 * publishing sets: leasing, nacking and requeueing change no indexed
 * column, and with the room fillfactor leaves on each page they are HOT
 * updates.  The per-key order index holds rows with a key only: a row
 * without one never waits for another.  The statements name both
 * predicates (state and published_at, which agree on every row), so that
 * the planner uses the indexes of a database at 1.0 and at 1.1 alike.
 */
DROP INDEX idempotency.outbox_ready;
CREATE INDEX outbox_ready ON idempotency.outbox (topic, id)
	WHERE published_at IS NULL;
DROP INDEX idempotency.outbox_key_order;
CREATE INDEX outbox_key_order ON idempotency.outbox (topic, key, id)
	WHERE published_at IS NULL AND key IS NOT NULL;
DROP INDEX idempotency.outbox_published;
CREATE INDEX outbox_published ON idempotency.outbox (published_at)
	WHERE published_at IS NOT NULL;
ALTER TABLE idempotency.outbox SET (fillfactor = 80);

CREATE FUNCTION idempotency.idem_outbox_enqueue_batch(topic text, payloads jsonb[],
													  keys text[] DEFAULT NULL,
													  headers jsonb[] DEFAULT NULL)
RETURNS SETOF bigint
AS 'MODULE_PATHNAME', 'idem_outbox_enqueue_batch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100;

COMMENT ON FUNCTION idempotency.idem_outbox_enqueue_batch(text, jsonb[], text[], jsonb[]) IS
	'enqueue several events of a topic in one call, inside the business transaction: their ids in array order; rows of one key keep the array''s order';

/*
 * idem_outbox_fetch gains per_key.  As for idem_claim, the longer argument
 * list is a new function: the roles that could execute the 1.0 one get
 * EXECUTE on it, and the 1.0 one is dropped, since two overloads would
 * make every existing call ambiguous.
 */
CREATE FUNCTION idempotency.idem_outbox_fetch(topic text, batch integer DEFAULT 100,
											  lease interval DEFAULT '30s',
											  per_key integer DEFAULT 1)
RETURNS SETOF idempotency.outbox
AS 'MODULE_PATHNAME', 'idem_outbox_fetch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100;

COMMENT ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval, integer) IS
	'lease up to batch ready rows of a topic for an external relay, oldest first and gap-safe per key, up to per_key consecutive rows of one key in one hand-out';

REVOKE ALL ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval, integer) FROM PUBLIC;

DO $$
DECLARE
	grantee text;
BEGIN
	FOR grantee IN
		SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
		FROM pg_proc p
		CROSS JOIN LATERAL aclexplode(p.proacl) a
		LEFT JOIN pg_roles r ON r.oid = a.grantee
		WHERE p.oid = 'idempotency.idem_outbox_fetch(text, integer, interval)'::regprocedure
		  AND a.privilege_type = 'EXECUTE'
		  AND a.grantee <> p.proowner
	LOOP
		EXECUTE format('GRANT EXECUTE ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval, integer) TO %s',
					   grantee);
	END LOOP;
END
$$;

DROP FUNCTION idempotency.idem_outbox_fetch(text, integer, interval);

CREATE FUNCTION idempotency.idem_outbox_ack(ids bigint[], attempts integer[])
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_outbox_ack_fenced'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_ack(bigint[], integer[]) IS
	'acknowledge rows still leased under the hand-outs that returned them (attempts as fetched) as published, each together with or after the earlier rows of its key; returns how many were';

CREATE FUNCTION idempotency.idem_outbox_nack(id bigint, error text, attempt integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_outbox_nack_fenced'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_nack(bigint, text, integer) IS
	'report a failed publish of a row still leased under the hand-out that returned it (attempt as fetched); the later rows of that hand-out go back to pending';

REVOKE ALL ON FUNCTION idempotency.idem_outbox_enqueue_batch(text, jsonb[], text[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_outbox_ack(bigint[], integer[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_outbox_nack(bigint, text, integer) FROM PUBLIC;

/* ------------------------- end of issue 19, items 2-4 ------------------------- */
