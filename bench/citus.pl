# make bench-citus: claim + complete and replay through a Citus coordinator
# (each call delegated to the worker of its tenant's shard) against the same
# workloads on one plain PostgreSQL with the extension, in the same run.
#
# The cluster is t/citus's (t/citus/CitusCluster.pm: a coordinator and two
# workers, the extension distributed beside a table of payments by tenant);
# the plain node has the same settings without Citus.  pgbench -M prepared,
# BENCH_CLIENTS clients (4) for BENCH_SECONDS (15 s) a run, BENCH_ROUNDS
# rounds (3), the two sides alternating; a figure is the median of the
# rounds' tps, a ratio the median of the rounds' ratios (Citus / one node).
# Every server runs on this machine, so the coordinator's hop to its
# workers is a local socket, and the cluster's four processes share its
# cores: the ratio is what the routing costs here, not what a cluster of
# machines would do.  It ends with one JSON line, as make bench does.
#
# Needs the citus extension installed in the server (see
# doc/integrations/citus.md); without it, it says so and stops.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/../t/citus";

use CitusCluster;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $clients = $ENV{BENCH_CLIENTS} // 4;
my $seconds = $ENV{BENCH_SECONDS} // 15;
my $rounds = $ENV{BENCH_ROUNDS} // 3;

my $cluster = CitusCluster->new;
my $coordinator = $cluster->coordinator;
my $plain = PostgreSQL::Test::Cluster->new('plain');
$plain->init;
$plain->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idempotency'\nmax_connections = 150\n");
$plain->start;
$plain->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# 16 tenants, spread over the shards; a new key each transaction
my $dir = $coordinator->basedir;
append_to_file("$dir/claim_complete.sql", q{
\set n random(1, 1000000000)
BEGIN;
SELECT idempotency.idem_claim('tenant-' || (:client_id % 16), 'k-' || :n || '-' || :client_id);
SELECT idempotency.idem_complete('tenant-' || (:client_id % 16), 'k-' || :n || '-' || :client_id, 201, 'ok');
COMMIT;
});
# 100 completed keys, replayed at random
append_to_file("$dir/replay.sql", q{
\set n random(1, 100)
SELECT idempotency.idem_claim('tenant-' || (:n % 16), 'r-' || :n);
});
my $completed = join('', map {
	my $scope = 'tenant-' . ($_ % 16);
	"SELECT idempotency.idem_claim('$scope', 'r-$_');\n"
	  . "SELECT idempotency.idem_complete('$scope', 'r-$_', 200, 'stored');\n"
} 1 .. 100);
for my $node ($coordinator, $plain)
{
	$node->safe_psql('postgres', $completed);
	is($node->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.keys WHERE key LIKE 'r-%' AND status_code = 200"),
		'100', 'the keys to replay are completed on ' . $node->name);
}

# tps of one pgbench run of script against node
sub tps
{
	my ($node, $script) = @_;
	my ($out, $err) = run_command(
		[
			'pgbench', '-n', '-M', 'prepared', '-c', $clients, '-j', $clients,
			'-T', $seconds, '-f', $script,
			'-h', $node->host, '-p', $node->port, 'postgres'
		]);
	my ($tps) = $out =~ /tps = ([\d.]+) \(without initial connection time\)/;
	die "pgbench failed against " . $node->name . ": $err" unless defined $tps;
	return $tps;
}

sub median
{
	my @sorted = sort { $a <=> $b } @_;
	return @sorted % 2 ? $sorted[$#sorted / 2]
	  : ($sorted[@sorted / 2 - 1] + $sorted[@sorted / 2]) / 2;
}

my %summary;
for my $workload ('claim_complete', 'replay')
{
	my (@citus, @one, @ratios);
	for my $round (1 .. $rounds)
	{
		my %tps;
		for my $side ($round % 2 ? ('citus', 'one') : ('one', 'citus'))
		{
			$tps{$side} =
			  tps($side eq 'citus' ? $coordinator : $plain, "$dir/$workload.sql");
		}
		push @citus, $tps{citus};
		push @one, $tps{one};
		push @ratios, $tps{citus} / $tps{one};
	}
	my $ratio = median(@ratios);
	diag(sprintf("%-15s through the coordinator %8.0f tps, one node %8.0f tps, ratio %.2f (rounds %s)",
			$workload, median(@citus), median(@one), $ratio,
			join(' ', map { sprintf('%.2f', $_) } @ratios)));
	$summary{"${workload}_citus_tps"} = int(median(@citus));
	$summary{"${workload}_one_node_tps"} = int(median(@one));
	$summary{"${workload}_citus_vs_one_node"} = sprintf('%.3f', $ratio) + 0;
}
diag('{' . join(', ', map { "\"$_\": $summary{$_}" } sort keys %summary) . '}');

$cluster->stop;
$plain->stop;
done_testing();
