# The key, deduplication and enqueue functions on a Citus cluster (a
# coordinator and two workers), the extension distributed beside the
# application's table by tenant with idem_distribute(): every call made
# through the coordinator runs on the node of its shard, in the shard, and
# commits there together with the business writes of its transaction.  A
# call that reaches a node without the shard is refused, and one beside a
# subquery is refused before Citus's planner could crash on it; a claim follows
# its shard when the shard moves; 32 sessions racing for one key through the
# coordinator execute it once; idem_cluster_counters() reads every node's
# counters.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use CitusCluster;
use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;

my $cluster = CitusCluster->new;
my $c = $cluster->coordinator;
my ($w1, $w2) = $cluster->workers;

sub call { return $c->safe_psql('postgres', $_[0]); }

# what the last statement of a script printed
sub last_line { return (split /\n/, $_[0])[-1]; }

# idem_distribute made the tables distributed, colocated with payments, and
# the functions distributed functions
is(call(q{
	SELECT string_agg(logicalrelid::text || ':' || partmethod::text, ' ' ORDER BY logicalrelid::text)
	FROM pg_dist_partition WHERE logicalrelid::text LIKE 'idempotency.%'}),
	'idempotency.keys:h idempotency.outbox:h idempotency.outbox_routes:n idempotency.processed_events:h',
	'keys, processed_events and outbox are hash-distributed, the routes a reference table');
is(call(q{
	SELECT count(DISTINCT colocationid) FROM pg_dist_partition
	WHERE logicalrelid IN ('payments'::regclass, 'idempotency.keys'::regclass,
		'idempotency.processed_events'::regclass, 'idempotency.outbox'::regclass)}),
	'1', 'they are colocated with the application table');
is(call(q{
	SELECT count(*) FROM pg_dist_object o JOIN pg_proc p ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid
	WHERE p.pronamespace = 'idempotency'::regnamespace AND o.distribution_argument_index = 0
		AND o.force_delegation}),
	'13', 'the thirteen functions are distributed by their first argument, delegated in transaction blocks');

# The one-transaction flow of tenant t1's payment $id, key pay-$id: claim,
# payment and completion in one transaction; returns the outcome of the
# claim of a retry made after it.
sub pay_once
{
	my ($id) = @_;
	return CitusCluster::outcome(last_line(call(qq{
		BEGIN;
		SELECT idempotency.idem_claim('t1', 'pay-$id');
		INSERT INTO payments VALUES ('t1', $id, 100);
		SELECT idempotency.idem_complete('t1', 'pay-$id', 201, 'paid');
		COMMIT;
		SELECT idempotency.idem_claim('t1', 'pay-$id');})));
}

# a table to colocate with must be distributed by a text COLLATE "C" column:
# the checks come before anything is distributed
call(q{
	CREATE TABLE by_int (tenant int);
	SELECT create_distributed_table('by_int', 'tenant', colocate_with => 'none');
	CREATE TABLE by_text (tenant text);
	SELECT create_distributed_table('by_text', 'tenant', colocate_with => 'none');});
my ($ret, $out, $err) = $c->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idempotency.idem_distribute('by_int')");
like($err, qr/42804: column tenant of table public.by_int must be of type text, not integer/,
	'a table distributed by an integer is refused (42804)');
($ret, $out, $err) = $c->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idempotency.idem_distribute('by_text')");
like($err, qr/42P21: column tenant of table public.by_text must have collation "C"/,
	'one distributed by text of another collation too (42P21)');
like($err, qr/HINT:  Citus does not alter a distribution column: undistribute the table \(SELECT undistribute_table\('public.by_text'\)\), ALTER TABLE public.by_text ALTER tenant TYPE text COLLATE "C"/,
	'with the steps that fix it');

# --- keys, one transaction: the claim, the payment and the completion
# commit together on the worker of tenant t1's shard
my $t1_worker = $cluster->node_of('idempotency.keys', 't1');
is(pay_once(1), 'replay', 'a key completed inside BEGIN replays to its retry');
like(call(q{SELECT idempotency.idem_claim('t1', 'pay-1')}), qr/^\(replay,201,paid,/,
	'the stored response');
is(call(q{SELECT outcome || ' ' || status_code || ' ' || body FROM idempotency.idem_claim('t1', 'pay-1')}),
	'replay 201 paid', 'a call alone in FROM is delegated too');
my $shard = call(q{SELECT get_shard_id_for_distribution_column('idempotency.keys', 't1'::text)});
is($t1_worker->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.keys_$shard WHERE scope = 't1' AND key = 'pay-1'"),
	'1', "the key's row is in its shard, on the worker that holds it");
is(call(q{SELECT count(*) FROM idempotency.keys WHERE scope = 't1'}), '1',
	'and Citus finds it there through the coordinator');

# a rollback leaves neither the payment nor the claim
call(q{
	BEGIN;
	SELECT idempotency.idem_claim('t1', 'pay-2');
	INSERT INTO payments VALUES ('t1', 2, 100);
	ROLLBACK;});
like(call(q{SELECT idempotency.idem_claim('t1', 'pay-2')}), qr/^\(claimed,,,,1,/,
	'after a rollback, the key is claimed afresh (attempt 1)');
is(call(q{SELECT count(*) FROM payments WHERE id = 2}), '0', 'and the payment is gone');

# --- keys, two transactions: claim, checkpoint, complete, each autocommit
is(CitusCluster::outcome(call(q{SELECT idempotency.idem_claim('t2', 'pay-3')})), 'claimed',
	'two transactions: claimed');
call(q{SELECT idempotency.idem_checkpoint('t2', 'pay-3', 'charged')});
is(CitusCluster::outcome(call(q{SELECT idempotency.idem_claim('t2', 'pay-3')})), 'in_progress',
	'a retry meanwhile is in_progress');
is(call(q{SELECT idempotency.idem_complete('t2', 'pay-3', 200, 'ok')}), 'stored',
	'completed in a later transaction');
call(q{SELECT idempotency.idem_claim('t2', 'pay-5')});
is(call(q{SELECT idempotency.idem_release('t2', 'pay-5')}), 't', 'a claim is released');
is(CitusCluster::outcome(call(q{SELECT idempotency.idem_claim('t2', 'pay-5')})), 'claimed',
	'and claimed afresh');
like(call(q{SELECT idempotency.idem_claim('t2', 'pay-3')}), qr/^\(replay,200,ok,/, 'and replays');

# --- a call on a node without the shard is refused, never run on the shell
($ret, $out, $err) = $c->psql('postgres',
	q{SELECT (idempotency.idem_claim('t1', 'pay-9')).outcome});
isnt($ret, 0, 'a call inside an expression is not delegated, and the coordinator holds no shard');
like($err, qr/idem_claim\(\) cannot run on this node: shard \d+ of table "idempotency.keys" is not placed here/,
	'the error names the shard');
like($err, qr/HINT:  Call it as a distributed function, as the whole query/,
	'and how to call it');
my $other = $t1_worker->port == $w1->port ? $w2 : $w1;
($ret, $out, $err) = $other->psql('postgres',
	q{SELECT (idempotency.idem_claim('t1', 'pay-9')).outcome});
like($err, qr/cannot run on this node/, 'so is a call on the other worker');
is($other->safe_psql('postgres', q{SELECT pg_relation_size('idempotency.keys')}), '0',
	'whose shell table stays empty');

# --- a call beside a subquery, a VALUES list, a view or a WITH query is
# refused before Citus plans it (0A000): Citus would delegate it from the
# query as its planner rewrote it (the subquery pulled up and gone), whose
# deparsing crashed the coordinator's backend (SIGSEGV); a table in a WITH
# query that FROM does not name (a local table of the coordinator's) leaves
# the call alone in FROM all the same
call(q{CREATE TABLE app_settings (v int); INSERT INTO app_settings VALUES (1)});
for my $query (
	q{SELECT count(*) FROM idempotency.idem_claim('t1', 'pay-9') c, (VALUES (1)) v},
	q{SELECT outcome FROM (SELECT * FROM idempotency.idem_claim('t1', 'pay-9')) s},
	q{WITH s AS (SELECT v FROM app_settings)
	  SELECT c.outcome, (SELECT v FROM s) FROM idempotency.idem_claim('t1', 'pay-9') c, (VALUES (1)) v},
	q{WITH s AS (SELECT v FROM app_settings)
	  SELECT count(*) FROM idempotency.idem_claim('t1', 'pay-9') c, (VALUES (1)) v},
	q{SELECT idempotency.idem_mark_processed('t1', 'event-9') FROM (SELECT 1) s})
{
	($ret, $out, $err) = $c->psql('postgres', "\\set VERBOSITY verbose\n$query");
	like($err, qr/ERROR:  0A000: idem_\w+\(\) cannot be called beside a subquery/,
		"refused with 0A000: $query");
}
like($err, qr/HINT:  Call it as the whole query, SELECT \.\.\. FROM idempotency\.idem_mark_processed\(\.\.\.\)/,
	'the hint says how to call it');
is(call(q{SELECT count(*) FROM idempotency.keys WHERE key = 'pay-9'}), '0',
	'the coordinator is still up, and no key was claimed');
unlike(slurp_file($c->logfile), qr/terminated by signal/, 'no server process crashed');

# --- deduplication: a mark commits or rolls back with the handler's writes
is(last_line(call(q{
	BEGIN;
	SELECT idempotency.idem_mark_processed('t1', 'event-1');
	INSERT INTO payments VALUES ('t1', 3, 5);
	COMMIT;
	SELECT idempotency.idem_mark_processed('t1', 'event-1');})), 'f',
	'a mark made inside BEGIN is a duplicate afterwards');
is(last_line(call(q{
	BEGIN;
	SELECT idempotency.idem_mark_processed('t1', 'event-2');
	ROLLBACK;
	SELECT idempotency.idem_mark_processed('t1', 'event-2');})), 't',
	'a mark rolled back is not');
is(call(q{SELECT idempotency.idem_is_processed('t1', 'event-2')}), 't', 'is_processed looks in the shard');

# --- the background worker of each node purges the shards placed there
my $t3_worker = $cluster->node_of('idempotency.keys', 't3');
my $t3_shard = call(q{SELECT get_shard_id_for_distribution_column('idempotency.keys', 't3'::text)});
my $t3_events = call(q{SELECT get_shard_id_for_distribution_column('idempotency.processed_events', 't3'::text)});
# (the rows purged on that node are counted there: the key and the event
# are written, then the count is awaited, since a purge may come as soon as
# they expire, a second later, before any look into the shard)
my $purged = q{SELECT coalesce(sum(purged), 0) FROM idempotency.idem_stats_counters()};
my $purged_before = $t3_worker->safe_psql('postgres', $purged);
like(call(q{SELECT idempotency.idem_claim('t3', 'short', NULL, '1 second')}), qr/^\(claimed,/,
	'an expiring key is claimed');
is(call(q{SELECT idempotency.idem_complete('t3', 'short', 200, 'soon gone')}), 'stored',
	'and completed');
is(call(q{SELECT idempotency.idem_mark_processed('t3', 'short', '1 second')}), 't',
	'an expiring event is marked');
ok($t3_worker->poll_query_until('postgres', qq{
	SELECT (SELECT count(*) FROM idempotency.keys_$t3_shard)
		+ (SELECT count(*) FROM idempotency.processed_events_$t3_events) = 0
		AND ($purged) >= $purged_before + 2}),
	"the worker's purge on the node of their shards deletes the expired key and event there");
is(call(q{SELECT purged_keys + purged_events FROM idempotency.idem_run_maintenance()}), '0',
	'idem_run_maintenance() on the coordinator, which holds no shard, purges nothing, and fails on nothing');

# --- the outbox: enqueues on both workers get ids unique in the cluster
my @topics = map { "topic-$_" } 1 .. 40;
my $topic1 = $cluster->value_on('idempotency.outbox', $w1, @topics);
my $topic2 = $cluster->value_on('idempotency.outbox', $w2, @topics);
for my $topic ($topic1, $topic2)
{
	for my $n (1 .. 3)
	{
		call(qq{
			BEGIN;
			SELECT idempotency.idem_outbox_enqueue('$topic', '{"n": $n}', 'k');
			COMMIT;});
	}
}
is(call(q{SELECT count(*) || ' ' || count(DISTINCT id) FROM idempotency.outbox}), '6 6',
	'six rows on two workers, six distinct ids');
is(call(q{SELECT string_agg(DISTINCT (id & 65535)::text, ',') FROM idempotency.outbox}), '1,2',
	"each id carries its worker's group in its low 16 bits");
is(call(qq{SELECT string_agg(payload->>'n', ',' ORDER BY id) FROM idempotency.outbox WHERE topic = '$topic2'}),
	'1,2,3', "a topic's ids follow its enqueues");


# --- a shard move: the claim follows its shard to the other worker
my $from = $t1_worker;
my $to = $from->port == $w1->port ? $w2 : $w1;
call(qq{SELECT citus_move_shard_placement($shard, '@{[ $from->host ]}', @{[ $from->port ]},
	'@{[ $to->host ]}', @{[ $to->port ]})});
is($cluster->node_of('idempotency.keys', 't1')->port, $to->port, 'the shard of t1 moved');
like(call(q{SELECT idempotency.idem_claim('t1', 'pay-1')}), qr/^\(replay,201,paid,/,
	'a completed key replays from its new node');
is(call(q{SELECT idempotency.idem_mark_processed('t1', 'event-1')}), 'f',
	'a processed event is still a duplicate there');
is(pay_once(4), 'replay', 'and the one-transaction flow runs there');
($ret, $out, $err) = $from->psql('postgres',
	q{SELECT (idempotency.idem_claim('t1', 'pay-9')).outcome});
like($err, qr/cannot run on this node/, 'the old node refuses the key now');

# --- 32 sessions race for one key through the coordinator, each in one
# transaction that claims, records its answer and, if it won, writes a side
# effect and completes; released together from a barrier (an advisory lock
# on the coordinator)
my $sessions = 32;
call(q{
	CREATE TABLE outcomes (tenant text COLLATE "C" NOT NULL, key text, answer text);
	SELECT create_distributed_table('outcomes', 'tenant', colocate_with => 'payments');
	CREATE TABLE side_effects (tenant text COLLATE "C" NOT NULL, key text);
	SELECT create_distributed_table('side_effects', 'tenant', colocate_with => 'payments');});
my $script = $c->basedir . '/race.sql';
append_to_file($script, q{
SELECT pg_advisory_lock_shared(1);
SELECT pg_advisory_unlock_shared(1);
BEGIN;
SELECT idempotency.idem_claim('race', 'key-:round') AS answer \gset
INSERT INTO outcomes VALUES ('race', 'key-:round', ':answer');
SELECT (':answer' LIKE '(claimed,%')::int AS won \gset
\if :won
INSERT INTO side_effects VALUES ('race', 'key-:round');
SELECT idempotency.idem_complete('race', 'key-:round', 201, 'done');
\endif
COMMIT;
});
for my $round (1 .. 3)
{
	my $barrier = $c->background_psql('postgres');
	$barrier->query_safe('SELECT pg_advisory_lock(1)');
	my ($bout, $berr) = ('', '');
	my $pgbench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', $sessions, '-j', 8, '-t', 1,
			'-f', $script, '-D', "round=$round",
			'-h', $c->host, '-p', $c->port, 'postgres'
		],
		'>', \$bout, '2>', \$berr);
	$c->poll_query_until('postgres',
		"SELECT count(*) = $sessions FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
	  or die "sessions did not reach the barrier";
	$barrier->query_safe('SELECT pg_advisory_unlock(1)');
	$barrier->quit;
	ok($pgbench->finish, "race round $round: every session ran") or diag($berr);

	is(call("SELECT count(*) FROM side_effects WHERE key = 'key-$round'"), '1',
		"race round $round: one side effect");
	is(call("SELECT count(*) FROM outcomes WHERE key = 'key-$round' AND answer LIKE '(claimed,%'"),
		'1', "race round $round: one claimed");
	is(call("SELECT count(*) FROM outcomes WHERE key = 'key-$round'"
		  . " AND (answer LIKE '(in_progress,%' OR answer LIKE '(replay,%')"),
		$sessions - 1, "race round $round: every other session in_progress or replay");
}
like(call(q{SELECT idempotency.idem_claim('race', 'key-1')}), qr/^\(replay,201,done,/,
	"the race's winner's response replays");

# --- a superuser's edit of Citus's metadata says processed_events is
# distributed by event_id: the functions would find a row's shard by its
# consumer where Citus looks by event_id, so they refuse the table (0A000)
# rather than write a shard Citus would not read (Citus does not let
# undistribute_table touch an extension's table, so the edit is the way),
# on the worker that holds t1's shards since the move, where the call runs
my $events_partkey = $to->safe_psql('postgres',
	"SELECT partkey FROM pg_dist_partition WHERE logicalrelid = 'idempotency.processed_events'::regclass");
$to->safe_psql('postgres', q{
	UPDATE pg_dist_partition
	SET partkey = column_name_to_column('idempotency.processed_events', 'event_id')
	WHERE logicalrelid = 'idempotency.processed_events'::regclass});
($ret, $out, $err) = $to->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idempotency.idem_is_processed('t1', 'event-1')");
like($err, qr/0A000: table "idempotency.processed_events" is distributed by column "event_id", not by "consumer"/,
	'a table distributed by another column is refused');
$to->safe_psql('postgres', qq{
	UPDATE pg_dist_partition SET partkey = '$events_partkey'
	WHERE logicalrelid = 'idempotency.processed_events'::regclass});
is($to->safe_psql('postgres', q{SELECT idempotency.idem_is_processed('t1', 'event-1')}), 't',
	'... and accepted again once the metadata is put back');

# --- the counters of every node, through the coordinator: each node's row
# is what that node's own idem_stats_counters() says
my $cluster_counters = call(q{
	SELECT string_agg(nodeport || ':' || claims || ':' || replays || ':' || conflicts, ' '
	                  ORDER BY nodeport)
	FROM idempotency.idem_cluster_counters()});
my $own_counters = join(' ', map {
	$_->port . ':' . $_->safe_psql('postgres',
		q{SELECT claims || ':' || replays || ':' || conflicts FROM idempotency.idem_stats_counters()})
} sort { $a->port <=> $b->port } ($c, $w1, $w2));
is($cluster_counters, $own_counters, "idem_cluster_counters() has each node's own counters");
cmp_ok(call(q{SELECT sum(claims) FROM idempotency.idem_cluster_counters()}), '>=', 3,
	'their sum counts the claims of the race rounds, made on the workers');

$cluster->stop;
done_testing();
