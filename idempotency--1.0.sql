/* idempotency--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * Everything lives in the schema idempotency, which CREATE EXTENSION creates
 * (the control file fixes it).  PUBLIC gets no privilege on anything here:
 * new tables grant nothing to PUBLIC, and each function's default EXECUTE
 * for PUBLIC is revoked at the end of this script.  The README lists the
 * GRANT statements that let an application role use the extension.
 *
 * The C functions read and write these tables directly (heap and index
 * access, no executor), so their column order is part of the C code: see
 * src/tables.c, which checks the shape of each table before touching it.
 */

/* ---------------------------------------------------------------------
 * 1. Idempotency keys
 * ---------------------------------------------------------------------
 */

/*
 * One row per (scope, key).  A row is "in progress" while status_code is
 * NULL and "completed" once a response is stored; there is no separate state
 * column to keep in step.  Key and scope use the "C" collation: they are
 * opaque identifiers, compared byte for byte.
 *
 * fillfactor leaves room on each page so that idem_complete's update of a
 * row claimed moments earlier is a HOT update (no indexed column changes).
 */
CREATE TABLE idempotency.keys (
	scope			 text COLLATE "C" NOT NULL,
	key				 text COLLATE "C" NOT NULL,
	fingerprint		 text,
	attempt			 integer NOT NULL,
	recovery_point	 text,
	lease_expires_at timestamptz,
	status_code		 integer CHECK (status_code BETWEEN 100 AND 599),
	body			 text,
	headers			 jsonb,
	ttl				 interval NOT NULL,
	created_at		 timestamptz NOT NULL,
	completed_at	 timestamptz,
	expires_at		 timestamptz NOT NULL,
	PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);

COMMENT ON TABLE idempotency.keys IS
	'idempotency keys: one row per (scope, key), in progress while status_code is NULL, completed once a response is stored';
COMMENT ON COLUMN idempotency.keys.scope IS 'caller''s namespace, typically {user}:{endpoint}';
COMMENT ON COLUMN idempotency.keys.key IS 'the client''s Idempotency-Key';
COMMENT ON COLUMN idempotency.keys.fingerprint IS 'hash of the request (idem_fingerprint); NULL matches anything';
COMMENT ON COLUMN idempotency.keys.attempt IS 'fencing token: 1 for the first claim, +1 for each takeover of a claim whose lease ran out';
COMMENT ON COLUMN idempotency.keys.recovery_point IS 'how far the last attempt got (idem_checkpoint), returned on takeover';
COMMENT ON COLUMN idempotency.keys.lease_expires_at IS 'in progress: when the claim may be taken over; NULL once completed';
COMMENT ON COLUMN idempotency.keys.status_code IS 'stored response status; NULL while in progress';
COMMENT ON COLUMN idempotency.keys.body IS 'stored response body, byte for byte';
COMMENT ON COLUMN idempotency.keys.headers IS 'stored response headers';
COMMENT ON COLUMN idempotency.keys.ttl IS 'how long the completed response is kept, counted from completion';
COMMENT ON COLUMN idempotency.keys.created_at IS 'when the key was first claimed';
COMMENT ON COLUMN idempotency.keys.completed_at IS 'when the response was stored';
COMMENT ON COLUMN idempotency.keys.expires_at IS 'from this instant the row counts as absent and may be purged: completed_at + ttl, or lease_expires_at + ttl while in progress';

SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');

CREATE TYPE idempotency.claim_result AS (
	outcome			text,
	status_code		integer,
	body			text,
	headers			jsonb,
	attempt			integer,
	recovery_point	text,
	created_at		timestamptz
);

COMMENT ON TYPE idempotency.claim_result IS
	'result of idem_claim: outcome is claimed, replay, in_progress or mismatch';

CREATE FUNCTION idempotency.idem_claim(scope text, key text,
									   fingerprint text DEFAULT NULL,
									   ttl interval DEFAULT NULL,
									   lease interval DEFAULT NULL)
RETURNS idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval) IS
	'claim an idempotency key, never blocking: claimed (run the operation), replay (stored response), in_progress (409) or mismatch (422)';

CREATE FUNCTION idempotency.idem_complete(scope text, key text,
										  status_code integer,
										  body text DEFAULT NULL,
										  headers jsonb DEFAULT NULL,
										  attempt integer DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_complete(text, text, integer, text, jsonb, integer) IS
	'store the response of a claimed key (stored), or release the key when the status is transient (released)';

CREATE FUNCTION idempotency.idem_release(scope text, key text,
										 attempt integer DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_release(text, text, integer) IS
	'drop an in-progress claim so that a retry runs the operation from scratch';

CREATE FUNCTION idempotency.idem_checkpoint(scope text, key text,
											recovery_point text,
											attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_checkpoint(text, text, text, integer) IS
	'record how far a multi-step operation got; returned to whoever takes the claim over';

CREATE FUNCTION idempotency.idem_fingerprint(request jsonb)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_jsonb'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(jsonb) IS
	'hex SHA-256 of the canonical text of a jsonb value: key order, duplicate keys and white space do not matter';

CREATE FUNCTION idempotency.idem_fingerprint(request text)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_bytes'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(text) IS
	'hex SHA-256 of the text''s bytes as given';

CREATE FUNCTION idempotency.idem_fingerprint(request bytea)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_bytes'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(bytea) IS
	'hex SHA-256 of the bytes';

/* ---------------------------------------------------------------------
 * Privileges: nothing for PUBLIC.
 * ---------------------------------------------------------------------
 */
REVOKE ALL ON ALL TABLES IN SCHEMA idempotency FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM PUBLIC;
