# A Citus cluster for the t/citus suite: a coordinator and two workers, each
# a PostgreSQL::Test::Cluster that preloads citus and idempotency, with the
# extension's tables distributed beside an application's table by tenant
# (idem_distribute), as the README's Citus section sets them up.

package CitusCluster;

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;

sub node
{
	my ($name, $conf) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);
	# wal_level = logical: shard moves copy by logical replication
	$node->init(allows_streaming => 'logical');
	$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'citus,idempotency'
max_connections = 150
max_worker_processes = 32
max_replication_slots = 16
max_wal_senders = 16
citus.shard_count = 4
citus.shard_replication_factor = 1
citus.local_hostname = '@{[ $node->host ]}'
idempotency.purge_interval = '1s'
$conf
});
	$node->start;
	$node->safe_psql('postgres', 'CREATE EXTENSION citus');
	return $node;
}

# The coordinator and two workers, the application's table "payments"
# distributed by tenant (text COLLATE "C"), and the extension distributed
# with it.  conf, if given, is added to every node's postgresql.conf.
sub new
{
	my ($class, %options) = @_;
	my $conf = $options{conf} // '';
	my $self = bless {}, $class;
	$self->{coordinator} = node('coordinator', $conf);
	$self->{workers} = [ node('worker1', $conf), node('worker2', $conf) ];

	my $c = $self->{coordinator};
	my $host = $c->host;
	$c->safe_psql('postgres', "SELECT citus_set_coordinator_host('$host', @{[ $c->port ]})");
	$c->safe_psql('postgres', "SELECT citus_add_node('$host', @{[ $_->port ]})")
	  for @{ $self->{workers} };
	$c->safe_psql('postgres', q{
		CREATE EXTENSION idempotency;
		CREATE TABLE payments (tenant text COLLATE "C" NOT NULL, id int, amount int,
			PRIMARY KEY (tenant, id));
		SELECT create_distributed_table('payments', 'tenant');
		SELECT idempotency.idem_distribute('payments');
	});
	return $self;
}

sub coordinator { return $_[0]->{coordinator}; }
sub workers { return @{ $_[0]->{workers} }; }

# The worker node whose shard of table holds value.
sub node_of
{
	my ($self, $table, $value) = @_;
	my $port = $self->coordinator->safe_psql('postgres', qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		WHERE p.shardid = get_shard_id_for_distribution_column('$table', '$value'::text)});
	my ($node) = grep { $_->port == $port } $self->workers;
	die "no worker on port $port" unless $node;
	return $node;
}

# A value of the distribution column whose shard is on worker (from a list
# of candidates).
sub value_on
{
	my ($self, $table, $worker, @candidates) = @_;
	for my $value (@candidates)
	{
		return $value if $self->node_of($table, $value)->port == $worker->port;
	}
	die "no candidate on worker " . $worker->name;
}

# The outcome of a claim_result as a distributed call returns it, "(claimed,...)".
sub outcome
{
	my ($row) = @_;
	return $row =~ /^\(([a-z_]+),/ ? $1 : "?$row";
}

sub stop
{
	my ($self) = @_;
	$_->stop for ($self->coordinator, $self->workers);
}

1;
