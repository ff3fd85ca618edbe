# The shape check of an extension table (src/tables/table_check.c) runs
# again after every relcache invalidation of the table and after every
# sinval reset, and the relcache entry it reads can be rebuilt in the middle
# of it, when it opens a catalog.  A healthy table must never be refused for
# that (issue 29, item 7): claims race a stream of invalidations of
# idempotency.keys itself (GRANT/REVOKE, ANALYZE, a reloption that the
# utility hook allows), catalog churn that fills the sinval queue (temporary
# tables created and dropped) and backends asleep inside a transaction,
# which fall behind and make the queue reset them.  Every claim must
# succeed.  Bounded in count and in time: the claimants stop after their
# claims or after 15 seconds, and the churn stops with them.
#
# Then the same made certain: a claim's check held at a catalog by a lock
# the test holds while the table is invalidated or the sinval queue
# overflows, so that the claimant rebuilds its relcache entries in the
# middle of the check.
#
# And the other way round: a change that commits while the check runs, and
# whose invalidation the check takes in after it looked at that part, must
# not be forgotten.  On a server that does not preload the library (no
# utility hook refuses the DDL), a reader's check is held at pg_inherits,
# which it opens last, while a trigger is created on the table; the next
# write must see the trigger and refuse the table.

use strict;
use warnings;

use IPC::Run;
use Time::HiRes qw(usleep);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $claimants = 3;
my $claims = 20000;    # each, unless 15 seconds pass first
my $sleepers = 8;

my $node = PostgreSQL::Test::Cluster->new('sinval');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
max_connections = 40
autovacuum = off
jit = off
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE churn_reader;
	-- a claimant's refusals, and how far it got; the churn runs until
	-- every claimant has said it is done
	CREATE TABLE refusals (claimant int, sqlstate text, message text, detail text);
	CREATE TABLE progress (claimant int PRIMARY KEY, claims int, done bool);
	CREATE TABLE churned (what text PRIMARY KEY, rounds int);

	CREATE PROCEDURE claim_many(me int, n int) LANGUAGE plpgsql AS $$
	DECLARE
		deadline timestamptz := clock_timestamp() + interval '15 s';
		i int := 0;
		state text;
		message text;
		detail text;
	BEGIN
		INSERT INTO progress VALUES (me, 0, false);
		COMMIT;
		WHILE i < n AND clock_timestamp() < deadline LOOP
			i := i + 1;
			BEGIN
				PERFORM idempotency.idem_claim('sinval', me || '-' || i);
			EXCEPTION WHEN OTHERS THEN
				GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE,
					message = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
				INSERT INTO refusals VALUES (me, state, message, detail);
			END;
			-- each claim in a transaction of its own: each takes its locks
			-- anew, which is where invalidations are taken in
			COMMIT;
		END LOOP;
		UPDATE progress SET claims = i, done = true WHERE claimant = me;
	END $$;

	-- churn until every claimant is done (or 25 seconds, whichever first)
	CREATE PROCEDURE churn(what text) LANGUAGE plpgsql AS $$
	DECLARE
		deadline timestamptz := clock_timestamp() + interval '25 s';
		rounds int := 0;
	BEGIN
		WHILE clock_timestamp() < deadline AND
			(SELECT count(*) FILTER (WHERE done) < count(*) OR count(*) = 0 FROM progress) LOOP
			rounds := rounds + 1;
			IF what = 'keys' THEN
				-- a relcache invalidation of keys itself at each commit (one
				-- session: these update its pg_class row)
				GRANT SELECT ON idempotency.keys TO churn_reader;
				COMMIT;
				REVOKE SELECT ON idempotency.keys FROM churn_reader;
				COMMIT;
				IF rounds % 10 = 0 THEN
					ANALYZE idempotency.keys;
					COMMIT;
					EXECUTE format('ALTER TABLE idempotency.keys SET (fillfactor = %s)',
								   90 + rounds / 10 % 10);
				END IF;
			ELSE
				-- dozens of sinval messages each: the queue fills, and the
				-- backends that lag behind it are reset
				CREATE TEMP TABLE churn_temp (a int PRIMARY KEY, b text);
				COMMIT;
				DROP TABLE churn_temp;
			END IF;
			COMMIT;
		END LOOP;
		INSERT INTO churned VALUES (what, rounds);
	END $$;
});

my @procs;
my $connstr = $node->connstr('postgres');
sub start_psql
{
	my ($sql) = @_;
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-d', $connstr, '-c', $sql ],
		'>', \$out, '2>', \$err);
	push @procs, [ $h, \$err, $sql ];
	return $h;
}

# backends that sleep inside a transaction do not read the sinval queue:
# they hold it back until it fills, and then it resets whoever lags
my @sleeping;
for my $i (1 .. $sleepers)
{
	my ($out, $err) = ('', '');
	push @sleeping, IPC::Run::start(
		[
			'psql', '-X', '-q', '-d', $connstr, '-c',
			'SELECT count(*) FROM idempotency.keys; SELECT pg_sleep(60)'
		],
		'>', \$out, '2>', \$err);
}
$node->poll_query_until('postgres',
	"SELECT count(*) = $sleepers FROM pg_stat_activity WHERE wait_event = 'PgSleep'")
  or die 'the sleepers did not fall asleep';

start_psql("CALL churn('$_')") for qw(keys temp);
start_psql("CALL claim_many($_, $claims)") for 1 .. $claimants;

for my $p (@procs)
{
	my ($h, $err, $sql) = @$p;
	ok($h->finish, "$sql ran to its end") or diag($$err);
}
# the sleepers are in pg_sleep: wake them, which ends their sessions
$node->safe_psql('postgres',
	"SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity WHERE wait_event = 'PgSleep'");
$_->finish for @sleeping;

my $made = $node->safe_psql('postgres', 'SELECT sum(claims) FROM progress');
note("claims made: $made; churn rounds: "
	  . $node->safe_psql('postgres',
		"SELECT string_agg(what || ' ' || rounds, ', ' ORDER BY what) FROM churned"));
cmp_ok($made, '>', 0, 'the claimants claimed');
is($node->safe_psql('postgres', "SELECT count(*) FROM churned WHERE rounds > 0"),
	'2', 'every churn ran alongside them');

my $refused = $node->safe_psql('postgres', q{
	SELECT count(*) || coalesce(': ' || min(sqlstate || ' ' || message || ' / ' || detail), '')
	FROM refusals
});
is($refused, '0', 'no claim failed: a healthy table is never refused');

# every claim made is there, and the table is still taken as it is
is($node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.keys WHERE scope = 'sinval'"),
	$made, 'every claim left its key');
is($node->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('sinval', 'after')"),
	'claimed', 'a claim after the churn works');

# The same made certain: a claim whose check runs again (keys was
# invalidated since its last) is held at a catalog the check opens, by a
# lock the test holds, while invalidations arrive; the claim and the next
# one in that session must be claimed.  Held at pg_opclass (looked up for
# the primary key's operator classes, before the constraints are compared
# with the key) or at pg_inherits (which the check opens last); the
# invalidations: one of keys itself, or more messages than the sinval
# queue holds, none about keys, which the claimant, asleep on the lock,
# does not read, so that the queue resets it and it rebuilds its open
# relcache entries when it gets the lock.
$node->safe_psql('postgres', q{
	CREATE TABLE bystander (a int);
	CREATE FUNCTION try_claim(k text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		message text;
		detail text;
	BEGIN
		RETURN (idempotency.idem_claim('held', k)).outcome;
	EXCEPTION WHEN OTHERS THEN
		GET STACKED DIAGNOSTICS message = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
		RETURN SQLSTATE || ' ' || message || ' / ' || detail;
	END $$;
});
my $invalidate_keys = q{
	GRANT SELECT ON idempotency.keys TO churn_reader;
	REVOKE SELECT ON idempotency.keys FROM churn_reader;
};
# a few messages a round (pg_class's catalog caches, the bystander's
# relcache entry): well past the queue's 4,096
my $overflow_queue = q{
	DO $$
	BEGIN
		FOR i IN 1 .. 2000 LOOP
			GRANT SELECT ON bystander TO churn_reader;
			COMMIT;
			REVOKE SELECT ON bystander FROM churn_reader;
			COMMIT;
		END LOOP;
	END $$
};
# What the test does while a catalog is locked goes through a session
# opened (and its caches loaded) before: a new one would wait for the lock
# at its start.
my $driver = $node->background_psql('postgres');
sub claimant_waits_for
{
	my ($catalog) = @_;
	my $query = "SELECT count(*) = 1 FROM pg_locks"
	  . " WHERE relation = 'pg_catalog.$catalog'::regclass AND NOT granted";
	for (1 .. 10 * $PostgreSQL::Test::Utils::timeout_default)
	{
		return 1 if $driver->query_safe($query) eq 't';
		usleep(100_000);
	}
	return 0;
}
$driver->query_safe("SELECT count(*) FROM pg_locks WHERE relation = 'pg_catalog.$_'::regclass")
  for qw(pg_opclass pg_inherits);
$driver->query_safe($invalidate_keys);
$driver->query_safe($overflow_queue =~ s/2000/1/r);

my $round = 0;
for my $case ([ 'pg_opclass', 'keys invalidated', $invalidate_keys ],
	[ 'pg_opclass', 'sinval reset', $overflow_queue ],
	[ 'pg_inherits', 'sinval reset', $overflow_queue ])
{
	my ($catalog, $what, $traffic) = @$case;
	$round++;
	my $claimant = $node->background_psql('postgres');
	$claimant->query_safe("SELECT try_claim('warm-$round')");
	$driver->query_safe($invalidate_keys);
	my $holder = $node->background_psql('postgres');
	$holder->query_safe("BEGIN; LOCK TABLE pg_catalog.$catalog IN ACCESS EXCLUSIVE MODE");
	$claimant->query_until(qr/claiming/, "\\echo claiming\nSELECT try_claim('held-$round');\n");
	claimant_waits_for($catalog) or die "the claimant did not reach $catalog";
	$driver->query_safe($traffic);
	$holder->query_safe('ROLLBACK');
	$holder->quit;
	is($claimant->query_safe("SELECT try_claim('next-$round')"), "claimed\nclaimed",
		"check held at $catalog, $what: the claim and the next are claimed");
	$claimant->quit;
}
$driver->quit;

$node->stop;

# The check held at pg_inherits (a lock the test holds) while a trigger is
# created on processed_events: CREATE TRIGGER's lock does not conflict with
# the reader's AccessShareLock, so it commits, and the reader takes in its
# invalidation when it gets pg_inherits, after it looked at the triggers.
my $plain = PostgreSQL::Test::Cluster->new('unguarded');
$plain->init;
$plain->append_conf('postgresql.conf', "jit = off\n");
$plain->start;
$plain->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE fired (event_id text);
	CREATE FUNCTION note_event() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO fired VALUES (NEW.event_id);
		RETURN NEW;
	END $$;
	-- a write, and what became of it
	CREATE FUNCTION try_mark(event text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		message text;
		detail text;
	BEGIN
		PERFORM idempotency.idem_mark_processed('held', event);
		RETURN 'marked';
	EXCEPTION WHEN OTHERS THEN
		GET STACKED DIAGNOSTICS message = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
		RETURN SQLSTATE || ' ' || message || ' / ' || detail;
	END $$;
});

my $locker = $plain->background_psql('postgres');
$locker->query_safe('BEGIN; LOCK TABLE pg_catalog.pg_inherits IN ACCESS EXCLUSIVE MODE');
# one session: a read, whose check waits for pg_inherits, then a write (a
# file for psql's input: nothing pumps a string into it meanwhile)
my $reads = $plain->basedir . '/reads.sql';
append_to_file($reads, q{
SELECT 'read ' || idempotency.idem_is_processed('held', 'e0');
SELECT try_mark('e1');
});
my ($read_out, $read_err) = ('', '');
my $reader = IPC::Run::start(
	[ 'psql', '-X', '-A', '-t', '-d', $plain->connstr('postgres'), '-f', $reads ],
	'>', \$read_out, '2>', \$read_err);
$plain->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_locks
	WHERE relation = 'pg_catalog.pg_inherits'::regclass AND NOT granted
}) or die 'the reader did not reach pg_inherits';
$plain->safe_psql('postgres', q{
	CREATE TRIGGER note_event AFTER INSERT ON idempotency.processed_events
	FOR EACH ROW EXECUTE FUNCTION note_event()
});
$locker->query_safe('ROLLBACK');
$locker->quit;
$reader->finish;

like($read_out, qr/^read false$/m, 'the read whose check was held works')
  or diag($read_err);
like($read_out,
	qr/^55000 idempotency does not support this change to table "idempotency.processed_events" \/ It has trigger "note_event"/m,
	'a trigger created while the check ran is seen by the next write')
  or diag($read_err);
is($plain->safe_psql('postgres', 'SELECT count(*) FROM idempotency.processed_events'),
	'0', '... which wrote nothing');

$plain->stop;
done_testing();
