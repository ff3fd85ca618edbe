# On a hot standby the extension's workers do nothing (they cannot write):
# no launcher, no worker.  After promotion the worker starts by itself and
# publishes what was waiting.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '200ms'
});
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (id bigint);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'INSERT INTO public.sink VALUES (e.id)';
});
$primary->backup('backup');

my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->start;

# rows that wait for a route: the primary's worker leaves them alone
$primary->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('later', jsonb_build_object('n', n), 'k')
	FROM generate_series(1, 3) n;
	SELECT idempotency.idem_outbox_route('later', 'function', 'sink_it');
});
$primary->wait_for_catchup($standby);
$primary->stop;

# The launcher is registered to start when recovery finishes: it does not
# start on a hot standby.  Checked twice: nothing runs now, and, after the
# promotion, the standby's log shows the launcher starting only after the
# promotion's new timeline (a launcher started during recovery would have
# logged before it).
is($standby->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'"),
	'0', 'a hot standby runs no idempotency worker');
ok($standby->safe_psql('postgres', 'SELECT idempotency.idem_is_processed(\'c\', \'e\')') eq 'f',
	'read-only functions work on the standby');

$standby->promote;
ok($standby->poll_query_until('postgres',
		"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'"),
	'after promotion the worker starts');
my $log = slurp_file($standby->logfile);
my $promoted = index($log, 'selected new timeline ID');
my $launched = index($log, 'idempotency launcher started');
ok($promoted >= 0 && $launched > $promoted,
	'the launcher started after the promotion, not during recovery');
ok($standby->poll_query_until('postgres', 'SELECT count(*) = 3 FROM sink'),
	'and publishes the rows that were waiting');
is($standby->safe_psql('postgres', 'SELECT count(*) FROM idempotency.outbox'),
	'0', 'nothing is left in the outbox');

$standby->stop;
done_testing();
