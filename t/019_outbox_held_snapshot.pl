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
autovacuum = off
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (seq bigserial, id bigint, key text, xid xid8, ready_read bigint);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS $$
		INSERT INTO public.sink (id, key, xid, ready_read)
		VALUES (e.id, e.key, pg_current_xact_id(),
		        pg_stat_get_xact_tuples_returned('idempotency.outbox_ready'::regclass))
	$$;
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
	$node->safe_psql('postgres', qq{
		SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('held',
			array_fill('{"n": 1}'::jsonb, ARRAY[$rows]),
			(SELECT array_agg('k' || n % 100) FROM generate_series(1, $rows) n))});
	$node->poll_query_until('postgres', "SELECT count(*) = $rows FROM sink")
	  or die "$label: the worker did not publish the rows";
	is($node->safe_psql('postgres', q{
		SELECT (SELECT count(*) - count(DISTINCT id) FROM sink) || ' ' ||
		       (SELECT count(*) FROM (SELECT id, lag(id) OVER (PARTITION BY key ORDER BY xid, id) AS before
		                              FROM sink) s WHERE before > id)}),
		'0 0', "$label: each row published once, each key's in order");
	my $batches = $node->safe_psql('postgres', 'SELECT count(DISTINCT xid) FROM sink');
	cmp_ok($batches, '>=', $rows / $batch, "$label: in batches of at most $batch");
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
$holder->query_safe('COMMIT');
$holder->quit;

$node->stop;
done_testing();
