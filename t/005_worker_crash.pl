# An immediate shutdown in the middle of publishing: after the restart,
# no row routed to a function or to logical decoding is lost or published
# twice, because each row's publication commits together with its removal.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $rows = 3000;

my $node = PostgreSQL::Test::Cluster->new('crash');
$node->init(allows_streaming => 'logical');
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '100ms'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (id bigint);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'INSERT INTO public.sink VALUES (e.id)';
	SELECT idempotency.idem_outbox_route('to_function', 'function', 'sink_it');
	SELECT idempotency.idem_outbox_route('to_wal', 'logical', 'crash.test');
	SELECT pg_create_logical_replication_slot('crash_slot', 'test_decoding');
});

$node->safe_psql('postgres', qq{
	SELECT idempotency.idem_outbox_enqueue(t, jsonb_build_object('n', n), 'k' || n % 7)
	FROM generate_series(1, $rows) n, unnest(ARRAY['to_function', 'to_wal']) t;
});

# stop hard once publishing is under way but not finished
$node->poll_query_until('postgres', 'SELECT count(*) > 0 FROM sink')
  or die "publishing did not start";
my $published = $node->safe_psql('postgres', 'SELECT count(*) FROM sink');
$node->stop('immediate');
cmp_ok($published, '<', $rows, "the server stopped in the middle of publishing ($published of $rows)");
$node->start;

$node->poll_query_until('postgres', 'SELECT count(*) = 0 FROM idempotency.outbox')
  or die "publishing did not finish after the restart";

is($node->safe_psql('postgres', 'SELECT count(*) || \' \' || count(DISTINCT id) FROM sink'),
	"$rows $rows", 'the function received every row exactly once');

my $messages = $node->safe_psql('postgres', q{
	SELECT count(*) || ' ' || count(DISTINCT substring(data FROM '"id" : (\d+)'))
	FROM pg_logical_slot_get_changes('crash_slot', NULL, NULL)
	WHERE data LIKE 'message:%prefix: crash.test%'});
is($messages, "$rows $rows", 'logical decoding saw every row exactly once');

$node->stop;
done_testing();
