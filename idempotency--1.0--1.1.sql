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
 * BEGIN wait (issue 18, part A): idem_claim gains wait interval DEFAULT
 * NULL.  A minimal edit, for the integrator to reconcile with the lease
 * helper's version of idem_claim (which also changes claim_result): the
 * five-argument function is dropped and the six-argument one created,
 * with its comment, no EXECUTE for PUBLIC (as the 1.0 script leaves every
 * function), and EXECUTE granted again to every role that had it on the
 * five-argument one.
 * ---------------------------------------------------------------------
 */
DO $wait$
DECLARE
	old_acl aclitem[];
	grant_ record;
BEGIN
	SELECT proacl INTO old_acl FROM pg_catalog.pg_proc
	WHERE oid = 'idempotency.idem_claim(text, text, text, interval, interval)'::pg_catalog.regprocedure;

	DROP FUNCTION idempotency.idem_claim(text, text, text, interval, interval);

	CREATE FUNCTION idempotency.idem_claim(scope text, key text,
										   fingerprint text DEFAULT NULL,
										   ttl interval DEFAULT NULL,
										   lease interval DEFAULT NULL,
										   wait interval DEFAULT NULL)
	RETURNS idempotency.claim_result
	AS 'MODULE_PATHNAME', 'idem_claim'
	LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

	COMMENT ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) IS
		'claim an idempotency key: claimed (run the operation), replay (stored response), in_progress (409) or mismatch (422); never blocks, unless wait is given: then waits up to that long for a request in flight with the same key';

	REVOKE ALL ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) FROM PUBLIC;
	FOR grant_ IN
		SELECT a.grantee, a.is_grantable
		FROM pg_catalog.aclexplode(old_acl) AS a
		JOIN pg_catalog.pg_proc p
		  ON p.oid = 'idempotency.idem_claim(text, text, text, interval, interval, interval)'::pg_catalog.regprocedure
		WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
	LOOP
		EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) TO %s%s',
								  CASE WHEN grant_.grantee = 0 THEN 'PUBLIC'
									   ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(grant_.grantee)) END,
								  CASE WHEN grant_.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
	END LOOP;
END
$wait$;
/* END wait (issue 18, part A) */
