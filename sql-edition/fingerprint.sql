/*
 * idem_fingerprint: the hex SHA-256 of a request, the same digits as the C
 * edition's (src/keys/fingerprint.c).  For jsonb, of its canonical text,
 * which is jsonb's own output (keys sorted and unique, one space after each
 * colon and comma); for text, of its bytes in the database's encoding (a
 * conversion to the same encoding changes nothing); for bytea, of the bytes.
 * Plain SQL functions: the planner inlines them into the calling query.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_fingerprint(request jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(request::text, pg_catalog.getdatabaseencoding())), 'hex');

CREATE OR REPLACE FUNCTION idempotency.idem_fingerprint(request text)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(request, pg_catalog.getdatabaseencoding())), 'hex');

CREATE OR REPLACE FUNCTION idempotency.idem_fingerprint(request bytea)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.encode(pg_catalog.sha256(request), 'hex');
