# The outbox's statements on Citus shards, nested: a route's function that
# calls the pull API on another shard of its node, whose call fails and is
# caught by the function (an EXCEPTION block), must leave the worker's batch
# on its own shard.  The batch's next statements (the row's published mark)
# then still run on the shard the row came from, so that the row is
# published once, not again at every batch.

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
sub shard_of
{
	return call(qq{SELECT get_shard_id_for_distribution_column('idempotency.outbox', '$_[0]')});
}

# two topics of worker 1, in two shards: the routed one, and the other
# that its route's function fetches from
my @on_w1 = grep { $cluster->node_of('idempotency.outbox', $_)->port == $w1->port }
  map { "topic-$_" } 1 .. 60;
my $routed = $on_w1[0];
my ($other) = grep { shard_of($_) ne shard_of($routed) } @on_w1;
die 'no two shards on worker 1' unless defined $other;

# The route's function logs each call, and fetches two rows of one key of
# the other topic, the second of which another session holds: the fetch
# fails on its lock_timeout after it began on the other topic's shard, and
# the function carries on.  (On every node, as idem_outbox_route checks it
# on the node it is called on.)
$_->safe_psql('postgres', qq{
	SET citus.enable_ddl_propagation = off;
	CREATE TABLE public.calls (id bigint, caught boolean);
	CREATE FUNCTION public.fetch_other(e idempotency.outbox) RETURNS void
	LANGUAGE plpgsql AS \$\$
	BEGIN
		BEGIN
			PERFORM set_config('lock_timeout', '10ms', true);
			PERFORM * FROM idempotency.idem_outbox_fetch('$other', 10, '30s', 10);
			INSERT INTO public.calls VALUES (e.id, false);
		EXCEPTION WHEN lock_not_available THEN
			INSERT INTO public.calls VALUES (e.id, true);
		END;
	END \$\$;}) for ($c, $w1, $w2);

call(qq{SELECT idempotency.idem_outbox_enqueue('$other', '{"n": $_}', 'k')}) for 1 .. 2;
my $held = call(qq{SELECT max(id) FROM idempotency.outbox WHERE topic = '$other'});
my $holder = $w1->background_psql('postgres');
$holder->query_safe(qq{BEGIN;
	SELECT id FROM idempotency.outbox_@{[ shard_of($other) ]} WHERE id = $held FOR UPDATE});

call(qq{SELECT idempotency.idem_outbox_route('$routed', 'function', 'public.fetch_other(idempotency.outbox)')});
my $id = call(qq{SELECT idempotency.idem_outbox_enqueue('$routed', '{"n": 1}', 'k')});

# published once: gone from its shard (outbox_retention is 0), or called
# again (the published mark went to another shard)
$w1->poll_query_until('postgres', qq{
	SELECT count(*) > 1 OR NOT EXISTS (SELECT FROM idempotency.outbox_@{[ shard_of($routed) ]}
	                                   WHERE id = $id)
	FROM public.calls})
  or die 'the row was neither published nor called again';
is($w1->safe_psql('postgres', q{SELECT string_agg(caught::text, ',') FROM public.calls}), 'true',
	"the route's function was called once, and caught the other shard's error");
is($w1->safe_psql('postgres', qq{SELECT count(*) FROM idempotency.outbox_@{[ shard_of($routed) ]}}),
	'0', 'the row is gone from its shard, published');
is($w1->safe_psql('postgres', qq{SELECT string_agg(state, ',' ORDER BY id)
	FROM idempotency.outbox_@{[ shard_of($other) ]}}),
	'pending,pending', "the other topic's rows are as they were");

$holder->query_safe('ROLLBACK');
$holder->quit;
$cluster->stop;
done_testing();
