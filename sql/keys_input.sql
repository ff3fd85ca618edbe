--
-- keys_input: bad arguments get an ERROR with a class-22 SQLSTATE, and
-- nothing is written.
--
SET search_path = idempotency, public;

-- NULL key or scope: 22004
SELECT idem_claim(NULL, 'k');
\echo :SQLSTATE
SELECT idem_claim('s', NULL);
\echo :SQLSTATE
SELECT idem_complete(NULL, 'k', 200);
\echo :SQLSTATE
SELECT idem_release('s', NULL);
\echo :SQLSTATE
SELECT idem_checkpoint(NULL, NULL, 'x');
\echo :SQLSTATE

-- An empty key: 22023 (an empty scope is allowed)
SELECT idem_claim('s', '');
\echo :SQLSTATE
SELECT idem_complete('s', '', 200);
\echo :SQLSTATE

-- Key and scope are limited to 255 bytes, not characters: 22001.
-- 'é' is two bytes in UTF-8, so 128 of them (256 bytes) are too many,
-- while 127 of them (254 bytes) are fine.
SELECT octet_length(repeat('é', 128)) AS bytes, length(repeat('é', 128)) AS characters;
SELECT idem_claim('s', repeat('é', 128));
\echo :SQLSTATE
SELECT idem_claim(repeat('é', 128), 'k');
\echo :SQLSTATE
SELECT idem_claim('s', repeat('x', 256));
\echo :SQLSTATE
SELECT outcome FROM idem_claim('s', repeat('é', 127));
SELECT outcome FROM idem_claim(repeat('x', 255), repeat('y', 255));
SELECT idem_complete(repeat('x', 256), 'k', 200);
\echo :SQLSTATE

-- Nothing was written by the refused calls.
SELECT count(*) AS rows_in_scope_s FROM keys WHERE scope = 's';
SELECT count(*) AS long_rows FROM keys WHERE octet_length(key) > 255 OR octet_length(scope) > 255;

-- Inside a transaction, a refused call aborts the transaction as any ERROR
-- does; nothing of it survives.
BEGIN;
SELECT outcome FROM idem_claim('s', 'in-txn');
SELECT idem_claim('s', NULL);
ROLLBACK;
SELECT count(*) AS in_txn_rows FROM keys WHERE key = 'in-txn';

-- A read-only transaction cannot claim: 25006
BEGIN READ ONLY;
SELECT idem_claim('s', 'read-only');
\echo :SQLSTATE
ROLLBACK;

-- The extension's tables are guarded: DDL that would change what the
-- functions rely on is refused (sql/ddl_guard), and a table altered where
-- no guard ran is refused by the functions (t/010_altered_tables.pl).
-- a plain column index is maintained like the primary key
BEGIN;
CREATE INDEX keys_by_status ON keys (status_code);
SELECT outcome FROM idem_claim('s', 'indexed');
SELECT idem_complete('s', 'indexed', 200, 'ok');
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT key FROM keys WHERE status_code = 200 AND scope = 's';
SELECT key FROM keys WHERE status_code = 200 AND scope = 's';
ROLLBACK;
-- a claim after TRUNCATE in the same transaction finds the table anew
BEGIN;
SELECT outcome FROM idem_claim('s', 'before-truncate');
TRUNCATE keys;
SELECT outcome FROM idem_claim('s', 'after-truncate');
SELECT idem_complete('s', 'after-truncate', 200, 'ok');
ROLLBACK;
-- and so is a partial one: a row gets an entry only once it matches
BEGIN;
CREATE INDEX keys_completed ON keys (completed_at) WHERE status_code = 201;
SELECT outcome FROM idem_claim('s', 'partial-a');
SELECT idem_complete('s', 'partial-a', 201, 'created');
SELECT outcome FROM idem_claim('s', 'partial-b');
SELECT idem_complete('s', 'partial-b', 200, 'ok');
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT key FROM keys WHERE status_code = 201 AND completed_at IS NOT NULL;
SELECT key FROM keys WHERE status_code = 201 AND completed_at IS NOT NULL AND key LIKE 'partial-%';
ROLLBACK;
