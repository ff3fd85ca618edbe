--
-- keys_security: least privilege, and what pg_dump keeps.
--
CREATE ROLE idem_nobody;
CREATE ROLE idem_app;

-- PUBLIC (here, a role with no grants) can use nothing in the schema.
SELECT has_schema_privilege('idem_nobody', 'idempotency', 'USAGE') AS schema_usage;
SELECT c.relname,
       has_table_privilege('idem_nobody', c.oid, 'SELECT') AS can_select,
       has_table_privilege('idem_nobody', c.oid, 'INSERT') AS can_insert,
       has_table_privilege('idem_nobody', c.oid, 'UPDATE') AS can_update,
       has_table_privilege('idem_nobody', c.oid, 'DELETE') AS can_delete
FROM pg_class c
WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'v', 'S')
ORDER BY c.relname;
SELECT p.oid::regprocedure AS function
FROM pg_proc p
WHERE p.pronamespace = 'idempotency'::regnamespace
  AND has_function_privilege('idem_nobody', p.oid, 'EXECUTE');

-- No function is SECURITY DEFINER without a pinned search_path.
SELECT p.oid::regprocedure AS definer_without_search_path
FROM pg_proc p
WHERE p.pronamespace = 'idempotency'::regnamespace AND p.prosecdef
  AND NOT coalesce(p.proconfig::text[] && ARRAY['search_path=pg_catalog, pg_temp'], false);

-- The grants the README gives an application role.
GRANT USAGE ON SCHEMA idempotency TO idem_app;
GRANT EXECUTE ON FUNCTION
    idempotency.idem_claim(text, text, text, interval, interval, interval),
    idempotency.idem_complete(text, text, integer, text, jsonb, integer),
    idempotency.idem_release(text, text, integer),
    idempotency.idem_checkpoint(text, text, text, integer),
    idempotency.idem_extend_lease(text, text, integer, interval),
    idempotency.idem_fingerprint(jsonb),
    idempotency.idem_fingerprint(text),
    idempotency.idem_fingerprint(bytea)
  TO idem_app;

-- With them the role uses the functions, but still cannot touch the table.
SET ROLE idem_app;
SELECT outcome FROM idempotency.idem_claim('app', 'k', idempotency.idem_fingerprint('{"a": 1}'::jsonb));
SELECT idempotency.idem_complete('app', 'k', 200, 'ok');
SELECT outcome, body FROM idempotency.idem_claim('app', 'k');
SELECT * FROM idempotency.keys;
\echo :SQLSTATE
DELETE FROM idempotency.keys;
\echo :SQLSTATE
RESET ROLE;

-- Without them, nothing.
SET ROLE idem_nobody;
SELECT idempotency.idem_claim('nobody', 'k');
\echo :SQLSTATE
RESET ROLE;

-- pg_dump keeps the keys: the table is registered as configuration data.
SELECT unnest(extconfig)::regclass AS dumped_table
FROM pg_extension WHERE extname = 'idempotency';

DROP OWNED BY idem_app;
DROP ROLE idem_app;
DROP ROLE idem_nobody;
