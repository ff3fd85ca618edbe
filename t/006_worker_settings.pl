# Running without shared_preload_libraries (a WARNING at CREATE EXTENSION,
# and idem_run_maintenance() doing the worker's work from SQL); the
# idempotency.databases allow-list; and the worker budget when background
# worker slots run out.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# --- without preload
my $plain = PostgreSQL::Test::Cluster->new('plain');
$plain->init;
$plain->start;
my ($ret, $out, $err) = $plain->psql('postgres', 'CREATE EXTENSION idempotency');
is($ret, 0, 'CREATE EXTENSION works without preload');
like($err, qr/WARNING:  idempotency is not in shared_preload_libraries/, 'and warns');
like($err, qr/HINT:  Add idempotency to shared_preload_libraries/, 'with a hint');

$plain->safe_psql('postgres', q{
	CREATE TABLE sink (id bigint);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'INSERT INTO public.sink VALUES (e.id)';
	SELECT idempotency.idem_outbox_route('t', 'function', 'sink_it');
	SELECT idempotency.idem_outbox_enqueue('t', '{}') FROM generate_series(1, 3);
	SELECT idempotency.idem_claim('s', 'k', ttl => '1 ms');
	SELECT idempotency.idem_complete('s', 'k', 200);
	SELECT idempotency.idem_mark_processed('c', 'e', '1 ms');
	SELECT pg_sleep(0.01);
});
is($plain->safe_psql('postgres', 'SELECT * FROM idempotency.idem_run_maintenance()'),
	'1|1|0|3|0', 'idem_run_maintenance purges and publishes from SQL');
is($plain->safe_psql('postgres', q{
		SELECT (SELECT count(*) FROM sink) || ' ' || (SELECT count(*) FROM idempotency.keys)
		       || ' ' || (SELECT count(*) FROM idempotency.outbox)}),
	'3 0 0', 'the rows were published and the expired ones purged');
is($plain->safe_psql('postgres', 'SELECT claims IS NULL FROM idempotency.stats'),
	't', 'without shared memory the counters are NULL');

# one call publishes a whole batch (publish_batch_size, 100) the fast way,
# more than the careful way's 32; when a row fails, the batch is done again
# carefully: the failing row is recorded, the others go out
$plain->safe_psql('postgres',
	"SELECT idempotency.idem_outbox_enqueue('t', '{}') FROM generate_series(1, 60)");
is($plain->safe_psql('postgres', 'SELECT published FROM idempotency.idem_run_maintenance()'),
	'60', 'one call publishes 60 rows in one go');
$plain->safe_psql('postgres', q{
	CREATE FUNCTION picky(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		IF e.payload ? 'bad' THEN RAISE EXCEPTION 'cannot take event %', e.id; END IF;
		INSERT INTO public.sink VALUES (e.id);
	END $$;
	SELECT idempotency.idem_outbox_route('p', 'function', 'picky');
	SELECT idempotency.idem_outbox_enqueue('p', '{}', 'k' || n) FROM generate_series(1, 5) n;
	SELECT idempotency.idem_outbox_enqueue('p', '{"bad": true}', 'k6');
});
is($plain->safe_psql('postgres',
		'SELECT published || \' \' || publish_failures FROM idempotency.idem_run_maintenance()'),
	'5 1', 'a failing row falls back to the careful way: 5 published, 1 failure');
is($plain->safe_psql('postgres', q{
		SELECT state || ' ' || attempts || ' ' || (last_error LIKE '%cannot take event%')
		FROM idempotency.outbox WHERE topic = 'p'}),
	'pending 1 true', 'the failing row waits for its retry, with its error');

# a cancel (here a statement timeout) during the fast batch ends the call,
# and leaves the session as it found it
$plain->safe_psql('postgres', q{
	CREATE FUNCTION slow(e idempotency.outbox) RETURNS void LANGUAGE sql AS 'SELECT pg_sleep(2)';
	SELECT idempotency.idem_outbox_route('s', 'function', 'slow');
	SELECT idempotency.idem_outbox_enqueue('s', '{}');
});
($ret, $out, $err) = $plain->psql('postgres', q{
	SET statement_timeout = '300ms';
	SELECT * FROM idempotency.idem_run_maintenance();
	RESET statement_timeout;
	SELECT 'still ' || 'fine';
	BEGIN;
	SELECT 'and ' || 'transactions work';
	COMMIT;
}, on_error_stop => 0);
like($err, qr/canceling statement due to statement timeout/, 'the timeout ends idem_run_maintenance');
unlike($err, qr/FATAL|current transaction is aborted/, 'and leaves no broken transaction behind');
like($out, qr/still fine\nand transactions work/, 'the session goes on');
$plain->stop;

# --- the allow-list and the worker budget
my $node = PostgreSQL::Test::Cluster->new('settings');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '200ms'
max_worker_processes = 3
});
$node->start;
for my $db ('one', 'two', 'three')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}

# three databases (and postgres, which has no extension) but only two slots
# besides the launcher's (one of them the logical replication launcher's)
ok($node->wait_for_log(qr/idempotency: could not start a worker for database/),
	'when worker slots run out, the launcher says so');
ok($node->log_contains(qr/HINT:  Raise max_worker_processes/),
	'... naming the setting to raise');
is($node->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency worker'"),
	'1', 'the workers that fit run; nothing crash-loops');

# serve only "two": the others are stopped or never started
$node->safe_psql('postgres', "ALTER SYSTEM SET idempotency.databases = 'two'");
$node->reload;
ok($node->poll_query_until('postgres', q{
		SELECT array_agg(application_name) = ARRAY['idempotency worker for database two']
		FROM pg_stat_activity WHERE backend_type = 'idempotency worker'}),
	'with idempotency.databases = two, only that database is served');

$node->stop;
done_testing();
