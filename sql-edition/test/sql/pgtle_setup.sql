--
-- pgtle_setup: the SQL edition installed as on Amazon RDS, Aurora or
-- Supabase: registered with pg_tle (dist/idempotency-pgtle--<version>.sql)
-- by a role that holds pgtle_admin and CREATE on the database, not
-- superuser, then created by it with CREATE EXTENSION, on a server that
-- preloads pg_tle only.  The C edition's tests then run against it
-- (scripts/check-sql-edition.sh, VIA=pgtle).
--
SELECT format('GRANT CREATE ON DATABASE %I TO idem_owner', current_database()) \gexec
CREATE EXTENSION pg_tle;
\set test_user :USER
\c - idem_owner
SELECT rolsuper, rolcreatedb, rolcreaterole, rolbypassrls,
	   pg_has_role('pgtle_admin', 'MEMBER') AS pgtle_admin
FROM pg_roles WHERE rolname = current_user;
-- registered in this database: nothing created yet
\set ECHO none
\o /dev/null
\i @pgtle_script@
\o
\set ECHO all
SELECT name, default_version, superuser, relocatable, schema, requires
FROM pgtle.available_extensions() WHERE name = 'idempotency';
SELECT count(*) AS schema_created FROM pg_namespace WHERE nspname = 'idempotency';
CREATE EXTENSION idempotency;

-- an extension of the installing role, in schema idempotency, owning
-- everything in it; its tables are configuration tables (pg_dump dumps
-- their rows), as the C edition's are
SELECT extname, extversion, extnamespace::regnamespace AS schema, extowner::regrole AS owner,
	   extrelocatable, (SELECT array_agg(c::regclass::text ORDER BY c::regclass::text) FROM unnest(extconfig) AS c) AS config_tables
FROM pg_extension WHERE extname = 'idempotency';
SELECT DISTINCT pg_get_userbyid(nspowner) AS owner FROM pg_namespace WHERE nspname = 'idempotency'
UNION SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace
UNION SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace;
SELECT obj_description('idempotency'::regnamespace, 'pg_namespace') AS edition;
-- every object of the schema is the extension's (a composite type through
-- its pg_type row, checked below)
SELECT c.relname AS not_a_member FROM pg_class c
WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind IN ('r', 'v', 'S')
	AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
					AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e');
SELECT t.typname AS type_not_a_member FROM pg_type t
WHERE t.typnamespace = 'idempotency'::regnamespace AND t.typtype = 'c'
	AND t.typrelid IN (SELECT oid FROM pg_class WHERE relkind = 'c')
	AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_type'::regclass AND d.objid = t.oid
					AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e');
SELECT count(*) AS functions_not_members FROM pg_proc p
WHERE p.pronamespace = 'idempotency'::regnamespace
	AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
					AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e');

\c - :test_user
-- no library but pg_tle: no C edition offered, no C function of ours
SHOW shared_preload_libraries;
SELECT count(*) AS c_edition_available FROM pg_available_extensions WHERE name = 'idempotency';
SELECT l.lanname, count(*) FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
WHERE p.pronamespace = 'idempotency'::regnamespace GROUP BY 1 ORDER BY 1;

-- every SECURITY DEFINER function pins its search_path: with a SET
-- clause, or (idem_outbox_route, which resolves a function's name with the
-- caller's search_path) in the first statement of its declarations
SELECT p.oid::regprocedure AS definer_without_search_path
FROM pg_proc p
WHERE p.pronamespace = 'idempotency'::regnamespace AND p.prosecdef
	AND NOT coalesce(p.proconfig @> '{"search_path=pg_catalog, pg_temp"}', false)
	AND NOT (p.proconfig IS NULL AND p.prosrc ~ '^\s*#variable_conflict use_column\s+DECLARE\s+caller_path pg_catalog\.text := pg_catalog\.current_setting\(''search_path''\);\s+pinned_path pg_catalog\.text := pg_catalog\.set_config\(''search_path'', ''pg_catalog, pg_temp'', true\);');

-- the functions work in the extension as in the plain script
SELECT outcome, attempt FROM idempotency.idem_claim('pgtle', 'k1');
SELECT idempotency.idem_complete('pgtle', 'k1', 201, 'created');
SELECT outcome, status_code, body FROM idempotency.idem_claim('pgtle', 'k1');
SELECT idempotency.idem_mark_processed('pgtle', 'e1'), idempotency.idem_is_processed('pgtle', 'e1');
SELECT purged_keys, purged_outbox FROM idempotency.idem_run_maintenance();
SELECT idempotency.idem_outbox_enqueue('pgtle', '{}', 'k') AS outbox_id \gset
SELECT id = :outbox_id AS fetched FROM idempotency.idem_outbox_fetch('pgtle');
SELECT idempotency.idem_outbox_ack(ARRAY[:outbox_id]::bigint[]) AS acknowledged;
-- (the outbox's tests that follow count ids from 1)
SELECT setval('idempotency.outbox_id_seq', 1, false) IS NOT NULL AS sequence_reset;
\set VERBOSITY terse
SELECT idempotency._outbox_on_shard('t', 'ack', '{}', NULL, NULL);
DELETE FROM idempotency.keys WHERE scope = 'pgtle';
DELETE FROM idempotency.processed_events WHERE consumer = 'pgtle';
\set VERBOSITY default
