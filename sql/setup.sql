--
-- setup: the extension, installed the way users install it.
--
CREATE EXTENSION idempotency;

-- every object lives in the schema idempotency, which is not relocatable
SELECT extname, extnamespace::regnamespace AS schema, extrelocatable
FROM pg_extension WHERE extname = 'idempotency';

-- the library is preloaded: the settings exist before the first call
SHOW idempotency.key_ttl;
SHOW idempotency.lease;
SHOW idempotency.release_statuses;

-- every primary key leads with the column a Citus cluster would distribute
-- the table by (see doc/integrations/citus.md)
SELECT c.relname AS "table", a.attname AS first_primary_key_column
FROM pg_index i
JOIN pg_class c ON c.oid = i.indrelid
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
WHERE i.indisprimary AND c.relnamespace = 'idempotency'::regnamespace
ORDER BY 1;

-- without Citus, idem_distribute() refuses and says what it needs
SELECT idempotency.idem_distribute();
-- nor does idem_cluster_counters(): one server's counters are in the view
SELECT * FROM idempotency.idem_cluster_counters();
