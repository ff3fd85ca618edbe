# The pull API on a distributed outbox, called through the coordinator by a
# relay's role that has EXECUTE on the functions and nothing else, as
# README.md grants it: a fetch, a fenced ack and a nack reach the rows on
# their workers (the ack and the nack find their rows' topics as the
# owner of the tables, and have them done by the internal function, which
# the relay may not call itself).

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
sub as_relay { return $c->safe_psql('postgres', $_[0], extra_params => [ '-U', 'relay' ]); }

call(q{
	CREATE ROLE relay LOGIN;
	GRANT USAGE ON SCHEMA idempotency TO relay;
	GRANT EXECUTE ON FUNCTION
		idempotency.idem_outbox_fetch(text, integer, interval, integer),
		idempotency.idem_outbox_ack(bigint[], integer[]),
		idempotency.idem_outbox_nack(bigint, text, integer)
	  TO relay;});

my @topics = map { "topic-$_" } 1 .. 60;
my $t1 = $cluster->value_on('idempotency.outbox', $w1, @topics);
my $t2 = $cluster->value_on('idempotency.outbox', $w2, @topics);
for my $topic ($t1, $t2)
{
	call(qq{SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": $_}', 'k$_')}) for 1 .. 2;
}

my @pairs = map { [ split /:/ ] } split /\n/, as_relay(qq{
	SELECT id || ':' || attempts FROM idempotency.idem_outbox_fetch('$t1', 10, '30s', 1)});
my @more = map { [ split /:/ ] } split /\n/, as_relay(qq{
	SELECT id || ':' || attempts FROM idempotency.idem_outbox_fetch('$t2', 10, '30s', 1)});
is(scalar(@pairs) . ':' . scalar(@more), '2:2', "the relay fetches each worker's topic");

my ($nacked, @acked) = (@pairs, @more);
my $ids = join ',', map { $_->[0] } @acked;
my $attempts = join ',', map { $_->[1] } @acked;
is(as_relay(qq{SELECT idempotency.idem_outbox_ack('{$ids}', '{$attempts}')}), '3',
	"the relay's fenced ack acknowledges rows on both workers");
is(as_relay(qq{SELECT idempotency.idem_outbox_nack($nacked->[0], 'later', $nacked->[1])}), 't',
	"the relay's fenced nack");
my ($ret, $out, $err) = $c->psql('postgres',
	qq{SELECT idempotency._outbox_on_shard('$t1', 'ack', '{$nacked->[0]}', NULL, NULL)},
	extra_params => [ '-U', 'relay' ]);
like($err, qr/permission denied/, 'the relay may not call the internal function itself');

$cluster->stop;
done_testing();
