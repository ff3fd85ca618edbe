# The update from 1.1 to 1.2 with outbox rows in flight, as an operator
# runs it (the library installed and preloaded, the DDL guard active): a
# database made at 1.0 and updated to 1.1 has rows dead, nacked, leased to
# a relay, and put back by a nack, and a backend connected since 1.1; it
# shows what a database still at 1.1 gets (a put-back row's next hand-out
# repeats a fence).  ALTER EXTENSION idempotency UPDATE brings it to 1.2:
# the failures are carried over, the leased rows' 1.1 fences still work,
# a stale relay's fence of a put-back row matches nothing at the row's next
# hand-out, requeue and the dead limit go by the failures, the backend
# connected since 1.1 runs 1.2's statements, and the database has the
# objects of a fresh 1.2 install.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('upgrade_1_2');
$node->init;
# no worker: nothing but this test may change a row
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'none'
idempotency.outbox_max_attempts = 3
# a nacked row waits until the test makes it available
idempotency.outbox_backoff_min = '1h'
idempotency.outbox_backoff_max = '1h'
});
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE old');

sub q1
{
	my ($sql) = @_;
	return $node->safe_psql('old', "SET search_path = idempotency; $sql");
}

# At 1.0: row 1 dies (its only try failed).
$node->safe_psql('old', "CREATE EXTENSION idempotency VERSION '1.0'");
q1(q{
	SELECT idem_outbox_enqueue('orders', '{"n": 1}', 'dead');
	SELECT count(*) FROM idem_outbox_fetch('orders', 1, '1 hour');
	SET idempotency.outbox_max_attempts = 1;
	SELECT idem_outbox_nack(1, 'rejected');
});
$node->safe_psql('old', "ALTER EXTENSION idempotency UPDATE TO '1.1'");

# At 1.1: row 2 nacked (pending, backing off); rows 3 and 4 (key held) and
# 5 (no key) leased to relay A; rows 6 and 7 handed out together, 6 nacked
# and 7 put back, and so 8 and 9.
q1(q{
	SELECT count(*) FROM idem_outbox_enqueue_batch('orders',
		array_fill('{}'::jsonb, ARRAY[8]),
		ARRAY['nacked', 'held', 'held', NULL, 'putback', 'putback', 'repeat', 'repeat']);
	SELECT count(*) FROM idem_outbox_fetch('orders', 10, '1 hour', 2);
	SELECT idem_outbox_nack(2, 'down', 1);
	SELECT idem_outbox_nack(6, 'down', 1);
	SELECT idem_outbox_nack(8, 'down', 1);
});
is(q1("SELECT string_agg(id || ':' || state || ':' || attempts, ' ' ORDER BY id) FROM outbox"),
	'1:dead:1 2:pending:1 3:leased:1 4:leased:1 5:leased:1 6:pending:1 7:pending:0 8:pending:1 9:pending:0',
	'at 1.1: a put-back takes its hand-out back (7 and 9 at attempts 0)');

# What a database still at 1.1 gets: row 9's next hand-out repeats the
# fence (1) of the one a nack put back, and that hand-out's stale nack acts
# on the new holder's lease.
q1(q{UPDATE outbox SET available_at = now() WHERE id IN (8, 9)});
is(q1("SELECT string_agg(id || ':' || attempts, ' ' ORDER BY id) FROM idem_outbox_fetch('orders', 10, '1 hour', 2)"),
	'8:2 9:1', 'at 1.1: row 9 is handed out again with attempts 1');
is(q1("SELECT idem_outbox_nack(9, 'stale', 1)"), 't',
	"at 1.1: the first hand-out's nack of row 9 acts on the second's lease");
q1(q{SELECT idem_outbox_enqueue('orders', '{}', 'fresh')});

# A backend connected since 1.1, its statements prepared for 1.1.
my $live = $node->background_psql('old');
$live->query_safe(q{
	SET search_path = idempotency;
	SELECT idem_outbox_enqueue('live', '{}', 'k');
	SELECT count(*) FROM idem_outbox_fetch('live', 1, '1 hour');
	SELECT idem_outbox_nack(id, 'down', 1) FROM outbox WHERE topic = 'live';
	UPDATE outbox SET available_at = now() WHERE topic = 'live';
});

$node->command_ok(
	[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-c', 'ALTER EXTENSION idempotency UPDATE',
		'-d', $node->connstr('old') ],
	'ALTER EXTENSION idempotency UPDATE to 1.2, with the DDL guard active');
is($node->safe_psql('old', "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.2', 'the database is at 1.2');

# The failures carried over: a dead or pending row's attempts were its
# failures, a leased row's one more.  Pending rows that were handed out or
# failed get a fence above any 1.1 gave them (at least outbox_max_attempts,
# 3); the rows never handed out (10) are left alone.
is(q1("SELECT string_agg(id || ':' || state || ':' || attempts || ':' || failures, ' ' ORDER BY id) FROM outbox WHERE topic = 'orders'"),
	'1:dead:1:1 2:pending:3:1 3:leased:1:0 4:leased:1:0 5:leased:1:0 6:pending:3:1 7:pending:3:0 8:leased:2:1 9:pending:3:1 10:pending:0:0',
	'at 1.2: failures carried over, pending rows past their 1.1 fences');

# Relay A's leases, fenced at 1.1, are acknowledged at 1.2.
is(q1("SELECT idem_outbox_ack(ARRAY[3, 4, 5]::bigint[], ARRAY[1, 1, 1])"), '3',
	"at 1.2: the leased rows' 1.1 fences acknowledge them");

# Rows 6 and 7 again: new fences; the 1.1 relay's fence of 7 (1) matches
# nothing, the new holder's acknowledgement counts.
q1(q{UPDATE outbox SET available_at = now() WHERE id IN (6, 7)});
is(q1("SELECT string_agg(id || ':' || attempts, ' ' ORDER BY id) FROM idem_outbox_fetch('orders', 10, '1 hour', 2) WHERE key = 'putback'"),
	'6:4 7:4', 'at 1.2: the put-back rows are handed out with new fences');
is(q1("SELECT idem_outbox_ack(ARRAY[7]::bigint[], ARRAY[1])::text || ' ' || idem_outbox_nack(7, 'stale', 1)::text"),
	'0 false', "at 1.2: the 1.1 hand-out's fence of row 7 acts on nothing");
is(q1("SELECT idem_outbox_ack(ARRAY[6, 7]::bigint[], ARRAY[4, 4])"), '2',
	"at 1.2: the new holder's acknowledgement counts");

# The dead row: requeued, its failures reset and its attempts kept; its
# next hand-out's fence is new.
is(q1("SELECT idem_outbox_requeue(1); SELECT state || ':' || attempts || ':' || failures FROM outbox WHERE id = 1"),
	"t\npending:1:0", 'at 1.2: a requeue resets the failures, not the attempts');
is(q1("SELECT string_agg(id || ':' || attempts, ' ') FROM idem_outbox_fetch('orders', 10, '1 hour') WHERE id = 1"),
	'1:2', '... and the next hand-out carries a new fence');
is(q1("SELECT idem_outbox_ack(ARRAY[1]::bigint[], ARRAY[1])::text || ' ' || idem_outbox_ack(ARRAY[1]::bigint[], ARRAY[2])::text"),
	'0 1', "... which the 1.0 hand-out's fence does not match");

# The nacked row dies on its third failure (outbox_max_attempts 3), its
# first carried over from 1.1.
q1(q{UPDATE outbox SET available_at = now() WHERE id = 2});
q1(q{SELECT idem_outbox_nack(id, 'down', attempts) FROM idem_outbox_fetch('orders', 10, '1 hour') WHERE id = 2});
q1(q{UPDATE outbox SET available_at = now() WHERE id = 2});
q1(q{SELECT idem_outbox_nack(id, 'down', attempts) FROM idem_outbox_fetch('orders', 10, '1 hour') WHERE id = 2});
is(q1("SELECT state || ':' || attempts || ':' || failures FROM outbox WHERE id = 2"),
	'dead:5:3', 'at 1.2: the row carried over with one failure dies on its third');

# The backend connected since 1.1 runs 1.2's statements: its nack counts a
# failure, and its hand-out does not repeat a fence.
$live->query_safe(q{
	SELECT idem_outbox_nack(id, 'down', attempts) FROM idem_outbox_fetch('live', 1, '1 hour');
});
$live->quit;
is(q1("SELECT state || ':' || attempts || ':' || failures FROM outbox WHERE topic = 'live'"),
	'pending:4:2', 'a backend connected since 1.1 runs 1.2\'s statements');

# The updated database has the objects a fresh 1.2 install has.
my $objects = extension_objects_query();
$node->safe_psql('postgres', 'CREATE DATABASE fresh');
$node->safe_psql('fresh', 'CREATE EXTENSION idempotency');
is($node->safe_psql('fresh', "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.2', 'CREATE EXTENSION installs 1.2 (1.0, then the updates)');
is($node->safe_psql('old', $objects), $node->safe_psql('fresh', $objects),
	'the updated database has the objects of a fresh 1.2 install');
like($node->safe_psql('fresh', $objects), qr/failures integer not null/, '... which the query lists');

$node->stop;
done_testing();
