# 32 sessions wait, with idem_claim's wait argument, for a key that one
# holder has claimed, each in a transaction of its own that runs the
# operation (a side-effect row) if it gets the key.  Whatever the holder
# does, the operation runs exactly once, and every waiter that did not run
# it answers replay with the stored response, byte for byte:
#
#   one transaction, the holder completes and commits: 32 replays;
#   one transaction, the holder rolls back: one waiter claims and runs it,
#     the 31 others wait for that one and replay its response;
#   two transactions, the holder's claim committed, its completion comes
#     in a later transaction: 32 replays.
#
# Half the waiters call idem_claim in FROM, half as a
# function.  The holder acts only once all 32 sleep in the wait (their wait
# event in pg_stat_activity), so that their wake-up is what is tested.  Then
# the server is restarted with one wait slot per partition, and 32 waiters
# each wait for a key of their own: those that find no free slot poll
# instead, and every one of them still replays.

use strict;
use warnings;

use IPC::Run;
use Time::HiRes qw(usleep);
use FindBin;
use lib $FindBin::RealBin;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use IdemTest;

my $waiters = 32;

my $node = PostgreSQL::Test::Cluster->new('wait');
$node->init;
$node->append_conf('postgresql.conf', preload() . qq{
max_connections = 60
max_prepared_transactions = 2
# the purge that wakes a waiter below is the test's, not the worker's
idempotency.purge_interval = '1d'
});
$node->start;
install_idempotency($node);

# a response of 100 kB (stored out of line) with bytes that a careless
# copy would change: quotes, backslashes, tabs, newlines, trailing spaces
my $body_sql = q{repeat(E'{"a": "\\\\ \t\n" }  ', 5000) || k};

$node->safe_psql('postgres', qq{
	CREATE TABLE side_effects (key text, backend int);
	CREATE TABLE outcomes (key text, outcome text, status_code int, body_md5 text,
						   headers jsonb, direct boolean);

	CREATE FUNCTION body_for(k text) RETURNS text LANGUAGE sql IMMUTABLE
	AS \$\$ SELECT $body_sql \$\$;

	-- what an application does per request, in one transaction, waiting
	-- up to a minute (idempotency.max_wait) for a request in flight with the same key
	CREATE FUNCTION handle_request(k text, direct boolean) RETURNS void
	LANGUAGE plpgsql AS \$\$
	DECLARE
		c idempotency.claim_result;
	BEGIN
		IF direct THEN
			SELECT * INTO c FROM idempotency.idem_claim('wait', k, wait => '1 min');
		ELSE
			c := idempotency.idem_claim('wait', k, wait => '1 min');
		END IF;
		INSERT INTO outcomes VALUES (k, c.outcome, c.status_code, md5(c.body), c.headers, direct);
		IF c.outcome = 'claimed' THEN
			INSERT INTO side_effects VALUES (k, pg_backend_pid());
			PERFORM idempotency.idem_complete('wait', k, 201, body_for(k),
											  jsonb_build_object('Location', '/payments/' || k));
		END IF;
	END \$\$;
});

my $script = $node->basedir . '/wait.sql';
append_to_file($script, q{
\set direct :client_id % 2
BEGIN;
SELECT handle_request('k' || :keyno || CASE WHEN :key_per_client = 1 THEN '-' || :client_id ELSE '' END,
					  :direct = 1);
COMMIT;
});

# start the waiters; return once all of them sleep in the wait
sub start_waiters
{
	my ($keyno, $key_per_client) = @_;
	my ($out, $err) = ('', '');
	my $pgbench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', $waiters, '-j', 4, '-t', 1,
			'-f', $script, '-D', "keyno=$keyno", '-D', "key_per_client=$key_per_client",
			'-h', $node->host, '-p', $node->port, 'postgres'
		],
		'>', \$out, '2>', \$err);
	my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
	while ($node->safe_psql('postgres', qq{
		SELECT count(*) FROM pg_stat_activity
		WHERE backend_type = 'client backend' AND } . waiting_claim())
		!= $waiters)
	{
		$pgbench->pump_nb;
		die "pgbench ended before its clients all waited: $err" unless $pgbench->pumpable;
		die "the waiters did not all wait: $err" if time() > $deadline;
		usleep(50_000);
	}
	return ($pgbench, \$err);
}

# the operation ran once, and every other waiter replayed its response
sub check_round
{
	my ($name, $key, $claimed) = @_;
	is($node->safe_psql('postgres', "SELECT count(*) FROM side_effects WHERE key = '$key'"),
		'1', "$name: the operation ran exactly once");
	is($node->safe_psql('postgres',
			"SELECT count(*) FROM outcomes WHERE key = '$key' AND outcome = 'claimed'"),
		$claimed, "$name: $claimed waiter(s) claimed the key");
	is($node->safe_psql('postgres', qq{
			SELECT count(*) FROM outcomes
			WHERE key = '$key' AND outcome = 'replay' AND status_code = 201
			  AND body_md5 = md5(body_for('$key'))
			  AND headers = jsonb_build_object('Location', '/payments/$key')}),
		$waiters - $claimed, "$name: every other waiter replayed the response, byte for byte");
	is($node->safe_psql('postgres',
			"SELECT count(DISTINCT direct) FROM outcomes WHERE key = '$key'"),
		'2', "$name: through FROM and the function");
}

for my $round (1 .. 2)
{
	# one transaction: the holder completes and commits
	my $key = "k1$round";
	my $holder = $node->background_psql('postgres');
	$holder->query_safe(qq{
		BEGIN;
		SELECT idempotency.idem_claim('wait', '$key');
		INSERT INTO side_effects VALUES ('$key', pg_backend_pid());
		SELECT idempotency.idem_complete('wait', '$key', 201, body_for('$key'),
										 jsonb_build_object('Location', '/payments/$key'));
	});
	my ($pgbench, $err) = start_waiters("1$round", 0);
	$holder->query_safe('COMMIT');
	$holder->quit;
	ok($pgbench->finish, "commit round $round: every waiter ran") or diag($$err);
	check_round("commit round $round", $key, 0);

	# one transaction: the holder rolls back, and one waiter runs it
	$key = "k2$round";
	$holder = $node->background_psql('postgres');
	$holder->query_safe(qq{
		BEGIN;
		SELECT idempotency.idem_claim('wait', '$key');
		INSERT INTO side_effects VALUES ('$key', pg_backend_pid());
	});
	($pgbench, $err) = start_waiters("2$round", 0);
	$holder->query_safe('ROLLBACK');
	$holder->quit;
	ok($pgbench->finish, "rollback round $round: every waiter ran") or diag($$err);
	check_round("rollback round $round", $key, 1);

	# two transactions: the claim commits, the completion comes later
	$key = "k3$round";
	$node->safe_psql('postgres', "SELECT idempotency.idem_claim('wait', '$key', lease => '1 hour')");
	($pgbench, $err) = start_waiters("3$round", 0);
	$node->safe_psql('postgres', qq{
		BEGIN;
		INSERT INTO side_effects VALUES ('$key', pg_backend_pid());
		SELECT idempotency.idem_complete('wait', '$key', 201, body_for('$key'),
										 jsonb_build_object('Location', '/payments/$key'), 1);
		COMMIT;
	});
	ok($pgbench->finish, "two-transaction round $round: every waiter ran") or diag($$err);
	check_round("two-transaction round $round", $key, 0);
}

# Nothing is left registered: a claim of a completed key with a wait
# answers at once, and so does one of a new key.
is($node->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('wait', 'k11', wait => '1 min')"),
	'replay', 'a completed key replays at once');

# Changes that name no key still wake the waiters of the database at once:
# COMMIT PREPARED and ROLLBACK PREPARED from another session, and a purge
# of expired keys.  Each waiter waits a minute under a statement_timeout
# of 5 s, less than the 10 s after which a waiter looks again unwoken: an
# answer rather than a cancel is one that a wake-up brought.
sub waiter_answer
{
	my ($key, $end_it) = @_;
	my $waiter = $node->background_psql('postgres');
	$waiter->query_until(qr/sent/, qq{\\echo sent
SET statement_timeout = '5s';
SELECT 'answer:' || outcome FROM idempotency.idem_claim('wait', '$key', wait => '1 min');
});
	$node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'client backend' AND } . waiting_claim() . qq{
		  AND query LIKE '%$key%'})
	  or die "the waiter of $key did not sleep";
	$end_it->();
	my ($answer) = $waiter->query('SELECT 1');
	$answer .= $waiter->{stderr};
	$waiter->quit;
	return $answer =~ /answer:(\w+)/ ? $1 : $answer;
}

my $preparer = $node->background_psql('postgres');
$preparer->query_safe(qq{
	BEGIN;
	SELECT idempotency.idem_claim('wait', 'prepared-commit');
	SELECT idempotency.idem_complete('wait', 'prepared-commit', 201, 'done');
	PREPARE TRANSACTION 'commit me';
	BEGIN;
	SELECT idempotency.idem_claim('wait', 'prepared-rollback');
	PREPARE TRANSACTION 'roll me back';
});
$preparer->quit;
is(waiter_answer('prepared-commit', sub { $node->safe_psql('postgres', "COMMIT PREPARED 'commit me'") }),
	'replay', 'COMMIT PREPARED from another session wakes the waiter: it replays');
is(waiter_answer('prepared-rollback', sub { $node->safe_psql('postgres', "ROLLBACK PREPARED 'roll me back'") }),
	'claimed', 'ROLLBACK PREPARED from another session wakes the waiter: it claims');

# a completed key whose response expired, deleted by a purge that commits
# while the waiter sleeps (idem_run_maintenance() purges in the caller's
# transaction, so the deletion is in flight until it commits).  The
# worker's first purge comes first (after it, none for a day): on a busy
# machine it could start late and take the key itself, and the waiter would
# find nothing to wait for.
if (edition() eq 'c')
{
	$node->poll_query_until('postgres',
		'SELECT worker_last_round IS NOT NULL FROM idempotency.stats')
	  or die "the worker never purged";
}
$node->safe_psql('postgres', qq{
	SELECT idempotency.idem_claim('wait', 'purged', ttl => '1 ms');
	SELECT idempotency.idem_complete('wait', 'purged', 201, 'done');
});
$node->poll_query_until('postgres',
	"SELECT expires_at < now() FROM idempotency.keys WHERE scope = 'wait' AND key = 'purged'")
  or die "the key did not expire";
my $purger = $node->background_psql('postgres');
$purger->query_safe('BEGIN; SELECT purged_keys FROM idempotency.idem_run_maintenance()');
is(waiter_answer('purged', sub { $purger->query_safe('COMMIT') }),
	'claimed', 'a purge that deleted the expired key wakes its waiter: it claims');
$purger->quit;

# One wait slot per partition (16 in all): 32 waiters, each on a key of
# its own, crowd some partitions; those without a slot poll.
# (The SQL edition has no slots: its waiters wait for the holder's lock,
# and the setting is a placeholder it never reads.)
$node->append_conf('postgresql.conf', 'idempotency.wait_slots = 16');
$node->restart;
is($node->safe_psql('postgres', 'SHOW idempotency.wait_slots'), '16', 'wait_slots is 16');

my $holder = $node->background_psql('postgres');
$holder->query_safe(qq{
	BEGIN;
	SELECT idempotency.idem_claim('wait', 'k4-' || n) FROM generate_series(0, $waiters - 1) n;
	INSERT INTO side_effects SELECT 'k4-' || n, pg_backend_pid() FROM generate_series(0, $waiters - 1) n;
	SELECT idempotency.idem_complete('wait', 'k4-' || n, 201, body_for('k4-' || n),
									 jsonb_build_object('Location', '/payments/k4-' || n))
	FROM generate_series(0, $waiters - 1) n;
});
my ($pgbench, $err) = start_waiters(4, 1);
$holder->query_safe('COMMIT');
$holder->quit;
ok($pgbench->finish, 'own keys: every waiter ran') or diag($$err);
is($node->safe_psql('postgres', qq{
		SELECT count(*) FROM outcomes o
		WHERE key LIKE 'k4-%' AND outcome = 'replay' AND status_code = 201
		  AND body_md5 = md5(body_for(key))}),
	$waiters, 'own keys: every waiter replayed its own key, slot or none');
is($node->safe_psql('postgres', "SELECT count(*) FROM side_effects WHERE key LIKE 'k4-%'"),
	$waiters, 'own keys: each operation ran once');

$node->stop;
done_testing();
