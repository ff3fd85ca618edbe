# Outbox ids on Citus, after a topic's shard came to a node whose sequence
# is behind the topic's ids (here: the node's sequence set back, as it is
# after a move from a node whose sequence was ahead): the enqueues that move
# the sequence past the topic's last id must not deadlock with each other.
# Two transactions enqueue into the topic at once, one of which enqueued
# into another topic first: both commit, and the topic's ids keep growing.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use CitusCluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $cluster = CitusCluster->new;
my $c = $cluster->coordinator;
my ($w1, $w2) = $cluster->workers;

my @on_w1 = grep { $cluster->node_of('idempotency.outbox', $_)->port == $w1->port }
  map { "topic-$_" } 1 .. 60;
my ($topic, $other) = @on_w1[ 0 .. 1 ];

$w1->safe_psql('postgres', q{SELECT setval('idempotency.outbox_id_seq', 1000)});
$c->safe_psql('postgres', qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": 0}', 'k')});
$w1->safe_psql('postgres', q{SELECT setval('idempotency.outbox_id_seq', 1)});

my $first = $w1->background_psql('postgres', on_error_stop => 0);
my $second = $w1->background_psql('postgres', on_error_stop => 0);

# the second holds the sequence as any enqueue does, until it commits
$second->query_safe(qq{BEGIN; SELECT idempotency.idem_outbox_enqueue('$other', '{}')});
# the first waits for it, to move the sequence past the topic's ids
$first->query_until(qr/enqueuing/, qq{BEGIN;
\\echo enqueuing
SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": 1}', 'a');
});
$w1->poll_query_until('postgres', q{
	SELECT count(*) > 0 FROM pg_locks
	WHERE relation = 'idempotency.outbox_id_seq'::regclass AND NOT granted})
  or die 'the first enqueue did not wait for the sequence';
# and the second enqueues into the topic too
my ($out, $failed_second) = $second->query(
	qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": 2}', 'b'); COMMIT;});
my $error = $second->{stderr};
my ($out1, $failed_first) = $first->query('COMMIT');
$error .= $first->{stderr};

is($failed_first + $failed_second, 0, 'both transactions commit') or diag($error);
is($c->safe_psql('postgres', qq{
	SELECT string_agg(payload->>'n', ',' ORDER BY id) FROM idempotency.outbox
	WHERE topic = '$topic'}), '0,2,1', "the topic's new ids come after its last one");

# a batch into the topic, with the node's sequence behind again: its ids
# grow from the first, which comes after the topic's last
$w1->safe_psql('postgres', q{SELECT setval('idempotency.outbox_id_seq', 1)});
$c->safe_psql('postgres', qq{SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('$topic',
	ARRAY['{"n": 3}', '{"n": 4}', '{"n": 5}']::jsonb[])});
is($c->safe_psql('postgres', qq{
	SELECT string_agg(payload->>'n', ',' ORDER BY id) FROM idempotency.outbox
	WHERE topic = '$topic'}), '0,2,1,3,4,5', "and so do a batch's");
is($c->safe_psql('postgres', q{SELECT count(DISTINCT id) = count(*) FROM idempotency.outbox}),
	't', 'every id is unique');

$first->quit;
$second->quit;
$cluster->stop;
done_testing();
