# No event lost to NOTIFY's limit.  With the default settings
# (outbox_retention = 0: a published row is deleted in the transaction that
# publishes it), a row routed to notify whose JSON is 8000 bytes or more
# goes out as a reference, {"id": ..., "truncated": true, "read": ...}, and
# the row stays for idempotency.notify_truncated_retention (1 hour): a
# listener, with SELECT on the outbox's columns it reads, runs the
# reference's query and gets the whole payload; a purge meanwhile deletes
# the other published rows but not this one; once the window has passed,
# the worker's purge deletes it.  Against both editions (t/IdemTest.pm):
# the SQL edition, without a worker, publishes a notify route's rows at
# the enqueue's commit, and purges when idem_run_maintenance() is called.

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('notify_truncated');
$node->init;
$node->append_conf('postgresql.conf', preload());
$node->start;
install_idempotency($node);

$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_route('big', 'notify', 'idem_big');
	CREATE ROLE listener LOGIN;
	GRANT USAGE ON SCHEMA idempotency TO listener;
	GRANT SELECT (id, payload, headers, created_at) ON idempotency.outbox TO listener;
});
# (the SQL edition defines no setting: unset, each is its default)
is($node->safe_psql('postgres', q{
		SELECT coalesce(current_setting('idempotency.outbox_retention', true), 'unset') || ' ' ||
		       coalesce(current_setting('idempotency.notify_truncated_retention', true), 'unset')}),
	edition() eq 'c' ? '0 1h' : 'unset unset', 'the settings are the defaults');
if (edition() eq 'c')
{
	$node->poll_query_until('postgres',
		"SELECT worker_last_round IS NOT NULL FROM idempotency.stats")
	  or die "the worker has not finished a round";
}

# a listener of its own role, connected before the rows are published
my $listener = $node->background_psql('postgres', extra_params => [ '-U', 'listener' ]);
$listener->query_safe('LISTEN idem_big');

my ($small, $large) = split /\n/, $node->safe_psql('postgres', q{
	BEGIN;
	SELECT idempotency.idem_outbox_enqueue('big', '{"n": 1}', 'k');
	SELECT idempotency.idem_outbox_enqueue('big', jsonb_build_object('blob', repeat('x', 9000)), 'k', '{"h": 1}');
	COMMIT;
});

# the worker publishes both in one transaction (one key, in order), the
# SQL edition each as it is enqueued: the small row is deleted, the large
# one kept as published
$node->poll_query_until('postgres',
	"SELECT state = 'published' FROM idempotency.outbox WHERE id = $large")
  or die "the large row was not published";
is($node->safe_psql('postgres', "SELECT count(*) FROM idempotency.outbox WHERE id = $small"),
	'0', 'the row sent whole is deleted as it is published (outbox_retention = 0)');

# The notifications went out with the commit that published the rows; the
# listener's psql prints them after its next query.
my $heard = '';
my $deadline = time + $PostgreSQL::Test::Utils::timeout_default;
until ($heard =~ /"truncated"/)
{
	die "the listener heard no truncated notification: $heard" if time > $deadline;
	$heard .= $listener->query_safe('SELECT 1');
	usleep(10_000) unless $heard =~ /"truncated"/;
}
like($heard,
	qr/Asynchronous notification "idem_big" with payload "\{"id" : $small, "topic" : "big", "key" : "k", "payload" : \{"n": 1\}/,
	'the small row reached the listener whole');
my $read = "SELECT payload, headers, created_at FROM idempotency.outbox WHERE id = $large";
like($heard,
	qr/Asynchronous notification "idem_big" with payload "\{"id" : $large, "topic" : "big", "key" : "k", "truncated" : true, "read" : "\Q$read\E"\}"/,
	'the large row reached it as a reference that says how to read the row');
my ($query) = $heard =~ /"read" : "([^"]*)"/;

# the listener runs the reference's query, with its column grants
like($listener->query_safe($query),
	qr/^\{"blob": "x{9000}"\}\|\{"h": 1\}\|\d{4}-\d\d-\d\d /,
	'the listener reads the whole payload, its headers and created_at by id');

# A purge keeps it, whatever outbox_retention says.  With the defaults:
$node->safe_psql('postgres', 'SELECT * FROM idempotency.idem_run_maintenance()');
is($node->safe_psql('postgres', "SELECT state FROM idempotency.outbox WHERE id = $large"),
	'published', 'a purge with the default settings keeps it');

# With an outbox_retention shorter than the window, the same purge deletes
# the other published rows past it and keeps this one: here a row a relay
# acknowledged, once it is older than outbox_retention (1 s).
my $acked = $node->safe_psql('postgres', q{
	SET idempotency.outbox_retention = '1h';
	SELECT idempotency.idem_outbox_enqueue('pulled', '{"n": 2}');
	SELECT idempotency.idem_outbox_ack(array_agg(id), array_agg(attempts))
	FROM idempotency.idem_outbox_fetch('pulled');
	SELECT id FROM idempotency.outbox WHERE topic = 'pulled' AND state = 'published';
});
($acked) = reverse split /\n/, $acked;
like($acked, qr/^\d+$/, 'a relay acknowledged a row, kept as published');
$node->poll_query_until('postgres',
	"SELECT published_at < now() - interval '1.5 s' FROM idempotency.outbox WHERE id = $acked")
  or die "the acknowledged row never got older than 1.5 s";
$node->safe_psql('postgres', q{
	SET idempotency.outbox_retention = '1s';
	SELECT * FROM idempotency.idem_run_maintenance();
});
is($node->safe_psql('postgres', qq{
		SELECT string_agg(id::text || ' ' || state, ', ' ORDER BY id)
		FROM idempotency.outbox WHERE id IN ($acked, $large)}),
	"$large published",
	'a purge with outbox_retention = 1s deletes the acknowledged row and keeps the truncated one');
like($listener->query_safe($query), qr/^\{"blob": "x{9000}"\}/,
	'the listener can still read it');

# Once the window has passed, the worker's purge deletes it (the SQL
# edition's, called as pg_cron would).
# (The SQL edition's settings are set per database, by its owner.)
if (edition() eq 'c')
{
	$node->safe_psql('postgres', q{
		ALTER SYSTEM SET idempotency.notify_truncated_retention = '1s';
		ALTER SYSTEM SET idempotency.purge_interval = '100ms';
	});
	$node->reload;
}
else
{
	$node->safe_psql('postgres', q{
		ALTER DATABASE postgres SET idempotency.notify_truncated_retention = '1s';
	});
}
my $gone = "SELECT count(*) = 0 FROM idempotency.outbox WHERE id = $large";
if (edition() eq 'sql')
{
	my $deadline = time + $PostgreSQL::Test::Utils::timeout_default;
	until ($node->safe_psql('postgres', $gone) eq 't' || time > $deadline)
	{
		$node->safe_psql('postgres', 'SELECT * FROM idempotency.idem_run_maintenance()');
		usleep(100_000);
	}
}
ok($node->poll_query_until('postgres', $gone),
	'the purge deletes the row once notify_truncated_retention has passed');

$listener->quit;
$node->stop;
done_testing();
