# make bench-citus: claim + complete, replay and enqueue through a Citus
# coordinator (each call delegated to the worker of its tenant's, or topic's,
# shard) against, in the same run:
#
# - Citus's own router statements of the same shape through the same
#   coordinator (issue 31, item 3; goal 0.8 each), on tables distributed
#   by the same column and colocated with ours: claim + complete against
#   BEGIN, INSERT ... ON CONFLICT DO NOTHING on the distribution key and
#   the primary key, an UPDATE of that row, COMMIT; replay against a
#   SELECT of a stored row by the same two columns; enqueue against an
#   INSERT of the same payload and key into a table distributed by topic,
#   its id from a sequence as the outbox's;
# - the same workloads of ours on one plain PostgreSQL with the extension
#   (what the routing costs, with no bar).
#
# The cluster is t/citus's (t/citus/CitusCluster.pm: a coordinator and two
# workers, the extension distributed beside a table of payments by tenant);
# the plain node has the same settings without Citus.  pgbench -M prepared,
# BENCH_CLIENTS clients (4) for BENCH_SECONDS (15 s) a run, BENCH_ROUNDS
# rounds (3), the sides in turn, which goes first rotating with the round;
# a figure is the median of the rounds' tps, a ratio the median of the
# rounds' ratios (ours through the coordinator / the other side).
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

# a tenant per client (of 16), spread over the shards; a new key each transaction
my $dir = $coordinator->basedir;
append_to_file("$dir/claim_complete.sql", q{
\set n random(1, 9000000000000000000)
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
# one event on the client's topic (of 16), with one of 50 ordering keys
append_to_file("$dir/enqueue.sql", q{
\set k random(0, 49)
SELECT idempotency.idem_outbox_enqueue('topic-' || (:client_id % 16), '{"order": 1, "sku": "A-1"}', 'key-' || :k);
});

# Citus's own router statements of the same shapes, on tables distributed
# and colocated as ours are (keys by scope, the outbox by topic)
$coordinator->safe_psql('postgres', q{
	CREATE TABLE router_keys (scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
		status_code int, body text, PRIMARY KEY (scope, key));
	SELECT create_distributed_table('router_keys', 'scope', colocate_with => 'idempotency.keys');
	CREATE TABLE router_events (topic text COLLATE "C" NOT NULL, id bigserial,
		key text COLLATE "C", payload jsonb NOT NULL, PRIMARY KEY (topic, id));
	SELECT create_distributed_table('router_events', 'topic', colocate_with => 'idempotency.outbox');
});
append_to_file("$dir/router_claim_complete.sql", q{
\set n random(1, 9000000000000000000)
BEGIN;
INSERT INTO router_keys (scope, key) VALUES ('tenant-' || (:client_id % 16), 'k-' || :n || '-' || :client_id) ON CONFLICT (scope, key) DO NOTHING;
UPDATE router_keys SET status_code = 201, body = 'ok' WHERE scope = 'tenant-' || (:client_id % 16) AND key = 'k-' || :n || '-' || :client_id;
COMMIT;
});
append_to_file("$dir/router_replay.sql", q{
\set n random(1, 100)
SELECT status_code, body FROM router_keys WHERE scope = 'tenant-' || (:n % 16) AND key = 'r-' || :n;
});
# For the profile of the enqueue, Citus's own delegation of a function
# call with the router INSERT in it (PL/pgSQL, colocated, force_delegation,
# as ours): ours against it is what our function does beyond the insert
# (the per-key lock, the id, the shard's checks); it against the router
# INSERT is what the delegation costs.  No goal.
$coordinator->safe_psql('postgres', q{
	CREATE FUNCTION bench_delegated_insert(topic text, key text, payload jsonb) RETURNS void
	LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO router_events (topic, key, payload) VALUES (topic, key, payload);
	END $$;
	SELECT create_distributed_function('bench_delegated_insert(text, text, jsonb)', 'topic',
		colocate_with => 'router_events', force_delegation => true);
});
append_to_file("$dir/delegated_enqueue.sql", q{
\set k random(0, 49)
SELECT bench_delegated_insert('topic-' || (:client_id % 16), 'key-' || :k, '{"order": 1, "sku": "A-1"}');
});
append_to_file("$dir/router_enqueue.sql", q{
\set k random(0, 49)
INSERT INTO router_events (topic, key, payload) VALUES ('topic-' || (:client_id % 16), 'key-' || :k, '{"order": 1, "sku": "A-1"}');
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
$coordinator->safe_psql('postgres', q{
	INSERT INTO router_keys SELECT 'tenant-' || (n % 16), 'r-' || n, 200, 'stored'
	FROM generate_series(1, 100) n;
});
is($coordinator->safe_psql('postgres',
		q{SELECT count(*) FROM router_keys WHERE key LIKE 'r-%' AND status_code = 200}),
	'100', 'the router rows to read are stored');
# Citus's side is its router path, one shard a statement, as pgbench sends
# it (prepared, the scope an expression of a parameter; past the five
# executions after which plancache.c weighs a generic plan, which Citus
# makes too dear to be taken for such a statement): not a multi-shard plan,
# which would make our ratio look better than it is
for my $statement (
	q{SELECT status_code, body FROM router_keys WHERE scope = 'tenant-' || ($1 % 16) AND key = 'r-' || $1},
	q{UPDATE router_keys SET status_code = 201, body = 'ok' WHERE scope = 'tenant-' || ($1 % 16) AND key = 'k-' || $1},
	q{INSERT INTO router_events (topic, key, payload) VALUES ('topic-' || ($1 % 16), 'key-' || ($1 % 50), '{}')})
{
	my $plan = $coordinator->safe_psql('postgres',
		"BEGIN; PREPARE s(int) AS $statement; " . ("EXECUTE s(5); " x 6)
		  . "EXPLAIN (COSTS OFF) EXECUTE s(5); ROLLBACK");
	like($plan, qr/Task Count: 1\b/, "one shard: $statement") or diag($plan);
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
	# a client that failed (pgbench stops it) would leave the figure to the
	# others: a figure counts every client or none
	die "pgbench: clients aborted against " . $node->name . ": $err" if $err =~ /aborted/;
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

# the sides of each workload: ours through the coordinator first, then
# what it is measured against
my %sides = (
	citus => [ $coordinator, '', '' ],
	router => [ $coordinator, 'router_', "Citus's router statements" ],
	delegated => [ $coordinator, 'delegated_', "Citus's delegated INSERT" ],
	one => [ $plain, '', 'one node' ]);
my %against = (
	claim_complete => [ 'router', 'one' ],
	replay => [ 'router', 'one' ],
	enqueue => [ 'router', 'delegated', 'one' ]);
my %summary;
for my $workload ('claim_complete', 'replay', 'enqueue')
{
	my @order = ('citus', @{ $against{$workload} });
	my (%tps, %ratios);
	for my $round (1 .. $rounds)
	{
		for my $side (@order)
		{
			my ($node, $prefix) = @{ $sides{$side} }[ 0, 1 ];
			push @{ $tps{$side} }, tps($node, "$dir/$prefix$workload.sql");
		}
		push @{ $ratios{$_} }, $tps{citus}[-1] / $tps{$_}[-1] for @{ $against{$workload} };
		push @order, shift @order;
	}
	for my $against (@{ $against{$workload} })
	{
		my $ratio = median(@{ $ratios{$against} });
		my $bar = $against eq 'router' ? ' (goal 0.80)' : '';
		diag(sprintf("%-15s through the coordinator %8.0f tps, %-25s %8.0f tps, ratio %.2f%s (rounds %s)",
				$workload, median(@{ $tps{citus} }), $sides{$against}[2],
				median(@{ $tps{$against} }), $ratio, $bar,
				join(' ', map { sprintf('%.2f', $_) } @{ $ratios{$against} })));
		my $name = $against eq 'one' ? 'one_node' : $against;
		$summary{"${workload}_citus_vs_$name"} = sprintf('%.3f', $ratio) + 0;
		$summary{"${workload}_${name}_tps"} = int(median(@{ $tps{$against} }));
	}
	$summary{"${workload}_citus_tps"} = int(median(@{ $tps{citus} }));
}
diag('{' . join(', ', map { "\"$_\": $summary{$_}" } sort keys %summary) . '}');

$cluster->stop;
$plain->stop;
done_testing();
