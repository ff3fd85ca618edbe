# The worker publishes while a snapshot is held elsewhere in the database (a
# long report, an ANALYZE, a dump).  The rows it publishes are deleted, but
# while that snapshot may still see them their entries in outbox_ready
# cannot be marked dead, and a batch whose walk started again from the
# topic's oldest entry would read every row the batches before it published:
# with n batches in a round, about n^2 / 2 batches of rows, and the worker
# fell behind (bench/README.md).  Counted, not timed: the route's function
# records, at each row it is given, the entries of outbox_ready the worker
# has read (pg_stat_get_xact_tuples_returned: the backend's counts not yet
# sent to the statistics, which it sends at most once a second, between
# batches), so that a batch's walk is what the count grew by from the
# batch before's last row to its own first, or, after a send, its first.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $rows = 3000;
my $batch = 100;

my $node = PostgreSQL::Test::Cluster->new('held_snapshot');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '1h'
idempotency.publish_batch_size = $batch
idempotency.outbox_max_attempts = 1
idempotency.purge_interval = '1h'
autovacuum = off
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (seq bigserial, id bigint, key text, xid xid8, ready_read bigint);
	CREATE TABLE healed ();
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		IF e.payload ? 'fail' AND NOT EXISTS (SELECT FROM public.healed) THEN
			RAISE EXCEPTION 'not yet';
		END IF;
		INSERT INTO public.sink (id, key, xid, ready_read)
		VALUES (e.id, e.key, pg_current_xact_id(),
		        pg_stat_get_xact_tuples_returned('idempotency.outbox_ready'::regclass));
	END $$;
	SELECT idempotency.idem_outbox_route('held', 'function', 'sink_it');
});
$node->poll_query_until('postgres',
	"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency worker'")
  or die "the worker did not start";

# $rows rows of 100 keys in one transaction: one round of the worker, in
# batches of $batch; returns the entries of outbox_ready the walks of its
# batches after the first read (the first walks from the topic's oldest)
sub publish_round
{
	my ($label) = @_;
	$node->safe_psql('postgres', 'TRUNCATE sink');
	enqueue($rows);
	$node->poll_query_until('postgres', "SELECT count(*) = $rows FROM sink")
	  or die "$label: the worker did not publish the rows";
	published_in_order($label);
	my $batches = $node->safe_psql('postgres', 'SELECT count(DISTINCT xid) FROM sink');
	cmp_ok($batches, '>=', $rows / $batch, "$label: in batches of at most $batch");
	return walked();
}

# $n rows of 100 keys in one transaction
sub enqueue
{
	my ($n) = @_;
	$node->safe_psql('postgres', qq{
		SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('held',
			array_fill('{"n": 1}'::jsonb, ARRAY[$n]),
			(SELECT array_agg('k' || n % 100) FROM generate_series(1, $n) n))});
}

sub published_in_order
{
	my ($label) = @_;
	is($node->safe_psql('postgres', q{
		SELECT (SELECT count(*) - count(DISTINCT id) FROM sink) || ' ' ||
		       (SELECT count(*) FROM (SELECT id, lag(id) OVER (PARTITION BY key ORDER BY xid, id) AS before
		                              FROM sink) s WHERE before > id)}),
		'0 0', "$label: each row published once, each key's in order");
}

# the entries of outbox_ready the walks of the batches in sink after the first read
sub walked
{
	return $node->safe_psql('postgres', q{
		WITH b AS (SELECT xid, min(seq) AS first_seq, max(seq) AS last_seq FROM sink GROUP BY xid),
		     v AS (SELECT b.xid, f.ready_read AS first, l.ready_read AS last
		           FROM b JOIN sink f ON f.seq = b.first_seq JOIN sink l ON l.seq = b.last_seq),
		     d AS (SELECT first, lag(last) OVER (ORDER BY xid) AS before FROM v)
		SELECT sum(CASE WHEN first < before THEN first ELSE first - before END)
		FROM d WHERE before IS NOT NULL});
}

my $alone = publish_round('no snapshot held');
cmp_ok($alone, '<=', 2 * $rows,
	"no snapshot held: the batches after the first read $alone entries of outbox_ready");

my $holder = $node->background_psql('postgres');
$holder->query_safe('BEGIN ISOLATION LEVEL REPEATABLE READ');
$holder->query_safe('SELECT 1');
my $held = publish_round('a snapshot held');
cmp_ok($held, '<=', 2 * $rows,
	"a snapshot held: the batches after the first read $held entries of outbox_ready, not each all the rows published before it");

# Rounds of one batch each, the snapshot still held: each round's walk
# starts at the topic's oldest unpublished row, looked for after where the
# round before found it, rather than at the topic's oldest entry, before
# every row published since the snapshot was taken (a publisher that keeps
# up does rounds of one or two batches, and read each time the rows
# published since the last vacuum: bench/README.md).
my ($nrounds, $per_round) = (30, 50);
$node->safe_psql('postgres', 'TRUNCATE sink');
for my $round (1 .. $nrounds)
{
	enqueue($per_round);
	$node->poll_query_until('postgres', 'SELECT count(*) = ' . $round * $per_round . ' FROM sink')
	  or die "round $round: the worker did not publish the rows";
}
published_in_order('rounds');
my $rounds = walked();
cmp_ok($rounds, '<=', 4 * $nrounds * $per_round,
	"$nrounds rounds of $per_round rows: their walks read $rounds entries of outbox_ready, not each all the rows published before it");
$holder->query_safe('COMMIT');
$holder->quit;

# A row whose transaction took its id before a round and committed after
# it, below where the next round starts: its commit says so, and it goes
# out at once (idempotency.naptime is an hour here).
$node->safe_psql('postgres', 'TRUNCATE sink');
my $late = $node->background_psql('postgres');
$late->query_safe('BEGIN');
my $late_id = $late->query_safe(q{SELECT idempotency.idem_outbox_enqueue('held', '{"late": 1}')});
enqueue(1);
$node->poll_query_until('postgres', 'SELECT count(*) = 1 FROM sink')
  or die 'the worker did not publish the row after the late one';
enqueue(1);
$node->poll_query_until('postgres', 'SELECT count(*) = 2 FROM sink')
  or die 'the worker did not publish the second row after the late one';
$late->query_safe('COMMIT');
$late->quit;
ok($node->poll_query_until('postgres', "SELECT count(*) = 1 FROM sink WHERE id = $late_id"),
	'a row committed after later rows were published goes out');

# A dead row, behind the rows published after it, requeued: so says its
# requeue, and it goes out at once.
my $dead_id = $node->safe_psql('postgres',
	q{SELECT idempotency.idem_outbox_enqueue('held', '{"fail": 1}')});
$node->poll_query_until('postgres',
	"SELECT state = 'dead' FROM idempotency.outbox WHERE id = $dead_id")
  or die 'the failing row did not die';
enqueue(10);
$node->poll_query_until('postgres', 'SELECT count(*) = 13 FROM sink')
  or die 'the worker did not publish the rows after the dead one';
$node->safe_psql('postgres', 'INSERT INTO healed DEFAULT VALUES');
is($node->safe_psql('postgres', "SELECT idempotency.idem_outbox_requeue($dead_id)"), 't',
	'the dead row is requeued');
ok($node->poll_query_until('postgres', "SELECT count(*) = 1 FROM sink WHERE id = $dead_id"),
	'a requeued row behind where the rounds start goes out');

# The purge of the published rows kept for outbox_retention walks
# outbox_published and finds the rows by id, whatever the statistics say:
# it never scans the whole table (which, planned as a join, it did on 18,
# reading every dead row at the table's front on each purge).  Rows of a
# topic without a route, taken and acknowledged through the pull API with
# the retention set for this session, then made old; the worker's purge is
# an hour away.
my $purged = $node->safe_psql('postgres', q{
	SET idempotency.outbox_retention = '1h';
	SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('pulled',
		array_fill('{"n": 1}'::jsonb, ARRAY[3000]));
	SELECT idempotency.idem_outbox_ack(array_agg(id), array_agg(attempts))
	FROM idempotency.idem_outbox_fetch('pulled', 3000);
	UPDATE idempotency.outbox SET published_at = published_at - interval '2 hours'
	WHERE topic = 'pulled' AND state = 'published';
	ANALYZE idempotency.outbox;
});
# in a connection of its own: its scans counted so far are the purge's
$purged = $node->safe_psql('postgres', q{
	SELECT purged_outbox || ' ' || pg_stat_get_xact_numscans('idempotency.outbox'::regclass)
	FROM idempotency.idem_run_maintenance();
});
is($purged, '3000 0',
	'the purge of published rows deletes them all without a scan of the whole outbox');

# Publishing's statements that find rows by id (the delete of a batch's
# rows, above all) are planned once, generic, under the walk's settings:
# planned while the outbox was nearly empty (a vacuum truncates it when
# publishing keeps up) and left to plancache.c, the delete's plan kept by
# the worker was a sequential scan, and read the whole table at each batch
# once a backlog came in.  The worker's data path run by
# idem_run_maintenance in one connection, whose plans it keeps (the worker
# taken off idempotency.databases meanwhile): ten batches of two rows on
# the truncated table, then one of $batch with 2,000 rows in the outbox.
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.databases = 'template1';
	SELECT pg_reload_conf();
});
$node->poll_query_until('postgres',
	"SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency worker'")
  or die 'the worker did not leave';
$node->safe_psql('postgres', q{
	DELETE FROM idempotency.outbox;
	VACUUM idempotency.outbox;
});
my $scans = $node->safe_psql('postgres', q{
	DO $$
	BEGIN
		FOR g IN 1 .. 10 LOOP
			PERFORM idempotency.idem_outbox_enqueue_batch('held',
				array_fill(('{"small": ' || g || '}')::jsonb, ARRAY[2]));
			IF (SELECT published FROM idempotency.idem_run_maintenance()) <> 2 THEN
				RAISE EXCEPTION 'batch %: not 2 rows published', g;
			END IF;
		END LOOP;
	END $$;
	SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('held',
		array_fill('{"n": 1}'::jsonb, ARRAY[2000]));
	BEGIN;
	SELECT pg_stat_get_xact_numscans('idempotency.outbox'::regclass) AS before \gset
	SELECT published || ' ' || pg_stat_get_xact_numscans('idempotency.outbox'::regclass) - :before
	FROM idempotency.idem_run_maintenance();
	COMMIT;
});
is((split /\n/, $scans)[-1], "$batch 0",
	'a batch published from a backlog, planned on a small outbox, scans no whole table');

# With a default route, the walk across the topics is the primary key's in
# id order, which holds the published rows kept for outbox_retention as
# well.  It is planned once, like the walks by topic, and starts each round
# at the oldest unpublished row of any topic: left to a custom plan for
# each batch, with statistics taken while the outbox held mostly published
# rows, a batch read all of outbox_ready, probed each row's key and sorted
# them; and a round began at the first entry, so that one with nothing to
# publish read every published row kept.  The worker is still off: rounds
# of idem_run_maintenance, each in a connection of its own, and the index
# entries a round reads counted as above.
my $spread = 700;
# each batch in a transaction of its own, as the worker's
sub publish_all
{
	1 while $node->safe_psql('postgres', q{
		SET idempotency.outbox_retention = '1h';
		SELECT published FROM idempotency.idem_run_maintenance();
	}) > 0;
}
$node->safe_psql('postgres', qq{
	DELETE FROM idempotency.outbox;
	VACUUM idempotency.outbox;
	SELECT idempotency.idem_outbox_route('*', 'notify', 'everything');
	SELECT count(*) FROM generate_series(1, 3) t,
		LATERAL idempotency.idem_outbox_enqueue_batch('spread' || t,
			array_fill('{"n": 1}'::jsonb, ARRAY[$spread]));
});
publish_all();
$node->safe_psql('postgres', 'ANALYZE idempotency.outbox');
is($node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.outbox WHERE state = 'published'"),
	3 * $spread, 'the rows of three topics are published and kept');
# a round of idem_run_maintenance: what it published, and the index
# entries it read
sub round_read
{
	return $node->safe_psql('postgres', q{
		SET idempotency.outbox_retention = '1h';
		BEGIN;
		SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) AS before
		FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass \gset
		SELECT m.published || ' ' || (SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) - :before
									   FROM pg_index WHERE indrelid = 'idempotency.outbox'::regclass)
		FROM idempotency.idem_run_maintenance() m;
		COMMIT;
	});
}
$node->safe_psql('postgres', qq{
	SELECT count(*) FROM generate_series(1, 3) t,
		LATERAL idempotency.idem_outbox_enqueue_batch('spread' || t,
			array_fill('{"n": 2}'::jsonb, ARRAY[$spread]));
});
my $full = round_read();
# statistics that say most rows are pending, then none is
$node->safe_psql('postgres', 'ANALYZE idempotency.outbox');
publish_all();
my $idle = round_read();
diag("default route: a batch from the backlog: $full; a round with nothing left: $idle");
my ($published, $read) = split / /, $full;
is($published, $batch, 'a batch across the topics publishes a full batch');
cmp_ok($read, '<=', 4 * $batch,
	'a batch across the topics, planned on stale statistics, reads about its batch');
($published, $read) = split / /, $idle;
is($published, 0, 'then everything is published');
cmp_ok($read, '<=', 50, 'a round with nothing to publish reads none of the kept rows');

# More topics with unpublished rows than the loose scan looks through: the
# walk starts at the first entry, as before the scan, and every row goes out.
$node->safe_psql('postgres', q{
	SELECT count(*) FROM generate_series(1, 1001) t,
		LATERAL idempotency.idem_outbox_enqueue('many' || t, '{"n": 3}');
});
publish_all();
is($node->safe_psql('postgres',
		"SELECT count(*) FILTER (WHERE state = 'published') || ' ' || count(*)"
		  . " FROM idempotency.outbox WHERE topic LIKE 'many%'"),
	'1001 1001', 'the rows of 1,001 topics are all published');

$node->stop;
done_testing();
