# What Debezium's PostgreSQL connector would receive, read from real pgoutput
# replication slots with the options the connector itself sends (proto_version
# 1, publication_names, and messages 'true', which it adds on PostgreSQL 14
# and later), decoded byte by byte in Perl:
#
#  (a) the worker's logical route: transactional logical decoding messages
#      with the prefix that doc/integrations/debezium.md puts in
#      message.prefix.include.list, whose content is the JSON object that
#      DecodeLogicalDecodingMessageContent turns into the record's "after"
#      and the outbox event router then reads
#      (id, topic, key, payload, headers, created_at): one per outbox row.
#      Read through the SQL functions, and through pg_recvlogical over the
#      replication protocol, as the connector streams.
#  (b) the outbox table captured by a publication: the relation's columns
#      and each INSERT's values, for the columns that
#      doc/integrations/debezium.md maps onto the outbox event router; the
#      worker's DELETE of each row once published; and what each kind of
#      route adds to the stream.
#
# No Kafka Connect runs here; what the connector does with these bytes is
# Debezium's code (PgOutputMessageDecoder, EventRouter,
# DecodeLogicalDecodingMessageContent), summarised where it matters below.

use strict;
use warnings;

use JSON::PP;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('debezium');
$node->init(allows_streaming => 'logical');    # wal_level = logical, walsenders
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
});
$node->start;

# The prefix doc/integrations/debezium.md tells users to put in Debezium's
# message.prefix.include.list (a list of regular expressions, each matched
# against the whole prefix), and the default prefix of a logical route.
my $documented_prefix = 'idempotency.outbox';

my $json = JSON::PP->new->canonical;

# ---------------------------------------------------------------------------
# pgoutput protocol version 1, as documented in "Logical Replication Message
# Formats": decode one message at $pos of $buf; return it and the position
# after it. Only the message types this test can meet are handled.
sub decode_pgoutput
{
	my ($buf, $pos) = @_;
	my $take = sub {
		my ($n) = @_;
		die "pgoutput message truncated at $pos" if $pos + $n > length($buf);
		my $bytes = substr($buf, $pos, $n);
		$pos += $n;
		return $bytes;
	};
	my $u8  = sub { unpack('C',  $take->(1)) };
	my $u16 = sub { unpack('n',  $take->(2)) };
	my $u32 = sub { unpack('N',  $take->(4)) };
	my $i32 = sub { unpack('l>', $take->(4)) };
	my $u64 = sub { unpack('Q>', $take->(8)) };
	my $str = sub {
		my $end = index($buf, "\0", $pos);
		die "unterminated string at $pos" if $end < 0;
		my $s = substr($buf, $pos, $end - $pos);
		$pos = $end + 1;
		return $s;
	};
	my $tuple = sub {
		my @values;
		my $natts = $u16->();
		for (1 .. $natts)
		{
			my $kind = $take->(1);
			if ($kind eq 'n') { push @values, undef; }
			elsif ($kind eq 't') { push @values, $take->($u32->()); }
			else { die "unexpected tuple column kind '$kind'"; }
		}
		return \@values;
	};

	my %m = (type => $take->(1));
	if ($m{type} eq 'B')
	{
		@m{qw(final_lsn commit_time xid)} = ($u64->(), $u64->(), $u32->());
	}
	elsif ($m{type} eq 'C')
	{
		@m{qw(flags lsn end_lsn commit_time)} = ($u8->(), $u64->(), $u64->(), $u64->());
	}
	elsif ($m{type} eq 'M')
	{
		$m{flags}   = $u8->();
		$m{lsn}     = $u64->();
		$m{prefix}  = $str->();
		$m{content} = $take->($u32->());
	}
	elsif ($m{type} eq 'R')
	{
		$m{relid}     = $u32->();
		$m{nspname}   = $str->();
		$m{relname}   = $str->();
		$m{replident} = chr($u8->());
		my $natts = $u16->();
		for (1 .. $natts)
		{
			my %col;
			@col{qw(flags name typoid typmod)} = ($u8->(), $str->(), $u32->(), $i32->());
			push @{ $m{columns} }, \%col;
		}
	}
	elsif ($m{type} eq 'I')
	{
		$m{relid} = $u32->();
		my $new = $take->(1);
		die "insert without a new tuple" unless $new eq 'N';
		$m{new} = $tuple->();
	}
	elsif ($m{type} eq 'D')
	{
		$m{relid} = $u32->();
		$m{kind}  = $take->(1);    # K: replica identity key, O: old tuple
		$m{old}   = $tuple->();
	}
	elsif ($m{type} eq 'U')
	{
		$m{relid} = $u32->();
		my $kind = $take->(1);
		if ($kind eq 'K' || $kind eq 'O')
		{
			$m{old} = $tuple->();
			$kind = $take->(1);
		}
		die "update without a new tuple" unless $kind eq 'N';
		$m{new} = $tuple->();
	}
	else
	{
		die "unexpected pgoutput message type '$m{type}'";
	}
	return (\%m, $pos);
}

# Consume a slot through the SQL interface, with Debezium's options; each
# row is one pgoutput message, which must be decoded to its last byte.
sub slot_changes
{
	my ($slot, $publication) = @_;
	my $hex = $node->safe_psql('postgres', qq{
		SELECT encode(data, 'hex')
		FROM pg_logical_slot_get_binary_changes('$slot', NULL, NULL,
			'proto_version', '1', 'publication_names', '$publication', 'messages', 'true')});
	my @messages;
	for my $line (split /\n/, $hex)
	{
		my $buf = pack('H*', $line);
		my ($m, $end) = decode_pgoutput($buf, 0);
		die "trailing bytes after a '$m->{type}' message" unless $end == length($buf);
		push @messages, $m;
	}
	return @messages;
}

# Transactional messages and row changes must sit between a BEGIN and its
# COMMIT: annotate each with the xid of its transaction (undef outside one).
sub in_transactions
{
	my $xid;
	for my $m (@_)
	{
		if ($m->{type} eq 'B') { $xid = $m->{xid}; }
		elsif ($m->{type} eq 'C') { $xid = undef; }
		else { $m->{xid} = $xid; }
	}
	return @_;
}

# The outbox rows as the table holds them, before they are published.
sub outbox_rows
{
	my ($topics) = @_;
	my %rows;
	for my $line (split /\n/, $node->safe_psql('postgres', qq{
			SELECT row_to_json(o) FROM idempotency.outbox o
			WHERE topic IN ($topics) ORDER BY id}))
	{
		my $row = $json->decode($line);
		$rows{ $row->{id} } = $row;
	}
	return %rows;
}

# Wait until the worker has published (and so deleted) the rows of these
# topics, then until the WAL written so far is flushed: logical decoding, by
# the SQL functions or a walsender, reads no further than the flushed WAL,
# and after an asynchronous commit the rows are gone before the commit
# record is flushed, which the test must not mistake for a missing change.
# Returns the position up to which the slots can now decode.
sub wait_published
{
	my ($topics) = @_;
	$node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM idempotency.outbox WHERE topic IN ($topics)")
	  or die "rows of $topics were not published";
	my $lsn = $node->safe_psql('postgres', 'SELECT pg_current_wal_insert_lsn()');
	$node->poll_query_until('postgres', "SELECT pg_current_wal_flush_lsn() >= '$lsn'")
	  or die "the WAL was not flushed up to $lsn";
	return $lsn;
}

# ---------------------------------------------------------------------------
# (a) the logical route, captured as logical decoding messages

# A publication is needed for pgoutput to start at all, but messages do not
# depend on its tables: one with no table (what Debezium 3's
# publication.autocreate.mode=no_tables creates) carries all of them.
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE PUBLICATION dbz_messages;
	SELECT pg_create_logical_replication_slot('dbz_messages', 'pgoutput');
	SELECT pg_create_logical_replication_slot('dbz_stream', 'pgoutput');
});

# Enqueue while the topic has no route, so that the rows can be read as the
# table holds them; a rolled-back enqueue must leave no trace.
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('orders',
		jsonb_build_object('n', n, 'note', 'déjà "vu"', 'lines', jsonb_build_array(n, n * 2)),
		'order-' || n % 2, jsonb_build_object('trace', 'trace-' || n))
	FROM generate_series(1, 4) n;
	SELECT idempotency.idem_outbox_enqueue('orders', '[1, "two", null]');   -- no key, no headers
	BEGIN;
	SELECT idempotency.idem_outbox_enqueue('orders', '{"rolled": "back"}', 'order-9');
	ROLLBACK;
});
my %orders = outbox_rows("'orders'");
is(scalar(keys %orders), 5, 'five rows enqueued');
sleep(1);    # a worker round: unrouted rows stay untouched
is(scalar(slot_changes('dbz_messages', 'dbz_messages')), 0,
	'nothing is decoded while the topic has no route');

$node->safe_psql('postgres', "SELECT idempotency.idem_outbox_route('orders', 'logical')");
my $endpos = wait_published("'orders'");
# a non-transactional message past endpos, so that pg_recvlogical reaches it at once
$node->safe_psql('postgres', "SELECT pg_logical_emit_message(false, 'test.end', 'end')");

my @decoded = in_transactions(slot_changes('dbz_messages', 'dbz_messages'));
my @ours = grep { $_->{type} eq 'M' && $_->{prefix} ne 'test.end' } @decoded;
is(scalar(@ours), 5, 'five logical decoding messages for five rows');
is(scalar(grep { $_->{prefix} eq $documented_prefix } @ours), 5,
	"each with the prefix '$documented_prefix'");
ok(scalar(grep { $_->{prefix} =~ /\A(?:$documented_prefix)\z/ } @ours) == 5,
	'which message.prefix.include.list matches as a whole-prefix regular expression');
is(scalar(grep { $_->{flags} == 1 && defined $_->{xid} } @ours), 5,
	'all transactional (flags 1), inside the BEGIN/COMMIT of the worker\'s transaction');

my %content_of;
my $fields_ok = 1;
for my $m (@ours)
{
	my $content = $json->decode($m->{content});
	my $fields = join(',', sort keys %$content);
	if ($fields ne 'created_at,headers,id,key,payload,topic')
	{
		diag "message content with fields $fields: $m->{content}";
		$fields_ok = 0;
	}
	$content_of{ $content->{id} }++;
	my $row = $orders{ $content->{id} } or next;
	for my $field (qw(topic key payload headers created_at))
	{
		next if $json->encode([ $content->{$field} ]) eq $json->encode([ $row->{$field} ]);
		diag "row $content->{id}: $field is " . $json->encode([ $content->{$field} ])
		  . ' in the message, ' . $json->encode([ $row->{$field} ]) . ' in the table';
		$fields_ok = 0;
	}
}
ok($fields_ok,
	'each content is a JSON object with exactly id, topic, key, payload, headers and created_at, as in the table');
is(join(',', sort { $a <=> $b } keys %content_of), join(',', sort { $a <=> $b } keys %orders),
	'the message ids are the outbox row ids');
is(scalar(grep { $_ != 1 } values %content_of), 0, 'each row exactly once');
my ($no_key) = grep { !defined $orders{$_}{key} } keys %orders;
my ($no_key_message) = grep { $json->decode($_->{content})->{id} == $no_key } @ours;
like($no_key_message->{content},
	qr/\A\{"id" : $no_key, "topic" : "orders", "key" : null, "payload" : \[1, "two", null\], "headers" : null, "created_at" : "[^"]+"\}\z/,
	'a row without key or headers has them as JSON nulls');

# The connector does not call the SQL functions: it streams over the
# replication protocol. pg_recvlogical does the same, with the same options;
# it writes each message followed by a newline.
my $stream = $node->pg_recvlogical_upto('postgres', 'dbz_stream', $endpos,
	$PostgreSQL::Test::Utils::timeout_default,
	'proto_version' => '1', 'publication_names' => 'dbz_messages', 'messages' => 'true');
my (@streamed, $pos);
for ($pos = 0; $pos < length($stream);)
{
	my ($m, $end) = decode_pgoutput($stream, $pos);
	die "no newline after a streamed '$m->{type}' message" unless substr($stream, $end, 1) eq "\n";
	push @streamed, $m;
	$pos = $end + 1;
}
is(join(' ', map { $_->{type} eq 'M' ? $json->decode($_->{content})->{id} : $_->{type} } @streamed),
	join(' ', map { $_->{type} eq 'M' ? $json->decode($_->{content})->{id} : $_->{type} }
		grep { !($_->{type} eq 'M' && $_->{prefix} eq 'test.end') } @decoded),
	'pg_recvlogical streams the same transaction and messages as the SQL interface');

# ---------------------------------------------------------------------------
# (b) the outbox table captured by a publication, for the outbox event router

$node->safe_psql('postgres', q{
	CREATE PUBLICATION dbz_outbox FOR TABLE idempotency.outbox;
	SELECT pg_create_logical_replication_slot('dbz_outbox', 'pgoutput');
	-- the route that lets the worker delete captured rows without
	-- publishing them anywhere else: a function that does nothing
	CREATE FUNCTION public.captured_by_debezium(e idempotency.outbox) RETURNS void
		LANGUAGE sql AS 'SELECT';
});
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_enqueue('invoices',
		jsonb_build_object('invoice', n, 'amount', n * 10.5), 'customer-' || n % 2,
		jsonb_build_object('trace', 'trace-' || n))
	FROM generate_series(1, 3) n;
	SELECT idempotency.idem_outbox_enqueue('invoices', '{"invoice": 4}');   -- no key, no headers
	SELECT idempotency.idem_outbox_enqueue('shipments', '{"shipment": 1}', 'parcel-1');
});
my %captured = outbox_rows("'invoices', 'shipments'");
$node->safe_psql('postgres', q{
	SELECT idempotency.idem_outbox_route('invoices', 'function', 'public.captured_by_debezium');
	SELECT idempotency.idem_outbox_route('shipments', 'logical');
});
wait_published("'invoices', 'shipments'");

my @changes = in_transactions(slot_changes('dbz_outbox', 'dbz_outbox'));
my ($relation) = grep { $_->{type} eq 'R' } @changes;
ok($relation, 'a relation message describes the table');
is("$relation->{nspname}.$relation->{relname}", 'idempotency.outbox',
	'for idempotency.outbox (table.include.list=idempotency.outbox)');
is($relation->{replident}, 'd', 'with the default replica identity (the primary key)');

my %column;
my $i = 0;
$column{ $_->{name} } = { %$_, index => $i++ } for @{ $relation->{columns} };
my $type_of = sub {
	my ($name) = @_;
	return $column{$name} ? $column{$name}{typoid} : 'missing';
};

# The outbox event router settings of doc/integrations/debezium.md, column
# by column, and the type of each as pgoutput announces it (Debezium maps bigint to INT64, text to
# STRING, jsonb to STRING with the io.debezium.data.Json name, which
# table.expand.json.payload turns back into a structure).
my %router = (
	'table.field.event.id'      => [ 'id',      20 ],      # bigint: the "id" header
	'table.field.event.key'     => [ 'key',     25 ],      # text: the Kafka key
	'table.field.event.payload' => [ 'payload', 3802 ],    # jsonb: the value
	'route.by.field'            => [ 'topic',   25 ],      # text: the Kafka topic
	'table.fields.additional.placement (headers:header:headers)' => [ 'headers', 3802 ],
);
for my $setting (sort keys %router)
{
	my ($name, $typoid) = @{ $router{$setting} };
	is($type_of->($name), $typoid, "$setting=$name: a column of type $typoid");
}
ok($column{id}{flags} & 1, 'id is the key column');

# created_at is timestamptz, which Debezium's PostgreSQL connector always
# sends as a STRING (io.debezium.time.ZonedTimestamp). The event router reads
# table.field.event.timestamp with getInt64 and accepts only the Timestamp,
# MicroTimestamp and NanoTimestamp types, so table.field.event.timestamp
# must not name created_at (every event would fail the connector).
is($type_of->('created_at'), 1184,
	'created_at is timestamptz, which cannot be table.field.event.timestamp');

my @inserts = grep { $_->{type} eq 'I' && $_->{relid} == $relation->{relid} } @changes;
is(scalar(@inserts), 5, 'one INSERT per enqueued row');
my $values_ok = 1;
my %inserted;
for my $insert (@inserts)
{
	my %value = map { $_ => $insert->{new}[ $column{$_}{index} ] } keys %column;
	my $row = $captured{ $value{id} };
	$inserted{ $value{id} }++;
	if (!$row)
	{
		diag "INSERT of unknown id $value{id}";
		$values_ok = 0;
		next;
	}
	my %expected = (
		topic   => $row->{topic},
		key     => $row->{key},
		payload => $json->encode($row->{payload}),
		headers => defined $row->{headers} ? $json->encode($row->{headers}) : undef,
		state   => 'pending');
	my %got = (
		topic   => $value{topic},
		key     => $value{key},
		payload => $json->encode($json->decode($value{payload})),
		headers => defined $value{headers} ? $json->encode($json->decode($value{headers})) : undef,
		state   => $value{state});
	for my $field (sort keys %expected)
	{
		next if ($expected{$field} // "\0NULL") eq ($got{$field} // "\0NULL");
		diag "id $value{id}: $field " . ($got{$field} // 'NULL') . ', expected ' . ($expected{$field} // 'NULL');
		$values_ok = 0;
	}
	$values_ok = 0 unless defined $insert->{xid};
}
ok($values_ok, 'each INSERT carries the id, topic, key, payload and headers enqueued, as pending');
is(join(',', map { "$_:$inserted{$_}" } sort keys %inserted),
	join(',', map { "$_:1" } sort keys %captured),
	'every row is inserted exactly once');

# Once published, the worker deletes each row (outbox_retention = 0): the
# router drops DELETEs (and the tombstones that follow them), so the table
# stays small and nothing is routed twice. Nothing is updated: the router
# would log an UPDATE as unexpected (table.op.invalid.behavior).
my %deleted = map { $_->{old}[ $column{id}{index} ] => 1 }
  grep { $_->{type} eq 'D' && $_->{relid} == $relation->{relid} } @changes;
is(join(',', sort keys %deleted), join(',', sort keys %captured),
	'the worker deleted every row once published');
is(scalar(grep { $_->{type} eq 'U' } @changes), 0, 'no UPDATE of the outbox reached the slot');

# What the route adds: the no-op function nothing; the logical route also a
# logical decoding message per row, which the connector captures too unless
# message.prefix.include.list / message.prefix.exclude.list leaves it out
# (it would then reach the <topic.prefix>.message topic, untouched by the
# router, a second copy of the event).
my @extra = grep { $_->{type} eq 'M' } @changes;
my %message_topics;
$message_topics{ $json->decode($_->{content})->{topic} }++ for @extra;
is(join(',', map { "$_:$message_topics{$_}" } sort keys %message_topics), 'shipments:1',
	'a logical route adds one message per row to the same stream, a function route none');

$node->stop;
done_testing();
