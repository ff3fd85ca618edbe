# What a superuser can do to the extension's tables on a server that does
# not preload the library (so no utility hook refuses the DDL): every change
# the direct path could not honour makes the functions refuse the table with
# 55000, a detail naming the change and a hint that undoes it; running the
# hint's statement makes them work again.  Never a crash, a spin, or a rule
# silently skipped.  Also: a call forced into a parallel worker, a takeover
# past the largest attempt number, and a table Citus says it distributed.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('altered');
$node->init;
$node->append_conf('postgresql.conf', "jit = off\n");
$node->start;
$node->safe_psql('postgres', q{
	SET client_min_messages = error;
	CREATE EXTENSION idempotency;
	SELECT idempotency.idem_claim('s', 'held', 'fp');
	SELECT idempotency.idem_claim('s', 'done', 'fp');
	SELECT idempotency.idem_complete('s', 'done', 200, 'stored body');
	SELECT idempotency.idem_outbox_enqueue('t', '{"n": 1}', 'k');
});

# Every call the direct path makes: a claim (insert), a replay (probe), a
# completion (update), a release (delete), a mark, an enqueue, a fetch.
my $every_call = q{
	SELECT idempotency.idem_claim('s', 'new' || txid_current());
	SELECT idempotency.idem_claim('s', 'done');
	SELECT idempotency.idem_complete('s', 'held', 201);
	SELECT idempotency.idem_claim('s', 'released');
	SELECT idempotency.idem_release('s', 'released');
	SELECT idempotency.idem_mark_processed('c', 'e' || txid_current());
	SELECT idempotency.idem_outbox_enqueue('t', '{}');
	SELECT count(*) FROM idempotency.idem_outbox_fetch('t', 10, '1 s');
	SELECT count(*) FROM idempotency.idem_run_maintenance();
};

sub works
{
	my ($what) = @_;
	my ($ret, $out, $err) = $node->psql('postgres', "BEGIN; $every_call ROLLBACK;");
	is($ret, 0, "$what: every function works") or diag($err);
}

# A table altered by $ddl: the first function that opens it refuses it, with
# 55000, a detail matching $detail and a hint giving the statement that
# undoes it; that statement (or $undo, where the hint can only describe it)
# makes every function work again.
sub refused_until_undone
{
	my ($ddl, $call, $detail, $undo) = @_;
	$node->safe_psql('postgres', $ddl);
	my ($ret, $out, $err) = $node->psql('postgres',
		"\\set VERBOSITY verbose\n$call");
	like($err, qr/ERROR:  55000: idempotency does not support this change to table/,
		"$ddl: refused with 55000");
	like($err, qr/DETAIL:  $detail/, "... saying what is wrong");
	if (!defined $undo)
	{
		($undo) = $err =~ /HINT:  Undo it with (.*)\.\n/;
		ok(defined $undo, '... and how to undo it') or return;
	}
	$node->safe_psql('postgres', $undo);
	works("after $undo");
}

works('as created');

refused_until_undone('ALTER TABLE idempotency.keys ALTER fingerprint SET NOT NULL',
	"SELECT idempotency.idem_claim('s', 'x', 'fp')",
	'Column "fingerprint" was made NOT NULL, which the extension would not enforce');
refused_until_undone('ALTER TABLE idempotency.outbox ALTER key SET NOT NULL',
	"SELECT idempotency.idem_outbox_enqueue('t', '{}', 'k')",
	'Column "key" was made NOT NULL');
refused_until_undone('ALTER TABLE idempotency.keys ALTER attempt DROP NOT NULL',
	"SELECT idempotency.idem_claim('s', 'x')",
	'Column "attempt" is no longer NOT NULL');
refused_until_undone('ALTER TABLE idempotency.processed_events ADD CONSTRAINT short CHECK (length(event_id) < 3)',
	"SELECT idempotency.idem_mark_processed('c', 'long event id')",
	'It has constraint "short", which the extension would not enforce');
refused_until_undone('ALTER TABLE idempotency.keys ALTER scope TYPE text COLLATE "POSIX"',
	"SELECT idempotency.idem_claim('s', 'done')",
	'Column "scope" has collation "POSIX", not "C"');
refused_until_undone(
	'CREATE TABLE orders (scope text COLLATE "C", key text COLLATE "C", FOREIGN KEY (scope, key) REFERENCES idempotency.keys)',
	"SELECT idempotency.idem_release('s', 'held')",
	'Constraint "orders_scope_key_fkey" of table public.orders works by triggers on it');
$node->safe_psql('postgres', 'DROP TABLE orders');
refused_until_undone(q{
	CREATE TABLE audit (k text);
	CREATE FUNCTION audit_it() RETURNS trigger LANGUAGE plpgsql AS
		'BEGIN INSERT INTO audit VALUES (NEW.key); RETURN NEW; END';
	CREATE TRIGGER audited AFTER INSERT ON idempotency.keys FOR EACH ROW EXECUTE FUNCTION audit_it()},
	"SELECT idempotency.idem_claim('s', 'x')",
	'It has trigger "audited", which the extension\'s writes would not fire');
is($node->safe_psql('postgres', 'SELECT count(*) FROM audit'), '0',
	'... and no row was written past the trigger');
refused_until_undone(q{
	CREATE POLICY only_s ON idempotency.keys USING (scope = 's');
	ALTER TABLE idempotency.keys ENABLE ROW LEVEL SECURITY;
	ALTER TABLE idempotency.keys FORCE ROW LEVEL SECURITY},
	"SELECT idempotency.idem_claim('other', 'x')",
	'Row-level security is enabled on it');
$node->safe_psql('postgres', 'DROP POLICY only_s ON idempotency.keys');
refused_until_undone('CREATE RULE no_delete AS ON DELETE TO idempotency.keys DO INSTEAD NOTHING',
	"SELECT idempotency.idem_release('s', 'held')",
	'It has rules', 'DROP RULE no_delete ON idempotency.keys');
refused_until_undone('CREATE TABLE more_keys () INHERITS (idempotency.keys)',
	"SELECT idempotency.idem_claim('s', 'x')",
	'Table public.more_keys inherits from it');
$node->safe_psql('postgres', 'DROP TABLE more_keys');
refused_until_undone(q{
	CREATE TABLE all_keys (LIKE idempotency.keys) PARTITION BY LIST (scope);
	ALTER TABLE all_keys ATTACH PARTITION idempotency.keys FOR VALUES IN ('s')},
	"SELECT idempotency.idem_claim('s', 'x')",
	'It is a partition of another table');
$node->safe_psql('postgres', 'DROP TABLE all_keys');

# Indexes the direct path cannot maintain: refused by name when the first
# write opens them (0A000).
for my $index ('CREATE INDEX keys_lower_key ON idempotency.keys (lower(key))',
	'CREATE UNIQUE INDEX keys_unique_attempt ON idempotency.keys (scope, key, attempt)')
{
	$node->safe_psql('postgres', $index);
	my ($ret, $out, $err) = $node->psql('postgres',
		"\\set VERBOSITY verbose\nSELECT idempotency.idem_claim('s', 'indexed')");
	like($err, qr/ERROR:  0A000: index "keys_\w+" on table "idempotency.keys" is not supported/,
		"$index: refused at the first write");
	$node->safe_psql('postgres', 'DROP INDEX IF EXISTS idempotency.keys_lower_key, idempotency.keys_unique_attempt');
}

# The primary key replaced: an existing key's claim used to spin until
# statement_timeout, a completion to answer "not claimed".
$node->safe_psql('postgres', 'SET statement_timeout = 0');
for my $pkey ('(key, scope)', '(scope, key) INCLUDE (attempt)', '(scope, key, attempt)')
{
	refused_until_undone(
		"ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey, ADD PRIMARY KEY $pkey",
		"SET statement_timeout = '5s'; SELECT idempotency.idem_claim('s', 'done')",
		'Its primary key "keys_pkey" is not PRIMARY KEY \(scope, key\)');
}
refused_until_undone(q{
	ALTER TABLE idempotency.processed_events DROP CONSTRAINT processed_events_pkey,
		ADD PRIMARY KEY (consumer, event_id) DEFERRABLE},
	"SELECT idempotency.idem_mark_processed('c', 'x')",
	'It has no primary key, or a deferrable one|Its primary key "processed_events_pkey" is not PRIMARY KEY \(consumer, event_id\), not deferrable');

# A dropped column used to crash idem_outbox_fetch (rows without it under a
# result type with it); it cannot be put back, so this comes last for the
# outbox.
$node->safe_psql('postgres', 'ALTER TABLE idempotency.outbox DROP COLUMN headers');
my ($ret, $out, $err) = $node->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT * FROM idempotency.idem_outbox_fetch('t', 10, '1 s')");
like($err, qr/ERROR:  55000: table "idempotency.outbox" does not have the columns/,
	'a dropped outbox column: idem_outbox_fetch refuses the table');
($ret, $out, $err) = $node->psql('postgres', 'SELECT * FROM idempotency.idem_run_maintenance()');
like($err, qr/does not have the columns/, '... and so does the publishing');

# Made PARALLEL SAFE and run in a parallel worker (debug_parallel_query, 16+;
# force_parallel_mode before): a clear 25000, not an internal error.
my $forced = $node->pg_version >= 16 ? 'debug_parallel_query' : 'force_parallel_mode';
($ret, $out, $err) = $node->psql('postgres', qq{
	\\set VERBOSITY verbose
	ALTER FUNCTION idempotency.idem_mark_processed(text, text, interval) PARALLEL SAFE;
	SET $forced = on;
	SELECT idempotency.idem_mark_processed('c', 'in a parallel worker');});
like($err, qr/ERROR:  25000: idem_mark_processed\(\) cannot run during a parallel operation/,
	'a call in a parallel worker is refused with 25000');

# A takeover past the largest attempt number: 22003, the row unchanged.
$node->safe_psql('postgres', q{
	UPDATE idempotency.keys SET attempt = 2147483647, lease_expires_at = now() - interval '1 s'
	WHERE key = 'held'});
($ret, $out, $err) = $node->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idempotency.idem_claim('s', 'held')");
like($err, qr/ERROR:  22003: key has been taken over too many times/,
	'a takeover past attempt 2147483647 is refused with 22003');
is($node->safe_psql('postgres', "SELECT attempt FROM idempotency.keys WHERE key = 'held'"),
	'2147483647', '... and the attempt is not wrapped');

# A table Citus lists (its catalog, reproduced here) is an empty shell on
# this node.  Hash-distributed, its rows are in shards, which Citus's own
# functions find (src/citus/shards.c): without them, 55000 rather than a
# read of the shell.  Any other kind of Citus table (a reference table
# here) is refused with 0A000.  The catalog's columns are found by name
# (here in another order than Citus's), and in one session a catalog that
# was missing is found once it exists (when the table's relcache entry is
# invalidated, as Citus does when it distributes a table: a GRANT here).
($ret, $out, $err) = $node->psql('postgres', q{
	SELECT idempotency.idem_claim('s', 'before the catalog');
	SET allow_system_table_mods = on;
	CREATE TABLE pg_catalog.pg_dist_partition (partmethod "char", logicalrelid regclass NOT NULL);
	INSERT INTO pg_catalog.pg_dist_partition VALUES ('h', 'idempotency.keys');
	GRANT SELECT ON idempotency.keys TO PUBLIC;
	REVOKE SELECT ON idempotency.keys FROM PUBLIC;
	\set VERBOSITY verbose
	SELECT idempotency.idem_claim('s', 'done');});
like($err, qr/ERROR:  55000: Citus's catalog does not say which column table "idempotency.keys" is distributed by/,
	'a table distributed by Citus by a column the catalog does not name is an error');
($ret, $out, $err) = $node->psql('postgres', q{
	SET allow_system_table_mods = on;
	ALTER TABLE pg_catalog.pg_dist_partition ADD partkey text;
	UPDATE pg_catalog.pg_dist_partition SET partkey = '{VAR :varno 1 :varattno 1 :vartype 25}';
	\set VERBOSITY verbose
	SELECT idempotency.idem_claim('s', 'done');});
like($err, qr/ERROR:  55000: function pg_catalog.get_shard_id_for_distribution_column of Citus does not exist/,
	'a table distributed by Citus, without Citus, is an error rather than a read of the shell');
($ret, $out, $err) = $node->psql('postgres', q{
	SET allow_system_table_mods = on;
	UPDATE pg_catalog.pg_dist_partition SET partmethod = 'n';
	\set VERBOSITY verbose
	SELECT idempotency.idem_claim('s', 'done');});
like($err, qr/ERROR:  0A000: idempotency does not support this change to table "idempotency.keys"/,
	'a Citus reference table is refused with 0A000');
like($err, qr/DETAIL:  The cluster distributes it other than by hash/, '... saying so');

ok(!$node->log_contains('terminated by signal|PANIC|TRAP:'), 'no backend crashed');
$node->stop;
done_testing();
