# The worker's life: it serves databases created after start without
# configuration, comes back after pg_terminate_backend and kill -9, never
# holds up DROP DATABASE, follows DROP / CREATE EXTENSION, and purges in
# bounded batches, pruning the pages it purged so that their space is in the
# free space map before any vacuum (what it pruned it says in the log).

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IPC::Run;
use Time::HiRes qw(time);

my $node = PostgreSQL::Test::Cluster->new('lifecycle');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.naptime = '200ms'
idempotency.purge_interval = '200ms'
restart_after_crash = on
# the worker says at DEBUG1 what its pruning after a purge did (see
# pruned_all_since)
log_min_messages = debug1
});
$node->start;

my $setup = q{
	CREATE EXTENSION idempotency;
	CREATE TABLE sink (id bigint);
	CREATE FUNCTION sink_it(e idempotency.outbox) RETURNS void LANGUAGE sql AS
		'INSERT INTO public.sink VALUES (e.id)';
	SELECT idempotency.idem_outbox_route('*', 'function', 'sink_it');
};
$node->safe_psql('postgres', $setup);

sub worker_pid
{
	my ($db) = @_;
	return $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database $db'");
}

sub wait_for_worker
{
	my ($db, $not_pid) = @_;
	$not_pid //= 0;
	$node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database $db' AND pid <> $not_pid})
	  or die "no worker for database $db";
	return worker_pid($db);
}

# Wait until the worker's last word since the log's offset on pruning the
# pages it purged rows of idempotency.keys on is that none is left to prune:
# it says how many are left at the end of each pass that pruned pages or had
# some to prune, and a page it could not prune yet (an older snapshot, a pin)
# is tried again in the next pass.  Call it once a pass has ended since the
# purge of interest, so that this pass's word is in the log.
my $prune_report = qr/pruned \d+ pages of relation "keys" in this pass: /;

sub pruned_all_since
{
	my ($offset) = @_;
	my $report = $prune_report;
	return eval {
		$node->wait_for_log(qr/${report}none left to prune\n(?:(?!$report).)*\z/s, $offset);
		1;
	};
}

# The pages of idempotency.keys that the pages table says rows were on
# (blkno), whose free space in the map is short of the space those rows
# took there (freed: the sum of their lengths), less 64 bytes (the map
# counts in steps of 32, and a pruned row's line pointer stays): '' if none.
sub pages_without_their_space
{
	my ($pages_table) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT coalesce(string_agg(p.blkno || ': ' || coalesce(f.avail, 0) || ' < ' || p.freed, ', '
								   ORDER BY p.blkno), '')
		FROM $pages_table p LEFT JOIN pg_freespace('idempotency.keys') f USING (blkno)
		WHERE coalesce(f.avail, 0) < p.freed - 64});
}

# publishing works in db: enqueue one row and see the function receive it
sub publishes
{
	my ($db, $what) = @_;
	my $id = $node->safe_psql($db, "SELECT idempotency.idem_outbox_enqueue('t', '{}')");
	ok($node->poll_query_until($db, "SELECT count(*) = 1 FROM sink WHERE id = $id"),
		"$what: a row is published in $db");
}

my $pid = wait_for_worker('postgres');
is($node->safe_psql('postgres',
		"SELECT datname || ': ' || backend_type || ', ' || application_name FROM pg_stat_activity WHERE pid = $pid"),
	'postgres: idempotency worker, idempotency worker for database postgres',
	'the worker shows in pg_stat_activity: one backend_type for every worker, the application_name naming its database');
publishes('postgres', 'at start');

# --- pg_terminate_backend stops a worker; the launcher starts it again,
# after a delay it logs
my $restart_delayed = qr/the worker for database "postgres" stopped; the next starts in \d+ ms/;
my $log_offset = -s $node->logfile;
$node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)");
my $new_pid = wait_for_worker('postgres', $pid);
isnt($new_pid, $pid, 'after pg_terminate_backend a new worker serves the database');
ok(eval { $node->wait_for_log($restart_delayed, $log_offset); 1 },
	'... started after a delay, as the launcher says in the log');
publishes('postgres', 'after pg_terminate_backend');

# --- the launcher too comes back after pg_terminate_backend
my $launcher = $node->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'");
$node->safe_psql('postgres', "SELECT pg_terminate_backend($launcher)");
ok($node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency launcher' AND pid <> $launcher}),
	'the launcher is restarted');
is(worker_pid('postgres'), $new_pid, 'a restarted launcher does not start a second worker');

# --- kill -9: the postmaster restarts everything; the worker comes back
kill 'KILL', $new_pid;
$node->poll_query_until('postgres', 'SELECT true')
  or die "the server did not come back from the crash";
my $after_crash = wait_for_worker('postgres', $new_pid);
ok($after_crash, 'after kill -9 of the worker, a worker serves the database again');
publishes('postgres', 'after kill -9');

# --- a database created after start is served with no configuration
$node->safe_psql('postgres', 'CREATE DATABASE later');
$node->safe_psql('later', $setup);
my $later_pid = wait_for_worker('later');
ok($later_pid, 'a database created after start gets its worker');
publishes('later', 'in the new database');

# --- DROP DATABASE of a served database succeeds at once
my $start = time();
my ($ret, $out, $err) = $node->psql('postgres', 'DROP DATABASE later');
my $took = time() - $start;
is($ret, 0, 'DROP DATABASE of a served database succeeds') or diag($err);
cmp_ok($took, '<', 5, sprintf('... and does not wait (%.2fs)', $took));
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database later'"),
	'no worker is left for the dropped database');

# --- DROP EXTENSION / CREATE EXTENSION in a live database: a worker that
# left for want of the extension is no crash, and the next CREATE EXTENSION
# starts one at once, not after the delay of a worker that stopped (which
# kept the worker of a server just set up away for a second)
$log_offset = -s $node->logfile;
$node->safe_psql('postgres', 'DROP EXTENSION idempotency CASCADE; DROP TABLE sink');
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency worker' AND application_name = 'idempotency worker for database postgres'"),
	'after DROP EXTENSION the worker leaves');
$node->safe_psql('postgres', $setup);
wait_for_worker('postgres');
publishes('postgres', 'after DROP and CREATE EXTENSION');
unlike(slurp_file($node->logfile, $log_offset), $restart_delayed,
	'... and the launcher started it again with no delay');

# --- purge happens in bounded batches, each a transaction of its own
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.purge_batch_size = 50;
	SELECT pg_reload_conf();
});
my $commits_before = $node->safe_psql('postgres',
	"SELECT xact_commit FROM pg_stat_database WHERE datname = 'postgres'");
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'k' || n, 1, '1 s', now() - interval '1 day', now() - interval '1 hour', 200
	FROM generate_series(1, 5000) n;
	INSERT INTO idempotency.processed_events
	SELECT 'c', 'e' || n, now() - interval '30 days', now() - interval '1 day'
	FROM generate_series(1, 2000) n;
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at)
	VALUES ('s', 'live', 1, '1 day', now(), now() + interval '1 day');
});
ok($node->poll_query_until('postgres', q{
		SELECT (SELECT count(*) FROM idempotency.keys) = 1
		   AND (SELECT count(*) FROM idempotency.processed_events) = 0}),
	'expired keys and events are purged; the live key stays');
ok($node->poll_query_until('postgres',
		"SELECT xact_commit >= $commits_before + 140 FROM pg_stat_database WHERE datname = 'postgres'"),
	'7000 rows were purged in batches of 50: at least 140 transactions');
ok($node->safe_psql('postgres', 'SELECT purged >= 7000 FROM idempotency.stats') eq 't',
	'the stats view counts the purged rows');

# --- a pass that deleted most of a table vacuums it at once (twice, so that
# emptied index pages are reusable): the space comes back for the next rows
ok($node->poll_query_until('postgres', q{
		SELECT vacuum_count >= 2 FROM pg_stat_user_tables
		WHERE relid = 'idempotency.keys'::regclass}),
	'the worker vacuumed the keys table after purging 5000 of its rows');
$node->safe_psql('postgres', 'CREATE EXTENSION pg_freespacemap');
ok($node->safe_psql('postgres', q{
		SELECT count(*) > 0 FROM pg_freespace('idempotency.keys_pkey') WHERE avail > 0}) eq 't',
	'the emptied index pages of the keys table are in its free space map');

# --- while other sessions write, the purge rests between its batches, and
# the vacuum after it waits for a pass that finds the database quiet
$node->safe_psql('postgres', q{
	ALTER TABLE idempotency.keys SET (autovacuum_enabled = off);
	CREATE TABLE writes (n int);
	CREATE TABLE stop_writing ();
});
my $vacuums_before = $node->safe_psql('postgres',
	"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass");
my $yields_before = $node->safe_psql('postgres',
	'SELECT purge_yields FROM idempotency.stats');
# Three writers, so that the database is busy for the worker's looks even
# when the machine is (a single writer starved of a core for 100 ms, the
# time the worker looks over, made the database look quiet to it on a
# loaded machine, and the worker vacuumed).
my ($writer_out, $writer_err) = ('', '');
my @writers = map {
	IPC::Run::start(
		[
			'psql', '-X', '-v', 'ON_ERROR_STOP=1', '-d', $node->connstr('postgres'), '-c', q{
			DO $$
			BEGIN
				WHILE NOT EXISTS (SELECT FROM stop_writing) LOOP
					INSERT INTO writes VALUES (1);
					COMMIT;
				END LOOP;
			END $$}
		],
		'>', \$writer_out, '2>', \$writer_err)
} 1 .. 3;
$node->poll_query_until('postgres', 'SELECT count(*) > 100 FROM writes')
  or die "the writers did not start: $writer_err";

# the pages the rows are on, and the space they take there, recorded before
# the worker can see them
$log_offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	BEGIN;
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'busy' || n, 1, '1 s', now() - interval '1 day', now() - interval '1 hour', 200
	FROM generate_series(1, 20000) n;
	CREATE TABLE busy_pages AS
	SELECT (ctid::text::point)[0]::bigint AS blkno, sum(pg_column_size(k.*)) AS freed
	FROM idempotency.keys k WHERE key LIKE 'busy%' GROUP BY 1;
	COMMIT;
});
ok($node->poll_query_until('postgres', 'SELECT count(*) = 1 FROM idempotency.keys'),
	'with another session writing, the expired keys are purged all the same');
my $purged_at = $node->safe_psql('postgres', 'SELECT clock_timestamp()');
ok($node->poll_query_until('postgres',
		"SELECT worker_last_round > '$purged_at' FROM idempotency.stats"),
	'... and the worker finished a pass since');
cmp_ok($node->safe_psql('postgres', 'SELECT purge_yields FROM idempotency.stats'),
	'>', $yields_before, '... resting between batches while the other session wrote');
is($node->safe_psql('postgres',
		"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass"),
	$vacuums_before, '... and not vacuuming while it wrote');

# ... yet the space of the rows it purged is reusable already: it pruned the
# pages it deleted them on and entered their free space in the map, so the
# rows written next fill them rather than grow the table
ok(pruned_all_since($log_offset),
	'... the worker pruned every page it purged rows on');
is(pages_without_their_space('busy_pages'), '',
	'... and each is in the free space map with the space of the rows purged from it');
my $pages = $node->safe_psql('postgres',
	"SELECT pg_relation_size('idempotency.keys') / 8192");
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'after' || n, 1, '1 day', now(), now() + interval '1 day', 200
	FROM generate_series(1, 10000) n;
});
cmp_ok($node->safe_psql('postgres', "SELECT pg_relation_size('idempotency.keys') / 8192"),
	'<=', $pages + 2, '... and the rows written next reuse their space, with no vacuum yet');
is($node->safe_psql('postgres',
		"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass"),
	$vacuums_before, '... (still none)');
$node->safe_psql('postgres', "DELETE FROM idempotency.keys WHERE key LIKE 'after%'");

$node->safe_psql('postgres', 'INSERT INTO stop_writing DEFAULT VALUES');
ok((grep { $_->finish } @writers) == 3, 'the writers stopped') or diag($writer_err);
ok($node->poll_query_until('postgres', qq{
		SELECT vacuum_count >= $vacuums_before + 2 FROM pg_stat_user_tables
		WHERE relid = 'idempotency.keys'::regclass}),
	'once the database is quiet, the worker vacuums the table it purged');

# --- a pass of one batch prunes its pages too, though it purged too little
# of the table to vacuum it (2000 rows of 22,000): their space is in the
# free space map at once
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.purge_batch_size = 5000;
	SELECT pg_reload_conf();
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'kept' || n, 1, '1 day', now(), now() + interval '1 day', 200
	FROM generate_series(1, 20000) n;
	ANALYZE idempotency.keys;
});
$vacuums_before = $node->safe_psql('postgres',
	"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass");
$log_offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	BEGIN;
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'once' || n, 1, '1 s', now() - interval '1 day', now() - interval '1 hour', 200
	FROM generate_series(1, 2000) n;
	CREATE TABLE once_pages AS
	SELECT (ctid::text::point)[0]::bigint AS blkno, sum(pg_column_size(k.*)) AS freed
	FROM idempotency.keys k WHERE key LIKE 'once%' GROUP BY 1;
	COMMIT;
});
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'once%'"),
	'2000 expired keys beside 20,000 live ones are purged');
$purged_at = $node->safe_psql('postgres', 'SELECT clock_timestamp()');
ok($node->poll_query_until('postgres',
		"SELECT worker_last_round > '$purged_at' FROM idempotency.stats"),
	'... and the worker finished a pass since');
is($node->safe_psql('postgres',
		"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass"),
	$vacuums_before, '... without vacuuming the table');
ok(pruned_all_since($log_offset), '... the worker pruned every page it purged rows on');
is(pages_without_their_space('once_pages'), '',
	'... and the pages they were on are in the free space map with their space');

# --- a snapshot older than a purge that outlasts the worker's wait for it
# keeps the purged pages from being pruned; they are pruned once it is gone,
# not left for a vacuum
my ($holder_in, $holder_out, $holder_err) = ('', '', '');
my $holder = IPC::Run::start(
	[ 'psql', '-X', '-v', 'ON_ERROR_STOP=1', '-d', $node->connstr('postgres') ],
	'<', \$holder_in, '>', \$holder_out, '2>', \$holder_err,
	IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default));
$holder_in .= "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 'snapshot' || ' taken';\n";
$holder->pump until $holder_out =~ /snapshot taken/;
$log_offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	BEGIN;
	INSERT INTO idempotency.keys (scope, key, attempt, ttl, created_at, expires_at, status_code)
	SELECT 's', 'held' || n, 1, '1 s', now() - interval '1 day', now() - interval '1 hour', 200
	FROM generate_series(1, 2000) n;
	CREATE TABLE held_pages AS
	SELECT (ctid::text::point)[0]::bigint AS blkno, sum(pg_column_size(k.*)) AS freed
	FROM idempotency.keys k WHERE key LIKE 'held%' GROUP BY 1;
	COMMIT;
});
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'held%'"),
	'with an older snapshot open, 2000 expired keys are purged');
ok(eval { $node->wait_for_log(qr/${prune_report}\d+ left to prune next pass/, $log_offset) },
	'... and the worker says their pages are left to prune');
isnt(pages_without_their_space('held_pages'), '',
	'... whose space is not in the free space map yet');

# Once the snapshot is gone, the worker's next try prunes the pages itself,
# not only enters in the map what a scan pruned since (its own next pass
# reads them too, and would prune them, for the hint it left on them).  It
# says what each try did at DEBUG2: raised now, and in effect once it says
# it could not prune them yet.
my $debug2_offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET log_min_messages = debug2;
	SELECT pg_reload_conf();
});
ok( eval {
		$node->wait_for_log(qr/could not prune the pages purged in relation "keys" yet/,
			$debug2_offset);
	},
	'... and the worker tries again in each pass');
my $commit_offset = -s $node->logfile;
$holder_in .= "COMMIT;\n";
ok($holder->finish, 'the older snapshot is gone') or diag($holder_err);
$purged_at = $node->safe_psql('postgres', 'SELECT clock_timestamp()');
ok($node->poll_query_until('postgres',
		"SELECT worker_last_round > '$purged_at' FROM idempotency.stats"),
	'... and the worker finished a pass since');
ok(pruned_all_since($log_offset), '... which pruned the pages left');
my ($first_try) = slurp_file($node->logfile, $commit_offset) =~
  /pruned (\d+) pages purged in relation "keys"/;
cmp_ok($first_try // 0, '>', 0, '... starting with its first try since');
is(pages_without_their_space('held_pages'), '',
	'... and entered them in the free space map with their space');
is($node->safe_psql('postgres',
		"SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass"),
	$vacuums_before, '... without vacuuming the table');

$node->safe_psql('postgres', 'ALTER TABLE idempotency.keys RESET (autovacuum_enabled)');

$node->stop;
done_testing();
