/*
 * The transactional outbox: idem_outbox_enqueue and its batch form, the
 * routes, and the pull API for external relays (fetch, ack, nack, requeue,
 * discard), with the C edition's arguments, answers, SQLSTATEs and messages
 * (src/outbox/outbox.c).  The C edition runs the outbox's statements through
 * SPI (src/outbox/outbox_sql.c); these functions run the same statements,
 * their $n parameters written as the variables they are given from, so
 * that the two editions read, lock and write the same rows in the same
 * order.  The statements are marked with the name they have there
 * (STMT_FETCH_SCAN and so on).
 *
 * Ordering, as in the C edition: enqueuers of one (topic, key) are
 * serialised by a transaction-level advisory lock taken before the row gets
 * its id, so that a later row of a key cannot get an id, let alone commit,
 * before an earlier one's transaction has ended; readers never work from an
 * id watermark, but take the head of each key, the oldest unpublished row,
 * and only if it is ready.
 *
 * The pull API's statements are planned as the C edition plans them: one
 * generic plan per backend, planned with what reads rows other than in
 * index order turned off (the functions' SET clauses), so that a fetch
 * costs its batch whatever the backlog and whatever the statistics say
 * (see walk_in_order_settings in outbox_sql.c).
 */

/*
 * The outbox's settings, read where they are used (settings.sql): the
 * backoff's bounds in milliseconds.
 */
CREATE FUNCTION idempotency._ms_setting(name text, default_ms integer, min_ms integer DEFAULT 1)
RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (pg_catalog.date_part('epoch', idempotency._duration_setting(name, 'ms', default_ms, min_ms)) * 1000)::integer;

/*
 * A function's signature as the C edition's messages write it
 * (format_procedure_qualified): its schema always, and each argument's type
 * schema-qualified but for those SQL names itself (integer, boolean, ...).
 */
CREATE FUNCTION idempotency._qualified_procedure(fn regprocedure)
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
	SELECT pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname) || '(' ||
		   coalesce((SELECT pg_catalog.string_agg(
						 CASE WHEN e.oid IN (1560, 16, 1042, 700, 701, 21, 23, 20, 1700, 1186, 1083,
											 1266, 1114, 1184, 1562, 1043)
							  THEN pg_catalog.format_type(e.oid, NULL)
							  ELSE pg_catalog.quote_ident(en.nspname) || '.' || pg_catalog.quote_ident(e.typname) END
						 || CASE WHEN e.oid <> t.oid THEN '[]' ELSE '' END, ',' ORDER BY a.i)
					 FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[]) WITH ORDINALITY AS a(typ, i)
					 JOIN pg_catalog.pg_type t ON t.oid = a.typ
					 JOIN pg_catalog.pg_type e
					   ON e.oid = CASE WHEN t.typelem <> 0 AND t.typsubscript = 'pg_catalog.array_subscript_handler'::pg_catalog.regproc
									   THEN t.typelem ELSE t.oid END
					 JOIN pg_catalog.pg_namespace en ON en.oid = e.typnamespace), '') || ')'
	FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
	WHERE p.oid = fn
$$;

/* The first argument of every outbox function that names a topic. */
CREATE FUNCTION idempotency._check_topic(topic text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
	IF topic = '*' THEN
		RAISE EXCEPTION '"*" is not a topic'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = '"*" names the default route in idem_outbox_route.';
	END IF;
END
$$;

/*
 * The rows just enqueued of a topic routed to notify or logical are
 * published at once, in the enqueuing transaction, rather than by the next
 * idem_run_maintenance(): a NOTIFY is delivered, and a transactional
 * logical message decoded, only when the transaction commits, and neither
 * if it rolls back, which is what publishing after the commit gives, with
 * no wait for the schedule.  Each row goes as publishing would send it
 * (the same message, the same truncated reference), in a subtransaction of
 * its own; one held back by an earlier unpublished row of its key, or whose
 * publication fails (its attempt recorded, as publishing records it), is
 * left pending for idem_run_maintenance().  A topic routed to a function,
 * to none, or not at all costs one look at the routes.
 */
CREATE FUNCTION idempotency._outbox_publish_at_commit(topic text, ids bigint[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF (SELECT r.target FROM idempotency.outbox_routes r
		WHERE r.topic = $1 OR r.topic = '*' ORDER BY r.topic = '*' LIMIT 1) IN ('notify', 'logical') THEN
		PERFORM idempotency._outbox_publish(clock_timestamp(), cardinality($2), true, $2);
	END IF;
END
$$;

/*
 * idem_outbox_enqueue(topic, payload, key, headers) -> bigint
 *
 * The row is written with one INSERT (the C edition writes the table and
 * its indexes itself); created_at and available_at are the same instant,
 * as there (the 1.1 -> 1.2 update tells a put-back row by their differing).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_enqueue(topic text, payload jsonb,
												key text DEFAULT NULL,
												headers jsonb DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_topic ALIAS FOR $1;
	p_payload ALIAS FOR $2;
	p_key ALIAS FOR $3;
	p_headers ALIAS FOR $4;
	now_ts timestamptz;
	new_id bigint;
BEGIN
	/* the arguments, checked in the C edition's order */
	IF p_topic IS NULL OR octet_length(p_topic) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_topic, 'topic', 1);
	END IF;
	IF p_key IS NOT NULL AND octet_length(p_key) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_key, 'key', 1);
	END IF;
	IF p_topic = '*' THEN
		PERFORM idempotency._check_topic(p_topic);
	END IF;
	IF p_payload IS NULL THEN
		RAISE EXCEPTION 'payload must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
		RAISE EXCEPTION 'headers must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_enqueue()');
	END IF;

	/* before the row gets its id: see the top of this file */
	IF p_key IS NOT NULL THEN
		PERFORM pg_advisory_xact_lock(idempotency._lock_id('outbox', p_topic, p_key));
	END IF;
	now_ts := clock_timestamp();
	INSERT INTO idempotency.outbox (id, topic, key, payload, headers, created_at, available_at)
	VALUES (nextval('idempotency.outbox_id_seq'), p_topic, p_key, p_payload, p_headers, now_ts, now_ts)
	RETURNING id INTO new_id;
	/* (the routes looked at here, a function call spared where they publish nothing) */
	IF (SELECT r.target FROM idempotency.outbox_routes r
		WHERE r.topic = p_topic OR r.topic = '*' ORDER BY r.topic = '*' LIMIT 1) IN ('notify', 'logical') THEN
		PERFORM idempotency._outbox_publish_at_commit(p_topic, ARRAY[new_id]);
	END IF;
	RETURN new_id;
END
$$;

/*
 * idem_outbox_enqueue_batch(topic, payloads, keys, headers) -> SETOF bigint
 *
 * Everything is checked before anything is written.  The keys' locks are
 * taken first, all of them, in an order that does not depend on the
 * arrays (by lock id), so that two batches naming the same keys in
 * different orders never deadlock; then the rows get their ids in array
 * order, the order of the rows of each key.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_enqueue_batch(topic text, payloads jsonb[],
													  keys text[] DEFAULT NULL,
													  headers jsonb[] DEFAULT NULL)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_topic ALIAS FOR $1;
	p_payloads ALIAS FOR $2;
	p_keys ALIAS FOR $3;
	p_headers ALIAS FOR $4;
	n integer;
	bad record;
	ids bigint[];
	now_ts timestamptz;
BEGIN
	IF p_topic IS NULL OR octet_length(p_topic) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_topic, 'topic', 1);
	END IF;
	PERFORM idempotency._check_topic(p_topic);
	IF p_payloads IS NULL THEN
		RAISE EXCEPTION 'payloads must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF array_ndims(p_payloads) > 1 THEN
		RAISE EXCEPTION 'payloads must be a one-dimensional array' USING ERRCODE = 'array_subscript_error';
	END IF;
	n := coalesce(cardinality(p_payloads), 0);
	IF p_keys IS NOT NULL THEN
		IF array_ndims(p_keys) > 1 THEN
			RAISE EXCEPTION 'keys must be a one-dimensional array' USING ERRCODE = 'array_subscript_error';
		END IF;
		IF cardinality(p_keys) <> n THEN
			RAISE EXCEPTION 'keys has % element%, not %', cardinality(p_keys),
				CASE WHEN cardinality(p_keys) = 1 THEN '' ELSE 's' END, n
				USING ERRCODE = 'array_subscript_error',
					  DETAIL = 'Each array gives one value per row: they must be equally long.';
		END IF;
	END IF;
	IF p_headers IS NOT NULL THEN
		IF array_ndims(p_headers) > 1 THEN
			RAISE EXCEPTION 'headers must be a one-dimensional array' USING ERRCODE = 'array_subscript_error';
		END IF;
		IF cardinality(p_headers) <> n THEN
			RAISE EXCEPTION 'headers has % element%, not %', cardinality(p_headers),
				CASE WHEN cardinality(p_headers) = 1 THEN '' ELSE 's' END, n
				USING ERRCODE = 'array_subscript_error',
					  DETAIL = 'Each array gives one value per row: they must be equally long.';
		END IF;
	END IF;

	/* the first bad element, in the C edition's order of checks */
	SELECT u.i, u.payload, u.key, u.header INTO bad
	FROM unnest(p_payloads, p_keys, p_headers) WITH ORDINALITY AS u(payload, key, header, i)
	WHERE u.i <= n
	  AND (u.payload IS NULL OR octet_length(u.key) NOT BETWEEN 1 AND 255
		   OR jsonb_typeof(u.header) <> 'object')
	ORDER BY u.i LIMIT 1;
	IF FOUND THEN
		IF bad.payload IS NULL THEN
			RAISE EXCEPTION 'payloads must not contain nulls'
				USING ERRCODE = 'null_value_not_allowed', DETAIL = format('Element %s is null.', bad.i);
		ELSIF octet_length(bad.key) < 1 THEN
			RAISE EXCEPTION 'keys must not contain empty strings'
				USING ERRCODE = 'invalid_parameter_value', DETAIL = format('Element %s is empty.', bad.i);
		ELSIF octet_length(bad.key) > 255 THEN
			RAISE EXCEPTION 'key is too long'
				USING ERRCODE = 'string_data_right_truncation',
					  DETAIL = format('Element %s is %s bytes long; the limit is 255 bytes.',
									  bad.i, octet_length(bad.key));
		ELSE
			RAISE EXCEPTION 'headers must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
		END IF;
	END IF;

	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_enqueue_batch()');
	END IF;
	IF n = 0 THEN
		RETURN;
	END IF;

	IF p_keys IS NOT NULL THEN
		PERFORM pg_advisory_xact_lock(l.id)
		FROM (SELECT DISTINCT idempotency._lock_id('outbox', p_topic, k) AS id
			  FROM unnest(p_keys) AS k WHERE k IS NOT NULL ORDER BY 1) AS l;
	END IF;
	/* the ids first, in array order */
	ids := ARRAY(SELECT nextval('idempotency.outbox_id_seq') FROM generate_series(1, n));
	now_ts := clock_timestamp();
	INSERT INTO idempotency.outbox (id, topic, key, payload, headers, created_at, available_at)
	SELECT ids[u.i], p_topic, u.key, u.payload, u.header, now_ts, now_ts
	FROM unnest(p_payloads, p_keys, p_headers) WITH ORDINALITY AS u(payload, key, header, i)
	WHERE u.i <= n;
	PERFORM idempotency._outbox_publish_at_commit(p_topic, ids);
	RETURN QUERY SELECT unnest(ids);
END
$$;

/*
 * idem_outbox_route(topic, target, destination) -> void
 *
 * A function target is resolved, and checked executable, as the caller
 * and with the caller's search_path, as the C edition does; the route
 * records the caller as run_as.  So this function has no SET search_path
 * clause, which would hide the caller's: it pins its own search_path as its
 * first statement (every name in that statement is qualified), sets the
 * caller's back only for the function's name, and the caller's again on
 * the way out (an error is undone with the (sub)transaction that sees it,
 * and the setting with it).  The caller, inside a SECURITY DEFINER
 * function, is the session's role (SET ROLE, or the session user): a
 * function of another role's that calls this one records that role, where
 * the C edition records the function's owner.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_route(topic text, target text,
											  destination text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
	caller_path pg_catalog.text := pg_catalog.current_setting('search_path');
	pinned_path pg_catalog.text := pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
	p_topic ALIAS FOR $1;
	p_target ALIAS FOR $2;
	p_destination pg_catalog.text := $3;
	caller regrole;
	fn regprocedure;
	proc record;
	what text;
BEGIN
	SELECT r.oid::regrole INTO caller FROM pg_roles r
	WHERE r.rolname = CASE WHEN current_setting('role') = 'none' THEN session_user::text
						   ELSE current_setting('role') END;
	IF p_topic IS NULL OR octet_length(p_topic) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_topic, 'topic', 1);
	END IF;
	IF p_target IS NULL THEN
		RAISE EXCEPTION 'target must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF p_target IN ('notify', 'logical') THEN
		what := CASE p_target WHEN 'notify' THEN 'channel name' ELSE 'message prefix' END;
		p_destination := coalesce(p_destination, CASE p_target WHEN 'notify' THEN 'idempotency_outbox'
																	ELSE 'idempotency.outbox' END);
		IF octet_length(p_destination) NOT BETWEEN 1 AND 63
			OR p_destination ~ '[\x01-\x20\x7f]' THEN
			RAISE EXCEPTION '"%" is not a valid %', p_destination, what
				USING ERRCODE = 'invalid_parameter_value',
					  DETAIL = format('A %s is 1 to %s bytes, without white space or control characters.', what, 63);
		END IF;
		caller := NULL;
	ELSIF p_target = 'function' THEN
		IF p_destination IS NULL THEN
			RAISE EXCEPTION 'the function target needs a destination'
				USING ERRCODE = 'null_value_not_allowed',
					  HINT = 'Name a function that takes one idempotency.outbox row.';
		END IF;
		/* a bare name means the overload that takes an outbox row */
		IF strpos(p_destination, '(') = 0 THEN
			p_destination := p_destination || '(idempotency.outbox)';
		END IF;
		PERFORM set_config('search_path', caller_path, true);
		fn := p_destination::regprocedure;
		PERFORM set_config('search_path', pinned_path, true);
		SELECT p.prokind, p.pronargs = 1 AND p.proargtypes[0] = 'idempotency.outbox'::regtype AS takes_one_row,
			   idempotency._qualified_procedure(fn) AS qualified
		INTO proc
		FROM pg_proc p WHERE p.oid = fn;
		IF proc.prokind <> 'f' THEN
			RAISE EXCEPTION '% is not a function', proc.qualified
				USING ERRCODE = 'wrong_object_type',
					  HINT = 'Route to a plain function that takes one idempotency.outbox row.';
		END IF;
		IF NOT proc.takes_one_row THEN
			RAISE EXCEPTION 'function % does not take one idempotency.outbox row', proc.qualified
				USING ERRCODE = 'datatype_mismatch',
					  HINT = 'Declare it as f(event idempotency.outbox).';
		END IF;
		IF NOT has_function_privilege(caller::oid, fn::oid, 'EXECUTE') THEN
			RAISE EXCEPTION 'permission denied for function %', proc.qualified
				USING ERRCODE = 'insufficient_privilege';
		END IF;
		p_destination := proc.qualified;
	ELSIF p_target = 'none' THEN
		IF p_destination IS NOT NULL THEN
			RAISE EXCEPTION 'the none target takes no destination' USING ERRCODE = 'invalid_parameter_value';
		END IF;
		caller := NULL;
	ELSE
		RAISE EXCEPTION '"%" is not an outbox route target', p_target
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = 'The targets are notify, logical, function and none.';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_route()');
	END IF;

	/* STMT_ROUTE */
	INSERT INTO idempotency.outbox_routes (topic, target, destination, run_as)
	VALUES (p_topic, p_target, p_destination, caller)
	ON CONFLICT (topic) DO UPDATE
	SET target = excluded.target, destination = excluded.destination,
		run_as = excluded.run_as;
	PERFORM set_config('search_path', caller_path, true);
END
$$;

/*
 * idem_outbox_fetch(topic, batch, lease, per_key) -> SETOF idempotency.outbox
 *
 * As the C edition's (find_heads, add_followers): the topic's unpublished
 * rows are walked in id order (STMT_FETCH_SCAN), a row being a head if it
 * is ready and either has no key or is the first row of its key met; the
 * candidates are locked as many at a time as heads are still wanted,
 * skipping those another relay is taking (STMT_FETCH_HEADS), until the
 * batch is full or the rows run out; then, with per_key above 1, the rows
 * that follow each head in its key, head by head, up to the first that is
 * not ready (STMT_FETCH_FOLLOWERS); then the lease (STMT_FETCH_LEASE).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_fetch(topic text, batch integer DEFAULT 100,
											  lease interval DEFAULT '30s',
											  per_key integer DEFAULT 1)
RETURNS SETOF idempotency.outbox
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	p_topic ALIAS FOR $1;
	p_batch ALIAS FOR $2;
	p_lease ALIAS FOR $3;
	p_per_key ALIAS FOR $4;
	now_ts timestamptz;
	max_attempts integer;
	r record;
	seen text[] := '{}';
	candidates bigint[] := '{}';
	head_ids bigint[] := '{}';
	head_keys text[] := '{}';
	head_follows boolean[] := '{}';
	handout bigint[];
	room integer;
BEGIN
	IF p_topic IS NULL OR octet_length(p_topic) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier(p_topic, 'topic', 1);
	END IF;
	IF p_batch IS NULL THEN
		RAISE EXCEPTION 'batch must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF p_batch <= 0 THEN
		RAISE EXCEPTION 'batch must be positive'
			USING ERRCODE = 'invalid_parameter_value', DETAIL = format('The value given was %s.', p_batch);
	END IF;
	IF p_lease IS NULL THEN
		RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF now() + p_lease <= now() THEN
		PERFORM idempotency._duration_arg(p_lease, 'lease', NULL, NULL, NULL);
	END IF;
	IF p_per_key IS NULL THEN
		RAISE EXCEPTION 'per_key must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF p_per_key <= 0 THEN
		RAISE EXCEPTION 'per_key must be positive'
			USING ERRCODE = 'invalid_parameter_value', DETAIL = format('The value given was %s.', p_per_key);
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_fetch()');
	END IF;
	now_ts := clock_timestamp();
	max_attempts := idempotency._integer_setting('idempotency.outbox_max_attempts', 1, 2147483647, 10);

	/* STMT_FETCH_SCAN */
	FOR r IN
		SELECT o.id, o.key, o.state IN ('pending', 'leased') AND o.available_at <= now_ts AS ready
		FROM idempotency.outbox o
		WHERE o.topic >= p_topic AND o.topic <= p_topic AND o.state <> 'published' AND o.published_at IS NULL
		ORDER BY o.topic, o.id
	LOOP
		IF r.key IS NOT NULL THEN
			CONTINUE WHEN r.key = ANY (seen);	/* an earlier row of its key is unpublished */
			seen := seen || r.key;
		END IF;
		IF r.ready THEN
			candidates := candidates || r.id;
		END IF;
		/* no more candidates at a time than heads are still wanted */
		IF cardinality(candidates) >= p_batch - cardinality(head_ids) THEN
			/* STMT_FETCH_HEADS */
			SELECT head_ids || array_agg(h.id ORDER BY h.id),
				   head_keys || array_agg(h.key ORDER BY h.id),
				   head_follows || array_agg(p_per_key > 1 AND h.key IS NOT NULL AND NOT h.exhausted ORDER BY h.id)
			INTO head_ids, head_keys, head_follows
			FROM (SELECT o.id, o.key, o.state = 'leased' AND o.failures + 1 >= max_attempts AS exhausted
				  FROM idempotency.outbox o
				  WHERE o.id = ANY (candidates) AND o.state IN ('pending', 'leased')
					AND o.published_at IS NULL AND o.available_at <= now_ts
				  ORDER BY o.id
				  FOR UPDATE OF o SKIP LOCKED) AS h;
			candidates := '{}';
			EXIT WHEN cardinality(head_ids) >= p_batch;
		END IF;
	END LOOP;
	IF cardinality(candidates) > 0 THEN
		SELECT head_ids || array_agg(h.id ORDER BY h.id),
			   head_keys || array_agg(h.key ORDER BY h.id),
			   head_follows || array_agg(p_per_key > 1 AND h.key IS NOT NULL AND NOT h.exhausted ORDER BY h.id)
		INTO head_ids, head_keys, head_follows
		FROM (SELECT o.id, o.key, o.state = 'leased' AND o.failures + 1 >= max_attempts AS exhausted
			  FROM idempotency.outbox o
			  WHERE o.id = ANY (candidates) AND o.state IN ('pending', 'leased')
				AND o.published_at IS NULL AND o.available_at <= now_ts
			  ORDER BY o.id
			  FOR UPDATE OF o SKIP LOCKED) AS h;
	END IF;
	head_ids := coalesce(head_ids, '{}');
	handout := head_ids;

	IF p_per_key > 1 THEN
		FOR h IN 1 .. coalesce(cardinality(head_ids), 0) LOOP
			EXIT WHEN cardinality(handout) >= p_batch;
			CONTINUE WHEN NOT head_follows[h];
			room := least(p_per_key - 1, p_batch - cardinality(handout));
			/* STMT_FETCH_FOLLOWERS: taken up to the first that is not ready */
			FOR r IN
				SELECT o.id, o.available_at <= now_ts
						AND (o.state = 'pending' OR (o.state = 'leased' AND o.failures + 1 < max_attempts)) AS ready
				FROM idempotency.outbox o
				WHERE o.topic = p_topic AND o.key = head_keys[h] AND o.id > head_ids[h]
				  AND o.state <> 'published' AND o.published_at IS NULL
				ORDER BY o.id LIMIT room
				FOR UPDATE OF o
			LOOP
				EXIT WHEN NOT r.ready;
				handout := handout || r.id;
			END LOOP;
		END LOOP;
	END IF;

	IF cardinality(handout) > 0 THEN
		/* STMT_FETCH_LEASE */
		RETURN QUERY
		WITH handed_out AS (
			UPDATE idempotency.outbox o
			SET state = CASE WHEN o.state = 'leased' AND o.failures + 1 >= max_attempts THEN 'dead' ELSE 'leased' END,
				attempts = CASE WHEN o.state = 'leased' AND o.failures + 1 >= max_attempts THEN o.attempts
								ELSE o.attempts + 1 END,
				failures = CASE WHEN o.state = 'leased' THEN o.failures + 1 ELSE o.failures END,
				last_error = CASE WHEN o.state = 'leased' AND o.failures + 1 >= max_attempts
								  THEN 'lease ran out without acknowledgement' ELSE o.last_error END,
				available_at = now_ts + p_lease
			WHERE o.id = ANY (handout)
			RETURNING o.*
		)
		SELECT * FROM handed_out WHERE state = 'leased' ORDER BY id;
	END IF;
END
$$;

/*
 * The fence of an acknowledgement: each id's attempts as given beside its
 * first place in ids (array_position's answer; C's ACK_FENCE), for the
 * statements below to test a row IN them, which the planner hashes (a
 * semi-join, or a hashed subplan), where a look-up of the id in ids for
 * each row read ids from its start every time (a fenced ack of 40,000 rows
 * took 17.6 s in C that way).  Inlined where it is called.
 */
CREATE FUNCTION idempotency._fence_pairs(p_ids bigint[], p_attempts integer[])
RETURNS TABLE (id bigint, attempts integer)
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
	SELECT DISTINCT ON (f.id) f.id, f.attempts
	FROM ROWS FROM (pg_catalog.unnest(p_ids), pg_catalog.unnest(p_attempts)) WITH ORDINALITY AS f (id, attempts, n)
	ORDER BY f.id, f.n
$$;

/*
 * The acknowledgement of ids (fenced: each still under the hand-out whose
 * attempts p_attempts gives beside it), as acknowledge_on in
 * src/outbox/outbox.c: the order check (STMT_ACK_CHECK, or its fenced form);
 * the rows a later row of their key relies on held (STMT_ACK_HOLD), each
 * chain cut at the first row no longer taken; then the write of the rows
 * let through that are still taken (STMT_ACK_CHECKED_*).  Under READ
 * COMMITTED a row another relay leased again meanwhile is read as it is
 * now, and left with the rows of its key after it: no 40001.  Each step
 * takes a snapshot of its own (the C edition's take one for the three):
 * a later snapshot sees no row that an earlier one let through become
 * acknowledgeable that was not, since ids only grow and an acknowledged
 * row never comes back.
 */
CREATE FUNCTION idempotency._outbox_acknowledge(p_ids bigint[], p_attempts integer[], fenced boolean)
RETURNS integer
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	now_ts timestamptz := clock_timestamp();
	keep boolean;
	c_ids bigint[];
	c_topics text[];
	c_keys text[];
	hold bigint[];
	held bigint[];
	dropped bigint[];
	acknowledged integer;
BEGIN
	keep := coalesce(current_setting('idempotency.outbox_retention', true), '') NOT IN ('', '0')
			AND idempotency._duration_setting('idempotency.outbox_retention', 's', 0, 0) > interval '0';

	/* STMT_ACK_CHECK, STMT_ACK_FENCED_CHECK */
	WITH taken AS MATERIALIZED (
		SELECT a.topic, a.key, max(a.id) AS newest FROM idempotency.outbox a
		WHERE a.id = ANY (p_ids) AND a.key IS NOT NULL GROUP BY a.topic, a.key
	), oldest AS MATERIALIZED (
		SELECT t.topic, (SELECT u.id FROM idempotency.outbox u
						 WHERE u.topic = t.topic
						   AND u.state <> 'published' AND u.published_at IS NULL
						 ORDER BY u.id LIMIT 1) AS id
		FROM (SELECT DISTINCT topic FROM taken) t
	), blocking AS MATERIALIZED (
		SELECT k.topic, k.key, b.id
		FROM taken k JOIN oldest f ON f.topic = k.topic
		CROSS JOIN LATERAL (
			SELECT e.id FROM idempotency.outbox e
			WHERE e.topic = k.topic AND e.key = k.key
			  AND e.id >= f.id AND e.id < k.newest
			  AND e.state <> 'published' AND e.published_at IS NULL
			  AND NOT coalesce(e.id IN (SELECT pg_catalog.unnest(p_ids)) AND e.state = 'leased'
							   AND (NOT fenced OR (e.id, e.attempts) IN (SELECT * FROM idempotency._fence_pairs(p_ids, p_attempts))), false)
			ORDER BY e.id LIMIT 1) b
	)
	SELECT array_agg(o.id ORDER BY o.topic, o.key, o.id), array_agg(o.topic ORDER BY o.topic, o.key, o.id),
		   array_agg(o.key ORDER BY o.topic, o.key, o.id)
	INTO c_ids, c_topics, c_keys
	FROM idempotency.outbox o
	WHERE o.id = ANY (p_ids) AND o.state = 'leased'
	  AND (NOT fenced OR (o.id, o.attempts) IN (SELECT * FROM idempotency._fence_pairs(p_ids, p_attempts)))
	  AND NOT EXISTS (
		  SELECT FROM blocking b
		  WHERE b.topic = o.topic AND b.key = o.key AND b.id < o.id);
	IF c_ids IS NULL THEN
		RETURN 0;
	END IF;

	/* the chains: the rows let through that come before another of their key */
	SELECT array_agg(w.id ORDER BY w.id) INTO hold
	FROM (SELECT u.id, u.key, max(u.id) OVER (PARTITION BY u.topic, u.key) AS last
		  FROM unnest(c_ids, c_topics, c_keys) AS u(id, topic, key)) AS w
	WHERE w.key IS NOT NULL AND w.id < w.last;
	IF hold IS NOT NULL THEN
		/* STMT_ACK_HOLD, STMT_ACK_FENCED_HOLD */
		held := ARRAY(SELECT o.id FROM idempotency.outbox o
					  WHERE o.id = ANY (hold) AND o.state = 'leased'
						AND (NOT fenced OR (o.id, o.attempts) IN (SELECT * FROM idempotency._fence_pairs(p_ids, p_attempts)))
					  ORDER BY o.id FOR UPDATE OF o);
		/* in each chain, the first row not held (its last is never) and those after it */
		SELECT array_agg(w.id) INTO dropped
		FROM (SELECT u.id, min(u.id) FILTER (WHERE u.id = ANY (hold) AND u.id <> ALL (held))
								 OVER (PARTITION BY u.topic, u.key) AS gap
			  FROM unnest(c_ids, c_topics, c_keys) AS u(id, topic, key)
			  WHERE u.key IS NOT NULL) AS w
		WHERE w.id >= w.gap;
		IF dropped IS NOT NULL THEN
			c_ids := ARRAY(SELECT i FROM unnest(c_ids) AS i WHERE i <> ALL (dropped));
		END IF;
	END IF;

	/* STMT_ACK_CHECKED_(FENCED_)KEEP, STMT_ACK_CHECKED_(FENCED_)DELETE */
	IF keep THEN
		UPDATE idempotency.outbox o SET state = 'published', published_at = now_ts
		WHERE o.id = ANY (c_ids) AND o.state = 'leased'
		  AND (NOT fenced OR (o.id, o.attempts) IN (SELECT * FROM idempotency._fence_pairs(p_ids, p_attempts)));
	ELSE
		DELETE FROM idempotency.outbox o
		WHERE o.id = ANY (c_ids) AND o.state = 'leased'
		  AND (NOT fenced OR (o.id, o.attempts) IN (SELECT * FROM idempotency._fence_pairs(p_ids, p_attempts)));
	END IF;
	GET DIAGNOSTICS acknowledged = ROW_COUNT;
	RETURN acknowledged;
END
$$;

/* idem_outbox_ack(ids) -> integer: leased rows among ids, now published. */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_ack(ids bigint[])
RETURNS integer
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF $1 IS NULL THEN
		RAISE EXCEPTION 'ids must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_ack()');
	END IF;
	RETURN idempotency._outbox_acknowledge($1, NULL, false);
END
$$;

/*
 * idem_outbox_ack(ids, attempts) -> integer: the rows among ids still
 * leased under the hand-out that returned them (attempts[i], as fetched,
 * for ids[i]), now published.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_ack(ids bigint[], attempts integer[])
RETURNS integer
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_ids ALIAS FOR $1;
	p_attempts ALIAS FOR $2;
BEGIN
	IF p_ids IS NULL THEN
		RAISE EXCEPTION 'ids must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF p_attempts IS NULL THEN
		RAISE EXCEPTION 'attempts must not be null'
			USING ERRCODE = 'null_value_not_allowed',
				  HINT = 'Pass the attempts column of the fetched rows, or call idem_outbox_ack(ids) to acknowledge unfenced.';
	END IF;
	IF array_ndims(p_ids) > 1 OR array_ndims(p_attempts) > 1 THEN
		RAISE EXCEPTION 'ids and attempts must be one-dimensional arrays' USING ERRCODE = 'array_subscript_error';
	END IF;
	IF coalesce(cardinality(p_ids), 0) <> coalesce(cardinality(p_attempts), 0) THEN
		RAISE EXCEPTION 'ids and attempts must be equally long'
			USING ERRCODE = 'array_subscript_error',
				  DETAIL = format('Their lengths are %s and %s; attempts gives the attempt of each id, as fetched.',
								  coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_attempts), 0));
	END IF;
	/* 1.1's rule, kept: the arrays pair by position, both from 1 */
	IF cardinality(p_ids) > 0 AND (array_lower(p_ids, 1) <> 1 OR array_lower(p_attempts, 1) <> 1) THEN
		RAISE EXCEPTION 'ids and attempts must be indexed from 1' USING ERRCODE = 'array_subscript_error';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_ack()');
	END IF;
	RETURN idempotency._outbox_acknowledge(p_ids, p_attempts, true);
END
$$;

/*
 * A nack (STMT_NACK, STMT_NACK_FENCED): the row, if it is leased (under
 * the hand-out that returned it with the fenced form), has failed one more
 * try, and is pending again after a backoff, or dead after its last; the
 * later rows of its key in the same hand-out (the same lease's end) go
 * back to pending at once, their attempts as the hand-out left them.
 */
CREATE FUNCTION idempotency._outbox_nack(p_id bigint, p_error text, p_attempt integer, fenced boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	now_ts timestamptz := clock_timestamp();
	max_attempts integer := idempotency._integer_setting('idempotency.outbox_max_attempts', 1, 2147483647, 10);
	backoff_min integer := idempotency._ms_setting('idempotency.outbox_backoff_min', 1000);
	backoff_max integer := greatest(backoff_min, idempotency._ms_setting('idempotency.outbox_backoff_max', 300000));
	nacked_id bigint;
BEGIN
	WITH target AS (
		SELECT id, topic, key, available_at FROM idempotency.outbox
		WHERE id = p_id AND state = 'leased' AND (NOT fenced OR attempts = p_attempt)
		FOR UPDATE
	), nacked AS (
		UPDATE idempotency.outbox o
		SET state = CASE WHEN o.failures + 1 >= max_attempts THEN 'dead' ELSE 'pending' END,
			failures = o.failures + 1,
			last_error = p_error,
			available_at = now_ts + make_interval(secs =>
				greatest(backoff_min, least(backoff_max, backoff_min * power(2, least((o.failures + 1) - 1, 30)))
						 * (0.5 + random() / 2)) / 1000.0)
		FROM target t WHERE o.id = t.id
		RETURNING o.id
	), released AS (
		UPDATE idempotency.outbox o
		SET state = 'pending', available_at = now_ts
		FROM target t
		WHERE o.topic = t.topic AND o.key = t.key AND o.id > t.id
		  AND o.state = 'leased' AND o.published_at IS NULL AND o.available_at = t.available_at
		RETURNING o.id
	)
	SELECT id INTO nacked_id FROM nacked;
	RETURN nacked_id IS NOT NULL;
END
$$;

/* idem_outbox_nack(id, error) -> boolean: false for a row not leased. */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_nack(id bigint, error text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF $1 IS NULL THEN
		RAISE EXCEPTION 'id must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_nack()');
	END IF;
	RETURN idempotency._outbox_nack($1, $2, NULL, false);
END
$$;

/*
 * idem_outbox_nack(id, error, attempt) -> boolean: false for a row not
 * leased under the hand-out that returned it with that attempt.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_nack(id bigint, error text, attempt integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF $1 IS NULL THEN
		RAISE EXCEPTION 'id must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF $3 IS NULL THEN
		RAISE EXCEPTION 'attempt must not be null'
			USING ERRCODE = 'null_value_not_allowed',
				  HINT = 'Pass the attempts column of the fetched row, or call idem_outbox_nack(id, error) to nack unfenced.';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_nack()');
	END IF;
	RETURN idempotency._outbox_nack($1, $2, $3, true);
END
$$;

/*
 * idem_outbox_requeue(id) -> boolean: a dead row is pending again, its
 * failures reset (STMT_REQUEUE); false for a row that is not dead.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_requeue(id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
	IF $1 IS NULL THEN
		RAISE EXCEPTION 'id must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_requeue()');
	END IF;
	UPDATE idempotency.outbox o SET state = 'pending', failures = 0, available_at = clock_timestamp()
	WHERE o.id = $1 AND o.state = 'dead';
	RETURN FOUND;
END
$$;

/*
 * idem_outbox_discard(id) -> boolean: a dead row is deleted (STMT_DISCARD);
 * false for a row that is not dead.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_outbox_discard(id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
	IF $1 IS NULL THEN
		RAISE EXCEPTION 'id must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_outbox_discard()');
	END IF;
	DELETE FROM idempotency.outbox o WHERE o.id = $1 AND o.state = 'dead';
	RETURN FOUND;
END
$$;

/*
 * ---------------------------------------------------------------------
 * Publishing, for idem_run_maintenance() (maintenance.sql): the routes
 * SQL can serve, as src/outbox/publish.c serves them.
 * ---------------------------------------------------------------------
 */

/*
 * Publish one row to its route (publish_one in publish.c); returns whether
 * its NOTIFY went out truncated: a message of 8000 bytes or more is too
 * long for NOTIFY, and the row's reference goes instead, which tells the
 * listener to read the row by its id.
 *
 * A function route's function runs as the role that set the route in the
 * C edition.  PL/pgSQL cannot change roles inside a SECURITY DEFINER
 * function (SET ROLE is refused there), so this edition calls it only when
 * that role is the edition's owner, as whom it runs here, and fails the
 * row's attempt otherwise (0A000).  It runs with the database's
 * search_path (the value RESET would give), as the worker's does, rather
 * than the one the edition's functions pin.
 */
CREATE FUNCTION idempotency._outbox_publish_one(target text, destination text, run_as regrole,
												 event idempotency.outbox, message text, reference text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn regprocedure;
	call_name text;
	identity_before text;
	identity_after text;
BEGIN
	/* idem_outbox_route never stores one, but the table's CHECK allows it */
	IF destination IS NULL THEN
		RAISE EXCEPTION 'the % route of the row''s topic has no destination', target
			USING ERRCODE = 'null_value_not_allowed', HINT = 'Set the route again with idem_outbox_route.';
	END IF;
	IF target = 'notify' THEN
		IF octet_length(message) > 7999 THEN
			PERFORM pg_notify(destination, reference);
			RETURN true;
		END IF;
		PERFORM pg_notify(destination, message);
	ELSIF target = 'logical' THEN
		PERFORM pg_logical_emit_message(true, destination, message);
	ELSIF target = 'function' THEN
		fn := destination::regprocedure;
		IF run_as IS NULL OR NOT EXISTS (SELECT FROM pg_roles WHERE oid = run_as) THEN
			RAISE EXCEPTION 'the role that routed to % no longer exists', destination
				USING ERRCODE = 'undefined_object', HINT = 'Set the route again with idem_outbox_route.';
		END IF;
		IF NOT has_function_privilege(run_as::oid, fn::oid, 'EXECUTE') THEN
			RAISE EXCEPTION 'role "%" may no longer execute %', run_as, destination
				USING ERRCODE = 'insufficient_privilege';
		END IF;
		IF run_as::oid <> (SELECT oid FROM pg_roles WHERE rolname = current_user) THEN
			RAISE EXCEPTION 'the SQL edition cannot run route function % as role "%"', destination, run_as
				USING ERRCODE = 'feature_not_supported',
					  DETAIL = format('It runs route functions as the role that owns it, %I, only.', current_user),
					  HINT = format('Set the route as role %I, or publish this topic with the C edition or an external relay.', current_user);
		END IF;
		SELECT format('%I.%I', n.nspname, p.proname) INTO call_name
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE p.oid = fn;
		identity_before := 'idempotency.outbox'::regclass::oid || '/' || pg_relation_filenode('idempotency.outbox');
		PERFORM set_config('search_path', (SELECT reset_val FROM pg_settings WHERE name = 'search_path'), true);
		EXECUTE format('SELECT %s($1)', call_name) USING event;
		PERFORM set_config('search_path', 'pg_catalog, pg_temp', true);
		identity_after := to_regclass('idempotency.outbox')::oid || '/' || pg_relation_filenode(to_regclass('idempotency.outbox'));
		IF identity_after IS DISTINCT FROM identity_before THEN
			RAISE EXCEPTION 'route function % % table idempotency.outbox', destination,
				CASE WHEN split_part(coalesce(identity_after, ''), '/', 1) <> split_part(identity_before, '/', 1)
					 THEN 'dropped' ELSE 'truncated or rewrote' END
				USING ERRCODE = 'object_not_in_prerequisite_state',
					  DETAIL = 'The rows are published in the transaction that calls the function, from that table.',
					  HINT = 'Change the function: it must not drop the extension, its schema or the outbox, nor truncate the outbox.';
		END IF;
	ELSE
		RAISE EXCEPTION 'unknown outbox route target "%"', target;
	END IF;
	RETURN false;
END
$$;

/*
 * One batch of publishing (outbox_publish_batch in publish.c), in the
 * current transaction: up to lim ready rows of the routed topics (of each
 * routed topic when there is no default route), each published together
 * with its removal or its "published" mark.  careful: each row in a
 * subtransaction of its own (a BEGIN ... EXCEPTION block), so that a route
 * that fails undoes only that row's attempt, which is recorded (backoff,
 * or dead); otherwise a failure raises, and the caller tries carefully.
 * looked says how many candidates there were.  With only_ids: those rows, if
 * they are candidates and routed to notify or logical (the enqueue's
 * publishing, below), as STMT_PUBLISH_CANDIDATE_ROW takes one row.
 */
CREATE FUNCTION idempotency._outbox_publish(now_ts timestamptz, lim integer, careful boolean,
											only_ids bigint[] DEFAULT NULL,
											OUT looked bigint, OUT published bigint, OUT failed bigint)
RETURNS record
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	routes record;
	t text;
	ids bigint[] := '{}';
	events idempotency.outbox[] := '{}';
	targets text[] := '{}';
	destinations text[] := '{}';
	run_ases regrole[] := '{}';
	messages text[] := '{}';
	refs text[] := '{}';
	previous bigint[] := '{}';
	done bigint[] := '{}';
	truncated bigint[] := '{}';
	was_truncated boolean;
	err_text text;
	walk_settings constant text[] := ARRAY['enable_seqscan', 'enable_bitmapscan', 'enable_sort',
										   'enable_hashjoin', 'enable_mergejoin', 'jit', 'plan_cache_mode'];
	saved text[];
	from_id bigint;
	max_attempts integer;
	backoff_min integer;
	backoff_max integer;
BEGIN
	looked := 0;
	published := 0;
	failed := 0;
	/* STMT_ROUTES: with no default route, only the routed topics */
	SELECT coalesce(bool_or(r.target <> 'none') FILTER (WHERE r.topic = '*'), false) AS default_routed,
		   coalesce(array_agg(r.topic) FILTER (WHERE r.topic <> '*' AND r.target <> 'none'), '{}') AS routed,
		   coalesce(array_agg(r.topic) FILTER (WHERE r.topic <> '*' AND r.target = 'none'), '{}') AS unrouted
	INTO routes FROM idempotency.outbox_routes r;
	IF NOT routes.default_routed AND cardinality(routes.routed) = 0 THEN
		RETURN;
	END IF;

	/* the walks: planned to walk the indexes in order, as the C edition plans them */
	IF only_ids IS NULL THEN
		saved := ARRAY(SELECT current_setting(s) FROM unnest(walk_settings) AS s);
		PERFORM set_config(s, CASE WHEN s = 'plan_cache_mode' THEN 'force_custom_plan' ELSE 'off' END, true)
		FROM unnest(walk_settings) AS s;
	END IF;
	IF only_ids IS NOT NULL THEN
		/* STMT_PUBLISH_CANDIDATE_ROW, for the rows given */
		SELECT array_agg(c.id ORDER BY c.id), array_agg(c.event ORDER BY c.id), array_agg(c.target ORDER BY c.id),
			   array_agg(c.destination ORDER BY c.id), array_agg(c.run_as ORDER BY c.id),
			   array_agg(c.message ORDER BY c.id), array_agg(c.reference ORDER BY c.id),
			   array_agg(c.previous_id ORDER BY c.id)
		INTO ids, events, targets, destinations, run_ases, messages, refs, previous
		FROM (
			WITH picked AS (
			  SELECT o AS event, o.id, o.topic, o.key, o.payload, o.headers, o.created_at
			  FROM idempotency.outbox o
			  WHERE o.state = 'pending' AND o.published_at IS NULL AND o.available_at <= now_ts
				AND o.id = ANY (only_ids)
				AND NOT EXISTS (SELECT FROM idempotency.outbox e
								WHERE e.topic = o.topic AND e.key = o.key AND e.id < o.id
								  AND e.state <> 'published' AND e.published_at IS NULL
								  AND NOT (e.state = 'pending' AND e.available_at <= now_ts)
								OFFSET 0)
			  ORDER BY o.id LIMIT lim
			  FOR UPDATE OF o SKIP LOCKED)
			SELECT p.event, p.id, r.target, r.destination, r.run_as,
				   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
									 'payload', p.payload, 'headers', p.headers,
									 'created_at', p.created_at)::text AS message,
				   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
									 'truncated', true, 'read',
									 'SELECT payload, headers, created_at FROM idempotency.outbox WHERE id = ' || p.id)::text AS reference,
				   (SELECT max(e.id) FROM idempotency.outbox e
					WHERE e.topic = p.topic AND e.key = p.key AND e.id < p.id
					  AND e.state <> 'published' AND e.published_at IS NULL) AS previous_id
			FROM picked p
			CROSS JOIN LATERAL (SELECT rt.target, rt.destination, rt.run_as
								FROM idempotency.outbox_routes rt
								WHERE rt.topic = p.topic OR rt.topic = '*'
								ORDER BY rt.topic = '*' LIMIT 1) r
			WHERE r.target IN ('notify', 'logical')
			ORDER BY p.id) AS c;
	ELSIF routes.default_routed THEN
		/*
		 * STMT_PUBLISH_OLDEST_EXCEPT: where the walk across the topics
		 * starts, past the published rows kept at the front of the primary
		 * key (a loose index scan of outbox_ready, one descent per topic; at
		 * 1,000 topics it gives up, and the walk starts at the first entry)
		 */
		WITH RECURSIVE topics(topic, n) AS (
		  (SELECT o.topic, 1 FROM idempotency.outbox o
		   WHERE o.state IN ('pending', 'leased') AND o.published_at IS NULL
		   ORDER BY o.topic LIMIT 1)
		  UNION ALL
		  SELECT (SELECT o.topic FROM idempotency.outbox o
				  WHERE o.topic > t.topic
					AND o.state IN ('pending', 'leased') AND o.published_at IS NULL
				  ORDER BY o.topic LIMIT 1), t.n + 1
		  FROM topics t WHERE t.topic IS NOT NULL AND t.n < 1000
		), oldest(id) AS (
		  SELECT min(f.id) FROM topics t
		  CROSS JOIN LATERAL (SELECT o.id FROM idempotency.outbox o
							  WHERE o.topic >= t.topic AND o.topic <= t.topic
								AND o.state IN ('pending', 'leased') AND o.published_at IS NULL
							  ORDER BY o.topic, o.id LIMIT 1) f
		  WHERE t.topic <> ALL (routes.unrouted)
		)
		SELECT CASE WHEN EXISTS (SELECT FROM topics t WHERE t.n = 1000 AND t.topic IS NOT NULL)
					THEN NULL
					ELSE coalesce(oldest.id, (SELECT o.id + 1 FROM idempotency.outbox o
											  ORDER BY o.id DESC LIMIT 1)) END
		INTO from_id FROM oldest;
		/* STMT_PUBLISH_CANDIDATES_EXCEPT */
		SELECT array_agg(c.id ORDER BY c.id), array_agg(c.event ORDER BY c.id), array_agg(c.target ORDER BY c.id),
			   array_agg(c.destination ORDER BY c.id), array_agg(c.run_as ORDER BY c.id),
			   array_agg(c.message ORDER BY c.id), array_agg(c.reference ORDER BY c.id),
			   array_agg(c.previous_id ORDER BY c.id)
		INTO ids, events, targets, destinations, run_ases, messages, refs, previous
		FROM (
			WITH picked AS (
			  SELECT o AS event, o.id, o.topic, o.key, o.payload, o.headers, o.created_at
			  FROM idempotency.outbox o
			  WHERE o.state = 'pending' AND o.published_at IS NULL AND o.available_at <= now_ts
				AND o.topic <> ALL (routes.unrouted) AND o.id >= coalesce(from_id, -9223372036854775808)
				AND NOT EXISTS (SELECT FROM idempotency.outbox e
								WHERE e.topic = o.topic AND e.key = o.key AND e.id < o.id
								  AND e.state <> 'published' AND e.published_at IS NULL
								  AND NOT (e.state = 'pending' AND e.available_at <= now_ts)
								OFFSET 0)
			  ORDER BY o.id LIMIT lim
			  FOR UPDATE OF o SKIP LOCKED)
			SELECT p.event, p.id, r.target, r.destination, r.run_as,
				   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
									 'payload', p.payload, 'headers', p.headers,
									 'created_at', p.created_at)::text AS message,
				   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
									 'truncated', true, 'read',
									 'SELECT payload, headers, created_at FROM idempotency.outbox WHERE id = ' || p.id)::text AS reference,
				   (SELECT max(e.id) FROM idempotency.outbox e
					WHERE e.topic = p.topic AND e.key = p.key AND e.id < p.id
					  AND e.state <> 'published' AND e.published_at IS NULL) AS previous_id
			FROM picked p
			CROSS JOIN LATERAL (SELECT rt.target, rt.destination, rt.run_as
								FROM idempotency.outbox_routes rt
								WHERE rt.topic = p.topic OR rt.topic = '*'
								ORDER BY rt.topic = '*' LIMIT 1) r
			WHERE r.target <> 'none'
			ORDER BY p.id) AS c;
	ELSE
		FOREACH t IN ARRAY routes.routed LOOP
			/* STMT_PUBLISH_CANDIDATES_TOPIC */
			SELECT ids || array_agg(c.id ORDER BY c.id), events || array_agg(c.event ORDER BY c.id),
				   targets || array_agg(c.target ORDER BY c.id), destinations || array_agg(c.destination ORDER BY c.id),
				   run_ases || array_agg(c.run_as ORDER BY c.id), messages || array_agg(c.message ORDER BY c.id),
				   refs || array_agg(c.reference ORDER BY c.id), previous || array_agg(c.previous_id ORDER BY c.id)
			INTO ids, events, targets, destinations, run_ases, messages, refs, previous
			FROM (
				WITH picked AS (
				  SELECT o AS event, o.id, o.topic, o.key, o.payload, o.headers, o.created_at
				  FROM idempotency.outbox o
				  WHERE o.state = 'pending' AND o.published_at IS NULL AND o.available_at <= now_ts
					AND o.topic >= t AND o.topic <= t
					AND NOT EXISTS (SELECT FROM idempotency.outbox e
									WHERE e.topic = o.topic AND e.key = o.key AND e.id < o.id
									  AND e.state <> 'published' AND e.published_at IS NULL
									  AND NOT (e.state = 'pending' AND e.available_at <= now_ts)
									OFFSET 0)
				  ORDER BY o.topic, o.id LIMIT lim
				  FOR UPDATE OF o SKIP LOCKED)
				SELECT p.event, p.id, r.target, r.destination, r.run_as,
					   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
										 'payload', p.payload, 'headers', p.headers,
										 'created_at', p.created_at)::text AS message,
					   json_build_object('id', p.id, 'topic', p.topic, 'key', p.key,
										 'truncated', true, 'read',
										 'SELECT payload, headers, created_at FROM idempotency.outbox WHERE id = ' || p.id)::text AS reference,
					   (SELECT max(e.id) FROM idempotency.outbox e
						WHERE e.topic = p.topic AND e.key = p.key AND e.id < p.id
						  AND e.state <> 'published' AND e.published_at IS NULL) AS previous_id
				FROM picked p
				CROSS JOIN LATERAL (SELECT rt.target, rt.destination, rt.run_as
									FROM idempotency.outbox_routes rt
									WHERE rt.topic = p.topic OR rt.topic = '*'
									ORDER BY rt.topic = '*' LIMIT 1) r
				WHERE r.target <> 'none'
				ORDER BY p.id) AS c;
		END LOOP;
	END IF;
	IF only_ids IS NULL THEN
		PERFORM set_config(s.name, s.value, true) FROM unnest(walk_settings, saved) AS s(name, value);
	END IF;
	ids := coalesce(ids, '{}');
	looked := cardinality(ids);

	FOR i IN 1 .. looked LOOP
		/* an earlier row of its key is still unpublished: it waits */
		CONTINUE WHEN previous[i] IS NOT NULL AND previous[i] <> ALL (done);
		IF careful THEN
			BEGIN
				was_truncated := idempotency._outbox_publish_one(targets[i], destinations[i], run_ases[i],
																  events[i], messages[i], refs[i]);
				err_text := NULL;
			EXCEPTION WHEN OTHERS THEN
				GET STACKED DIAGNOSTICS err_text = MESSAGE_TEXT;
			END;
		ELSE
			was_truncated := idempotency._outbox_publish_one(targets[i], destinations[i], run_ases[i],
															  events[i], messages[i], refs[i]);
			err_text := NULL;
		END IF;
		IF err_text IS NULL THEN
			done := done || ids[i];
			IF was_truncated THEN
				truncated := truncated || ids[i];
			END IF;
			CONTINUE;
		END IF;
		RAISE LOG 'idempotency: outbox row % could not be published to % "%": %',
			ids[i], targets[i], coalesce(destinations[i], ''), err_text;
		/* STMT_PUBLISH_FAILED */
		max_attempts := idempotency._integer_setting('idempotency.outbox_max_attempts', 1, 2147483647, 10);
		backoff_min := idempotency._ms_setting('idempotency.outbox_backoff_min', 1000);
		backoff_max := greatest(backoff_min, idempotency._ms_setting('idempotency.outbox_backoff_max', 300000));
		UPDATE idempotency.outbox
		SET attempts = attempts + 1,
			failures = failures + 1,
			state = CASE WHEN failures + 1 >= max_attempts THEN 'dead' ELSE 'pending' END,
			last_error = err_text,
			available_at = now_ts + make_interval(secs =>
				greatest(backoff_min, least(backoff_max, backoff_min * power(2, least((failures + 1) - 1, 30)))
						 * (0.5 + random() / 2)) / 1000.0)
		WHERE id = ids[i] AND state = 'pending';
		failed := failed + 1;
	END LOOP;

	/*
	 * The rows whose NOTIFY went out truncated are kept, for the listener
	 * to read (STMT_MARK_PUBLISHED_TRUNCATED), unless the window is 0; the
	 * others are deleted, or kept for outbox_retention.
	 */
	published := cardinality(done);
	IF cardinality(truncated) > 0
		AND idempotency._duration_setting('idempotency.notify_truncated_retention', 's', 3600, 0) > interval '0' THEN
		UPDATE idempotency.outbox
		SET state = 'published', published_at = now_ts, attempts = attempts + 1, available_at = 'infinity'
		WHERE id = ANY (truncated);
		done := ARRAY(SELECT d FROM unnest(done) AS d WHERE d <> ALL (truncated));
	END IF;
	IF cardinality(done) > 0 THEN
		IF idempotency._duration_setting('idempotency.outbox_retention', 's', 0, 0) = interval '0' THEN
			/* STMT_MARK_PUBLISHED_DELETE */
			DELETE FROM idempotency.outbox WHERE id = ANY (done);
		ELSE
			/* STMT_MARK_PUBLISHED_KEEP */
			UPDATE idempotency.outbox
			SET state = 'published', published_at = now_ts, attempts = attempts + 1
			WHERE id = ANY (done);
		END IF;
	END IF;
END
$$;
