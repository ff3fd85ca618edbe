# Prometheus: Debian's prometheus-postgres-exporter, started with
# prometheus/queries.yaml against a test instance, as the least-privileged
# role of doc/integrations/prometheus.md, serves each column of
# idempotency.stats as a metric, with the view's value after known traffic:
# claims of every outcome, a takeover, releases, completions, marks, a purge,
# outbox rows of three topics in each state, a publish and a failure of the
# worker; and a second database, which the exporter finds by itself.  The
# exporter listens on 127.0.0.1 only, on a free port; it is stopped on
# every way out.  Without the exporter installed the test fails:
# scripts/deps.sh installs it.
#
# Every column of the view must have its metric: a counter (a bigint column
# the view takes from idempotency.idem_stats_counters()) as
# idempotency_<column>_total of type counter, the rest as the mapping below
# says; a column added to the view without a metric fails here.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use HTTP::Tiny;
use IPC::Run;
use List::Util qw(max sum0);
use Time::HiRes qw(usleep);

my $exporter_bin = '/usr/bin/prometheus-postgres-exporter';
# a failure, not a skip: the other tests of the suite still run
-x $exporter_bin
  or die "$exporter_bin is missing: install Debian's prometheus-postgres-exporter "
  . "(scripts/deps.sh does, as root)\n";

# prove runs in the top directory of the tree
my $queries = 'prometheus/queries.yaml';
my $doc = 'doc/integrations/prometheus.md';
-r $queries or die "$queries is missing\n";

my $node = PostgreSQL::Test::Cluster->new('prometheus');
$node->init;
# purge_interval: the worker purges once, at its start, so that the expired
# rows made below stay, counted, until the scrape; max_attempts: a row dies
# at its first failure, so that the failing route's counters stop moving.
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.purge_interval = '24h'
idempotency.outbox_max_attempts = 1
});
$node->start;
# app, and shop, which the exporter finds by itself (--auto-discover-databases)
$node->safe_psql('postgres', 'CREATE DATABASE app');
$node->safe_psql('postgres', 'CREATE DATABASE shop');
$node->safe_psql($_, 'CREATE EXTENSION idempotency') for ('app', 'shop');

# --- the exporter's role, with the very statements of the doc's block
open(my $fh, '<', $doc) or die "cannot read $doc: $!";
my $markdown = do { local $/; <$fh> };
close $fh;
my ($role_sql) = $markdown =~ /<!-- exporter-role -->\n```sql\n(.*?)```/s
  or die "no ```sql block after <!-- exporter-role --> in $doc";
$node->safe_psql('app', $role_sql);
# in another database, the grants again (the role is the cluster's)
(my $grants_sql = $role_sql) =~ s/^CREATE ROLE .*\n//m;
$node->safe_psql('shop', $grants_sql);

# least privilege: it reads no response, payload or event id
for my $read ('body FROM idempotency.keys', 'payload FROM idempotency.outbox',
	'event_id FROM idempotency.processed_events')
{
	my ($ret, $out, $err) = $node->psql('app', "SET ROLE prometheus; SELECT $read");
	like($err, qr/permission denied/, "the exporter's role may not read $read");
}

# --- each worker has made its first round (its purge pass)
for my $db ('app', 'shop')
{
	$node->poll_query_until($db,
		'SELECT worker_pid IS NOT NULL AND worker_last_round IS NOT NULL FROM idempotency.stats')
	  or die "the worker of $db did not finish its first round";
}
$node->safe_psql('shop', q{SELECT idempotency.idem_claim('shop', 'only')});

# --- known traffic
$node->safe_psql('app', q{
	CREATE FUNCTION public.sink(e idempotency.outbox) RETURNS void LANGUAGE sql AS 'SELECT';
	CREATE FUNCTION public.refuse(e idempotency.outbox) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		RAISE EXCEPTION 'downstream rejected event %', e.id;
	END $$;

	-- claimed and stored, then a replay and a mismatch
	SELECT idempotency.idem_claim('shop', 'k1', 'fp1');
	SELECT idempotency.idem_complete('shop', 'k1', 201, '{}');
	SELECT outcome FROM idempotency.idem_claim('shop', 'k1', 'fp1');
	SELECT outcome FROM idempotency.idem_claim('shop', 'k1', 'fp2');
	-- in progress (committed), then a conflicting claim
	SELECT idempotency.idem_claim('shop', 'k2');
	SELECT outcome FROM idempotency.idem_claim('shop', 'k2');
	-- released twice: a transient status, then idem_release
	SELECT idempotency.idem_claim('shop', 'k3');
	SELECT idempotency.idem_complete('shop', 'k3', 503);
	SELECT idempotency.idem_claim('shop', 'k4');
	SELECT idempotency.idem_release('shop', 'k4');
	-- a lease that runs out at once, taken over below
	SELECT idempotency.idem_claim('shop', 'k5', lease => '1 millisecond');
	-- completed keys that expire within a second: purged below
	SELECT idempotency.idem_claim('shop', 'old' || n, ttl => '1 second') FROM generate_series(1, 2) n;
	SELECT idempotency.idem_complete('shop', 'old' || n, 200) FROM generate_series(1, 2) n;

	SELECT idempotency.idem_mark_processed('billing', 'e' || n) FROM generate_series(1, 3) n;
	SELECT idempotency.idem_mark_processed('billing', 'e1');
	SELECT idempotency.idem_mark_processed('billing', 'old', '1 second');
});
$node->poll_query_until('app', q{
	SELECT (SELECT count(*) FROM idempotency.keys WHERE expires_at <= now()) = 2
	   AND (SELECT count(*) FROM idempotency.processed_events WHERE expires_at <= now()) = 1})
  or die 'the short-lived keys and event did not expire';
is($node->safe_psql('app', 'SELECT purged_keys, purged_events FROM idempotency.idem_run_maintenance()'),
	'2|1', 'idem_run_maintenance purges the expired keys and event');
is($node->safe_psql('app', q{SELECT outcome, attempt FROM idempotency.idem_claim('shop', 'k5')}),
	'claimed|2', 'the claim whose lease ran out is taken over');

# expired rows that stay until the scrape (the worker purges again in 24 h)
$node->safe_psql('app', q{
	SELECT idempotency.idem_claim('shop', 'gone', ttl => '1 second');
	SELECT idempotency.idem_complete('shop', 'gone', 200);
	SELECT idempotency.idem_mark_processed('billing', 'gone', '1 second');
});
$node->poll_query_until('app', 'SELECT keys_expired = 1 AND events_expired = 1 FROM idempotency.stats')
  or die 'the key and event gone did not expire';

# the outbox: audit (no route) has rows pending, leased and dead; invoices
# (no route) one pending row; orders is published by the worker; broken's
# function fails, so its row dies at once
$node->safe_psql('app', q{
	SELECT idempotency.idem_outbox_enqueue('audit', jsonb_build_object('n', n)) FROM generate_series(1, 4) n;
	SELECT idempotency.idem_outbox_enqueue('invoices', '{"n": 1}', 'customer-7');
});
my $leased = $node->safe_psql('app',
	q{SELECT id FROM idempotency.idem_outbox_fetch('audit', 1, '1 hour')});
my $nacked = $node->safe_psql('app',
	q{SELECT id FROM idempotency.idem_outbox_fetch('audit', 1, '1 hour')});
is($node->safe_psql('app', "SELECT idempotency.idem_outbox_nack($nacked, 'rejected')"),
	't', 'a relay reports a failure');
$node->safe_psql('app', q{
	SELECT idempotency.idem_outbox_route('orders', 'function', 'public.sink');
	SELECT idempotency.idem_outbox_route('broken', 'function', 'public.refuse');
	SELECT idempotency.idem_outbox_enqueue('orders', jsonb_build_object('n', n), 'o' || n % 2)
	FROM generate_series(1, 3) n;
	SELECT idempotency.idem_outbox_enqueue('broken', '{"n": 1}');
});
$node->poll_query_until('app', q{
	SELECT published = 3 AND publish_failures = 1
	   AND NOT EXISTS (SELECT FROM idempotency.outbox
	                   WHERE topic IN ('orders', 'broken') AND state IN ('pending', 'leased'))
	FROM idempotency.stats})
  or die 'the worker did not publish orders and give up on broken: '
  . $node->safe_psql('app', 'SELECT * FROM idempotency.stats');

is($node->safe_psql('app', q{
		SELECT keys_in_progress, keys_completed, keys_expired, events, events_expired,
		       outbox_pending, outbox_dead, claims, replays, conflicts, mismatches,
		       takeovers, released, purged, published, publish_failures
		FROM idempotency.stats}),
	'2|1|1|3|1|4|2|9|1|1|1|1|2|3|3|1',
	'the view counts the traffic');

# --- the exporter
my $port = PostgreSQL::Test::Cluster::get_free_port();
my $log = "${PostgreSQL::Test::Utils::log_path}/prometheus_exporter.log";
my $exporter;

# stopped on every way out: at the end, on die, and on a signal
sub stop_exporter
{
	return unless $exporter;
	$exporter->kill_kill(grace => 5) if $exporter->pumpable;
	$exporter = undef;
}
END { stop_exporter(); }
local $SIG{INT} = local $SIG{TERM} = sub { stop_exporter(); die "killed\n"; };

{
	local $ENV{DATA_SOURCE_NAME} = sprintf('host=%s port=%d user=prometheus dbname=app sslmode=disable',
		$node->host, $node->port);
	$exporter = IPC::Run::start(
		[
			$exporter_bin, "--web.listen-address=127.0.0.1:$port",
			"--extend.query-path=$queries", '--auto-discover-databases',
			'--include-databases=shop', '--log.level=info'
		],
		'<', \undef, '>&', $log);
}
my $version = `$exporter_bin --version 2>&1`;
note "exporter: " . (split /\n/, $version)[0];

my $http = HTTP::Tiny->new(timeout => 30);
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
# the landing page answers once it listens (it runs no query, so that the
# first scrape of /metrics below is the first run of the cached queries)
until ($http->get("http://127.0.0.1:$port/")->{status} == 200)
{
	die "the exporter exited:\n" . slurp_file($log) unless $exporter->pumpable;
	die "the exporter did not answer on 127.0.0.1:$port:\n" . slurp_file($log)
	  if time() > $deadline;
	usleep(50_000);
}

# the view read just before and just after the scrape: the publish lag grows
# between the two, everything else must not move
my $view_sql = q{SELECT row_to_json(s) FROM idempotency.stats s};
my $before = $node->safe_psql('app', $view_sql);
my $response = $http->get("http://127.0.0.1:$port/metrics");
my $after = $node->safe_psql('app', $view_sql);
is($response->{status}, 200, 'GET /metrics answers 200');
my $body = $response->{content};

# "name{labels} value" lines, and "# TYPE name type"
my (%samples, %types);
for my $line (split /\n/, $body)
{
	if ($line =~ /^# TYPE (\S+) (\S+)$/) { $types{$1} = $2; next; }
	next if $line =~ /^#/ || $line !~ /\S/;
	my ($name, $labels, $value) = $line =~ /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)/
	  or die "unparsable line: $line";
	my %l = ($labels // '') =~ /(\w+)="((?:[^"\\]|\\.)*)"/g;
	push @{ $samples{$name} }, { labels => \%l, value => $value };
}
note join("\n", grep { /^idempotency_/ } split /\n/, $body);

sub samples_of
{
	my ($name, %want) = @_;
	return grep {
		my $s = $_;
		!grep { ($s->{labels}{$_} // '') ne $want{$_} } keys %want
	} @{ $samples{$name} // [] };
}

# one sample, of the app database unless another is asked for
sub value_of
{
	my ($name, %want) = @_;
	my @s = samples_of($name, database => 'app', %want);
	return undef unless @s == 1;
	return $s[0]{value};
}

is($samples{pg_up}[0]{value}, '1', 'the exporter reaches the server');
my @load = samples_of('pg_exporter_user_queries_load_error', filename => $queries);
is(scalar(@load) . ' ' . ($load[0]{value} // ''), '1 0', 'it loads the queries file');
is($samples{pg_exporter_last_scrape_error}[0]{value}, '0',
	'every query ran without an error, as the exporter\'s role')
  or diag slurp_file($log);

# --- every column of the view has its metric, with the view's value
my %view_before = %{ decode_row($before) };
my %view = %{ decode_row($after) };
my %counter = map { $_ => 1 } split /\n/, $node->safe_psql('app', q{
	SELECT a.name
	FROM pg_proc p,
	     unnest(p.proargnames, p.proallargtypes::regtype[], p.proargmodes) AS a(name, type, mode)
	WHERE p.oid = 'idempotency.idem_stats_counters()'::regprocedure
	  AND a.mode = 'o' AND a.type = 'bigint'::regtype});
ok(scalar(keys %counter) >= 10, 'idem_stats_counters() has its counters: ' . join(', ', sort keys %counter));

my @topics = ('audit', 'invoices', 'broken');
my %outbox = (
	pending => { audit => 2, invoices => 1, broken => 0 },
	leased => { audit => 1, invoices => 0, broken => 0 },
	dead => { audit => 1, invoices => 0, broken => 1 });
my %gauge = (
	keys_in_progress => sub { value_of('idempotency_keys_in_progress') },
	keys_completed => sub { value_of('idempotency_keys_completed') },
	keys_expired => sub { value_of('idempotency_keys_expired') },
	events => sub { value_of('idempotency_events_retained') },
	events_expired => sub { value_of('idempotency_events_expired') },
	outbox_pending => sub {
		sum0(map { $_->{value} } samples_of('idempotency_outbox_pending', database => 'app'),
			samples_of('idempotency_outbox_leased', database => 'app'));
	},
	outbox_dead => sub {
		sum0(map { $_->{value} } samples_of('idempotency_outbox_dead', database => 'app'));
	},
	worker_pid => sub { value_of('idempotency_worker_up') },
	worker_last_round => sub { value_of('idempotency_worker_last_round_timestamp_seconds') },
	publish_lag => sub {
		max(map { $_->{value} } samples_of('idempotency_outbox_publish_lag_seconds', database => 'app'));
	});

my @columns = split /\n/, $node->safe_psql('app', q{
	SELECT attname FROM pg_attribute
	WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 0 AND NOT attisdropped
	ORDER BY attnum});
for my $column (@columns)
{
	if ($counter{$column})
	{
		my $metric = "idempotency_${column}_total";
		is($types{$metric}, 'counter', "$metric is a counter");
		is_value(value_of($metric), $view{$column}, "$metric is the view's $column ($view{$column})");
		is($view_before{$column}, $view{$column}, "$column did not move during the scrape");
	}
	elsif ($column eq 'worker_pid')
	{
		is($gauge{$column}->(), '1', 'idempotency_worker_up is 1 while the view has a worker_pid');
	}
	elsif ($column eq 'worker_last_round')
	{
		my $epoch = $node->safe_psql('app',
			'SELECT extract(epoch FROM worker_last_round) FROM idempotency.stats');
		my $got = $gauge{$column}->();
		ok(defined $got && abs($got - $epoch) < 0.001,
			"idempotency_worker_last_round_timestamp_seconds is the view's worker_last_round ($epoch): "
			  . ($got // 'none'));
	}
	elsif ($column eq 'publish_lag')
	{
		# seconds, between the view's lag before and after the scrape
		my ($low, $high) = split /\|/, $node->safe_psql('app', qq{
			SELECT extract(epoch FROM '$view_before{publish_lag}'::interval),
			       extract(epoch FROM '$view{publish_lag}'::interval)});
		my $got = $gauge{$column}->();
		ok(defined $got && $got >= $low - 0.001 && $got <= $high + 0.001,
			"the largest idempotency_outbox_publish_lag_seconds ("
			  . ($got // 'none') . ") is the view's publish_lag, between $low and $high");
	}
	elsif ($gauge{$column})
	{
		is_value($gauge{$column}->(), $view{$column}, "the metric of $column is the view's ($view{$column})");
		is($view_before{$column}, $view{$column}, "$column did not move during the scrape");
	}
	else
	{
		fail("idempotency.stats' column $column has no metric in prometheus/queries.yaml");
	}
}

# --- per topic, what the traffic left
for my $topic (@topics)
{
	for my $state (sort keys %outbox)
	{
		is_value(value_of("idempotency_outbox_$state", topic => $topic), $outbox{$state}{$topic},
			"idempotency_outbox_$state\{topic=\"$topic\"} is $outbox{$state}{$topic}");
	}
}
is(scalar(samples_of('idempotency_outbox_pending', database => 'app')), 3,
	'no series for orders, whose rows are all published');
is(value_of('idempotency_outbox_publish_lag_seconds', topic => 'broken'), '0',
	'no lag where no row is ready');
cmp_ok(value_of('idempotency_outbox_publish_lag_seconds', topic => 'invoices'), '>', 0,
	'a lag where a row waits');

# --- the other database, through the same exporter
is_value(value_of('idempotency_claims_total', database => 'shop'), 1,
	'shop, found by the exporter, has its own counters');
is_value(value_of('idempotency_keys_in_progress', database => 'shop'), 1, 'and its own keys');
is_value(value_of('idempotency_worker_up', database => 'shop'), 1, 'and its own worker');

# --- each metric has a help text of its own
for my $name (grep { /^idempotency_/ } sort keys %samples)
{
	like($body, qr/^# HELP \Q$name\E (?!Unknown metric)\S.*$/m, "$name has a help text");
}

stop_exporter();
$node->stop;
done_testing();

# a sample's value (as Go prints it: 9, 1e+06, 1.7e+09) against a number
sub is_value
{
	my ($got, $want, $name) = @_;
	ok(defined $got && defined $want && $got == $want, $name)
	  or diag 'got ' . ($got // 'no single sample') . ', expected ' . ($want // 'NULL');
}

sub decode_row
{
	my ($json) = @_;
	# the view's row as JSON: numbers, strings and nulls only
	my %row;
	while ($json =~ /"(\w+)":(?:"((?:[^"\\]|\\.)*)"|(null)|([-0-9.eE+]+))/g)
	{
		$row{$1} = defined $2 ? $2 : defined $3 ? undef : $4;
	}
	return \%row;
}
