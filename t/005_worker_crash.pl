# An immediate shutdown in the middle of publishing: after the restart,
# no row routed to a function or to logical decoding is lost or published
# twice, because each row's publication commits together with its removal.
# The middle is the test's, not the machine's: the route's function stops
# at a gate halfway through the rows, inside a batch's transaction (the
# batches before it committed, its own rows and logical messages not), and
# the server is stopped while the worker waits there.

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
	CREATE TABLE gate (open boolean);
	INSERT INTO gate VALUES (false);
	-- each statement of the loop reads the gate with a new snapshot
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO public.sink VALUES (e.id);
		WHILE (e.payload->>'n')::int > 1500 AND NOT (SELECT open FROM public.gate) LOOP
			PERFORM pg_sleep(0.01);
		END LOOP;
	END $$;
	SELECT idempotency.idem_outbox_route('to_function', 'function', 'sink_it');
	SELECT idempotency.idem_outbox_route('to_wal', 'logical', 'crash.test');
	SELECT pg_create_logical_replication_slot('crash_slot', 'test_decoding');
});

$node->safe_psql('postgres', qq{
	SELECT idempotency.idem_outbox_enqueue(t, jsonb_build_object('n', n), 'k' || n % 7)
	FROM generate_series(1, $rows) n, unnest(ARRAY['to_function', 'to_wal']) t;
});

# stop hard once the worker waits at the gate, in the middle of a batch
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	WHERE backend_type = 'idempotency worker' AND wait_event = 'PgSleep'})
  or die "publishing did not reach the gate";
my $published = $node->safe_psql('postgres', 'SELECT count(*) FROM sink');
$node->stop('immediate');
cmp_ok($published, '<', $rows, "the server stopped in the middle of publishing ($published of $rows)");
$node->start;
$node->safe_psql('postgres', 'UPDATE gate SET open = true');

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
