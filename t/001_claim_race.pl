# 32 sessions claim the same key at the same instant, in one-transaction
# mode, each inserting a side-effect row when it wins.  Exactly one wins;
# every other outcome is in_progress or replay.  The sessions are released
# together from a barrier (an advisory lock the test holds), and the race is
# run several times with fresh keys.

use strict;
use warnings;

use IPC::Run;
use FindBin;
use lib $FindBin::RealBin;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use IdemTest;

my $sessions = 32;
my $rounds = 5;

my $node = PostgreSQL::Test::Cluster->new('race');
$node->init;
$node->append_conf('postgresql.conf', preload() . qq{
max_connections = 60
});
$node->start;
install_idempotency($node);

$node->safe_psql('postgres', q{
	CREATE TABLE side_effects (key text, backend int);
	CREATE TABLE outcomes (key text, outcome text);

	-- what an application does per request, in one transaction
	CREATE FUNCTION handle_request(k text) RETURNS void LANGUAGE plpgsql AS $$
	DECLARE
		answer text := (idempotency.idem_claim('race', k)).outcome;
	BEGIN
		INSERT INTO outcomes VALUES (k, answer);
		IF answer = 'claimed' THEN
			INSERT INTO side_effects VALUES (k, pg_backend_pid());
			PERFORM idempotency.idem_complete('race', k, 201, 'done');
		END IF;
	END $$;
});

my $script = $node->basedir . '/race.sql';
append_to_file($script, q{
SELECT pg_advisory_lock_shared(1);
SELECT pg_advisory_unlock_shared(1);
BEGIN;
SELECT handle_request('key-' || :round);
COMMIT;
});

for my $round (1 .. $rounds)
{
	my $barrier = $node->background_psql('postgres');
	$barrier->query_safe('SELECT pg_advisory_lock(1)');

	my ($out, $err) = ('', '');
	my $pgbench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', $sessions, '-j', 8, '-t', 1,
			'-f', $script, '-D', "round=$round",
			'-h', $node->host, '-p', $node->port, 'postgres'
		],
		'>', \$out, '2>', \$err);

	# wait until every session is queued behind the barrier, then open it
	$node->poll_query_until('postgres',
		"SELECT count(*) = $sessions FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
	  or die "sessions did not reach the barrier";
	$barrier->query_safe('SELECT pg_advisory_unlock(1)');
	$barrier->quit;

	ok($pgbench->finish, "round $round: every session ran") or diag($err);

	my $key = "key-$round";
	is($node->safe_psql('postgres', "SELECT count(*) FROM side_effects WHERE key = '$key'"),
		'1', "round $round: exactly one side effect");
	is($node->safe_psql('postgres',
			"SELECT count(*) FROM outcomes WHERE key = '$key' AND outcome = 'claimed'"),
		'1', "round $round: exactly one claimed");
	is($node->safe_psql('postgres',
			"SELECT count(*) FROM outcomes WHERE key = '$key' AND outcome IN ('in_progress', 'replay')"),
		$sessions - 1, "round $round: every other session got in_progress or replay");
}

# the winner's response is what every later claim replays
is($node->safe_psql('postgres',
		"SELECT outcome || ' ' || status_code || ' ' || body FROM idempotency.idem_claim('race', 'key-1')"),
	'replay 201 done', 'the stored response replays');

$node->stop;
done_testing();
