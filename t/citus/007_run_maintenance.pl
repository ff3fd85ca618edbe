# idem_run_maintenance() on a Citus worker node publishes one batch of each
# outbox shard placed on it: a shard whose batch was full does not take the
# next shard's turn.  The background worker serves no database here, so
# that the call is the only one publishing.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use CitusCluster;
use PostgreSQL::Test::Utils;
use Test::More;

# batches of one row; the worker serves a database that does not exist
my $cluster = CitusCluster->new(conf => q{
idempotency.databases = 'no_such_database'
idempotency.publish_batch_size = 1
});
my $c = $cluster->coordinator;
my ($w1) = $cluster->workers;

sub call { return $c->safe_psql('postgres', $_[0]); }
sub shard_of { return call(qq{SELECT get_shard_id_for_distribution_column('idempotency.outbox', '$_[0]'::text)}); }

# two topics whose shards are both on w1, and not the same shard
my @on_w1 = grep { $cluster->node_of('idempotency.outbox', $_)->port == $w1->port }
  map { "topic-$_" } 1 .. 60;
my $first = $on_w1[0];
my ($second) = grep { shard_of($_) ne shard_of($first) } @on_w1;
die 'no two shards on worker1' unless defined $second;

for my $topic ($first, $second)
{
	call(qq{SELECT idempotency.idem_outbox_route('$topic', 'notify')});
	call(qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": $_}')}) for 1 .. 2;
}

is($w1->safe_psql('postgres', q{SELECT published FROM idempotency.idem_run_maintenance()}),
	'2', "idem_run_maintenance() on the shards' node publishes a batch of one row of each");
is(call(qq{
	SELECT string_agg(topic || ':' || count, ',' ORDER BY topic) FROM (
		SELECT topic, count(*) FILTER (WHERE published_at IS NULL)
		FROM idempotency.outbox WHERE topic IN ('$first', '$second') GROUP BY topic) t}),
	join(',', map { "$_:1" } sort ($first, $second)),
	'... one of each shard, not two of the first: each has one left');

# With a default route, the walk across the topics on each shard: a round
# starts at the shard's oldest unpublished row (the statements run on the
# shards under their names), and every row goes out, one batch of each
# shard a call.
call(q{SELECT idempotency.idem_outbox_route('*', 'notify')});
for my $topic ($first, $second)
{
	call(qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": $_}')}) for 3 .. 5;
}
is($w1->safe_psql('postgres', q{SELECT published FROM idempotency.idem_run_maintenance()}),
	'2', 'with a default route too, a batch of one row of each shard');
my $published = 2;
for (1 .. 10)
{
	my $n = $w1->safe_psql('postgres', q{SELECT published FROM idempotency.idem_run_maintenance()});
	last if $n == 0;
	$published += $n;
}
is($published, 8, '... and then the rest, the rows of both topics');
is(call(qq{SELECT count(*) FROM idempotency.outbox
		   WHERE topic IN ('$first', '$second') AND published_at IS NULL}),
	'0', '... none left');

$cluster->stop;
done_testing();
