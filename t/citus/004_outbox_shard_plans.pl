# The plans of the outbox's statements on a Citus shard, which a backend
# keeps per shard: when the shard moves away and back (a new table under the
# same name), a backend that lives through it (a relay's connection, the
# background worker) plans the statements for the new table and frees those
# of the old one, rather than keep the plans of every shard it ever saw.

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

sub call { return $c->safe_psql('postgres', $_[0]); }

my $topic = $cluster->value_on('idempotency.outbox', $w1, map { "topic-$_" } 1 .. 60);
my $shard = call(qq{SELECT get_shard_id_for_distribution_column('idempotency.outbox', '$topic')});

# one connection to worker 1 that fetches the topic there, and counts the
# plans it keeps of statements on the shard
my $relay = $w1->background_psql('postgres');
sub fetch_and_count_plans
{
	call(qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{}')});
	$relay->query_safe(qq{SELECT count(*) FROM idempotency.idem_outbox_fetch('$topic', 10, '1s')});
	return $relay->query_safe(qq{
		SELECT count(*) FROM pg_backend_memory_contexts
		WHERE name = 'CachedPlanSource' AND ident LIKE '%idempotency.outbox_$shard %'});
}

sub move
{
	my ($from, $to) = @_;
	call(q{CALL citus_cleanup_orphaned_resources()});
	call(qq{SELECT citus_move_shard_placement($shard, '@{[ $from->host ]}', @{[ $from->port ]},
		'@{[ $to->host ]}', @{[ $to->port ]})});
	is($cluster->node_of('idempotency.outbox', $topic)->port, $to->port,
		'the shard moved to ' . $to->name);
}

my $planned = fetch_and_count_plans();
ok($planned > 0, "the relay's backend keeps the plans of its fetch on the shard ($planned)");

move($w1, $w2);
move($w2, $w1);
is(fetch_and_count_plans(), $planned,
	'after the shard moved away and back, its statements are planned once, for the new table');
move($w1, $w2);
move($w2, $w1);
is(fetch_and_count_plans(), $planned, 'and again');

$relay->quit;
$cluster->stop;
done_testing();
