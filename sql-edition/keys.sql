/*
 * Idempotency keys: idem_claim, idem_complete, idem_release,
 * idem_checkpoint and idem_extend_lease, with the C edition's arguments,
 * answers, SQLSTATEs and messages (src/keys/keys.c decides the same way).
 *
 * SQL cannot see a row another transaction is inserting, and an INSERT or
 * UPDATE of a row another transaction holds waits for it.  So every write
 * of a key is preceded by a transaction-level advisory lock on the key
 * (_lock_id): a transaction that wrote a key holds its lock until it ends,
 * as the C edition's in-flight row is seen until its transaction ends.
 * idem_claim never waits for it:
 *
 *   it reads the key (an ordinary snapshot: committed rows and its own) and
 *   decides as the C edition does: mismatch, replay and a held claim are
 *   answered at once, without a lock;
 *   only where it would write (a new or expired key, or a lease run out) it
 *   takes the lock with pg_try_advisory_xact_lock: held by another
 *   transaction, that transaction is inserting or changing the key, and the
 *   answer is in_progress;
 *   with the lock, it writes only if the row is still the version it read
 *   (INSERT ... ON CONFLICT DO NOTHING, or UPDATE ... WHERE ctid and xmin
 *   are the ones read); otherwise the key changed in between and it decides
 *   again.
 *
 * The lock is taken in a subtransaction (a BEGIN ... EXCEPTION block) that
 * is rolled back when nothing was written, which releases it: a claim that
 * answers anything but claimed holds nothing.  Uniqueness still comes from
 * the primary key.  Under REPEATABLE READ and SERIALIZABLE the statements
 * raise 40001 where the row changed after the snapshot; a row committed
 * after the snapshot is not seen at all, so the C edition's answers from it
 * (replay, in_progress) are 40001 here (doc/internals.md lists the
 * differences).
 *
 * With a wait, a key held by a transaction in flight is waited for under
 * lock_timeout (the time left), in two ways.  First alongside the key's
 * other waiters: its lock taken shared (pg_advisory_xact_lock_shared) in a
 * subtransaction rolled back at once, so that the holder's end wakes them
 * all together and each finds the answer (a replay) at once.  A waiter
 * that then still has to write waits in line: it takes the lock with
 * pg_advisory_xact_lock rather than trying it, and once the lock is its
 * own, writes, or finds the key changed and lets the lock go (its
 * subtransaction rolled back) to the next in line.  Trying and waiting
 * apart, as this did first, never ends with many waiters after a holder
 * that rolls back: the lock always goes to some waiter, so it is never
 * free when another tries it (t/014, 32 waiters, went round for the whole
 * minute).  A committed claim whose lease runs is
 * looked at again every 10 ms (the C edition without shared_preload_libraries
 * does the same).
 */

CREATE OR REPLACE FUNCTION idempotency.idem_claim(scope text, key text,
									   fingerprint text DEFAULT NULL,
									   ttl interval DEFAULT NULL,
									   lease interval DEFAULT NULL,
									   wait interval DEFAULT NULL)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_scope ALIAS FOR $1;
	p_key ALIAS FOR $2;
	p_fingerprint ALIAS FOR $3;
	p_ttl ALIAS FOR $4;		/* given the settings' defaults before a write */
	p_lease ALIAS FOR $5;
	p_wait ALIAS FOR $6;
	k record;
	found_row boolean;
	now_ts timestamptz;
	deadline timestamptz;
	remaining interval;
	lock_id bigint;
	decision text;
	busy boolean;
	in_line boolean;
	waited boolean;			/* NULL until the first wait, as false */
	saved_lock_timeout text;
	claimed boolean;
BEGIN
	/*
	 * The arguments, checked as the C edition checks them, in its order;
	 * the usual call (a scope and a key, the settings' durations, a
	 * writable transaction) is told in one expression: a PL/pgSQL
	 * expression is set up again in each transaction, and a replay is a
	 * handful of them.
	 */
	IF p_scope IS NULL OR p_key IS NULL OR octet_length(p_scope) > 255
		OR octet_length(p_key) NOT BETWEEN 1 AND 255
		OR p_ttl IS NOT NULL OR p_lease IS NOT NULL OR p_wait IS NOT NULL
		OR current_setting('transaction_read_only') = 'on' THEN
		IF p_scope IS NULL OR p_key IS NULL OR octet_length(p_scope) > 255
			OR octet_length(p_key) NOT BETWEEN 1 AND 255 THEN
			PERFORM idempotency._check_identifier(p_scope, 'scope', 0);
			PERFORM idempotency._check_identifier(p_key, 'key', 1);
		END IF;
		IF p_ttl IS NOT NULL AND now() + p_ttl <= now() THEN
			PERFORM idempotency._duration_arg(p_ttl, 'ttl', 'idempotency.key_ttl', 's', 86400);
		END IF;
		IF p_lease IS NOT NULL AND now() + p_lease <= now() THEN
			PERFORM idempotency._duration_arg(p_lease, 'lease', 'idempotency.lease', 'ms', 60000);
		END IF;
		IF p_wait IS NOT NULL THEN
			now_ts := clock_timestamp();
			IF now_ts + p_wait < now_ts THEN
				RAISE EXCEPTION 'wait must not be negative'
					USING ERRCODE = 'invalid_parameter_value',
						  DETAIL = format('The value given was "%s".', p_wait),
						  HINT = 'Give 0 or NULL to answer in_progress at once.';
			END IF;
			IF now_ts + p_wait > now_ts + idempotency._duration_setting('idempotency.max_wait', 'ms', 60000, 0) THEN
				RAISE EXCEPTION 'wait must not exceed idempotency.max_wait (%)',
					idempotency._setting_text(extract(epoch FROM
						idempotency._duration_setting('idempotency.max_wait', 'ms', 60000, 0))::bigint * 1000, 'ms')
					USING ERRCODE = 'invalid_parameter_value',
						  DETAIL = format('The value given was "%s".', p_wait),
						  HINT = 'A waiting claim holds its connection: wait less and let the client retry, or raise the setting.';
			END IF;
			IF now_ts + p_wait > now_ts THEN
				deadline := now_ts + p_wait;
			END IF;
		END IF;
		IF current_setting('transaction_read_only') = 'on' THEN
			PERFORM idempotency._require_writable('idem_claim()');
		END IF;
	END IF;

	LOOP
		SELECT k0.*, k0.xmin AS row_xmin, k0.ctid AS row_ctid INTO k
		FROM idempotency.keys AS k0
		WHERE k0.scope = p_scope AND k0.key = p_key;
		found_row := FOUND;
		now_ts := clock_timestamp();

		/* mine: never taken over (nor waited for) by its own transaction */
		decision := CASE WHEN NOT found_row THEN 'new'
					WHEN k.expires_at <= now_ts THEN 'reset'
					WHEN k.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
						AND k.fingerprint <> p_fingerprint COLLATE "C" THEN 'mismatch'
					WHEN k.status_code IS NOT NULL THEN 'replay'
					WHEN idempotency._written_by_us(k.row_xmin) THEN 'mine'
					WHEN k.lease_expires_at > now_ts THEN 'held'
					ELSE 'takeover' END;
		IF decision = 'replay' THEN
			RETURN ROW('replay', k.status_code, k.body, k.headers, k.attempt, k.recovery_point,
					   k.created_at, NULL, k.expires_at)::idempotency.claim_result;
		ELSIF decision = 'mismatch' THEN
			RETURN ROW('mismatch', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::idempotency.claim_result;
		END IF;

		busy := false;
		IF decision IN ('new', 'reset', 'takeover') THEN
			/* the settings' defaults are read (and checked) only to write */
			IF p_ttl IS NULL THEN
				p_ttl := CASE WHEN coalesce(current_setting('idempotency.key_ttl', true), '') = ''
						 THEN interval '24 hours'
						 ELSE idempotency._duration_setting('idempotency.key_ttl', 's', 86400) END;
			END IF;
			IF p_lease IS NULL THEN
				p_lease := CASE WHEN coalesce(current_setting('idempotency.lease', true), '') = ''
						   THEN interval '1 minute'
						   ELSE idempotency._duration_setting('idempotency.lease', 'ms', 60000) END;
			END IF;
			IF lock_id IS NULL THEN
				lock_id := idempotency._lock_id('k', p_scope, p_key);
			END IF;
			claimed := false;
			BEGIN
				in_line := false;
				IF NOT pg_try_advisory_xact_lock(lock_id) THEN
					/* another transaction is writing the key: wait in line, or answer */
					now_ts := clock_timestamp();
					IF waited AND deadline IS NOT NULL AND now_ts < deadline THEN
						in_line := true;
						saved_lock_timeout := current_setting('lock_timeout');
						PERFORM set_config('lock_timeout',
										   greatest(ceil(extract(epoch FROM deadline - now_ts) * 1000), 1)::bigint::text,
										   true);
						PERFORM pg_advisory_xact_lock(lock_id);
						PERFORM set_config('lock_timeout', saved_lock_timeout, true);
						in_line := false;
						now_ts := clock_timestamp();
					ELSE
						busy := true;
					END IF;
				END IF;
				IF NOT busy THEN
					IF decision = 'new' THEN
						INSERT INTO idempotency.keys AS k1
							(scope, key, fingerprint, attempt, recovery_point, lease_expires_at,
							 status_code, body, headers, ttl, created_at, completed_at, expires_at)
						VALUES (p_scope, p_key, p_fingerprint, 1, NULL, now_ts + p_lease,
								NULL, NULL, NULL, p_ttl, now_ts, NULL, now_ts + p_lease + p_ttl)
						ON CONFLICT DO NOTHING;
					ELSE
						IF decision = 'takeover' AND k.attempt = 2147483647 THEN
							RAISE EXCEPTION 'key has been taken over too many times'
								USING ERRCODE = 'numeric_value_out_of_range',
									  DETAIL = 'Its attempt number is already 2147483647.',
									  HINT = 'Release the key with idem_release, or let it expire.';
						END IF;
						UPDATE idempotency.keys AS k1
						SET fingerprint = CASE WHEN decision = 'takeover'
										  THEN coalesce(k1.fingerprint, p_fingerprint) ELSE p_fingerprint END,
							attempt = CASE WHEN decision = 'takeover' THEN k1.attempt + 1 ELSE 1 END,
							recovery_point = CASE WHEN decision = 'takeover' THEN k1.recovery_point END,
							lease_expires_at = now_ts + p_lease,
							status_code = NULL, body = NULL, headers = NULL,
							ttl = p_ttl,
							created_at = CASE WHEN decision = 'takeover' THEN k1.created_at ELSE now_ts END,
							completed_at = NULL,
							expires_at = now_ts + p_lease + p_ttl
						WHERE k1.ctid = k.row_ctid AND k1.xmin = k.row_xmin
							AND k1.scope = p_scope AND k1.key = p_key;
					END IF;
					IF NOT FOUND THEN
						/* the key changed since it was read: let the lock go, look again */
						RAISE SQLSTATE 'IDMRB';
					END IF;
					claimed := true;
				END IF;
			EXCEPTION
				WHEN SQLSTATE 'IDMRB' THEN
					NULL;
				WHEN lock_not_available THEN
					/* the wait's own lock_timeout ran out (and is undone): in_progress */
					IF NOT in_line THEN
						RAISE;
					END IF;
					busy := true;
			END;
			IF claimed THEN
				RETURN ROW('claimed', NULL, NULL, NULL,
						   CASE WHEN decision = 'takeover' THEN k.attempt + 1 ELSE 1 END,
						   CASE WHEN decision = 'takeover' THEN k.recovery_point END,
						   CASE WHEN decision = 'takeover' THEN k.created_at ELSE now_ts END,
						   now_ts + p_lease, NULL)::idempotency.claim_result;
			END IF;
			CONTINUE WHEN NOT busy;
		END IF;

		/* in_progress, unless a wait has time left for a holder other than us */
		IF deadline IS NOT NULL AND decision <> 'mine' THEN
			now_ts := clock_timestamp();
			IF now_ts < deadline THEN
				remaining := deadline - now_ts;
				IF busy THEN
					/*
					 * The first wait for a writer's transaction: its lock
					 * taken shared, alongside the key's other waiters, and
					 * let go at once (the subtransaction is rolled back, and
					 * the lock_timeout set here with it).
					 */
					BEGIN
						PERFORM set_config('lock_timeout',
										   greatest(ceil(extract(epoch FROM remaining) * 1000), 1)::bigint::text,
										   true);
						PERFORM pg_advisory_xact_lock_shared(lock_id);
						RAISE SQLSTATE 'IDMRB';
					EXCEPTION
						WHEN SQLSTATE 'IDMRB' OR lock_not_available THEN
							NULL;
					END;
					waited := true;
				ELSE
					/* a committed claim: look again in 10 ms, or at its lease's end */
					PERFORM pg_sleep(greatest(0.001, extract(epoch FROM
						least(remaining, interval '10 ms', k.lease_expires_at - now_ts))));
				END IF;
				CONTINUE;
			END IF;
		END IF;

		IF NOT found_row THEN
			RETURN ROW('in_progress', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::idempotency.claim_result;
		END IF;
		RETURN ROW('in_progress', k.status_code, k.body, k.headers, k.attempt, k.recovery_point, k.created_at,
				   CASE WHEN decision = 'held' THEN k.lease_expires_at END, NULL)::idempotency.claim_result;
	END LOOP;
END
$$;

/*
 * The claim that idem_complete, idem_release, idem_checkpoint and
 * idem_extend_lease act on, with its lock held, or the error that says why
 * there is none (src/keys/keys.c's find_claim).  A key another transaction
 * is writing is waited for (the C edition waits for its row) once its
 * committed row passes the checks, except a claim that is not committed
 * yet, which is not this transaction's.
 */
CREATE FUNCTION idempotency._find_claim(p_scope text, p_key text, p_attempt integer,
										function_name text)
RETURNS idempotency.keys
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
AS $$
DECLARE
	k idempotency.keys;
	lock_id bigint;
	locked boolean;
BEGIN
	IF p_scope IS NULL OR p_key IS NULL OR octet_length(p_scope) > 255
		OR octet_length(p_key) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_scope, 'scope', 0);
		PERFORM idempotency._check_identifier(p_key, 'key', 1);
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable(function_name);
	END IF;
	/*
	 * As C decides on the row it probes before it waits to write it: the
	 * checks run on the committed row first, and an error is raised
	 * without waiting for a transaction that holds the key; only a claim
	 * that passes them waits for the key's lock, then is read and checked
	 * again (the holder may have changed it).
	 */
	lock_id := idempotency._lock_id('k', p_scope, p_key);
	locked := pg_try_advisory_xact_lock(lock_id);
	LOOP
		SELECT k0.* INTO k FROM idempotency.keys AS k0 WHERE k0.scope = p_scope AND k0.key = p_key;
		IF NOT FOUND AND NOT locked THEN
			RAISE EXCEPTION 'idempotency key "%" in scope "%" is not claimed by this transaction', p_key, p_scope
				USING ERRCODE = '22I01',
					  DETAIL = 'Another transaction''s claim of the key has not committed yet.';
		END IF;
		IF NOT FOUND OR k.expires_at <= clock_timestamp() THEN
			RAISE EXCEPTION 'idempotency key "%" in scope "%" is not claimed', p_key, p_scope
				USING ERRCODE = '22I01',
					  HINT = 'Call idem_claim first; a claim also ends when it is released or expires.';
		END IF;
		IF k.status_code IS NOT NULL THEN
			RAISE EXCEPTION 'idempotency key "%" in scope "%" is already completed', p_key, p_scope
				USING ERRCODE = '22I02',
					  DETAIL = format('Its response (status %s) is stored and is replayed to every retry.', k.status_code);
		END IF;
		IF p_attempt IS NOT NULL AND p_attempt <> k.attempt THEN
			IF p_attempt < k.attempt THEN
				RAISE EXCEPTION 'idempotency key "%" in scope "%" is held by attempt %, not %',
					p_key, p_scope, k.attempt, p_attempt
					USING ERRCODE = '22I03',
						  HINT = 'The claim''s lease ran out and a retry took the key over; this attempt must stop without side effects.';
			END IF;
			RAISE EXCEPTION 'idempotency key "%" in scope "%" is held by attempt %, not %',
				p_key, p_scope, k.attempt, p_attempt
				USING ERRCODE = '22I03';
		END IF;
		EXIT WHEN locked;
		PERFORM pg_advisory_xact_lock(lock_id);
		locked := true;
	END LOOP;
	RETURN k;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_complete(scope text, key text,
										  status_code integer,
										  body text DEFAULT NULL,
										  headers jsonb DEFAULT NULL,
										  attempt integer DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	k idempotency.keys;
	now_ts timestamptz;
	released boolean;
BEGIN
	IF $3 IS NULL THEN
		RAISE EXCEPTION 'status_code must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF $3 NOT BETWEEN 100 AND 599 THEN
		RAISE EXCEPTION 'status_code % is not an HTTP status code', $3
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'HTTP status codes are between 100 and 599.';
	END IF;
	/* the default list inline; a list that is set is parsed */
	IF coalesce(current_setting('idempotency.release_statuses', true), '') = '' THEN
		released := $3 IN (408, 425, 429) OR $3 BETWEEN 500 AND 599;
	ELSE
		released := idempotency._status_is_released($3);
	END IF;
	/* a body to store must fit idempotency.max_response_bytes (the default inline) */
	IF NOT released AND octet_length($4) >
		(CASE WHEN coalesce(current_setting('idempotency.max_response_bytes', true), '') = '' THEN 1048576
		 ELSE idempotency._bytes_setting('idempotency.max_response_bytes', 1048576, 1073741823) END) THEN
		RAISE EXCEPTION 'response body is too large to store'
			USING ERRCODE = 'program_limit_exceeded',
				  DETAIL = format('It is %s bytes long; the limit, idempotency.max_response_bytes, is %s.',
								  octet_length($4),
								  idempotency._setting_text(idempotency._bytes_setting('idempotency.max_response_bytes', 1048576, 1073741823), 'B')),
				  HINT = 'Release the key with idem_release and answer without storing, or raise the setting.';
	END IF;
	/*
	 * The common case first: valid arguments, a writable transaction, the
	 * key's lock free (or ours) and the claim there, in progress, of this
	 * attempt.  Anything else goes through _find_claim, which waits where
	 * the C edition waits and raises its errors.
	 */
	IF NOT released AND $1 IS NOT NULL AND $2 IS NOT NULL AND octet_length($1) <= 255
		AND octet_length($2) BETWEEN 1 AND 255
		AND current_setting('transaction_read_only') = 'off'
		AND pg_try_advisory_xact_lock(idempotency._lock_id('k', $1, $2)) THEN
		now_ts := clock_timestamp();
		UPDATE idempotency.keys AS k1
		SET status_code = $3, body = $4, headers = $5, lease_expires_at = NULL,
			completed_at = now_ts, expires_at = now_ts + k1.ttl
		WHERE k1.scope = $1 AND k1.key = $2 AND k1.status_code IS NULL
			AND k1.expires_at > now_ts AND ($6 IS NULL OR k1.attempt = $6);
		IF FOUND THEN
			RETURN 'stored';
		END IF;
	END IF;
	k := idempotency._find_claim($1, $2, $6, 'idem_complete()');
	IF released THEN
		DELETE FROM idempotency.keys AS k1 WHERE k1.scope = $1 AND k1.key = $2;
		RETURN 'released';
	END IF;
	now_ts := clock_timestamp();
	UPDATE idempotency.keys AS k1
	SET status_code = $3, body = $4, headers = $5, lease_expires_at = NULL,
		completed_at = now_ts, expires_at = now_ts + k1.ttl
	WHERE k1.scope = $1 AND k1.key = $2;
	RETURN 'stored';
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_release(scope text, key text,
										 attempt integer DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._find_claim($1, $2, $3, 'idem_release()');
	DELETE FROM idempotency.keys AS k1 WHERE k1.scope = $1 AND k1.key = $2;
	RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_checkpoint(scope text, key text,
											recovery_point text,
											attempt integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._find_claim($1, $2, $4, 'idem_checkpoint()');
	UPDATE idempotency.keys AS k1 SET recovery_point = $3
	WHERE k1.scope = $1 AND k1.key = $2;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_extend_lease(scope text, key text,
											  attempt integer,
											  lease interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_lease interval;
	lease_end timestamptz;
BEGIN
	IF $3 IS NULL THEN
		RAISE EXCEPTION 'attempt must not be null'
			USING ERRCODE = 'null_value_not_allowed',
				  HINT = 'Pass the attempt that idem_claim returned with "claimed".';
	END IF;
	p_lease := idempotency._duration_arg($4, 'lease', 'idempotency.lease', 'ms', 60000);
	PERFORM idempotency._find_claim($1, $2, $3, 'idem_extend_lease()');
	lease_end := clock_timestamp() + p_lease;
	UPDATE idempotency.keys AS k1
	SET lease_expires_at = lease_end, expires_at = lease_end + k1.ttl
	WHERE k1.scope = $1 AND k1.key = $2;
	RETURN lease_end;
END
$$;
