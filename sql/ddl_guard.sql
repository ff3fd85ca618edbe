--
-- ddl_guard: on a server that preloads the library, DDL that would break
-- what the functions rely on is refused when it is run (the functions write
-- the tables without the executor, see doc/internals.md), and DDL the
-- direct path honours is allowed and leaves every function working.
--
SET search_path = idempotency, public;

-- The refusal names the table, what the change would break, and what is
-- allowed instead.
\set VERBOSITY default
ALTER TABLE idempotency.keys ADD CHECK (attempt < 5);
\echo :SQLSTATE

-- One statement per kind of change: each is refused with 0A000, and none
-- leaves anything behind.
CREATE TABLE other (scope text COLLATE "C", key text COLLATE "C", id bigint);
CREATE TABLE parent (LIKE idempotency.keys) PARTITION BY LIST (scope);
CREATE FUNCTION pg_temp.outcome(ddl text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	detail text;
BEGIN
	EXECUTE ddl;
	RETURN 'allowed';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
	RETURN SQLSTATE || ' ' || coalesce(nullif(detail, ''), SQLERRM);
END $$;
SELECT ddl, pg_temp.outcome(ddl) FROM (VALUES
	('ALTER TABLE idempotency.keys ALTER fingerprint SET NOT NULL'),
	('ALTER TABLE idempotency.keys ALTER attempt DROP NOT NULL'),
	('ALTER TABLE idempotency.keys ALTER body TYPE varchar'),
	('ALTER TABLE idempotency.keys ADD COLUMN note text'),
	('ALTER TABLE idempotency.outbox DROP COLUMN payload'),
	('ALTER TABLE idempotency.keys DROP CONSTRAINT keys_status_code_check'),
	('ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey, ADD PRIMARY KEY (key, scope)'),
	('ALTER TABLE idempotency.processed_events ENABLE ROW LEVEL SECURITY'),
	('ALTER TABLE idempotency.processed_events FORCE ROW LEVEL SECURITY'),
	('CREATE POLICY p ON idempotency.keys USING (true)'),
	('CREATE TRIGGER t BEFORE INSERT ON idempotency.outbox FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()'),
	('CREATE RULE r AS ON INSERT TO idempotency.keys DO ALSO NOTIFY k'),
	('CREATE TABLE child (s text COLLATE "C", k text COLLATE "C", FOREIGN KEY (s, k) REFERENCES idempotency.keys)'),
	('CREATE TABLE child (s text COLLATE "C" REFERENCES idempotency.outbox_routes, e text REFERENCES idempotency.processed_events)'),
	('ALTER TABLE other ADD FOREIGN KEY (scope, key) REFERENCES idempotency.keys'),
	('ALTER TABLE other ADD COLUMN k2 text REFERENCES idempotency.keys'),
	('CREATE TABLE child () INHERITS (idempotency.keys)'),
	('ALTER TABLE parent ATTACH PARTITION idempotency.keys FOR VALUES IN (''s'')'),
	('CREATE UNIQUE INDEX ON idempotency.keys (key)'),
	('CREATE INDEX ON idempotency.keys (lower(key))'),
	('ALTER TABLE idempotency.keys RENAME TO keys2'),
	('ALTER TABLE idempotency.keys RENAME COLUMN body TO content'),
	('ALTER TABLE idempotency.keys SET SCHEMA public'),
	('ALTER TABLE idempotency.keys SET ACCESS METHOD heap'),
	('ALTER TABLE idempotency.keys DISABLE TRIGGER ALL'),
	('ALTER FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) PARALLEL SAFE'),
	('ALTER FUNCTION idempotency.idem_complete(text, text, integer, text, jsonb, integer) SECURITY DEFINER')
) AS refused(ddl);
SELECT count(*) AS constraints_left_behind FROM pg_constraint
WHERE conrelid IN ('idempotency.keys'::regclass, 'other'::regclass)
  AND conname NOT IN ('keys_pkey', 'keys_status_code_check')
  AND contype <> 'n';
SELECT count(*) AS tables_left_behind FROM pg_class WHERE relname IN ('child', 'keys2');

-- What the direct path honours is allowed.
SELECT ddl, pg_temp.outcome(ddl) FROM (VALUES
	('ALTER TABLE idempotency.keys SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05)'),
	('ALTER TABLE idempotency.keys RESET (autovacuum_vacuum_scale_factor)'),
	('ALTER TABLE idempotency.keys ALTER body SET STATISTICS 500'),
	('ALTER TABLE idempotency.keys ALTER body SET STORAGE EXTERNAL'),
	('ALTER TABLE idempotency.processed_events SET UNLOGGED'),
	('ALTER TABLE idempotency.processed_events SET LOGGED'),
	('ALTER TABLE idempotency.keys CLUSTER ON keys_pkey'),
	('ALTER TABLE idempotency.keys REPLICA IDENTITY FULL'),
	('CREATE INDEX keys_by_creation ON idempotency.keys (created_at) WHERE status_code IS NULL'),
	('CREATE INDEX events_by_id ON idempotency.processed_events (event_id)'),
	('ALTER FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) COST 10'),
	('ALTER TABLE other ADD CHECK (id > 0)')
) AS allowed(ddl);

-- ... and so are maintenance commands.
VACUUM idempotency.keys;
ANALYZE idempotency.keys;
REINDEX TABLE idempotency.keys;
CLUSTER idempotency.keys;
TRUNCATE idempotency.processed_events;

-- After all of them, every function works, and the indexes of the
-- operator's own are maintained: a row the functions wrote is found through
-- them.
SELECT outcome FROM idem_claim('guard', 'after-ddl');
SELECT idem_complete('guard', 'after-ddl', 200, 'done');
SELECT outcome, body FROM idem_claim('guard', 'after-ddl');
SELECT idem_mark_processed('guard', 'evt-1') AS first, idem_mark_processed('guard', 'evt-1') AS again;
SET enable_seqscan = off;
SET enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT event_id FROM idempotency.processed_events WHERE event_id = 'evt-1';
SELECT event_id FROM idempotency.processed_events WHERE event_id = 'evt-1';
SELECT outcome FROM idem_claim('guard', 'in-progress');
SELECT key FROM idempotency.keys WHERE status_code IS NULL AND created_at <= now() AND scope = 'guard';
RESET enable_seqscan;
RESET enable_bitmapscan;

-- The replica identity is honoured as SQL honours it: with the table in a
-- publication and no replica identity, an update is refused with 55000.
SET client_min_messages = error;  -- (without wal_level = logical, a warning)
CREATE PUBLICATION guard_pub FOR TABLE idempotency.keys;
RESET client_min_messages;
ALTER TABLE idempotency.keys REPLICA IDENTITY NOTHING;
SELECT outcome FROM idem_claim('guard', 'published');
SELECT idem_complete('guard', 'published', 200, 'done');
\echo :SQLSTATE
UPDATE idempotency.keys SET body = 'x' WHERE key = 'published';
\echo :SQLSTATE
ALTER TABLE idempotency.keys REPLICA IDENTITY DEFAULT;
SELECT idem_complete('guard', 'published', 200, 'done');
DROP PUBLICATION guard_pub;

-- Restore what this file changed.
ALTER TABLE idempotency.keys SET (fillfactor = 80);
ALTER TABLE idempotency.keys ALTER body SET STATISTICS -1;
ALTER TABLE idempotency.keys ALTER body SET STORAGE EXTENDED;
ALTER TABLE idempotency.keys SET WITHOUT CLUSTER;
DROP INDEX idempotency.keys_by_creation, idempotency.events_by_id;
ALTER FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) COST 1;
DELETE FROM idempotency.keys WHERE scope = 'guard';
DELETE FROM idempotency.processed_events WHERE consumer = 'guard';
DROP TABLE other, parent;
