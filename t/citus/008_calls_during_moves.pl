# Calls through the coordinator while their tenant's shard group moves:
# 7 sessions loop, one through claim + complete, one through enqueue, one
# through mark_processed, one through a plain router INSERT into the
# colocated table payments, all for tenant t1, one through claim +
# release, and two relays on topics of the same shard group, each
# enqueueing a row and fetching one, one acknowledging it and the other
# nacking it (both fenced), while t1's shard group moves between the two
# workers 4 times in block_writes mode and 4 times in force_logical mode.
# Every call of ours
# must succeed, as Citus's own router INSERT does (it waits behind the move
# and lands on the new placement), and afterwards the tables hold exactly
# the rows of the calls that succeeded: none lost, none twice.
#
# The calls come in the forms Citus delegates: the distribution argument a
# constant (complete, mark_processed), a parameter bound to a prepared
# statement (claim) or an expression that folds to a constant (enqueue).
#
# Each session is a psql reading a script fed in batches of iterations: a
# call's outcome is echoed as "ok KIND ID" or "fail KIND ID SQLSTATE", from
# psql's ERROR and SQLSTATE variables.  The moves run from a fifth psql,
# started once every session has finished an iteration, and the sessions
# are fed until the last move has ended; no move starts before every
# session has finished an iteration since the previous one ended, so calls
# run around every move.

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

my $shard = call(q{SELECT get_shard_id_for_distribution_column('idempotency.keys', 't1'::text)});
my @modes = ('block_writes', 'force_logical');
my $moves_per_mode = 4;
my $sessions = 7;
my $batch = 3;    # iterations fed to a session at a time

# what each session calls: one kind each, so that each kind meets the moves
# on its own, not only when the others leave it room
my @kinds = (undef, 'claim', 'enqueue', 'mark_processed', 'insert', 'release', 'ack', 'nack');
my @all_kinds = qw(claim complete enqueue mark_processed insert release relay_enqueue fetch ack nack);

# the relays' topics: two values whose outbox shard is t1's, so that they
# move with it
my @relay_topics;
for my $n (1 .. 1000)
{
	last if @relay_topics == 2;
	push @relay_topics, "r$n"
	  if call(qq{SELECT get_shard_id_for_distribution_column('idempotency.outbox', 'r$n'::text)
		= get_shard_id_for_distribution_column('idempotency.outbox', 't1'::text)}) eq 't';
}
die "no topics of t1's shard" unless @relay_topics == 2;
my %relay_topic = (ack => $relay_topics[0], nack => $relay_topics[1]);

# One iteration of session $s, number $i: its calls, each echoing its outcome.
sub iteration
{
	my ($s, $i) = @_;
	my $id = "$s-$i";
	my $n = $s * 1000000 + $i;
	my %calls = (
		claim => qq{
EXECUTE claim('t1', 'k-$id') \\gset
\\if :ERROR
\\echo fail claim $id :SQLSTATE
\\else
\\echo ok claim $id :outcome
SELECT idempotency.idem_complete('t1', 'k-$id', 201, 'done') AS stored \\gset
\\if :ERROR
\\echo fail complete $id :SQLSTATE
\\else
\\echo ok complete $id :stored
\\endif
\\endif
},
		enqueue => qq{
SELECT idempotency.idem_outbox_enqueue('t' || '1', '{"id": "$id"}') AS enqueued \\gset
\\if :ERROR
\\echo fail enqueue $id :SQLSTATE
\\else
\\echo ok enqueue $id
\\endif
},
		mark_processed => qq{
SELECT idempotency.idem_mark_processed('t1', 'e-$id') AS marked \\gset
\\if :ERROR
\\echo fail mark_processed $id :SQLSTATE
\\else
\\echo ok mark_processed $id :marked
\\endif
},
		insert => qq{
INSERT INTO payments VALUES ('t1', $n, 1);
\\if :ERROR
\\echo fail insert $id :SQLSTATE
\\else
\\echo ok insert $id
\\endif
},
		release => qq{
EXECUTE claim('t1', 'x-$id') \\gset
\\if :ERROR
\\echo fail release $id :SQLSTATE
\\else
SELECT idempotency.idem_release('t1', 'x-$id') AS released \\gset
\\if :ERROR
\\echo fail release $id :SQLSTATE
\\else
\\echo ok release $id
\\endif
\\endif
});
	for my $end ('ack', 'nack')
	{
		my $topic = $relay_topic{$end};
		my $call = $end eq 'ack'
		  ? "idempotency.idem_outbox_ack(ARRAY[:fetched_id]::bigint[], ARRAY[:fetched_attempts])"
		  : "idempotency.idem_outbox_nack(:fetched_id, 'refused', :fetched_attempts)";
		$calls{$end} = qq{
SELECT idempotency.idem_outbox_enqueue('$topic', '{"id": "$id"}') AS relay_enqueued \\gset
\\if :ERROR
\\echo fail relay_enqueue $id :SQLSTATE
\\else
\\echo ok relay_enqueue $id
SELECT count(*) AS fetched_rows, min(id) AS fetched_id, min(attempts) AS fetched_attempts
FROM idempotency.idem_outbox_fetch('$topic', 1) \\gset
\\if :ERROR
\\echo fail fetch $id :SQLSTATE
\\elif :fetched_rows
\\echo ok fetch $id
SELECT $call AS ended \\gset
\\if :ERROR
\\echo fail $end $id :SQLSTATE
\\else
\\echo ok $end $id :ended
\\endif
\\else
\\echo ok fetch $id (none)
\\endif
\\endif
};
	}
	return $calls{ $kinds[$s] } . "\\echo done $s $i\n";
}

# the moves, each echoing its end; the first wait for the sessions
my @moves;
{
	my $on = $cluster->node_of('idempotency.keys', 't1');
	for my $mode (@modes)
	{
		for (1 .. $moves_per_mode)
		{
			my $to = $on->port == $w1->port ? $w2 : $w1;
			push @moves, qq{
CALL citus_cleanup_orphaned_resources();
SELECT citus_move_shard_placement($shard, '@{[ $on->host ]}', @{[ $on->port ]},
	'@{[ $to->host ]}', @{[ $to->port ]}, shard_transfer_mode => '$mode');
\\echo moved @{[ scalar @moves ]} $mode
};
			$on = $to;
		}
	}
}

my @psql = ('psql', '-X', '-q', '-At', '-h', $c->host, '-p', $c->port, 'postgres');
my (@in, @out, @err, @fed);
my ($mover_in, $mover_out, $mover_err) = ('', '', '');
my @harness = ([ @psql, '-v', 'ON_ERROR_STOP=1' ], '<', \$mover_in, '>', \$mover_out,
	'2>', \$mover_err);
for my $s (1 .. $sessions)
{
	($in[$s], $out[$s], $err[$s], $fed[$s]) = ('', '', '', 0);
	$in[$s] .= "PREPARE claim(text, text) AS SELECT outcome FROM idempotency.idem_claim(\$1, \$2);\n";
	push @harness, '&', [@psql], '<', \$in[$s], '>', \$out[$s], '2>', \$err[$s];
}
my $timeout = IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default * 4);
my $h = IPC::Run::start(@harness, $timeout);

# the last iteration each session finished
sub finished
{
	my ($s) = @_;
	return 0 unless $s;    # (arrays indexed by session start at 1)
	my @done = $out[$s] =~ /^done $s (\d+)$/mg;
	return @done ? $done[-1] : 0;
}

my $next_move = 0;     # index of the next move to feed
my $moved = 0;         # moves ended
my @finished_at = (0) x ($sessions + 1);    # each session's, when the last move was fed
my @mode_ends;         # per mode, each session's finished iteration when its last move ended
while ($moved < @moves)
{
	for my $s (1 .. $sessions)
	{
		if (finished($s) == $fed[$s])
		{
			$in[$s] .= iteration($s, ++$fed[$s]) for 1 .. $batch;
		}
	}
	$moved = () = $mover_out =~ /^moved /mg;
	for my $m (0 .. $#modes)
	{
		$mode_ends[$m] //= [ map { finished($_) } 0 .. $sessions ]
		  if $moved >= ($m + 1) * $moves_per_mode;
	}
	if ($next_move == $moved && $next_move < @moves
		&& !grep { finished($_) <= $finished_at[$_] } 1 .. $sessions)
	{
		@finished_at = map { finished($_) } 0 .. $sessions;
		$mover_in .= $moves[ $next_move++ ];
	}
	die "a move failed: $mover_err" if $mover_err =~ /ERROR/;
	$h->pump;
}
$mover_in .= "\\q\n";
$in[$_] .= "\\q\n" for 1 .. $sessions;
$h->finish or die "psql failed: $mover_err";
is($moved, scalar @moves, "t1's shard group moved " . scalar(@moves) . ' times');

# the outcomes, per kind
my (%ok, %failed, %ids, %sqlstates);
my $acked = 0;
for my $s (1 .. $sessions)
{
	for my $line (split /\n/, $out[$s])
	{
		if ($line =~ /^ok (\w+) (\S+)(?: (\S+))?/)
		{
			$ok{$1}++;
			push @{ $ids{$1} }, $2;
			$acked += $3 if $1 eq 'ack';
		}
		elsif ($line =~ /^fail (\w+) ((\d+)-(\d+)) (\w+)/)
		{
			my ($kind, $iteration, $sqlstate) = ($1, $4, $5);
			# the mode whose moves were under way (as near as the
			# iterations finished when each mode's last move ended say)
			my ($mode) = grep { $iteration <= $mode_ends[$_][$s] } 0 .. $#modes;
			$failed{$kind}++;
			$sqlstates{"$kind $sqlstate " . $modes[ $mode // $#modes ]}++;
		}
	}
}
my $iterations = 0;
$iterations += finished($_) for 1 .. $sessions;
note("$iterations iterations; ok: "
	  . join(', ', map { "$_ " . ($ok{$_} // 0) } @all_kinds)
	  . '; failed: ' . join(', ', map { "$_ $sqlstates{$_}" } sort keys %sqlstates));
if (%failed)
{
	my %first;
	for my $s (1 .. $sessions)
	{
		$first{$_} = 1 for $err[$s] =~ /^(ERROR: .*)$/mg;
	}
	diag("errors seen: " . join("\n", sort keys %first));
}
for my $kind (@all_kinds)
{
	is($failed{$kind} // 0, 0, "no $kind failed during the moves");
}

# the rows: exactly those of the calls that succeeded
sub rows_are
{
	my ($query, $kind, $name) = @_;
	my @expected = sort @{ $ids{$kind} // [] };
	my @rows = sort split /\n/, call($query);
	is(scalar(@rows), scalar(@expected), "$name: one row per successful call");
	is_deeply(\@rows, \@expected, "$name: the rows of the successful calls, once each");
}
rows_are(q{SELECT substr(key, 3) FROM idempotency.keys WHERE scope = 't1' AND key LIKE 'k-%'},
	'claim', 'keys');
rows_are(q{SELECT substr(key, 3) FROM idempotency.keys
		WHERE scope = 't1' AND key LIKE 'k-%' AND status_code = 201},
	'complete', 'completed keys');
rows_are(q{SELECT payload->>'id' FROM idempotency.outbox WHERE topic = 't1' AND payload ? 'id'},
	'enqueue', 'outbox');
rows_are(q{SELECT substr(event_id, 3) FROM idempotency.processed_events
		WHERE consumer = 't1' AND event_id LIKE 'e-%'},
	'mark_processed', 'processed events');
rows_are(q{SELECT (id / 1000000) || '-' || (id % 1000000) FROM payments WHERE tenant = 't1'},
	'insert', 'payments');

# released keys are gone; the relays' rows: the acknowledged ones gone,
# the nacked ones back (pending), none lost, none twice
is(call(q{SELECT count(*) FROM idempotency.keys WHERE scope = 't1' AND key LIKE 'x-%'}), '0',
	'released keys: none left');
my ($ack_topic, $nack_topic) = @relay_topic{ 'ack', 'nack' };
my @ack_enqueued = grep { /^6-/ } @{ $ids{relay_enqueue} // [] };
my @nack_enqueued = grep { /^7-/ } @{ $ids{relay_enqueue} // [] };
is(call(qq{SELECT count(*) FROM idempotency.outbox WHERE topic = '$ack_topic'}),
	scalar(@ack_enqueued) - $acked, 'the relay that acknowledges: its rows less those acknowledged');
is(call(qq{SELECT count(DISTINCT payload->>'id') || ' ' || count(*) FROM idempotency.outbox
		WHERE topic = '$nack_topic'}),
	scalar(@nack_enqueued) . ' ' . scalar(@nack_enqueued), 'the relay that nacks: every row, once');
ok($acked > 0 && ($ok{nack} // 0) > 0, "acknowledged $acked rows, nacked " . ($ok{nack} // 0));

# every key completed replays its response
my ($first_completed) = sort @{ $ids{complete} // [] };
like(call(qq{SELECT idempotency.idem_claim('t1', 'k-$first_completed')}), qr/^\(replay,201,done,/,
	'a completed key replays after the moves') if defined $first_completed;

# A call that Citus sends to a node its metadata named for the shard, after
# the shard has moved away, is refused with a retryable SQLSTATE (40001):
# here, one sent to the node t1's shard group has left, over a connection
# named as Citus names its own
my $from = $cluster->node_of('idempotency.keys', 't1')->port == $w1->port ? $w2 : $w1;
my $as_citus = $from->connstr('postgres') . ' application_name=\'citus_internal gpid=10000000001\'';
my ($ret, $out, $err) = $from->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idempotency.idem_claim('t1', 'k-late')",
	connstr => $as_citus);
like($err, qr/ERROR:  40001: idem_claim\(\) cannot run on this node: shard $shard of table "idempotency.keys" is no longer placed here/,
	'a call Citus sent to the old node is refused with 40001');
like($err, qr/HINT:  Retry the transaction: Citus sends the call to the shard's new node\./,
	'and the hint says to retry');
($ret, $out, $err) = $from->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT (idempotency.idem_claim('t1', 'k-late')).outcome");
like($err, qr/ERROR:  55000: idem_claim\(\) cannot run on this node: shard $shard of table "idempotency.keys" is not placed here/,
	'one made there inside an expression, which Citus does not delegate, with 55000 as before');

$cluster->stop;
done_testing();
