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

-- every primary key holds the column a Citus cluster would distribute the
-- table by (see doc/integrations/citus.md), first but for the outbox's,
-- which finds a row by id
SELECT c.relname AS "table",
       string_agg(a.attname, ', ' ORDER BY k.n) AS primary_key_columns
FROM pg_index i
JOIN pg_class c ON c.oid = i.indrelid
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k (attnum, n)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indisprimary AND c.relnamespace = 'idempotency'::regnamespace
GROUP BY 1 ORDER BY 1;

-- without Citus, idem_distribute() refuses and says what it needs
SELECT idempotency.idem_distribute();
-- nor does idem_cluster_counters(): one server's counters are in the view
SELECT * FROM idempotency.idem_cluster_counters();
