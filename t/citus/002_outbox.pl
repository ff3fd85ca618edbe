# The outbox on a Citus cluster (a coordinator and two workers), distributed
# by topic with idem_distribute(): the background worker of each node
# publishes the rows of the shards placed on it, in order per key, each row
# once, and purges them once published; the pull API works through the
# coordinator, a fetch on the node of its topic's shard and an ack, nack,
# requeue or discard on the nodes of its rows' shards, in the caller's
# transaction; and a shard's rows follow it when it moves, none lost and
# none published twice.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use CitusCluster;
use PostgreSQL::Test::Utils;
use Test::More;

# one attempt: a nack makes a row dead, for requeue and discard; published
# rows are kept a second, then purged
my $cluster = CitusCluster->new(conf => q{
idempotency.outbox_max_attempts = 1
idempotency.outbox_retention = '1s'
});
my $c = $cluster->coordinator;
my ($w1, $w2) = $cluster->workers;

sub call { return $c->safe_psql('postgres', $_[0]); }

# Each node logs what its worker publishes through the route's function: a
# table of its own (not a Citus one) and the function, on every node.
for my $node ($c, $w1, $w2)
{
	$node->safe_psql('postgres', q{
		SET citus.enable_ddl_propagation = off;
		CREATE TABLE public.published_log (seq bigserial, node int, id bigint, topic text,
			key text, n int);
		CREATE FUNCTION public.log_event(e idempotency.outbox) RETURNS void
		LANGUAGE sql AS $$
			INSERT INTO public.published_log (node, id, topic, key, n)
			SELECT groupid, e.id, e.topic, e.key, (e.payload->>'n')::int FROM pg_dist_local_group
		$$;});
}
sub group_of { return $_[0]->safe_psql('postgres', 'SELECT groupid FROM pg_dist_local_group'); }

# What node logged of topic: "n,n,..." in the order published.
sub logged
{
	my ($node, $topic) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT coalesce(string_agg(n::text, ',' ORDER BY seq), '') FROM public.published_log
		WHERE topic = '$topic'});
}

sub enqueue
{
	my ($topic, @ns) = @_;
	call(qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": $_}', 'k')}) for @ns;
}

my @topics = map { "topic-$_" } 1 .. 60;
my @on_w1 = grep { $cluster->node_of('idempotency.outbox', $_)->port == $w1->port } @topics;
my @on_w2 = grep { $cluster->node_of('idempotency.outbox', $_)->port == $w2->port } @topics;
my ($routed1, $pull1, $moved) = @on_w1[ 0 .. 2 ];
my ($routed2, $pull2) = @on_w2[ 0 .. 1 ];

# --- publishing: each worker publishes its shards' rows, in order, once
for my $topic ($routed1, $routed2)
{
	call(qq{SELECT idempotency.idem_outbox_route('$topic', 'function', 'public.log_event(idempotency.outbox)')});
}
enqueue($routed1, 1 .. 5);
enqueue($routed2, 1 .. 5);
$w1->poll_query_until('postgres',
	qq{SELECT count(*) = 5 FROM public.published_log WHERE topic = '$routed1'})
  or die 'worker 1 did not publish its topic';
$w2->poll_query_until('postgres',
	qq{SELECT count(*) = 5 FROM public.published_log WHERE topic = '$routed2'})
  or die 'worker 2 did not publish its topic';
is(logged($w1, $routed1), '1,2,3,4,5', "worker 1's worker publishes its shard's rows in order");
is(logged($w2, $routed2), '1,2,3,4,5', "worker 2's worker publishes its shard's rows in order");
is($w1->safe_psql('postgres', q{SELECT count(DISTINCT node) || ':' || min(node) FROM public.published_log}),
	'1:' . group_of($w1), "each by the node's own worker");
is(logged($w1, $routed2) . logged($w2, $routed1) . logged($c, $routed1) . logged($c, $routed2), '',
	'no node publishes another node\'s rows');
is($w1->safe_psql('postgres', q{SELECT pg_relation_size('idempotency.outbox')}), '0',
	"the workers' shell tables stay empty");

# published rows are kept for outbox_retention, then purged on their node
$c->poll_query_until('postgres', qq{
	SELECT count(*) = 0 FROM idempotency.outbox WHERE topic IN ('$routed1', '$routed2')})
  or die 'the published rows were not purged';
pass('published rows are purged from the shards once outbox_retention has passed');

# --- the pull API through the coordinator
enqueue($pull1, 1 .. 3);
enqueue($pull2, 1 .. 3);
my $fetched1 = call(qq{
	SELECT string_agg(id || ':' || attempts, ' ' ORDER BY id)
	FROM idempotency.idem_outbox_fetch('$pull1', 10, '30s', 10)});
my $fetched2 = call(qq{
	BEGIN;
	SELECT string_agg(id || ':' || attempts, ' ' ORDER BY id)
	FROM idempotency.idem_outbox_fetch('$pull2', 2, '30s', 10);
	COMMIT;});
$fetched2 = (split /\n/, $fetched2)[-1] // '';
is(scalar(split / /, $fetched1), 3, 'a fetch through the coordinator hands out its topic\'s rows');
is(scalar(split / /, $fetched2), 2, 'and so does one inside a transaction block, up to its batch');
is(call(qq{SELECT count(*) FROM idempotency.outbox WHERE state = 'leased'}), '5',
	'the rows handed out are leased in their shards');

# one fenced ack names rows of both workers' topics
my @pairs = map { [ split /:/ ] } split / /, "$fetched1 $fetched2";
my $ids = join ',', map { $_->[0] } @pairs;
my $attempts = join ',', map { $_->[1] } @pairs;
is(call(qq{SELECT idempotency.idem_outbox_ack('{$ids}', '{$attempts}')}), '5',
	'an ack through the coordinator acknowledges rows on both workers');
is(call(qq{SELECT idempotency.idem_outbox_ack('{$ids}', '{$attempts}')}), '0',
	'and again, nothing: they are published');
is(call(qq{SELECT string_agg(state, ',') FROM idempotency.outbox WHERE topic IN ('$pull1', '$pull2') AND state <> 'published'}),
	'pending', "the last row of the second topic waits for its turn");

# a nack on the last attempt makes the row dead; requeue, then discard it
my ($last) = split /:/, call(qq{
	SELECT id || ':' || attempts FROM idempotency.idem_outbox_fetch('$pull2', 10, '30s', 10)});
is(call(qq{SELECT idempotency.idem_outbox_nack($last, 'broker down', 1)}), 't',
	'a fenced nack through the coordinator');
is(call(qq{SELECT state || ':' || last_error FROM idempotency.outbox WHERE id = $last}),
	'dead:broker down', 'makes the row dead on its last attempt, with the error');
is(call(qq{SELECT idempotency.idem_outbox_nack($last, 'again', 1)}), 'f',
	'a second nack finds it not leased');
is(call(qq{SELECT idempotency.idem_outbox_requeue($last)}), 't', 'a requeue through the coordinator');
is(call(qq{SELECT state || ':' || attempts || ':' || failures FROM idempotency.outbox WHERE id = $last}),
	'pending:1:0', 'makes it pending again, its failures reset and its attempts (the fence) kept');
call(qq{SELECT count(*) FROM idempotency.idem_outbox_fetch('$pull2')});
call(qq{SELECT idempotency.idem_outbox_nack($last, 'still down')});
is(call(qq{SELECT idempotency.idem_outbox_discard($last)}), 't', 'a discard through the coordinator');
is(call(qq{SELECT count(*) FROM idempotency.outbox WHERE id = $last}), '0', 'deletes the dead row');
is(call(q{SELECT idempotency.idem_outbox_ack('{}', '{}')}), '0', 'an empty ack acknowledges nothing');
my ($ret, $out, $err) = $c->psql('postgres',
	q{SELECT idempotency._outbox_on_shard('x', 'merge', '{1}', NULL, NULL)});
like($err, qr/"merge" is not a call of the outbox's rows/, 'the internal function checks its call');

# --- a shard move: the rows follow their shard, none lost, none twice
enqueue($moved, 1 .. 4);
my ($first) = split /:/, call(qq{
	SELECT id || ':' || attempts FROM idempotency.idem_outbox_fetch('$moved', 1)});
is(call(qq{SELECT idempotency.idem_outbox_ack('{$first}')}), '1',
	"the moving topic's first row is taken by a relay before the move");
my $shard = call(qq{SELECT get_shard_id_for_distribution_column('idempotency.outbox', '$moved')});
call(qq{SELECT citus_move_shard_placement($shard, '@{[ $w1->host ]}', @{[ $w1->port ]},
	'@{[ $w2->host ]}', @{[ $w2->port ]})});
is($cluster->node_of('idempotency.outbox', $moved)->port, $w2->port, 'the outbox shard moved');
my ($second, $n, $tries) = split /:/, call(qq{
	SELECT id || ':' || (payload->>'n') || ':' || attempts
	FROM idempotency.idem_outbox_fetch('$moved', 1)});
is("$n:$tries", '2:1', 'a fetch through the coordinator finds the next row on the new node');
is(call(qq{SELECT idempotency.idem_outbox_nack($second, 'retry on the worker')}), 't',
	'a nack through the coordinator reaches it there');
is(call(qq{SELECT idempotency.idem_outbox_requeue($second)}), 't', 'and so does a requeue');
call(qq{SELECT idempotency.idem_outbox_route('$moved', 'function', 'public.log_event(idempotency.outbox)')});
$w2->poll_query_until('postgres',
	qq{SELECT count(*) = 3 FROM public.published_log WHERE topic = '$moved'})
  or die 'the new node did not publish the moved rows';
is(logged($w2, $moved), '2,3,4', 'the new node publishes the rest, in order');
is(logged($w1, $moved), '', 'the old node published none of them');
$c->poll_query_until('postgres', qq{SELECT count(*) = 0 FROM idempotency.outbox WHERE topic = '$moved'})
  or die 'the moved rows were not purged';
enqueue($moved, 5);
$w2->poll_query_until('postgres',
	qq{SELECT count(*) = 4 FROM public.published_log WHERE topic = '$moved'})
  or die 'the new node did not publish a row enqueued after the move';
is(logged($w2, $moved), '2,3,4,5', 'and the rows enqueued after the move');

# --- a topic's ids keep growing across a move to a node whose sequence is
# behind: the rows it brings keep their ids, and the next come after them
$w2->safe_psql('postgres', q{SELECT setval('idempotency.outbox_id_seq', 1000000)});
call(qq{SELECT idempotency.idem_outbox_route('$moved', 'none')});
enqueue($moved, 6);
call(qq{SELECT citus_move_shard_placement($shard, '@{[ $w2->host ]}', @{[ $w2->port ]},
	'@{[ $w1->host ]}', @{[ $w1->port ]})});
is($cluster->node_of('idempotency.outbox', $moved)->port, $w1->port, 'the outbox shard moved back');
enqueue($moved, 7, 8);
is(call(qq{SELECT string_agg(payload->>'n', ',' ORDER BY id) FROM idempotency.outbox
	WHERE topic = '$moved' AND published_at IS NULL}), '6,7,8',
	'rows enqueued after the move get ids above those the shard brought');
is(call(qq{SELECT string_agg(DISTINCT (id & 65535)::text, ',') FROM idempotency.outbox
	WHERE topic = '$moved' AND published_at IS NULL}), join(',', sort (group_of($w1), group_of($w2))),
	"each id carries its node's group in its low 16 bits");
call(qq{SELECT idempotency.idem_outbox_route('$moved', 'function', 'public.log_event(idempotency.outbox)')});
$w1->poll_query_until('postgres',
	qq{SELECT count(*) = 3 FROM public.published_log WHERE topic = '$moved'})
  or die 'the node did not publish the rows after the second move';
is(logged($w1, $moved), '6,7,8', 'and they are published in that order');

$cluster->stop;
done_testing();
