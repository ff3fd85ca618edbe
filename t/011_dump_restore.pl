# pg_dump and pg_restore of a database that uses the extension, on a server
# that preloads the library (so the utility hook that refuses DDL on the
# extension's tables is active during the restore): every stored response,
# claim in progress, processed event, outbox row and route comes back, and
# every function works on the restored database as on the original.  Also
# in plain SQL format through psql, as many backups are taken; and the
# update of a 1.0 database, whose script the guard lets through.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('dump');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'none'
});
$node->start;

$node->safe_psql('postgres', 'CREATE DATABASE source');
$node->safe_psql('source', q{
	CREATE EXTENSION idempotency;
	SELECT idempotency.idem_claim('s', 'in-progress', 'fp');
	SELECT idempotency.idem_claim('s', 'done', 'fp');
	SELECT idempotency.idem_complete('s', 'done', 201, '{"id": 7}', '{"Location": "/7"}');
	SELECT idempotency.idem_mark_processed('c', 'evt-' || n) FROM generate_series(1, 3) n;
	SELECT idempotency.idem_outbox_route('orders', 'none');
	SELECT idempotency.idem_outbox_enqueue('orders', jsonb_build_object('n', n), 'k')
	FROM generate_series(1, 3) n;
});

# What the database holds, table by table, in one comparable string.
my $contents = q{
	SELECT string_agg(row, E'\n' ORDER BY row) FROM (
		SELECT format('key %s %s %s %s %s', scope, key, fingerprint, status_code, body) AS row
		FROM idempotency.keys
		UNION ALL SELECT format('event %s %s', consumer, event_id) FROM idempotency.processed_events
		UNION ALL SELECT format('outbox %s %s %s %s %s', id, topic, key, payload, state)
		FROM idempotency.outbox
		UNION ALL SELECT format('route %s %s', topic, target) FROM idempotency.outbox_routes
		UNION ALL SELECT format('next id %s', last_value) FROM idempotency.outbox_id_seq
	) rows};
my $before = $node->safe_psql('source', $contents);

sub restored_works
{
	my ($db, $how) = @_;
	is($node->safe_psql($db, $contents), $before, "$how: every row is back");
	is($node->safe_psql($db, q{
			SELECT outcome || ' ' || status_code || ' ' || body
			FROM idempotency.idem_claim('s', 'done', 'fp')}),
		'replay 201 {"id": 7}', "$how: a stored response replays");
	is($node->safe_psql($db,
			"SELECT outcome FROM idempotency.idem_claim('s', 'in-progress', 'fp')"),
		'in_progress', "$how: a claim in progress is still held");
	is($node->safe_psql($db, q{
			SELECT idempotency.idem_mark_processed('c', 'evt-1') || ' '
			       || idempotency.idem_mark_processed('c', 'evt-4')}),
		'false true', "$how: processed events are remembered");
	cmp_ok($node->safe_psql($db, "SELECT idempotency.idem_outbox_enqueue('orders', '{}', 'k')"),
		'>', $node->safe_psql('source', 'SELECT max(id) FROM idempotency.outbox'),
		"$how: new outbox ids follow the restored ones");
	is($node->safe_psql($db,
			"SELECT count(*) FROM idempotency.idem_outbox_fetch('orders', 10, '1 min')"),
		'1', "$how: the pull API hands out the key's first row");
	is($node->safe_psql($db, q{
			SELECT outcome FROM idempotency.idem_claim('s', 'new')}),
		'claimed', "$how: a new key is claimed");
}

my $dump = $node->basedir . '/source.dump';
$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('source') ],
	'pg_dump -Fc');
$node->safe_psql('postgres', 'CREATE DATABASE custom');
$node->command_ok([ 'pg_restore', '--exit-on-error', '-d', $node->connstr('custom'), $dump ],
	'pg_restore into a new database, with the DDL guard active');
restored_works('custom', 'pg_restore');

my $sql = $node->basedir . '/source.sql';
$node->command_ok([ 'pg_dump', '-f', $sql, '-d', $node->connstr('source') ],
	'pg_dump in plain SQL');
$node->safe_psql('postgres', 'CREATE DATABASE plain');
$node->command_ok(
	[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-f', $sql, '-d', $node->connstr('plain') ],
	'psql restores the plain dump');
restored_works('plain', 'psql');

# The extension's own scripts are not guarded: a 1.0 database updates to
# 1.2 with the guard active (1.1's constraint, 1.2's column).
$node->safe_psql('postgres', 'CREATE DATABASE old');
$node->safe_psql('old', "CREATE EXTENSION idempotency VERSION '1.0'");
$node->command_ok(
	[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-c', 'ALTER EXTENSION idempotency UPDATE',
		'-d', $node->connstr('old') ],
	'ALTER EXTENSION idempotency UPDATE from 1.0, with the DDL guard active');
is($node->safe_psql('old', q{
		SELECT extversion || ' ' || (SELECT count(*) FROM pg_constraint
		                            WHERE conname = 'outbox_routes_destination_check')
		       || ' ' || (SELECT count(*) FROM pg_attribute
		                  WHERE attrelid = 'idempotency.outbox'::regclass AND attname = 'failures')
		FROM pg_extension WHERE extname = 'idempotency'}),
	'1.2 1 1', '... to 1.2, with its constraint and column');

$node->stop;
done_testing();
