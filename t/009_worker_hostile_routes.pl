# Route functions that fail, or do what a route function should not, never
# make the worker crash-loop nor stall the database: their row's attempts
# count up to dead while the other rows go out.  A function that raises;
# one that raises a cancel's SQLSTATE itself; one that drops the extension,
# truncates the outbox or drops a table; one whose work makes the batch's
# own bookkeeping fail after the row's subtransaction (the row is then tried
# alone, and its failure recorded in a transaction of its own); routes with
# no destination; and 1500 routed topics at the largest batch size, whose
# batch was allocated as their product up front.  idem_run_maintenance,
# which has no worker to record a failure for it, goes the same ways in
# subtransactions.
#
# Every section uses topics of its own and routes them to none at its end,
# so that one that fails leaves the next ones to say what they say.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $max_attempts = 3;

# A route function that drops the extension takes ACCESS EXCLUSIVE locks on
# its objects before its failure undoes the drop, so a query of the test's
# on the outbox meanwhile can deadlock with the worker.  The test's sessions
# wait for no lock longer than 100 ms, and look for a deadlock after 10 ms,
# well before the worker does (after the default second): whichever way the
# locks cross, the test's query is the one that fails, and is tried again
# (poll_query_until), and the worker's attempt fails for what its function
# did, never for a deadlock.
$ENV{PGOPTIONS} = '-c lock_timeout=100ms -c deadlock_timeout=10ms';

my $node = PostgreSQL::Test::Cluster->new('hostile');
$node->init;
# outbox_retention keeps published rows, so that a test can see them
# published, and so that the published mark is an UPDATE (see 'overflow');
# the worker serves postgres only, idem_run_maintenance is tried in manual
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '200ms'
idempotency.outbox_backoff_min = '20ms'
idempotency.outbox_backoff_max = '40ms'
idempotency.outbox_max_attempts = $max_attempts
idempotency.outbox_retention = '1h'
idempotency.databases = 'postgres'
});
$node->start;

my $setup = q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (id bigint, topic text);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'INSERT INTO public.sink VALUES (e.id, e.topic)';
	CREATE FUNCTION always_fails(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		RAISE EXCEPTION 'downstream rejected event %', e.id;
	END $$;
	CREATE FUNCTION fake_cancel(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		RAISE EXCEPTION 'not a real cancel' USING ERRCODE = 'query_canceled';
	END $$;
	CREATE FUNCTION drop_extension(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		DROP EXTENSION idempotency CASCADE;
	END $$;
	CREATE FUNCTION truncate_outbox(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		TRUNCATE idempotency.outbox;
	END $$;
	CREATE TABLE doomed_sink (id bigint);
	CREATE FUNCTION sink_and_drop(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO public.doomed_sink VALUES (e.id);
		DROP TABLE public.doomed_sink;
	END $$;
	-- succeeds, but leaves the row's attempts where the published mark
	-- (attempts + 1) overflows: the batch fails after the row's
	-- subtransaction, in a statement of its own
	CREATE FUNCTION overflow(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'UPDATE idempotency.outbox SET attempts = 2147483647 WHERE id = e.id';
	SELECT idempotency.idem_outbox_route('good', 'function', 'sink_it');
};
$node->safe_psql('postgres', $setup);

sub worker_pids
{
	return $node->safe_psql('postgres',
		"SELECT string_agg(pid::text, ',') FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'");
}

$node->poll_query_until('postgres',
	"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'")
  or die "the worker did not start";
my $worker_pid = worker_pids();

# Wait for a topic's rows to be published; say whether they were.
sub published
{
	my ($db, $topic) = @_;
	return $node->poll_query_until($db,
		"SELECT count(*) > 0 AND bool_and(state = 'published') FROM idempotency.outbox WHERE topic = '$topic'");
}

# Wait for the first row of a topic to be dead; say whether it was.
sub dead
{
	my ($db, $topic) = @_;
	return $node->poll_query_until($db,
		"SELECT state = 'dead' FROM idempotency.outbox WHERE topic = '$topic' ORDER BY id LIMIT 1");
}

# A query's result, tried again while it fails (its lock timing out: see
# PGOPTIONS above), which it may do only while a worker whose fix is
# missing is still at a hostile row.
sub query_retrying
{
	my ($db, $sql) = @_;
	my $result;
	foreach (1 .. 10 * $PostgreSQL::Test::Utils::timeout_default)
	{
		return $result if defined($result = eval { $node->safe_psql($db, $sql) });
		usleep(100_000);
	}
	die "query failed all along: $sql";
}

sub first_row
{
	my ($db, $topic) = @_;
	return query_retrying($db,
		"SELECT state || ' ' || attempts || ' ' || coalesce(last_error, '') FROM idempotency.outbox WHERE topic = '$topic' ORDER BY id LIMIT 1");
}

# A hostile topic's row and a good topic's rows, enqueued together (one
# commit, so that the worker starts on them once all are there); the good
# ones must go out while the hostile one fails its attempts to dead, with
# last_error matching $error; the same worker serves throughout.
sub hostile_route
{
	my (%args) = @_;
	my $topic = $args{topic};
	my $good = "good_$topic";

	$node->safe_psql('postgres', qq{
		BEGIN;
		SELECT idempotency.idem_outbox_route('$topic', 'function', '$args{function}');
		SELECT idempotency.idem_outbox_route('$good', 'function', 'sink_it');
		SELECT idempotency.idem_outbox_enqueue('$topic', '{}', 'k');
		SELECT idempotency.idem_outbox_enqueue('$good', jsonb_build_object('n', n), 'k' || n)
		FROM generate_series(1, 5) n;
		COMMIT;
	});
	ok(published('postgres', $good), "$args{what}: another topic's rows are published meanwhile");
	ok(dead('postgres', $topic), "$args{what}: the row goes dead");
	like(first_row('postgres', $topic), qr/^dead $max_attempts $args{error}/,
		"$args{what}: after $max_attempts attempts, with its error");
	is(worker_pids(), $worker_pid, "$args{what}: the same worker serves, and only it");
	stop_route($topic);
}

# Whatever came of a section, the rows of later ones must not wait for its
# route (tried again: a worker still at it may hold the routes' lock)
sub stop_route
{
	my ($topic) = @_;
	$node->poll_query_until('postgres',
		"SELECT count(*) = 1 FROM (SELECT idempotency.idem_outbox_route('$topic', 'none')) r")
	  or die "could not route $topic to none";
}

# --- a function that raises
hostile_route(
	what => 'a raising function',
	topic => 'raises',
	function => 'always_fails',
	error => qr/downstream rejected event \d+/);

# --- a function that raises a cancel's SQLSTATE itself: not a cancel
hostile_route(
	what => 'a function raising query_canceled',
	topic => 'fake_cancel',
	function => 'fake_cancel',
	error => qr/not a real cancel/);

# --- DROP EXTENSION from within: refused, as the function's failure; the
# extension, its rows and the function itself are all still there
hostile_route(
	what => 'DROP EXTENSION in the function',
	topic => 'drops_extension',
	function => 'drop_extension',
	error => qr/cannot drop extension "idempotency" during a restricted operation/);
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'}),
	'1', 'DROP EXTENSION in the function: the extension is still installed');
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_proc WHERE proname = 'drop_extension'}),
	'1', 'DROP EXTENSION in the function: what it dropped is back, the function too');

# --- TRUNCATE of the outbox from within: refused; a row waiting for a relay
# (topic routed to none) is still there
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_route('for_relay', 'none');
	SELECT idempotency.idem_outbox_enqueue('for_relay', '{"keep": "me"}');
});
hostile_route(
	what => 'TRUNCATE of the outbox in the function',
	topic => 'truncates',
	function => 'truncate_outbox',
	error => qr/route function public\.truncate_outbox\(idempotency\.outbox\) truncated or rewrote table idempotency\.outbox/);
is(query_retrying('postgres', q{
		SELECT state || ' ' || (payload = '{"keep": "me"}') FROM idempotency.outbox WHERE topic = 'for_relay'}),
	'pending true', 'TRUNCATE of the outbox in the function: a row no batch held is still there');

# --- a function that drops the table it writes: its first row goes out
# (insert and drop commit with the row's mark), the next has no table left
$node->safe_psql('postgres', q{
	BEGIN;
	SELECT idempotency.idem_outbox_route('drops_sink', 'function', 'sink_and_drop');
	SELECT idempotency.idem_outbox_enqueue('drops_sink', jsonb_build_object('n', n), 'k')
	FROM generate_series(1, 2) n;
	SELECT idempotency.idem_outbox_enqueue('good', '{"after": "drops_sink"}');
	COMMIT;
});
ok( $node->poll_query_until('postgres', q{
		SELECT string_agg(state, ' ' ORDER BY id) = 'published dead'
		FROM idempotency.outbox WHERE topic = 'drops_sink'}),
	'DROP TABLE of its sink in the function: the first row is published, the next goes dead');
like(
	$node->safe_psql('postgres', q{
		SELECT attempts || ' ' || last_error FROM idempotency.outbox
		WHERE topic = 'drops_sink' ORDER BY id OFFSET 1}),
	qr/^$max_attempts relation "public\.doomed_sink" does not exist/,
	'DROP TABLE of its sink in the function: the next row failed for want of the table');
ok(published('postgres', 'good'), 'DROP TABLE of its sink in the function: other rows go out');
is(worker_pids(), $worker_pid, 'DROP TABLE of its sink in the function: the same worker serves');
stop_route('drops_sink');

# --- a function whose work makes the batch fail after the row's
# subtransaction (the published mark overflows attempts): the careful batch
# fails as a whole, the row is tried alone, and its failure is recorded in
# a transaction of its own
hostile_route(
	what => 'a failure after the row\'s subtransaction',
	topic => 'overflow',
	function => 'overflow',
	error => qr/integer out of range/);
ok($node->log_contains(qr/outbox row \d+ could not be published: its transaction failed: integer out of range/),
	'a failure after the row\'s subtransaction: recorded once its transaction had failed');

# --- routes with no destination, written directly (idem_outbox_route never
# stores one): each row's attempts count up, with the reason.  A CHECK
# refuses such rows from 1.1 on (the update refuses to run while there are
# any), but a database still at 1.0, which the library serves as well, may
# have them: without the CHECK, this one stands for such a database.
$node->safe_psql('postgres', q{
	ALTER TABLE idempotency.outbox_routes DROP CONSTRAINT IF EXISTS outbox_routes_destination_check;
	BEGIN;
	INSERT INTO idempotency.outbox_routes VALUES ('n', 'notify', NULL);
	INSERT INTO idempotency.outbox_routes VALUES ('l', 'logical', NULL);
	INSERT INTO idempotency.outbox_routes VALUES ('f', 'function', NULL);
	SELECT idempotency.idem_outbox_enqueue(t, '{}') FROM unnest(ARRAY['n', 'l', 'f']) t;
	SELECT idempotency.idem_outbox_enqueue('good', '{"after": "no destination"}');
	COMMIT;
});
foreach my $route ([ 'n', 'notify' ], [ 'l', 'logical' ], [ 'f', 'function' ])
{
	my ($topic, $target) = @$route;
	ok(dead('postgres', $topic), "a $target route with no destination: the row goes dead");
	like(first_row('postgres', $topic),
		qr/^dead $max_attempts the $target route of the row's topic has no destination/,
		"a $target route with no destination: its attempts counted, with the reason");
}
ok(published('postgres', 'good'), 'routes with no destination: other rows go out');
stop_route($_) foreach ('n', 'l', 'f');

# --- idem_run_maintenance, where no worker runs: a row whose function drops
# the extension, and one whose failure comes after its subtransaction, are
# failed attempts, and the call goes on with the other rows
$node->safe_psql('postgres', 'CREATE DATABASE manual');
$node->safe_psql('manual', $setup);
$node->safe_psql('manual', q{
	SELECT idempotency.idem_outbox_route('drops_extension', 'function', 'drop_extension');
	SELECT idempotency.idem_outbox_route('overflow', 'function', 'overflow');
	SELECT idempotency.idem_outbox_enqueue('drops_extension', '{}');
	SELECT idempotency.idem_outbox_enqueue('overflow', '{}');
	SELECT idempotency.idem_outbox_enqueue('good', jsonb_build_object('n', n)) FROM generate_series(1, 3) n;
});
my ($ret, $stdout, $stderr) = $node->psql('manual',
	'SELECT published, publish_failures FROM idempotency.idem_run_maintenance()');
is($ret, 0, 'idem_run_maintenance with hostile routes: the call succeeds')
  or diag($stderr);
is($stdout, '3|2', 'idem_run_maintenance with hostile routes: 3 rows published, 2 failures');
# each call is one attempt of each ready row: call until both are dead
ok( $node->poll_query_until('manual', q{
		SELECT idempotency.idem_run_maintenance() \\gset
		SELECT count(*) = 2 FROM idempotency.outbox
		WHERE topic IN ('drops_extension', 'overflow') AND state = 'dead'}),
	'idem_run_maintenance with hostile routes: both rows go dead');
like(first_row('manual', 'drops_extension'), qr/^dead $max_attempts cannot drop extension "idempotency" during a restricted operation/,
	'idem_run_maintenance: the row whose function dropped the extension failed its attempts');
like(first_row('manual', 'overflow'), qr/^dead $max_attempts integer out of range/,
	'idem_run_maintenance: the row that failed after its subtransaction failed its attempts');

# --- 1500 routed topics at the largest batch size (10000 a topic): the
# batch holds what is pending, not room for 1500 x 10000 rows
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_route('many_' || n, 'function', 'sink_it')
	FROM generate_series(1, 1500) n;
	ALTER SYSTEM SET idempotency.publish_batch_size = 10000;
});
# a restart, so that the worker has the new size before the rows come
$node->restart;
$node->poll_query_until('postgres',
	"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'")
  or die "the worker did not start again";
my $log_offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('many_' || n, '{}') FROM generate_series(1, 1500) n;
});
ok( $node->poll_query_until('postgres', q{
		SELECT count(*) = 1500 AND bool_and(state = 'published')
		FROM idempotency.outbox WHERE topic LIKE 'many\_%'}),
	'1500 routes at batch size 10000: the rows are published');
ok(!$node->log_contains(qr/invalid memory alloc/, $log_offset),
	'1500 routes at batch size 10000: no batch asked for the product of the two');

ok(!$node->log_contains(qr/terminated by signal/), 'no server process crashed');

$node->stop;
done_testing();
