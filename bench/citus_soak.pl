# The Citus soak (issue 31, item 4), for a person to run where Citus is
# installed: make soak-citus SOAK_MINUTES=10.  On t/citus's cluster (a
# coordinator and two workers, t/citus/CitusCluster.pm), for SOAK_MINUTES
# minutes (1), everything through the coordinator, for one tenant "soak":
#
# - 4 producers, each transaction claiming a key of its own, enqueueing an
#   event on one of 50 ordering keys and completing the key; a failed
#   transaction is retried with the same key (its claim replays if it had
#   committed after all), so an event is committed once;
# - 1 consumer: fetches batches (the pull API), marks each row processed
#   (idem_mark_processed, by the row's id, as a broker's consumer would)
#   and acks what it processed;
# - races: 16 sessions claim one key at once, the winner writes a side
#   effect and completes, in one transaction; then a late retry claims it
#   again, as a client would;
# - the tenant's shard group moves between the workers, 4 times in
#   block_writes mode and 4 in force_logical mode, over and over;
# - every 20 s, a worker's idempotency worker gets SIGKILL, and that node
#   restarts at once (the postmaster's crash restart).
#
# Then it drains the outbox and ends with one line:
#
#   citus soak: N committed, L lost, D duplicated, O order violations, X double executions, C crashes
#
# N: producers' events committed; L: committed events never processed;
# D: events processed more than once; O: events a consumer processed after
# a later event of the same producer and key; X: side effects of a race key
# beyond the first; C: server processes ended by a signal other than the
# soak's SIGKILLs (from the servers' logs).
#
# SOAK_FAULT plants a fault so that its counter must move (the soak is known
# to see what it counts): lost (the consumer acks one event it did not
# process), duplicated (a producer enqueues one event again outside its
# claimed key, as a retry without idempotency does), order (the consumer
# processes one batch backwards), double (a race's winner releases its key
# instead of completing it, so the late retry runs the side effect again),
# crash (one SIGSEGV instead of a SIGKILL).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/../t/citus";

use CitusCluster;
use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $minutes = $ENV{SOAK_MINUTES} // 1;
my $fault = $ENV{SOAK_FAULT} // '';
die "SOAK_FAULT: lost, duplicated, order, double or crash\n"
  if $fault ne '' && $fault !~ /^(lost|duplicated|order|double|crash)$/;

# a node whose process was killed restarts at once (the test clusters keep
# it down by default); the retries would fill the logs with statements
my $cluster = CitusCluster->new(conf => "restart_after_crash = on\nlog_statement = 'none'\nlog_min_error_statement = 'panic'\n");
my $c = $cluster->coordinator;
my ($w1, $w2) = $cluster->workers;
$c->safe_psql('postgres', q{
	CREATE TABLE side_effects (tenant text COLLATE "C" NOT NULL, key text);
	SELECT create_distributed_table('side_effects', 'tenant', colocate_with => 'payments');});
my $shard = $c->safe_psql('postgres',
	q{SELECT get_shard_id_for_distribution_column('idempotency.keys', 'soak'::text)});

# --- sessions: a psql each, fed a step at a time; a step ends with an
# echoed line "step ..." that says how it went
my @psql = ('psql', '-X', '-q', '-At', '-h', $c->host, '-p', $c->port, 'postgres');
my (@harness, %session);
sub session
{
	my ($name) = @_;
	my $s = $session{$name} = { name => $name, in => '', out => '', err => '', busy => 0, seen => 0 };
	push @harness, '&' if @harness;
	push @harness, [@psql], '<', \$s->{in}, '>', \$s->{out}, '2>', \$s->{err};
	return $s;
}
sub feed { my ($s, $step) = @_; $s->{in} .= $step; $s->{busy} = 1; }
# a step that failed is fed again 0.1 s later, as a client backs off
sub later { my ($s) = @_; $s->{not_before} = time + 0.1; }
sub ready { my ($s) = @_; return !$s->{busy} && time >= ($s->{not_before} // 0); }
# the lines a session printed since last asked, once its step has ended
sub step_lines
{
	my ($s) = @_;
	return () unless $s->{busy};
	my $new = substr($s->{out}, $s->{seen});
	return () unless $new =~ /^step [^\n]*\n/m;
	$s->{seen} = length $s->{out};
	$s->{busy} = 0;
	return split /\n/, $new;
}

# a statement, and the lines that say what it did (psql's ERROR variable)
sub checked
{
	my ($sql, $ok, $fail) = @_;
	return "$sql\n\\if :ERROR\n\\set failed 1\n$fail\n\\else\n$ok\n\\endif\n";
}

# --- producers
my (%committed, %next_seq);
my @producers = map { session("producer$_") } 1 .. 4;
sub produce
{
	my ($p, $seq) = @_;
	# three events in a row on a key, so that a batch holds several of one
	# producer's events on one key, whose order the consumer must keep
	my $key = 'k' . (($p * 13 + int($seq / 3)) % 50);
	my $payload = qq{{"p": $p, "seq": $seq, "k": "$key"}};
	my $extra = '';
	if ($fault eq 'duplicated' && $p == 1 && $seq == 3)
	{
		# planted: the event enqueued again outside the claimed key
		$extra = "SELECT idempotency.idem_outbox_enqueue('soak', '$payload', '$key') AS dup \\gset\n";
	}
	return qq{\\set failed 0
$extra
BEGIN;
SELECT outcome = 'claimed' AS claimed, outcome = 'replay' AS replayed
FROM idempotency.idem_claim('soak', 'p$p-$seq') \\gset
\\if :ERROR
ROLLBACK;
\\echo step retry
\\elif :replayed
ROLLBACK;
\\echo step committed $p $seq
\\elif :claimed
}
	  . checked("SELECT idempotency.idem_outbox_enqueue('soak', '$payload', '$key') AS id \\gset", '', '')
	  . checked("SELECT idempotency.idem_complete('soak', 'p$p-$seq', 200, 'sent') AS stored \\gset", '', '')
	  . qq{\\if :failed
ROLLBACK;
\\echo step retry
\\else
COMMIT;
\\if :ERROR
\\echo step retry
\\else
\\echo step committed $p $seq
\\endif
\\endif
\\else
ROLLBACK;
\\echo step retry
\\endif
};
}

# --- the consumer
my $consumer = session('consumer');
my (%processed, %last_seq);
my ($lost, $duplicated, $order) = (0, 0, 0);
my ($planted_lost, $planted_order) = (0, 0);
my @pending_batch;    # rows fetched, to process then ack
my $fetch = q{SELECT coalesce(string_agg(id || ':' || attempts || ':' || (payload->>'p') || ':'
	|| (payload->>'seq') || ':' || key, ' ' ORDER BY id), '') AS batch
FROM idempotency.idem_outbox_fetch('soak', 20, '5s', 5) \gset
\if :ERROR
\echo step fetched
\else
\echo step fetched :batch
\endif
};
sub process_batch
{
	my @rows = map { [ split /:/ ] } @_;
	if ($fault eq 'order' && !$planted_order && @rows > 1)
	{
		my %by;
		$by{"$_->[2]:$_->[4]"}++ for @rows;
		if (grep { $_ > 1 } values %by)
		{
			@rows = reverse @rows;    # planted: a batch processed backwards
			$planted_order = 1;
		}
	}
	my $step = "\\set failed 0\n";
	for my $row (@rows)
	{
		my ($id, $attempts, $p, $seq, $key) = @$row;
		if ($fault eq 'lost' && !$planted_lost && $seq >= 5)
		{
			# planted: acked without being processed
			$planted_lost = 1;
			$step .= "\\echo acked $id $attempts\n";
			next;
		}
		$step .= "\\if :failed\n\\else\n"
		  . checked("SELECT idempotency.idem_mark_processed('soak', 'ev-$id') AS fresh \\gset",
			"\\echo processed $id $attempts $p $seq $key :fresh", '')
		  . "\\endif\n";
	}
	return $step . "\\echo step processed\n";
}

# --- races
my @racers = map { session("racer$_") } 1 .. 16;
my $late = session('late retry');
my $round = 0;
sub race
{
	my ($key, $late_retry) = @_;
	my $end = $fault eq 'double' && !$late_retry
	  ? "SELECT idempotency.idem_release('soak', '$key') AS released \\gset"
	  : "SELECT idempotency.idem_complete('soak', '$key', 201, 'done') AS stored \\gset";
	return qq{\\set failed 0
BEGIN;
SELECT outcome = 'claimed' AS won FROM idempotency.idem_claim('soak', '$key') \\gset
\\if :ERROR
\\set failed 1
\\elif :won
INSERT INTO side_effects VALUES ('soak', '$key');
$end
\\endif
\\if :failed
ROLLBACK;
\\echo step retry
\\else
COMMIT;
\\if :ERROR
\\echo step retry
\\else
\\echo step raced
\\endif
\\endif
};
}

# --- the moves
my $mover = session('mover');
my $moves = 0;
my $on = $cluster->node_of('idempotency.keys', 'soak');
sub next_move
{
	# where the shard is now (a move that failed at its end may have moved it)
	my ($ret, $port) = $c->psql('postgres', qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		WHERE p.shardid = $shard});
	($on) = grep { $_->port == $port } ($w1, $w2) if $ret == 0 && $port =~ /^\d+$/ && $port != $on->port;
	my $to = $on->port == $w1->port ? $w2 : $w1;
	my $mode = ($moves % 8) < 4 ? 'block_writes' : 'force_logical';
	return qq{CALL citus_cleanup_orphaned_resources();
SELECT citus_move_shard_placement($shard, '@{[ $on->host ]}', @{[ $on->port ]},
	'@{[ $to->host ]}', @{[ $to->port ]}, shard_transfer_mode => '$mode');
\\if :ERROR
\\echo step unmoved
\\else
\\echo step moved
\\endif
};
}

my $timeout = IPC::Run::timeout(60 * ($minutes + 10));
my $h = IPC::Run::start(@harness, $timeout);
feed($_, produce(substr($_->{name}, -1), $next_seq{ $_->{name} } = 1)) for @producers;
feed($consumer, $fetch);
feed($mover, next_move());
my @race_done;
sub start_round
{
	$round++;
	@race_done = ();
	feed($_, race("race-$round")) for @racers;
}
start_round();

my $end = time + 60 * $minutes;
my $next_kill = time + 20;
my ($kills, $planted_crash) = (0, 0);
my $draining = 0;
my ($drained_at, $next_check);
while (1)
{
	$h->pump_nb;
	my $now = time;
	for my $s (@producers)
	{
		my $p = substr($s->{name}, -1);
		for (step_lines($s))
		{
			$committed{"$1 $2"}++, $next_seq{ $s->{name} }++ if /^step committed (\d+) (\d+)/;
			later($s) if /^step retry/;
		}
		feed($s, produce($p, $next_seq{ $s->{name} })) if ready($s) && $now < $end;
	}
	for (step_lines($consumer))
	{
		if (/^step fetched ?(.*)$/)
		{
			my @rows = split / /, $1;
			@pending_batch = @rows;
			feed($consumer, @rows ? process_batch(@rows) : $fetch);
		}
		elsif (/^processed (\d+) (\d+) (\d+) (\d+) (\S+) (t|f)$/)
		{
			my ($id, $attempts, $p, $seq, $key, $fresh) = ($1, $2, $3, $4, $5, $6);
			push @{ $consumer->{ack} }, [ $id, $attempts ];
			next unless $fresh eq 't';
			$processed{"$p $seq"}++;
			$order++ if ($last_seq{"$p $key"} // 0) > $seq;
			$last_seq{"$p $key"} = $seq if ($last_seq{"$p $key"} // 0) < $seq;
		}
		elsif (/^acked (\d+) (\d+)$/)
		{
			push @{ $consumer->{ack} }, [ $1, $2 ];
		}
		elsif (/^step processed/)
		{
			my $acks = delete $consumer->{ack} // [];
			my $ack = @$acks
			  ? "SELECT idempotency.idem_outbox_ack('{" . join(',', map { $_->[0] } @$acks) . "}', '{"
			  . join(',', map { $_->[1] } @$acks) . "}') AS n \\gset\n"
			  : '';
			feed($consumer, "$ack\\echo step acked\n");
		}
		elsif (/^step acked/)
		{
			feed($consumer, $fetch);
		}
	}
	for my $s (@racers)
	{
		for (step_lines($s))
		{
			push @race_done, $s if /^step raced/;
			later($s), $s->{retry} = 1 if /^step retry/;
		}
		feed($s, race("race-$round")), $s->{retry} = 0 if $s->{retry} && ready($s);    # a client's retry
	}
	if (@race_done == @racers && !$late->{busy} && !$late->{raced})
	{
		feed($late, race("race-$round", 1));
		$late->{raced} = 1;
	}
	feed($late, race("race-$round", 1)), $late->{retry} = 0 if $late->{retry} && ready($late);
	for (step_lines($late))
	{
		later($late), $late->{retry} = 1 if /^step retry/;
		if (/^step raced/)
		{
			$late->{raced} = 0;
			start_round() if $now < $end;
			@race_done = () if $now >= $end;
		}
	}
	for (step_lines($mover))
	{
		$moves++ if /^step moved/;
		later($mover) if /^step unmoved/;
		$mover->{idle} = 1;
	}
	if ($mover->{idle} && ready($mover) && $now < $end)
	{
		$mover->{idle} = 0;
		feed($mover, next_move());
	}
	if ($now >= $next_kill && $now < $end)
	{
		# SIGKILL (or, planted, SIGSEGV) a worker's idempotency worker
		my $node = $kills % 2 ? $w2 : $w1;
		my ($ret, $pid) = $node->psql('postgres',
			q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency worker'});
		if ($ret == 0 && $pid =~ /^(\d+)/)
		{
			my $signal = $fault eq 'crash' && !$planted_crash++ ? 'SEGV' : 'KILL';
			kill $signal, $1;
			$kills++;
		}
		$next_kill = $now + 20;
	}
	die "the soak did not end 10 minutes after its time" if $now > $end + 600;
	if ($now >= $end && $now >= ($next_check // 0)
		&& !grep { $_->{busy} || $_->{retry} } @producers, @racers, $late, $mover)
	{
		$next_check = $now + 1;
		# drained: nothing pending or leased is left
		my ($ret, $left) = $c->psql('postgres',
			q{SELECT count(*) FROM idempotency.outbox WHERE topic = 'soak' AND state IN ('pending', 'leased')});
		# (a row processed is acked only after its line was read)
		last if $ret == 0 && $left eq '0';
		$drained_at //= $now;
		die "the outbox did not drain in 5 minutes" if $now - $drained_at > 300;
	}
	select(undef, undef, undef, 0.005);
}
$_->{in} .= "\\q\n" for values %session;
$h->finish;

# --- the counts
my $n = keys %committed;
$lost = grep { !$processed{$_} } keys %committed;
$duplicated = grep { $_ > 1 } values %processed;
my $double = $c->safe_psql('postgres',
	q{SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM side_effects GROUP BY key) s});
my $crashes = 0;
for my $node ($c, $w1, $w2)
{
	my $log = slurp_file($node->logfile);
	$crashes += () = $log =~ /terminated by signal (?!9:)\d+/g;
}
note("$moves moves, $kills kills, $round race rounds");
my $line = "citus soak: $n committed, $lost lost, $duplicated duplicated, $order order violations, "
  . "$double double executions, $crashes crashes";
diag($line);
my %counter = (lost => $lost, duplicated => $duplicated, order => $order,
	double => $double, crash => $crashes);
for my $name (sort keys %counter)
{
	if ($name eq $fault)
	{
		cmp_ok($counter{$name}, '>', 0, "the planted fault moves the $name counter");
	}
	else
	{
		is($counter{$name}, 0, "no $name");
	}
}
cmp_ok($n, '>', 0, 'events were committed');
$cluster->stop;
done_testing();
