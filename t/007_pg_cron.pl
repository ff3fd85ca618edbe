# pg_cron where preloading idempotency is impossible: an instance that
# preloads pg_cron only (as on a managed service that offers pg_cron but not
# our library) runs idempotency.idem_run_maintenance() on a schedule, with the
# exact calls doc/integrations/pg-cron.md gives, and that job alone purges
# expired keys and processed events and publishes the outbox.
#
# Debian's postgresql-15-cron is pg_cron 1.4, whose finest schedule is a
# minute (second intervals came in 1.5), so the first run comes at the next
# minute boundary: the test waits for it (up to the default TAP timeout,
# 180 s). With pg_cron 1.5 or later it uses the '1 seconds' form instead.

use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('cron');
$node->init;

# pg_cron's launcher connects to cron.database_name at start (a postmaster
# setting): create that database first, so that the launcher does not fail
# and restart in a loop until it exists.
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE app');
$node->safe_psql('postgres', 'CREATE DATABASE shop');
$node->stop;

# Jobs run in ordinary sessions that pg_cron opens with libpq to cron.host
# and this instance's port. The test instance listens on a Unix socket only
# (listen_addresses = ''), so the default cron.host 'localhost' would fail
# with "connection failed": point cron.host at the socket directory, which
# libpq takes for a Unix socket because it is an absolute path. This is the
# libpq mode most installations use (cron.use_background_workers = on would
# work too, but needs a max_worker_processes slot per running job); and it
# runs the job in a plain client backend, the case where our library is
# loaded on first use rather than preloaded. Local connections are trusted
# by the test cluster's pg_hba.conf.
my $socket_dir = $node->host;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'pg_cron'
cron.database_name = 'app'
cron.host = '$socket_dir'
});
$node->start;

# --- without preload: CREATE EXTENSION warns, nothing runs in the background
my ($ret, $out, $err) = $node->psql('app', 'CREATE EXTENSION idempotency');
is($ret, 0, 'CREATE EXTENSION idempotency works with only pg_cron preloaded');
like($err, qr/WARNING:  idempotency is not in shared_preload_libraries/,
	'and warns that nothing runs in the background');
$node->psql('shop', 'CREATE EXTENSION idempotency');
$node->safe_psql('app', 'CREATE EXTENSION pg_cron');
my $cron_version = $node->safe_psql('app',
	"SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'");
note "pg_cron $cron_version";

# In each database: keys and events that will have expired by the time the
# job runs, one key that must stay, and outbox rows routed to a function that
# records who published them (the session's pid and application_name).
for my $db ('app', 'shop')
{
	$node->safe_psql($db, q{
		CREATE TABLE sink (seq bigserial, id bigint, topic text, key text,
		                   app text, pid int, published_at timestamptz);
		CREATE FUNCTION public.sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS $$
			INSERT INTO public.sink (id, topic, key, app, pid, published_at)
			VALUES (e.id, e.topic, e.key, pg_catalog.current_setting('application_name'),
			        pg_catalog.pg_backend_pid(), pg_catalog.clock_timestamp())
		$$;
		SELECT idempotency.idem_outbox_route('orders', 'function', 'public.sink_it');

		-- completed, expiring 1 s after completion
		SELECT idempotency.idem_claim('alice:POST /orders', 'k' || n, ttl => '1 second')
		FROM generate_series(1, 3) n;
		SELECT idempotency.idem_complete('alice:POST /orders', 'k' || n, 201, '{}')
		FROM generate_series(1, 3) n;
		-- abandoned in progress: expires at lease + ttl
		SELECT idempotency.idem_claim('alice:POST /orders', 'abandoned',
		                              ttl => '1 second', lease => '1 second');
		-- kept for a day
		SELECT idempotency.idem_claim('alice:POST /orders', 'fresh');
		SELECT idempotency.idem_complete('alice:POST /orders', 'fresh', 201, '{}');
		SELECT idempotency.idem_mark_processed('billing', 'evt-' || n, '1 second')
		FROM generate_series(1, 2) n;
		SELECT idempotency.idem_mark_processed('billing', 'evt-kept');

		SELECT idempotency.idem_outbox_enqueue('orders', jsonb_build_object('n', n), 'order-' || n % 2)
		FROM generate_series(1, 5) n;
		-- no route: waits for an external relay, and the job must leave it alone
		SELECT idempotency.idem_outbox_enqueue('audit', '{"n": 0}');
	});
	$node->poll_query_until($db, q{
		SELECT (SELECT count(*) FROM idempotency.keys WHERE expires_at < now()) = 4
		   AND (SELECT count(*) FROM idempotency.processed_events WHERE expires_at < now()) = 2})
	  or die "the short-lived keys and events did not expire in $db";
}

# --- nothing happens before pg_cron runs the job: no worker, expired rows stay
sub state_of
{
	my ($db) = @_;
	return $node->safe_psql($db, q{
		SELECT (SELECT count(*) FROM idempotency.keys) || ' keys, '
		    || (SELECT count(*) FROM idempotency.processed_events) || ' events, '
		    || (SELECT count(*) FROM idempotency.outbox WHERE state = 'pending') || ' pending, '
		    || (SELECT count(*) FROM sink) || ' published'});
}
is(state_of('app'), '5 keys, 3 events, 6 pending, 0 published',
	'before the job: expired keys and events are still there, nothing is published');
is(state_of('shop'), '5 keys, 3 events, 6 pending, 0 published',
	'the same in the second database');
is($node->safe_psql('app',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'"),
	'0', 'no idempotency worker or launcher runs');
is($node->safe_psql('app', 'SELECT purged IS NULL AND published IS NULL FROM idempotency.stats'),
	't', 'and the cumulative counters are NULL without preload');

# --- schedule it, exactly as doc/integrations/pg-cron.md says
my $schedule = '* * * * *';
if ($cron_version =~ /^1\.[0-4]\b/)
{
	# doc/integrations/pg-cron.md says second intervals need pg_cron 1.5:
	# 1.4 refuses them
	($ret, $out, $err) = $node->psql('app',
		"SELECT cron.schedule('too-fast', '1 seconds', 'SELECT idempotency.idem_run_maintenance()')");
	isnt($ret, 0, "pg_cron $cron_version refuses a '1 seconds' schedule");
	like($err, qr/invalid schedule: 1 seconds/, 'as an invalid schedule');
}
else
{
	$schedule = '1 seconds';
}
my $jobs = $node->safe_psql('app', qq{
	SELECT cron.schedule('idempotency-maintenance', '$schedule',
	                     'SELECT idempotency.idem_run_maintenance()');
	SELECT cron.schedule_in_database('idempotency-maintenance-shop', '$schedule',
	                                 'SELECT idempotency.idem_run_maintenance()', 'shop');
});
my ($job_app, $job_shop) = split /\n/, $jobs;
my $scheduled_at = time();
note "scheduled jobs $job_app (app) and $job_shop (shop) with '$schedule'";

$node->poll_query_until('app', qq{
	SELECT count(DISTINCT jobid) = 2 FROM cron.job_run_details
	WHERE jobid IN ($job_app, $job_shop) AND status IN ('succeeded', 'failed')})
  or die 'pg_cron did not run both jobs: '
  . $node->safe_psql('app', 'SELECT * FROM cron.job_run_details');
note sprintf('first runs done %d s after scheduling', time() - $scheduled_at);

is($node->safe_psql('app', qq{
		SELECT string_agg(DISTINCT status || ': ' || return_message, ', ')
		FROM cron.job_run_details
		WHERE jobid IN ($job_app, $job_shop) AND status IN ('succeeded', 'failed')}),
	'succeeded: 1 row',
	'cron.job_run_details: both jobs succeeded, one row from idem_run_maintenance each');

# --- what the job did
for my $db ('app', 'shop')
{
	my $job = $db eq 'app' ? $job_app : $job_shop;

	is(state_of($db), '1 keys, 1 events, 1 pending, 5 published',
		"$db: the job purged the expired keys and events and published the routed rows");
	is($node->safe_psql($db, 'SELECT key FROM idempotency.keys'), 'fresh',
		"$db: the key within its ttl is kept");
	is($node->safe_psql($db, "SELECT topic || ' ' || state FROM idempotency.outbox"),
		'audit pending', "$db: the row without a route still waits for a relay");
	is($node->safe_psql($db, q{
			SELECT count(*) || ' ' || count(DISTINCT id) || ' '
			    || bool_and(id > coalesce(prev, 0))
			FROM (SELECT id, lag(id) OVER (PARTITION BY key ORDER BY seq) AS prev FROM sink) s}),
		'5 5 true', "$db: each row published once, in id order per key");

	# published by the job's own session, not by anything else: the pid
	# pg_cron recorded for a successful run of this job, and pg_cron's
	# application_name; and not after that run ended
	my $runs = $node->safe_psql('app', qq{
		SELECT string_agg(format('(%s, %L::timestamptz)', job_pid, end_time), ', ')
		FROM cron.job_run_details WHERE jobid = $job AND status = 'succeeded'});
	$runs = '(NULL::int, NULL::timestamptz)' if $runs eq '';
	is($node->safe_psql($db, qq{
			SELECT count(*) FROM sink s
			WHERE s.app = 'pg_cron'
			  AND EXISTS (SELECT FROM (VALUES $runs) r(pid, end_time)
			              WHERE r.pid = s.pid AND s.published_at <= r.end_time)}),
		'5', "$db: published inside a pg_cron run of its job (pid, application_name, time)");
}

$node->safe_psql('app', "SELECT cron.unschedule('idempotency-maintenance')");
$node->safe_psql('app', "SELECT cron.unschedule('idempotency-maintenance-shop')");

# --- a claim that waits, without preload: there are no wait slots in shared
# memory, so it polls, and answers in_progress when its wait runs out (it
# crashed the backend, leaving a slot it never entered: a NULL dereference)
my ($holder_out, $holder_err) = ('', '');
my $holder = IPC::Run::start(
	[ 'psql', '-X', '-q', '-d', $node->connstr('shop'), '-c',
	  "BEGIN; SELECT idempotency.idem_claim('wait', 'held'); SELECT pg_sleep(300); COMMIT" ],
	'>', \$holder_out, '2>', \$holder_err);
$node->poll_query_until('shop', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	WHERE datname = 'shop' AND wait_event = 'PgSleep'})
  or die 'the holder never got to its sleep';
is($node->safe_psql('shop',
		"SELECT outcome FROM idempotency.idem_claim('wait', 'held', wait => '300 ms')"),
	'in_progress',
	'without preload, a claim that waits for a held key polls, and answers in_progress when its wait runs out');
is($node->safe_psql('shop', "SELECT (idempotency.idem_claim('wait', 'held', wait => '50 ms')).outcome"),
	'in_progress', 'the same through the function, and the server is still up');
$node->safe_psql('shop', q{
	SELECT pg_cancel_backend(pid) FROM pg_stat_activity
	WHERE datname = 'shop' AND wait_event = 'PgSleep'});
$holder->finish;

$node->stop;

done_testing();
