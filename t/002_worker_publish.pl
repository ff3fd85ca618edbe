# The background worker publishes the outbox: to NOTIFY, to logical
# decoding, and to a function, in order per key and exactly once; a failing
# function is retried with backoff and then dead while other topics flow; a
# commit wakes the worker at once; SIGHUP changes its settings.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $node = PostgreSQL::Test::Cluster->new('publish');
$node->init(allows_streaming => 'logical');
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '10s'
idempotency.outbox_backoff_min = '20ms'
idempotency.outbox_backoff_max = '40ms'
idempotency.outbox_max_attempts = 3
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (seq bigserial, id bigint, topic text, key text,
	                   created_at timestamptz, published_at timestamptz);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS $$
		INSERT INTO public.sink (id, topic, key, created_at, published_at)
		VALUES (e.id, e.topic, e.key, e.created_at, clock_timestamp())
	$$;
	CREATE FUNCTION always_fails(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		RAISE EXCEPTION 'downstream rejected event %', e.id;
	END $$;
	SELECT idempotency.idem_outbox_route('fast', 'function', 'sink_it');
	SELECT idempotency.idem_outbox_route('ordered', 'function', 'sink_it');
	SELECT idempotency.idem_outbox_route('bad', 'function', 'always_fails');
	SELECT idempotency.idem_outbox_route('note', 'notify', 'idem_test');
	SELECT idempotency.idem_outbox_route('events', 'logical', 'idem.test');
	SELECT pg_create_logical_replication_slot('idem_slot', 'test_decoding');
});

$node->poll_query_until('postgres',
	"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'")
  or die "the worker did not start";
my $worker_pid = $node->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'");

# Waits until every row of the topic is published; false if that never
# happens (poll_query_until's timeout), for ok() to report.
sub published
{
	my ($topic) = @_;
	return $node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM idempotency.outbox WHERE topic = '$topic' AND state <> 'published'");
}

sub wait_published
{
	my ($topic) = @_;
	published($topic) or die "rows of topic $topic were not published";
}

# --- commit to publish well before the naptime (10 s): the commit wakes it
# the worker has finished its first round (it purges last) and sleeps
$node->poll_query_until('postgres',
	"SELECT worker_last_round IS NOT NULL FROM idempotency.stats")
  or die "the worker has not finished a round";
$node->safe_psql('postgres', "SELECT idempotency.idem_outbox_enqueue('fast', '{\"n\": 1}')");
wait_published('fast');
my $delay = $node->safe_psql('postgres',
	"SELECT extract(epoch FROM published_at - created_at) FROM sink WHERE topic = 'fast'");
cmp_ok($delay, '<', 1.0, "published ${delay}s after the enqueue, with naptime 10s");

# --- an enqueue wakes the worker only for a routed topic, as this session
# knows the routes; a commit that routes moves what it knows.  In one
# session: a row of an unrouted topic (no wake-up, nothing to publish), the
# route (its commit wakes the worker for that row), then another row, which
# must wake the worker itself: with a stale view of the routes it would wait
# for the naptime, 10 s.
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('late', '{"n": 1}');
	SELECT pg_sleep(0.5);
	SELECT idempotency.idem_outbox_route('late', 'function', 'sink_it');
	SELECT pg_sleep(0.5);
	SELECT idempotency.idem_outbox_enqueue('late', '{"n": 2}');
});
wait_published('late');
is($node->safe_psql('postgres', q{
		SELECT count(*) || ' ' || bool_and(published_at - created_at < interval '2 s')
		FROM sink WHERE topic = 'late' AND id = (SELECT max(id) FROM sink WHERE topic = 'late')}),
	'1 true', 'a row enqueued after its topic was routed wakes the worker at once');
is($node->safe_psql('postgres', "SELECT count(*) FROM sink WHERE topic = 'late'"),
	'2', 'both rows of the newly routed topic are published');

# a route change that rolls back leaves nothing behind in what the session
# knows: its next row of the (still routed) topic wakes the worker at once
$node->safe_psql('postgres', q{
	BEGIN;
	SELECT idempotency.idem_outbox_route('late', 'none');
	SELECT idempotency.idem_outbox_enqueue('late', '{"n": 3}');
	ROLLBACK;
	SELECT idempotency.idem_outbox_enqueue('late', '{"n": 4}');
});
wait_published('late');
is($node->safe_psql('postgres', q{
		SELECT bool_and(published_at - created_at < interval '2 s')
		FROM sink WHERE topic = 'late' AND id = (SELECT max(id) FROM sink WHERE topic = 'late')}),
	't', 'after a rolled-back route change, a row of the routed topic wakes the worker at once');

# --- function target: every row once, in id order per key, with concurrent enqueuers
my $script = $node->basedir . '/enqueue.sql';
append_to_file($script, q{
SELECT idempotency.idem_outbox_enqueue('ordered', jsonb_build_object('client', :client_id),
                                       'key-' || (random() * 3)::int);
});
$node->command_ok(
	[ 'pgbench', '-n', '-c', 4, '-j', 4, '-t', 50, '-f', $script, 'postgres' ],
	'4 sessions enqueue 200 rows on 4 keys');
wait_published('ordered');
is($node->safe_psql('postgres',
		"SELECT count(*) || ' ' || count(DISTINCT id) FROM sink WHERE topic = 'ordered'"),
	'200 200', 'the function received each of the 200 rows exactly once');
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM (
			SELECT id < lag(id) OVER (PARTITION BY key ORDER BY seq) AS out_of_order
			FROM sink WHERE topic = 'ordered') s
		WHERE out_of_order}),
	'0', 'per key, rows reached the function in id order');

# --- NOTIFY reaches a LISTEN session; a payload too large for NOTIFY sends a reference
my $listener = $node->background_psql('postgres');
$listener->query_safe('LISTEN idem_test');
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('note', '{"hello": "world"}', 'k1');
	SELECT idempotency.idem_outbox_enqueue('note', jsonb_build_object('big', repeat('x', 9000)), 'k2');
});
wait_published('note');
my $heard = '';
for (1 .. 50)
{
	$heard .= $listener->query('SELECT 1');
	last if $heard =~ /truncated/;
	usleep(100_000);
}
like($heard, qr/Asynchronous notification "idem_test" with payload "\{"id" : \d+, "topic" : "note", "key" : "k1", "payload" : \{"hello": "world"\}/,
	'the LISTEN session heard the row as JSON');
like($heard, qr/Asynchronous notification "idem_test" with payload "\{"id" : (\d+), "topic" : "note", "key" : "k2", "truncated" : true, "read" : "SELECT payload, headers, created_at FROM idempotency.outbox WHERE id = \1"\}"/,
	'an oversized row is announced by reference, with the query that reads it');
$listener->quit;

# --- logical decoding: exactly one message per published row
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('events', jsonb_build_object('n', n), 'k' || n % 2)
	FROM generate_series(1, 10) n;
});
wait_published('events');
my $changes = $node->safe_psql('postgres',
	"SELECT data FROM pg_logical_slot_get_changes('idem_slot', NULL, NULL) WHERE data LIKE 'message:%prefix: idem.test%'");
my @ids = ($changes =~ /"id" : (\d+)/g);
is(scalar(@ids), 10, 'ten logical messages for ten rows');
my %seen = map { $_ => 1 } @ids;
is(scalar(keys %seen), 10, 'each row once');
like($changes, qr/transactional: 1/, 'messages are transactional');

# --- a failing function: retried with backoff, then dead, while other topics flow
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('bad', '{"n": 1}', 'poison');
	SELECT idempotency.idem_outbox_enqueue('bad', '{"n": 2}', 'poison');
	SELECT idempotency.idem_outbox_enqueue('fast', jsonb_build_object('n', n)) FROM generate_series(2, 6) n;
});
$node->poll_query_until('postgres',
	"SELECT state = 'dead' FROM idempotency.outbox WHERE topic = 'bad' ORDER BY id LIMIT 1")
  or die "the failing row did not die";
is($node->safe_psql('postgres',
		"SELECT attempts || ' ' || (last_error LIKE 'downstream rejected event%') FROM idempotency.outbox WHERE topic = 'bad' ORDER BY id LIMIT 1"),
	'3 true', 'the failing row was tried 3 times and keeps its last error');
is($node->safe_psql('postgres',
		"SELECT state || ' ' || attempts FROM idempotency.outbox WHERE topic = 'bad' ORDER BY id OFFSET 1"),
	'pending 0', 'the next row of its key is held back, untried');
wait_published('fast');
is($node->safe_psql('postgres', "SELECT count(*) FROM sink WHERE topic = 'fast'"),
	'6', 'the other topic kept publishing');
ok($node->safe_psql('postgres', "SELECT publish_failures >= 3 AND published >= 216 FROM idempotency.stats") eq 't',
	'the stats view counts publications and failures');
is($node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'"),
	$worker_pid, 'the worker survived the failures');

# --- a key stuck behind a dead row does not starve the other keys, even when
# its rows fill whole batches
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('bad', jsonb_build_object('n', n), 'poison')
	FROM generate_series(3, 80) n;
	SELECT idempotency.idem_outbox_enqueue('fast', jsonb_build_object('n', n), 'key-' || n)
	FROM generate_series(7, 11) n;
});
ok(published('fast'), 'rows of other keys are published past 78 rows held back by a dead one');
is($node->safe_psql('postgres', "SELECT count(*) FROM sink WHERE topic = 'fast'"),
	'11', 'every row of the other keys reached the sink');
is($node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.outbox WHERE topic = 'bad' AND key = 'poison' AND state = 'pending' AND attempts = 0"),
	'79', 'the 79 rows behind the dead one wait, untried');

# --- a route function runs with search_path pinned, and what it SETs does
# not stick to the worker
$node->safe_psql('postgres', q{
	CREATE FUNCTION meddle(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO public.sink (id, topic, key) VALUES (e.id, e.topic, current_setting('search_path'));
		PERFORM set_config('default_transaction_read_only', 'on', false);
	END $$;
	SELECT idempotency.idem_outbox_route('meddle', 'function', 'meddle');
	SELECT idempotency.idem_outbox_enqueue('meddle', '{}');
});
wait_published('meddle');
is($node->safe_psql('postgres', "SELECT key FROM sink WHERE topic = 'meddle'"),
	'pg_catalog, pg_temp', 'route functions see search_path pg_catalog, pg_temp');
# read-only, the worker could no longer publish: the next row proves it is not
$node->safe_psql('postgres', "SELECT idempotency.idem_outbox_enqueue('fast', '{\"after\": \"meddle\"}')");
ok(published('fast'), 'a setting changed by a route function did not stick to the worker');
is($node->safe_psql('postgres', "SELECT count(*) FROM sink WHERE topic = 'fast'"),
	'12', 'the row enqueued after the route function reached the sink');

# --- publishing commits synchronously, also after a purge, whose batches
# commit asynchronously (the worker purged when it started)
$node->poll_query_until('postgres',
	"SELECT worker_last_round IS NOT NULL FROM idempotency.stats")
  or die "the worker has not purged yet";
$node->safe_psql('postgres', q{
	CREATE FUNCTION durability(e idempotency.outbox) RETURNS void LANGUAGE sql AS $$
		INSERT INTO public.sink (id, topic, key)
		VALUES (e.id, e.topic, pg_catalog.current_setting('synchronous_commit'))
	$$;
	SELECT idempotency.idem_outbox_route('durable', 'function', 'durability');
	SELECT idempotency.idem_outbox_enqueue('durable', '{}');
});
wait_published('durable');
is($node->safe_psql('postgres', "SELECT key FROM sink WHERE topic = 'durable'"),
	'on', 'the worker publishes with synchronous_commit on after purging');

# --- SIGHUP: a changed setting is honoured without a restart
$node->safe_psql('postgres', "ALTER SYSTEM SET idempotency.outbox_retention = '1h'");
$node->reload;
# The worker reloads when it next wakes, and a row published before that is
# deleted at once: each poll enqueues a row, until one published after the
# reload is kept.
ok( $node->poll_query_until('postgres', q{
		SELECT idempotency.idem_outbox_enqueue('fast', '{"after": "reload"}') IS NOT NULL
		   AND (SELECT count(*) > 0 FROM idempotency.outbox
				WHERE topic = 'fast' AND state = 'published')}),
	'after SIGHUP, published rows are kept for outbox_retention');

$node->stop;
done_testing();
