# The update from 1.0 to 1.1 (ALTER EXTENSION ... UPDATE TO '1.1'; the
# update on to 1.2 is t/018_upgrade_1_2.pl's), as an operator runs it: the new library is
# installed and preloaded (so the DDL guard is active), a database still at
# 1.0 keeps working with it (7-column claim results, no idem_extend_lease),
# then ALTER EXTENSION idempotency UPDATE brings it to 1.1 without changing
# a row, every function works at 1.1 (9 columns, idem_extend_lease), the
# roles granted EXECUTE on 1.0's idem_claim can call the new one, the
# updated database has the same objects as a fresh 1.1 install, and a
# pg_dump of it restores, grants included.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('upgrade');
$node->init;
# no worker: nothing but this test may change a row
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'none'
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE DATABASE old;
	CREATE ROLE app;
	CREATE ROLE app_sub;
	CREATE ROLE app_gone;
});
$node->safe_psql('old', q{
	CREATE EXTENSION idempotency VERSION '1.0';
	CREATE FUNCTION public.forward(r idempotency.outbox) RETURNS void
	LANGUAGE sql AS 'SELECT NULL';
	GRANT USAGE ON SCHEMA idempotency TO app, app_sub, app_gone;
	GRANT EXECUTE ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval)
	TO app WITH GRANT OPTION;
	GRANT EXECUTE ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval)
	TO app_gone;
	SET ROLE app;
	GRANT EXECUTE ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval)
	TO app_sub;
});
is($node->safe_psql('old',
		"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.0', 'a database at 1.0, with the 1.1 library preloaded');

# Every table, in every state.
$node->safe_psql('old', q{
	SET search_path = idempotency;
	-- keys: completed, in progress (two-transaction), a lease run out with
	-- a recovery point
	SELECT idem_claim('s', 'done', 'fp', ttl => '7 days');
	SELECT idem_complete('s', 'done', 201, '{"id": 7}', '{"Location": "/7"}');
	SELECT idem_claim('s', 'held', 'fp', lease => '1 hour');
	SELECT idem_claim('s', 'crashed', lease => '1 millisecond');
	SELECT idem_checkpoint('s', 'crashed', 'charged ch_1', 1);
	-- processed events
	SELECT idem_mark_processed('c', 'evt-' || n) FROM generate_series(1, 3) n;
	-- outbox: pending, leased, dead, published (kept an hour)
	SELECT idem_outbox_route('orders', 'none');
	SELECT idem_outbox_route('*', 'notify', 'events');
	SELECT idem_outbox_route('forwarded', 'function', 'public.forward');
	SELECT idem_outbox_enqueue('orders', jsonb_build_object('n', n), 'k' || n)
	FROM generate_series(1, 5) n;
	SELECT count(*) FROM idem_outbox_fetch('orders', 3, '1 hour');
	SET idempotency.outbox_max_attempts = 1;
	SELECT idem_outbox_nack(2, 'broker down');
	SET idempotency.outbox_retention = '1h';
	SELECT idem_outbox_ack(ARRAY[3]::bigint[]);
	-- a route 1.0 let through and 1.1 refuses: no destination
	INSERT INTO outbox_routes (topic, target) VALUES ('legacy', 'notify');
});
ok($node->poll_query_until('old', q{
		SELECT lease_expires_at < now() FROM idempotency.keys
		WHERE scope = 's' AND key = 'crashed'}),
	'the lease of "crashed" ran out');
is($node->safe_psql('old', q{
		SELECT string_agg(state, ' ' ORDER BY id) FROM idempotency.outbox}),
	'leased dead published pending pending', 'outbox rows in every state');

# The columns of claim_result, as the database declares it, called as a
# function and in FROM.
sub result_columns
{
	my ($version, $ncolumns) = @_;
	my $claim = "idempotency.idem_claim('s', 'done', 'fp')";

	is($node->safe_psql('old', qq{
			SELECT count(*) FROM json_object_keys((SELECT row_to_json(c) FROM $claim c))}),
		$ncolumns, "at $version: the function answers $ncolumns columns");
	my @fields = split /\|/, $node->safe_psql('old', "SELECT * FROM $claim"), -1;
	is(scalar @fields, $ncolumns, "at $version: a call in FROM answers $ncolumns columns");
}

# The new library against the 1.0 objects: claim results have 1.0's 7
# columns.
result_columns('1.0', 7);
is($node->safe_psql('old', q{
		SELECT * FROM idempotency.idem_claim('s', 'done', 'fp')}),
	'replay|201|{"id": 7}|{"Location": "/7"}|1||'
	  . $node->safe_psql('old',
		"SELECT created_at FROM idempotency.keys WHERE key = 'done'"),
	'at 1.0: a call in FROM answers the 7 columns');
is($node->safe_psql('old', q{
		SET search_path = idempotency;
		SELECT outcome FROM idem_claim('s', 'at-1.0');
		SELECT idem_checkpoint('s', 'at-1.0', 'step 1', 1);
		SELECT idem_complete('s', 'at-1.0', 200, 'ok', attempt => 1);
		SELECT outcome || ' ' || body FROM idem_claim('s', 'at-1.0');
		SELECT outcome FROM idem_claim('s', 'released');
		SELECT idem_release('s', 'released', 1);
		SELECT idem_mark_processed('c', 'evt-1') || ' ' || idem_is_processed('c', 'evt-2');
		SELECT length(idem_fingerprint('{"a": 1}'::jsonb));
		SELECT idem_outbox_requeue(idem_outbox_enqueue('scratch', '{}')) IS NOT NULL;
		SELECT count(*) FROM idem_outbox_fetch('scratch', 10, '1 hour');
		SELECT idem_outbox_ack(array_agg(id)) FROM outbox WHERE topic = 'scratch';
		SELECT purged_keys >= 0 FROM idem_run_maintenance();
		SELECT keys_in_progress FROM stats;
	}),
	"claimed\n\nstored\nreplay ok\nclaimed\nt\nfalse true\n64\nt\n1\n1\nt\n2",
	'at 1.0: every function works');
is($node->safe_psql('old', q{
		SELECT to_regprocedure('idempotency.idem_extend_lease(text, text, integer, interval)')
		       IS NULL}),
	't', 'at 1.0: no idem_extend_lease');

# The update refuses to run while a route has no destination (its dump
# would not restore), naming it and changing nothing; set, it runs.
my ($ret, $stdout, $stderr) = $node->psql('old', q{
	\set VERBOSITY verbose
	ALTER EXTENSION idempotency UPDATE TO '1.1'});
like($stderr, qr/ERROR:  55000: idempotency cannot be updated while a route has no destination\n.*topics 'legacy'/s,
	'the update refuses a route without a destination, and names it');
is($node->safe_psql('old', q{
		SELECT extversion || ' ' || (SELECT count(*) FROM pg_proc WHERE proname = 'idem_claim')
		FROM pg_extension WHERE extname = 'idempotency'}),
	'1.0 1', '... and changes nothing');
$node->safe_psql('old', "SELECT idempotency.idem_outbox_route('legacy', 'notify', 'events')");

# Every row, every column, of every table and the sequence.
my $rows = q{
	SELECT string_agg(r, E'\n' ORDER BY r) FROM (
		SELECT 'keys ' || k::text AS r FROM idempotency.keys k
		UNION ALL SELECT 'event ' || e::text FROM idempotency.processed_events e
		UNION ALL SELECT 'outbox ' || o::text FROM idempotency.outbox o
		UNION ALL SELECT 'route ' || r::text FROM idempotency.outbox_routes r
		UNION ALL SELECT 'sequence ' || s.last_value || ' ' || s.is_called
		FROM idempotency.outbox_id_seq s
	) rows};
my $before = $node->safe_psql('old', $rows);

$node->command_ok(
	[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-c', "ALTER EXTENSION idempotency UPDATE TO '1.1'",
		'-d', $node->connstr('old') ],
	'ALTER EXTENSION idempotency UPDATE, with the DDL guard active');
is($node->safe_psql('old',
		"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.1', 'the database is at 1.1');
is($node->safe_psql('old', $rows), $before, 'no row changed');

# At 1.1: 9 columns, and what the stored rows say.
result_columns('1.1', 9);
is($node->safe_psql('old', q{
		SELECT c.outcome, c.lease_expires_at IS NULL, c.expires_at = k.expires_at
		FROM idempotency.idem_claim('s', 'done', 'fp') c, idempotency.keys k
		WHERE k.key = 'done'}),
	'replay|t|t', 'at 1.1: a stored response replays, with its expiry');
is($node->safe_psql('old', q{
		SELECT c.outcome, c.lease_expires_at = k.lease_expires_at, c.expires_at IS NULL
		FROM idempotency.idem_claim('s', 'held', 'fp') c, idempotency.keys k
		WHERE k.key = 'held'}),
	'in_progress|t|t', 'at 1.1: a claim held since 1.0 says when its lease runs out');
is($node->safe_psql('old', q{
		SELECT outcome, attempt, recovery_point, lease_expires_at > now()
		FROM idempotency.idem_claim('s', 'crashed', lease => '1 hour')}),
	'claimed|2|charged ch_1|t', 'at 1.1: a lease run out at 1.0 is taken over');
is($node->safe_psql('old', q{
		SET search_path = idempotency;
		SELECT idem_extend_lease('s', 'crashed', 2, '2 hours') > now() + interval '1 hour';
		SELECT idem_extend_lease('s', 'held', 1) IS NOT NULL;
		SELECT idem_checkpoint('s', 'crashed', 'receipt sent', 2);
		SELECT idem_complete('s', 'crashed', 200, 'ok', attempt => 2);
		SELECT outcome || ' ' || body FROM idem_claim('s', 'crashed');
		SELECT idem_release('s', 'held', 1);
		SELECT outcome FROM idem_claim('s', 'held');
		SELECT idem_mark_processed('c', 'evt-3') || ' ' || idem_mark_processed('c', 'evt-4');
		SELECT idem_is_processed('c', 'evt-4');
		SELECT count(*) FROM idem_outbox_fetch('orders', 10, '1 hour');
		SELECT idem_outbox_ack(ARRAY[1]::bigint[]);
		SELECT idem_outbox_requeue(2);
		SELECT idem_outbox_discard(2);  -- false: pending again
		SELECT idem_outbox_enqueue('orders', '{}', 'k9') > 5;
		SELECT idem_outbox_route('orders', 'logical', 'orders');
		SELECT target || ' ' || destination FROM outbox_routes WHERE topic = 'legacy';
		SELECT purged_keys >= 0 FROM idem_run_maintenance();
		SELECT outbox_dead FROM stats;
	}),
	"t\nt\n\nstored\nreplay ok\nt\nclaimed\nfalse true\nt\n2\n1\nt\nf\nt\n\nnotify events\nt\n0",
	'at 1.1: every function works');
$node->safe_psql('old', "SELECT idempotency.idem_complete('s', 'held', 201, 'done')");

# At 1.1, what 1.1 adds for events and the outbox: batch marks and looks,
# the batch enqueue, a key's rows in one hand-out, the fenced acknowledgement
# (once: the second finds nothing leased).
is($node->safe_psql('old', q{
		SET search_path = idempotency;
		SELECT string_agg(id, ',')
		FROM idem_mark_processed_batch('c', ARRAY['evt-4', 'evt-5', 'evt-5', 'evt-6']) AS id;
		SELECT string_agg(id, ',')
		FROM idem_is_processed_batch('c', ARRAY['evt-6', 'evt-7', 'evt-1']) AS id;
		SELECT idem_outbox_route('pulled', 'none');
		SELECT count(*) FROM idem_outbox_enqueue_batch('pulled',
			ARRAY['{"n": 1}', '{"n": 2}', '{"n": 3}']::jsonb[], ARRAY['k', 'k', 'k']);
		CREATE TEMP TABLE handed AS
			SELECT id, attempts FROM idem_outbox_fetch('pulled', 10, '1 hour', per_key => 3);
		SELECT count(*) FROM handed;
		SELECT idem_outbox_ack(array_agg(id ORDER BY id), array_agg(attempts ORDER BY id)) FROM handed;
		SELECT idem_outbox_ack(array_agg(id ORDER BY id), array_agg(attempts ORDER BY id)) FROM handed;
	}),
	"evt-5,evt-6\nevt-6,evt-1\n\n3\n3\n3\n0",
	'at 1.1: batch marks, batch enqueue, per-key fetch and fenced acknowledgement work');

# The grants on 1.0's idem_claim are on the new one, by the same grantors.
is($node->safe_psql('old', q{
		SELECT array_to_string(array_agg(a.grantee::regrole || ' by ' || a.grantor::regrole
		                                 || CASE WHEN a.is_grantable THEN ' with grant option'
		                                         ELSE '' END
		                                 ORDER BY a.grantee::regrole::text), ', ')
		FROM pg_proc p, aclexplode(p.proacl) a
		WHERE p.oid = 'idempotency.idem_claim(text, text, text, interval, interval, interval)'::regprocedure
		  AND a.grantee <> p.proowner}),
	'app by ' . $node->safe_psql('old', 'SELECT current_user')
	  . ' with grant option, app_gone by '
	  . $node->safe_psql('old', 'SELECT current_user') . ', app_sub by app',
	'the 1.0 grants are carried over');
for my $role ('app', 'app_sub')
{
	is($node->safe_psql('old', qq{
			SET ROLE $role;
			SELECT outcome FROM idempotency.idem_claim('s', 'done');
			SELECT (idempotency.idem_claim('s', 'done')).outcome}),
		"replay\nreplay", "$role, granted EXECUTE at 1.0, calls idem_claim at 1.1");
}
($ret, $stdout, $stderr) = $node->psql('old', q{
	SET ROLE app;
	SELECT idempotency.idem_extend_lease('s', 'held', 1)});
like($stderr, qr/permission denied for function idem_extend_lease/,
	'idem_extend_lease is not granted by the update');

# The carried grants are the operator's, not the extension's initial
# privileges: a revoked role can be dropped, nothing else holds it.
$node->safe_psql('old', q{
	REVOKE ALL ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval)
	FROM app_gone;
	REVOKE USAGE ON SCHEMA idempotency FROM app_gone;
	DROP ROLE app_gone;
});
is($node->safe_psql('old', q{
		SELECT initprivs FROM pg_init_privs
		WHERE objoid = 'idempotency.idem_claim(text, text, text, interval, interval, interval)'::regprocedure}),
	$node->safe_psql('old', q{
		SELECT initprivs FROM pg_init_privs
		WHERE objoid = 'idempotency.idem_fingerprint(jsonb)'::regprocedure}),
	"idem_claim's initial privileges are the script's, as its siblings'");

# The updated database has the objects a fresh 1.1 install has.
my $objects = extension_objects_query();
$node->safe_psql('postgres', 'CREATE DATABASE fresh');
$node->safe_psql('fresh', "CREATE EXTENSION idempotency VERSION '1.1'");
is($node->safe_psql('old', $objects), $node->safe_psql('fresh', $objects),
	'the updated database has the objects of a fresh 1.1 install');
like($node->safe_psql('fresh', $objects), qr/idem_extend_lease/, '... which the query lists');

# pg_dump of the updated database restores: rows, functions and grants.
my $after = $node->safe_psql('old', $rows);
my $dump = $node->basedir . '/old.dump';
$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('old') ],
	'pg_dump of the updated database');
$node->safe_psql('postgres', 'CREATE DATABASE restored');
# pg_dump's CREATE EXTENSION IF NOT EXISTS names no version: the restore
# would create the default one (1.2, t/018_upgrade_1_2.pl), so the dump's
# version, 1.1, is created first, and the restore leaves out the schema and
# the extension
$node->safe_psql('restored', "CREATE EXTENSION idempotency VERSION '1.1'");
my $list = $node->basedir . '/old.list';
$node->command_ok([ 'pg_restore', '-l', '-f', $list, $dump ], 'the dump\'s table of contents');
my $contents = slurp_file($list);
$contents =~ s/^(\d+; \d+ \d+ (?:SCHEMA - idempotency|EXTENSION - idempotency) )/;$1/mg;
open(my $fh, '>', $list) or die "could not write $list: $!";
print $fh $contents;
close($fh);
$node->command_ok([ 'pg_restore', '--exit-on-error', '-L', $list, '-d', $node->connstr('restored'), $dump ],
	'pg_restore into a new database, with the DDL guard active');
is($node->safe_psql('restored', $rows), $after, 'every row is back');
is($node->safe_psql('restored',
		"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.1', 'the restored database is at 1.1');
is($node->safe_psql('restored', q{
		SET ROLE app_sub;
		SELECT outcome || ' ' || body FROM idempotency.idem_claim('s', 'crashed');
		RESET ROLE;
		SELECT outcome FROM idempotency.idem_claim('s', 'restored', lease => '1 hour');
		SELECT idempotency.idem_extend_lease('s', 'restored', 1, '2 hours') > now();
		SELECT count(*) FROM json_object_keys(
			(SELECT row_to_json(c) FROM idempotency.idem_claim('s', 'done') c))}),
	"replay ok\nclaimed\nt\n9",
	'the restored database works, and the carried grants came back with it');

$node->stop;
done_testing();
