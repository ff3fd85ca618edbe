# Three relays drain one topic with per_key > 1 while an enqueuer keeps
# adding events, and fail on purpose: some nack a row (delivering the rows
# of its key before it), some drop a hand-out as if they had crashed (its
# lease runs out), some take so long that their lease runs out before they
# acknowledge.  Each relay delivers a hand-out's rows of a key into a table,
# in the same transaction as its fenced acknowledgement, and rolls the
# delivery back unless every row was acknowledged: so the table holds what
# was published, once.  At the end every event was delivered exactly once,
# and each key's events in their order.

use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $relays = 3;
my $events = 3000;
my $keys = 40;

my $node = PostgreSQL::Test::Cluster->new('relays');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.outbox_backoff_min = '5ms'
idempotency.outbox_backoff_max = '20ms'
idempotency.outbox_max_attempts = 1000000
});
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE delivered (seq bigserial PRIMARY KEY, id bigint, key text,
							relay text, attempts int);
	CREATE TABLE tally (relay text, what text);

	-- enqueue $total events of $keys keys, in batches of random size and
	-- keys, each batch in a transaction of its own
	CREATE PROCEDURE enqueue(total int, keys int) LANGUAGE plpgsql AS $$
	DECLARE
		done int := 0;
		n int;
	BEGIN
		WHILE done < total LOOP
			n := least(total - done, 1 + (random() * 30)::int);
			PERFORM idempotency.idem_outbox_enqueue_batch('events',
				(SELECT array_agg(jsonb_build_object('n', done + i) ORDER BY i)
				 FROM generate_series(1, n) i),
				(SELECT array_agg('key-' || (random() * (keys - 1))::int ORDER BY i)
				 FROM generate_series(1, n) i));
			done := done + n;
			COMMIT;
		END LOOP;
	END $$;

	-- deliver rows of one key of a hand-out together with their fenced
	-- acknowledgement; nothing if any of them was not acknowledged.  Under
	-- READ COMMITTED, an acknowledgement during which another relay leased
	-- one of the rows again says so in its count (no 40001 to retry).
	CREATE PROCEDURE deliver(relay text, k text, ids bigint[], attempts int[])
	LANGUAGE plpgsql AS $$
	DECLARE
		acked int;
	BEGIN
		IF cardinality(ids) = 0 THEN
			RETURN;
		END IF;
		INSERT INTO delivered (id, key, relay, attempts)
		SELECT i, k, relay, a FROM unnest(ids, attempts) AS u (i, a);
		acked := idempotency.idem_outbox_ack(ids, attempts);
		IF acked = cardinality(ids) THEN
			INSERT INTO tally VALUES (relay, 'acked');
			COMMIT;
		ELSE
			ROLLBACK;
			INSERT INTO tally VALUES (relay, 'refused');
			COMMIT;
		END IF;
	END $$;

	CREATE PROCEDURE relay(name text, total int) LANGUAGE plpgsql AS $$
	DECLARE
		ids bigint[];
		keys text[];
		attempts int[];
		k text;
		key_ids bigint[];
		key_attempts int[];
		fate float8;
		failing int;
	BEGIN
		WHILE (SELECT count(*) FROM delivered) < total LOOP
			SELECT array_agg(f.id ORDER BY f.id), array_agg(f.key ORDER BY f.id),
				   array_agg(f.attempts ORDER BY f.id)
			INTO ids, keys, attempts
			FROM idempotency.idem_outbox_fetch('events', 20, '200 milliseconds', 4) f;
			COMMIT;
			IF ids IS NULL THEN
				PERFORM pg_sleep(0.005);
				CONTINUE;
			END IF;
			fate := random();
			IF fate < 0.05 THEN
				-- crash: the hand-out is dropped, its lease runs out
				INSERT INTO tally VALUES (name, 'crashed');
				COMMIT;
				CONTINUE;
			ELSIF fate < 0.10 THEN
				-- too slow: the lease runs out before the acknowledgement
				INSERT INTO tally VALUES (name, 'slow');
				COMMIT;
				PERFORM pg_sleep(0.6);
			END IF;
			FOREACH k IN ARRAY (SELECT array_agg(DISTINCT x) FROM unnest(keys) x) LOOP
				SELECT array_agg(u.i ORDER BY u.i), array_agg(u.a ORDER BY u.i)
				INTO key_ids, key_attempts
				FROM unnest(ids, keys, attempts) AS u (i, k2, a) WHERE u.k2 = k;
				failing := CASE WHEN random() < 0.15
								THEN 1 + (random() * (cardinality(key_ids) - 1))::int END;
				IF failing IS NULL THEN
					CALL deliver(name, k, key_ids, key_attempts);
				ELSE
					-- the rows before the failing one go out; it is nacked,
					-- and the ones after it go back with it
					CALL deliver(name, k, key_ids[1:failing - 1], key_attempts[1:failing - 1]);
					IF idempotency.idem_outbox_nack(key_ids[failing], 'injected failure',
													key_attempts[failing]) THEN
						INSERT INTO tally VALUES (name, 'nacked');
					END IF;
					COMMIT;
				END IF;
			END LOOP;
		END LOOP;
	END $$;
});

my @running;
my %stderr;
push @running, IPC::Run::start(
	[ 'psql', '-X', '-v', 'ON_ERROR_STOP=1', '-h', $node->host, '-p', $node->port,
	  '-d', 'postgres', '-c', "CALL enqueue($events, $keys)" ],
	'>', \my $enqueue_out, '2>', \$stderr{enqueuer});
for my $relay (1 .. $relays)
{
	push @running, IPC::Run::start(
		[ 'psql', '-X', '-v', 'ON_ERROR_STOP=1', '-h', $node->host, '-p', $node->port,
		  '-d', 'postgres', '-c', "CALL relay('relay-$relay', $events)" ],
		'>', \my $out, '2>', \$stderr{"relay-$relay"});
}

$node->poll_query_until('postgres', "SELECT count(*) >= $events FROM delivered")
  or die "the relays did not deliver every event";
for my $process (@running)
{
	$process->finish;
}
for my $who (sort keys %stderr)
{
	is($stderr{$who}, '', "$who ran without an error");
}

is($node->safe_psql('postgres', 'SELECT count(*), count(DISTINCT id) FROM delivered'),
	"$events|$events", 'every event was delivered once');
is($node->safe_psql('postgres', q{
	SELECT count(*) FROM (
		SELECT id < lag(id) OVER (PARTITION BY key ORDER BY seq) AS wrong FROM delivered) d
	WHERE wrong}),
	'0', "each key's events were delivered in their order");
is($node->safe_psql('postgres', 'SELECT count(*) FROM idempotency.outbox'),
	'0', 'nothing is left in the outbox');
is($node->safe_psql('postgres', q{
	SELECT count(*) > 1 FROM delivered GROUP BY key ORDER BY 1 DESC LIMIT 1}),
	't', 'keys had several events');

# the failures did happen, so that the checks above saw them handled
my %tally = map { split /\|/ } split /\n/, $node->safe_psql('postgres',
	"SELECT what, count(*) FROM tally GROUP BY what");
for my $what (qw(acked nacked crashed slow refused))
{
	ok(($tally{$what} // 0) > 0, "some hand-outs were $what")
	  or diag(explain \%tally);
}
ok($node->safe_psql('postgres', 'SELECT max(attempts) FROM delivered') > 1,
	'some events were delivered on a later attempt');

# One library serves a database still at 1.0 (the three-argument fetch,
# the unfenced ack and nack, 1.0's indexes), and its update carries the
# relay's grant over to the new fetch.
$node->safe_psql('postgres', q{
	CREATE DATABASE old;
	CREATE ROLE old_relay;
});
$node->safe_psql('old', q{
	CREATE EXTENSION idempotency VERSION '1.0';
	GRANT USAGE ON SCHEMA idempotency TO old_relay;
	GRANT EXECUTE ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval) TO old_relay;
});
is($node->safe_psql('old', q{
	SELECT count(idempotency.idem_outbox_enqueue('t', '{}', 'k')) FROM generate_series(1, 3);
	SET ROLE old_relay;
	SELECT string_agg(id::text, ',') FROM idempotency.idem_outbox_fetch('t', 10, '1 hour');
	RESET ROLE;
	SELECT idempotency.idem_outbox_nack(1, 'failed');
	UPDATE idempotency.outbox SET available_at = now() WHERE id = 1;
	SELECT string_agg(id || ':' || attempts, ',') FROM idempotency.idem_outbox_fetch('t', 10, '1 hour');
	SELECT idempotency.idem_outbox_ack(ARRAY[2, 1]);
	SELECT string_agg(id::text, ',') FROM idempotency.idem_outbox_fetch('t');
}), "3\n1\nt\n1:2\n1\n2", 'at 1.0: one row per key, nack, ack in order');

$node->safe_psql('old', q{ALTER EXTENSION idempotency UPDATE TO '1.1'});
is($node->safe_psql('old', q{
	SELECT has_function_privilege('old_relay',
		'idempotency.idem_outbox_fetch(text, integer, interval, integer)', 'EXECUTE'),
	       has_function_privilege('old_relay',
		'idempotency.idem_outbox_ack(bigint[], integer[])', 'EXECUTE'),
	       to_regprocedure('idempotency.idem_outbox_fetch(text, integer, interval)') IS NULL
}), 't|f|t', 'the update carries the grant of the 1.0 fetch to the new one, and drops the old one');
is($node->safe_psql('old', q{
	SELECT count(idempotency.idem_outbox_enqueue('t', '{}', 'k')) FROM generate_series(1, 2);
	UPDATE idempotency.outbox SET available_at = now() WHERE id = 2;
	SET ROLE old_relay;
	SELECT string_agg(id || ':' || attempts, ',') FROM idempotency.idem_outbox_fetch('t', 10, '1 hour', 5);
	RESET ROLE;
	SELECT idempotency.idem_outbox_ack(ARRAY[2, 3, 4, 5], ARRAY[2, 1, 1, 1]);
	SELECT string_agg(c.relname || ': ' || pg_get_expr(i.indpred, i.indrelid), '; ' ORDER BY c.relname)
	FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
	WHERE i.indrelid = 'idempotency.outbox'::regclass AND i.indpred IS NOT NULL;
}), "2\n2:2,3:1,4:1,5:1\n4\n"
  . "outbox_key_order: ((published_at IS NULL) AND (key IS NOT NULL)); "
  . "outbox_published: (published_at IS NOT NULL); outbox_ready: (published_at IS NULL)",
	'after the update: the per-key fetch and the fenced ack, on the new indexes');

$node->stop;
done_testing();
