--
-- sql_edition_setup: the SQL edition, installed as a managed service's user
-- installs it: psql -f, by a role that is not a superuser and holds only
-- CREATE on the database, on a server without the C edition.  The C
-- edition's tests then run against it (scripts/check-sql-edition.sh).
--
SELECT format('GRANT CREATE ON DATABASE %I TO idem_owner', current_database()) \gexec
\set test_user :USER
\c - idem_owner
-- the installing role may create schemas in this database, and nothing more
SELECT rolsuper, rolcreatedb, rolcreaterole, rolbypassrls FROM pg_roles WHERE rolname = current_user;
\set ECHO none
\o /dev/null
\i @script@
\o
\set ECHO all

-- it owns the schema and everything in it
SELECT DISTINCT pg_get_userbyid(nspowner) AS owner FROM pg_namespace WHERE nspname = 'idempotency'
UNION SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace
UNION SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace;
SELECT obj_description('idempotency'::regnamespace, 'pg_namespace') AS edition;

\c - :test_user
-- no library: nothing preloaded, no C edition offered, no C function
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

-- the settings are not defined (a misspelt name is no error), and unset
-- they have the C edition's defaults, which the functions read when used
SELECT current_setting('idempotency.key_ttl', true) AS key_ttl,
	   current_setting('idempotency.lease', true) AS lease;
SELECT idempotency._duration_setting('idempotency.key_ttl', 's', 86400) AS key_ttl,
	   idempotency._duration_setting('idempotency.lease', 'ms', 60000) AS lease,
	   idempotency._duration_setting('idempotency.event_retention', 's', 1209600) AS event_retention;

-- the outbox's part on a shard of Citus is the C edition's alone: 0A000
\set VERBOSITY default
SELECT idempotency._outbox_on_shard('t', 'ack', '{}', NULL, NULL);
\set VERBOSITY terse
-- the statistics' row counts work; the counters are NULL, as in the C
-- edition without shared_preload_libraries
SELECT keys_in_progress, events, claims, worker_pid FROM idempotency.stats;
SELECT count(*) AS counter_rows FROM idempotency.idem_stats_counters();

-- as in the C edition: without Citus, the Citus functions refuse
SELECT idempotency.idem_distribute();
SELECT * FROM idempotency.idem_cluster_counters();
